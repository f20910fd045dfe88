//! Helpers shared by the end-to-end tests in `tests/tests/`: they run the real `pyebpf` binary
//! (`PYEBPF_BIN`) against real processes; `cargo xtask test` sets the environment.

pub mod otlp;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The value of `name`, one of the variables `cargo xtask test` sets; without it (a plain `cargo
/// test`), one line says so and the test binary exits, rather than a panic per test.
pub fn xtask_env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| needs_xtask(&format!("{name} is not set")))
}

/// Says in one line that these tests need what `cargo xtask test` provides (`missing` is what is
/// not there) and ends the test binary with status 2.
pub fn needs_xtask(missing: &str) -> ! {
    // Straight to the file descriptor: libtest captures `eprintln!`, and drops what it captured
    // when the binary exits.
    let line = format!("{missing}: these tests run under `cargo xtask test`, which builds pyebpf, installs what they need and sets it up\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    std::process::exit(2);
}

/// The test interpreters' prefix (`PYEBPF_PYTHONS`).
pub fn test_pythons() -> PathBuf {
    PathBuf::from(xtask_env("PYEBPF_PYTHONS"))
}

pub fn pyebpf() -> PathBuf {
    let bin = PathBuf::from(xtask_env("PYEBPF_BIN"));
    assert!(bin.exists(), "PYEBPF_BIN {} does not exist", bin.display());
    bin
}

/// The signals a test may send, and those a shell or `nohup` may have left ignored or blocked.
const STOP_SIGNALS: [libc::c_int; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

/// Has `command` start with SIGINT, SIGTERM, SIGHUP and SIGQUIT at their defaults and unblocked,
/// whatever the test suite inherited (`nohup`, a script's background job): what a test sends then
/// has the effect it has on a plain start. Tests of other dispositions set them after this.
pub fn with_default_signals(command: &mut Command) -> &mut Command {
    // SAFETY: between fork and exec the closure calls only signal and sigprocmask functions,
    // which are async-signal-safe, on a set of its own.
    unsafe {
        command.pre_exec(|| {
            let mut set = std::mem::zeroed::<libc::sigset_t>();
            libc::sigemptyset(&mut set);
            for signal in STOP_SIGNALS {
                if libc::signal(signal, libc::SIG_DFL) == libc::SIG_ERR {
                    return Err(std::io::Error::last_os_error());
                }
                libc::sigaddset(&mut set, signal);
            }
            if libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

/// `pyebpf`, to be started with its stop signals at their defaults ([`with_default_signals`]).
pub fn pyebpf_command() -> Command {
    let mut command = Command::new(pyebpf());
    with_default_signals(&mut command);
    command
}

/// A signal sent to a child: what it was and when, for the report if the child does not stop.
pub struct Sent {
    pub name: &'static str,
    pub signal: libc::c_int,
    /// Milliseconds after the child's start.
    pub after_ms: u64,
    /// The child's `SigIgn`, `SigBlk` and `SigCgt` lines just after it was started (what it
    /// inherited, unless it had already set its own).
    pub at_start: String,
}

/// The `Sig*` lines of `/proc/PID/status`.
pub fn signal_masks(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status.lines().filter(|l| ["SigIgn:", "SigBlk:", "SigCgt:"].iter().any(|k| l.starts_with(k))).collect::<Vec<_>>().join(" ")
}

/// Each thread of `pid` as `TID COMM (WCHAN)`: where a stuck process waits.
pub fn threads_and_wchans(pid: u32) -> String {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return "(gone)".into() };
    let read = |tid: &str, file: &str| std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/{file}")).unwrap_or_default().trim().to_string();
    tasks
        .filter_map(|t| t.ok())
        .map(|t| {
            let tid = t.file_name().to_string_lossy().into_owned();
            format!("{tid} {} ({})", read(&tid, "comm"), read(&tid, "wchan"))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Waits up to `limit` for `child` to exit after `sent`; returns its output. If it does not, it
/// says why it might not have (the signal, the moment, its masks at the start and now, each
/// thread's name and wait channel), kills it, and panics.
pub fn wait_after_signal(child: Child, sent: &Sent, limit: Duration) -> Output {
    let pid = child.id();
    let started = Instant::now();
    let waiter = std::thread::spawn(move || child.wait_with_output().unwrap());
    while !waiter.is_finished() {
        if started.elapsed() > limit {
            let report = format!(
                "pyebpf {pid} still ran {limit:?} after {} sent {} ms after its start; at its start: {}; now: {}; threads: {}",
                sent.name,
                sent.after_ms,
                sent.at_start,
                signal_masks(pid),
                threads_and_wchans(pid)
            );
            // SAFETY: kill takes a pid and a signal; the child is not reaped yet.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            let _ = waiter.join();
            panic!("{report}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    waiter.join().unwrap()
}

/// Debian's test interpreter `python3.X`, installed by `cargo xtask test`.
pub fn debian_python(version: &str) -> PathBuf {
    let path = test_pythons().join(format!("usr/bin/python{version}"));
    assert!(path.exists(), "test interpreter missing: {}", path.display());
    path
}

/// The free-threaded CPython 3.13 (`python3.13t`, GIL disabled) that `cargo xtask test` builds
/// from Debian's source package (`PYEBPF_FREE_THREADED`).
pub fn free_threaded_python() -> PathBuf {
    let path = PathBuf::from(xtask_env("PYEBPF_FREE_THREADED"));
    assert!(path.exists(), "the free-threaded test interpreter is missing at {} (cargo xtask setup builds it)", path.display());
    path
}

/// Debian 12's own `python3.11` (3.11.2, stripped, libpython linked into the executable), which
/// `cargo xtask test` installs where it is missing.
pub fn system_python_3_11() -> PathBuf {
    let path = PathBuf::from("/usr/bin/python3.11");
    assert!(path.exists(), "Debian's python3.11 is missing at {} (apt-get install python3.11)", path.display());
    path
}

/// pyenv's interpreter of this exact version (`3.13.0`).
pub fn pyenv_python(version: &str) -> PathBuf {
    let root = std::env::var("PYENV_ROOT").map(PathBuf::from).unwrap_or_else(|_| PathBuf::from(xtask_env("HOME")).join(".pyenv"));
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
    pyebpf_command().args(args).output().unwrap()
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
    with_default_signals(&mut command);
    command
}

/// Runs `pyebpf record -o DIR/profile.folded ARGS` and returns (collapsed text, stderr).
pub fn record_collapsed(args: &[&str]) -> (String, String) {
    record_collapsed_by(pyebpf_command(), args)
}

/// [`record_collapsed`] with tracefs unmounted ([`pyebpf_without_tracefs`]).
pub fn record_collapsed_without_tracefs(args: &[&str]) -> (String, String) {
    record_collapsed_by(pyebpf_without_tracefs(), args)
}

/// [`record_collapsed`] by the given command (with its own environment, say).
pub fn record_collapsed_by(mut pyebpf: Command, args: &[&str]) -> (String, String) {
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

/// A number from the `--stats` line starting with `label` (after any indent): the `index`-th
/// number on it.
pub fn stats_number(stderr: &str, label: &str, index: usize) -> f64 {
    let line = stderr.lines().map(str::trim_start).find(|l| l.starts_with(label)).unwrap_or_else(|| panic!("no `{label}` in --stats:\n{stderr}"));
    line[label.len()..]
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter(|s| !s.is_empty() && s.parse::<f64>().is_ok())
        .nth(index)
        .unwrap_or_else(|| panic!("`{line}` has no number {index}"))
        .parse()
        .unwrap()
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

/// `KEY:\tN` values (`prog_id`, `map_id`, `link_id`) of a process's file descriptors.
pub fn bpf_ids(pid: u32, key: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else { return Vec::new() };
    let prefix = format!("{key}:");
    let mut ids: Vec<u32> = entries
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path()).ok())
        .flat_map(|info| info.lines().filter_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok()).collect::<Vec<u32>>())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// `bpftool ARGS`'s standard output.
pub fn bpftool(args: &[&str]) -> String {
    let output = Command::new("bpftool").args(args).output().expect("bpftool must be installed (cargo xtask test installs it)");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The id of the BPF map named `name` that the process holds, if it holds one.
pub fn bpf_map_id(pid: u32, name: &str) -> Option<u32> {
    bpf_ids(pid, "map_id").into_iter().find(|id| bpftool(&["map", "show", "id", &id.to_string()]).contains(&format!("name {name} ")))
}

/// The keys of a BPF hash map whose keys are `u32`s, as `bpftool -j map dump` shows them (bytes
/// in hex, little-endian, where the map has no BTF).
pub fn bpf_map_u32_keys(id: u32) -> Vec<u32> {
    let dump = bpftool(&["-j", "map", "dump", "id", &id.to_string()]);
    let entries: Vec<serde_json::Value> = serde_json::from_str(&dump).unwrap_or_else(|err| panic!("bpftool's dump of map {id}: {err}: {dump}"));
    entries
        .iter()
        .map(|entry| match &entry["key"] {
            serde_json::Value::Array(bytes) => {
                let bytes: Vec<u8> = bytes.iter().map(|b| u8::from_str_radix(b.as_str().unwrap().trim_start_matches("0x"), 16).unwrap()).collect();
                u32::from_le_bytes(bytes.try_into().unwrap_or_else(|b| panic!("a key of {} bytes in map {id}", Vec::len(&b))))
            }
            key => key.as_u64().and_then(|k| u32::try_from(k).ok()).unwrap_or_else(|| panic!("map {id}: key {key}")),
        })
        .collect()
}

/// The context switches of `pid`'s thread named `name` so far.
fn switches_of_thread(pid: u32, name: &str) -> u64 {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        let status = std::fs::read_to_string(task.path().join("status")).unwrap();
        return status
            .lines()
            .filter(|line| line.starts_with("voluntary_ctxt_switches") || line.starts_with("nonvoluntary_ctxt_switches"))
            .map(|line| line.split_whitespace().last().unwrap().parse::<u64>().unwrap())
            .sum();
    }
    panic!("pyebpf (pid {pid}) has no thread named {name}");
}

/// How often pyebpf's reader thread was woken while `pyebpf record -p PID -F 49 -d 6` profiled
/// `pid`, over the 3 s after its first 2 (past start-up: the process attached, its first second
/// over), with the samples the run wrote in all and its stderr. Fails if pyebpf fails.
pub fn reader_wakes_at_49_hz(pid: u32) -> (u64, u64, String) {
    let out = tempfile::tempdir().unwrap();
    let profile = out.path().join("profile.pb.gz");
    let pid = pid.to_string();
    let args = ["record", "-p", &pid, "-F", "49", "-d", "6", "-o", profile.to_str().unwrap()];
    let pyebpf = pyebpf_command().args(args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(2000));
    let before = switches_of_thread(pyebpf.id(), "pyebpf-reader");
    std::thread::sleep(Duration::from_millis(3000));
    let woken = switches_of_thread(pyebpf.id(), "pyebpf-reader") - before;
    let output = pyebpf.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "pyebpf failed: {stderr}");
    let samples = stderr.split(" samples").next().and_then(|head| head.rsplit(' ').next()).and_then(|n| n.parse().ok()).unwrap_or(0);
    (woken, samples, stderr)
}

/// `start(callback, native_s, seconds)`: a thread that spins in C for `native_s`, then calls
/// `callback` (if any) over and over, 0.3 ms apart, until `seconds`; returns its index.
const C_THREADS_LIBRARY: &str = r#"
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct job { void (*callback)(void); double native_s, seconds; volatile long tid; };
static struct job jobs[8];
static pthread_t threads[8];
static int started;
static volatile unsigned long sink;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void *run(void *arg) {
    struct job *job = arg;
    double start = now();
    job->tid = syscall(SYS_gettid);
    while (now() - start < job->native_s)
        sink++;
    while (job->callback && now() - start < job->seconds) {
        job->callback();
        /* Out of the running for as long as a call: the GIL goes round, rather than between
           two threads while a third waits (as glibc's condition variable may have it). */
        usleep(5000);
    }
    return 0;
}

int start(void (*callback)(void), double native_s, double seconds) {
    if (started == 8)
        return -1;
    jobs[started] = (struct job){ callback, native_s, seconds, 0 };
    if (pthread_create(&threads[started], 0, run, &jobs[started]))
        return -1;
    return started++;
}

long tid_of(int index) { return index >= 0 && index < started ? jobs[index].tid : 0; }

void join_all(void) {
    for (int i = 0; i < started; i++)
        pthread_join(threads[i], 0);
}
"#;

fn c_threads_library(dir: &Path) -> PathBuf {
    compile_c(dir, "libcthreads.so", C_THREADS_LIBRARY, &["-O2", "-shared", "-fPIC", "-pthread"])
}

/// Starts `c_threads.py` (C threads in a Python process) in `mode` under `python` with `env`,
/// building its library in `dir`; the process and its C threads' ids by name.
pub fn start_c_threads(python: &Path, dir: &Path, mode: &str, seconds: &str, env: &[(&str, &str)]) -> (Killed, Vec<(String, u32)>) {
    let ready = dir.join("ready");
    let mut command = Command::new(python);
    command.arg(script("c_threads.py")).arg(&ready).arg(c_threads_library(dir)).args([seconds, mode]).envs(env.iter().copied()).stdin(Stdio::null());
    let child = Killed(command.spawn().unwrap());
    wait_for_file(&ready, &format!("c_threads.py {mode} under {}", python.display()));
    // Written in one go, but read it whole.
    std::thread::sleep(Duration::from_millis(50));
    let threads = std::fs::read_to_string(&ready)
        .unwrap()
        .lines()
        .map(|line| {
            let (name, tid) = line.split_once(' ').unwrap();
            (name.to_string(), tid.parse().unwrap())
        })
        .collect();
    (child, threads)
}
