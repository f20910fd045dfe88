//! Issue 3 end to end: `pyebpf dump --json` against each real interpreter's own view of its threads.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn pyebpf() -> PathBuf {
    let bin = PathBuf::from(std::env::var("PYEBPF_BIN").expect("PYEBPF_BIN must name the pyebpf binary (cargo xtask test sets it)"));
    assert!(bin.exists(), "PYEBPF_BIN {} does not exist", bin.display());
    bin
}

fn pythons() -> PathBuf {
    PathBuf::from(std::env::var("PYEBPF_PYTHONS").expect("PYEBPF_PYTHONS must name the test Pythons' prefix (cargo xtask test sets it)"))
}

fn pyenv(version: &str) -> PathBuf {
    let root = std::env::var("PYENV_ROOT").map(PathBuf::from).unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap()).join(".pyenv"));
    let minor = version.rsplit_once('.').map_or(version, |(mm, _)| mm);
    let path = root.join(format!("versions/{version}/bin/python{minor}"));
    assert!(path.exists(), "pyenv's Python {version} is missing at {}", path.display());
    path
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn dump(pid: u32, json: bool) -> Output {
    let mut command = Command::new(pyebpf());
    command.args(["dump", "-p", &pid.to_string()]);
    if json {
        command.arg("--json");
    }
    command.output().unwrap()
}

fn check_dump_matches_the_interpreter(python: &Path) {
    assert!(python.exists(), "test interpreter missing: {}", python.display());
    let dir = tempfile::tempdir().unwrap();
    let view_file = dir.path().join("view.json");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/dump_state.py");
    let child = Killed(Command::new(python).arg(script).arg(&view_file).stdin(Stdio::null()).spawn().unwrap());
    let started = Instant::now();
    while !view_file.exists() {
        assert!(started.elapsed() < Duration::from_secs(30), "{} never wrote its view", python.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    // The reporting thread exits right after writing the view.
    std::thread::sleep(Duration::from_millis(300));
    let view: Value = serde_json::from_str(&std::fs::read_to_string(&view_file).unwrap()).unwrap();
    let output = dump(child.0.id(), true);
    assert!(output.status.success(), "dump failed: {}", String::from_utf8_lossy(&output.stderr));
    let dumped: Value = serde_json::from_slice(&output.stdout).unwrap();
    let threads = dumped["threads"].as_array().unwrap();
    let view = view.as_object().unwrap();
    assert_eq!(threads.len(), view.len(), "threads: dump {dumped:#} vs view {view:#?}");
    for thread in threads {
        let tid = thread["tid"].to_string();
        let expected = view.get(&tid).unwrap_or_else(|| panic!("dump lists thread {tid} that the interpreter does not"));
        assert_eq!(&thread["frames"], expected, "thread {tid} of {}", python.display());
    }
    let deepest = threads.iter().map(|t| t["frames"].as_array().unwrap().len()).max().unwrap();
    assert!(deepest > 500, "the 500-deep thread is missing ({deepest} frames at most)");
    let text = String::from_utf8_lossy(&dump(child.0.id(), false).stdout).into_owned();
    for expected in ["in Outer.method.<locals>.inner", "in größe_straße", "in 関数_名前", "in 𠀀𠀁", "in <lambda>", "File \"<exec-built>\", line 2, in built_by_exec"] {
        assert!(text.contains(expected), "traceback output lacks `{expected}`:\n{text}");
    }
}

#[test]
fn dump_matches_pyenv_3_13_0() {
    check_dump_matches_the_interpreter(&pyenv("3.13.0"));
}

#[test]
fn dump_matches_debian_3_13() {
    check_dump_matches_the_interpreter(&pythons().join("usr/bin/python3.13"));
}

#[test]
fn dump_matches_debian_3_14() {
    check_dump_matches_the_interpreter(&pythons().join("usr/bin/python3.14"));
}

#[test]
fn dump_matches_debian_3_15() {
    check_dump_matches_the_interpreter(&pythons().join("usr/bin/python3.15"));
}

fn assert_clean_error(output: &Output, expected: &str) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "expected a failure, got success");
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(expected), "stderr lacks `{expected}`: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "not one line: {stderr}");
}

#[test]
fn dump_of_a_non_python_process_is_a_clear_error() {
    let sleeper = Killed(Command::new("sleep").arg("30").spawn().unwrap());
    assert_clean_error(&dump(sleeper.0.id(), false), "is not a CPython process");
}

#[test]
fn dump_of_python_3_11_is_a_clear_error() {
    let old = Killed(Command::new(pyenv("3.11.7")).args(["-c", "import time; time.sleep(30)"]).spawn().unwrap());
    std::thread::sleep(Duration::from_millis(300));
    assert_clean_error(&dump(old.0.id(), false), "older than 3.13");
}

#[test]
fn dump_of_a_missing_process_is_a_clear_error() {
    let mut gone = Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    assert_clean_error(&dump(pid, false), "does not exist");
}

/// Processes that exit while being read: every outcome is a success or one clear error line.
#[test]
fn dump_of_a_process_exiting_mid_read_never_panics() {
    let python = pythons().join("usr/bin/python3.15");
    for delay_ms in [0u64, 5, 10, 20, 40, 80] {
        let child = Killed(
            Command::new(&python)
                .args(["-c", "import threading\nfor _ in range(50): threading.Thread(target=lambda: None).start()"])
                .spawn()
                .unwrap(),
        );
        std::thread::sleep(Duration::from_millis(delay_ms));
        let output = dump(child.0.id(), false);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains("panicked"), "{stderr}");
        if !output.status.success() {
            assert_eq!(stderr.trim_end().lines().count(), 1, "not one line: {stderr}");
        }
    }
}
