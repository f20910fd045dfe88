//! Issue 4 end to end: real CPython 3.8 to 3.15 processes recorded by the real pyebpf binary.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use pyebpf_tests::{
    count_where, debian_python, free_threaded_python, pyebpf, pyenv_python, record_collapsed as record, stacks_of, start_ready, stats_number,
    system_python_3_11, total, Killed,
};

/// The interpreters under test: (label, path).
fn interpreters() -> Vec<(&'static str, PathBuf)> {
    vec![
        ("pyenv-3.8.18", pyenv_python("3.8.18")),
        ("pyenv-3.9.18", pyenv_python("3.9.18")),
        ("pyenv-3.10.13", pyenv_python("3.10.13")),
        ("pyenv-3.11.7", pyenv_python("3.11.7")),
        ("system-3.11", system_python_3_11()),
        ("pyenv-3.12.1", pyenv_python("3.12.1")),
        ("pyenv-3.13.0", pyenv_python("3.13.0")),
        ("debian-3.13", debian_python("3.13")),
        ("debian-3.14", debian_python("3.14")),
        ("debian-3.15", debian_python("3.15")),
        // Beside pyenv's and Debian's 3.13 GIL builds: one recording reads both flavours.
        ("free-threaded-3.13", free_threaded_python()),
    ]
}

fn python(label: &str) -> PathBuf {
    interpreters().into_iter().find(|(l, _)| *l == label).unwrap().1
}

/// A workload script, settled into its steady state; killed when dropped.
struct Workload {
    child: Killed,
    _dir: tempfile::TempDir,
}

impl Workload {
    fn start(python: &Path, script_name: &str, args: &[&str]) -> Workload {
        let (child, dir) = start_ready(python, script_name, args);
        std::thread::sleep(Duration::from_millis(200));
        Workload { child, _dir: dir }
    }

    fn pid(&self) -> u32 {
        self.child.pid()
    }
}

/// A Python frame as collapsed output renders it: `QUALNAME (FILE:LINE)`.
fn is_python_frame(frame: &str, qualname: &str) -> bool {
    frame.starts_with(&format!("{qualname} (")) && frame.ends_with(')') && frame.contains(".py:")
}

fn any_python_frame(frame: &str) -> bool {
    frame.ends_with(')') && frame.rsplit_once(".py:").is_some_and(|(_, line)| line.trim_end_matches(')').parse::<u32>().is_ok())
}

fn check_proportions(label: &str) {
    let workload = Workload::start(&python(label), "sampling_proportions.py", &[]);
    let pid = workload.pid().to_string();
    let (collapsed, _) = record(&["-p", &pid, "-F", "499", "-d", "6"]);
    let stacks = stacks_of(&collapsed, workload.pid());
    let counts: Vec<u64> = ["sixty_percent", "thirty_percent", "ten_percent"]
        .iter()
        .map(|name| count_where(&stacks, |frames| frames.iter().any(|f| is_python_frame(f, name))))
        .collect();
    let busy: u64 = counts.iter().sum();
    assert!(busy * 10 >= total(&stacks) * 9, "{label}: only {busy} of {} samples in the three functions", total(&stacks));
    assert!(busy > 1000, "{label}: too few samples ({busy}) to measure shares");
    for (count, expected) in counts.iter().zip([60.0, 30.0, 10.0]) {
        let share = 100.0 * *count as f64 / busy as f64;
        assert!((share - expected).abs() <= 3.0, "{label}: share {share:.1}% where {expected}% was spent (counts {counts:?})");
    }
}

#[test]
fn proportions_pyenv_3_8_18() {
    check_proportions("pyenv-3.8.18");
}

#[test]
fn proportions_pyenv_3_9_18() {
    check_proportions("pyenv-3.9.18");
}

#[test]
fn proportions_pyenv_3_10_13() {
    check_proportions("pyenv-3.10.13");
}

#[test]
fn proportions_pyenv_3_11_7() {
    check_proportions("pyenv-3.11.7");
}

#[test]
fn proportions_system_3_11() {
    check_proportions("system-3.11");
}

#[test]
fn proportions_pyenv_3_12_1() {
    check_proportions("pyenv-3.12.1");
}

#[test]
fn proportions_pyenv_3_13_0() {
    check_proportions("pyenv-3.13.0");
}

#[test]
fn proportions_debian_3_13() {
    check_proportions("debian-3.13");
}

#[test]
fn proportions_debian_3_14() {
    check_proportions("debian-3.14");
}

#[test]
fn proportions_free_threaded_3_13() {
    check_proportions("free-threaded-3.13");
}

#[test]
fn proportions_debian_3_15() {
    check_proportions("debian-3.15");
}

/// The Python frames of a stack, root first, as qualnames.
fn python_qualnames(frames: &[String]) -> Vec<&str> {
    frames.iter().filter(|f| any_python_frame(f)).map(|f| f.split(" (").next().unwrap()).collect()
}

fn check_depth(label: &str) {
    let workload = Workload::start(&python(label), "sampling_deep.py", &["400"]);
    let pid = workload.pid().to_string();
    let (collapsed, _) = record(&["-p", &pid, "-F", "199", "-d", "3"]);
    let stacks = stacks_of(&collapsed, workload.pid());
    let mut expected = vec!["<module>"];
    expected.extend(std::iter::repeat_n("recurse", 400));
    let complete = count_where(&stacks, |frames| python_qualnames(frames) == expected);
    let all = total(&stacks);
    assert!(all >= 300, "{label}: only {all} samples");
    assert!(complete * 100 >= all * 99, "{label}: {complete} of {all} samples show the 400 frames in order");
}

/// Before 3.11 every Python call recurses in C: 400 frames and 400 interpreter activations.
#[test]
fn depth_400_pyenv_3_10_13() {
    check_depth("pyenv-3.10.13");
}

#[test]
fn depth_400_pyenv_3_11_7() {
    check_depth("pyenv-3.11.7");
}

#[test]
fn depth_400_system_3_11() {
    check_depth("system-3.11");
}

#[test]
fn depth_400_pyenv_3_12_1() {
    check_depth("pyenv-3.12.1");
}

#[test]
fn depth_400_pyenv_3_13_0() {
    check_depth("pyenv-3.13.0");
}

#[test]
fn depth_400_debian_3_13() {
    check_depth("debian-3.13");
}

#[test]
fn depth_400_debian_3_14() {
    check_depth("debian-3.14");
}

#[test]
fn depth_400_debian_3_15() {
    check_depth("debian-3.15");
}

/// A native frame of hashing code: named so, or in OpenSSL's libcrypto (stripped: frames there
/// are `libcrypto.so.3+0xOFFSET`) or the `_hashlib` module.
fn is_hashing_frame(frame: &str) -> bool {
    let lower = frame.to_ascii_lowercase();
    !any_python_frame(frame) && ["sha", "hacl", "evp_digest", "libcrypto", "_hashlib"].iter().any(|name| lower.contains(name))
}

#[test]
fn native_hashing_frames_sit_under_their_python_caller_on_3_15() {
    let workload = Workload::start(&python("debian-3.15"), "sampling_hash.py", &[]);
    let pid = workload.pid().to_string();
    let (collapsed, _) = record(&["-p", &pid, "-F", "199", "-d", "3"]);
    let stacks = stacks_of(&collapsed, workload.pid());
    let merged = count_where(&stacks, |frames| {
        let Some(caller) = frames.iter().position(|f| is_python_frame(f, "hash_caller")) else { return false };
        let below = &frames[caller + 1..];
        below.first().is_some_and(|f| !any_python_frame(f)) && below.iter().all(|f| !any_python_frame(f)) && below.iter().any(|f| is_hashing_frame(f))
    });
    let all = total(&stacks);
    assert!(merged * 2 > all, "{merged} of {all} samples have native hashing frames directly under hash_caller:\n{collapsed}");

    let (python_only, _) = record(&["-p", &pid, "-F", "199", "-d", "2", "--no-native"]);
    let stacks = stacks_of(&python_only, workload.pid());
    let all = total(&stacks);
    assert!(all > 100, "only {all} samples");
    for (frames, _) in &stacks {
        assert!(frames.iter().all(|f| any_python_frame(f)), "--no-native left a native frame: {frames:?}");
    }
    // The loop around the calls runs too, briefly: nearly every sample is inside one.
    let in_caller = count_where(&stacks, |frames| frames.iter().any(|f| is_python_frame(f, "hash_caller")));
    assert!(in_caller * 100 >= all * 95, "{in_caller} of {all} samples inside hash_caller:\n{python_only}");
}

#[test]
fn depth_400_free_threaded_3_13() {
    check_depth("free-threaded-3.13");
}

/// On 3.15 the kernel's walk stops at the marker: far fewer frames walked per sample than when
/// it walks every chain in full (`--no-cache`), with the same complete stacks.
#[test]
fn last_profiled_frame_cuts_the_kernel_walk_on_3_15() {
    let workload = Workload::start(&python("debian-3.15"), "sampling_deep.py", &["200"]);
    let pid = workload.pid().to_string();
    let (_, cached) = record(&["-p", &pid, "-F", "199", "-d", "3", "--stats"]);
    let (_, uncached) = record(&["-p", &pid, "-F", "199", "-d", "3", "--stats", "--no-cache"]);
    let joins = stats_number(&cached, "marker joins:", 1);
    assert!(joins > 90.0, "marker joins in {joins}% of samples:\n{cached}");
    let walked_cached = stats_number(&cached, "frames walked in the kernel:", 1);
    let walked_uncached = stats_number(&uncached, "frames walked in the kernel:", 1);
    assert!(walked_uncached >= 200.0, "--no-cache walked {walked_uncached} frames per sample of a 200-deep stack");
    assert!(walked_uncached >= 5.0 * walked_cached, "{walked_uncached} frames walked per sample uncached vs {walked_cached} with the marker");
    for stats in [&cached, &uncached] {
        assert_eq!(stats_number(stats, "truncated:", 0), 0.0, "{stats}");
    }
}

/// On 3.13/3.14 the kernel walks the whole chain: at steady state no frame is read from the
/// process (code objects are decoded once).
fn check_no_remote_frame_reads(label: &str) {
    let workload = Workload::start(&python(label), "sampling_deep.py", &["200"]);
    let pid = workload.pid().to_string();
    let (_, stats) = record(&["-p", &pid, "-F", "199", "-d", "3", "--stats"]);
    assert!(stats_number(&stats, "frames walked in the kernel:", 1) >= 200.0, "{label}: {stats}");
    assert!(stats_number(&stats, "remote reads:", 1) < 0.2, "{label}: {stats}");
    assert_eq!(stats_number(&stats, "truncated:", 0), 0.0, "{label}: {stats}");
}

#[test]
fn kernel_walks_whole_chains_on_free_threaded_3_13() {
    check_no_remote_frame_reads("free-threaded-3.13");
}

#[test]
fn kernel_walks_whole_chains_on_3_14() {
    check_no_remote_frame_reads("debian-3.14");
}

#[test]
fn kernel_walks_whole_chains_on_3_13() {
    check_no_remote_frame_reads("debian-3.13");
}

#[test]
fn one_recording_covers_every_version() {
    let workloads: Vec<(&str, Workload)> =
        interpreters().into_iter().map(|(label, path)| (label, Workload::start(&path, "sampling_deep.py", &["30"]))).collect();
    // Eleven spinners share two CPUs: 6 s gives each about 100 samples.
    let (collapsed, _) = record(&["-a", "-F", "99", "-d", "6"]);
    let mut expected = vec!["<module>"];
    expected.extend(std::iter::repeat_n("recurse", 30));
    for (label, workload) in &workloads {
        let stacks = stacks_of(&collapsed, workload.pid());
        let right = count_where(&stacks, |frames| python_qualnames(frames) == expected);
        let all = total(&stacks);
        assert!(all >= 50, "{label}: only {all} samples");
        let wrong: Vec<_> = stacks.iter().filter(|(frames, _)| python_qualnames(frames) != expected).take(3).collect();
        assert!(right * 100 >= all * 95, "{label}: {right} of {all} samples have the right Python stack; some that do not: {wrong:#?}");
    }
}

/// pyebpf writes only to validated 3.15 processes, and only 8-byte `last_profiled_frame` fields:
/// every write system call it makes during a host-wide recording is traced.
#[test]
fn writes_only_the_marker_of_3_15_processes() {
    let workloads: HashMap<&str, Workload> =
        interpreters().into_iter().map(|(label, path)| (label, Workload::start(&path, "sampling_idle_threads.py", &[]))).collect();
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace");
    // `open` too: musl's open() is that system call, glibc's is openat.
    let status = Command::new("strace")
        .args(["-f", "-qq", "-e", "trace=process_vm_writev,open,openat", "-o"])
        .arg(&trace)
        .arg(pyebpf())
        .args(["record", "-a", "-F", "99", "-d", "3", "-o"])
        .arg(dir.path().join("p.folded"))
        .status()
        .expect("strace must be installed (cargo xtask test installs it)");
    assert!(status.success());
    let trace = std::fs::read_to_string(trace).unwrap();
    let target_315 = workloads["debian-3.15"].pid();
    let mut writes_315 = 0;
    for line in trace.lines() {
        if let Some(call) = line.split_once("process_vm_writev(").map(|(_, rest)| rest) {
            let pid: u32 = call.split(',').next().unwrap().trim().parse().unwrap();
            assert_eq!(pid, target_315, "pyebpf wrote to process {pid}, not the 3.15 process: {line}");
            assert!(call.contains("iov_len=8}], 1, [{iov_base=") && call.ends_with("= 8"), "not one 8-byte write: {line}");
            writes_315 += 1;
        }
        if line.contains("/mem\"") {
            assert!(line.contains("O_RDONLY"), "pyebpf opened process memory for writing: {line}");
        }
    }
    assert!(writes_315 > 0, "no marker write to the 3.15 process was traced: the check above proves nothing");
}

/// Processes of CPythons pyebpf does not read are named, with their version, in the summary.
#[test]
fn older_pythons_are_named_in_the_summary() {
    let spin = "while True: pass";
    let older = [pyenv_python("3.7.16"), pyenv_python("3.6.15"), pyenv_python("2.7.18")];
    let children: Vec<Killed> = older.iter().map(|python| Killed(Command::new(python).args(["-c", spin]).spawn().unwrap())).collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut args = vec!["-d".to_string(), "1".to_string()];
    for child in &children {
        args.extend(["-p".to_string(), child.pid().to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_, stderr) = record(&args);
    let line = stderr.lines().find(|l| l.contains("native frames only")).unwrap_or_else(|| panic!("no line names them: {stderr}"));
    for (child, version) in children.iter().zip(["3.7", "3.6", "2.7"]) {
        assert!(line.contains(&format!("CPython {version} (pid {})", child.pid())), "{version} is not named: {line}");
    }
}
