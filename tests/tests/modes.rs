//! `record --mode wall|off-cpu|gil` against workloads whose true split is known: a thread that
//! sleeps 7 ms and spins 3 ms every 10 ms beside one blocked on a lock throughout, and two threads
//! that hold the GIL in turns for 1 ms and 3 ms beside one hashing without it.

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use pyebpf_tests::{debian_python, free_threaded_python, pyebpf, pyenv_python, record_collapsed as record, stacks_of, start_ready, Killed, Stack};

/// A waits.py workload with its threads' ids by name; killed when dropped.
struct Workload {
    child: Killed,
    _dir: tempfile::TempDir,
    tids: HashMap<String, u32>,
}

impl Workload {
    fn start(python: &std::path::Path, args: &[&str]) -> Workload {
        let (child, dir) = start_ready(python, "waits.py", args);
        let ready = std::fs::read_to_string(dir.path().join("ready")).unwrap();
        let tids = ready.lines().filter_map(|line| line.split_once(' ')).map(|(tid, name)| (name.to_string(), tid.parse().unwrap())).collect();
        std::thread::sleep(Duration::from_millis(200));
        Workload { child, _dir: dir, tids }
    }

    fn pid(&self) -> String {
        self.child.pid().to_string()
    }

    /// Seconds the serving thread has spent in `wait_io` and `compute` so far (with `gil`: CPU
    /// seconds `quarter` and `three_quarters` have run holding the GIL), as the workload measured.
    fn truth(&self) -> (f64, f64) {
        let text = std::fs::read_to_string(self._dir.path().join("ready.truth")).unwrap_or_default();
        let mut numbers = text.split_whitespace().map(|n| n.parse::<f64>().unwrap_or(0.0));
        (numbers.next().unwrap_or(0.0), numbers.next().unwrap_or(0.0))
    }

    /// The stacks of thread `name` (collapsed output with `--threads`), without the thread frame.
    fn thread(&self, stacks: &[Stack], name: &str) -> Vec<Stack> {
        let frame = format!("thread {}", self.tids[name]);
        stacks.iter().filter(|(frames, _)| frames.first() == Some(&frame)).map(|(frames, n)| (frames[1..].to_vec(), *n)).collect()
    }
}

fn has_function(frames: &[String], qualname: &str) -> bool {
    frames.iter().any(|f| f.starts_with(&format!("{qualname} (")))
}

/// Microseconds of `stacks` that pass `keep`.
fn weight(stacks: &[Stack], keep: impl Fn(&[String]) -> bool) -> u64 {
    stacks.iter().filter(|(frames, _)| keep(frames)).map(|(_, n)| n).sum()
}

/// A duration as `go tool pprof` prints it (`5.99s`, `5990ms`, `1.2mins`), in seconds.
fn pprof_seconds(text: &str) -> Option<f64> {
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (number, unit) = text.split_at(split);
    let scale = match unit {
        "ns" => 1e-9,
        "us" | "µs" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        "mins" => 60.0,
        _ => return None,
    };
    Some(number.parse::<f64>().ok()? * scale)
}

fn share(part: u64, whole: u64) -> f64 {
    100.0 * part as f64 / whole.max(1) as f64
}

/// The share of its time, in percent, the serving thread waited between two readings of what it
/// measured of itself ([`Workload::truth`]).
fn measured_wait_share(before: (f64, f64), after: (f64, f64)) -> f64 {
    let (waited, computed) = (after.0 - before.0, after.1 - before.1);
    100.0 * waited / (waited + computed)
}

/// Checks that `wait_io` and `compute` split their time as the serving thread measured of itself
/// (`true_wait` percent waiting), within `points`, and hold most of its time; returns `wait_io`'s
/// weight. The thread times only those two: what it spends between them (its loop, rewriting its
/// truth file, which can wait for the disk) is left out of both sides.
fn assert_split_as_measured(serve: &[Stack], serve_total: u64, true_wait: f64, points: f64, context: &str) -> u64 {
    let wait_io = weight(serve, |frames| has_function(frames, "wait_io"));
    let compute = weight(serve, |frames| has_function(frames, "compute"));
    let both = wait_io + compute;
    assert!(share(both, serve_total) >= 75.0, "wait_io and compute hold {:.1}% of the serving thread: {context}", share(both, serve_total));
    assert!(
        (share(wait_io, both) - true_wait).abs() <= points,
        "wait_io {:.1}% of the serving thread's wait_io and compute, where it measured {true_wait:.1}%: {context}",
        share(wait_io, both)
    );
    wait_io
}

#[test]
fn wall_mode_splits_a_thread_between_its_sleep_and_its_work_and_counts_a_lock_waiter_throughout() {
    check_wall_split(&debian_python("3.15"));
}

/// The same on a free-threaded build, where waiting detaches the thread rather than releasing a GIL.
#[test]
fn wall_mode_splits_a_free_threaded_thread_and_counts_its_lock_waiter() {
    check_wall_split(&free_threaded_python());
}

fn check_wall_split(python: &std::path::Path) {
    let workload = Workload::start(python, &[]);
    let before = workload.truth();
    let (collapsed, stderr) = record(&["-p", &workload.pid(), "--mode", "wall", "-F", "199", "-d", "4", "--threads"]);
    let after = workload.truth();
    // The true split is 70/30 as written, moved by what its sleeps overrun and its work waits for
    // a CPU (58% waiting on a host losing time to steal): the thread measures it. It needs only to
    // be a split, far from either end.
    let true_wait = measured_wait_share(before, after);
    assert!((45.0..=85.0).contains(&true_wait), "the serving thread waited {true_wait:.1}% of its time, not a split near 70%");
    let stacks = stacks_of(&collapsed, workload.child.pid());
    let serve = workload.thread(&stacks, "serve");
    let serve_total = weight(&serve, |_| true);
    // Each thread's wall time is the recording's (4 s, in microseconds), within what starting takes.
    assert!((3_600_000..=4_600_000).contains(&serve_total), "serving thread has {serve_total} us of a 4 s recording: {stderr}");
    let wait_io = assert_split_as_measured(&serve, serve_total, true_wait, 3.0, &stderr);
    let asleep = weight(&serve, |frames| has_function(frames, "wait_io") && frames.last().is_some_and(|f| f == "[off-cpu sleep]"));
    assert!(asleep * 100 >= wait_io * 95, "wait_io is not labelled a sleep: {asleep} of {wait_io} us");

    let waiter = workload.thread(&stacks, "lock_waiter");
    let waiter_total = weight(&waiter, |_| true);
    let locked = weight(&waiter, |frames| has_function(frames, "lock_waiter") && frames.last().is_some_and(|f| f == "[off-cpu lock]"));
    assert!((3_600_000..=4_600_000).contains(&waiter_total), "lock waiter has {waiter_total} us of a 4 s recording: {stderr}");
    assert!(share(locked, waiter_total) >= 97.0, "lock waiter: {locked} of {waiter_total} us labelled a lock wait: {collapsed}");
    assert!(stderr.contains("still waiting at the end"), "{stderr}");
}

/// A thread that waits 40 times per 10 ms cycle, for 0.15 ms each, is captured at most once per
/// millisecond after its burst: most of its waits begin without a capture, and count with the
/// stacks of its next captured wait (a preemption's take only preemptions). Its split is what it
/// measured of itself (its sleeps end late).
#[test]
fn wall_mode_counts_waits_shorter_than_off_cpu_min() {
    let workload = Workload::start(&debian_python("3.15"), &["6", "4", "40"]);
    let before = workload.truth();
    let (collapsed, stderr) = record(&["-p", &workload.pid(), "--mode", "wall", "-F", "199", "-d", "4", "--threads"]);
    let after = workload.truth();
    let true_wait = measured_wait_share(before, after);
    let serve = workload.thread(&stacks_of(&collapsed, workload.child.pid()), "serve");
    let serve_total = weight(&serve, |_| true);
    assert!((3_600_000..=4_600_000).contains(&serve_total), "serving thread has {serve_total} us of a 4 s recording: {stderr}");
    // The waits after `wait_io`'s last capture count with its next captured wait, not with
    // `compute`'s preemptions. wait_io still reads 1.4-2.7 points low in the runs measured (5.5
    // in a failing run before, when waits were carried into any next capture): 4 points allowed.
    assert_split_as_measured(&serve, serve_total, true_wait, 4.0, &stderr);
    let short: u64 = stderr.split("still waiting at the end); ").nth(1).and_then(|rest| rest.split_whitespace().next()?.parse().ok()).unwrap_or(0);
    assert!(short > 4000, "the waits were not shorter than --off-cpu-min: {short} begun without a capture: {stderr}");
}

#[test]
fn off_cpu_mode_has_only_the_waits() {
    check_off_cpu_waits(&debian_python("3.15"));
}

#[test]
fn off_cpu_mode_has_only_the_waits_free_threaded() {
    check_off_cpu_waits(&free_threaded_python());
}

fn check_off_cpu_waits(python: &std::path::Path) {
    let workload = Workload::start(python, &[]);
    let (collapsed, stderr) = record(&["-p", &workload.pid(), "--mode", "off-cpu", "-F", "199", "-d", "3", "--threads"]);
    let stacks = stacks_of(&collapsed, workload.child.pid());
    let serve = workload.thread(&stacks, "serve");
    let serve_total = weight(&serve, |_| true);
    let wait_io = weight(&serve, |frames| has_function(frames, "wait_io"));
    assert!(serve_total > 1_500_000, "serving thread off CPU for {serve_total} us of 3 s: {stderr}");
    assert!(share(wait_io, serve_total) >= 95.0, "wait_io {:.1}% of the serving thread's off-CPU time: {collapsed}", share(wait_io, serve_total));
    let on_cpu = weight(&stacks, |frames| !frames.last().is_some_and(|f| f.starts_with("[off-cpu ")));
    assert_eq!(on_cpu, 0, "off-cpu mode has on-CPU stacks: {collapsed}");
}

fn check_gil_split(python: &std::path::Path) {
    let workload = Workload::start(python, &["gil"]);
    // The truth is the CPU time each holder measured of itself while it held the GIL; the kernel's
    // count of their CPU time adds the hand-offs, which cost both the same per turn. The turns are
    // of CPU time: turns of wall time split it 1:3 only where nothing took CPU from them, and on a
    // host losing time to steal quarter measured 26.6-27.2% of the CPU time where pyebpf saw it
    // hold the GIL 22.2-23.9% (in 4 of 8 runs). 8 s at 499 Hz: about 3,500 samples of holders
    // (1,800 beside two spinning processes), whose quarter varies by chance 0.7 points (1.0).
    let before = workload.truth();
    let steal_before = steal_ticks();
    let (collapsed, stderr) = record(&["-p", &workload.pid(), "--mode", "gil", "-F", "499", "-d", "8", "--threads"]);
    let after = workload.truth();
    let steal = steal_ticks() - steal_before;
    let (quarter_s, three_quarters_s) = (after.0 - before.0, after.1 - before.1);
    let true_quarter = 100.0 * quarter_s / (quarter_s + three_quarters_s).max(1e-9);
    let stacks = stacks_of(&collapsed, workload.child.pid());
    let quarter = weight(&workload.thread(&stacks, "quarter"), |_| true);
    let three_quarters = weight(&workload.thread(&stacks, "three_quarters"), |_| true);
    let holders = quarter + three_quarters;
    assert!(holders > 800, "too few samples holding the GIL ({holders}): {stderr}");
    assert!(
        (15.0..=35.0).contains(&true_quarter),
        "quarter held {true_quarter:.1}% of the holders' CPU time with the GIL, not about a quarter: the workload did not run as meant"
    );
    assert!(
        (share(quarter, holders) - true_quarter).abs() <= 3.0,
        "{}: quarter held {:.1}% ({quarter} of {holders}) where it measured {true_quarter:.1}% of the holders' CPU time with the GIL ({quarter_s:.2} s and {three_quarters_s:.2} s; the host lost {steal} ticks to steal): {stderr}",
        python.display(),
        share(quarter, holders)
    );
    // The hashing thread runs half of the time, but without the GIL.
    let hashing = weight(&stacks, |frames| has_function(frames, "no_gil"));
    assert!(hashing * 20 < holders, "{}: {hashing} samples of the thread without the GIL, {holders} of holders", python.display());
}

/// The host's steal time so far, in clock ticks (`/proc/stat`): time its CPUs were ready to run
/// but the hypervisor ran something else.
fn steal_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap();
    stat.lines().next().and_then(|cpu| cpu.split_whitespace().nth(8)?.parse().ok()).unwrap_or(0)
}

#[test]
fn gil_mode_keeps_only_the_holders_3_15() {
    check_gil_split(&debian_python("3.15"));
}

#[test]
fn gil_mode_keeps_only_the_holders_3_11() {
    check_gil_split(&pyenv_python("3.11.7"));
}

#[test]
fn wall_mode_profiles_are_weighted_in_nanoseconds_in_pprof() {
    let workload = Workload::start(&debian_python("3.15"), &[]);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("wall.pb.gz");
    // Not the default 99 Hz, whose period is the workload's cycle: 199 Hz samples each cycle twice.
    let status = Command::new(pyebpf()).args(["record", "-p", &workload.pid(), "--mode", "wall", "-F", "199", "-d", "2", "-o"]).arg(&out).status().unwrap();
    assert!(status.success());
    let top = |index: &str| {
        let mut go = Command::new("go");
        go.args(["tool", "pprof", "-top"]);
        if !index.is_empty() {
            go.arg(format!("-sample_index={index}"));
        }
        let output = go.arg(&out).output().unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let wall = top("wall");
    assert!(top("").contains("Type: wall"), "wall is not the default sample type: {}", top(""));
    // Three threads for 2 s: about 6 s of wall time in all.
    let total = wall.lines().find(|line| line.starts_with("Showing nodes accounting for")).and_then(|line| line.rsplit(" of ").next()?.strip_suffix(" total"));
    let seconds = total.and_then(pprof_seconds).unwrap_or_else(|| panic!("no total in seconds in {wall}"));
    assert!((5.0..7.5).contains(&seconds), "wall total {seconds} s: {wall}");
    assert!(top("off_cpu").contains("lock_waiter"), "{}", top("off_cpu"));
    assert!(top("cpu").contains("spin_for"), "{}", top("cpu"));
}

#[test]
fn host_wide_wall_mode_with_twenty_python_processes_loses_nothing_and_keeps_their_splits() {
    // 95/5 rather than 70/30: twenty threads computing 30% of the time would need three CPUs. On
    // two busy CPUs sleeps end late and work waits for a CPU: each serving thread measures its
    // own split over the recording, the answer to compare with.
    let workloads: Vec<Workload> = (0..20).map(|_| Workload::start(&debian_python("3.15"), &["19", "1"])).collect();
    std::thread::sleep(Duration::from_millis(500));
    let before: Vec<(f64, f64)> = workloads.iter().map(Workload::truth).collect();
    // Not 99 Hz: its 10.1 ms period is half these threads' cycle, and a cycle locked to the
    // sampling clock puts its 1 ms of work between the samples (aliasing, as for perf).
    let (collapsed, stderr) = record(&["-a", "--python-only", "--mode", "wall", "-F", "331", "-d", "4", "--threads"]);
    let after: Vec<(f64, f64)> = workloads.iter().map(Workload::truth).collect();
    assert!(stderr.contains("(0 lost)"), "{stderr}");
    for ((workload, before), after) in workloads.iter().zip(before).zip(after) {
        let true_wait = measured_wait_share(before, after);
        let stacks = stacks_of(&collapsed, workload.child.pid());
        let serve = workload.thread(&stacks, "serve");
        let serve_total = weight(&serve, |_| true);
        let pid = workload.pid();
        assert!((3_000_000..=4_600_000).contains(&serve_total), "pid {pid}: serving thread has {serve_total} us: {stderr}");
        assert_split_as_measured(&serve, serve_total, true_wait, 3.0, &format!("pid {pid}"));
        let waiter = workload.thread(&stacks, "lock_waiter");
        let locked = weight(&waiter, |frames| has_function(frames, "lock_waiter") && frames.last().is_some_and(|f| f == "[off-cpu lock]"));
        assert!(share(locked, weight(&waiter, |_| true)) >= 97.0, "pid {pid}: lock waiter {locked} us locked");
    }
}
