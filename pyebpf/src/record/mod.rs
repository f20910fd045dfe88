//! `pyebpf record`: sample until the duration ends, a signal arrives, the command or every given
//! process exits (a launched command gets the first signal and is waited for), resolve every
//! sample to a stack while its process is alive, then write the profile (with `--rotate`, also at
//! the end of every period, starting a new profile each time; with `--otlp`, also sends each
//! export period to a collector: see [`periods`]).

mod periods;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};

use crate::bpf::{check_privileges, default_ring_buffer_kb, Sampler, SamplerOptions};
use crate::cli::{GroupBy, RecordArgs};
use crate::mode::Mode;
use crate::otlp::{self, Exporter, Headers, OtlpOptions, TlsFiles};
use crate::output::{self, Files, ProfileSink, Rendering};
use crate::process::{self, Launched, Watched};
use crate::progress::Progress;
use crate::python::SamplingOptions;
use crate::reader::RecordBatch;
use crate::report;
use crate::session::{add_samples, DetailsWanted, Session, SessionOptions};
use crate::stack::{FrameCarry, Profile, Timeline, MAX_EVENTS};
use crate::stats::Stats;
use crate::stop_signals::StopSignals;
use crate::summary::{RunTotals, Summary};
use crate::wake_timer::WakeTimer;
use periods::{report_period, write_and_retain, Boundary, Ended, Periods, WrittenPeriods};

/// An export period that ends this close to `--duration`'s end is ended by it (the timers of
/// both fire in the same instant, in either order).
const END_SLACK: Duration = Duration::from_millis(100);

/// How often the status line is redrawn, when standard error is a terminal.
const STATUS_EVERY: Duration = Duration::from_millis(250);

/// `-o` unless given (and without --otlp).
const DEFAULT_OUTPUT: &str = "profile.pb.gz";

pub fn run(args: RecordArgs) -> Result<()> {
    let endpoint = otlp::endpoint(args.otlp.endpoint.as_deref())?;
    let output = output_path(&args, endpoint.is_some())?;
    let rendering = Rendering { threads: args.threads, title: command_line() };
    let sink = output
        .as_deref()
        .map(|path| {
            let sink = ProfileSink::new(path, args.format, files(&args), rendering, args.function);
            sink.map(Arc::new).with_context(|| format!("cannot write {}", output::display_name(path)))
        })
        .transpose()?;
    check_privileges()?;
    let exporter = endpoint.map(|endpoint| exporter(&args, endpoint)).transpose()?;
    let watched = Watched::open(&args.pid)?;
    process::raise_open_file_limit();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().context("start the async runtime")?;
    let periods = Periods::new(args.rotate, sink.as_ref(), exporter.map(|exporter| (exporter, args.otlp.period)))?;
    let (ended, mut stats) = runtime.block_on(record(&args, &watched, periods))?;
    let mut summary = summary(&args, sink.as_deref(), ended.file, ended.totals, ended.written, &stats)?;
    // Written first: the exporter's flush ran meanwhile, and -o never waits for a collector.
    stats.otlp = ended.exporter.map(Exporter::join);
    summary.otlp = stats.otlp.clone();
    report::report_text(format_args!("{summary}"));
    if args.stats {
        report::report_text(format_args!("{stats}"));
    }
    Ok(())
}

/// `-o`, or profile.pb.gz without it; with --otlp, no file unless -o is given.
fn output_path(args: &RecordArgs, exporting: bool) -> Result<Option<PathBuf>> {
    match (&args.output, exporting) {
        (Some(path), _) => Ok(Some(path.clone())),
        (None, false) => Ok(Some(PathBuf::from(DEFAULT_OUTPUT))),
        (None, true) if args.rotate.is_some() => bail!("--rotate with --otlp needs -o: the files' names are made from it"),
        (None, true) => Ok(None),
    }
}

/// The exporter `--otlp` (or PYEBPF_OTLP_ENDPOINT) asks for, started.
fn exporter(args: &RecordArgs, endpoint: otlp::Endpoint) -> Result<Exporter> {
    let otlp = &args.otlp;
    let options = OtlpOptions {
        endpoint,
        period: Duration::from_secs(otlp.period),
        tls: TlsFiles { ca: otlp.ca.clone(), cert: otlp.cert.clone(), key: otlp.key.clone() },
        headers: Headers::load(otlp.headers_file.as_deref())?,
        queue_bytes: usize::try_from(otlp.queue_mb << 20).unwrap_or(usize::MAX),
        flush_timeout: Duration::from_secs(otlp.flush_timeout),
        service_name: otlp.service_name.clone(),
        host_name: otlp::host_name(),
    };
    Ok(Exporter::start(options)?)
}

/// Writes the last file period (the whole run without `--rotate`) and sums up the run.
fn summary(
    args: &RecordArgs,
    sink: Option<&ProfileSink>,
    file: Option<Profile>,
    totals: Option<RunTotals>,
    written: Option<WrittenPeriods>,
    stats: &Stats,
) -> Result<Summary> {
    let (Some(sink), Some(profile)) = (sink, file) else {
        // No files: the run is what the exporter was given.
        let endpoint = otlp::endpoint(args.otlp.endpoint.as_deref()).ok().flatten().map_or_else(String::new, |endpoint| endpoint.to_string());
        return Ok(Summary::new(totals.unwrap_or_default(), stats, endpoint, None));
    };
    let output = write_and_retain(sink, &profile).context("cannot write the profile")?;
    Ok(match written {
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
            Summary::new(totals, stats, files, None)
        }
        None => Summary::new(RunTotals::of(&profile), stats, output, sink.open_command()),
    })
}

/// One profile at `-o`, or a file per `--rotate` period.
fn files(args: &RecordArgs) -> Files {
    match args.rotate {
        Some(_) => Files::Rotated { keep: args.keep.map(|keep| keep as usize) },
        None => Files::Single,
    }
}

/// Ends the current piece of the recording (a `--rotate` or `--otlp-period` boundary, at `at` and
/// `at_unix_ns`: before the ring buffer was drained into it) and returns it; the next starts in the
/// recording's profile, with only the frames the session's caches still use.
fn cut(run: &mut Recording, at: Instant, at_unix_ns: i64) -> Profile {
    let next = run.profile.next_period();
    let mut finished = std::mem::replace(&mut run.profile, next);
    run.session.carry_frames(&mut FrameCarry::new(&finished.frames, &mut run.profile.frames));
    finished.duration_ns = at.duration_since(run.started).as_nanos() as i64;
    run.started = at;
    run.profile.start_unix_ns = at_unix_ns;
    finished
}

fn unix_now_ns() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i64)
}

/// The session `record` runs, as its options ask.
fn session(args: &RecordArgs) -> Session {
    let sampling =
        SamplingOptions { marker: !args.no_cache, read_only: args.read_only, max_frames: args.max_python_frames, async_aware: args.mode.async_aware };
    Session::new(SessionOptions {
        sampling,
        no_native: args.no_native,
        native_lines: args.native_lines,
        filter: args.filter.sample_filter(),
        unwind: args.unwind,
        mode: args.mode.mode,
        kernel: args.kernel,
        details: otlp::endpoint(args.otlp.endpoint.as_deref())
            .ok()
            .flatten()
            .map(|_| DetailsWanted { env_var: args.otlp.service_name.env_var().map(str::to_string) }),
        timed: args.stats,
    })
}

/// What the sampler loads and samples, as `record`'s options ask.
fn sampler_options(args: &RecordArgs) -> SamplerOptions {
    let mode = args.mode.mode;
    SamplerOptions {
        frequency_hz: args.frequency,
        kernel_stacks: args.kernel,
        targets: if args.all { None } else { Some(args.pid.clone()) },
        follow_forks: !args.command.is_empty() || args.subprocesses,
        ring_buffer_kb: args.ring_buffer_kb.unwrap_or_else(|| default_ring_buffer_kb(args.frequency)),
        program_stats: args.stats,
        unwind: args.unwind,
        gil: mode == Mode::Gil,
        tasks: args.mode.async_aware,
        waiting_tasks: mode.counts_waits() && args.mode.async_aware,
        off_cpu_min: mode.counts_waits().then(|| Duration::from_micros(args.mode.off_cpu_min_us)),
    }
}

/// The command to profile, started once the sampler follows pyebpf's forks.
fn launch(args: &RecordArgs, sampler: &mut Sampler) -> Result<Option<Launched>> {
    if args.command.is_empty() {
        return Ok(None);
    }
    // pyebpf itself is a target for the fork hook (its own samples are still dropped), so the
    // command is one from its fork on and cannot start children before it is registered.
    sampler.add_target(std::process::id())?;
    Ok(Some(Launched::start(&args.command, args.output.as_deref().is_some_and(output::is_stdout))?))
}

/// A recording under way: the session, the sampler feeding it, and the profile it fills.
struct Recording {
    session: Session,
    sampler: Sampler,
    profile: Profile,
    stats: Stats,
    /// When the current period (the whole recording, without `--rotate`) started.
    started: Instant,
}

/// Records until the end of the run, handing each piece cut at a period's end (and the last) to
/// `periods`; returns what they came to, and the run's counts.
async fn record(args: &RecordArgs, watched: &Watched, mut periods: Periods) -> Result<(Ended, Stats)> {
    // Stop signals that came while pyebpf loaded are read here too (see `stop_signals`).
    let mut stops = StopSignals::new().context("read stop signals")?;
    let mut session = session(args);
    let mut stats = Stats::default();
    stats.tasks.enabled = args.mode.async_aware;
    let mut sampler = session.start_sampler(&sampler_options(args), &mut stats)?;
    // For whoever measures steady state (the always-on bench): start-up ends here.
    log::info!("sampling at {} Hz", args.frequency);
    let mut command = launch(args, &mut sampler)?;
    session.start_recording();
    let profile = first_profile(args, &periods);
    let mut run = Recording { session, sampler, profile, stats, started: Instant::now() };
    let deadline = args.duration.map(|duration| tokio::time::Instant::now() + duration);
    periods.start_clocks();
    let mut batch = RecordBatch::default();
    let mut lost_reported = 0;
    let progress = Progress::start();
    let mut status = progress.shown().then(|| tokio::time::interval(STATUS_EVERY));
    let mut upkeep = WakeTimer::after(run.session.upkeep_interval()).context("create the upkeep timer")?;
    let exits = process::exits(command.as_ref().map(Launched::pidfd).transpose()?, watched.pidfds().context("watch the processes")?);
    tokio::pin!(exits);
    loop {
        tokio::select! {
            read = run.sampler.read_samples(&mut batch) => {
                read?;
                run.add(&mut batch);
                // Awake anyway: an upkeep nearly due is done now, not on a wakeup of its own.
                if upkeep.left() < run.session.upkeep_interval() / 4 {
                    lost_reported = run.upkeep(&mut upkeep, &periods, &progress, lost_reported)?;
                }
            }
            signal = stops.next() => if !pass_to_command(&mut command, signal) { break },
            boundary = periods.next() => {
                if boundary == Boundary::Export && deadline.is_some_and(|deadline| deadline <= tokio::time::Instant::now() + END_SLACK) {
                    // The recording ends now: its end sends this period, not a near-empty one after.
                    break;
                }
                let piece = run.cut_now(&mut batch).await?;
                if let (Boundary::Export, Some(timeline)) = (boundary, &mut run.profile.timeline) {
                    timeline.restart_bound();
                }
                periods.hand_over(piece, Some(boundary), run.sampler.lost_samples());
            }
            _ = sleep_until(deadline) => break,
            exited = &mut exits => {
                exited.context("watch the processes")?;
                break;
            }
            _ = upkeep.fired() => lost_reported = run.upkeep(&mut upkeep, &periods, &progress, lost_reported)?,
            _ = tick(&mut status) => progress.update(&run.stats, lost_reported),
        }
    }
    let ended = Instant::now();
    // What the kernel sent before the stop is still in the ring buffer or the reader's queue; a
    // reader that stopped has handed over what it could, and the profile is written all the same.
    if let Err(err) = run.sampler.drain_samples(&mut batch).await {
        crate::report!("the last samples were not all read: {err}");
    }
    run.add(&mut batch);
    run.session.count_open_waits(&mut run.sampler, &mut run.stats, &mut run.profile);
    progress.finish();
    let (last, stats) = run.finish(args.mode.mode, ended);
    periods.hand_over(last, None, stats.lost_samples);
    Ok((periods.finish(), stats))
}

/// The profile the recording starts with.
fn first_profile(args: &RecordArgs, periods: &Periods) -> Profile {
    let mut profile = Profile::new(args.frequency);
    profile.mode = args.mode.mode;
    profile.group_by_container = args.group_by == GroupBy::Container;
    profile.start_unix_ns = unix_now_ns();
    profile.timeline = periods.exports().then(|| Box::new(Timeline::new(MAX_EVENTS)));
    profile
}

impl Recording {
    fn add(&mut self, batch: &mut RecordBatch) {
        add_samples(batch, &mut self.session, &mut self.sampler, &mut self.profile, &mut self.stats);
    }

    /// Ends the current piece now, with what was sampled up to now (drained into it).
    async fn cut_now(&mut self, batch: &mut RecordBatch) -> Result<Profile> {
        let (at, at_unix_ns) = (Instant::now(), unix_now_ns());
        self.sampler.drain_samples(batch).await?;
        self.add(batch);
        Ok(cut(self, at, at_unix_ns))
    }

    /// The slow upkeep: lost samples and the exporter's complaints said, the session's safety
    /// checks; then `timer` set for the next. Returns the lost samples reported so far.
    fn upkeep(&mut self, timer: &mut WakeTimer, periods: &Periods, progress: &Progress, lost_reported: u64) -> Result<u64> {
        let lost_reported = report_lost(&self.sampler, lost_reported, progress);
        for line in periods.exporter_lines() {
            progress.warn(&format!("pyebpf: {line}"));
        }
        let lost_events = self.sampler.lost_events();
        self.session.upkeep(&mut self.sampler, lost_events);
        timer.set(self.session.upkeep_interval()).context("set the upkeep timer")?;
        Ok(lost_reported)
    }

    /// The last profile, ended at `ended`, and the run's counts.
    fn finish(mut self, mode: Mode, ended: Instant) -> (Profile, Stats) {
        let (sampler, stats) = (&self.sampler, &mut self.stats);
        self.session.finish(stats);
        stats.lost_samples = sampler.lost_samples();
        (stats.reader_dropped_batches, stats.reader_dropped_samples) = sampler.reader_drops();
        let in_ns = |run_time: Option<(Duration, u64)>| run_time.map_or((0, 0), |(time, runs)| (time.as_nanos() as u64, runs));
        (stats.program_run_time_ns, stats.program_runs) = in_ns(sampler.sampler_run_time());
        stats.sampling_clock = sampler.clock();
        if mode.counts_waits() {
            (stats.switch_run_time_ns, stats.switch_runs) = in_ns(sampler.program_run_time(sampler.programs().switch));
        }
        stats.own_cpu_ns = own_cpu_ns();
        let (short_intervals, short_ns) = sampler.short_waits();
        stats.off_cpu.short_intervals += short_intervals;
        stats.off_cpu.short_ns += short_ns;
        self.profile.duration_ns = ended.duration_since(self.started).as_nanos() as i64;
        (self.profile, self.stats)
    }
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

/// The next tick of `interval`; never without one.
async fn tick(interval: &mut Option<tokio::time::Interval>) {
    match interval {
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
