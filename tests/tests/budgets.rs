//! Issue 7, part 3 end to end: what a target can make pyebpf read and keep is bounded. A target
//! pointing 3,000 functions' location tables at one shared 1 MiB `bytes` object (which once made
//! `dump` reach 3 GB), and a thread 10,000 frames deep, which `dump` shows as its innermost 4,096
//! frames marked truncated.

use std::fs::File;
use std::path::Path;

use pyebpf_tests::{debian_python, pyebpf_command, stacks_of, start_ready, total};
use serde_json::Value;

/// The memory bound the README documents for one target, with room for the binary itself.
const MAX_RSS: u64 = 256 << 20;

struct Measured {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    /// Peak resident set of the pyebpf process alone.
    max_rss: u64,
}

/// Runs `pyebpf ARGS` and measures its peak memory with `wait4`, which reports that one child's
/// `ru_maxrss` (RUSAGE_CHILDREN would mix in every child this test process ever reaped).
fn run_measured(args: &[&str]) -> Measured {
    let dir = tempfile::tempdir().unwrap();
    let (out_path, err_path) = (dir.path().join("stdout"), dir.path().join("stderr"));
    // Reaped below with wait4, which Child::wait cannot do (it needs the rusage).
    #[allow(clippy::zombie_processes)]
    let child = pyebpf_command().args(args).stdout(File::create(&out_path).unwrap()).stderr(File::create(&err_path).unwrap()).spawn().unwrap();
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `status` and `usage` are valid for writes; `pid` is our own unreaped child.
    let reaped = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(reaped, pid, "wait4: {}", std::io::Error::last_os_error());
    Measured {
        code: libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)),
        stdout: std::fs::read_to_string(&out_path).unwrap(),
        stderr: std::fs::read_to_string(&err_path).unwrap(),
        max_rss: usage.ru_maxrss as u64 * 1024,
    }
}

/// The least `ru_maxrss` any child of this test process reports: a child shares this process's
/// memory until it execs, and Linux counts that peak as the child's. Measured with a run that
/// allocates nothing, so a pyebpf peak is its own only where it is above this floor.
fn spawn_floor() -> u64 {
    run_measured(&["--version"]).max_rss
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

const CHAIN: usize = 3000;

fn check_shared_linetable_target(python: &Path) {
    let (target, _dir) = start_ready(python, "shared_linetable.py", &[&CHAIN.to_string()]);
    let pid = target.pid().to_string();

    let dump = run_measured(&["dump", "-p", &pid, "--json"]);
    let floor = spawn_floor();
    eprintln!("dump of the shared-line-table target under {}: max RSS {:.1} MiB (floor {:.1} MiB)", python.display(), mib(dump.max_rss), mib(floor));
    assert_eq!(dump.code, Some(0), "dump failed: {}", dump.stderr);
    assert!(dump.max_rss < MAX_RSS, "dump reached {:.1} MiB", mib(dump.max_rss));
    let dumped: Value = serde_json::from_str(&dump.stdout).unwrap();
    let main = dumped["threads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tid"].as_u64().map(|tid| tid.to_string()) == Some(pid.clone()))
        .expect("the main thread is dumped");
    let names: Vec<&str> = main["frames"].as_array().unwrap().iter().map(|f| f["qualname"].as_str().unwrap()).collect();
    for name in ["f0", "f1500", &format!("f{}", CHAIN - 1)] {
        assert!(names.contains(&name), "the chain's {name} is missing from the dump");
    }
    assert_eq!(main["truncated"], Value::Bool(false));

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("profile.folded");
    let out_arg = out.to_str().unwrap();
    let record = run_measured(&["record", "-p", &pid, "-d", "5", "-F", "499", "--stats", "-o", out_arg]);
    eprintln!(
        "record of the shared-line-table target under {}: max RSS {:.1} MiB (floor {:.1} MiB)\n{}",
        python.display(),
        mib(record.max_rss),
        mib(floor),
        record.stderr
    );
    assert_eq!(record.code, Some(0), "record failed: {}", record.stderr);
    assert!(record.max_rss < MAX_RSS, "record reached {:.1} MiB", mib(record.max_rss));
    assert!(record.stderr.contains("code objects cached:"), "--stats does not show the code cache: {}", record.stderr);
    let stacks = stacks_of(&std::fs::read_to_string(&out).unwrap(), target.pid());
    let innermost = format!("f{} (shared_linetable_chain.py:", CHAIN - 1);
    // The chain is deeper than the kernel walks (512 frames): its innermost frames, marked.
    let deep: Vec<_> = stacks.iter().filter(|(frames, _)| frames.iter().any(|f| f.starts_with(&innermost))).collect();
    assert!(!deep.is_empty(), "no sample shows the innermost frame ({} samples of the target)", total(&stacks));
    let mut cut_short = 0;
    for (frames, n) in &deep {
        assert_eq!(frames[0], "[truncated]", "a {CHAIN}-deep chain not marked truncated: {frames:?}");
        // The kept frames run under the interpreter the native stack reached, not above its root.
        let first_python = frames.iter().position(|f| f.contains("shared_linetable_chain.py:")).unwrap();
        assert!(!frames[first_python..].iter().any(|f| f == "_start" || f == "PyEval_EvalCode"), "Python frames placed above the native root: {frames:?}");
        if !frames.iter().any(|f| f.starts_with(&format!("f{} (", CHAIN - 500))) {
            cut_short += n;
        }
    }
    // A sample that joined a marker chain dropped meanwhile (its reader fell behind under load)
    // is cut where the kernel's walk stopped, marked: rare, never the rule.
    let deep_samples: u64 = deep.iter().map(|(_, n)| n).sum();
    assert!(cut_short * 100 <= deep_samples, "{cut_short} of {deep_samples} deep samples lost frame f{}", CHAIN - 500);
}

#[test]
fn shared_linetable_target_stays_bounded_3_14() {
    check_shared_linetable_target(&debian_python("3.14"));
}

#[test]
fn shared_linetable_target_stays_bounded_3_15() {
    check_shared_linetable_target(&debian_python("3.15"));
}

fn check_deep_stack(python: &Path) {
    let (target, _dir) = start_ready(python, "deep_stack.py", &["10000"]);
    let pid = target.pid().to_string();

    let json = run_measured(&["dump", "-p", &pid, "--json"]);
    assert_eq!(json.code, Some(0), "dump failed: {}", json.stderr);
    let dumped: Value = serde_json::from_str(&json.stdout).unwrap();
    let threads = dumped["threads"].as_array().unwrap();
    assert_eq!(threads.len(), 2, "{dumped:#}");
    let main = threads.iter().find(|t| t["tid"].as_u64().map(|tid| tid.to_string()) == Some(pid.clone())).expect("the main thread is dumped");
    let frames: Vec<&str> = main["frames"].as_array().unwrap().iter().map(|f| f["qualname"].as_str().unwrap()).collect();
    assert_eq!(frames.len(), 4096, "frames of the 10,000-deep thread under {}", python.display());
    assert_eq!(frames[0], "leaf", "the innermost frame is not first");
    assert!(frames[1..].iter().all(|&f| f == "recurse"), "frames other than recurse below leaf: the outermost ones were kept");
    assert_eq!(main["truncated"], Value::Bool(true));
    let other = threads.iter().find(|t| t["tid"].as_u64().map(|tid| tid.to_string()) != Some(pid.clone())).unwrap();
    assert_eq!(other["truncated"], Value::Bool(false));
    assert!(other["frames"].as_array().unwrap().iter().any(|f| f["qualname"] == "shallow"), "{other:#}");

    let text = run_measured(&["dump", "-p", &pid]);
    assert_eq!(text.code, Some(0), "dump failed: {}", text.stderr);
    assert_eq!(text.stdout.matches("... older frames not shown (the stack is deeper than 4096 frames)").count(), 1, "{}", text.stdout);
    assert_eq!(text.stdout.matches(", in recurse\n").count(), 4095);
    let main_traceback = text.stdout.split("\nThread ").find(|t| t.starts_with(&pid)).unwrap();
    assert!(main_traceback.trim_end().ends_with(", in leaf"), "the main thread's traceback does not end at leaf");
}

#[test]
fn deep_stack_dump_shows_the_innermost_frames_marked_truncated() {
    for version in ["3.13", "3.14", "3.15"] {
        check_deep_stack(&debian_python(version));
    }
}
