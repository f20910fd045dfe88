//! pyebpf's one write into a target, CPython 3.15's `last_profiled_frame` marker, cannot corrupt
//! it (issue 7): a program whose threads come and go, and which checks its own heap, runs under
//! `record -p` and `record -a`; every `process_vm_writev` pyebpf makes is traced.

use std::process::Command;
use std::time::Duration;

use pyebpf_tests::{debian_python, pyebpf, script, wait_for_file, Killed};

/// Records the thread-churn canary for `seconds` with `mode` (`-p PID` or `-a`) under strace,
/// then checks its heap report and that every write went to its static main thread state.
fn churn_run(mode: &str, seconds: u32) {
    let dir = tempfile::tempdir().unwrap();
    let (ready, report, trace) = (dir.path().join("ready"), dir.path().join("report"), dir.path().join("trace"));
    let child = Killed(Command::new(debian_python("3.15")).arg(script("thread_churn.py")).arg(&ready).arg(&report).spawn().unwrap());
    wait_for_file(&ready, "thread_churn.py");
    let main_tstate: u64 = std::fs::read_to_string(&ready).unwrap().trim().parse().unwrap();
    let pid = child.pid().to_string();
    let target: Vec<&str> = if mode == "-a" { vec!["-a"] } else { vec!["-p", &pid] };
    let status = Command::new("strace")
        .args(["-f", "--seccomp-bpf", "-qq", "-e", "trace=process_vm_writev", "-o"])
        .arg(&trace)
        .arg(pyebpf())
        .arg("record")
        .args(&target)
        .args(["-F", "999", "-d", &seconds.to_string(), "-o"])
        .arg(dir.path().join("p.folded"))
        .status()
        .expect("strace must be installed (cargo xtask test installs it)");
    assert!(status.success(), "pyebpf record {mode} failed");
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(child.pid() as i32, libc::SIGTERM) };
    wait_for_file(&report, "the canary's report");
    std::thread::sleep(Duration::from_millis(50));
    let report = std::fs::read_to_string(&report).unwrap();
    assert!(report.starts_with("corrupted 0 checked "), "{mode}: heap corrupted: {report}");
    let checked: u64 = report.trim().rsplit(' ').next().unwrap().parse().unwrap();
    assert!(checked > 1000, "{mode}: the canary checked only {checked} buffers");

    let trace = std::fs::read_to_string(&trace).unwrap();
    let mut writes = 0;
    let mut addresses = std::collections::HashSet::new();
    for line in trace.lines().filter(|l| l.contains("process_vm_writev(")) {
        let remote = line.rsplit_once("[{iov_base=").unwrap_or_else(|| panic!("unparsed: {line}")).1;
        let addr = u64::from_str_radix(remote.trim_start_matches("0x").split(',').next().unwrap(), 16).unwrap();
        assert!(line.ends_with("= 8") && remote.contains("iov_len=8}"), "{mode}: not one 8-byte write: {line}");
        addresses.insert(addr);
        if line.contains(&format!("process_vm_writev({pid},")) {
            assert!((main_tstate..main_tstate + 4096).contains(&addr), "{mode}: write at {addr:#x}, outside the main thread state at {main_tstate:#x}: {line}");
            writes += 1;
        }
    }
    assert!(writes > 0, "{mode}: no marker write to the canary was traced: the checks above prove nothing");
    // Under -a other 3.15 processes get markers too: in the same (non-PIE) binary, at the same
    // static address; anything else would be a write somewhere the canary's check cannot vouch for.
    assert_eq!(addresses.len(), 1, "{mode}: writes at several addresses: {addresses:x?}");
}

#[test]
fn thread_churn_is_not_corrupted_under_record_p() {
    for _ in 0..3 {
        churn_run("-p", 30);
    }
}

#[test]
fn thread_churn_is_not_corrupted_under_record_a() {
    for _ in 0..3 {
        churn_run("-a", 30);
    }
}

/// `--read-only` writes nothing, and its stacks are still complete.
#[test]
fn read_only_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (ready, report, trace) = (dir.path().join("ready"), dir.path().join("report"), dir.path().join("trace"));
    let _child = Killed(Command::new(debian_python("3.15")).arg(script("thread_churn.py")).arg(&ready).arg(&report).spawn().unwrap());
    wait_for_file(&ready, "thread_churn.py");
    let output = Command::new("strace")
        .args(["-f", "--seccomp-bpf", "-qq", "-e", "trace=process_vm_writev,pwrite64", "-o"])
        .arg(&trace)
        .arg(pyebpf())
        .args(["record", "-a", "--read-only", "--stats", "-F", "999", "-d", "5", "-o"])
        .arg(dir.path().join("p.folded"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let trace = std::fs::read_to_string(&trace).unwrap();
    assert!(!trace.contains("process_vm_writev("), "--read-only wrote into a process:\n{trace}");
    assert!(stderr.contains("markers established:        0 "), "{stderr}");
    assert!(stderr.contains("truncated:                0 "), "{stderr}");
}
