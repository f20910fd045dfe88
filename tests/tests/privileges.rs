//! Issue 13, least privilege: as an unprivileged user (nobody) holding only CAP_BPF, CAP_PERFMON
//! and CAP_SYS_PTRACE (`setpriv`, the same as `capsh --caps=... --user=nobody --addamb=...`),
//! `record -a` works, Python frames included; without any one of them, one line names it. An
//! interpreter in a directory nobody may enter is named as unreadable, not taken for no Python.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use pyebpf_tests::{assert_one_line_error, compile_c, count_where, pyebpf, stacks_of, total, Killed};

const CAPS: [&str; 3] = ["bpf", "perfmon", "sys_ptrace"];

/// pyebpf copied into a directory anyone may enter and write (for its output).
fn shared_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let bin = dir.path().join("pyebpf");
    std::fs::copy(pyebpf(), &bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    (dir, bin)
}

/// Runs `bin ARGS` as nobody with exactly `caps` (permitted, effective, inheritable, ambient and
/// bounding sets).
fn as_nobody_with(caps: &[&str], bin: &Path, args: &[&str]) -> Output {
    let set = std::iter::once("-all".to_string()).chain(caps.iter().map(|c| format!("+{c}"))).collect::<Vec<_>>().join(",");
    Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(format!("--inh-caps={set}"))
        .arg(format!("--ambient-caps={set}"))
        .arg(format!("--bounding-set={set}"))
        .arg("--")
        .arg(bin)
        .args(args)
        .output()
        .expect("setpriv (util-linux) must be installed")
}

/// A root-owned Debian `python{version}` spinning in `cap_spin`, run from a bind mount of the
/// test Pythons' prefix at `dir/pythons` (in its own mount namespace), so the interpreter's path
/// is as reachable as `dir` is: the test Pythons' own prefix may lie under `/root`.
fn python_under(dir: &Path, version: &str) -> Killed {
    let prefix = pyebpf_tests::test_pythons();
    let mount = dir.join("pythons");
    std::fs::create_dir_all(&mount).unwrap();
    let python = mount.join(format!("usr/bin/python{version}"));
    let child = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", "mount --bind \"$1\" \"$2\" && exec \"$3\" -c \"$4\"", "sh"])
        .arg(prefix)
        .arg(&mount)
        .arg(&python)
        .arg("def cap_spin():\n    while True: pass\ncap_spin()")
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    child_is_python(Killed(child))
}

fn child_is_python(child: Killed) -> Killed {
    let exe = std::fs::read_link(format!("/proc/{}/exe", child.pid())).unwrap();
    assert!(exe.to_string_lossy().contains("python3."), "the target did not start: {}", exe.display());
    child
}

#[test]
fn record_all_works_with_only_bpf_perfmon_and_sys_ptrace() {
    let (dir, bin) = shared_dir();
    // 3.15: pyebpf also writes its marker into the target, which needs ptrace access.
    let targets = [python_under(dir.path(), "3.14"), python_under(dir.path(), "3.15")];
    let out = dir.path().join("p.folded");
    let output = as_nobody_with(&CAPS, &bin, &["record", "-a", "-d", "3", "-F", "199", "-o", out.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "record -a with the three capabilities failed: {stderr}");
    let text = std::fs::read_to_string(&out).unwrap();
    for target in &targets {
        let stacks = stacks_of(&text, target.pid());
        let with = stacks.iter().filter(|(frames, _)| frames.iter().any(|f| f.starts_with("cap_spin ("))).map(|(_, n)| n).sum::<u64>();
        assert!(total(&stacks) >= 20, "only {} samples of {}: {stderr}", total(&stacks), target.pid());
        assert!(with * 10 >= total(&stacks) * 9, "{with} of {} samples of {} in cap_spin: {stderr}", total(&stacks), target.pid());
    }
}

/// Spins in leaf_fn under outer_fn → middle_fn. The call leaf_fn never makes keeps gcc from
/// leaving out its frame (shrink-wrapping), which would hide middle_fn from frame pointers.
const SPIN_C: &str = r#"
#include <unistd.h>
volatile unsigned long sink;
static int calls;
__attribute__((noinline)) void leaf_fn(void) { for (;;) { if (calls) sink += getppid(); else sink++; } }
__attribute__((noinline)) void middle_fn(void) { leaf_fn(); sink++; }
__attribute__((noinline)) void outer_fn(void) { middle_fn(); sink++; }
int main(int argc, char **argv) { (void)argv; calls = argc > 1; outer_fn(); return 0; }
"#;

/// Without CAP_SYS_ADMIN `/proc/PID/map_files` is closed to pyebpf, so native frames come from the
/// file at the path the target names, which pyebpf opens itself (inside the target's root, as a
/// regular file) and blazesym reads through that open descriptor.
#[test]
fn native_frames_resolve_without_cap_sys_admin() {
    let (dir, bin) = shared_dir();
    let spin = compile_c(dir.path(), "spin", SPIN_C, &["-O1", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"]);
    let target = Killed(Command::new(&spin).spawn().unwrap());
    std::thread::sleep(Duration::from_millis(100));
    let out = dir.path().join("p.folded");
    let output = as_nobody_with(&CAPS, &bin, &["record", "-p", &target.pid().to_string(), "-d", "2", "-o", out.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "record -p with the three capabilities failed: {stderr}");
    let text = std::fs::read_to_string(&out).unwrap();
    let stacks = stacks_of(&text, target.pid());
    let chained = count_where(&stacks, |frames| frames.join(";").contains("outer_fn;middle_fn;leaf_fn"));
    assert!(total(&stacks) >= 20, "only {} samples of {}: {stderr}", total(&stacks), target.pid());
    assert!(chained * 10 >= total(&stacks) * 9, "{chained} of {} samples in outer_fn;middle_fn;leaf_fn:\n{text}", total(&stacks));
}

#[test]
fn each_missing_capability_is_named() {
    let (dir, bin) = shared_dir();
    let out = dir.path().join("p.folded");
    for missing in CAPS {
        let caps: Vec<&str> = CAPS.into_iter().filter(|c| *c != missing).collect();
        let output = as_nobody_with(&caps, &bin, &["record", "-a", "-d", "1", "-o", out.to_str().unwrap()]);
        let name = format!("CAP_{}", missing.to_uppercase());
        assert_one_line_error(&output, &format!("lacks {name} ("));
        assert!(!out.exists(), "a failed recording left a file");
    }
}

#[test]
fn an_interpreter_nobody_may_open_is_named_not_taken_for_no_python() {
    let (dir, bin) = shared_dir();
    let closed = dir.path().join("closed");
    std::fs::create_dir(&closed).unwrap();
    std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).unwrap();
    let target = python_under(&closed, "3.14");
    let output = as_nobody_with(&CAPS, &bin, &["dump", "-p", &target.pid().to_string()]);
    assert_one_line_error(&output, "CAP_DAC_READ_SEARCH");
    assert!(String::from_utf8_lossy(&output.stderr).contains("Permission denied"), "{output:?}");
    // With it, the same process is read.
    let output = as_nobody_with(&["bpf", "perfmon", "sys_ptrace", "dac_read_search"], &bin, &["dump", "-p", &target.pid().to_string()]);
    assert!(output.status.success() && String::from_utf8_lossy(&output.stdout).contains("cap_spin"), "{output:?}");
}
