//! `pyebpf record`: sample until the duration ends, a signal arrives, the command or every given
//! process exits (a launched command gets the first signal and is waited for), resolve every
//! sample to a stack while its process is alive, then write the profile (with `--rotate`, also at
//! the end of every period, starting a new profile each time).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use std::collections::HashSet;

use pyebpf_common::{user_status, ProcessEvent, SampleRecord};
use tokio::signal::unix::{signal, SignalKind};

use crate::bpf::{check_privileges, Record, Sampler, SamplerOptions};
use crate::cli::{GroupBy, RecordArgs, UnwindMode};
use crate::filter::SampleFilter;
use crate::merge::{self, NativeStack};
use crate::python_sampling::{PythonSampling, SamplingOptions};
use crate::output::{self, ProfileSink, Rendering};
use crate::process::{self, Launched, ProcessNames, Watched};
use crate::processes::ProcessTable;
use crate::progress::Progress;
use crate::report;
use crate::stack::{Frame, Profile, StackKey};
use crate::stats::Stats;
use crate::summary::Summary;
use crate::symbolize::Symbolizer;
use crate::unwind::{Snapshot, StackUnwinder};

/// How often lost samples are checked and periodic upkeep runs.
const TICK: Duration = Duration::from_millis(250);

/// Turns raw samples into stacks.
pub struct SampleResolver {
    symbolizer: Symbolizer,
    names: ProcessNames,
    python: PythonSampling,
    processes: ProcessTable,
    no_native: bool,
    filter: SampleFilter,
    unwind: UnwindMode,
    unwinder: StackUnwinder,
    /// Processes whose stacks the eBPF program copies (`--unwind auto`).
    copying_stacks: HashSet<u32>,
}

impl SampleResolver {
    pub fn new(options: SamplingOptions, no_native: bool, filter: SampleFilter, unwind: UnwindMode) -> Self {
        SampleResolver {
            symbolizer: Symbolizer::new(),
            names: ProcessNames::default(),
            python: PythonSampling::new(options),
            processes: ProcessTable::default(),
            no_native,
            filter,
            unwind,
            unwinder: StackUnwinder::new(),
            copying_stacks: HashSet::new(),
        }
    }

    /// The sample's stack, or None when the filter drops it (checked before any remote read).
    pub fn resolve(&mut self, record: &SampleRecord, sampler: &mut Sampler, stats: &mut Stats) -> Option<StackKey> {
        let comm = self.names.name(record.tgid, &record.comm);
        if !self.filter.keeps_process(&comm) {
            return None;
        }
        let labels = self.processes.sampled(record.tgid);
        self.python.discover(record.tgid, sampler, stats);
        if self.filter.python_only && !self.python.is_python(record.tgid) {
            return None;
        }
        let python = self.python.python_stack(record, sampler, stats);
        let kernel_len = (record.kernel_len as usize).min(record.kernel_stack.len());
        let mut frames: Vec<Frame> = Vec::new();
        if !(self.no_native && python.is_some()) {
            frames.extend(self.symbolizer.kernel_frames(&record.kernel_stack[..kernel_len]).into_iter().map(Frame::Kernel));
        }
        let truncated = python.as_ref().is_some_and(|p| p.truncated);
        match python {
            Some(python) if self.no_native => frames.extend(merge::python_only(&python.items)),
            python => {
                let native = self.native_stack(record, sampler, stats);
                match python {
                    Some(python) => frames.extend(merge::merge_stacks(&native, &python.items)),
                    None => frames.extend(native.trusted_frames()),
                }
            }
        }
        Some(StackKey { pid: record.tgid, tid: record.tid, comm, frames, truncated, labels: Some(labels) })
    }

    /// The sample's user stack: unwound from its stack copy where it has one, else the frame-pointer
    /// walk the kernel did. With `--unwind auto`, a frame-pointer walk that reached neither a zero
    /// frame pointer nor libc's start code has the process's later samples carry stack copies.
    fn native_stack(&mut self, record: &SampleRecord, sampler: &mut Sampler, stats: &mut Stats) -> NativeStack {
        if record.stack_len > 0 {
            let stack = &record.stack_tail[..(record.stack_len as usize).min(record.stack_tail.len())];
            let started = thread_cpu_ns();
            let unwound = self.unwinder.unwind(record.tgid, &Snapshot { ip: record.user_stack[0], sp: record.user_sp, bp: record.user_bp, stack });
            let took = thread_cpu_ns().saturating_sub(started);
            stats.count_unwind(&unwound, stack.len(), record.user_status & user_status::SNAPSHOT_FULL != 0, took);
            return NativeStack {
                levels: self.symbolizer.user_levels(record.tgid, &unwound.addrs),
                frame_bases: unwound.frame_bases,
                sp: record.user_sp,
            };
        }
        let user_len = (record.user_len as usize).min(record.user_stack.len());
        let bases_len = (record.frame_bases_len as usize).min(record.user_frame_bases.len());
        let native = NativeStack {
            levels: self.symbolizer.user_levels(record.tgid, &record.user_stack[..user_len]),
            frame_bases: record.user_frame_bases[..bases_len].to_vec(),
            sp: record.user_sp,
        };
        let complete = record.user_status & user_status::FP_COMPLETE != 0 || native.reaches_start_code();
        if self.unwind == UnwindMode::Auto && user_len > 0 && !complete {
            self.copy_stacks_of(record.tgid, sampler);
        }
        native
    }

    fn copy_stacks_of(&mut self, pid: u32, sampler: &mut Sampler) {
        if self.copying_stacks.insert(pid) {
            if let Err(err) = sampler.copy_stacks_of(pid) {
                log::debug!("process {pid}: stacks stay frame-pointer unwound: {err}");
            }
        }
    }

    /// Attaches to processes already running (those the filter keeps), before sampling starts.
    pub fn attach_all(&mut self, pids: impl IntoIterator<Item = u32>, stats: &mut Stats) {
        let kept: Vec<u32> = pids.into_iter().filter(|&pid| self.filter.keeps_process(&self.names.name(pid, &[]))).collect();
        self.python.attach_all(kept, stats);
    }

    /// Tells the eBPF program about the processes attached so far.
    pub fn register_all(&mut self, sampler: &mut Sampler) {
        self.python.register_all(sampler);
    }

    pub fn upkeep(&mut self, sampler: &mut Sampler) {
        self.python.upkeep(sampler);
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
        self.processes.forget(pid);
        self.python.forget(pid, sampler);
        self.symbolizer.forget_process(pid);
        self.names.forget(pid);
        self.unwinder.forget_process(pid);
        if self.copying_stacks.remove(&pid) {
            sampler.stop_copying_stacks_of(pid);
        }
    }

    pub fn finish(&self, stats: &mut Stats) {
        stats.code_cache = self.python.code_cache_counters();
    }
}

pub fn run(args: RecordArgs) -> Result<()> {
    let output_name = output::display_name(&args.output);
    let rendering = Rendering { threads: args.threads, title: command_line() };
    let sink = ProfileSink::new(&args.output, args.format, args.rotate.is_some(), rendering, args.function).with_context(|| format!("cannot write {output_name}"))?;
    check_privileges()?;
    let watched = Watched::open(&args.pid)?;
    process::raise_open_file_limit();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().context("start the async runtime")?;
    let (profile, stats) = runtime.block_on(record(&args, &watched, &sink))?;
    let output = sink.write(&profile).context("cannot write the profile")?;
    report::report_text(format_args!("{}", Summary::new(&profile, &stats, output, sink.open_command())));
    if args.stats {
        report::report_text(format_args!("{stats}"));
    }
    Ok(())
}

/// `--rotate`: ends the period, writes its profile, and starts the next one in `profile`.
fn rotate(sink: &ProfileSink, profile: &mut Profile, period_started: &mut Instant, lost: u64) {
    let mut finished = std::mem::replace(profile, Profile::new(profile.frequency_hz));
    finished.duration_ns = period_started.elapsed().as_nanos() as i64;
    *period_started = Instant::now();
    profile.start_unix_ns = unix_now_ns();
    // A period that cannot be written is lost, but the next ones may still be: keep recording.
    match sink.write(&finished) {
        Ok(name) => {
            let processes: std::collections::HashSet<u32> = finished.counts.keys().map(|k| k.pid).collect();
            report!("wrote {} samples of {} processes to {name} ({lost} lost)", finished.total_samples(), processes.len());
        }
        Err(err) => report!("cannot write the profile: {err}"),
    }
}

fn unix_now_ns() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i64)
}

async fn record(args: &RecordArgs, watched: &Watched, sink: &ProfileSink) -> Result<(Profile, Stats)> {
    // Installed before the command starts, so a signal never finds pyebpf without its handlers,
    // and the command starts with these signals at their defaults (exec resets handled signals).
    let mut interrupt = signal(SignalKind::interrupt()).context("install the SIGINT handler")?;
    let mut terminate = signal(SignalKind::terminate()).context("install the SIGTERM handler")?;
    // A closed terminal or session (SIGHUP) ends the recording like Ctrl-C: the profile is written.
    let mut hangup = signal(SignalKind::hangup()).context("install the SIGHUP handler")?;
    let options = SamplingOptions { marker: !args.no_cache, read_only: args.read_only, max_frames: args.max_python_frames };
    let filter = SampleFilter { comm: args.comm.clone(), python_only: args.python_only };
    let mut resolver = SampleResolver::new(options, args.no_native, filter, args.unwind);
    let mut stats = Stats::default();
    resolver.attach_all(if args.all { process::all_pids() } else { args.pid.clone() }, &mut stats);
    let targets = if args.all { None } else { Some(args.pid.clone()) };
    let mut sampler = Sampler::start(&SamplerOptions {
        frequency_hz: args.frequency,
        kernel_stacks: args.kernel,
        targets,
        follow_forks: !args.command.is_empty() || args.subprocesses,
        ring_buffer_kb: args.ring_buffer_kb,
        program_stats: args.stats,
        snapshot_all: args.unwind == UnwindMode::Dwarf,
    })?;
    resolver.register_all(&mut sampler);
    sampler.start_sampling()?;
    let mut command = if args.command.is_empty() {
        None
    } else {
        // pyebpf itself is a target for the fork hook (its own samples are still dropped), so the
        // command is one from its fork on and cannot start children before it is registered.
        sampler.add_target(std::process::id())?;
        Some(Launched::start(&args.command, output::is_stdout(&args.output))?)
    };
    let mut profile = Profile::new(args.frequency);
    profile.group_by_container = args.group_by == GroupBy::Container;
    let mut started = Instant::now();
    profile.start_unix_ns = unix_now_ns();
    let deadline = args.duration.map(|duration| tokio::time::Instant::now() + duration);
    let mut rotation = args.rotate.map(|secs| {
        let period = Duration::from_secs(secs);
        tokio::time::interval_at(tokio::time::Instant::now() + period, period)
    });
    let mut tick = tokio::time::interval(TICK);
    let mut batch = Vec::new();
    let mut lost_reported = 0;
    let progress = Progress::start();
    loop {
        tokio::select! {
            read = sampler.read_samples(&mut batch) => {
                read?;
                add_samples(&mut batch, &mut resolver, &mut sampler, &mut profile, &mut stats);
            }
            _ = interrupt.recv() => if !pass_to_command(&mut command, libc::SIGINT) { break },
            _ = terminate.recv() => if !pass_to_command(&mut command, libc::SIGTERM) { break },
            _ = hangup.recv() => break,
            _ = next_period(&mut rotation) => rotate(sink, &mut profile, &mut started, sampler.lost_samples()),
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
    // What the kernel sent before the stop is still in the ring buffer.
    if tokio::time::timeout(Duration::from_millis(20), sampler.read_samples(&mut batch)).await.is_ok() {
        add_samples(&mut batch, &mut resolver, &mut sampler, &mut profile, &mut stats);
    }
    progress.finish();
    resolver.finish(&mut stats);
    stats.lost_samples = sampler.lost_samples();
    (stats.program_run_time_ns, stats.program_runs) =
        sampler.program_run_time().map_or((0, 0), |(time, runs)| (time.as_nanos() as u64, runs));
    stats.own_cpu_ns = own_cpu_ns();
    profile.duration_ns = started.elapsed().as_nanos() as i64;
    Ok((profile, stats))
}

fn add_samples(batch: &mut Vec<Record>, resolver: &mut SampleResolver, sampler: &mut Sampler, profile: &mut Profile, stats: &mut Stats) {
    if let Some(delay) = test_consumer_delay() {
        std::thread::sleep(delay);
    }
    for record in batch.drain(..) {
        match record {
            Record::Sample(record) => {
                stats.samples += 1;
                if let Some(key) = resolver.resolve(&record, sampler, stats) {
                    profile.add(key, 1);
                }
            }
            Record::Event(event) => resolver.process_event(&event, sampler),
        }
    }
}

/// `PYEBPF_TEST_CONSUMER_DELAY_MS`: stalls the consumer before each batch, so tests can show that
/// stacks stay true when userspace falls behind the sampled threads.
fn test_consumer_delay() -> Option<Duration> {
    static DELAY: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| std::env::var("PYEBPF_TEST_CONSUMER_DELAY_MS").ok()?.parse().ok().map(Duration::from_millis))
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
