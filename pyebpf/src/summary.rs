//! What `record` prints when it is done: where the time went, without another tool.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use crate::stack::{Frame, Profile};
use crate::stats::Stats;

/// How many Python functions the summary lists.
const TOP: usize = 5;

/// A Python function, whatever line it was on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Function {
    pub qualname: Arc<str>,
    pub filename: Arc<str>,
}

/// A function's samples: as the innermost Python frame (own) and anywhere on the stack (total).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionTime {
    pub function: Function,
    pub own: u64,
    pub total: u64,
}

#[derive(Debug)]
pub struct Summary {
    pub duration_s: f64,
    pub samples: u64,
    pub frequency_hz: u64,
    pub processes: usize,
    pub python_processes: u64,
    /// The hottest Python functions by own samples (those with any), at most [`TOP`].
    pub top: Vec<FunctionTime>,
    pub lost: u64,
    /// Python stacks cut where the chain could not be proven.
    pub truncated: u64,
    /// Samples without a single frame.
    pub unresolved: u64,
    /// Where the profile went, and the command that opens it (none for standard output, devices).
    pub output: String,
    pub open_command: Option<String>,
}

impl Summary {
    pub fn new(profile: &Profile, stats: &Stats, output: String, open_command: Option<String>) -> Self {
        Summary {
            duration_s: profile.duration_ns as f64 / 1e9,
            samples: profile.total_samples(),
            frequency_hz: profile.frequency_hz,
            processes: profile.processes(),
            python_processes: stats.python_processes,
            top: python_functions(profile).into_iter().filter(|time| time.own > 0).take(TOP).collect(),
            lost: stats.lost_samples,
            truncated: stats.truncated_samples,
            unresolved: profile.stacks().filter(|(key, _)| key.frames.is_empty()).map(|(_, count)| count).sum(),
            output,
            open_command,
        }
    }
}

/// Every Python function of the profile with its own and total samples, by own samples, most first.
/// A recursive function counts once per sample in its total.
pub fn python_functions(profile: &Profile) -> Vec<FunctionTime> {
    let mut times: HashMap<Function, (u64, u64)> = HashMap::new();
    let mut seen = HashSet::new();
    for (key, count) in profile.stacks() {
        seen.clear();
        let mut innermost = true;
        for frame in key.frames.iter() {
            let Frame::Python(python) = frame else { continue };
            let function = Function { qualname: python.qualname.clone(), filename: python.filename.clone() };
            let time = times.entry(function.clone()).or_default();
            if innermost {
                time.0 += count;
                innermost = false;
            }
            if seen.insert(function) {
                time.1 += count;
            }
        }
    }
    let mut functions: Vec<FunctionTime> = times.into_iter().map(|(function, (own, total))| FunctionTime { function, own, total }).collect();
    functions.sort_by(|a, b| {
        (b.own, b.total).cmp(&(a.own, a.total)).then_with(|| (&a.function.qualname, &a.function.filename).cmp(&(&b.function.qualname, &b.function.filename)))
    });
    functions
}

fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The first line stays as it always was: scripts read it.
        writeln!(f, "pyebpf: wrote {} samples of {} processes to {} ({} lost)", self.samples, self.processes, self.output, self.lost)?;
        writeln!(
            f,
            "  {:.1} s at {} Hz, {} samples, {} processes ({} Python)",
            self.duration_s, self.frequency_hz, self.samples, self.processes, self.python_processes
        )?;
        if self.top.is_empty() {
            writeln!(f, "  no Python frames were sampled")?;
        } else {
            writeln!(f, "  top Python functions by own time (share of all samples):")?;
            writeln!(f, "     own   total  function")?;
            for time in &self.top {
                writeln!(
                    f,
                    "  {:>5.1}%  {:>5.1}%  {} ({})",
                    share(time.own, self.samples),
                    share(time.total, self.samples),
                    time.function.qualname,
                    time.function.filename
                )?;
            }
        }
        write!(f, "  lost: {}, Python stacks truncated: {}, unresolved (no frames): {}", self.lost, self.truncated, self.unresolved)?;
        if let Some(command) = &self.open_command {
            write!(f, "\n  open it: {command}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::test_profile::{key, python, sample_profile};

    #[test]
    fn own_time_is_the_innermost_python_frame_and_total_counts_recursion_once() {
        let mut profile = sample_profile();
        // work -> work -> helper: helper is own, work counts once in total.
        let frames = vec![python("helper", "/w.py", 1, 2), python("work", "/w.py", 5, 6), python("work", "/w.py", 5, 7)];
        profile.add(key(300, 300, "py", frames), 4);
        let functions = python_functions(&profile);
        let find = |name: &str| functions.iter().find(|f| &*f.function.qualname == name).unwrap().clone();
        assert_eq!((find("Worker.compute").own, find("Worker.compute").total), (10, 10));
        assert_eq!((find("main").own, find("main").total), (0, 10));
        assert_eq!((find("helper").own, find("helper").total), (4, 4));
        assert_eq!((find("work").own, find("work").total), (0, 4));
        assert_eq!(&*functions[0].function.qualname, "Worker.compute");
    }

    #[test]
    fn summary_lists_shares_counts_and_how_to_open() {
        let profile = sample_profile();
        let stats = Stats { lost_samples: 2, truncated_samples: 1, python_processes: 1, ..Stats::default() };
        let text = Summary::new(&profile, &stats, "out.svg".into(), Some("xdg-open out.svg".into())).to_string();
        assert!(text.starts_with("pyebpf: wrote 15 samples of 2 processes to out.svg (2 lost)\n"), "{text}");
        assert!(text.contains("2.0 s at 100 Hz, 15 samples, 2 processes (1 Python)"), "{text}");
        assert!(text.contains(" 66.7%   66.7%  Worker.compute (/srv/work.py)"), "{text}");
        assert!(!text.contains("main (/srv/work.py)"), "a function without own samples is listed: {text}");
        assert!(text.contains("lost: 2, Python stacks truncated: 1, unresolved (no frames): 0"), "{text}");
        assert!(text.ends_with("open it: xdg-open out.svg"), "{text}");
    }
}
