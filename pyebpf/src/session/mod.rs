//! A profiling session: turns what the eBPF program sends (samples, off-CPU intervals, waiting
//! tasks, process events) into weighted stacks in a [`Profile`]. `record` and `top` both run one.
//!
//! One sample's trip: [`Session::resolve`] names the process and applies the filter
//! ([`processes`]), has [`Pythons`] turn the frames the kernel walked into a proven Python stack,
//! has [`native::NativeStacks`] unwind, symbolize and merge the native frames around it, and has
//! [`off_cpu::OffCpu`] count it for what it stands for (a period, or an interval off CPU).
//! A sample identical to one resolved before skips the middle: [`repeats`] keeps what that one
//! resolved to. What is known of a process is forgotten in one place, [`Session::forget`].

mod native;
mod off_cpu;
mod processes;
mod repeats;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use pyebpf_common::{origin, py_status, OffCpuEnd, OffCpuStart, ProcessEvent, SampleRecord, WaitingTasks};

use crate::bpf::{Sampler, SamplerOptions, UnwindMode};
use crate::filter::SampleFilter;
use crate::kernel_maps::KernelMaps;
use crate::ktime::monotonic_ns;
use crate::mode::Mode;
use crate::process;
use crate::python::{PyItem, Pythons, SamplingOptions, TaskStack};
use crate::reader::{Record, RecordBatch};
use crate::stack::{Frame, FrameCarry, FrameId, ProcessLabels, Profile, SampleStack, ThreadState, Weight};
use crate::stats::{SampleCounts, Stats};
use crate::waits::{wait_reason, waiting_record, KernelSymbols};
use native::NativeStacks;
use off_cpu::OffCpu;
pub use processes::DetailsWanted;
use processes::ProcessTable;
use repeats::{Repeats, Slot};

/// Frames a repeat's innermost level may have beyond those of the sample it repeats (calls
/// inlined there) without its stack being reallocated.
const LEAF_FRAMES_SPARE: usize = 16;

/// How often the safety upkeep runs: thread lists re-read now and then, unmapped code expired,
/// lost events looked for. What needs to be prompt is driven by records instead: a sample of an
/// unknown process or thread (the eBPF program wakes the reader soon for it), exec and exit events.
pub const UPKEEP: Duration = Duration::from_secs(2);

/// Upkeep while a process's asyncio table is looked for (`--async-aware`, 3.14+ before it imports
/// asyncio): its tasks are read from the upkeep after the import.
const UPKEEP_TASKS_PENDING: Duration = Duration::from_millis(500);

/// Processes gone without an event are looked for at least this often, and at the next upkeep
/// whenever events were lost (otherwise every exit came as an event).
const STALE_CHECK: Duration = Duration::from_secs(30);

/// What a session resolves, and how.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    pub sampling: SamplingOptions,
    /// Python frames only where a sample has them (`--no-native`).
    pub no_native: bool,
    /// Native frames' lines and inlined calls from DWARF (`--native-lines`).
    pub native_lines: bool,
    pub filter: SampleFilter,
    pub unwind: UnwindMode,
    /// What the profile measures: which records count, and how much.
    pub mode: Mode,
    /// Show kernel frames (`--kernel`); off-CPU records carry them anyway, to tell why.
    pub kernel: bool,
    /// What is read of each process beyond its labels (`record --otlp`).
    pub details: Option<DetailsWanted>,
    /// Count what unwinding costs in CPU time (`record --stats`).
    pub timed: bool,
}

/// For this long after its first sample, a Python process's samples reach userspace within the
/// urgent latency ([`crate::reader::URGENT_LATENCY`]), not the batching one: a process that lives
/// less than the batching latency would otherwise exit before its code objects were read.
const YOUNG_PYTHON: Duration = Duration::from_secs(1);

/// Buffers reused from sample to sample, so a sample seen before allocates nothing.
#[derive(Default)]
struct Scratch {
    python: Vec<PyItem>,
    task_stacks: Vec<TaskStack>,
    /// A repeat's stack, where its leaf level's frames differ from the first's.
    repeat: Vec<FrameId>,
}

/// Turns raw records into stacks.
pub struct Session {
    options: SessionOptions,
    processes: ProcessTable,
    python: Pythons,
    native: NativeStacks,
    off_cpu: OffCpu,
    scratch: Scratch,
    repeats: Repeats,
    /// The native entries' resets the repeats were resolved after.
    native_resets: u64,
    /// The frame table the cached frame ids belong to.
    frames_generation: u64,
    /// When processes gone without an event were last looked for, and the events lost by then.
    stale_checked: (Instant, u64),
}

impl Session {
    pub fn new(options: SessionOptions) -> Self {
        Session {
            processes: ProcessTable::with_details(options.details.clone()),
            python: Pythons::new(options.sampling),
            native: NativeStacks::new(options.unwind, options.no_native, options.native_lines, options.timed),
            off_cpu: OffCpu::new(options.mode.counts_waits()),
            scratch: Scratch::default(),
            repeats: Repeats::new(),
            native_resets: 0,
            frames_generation: 0,
            stale_checked: (Instant::now(), 0),
            options,
        }
    }

    /// Attaches to the processes already running (every process, or the sampler's targets),
    /// loads the sampler, registers them, and starts sampling: how `record` and `top` begin.
    pub fn start_sampler(&mut self, options: &SamplerOptions, stats: &mut Stats) -> Result<Sampler> {
        let kept = self.attach_all(options.targets.clone().unwrap_or_else(process::all_pids), stats);
        let mut sampler = Sampler::start(options)?;
        self.register_all(&mut sampler, kept);
        sampler.start_sampling()?;
        Ok(sampler)
    }

    /// Attaches to processes already running (those the filter keeps), before sampling starts.
    fn attach_all(&mut self, pids: impl IntoIterator<Item = u32>, stats: &mut Stats) -> Vec<u32> {
        let kept: Vec<u32> = pids.into_iter().filter(|&pid| self.options.filter.keeps_process(&self.processes.name(pid, &[]))).collect();
        self.python.attach_all(kept.iter().copied(), self.processes.maps(), stats);
        kept
    }

    /// Tells the eBPF program about the processes attached so far, and has it watch the waits of
    /// those profiled (a thread that waits from the start on is counted too).
    fn register_all(&mut self, kernel: &mut dyn KernelMaps, kept: Vec<u32>) {
        self.python.register_all(kernel, self.processes.maps());
        if !self.options.mode.counts_waits() {
            return;
        }
        for &pid in &kept {
            if !self.options.filter.python_only || self.python.is_python(pid) {
                self.off_cpu.watch(pid, kernel);
            }
        }
        self.off_cpu.take_baseline(monotonic_ns());
    }

    /// Measures `mode` from now on, with a sampler started afresh ([`Self::start_sampler`]): what
    /// the old sampler's maps held is gone with it.
    pub fn set_mode(&mut self, mode: Mode) {
        self.options.mode = mode;
        self.off_cpu = OffCpu::new(mode.counts_waits());
        self.native.forget_copying();
        self.python.forget_registrations();
        self.repeats.clear();
    }

    /// The recording starts now: off-CPU time before is not its.
    pub fn start_recording(&mut self) {
        self.off_cpu.start_recording(monotonic_ns());
    }

    /// Moves the frames the caches keep ids of into the next period's table.
    pub fn carry_frames(&mut self, carry: &mut FrameCarry<'_>) {
        self.native.carry_frames(carry);
        self.python.carry_frames(carry);
        self.off_cpu.carry_frames(carry);
        self.frames_generation = carry.new_generation();
        // Stacks are resolved once per period: the next one starts without repeats.
        self.repeats.clear();
    }

    /// Resolves the sample's stack and counts it in `profile`; false when the filter drops it
    /// (checked before any remote read).
    pub fn resolve(&mut self, record: &SampleRecord, kernel: &mut dyn KernelMaps, stats: &mut Stats, profile: &mut Profile) -> bool {
        self.follow_frame_table(profile);
        let Some((comm, labels)) = self.admit(record, kernel, stats) else { return false };
        // `comm` is the process's name (as pprof labels it); OTLP's `thread.name` is the thread's.
        profile.name_thread(record.tgid, record.tid, &record.comm);
        self.native.unwind_ahead(record, self.processes.maps(), kernel, stats);
        let Some(slot) = self.count_repeat(record, &comm, &labels, kernel, stats, profile) else { return true };
        let before = SampleCounts::of(stats);
        let python = &mut self.scratch.python;
        let outcome = self.python.python_stack(record, kernel, stats, &mut profile.frames, python);
        let (frames, native) = self.native.stack(record, outcome.is_python().then_some(&python[..]), self.processes.maps(), kernel, stats, &mut profile.frames);
        let state = thread_state(record, frames, self.options.kernel, profile);
        if let Some(slot) = slot {
            self.repeats.keep(slot, frames, outcome.is_cut(), before.since(stats), native);
            // Its repeats at other addresses are built here: sized now, they allocate nothing.
            self.scratch.repeat.clear();
            self.scratch.repeat.reserve(frames.len() + LEAF_FRAMES_SPARE);
        }
        let sample = SampleStack { pid: record.tgid, tid: record.tid, comm: &comm, frames, truncated: outcome.is_cut(), labels: Some(&labels), state };
        self.off_cpu.count(record, sample, stats, profile);
        // Only now: until the process is known, its samples come soon and with copies.
        self.known_once_settled(record, kernel);
        true
    }

    /// Tells the eBPF program that the process's samples need not reach userspace soon, once it
    /// is classified, how its stacks unwind is settled and it is past its first second. A repeat
    /// may settle it too: a process whose samples all repeat (a loop in C) has no other.
    fn known_once_settled(&mut self, record: &SampleRecord, kernel: &mut dyn KernelMaps) {
        if self.processes.is_known(record.tgid) {
            return;
        }
        if self.python.classified(record.tgid) && self.native.unwinding_settled(record) && !self.young_python(record.tgid) {
            self.processes.known(record.tgid, kernel);
        }
    }

    /// Counts a sample identical to one resolved before with that one's stack, and the counters
    /// its resolution added; otherwise (`Some`) where its resolution is kept, if anywhere.
    fn count_repeat(
        &mut self,
        record: &SampleRecord,
        comm: &Arc<str>,
        labels: &Arc<ProcessLabels>,
        kernel: &mut dyn KernelMaps,
        stats: &mut Stats,
        profile: &mut Profile,
    ) -> Option<Option<Slot>> {
        if self.native.resets() != self.native_resets {
            self.repeats.clear();
            self.native_resets = self.native.resets();
        }
        let known = self.native.know_leaf(record, self.processes.maps(), &mut profile.frames);
        let native = &self.native;
        let leaf_level = |leaf| known.filter(|&(at, _)| at == leaf).map(|(_, known)| native.leaf_level(known));
        let resolved = match self.repeats.look_up(record, native.unwound(), self.python.state(record.tgid), leaf_level) {
            Ok(resolved) => resolved,
            Err(slot) => return Some(slot),
        };
        stats.repeats += 1;
        resolved.counts.add_to(stats);
        self.python.repeat(record, kernel, stats, &mut profile.frames);
        let frames = match resolved.leaf {
            Some((at, leaf)) => {
                let (inner, outer) = resolved.frames.split_at(at.min(resolved.frames.len()));
                let stack = &mut self.scratch.repeat;
                stack.clear();
                stack.extend_from_slice(inner);
                stack.extend_from_slice(leaf);
                stack.extend_from_slice(outer);
                &stack[..]
            }
            None => resolved.frames,
        };
        let truncated = resolved.truncated;
        let sample = SampleStack { pid: record.tgid, tid: record.tid, comm, frames, truncated, labels: Some(labels), state: ThreadState::OnCpu };
        self.off_cpu.count(record, sample, stats, profile);
        self.native.settle_repeat(record);
        self.known_once_settled(record, kernel);
        None
    }

    /// A table the caches were not carried into: their ids would name other frames there.
    fn follow_frame_table(&mut self, profile: &Profile) {
        if profile.frames.generation() != self.frames_generation {
            self.native.clear_frame_ids();
            self.python.clear_frame_ids();
            self.off_cpu.clear_captures();
            self.repeats.clear();
            self.frames_generation = profile.frames.generation();
        }
    }

    /// The process's name and labels when the filter and the mode keep the record; attaches to
    /// the process (and watches its waits) on its first sample.
    fn admit(&mut self, record: &SampleRecord, kernel: &mut dyn KernelMaps, stats: &mut Stats) -> Option<(Arc<str>, Arc<ProcessLabels>)> {
        let comm = self.processes.name(record.tgid, &record.comm);
        let filter = &self.options.filter;
        if !filter.keeps_process(&comm) {
            self.processes.known(record.tgid, kernel);
            return None;
        }
        let ip = (record.user_len > 0).then(|| record.user_stack[0]);
        if self.python.discover(record.tgid, ip, kernel, self.processes.maps(), stats) {
            // Known before it was found to be Python (its `libpython` mapped late).
            self.processes.unknown(record.tgid, kernel);
        }
        let python = &self.python;
        let labels = self.processes.sampled(record.tgid, || python.version(record.tgid).map(|version| version.to_string()));
        if filter.python_only && !self.python.is_python(record.tgid) {
            self.known_once_classified(record.tgid, kernel);
            return None;
        }
        self.off_cpu.watch(record.tgid, kernel);
        if !self.counts(record) {
            self.known_once_classified(record.tgid, kernel);
            return None;
        }
        Some((comm, labels))
    }

    /// Whether `pid` is a Python process first sampled less than [`YOUNG_PYTHON`] ago.
    fn young_python(&self, pid: u32) -> bool {
        self.python.is_python(pid) && self.processes.sampled_for(pid) < YOUNG_PYTHON
    }

    /// Tells the eBPF program that the process's samples need not reach userspace soon, once what
    /// they need of the live process is read. A sample resolved calls this only after its stack:
    /// until then the program copies the process's stacks whose frame-pointer walk broke, and
    /// whether they need copying is decided with that stack.
    fn known_once_classified(&mut self, pid: u32, kernel: &mut dyn KernelMaps) {
        if self.python.classified(pid) {
            self.processes.known(pid, kernel);
        }
    }

    /// Whether the mode counts this record: off-CPU mode only intervals, GIL mode only samples
    /// of threads holding the GIL (of a free-threaded process, which has none, every sample on
    /// CPU, as CPU mode counts them).
    fn counts(&self, record: &SampleRecord) -> bool {
        match self.options.mode {
            Mode::Cpu | Mode::Wall => true,
            Mode::OffCpu => record.origin == origin::OFF_CPU,
            Mode::Gil => record.origin == origin::ON_CPU && (record.py.status & py_status::HOLDS_GIL != 0 || self.python.is_free_threaded(record.tgid)),
        }
    }

    /// The waiting tasks of a thread at its capture just resolved, counted as the capture counts.
    pub fn waiting_tasks(&mut self, waiting: &WaitingTasks, stats: &mut Stats, profile: &mut Profile) {
        let Some(capture) = self.off_cpu.take_task_capture(waiting.tid, waiting.time_ns) else { return };
        let stacks = &mut self.scratch.task_stacks;
        self.python.waiting_stacks(capture.pid, waiting, &mut profile.frames, stacks, stats);
        self.off_cpu.count_tasks(&capture, waiting.tid, stacks, profile);
    }

    /// A thread captured as it left the CPU came back: its stacks count for the time it was away.
    pub fn end_wait(&mut self, end: &OffCpuEnd, stats: &mut Stats, profile: &mut Profile) {
        self.off_cpu.end_wait(end, stats, profile);
    }

    /// Counts the threads of watched processes that are still off CPU at the end, each up to now:
    /// those captured as they left with the stacks captured then; those blocked since before the
    /// switch hook watched them with stacks read now, kept only if their context-switch count
    /// proves they have not run meanwhile.
    pub fn count_open_waits(&mut self, kernel: &mut dyn KernelMaps, stats: &mut Stats, profile: &mut Profile) {
        let throughout = self.off_cpu.count_open(kernel, monotonic_ns(), stats, profile);
        if throughout.is_empty() {
            return;
        }
        let kernel_symbols = KernelSymbols::read();
        for (tid, start) in throughout {
            self.count_blocked_throughout(tid, &start, &kernel_symbols, kernel, stats, profile);
        }
    }

    /// A thread blocked since before the switch hook watched it, read now and counted if it has
    /// provably not run since.
    fn count_blocked_throughout(
        &mut self,
        tid: u32,
        start: &OffCpuStart,
        kernel_symbols: &KernelSymbols,
        kernel: &mut dyn KernelMaps,
        stats: &mut Stats,
        profile: &mut Profile,
    ) {
        let Some(mut record) = waiting_record(tid, start, monotonic_ns(), kernel_symbols) else { return };
        if !self.python.capture_waiting(start.tgid, tid, &mut record) {
            record.py = Default::default();
        }
        let mut task_stacks = Vec::new();
        self.python.read_waiting_stacks(start.tgid, tid, &mut profile.frames, &mut task_stacks, stats);
        if !self.off_cpu.blocked_since_start(start.tgid, tid) || !self.resolve(&record, kernel, stats, profile) {
            return;
        }
        stats.off_cpu.open_at_end += 1;
        let comm = self.processes.name(start.tgid, &record.comm);
        let python = &self.python;
        let labels = self.processes.sampled(start.tgid, || python.version(start.tgid).map(|version| version.to_string()));
        for (frames, truncated) in &task_stacks {
            let sample = SampleStack { pid: start.tgid, tid, comm: &comm, frames, truncated: *truncated, labels: Some(&labels), state: ThreadState::TaskWait };
            profile.add_event(sample, Weight { samples: 1, ns: record.weight_ns }, record.time_ns);
        }
    }

    /// Periodic upkeep: thread lists re-read, and processes gone without an event forgotten
    /// (`lost_events`: exec and exit events lost so far).
    pub fn upkeep(&mut self, kernel: &mut dyn KernelMaps, lost_events: u64) {
        self.python.upkeep(kernel, self.processes.maps());
        self.repeats.forget_unmapped(&self.native.expire_unmapped());
        let (checked, lost) = self.stale_checked;
        if lost_events == lost && checked.elapsed() < STALE_CHECK {
            return;
        }
        self.stale_checked = (Instant::now(), lost_events);
        for pid in self.processes.stale() {
            self.forget(pid, kernel);
        }
    }

    /// When [`Self::upkeep`] is due next.
    pub fn upkeep_interval(&self) -> Duration {
        if self.python.tasks_pending() {
            UPKEEP_TASKS_PENDING
        } else {
            UPKEEP
        }
    }

    /// An exec or exit, read after the process's earlier samples were resolved: what was known
    /// of it no longer holds, and its next sample (a new program, or another process reusing the
    /// PID) is classified, named and symbolized afresh.
    pub fn process_event(&mut self, event: &ProcessEvent, kernel: &mut dyn KernelMaps) {
        self.forget(event.tgid, kernel);
    }

    /// Forgets everything known of `pid`, in every holder.
    fn forget(&mut self, pid: u32, kernel: &mut dyn KernelMaps) {
        self.repeats.invalidate(pid);
        self.off_cpu.forget(pid, kernel);
        self.processes.forget(pid, kernel);
        self.python.forget(pid, kernel);
        self.native.forget(pid, kernel);
    }

    /// The session's own counts, into `stats` at the end.
    pub fn finish(&self, stats: &mut Stats) {
        stats.code_cache = self.python.code_cache_counters();
        self.python.unreadable_tasks(stats);
    }
}

/// What the thread was doing: on CPU, or why it waited (from the kernel frames, which are then
/// dropped unless asked for).
fn thread_state(record: &SampleRecord, frames: &mut Vec<FrameId>, show_kernel: bool, profile: &Profile) -> ThreadState {
    if record.origin != origin::OFF_CPU {
        return ThreadState::OnCpu;
    }
    let state = wait_reason(record.wait_state, frames.iter().map(|&id| profile.frames.frame(id)));
    if !show_kernel {
        frames.retain(|&id| !matches!(profile.frames.frame(id), Frame::Kernel(_)));
    }
    state
}

/// Resolves a batch of records in order: samples become stacks in `profile`, events update the session.
pub fn add_samples(batch: &mut RecordBatch, session: &mut Session, kernel: &mut dyn KernelMaps, profile: &mut Profile, stats: &mut Stats) {
    if let Some(delay) = test_consumer_delay() {
        std::thread::sleep(delay);
    }
    while let Some(record) = batch.next() {
        match record {
            Record::Sample(record) => {
                stats.samples += 1;
                session.resolve(record, kernel, stats, profile);
            }
            Record::Event(event) => session.process_event(&event, kernel),
            Record::OffCpuEnd(end) => session.end_wait(&end, stats, profile),
            Record::WaitingTasks(waiting) => session.waiting_tasks(waiting, stats, profile),
        }
    }
}

/// `PYEBPF_TEST_CONSUMER_DELAY_MS`: stalls the consumer before each batch, so tests can show that
/// stacks stay true when userspace falls behind the sampled threads.
fn test_consumer_delay() -> Option<Duration> {
    static DELAY: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| std::env::var("PYEBPF_TEST_CONSUMER_DELAY_MS").ok()?.parse().ok().map(Duration::from_millis))
}
