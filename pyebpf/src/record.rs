//! `pyebpf record`: sample until the duration ends, a signal arrives, the command or every given
//! process exits (a launched command gets the first signal and is waited for), resolve every
//! sample to a stack while its process is alive, then write the profile (with `--rotate`, also at
//! the end of every period, starting a new profile each time).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

use crate::bpf::{check_privileges, Sampler, SamplerOptions, UnwindMode};
use crate::cli::{GroupBy, RecordArgs};
use crate::mode::Mode;
use crate::output::{self, Files, OutputError, ProfileSink, Rendering};
use crate::process::{self, Launched, Watched};
use crate::progress::Progress;
use crate::python::SamplingOptions;
use crate::reader::RecordBatch;
use crate::report;
use crate::session::{add_samples, Session, SessionOptions, TICK};
use crate::stack::{FrameCarry, Profile};
use crate::stats::Stats;
use crate::stop_signals::StopSignals;
use crate::summary::{RunTotals, Summary};

pub fn run(args: RecordArgs) -> Result<()> {
    let output_name = output::display_name(&args.output);
    let rendering = Rendering { threads: args.threads, title: command_line() };
    let sink =
        Arc::new(ProfileSink::new(&args.output, args.format, files(&args), rendering, args.function).with_context(|| format!("cannot write {output_name}"))?);
    check_privileges()?;
    let watched = Watched::open(&args.pid)?;
    process::raise_open_file_limit();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().context("start the async runtime")?;
    let ((profile, stats), periods) = runtime.block_on(record(&args, &watched, &sink))?;
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
/// the recording's profile, with only the frames the session's caches still use.
fn rotate(writer: &PeriodWriter, run: &mut Recording) {
    let next = run.profile.next_period();
    let mut finished = std::mem::replace(&mut run.profile, next);
    run.session.carry_frames(&mut FrameCarry::new(&finished.frames, &mut run.profile.frames));
    finished.duration_ns = run.started.elapsed().as_nanos() as i64;
    run.started = Instant::now();
    run.profile.start_unix_ns = unix_now_ns();
    writer.write(finished, run.sampler.lost_samples());
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

/// The session `record` runs, as its options ask.
fn session(args: &RecordArgs) -> Session {
    let sampling =
        SamplingOptions { marker: !args.no_cache, read_only: args.read_only, max_frames: args.max_python_frames, async_aware: args.mode.async_aware };
    Session::new(SessionOptions {
        sampling,
        no_native: args.no_native,
        filter: args.filter.sample_filter(),
        unwind: args.unwind,
        mode: args.mode.mode,
        kernel: args.kernel,
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
        ring_buffer_kb: args.ring_buffer_kb,
        program_stats: args.stats,
        snapshot_all: args.unwind == UnwindMode::Dwarf,
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
    Ok(Some(Launched::start(&args.command, output::is_stdout(&args.output))?))
}

/// The `--rotate` periods' clock.
fn rotation(args: &RecordArgs) -> Option<tokio::time::Interval> {
    args.rotate.map(|secs| {
        let period = Duration::from_secs(secs);
        let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        // A period that ends late (a busy host) does not make the next ones short to catch up:
        // every period lasts at least SECONDS, so no two start in the same second.
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        interval
    })
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

/// Records until the end of the run; returns its last (or only) profile, and with `--rotate` what
/// the periods written before it add up to.
async fn record(args: &RecordArgs, watched: &Watched, sink: &Arc<ProfileSink>) -> Result<((Profile, Stats), Option<WrittenPeriods>)> {
    // Stop signals that came while pyebpf loaded are read here too (see `stop_signals`).
    let mut stops = StopSignals::new().context("read stop signals")?;
    let mut session = session(args);
    let mut stats = Stats::default();
    stats.tasks.enabled = args.mode.async_aware;
    let mut sampler = session.start_sampler(&sampler_options(args), &mut stats)?;
    let mut command = launch(args, &mut sampler)?;
    session.start_recording();
    let mut profile = Profile::new(args.frequency);
    profile.mode = args.mode.mode;
    profile.group_by_container = args.group_by == GroupBy::Container;
    profile.start_unix_ns = unix_now_ns();
    let mut run = Recording { session, sampler, profile, stats, started: Instant::now() };
    let deadline = args.duration.map(|duration| tokio::time::Instant::now() + duration);
    let writer = args.rotate.map(|_| PeriodWriter::start(Arc::clone(sink))).transpose()?;
    let mut rotation = rotation(args);
    let mut tick = tokio::time::interval(TICK);
    let mut batch = RecordBatch::default();
    let mut lost_reported = 0;
    let progress = Progress::start();
    loop {
        tokio::select! {
            read = run.sampler.read_samples(&mut batch) => {
                read?;
                add_samples(&mut batch, &mut run.session, &mut run.sampler, &mut run.profile, &mut run.stats);
            }
            signal = stops.next() => if !pass_to_command(&mut command, signal) { break },
            _ = next_period(&mut rotation) => if let Some(writer) = &writer {
                rotate(writer, &mut run);
            },
            _ = sleep_until(deadline) => break,
            _ = tick.tick() => {
                lost_reported = report_lost(&run.sampler, lost_reported, &progress);
                progress.update(&run.stats, lost_reported);
                run.session.upkeep(&mut run.sampler);
                if command.as_mut().is_some_and(Launched::exited) || watched.all_exited() {
                    break;
                }
            }
        }
    }
    // What the kernel sent before the stop is still in the ring buffer or the reader's queue.
    if tokio::time::timeout(Duration::from_millis(20), run.sampler.read_samples(&mut batch)).await.is_ok() {
        add_samples(&mut batch, &mut run.session, &mut run.sampler, &mut run.profile, &mut run.stats);
    }
    run.session.count_open_waits(&mut run.sampler, &mut run.stats, &mut run.profile);
    progress.finish();
    let periods = writer.map(PeriodWriter::finish);
    Ok((run.finish(args.mode.mode), periods))
}

impl Recording {
    /// The last profile and the run's counts.
    fn finish(mut self, mode: Mode) -> (Profile, Stats) {
        let (sampler, stats) = (&self.sampler, &mut self.stats);
        self.session.finish(stats);
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
        self.profile.duration_ns = self.started.elapsed().as_nanos() as i64;
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
