//! What `cargo xtask dist` ships, checked as a user installs it: the static binary alone in an empty
//! root, the wheel in fresh virtual environments without a network, and the Debian package with its
//! unit's command line under only the three capabilities it keeps.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use pyebpf_tests::otlp::{Collector, Sink};
use pyebpf_tests::*;

/// An artifact `cargo xtask test` built with `cargo xtask dist` (`PYEBPF_DIST_*`).
fn artifact(name: &str) -> PathBuf {
    let path = PathBuf::from(xtask_env(name));
    assert!(path.is_file(), "{name} {} is not a file", path.display());
    path
}

/// A Python spinning in `fib`, to profile.
fn busy_python(python: &Path) -> (Killed, tempfile::TempDir) {
    start_ready(python, "busy_recursion.py", &[])
}

/// Asserts that a collapsed profile holds Python `fib` frames of `pid`.
fn assert_python_frames(collapsed: &str, pid: u32, how: &str) {
    let stacks = stacks_of(collapsed, pid);
    let with_fib = count_where(&stacks, |frames| frames.iter().any(|f| f.starts_with("fib (")));
    assert!(with_fib * 2 > total(&stacks), "{how}: {with_fib} of {} samples of {pid} in Python's fib:\n{collapsed}", total(&stacks));
}

fn success(output: &Output, what: &str) {
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn the_static_binary_records_python_alone_in_an_empty_root() {
    let binary = artifact("PYEBPF_DIST_BINARY");
    let file = Command::new("file").arg(&binary).output().unwrap();
    let described = String::from_utf8_lossy(&file.stdout);
    assert!(described.contains("statically linked") || described.contains("static-pie linked"), "{described}");
    assert!(!described.contains("with debug_info") && described.contains("stripped") && !described.contains("not stripped"), "{described}");
    eprintln!("{described}");
    let (python, _ready) = busy_python(&pyenv_python("3.12.1"));
    // The root holds the binary and what pyebpf reads of the host: /proc and /sys, mounted in a
    // private mount namespace. The Python runs outside it, as a container's would.
    let root = tempfile::tempdir().unwrap();
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::copy(&binary, root.path().join("pyebpf")).unwrap();
    for dir in ["proc", "sys", "out"] {
        std::fs::create_dir(root.path().join(dir)).unwrap();
    }
    let setup = "mount -t proc proc \"$1/proc\" && mount -t sysfs sysfs \"$1/sys\" && exec chroot \"$1\" /pyebpf record -p \"$2\" -d 3 -o /out/p.folded";
    let mut command = Command::new("unshare");
    command.args(["--mount", "--propagation", "private", "sh", "-c", setup, "sh"]).arg(root.path()).arg(python.pid().to_string());
    let recorded = with_default_signals(&mut command).output().unwrap();
    success(&recorded, "pyebpf record in an empty root");
    let entries: Vec<_> = std::fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(entries.len(), 4, "the root holds more than pyebpf, proc, sys and out: {entries:?}");
    assert_python_frames(&std::fs::read_to_string(root.path().join("out/p.folded")).unwrap(), python.pid(), "static binary in an empty root");
}

#[test]
fn the_wheel_installs_offline_into_fresh_virtual_environments() {
    let wheel = artifact("PYEBPF_DIST_WHEEL");
    // What it profiles is a Python pyebpf reads (3.12); the environments are of the oldest Python
    // the wheel is for, of the commonest, and of Debian's own.
    let (target, _ready) = busy_python(&pyenv_python("3.12.1"));
    for python in [pyenv_python("3.8.18"), pyenv_python("3.12.1"), PathBuf::from("/usr/bin/python3.11")] {
        let dir = tempfile::tempdir().unwrap();
        let venv = dir.path().join("venv");
        success(&Command::new(&python).args(["-m", "venv"]).arg(&venv).output().unwrap(), &format!("{} -m venv", python.display()));
        // No network: a network namespace of its own has only a loopback that is down.
        let mut pip = Command::new("unshare");
        pip.args(["--net", "--"]).arg(venv.join("bin/pip")).args(["install", "--no-index", "--no-cache-dir"]).arg(&wheel);
        for name in ["PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"] {
            pip.env_remove(name);
        }
        success(&pip.output().unwrap(), &format!("pip install of the wheel into a venv of {}", python.display()));
        let installed = venv.join("bin/pyebpf");
        assert!(installed.metadata().is_ok_and(|m| m.permissions().mode() & 0o111 != 0), "{} is not an executable", installed.display());
        let out = dir.path().join("p.folded");
        let recorded =
            with_default_signals(&mut Command::new(&installed)).args(["record", "-p", &target.pid().to_string(), "-d", "2", "-o"]).arg(&out).output().unwrap();
        success(&recorded, "pyebpf from the wheel");
        assert_python_frames(&std::fs::read_to_string(&out).unwrap(), target.pid(), &format!("wheel in a venv of {}", python.display()));
    }
}

/// The value of `KEY=` in a unit file (the last one, as systemd reads it).
fn unit_setting<'a>(unit: &'a str, key: &str) -> &'a str {
    unit.lines().filter_map(|line| line.strip_prefix(key)?.strip_prefix('=')).next_back().unwrap_or_else(|| panic!("the unit has no {key}="))
}

/// The unit's ExecStart with its variables expanded as systemd does: `${NAME}` to one word,
/// `$NAME` to as many words as the value has.
fn exec_start(unit: &str, variables: &[(&str, &str)]) -> Vec<String> {
    let value = |name: &str| variables.iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("no value for ${name}")).1;
    let mut words = Vec::new();
    for word in unit_setting(unit, "ExecStart").split_whitespace() {
        if let Some(name) = word.strip_prefix("${").and_then(|rest| rest.strip_suffix('}')) {
            words.push(value(name).to_string());
        } else if let Some(name) = word.strip_prefix('$') {
            words.extend(value(name).split_whitespace().map(str::to_string));
        } else {
            words.push(word.to_string());
        }
    }
    words
}

/// The bounding set without CAP_BPF, CAP_PERFMON and CAP_SYS_PTRACE, for `capsh --drop`.
fn all_capabilities_but_three() -> String {
    let print = Command::new("capsh").arg("--print").output().unwrap();
    let text = String::from_utf8_lossy(&print.stdout).into_owned();
    let bounding = text.lines().find_map(|line| line.strip_prefix("Bounding set =")).unwrap_or_else(|| panic!("capsh --print: {text}"));
    bounding.split(',').filter(|cap| !["cap_bpf", "cap_perfmon", "cap_sys_ptrace"].contains(cap)).collect::<Vec<_>>().join(",")
}

/// The package, checked for its files and installed by dpkg into a root of its own.
fn installed_package() -> tempfile::TempDir {
    let deb = artifact("PYEBPF_DIST_DEB");
    let contents = Command::new("dpkg-deb").arg("--contents").arg(&deb).output().unwrap();
    success(&contents, "dpkg-deb --contents");
    let listing = String::from_utf8_lossy(&contents.stdout).into_owned();
    for file in [
        "./usr/bin/pyebpf",
        "./usr/share/man/man1/pyebpf.1.gz",
        "./usr/share/man/man1/pyebpf-record.1.gz",
        "./lib/systemd/system/pyebpf.service",
        "./etc/default/pyebpf",
    ] {
        assert!(listing.contains(file), "the package lacks {file}:\n{listing}");
    }
    // Installed by dpkg into a root of its own, which starts empty but for dpkg's database.
    let root = tempfile::tempdir().unwrap();
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    for dir in ["var/lib/dpkg/info", "var/lib/dpkg/updates", "proc", "sys"] {
        std::fs::create_dir_all(root.path().join(dir)).unwrap();
    }
    std::fs::write(root.path().join("var/lib/dpkg/status"), "").unwrap();
    let installed = Command::new("dpkg").arg(format!("--root={}", root.path().display())).args(["--log=/dev/null", "-i"]).arg(&deb).output().unwrap();
    success(&installed, "dpkg -i");
    let status = std::fs::read_to_string(root.path().join("var/lib/dpkg/status")).unwrap();
    assert!(status.contains("Package: pyebpf") && status.contains("Status: install ok installed"), "{status}");
    let page = Command::new("zcat").arg(root.path().join("usr/share/man/man1/pyebpf-record.1.gz")).output().unwrap();
    assert!(String::from_utf8_lossy(&page.stdout).contains("keep"), "man pyebpf-record does not document --keep");
    root
}

/// The installed unit passes `systemd-analyze verify`.
fn verify_unit(root: &Path) {
    // systemd-analyze checks the unit against the host's units and finds its binary and manual
    // page: the package's files are laid over the host's, in a private mount namespace.
    let overlay = "for dir in usr/bin lib/systemd/system usr/share/man/man1 etc/default; do \
                   mount -t overlay overlay -o \"lowerdir=$1/$dir:/$dir\" \"/$dir\" || exit 99; done; exec systemd-analyze verify pyebpf.service";
    let verify = Command::new("unshare").args(["--mount", "--propagation", "private", "sh", "-c", overlay, "sh"]).arg(root).output().unwrap();
    success(&verify, "systemd-analyze verify");
    let complaints = String::from_utf8_lossy(&verify.stderr);
    assert!(complaints.trim().is_empty(), "systemd-analyze verify complains about the unit: {complaints}");
}

/// Sets `KEY=VALUE` lines of the installed `/etc/default/pyebpf`, as an administrator edits it:
/// a setting already there is replaced, a new one added.
fn set_defaults(root: &Path, settings: &[(&str, &str)]) {
    let file = root.join("etc/default/pyebpf");
    let mut lines: Vec<String> = std::fs::read_to_string(&file).unwrap().lines().map(str::to_string).collect();
    for (key, value) in settings {
        let line = format!("{key}={value}");
        match lines.iter_mut().find(|l| l.split_once('=').is_some_and(|(k, _)| k.trim() == *key)) {
            Some(existing) => *existing = line,
            None => lines.push(line),
        }
    }
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
}

/// The environment systemd gives the unit's command: the unit's `Environment=` assignments, then
/// those of its `EnvironmentFile=` (the installed `/etc/default/pyebpf`), the later winning.
fn unit_environment(unit: &str, root: &Path) -> Vec<(String, String)> {
    let mut variables: Vec<(String, String)> = Vec::new();
    let mut set = |key: &str, value: &str| {
        variables.retain(|(k, _)| k != key);
        variables.push((key.to_string(), value.trim_matches('"').to_string()));
    };
    for assignment in unit.lines().filter_map(|line| line.strip_prefix("Environment=")).flat_map(str::split_whitespace) {
        let (key, value) = assignment.split_once('=').unwrap_or_else(|| panic!("Environment= assignment {assignment:?}"));
        set(key, value);
    }
    assert!(unit.lines().any(|line| line == "EnvironmentFile=-/etc/default/pyebpf"), "the unit does not read /etc/default/pyebpf");
    let defaults = std::fs::read_to_string(root.join("etc/default/pyebpf")).unwrap();
    for line in defaults.lines().map(str::trim).filter(|line| !line.is_empty() && !line.starts_with('#')) {
        let (key, value) = line.split_once('=').unwrap_or_else(|| panic!("/etc/default/pyebpf line {line:?}"));
        set(key.trim(), value.trim());
    }
    variables
}

/// The unit's command line, with the variables the unit and `/etc/default/pyebpf` set, chrooted
/// into the installed root, under only the three capabilities the unit keeps, with the
/// environment systemd gives it (and a PATH for the wrappers); killed if it outlives a test.
fn start_unit_command(root: &Path) -> (std::process::Child, Instant) {
    let unit = std::fs::read_to_string(root.join("lib/systemd/system/pyebpf.service")).unwrap();
    let environment = unit_environment(&unit, root);
    let variables: Vec<(&str, &str)> = environment.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let command = exec_start(&unit, &variables);
    assert_eq!(command[0], "/usr/bin/pyebpf", "{command:?}");
    std::fs::create_dir_all(root.join("var/lib/pyebpf")).unwrap();
    let setup = "mount -t proc proc \"$1/proc\" && mount -t sysfs sysfs \"$1/sys\" && root=$1 && drop=$2 && shell=$3 && shift 3 && \
                 exec capsh --chroot=\"$root\" --drop=\"$drop\" --shell=\"$shell\" -- \"$@\"";
    let mut run = Command::new("unshare");
    run.args(["--mount", "--propagation", "private", "sh", "-c", setup, "sh"]).arg(root).arg(all_capabilities_but_three()).arg(&command[0]).args(&command[1..]);
    run.env_clear().env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").envs(variables.iter().copied());
    let started = Instant::now();
    let child = with_default_signals(&mut run).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    // capsh execs pyebpf: its capabilities are the three, nothing else.
    let effective = loop {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let name = status.lines().find_map(|line| line.strip_prefix("Name:\t")).unwrap_or_default().to_string();
        if name == "pyebpf" {
            break status.lines().find_map(|line| line.strip_prefix("CapEff:\t")).unwrap_or_default().to_string();
        }
        assert!(started.elapsed() < Duration::from_secs(10), "pyebpf did not start under capsh");
        std::thread::sleep(Duration::from_millis(20));
    };
    let three = (1u64 << 19) | (1 << 38) | (1 << 39);
    assert_eq!(u64::from_str_radix(&effective, 16).unwrap(), three, "CapEff {effective}");
    (child, started)
}

/// Sends SIGTERM to the unit's command after `run_for`, as `systemctl stop` does; returns its
/// stderr once it succeeded.
fn stop_unit_command(child: std::process::Child, started: Instant, run_for: Duration) -> String {
    std::thread::sleep(run_for.saturating_sub(started.elapsed()));
    let sent = Sent { name: "SIGTERM", signal: libc::SIGTERM, after_ms: started.elapsed().as_millis() as u64, at_start: String::new() };
    // SAFETY: kill takes a pid and a signal; the child is not reaped yet.
    unsafe { libc::kill(child.id() as i32, sent.signal) };
    let output = wait_after_signal(child, &sent, Duration::from_secs(30));
    success(&output, "the unit's command line under capsh");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn the_package_installs_and_its_unit_writes_and_retires_profiles_with_three_capabilities() {
    let root = installed_package();
    // The periods of a test, set where an administrator sets them.
    set_defaults(root.path(), &[("PYEBPF_ROTATE", "1"), ("PYEBPF_KEEP", "3"), ("PYEBPF_OPTIONS", "--python-only")]);
    verify_unit(root.path());
    let (python, _ready) = busy_python(&pyenv_python("3.12.1"));
    let (child, started) = start_unit_command(root.path());
    let stderr = stop_unit_command(child, started, Duration::from_millis(5500));
    // `wrote N samples of M processes to NAME (L lost)`, one line per period (the summary's
    // `to K files, ...` is not one).
    let written: Vec<&str> =
        stderr.lines().filter_map(|line| line.split_once(" processes to ")?.1.split(" (").next()).filter(|name| name.starts_with('/')).collect();
    assert!(written.len() >= 5, "fewer than 5 periods written in 5.5 s at 1 s each:\n{stderr}");
    let state = root.path().join("var/lib/pyebpf");
    let mut left: Vec<String> = std::fs::read_dir(&state).unwrap().map(|e| format!("/var/lib/pyebpf/{}", e.unwrap().file_name().to_string_lossy())).collect();
    left.sort();
    let newest: Vec<String> = written[written.len() - 3..].iter().map(|name| name.to_string()).collect();
    assert_eq!(left, newest, "--keep 3 should leave the newest three of {written:?}");
    let newest_file = root.path().join(newest[2].trim_start_matches('/'));
    let top = Command::new("go").args(["tool", "pprof", "-top"]).arg(&newest_file).env("HOME", root.path()).output().unwrap();
    success(&top, "go tool pprof -top of the last period");
    assert!(String::from_utf8_lossy(&top.stdout).contains("fib"), "the last period lacks Python's fib: {}", String::from_utf8_lossy(&top.stdout));
    drop(python);
}

/// With `PYEBPF_OTLP_ENDPOINT` set in `/etc/default/pyebpf`, the unit (still valid) sends every
/// period to a real collector there, and may reach it: the network is not taken from it.
#[test]
fn the_packages_unit_exports_to_the_collector_named_in_etc_default() {
    let root = installed_package();
    let unit = std::fs::read_to_string(root.path().join("lib/systemd/system/pyebpf.service")).unwrap();
    assert!(!unit.lines().any(|line| line.trim() == "PrivateNetwork=yes"), "the unit has no network to export with");
    let families = unit_setting(&unit, "RestrictAddressFamilies");
    assert!(families.split_whitespace().any(|f| f == "AF_INET") && families.split_whitespace().any(|f| f == "AF_INET6"), "RestrictAddressFamilies={families}");
    let sink = Sink::start();
    let collector = Collector::start(&sink, None);
    set_defaults(root.path(), &[("PYEBPF_OTLP_ENDPOINT", &collector.http_url()), ("PYEBPF_OPTIONS", "--python-only --otlp-period 2")]);
    verify_unit(root.path());
    let (python, _ready) = busy_python(&pyenv_python("3.12.1"));
    let (child, started) = start_unit_command(root.path());
    let stderr = stop_unit_command(child, started, Duration::from_millis(5500));
    let summary = stderr.lines().find(|line| line.contains("otlp: ") && line.contains(" sent to ")).unwrap_or_else(|| panic!("no otlp summary:\n{stderr}"));
    assert!(summary.contains(&format!(" sent to {}", collector.http_url())), "{summary}");
    let requests = sink.wait_requests(3, Duration::from_secs(10));
    assert!(requests.len() >= 3, "{} requests reached the collector in 5.5 s at 2 s each:\n{stderr}", requests.len());
    let fib: u64 = requests
        .iter()
        .flat_map(|r| &r.resources)
        .filter(|r| r.pid() == Some(python.pid()))
        .flat_map(|r| &r.profiles)
        .flat_map(|p| &p.samples)
        .filter(|s| s.stack.iter().any(|f| f.name() == "fib"))
        .map(|s| s.count)
        .sum();
    assert!(fib >= 100, "{fib} samples in Python's fib reached the collector:\n{stderr}");
}
