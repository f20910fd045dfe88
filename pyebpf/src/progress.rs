//! The status line `record` keeps on standard error while it samples, when that is a terminal.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::stats::Stats;

pub struct Progress {
    /// None when standard error is not a terminal: logs and pipes get no status lines.
    bar: Option<ProgressBar>,
    started: Instant,
}

impl Progress {
    pub fn start() -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            bar.set_style(ProgressStyle::with_template("{spinner} {msg}").expect("a valid template"));
            bar
        });
        Progress { bar, started: Instant::now() }
    }

    /// Whether a status line is shown (standard error is a terminal).
    pub fn shown(&self) -> bool {
        self.bar.is_some()
    }

    pub fn update(&self, stats: &Stats, lost: u64) {
        if let Some(bar) = &self.bar {
            bar.set_message(status(self.started.elapsed(), stats, lost));
            bar.tick();
        }
    }

    /// Prints `line` on standard error without tearing the status line.
    pub fn warn(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.suspend(|| crate::report::report_text(format_args!("{line}"))),
            None => crate::report::report_text(format_args!("{line}")),
        }
    }

    /// Removes the status line, before the summary is printed.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn status(elapsed: Duration, stats: &Stats, lost: u64) -> String {
    format!(
        "recording {:.1} s: {} samples, {} Python processes, {lost} lost (Ctrl-C stops and writes)",
        elapsed.as_secs_f64(),
        stats.samples,
        stats.python_processes
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names_elapsed_samples_processes_and_lost() {
        let stats = Stats { samples: 1234, python_processes: 3, ..Stats::default() };
        assert_eq!(status(Duration::from_millis(2500), &stats, 7), "recording 2.5 s: 1234 samples, 3 Python processes, 7 lost (Ctrl-C stops and writes)");
    }
}
