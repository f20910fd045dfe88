//! The session's off-CPU accounting with the kernel's maps faked: what each capture counts, in
//! nanoseconds, when its interval ends, when it began before the recording, and when it is still
//! open at the end; and that forgetting a process drops its open captures. Also which processes
//! the kernel is told userspace knows.

use std::process::{Child, Command, Stdio};

use pyebpf_common::{origin, OffCpuEnd, OffCpuStart, ProcessEvent, SampleRecord};

use super::*;
use crate::kernel_maps::fake::FakeKernel;

const MS: u64 = 1_000_000;

/// A process to attribute records to: not pyebpf's own (whose waits are never watched), not Python.
struct Sleeper(Child);

impl Sleeper {
    fn start() -> Sleeper {
        Sleeper(Command::new("sleep").arg("60").stdin(Stdio::null()).spawn().expect("run sleep"))
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wall_session() -> Session {
    let sampling = SamplingOptions { marker: false, read_only: true, max_frames: 512, async_aware: false };
    let filter = crate::filter::SampleFilter::default();
    let mut session =
        Session::new(SessionOptions { sampling, no_native: false, filter, unwind: UnwindMode::Fp, mode: Mode::Wall, kernel: false, details: None });
    session.start_recording();
    session
}

/// A record of thread `tid` of `pid` at `time_ns`: on CPU, or a capture as it left the CPU
/// weighted `weight_ns` (0: its interval's end follows).
fn record(pid: u32, tid: u32, origin: u32, time_ns: u64, weight_ns: u64) -> Box<SampleRecord> {
    // SAFETY: all-zero bytes are a valid SampleRecord (plain data).
    let mut record = unsafe { Box::<SampleRecord>::new_zeroed().assume_init() };
    (record.tgid, record.tid, record.origin, record.time_ns, record.weight_ns) = (pid, tid, origin, time_ns, weight_ns);
    record.wait_state = 1;
    record
}

fn end(tid: u32, start_ns: u64, away_ns: u64, carried_ns: u64) -> OffCpuEnd {
    OffCpuEnd { kind: 0, tid, start_ns, away_ns, carried_ns }
}

#[test]
fn each_capture_counts_its_period_or_its_whole_interval_within_the_recording() {
    let sleeper = Sleeper::start();
    let (pid, tid) = (sleeper.pid(), sleeper.pid());
    let mut session = wall_session();
    let (mut kernel, mut stats, mut profile) = (FakeKernel::default(), Stats::default(), Profile::new(100));
    let start = monotonic_ns();
    session.off_cpu.start_recording(start);
    assert!(session.resolve(&record(pid, tid, origin::ON_CPU, start, 0), &mut kernel, &mut stats, &mut profile));
    assert_eq!(profile.total_ns(), 10 * MS, "a sample counts its period");
    assert!(kernel.watching.contains(&pid), "the process's waits are not watched");

    // Captured as it left at start + 5 ms; its end says 7 ms away, 2 ms carried from before.
    std::thread::sleep(Duration::from_millis(5));
    let left = monotonic_ns();
    session.resolve(&record(pid, tid, origin::OFF_CPU, left, 0), &mut kernel, &mut stats, &mut profile);
    assert_eq!(profile.total_ns(), 10 * MS, "an open interval counts nothing yet");
    session.end_wait(&end(tid, left - 1, 7 * MS, 0), &mut stats, &mut profile);
    assert_eq!(profile.total_ns(), 10 * MS, "the end of another interval of the thread was taken");
    session.end_wait(&end(tid, left, 7 * MS, 2 * MS), &mut stats, &mut profile);
    assert_eq!(profile.total_ns(), 19 * MS);
    assert_eq!((stats.off_cpu.intervals, stats.off_cpu.carried_ns), (1, 2 * MS));

    // A capture weighted whole in the kernel counts at once.
    session.resolve(&record(pid, tid, origin::OFF_CPU, left, 3 * MS), &mut kernel, &mut stats, &mut profile);
    assert_eq!((profile.total_ns(), stats.off_cpu.intervals), (22 * MS, 2));

    // Only what lies within the recording counts: an interval from 1 s before it, carried time
    // from before it.
    session.resolve(&record(pid, tid, origin::OFF_CPU, start - 1000 * MS, 0), &mut kernel, &mut stats, &mut profile);
    session.end_wait(&end(tid, start - 1000 * MS, 1001 * MS, 5000 * MS), &mut stats, &mut profile);
    assert_eq!(profile.total_ns(), 23 * MS);
}

#[test]
fn waits_still_open_at_the_end_count_up_to_then_and_go_with_their_process() {
    let sleeper = Sleeper::start();
    let (pid, tid, other) = (sleeper.pid(), sleeper.pid(), sleeper.pid() + 1);
    let mut session = wall_session();
    let (mut kernel, mut stats, mut profile) = (FakeKernel::default(), Stats::default(), Profile::new(100));
    let left = monotonic_ns();
    session.resolve(&record(pid, tid, origin::OFF_CPU, left, 0), &mut kernel, &mut stats, &mut profile);
    // The hook's view at the end: `tid` still off since its capture, `other` off since an
    // interval it did not capture.
    let open = |start_ns, captured_ns| OffCpuStart { start_ns, captured_ns, tgid: pid, ..Default::default() };
    kernel.off_cpu = vec![(tid, open(left, left)), (other, open(left, 0))];
    std::thread::sleep(Duration::from_millis(20));
    session.count_open_waits(&mut kernel, &mut stats, &mut profile);
    let counted = profile.total_ns();
    assert!((20 * MS..2000 * MS).contains(&counted), "counted {counted} ns of a wait of 20 ms and more");
    assert_eq!((stats.off_cpu.intervals, stats.off_cpu.open_at_end), (1, 1));
    assert_eq!(stats.off_cpu.short_intervals, 1, "the uncaptured interval is summed as short");

    // An exit drops what is open of the process: its interval's end counts nothing.
    let mut profile = Profile::new(100);
    session.resolve(&record(pid, tid, origin::OFF_CPU, left + 1, 0), &mut kernel, &mut stats, &mut profile);
    session.process_event(&ProcessEvent { kind: 0, tgid: pid, time_ns: 0, comm: [0; pyebpf_common::COMM_LEN] }, &mut kernel);
    assert!(!kernel.watching.contains(&pid), "the exited process is still watched");
    session.end_wait(&end(tid, left + 1, 7 * MS, 0), &mut stats, &mut profile);
    assert_eq!(profile.total_ns(), 0);
}

/// The eBPF program hands over samples of processes userspace does not know yet soon: a process
/// still checked for a late `libpython` stays unknown to it, one the filter drops is known at its
/// first sample, and an exit forgets it (its PID may name another process next).
#[test]
fn the_kernel_is_told_which_processes_are_known_until_they_exit() {
    let sleeper = Sleeper::start();
    let pid = sleeper.pid();
    let (mut kernel, mut stats, mut profile) = (FakeKernel::default(), Stats::default(), Profile::new(100));
    let mut session = wall_session();
    session.resolve(&record(pid, pid, origin::ON_CPU, monotonic_ns(), 0), &mut kernel, &mut stats, &mut profile);
    assert!(!kernel.known.contains(&pid), "a process checked again later is known already");

    let sampling = SamplingOptions { marker: false, read_only: true, max_frames: 512, async_aware: false };
    let filter = crate::filter::SampleFilter { comm: Some(regex::Regex::new("^no-such-process$").unwrap()), python_only: false };
    let mut session =
        Session::new(SessionOptions { sampling, no_native: false, filter, unwind: UnwindMode::Fp, mode: Mode::Cpu, kernel: false, details: None });
    assert!(!session.resolve(&record(pid, pid, origin::ON_CPU, monotonic_ns(), 0), &mut kernel, &mut stats, &mut profile));
    assert!(kernel.known.contains(&pid), "a process the filter drops is not known");
    session.process_event(&ProcessEvent { kind: 0, tgid: pid, time_ns: 0, comm: [0; pyebpf_common::COMM_LEN] }, &mut kernel);
    assert!(!kernel.known.contains(&pid), "an exited process is still known");
}
