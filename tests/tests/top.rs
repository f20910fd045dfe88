//! Issue 12: `pyebpf top`, the live view, run as a person would — in a real terminal (tmux),
//! read off the screen with `capture-pane`, typed at with `send-keys` — against a real Python
//! workload. The terminal must come back as it was on every way out.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use pyebpf_tests::{assert_one_line_error, debian_python, pyebpf, pyebpf_command, start_ready};

/// A tmux server of the test's own (its socket in a directory of its own), killed when dropped.
struct Tmux {
    socket: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Tmux {
    /// Starts `sh -c SCRIPT` in a detached session of `width` x `height`.
    fn start(script: &str, width: u16, height: u16) -> Tmux {
        let dir = tempfile::tempdir().unwrap();
        let tmux = Tmux { socket: dir.path().join("tmux"), _dir: dir };
        let (width, height) = (width.to_string(), height.to_string());
        tmux.run(&["new-session", "-d", "-x", &width, "-y", &height, "sh", "-c", script]);
        tmux
    }

    fn run(&self, args: &[&str]) -> String {
        let output =
            Command::new("tmux").arg("-S").arg(&self.socket).args(args).output().expect("tmux must be installed (Debian's tmux; cargo xtask test installs it)");
        assert!(output.status.success(), "tmux {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-J"])
    }

    /// Whether the pane shows the alternate screen (a full-screen program owns it).
    fn alternate_on(&self) -> bool {
        self.run(&["display", "-p", "#{alternate_on}"]).trim() == "1"
    }

    /// Polls the screen until `found` holds, for at most `limit`; returns the screen and when.
    fn wait_for(&self, limit: Duration, found: impl Fn(&str) -> bool) -> Option<(String, Instant)> {
        let started = Instant::now();
        while started.elapsed() < limit {
            let screen = self.screen();
            if found(&screen) {
                return Some((screen, Instant::now()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// The PID of the pane's shell.
    fn shell_pid(&self) -> u32 {
        self.run(&["display", "-p", "#{pane_pid}"]).trim().parse().unwrap()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux").arg("-S").arg(&self.socket).arg("kill-server").output();
    }
}

/// `pyebpf top ARGS` in a pane, followed by its exit status on the screen and the terminal's
/// modes (`stty -a`) in `modes`.
fn top_script(args: &str, modes: &Path) -> String {
    format!("{} top {args}; echo TOP-EXIT=$?; stty -a > {}; sleep 60", pyebpf().display(), modes.display())
}

/// The first frame is drawn (the status line shows) and then `hot` appears within 3 s of it;
/// returns the screen that shows it.
fn wait_for_hot_function(tmux: &Tmux, started: Instant, hot: &str) -> String {
    let (screen, first_frame) = tmux
        .wait_for(Duration::from_secs(60), |screen| screen.contains("pyebpf top "))
        .unwrap_or_else(|| panic!("no frame was drawn within 60 s: {}", tmux.screen()));
    println!("first frame drawn {:?} after pyebpf started (BPF load and attach)", first_frame - started);
    assert!(tmux.alternate_on(), "top does not use the alternate screen: {screen}");
    let (screen, shown) = tmux
        .wait_for(Duration::from_secs(3), |screen| screen.contains(hot))
        .unwrap_or_else(|| panic!("{hot} did not show within 3 s of the first frame: {}", tmux.screen()));
    println!("{hot} shown {:?} after the first frame", shown - first_frame);
    screen
}

/// After the view ended: the exit status, the ordinary screen, and a terminal out of raw mode.
fn assert_restored(tmux: &Tmux, modes: &Path, expected_exit: &str) {
    let (screen, _) =
        tmux.wait_for(Duration::from_secs(10), |screen| screen.contains("TOP-EXIT=")).unwrap_or_else(|| panic!("pyebpf did not exit: {}", tmux.screen()));
    assert!(screen.contains(&format!("TOP-EXIT={expected_exit}")), "{screen}");
    assert!(!tmux.alternate_on(), "the alternate screen is still on");
    assert!(!screen.contains("OWN%"), "the view is still on the screen: {screen}");
    pyebpf_tests::wait_for_file(modes, "stty -a after pyebpf top");
    std::thread::sleep(Duration::from_millis(100));
    let modes = fs::read_to_string(modes).unwrap();
    let words: Vec<&str> = modes.split_whitespace().collect();
    for mode in ["icanon", "echo", "isig"] {
        assert!(words.contains(&mode), "the terminal is left without {mode} (raw mode): {modes}");
    }
}

#[test]
fn top_shows_the_hot_python_function_and_q_restores_the_terminal() {
    let (python, _ready) = start_ready(&debian_python("3.14"), "own_time.py", &[]);
    let dir = tempfile::tempdir().unwrap();
    let modes = dir.path().join("modes");
    let started = Instant::now();
    let tmux = Tmux::start(&top_script(&format!("-p {}", python.pid()), &modes), 160, 45);
    let screen = wait_for_hot_function(&tmux, started, "sixty_percent");
    let row = screen.lines().find(|line| line.contains("sixty_percent")).unwrap();
    assert!(row.contains("own_time.py:") && row.contains(&format!("python3.14 {}", python.pid())), "row lacks file:line or process: {row}");
    assert!(screen.contains("OWN%") && screen.contains("TOTAL%"), "{screen}");

    // Python frames only: the native frames go, the Python ones stay, and sixty_percent is the
    // hottest by own time (about 60% against 30% and 10%).
    tmux.run(&["send-keys", "p"]);
    let (screen, _) = tmux
        .wait_for(Duration::from_secs(3), |screen| screen.contains("frames: Python only"))
        .unwrap_or_else(|| panic!("p did not switch frames: {}", tmux.screen()));
    let first_row = screen.lines().skip_while(|line| !line.contains("OWN%")).nth(1).unwrap_or_default();
    assert!(first_row.contains("sixty_percent"), "hottest Python function by own time is not sixty_percent: {screen}");
    tmux.run(&["send-keys", "t"]);
    tmux.wait_for(Duration::from_secs(3), |screen| screen.contains("sorted by total")).unwrap_or_else(|| panic!("t did not sort: {}", tmux.screen()));
    tmux.run(&["send-keys", "Space"]);
    tmux.wait_for(Duration::from_secs(3), |screen| screen.contains("[PAUSED]")).unwrap_or_else(|| panic!("space did not pause: {}", tmux.screen()));

    tmux.run(&["send-keys", "q"]);
    assert_restored(&tmux, &modes, "0");
}

/// `top` on a free-threaded process: its hot function shows with its file and line.
#[test]
fn top_shows_the_hot_function_of_a_free_threaded_python() {
    let (python, _ready) = start_ready(&pyebpf_tests::free_threaded_python(), "own_time.py", &[]);
    let dir = tempfile::tempdir().unwrap();
    let modes = dir.path().join("modes");
    let tmux = Tmux::start(&top_script(&format!("-p {}", python.pid()), &modes), 160, 45);
    let screen = wait_for_hot_function(&tmux, Instant::now(), "sixty_percent");
    let row = screen.lines().find(|line| line.contains("sixty_percent")).unwrap();
    assert!(row.contains("own_time.py:") && row.contains(&format!("python3.13t {}", python.pid())), "row lacks file:line or process: {row}");
    tmux.run(&["send-keys", "q"]);
    assert_restored(&tmux, &modes, "0");
}

/// `top --async-aware`: the running task and the task awaiting it are rows of their own, beside
/// the functions, with a total share like a function's (busy-1 runs all the time, under parent).
#[test]
fn async_aware_top_shows_the_running_tasks() {
    let (python, _ready) = start_ready(&debian_python("3.14"), "async_tree.py", &["tree"]);
    let dir = tempfile::tempdir().unwrap();
    let modes = dir.path().join("modes");
    let started = Instant::now();
    let tmux = Tmux::start(&top_script(&format!("-p {} --async-aware", python.pid()), &modes), 160, 45);
    let screen = wait_for_hot_function(&tmux, started, "[task busy-1]");
    for task in ["[task busy-1]", "[task parent]"] {
        let row = screen.lines().find(|line| line.contains(task)).unwrap_or_else(|| panic!("no {task} row: {screen}"));
        assert!(row.contains("[asyncio]"), "{row}");
    }
    tmux.run(&["send-keys", "q"]);
    assert_restored(&tmux, &modes, "0");
}

#[test]
fn ctrl_c_quits_and_restores_the_terminal() {
    let (python, _ready) = start_ready(&debian_python("3.14"), "own_time.py", &[]);
    let dir = tempfile::tempdir().unwrap();
    let modes = dir.path().join("modes");
    let tmux = Tmux::start(&top_script(&format!("-p {}", python.pid()), &modes), 160, 45);
    wait_for_hot_function(&tmux, Instant::now(), "sixty_percent");
    tmux.run(&["send-keys", "C-c"]);
    assert_restored(&tmux, &modes, "0");
}

#[test]
fn sigterm_sighup_and_sigint_quit_and_restore_the_terminal() {
    let (python, _ready) = start_ready(&debian_python("3.14"), "own_time.py", &[]);
    for (name, signal) in [("SIGTERM", libc::SIGTERM), ("SIGHUP", libc::SIGHUP), ("SIGINT", libc::SIGINT)] {
        println!("{name}:");
        let dir = tempfile::tempdir().unwrap();
        let modes = dir.path().join("modes");
        let tmux = Tmux::start(&top_script(&format!("-p {} --python-only", python.pid()), &modes), 160, 45);
        wait_for_hot_function(&tmux, Instant::now(), "sixty_percent");
        let shell = tmux.shell_pid();
        let children = fs::read_to_string(format!("/proc/{shell}/task/{shell}/children")).unwrap();
        let top: i32 = children.split_whitespace().next().expect("pyebpf runs under the pane's shell").parse().unwrap();
        assert!(fs::read_to_string(format!("/proc/{top}/cmdline")).unwrap().contains("top"), "pid {top} is not pyebpf top");
        // SAFETY: kill only sends a signal to the pyebpf this test started.
        assert_eq!(unsafe { libc::kill(top, signal) }, 0);
        assert_restored(&tmux, &modes, "0");
    }
}

#[test]
fn top_without_a_terminal_is_a_one_line_error_before_loading() {
    let started = Instant::now();
    let output = pyebpf_command().arg("top").output().unwrap();
    assert!(started.elapsed() < Duration::from_secs(2), "took {:?}: it loaded the sampler first", started.elapsed());
    assert_one_line_error(&output, "standard output must be a terminal");
}

#[test]
fn top_in_a_too_small_terminal_is_a_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let modes = dir.path().join("modes");
    let tmux = Tmux::start(&top_script("", &modes), 50, 8);
    let (screen, _) =
        tmux.wait_for(Duration::from_secs(10), |screen| screen.contains("TOP-EXIT=")).unwrap_or_else(|| panic!("pyebpf did not exit: {}", tmux.screen()));
    assert!(screen.contains("TOP-EXIT=1"), "{screen}");
    assert!(screen.contains("pyebpf: the terminal is 50x8; pyebpf top needs at least 60x10"), "{screen}");
    assert!(!tmux.alternate_on());
}

#[test]
fn help_explains_the_view_and_its_keys() {
    let output = pyebpf_command().args(["top", "--help"]).output().unwrap();
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    for text in [
        "OWN%",
        "TOTAL%",
        "file:line",
        "o sort by own",
        "t sort by total",
        "m switch",
        "p switch",
        "space pause",
        "Ctrl-C quit",
        "--comm",
        "--python-only",
        "-F",
        "--mode",
    ] {
        assert!(help.contains(text), "--help lacks {text}: {help}");
    }
}

/// The TOTAL% of `function`'s row on a screen of top.
fn total_share(screen: &str, function: &str) -> Option<f64> {
    let row = screen.lines().find(|line| line.split_whitespace().nth(4) == Some(function))?;
    row.split_whitespace().nth(1)?.parse().ok()
}

#[test]
fn m_switches_to_wall_clock_time_where_waits_show() {
    let (python, _ready) = start_ready(&debian_python("3.15"), "waits.py", &[]);
    let dir = tempfile::tempdir().unwrap();
    let modes = dir.path().join("modes");
    let started = Instant::now();
    let tmux = Tmux::start(&top_script(&format!("-p {}", python.pid()), &modes), 160, 45);
    let screen = wait_for_hot_function(&tmux, started, "spin_for");
    assert!(screen.contains("[CPU time]"), "{screen}");
    // On CPU, wait_io only enters and leaves its sleep; in wall-clock time it is 70% of its thread.
    assert!(total_share(&screen, "wait_io").is_none_or(|share| share < 20.0), "{screen}");
    tmux.run(&["send-keys", "m"]);
    tmux.wait_for(Duration::from_secs(10), |screen| screen.contains("[wall-clock time]") && total_share(screen, "wait_io").is_some_and(|share| share >= 40.0))
        .unwrap_or_else(|| panic!("m did not show wall-clock time with the sleeping function: {}", tmux.screen()));
    tmux.run(&["send-keys", "q"]);
    assert_restored(&tmux, &modes, "0");
}
