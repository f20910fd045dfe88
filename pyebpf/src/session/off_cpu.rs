//! Off-CPU accounting (`--mode wall` and `off-cpu`): which processes the switch hooks watch, and
//! what each captured stack counts: a sample's period, or the interval its thread was off CPU,
//! known when the thread comes back (or at the end of the recording); the waiting asyncio tasks
//! read with a capture count as long as it does.

use std::sync::Arc;

use hashbrown::{HashMap, HashSet};
use pyebpf_common::{origin, task_status, OffCpuEnd, OffCpuStart, SampleRecord};

use crate::kernel_maps::KernelMaps;
use crate::python::TaskStack;
use crate::stack::{FrameCarry, ProcessLabels, Profile, SampleStack, StoredStack, ThreadState, Weight};
use crate::stats::Stats;
use crate::waits::SwitchBaseline;

/// An off-CPU capture, resolved, until its thread comes back.
struct PendingWait {
    /// The capture's time: which interval of the thread it is.
    start_ns: u64,
    stack: StoredStack,
    /// The stacks of the tasks that waited meanwhile (`--async-aware`): they waited as long.
    tasks: Vec<StoredStack>,
}

impl PendingWait {
    /// The thread's stack and its waiting tasks', each for the `ns` it was off CPU.
    fn count(&self, ns: u64, profile: &mut Profile) {
        for stack in std::iter::once(&self.stack).chain(&self.tasks) {
            profile.add_event(stack.as_sample(), Weight { samples: 1, ns }, self.start_ns);
        }
    }
}

/// A capture whose thread's waiting tasks follow it in the ring buffer.
pub struct TaskCapture {
    time_ns: u64,
    pub pid: u32,
    comm: Arc<str>,
    labels: Arc<ProcessLabels>,
    /// What each waiting task counts: the sample's period, the interval off CPU, or (`None`) the
    /// interval still open, known when the thread is back.
    ns: Option<u64>,
}

/// The off-CPU side of a recording.
#[derive(Default)]
pub struct OffCpu {
    /// The mode counts off-CPU intervals (wall, off-cpu).
    enabled: bool,
    /// Processes whose off-CPU intervals the switch hooks capture.
    watching: HashSet<u32>,
    /// Their threads' context switches when the hooks began watching them.
    baseline: SwitchBaseline,
    /// Threads captured as they left the CPU, waiting for their interval's end, by tid.
    pending: HashMap<u32, PendingWait>,
    /// The last capture of each thread whose waiting tasks follow it (`--async-aware`), by tid.
    task_captures: HashMap<u32, TaskCapture>,
    /// `CLOCK_MONOTONIC` when the recording started: waits count from then on.
    recording_start_ns: u64,
}

impl OffCpu {
    pub fn new(enabled: bool) -> Self {
        OffCpu { enabled, ..OffCpu::default() }
    }

    /// The recording starts `now_ns`: off-CPU time before is not its.
    pub fn start_recording(&mut self, now_ns: u64) {
        self.recording_start_ns = now_ns;
    }

    /// Has the switch hooks capture `pid`'s off-CPU intervals, in the modes that count them.
    pub fn watch(&mut self, pid: u32, kernel: &mut dyn KernelMaps) {
        if self.enabled && pid != std::process::id() && self.watching.insert(pid) {
            if let Err(err) = kernel.watch_waits(pid) {
                log::debug!("process {pid}: its off-CPU time is not captured: {err}");
            }
        }
    }

    /// Counts the switches of the watched processes' threads now: a thread that waits from the
    /// start on is counted too.
    pub fn take_baseline(&mut self, now_ns: u64) {
        self.baseline = SwitchBaseline::take(self.watching.iter().copied(), now_ns);
    }

    /// Counts a resolved sample: a period on CPU, a whole interval off CPU, or (the interval still
    /// open) nothing until its thread is back. A capture whose waiting tasks follow is kept for them.
    pub fn count(&mut self, record: &SampleRecord, sample: SampleStack<'_>, stats: &mut Stats, profile: &mut Profile) {
        let ns = if record.origin != origin::OFF_CPU {
            profile.add_event(sample, Weight { samples: 1, ns: profile.period_ns() }, record.time_ns);
            Some(profile.period_ns())
        } else if record.weight_ns != 0 {
            stats.off_cpu.intervals += 1;
            profile.add_event(sample, Weight { samples: 1, ns: record.weight_ns }, record.time_ns);
            Some(record.weight_ns)
        } else {
            // Its length comes when the thread is back (`end_wait`).
            self.pending.insert(record.tid, PendingWait { start_ns: record.time_ns, stack: StoredStack::from_sample(&sample), tasks: Vec::new() });
            None
        };
        if record.tasks.status & task_status::WAITING_FOLLOWS != 0 {
            let capture =
                TaskCapture { time_ns: record.time_ns, pid: record.tgid, comm: sample.comm.clone(), labels: sample.labels.cloned().unwrap_or_default(), ns };
            self.task_captures.insert(record.tid, capture);
        }
    }

    /// The capture of thread `tid` at `time_ns` whose waiting tasks have come.
    pub fn take_task_capture(&mut self, tid: u32, time_ns: u64) -> Option<TaskCapture> {
        self.task_captures.remove(&tid).filter(|capture| capture.time_ns == time_ns)
    }

    /// The waiting tasks' stacks of a capture: each counts what the capture counts (a period, or
    /// the interval the thread was off CPU, in which none of its tasks could run).
    pub fn count_tasks(&mut self, capture: &TaskCapture, tid: u32, stacks: &[TaskStack], profile: &mut Profile) {
        for (frames, truncated) in stacks {
            let sample = SampleStack {
                pid: capture.pid,
                tid,
                comm: &capture.comm,
                frames,
                truncated: *truncated,
                labels: Some(&capture.labels),
                state: ThreadState::TaskWait,
            };
            match capture.ns {
                Some(ns) => profile.add_event(sample, Weight { samples: 1, ns }, capture.time_ns),
                None => match self.pending.get_mut(&tid) {
                    Some(pending) if pending.start_ns == capture.time_ns => pending.tasks.push(StoredStack::from_sample(&sample)),
                    _ => {}
                },
            }
        }
    }

    /// A thread captured as it left the CPU came back: its stacks count for the time it was away.
    pub fn end_wait(&mut self, end: &OffCpuEnd, stats: &mut Stats, profile: &mut Profile) {
        // The end of another interval of the thread (its capture was dropped) leaves this one open.
        if self.pending.get(&end.tid).is_none_or(|pending| pending.start_ns != end.start_ns) {
            return;
        }
        let pending = self.pending.remove(&end.tid).expect("looked up above");
        stats.off_cpu.intervals += 1;
        let carried = self.carried(end.carried_ns, end.start_ns, stats);
        let ns = self.within_recording(end.start_ns, end.start_ns.saturating_add(end.away_ns)) + carried;
        pending.count(ns, profile);
    }

    /// Nanoseconds of an interval from `start_ns` to `end_ns` within the recording.
    pub fn within_recording(&self, start_ns: u64, end_ns: u64) -> u64 {
        end_ns.saturating_sub(start_ns.max(self.recording_start_ns))
    }

    /// The uncaptured off-CPU time a capture at `start_ns` stands for, counted in `stats`: it lies
    /// before the capture, and only what the recording holds counts.
    fn carried(&self, carried_ns: u64, start_ns: u64, stats: &mut Stats) -> u64 {
        let carried = carried_ns.min(self.within_recording(0, start_ns));
        stats.off_cpu.carried_ns += carried;
        carried
    }

    /// Counts the threads of watched processes that are still off CPU at `now_ns`, those captured
    /// as they left with the stacks captured then; returns those the hook never saw leave
    /// (blocked since before it watched, and still), whose stacks the caller reads now.
    pub fn count_open(&mut self, kernel: &dyn KernelMaps, now_ns: u64, stats: &mut Stats, profile: &mut Profile) -> Vec<(u32, OffCpuStart)> {
        let watched = kernel.watched_threads();
        for (tid, entry) in &watched {
            if entry.start_ns == 0 || !self.watching.contains(&entry.tgid) {
                continue;
            }
            match self.pending.remove(tid) {
                Some(pending) if pending.start_ns == entry.start_ns => {
                    stats.off_cpu.intervals += 1;
                    stats.off_cpu.open_at_end += 1;
                    let ns = self.within_recording(entry.start_ns, now_ns) + self.carried(entry.carried_for_capture(), entry.start_ns, stats);
                    pending.count(ns, profile);
                }
                _ if entry.captured_ns != entry.start_ns => {
                    stats.off_cpu.short_intervals += 1;
                    stats.off_cpu.short_ns += self.within_recording(entry.start_ns, now_ns);
                }
                _ => {}
            }
        }
        let seen: HashSet<u32> = watched.iter().map(|(tid, _)| *tid).collect();
        let mut throughout: Vec<(u32, OffCpuStart)> = self.baseline.blocked_throughout().into_iter().filter(|(tid, _)| !seen.contains(tid)).collect();
        for (_, start) in &mut throughout {
            start.start_ns = start.start_ns.max(self.recording_start_ns);
        }
        throughout
    }

    /// Whether `tid` of `tgid` has not run since the switch counts were read at the start.
    pub fn blocked_since_start(&self, tgid: u32, tid: u32) -> bool {
        self.baseline.unchanged(tgid, tid)
    }

    /// Stops watching `pid` (it exited or replaced its program) and drops its open captures.
    pub fn forget(&mut self, pid: u32, kernel: &mut dyn KernelMaps) {
        if self.watching.remove(&pid) {
            kernel.stop_watching_waits(pid);
            self.pending.retain(|_, pending| pending.stack.as_sample().pid != pid);
        }
        self.task_captures.retain(|_, capture| capture.pid != pid);
    }

    /// Drops the captures still open (their frames belong to a table that is gone).
    pub fn clear_captures(&mut self) {
        self.pending.clear();
        self.task_captures.clear();
    }

    /// Moves the frames of the captures still open into the next period's table.
    pub fn carry_frames(&mut self, carry: &mut FrameCarry<'_>) {
        let pending = self.pending.values_mut().flat_map(|pending| std::iter::once(&mut pending.stack).chain(&mut pending.tasks));
        for id in pending.flat_map(|stack| stack.frames_mut().iter_mut()) {
            *id = carry.carry(*id);
        }
    }
}
