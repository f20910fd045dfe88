//! What `record` prints when it is done: where the time went, without another tool.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use crate::mode::Mode;
use crate::stack::{Frame, Profile};
use crate::stats::{NamedProcesses, OffCpuTotals, Stats, TaskTotals};

/// How many Python functions the summary lists.
const TOP: usize = 5;

/// A Python function, whatever line it was on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Function {
    pub qualname: Arc<str>,
    pub filename: Arc<str>,
}

/// A function's time in nanoseconds: as the innermost Python frame (own) and anywhere on the
/// stack (total).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionTime {
    pub function: Function,
    pub own: u64,
    pub total: u64,
}

/// Distinct Python functions a run's summary counts; a hostile process could name without end.
const MAX_RUN_FUNCTIONS: usize = 50_000;

/// What the profiles of a run add up to, for its summary. With `--rotate` each period's profile
/// is written and dropped, so the run is summed period by period.
#[derive(Debug, Default)]
pub struct RunTotals {
    pub profiles: usize,
    pub samples: u64,
    /// The time the samples stand for, in nanoseconds.
    pub ns: u64,
    pub duration_ns: i64,
    pub frequency_hz: u64,
    pub mode: Mode,
    pids: HashSet<u32>,
    /// Own and total nanoseconds per function.
    functions: HashMap<Function, (u64, u64)>,
    /// Nanoseconds whose innermost function came after [`MAX_RUN_FUNCTIONS`] others.
    uncounted: u64,
    frameless: u64,
}

impl RunTotals {
    pub fn of(profile: &Profile) -> Self {
        let mut totals = RunTotals::default();
        totals.add(profile);
        totals
    }

    pub fn add(&mut self, profile: &Profile) {
        self.profiles += 1;
        self.samples += profile.total_samples();
        self.ns = self.ns.saturating_add(profile.total_ns());
        self.duration_ns += profile.duration_ns;
        self.frequency_hz = profile.frequency_hz;
        self.mode = profile.mode;
        self.pids.extend(profile.stacks().map(|(key, _)| key.pid));
        self.frameless += profile.stacks().filter(|(key, _)| key.frames.is_empty()).map(|(_, weight)| weight.samples).sum::<u64>();
        self.uncounted += add_python_functions(profile, &mut self.functions, MAX_RUN_FUNCTIONS);
    }

    pub fn processes(&self) -> usize {
        self.pids.len()
    }
}

#[derive(Debug)]
pub struct Summary {
    pub duration_s: f64,
    pub samples: u64,
    /// Nanoseconds the samples stand for: the whole of the shares.
    pub ns: u64,
    pub frequency_hz: u64,
    pub mode: Mode,
    pub processes: usize,
    pub python_processes: u64,
    /// The hottest Python functions by own time (those with any), at most [`TOP`].
    pub top: Vec<FunctionTime>,
    /// Nanoseconds in functions the summary had no room for (a run naming more than [`MAX_RUN_FUNCTIONS`]).
    pub uncounted: u64,
    /// Off-CPU intervals: captured with stacks, and summed without (shorter than `--off-cpu-min`).
    pub off_cpu: OffCpuTotals,
    pub lost: u64,
    /// Python stacks cut where the chain could not be proven.
    pub truncated: u64,
    /// Samples without a single frame.
    pub frameless: u64,
    /// Processes of CPythons pyebpf does not read, as `Stats` names them, and how many more.
    pub unsupported_pythons: NamedProcesses,
    pub free_threaded: NamedProcesses,
    /// `--async-aware`.
    pub tasks: TaskTotals,
    /// Where the profile went, and the command that opens it (none for standard output, devices).
    pub output: String,
    pub open_command: Option<String>,
    /// `--otlp`: what was delivered.
    pub otlp: Option<crate::otlp::OtlpTotals>,
}

impl Summary {
    pub fn new(totals: RunTotals, stats: &Stats, output: String, open_command: Option<String>) -> Self {
        Summary {
            duration_s: totals.duration_ns as f64 / 1e9,
            samples: totals.samples,
            ns: totals.ns,
            frequency_hz: totals.frequency_hz,
            mode: totals.mode,
            off_cpu: stats.off_cpu,
            processes: totals.processes(),
            python_processes: stats.python_processes,
            top: sorted_functions(totals.functions).into_iter().filter(|time| time.own > 0).take(TOP).collect(),
            uncounted: totals.uncounted,
            lost: stats.lost_samples,
            truncated: stats.truncated_samples,
            frameless: totals.frameless,
            unsupported_pythons: stats.unsupported_pythons.clone(),
            free_threaded: stats.free_threaded.clone(),
            tasks: stats.tasks.clone(),
            output,
            open_command,
            otlp: stats.otlp.clone(),
        }
    }
}

/// Adds the profile's time to each Python function's own time (as the innermost Python frame) and
/// total (anywhere on the stack; a recursive function counts once per sample), counting at most
/// `max` functions; returns the nanoseconds whose innermost function found no room.
fn add_python_functions(profile: &Profile, times: &mut HashMap<Function, (u64, u64)>, max: usize) -> u64 {
    let mut uncounted = 0;
    let mut seen = HashSet::new();
    for (key, weight) in profile.stacks() {
        let count = weight.ns;
        seen.clear();
        let mut innermost = true;
        for frame in key.frames.iter() {
            let Frame::Python(python) = frame else { continue };
            let function = Function { qualname: python.qualname.clone(), filename: python.filename.clone() };
            let first_here = seen.insert(function.clone());
            if times.len() >= max && !times.contains_key(&function) {
                if innermost {
                    uncounted += count;
                }
            } else {
                let time = times.entry(function).or_default();
                if innermost {
                    time.0 += count;
                }
                if first_here {
                    time.1 += count;
                }
            }
            innermost = false;
        }
    }
    uncounted
}

/// The functions by own samples, most first.
fn sorted_functions(times: HashMap<Function, (u64, u64)>) -> Vec<FunctionTime> {
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

impl Summary {
    /// The run: samples, processes, the time measured and, for waits, the off-CPU intervals.
    fn write_run(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The first line stays as it always was: scripts read it.
        writeln!(f, "pyebpf: wrote {} samples of {} processes to {} ({} lost)", self.samples, self.processes, self.output, self.lost)?;
        writeln!(
            f,
            "  {:.1} s at {} Hz, {} samples, {} processes ({} Python)",
            self.duration_s, self.frequency_hz, self.samples, self.processes, self.python_processes
        )?;
        if self.mode != Mode::Cpu {
            writeln!(f, "  {}: {:.3} s in all", self.mode.measures(), self.ns as f64 / 1e9)?;
        }
        if self.mode.counts_waits() {
            let o = &self.off_cpu;
            writeln!(
                f,
                "  off CPU: {} intervals with stacks ({} still waiting at the end); {} shorter ones begun without a capture (see --off-cpu-min), {:.3} s, {:.3} s of it counted with their thread's next capture of their kind",
                o.intervals,
                o.open_at_end,
                o.short_intervals,
                o.short_ns as f64 / 1e9,
                o.carried_ns as f64 / 1e9
            )?;
        }
        Ok(())
    }

    /// The top Python functions, and what the listing leaves out.
    fn write_top(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.top.is_empty() {
            writeln!(f, "  no Python frames were sampled")?;
        } else if self.mode == Mode::Cpu {
            writeln!(f, "  top Python functions by own time (share of all samples):")?;
        } else {
            writeln!(f, "  top Python functions by own {} (share of all of it):", self.mode.measures())?;
        }
        if !self.top.is_empty() {
            writeln!(f, "     own   total  function")?;
            for time in &self.top {
                writeln!(
                    f,
                    "  {:>5.1}%  {:>5.1}%  {} ({})",
                    share(time.own, self.ns),
                    share(time.total, self.ns),
                    time.function.qualname,
                    time.function.filename
                )?;
            }
        }
        if self.uncounted > 0 {
            writeln!(f, "  ({:.3} s are in functions beyond the first {MAX_RUN_FUNCTIONS} and not listed)", self.uncounted as f64 / 1e9)?;
        }
        if !self.unsupported_pythons.is_empty() {
            writeln!(f, "  native frames only (pyebpf reads CPython 3.8 to 3.15, and free-threaded 3.13): {}", self.unsupported_pythons)?;
        }
        self.write_free_threaded(f)
    }

    fn write_free_threaded(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.free_threaded.is_empty() {
            return Ok(());
        }
        if self.mode == Mode::Gil {
            writeln!(f, "  no GIL in {}: --mode gil counted their time on CPU, as --mode cpu does", self.free_threaded)
        } else {
            writeln!(f, "  no GIL: {}", self.free_threaded)
        }
    }

    /// How samples were placed in asyncio tasks, with `--async-aware`.
    fn write_tasks(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tasks = &self.tasks;
        if tasks.enabled {
            writeln!(
                f,
                "  asyncio: {} samples in a task ({} with the task not placed: its coroutine was not in the stack kept; {} task chains cut)",
                tasks.placed, tasks.unplaced, tasks.chains_cut
            )?;
            if self.mode.counts_waits() {
                writeln!(
                    f,
                    "  asyncio waits: {} stacks of waiting tasks ({} captures read their thread's task list in part: {} waiting tasks at most, the oldest)",
                    tasks.waiting,
                    tasks.waiting_cut,
                    pyebpf_common::MAX_WAITING_TASKS
                )?;
            }
        }
        if !tasks.unsupported.is_empty() {
            writeln!(f, "  no asyncio tasks (pyebpf reads them from CPython 3.14 on): {}", tasks.unsupported)?;
        }
        Ok(())
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write_run(f)?;
        self.write_top(f)?;
        self.write_tasks(f)?;
        write!(f, "  lost: {}, Python stacks truncated: {}, samples without frames: {}", self.lost, self.truncated, self.frameless)?;
        if let Some(otlp) = &self.otlp {
            write!(f, "\n  {otlp}")?;
        }
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

    /// Nanoseconds of one sample at the test profiles' 100 Hz.
    const PERIOD: u64 = 10_000_000;

    #[test]
    fn own_time_is_the_innermost_python_frame_and_total_counts_recursion_once() {
        let mut profile = sample_profile();
        // work -> work -> helper: helper is own, work counts once in total.
        let frames = vec![python("helper", "/w.py", 1, 2), python("work", "/w.py", 5, 6), python("work", "/w.py", 5, 7)];
        profile.add(key(300, 300, "py", frames), 4);
        let functions = sorted_functions(RunTotals::of(&profile).functions);
        let find = |name: &str| functions.iter().find(|f| &*f.function.qualname == name).map(|f| (f.own / PERIOD, f.total / PERIOD)).unwrap();
        assert_eq!(find("Worker.compute"), (10, 10));
        assert_eq!(find("main"), (0, 10));
        assert_eq!(find("helper"), (4, 4));
        assert_eq!(find("work"), (0, 4));
        assert_eq!(&*functions[0].function.qualname, "Worker.compute");
    }

    #[test]
    fn a_run_adds_up_its_periods_and_counts_functions_beyond_the_bound_apart() {
        let mut second = Profile::new(100);
        second.duration_ns = 1_000_000_000;
        second.add(key(300, 300, "py", vec![python("late", "/w.py", 1, 2), python("main", "/srv/work.py", 30, 31)]), 6);
        let mut totals = RunTotals::of(&sample_profile());
        totals.add(&second);
        assert_eq!((totals.profiles, totals.samples, totals.duration_ns, totals.processes()), (2, 21, 3_000_000_000, 3));
        let functions = sorted_functions(std::mem::take(&mut totals.functions));
        let times: Vec<(&str, u64, u64)> = functions.iter().map(|f| (&*f.function.qualname, f.own / PERIOD, f.total / PERIOD)).collect();
        assert_eq!(times, [("Worker.compute", 10, 10), ("late", 6, 6), ("main", 0, 16)]);

        // Room for one function: `late` is new and innermost, so its samples are counted apart;
        // `main` already has its row and keeps counting.
        let mut first = Profile::new(100);
        first.add(key(300, 300, "py", vec![python("main", "/srv/work.py", 30, 33)]), 1);
        let mut bounded = HashMap::new();
        assert_eq!(add_python_functions(&first, &mut bounded, 1), 0);
        assert_eq!(add_python_functions(&second, &mut bounded, 1), 6 * PERIOD);
        assert_eq!(bounded.len(), 1);
        assert_eq!(bounded[&Function { qualname: "main".into(), filename: "/srv/work.py".into() }], (PERIOD, 7 * PERIOD));
    }

    #[test]
    fn summary_lists_shares_counts_and_how_to_open() {
        let profile = sample_profile();
        let stats = Stats { lost_samples: 2, truncated_samples: 1, python_processes: 1, ..Stats::default() };
        let text = Summary::new(RunTotals::of(&profile), &stats, "out.svg".into(), Some("xdg-open out.svg".into())).to_string();
        assert!(text.starts_with("pyebpf: wrote 15 samples of 2 processes to out.svg (2 lost)\n"), "{text}");
        assert!(text.contains("2.0 s at 100 Hz, 15 samples, 2 processes (1 Python)"), "{text}");
        assert!(text.contains(" 66.7%   66.7%  Worker.compute (/srv/work.py)"), "{text}");
        assert!(!text.contains("main (/srv/work.py)"), "a function without own samples is listed: {text}");
        assert!(text.contains("lost: 2, Python stacks truncated: 1, samples without frames: 0"), "{text}");
        assert!(text.ends_with("open it: xdg-open out.svg"), "{text}");
        assert!(!text.contains("native frames only"), "{text}");
    }

    #[test]
    fn summary_names_processes_of_unsupported_pythons_within_its_bound() {
        let mut stats = Stats::default();
        for pid in 0..10 {
            stats.unsupported_pythons.add(format!("CPython 3.11.2 (pid {pid})"));
        }
        let text = Summary::new(RunTotals::of(&sample_profile()), &stats, "out.folded".into(), None).to_string();
        let line = text.lines().find(|l| l.contains("native frames only")).unwrap_or_else(|| panic!("{text}"));
        assert!(line.ends_with("CPython 3.11.2 (pid 7) and 2 more"), "{line}");
        assert_eq!(line.matches("CPython 3.11.2").count(), crate::stats::MAX_NAMED_UNSUPPORTED, "{line}");
    }
}
