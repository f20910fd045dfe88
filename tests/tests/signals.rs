//! Issue 18: the stop-signal policy (README, "Stop signals") under the dispositions operators'
//! starts leave behind: `nohup` (SIGHUP ignored), a script's background job (SIGINT ignored), a
//! parent that blocked them. Each test sets its child's dispositions itself, so it gives the same
//! result however the suite was started.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pyebpf_tests::{debian_python, pyebpf_command, signal_masks, wait_after_signal, Killed, Sent};

/// Moments after the start at which a signal is sent, in ms: during loading, as sampling starts,
/// well into it.
const MOMENTS_MS: [u64; 4] = [3, 30, 300, 1000];

fn spinner() -> Killed {
    Killed(Command::new(debian_python("3.14")).args(["-c", "def policy_spin():\n    while True: pass\npolicy_spin()"]).stdin(Stdio::null()).spawn().unwrap())
}

/// How a test's parent leaves a signal for pyebpf.
#[derive(Clone, Copy)]
enum Left {
    Ignored,
    Blocked,
}

/// `pyebpf record -a -o DIR/profile.folded`, started with `signals` left as `left` (the others
/// at their defaults); returns the child, when it started and what its masks were then.
fn start(dir: &Path, left: Left, signals: &[libc::c_int]) -> (Child, Instant, String) {
    let mut command = pyebpf_command();
    command.args(["record", "-a", "-F", "499", "-o"]).arg(profile(dir)).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    let signals = signals.to_vec();
    // SAFETY: between fork and exec the closure calls only signal and sigprocmask functions,
    // which are async-signal-safe; it runs after the defaults set by `pyebpf_command`.
    unsafe {
        command.pre_exec(move || {
            let mut set = std::mem::zeroed::<libc::sigset_t>();
            libc::sigemptyset(&mut set);
            for &signal in &signals {
                match left {
                    Left::Ignored => {
                        libc::signal(signal, libc::SIG_IGN);
                    }
                    Left::Blocked => {
                        libc::sigaddset(&mut set, signal);
                    }
                }
            }
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            Ok(())
        });
    }
    let child = command.spawn().unwrap();
    let started = Instant::now();
    let masks = signal_masks(child.id());
    (child, started, masks)
}

fn profile(dir: &Path) -> PathBuf {
    dir.join("profile.folded")
}

fn send(child: &Child, signal: libc::c_int) {
    // SAFETY: kill takes a pid and a signal; the child is not reaped yet.
    assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
}

/// Whether `pid` has a handler for `signal` (`SigCgt`): pyebpf's first instruction has run.
fn handles(pid: u32, signal: libc::c_int) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let caught = status.lines().find_map(|l| l.strip_prefix("SigCgt:")).and_then(|v| u64::from_str_radix(v.trim(), 16).ok()).unwrap_or(0);
    caught & (1 << (signal - 1)) != 0
}

/// Sends `signal` and waits (at most 10 s) for pyebpf to stop; asserts it exited successfully
/// with a whole collapsed profile of the spinner.
fn stops_and_writes(child: Child, sent: Sent, dir: &Path) {
    send(&child, sent.signal);
    let output = wait_after_signal(child, &sent, Duration::from_secs(10));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{} at {} ms: pyebpf exited with {:?}: {stderr}", sent.name, sent.after_ms, output.status);
    let text = std::fs::read_to_string(profile(dir)).unwrap_or_else(|err| panic!("{} at {} ms: no profile ({err}): {stderr}", sent.name, sent.after_ms));
    assert!(text.is_empty() || text.ends_with('\n'), "{} at {} ms: the profile ends mid-line", sent.name, sent.after_ms);
    assert!(text.lines().all(|l| l.rsplit_once(' ').is_some_and(|(_, n)| n.parse::<u64>().is_ok_and(|n| n > 0))), "malformed profile:\n{text}");
    eprintln!("{} at {} ms: stopped, whole profile of {} lines", sent.name, sent.after_ms, text.lines().count());
}

fn wait_until(what: &str, limit: Duration, done: impl Fn() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < limit, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// `nohup`: SIGHUP left ignored stays ignored, at every moment of the run (from the first
/// instruction: the kernel drops it before then too); SIGTERM then stops it and it writes.
#[test]
fn sighup_left_ignored_is_ignored_for_the_whole_run() {
    let _spinner = spinner();
    for moment in std::iter::once(0).chain(MOMENTS_MS) {
        let dir = tempfile::tempdir().unwrap();
        let (mut child, started, at_start) = start(dir.path(), Left::Ignored, &[libc::SIGHUP]);
        std::thread::sleep(Duration::from_millis(moment).saturating_sub(started.elapsed()));
        let after_ms = started.elapsed().as_millis() as u64;
        send(&child, libc::SIGHUP);
        std::thread::sleep(Duration::from_millis(1500));
        if let Some(status) = child.try_wait().unwrap() {
            let mut stderr = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
            panic!("SIGHUP at {after_ms} ms stopped pyebpf under an ignored SIGHUP ({status}; at its start: {at_start}): {stderr}");
        }
        eprintln!("SIGHUP at {after_ms} ms: ignored (still recording 1.5 s later)");
        stops_and_writes(child, Sent { name: "SIGTERM", signal: libc::SIGTERM, after_ms: started.elapsed().as_millis() as u64, at_start }, dir.path());
    }
}

/// A script's background job: SIGINT (or SIGTERM) left ignored still stops pyebpf, which writes,
/// from its first instruction on. A signal sent before that instruction (during the exec) meets
/// the inherited ignore and is dropped by the kernel: that case is told apart by `SigCgt` at the
/// moment of sending, and pyebpf must then stop at the next one.
#[test]
fn sigint_and_sigterm_left_ignored_still_stop_and_write() {
    let _spinner = spinner();
    for (name, signal) in [("SIGINT", libc::SIGINT), ("SIGTERM", libc::SIGTERM)] {
        // At once, with nothing waited for.
        let dir = tempfile::tempdir().unwrap();
        let (mut child, started, at_start) = start(dir.path(), Left::Ignored, &[signal]);
        let handled = handles(child.id(), signal);
        let after_ms = started.elapsed().as_millis() as u64;
        send(&child, signal);
        if handled {
            stops_and_writes(child, Sent { name, signal, after_ms, at_start }, dir.path());
        } else {
            std::thread::sleep(Duration::from_millis(1500));
            if child.try_wait().unwrap().is_some() {
                eprintln!("{name} at {after_ms} ms (before pyebpf's first instruction): it stopped");
            } else {
                eprintln!("{name} at {after_ms} ms (before pyebpf's first instruction): dropped by the kernel, as the policy says");
                stops_and_writes(child, Sent { name, signal, after_ms: started.elapsed().as_millis() as u64, at_start }, dir.path());
            }
        }
        // At pyebpf's first instruction (its handler is in place), then later.
        let dir = tempfile::tempdir().unwrap();
        let (child, started, at_start) = start(dir.path(), Left::Ignored, &[signal]);
        wait_until("pyebpf handles the signal", Duration::from_secs(5), || handles(child.id(), signal));
        stops_and_writes(child, Sent { name, signal, after_ms: started.elapsed().as_millis() as u64, at_start }, dir.path());
        // A loaded machine can take longer than the first moment to reach that instruction; a
        // signal sent before it would be the dropped case above, so each moment waits for it.
        for moment in MOMENTS_MS {
            let dir = tempfile::tempdir().unwrap();
            let (child, started, at_start) = start(dir.path(), Left::Ignored, &[signal]);
            wait_until("pyebpf handles the signal", Duration::from_secs(5), || handles(child.id(), signal));
            std::thread::sleep(Duration::from_millis(moment).saturating_sub(started.elapsed()));
            stops_and_writes(child, Sent { name, signal, after_ms: started.elapsed().as_millis() as u64, at_start }, dir.path());
        }
    }
}

/// A stop signal the parent left blocked is held by the kernel, not dropped: sent at once, it
/// reaches pyebpf when pyebpf unblocks it, and stops it.
#[test]
fn stop_signals_left_blocked_are_unblocked() {
    let _spinner = spinner();
    let stops = [("SIGINT", libc::SIGINT), ("SIGTERM", libc::SIGTERM), ("SIGHUP", libc::SIGHUP)];
    for (name, signal) in stops {
        for moment in [0, 300] {
            let dir = tempfile::tempdir().unwrap();
            let (child, started, at_start) = start(dir.path(), Left::Blocked, &stops.map(|(_, s)| s));
            std::thread::sleep(Duration::from_millis(moment).saturating_sub(started.elapsed()));
            stops_and_writes(child, Sent { name, signal, after_ms: started.elapsed().as_millis() as u64, at_start }, dir.path());
        }
    }
}

/// `record -- COMMAND` starts COMMAND with the dispositions pyebpf's parent left: ignored SIGHUP
/// and SIGINT stay ignored there, as without pyebpf in between; with the defaults, none is.
#[test]
fn a_launched_command_inherits_what_the_parent_left_ignored() {
    for (left, expected) in [(true, 0b11u64), (false, 0)] {
        let dir = tempfile::tempdir().unwrap();
        let seen = dir.path().join("sigign");
        let mut command = pyebpf_command();
        command
            .args(["record", "-F", "49", "-o"])
            .arg(profile(dir.path()))
            .args(["--", "sh", "-c"])
            .arg(format!("grep SigIgn /proc/$$/status > {}", seen.display()));
        if left {
            // SAFETY: signal is async-signal-safe; the closure runs between fork and exec.
            unsafe {
                command.pre_exec(|| {
                    libc::signal(libc::SIGHUP, libc::SIG_IGN);
                    libc::signal(libc::SIGINT, libc::SIG_IGN);
                    Ok(())
                });
            }
        }
        let output = command.output().unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let line = std::fs::read_to_string(&seen).unwrap();
        let ignored = u64::from_str_radix(line.trim().trim_start_matches("SigIgn:").trim(), 16).unwrap();
        assert_eq!(ignored & 0b11, expected, "SIGHUP and SIGINT ignored in the command (parent left them ignored: {left}): {line}");
    }
}
