//! The timer clock (the eBPF crate's `tick` module): a BPF timer on every CPU that samples once
//! in each period asked for, at an instant drawn at random within it. No user-space thread takes
//! part once it runs, and each sample costs one timer interrupt.
//!
//! Kernels before 6.7 have no pinned, absolute BPF timers: there the start fails on every CPU and
//! the sampler falls back to the perf-event clock (`sampling_clock`), as it does where a CPU
//! cannot be reached (a process confined to some CPUs cannot run a thread on the others).

use aya::maps::{Array, MapData};
use aya::programs::BtfTracePoint;
use pyebpf_common::{tick_status, Tick};

/// A CPU's clock entry as userspace sees it: the timer is opaque.
type TickState = Tick<[u64; 2]>;

/// The timers of every CPU, running; dropping it stops them.
pub struct TimerClock {
    ticks: Array<MapData, TickState>,
}

/// Why the timer clock did not start.
#[derive(Debug, thiserror::Error)]
pub enum TimerClockError {
    #[error("cannot attach the clock's start hook: {0}")]
    Program(#[from] aya::programs::ProgramError),
    #[error("cannot read the clock's map: {0}")]
    Map(#[from] aya::maps::MapError),
    #[error("the clock did not start on CPU {cpu} ({reason})")]
    Cpu { cpu: u32, reason: String },
}

impl TimerClock {
    /// Starts the clock of each CPU of `cpus` through `start` (loaded, not attached): the hook is
    /// attached while a thread pinned to each CPU in turn renames itself, then detached. On an
    /// error no clock runs.
    pub fn start(start: &mut BtfTracePoint, ticks: aya::maps::Map, cpus: &[u32]) -> Result<TimerClock, TimerClockError> {
        let clock = TimerClock { ticks: Array::try_from(ticks)? };
        let link = start.attach()?;
        let started = cpus.iter().try_for_each(|&cpu| rename_on(cpu).map_err(|err| TimerClockError::Cpu { cpu, reason: err.to_string() }));
        start.detach(link)?;
        started?;
        for &cpu in cpus {
            let status = clock.ticks.get(&cpu, 0)?.status;
            if status != tick_status::STARTED {
                let reason = if status == tick_status::FAILED { "the kernel refused its timer" } else { "its start hook did not run" };
                return Err(TimerClockError::Cpu { cpu, reason: reason.into() });
            }
        }
        Ok(clock)
    }
}

impl Drop for TimerClock {
    /// Stops every CPU's timer: writing an entry frees the timer it held.
    fn drop(&mut self) {
        for cpu in 0..self.ticks.len() {
            let _ = self.ticks.set(cpu, TickState::default(), 0);
        }
    }
}

/// Runs the start hook on `cpu`: a thread pinned there renames itself.
fn rename_on(cpu: u32) -> std::io::Result<()> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                // SAFETY: a zeroed CPU set with one CPU added, for the calling thread.
                let pinned = unsafe {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    libc::CPU_SET(cpu as usize, &mut set);
                    libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
                };
                if !pinned {
                    return Err(std::io::Error::last_os_error());
                }
                // SAFETY: PR_SET_NAME reads a NUL-terminated name of at most 16 bytes.
                if unsafe { libc::prctl(libc::PR_SET_NAME, c"pyebpf-clock".as_ptr()) } != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the clock's start thread panicked")))
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use pyebpf_common::Strata;

    use crate::sampling_clock::tests::random_words;

    const COUNT: usize = Strata::COUNT as usize;

    /// The strata of `periods` periods, as the eBPF program draws them.
    fn strata(periods: usize, seed: u32) -> Vec<u32> {
        let mut random = random_words(seed);
        let mut strata = Strata::default();
        (0..periods).map(|_| strata.next(&mut random)).collect()
    }

    #[test]
    fn each_block_samples_every_stratum_once_in_its_own_order() {
        let all = strata(COUNT * 1000, 0x1234_5678);
        let mut orders = HashSet::new();
        for block in all.chunks(COUNT) {
            let mut sorted = block.to_vec();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..Strata::COUNT).collect::<Vec<_>>(), "{block:?}");
            orders.insert(block.to_vec());
        }
        assert!(orders.len() >= 990, "{} orders of 1000 blocks", orders.len());
    }

    #[test]
    fn periods_a_cycle_apart_sample_different_parts_of_the_period() {
        // A cycle of `m` periods is seen at one phase by the periods `m` apart: the block's
        // 32 / m of them fall one in each 32 / m-th of the period (each run of `m` strata).
        for block in strata(COUNT * 200, 0x9e37_79b9).chunks(COUNT) {
            for m in [2, 4, 8, 16, 32] {
                for first in 0..m {
                    let parts: HashSet<u32> = block.iter().skip(first).step_by(m).map(|s| s / m as u32).collect();
                    assert_eq!(parts.len(), COUNT / m, "a cycle of {m} periods: {block:?}");
                }
            }
        }
    }

    /// How far the share sampled of the first 60% of a cycle of `cycle` periods strays from 60%
    /// over runs of 800 periods (4 s at 199 Hz), as a root mean square, in points.
    fn stray(cycle: f64, runs: u32, random: &mut impl FnMut() -> u32) -> f64 {
        let fraction = |word: u32| f64::from(word) / 2f64.powi(32);
        let squares: f64 = (0..runs)
            .map(|_| {
                let start = fraction(random()) * cycle;
                let mut strata = Strata::default();
                let inside = (0..800)
                    .filter(|&period| {
                        let stratum = strata.next(&mut *random);
                        let at = start + f64::from(period) + (f64::from(stratum) + fraction(random())) / COUNT as f64;
                        at % cycle < 0.6 * cycle
                    })
                    .count();
                (100.0 * inside as f64 / 800.0 - 60.0).powi(2)
            })
            .sum();
        (squares / f64::from(runs)).sqrt()
    }

    #[test]
    fn a_split_strays_less_than_by_chance_at_whole_periods_and_never_much_more() {
        let mut random = random_words(0x0bad_f00d);
        // Random instants: a binomial spread of 800 samples at 60%.
        let chance = 100.0 * (0.6f64 * 0.4 / 800.0).sqrt();
        // The aliasing tests' cycles: 10 ms at 199 Hz, 10.1 ms at 99 Hz.
        for cycle in [10.0 / (1000.0 / 199.0), 10.1 / (1000.0 / 99.0), 1.0, 2.0, 4.0] {
            let stray = stray(cycle, 400, &mut random);
            assert!(stray < 0.5 * chance, "a cycle of {cycle:.4} periods: {stray:.2} points, chance {chance:.2}");
        }
        // Every cycle from a tenth of a period to 30 periods; the largest of many estimates of
        // 400 runs each is about a tenth above its true value.
        let mut worst = (0.0, 0.0);
        let mut cycle = 0.1;
        while cycle < 30.0 {
            let stray = stray(cycle, 400, &mut random);
            if stray > worst.0 {
                worst = (stray, cycle);
            }
            cycle *= 1.03;
        }
        assert!(worst.0 < 1.5 * chance, "a cycle of {:.3} periods: {:.2} points, chance {chance:.2}", worst.1, worst.0);
        println!("worst: a cycle of {:.3} periods, {:.2} points (chance {chance:.2})", worst.1, worst.0);
    }
}
