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
