//! `pyebpf record`: sample until the duration ends, a signal arrives or the command exits, resolve
//! every sample to a stack while its process is alive, then write the profile.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use pyebpf_common::SampleRecord;
use tokio::signal::unix::{signal, SignalKind};

use crate::bpf::{check_privileges, Sampler, SamplerOptions};
use crate::cli::RecordArgs;
use crate::filter::SampleFilter;
use crate::merge::{self, NativeStack};
use crate::python_sampling::{PythonSampling, SamplingOptions};
use crate::output;
use crate::process::{self, ProcessNames};
use crate::progress::Progress;
use crate::stack::{Frame, Profile, StackKey};
use crate::stats::Stats;
use crate::summary::Summary;
use crate::symbolize::Symbolizer;

/// How often lost samples are checked and periodic upkeep runs.
const TICK: Duration = Duration::from_millis(250);

/// Turns raw samples into stacks.
pub struct SampleResolver {
    symbolizer: Symbolizer,
    names: ProcessNames,
    python: PythonSampling,
    no_native: bool,
    filter: SampleFilter,
}

impl SampleResolver {
    pub fn new(options: SamplingOptions, no_native: bool, filter: SampleFilter) -> Self {
        SampleResolver {
            symbolizer: Symbolizer::new(),
            names: ProcessNames::default(),
            python: PythonSampling::new(options),
            no_native,
            filter,
        }
    }

    /// The sample's stack, or None when the filter drops it (checked before any remote read).
    pub fn resolve(&mut self, record: &SampleRecord, sampler: &mut Sampler, stats: &mut Stats) -> Option<StackKey> {
        let comm = self.names.name(record.tgid, &record.comm);
        if !self.filter.keeps_process(&comm) {
            return None;
        }
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
                let user_len = (record.user_len as usize).min(record.user_stack.len());
                let bases_len = (record.frame_bases_len as usize).min(record.user_frame_bases.len());
                let native = NativeStack {
                    levels: self.symbolizer.user_levels(record.tgid, &record.user_stack[..user_len]),
                    frame_bases: record.user_frame_bases[..bases_len].to_vec(),
                    sp: record.user_sp,
                };
                match python {
                    Some(python) => frames.extend(merge::merge_stacks(&native, &python.items)),
                    None => frames.extend(native.trusted_frames()),
                }
            }
        }
        Some(StackKey { pid: record.tgid, tid: record.tid, comm, frames, truncated })
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
    }

    pub fn finish(&self, stats: &mut Stats) {
        stats.code_cache = self.python.code_cache_counters();
    }
}

pub fn run(args: RecordArgs) -> Result<()> {
    let format = output::resolve_format(&args.output, args.format)?;
    let output_name = output::display_name(&args.output);
    output::check_writable(&args.output, format).with_context(|| format!("cannot write {output_name}"))?;
    check_privileges()?;
    process::check_pids(&args.pid)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().context("start the async runtime")?;
    let (mut profile, stats) = runtime.block_on(record(&args))?;
    if args.function {
        profile = profile.by_function();
    }
    let rendering = output::Rendering { threads: args.threads, title: command_line() };
    output::write_profile(&profile, &args.output, format, &rendering).with_context(|| format!("cannot write {output_name}"))?;
    let open = output::open_command(&args.output, format);
    eprintln!("{}", Summary::new(&profile, &stats, output_name.into_owned(), open));
    if args.stats {
        eprintln!("{stats}");
    }
    Ok(())
}

async fn record(args: &RecordArgs) -> Result<(Profile, Stats)> {
    let options = SamplingOptions { marker: !args.no_cache, read_only: args.read_only, max_frames: args.max_python_frames };
    let filter = SampleFilter { comm: args.comm.clone(), python_only: args.python_only };
    let mut resolver = SampleResolver::new(options, args.no_native, filter);
    let mut stats = Stats::default();
    resolver.attach_all(if args.all { process::all_pids() } else { args.pid.clone() }, &mut stats);
    let targets = if args.all { None } else { Some(args.pid.clone()) };
    let mut sampler = Sampler::start(&SamplerOptions {
        frequency_hz: args.frequency,
        kernel_stacks: args.kernel,
        targets,
        follow_forks: !args.command.is_empty(),
        ring_buffer_kb: args.ring_buffer_kb,
        program_stats: args.stats,
    })?;
    let mut child = if args.command.is_empty() {
        None
    } else {
        let child = process::launch(&args.command, output::is_stdout(&args.output))?;
        sampler.add_target(child.id())?;
        Some(child)
    };

    resolver.register_all(&mut sampler);
    let mut profile = Profile::new(args.frequency);
    let started = Instant::now();
    profile.start_unix_ns = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i64);
    let deadline = args.duration.map(|secs| tokio::time::Instant::now() + Duration::from_secs_f64(secs.max(0.0)));
    let mut interrupt = signal(SignalKind::interrupt()).context("install the SIGINT handler")?;
    let mut terminate = signal(SignalKind::terminate()).context("install the SIGTERM handler")?;
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
            _ = interrupt.recv() => break,
            _ = terminate.recv() => break,
            _ = sleep_until(deadline) => break,
            _ = tick.tick() => {
                lost_reported = report_lost(&sampler, lost_reported, &progress);
                progress.update(&stats, lost_reported);
                resolver.upkeep(&mut sampler);
                if child_exited(&mut child) {
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

fn add_samples(batch: &mut Vec<Box<SampleRecord>>, resolver: &mut SampleResolver, sampler: &mut Sampler, profile: &mut Profile, stats: &mut Stats) {
    if let Some(delay) = test_consumer_delay() {
        std::thread::sleep(delay);
    }
    for record in batch.drain(..) {
        stats.samples += 1;
        if let Some(key) = resolver.resolve(&record, sampler, stats) {
            profile.add(key, 1);
        }
    }
}

/// `PYEBPF_TEST_CONSUMER_DELAY_MS`: stalls the consumer before each batch, so tests can show that
/// stacks stay true when userspace falls behind the sampled threads.
fn test_consumer_delay() -> Option<Duration> {
    static DELAY: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| std::env::var("PYEBPF_TEST_CONSUMER_DELAY_MS").ok()?.parse().ok().map(Duration::from_millis))
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

fn child_exited(child: &mut Option<std::process::Child>) -> bool {
    child.as_mut().is_some_and(|c| !matches!(c.try_wait(), Ok(None)))
}

/// pyebpf's command line, the title of what it wrote.
fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}
