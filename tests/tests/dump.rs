//! Issue 3 end to end: `pyebpf dump --json` against each real interpreter's own view of its threads.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use pyebpf_tests::{assert_one_line_error, debian_python, pyebpf, pyenv_python, script, wait_for_file, Killed};
use serde_json::Value;

fn dump(pid: u32, json: bool) -> Output {
    let mut command = Command::new(pyebpf());
    command.args(["dump", "-p", &pid.to_string()]);
    if json {
        command.arg("--json");
    }
    command.output().unwrap()
}

fn check_dump_matches_the_interpreter(python: &Path) {
    let dir = tempfile::tempdir().unwrap();
    let view_file = dir.path().join("view.json");
    let child = Killed(Command::new(python).arg(script("dump_state.py")).arg(&view_file).stdin(Stdio::null()).spawn().unwrap());
    wait_for_file(&view_file, &format!("dump_state.py under {}", python.display()));
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
    check_dump_matches_the_interpreter(&pyenv_python("3.13.0"));
}

#[test]
fn dump_matches_debian_3_13() {
    check_dump_matches_the_interpreter(&debian_python("3.13"));
}

#[test]
fn dump_matches_debian_3_14() {
    check_dump_matches_the_interpreter(&debian_python("3.14"));
}

#[test]
fn dump_matches_debian_3_15() {
    check_dump_matches_the_interpreter(&debian_python("3.15"));
}

fn assert_clean_error(output: &Output, expected: &str) {
    assert_eq!(output.status.code(), Some(1));
    assert_one_line_error(output, expected);
}

#[test]
fn dump_of_a_non_python_process_is_a_clear_error() {
    let sleeper = Killed(Command::new("sleep").arg("30").spawn().unwrap());
    assert_clean_error(&dump(sleeper.0.id(), false), "is not a CPython process");
}

#[test]
fn dump_of_python_3_11_is_a_clear_error() {
    let old = Killed(Command::new(pyenv_python("3.11.7")).args(["-c", "import time; time.sleep(30)"]).spawn().unwrap());
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
    let python = debian_python("3.15");
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
