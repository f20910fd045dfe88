//! pyebpf's reader is woken by the kernel when records are due, not at every sample: a known
//! process's samples wait in the ring buffer up to the latency bound (100 sampling periods, at most
//! 2 s: 2 s at 49 Hz), so the reader wakes far less often than samples come.

use std::process::Stdio;
use std::time::Duration;

use pyebpf_tests::{pyebpf_command, pyenv_python, start_ready, switches_of_thread};

/// A Python 3.12 process five frames deep (deeper than the walk a 3.15 marker would shorten, so
/// this fails where any Python process's deep samples are taken as urgent).
#[test]
fn the_reader_sleeps_through_samples_of_a_known_process() {
    let (busy, _dir) = start_ready(&pyenv_python("3.12.1"), "always_busy.py", &["60"]);
    let out = tempfile::tempdir().unwrap();
    let profile = out.path().join("profile.pb.gz");
    let pid = busy.pid().to_string();
    let args = ["record", "-p", &pid, "-F", "49", "-d", "6", "-o", profile.to_str().unwrap()];
    let pyebpf = pyebpf_command().args(args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    // Past start-up (the process is attached and known by then).
    std::thread::sleep(Duration::from_millis(2000));
    let before = switches_of_thread(pyebpf.id(), "pyebpf-reader");
    std::thread::sleep(Duration::from_millis(3000));
    let woken = switches_of_thread(pyebpf.id(), "pyebpf-reader") - before;
    let output = pyebpf.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "pyebpf failed: {stderr}");
    let samples: u64 = stderr.split(" samples").next().and_then(|head| head.rsplit(' ').next()).and_then(|n| n.parse().ok()).unwrap_or(0);
    // 49 Hz on the one CPU the process runs on: about 290 samples in 6 s.
    assert!(samples >= 150, "too few samples to judge ({samples}): {stderr}");
    // Woken by the latency bound (every 2 s) and the reader's own look two bounds after a batch
    // at most, and its switches while it runs; a sample waking it would be about 150 in these 3 s.
    assert!(woken <= 60, "the reader was woken {woken} times in 3 s at 49 Hz ({samples} samples in all): {stderr}");
}
