//! A Python in its own PID and mount namespaces (a container), whose interpreter is visible only
//! inside them: its thread ids there are not the host's, and its files are reached through
//! /proc/PID/root.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pyebpf_tests::{record_collapsed, script, stacks_of, total, Killed};

/// Starts `alternating.py` under Debian's python3.14 bind-mounted at a path that exists only in a
/// new mount namespace, in a new PID namespace; returns the child and the host PID of the Python.
fn start_contained(dir: &std::path::Path) -> (Killed, u32) {
    start_contained_python(dir, &pyebpf_tests::test_pythons(), "usr/bin/python3.14")
}

/// `start_contained` with the interpreter at `python` under `prefix`, which is bind-mounted.
fn start_contained_python(dir: &std::path::Path, prefix: &std::path::Path, python: &str) -> (Killed, u32) {
    let prefix = prefix.display();
    let inside = "/run/pyebpf-test-container-python";
    let ready = dir.join("ready");
    let shell =
        format!("mkdir -p {inside} && mount --bind {prefix} {inside} && exec {inside}/{python} {} {} 1", script("alternating.py").display(), ready.display());
    // --kill-child: the Python is its namespace's init, which ignores SIGTERM; when `Killed` kills
    // unshare, the kernel kills the Python too (it would otherwise spin on, holding the test's
    // stdout open).
    let child = Killed(
        Command::new("unshare")
            .args(["--pid", "--mount", "--fork", "--kill-child", "--mount-proc", "--propagation", "private", "sh", "-c", &shell])
            .stdin(Stdio::null())
            .spawn()
            .expect("unshare (util-linux) must be installed"),
    );
    let started = Instant::now();
    while !ready.exists() {
        assert!(started.elapsed() < Duration::from_secs(30), "the contained Python did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!std::path::Path::new(inside).join("usr").exists(), "the interpreter is visible outside its namespace: the test proves nothing");
    // The Python is the forked child of unshare, the child of the process spawned.
    let children = std::fs::read_to_string(format!("/proc/{}/task/{}/children", child.pid(), child.pid())).unwrap();
    let python: u32 = children.split_whitespace().next().expect("unshare's child").parse().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{python}/status")).unwrap();
    let nspid = status.lines().find(|l| l.starts_with("NSpid:")).unwrap();
    assert_eq!(nspid.split_whitespace().count(), 3, "not in a nested PID namespace: {nspid}");
    (child, python)
}

fn check_python_share(mode: &[&str], python: u32) {
    let (collapsed, stderr) = record_collapsed(&[mode, &["-F", "499", "-d", "3"]].concat());
    let stacks = stacks_of(&collapsed, python);
    let all = total(&stacks);
    let with_python =
        stacks.iter().filter(|(frames, _)| frames.iter().any(|f| f.starts_with("a_leaf (") || f.starts_with("b_leaf ("))).map(|(_, n)| n).sum::<u64>();
    assert!(all >= 200, "{mode:?}: only {all} samples of the contained Python: {stderr}");
    assert!(with_python * 100 >= all * 95, "{mode:?}: {with_python} of {all} samples have Python frames");
}

#[test]
fn a_contained_python_gets_python_frames_under_p_and_a() {
    let dir = tempfile::tempdir().unwrap();
    let (_child, python) = start_contained(dir.path());
    check_python_share(&["-p", &python.to_string()], python);
    check_python_share(&["-a"], python);
}

/// 3.11, read with pyebpf's own table: its threads are named by their ids inside the namespace.
#[test]
fn a_contained_3_11_gets_python_frames_under_a() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = pyebpf_tests::pyenv_python("3.11.7").parent().unwrap().parent().unwrap().to_path_buf();
    let (_child, python) = start_contained_python(dir.path(), &prefix, "bin/python3.11");
    check_python_share(&["-a"], python);
}

/// Free-threaded 3.13, two threads alternating in parallel inside the namespaces.
#[test]
fn a_contained_free_threaded_python_gets_python_frames_under_p_and_a() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = pyebpf_tests::free_threaded_python().parent().unwrap().parent().unwrap().to_path_buf();
    let (_child, python) = start_contained_python(dir.path(), &prefix, "bin/python3.13t");
    check_python_share(&["-p", &python.to_string()], python);
    check_python_share(&["-a"], python);
}

/// pprof labels a contained process with its host PID, its PID inside the namespace and its
/// cgroup path (read independently here from /proc/PID/cgroup); `go tool pprof` reads them.
#[test]
fn a_contained_python_is_labelled_with_both_pids_and_its_cgroup() {
    let dir = tempfile::tempdir().unwrap();
    let (_child, python) = start_contained(dir.path());
    let out = dir.path().join("profile.pb.gz");
    let output = Command::new(pyebpf_tests::pyebpf()).args(["record", "-p", &python.to_string(), "-d", "1", "-o"]).arg(&out).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let raw = Command::new("go").args(["tool", "pprof", "-raw"]).arg(&out).output().expect("go tool pprof (golang-go) must be installed");
    let raw = String::from_utf8_lossy(&raw.stdout);
    let status = std::fs::read_to_string(format!("/proc/{python}/status")).unwrap();
    let ns_pid = status.lines().find_map(|l| l.strip_prefix("NSpid:")).unwrap().split_whitespace().last().unwrap().to_string();
    assert!(raw.contains(&format!("pid:[{python}]")), "no host pid label:\n{raw}");
    assert!(raw.contains(&format!("ns_pid:[{ns_pid}]")), "no ns_pid label {ns_pid}:\n{raw}");
    let cgroups = std::fs::read_to_string(format!("/proc/{python}/cgroup")).unwrap();
    let paths: Vec<&str> = cgroups.lines().filter_map(|l| l.splitn(3, ':').nth(2)).filter(|p| *p != "/").collect();
    if paths.is_empty() {
        assert!(!raw.contains("cgroup:["), "a cgroup label for a process in the root cgroup:\n{raw}");
    } else {
        assert!(paths.iter().any(|p| raw.contains(&format!("cgroup:[{p}]"))), "no cgroup label among {paths:?}:\n{raw}");
    }
}

/// `--group-by container` puts the process's cgroup (or `[host]`) above its `COMM (PID)` frame.
#[test]
fn group_by_container_adds_a_root_frame() {
    let dir = tempfile::tempdir().unwrap();
    let (_child, python) = start_contained(dir.path());
    let (collapsed, _) = record_collapsed(&["-p", &python.to_string(), "-d", "1", "--group-by", "container"]);
    let process_frame = format!(";python3.14 ({python});");
    let lines: Vec<&str> = collapsed.lines().filter(|l| l.contains(&process_frame)).collect();
    assert!(!lines.is_empty(), "no stacks of {python} under a root frame:\n{collapsed}");
    assert!(lines.iter().all(|l| l.starts_with("[cgroup /") || l.starts_with("[host];")), "{lines:?}");
}
