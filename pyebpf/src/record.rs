//! `pyebpf record`: sample until the duration ends, a signal arrives, the command or every given
//! process exits (a launched command gets the first signal and is waited for), resolve every
//! sample to a stack while its process is alive, then write the profile (with `--rotate`, also at
//! the end of every period, starting a new profile each time).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use hashbrown::{HashMap, HashSet};
use pyebpf_common::{origin, py_status, task_status, user_status, OffCpuEnd, OffCpuStart, ProcessEvent, SampleRecord, WaitingTasks};

use crate::bpf::{check_privileges, Sampler, SamplerOptions};
use crate::cli::{GroupBy, Mode, RecordArgs, UnwindMode};
use crate::filter::SampleFilter;
use crate::maps::MapsCache;
use crate::merge::{python_frames, Merged, Merger, NativeStack};
use crate::native_ids::{IdLevel, NativeIds};
use crate::output::{self, Files, OutputError, ProfileSink, Rendering};
use crate::process::{self, Launched, ProcessNames, Watched};
use crate::processes::ProcessTable;
use crate::progress::Progress;
use crate::python_sampling::{PyItem, PythonSampling, SamplingOptions};
use crate::reader::{Record, RecordBatch};
use crate::report;
use crate::stack::{Frame, FrameCarry, FrameId, ProcessLabels, Profile, SampleStack, StoredStack, ThreadState, Weight};
use crate::stats::Stats;
use crate::stop_signals::StopSignals;
use crate::summary::{RunTotals, Summary};
use crate::symbolize::Symbolizer;
use crate::unwind::{Snapshot, StackUnwinder, Unwound};
use crate::waits::{wait_reason, waiting_record, KernelSymbols, SwitchBaseline};

/// How often lost samples are checked and periodic upkeep runs.
pub const TICK: Duration = Duration::from_millis(250);

/// Turns raw samples into stacks.
pub struct SampleResolver {
    /// The maps of the processes sampled, shared by the symbolizer, the unwinder and the Python reader.
    maps: MapsCache,
    symbolizer: Symbolizer,
    native: NativeIds,
    names: ProcessNames,
    python: PythonSampling,
    processes: ProcessTable,
    no_native: bool,
    filter: SampleFilter,
    scratch: Scratch,
    unwind: UnwindMode,
    unwinder: StackUnwinder,
    /// Processes whose stacks the eBPF program copies (`--unwind auto`).
    copying_stacks: HashSet<u32>,
    /// The frame table the cached frame ids belong to.
    frames_generation: u64,
    /// What the profile measures: which records count, and how much.
    mode: Mode,
    /// Show kernel frames (`--kernel`); off-CPU records carry them anyway, to tell why.
    kernel: bool,
    /// Processes whose off-CPU intervals the switch hooks capture.
    watching_waits: HashSet<u32>,
    /// Their threads' context switches when the hooks began watching them.
    baseline: SwitchBaseline,
    /// Threads captured as they left the CPU, waiting for their interval's end, by tid.
    pending_waits: HashMap<u32, PendingWait>,
    /// The last capture of each thread whose waiting tasks follow it (`--async-aware`), by tid.
    task_captures: HashMap<u32, TaskCapture>,
    /// `CLOCK_MONOTONIC` when the recording started: waits count from then on.
    recording_start_ns: u64,
}

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
            profile.add_sample(stack.as_sample(), Weight { samples: 1, ns });
        }
    }
}

/// A capture whose thread's waiting tasks follow it in the ring buffer.
struct TaskCapture {
    time_ns: u64,
    pid: u32,
    comm: Arc<str>,
    labels: Arc<ProcessLabels>,
    /// What each waiting task counts: the sample's period, the interval off CPU, or (`None`) the
    /// interval still open, known when the thread is back.
    ns: Option<u64>,
}

/// Buffers reused from sample to sample, so a sample seen before allocates nothing.
#[derive(Default)]
struct Scratch {
    python: Vec<PyItem>,
    levels: Vec<IdLevel>,
    frames: Vec<FrameId>,
    merger: Merger,
    task_stacks: Vec<(Vec<FrameId>, bool)>,
}

impl SampleResolver {
    pub fn new(options: SamplingOptions, no_native: bool, filter: SampleFilter, unwind: UnwindMode, mode: Mode, kernel: bool) -> Self {
        SampleResolver {
            maps: MapsCache::default(),
            symbolizer: Symbolizer::new(),
            native: NativeIds::default(),
            names: ProcessNames::default(),
            python: PythonSampling::new(options),
            processes: ProcessTable::default(),
            no_native,
            filter,
            scratch: Scratch::default(),
            unwind,
            unwinder: StackUnwinder::new(),
            copying_stacks: HashSet::new(),
            frames_generation: 0,
            mode,
            kernel,
            watching_waits: HashSet::new(),
            baseline: SwitchBaseline::default(),
            pending_waits: HashMap::new(),
            task_captures: HashMap::new(),
            recording_start_ns: 0,
        }
    }

    /// Measures `mode` from now on, with a sampler started afresh ([`Self::start_sampler`]): what
    /// the old sampler's maps held is gone with it.
    pub fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
        self.watching_waits.clear();
        self.pending_waits.clear();
        self.task_captures.clear();
        self.copying_stacks.clear();
        self.baseline = SwitchBaseline::default();
        self.python.forget_registrations();
    }

    /// The recording starts now: off-CPU time before is not its.
    pub fn start_recording(&mut self) {
        self.recording_start_ns = monotonic_ns();
    }

    /// Nanoseconds of an interval from `start_ns` to `end_ns` within the recording.
    fn within_recording(&self, start_ns: u64, end_ns: u64) -> u64 {
        end_ns.saturating_sub(start_ns.max(self.recording_start_ns))
    }

    /// Has the switch hooks capture `pid`'s off-CPU intervals, in the modes that count them.
    fn watch_waits(&mut self, pid: u32, sampler: &mut Sampler) {
        if self.mode.counts_waits() && pid != std::process::id() && self.watching_waits.insert(pid) {
            if let Err(err) = sampler.watch_waits(pid) {
                log::debug!("process {pid}: its off-CPU time is not captured: {err}");
            }
        }
    }

    /// Whether the mode counts this record: off-CPU mode only intervals, GIL mode only samples
    /// of threads holding the GIL.
    fn counts(&self, record: &SampleRecord) -> bool {
        match self.mode {
            Mode::Cpu | Mode::Wall => true,
            Mode::OffCpu => record.origin == origin::OFF_CPU,
            Mode::Gil => record.origin == origin::ON_CPU && record.py.status & py_status::HOLDS_GIL != 0,
        }
    }

    /// Moves the frames the caches keep ids of into the next period's table.
    pub fn carry_frames(&mut self, carry: &mut FrameCarry<'_>) {
        self.native.carry_frames(carry);
        self.python.carry_frames(carry);
        let pending = self.pending_waits.values_mut().flat_map(|pending| std::iter::once(&mut pending.stack).chain(&mut pending.tasks));
        for id in pending.flat_map(|stack| stack.frames_mut().iter_mut()) {
            *id = carry.carry(*id);
        }
        self.frames_generation = carry.new_generation();
    }

    /// Resolves the sample's stack and counts it in `profile`; false when the filter drops it
    /// (checked before any remote read).
    pub fn resolve(&mut self, record: &SampleRecord, sampler: &mut Sampler, stats: &mut Stats, profile: &mut Profile) -> bool {
        if profile.frames.generation() != self.frames_generation {
            // A table the caches were not carried into: their ids would name other frames there.
            self.native.clear();
            self.python.clear_frame_ids();
            self.pending_waits.clear();
            self.task_captures.clear();
            self.frames_generation = profile.frames.generation();
        }
        let comm = self.names.name(record.tgid, &record.comm);
        if !self.filter.keeps_process(&comm) {
            return false;
        }
        let labels = self.processes.sampled(record.tgid);
        self.python.discover(record.tgid, sampler, &mut self.maps, stats);
        if self.filter.python_only && !self.python.is_python(record.tgid) {
            return false;
        }
        self.watch_waits(record.tgid, sampler);
        if !self.counts(record) {
            return false;
        }
        let off_cpu = record.origin == origin::OFF_CPU;
        let Scratch { python, levels, frames, merger, .. } = &mut self.scratch;
        let truncated = self.python.python_stack(record, sampler, stats, &mut profile.frames, python);
        frames.clear();
        if !(self.no_native && truncated.is_some()) {
            let kernel_len = (record.kernel_len as usize).min(record.kernel_stack.len());
            self.native.kernel_frames(&mut self.symbolizer, &mut profile.frames, &record.kernel_stack[..kernel_len], frames);
        }
        if self.no_native && truncated.is_some() {
            frames.extend(python_frames(python).copied());
        } else {
            // Unwound from the stack copy where the sample has one, else the kernel's frame-pointer walk.
            let unwound = (record.stack_len > 0).then(|| unwind_copy(&mut self.unwinder, &mut self.maps, record, stats));
            let (addrs, bases) = match &unwound {
                Some(unwound) => (&unwound.addrs[..], &unwound.frame_bases[..]),
                None => {
                    let user_len = (record.user_len as usize).min(record.user_stack.len());
                    let bases_len = (record.frame_bases_len as usize).min(record.user_frame_bases.len());
                    (&record.user_stack[..user_len], &record.user_frame_bases[..bases_len])
                }
            };
            self.native.user_levels(&mut self.symbolizer, &mut self.maps, &mut profile.frames, record.tgid, addrs, levels);
            let stack = NativeStack { levels, frame_bases: bases, sp: record.user_sp };
            // `--unwind auto`: a frame-pointer walk that reached neither a zero frame pointer nor
            // the C library's start code has the process's later samples carry stack copies.
            if unwound.is_none()
                && self.unwind == UnwindMode::Auto
                && !addrs.is_empty()
                && record.user_status & user_status::FP_COMPLETE == 0
                && !stack.reaches_start_code()
                && self.copying_stacks.insert(record.tgid)
            {
                if let Err(err) = sampler.copy_stacks_of(record.tgid) {
                    log::debug!("process {}: stacks stay frame-pointer unwound: {err}", record.tgid);
                }
            }
            let native = &self.native;
            if truncated.is_some() {
                merger.merge(&stack, python, |piece| match piece {
                    Merged::Native(level) => frames.extend_from_slice(native.frames(level)),
                    Merged::Python(&id) => frames.push(id),
                });
            } else {
                for level in &levels[..stack.trusted_levels()] {
                    frames.extend_from_slice(native.frames(level));
                }
            }
        }
        let state = if off_cpu { wait_reason(record.wait_state, frames.iter().map(|&id| profile.frames.frame(id))) } else { ThreadState::OnCpu };
        if off_cpu && !self.kernel {
            frames.retain(|&id| !matches!(profile.frames.frame(id), Frame::Kernel(_)));
        }
        let sample =
            SampleStack { pid: record.tgid, tid: record.tid, comm: &comm, frames, truncated: truncated.unwrap_or(false), labels: Some(&labels), state };
        let ns = if !off_cpu {
            profile.add_sample(sample, Weight { samples: 1, ns: profile.period_ns() });
            Some(profile.period_ns())
        } else if record.weight_ns != 0 {
            stats.off_cpu.intervals += 1;
            profile.add_sample(sample, Weight { samples: 1, ns: record.weight_ns });
            Some(record.weight_ns)
        } else {
            // Its length comes when the thread is back (`end_wait`).
            self.pending_waits.insert(record.tid, PendingWait { start_ns: record.time_ns, stack: StoredStack::from_sample(&sample), tasks: Vec::new() });
            None
        };
        if record.tasks.status & task_status::WAITING_FOLLOWS != 0 {
            self.task_captures.insert(record.tid, TaskCapture { time_ns: record.time_ns, pid: record.tgid, comm, labels, ns });
        }
        true
    }

    /// The waiting tasks of a thread at its capture just resolved: each task's stack counts what
    /// the capture counts (a period, or the interval the thread was off CPU, in which none of its
    /// tasks could run).
    pub fn waiting_tasks(&mut self, waiting: &WaitingTasks, stats: &mut Stats, profile: &mut Profile) {
        let Some(capture) = self.task_captures.remove(&waiting.tid) else { return };
        if capture.time_ns != waiting.time_ns {
            return;
        }
        let stacks = &mut self.scratch.task_stacks;
        self.python.waiting_stacks(capture.pid, waiting, &mut profile.frames, stacks, stats);
        for (frames, truncated) in stacks.iter() {
            let sample = SampleStack {
                pid: capture.pid,
                tid: waiting.tid,
                comm: &capture.comm,
                frames,
                truncated: *truncated,
                labels: Some(&capture.labels),
                state: ThreadState::TaskWait,
            };
            match capture.ns {
                Some(ns) => profile.add_sample(sample, Weight { samples: 1, ns }),
                None => match self.pending_waits.get_mut(&waiting.tid) {
                    Some(pending) if pending.start_ns == waiting.time_ns => pending.tasks.push(StoredStack::from_sample(&sample)),
                    _ => {}
                },
            }
        }
    }

    /// A thread captured as it left the CPU came back: its stacks count for the time it was away.
    pub fn end_wait(&mut self, end: &OffCpuEnd, stats: &mut Stats, profile: &mut Profile) {
        let Some(pending) = self.pending_waits.get(&end.tid) else { return };
        if pending.start_ns != end.start_ns {
            return;
        }
        let pending = self.pending_waits.remove(&end.tid).expect("looked up above");
        stats.off_cpu.intervals += 1;
        let carried = self.carried(end.carried_ns, end.start_ns, stats);
        let ns = self.within_recording(end.start_ns, end.start_ns.saturating_add(end.away_ns)) + carried;
        pending.count(ns, profile);
    }

    /// The uncaptured off-CPU time a capture at `start_ns` stands for, counted in `stats`: it lies
    /// before the capture, and only what the recording holds counts.
    fn carried(&self, carried_ns: u64, start_ns: u64, stats: &mut Stats) -> u64 {
        let carried = carried_ns.min(self.within_recording(0, start_ns));
        stats.off_cpu.carried_ns += carried;
        carried
    }

    /// Counts the threads of watched processes that are still off CPU at the end, each up to now:
    /// those captured as they left with the stacks captured then; those blocked since before the
    /// switch hook watched them with stacks read now, kept only if their context-switch count
    /// proves they have not run meanwhile.
    pub fn count_open_waits(&mut self, sampler: &mut Sampler, stats: &mut Stats, profile: &mut Profile) {
        let now = monotonic_ns();
        let watched = sampler.watched_threads();
        for (tid, entry) in &watched {
            if entry.start_ns == 0 || !self.watching_waits.contains(&entry.tgid) {
                continue;
            }
            match self.pending_waits.remove(tid) {
                Some(pending) if pending.start_ns == entry.start_ns => {
                    stats.off_cpu.intervals += 1;
                    stats.off_cpu.open_at_end += 1;
                    let ns = self.within_recording(entry.start_ns, now) + self.carried(entry.carried_ns, entry.start_ns, stats);
                    pending.count(ns, profile);
                }
                _ if entry.captured_ns != entry.start_ns => {
                    stats.off_cpu.short_intervals += 1;
                    stats.off_cpu.short_ns += self.within_recording(entry.start_ns, now);
                }
                _ => {}
            }
        }
        // Threads the hook never saw leave: blocked since before it watched, and still.
        let seen: HashSet<u32> = watched.iter().map(|(tid, _)| *tid).collect();
        let throughout: Vec<(u32, OffCpuStart)> = self.baseline.blocked_throughout().into_iter().filter(|(tid, _)| !seen.contains(tid)).collect();
        if throughout.is_empty() {
            return;
        }
        let kernel_symbols = KernelSymbols::read();
        for (tid, mut start) in throughout {
            start.start_ns = start.start_ns.max(self.recording_start_ns);
            let Some(mut record) = waiting_record(tid, &start, monotonic_ns(), &kernel_symbols) else { continue };
            if !self.python.capture_waiting(start.tgid, tid, &mut record) {
                record.py = Default::default();
            }
            let mut task_stacks = Vec::new();
            self.python.read_waiting_stacks(start.tgid, tid, &mut profile.frames, &mut task_stacks, stats);
            if !self.baseline.unchanged(start.tgid, tid) {
                continue;
            }
            if self.resolve(&record, sampler, stats, profile) {
                stats.off_cpu.open_at_end += 1;
                let comm = self.names.name(start.tgid, &record.comm);
                let labels = self.processes.sampled(start.tgid);
                for (frames, truncated) in &task_stacks {
                    let sample =
                        SampleStack { pid: start.tgid, tid, comm: &comm, frames, truncated: *truncated, labels: Some(&labels), state: ThreadState::TaskWait };
                    profile.add_sample(sample, Weight { samples: 1, ns: record.weight_ns });
                }
            }
        }
    }

    /// Attaches to processes already running (those the filter keeps), before sampling starts.
    fn attach_all(&mut self, pids: impl IntoIterator<Item = u32>, stats: &mut Stats) -> Vec<u32> {
        let kept: Vec<u32> = pids.into_iter().filter(|&pid| self.filter.keeps_process(&self.names.name(pid, &[]))).collect();
        self.python.attach_all(kept.iter().copied(), stats);
        kept
    }

    /// Tells the eBPF program about the processes attached so far, and has it watch the waits of
    /// those profiled (a thread that waits from the start on is counted too).
    fn register_all(&mut self, sampler: &mut Sampler, kept: Vec<u32>) {
        self.python.register_all(sampler, &mut self.maps);
        if !self.mode.counts_waits() {
            return;
        }
        for &pid in &kept {
            if !self.filter.python_only || self.python.is_python(pid) {
                self.watch_waits(pid, sampler);
            }
        }
        self.baseline = SwitchBaseline::take(self.watching_waits.iter().copied(), monotonic_ns());
    }

    pub fn upkeep(&mut self, sampler: &mut Sampler) {
        self.python.upkeep(sampler, &mut self.maps);
        self.native.expire_unmapped();
        for pid in self.processes.stale() {
            self.forget(pid, sampler);
        }
    }

    /// An exec or exit, read after the process's earlier samples were resolved: what was known
    /// of it no longer holds, and its next sample (a new program, or another process reusing the
    /// PID) is classified, named and symbolized afresh.
    pub fn process_event(&mut self, event: &ProcessEvent, sampler: &mut Sampler) {
        self.forget(event.tgid, sampler);
    }

    fn forget(&mut self, pid: u32, sampler: &mut Sampler) {
        if self.watching_waits.remove(&pid) {
            sampler.stop_watching_waits(pid);
            self.pending_waits.retain(|_, pending| pending.stack.as_sample().pid != pid);
        }
        self.task_captures.retain(|_, capture| capture.pid != pid);
        self.processes.forget(pid);
        self.python.forget(pid, sampler);
        self.symbolizer.forget_process(pid);
        self.native.forget_process(pid);
        self.names.forget(pid);
        self.unwinder.forget_process(pid);
        self.maps.forget(pid);
        if self.copying_stacks.remove(&pid) {
            sampler.stop_copying_stacks_of(pid);
        }
    }

    pub fn finish(&self, stats: &mut Stats) {
        stats.code_cache = self.python.code_cache_counters();
        self.python.unreadable_tasks(stats);
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
}

pub fn run(args: RecordArgs) -> Result<()> {
    let output_name = output::display_name(&args.output);
    let rendering = Rendering { threads: args.threads, title: command_line() };
    let sink =
        Arc::new(ProfileSink::new(&args.output, args.format, files(&args), rendering, args.function).with_context(|| format!("cannot write {output_name}"))?);
    check_privileges()?;
    let watched = Watched::open(&args.pid)?;
    process::raise_open_file_limit();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().context("start the async runtime")?;
    let (profile, stats, periods) = runtime.block_on(record(&args, &watched, &sink))?;
    let output = write_and_retain(&sink, &profile).context("cannot write the profile")?;
    let summary = match periods {
        // The run's summary adds up every period; each period's own line names its file.
        Some(WrittenPeriods { mut totals, first }) => {
            report_period(&profile, &output, stats.lost_samples);
            totals.add(&profile);
            let files = match first {
                Some(first) => {
                    let kept = args.keep.filter(|&keep| totals.profiles as u64 > keep).map(|keep| format!(" (the newest {keep} kept)")).unwrap_or_default();
                    format!("{} files{kept}, {first} to {output}", totals.profiles)
                }
                None => output,
            };
            Summary::new(totals, &stats, files, None)
        }
        None => Summary::new(RunTotals::of(&profile), &stats, output, sink.open_command()),
    };
    report::report_text(format_args!("{summary}"));
    if args.stats {
        report::report_text(format_args!("{stats}"));
    }
    Ok(())
}

/// One profile at `-o`, or a file per `--rotate` period.
fn files(args: &RecordArgs) -> Files {
    match args.rotate {
        Some(_) => Files::Rotated { keep: args.keep.map(|keep| keep as usize) },
        None => Files::Single,
    }
}

/// Writes a profile, then with `--keep` removes the oldest period files past it (a file that
/// cannot be removed is said, and the recording goes on).
fn write_and_retain(sink: &ProfileSink, profile: &Profile) -> Result<String, OutputError> {
    let name = sink.write(profile)?;
    if let Err(err) = sink.remove_oldest() {
        report!("cannot remove an old profile: {err}");
    }
    Ok(name)
}

/// `--rotate`: ends the period and hands its profile to the writer; the next period starts in
/// `profile`, with only the frames the resolver's caches still use.
fn rotate(writer: &PeriodWriter, resolver: &mut SampleResolver, profile: &mut Profile, period_started: &mut Instant, lost: u64) {
    let next = profile.next_period();
    let mut finished = std::mem::replace(profile, next);
    resolver.carry_frames(&mut FrameCarry::new(&finished.frames, &mut profile.frames));
    finished.duration_ns = period_started.elapsed().as_nanos() as i64;
    *period_started = Instant::now();
    profile.start_unix_ns = unix_now_ns();
    writer.write(finished, lost);
}

/// The line of one `--rotate` period written to `name`, with the samples lost in the run so far.
fn report_period(profile: &Profile, name: &str, lost: u64) {
    report!("wrote {} samples of {} processes to {name} ({lost} lost)", profile.total_samples(), profile.processes());
}

/// Writes the periods of `--rotate` in order on a thread of its own, so that the sampling loop
/// keeps reading samples while a large profile is rendered: a short-lived process whose samples
/// waited in the ring buffer meanwhile would be gone, unresolved, when they were read.
struct PeriodWriter {
    /// One period waits at most; a writer slower than the periods holds the loop back.
    queue: std::sync::mpsc::SyncSender<(Profile, u64)>,
    thread: std::thread::JoinHandle<WrittenPeriods>,
}

/// The periods a [`PeriodWriter`] wrote: what they add up to, and the first one's file.
#[derive(Default)]
struct WrittenPeriods {
    totals: RunTotals,
    first: Option<String>,
}

impl PeriodWriter {
    fn start(sink: Arc<ProfileSink>) -> Result<PeriodWriter> {
        let (queue, periods) = std::sync::mpsc::sync_channel::<(Profile, u64)>(1);
        let thread = std::thread::Builder::new()
            .name("pyebpf-writer".into())
            .spawn(move || {
                let mut written = WrittenPeriods::default();
                for (profile, lost) in periods {
                    // A period that cannot be written is lost, but the next ones may still be.
                    match write_and_retain(&sink, &profile) {
                        Ok(name) => {
                            report_period(&profile, &name, lost);
                            written.totals.add(&profile);
                            written.first.get_or_insert(name);
                        }
                        Err(err) => report!("cannot write the profile: {err}"),
                    }
                }
                written
            })
            .context("start the profile writer")?;
        Ok(PeriodWriter { queue, thread })
    }

    fn write(&self, profile: Profile, lost: u64) {
        if self.queue.send((profile, lost)).is_err() {
            report!("cannot write the profile: the writer stopped");
        }
    }

    /// Waits until every period handed over is written; returns what they add up to.
    fn finish(self) -> WrittenPeriods {
        drop(self.queue);
        self.thread.join().unwrap_or_else(|_| {
            report!("cannot write the profile: the writer failed");
            WrittenPeriods::default()
        })
    }
}

fn unix_now_ns() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i64)
}

/// Records until the end of the run; returns its last (or only) profile, and with `--rotate` what
/// the periods written before it add up to.
async fn record(args: &RecordArgs, watched: &Watched, sink: &Arc<ProfileSink>) -> Result<(Profile, Stats, Option<WrittenPeriods>)> {
    // Stop signals that came while pyebpf loaded are read here too (see `stop_signals`).
    let mut stops = StopSignals::new().context("read stop signals")?;
    let options = SamplingOptions { marker: !args.no_cache, read_only: args.read_only, max_frames: args.max_python_frames, async_aware: args.mode.async_aware };
    let mode = args.mode.mode;
    let mut resolver = SampleResolver::new(options, args.no_native, args.filter.sample_filter(), args.unwind, mode, args.kernel);
    let mut stats = Stats::default();
    stats.tasks.enabled = args.mode.async_aware;
    let targets = if args.all { None } else { Some(args.pid.clone()) };
    let mut sampler = resolver.start_sampler(
        &SamplerOptions {
            frequency_hz: args.frequency,
            kernel_stacks: args.kernel,
            targets,
            follow_forks: !args.command.is_empty() || args.subprocesses,
            ring_buffer_kb: args.ring_buffer_kb,
            program_stats: args.stats,
            snapshot_all: args.unwind == UnwindMode::Dwarf,
            gil: mode == Mode::Gil,
            tasks: args.mode.async_aware,
            waiting_tasks: mode.counts_waits() && args.mode.async_aware,
            off_cpu_min: mode.counts_waits().then(|| Duration::from_micros(args.mode.off_cpu_min_us)),
        },
        &mut stats,
    )?;
    let mut command = if args.command.is_empty() {
        None
    } else {
        // pyebpf itself is a target for the fork hook (its own samples are still dropped), so the
        // command is one from its fork on and cannot start children before it is registered.
        sampler.add_target(std::process::id())?;
        Some(Launched::start(&args.command, output::is_stdout(&args.output))?)
    };
    resolver.start_recording();
    let mut profile = Profile::new(args.frequency);
    profile.mode = mode;
    profile.group_by_container = args.group_by == GroupBy::Container;
    let mut started = Instant::now();
    profile.start_unix_ns = unix_now_ns();
    let deadline = args.duration.map(|duration| tokio::time::Instant::now() + duration);
    let writer = args.rotate.map(|_| PeriodWriter::start(Arc::clone(sink))).transpose()?;
    let mut rotation = args.rotate.map(|secs| {
        let period = Duration::from_secs(secs);
        let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        // A period that ends late (a busy host) does not make the next ones short to catch up:
        // every period lasts at least SECONDS, so no two start in the same second.
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        interval
    });
    let mut tick = tokio::time::interval(TICK);
    let mut batch = RecordBatch::default();
    let mut lost_reported = 0;
    let progress = Progress::start();
    loop {
        tokio::select! {
            read = sampler.read_samples(&mut batch) => {
                read?;
                add_samples(&mut batch, &mut resolver, &mut sampler, &mut profile, &mut stats);
            }
            signal = stops.next() => if !pass_to_command(&mut command, signal) { break },
            _ = next_period(&mut rotation) => if let Some(writer) = &writer {
                rotate(writer, &mut resolver, &mut profile, &mut started, sampler.lost_samples());
            },
            _ = sleep_until(deadline) => break,
            _ = tick.tick() => {
                lost_reported = report_lost(&sampler, lost_reported, &progress);
                progress.update(&stats, lost_reported);
                resolver.upkeep(&mut sampler);
                if command.as_mut().is_some_and(Launched::exited) || watched.all_exited() {
                    break;
                }
            }
        }
    }
    // What the kernel sent before the stop is still in the ring buffer or the reader's queue.
    if tokio::time::timeout(Duration::from_millis(20), sampler.read_samples(&mut batch)).await.is_ok() {
        add_samples(&mut batch, &mut resolver, &mut sampler, &mut profile, &mut stats);
    }
    resolver.count_open_waits(&mut sampler, &mut stats, &mut profile);
    progress.finish();
    let periods = writer.map(PeriodWriter::finish);
    resolver.finish(&mut stats);
    stats.lost_samples = sampler.lost_samples();
    (stats.reader_dropped_batches, stats.reader_dropped_samples) = sampler.reader_drops();
    let run_time = |name| sampler.program_run_time(name).map_or((0, 0), |(time, runs): (Duration, u64)| (time.as_nanos() as u64, runs));
    (stats.program_run_time_ns, stats.program_runs) = run_time(sampler.programs().sample);
    if mode.counts_waits() {
        (stats.switch_run_time_ns, stats.switch_runs) = run_time(sampler.programs().switch);
    }
    stats.own_cpu_ns = own_cpu_ns();
    let (short_intervals, short_ns) = sampler.short_waits();
    stats.off_cpu.short_intervals += short_intervals;
    stats.off_cpu.short_ns += short_ns;
    profile.duration_ns = started.elapsed().as_nanos() as i64;
    Ok((profile, stats, periods))
}

/// Resolves a batch of records in order: samples become stacks in `profile`, events update the resolver.
pub fn add_samples(batch: &mut RecordBatch, resolver: &mut SampleResolver, sampler: &mut Sampler, profile: &mut Profile, stats: &mut Stats) {
    if let Some(delay) = test_consumer_delay() {
        std::thread::sleep(delay);
    }
    while let Some(record) = batch.next() {
        match record {
            Record::Sample(record) => {
                stats.samples += 1;
                resolver.resolve(record, sampler, stats, profile);
            }
            Record::Event(event) => resolver.process_event(&event, sampler),
            Record::OffCpuEnd(end) => resolver.end_wait(&end, stats, profile),
            Record::WaitingTasks(waiting) => resolver.waiting_tasks(waiting, stats, profile),
        }
    }
}

/// `PYEBPF_TEST_CONSUMER_DELAY_MS`: stalls the consumer before each batch, so tests can show that
/// stacks stay true when userspace falls behind the sampled threads.
fn test_consumer_delay() -> Option<Duration> {
    static DELAY: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| std::env::var("PYEBPF_TEST_CONSUMER_DELAY_MS").ok()?.parse().ok().map(Duration::from_millis))
}

/// A sample's user stack unwound from its copy, with what it cost counted in `stats`.
fn unwind_copy(unwinder: &mut StackUnwinder, maps: &mut MapsCache, record: &SampleRecord, stats: &mut Stats) -> Unwound {
    let stack = &record.stack_tail[..(record.stack_len as usize).min(record.stack_tail.len())];
    let started = thread_cpu_ns();
    let unwound = unwinder.unwind(maps, record.tgid, &Snapshot { ip: record.user_stack[0], sp: record.user_sp, bp: record.user_bp, stack });
    stats.count_unwind(&unwound, stack.len(), record.user_status & user_status::SNAPSHOT_FULL != 0, thread_cpu_ns().saturating_sub(started));
    unwound
}

/// `CLOCK_MONOTONIC` now, the clock of the kernel's `bpf_ktime_get_ns`.
fn monotonic_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime fills the timespec it is given.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) } != 0 {
        return 0;
    }
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// CPU time of the calling thread so far: what one step costs, also on a busy host.
fn thread_cpu_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime fills the timespec it is given.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) } != 0 {
        return 0;
    }
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// User plus system CPU time of this process so far.
fn own_cpu_ns() -> u64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } != 0 {
        return 0;
    }
    // SAFETY: initialised above (zeroed, then filled on success).
    let usage = unsafe { usage.assume_init() };
    let ns = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    ns(usage.ru_utime) + ns(usage.ru_stime)
}

async fn next_period(rotation: &mut Option<tokio::time::Interval>) {
    match rotation {
        Some(interval) => {
            interval.tick().await;
        }
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Warns when the kernel dropped samples since the last report; returns the new total.
fn report_lost(sampler: &Sampler, reported: u64, progress: &Progress) -> u64 {
    let lost = sampler.lost_samples();
    if lost > reported {
        progress.warn(&format!("pyebpf: lost {} samples (ring buffer full); try a larger --ring-buffer-kb", lost - reported));
    }
    lost
}

/// With a command running, the first stop signal goes to it and the recording waits for it to
/// exit; returns whether the signal was passed on (otherwise the recording stops now).
fn pass_to_command(command: &mut Option<Launched>, signal: i32) -> bool {
    command.as_mut().is_some_and(|command| command.pass_signal(signal))
}

/// pyebpf's command line, the title of what it wrote.
fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}
