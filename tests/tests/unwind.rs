//! Issue 10 end to end: complete native stacks through code built without frame pointers, unwound
//! from each file's call frame information (`--unwind auto`, the default, and `dwarf`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use pyebpf_tests::{
    compile_c, count_where, debian_python, pyenv_python, record_collapsed as record, stacks_of, start_ready, stats_number, system_python_3_11, total, Killed,
};

/// A frame of Python code as collapsed output renders it: `QUALNAME (FILE.py:LINE)`.
fn is_python(frame: &str) -> bool {
    frame.ends_with(')') && frame.rsplit_once(".py:").is_some_and(|(_, line)| line.trim_end_matches(')').parse::<u32>().is_ok())
}

fn is_python_frame(frame: &str, qualname: &str) -> bool {
    frame.starts_with(&format!("{qualname} (")) && is_python(frame)
}

/// The native frames under the Python function `caller`, innermost last (collapsed order), when
/// the sample is inside it; None otherwise. Only native frames may follow it.
fn native_under<'a>(frames: &'a [String], caller: &str) -> Option<&'a [String]> {
    let at = frames.iter().position(|f| is_python_frame(f, caller))?;
    Some(&frames[at + 1..])
}

/// A native frame of hashing code: named so, or in OpenSSL's libcrypto (stripped: frames there are
/// `libcrypto.so.3+0xOFFSET`), or the `_hashlib` module.
fn is_hashing_frame(frame: &str) -> bool {
    let lower = frame.to_ascii_lowercase();
    !is_python(frame) && ["sha", "hacl", "evp_digest", "libcrypto", "_hashlib"].iter().any(|name| lower.contains(name))
}

/// The stack's root: collapsed stacks start at the outermost frame, and a complete one starts at
/// the executable's entry point `_start` and passes `Py_BytesMain` on its way to the interpreter
/// (both are in `.dynsym`, so named in Debian's stripped builds too; `main` is not).
fn reaches_root(frames: &[String]) -> bool {
    frames.first().is_some_and(|f| f == "_start") && frames.iter().any(|f| f == "Py_BytesMain")
}

/// Samples unwound by rules in the kernel, and from copies in userspace.
fn unwound_where(stderr: &str) -> (u64, u64) {
    (stats_number(stderr, "in the kernel, by rules:", 0) as u64, stats_number(stderr, "CFI-unwound samples:", 0) as u64)
}

fn check_python(python: &Path) {
    let (child, _dir) = start_ready(python, "unwind_native.py", &[]);
    std::thread::sleep(Duration::from_millis(300));
    let pid = child.pid().to_string();
    let (collapsed, stderr) = record(&["-p", &pid, "-F", "499", "-d", "5", "--stats"]);
    let stacks = stacks_of(&collapsed, child.pid());
    let all = total(&stacks);
    assert!(all >= 100, "{}: only {all} samples\n{stderr}", python.display());
    for (caller, is_callee) in [("hash_caller", is_hashing_frame as fn(&str) -> bool), ("regex_caller", |_: &str| true)] {
        let inside = count_where(&stacks, |frames| native_under(frames, caller).is_some());
        // Native code called from the function lies directly under it, and so does nothing else:
        // the frame-pointer walk of these builds gave one frame at most (the leaf), so two or more
        // show the unwind went through the C code's callers.
        let complete = count_where(&stacks, |frames| {
            native_under(frames, caller).is_some_and(|below| below.len() >= 2 && below.iter().all(|f| !is_python(f)) && below.iter().any(|f| is_callee(f)))
        });
        assert!(inside >= 20, "{}: only {inside} samples in {caller}:\n{collapsed}", python.display());
        assert!(
            complete * 100 >= inside * 80,
            "{}: {complete} of {inside} samples in {caller} have its native callees under it:\n{collapsed}",
            python.display()
        );
    }
    let rooted = count_where(&stacks, reaches_root);
    assert!(rooted * 100 >= all * 80, "{}: {rooted} of {all} samples reach _start through Py_BytesMain:\n{collapsed}", python.display());
    // Unwound by call frame information, the stacks above were mostly unwound in the kernel, by
    // the rules userspace published from the first ones it unwound from copies.
    let (in_kernel, copied) = unwound_where(&stderr);
    if in_kernel + copied > 0 {
        assert!(
            in_kernel * 100 >= (in_kernel + copied) * 70,
            "{}: {in_kernel} samples unwound in the kernel, {copied} from copies:\n{stderr}",
            python.display()
        );
    }
}

#[test]
fn python_native_stacks_debian_3_13() {
    check_python(&debian_python("3.13"));
}

#[test]
fn python_native_stacks_debian_3_14() {
    check_python(&debian_python("3.14"));
}

#[test]
fn python_native_stacks_debian_3_15() {
    check_python(&debian_python("3.15"));
}

/// Before 3.11 every Python frame is an interpreter activation of its own, placed by name.
#[test]
fn python_native_stacks_pyenv_3_10_13() {
    check_python(&pyenv_python("3.10.13"));
}

/// 3.11 places each Python segment at its interpreter's C frame by name: Debian's stripped build.
#[test]
fn python_native_stacks_system_3_11() {
    check_python(&system_python_3_11());
}

#[test]
fn python_native_stacks_pyenv_3_13_0() {
    check_python(&pyenv_python("3.13.0"));
}

/// main → chain_a → chain_b → chain_c → chain_d, spinning in chain_d for argv[1] seconds; every
/// call is followed by work, so none becomes a jump.
const CHAIN_C: &str = r#"
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>
volatile unsigned long sink;
volatile sig_atomic_t stop;
static void on_alarm(int sig) { (void)sig; stop = 1; }
__attribute__((noinline)) void chain_d(unsigned long n) { while (!stop) sink += n * sink + 1; }
__attribute__((noinline)) void chain_c(unsigned long n) { chain_d(n + sink); sink++; }
__attribute__((noinline)) void chain_b(unsigned long n) { chain_c(n * 3 + sink); sink++; }
__attribute__((noinline)) void chain_a(unsigned long n) { chain_b(n ^ sink); sink++; }
int main(int argc, char **argv) {
    signal(SIGALRM, on_alarm);
    alarm(argc > 1 ? atoi(argv[1]) : 60);
    chain_a(argc);
    return 0;
}
"#;

fn compile_chain(dir: &Path) -> PathBuf {
    compile_c(dir, "chain", CHAIN_C, &["-O2", "-fomit-frame-pointer"])
}

fn chain_share(unwind: &str, binary: &Path) -> (u64, u64, String) {
    let child = Killed(Command::new(binary).arg("30").spawn().unwrap());
    std::thread::sleep(Duration::from_millis(100));
    let pid = child.pid().to_string();
    let (collapsed, _) = record(&["-p", &pid, "-F", "199", "-d", "3", "--unwind", unwind]);
    let stacks = stacks_of(&collapsed, child.pid());
    let chained = count_where(&stacks, |frames| frames.join(";").contains("main;chain_a;chain_b;chain_c;chain_d"));
    (chained, total(&stacks), collapsed)
}

#[test]
fn c_without_frame_pointers_shows_its_whole_chain() {
    let dir = tempfile::tempdir().unwrap();
    let binary = compile_chain(dir.path());
    for unwind in ["auto", "dwarf"] {
        let (chained, all, collapsed) = chain_share(unwind, &binary);
        assert!(all >= 50, "--unwind {unwind}: only {all} samples");
        assert!(chained * 100 >= all * 90, "--unwind {unwind}: {chained} of {all} samples show main;chain_a;chain_b;chain_c;chain_d:\n{collapsed}");
    }
    // The control: frame pointers alone cannot unwind this program (else the test shows nothing).
    let (chained, all, collapsed) = chain_share("fp", &binary);
    assert!(chained * 2 < all, "--unwind fp: {chained} of {all} samples show the whole chain: was it built with frame pointers?\n{collapsed}");
}

/// Once userspace has unwound stacks from copies, the eBPF program unwinds the process's later
/// samples itself by the rules of the code they went through: most samples come without a copy,
/// and they show the whole chain as the copies did.
#[test]
fn the_kernel_unwinds_by_the_rules_userspace_published() {
    let dir = tempfile::tempdir().unwrap();
    let binary = compile_chain(dir.path());
    let child = Killed(Command::new(&binary).arg("30").spawn().unwrap());
    std::thread::sleep(Duration::from_millis(100));
    let pid = child.pid().to_string();
    let (collapsed, stderr) = record(&["-p", &pid, "-F", "199", "-d", "3", "--unwind", "dwarf", "--stats"]);
    let stacks = stacks_of(&collapsed, child.pid());
    let all = total(&stacks);
    let chained = count_where(&stacks, |frames| frames.join(";").contains("main;chain_a;chain_b;chain_c;chain_d"));
    let (in_kernel, copied) = unwound_where(&stderr);
    assert!(all >= 300, "only {all} samples\n{stderr}");
    assert!(in_kernel * 100 >= all * 90, "{in_kernel} of {all} samples unwound in the kernel ({copied} from copies):\n{stderr}");
    assert!(chained * 100 >= all * 95, "{chained} of {all} samples show main;chain_a;chain_b;chain_c;chain_d:\n{collapsed}");
}
