//! Issue 7, part 2: `record -o PATH` never destroys what is at PATH. A symlink stays a link and its
//! target gets the profile, a device stays a device, a FIFO's reader gets the whole profile, `-` is
//! standard output, a directory is refused before sampling, and no temporary outlives a killed run.

use std::ffi::CString;
use std::fs;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime};

use pyebpf_tests::{assert_one_line_error, pyebpf, pyebpf_command, Killed};

/// A process that keeps one CPU busy, so a host-wide recording has samples on an idle machine.
fn busy() -> Killed {
    Killed(Command::new("sh").args(["-c", "while :; do :; done"]).spawn().unwrap())
}

/// `pyebpf record -a -d 1 -F 49 -o OUTPUT EXTRA...` while something runs, with stdout captured.
fn record_to(output: &Path, extra: &[&str]) -> Output {
    let _busy = busy();
    pyebpf_command().args(["record", "-a", "-d", "1", "-F", "49", "-o"]).arg(output).args(extra).output().unwrap()
}

fn assert_success(output: &Output) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "pyebpf record failed: {stderr}");
    stderr
}

/// N in the summary line `pyebpf: wrote N samples of ... to WHERE (...)`, which must name `to`.
fn samples_written(stderr: &str, to: &str) -> u64 {
    let line = stderr.lines().find(|line| line.starts_with("pyebpf: wrote ")).unwrap_or_else(|| panic!("no summary line: {stderr}"));
    assert!(line.contains(&format!(" to {to} (")), "summary does not name {to}: {line}");
    let samples: u64 = line["pyebpf: wrote ".len()..].split(' ').next().unwrap().parse().unwrap();
    assert!(samples > 0, "no samples recorded, so nothing is tested: {line}");
    samples
}

/// The sum of the counts of a collapsed profile, every line checked to be `STACK COUNT`.
fn collapsed_total(text: &str) -> u64 {
    assert!(text.ends_with('\n'), "collapsed profile is cut short: {:?}", &text[text.len().saturating_sub(200)..]);
    text.lines()
        .map(|line| {
            let (stack, count) = line.rsplit_once(' ').unwrap_or_else(|| panic!("not a collapsed line: {line}"));
            assert!(stack.contains(" ("), "no `COMM (PID)` root: {line}");
            count.parse::<u64>().unwrap_or_else(|_| panic!("bad count: {line}"))
        })
        .sum()
}

/// `go tool pprof -raw` reads the file (a cut gzip stream does not parse) and finds samples in it.
/// Their sum may fall short of the summary: go's reader drops samples without any location (a
/// sample whose stack came back empty), which the file does hold.
fn assert_pprof_holds(profile: &Path, expected: u64) {
    let output = Command::new("go").args(["tool", "pprof", "-raw"]).arg(profile).output().expect("go (golang-go) must be installed");
    assert!(output.status.success(), "go tool pprof -raw failed: {}", String::from_utf8_lossy(&output.stderr));
    let raw = String::from_utf8_lossy(&output.stdout);
    // After `Samples:` and its header line, each sample line starts with its count.
    let samples: u64 = raw
        .lines()
        .skip_while(|line| !line.starts_with("Samples:"))
        .skip(2)
        .take_while(|line| !line.starts_with("Locations"))
        .filter_map(|line| line.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    assert!(samples > 0 && samples <= expected, "{samples} pprof samples, {expected} in the summary:\n{raw}");
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<_> = fs::read_dir(dir).unwrap().map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

fn c_path(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).unwrap()
}

#[test]
fn a_symlink_stays_a_link_and_its_target_gets_the_profile() {
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real.folded");
    let link = dir.path().join("link.folded");
    fs::write(&real, "old;stack 1\n").unwrap();
    std::os::unix::fs::symlink("real.folded", &link).unwrap();
    let samples = samples_written(&assert_success(&record_to(&link, &[])), &link.display().to_string());
    assert!(fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link was replaced");
    assert_eq!(fs::read_link(&link).unwrap(), PathBuf::from("real.folded"));
    assert_eq!(collapsed_total(&fs::read_to_string(&real).unwrap()), samples);
    assert_eq!(names_in(dir.path()), ["link.folded", "real.folded"]);

    // pprof through a link to a file that does not exist yet: the file is created, the link kept.
    let pprof_link = dir.path().join("link.pb.gz");
    std::os::unix::fs::symlink("new.pb.gz", &pprof_link).unwrap();
    let samples = samples_written(&assert_success(&record_to(&pprof_link, &[])), &pprof_link.display().to_string());
    assert!(fs::symlink_metadata(&pprof_link).unwrap().file_type().is_symlink(), "the link was replaced");
    assert_pprof_holds(&dir.path().join("new.pb.gz"), samples);
    assert_eq!(names_in(dir.path()), ["link.folded", "link.pb.gz", "new.pb.gz", "real.folded"]);
}

#[test]
fn a_character_device_stays_a_device() {
    let dir = tempfile::tempdir().unwrap();
    let device = dir.path().join("null");
    let rdev = libc::makedev(1, 3);
    // SAFETY: a valid NUL-terminated path.
    let made = unsafe { libc::mknod(c_path(&device).as_ptr(), libc::S_IFCHR | 0o666, rdev) };
    assert_eq!(made, 0, "mknod: {}", std::io::Error::last_os_error());
    assert_success(&record_to(&device, &[]));
    let meta = fs::symlink_metadata(&device).unwrap();
    assert!(meta.file_type().is_char_device(), "the device was replaced by {:?}", meta.file_type());
    assert_eq!(meta.rdev(), rdev);
    assert_eq!(names_in(dir.path()), ["null"]);
}

#[test]
fn a_fifo_stays_a_fifo_and_its_reader_gets_the_whole_profile() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("stacks.folded");
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path(&fifo).as_ptr(), 0o600) }, 0, "mkfifo: {}", std::io::Error::last_os_error());
    // The reader waits in open() for the first writer: a check before sampling that opened the FIFO
    // would hand it an empty profile.
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || {
            let mut text = String::new();
            fs::File::open(fifo).unwrap().read_to_string(&mut text).unwrap();
            text
        })
    };
    let samples = samples_written(&assert_success(&record_to(&fifo, &[])), &fifo.display().to_string());
    assert_eq!(collapsed_total(&reader.join().unwrap()), samples, "the reader did not get the whole profile");
    assert!(fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "the FIFO was replaced");
    assert_eq!(names_in(dir.path()), ["stacks.folded"]);
}

#[test]
fn dash_writes_the_profile_to_stdout_and_the_summary_to_stderr() {
    let collapsed = record_to(Path::new("-"), &["--format", "collapsed"]);
    let samples = samples_written(&assert_success(&collapsed), "standard output");
    assert_eq!(collapsed_total(&String::from_utf8(collapsed.stdout).unwrap()), samples);

    // Without --format, `-` is pprof: binary, fine on a pipe.
    let pprof = record_to(Path::new("-"), &[]);
    let samples = samples_written(&assert_success(&pprof), "standard output");
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("stdout.pb.gz");
    fs::write(&saved, &pprof.stdout).unwrap();
    assert_pprof_holds(&saved, samples);
}

#[test]
fn dash_sends_a_launched_commands_output_to_stderr() {
    let output = pyebpf_command()
        .args(["record", "-F", "49", "-o", "-", "--format", "collapsed", "--", "sh", "-c", "echo from-the-command; exec timeout 1 sh -c 'while :; do :; done'"])
        .output()
        .unwrap();
    let stderr = assert_success(&output);
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(!stdout.contains("from-the-command"), "the command's output is in the profile:\n{stdout}");
    assert!(stderr.contains("from-the-command"), "the command's output was lost: {stderr}");
    assert_eq!(collapsed_total(&stdout), samples_written(&stderr, "standard output"));
}

#[test]
fn binary_pprof_to_a_terminal_is_refused_before_sampling() {
    let (mut master, mut slave) = (0, 0);
    // SAFETY: out-pointers to two ints; name, termios and window size may be null.
    let opened = unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), std::ptr::null()) };
    assert_eq!(opened, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: openpty returned two open descriptors that nothing else owns.
    let (_master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let terminal = fs::read_link(format!("/proc/self/fd/{}", slave.as_raw_fd())).unwrap();
    for (output, stdout) in [(Path::new("-"), Stdio::from(slave)), (&terminal, Stdio::null())] {
        let started = Instant::now();
        let result = pyebpf_command().args(["record", "-a", "-d", "5", "-o"]).arg(output).stdout(stdout).output().unwrap();
        assert_one_line_error(&result, "--format collapsed");
        assert!(started.elapsed() < Duration::from_secs(3), "-o {} refused only after sampling: {:?}", output.display(), started.elapsed());
    }
}

#[test]
fn a_directory_is_refused_before_sampling_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("keep"), "x").unwrap();
    let started = Instant::now();
    let output = pyebpf_command().args(["record", "-a", "-d", "5", "-o"]).arg(dir.path()).output().unwrap();
    assert_one_line_error(&output, "is a directory");
    assert!(started.elapsed() < Duration::from_secs(3), "refused only after sampling: {:?}", started.elapsed());
    assert_eq!(names_in(dir.path()), ["keep"]);
}

#[test]
fn stale_temporaries_of_a_killed_run_are_removed_by_the_next_run() {
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join(".pyebpf-Ab3xYz.tmp");
    let fresh = dir.path().join(".pyebpf-Fresh1.tmp");
    let foreign = dir.path().join(".pyebpf-notours.tmp");
    for path in [&stale, &fresh, &foreign] {
        fs::write(path, "half a profile").unwrap();
    }
    let long_ago = SystemTime::now() - Duration::from_secs(600);
    for path in [&stale, &foreign] {
        fs::File::options().write(true).open(path).unwrap().set_modified(long_ago).unwrap();
    }
    assert_success(&record_to(&dir.path().join("profile.pb.gz"), &[]));
    // The fresh one may belong to a run still writing; the other is not of pyebpf's naming.
    assert_eq!(names_in(dir.path()), [".pyebpf-Fresh1.tmp", ".pyebpf-notours.tmp", "profile.pb.gz"]);
}

#[test]
fn a_killed_recording_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("profile.pb.gz"), "the previous profile").unwrap();
    let mut recorder = pyebpf_command().args(["record", "-a", "-d", "5", "-o"]).arg(dir.path().join("profile.pb.gz")).stderr(Stdio::null()).spawn().unwrap();
    std::thread::sleep(Duration::from_secs(1));
    recorder.kill().unwrap();
    assert_eq!(recorder.wait().unwrap().signal(), Some(libc::SIGKILL));
    assert_eq!(names_in(dir.path()), ["profile.pb.gz"]);
    assert_eq!(fs::read_to_string(dir.path().join("profile.pb.gz")).unwrap(), "the previous profile");
}

/// The profile is written into a file with no name (`O_TMPFILE`), named only once complete and
/// renamed over the target by the very next call: a SIGKILL at any point of the write leaves no file.
#[test]
fn the_temporary_has_no_name_while_it_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace");
    let out_dir = dir.path().join("out");
    fs::create_dir(&out_dir).unwrap();
    let _busy = busy();
    // `open` too: musl's open() is that system call, glibc's is openat.
    let status = Command::new("strace")
        .args(["-f", "-qq", "-e", "trace=open,openat,write,fsync,linkat,rename,renameat,renameat2", "-o"])
        .arg(&trace)
        .arg(pyebpf())
        .args(["record", "-a", "-d", "1", "-F", "49", "-o"])
        .arg(out_dir.join("profile.pb.gz"))
        .stderr(Stdio::null())
        .status()
        .expect("strace must be installed (cargo xtask test installs it)");
    assert!(status.success());
    let trace = fs::read_to_string(trace).unwrap();
    let writer =
        trace.lines().find(|line| line.contains("O_TMPFILE")).and_then(|line| line.split(' ').next()).unwrap_or_else(|| panic!("no O_TMPFILE open:\n{trace}"));
    // The writing thread's calls, in order (strace -f prefixes each line with the thread id).
    let calls: Vec<&str> = trace.lines().filter_map(|line| line.strip_prefix(writer)?.strip_prefix(' ')).map(str::trim_start).collect();
    let opened = calls.iter().position(|call| call.contains("O_TMPFILE")).unwrap();
    let fd = calls[opened].rsplit("= ").next().unwrap();
    let linked = calls.iter().position(|call| call.starts_with("linkat(")).unwrap_or_else(|| panic!("no linkat:\n{trace}"));
    assert!(calls[linked].contains(&format!("/proc/self/fd/{fd}")), "linkat names another file: {}", calls[linked]);
    let writes_before = calls[opened..linked].iter().filter(|call| call.starts_with(&format!("write({fd},"))).count();
    let writes_after = calls[linked..].iter().filter(|call| call.starts_with(&format!("write({fd},"))).count();
    assert!(writes_before > 0 && writes_after == 0, "{writes_before} writes before the link, {writes_after} after:\n{trace}");
    assert!(calls[linked + 1].starts_with("rename"), "the named temporary is not renamed at once: {}", calls[linked + 1]);
    assert_eq!(names_in(&out_dir), ["profile.pb.gz"]);
}
