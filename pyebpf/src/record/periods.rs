//! Where a recording's periods go. Two clocks may cut the recording's profile: `--rotate` (a
//! file per period) and `--otlp-period` (a request per period). At each tick of either, the
//! sampling loop hands the piece sampled since the last cut over and starts a new one; the
//! exporter gets every piece and a period end at its own ticks, the files get the pieces merged
//! into their own periods (the whole run without `--rotate`), so neither waits for the other and
//! both see every sample once.

use std::sync::Arc;

use anyhow::{Context, Result};

use crate::otlp::Exporter;
use crate::output::{OutputError, ProfileSink};
use crate::report;
use crate::stack::Profile;
use crate::summary::RunTotals;

/// Which clock ticked.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Boundary {
    /// A `--rotate` period ends.
    File,
    /// An `--otlp-period` ends.
    Export,
}

/// The recording's consumers of periods and their clocks.
pub(super) struct Periods {
    /// The clocks' periods in seconds, until they start.
    seconds: (Option<u64>, Option<u64>),
    rotation: Option<tokio::time::Interval>,
    export: Option<tokio::time::Interval>,
    /// `--rotate`: writes each file period on a thread of its own.
    writer: Option<PeriodWriter>,
    exporter: Option<Exporter>,
    /// Whether files are written at all (with `--otlp`, only with -o).
    files: bool,
    /// The file period being made of pieces (None: no piece yet).
    file_period: Option<Profile>,
    /// Without files, the run's totals for the summary, piece by piece.
    totals: Option<RunTotals>,
}

/// What the periods came to when the recording ended.
pub(super) struct Ended {
    /// The last file period (the whole run without `--rotate`), to be written by the caller.
    pub file: Option<Profile>,
    /// Without files, what the run adds up to.
    pub totals: Option<RunTotals>,
    /// `--rotate`: the periods written before the last.
    pub written: Option<WrittenPeriods>,
    pub exporter: Option<Exporter>,
}

impl Periods {
    pub fn new(rotate_s: Option<u64>, sink: Option<&Arc<ProfileSink>>, exporter: Option<(Exporter, u64)>) -> Result<Periods> {
        let writer = match (rotate_s, sink) {
            (Some(_), Some(sink)) => Some(PeriodWriter::start(Arc::clone(sink))?),
            _ => None,
        };
        Ok(Periods {
            seconds: (rotate_s.filter(|_| writer.is_some()), exporter.as_ref().map(|&(_, period_s)| period_s)),
            rotation: None,
            export: None,
            writer,
            exporter: exporter.map(|(exporter, _)| exporter),
            files: sink.is_some(),
            file_period: None,
            totals: sink.is_none().then(RunTotals::default),
        })
    }

    /// Starts the clocks (in the recording's runtime), when sampling begins.
    pub fn start_clocks(&mut self) {
        self.rotation = self.seconds.0.map(clock);
        self.export = self.seconds.1.map(clock);
    }

    /// The next tick of either clock (never, without both).
    pub async fn next(&mut self) -> Boundary {
        tokio::select! {
            _ = tick(&mut self.rotation) => Boundary::File,
            _ = tick(&mut self.export) => Boundary::Export,
        }
    }

    /// Hands over a piece cut at `boundary` (or at the end): to the exporter, which ends its
    /// period at its own boundary, and into the file period, written at a file boundary.
    pub fn hand_over(&mut self, piece: Profile, boundary: Option<Boundary>, lost: u64) {
        let piece = Arc::new(piece);
        if let Some(exporter) = &self.exporter {
            exporter.add(Arc::clone(&piece));
            if boundary != Some(Boundary::File) {
                exporter.end_period();
            }
        }
        if let Some(totals) = &mut self.totals {
            totals.add(&piece);
        }
        if self.files {
            self.file_period = Some(match self.file_period.take() {
                // Without an exporter the piece is the whole file period: moved, not copied.
                None => Arc::try_unwrap(piece).unwrap_or_else(|shared| merged(None, &shared)),
                Some(period) => merged(Some(period), &piece),
            });
        }
        if boundary == Some(Boundary::File) {
            if let (Some(writer), Some(period)) = (&self.writer, self.file_period.take()) {
                writer.write(period, lost);
            }
        }
    }

    /// Whether the periods are exported.
    pub fn exports(&self) -> bool {
        self.exporter.is_some()
    }

    /// What the exporter has to say, for the status line's owner to print.
    pub fn exporter_lines(&self) -> Vec<String> {
        self.exporter.as_ref().map(Exporter::take_lines).unwrap_or_default()
    }

    /// The end of the recording, after its last piece was handed over.
    pub fn finish(mut self) -> Ended {
        if let Some(exporter) = &self.exporter {
            // From now on the exporter has --otlp-flush-timeout to deliver, while -o is written.
            exporter.close();
        }
        Ended { file: self.file_period.take(), totals: self.totals, written: self.writer.map(PeriodWriter::finish), exporter: self.exporter }
    }
}

/// `piece` added to `period` (a new one, if None).
fn merged(period: Option<Profile>, piece: &Profile) -> Profile {
    let mut period = period.unwrap_or_else(|| piece.next_period());
    period.absorb(piece);
    period
}

/// A clock ticking every `seconds`, first after one period.
fn clock(seconds: u64) -> tokio::time::Interval {
    let period = std::time::Duration::from_secs(seconds);
    let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    // A period that ends late (a busy host) does not make the next ones short to catch up:
    // every period lasts at least SECONDS, so no two start in the same second.
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval
}

async fn tick(clock: &mut Option<tokio::time::Interval>) {
    match clock {
        Some(interval) => {
            interval.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// Writes a profile, then with `--keep` removes the oldest period files past it (a file that
/// cannot be removed is said, and the recording goes on).
pub(super) fn write_and_retain(sink: &ProfileSink, profile: &Profile) -> Result<String, OutputError> {
    let name = sink.write(profile)?;
    if let Err(err) = sink.remove_oldest() {
        report!("cannot remove an old profile: {err}");
    }
    Ok(name)
}

/// The line of one `--rotate` period written to `name`, with the samples lost in the run so far.
pub(super) fn report_period(profile: &Profile, name: &str, lost: u64) {
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
pub(super) struct WrittenPeriods {
    pub totals: RunTotals,
    pub first: Option<String>,
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
