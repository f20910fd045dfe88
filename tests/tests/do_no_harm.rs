//! pyebpf's one write into a target, CPython 3.15's `last_profiled_frame` marker, cannot corrupt
//! it (issue 7): a program whose threads come and go, and which checks its own heap, runs under
//! `record -p` and `record -a`; every `process_vm_writev` pyebpf makes is traced. And what the
//! eBPF program reads a thread through, its registration, goes when the thread exits.

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pyebpf_tests::{bpf_map_id, bpf_map_u32_keys, debian_python, pyebpf, script, start_ready, wait_for_file, Killed};

/// Canaries run side by side in each recording: three of them for 30 s expose as many thread
/// states to the marker write as three runs of one, in a third of the time.
const CANARIES: usize = 3;

/// One thread-churn canary: its files, and its main thread state's address (static in the
/// non-PIE binary, so the same in every canary).
struct Canary {
    child: Killed,
    report: std::path::PathBuf,
    main_tstate: u64,
}

fn start_canary(dir: &std::path::Path, n: usize) -> Canary {
    let (ready, report) = (dir.join(format!("ready{n}")), dir.join(format!("report{n}")));
    let child = Killed(Command::new(debian_python("3.15")).arg(script("thread_churn.py")).arg(&ready).arg(&report).spawn().unwrap());
    wait_for_file(&ready, "thread_churn.py");
    let main_tstate = std::fs::read_to_string(&ready).unwrap().trim().parse().unwrap();
    Canary { child, report, main_tstate }
}

/// Records the thread-churn canaries for `seconds` with `mode` (`-p PID` each, or `-a`) under
/// strace, then checks each one's heap report and that every write went to its static main
/// thread state.
fn churn_run(mode: &str, seconds: u32) {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace");
    let canaries: Vec<Canary> = (0..CANARIES).map(|n| start_canary(dir.path(), n)).collect();
    let pids: Vec<String> = canaries.iter().map(|c| c.child.pid().to_string()).collect();
    let target: Vec<&str> = if mode == "-a" { vec!["-a"] } else { pids.iter().flat_map(|pid| ["-p", pid.as_str()]).collect() };
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
    for canary in &canaries {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(canary.child.pid() as i32, libc::SIGTERM) };
    }
    let trace = std::fs::read_to_string(&trace).unwrap();
    // Each traced write: its line and the remote address it wrote.
    let writes: Vec<(&str, u64)> = trace
        .lines()
        .filter(|l| l.contains("process_vm_writev("))
        .map(|line| {
            let remote = line.rsplit_once("[{iov_base=").unwrap_or_else(|| panic!("unparsed: {line}")).1;
            assert!(line.ends_with("= 8") && remote.contains("iov_len=8}"), "{mode}: not one 8-byte write: {line}");
            (line, u64::from_str_radix(remote.trim_start_matches("0x").split(',').next().unwrap(), 16).unwrap())
        })
        .collect();
    let addresses: std::collections::HashSet<u64> = writes.iter().map(|&(_, addr)| addr).collect();
    for (canary, pid) in canaries.iter().zip(&pids) {
        wait_for_file(&canary.report, "the canary's report");
        std::thread::sleep(Duration::from_millis(50));
        let report = std::fs::read_to_string(&canary.report).unwrap();
        assert!(report.starts_with("corrupted 0 checked "), "{mode}, canary {pid}: heap corrupted: {report}");
        let checked: u64 = report.trim().rsplit(' ').next().unwrap().parse().unwrap();
        assert!(checked > 1000, "{mode}, canary {pid}: it checked only {checked} buffers");
        let main = canary.main_tstate..canary.main_tstate + 4096;
        let mine: Vec<&(&str, u64)> = writes.iter().filter(|(line, _)| line.contains(&format!("process_vm_writev({pid},"))).collect();
        for (line, addr) in &mine {
            assert!(main.contains(addr), "{mode}: write at {addr:#x}, outside canary {pid}'s main thread state at {:#x}: {line}", main.start);
        }
        assert!(!mine.is_empty(), "{mode}: no marker write to canary {pid} was traced: the checks above prove nothing");
    }
    // Under -a other 3.15 processes get markers too: in the same (non-PIE) binary, at the same
    // static address; anything else would be a write somewhere the canaries' checks cannot vouch for.
    assert_eq!(addresses.len(), 1, "{mode}: writes at several addresses: {addresses:x?}");
}

#[test]
fn thread_churn_is_not_corrupted_under_record_p() {
    churn_run("-p", 30);
}

#[test]
fn thread_churn_is_not_corrupted_under_record_a() {
    churn_run("-a", 30);
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

/// A thread's registration with the eBPF program (its `PY_THREADS` entry, naming its thread state,
/// which CPython frees at the thread's exit) goes when the thread exits, not at userspace's next
/// read of the thread list (every 30 s). Threads of 150-400 ms come and go under `record -p`; at
/// each look, every thread seen registered before whose `/proc` entry is gone (the kernel's exit
/// hook runs before the thread leaves `/proc`) must be out of the map.
#[test]
fn exited_threads_leave_no_registration_in_the_kernel() {
    let (target, dir) = start_ready(&debian_python("3.13"), "thread_turnover.py", &["60"]);
    let pid = target.pid();
    let recording = Killed(
        Command::new(pyebpf())
            .args(["record", "-p", &pid.to_string(), "-F", "499", "-d", "30", "-o"])
            .arg(dir.path().join("p.folded"))
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let started = Instant::now();
    let map = loop {
        if let Some(id) = bpf_map_id(recording.pid(), "PY_THREADS") {
            break id;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "pyebpf held no PY_THREADS map after 30 s");
        std::thread::sleep(Duration::from_millis(50));
    };
    let (mut seen, mut exited) = (BTreeSet::new(), BTreeSet::new());
    let looking = Instant::now();
    while looking.elapsed() < Duration::from_secs(10) {
        let gone: BTreeSet<u32> = seen.iter().copied().filter(|tid| !std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists()).collect();
        let registered: BTreeSet<u32> = bpf_map_u32_keys(map).into_iter().collect();
        let stale: Vec<&u32> = gone.intersection(&registered).collect();
        assert!(stale.is_empty(), "threads {stale:?} of {pid} exited but are still registered with the eBPF program");
        exited.extend(gone);
        seen.extend(registered.into_iter().filter(|&tid| tid != pid));
        std::thread::sleep(Duration::from_millis(100));
    }
    // Only threads seen registered, then gone, prove anything above.
    assert!(exited.len() >= 30, "only {} threads of {pid} were seen registered and then exiting ({} seen registered)", exited.len(), seen.len());
}
