//! Issue 2 end to end: the sampler, `record` targets, signals, lost samples, errors and outputs,
//! on real C programs.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pyebpf_tests::{
    assert_one_line_error, compile_c, count_where, debian_python, pyebpf, pyebpf_command, pyebpf_without_tracefs, record_collapsed,
    record_collapsed_without_tracefs, run_pyebpf, signal_masks, stacks_of, threads_and_wchans, total, wait_after_signal, wait_for_file, without_tracefs,
    Killed, Sent,
};

/// Spins in leaf_fn under main → outer_fn → middle_fn (for argv[1] seconds, default forever);
/// with argv[2] = "syscalls" the leaf makes system calls instead.
const SPIN_C: &str = r#"
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
volatile unsigned long sink;
volatile sig_atomic_t stop;
static int syscalls;
static void on_alarm(int sig) { (void)sig; stop = 1; }
__attribute__((noinline)) void leaf_fn(void) { while (!stop) { if (syscalls) sink += getppid(); else sink++; } }
__attribute__((noinline)) void middle_fn(void) { leaf_fn(); sink++; }
__attribute__((noinline)) void outer_fn(void) { middle_fn(); sink++; }
int main(int argc, char **argv) {
    signal(SIGALRM, on_alarm);
    if (argc > 1) alarm(atoi(argv[1]));
    syscalls = argc > 2 && strcmp(argv[2], "syscalls") == 0;
    outer_fn();
    return 0;
}
"#;

/// Compiles SPIN_C with frame pointers everywhere (Debian's gcc omits them in leaf functions
/// unless told not to) into `dir/name`.
fn compile_spin(dir: &Path, name: &str) -> PathBuf {
    compile_c(dir, name, SPIN_C, &["-O1", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"])
}

fn spin(dir: &Path, args: &[&str]) -> Killed {
    let binary = dir.join("spin");
    if !binary.exists() {
        compile_spin(dir, "spin");
    }
    let child = Killed(Command::new(binary).args(args).spawn().unwrap());
    std::thread::sleep(Duration::from_millis(100));
    child
}

/// CPU time (user + system) a process has used so far, from `/proc/PID/stat`.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the parenthesised comm: state is field 3, utime 14 and stime 15.
    let after_comm = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<u64> = after_comm.split_whitespace().skip(11).take(2).map(|f| f.parse().unwrap()).collect();
    // SAFETY: sysconf has no preconditions.
    let ticks_per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    fields.iter().sum::<u64>() as f64 / ticks_per_second
}

fn go_pprof(args: &[&str], profile: &Path) -> String {
    let output = Command::new("go").args(["tool", "pprof"]).args(args).arg(profile).output().expect("go (golang-go) must be installed");
    assert!(output.status.success(), "go tool pprof {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn host_wide_recording_sees_the_whole_call_chain() {
    let dir = tempfile::tempdir().unwrap();
    let spinner = spin(dir.path(), &[]);
    let cpu_before = cpu_seconds(spinner.pid());
    let (collapsed, _) = record_collapsed(&["-a", "-d", "4", "-F", "99"]);
    let cpu = cpu_seconds(spinner.pid()) - cpu_before;
    let stacks = stacks_of(&collapsed, spinner.pid());
    let samples = total(&stacks);
    assert!(
        (317..=475).contains(&samples),
        "{samples} samples where 4 s at 99 Hz is 396 (±20%); the spinner ran {cpu:.2} s on a CPU meanwhile (a busy host gives it less)"
    );
    let chained = count_where(&stacks, |frames| frames.join(";").contains("main;outer_fn;middle_fn;leaf_fn"));
    assert!(chained * 10 >= samples * 9, "{chained} of {samples} samples have main;outer_fn;middle_fn;leaf_fn:\n{collapsed}");
}

#[test]
fn pprof_output_reads_in_go_tool_pprof() {
    let dir = tempfile::tempdir().unwrap();
    let spinner = spin(dir.path(), &[]);
    let profile = dir.path().join("profile.pb.gz");
    let output = run_pyebpf(&["record", "-a", "-d", "2", "-F", "99", "-o", profile.to_str().unwrap()]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let top = go_pprof(&["-top"], &profile);
    assert!(top.contains("leaf_fn"), "-top lacks leaf_fn:\n{top}");
    let traces = go_pprof(&["-traces"], &profile);
    let spinner_label = format!("pid:  {}\n", spinner.pid());
    // Other processes' traces can hold a `main` too, so the order is checked inside the spinner's own.
    let chain = ["leaf_fn", "middle_fn", "outer_fn", "main"];
    let in_order = |trace: &str| {
        let positions: Option<Vec<usize>> = chain.iter().map(|f| trace.find(&format!(" {f}\n"))).collect();
        positions.is_some_and(|p| p.windows(2).all(|w| w[0] < w[1]))
    };
    let spinner_traces: Vec<&str> = traces.split("-----------+").filter(|trace| trace.contains(&spinner_label)).collect();
    assert!(!spinner_traces.is_empty(), "no trace labelled {spinner_label:?}:\n{}", &traces[..traces.len().min(2000)]);
    assert!(spinner_traces.iter().any(|t| in_order(t)), "no spinner trace shows {chain:?} in order:\n{}", spinner_traces.join("\n"));
    let raw = go_pprof(&["-raw"], &profile);
    assert!(raw.contains("leaf_fn") && raw.contains("samples/count"), "-raw:\n{raw}");
}

#[test]
fn native_lines_come_from_dwarf_only_with_native_lines() {
    let dir = tempfile::tempdir().unwrap();
    let binary = compile_c(dir.path(), "spin", SPIN_C, &["-g", "-O1", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"]);
    let spinner = Killed(Command::new(&binary).spawn().unwrap());
    std::thread::sleep(Duration::from_millis(100));
    let pid = spinner.pid().to_string();
    // The locations `go tool pprof -raw` lists for leaf_fn: `N: 0xADDR M=1 leaf_fn FILE:LINE s=0`.
    let leaf_locations = |extra: &[&str], name: &str| -> Vec<String> {
        let profile = dir.path().join(name);
        let mut args = vec!["record", "-p", &pid, "-d", "2", "-F", "99", "-o", profile.to_str().unwrap()];
        args.extend_from_slice(extra);
        let output = run_pyebpf(&args);
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        go_pprof(&["-raw"], &profile).lines().filter(|line| line.contains(" leaf_fn ")).map(str::to_string).collect()
    };

    // By default from the symbol table: the function, without a file or line.
    let plain = leaf_locations(&[], "plain.pb.gz");
    assert!(!plain.is_empty() && plain.iter().all(|line| line.contains(" leaf_fn :0 ")), "{plain:#?}");
    // Asked for, from the binary's own DWARF.
    let with_lines = leaf_locations(&["--native-lines"], "lines.pb.gz");
    let source = format!("{}:", dir.path().join("spin.c").display());
    assert!(!with_lines.is_empty() && with_lines.iter().all(|line| line.contains(&source)), "{with_lines:#?} (want {source}LINE)");
}

fn interrupted_recording_still_writes(signal: i32, file: &str) {
    let dir = tempfile::tempdir().unwrap();
    let _spinner = spin(dir.path(), &[]);
    let out = dir.path().join(file);
    let recorder = pyebpf_command().args(["record", "-a", "-o"]).arg(&out).stderr(Stdio::piped()).spawn().unwrap();
    let at_start = signal_masks(recorder.id());
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(recorder.id() as i32, signal) }, 0);
    let sent = Sent { name: "the stop signal", signal, after_ms: 1500, at_start };
    let status = wait_after_signal(recorder, &sent, Duration::from_secs(10)).status;
    assert!(status.success(), "pyebpf exited with {status} after signal {signal}");
    if file.ends_with(".pb.gz") {
        let top = go_pprof(&["-top"], &out);
        assert!(top.contains("leaf_fn"), "{top}");
    } else {
        let text = std::fs::read_to_string(&out).unwrap();
        assert!(text.contains("leaf_fn"), "{text}");
    }
}

#[test]
fn sigint_still_writes_the_profile() {
    interrupted_recording_still_writes(libc::SIGINT, "profile.pb.gz");
}

#[test]
fn sigterm_still_writes_the_profile() {
    interrupted_recording_still_writes(libc::SIGTERM, "profile.folded");
}

#[test]
fn pid_mode_records_only_that_process() {
    let dir = tempfile::tempdir().unwrap();
    let wanted = spin(dir.path(), &[]);
    let other = spin(dir.path(), &[]);
    let cpu_before = cpu_seconds(wanted.pid());
    let (collapsed, _) = record_collapsed(&["-p", &wanted.pid().to_string(), "-d", "2"]);
    let cpu = cpu_seconds(wanted.pid()) - cpu_before;
    assert!(total(&stacks_of(&collapsed, wanted.pid())) > 100, "too few samples for 2 s at 99 Hz; the process ran {cpu:.2} s on a CPU meanwhile:\n{collapsed}");
    assert_eq!(total(&stacks_of(&collapsed, other.pid())), 0);
    assert!(collapsed.lines().all(|l| l.starts_with(&format!("spin ({})", wanted.pid()))), "{collapsed}");
}

#[test]
fn command_mode_follows_children_and_ends_with_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let binary = compile_spin(dir.path(), "spin");
    let script = format!("{0} 1 & {0} 2; wait", binary.display());
    let started = Instant::now();
    let (collapsed, _) = record_collapsed_without_tracefs(&["-d", "60", "--", "sh", "-c", &script]);
    assert!(started.elapsed() < Duration::from_secs(10), "pyebpf did not stop when the command ended");
    let spinners: std::collections::HashSet<&str> =
        collapsed.lines().filter(|l| l.starts_with("spin (") && l.contains("leaf_fn")).map(|l| l.split(';').next().unwrap()).collect();
    assert_eq!(spinners.len(), 2, "both children of the command should be sampled:\n{collapsed}");
}

#[test]
fn tests_without_tracefs_do_not_see_a_tracefs_mounted_on_the_host() {
    // The "host" here is a private namespace with tracefs and debugfs mounted (or already there,
    // as on a developer's machine); the wrapper must hide both before running its program.
    let check = "(mountpoint -q /sys/kernel/tracing || mount -t tracefs tracefs /sys/kernel/tracing) \
                 && (mountpoint -q /sys/kernel/debug || mount -t debugfs debugfs /sys/kernel/debug) \
                 && test -e /sys/kernel/tracing/events && test -e /sys/kernel/debug/tracing/events && exec \"$@\"";
    let wrapped_shell = without_tracefs("sh".as_ref());
    let output = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", check, "sh"])
        .arg(wrapped_shell.get_program())
        .args(wrapped_shell.get_args())
        .args(["-c", "find /sys/kernel/tracing /sys/kernel/debug -mindepth 1 -maxdepth 1 | wc -l"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "0", "tracefs or debugfs still mounted: {stderr}");
}

#[test]
fn pid_mode_ends_and_writes_when_the_process_exits() {
    let dir = tempfile::tempdir().unwrap();
    // Spins for 3 s (pyebpf's start-up on a loaded machine can take a second), then exits (and
    // stays an unreaped zombie of this test until dropped).
    let spinner = spin(dir.path(), &["3"]);
    let started = Instant::now();
    let (collapsed, stderr) = record_collapsed_without_tracefs(&["-p", &spinner.pid().to_string(), "-d", "30"]);
    let took = started.elapsed();
    assert!(took < Duration::from_secs(7), "pyebpf ran {took:?} after its only target exited after 3 s");
    // The exited spinner is an unreaped zombie: its CPU time is still readable.
    let cpu = cpu_seconds(spinner.pid());
    let stacks = stacks_of(&collapsed, spinner.pid());
    let leaf = count_where(&stacks, |frames| frames.iter().any(|f| f == "leaf_fn"));
    // A floor that holds on a loaded machine: the spinner's 1 s is wall time, not CPU time.
    assert!(leaf >= 5, "{leaf} samples in leaf_fn; the spinner ran {cpu:.2} s on a CPU in all: {stderr}\n{collapsed}");
}

/// A process the test did not start itself (a command pyebpf launched), held by a pidfd: a
/// failing test kills it rather than leave it spinning, and never hits a reused PID.
struct Grandchild(OwnedFd);

impl Grandchild {
    fn open(pid: u32) -> Grandchild {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        assert!(fd >= 0, "pidfd_open({pid}): {}", std::io::Error::last_os_error());
        // SAFETY: a descriptor just created, owned by nobody else.
        Grandchild(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }

    fn exited(&self) -> bool {
        let mut poll = libc::pollfd { fd: self.0.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, zero timeout.
        unsafe { libc::poll(&mut poll, 1, 0) == 1 }
    }
}

impl Drop for Grandchild {
    fn drop(&mut self) {
        // SAFETY: pidfd_send_signal on our own pidfd; harmless once the process has exited.
        unsafe { libc::syscall(libc::SYS_pidfd_send_signal, self.0.as_raw_fd(), libc::SIGKILL, std::ptr::null::<libc::siginfo_t>(), 0) };
    }
}

/// Starts `record -d 30 -- COMMAND` without tracefs, sends `signal` to pyebpf once COMMAND has
/// written its PID to `ready`, and checks that COMMAND got the signal (it writes `got`) and
/// exited, and that pyebpf then wrote the profile and exited 0 soon after. Returns the profile.
fn command_gets_the_signal(signal: i32, command: &[&str], dir: &Path) -> String {
    let out = dir.join("profile.folded");
    let stderr_path = dir.join("stderr");
    let mut recorder = pyebpf_without_tracefs()
        .args(["record", "-d", "30", "-o"])
        .arg(&out)
        .arg("--")
        .args(command)
        // A file, not a pipe: a command left running would hold a pipe open.
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    wait_for_file(&dir.join("ready"), "the command");
    let command_pid: u32 = std::fs::read_to_string(dir.join("ready")).unwrap().trim().parse().unwrap();
    let command = Grandchild::open(command_pid);
    std::thread::sleep(Duration::from_secs(1));
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(recorder.id() as i32, signal) }, 0);
    let signalled = Instant::now();
    let status = loop {
        if let Some(status) = recorder.try_wait().unwrap() {
            break status;
        }
        if signalled.elapsed() > Duration::from_secs(10) {
            let (masks, threads) = (signal_masks(recorder.id()), threads_and_wchans(recorder.id()));
            let _ = recorder.kill();
            let _ = recorder.wait();
            panic!("pyebpf still ran 10 s after signal {signal}, sent 1 s into the command; masks: {masks}; threads: {threads}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(status.success(), "pyebpf exited with {status} after signal {signal}: {stderr}");
    assert!(signalled.elapsed() < Duration::from_secs(5), "pyebpf took {:?} to finish", signalled.elapsed());
    assert!(command.exited(), "pyebpf finished while its command still ran: {stderr}");
    let got = std::fs::read_to_string(dir.join("got")).unwrap_or_else(|_| panic!("the command did not get signal {signal}: {stderr}"));
    assert!(!got.is_empty());
    std::fs::read_to_string(&out).unwrap()
}

/// Samples whose root is `COMM (PID)` for this comm.
fn samples_of_comm(collapsed: &str, comm: &str) -> u64 {
    let root = format!("{comm} (");
    collapsed.lines().filter(|l| l.starts_with(&root)).filter_map(|l| l.rsplit_once(' ')?.1.parse::<u64>().ok()).sum()
}

#[test]
fn sigterm_goes_to_the_command_and_pyebpf_writes_after_it_exits() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!("trap 'echo term > {0}/got; exit 0' TERM; echo $$ > {0}/pid; mv {0}/pid {0}/ready; while :; do :; done", dir.path().display());
    let collapsed = command_gets_the_signal(libc::SIGTERM, &["sh", "-c", &script], dir.path());
    let shell_samples = samples_of_comm(&collapsed, "sh");
    assert!(shell_samples >= 5, "{shell_samples} samples of the spinning shell in ~1 s at 99 Hz:\n{collapsed}");
}

#[test]
fn sigint_goes_to_a_python_command_as_keyboard_interrupt() {
    let dir = tempfile::tempdir().unwrap();
    // The loop body has a line of its own: 3.11 does not catch an interrupt in `while True: pass`.
    let program = "import os, pathlib, sys\n\
                   d = pathlib.Path(sys.argv[1])\n\
                   (d / 'pid').write_text(str(os.getpid()))\n\
                   (d / 'pid').rename(d / 'ready')\n\
                   try:\n    while True:\n        sum(range(100))\n\
                   except KeyboardInterrupt:\n    (d / 'got').write_text('KeyboardInterrupt')\n";
    let python = debian_python("3.13");
    let command = [python.to_str().unwrap(), "-c", program, dir.path().to_str().unwrap()];
    let collapsed = command_gets_the_signal(libc::SIGINT, &command, dir.path());
    assert_eq!(std::fs::read_to_string(dir.path().join("got")).unwrap(), "KeyboardInterrupt");
    let python_samples = samples_of_comm(&collapsed, "python3.13");
    assert!(python_samples >= 5, "{python_samples} samples of the spinning Python in ~1 s at 99 Hz:\n{collapsed}");
}

#[test]
fn a_kernel_without_btf_is_one_clear_line() {
    // The kernel's BTF hidden under an empty tmpfs, in a private mount namespace.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p.folded");
    let output = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs none /sys/kernel/btf && exec \"$@\"", "sh"])
        .arg(pyebpf())
        .args(["record", "-d", "1", "-o"])
        .arg(&out)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_one_line_error(&output, "this kernel has no BTF (/sys/kernel/btf/vmlinux is missing)");
    assert!(!out.exists(), "a failed recording left a file");
}

#[test]
fn lost_samples_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let _spinners = [spin(dir.path(), &[]), spin(dir.path(), &[])];
    // Lost samples are looked for every 2 s while recording: 3 s has one look at least.
    let (_, stderr) = record_collapsed(&["-a", "-d", "3", "-F", "10000", "--ring-buffer-kb", "4"]);
    let lost: u64 = stderr
        .lines()
        .find_map(|l| l.strip_suffix(" lost)").and_then(|l| l.rsplit_once('(')).and_then(|(_, n)| n.parse().ok()))
        .unwrap_or_else(|| panic!("no lost-sample count in the summary: {stderr}"));
    assert!(lost > 0, "a 4 KiB ring buffer at 10 kHz lost nothing: {stderr}");
    assert!(stderr.contains("pyebpf: lost "), "no warning while recording: {stderr}");
}

#[test]
fn kernel_stacks_end_in_k() {
    let dir = tempfile::tempdir().unwrap();
    let spinner = spin(dir.path(), &["60", "syscalls"]);
    let (collapsed, _) = record_collapsed(&["-p", &spinner.pid().to_string(), "-d", "2", "--kernel"]);
    let stacks = stacks_of(&collapsed, spinner.pid());
    // glibc's getppid keeps no frame of its own, so a frame-pointer unwind goes from it to middle_fn.
    let in_kernel = count_where(&stacks, |frames| frames.last().is_some_and(|f| f.ends_with("_[k]")) && frames.iter().any(|f| f == "middle_fn"));
    assert!(in_kernel * 4 > total(&stacks), "{in_kernel} of {} samples end in kernel frames:\n{collapsed}", total(&stacks));
    // The timer clock reads kernel stacks inside its own soft interrupt: its frames are not the
    // sampled thread's.
    let clock_frame = |frame: &String| ["bpf_timer_cb", "hrtimer_run_softirq", "on_tick"].iter().any(|name| frame.contains(name));
    let with_clock = count_where(&stacks, |frames| frames.iter().any(clock_frame));
    assert_eq!(with_clock, 0, "samples with the clock's own frames:\n{collapsed}");
}

#[test]
fn bad_arguments_fail_before_sampling_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p.pb.gz");
    let mut gone = Command::new("true").spawn().unwrap();
    let pid = gone.id().to_string();
    gone.wait().unwrap();
    assert_one_line_error(&run_pyebpf(&["record", "-p", &pid, "-o", out.to_str().unwrap()]), "no such process");
    assert!(!out.exists(), "a failed recording left a file");
    let missing = dir.path().join("no/such/dir/p.pb.gz");
    assert_one_line_error(&run_pyebpf(&["record", "-a", "-d", "1", "-o", missing.to_str().unwrap()]), "cannot write");
    assert_one_line_error(&run_pyebpf(&["record", "-a", "-d", "1", "--ring-buffer-kb", "3", "-o", out.to_str().unwrap()]), "power of two");
}
