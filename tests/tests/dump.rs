//! Issue 3 end to end: `pyebpf dump --json` against each real interpreter's own view of its threads.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use pyebpf_tests::{
    assert_one_line_error, debian_python, free_threaded_python, pyebpf_command, pyenv_python, script, start_ready, system_python_3_11, wait_for_file, Killed,
};
use serde_json::Value;

fn dump(pid: u32, json: bool) -> Output {
    let mut command = pyebpf_command();
    command.args(["dump", "-p", &pid.to_string()]);
    if json {
        command.arg("--json");
    }
    command.output().unwrap()
}

/// Whether `python` names functions by qualified name (3.11+) or plain name.
fn qualified(python: &Path) -> bool {
    !["3.8", "3.9", "3.10"].iter().any(|old| python.to_string_lossy().ends_with(&format!("python{old}")))
}

fn check_dump_matches_the_interpreter(python: &Path) {
    check_dump_beside_spinners(python, 0);
}

/// [`check_dump_matches_the_interpreter`] while `spinners` more threads run Python all along:
/// theirs are shown with their functions (they have no fixed line), the others' exactly.
fn check_dump_beside_spinners(python: &Path, spinners: usize) {
    let dir = tempfile::tempdir().unwrap();
    let view_file = dir.path().join("view.json");
    let child = Killed(Command::new(python).arg(script("dump_state.py")).arg(&view_file).arg(spinners.to_string()).stdin(Stdio::null()).spawn().unwrap());
    wait_for_file(&view_file, &format!("dump_state.py under {}", python.display()));
    // The reporting thread exits right after writing the view.
    std::thread::sleep(Duration::from_millis(300));
    let view: Value = serde_json::from_str(&std::fs::read_to_string(&view_file).unwrap()).unwrap();
    let output = dump(child.0.id(), true);
    assert!(output.status.success(), "dump failed: {}", String::from_utf8_lossy(&output.stderr));
    let dumped: Value = serde_json::from_slice(&output.stdout).unwrap();
    let threads = dumped["threads"].as_array().unwrap();
    let view = view.as_object().unwrap();
    let spinning: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(view_file.with_extension("json.spinning")).unwrap()).unwrap();
    assert_eq!(spinning.len(), spinners);
    assert_eq!(threads.len(), view.len() + spinners, "threads: dump {dumped:#} vs view {view:#?} and {spinners} spinning");
    for thread in threads {
        let tid = thread["tid"].to_string();
        if spinning.contains(&thread["tid"]) {
            let names: Vec<&str> = thread["frames"].as_array().unwrap().iter().filter_map(|f| f["qualname"].as_str()).collect();
            assert_eq!(names, ["spinning", "Thread.run", "Thread._bootstrap_inner", "Thread._bootstrap"], "spinning thread {tid}");
            assert_eq!(thread["attached"], true, "a thread running Python is attached: {thread:#}");
            continue;
        }
        let expected = view.get(&tid).unwrap_or_else(|| panic!("dump lists thread {tid} that the interpreter does not"));
        assert_eq!(&thread["frames"], expected, "thread {tid} of {}", python.display());
    }
    let deepest = threads.iter().map(|t| t["frames"].as_array().unwrap().len()).max().unwrap();
    assert!(deepest > 600, "the 600-deep thread is missing ({deepest} frames at most)");
    let text = String::from_utf8_lossy(&dump(child.0.id(), false).stdout).into_owned();
    if spinners > 0 {
        assert_eq!(dumped["free_threaded"], true, "{dumped:#}");
        assert!(threads.iter().all(|t| t["holds_gil"] == false), "a GIL holder where there is no GIL: {dumped:#}");
        assert!(text.starts_with(&format!("Process {}: free-threaded CPython 3.13", child.0.id())), "{text}");
        assert!(text.matches("[attached]").count() >= spinners, "{text}");
    }
    let (inner, init) = if qualified(python) { ("in Outer.method.<locals>.inner", "in Constructed.__init__") } else { ("in inner", "in __init__") };
    for expected in [inner, "in größe_straße", "in 関数_名前", "in 𠀀𠀁", "in <lambda>", "File \"<exec-built>\", line 2, in built_by_exec", init] {
        assert!(text.contains(expected), "traceback output lacks `{expected}`:\n{text}");
    }
    assert!(!text.contains("File \"__init__\""), "the interpreter's __init__ trampoline is shown:\n{text}");
}

#[test]
fn dump_matches_pyenv_3_8_18() {
    check_dump_matches_the_interpreter(&pyenv_python("3.8.18"));
}

#[test]
fn dump_matches_pyenv_3_9_18() {
    check_dump_matches_the_interpreter(&pyenv_python("3.9.18"));
}

#[test]
fn dump_matches_pyenv_3_10_13() {
    check_dump_matches_the_interpreter(&pyenv_python("3.10.13"));
}

#[test]
fn dump_matches_pyenv_3_11_7() {
    check_dump_matches_the_interpreter(&pyenv_python("3.11.7"));
}

#[test]
fn dump_matches_system_3_11() {
    check_dump_matches_the_interpreter(&system_python_3_11());
}

#[test]
fn dump_matches_pyenv_3_12_1() {
    check_dump_matches_the_interpreter(&pyenv_python("3.12.1"));
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

/// Free-threaded: every thread as the interpreter sees it while two more run Python in parallel,
/// each attached thread marked, and no GIL holder.
#[test]
fn dump_matches_free_threaded_3_13_beside_running_threads() {
    let python = free_threaded_python();
    check_dump_beside_spinners(&python, 2);
}

#[test]
fn dump_matches_debian_3_15() {
    check_dump_matches_the_interpreter(&debian_python("3.15"));
}

/// The thread spinning in Python code is the GIL holder in most dumps; the waiting ones never are.
#[test]
fn dump_names_the_gil_holder() {
    for python in [
        pyenv_python("3.8.18"),
        pyenv_python("3.10.13"),
        pyenv_python("3.11.7"),
        system_python_3_11(),
        pyenv_python("3.12.1"),
        debian_python("3.13"),
        debian_python("3.14"),
        debian_python("3.15"),
    ] {
        let (child, dir) = start_ready(&python, "gil_spinner.py", &[]);
        let spinner: u64 = std::fs::read_to_string(dir.path().join("ready")).unwrap().trim().parse().unwrap();
        let mut spinner_held = 0;
        for _ in 0..20 {
            let output = dump(child.pid(), true);
            assert!(output.status.success(), "dump failed: {}", String::from_utf8_lossy(&output.stderr));
            let dumped: Value = serde_json::from_slice(&output.stdout).unwrap();
            for thread in dumped["threads"].as_array().unwrap() {
                let holds = thread["holds_gil"].as_bool().unwrap();
                if thread["tid"].as_u64() == Some(spinner) {
                    spinner_held += usize::from(holds);
                } else {
                    assert!(!holds, "waiting thread {} reported as the GIL holder under {}", thread["tid"], python.display());
                }
            }
        }
        assert!(spinner_held >= 10, "the spinning thread held the GIL in only {spinner_held} of 20 dumps under {}", python.display());
    }
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

/// Every CPython older than 3.8 on these machines is named, with its version (from the
/// interpreter's file name: 3.7 has `_PyRuntime`, 2.7 and 3.6 do not), in one line.
#[test]
fn dump_of_an_older_python_names_its_version() {
    let pyenv = ["2.7.18", "3.6.15", "3.7.16"];
    let expected = ["CPython 2.7 ", "CPython 3.6 ", "CPython 3.7 "];
    for (python, expected) in pyenv.iter().map(|v| pyenv_python(v)).zip(expected) {
        assert!(python.exists(), "{} is missing", python.display());
        let old = Killed(Command::new(&python).args(["-c", "import time; time.sleep(30)"]).spawn().unwrap());
        std::thread::sleep(Duration::from_millis(300));
        let output = dump(old.0.id(), false);
        assert_clean_error(&output, &format!("{expected}is not supported"));
        eprintln!("{}: {}", python.display(), String::from_utf8_lossy(&output.stderr).trim());
    }
}

#[test]
fn dump_of_a_missing_process_is_a_clear_error() {
    let mut gone = Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    assert_clean_error(&dump(pid, false), "does not exist");
}

/// A process that exits while being dumped: back-to-back dumps until it is gone; each one either
/// succeeds or fails with one clear line, and none panics.
#[test]
fn dump_of_a_process_exiting_mid_read_is_a_clear_error() {
    for version in ["3.13", "3.15"] {
        let (_child, _dir) = start_ready(&debian_python(version), "exits_soon.py", &["0.5"]);
        let mut outcomes = std::collections::BTreeMap::<String, usize>::new();
        let started = std::time::Instant::now();
        loop {
            assert!(started.elapsed() < Duration::from_secs(30), "the process never ended: {outcomes:?}");
            let output = dump(_child.pid(), false);
            let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
            assert!(!stderr.contains("panicked"), "{stderr}");
            if output.status.success() {
                *outcomes.entry("ok".into()).or_default() += 1;
                continue;
            }
            assert_eq!(output.status.code(), Some(1), "{stderr}");
            assert_eq!(stderr.trim_end().lines().count(), 1, "not one line: {stderr}");
            assert!(stderr.contains("exited"), "an exiting process gave another error: {stderr}");
            let gone = stderr.contains("has exited)");
            *outcomes.entry(stderr.split(": ").last().unwrap_or_default().trim().to_string()).or_default() += 1;
            if gone {
                break;
            }
        }
        eprintln!("dumps of an exiting {version} process: {outcomes:?}");
        assert!(outcomes.get("ok").is_some_and(|&n| n > 0), "no dump succeeded before the exit: {outcomes:?}");
    }
}

/// A thread running `fib(22)` changes its stack all the time: a dump still reads it whole (it
/// tries again from the new current frame when a read lands on a frame that just went away).
fn check_dump_of_a_busy_thread(python: &Path) {
    let (target, _dir) = start_ready(python, "busy_recursion.py", &[]);
    let mut whole = 0;
    let mut failures = Vec::new();
    for _ in 0..100 {
        let output = dump(target.pid(), true);
        let stdout = String::from_utf8_lossy(&output.stdout);
        let parsed: Option<Value> = serde_json::from_str(&stdout).ok();
        let main = parsed.as_ref().and_then(|p| p["threads"].as_array()?.iter().find(|t| t["tid"] == target.pid()).cloned());
        let read_whole = output.status.success()
            && main.as_ref().is_some_and(|t| {
                let names: Vec<&str> = t["frames"].as_array().unwrap().iter().filter_map(|f| f["qualname"].as_str()).collect();
                t.get("error").is_none() && names.last() == Some(&"<module>") && names.first() == Some(&"fib")
            });
        if read_whole {
            whole += 1;
        } else {
            failures.push(format!("{}{}", stdout, String::from_utf8_lossy(&output.stderr)));
        }
    }
    assert!(whole >= 99, "{}: {whole} of 100 dumps read the busy stack whole; first failure:\n{}", python.display(), failures[0]);
}

#[test]
fn dump_of_a_busy_thread_debian_3_14() {
    check_dump_of_a_busy_thread(&debian_python("3.14"));
}

#[test]
fn dump_of_a_busy_thread_debian_3_15() {
    check_dump_of_a_busy_thread(&debian_python("3.15"));
}

/// A thread that entered a subinterpreter has a thread state in each interpreter: both are shown,
/// each with its interpreter, and the one it does not run in now is marked parked.
#[test]
fn dump_labels_each_interpreter_of_a_thread_in_a_subinterpreter() {
    let (target, _dir) = start_ready(&debian_python("3.14"), "subinterpreter.py", &[]);
    let output = dump(target.pid(), false);
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{text}{}", String::from_utf8_lossy(&output.stderr));
    let blocks: Vec<&str> = text.split("\nThread ").skip(1).collect();
    let main = format!("{} (python3.14) in interpreter ", target.pid());
    let running = blocks.iter().find(|b| b.starts_with(&main) && !b.starts_with(&format!("{main}0"))).unwrap_or_else(|| panic!("{text}"));
    assert!(!running.contains("[parked") && running.contains("in sub_spin"), "{text}");
    let parked = blocks.iter().find(|b| b.starts_with(&format!("{main}0"))).unwrap_or_else(|| panic!("{text}"));
    assert!(parked.lines().next().unwrap().ends_with("[parked: the thread runs in another interpreter]"), "{text}");
    assert!(parked.contains("in enter_sub") && !parked.contains("sub_spin"), "{text}");
    let json: Value = serde_json::from_slice(&dump(target.pid(), true).stdout).unwrap();
    let states: Vec<(i64, bool)> = json["threads"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["tid"] == target.pid())
        .map(|t| (t["interpreter"].as_i64().unwrap(), t["parked"].as_bool().unwrap()))
        .collect();
    assert_eq!(states.len(), 2, "{json}");
    assert!(states.contains(&(0, true)) && states.iter().any(|&(id, parked)| id != 0 && !parked), "{states:?}");
}
