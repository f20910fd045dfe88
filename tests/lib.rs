//! Helpers shared by the end-to-end tests in `tests/tests/`: they run the real `pyebpf` binary
//! (`PYEBPF_BIN`) against real processes; `cargo xtask test` sets the environment.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub fn pyebpf() -> PathBuf {
    let bin = PathBuf::from(std::env::var("PYEBPF_BIN").expect("PYEBPF_BIN must name the pyebpf binary (cargo xtask test sets it)"));
    assert!(bin.exists(), "PYEBPF_BIN {} does not exist", bin.display());
    bin
}

/// Debian's test interpreter `python3.X`, installed by `cargo xtask test`.
pub fn debian_python(version: &str) -> PathBuf {
    let prefix = PathBuf::from(std::env::var("PYEBPF_PYTHONS").expect("PYEBPF_PYTHONS must name the test Pythons' prefix (cargo xtask test sets it)"));
    let path = prefix.join(format!("usr/bin/python{version}"));
    assert!(path.exists(), "test interpreter missing: {}", path.display());
    path
}

/// pyenv's interpreter of this exact version (`3.13.0`).
pub fn pyenv_python(version: &str) -> PathBuf {
    let root = std::env::var("PYENV_ROOT").map(PathBuf::from).unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap()).join(".pyenv"));
    let minor = version.rsplit_once('.').map_or(version, |(minor, _)| minor);
    let path = root.join(format!("versions/{version}/bin/python{minor}"));
    assert!(path.exists(), "pyenv's Python {version} is missing at {}", path.display());
    path
}

pub fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts").join(name)
}

/// A child process, killed when dropped.
pub struct Killed(pub Child);

impl Killed {
    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn wait_for_file(path: &Path, what: &str) {
    let started = Instant::now();
    while !path.exists() {
        assert!(started.elapsed() < Duration::from_secs(30), "{what} did not get ready");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `program script READY_FILE args...` and waits until the script writes READY_FILE.
pub fn start_ready(program: &Path, script_name: &str, args: &[&str]) -> (Killed, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("ready");
    let child = Killed(Command::new(program).arg(script(script_name)).arg(&ready).args(args).stdin(Stdio::null()).spawn().unwrap());
    wait_for_file(&ready, &format!("{script_name} under {}", program.display()));
    (child, dir)
}

/// Runs `pyebpf ARGS`.
pub fn run_pyebpf(args: &[&str]) -> Output {
    Command::new(pyebpf()).args(args).output().unwrap()
}

/// Unmounts tracefs (and debugfs, which mounts it again on access) in the caller's fresh mount
/// namespace, fails with 99 if it is still visible, then runs its arguments.
const WITHOUT_TRACEFS: &str = "for m in /sys/kernel/debug/tracing /sys/kernel/tracing /sys/kernel/debug; do \
        while umount \"$m\" 2>/dev/null; do :; done; \
    done; \
    if [ -e /sys/kernel/tracing/events ] || [ -e /sys/kernel/debug/tracing/events ]; then \
        echo 'tracefs still visible' >&2; exit 99; \
    fi; \
    exec \"$@\"";

/// `pyebpf`, run in a private mount namespace where tracefs is not mounted: what follows the
/// kernel's events must work on a machine without tracefs, and a test of it cannot pass because
/// someone mounted tracefs on the host. The process is pyebpf itself (the wrappers exec it).
pub fn pyebpf_without_tracefs() -> Command {
    without_tracefs(pyebpf().as_os_str())
}

/// `program`, run in a private mount namespace where tracefs is not mounted (see
/// [`pyebpf_without_tracefs`]).
pub fn without_tracefs(program: &std::ffi::OsStr) -> Command {
    let mut command = Command::new("unshare");
    command.args(["--mount", "--propagation", "private", "sh", "-c", WITHOUT_TRACEFS, "sh"]).arg(program);
    command
}

/// Runs `pyebpf record -o DIR/profile.folded ARGS` and returns (collapsed text, stderr).
pub fn record_collapsed(args: &[&str]) -> (String, String) {
    record_collapsed_by(Command::new(pyebpf()), args)
}

/// [`record_collapsed`] with tracefs unmounted ([`pyebpf_without_tracefs`]).
pub fn record_collapsed_without_tracefs(args: &[&str]) -> (String, String) {
    record_collapsed_by(pyebpf_without_tracefs(), args)
}

fn record_collapsed_by(mut pyebpf: Command, args: &[&str]) -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("profile.folded");
    let output = pyebpf.arg("record").arg("-o").arg(&out).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "pyebpf record {args:?} failed: {stderr}");
    (std::fs::read_to_string(&out).unwrap(), stderr)
}

/// One collapsed line: frames root first, without the `COMM (PID)` root, and its count.
pub type Stack = (Vec<String>, u64);

/// The stacks of one process in collapsed output.
pub fn stacks_of(collapsed: &str, pid: u32) -> Vec<Stack> {
    let root_suffix = format!(" ({pid})");
    collapsed
        .lines()
        .filter_map(|line| {
            let (stack, count) = line.rsplit_once(' ')?;
            let mut frames = stack.split(';');
            let root = frames.next()?;
            root.ends_with(&root_suffix).then(|| (frames.map(str::to_string).collect(), count.parse().unwrap()))
        })
        .collect()
}

pub fn total(stacks: &[Stack]) -> u64 {
    stacks.iter().map(|(_, n)| n).sum()
}

pub fn count_where(stacks: &[Stack], keep: impl Fn(&[String]) -> bool) -> u64 {
    stacks.iter().filter(|(frames, _)| keep(frames)).map(|(_, n)| n).sum()
}

/// Compiles the C program `source` with gcc and `flags` into `dir/name`.
pub fn compile_c(dir: &Path, name: &str, source: &str, flags: &[&str]) -> PathBuf {
    let file = dir.join(format!("{name}.c"));
    std::fs::write(&file, source).unwrap();
    let binary = dir.join(name);
    let status = Command::new("gcc").args(flags).arg("-o").arg(&binary).arg(&file).status().expect("gcc must be installed (cargo xtask test installs it)");
    assert!(status.success(), "gcc failed on {}", file.display());
    binary
}

/// Asserts a failed run printed exactly one line, containing `expected`, and no panic.
pub fn assert_one_line_error(output: &Output, expected: &str) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "expected a failure, got success: {stderr}");
    assert!(stderr.contains(expected), "stderr lacks `{expected}`: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "not one line: {stderr}");
}
