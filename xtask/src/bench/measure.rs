//! Running a command with its CPU time and peak memory, and reading figures from its output.

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub struct Measured {
    /// User + system time of the command's process (and of children it waited for).
    pub cpu_s: f64,
    /// CPU time the process's threads ran between the two moments of the steady window, if given.
    pub window_cpu_s: Option<f64>,
    pub wall_s: f64,
    pub max_rss_mb: f64,
    pub stdout: String,
    pub stderr: String,
    pub samples: u64,
    pub collapsed: String,
}

impl Measured {
    /// The workload's own timing: the last line of its output that is a number.
    pub fn workload_seconds(&self) -> Result<f64> {
        // Profilers may print around the workload's own line.
        self.stdout
            .lines()
            .rev()
            .find_map(|l| l.trim().parse().ok())
            .with_context(|| format!("no timing in workload output {:?} (stderr {:?})", self.stdout, self.stderr))
    }
}

/// Runs `command` to completion; fails if it fails. CPU and peak RSS come from `wait4`; with a
/// `window` (from, to) after the start, also the CPU it used between those moments.
pub fn run_measured(command: &mut Command, window: Option<(Duration, Duration)>) -> Result<Measured> {
    let started = Instant::now();
    let mut child = command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().with_context(|| format!("start {command:?}"))?;
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            let _ = pipe.read_to_end(&mut text);
            String::from_utf8_lossy(&text).into_owned()
        })
    };
    let stdout = drain(Box::new(child.stdout.take().expect("piped")));
    let stderr = drain(Box::new(child.stderr.take().expect("piped")));
    let pid = child.id() as libc::pid_t;
    let window_cpu_s = window.and_then(|(from, to)| {
        std::thread::sleep(from.saturating_sub(started.elapsed()));
        let before = threads_cpu_ns(child.id())?;
        std::thread::sleep(to.saturating_sub(started.elapsed()));
        Some(threads_cpu_ns(child.id())?.saturating_sub(before) as f64 / 1e9)
    });
    let mut status = 0;
    // SAFETY: rusage is plain data that wait4 fills; the child is ours and not yet waited for.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: wait4 fills the status and usage it is given.
    if unsafe { libc::wait4(pid, &mut status, 0, &mut usage) } != pid {
        bail!("wait for {command:?}: {}", std::io::Error::last_os_error());
    }
    let wall_s = started.elapsed().as_secs_f64();
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    let measured = Measured {
        cpu_s: seconds(usage.ru_utime) + seconds(usage.ru_stime),
        window_cpu_s,
        wall_s,
        max_rss_mb: usage.ru_maxrss as f64 / 1024.0,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
        samples: 0,
        collapsed: String::new(),
    };
    if !ExitStatus::from_raw(status).success() {
        bail!("{command:?} failed ({}): {}", ExitStatus::from_raw(status), measured.stderr.trim());
    }
    Ok(measured)
}

/// The time all threads of `pid` have run, in ns (schedstat: exact, unlike clock ticks).
pub fn threads_cpu_ns(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let run_ns =
        |task: std::fs::DirEntry| -> Option<u64> { std::fs::read_to_string(task.path().join("schedstat")).ok()?.split_whitespace().next()?.parse().ok() };
    Some(tasks.flatten().filter_map(run_ns).sum())
}

/// Samples in a collapsed-stack file: the sum of each line's trailing count.
pub fn collapsed_samples(path: &Path) -> Result<u64> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    Ok(text.lines().filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<u64>().ok()).sum())
}

pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The line of `--stats` output that starts with `label`.
pub fn stat_line(stats: &str, label: &str) -> Option<String> {
    stats.lines().find(|l| l.trim_start().starts_with(label)).map(str::to_string)
}

/// The number just before `unit` in `line`, e.g. `1.68` in `(1.68 us per recorded sample, ...)`.
pub fn figure_before(line: &str, unit: &str) -> Option<f64> {
    let before = &line[..line.find(unit)?];
    before.split(|c: char| c == '(' || c == ',' || c.is_whitespace()).rev().find(|w| !w.is_empty())?.parse().ok()
}

/// The first number after the label's colon.
pub fn first_number(line: &str) -> Option<f64> {
    line.split_once(':')?.1.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_read_from_stats_lines() {
        let line = "eBPF program time:          5.1 ms (1.68 us per recorded sample, 0.84 us per run)";
        assert_eq!(figure_before(line, "us per recorded sample"), Some(1.68));
        assert_eq!(figure_before("remote reads:  229 (0.08 per python sample)", "per python sample"), Some(0.08));
        assert_eq!(first_number("lost samples:               17"), Some(17.0));
    }
}
