//! Issue 13 end to end: bad values, closed standard error, SIGHUP, `--rotate`, a soak (bounded
//! memory in a long run), and hostile targets.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use pyebpf_tests::{assert_one_line_error, debian_python, pyebpf, pyebpf_command, run_pyebpf, stacks_of, start_ready, total, Killed};

/// A Python process spinning in `spin` forever, under Debian's 3.14.
fn python_spinner() -> Killed {
    let child = Command::new(debian_python("3.14")).args(["-c", "def spin():\n    while True: pass\nspin()"]).stdin(Stdio::null()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    Killed(child)
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    files
}

#[test]
fn bad_values_fail_before_sampling_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p.folded");
    let out = out.to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["-d", "inf"], "--duration"),
        (&["-d", "1e20"], "--duration"),
        (&["-d", "NaN"], "--duration"),
        (&["--duration=-1"], "--duration"),
        (&["-d", "0"], "--duration"),
        (&["-d", "soon"], "--duration"),
        (&["--ring-buffer-kb", "4194304"], "--ring-buffer-kb"),
        (&["--ring-buffer-kb", "4294967296"], "--ring-buffer-kb"),
        (&["--ring-buffer-kb", "1000"], "power of two"),
        (&["-F", "0"], "--frequency"),
        (&["-F", "1000000"], "--frequency"),
        (&["-F", "99999999999999999999999"], "--frequency"),
        (&["--rotate", "0"], "--rotate"),
        (&["--rotate", "1e3"], "--rotate"),
        // A negative number is a bad value, not an unknown option followed by usage help.
        (&["-d", "-1"], "--duration"),
        (&["-d", "-0"], "--duration"),
        // Rounds to a recording of no time at all.
        (&["-d", "1e-12"], "--duration"),
        (&["-F", "-5"], "--frequency"),
        (&["--rotate", "-1"], "--rotate"),
        (&["--ring-buffer-kb", "0"], "--ring-buffer-kb"),
        (&["--ring-buffer-kb", "-4"], "--ring-buffer-kb"),
        (&["--max-python-frames", "0"], "--max-python-frames"),
        (&["--max-python-frames", "-3"], "--max-python-frames"),
        (&["--max-python-frames", "513"], "--max-python-frames"),
        // A choice names the values it allows on the same line.
        (&["--unwind", "xyz"], "possible values: fp, dwarf, auto"),
        (&["--format", "xyz"], "possible values: pprof, collapsed"),
    ];
    for (args, expected) in cases {
        let started = Instant::now();
        let mut all = vec!["record", "-a", "-o", out];
        all.extend_from_slice(args);
        let output = run_pyebpf(&all);
        assert_one_line_error(&output, expected);
        assert_ne!(output.status.code(), Some(101), "{args:?} panicked");
        assert!(started.elapsed() < Duration::from_secs(2), "{args:?} sampled before failing");
        assert!(files_in(dir.path()).is_empty(), "{args:?} left a file");
    }
    for args in [&["record", "-p", "-1", "-o", out][..], &["top", "-F", "0"], &["top", "-F", "-1"], &["top", "-p", "-1"], &["dump", "-p", "-1"]] {
        let output = run_pyebpf(args);
        assert_one_line_error(&output, "invalid value");
        assert_eq!(output.status.code(), Some(2), "{args:?}");
    }
    // --rotate writes new files next to a file name; standard output cannot be rotated.
    assert_one_line_error(&run_pyebpf(&["record", "-a", "-d", "1", "--rotate", "1", "-o", "-"]), "--rotate");
    assert_one_line_error(&run_pyebpf(&["record", "-a", "-d", "1", "--rotate", "1", "-o", "/dev/null"]), "--rotate");
}

/// `pyebpf` copied where an unprivileged user can run it.
/// `--version` names the version, the commit built from (this checkout's HEAD) and the CPythons read.
#[test]
fn version_names_the_commit_and_the_pythons_read() {
    let output = run_pyebpf(&["--version"]);
    assert!(output.status.success(), "{output:?}");
    let text = String::from_utf8_lossy(&output.stdout);
    let head = Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).current_dir(env!("CARGO_MANIFEST_DIR")).output().unwrap();
    let head = String::from_utf8_lossy(&head.stdout).trim().to_string();
    assert_eq!(head.len(), 12, "no git HEAD to compare with");
    assert_eq!(text.trim(), format!("pyebpf {} (commit {head}; reads CPython 3.8 to 3.15, and free-threaded 3.13)", env!("CARGO_PKG_VERSION")));
}

fn runnable_by_anyone(dir: &Path) -> PathBuf {
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = dir.join("pyebpf");
    std::fs::copy(pyebpf(), &bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

fn as_nobody(bin: &Path, args: &[&str]) -> Output {
    Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(bin)
        .args(args)
        .output()
        .expect("setpriv (util-linux) must be installed")
}

#[test]
fn dump_of_a_process_that_cannot_be_read_says_permission_denied() {
    let dir = tempfile::tempdir().unwrap();
    let bin = runnable_by_anyone(dir.path());
    assert_one_line_error(&as_nobody(&bin, &["dump", "-p", "1"]), "permission denied");
    let spinner = python_spinner();
    let output = as_nobody(&bin, &["dump", "-p", &spinner.pid().to_string()]);
    assert_one_line_error(&output, "permission denied");
    assert!(!String::from_utf8_lossy(&output.stderr).contains("does not exist"), "{output:?}");
    // A process that is really gone still says so.
    let gone = {
        let mut child = Command::new("true").spawn().unwrap();
        child.wait().unwrap();
        child.id()
    };
    assert_one_line_error(&run_pyebpf(&["dump", "-p", &gone.to_string()]), "does not exist");
}

#[test]
fn a_write_error_says_its_cause_once() {
    let _spinner = python_spinner();
    let output = run_pyebpf(&["record", "-a", "-d", "0.5", "--format", "collapsed", "-o", "/dev/full"]);
    assert_one_line_error(&output, "No space left on device");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.matches("No space left on device").count(), 1, "{stderr}");
}

/// Runs `sh -c 'exec pyebpf ARGS REDIRECTION'`.
fn with_stderr(redirection: &str, args: &[&str]) -> Output {
    let script = format!("exec \"$0\" \"$@\" {redirection}");
    Command::new("sh").arg("-c").arg(script).arg(pyebpf()).args(args).output().unwrap()
}

#[test]
fn closed_or_broken_stderr_never_panics() {
    let _spinner = python_spinner();
    let dir = tempfile::tempdir().unwrap();
    // Closed, then a pipe nobody reads (`2>&-` vs a pipe whose reader exited).
    for (name, redirection) in [("closed.folded", "2>&-"), ("broken.folded", "2>&1 | true")] {
        let out = dir.path().join(name);
        let out = out.to_str().unwrap();
        let script = format!("\"$0\" \"$@\" {redirection}; echo rc=$?");
        let shell = |args: &[&str]| Command::new("bash").arg("-c").arg(&script).arg(pyebpf()).args(args).output().unwrap();
        let recorded = shell(&["record", "-a", "-d", "1", "--stats", "-o", out]);
        let rc = String::from_utf8_lossy(&recorded.stdout).trim().to_string();
        if redirection == "2>&-" {
            assert_eq!(rc, "rc=0", "{redirection}: {recorded:?}");
        }
        let text = std::fs::read_to_string(out).unwrap_or_else(|err| panic!("{redirection}: no profile: {err}"));
        assert!(text.lines().count() > 0, "{redirection}: empty profile");
        // An error with nowhere to go still exits with its own status, not a panic's 101.
        let failed = with_stderr("2>&-", &["record", "-a", "-d", "inf", "-o", out]);
        assert_eq!(failed.status.code(), Some(2), "{failed:?}");
        let failed = with_stderr("2>&-", &["dump", "-p", "4194304"]);
        assert_eq!(failed.status.code(), Some(1), "{failed:?}");
    }
}

#[test]
fn sighup_still_writes_the_profile() {
    let spinner = python_spinner();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("hup.folded");
    let recorder = pyebpf_command().args(["record", "-a", "-o"]).arg(&out).stderr(Stdio::piped()).spawn().unwrap();
    let at_start = pyebpf_tests::signal_masks(recorder.id());
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(recorder.id() as i32, libc::SIGHUP) }, 0);
    let sent = pyebpf_tests::Sent { name: "SIGHUP", signal: libc::SIGHUP, after_ms: 1500, at_start };
    let status = pyebpf_tests::wait_after_signal(recorder, &sent, Duration::from_secs(10)).status;
    assert!(status.success(), "pyebpf exited with {status} after SIGHUP");
    let text = std::fs::read_to_string(&out).unwrap();
    let stacks = stacks_of(&text, spinner.pid());
    assert!(total(&stacks) > 0, "no samples of the spinner:\n{text}");
    assert!(stacks.iter().any(|(frames, _)| frames.iter().any(|f| f.starts_with("spin (<string>"))), "no Python frame:\n{text}");
}

#[test]
fn rotate_writes_a_complete_profile_every_period() {
    let spinner = python_spinner();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p.folded");
    let output = pyebpf_command().args(["record", "-a", "-F", "199", "--rotate", "1", "-d", "3.5", "-o"]).arg(&out).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(!out.exists(), "--rotate wrote the unrotated name too");
    let files = files_in(dir.path());
    assert!((3..=4).contains(&files.len()), "{} files: {files:?}\n{stderr}", files.len());
    let mut spinner_samples = Vec::new();
    let mut all_samples = 0;
    for file in &files {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        // p.YYYYMMDDTHHMMSS.folded
        let stamp = name.strip_prefix("p.").and_then(|rest| rest.strip_suffix(".folded")).unwrap_or_else(|| panic!("{name}"));
        assert!(stamp.len() == 15 && stamp.as_bytes()[8] == b'T' && stamp.chars().filter(char::is_ascii_digit).count() == 14, "{name}");
        assert!(stderr.contains(&name), "no `wrote` line for {name}: {stderr}");
        let text = std::fs::read_to_string(file).unwrap();
        for line in text.lines() {
            let (_, count) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{name}: bad line {line:?}"));
            assert!(count.parse::<u64>().is_ok_and(|n| n > 0), "{name}: bad count in {line:?}");
        }
        let stacks = stacks_of(&text, spinner.pid());
        assert!(stacks.iter().any(|(frames, _)| frames.iter().any(|f| f.starts_with("spin (<string>"))), "{name}: no Python frame");
        spinner_samples.push(total(&stacks));
        all_samples += text.lines().map(|line| line.rsplit_once(' ').unwrap().1.parse::<u64>().unwrap()).sum::<u64>();
    }
    // The run's summary adds up every period, not only the last: its samples are all the files'
    // (`pyebpf: wrote N samples of P processes to F files, FIRST to LAST (L lost)`), and the
    // spinner, busy throughout, is its hottest function with at least its samples in the files.
    let run = stderr.lines().rfind(|l| l.starts_with("pyebpf: wrote ")).unwrap();
    let expected = format!(" to {} files, {} to {} (", files.len(), files[0].display(), files[files.len() - 1].display());
    assert!(run.contains(&expected), "run summary {run:?} does not name the {} files:\n{stderr}", files.len());
    let run_samples: u64 = run["pyebpf: wrote ".len()..].split(' ').next().unwrap().parse().unwrap();
    assert_eq!(run_samples, all_samples, "the run summary's samples are not the files' sum:\n{stderr}");
    let hottest = stderr.lines().skip_while(|l| !l.contains("own   total")).nth(1).unwrap_or_else(|| panic!("{stderr}"));
    let own_share: f64 = hottest.split('%').next().unwrap().trim().parse().unwrap();
    let spinner_share = 100.0 * spinner_samples.iter().sum::<u64>() as f64 / all_samples as f64;
    assert!(hottest.contains("spin (<string>)") && own_share >= spinner_share - 0.1, "hottest {hottest:?}, the spinner has {spinner_share:.1}%:\n{stderr}");
    // Each full period holds at most a second of the spinner (199 Hz, a little slack for timers):
    // the aggregate restarts every period. On a busy machine the spinner gets less than a CPU, but
    // every full period gets a like share of it.
    let full = &spinner_samples[..spinner_samples.len() - 1];
    let mean = full.iter().sum::<u64>() / full.len() as u64;
    assert!(full.iter().all(|&n| n <= 230 && n * 2 >= mean), "samples per period: {spinner_samples:?}");
    assert!(spinner_samples.iter().all(|&n| n > 0), "samples per period: {spinner_samples:?}");
}

/// Resident memory of a process, in KiB (`VmRSS` of `/proc/PID/status`).
/// Issue 13's soak, sized for CI: `tests/soak.py` runs `record -a -F 999 --rotate 15` for 90 s
/// while a new short-lived Python (3.13, 3.14, 3.15 in turn) starts every 0.2 s, and fails unless
/// RSS (whole and anonymous, read every 5 s) stays within 10% (8 MiB at least) of its warm-up peak,
/// nothing is lost, every short-lived process has its Python frames, and every rotated file is whole.
/// The 10-minute run of docs/RELIABILITY.md is the same script with `--duration 600 --rotate 60`.
#[test]
fn a_short_soak_stays_flat_loses_nothing_and_resolves_every_process() {
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("soak.py");
    let output = Command::new("python3")
        .arg(&script)
        .args(["--duration", "90", "--rotate", "15", "--rss-interval", "5", "--out"])
        .arg(dir.path())
        .env("PYEBPF_BIN", pyebpf())
        .output()
        .expect("python3 runs tests/soak.py");
    let stdout = String::from_utf8_lossy(&output.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "the soak failed:\n{stdout}");
}

/// A C program named `python3.15` whose `.PyRuntime` section (and `_PyRuntime` symbol) holds
/// the whole static image of Debian 3.15's: a well-formed debug-offsets table (cookie `xdebugpy`,
/// version 3.15.2) whose pointers lead nowhere in this process.
fn fake_python(dir: &Path) -> PathBuf {
    let image = dir.join("runtime.bin");
    let python = debian_python("3.15");
    let status = Command::new("objcopy").args(["-O", "binary", "--only-section=.PyRuntime"]).arg(&python).arg(&image).status().unwrap();
    assert!(status.success());
    assert!(std::fs::read(&image).unwrap().starts_with(b"xdebugpy"), "3.15's .PyRuntime does not start with its debug offsets");
    let object = dir.join("runtime.o");
    let status = Command::new("objcopy")
        .current_dir(dir)
        .args(["-I", "binary", "-O", "elf64-x86-64", "-B", "i386:x86-64"])
        .args(["--rename-section", ".data=.PyRuntime,alloc,load,data,contents"])
        .args(["--redefine-sym", "_binary_runtime_bin_start=_PyRuntime", "runtime.bin", "runtime.o"])
        .status()
        .unwrap();
    assert!(status.success());
    let source = dir.join("fake.c");
    std::fs::write(
        &source,
        "extern char _PyRuntime[];\nvolatile unsigned long sink;\nint main(void) { for (;;) sink += (unsigned long)_PyRuntime[sink & 7]; }\n",
    )
    .unwrap();
    let fake_dir = dir.join("fake");
    std::fs::create_dir(&fake_dir).unwrap();
    let binary = fake_dir.join("python3.15");
    let status = Command::new("gcc")
        .args(["-O1", "-Wl,--export-dynamic", "-Wl,-z,noexecstack", "-o"])
        .arg(&binary)
        .arg(&source)
        .arg(&object)
        .status()
        .expect("gcc must be installed");
    assert!(status.success());
    binary
}

/// Target PIDs of the `process_vm_writev` calls in an `strace -f -o` log.
fn written_pids(log: &str) -> Vec<u32> {
    log.lines().filter_map(|line| line.split_once("process_vm_writev(")?.1.split(',').next()?.trim().parse().ok()).collect()
}

#[test]
fn hostile_targets_are_survived_and_never_written() {
    let mut hostile = Vec::new();
    let mut keep = Vec::new();
    for version in ["3.14", "3.15"] {
        let modes = ["frame_loop", "long_name", "thread_cycle", "unmapped_previous", "endless_linetable", "bad_cookie"];
        for mode in modes {
            let (child, dir) = pyebpf_tests::start_ready(&debian_python(version), "hostile.py", &[mode]);
            hostile.push((format!("{version} {mode}"), child));
            keep.push(dir);
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let fake = Killed(Command::new(fake_python(dir.path())).spawn().unwrap());
    // The normal workload, on 3.15 so that pyebpf does write its marker into it: strace sees writes.
    let normal = Killed(
        Command::new(debian_python("3.15"))
            .args(["-c", "def normal_spin(n):\n    if n: return normal_spin(n - 1)\n    while True: pass\nnormal_spin(12)"])
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    std::thread::sleep(Duration::from_millis(500));
    let (text, strace_log) = record_host_under_strace(dir.path());
    let normal_stacks = stacks_of(&text, normal.pid());
    let with_python = |stacks: &[(Vec<String>, u64)]| {
        stacks.iter().filter(|(frames, _)| frames.iter().any(|f| f.starts_with("normal_spin (<string>"))).map(|(_, n)| n).sum::<u64>()
    };
    assert!(with_python(&normal_stacks) * 2 > total(&normal_stacks), "the normal workload lost its Python frames:\n{normal_stacks:?}");
    for (name, child) in &mut hostile {
        assert!(matches!(child.0.try_wait(), Ok(None)), "{name} died");
        assert!(total(&stacks_of(&text, child.pid())) > 0, "no samples of {name}");
    }
    assert!(total(&stacks_of(&text, fake.pid())) > 0, "no samples of the fake python");

    let written = written_pids(&strace_log);
    assert!(written.contains(&normal.pid()), "strace saw no marker write into the normal 3.15 workload:\n{strace_log}");
    for (name, child) in &hostile {
        assert!(!written.contains(&child.pid()), "pyebpf wrote into {name}:\n{strace_log}");
    }
    assert!(!written.contains(&fake.pid()), "pyebpf wrote into the fake python:\n{strace_log}");
    dump_names_each_fault(&hostile);
    eprintln!("process_vm_writev calls: {} (targets {:?})", written.len(), {
        let mut targets = written.clone();
        targets.dedup();
        targets
    });
}

/// `record -a` for 4 s under strace, which logs every `process_vm_writev`: the profile and the log.
/// The run must succeed, without a panic and without repeating a line.
fn record_host_under_strace(dir: &Path) -> (String, String) {
    let out = dir.join("hostile.folded");
    let log = dir.join("strace.log");
    let output = Command::new("strace")
        .args(["-f", "--seccomp-bpf", "-e", "trace=process_vm_writev", "-o"])
        .arg(&log)
        .arg(pyebpf())
        .args(["record", "-a", "-F", "499", "-d", "4", "-o"])
        .arg(&out)
        .output()
        .expect("strace must be installed");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let mut lines: Vec<&str> = stderr.lines().filter(|line| !line.trim().is_empty()).collect();
    let count = lines.len();
    lines.sort_unstable();
    lines.dedup();
    assert_eq!(lines.len(), count, "a line repeated: {stderr}");

    (std::fs::read_to_string(&out).unwrap(), std::fs::read_to_string(&log).unwrap())
}

/// `dump` names what is wrong with each hostile target, instead of garbage or a hang.
fn dump_names_each_fault(hostile: &[(String, Killed)]) {
    for (name, child) in hostile {
        let expected = match name.rsplit_once(' ').unwrap().1 {
            "frame_loop" => "frame chain loops",
            "long_name" => "beyond the process's memory",
            "thread_cycle" => "looping",
            "unmapped_previous" => "older frames unreadable: cannot read 82 bytes at 0xdead0000",
            "endless_linetable" => "a location table of 1099511627776 bytes",
            _ => "no `xdebugpy` cookie in _PyRuntime, yet the interpreter is CPython 3.1",
        };
        let dumped = run_pyebpf(&["dump", "-p", &child.pid().to_string()]);
        let text = format!("{}{}", String::from_utf8_lossy(&dumped.stdout), String::from_utf8_lossy(&dumped.stderr));
        assert!(text.contains(expected), "dump of {name} lacks `{expected}`: {text}");
    }
}

/// A busy program named `python3.99` that unlinked itself and left FIFOs at both names its
/// mapping may be looked up by (`python3.99` and `python3.99 (deleted)`): opening either blocks
/// until a writer comes, so pyebpf must not open what a target names without checking it.
fn target_behind_fifos(dir: &Path) -> Killed {
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let program = dir.join("python3.99");
    std::fs::copy("/usr/bin/yes", &program).unwrap();
    let child = Killed(Command::new(&program).stdout(Stdio::null()).spawn().unwrap());
    std::thread::sleep(Duration::from_millis(200));
    std::fs::remove_file(&program).unwrap();
    for name in ["python3.99", "python3.99 (deleted)"] {
        let status = Command::new("mkfifo").arg(dir.join(name)).status().unwrap();
        assert!(status.success(), "mkfifo {name}");
    }
    child
}

/// Runs `pyebpf ARGS` under `timeout 30` (`prefix` first, e.g. setpriv), asserting it ends.
fn ends_in_time(prefix: &[&str], bin: &Path, args: &[&str]) -> Output {
    let (program, rest) = prefix.split_first().map_or(("timeout", &[][..]), |(first, rest)| (*first, rest));
    let mut command = Command::new(program);
    command.args(rest);
    if !prefix.is_empty() {
        command.arg("timeout");
    }
    let output = command.args(["30"]).arg(bin).args(args).output().unwrap();
    assert_ne!(output.status.code(), Some(124), "pyebpf {args:?} hung on a FIFO a target named: {output:?}");
    output
}

#[test]
fn a_fifo_in_place_of_a_mapped_file_blocks_nothing() {
    // Before the target starts: a missing environment ends the binary, which would leave it running.
    let bin = pyebpf();
    let dir = tempfile::tempdir().unwrap();
    let target = target_behind_fifos(dir.path());
    let pid = target.pid().to_string();
    // A busy copy of `yes` named like an interpreter is not taken for a CPython of that version.
    let dumped = ends_in_time(&[], &bin, &["dump", "-p", &pid]);
    assert_one_line_error(&dumped, "not a CPython process");
    let out = dir.path().join("p.folded");
    let recorded = ends_in_time(&[], &bin, &["record", "-p", &pid, "-d", "2", "-o", out.to_str().unwrap()]);
    assert!(recorded.status.success(), "{recorded:?}");
    assert!(total(&stacks_of(&std::fs::read_to_string(&out).unwrap(), target.pid())) > 0, "no samples of the target");
    // Without CAP_SYS_ADMIN, /proc/PID/map_files is closed and symbolization falls back to the
    // path the target names.
    let shared = tempfile::tempdir().unwrap();
    let anyones = runnable_by_anyone(shared.path());
    std::fs::set_permissions(shared.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = shared.path().join("p.folded");
    let caps = "--inh-caps=-all,+bpf,+perfmon,+sys_ptrace";
    let nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", caps, "--ambient-caps=-all,+bpf,+perfmon,+sys_ptrace", "--"];
    let recorded = ends_in_time(&nobody, &anyones, &["record", "-p", &pid, "-d", "2", "-o", out.to_str().unwrap()]);
    assert!(recorded.status.success(), "{recorded:?}");
    assert!(total(&stacks_of(&std::fs::read_to_string(&out).unwrap(), target.pid())) > 0, "no samples of the target");
}

/// Whether a collapsed stack holds a Python frame of function `name` (`NAME (FILE:LINE)`).
fn has_python_frame(frames: &[String], name: &str) -> bool {
    frames.iter().any(|f| f.starts_with(&format!("{name} (")))
}

/// A thread has a thread state in each interpreter it entered; its samples must be read in the
/// one it runs in (it used to be whichever was listed last: the main interpreter's, parked at
/// `Interpreter.exec`, so `sub_spin` never showed).
#[test]
fn a_thread_running_in_a_subinterpreter_is_sampled_there() {
    for version in ["3.14", "3.15"] {
        // The main thread spins in `sub_spin` in a subinterpreter, a second thread in `main_spin`.
        let (target, dir) = start_ready(&debian_python(version), "subinterpreter.py", &[]);
        let out = dir.path().join("sub.folded");
        let output = run_pyebpf(&["record", "-p", &target.pid().to_string(), "-d", "2", "--threads", "-o", out.to_str().unwrap()]);
        assert!(output.status.success(), "{version}: {}", String::from_utf8_lossy(&output.stderr));
        let text = std::fs::read_to_string(&out).unwrap();
        let stacks = stacks_of(&text, target.pid());
        let main_thread = format!("thread {}", target.pid());
        let (mut in_sub, mut parked, mut other_thread) = (0, 0, 0);
        for (frames, count) in &stacks {
            if frames.contains(&main_thread) {
                if has_python_frame(frames, "sub_spin") {
                    in_sub += count;
                } else if has_python_frame(frames, "Interpreter.exec") {
                    parked += count;
                }
            } else if has_python_frame(frames, "main_spin") {
                other_thread += count;
            }
        }
        assert!(in_sub >= 20, "{version}: {in_sub} samples of the main thread in sub_spin, {parked} at Interpreter.exec:\n{text}");
        assert!(parked * 20 <= in_sub, "{version}: {parked} samples of the main thread parked at Interpreter.exec, {in_sub} in sub_spin");
        assert!(other_thread >= 20, "{version}: the main interpreter's thread has {other_thread} samples in main_spin");
    }
}

/// A thread that switches interpreters every 20 ms (`main_part` in the main interpreter, then
/// `sub_part` in a subinterpreter, for equal times) switches far faster than pyebpf re-reads thread
/// lists: each sample must be read in the thread state attached at the sample, which the eBPF
/// program looks up. Read in the state chosen at the last thread-list read, half of the samples
/// were parked at `Interpreter.exec` or had no Python frame.
#[test]
fn a_thread_switching_interpreters_is_sampled_where_it_runs_at_each_sample() {
    for version in ["3.14", "3.15"] {
        let (target, _dir) = start_ready(&debian_python(version), "subinterpreter_switching.py", &["20"]);
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("switching.folded");
        let output = run_pyebpf(&["record", "-p", &target.pid().to_string(), "-F", "499", "-d", "4", "-o", out.to_str().unwrap()]);
        assert!(output.status.success(), "{version}: {}", String::from_utf8_lossy(&output.stderr));
        let text = std::fs::read_to_string(&out).unwrap();
        let (mut sub, mut main, mut elsewhere) = (0, 0, 0);
        for (frames, count) in stacks_of(&text, target.pid()) {
            match (has_python_frame(&frames, "sub_part"), has_python_frame(&frames, "main_part")) {
                (true, false) => sub += count,
                (false, true) => main += count,
                _ => elsewhere += count,
            }
        }
        let all = sub + main + elsewhere;
        let context = format!("{version}: sub_part {sub}, main_part {main}, neither {elsewhere}");
        assert!(all >= 400, "{context}: too few samples");
        // Switching itself (`Interpreter.exec` setting up the call) takes a little of the time.
        assert!(elsewhere * 20 <= all, "{context}: over 5% of the samples in neither function");
        let sub_share = 100.0 * sub as f64 / (sub + main) as f64;
        assert!((sub_share - 50.0).abs() <= 8.0, "{context}: sub_part has {sub_share:.1}% where it ran half of the time");
    }
}

/// `code object cache hit rate: P% of N` from `--stats`: N.
fn code_cache_lookups(stats: &str) -> u64 {
    let line = stats.lines().find(|line| line.starts_with("code object cache hit rate:")).unwrap_or_else(|| panic!("no code cache line:\n{stats}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Three short-lived Pythons, one after the other, each calling 300 functions of its own for
/// 0.5 s: when the recording ends all have exited, and `--stats` must still count what their
/// code-object caches did (it used to sum the processes still attached at the end: "0.0% of 0").
#[test]
fn stats_keep_the_counters_of_exited_processes() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("short.py");
    std::fs::write(
        &script,
        "import time\nexec('\\n'.join(f'def f{i}():\\n    return {i}' for i in range(300)))\nfunctions = [globals()[f'f{i}'] for i in range(300)]\nt = time.time()\ndef busy():\n    while time.time() - t < 0.5:\n        for f in functions: f()\nbusy()\n",
    )
    .unwrap();
    let python = debian_python("3.14");
    let runs = format!("for i in 1 2 3; do {} {}; done", python.display(), script.display());
    let out = dir.path().join("short.folded");
    let output = run_pyebpf(&["record", "-F", "999", "--stats", "-o", out.to_str().unwrap(), "--", "sh", "-c", &runs]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.lines().any(|line| line.contains(";busy (")), "the short-lived Pythons were not sampled:\n{stderr}");
    let lookups = code_cache_lookups(&stderr);
    assert!(lookups >= 30, "{lookups} code-object lookups counted for three exited Pythons:\n{stderr}");
}

/// A file on /proc or /sys looks writable to root (access() agrees), yet no temporary can be
/// created next to it: that used to show only once the recording was over, losing it.
#[test]
fn kernel_file_systems_are_refused_before_sampling() {
    for (output, kind) in [("/proc/version", "proc"), ("/proc/profile.folded", "proc"), ("/sys/kernel/profile.folded", "sysfs")] {
        let started = Instant::now();
        let output_of = run_pyebpf(&["record", "-a", "-d", "5", "--format", "collapsed", "-o", output]);
        assert_one_line_error(&output_of, &format!("on a {kind} file system"));
        assert!(started.elapsed() < Duration::from_secs(2), "{output}: sampled before failing");
    }
}
