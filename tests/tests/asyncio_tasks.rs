//! Issue 21: `pyebpf dump --async` against asyncio programs whose task tree is known, on the
//! interpreters that have the asyncio debug offsets (3.14, 3.15), and its bounds and refusals.

use std::collections::HashMap;
use std::path::Path;

use pyebpf_tests::{assert_one_line_error, count_where, debian_python, record_collapsed, run_pyebpf, stacks_of, start_ready};
use serde_json::Value;

fn dump_tasks(pid: u32, extra: &[&str]) -> (Value, String) {
    let pid = pid.to_string();
    let mut args = vec!["dump", "--async", "-p", &pid];
    args.extend_from_slice(extra);
    let json = run_pyebpf(&[args.as_slice(), &["--json"]].concat());
    assert!(json.status.success(), "dump --async --json failed: {}", String::from_utf8_lossy(&json.stderr));
    let text = run_pyebpf(&args);
    assert!(text.status.success(), "dump --async failed: {}", String::from_utf8_lossy(&text.stderr));
    (serde_json::from_slice(&json.stdout).unwrap(), String::from_utf8(text.stdout).unwrap())
}

/// The function names of a task's frames, innermost first.
fn frame_names(task: &Value) -> Vec<&str> {
    task["frames"].as_array().unwrap().iter().map(|frame| frame["qualname"].as_str().unwrap()).collect()
}

fn check_tree(python: &Path) {
    let (child, _dir) = start_ready(python, "async_tree.py", &["tree"]);
    let (dump, text) = dump_tasks(child.pid(), &[]);
    let threads = dump["threads"].as_array().unwrap();
    assert_eq!(threads.len(), 1, "{dump:#}");
    let thread = &threads[0];
    assert_eq!(thread["loop_running"], true, "{dump:#}");
    let tasks = thread["tasks"].as_array().unwrap();
    let by_name: HashMap<&str, &Value> = tasks.iter().map(|task| (task["name"].as_str().unwrap(), task)).collect();
    let name_of: HashMap<&str, &str> = tasks.iter().map(|task| (task["id"].as_str().unwrap(), task["name"].as_str().unwrap())).collect();
    let mut names: Vec<&str> = by_name.keys().copied().collect();
    names.sort_unstable();
    assert_eq!(names, ["Task-1", "busy-1", "chain-1", "chain-2", "chain-3", "group", "idle-1", "parent", "worker-1", "worker-2"], "{dump:#}");
    assert_eq!(thread["tasks_total"], 10);
    // Who awaits whom, exactly.
    let expected_awaiter = [
        ("Task-1", None),
        ("parent", Some("Task-1")),
        ("chain-1", Some("Task-1")),
        ("group", Some("Task-1")),
        ("busy-1", Some("parent")),
        ("idle-1", Some("parent")),
        ("chain-2", Some("chain-1")),
        ("chain-3", Some("chain-2")),
        ("worker-1", Some("group")),
        ("worker-2", Some("group")),
    ];
    for (name, awaiter) in expected_awaiter {
        let awaited_by: Vec<&str> = by_name[name]["awaited_by"].as_array().unwrap().iter().map(|id| name_of[id.as_str().unwrap()]).collect();
        assert_eq!(awaited_by, awaiter.into_iter().collect::<Vec<_>>(), "awaiters of {name}: {dump:#}");
    }
    // The loop runs busy-1 and nothing else; each waiting task's coroutine chain ends where it waits.
    let busy = by_name["busy-1"];
    assert_eq!(thread["running_task"], busy["id"], "{dump:#}");
    assert_eq!(busy["state"], "running");
    let busy_frames = frame_names(busy);
    assert_eq!(busy_frames.last(), Some(&"busy_child"), "{dump:#}");
    assert!(busy_frames.len() <= 2 && busy_frames.iter().all(|name| ["crunch", "busy_child"].contains(name)), "busy-1: {busy_frames:?}");
    for (name, frames) in [
        ("Task-1", &["main"][..]),
        ("parent", &["parent"]),
        ("idle-1", &["sleep", "idle_child"]),
        ("chain-1", &["chain"]),
        ("chain-2", &["chain"]),
        ("chain-3", &["sleep", "chain"]),
        ("worker-1", &["Event.wait", "worker"]),
        ("worker-2", &["Event.wait", "worker"]),
    ] {
        assert_eq!(by_name[name]["state"], "waiting", "{name}: {dump:#}");
        assert_eq!(frame_names(by_name[name]), frames, "{name}: {dump:#}");
    }
    let group = frame_names(by_name["group"]);
    assert_eq!(group.last(), Some(&"group"), "{group:?}");
    assert!(group.contains(&"TaskGroup.__aexit__"), "{group:?}");
    // The text tree: each task under the one awaiting it, its stack as a traceback.
    for line in
        ["  [task Task-1] waiting", "    [task parent] waiting", "      [task busy-1] running", "      [task idle-1] waiting", "        [task chain-3] waiting"]
    {
        assert!(text.lines().any(|l| l == line), "no line `{line}` in:\n{text}");
    }
    assert!(text.contains(", in idle_child\n"), "{text}");
}

#[test]
fn task_tree_on_debian_3_14() {
    check_tree(&debian_python("3.14"));
}

#[test]
fn task_tree_on_debian_3_15() {
    check_tree(&debian_python("3.15"));
}

/// 10,000 suspended tasks: at most --max-tasks are read, the rest counted, and the cut said.
#[test]
fn ten_thousand_tasks_are_cut_and_counted() {
    let (child, _dir) = start_ready(&debian_python("3.15"), "async_tree.py", &["many", "10000"]);
    let (dump, text) = dump_tasks(child.pid(), &["--max-tasks", "500"]);
    let thread = &dump["threads"][0];
    assert_eq!(thread["tasks"].as_array().unwrap().len(), 500, "tasks read");
    // The sleepers and the main task.
    assert_eq!(thread["tasks_total"], 10_001);
    assert_eq!(thread["tasks_uncounted"], false);
    assert!(text.contains("9501 more tasks not read (at most 500 are: see --max-tasks)"), "{text}");
    let (dump, _) = dump_tasks(child.pid(), &[]);
    assert_eq!(dump["threads"][0]["tasks"].as_array().unwrap().len(), 1000, "the default bound");
}

/// 3.13 has no asyncio debug offsets: one line says so, rather than tasks guessed.
#[test]
fn older_interpreters_are_refused_in_one_line() {
    let (child, _dir) = start_ready(&debian_python("3.13"), "async_tree.py", &["many", "3"]);
    let output = run_pyebpf(&["dump", "--async", "-p", &child.pid().to_string()]);
    assert_one_line_error(&output, "asyncio tasks are read from CPython 3.14 on");
}

/// A stack's task frames and Python functions, root first: what `record --async-aware` puts above
/// the event loop (native frames and files left out).
fn task_path(frames: &[String]) -> Vec<&str> {
    let first_task = frames.iter().position(|frame| frame.starts_with("[task ")).unwrap_or(frames.len());
    frames[first_task..].iter().filter(|frame| frame.starts_with("[task ") || frame.contains(".py:")).map(|frame| frame.split(" (").next().unwrap()).collect()
}

/// busy-1 and chain-3 take turns every millisecond or so, each under its own chain of tasks: a
/// task read after the sample would put one's function under the other's tasks.
fn check_record_places_tasks(python: &Path) {
    let (child, _dir) = start_ready(python, "async_tree.py", &["alternate"]);
    let pid = child.pid().to_string();
    let (collapsed, stderr) = record_collapsed(&["-p", &pid, "-d", "3", "--async-aware"]);
    let stacks = stacks_of(&collapsed, child.pid());
    let busy = ["[task Task-1]", "main", "[task parent]", "parent", "[task busy-1]", "busy_child", "crunch"];
    let chained = ["[task Task-1]", "main", "[task chain-1]", "chain", "[task chain-2]", "chain", "[task chain-3]", "chain", "grind"];
    fn runs(leaf: &str) -> impl Fn(&[String]) -> bool + '_ {
        move |frames| frames.iter().any(|frame| frame.starts_with(&format!("{leaf} (")))
    }
    for (leaf, expected) in [("crunch", &busy[..]), ("grind", &chained[..])] {
        let all = count_where(&stacks, runs(leaf));
        let placed = count_where(&stacks, |frames| runs(leaf)(frames) && task_path(frames) == expected);
        assert!(all >= 100, "{leaf}: only {all} samples: {collapsed}");
        assert!(placed * 100 >= all * 95, "{leaf}: {placed} of {all} samples under {expected:?}:\n{collapsed}");
        // Never under the other task's chain.
        let other = if leaf == "crunch" { "[task chain-3]" } else { "[task busy-1]" };
        let wrong = count_where(&stacks, |frames| runs(leaf)(frames) && frames.iter().any(|frame| frame == other));
        assert_eq!(wrong, 0, "{leaf} under {other}:\n{collapsed}");
    }
    assert!(stderr.contains("asyncio: "), "{stderr}");
}

#[test]
fn record_places_tasks_on_debian_3_14() {
    check_record_places_tasks(&debian_python("3.14"));
}

#[test]
fn record_places_tasks_on_debian_3_15() {
    check_record_places_tasks(&debian_python("3.15"));
}

/// A chain of 12 tasks: the 8 innermost are shown, under a `[task …]` that marks the cut.
#[test]
fn record_cuts_task_chains_past_eight() {
    let (child, _dir) = start_ready(&debian_python("3.14"), "async_tree.py", &["deep", "12"]);
    let pid = child.pid().to_string();
    let (collapsed, stderr) = record_collapsed(&["-p", &pid, "-d", "2", "--async-aware", "--stats"]);
    // The task walk fits on top of the timer clock's callback: it samples here too.
    assert!(stderr.lines().any(|line| line.starts_with("sampling clock:") && line.contains(" timer ")), "{stderr}");
    let stacks = stacks_of(&collapsed, child.pid());
    let spinning = |frames: &[String]| frames.iter().any(|frame| frame.starts_with("crunch ("));
    let all = count_where(&stacks, spinning);
    let mut expected = vec!["[task …]".to_string()];
    for n in 5..=12 {
        expected.push(format!("[task deep-{n}]"));
        expected.push("deep".into());
    }
    expected.push("crunch".into());
    let cut = count_where(&stacks, |frames| spinning(frames) && task_path(frames) == expected);
    assert!(all >= 50 && cut * 100 >= all * 95, "{cut} of {all} samples under {expected:?}:\n{collapsed}");
    let summary_cut = stderr.lines().find(|line| line.contains("asyncio: ")).unwrap_or_else(|| panic!("{stderr}"));
    assert!(!summary_cut.contains(" 0 task chains cut"), "{stderr}");
}

/// 3.13 has no asyncio debug offsets: its stacks are recorded as ever, and the summary says its
/// tasks are not shown.
#[test]
fn record_async_aware_names_older_interpreters() {
    let (child, _dir) = start_ready(&debian_python("3.13"), "async_tree.py", &["deep", "2"]);
    let pid = child.pid().to_string();
    let (collapsed, stderr) = record_collapsed(&["-p", &pid, "-d", "1", "--async-aware"]);
    let stacks = stacks_of(&collapsed, child.pid());
    assert!(count_where(&stacks, |frames| frames.iter().any(|frame| frame.starts_with("crunch ("))) > 0, "{collapsed}");
    assert!(!collapsed.contains("[task "), "{collapsed}");
    assert!(stderr.contains("no asyncio tasks (pyebpf reads them from CPython 3.14 on): CPython 3.13"), "{stderr}");
}

/// Microseconds of the stacks of waiting tasks (`[awaiting]` leaves) whose task path is `path`.
fn waiting_us(stacks: &[pyebpf_tests::Stack], path: &[&str]) -> u64 {
    count_where(stacks, |frames| frames.last().is_some_and(|leaf| leaf == "[awaiting]") && task_path(frames) == path)
}

/// `--mode wall --async-aware`: each suspended task counts the whole recording under its own task
/// frame, with the tasks awaiting it above and what it waits on as its innermost frame; busy-1,
/// which never suspends, never waits.
fn check_waiting_tasks(python: &Path) {
    let (child, _dir) = start_ready(python, "async_tree.py", &["tree"]);
    let pid = child.pid().to_string();
    let (collapsed, stderr) = record_collapsed(&["-p", &pid, "-d", "3", "--mode", "wall", "--async-aware"]);
    let stacks = stacks_of(&collapsed, child.pid());
    let duration_us = 3_000_000;
    for path in [
        &["[task Task-1]", "main", "[task parent]", "parent", "[task idle-1]", "idle_child", "sleep"][..],
        &["[task Task-1]", "main", "[task chain-1]", "chain", "[task chain-2]", "chain", "[task chain-3]", "chain", "sleep"],
        &["[task Task-1]", "main", "[task group]", "group", "TaskGroup.__aexit__", "TaskGroup._aexit", "[task worker-1]", "worker", "Event.wait"],
        &["[task Task-1]", "main", "[task parent]", "parent"],
    ] {
        let us = waiting_us(&stacks, path);
        assert!(us * 100 >= duration_us * 95 && us * 100 <= duration_us * 105, "{path:?} waited {us} us of {duration_us}:\n{collapsed}");
    }
    let busy_waits = count_where(&stacks, |frames| frames.last().is_some_and(|leaf| leaf == "[awaiting]") && frames.iter().any(|f| f == "[task busy-1]"));
    assert_eq!(busy_waits, 0, "busy-1 never waits:\n{collapsed}");
    assert!(stderr.contains("asyncio waits: "), "{stderr}");
}

#[test]
fn wall_mode_accounts_waiting_tasks_on_debian_3_14() {
    check_waiting_tasks(&debian_python("3.14"));
}

#[test]
fn wall_mode_accounts_waiting_tasks_on_debian_3_15() {
    check_waiting_tasks(&debian_python("3.15"));
}

/// 10,000 sleeping tasks: each capture reads the 16 oldest waiting tasks, and the summary counts
/// the captures that had more.
#[test]
fn ten_thousand_waiting_tasks_are_cut_at_each_capture() {
    let (child, _dir) = start_ready(&debian_python("3.15"), "async_tree.py", &["many", "10000"]);
    let pid = child.pid().to_string();
    let (collapsed, stderr) = record_collapsed(&["-p", &pid, "-d", "2", "--mode", "wall", "--async-aware"]);
    let stacks = stacks_of(&collapsed, child.pid());
    let mut names: Vec<&str> = stacks
        .iter()
        .filter(|(frames, _)| frames.last().is_some_and(|leaf| leaf == "[awaiting]"))
        .filter_map(|(frames, _)| frames.iter().rev().find(|frame| frame.starts_with("[task ")).map(String::as_str))
        .collect();
    names.sort_unstable();
    names.dedup();
    // pyebpf reads 16 waiting tasks per capture (MAX_WAITING_TASKS).
    assert!(!names.is_empty() && names.len() <= 16, "{names:?}");
    let line = stderr.lines().find(|line| line.contains("asyncio waits: ")).unwrap_or_else(|| panic!("{stderr}"));
    assert!(!line.contains("(0 captures"), "{line}");
}

/// The same in pprof, read by `go tool pprof`: task frames are functions, and the waiting tasks'
/// samples carry `thread_state=task-wait`, so they can be kept alone or left out.
#[test]
fn waiting_tasks_are_labelled_in_pprof() {
    let (child, _dir) = start_ready(&debian_python("3.15"), "async_tree.py", &["tree"]);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tasks.pb.gz");
    let pid = child.pid().to_string();
    let record = run_pyebpf(&["record", "-p", &pid, "-d", "2", "--mode", "wall", "--async-aware", "-o", out.to_str().unwrap()]);
    assert!(record.status.success(), "{}", String::from_utf8_lossy(&record.stderr));
    let top = |filter: &str| {
        let output = std::process::Command::new("go")
            .args(["tool", "pprof", "-top", "-nodecount=200", "-sample_index=wall", filter])
            .arg(&out)
            .output()
            .expect("go tool pprof (golang-go) must be installed");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let tasks = top("-tagfocus=thread_state=task-wait");
    assert!(tasks.contains("[task idle-1]") && tasks.contains("Event.wait"), "{tasks}");
    assert!(!tasks.contains("[task busy-1]"), "busy-1 never waits: {tasks}");
    let threads = top("-tagignore=thread_state=task-wait");
    assert!(threads.contains("[task busy-1]") && !threads.contains("[task idle-1]"), "{threads}");
}
