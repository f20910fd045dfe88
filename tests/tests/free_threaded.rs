//! Free-threaded CPython (PEP 703, `python3.13t` with the GIL disabled): Python frames from threads
//! that run in parallel, checked against what each thread measured of itself, and native stacks of
//! the build whole down to its root.

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use pyebpf_tests::{free_threaded_python, pyebpf_command, record_collapsed as record, stacks_of, start_ready, total, wait_for_file};

const FUNCTIONS: [&str; 4] = ["alpha", "beta", "gamma", "delta"];

fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill takes a pid and a signal.
    assert_eq!(unsafe { libc::kill(pid as i32, signal) }, 0);
}

/// The innermost of `FUNCTIONS` in a collapsed stack.
fn worker_of(frames: &[String]) -> Option<&'static str> {
    frames.iter().rev().find_map(|frame| FUNCTIONS.into_iter().find(|name| frame.starts_with(&format!("{name} ("))))
}

/// Four threads spinning at once on both CPUs: each function's share of the Python samples is
/// within 3 points of the CPU time its thread measured of itself over the same window.
#[test]
fn parallel_threads_get_the_shares_they_measured() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let (child, _ready) = start_ready(&free_threaded_python(), "parallel_threads.py", &[report.to_str().unwrap()]);
    std::thread::sleep(Duration::from_millis(300));
    signal(child.pid(), libc::SIGUSR1);
    let (collapsed, stderr) = record(&["-p", &child.pid().to_string(), "-F", "499", "-d", "6"]);
    signal(child.pid(), libc::SIGUSR2);
    wait_for_file(&report, "parallel_threads.py's report");
    let measured: HashMap<String, f64> = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let cpu: f64 = measured.values().sum();
    let mut samples: HashMap<&str, u64> = HashMap::new();
    for (frames, n) in stacks_of(&collapsed, child.pid()) {
        if let Some(name) = worker_of(&frames) {
            *samples.entry(name).or_default() += n;
        }
    }
    let python: u64 = samples.values().sum();
    let context = format!("samples {samples:?}, CPU seconds {measured:?}\n{stderr}");
    // Four threads on two CPUs for 6 s: well over one CPU's worth in all.
    assert!(cpu > 6.0, "the threads did not run in parallel: {context}");
    // At 499 Hz, a sample per 2 ms of the threads' CPU time, less what starting takes.
    assert!(python as f64 >= cpu * 499.0 * 0.8, "too few Python samples: {context}");
    for name in FUNCTIONS {
        let sampled = 100.0 * samples.get(name).copied().unwrap_or(0) as f64 / python as f64;
        let own = 100.0 * measured[name] / cpu;
        assert!((sampled - own).abs() <= 3.0, "{name}: {sampled:.1}% of the samples, {own:.1}% of the CPU time: {context}");
    }
    assert!(stderr.contains("no GIL: free-threaded CPython 3.13"), "the summary does not name the flavour:\n{stderr}");
    println!("samples {samples:?}, CPU seconds {measured:?}");
}

/// The build's native stacks, merged with the Python frames, reach the thread's root (`_start`
/// for the main thread, `clone3` for the others) in at least 95% of samples, as Debian's GIL
/// builds do.
#[test]
fn native_stacks_reach_the_root() {
    let (child, _dir) = start_ready(&free_threaded_python(), "alternating.py", &["1", "2"]);
    let (collapsed, _) = record(&["-p", &child.pid().to_string(), "-F", "499", "-d", "4"]);
    let stacks = stacks_of(&collapsed, child.pid());
    let rooted: u64 =
        stacks.iter().filter(|(frames, _)| frames.first().is_some_and(|root| ["_start", "clone3", "clone"].contains(&root.as_str()))).map(|(_, n)| n).sum();
    let all = total(&stacks);
    assert!(all >= 2000, "only {all} samples");
    let unrooted: Vec<_> =
        stacks.iter().filter(|(frames, _)| !frames.first().is_some_and(|root| ["_start", "clone3", "clone"].contains(&root.as_str()))).take(5).collect();
    assert!(rooted * 100 >= all * 95, "{rooted} of {all} samples reach the root; some that do not: {unrooted:#?}");
    println!("{rooted} of {all} samples reach the root");
}

/// `--mode gil` on a process without a GIL: one line says so, and its samples are counted as
/// `--mode cpu` counts them.
#[test]
fn gil_mode_says_there_is_no_gil_and_counts_time_on_cpu() {
    let (child, _dir) = start_ready(&free_threaded_python(), "alternating.py", &["1", "2"]);
    let pid = child.pid().to_string();
    let (gil, stderr) = record(&["-p", &pid, "-F", "199", "-d", "3", "--mode", "gil"]);
    let lines: Vec<&str> = stderr.lines().filter(|line| line.contains("no GIL")).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains("free-threaded CPython 3.13") && lines[0].contains("--mode gil counted their time on CPU"), "{stderr}");
    // Two threads spinning on two CPUs for 3 s at 199 Hz: about 1,200 samples, as in CPU mode.
    let samples = total(&stacks_of(&gil, child.pid()));
    assert!(samples >= 800, "{samples} samples in GIL mode\n{stderr}");
}

#[test]
fn version_names_the_free_threaded_build_it_reads() {
    let output = pyebpf_command().arg("--version").output().unwrap();
    let version = String::from_utf8_lossy(&output.stdout);
    assert!(version.contains("free-threaded 3.13"), "{version}");
}

/// Every output format of a recording of the four parallel threads names all four functions
/// (pprof as `go tool pprof` reads it).
#[test]
fn every_output_format_names_the_parallel_functions() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let (child, _ready) = start_ready(&free_threaded_python(), "parallel_threads.py", &[report.to_str().unwrap()]);
    for name in ["profile.pb.gz", "profile.folded", "flame.svg", "profile.speedscope.json"] {
        let out = dir.path().join(name);
        let output = pyebpf_command().args(["record", "-p", &child.pid().to_string(), "-F", "199", "-d", "1", "-o"]).arg(&out).output().unwrap();
        assert!(output.status.success(), "{name}: {}", String::from_utf8_lossy(&output.stderr));
        let text = if name.ends_with(".pb.gz") {
            let top =
                Command::new("go").args(["tool", "pprof", "-top", "-nodecount=100"]).arg(&out).output().expect("go tool pprof (golang-go) must be installed");
            assert!(top.status.success(), "go tool pprof: {}", String::from_utf8_lossy(&top.stderr));
            String::from_utf8_lossy(&top.stdout).into_owned()
        } else {
            std::fs::read_to_string(&out).unwrap()
        };
        for function in FUNCTIONS {
            assert!(text.contains(function), "{name} lacks {function}:\n{}", &text[..text.len().min(3000)]);
        }
    }
}
