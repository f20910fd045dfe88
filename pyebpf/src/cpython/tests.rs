//! The reader's API on real interpreters (Debian's, under `PYEBPF_PYTHONS`): versions, threads,
//! the eBPF configuration, frames, and the 3.15 marker, the only write pyebpf makes, which must be
//! refused everywhere else.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::memory::ReadExt;
use super::{PyError, PyProcess};
use pyebpf_common::NO_OFFSET;

struct Target(Child);

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts Debian's `python3.X` with two threads waiting, and attaches once it is ready.
fn attach(version: &str) -> (Target, PyProcess) {
    let code =
        "import sys, threading\nhold = threading.Event()\nthreading.Thread(target=hold.wait, daemon=True).start()\nopen(sys.argv[1], 'w').close()\nhold.wait()";
    attach_running(version, code)
}

/// Starts Debian's `python3.X -c CODE READY_FILE`, and attaches once CODE creates READY_FILE.
fn attach_running(version: &str, code: &str) -> (Target, PyProcess) {
    let python = match version {
        "3.13t" => pyebpf_tests::free_threaded_python(),
        _ => pyebpf_tests::debian_python(version),
    };
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("ready");
    let target = Target(Command::new(&python).args(["-c", code]).arg(&ready).stdin(Stdio::null()).spawn().unwrap());
    let started = Instant::now();
    while !ready.exists() {
        assert!(started.elapsed() < Duration::from_secs(30), "{} did not get ready", python.display());
        std::thread::sleep(Duration::from_millis(10));
    }
    let process = PyProcess::attach(target.0.id()).unwrap_or_else(|err| panic!("attach to {}: {err}", python.display()));
    (target, process)
}

#[test]
fn threads_and_versions_of_each_interpreter() {
    for (version, minor, tag_mask) in [("3.13", 13, 0), ("3.14", 14, 3), ("3.15", 15, 3)] {
        let (target, mut process) = attach(version);
        assert_eq!((process.version().major(), process.version().minor()), (3, minor));
        let threads = process.threads().unwrap();
        assert_eq!(threads.len(), 2, "threads of {version}: {threads:?}");
        assert!(threads.iter().any(|t| t.tid == target.0.id()), "the main thread's tid is missing: {threads:?}");
        assert!(threads.iter().all(|t| t.current_frame != 0), "a waiting thread without frames: {threads:?}");
        let main = threads.iter().find(|t| t.tid == target.0.id()).unwrap();
        assert_eq!(process.thread_name(main.tid).as_deref(), Some(format!("python{version}").as_str()));
        let config = process.bpf_config();
        assert_eq!(config.executable_tag_mask, tag_mask, "{version}");
        assert_eq!(config.tstate_last_profiled_frame != NO_OFFSET, minor == 15, "{version}");
        assert_eq!(config.tstate_last_profiled_seq != NO_OFFSET, minor == 15, "{version}");
        // What the eBPF program reads to find a thread's attached state (with subinterpreters):
        // the main interpreter's list, followed with the config's offsets, names every thread.
        let mem = process.memory();
        let interp = mem.read_u64(config.interpreters_head).unwrap();
        assert_eq!(mem.read_u64(interp + config.interp_next as u64).unwrap(), 0, "{version}: one interpreter");
        let mut listed = Vec::new();
        let mut tstate = mem.read_u64(interp + config.interp_threads_head as u64).unwrap();
        while tstate != 0 && listed.len() < 8 {
            listed.push((mem.read_u64(tstate + config.tstate_native_thread_id as u64).unwrap() as u32, tstate));
            tstate = mem.read_u64(tstate + config.tstate_next as u64).unwrap();
        }
        let mut expected: Vec<(u32, u64)> = threads.iter().map(|t| (t.ns_tid, t.tstate)).collect();
        listed.sort();
        expected.sort();
        assert_eq!(listed, expected, "{version}");
        assert!(!process.has_subinterpreters(), "{version}");
        let (reads, bytes) = (process.remote_counters().reads, process.remote_counters().bytes);
        assert!(reads > 0 && bytes > 0, "remote reads were not counted");
    }
}

#[test]
fn the_marker_is_written_only_into_the_static_main_thread_state_of_3_15() {
    let (target, mut process) = attach("3.15");
    let threads = process.threads().unwrap();
    let main = threads.iter().find(|t| t.tid == target.0.id()).unwrap();
    let worker = threads.iter().find(|t| t.tid != target.0.id()).unwrap();
    assert!(process.marker_writable(main.tstate), "the main thread state lies in _PyRuntime");
    assert!(!process.marker_writable(worker.tstate), "a worker's thread state is heap memory, freed before its thread exits");
    let refused = |result: Result<(), PyError>| matches!(result, Err(PyError::WriteRefused(_)));
    assert!(refused(process.set_last_profiled_frame(main.tstate, main.current_frame)), "written before any frame was decoded");
    let link = process.walk_frames(main.current_frame).unwrap().links[0];
    process.frame_info(&link).unwrap();
    assert!(refused(process.set_last_profiled_frame(worker.tstate, worker.current_frame)));
    process.set_last_profiled_frame(main.tstate, main.current_frame).unwrap();
    assert_eq!(process.read_marker_state(main.tstate).unwrap().marker, main.current_frame);
    process.set_last_profiled_frame(main.tstate, 0).unwrap();
    assert_eq!(process.read_marker_state(main.tstate).unwrap().marker, 0);

    for version in ["3.13", "3.14"] {
        let (target, mut process) = attach(version);
        let threads = process.threads().unwrap();
        let main = threads.iter().find(|t| t.tid == target.0.id()).unwrap();
        assert!(process.read_marker_state(main.tstate).is_err());
        assert!(!process.marker_writable(main.tstate));
        assert!(refused(process.set_last_profiled_frame(main.tstate, 0)), "a marker write to CPython {version} was not refused");
    }
    // A free-threaded 3.15 would share the version number, not the behaviour the write was tested
    // against.
    let (target, mut process) = attach("3.15");
    process.offsets.free_threaded = true;
    let main = process.threads().unwrap().into_iter().find(|t| t.tid == target.0.id()).unwrap();
    assert!(!process.marker_writable(main.tstate));
}

/// Free-threaded 3.13 (a larger object header): every offset from its own table, `co_version`
/// where its code objects keep it, no GIL holder, and frames that decode to its functions.
#[test]
fn free_threaded_3_13_is_read_with_its_own_layout() {
    let code = "import sys, threading\nhold = threading.Event()\ndef parked_here():\n    open(sys.argv[1], 'w').close()\n    hold.wait()\nparked_here()";
    let (target, mut process) = attach_running("3.13t", code);
    let o = process.offsets().clone();
    assert!(o.free_threaded);
    assert_eq!(process.python_name(), format!("free-threaded CPython {}", o.version));
    // `ob_tid`, flags, mutex, GC bits and the local and shared counts come before the type.
    assert_eq!(o.object_type, 24);
    assert_eq!(o.code_identity, super::offsets::CodeIdentity::Version(108));
    let main = process.threads().unwrap().into_iter().find(|t| t.tid == target.0.id()).unwrap();
    assert!(!main.holds_gil && !main.active, "a thread blocked in wait() is detached, and no thread holds a GIL");
    let walk = process.walk_frames(main.current_frame).unwrap();
    let names: Vec<String> = walk.links.iter().filter_map(|link| process.frame_info(link).unwrap()).map(|f| f.frame.qualname.to_string()).collect();
    assert!(names.iter().any(|name| name == "parked_here") && names.last().is_some_and(|name| name == "<module>"), "{names:?}");
    let version = process.code_version(walk.links[walk.links.len() - 1].code).unwrap();
    assert_ne!(version, 0, "co_version read from the wrong place");
}

#[test]
fn frames_resolve_step_by_step_and_the_code_cache_hits() {
    let (_target, mut process) = attach("3.14");
    let threads = process.threads().unwrap();
    for _ in 0..2 {
        for thread in &threads {
            let links = process.walk_frames(thread.current_frame).unwrap().links;
            assert!(!links.is_empty());
            let innermost = process.frame_info(&links[0]).unwrap().expect("the innermost frame runs Python code");
            assert_eq!(&*innermost.frame.qualname, "Condition.wait", "{innermost:?}");
            assert!(innermost.location.column.is_some(), "no columns: {innermost:?}");
            assert_eq!(process.python_frame(links[0].code, links[0].instr_ptr).unwrap(), innermost.frame);
        }
    }
    let counters = process.code_cache_counters();
    assert!(counters.hits > 0 && counters.misses > 0, "code cache {counters:?}");
    assert_eq!(counters.cached_entries, counters.misses, "{counters:?}");
    assert!(counters.cached_bytes > 0 && counters.evictions == 0, "{counters:?}");
}

#[test]
fn a_process_gone_between_reads_gives_errors() {
    let (mut target, mut process) = attach("3.14");
    let threads = process.threads().unwrap();
    target.0.kill().unwrap();
    target.0.wait().unwrap();
    let err = process.walk_frames(threads[0].current_frame).expect_err("frames of an exited process");
    assert!(err.process_gone(), "{err}");
    assert!(matches!(process.threads(), Err(PyError::Memory(_))));
    assert!(process.code(threads[0].current_frame).is_err());
}

/// A function whose location table is past the 64 KiB budget, and names past the 4 KiB one.
const OVERSIZED: &str = r#"
import sys, threading
hold = threading.Event()
namespace = {"hold": hold}
exec("def big():\n" + "    x = 1\n" * 40000 + "    hold.wait()\n", namespace)
exec("def " + "n" * 10000 + "():\n    hold.wait()\n", namespace)
exec("def " + "\U00020000" * 2000 + "():\n    hold.wait()\n", namespace)
for function in list(namespace.values())[1:]:
    if callable(function):
        threading.Thread(target=function, daemon=True).start()
assert len(namespace["big"].__code__.co_linetable) > 64 << 10
open(sys.argv[1], 'w').close()
hold.wait()
"#;

#[test]
fn location_tables_and_names_are_cut_at_their_budgets() {
    let (_target, mut process) = attach_running("3.14", OVERSIZED);
    let mut frames = Vec::new();
    for thread in process.threads().unwrap() {
        for link in process.walk_frames(thread.current_frame).unwrap().links {
            frames.extend(process.frame_info(&link).unwrap());
        }
    }
    let big = frames.iter().find(|f| &*f.frame.qualname == "big").expect("big() is on a stack");
    assert_eq!(big.frame.first_line, 1);
    assert_eq!(big.frame.line, 0, "a line past the read part of the table is unknown: {big:?}");
    let ascii = frames.iter().find(|f| f.frame.qualname.starts_with('n')).expect("the long ASCII name is on a stack");
    assert_eq!(&*ascii.frame.qualname, format!("{}…", "n".repeat(4096)));
    assert_eq!(ascii.frame.line, 2, "a short table is read whole: {:?}", ascii.location);
    let wide = frames.iter().find(|f| f.frame.qualname.starts_with('\u{20000}')).expect("the long UCS-4 name is on a stack");
    assert_eq!(&*wide.frame.qualname, format!("{}…", "\u{20000}".repeat(1024)));
    let counters = process.code_cache_counters();
    assert_eq!((counters.truncated_linetables, counters.truncated_strings), (1, 2), "{counters:?}");
}

/// The main thread spins in a subinterpreter, entered from the main interpreter, while another
/// thread waits in the main interpreter; `sys.argv[1]` is created from inside the subinterpreter.
const SUBINTERPRETER: &str = r#"
import sys, threading
try:
    from concurrent import interpreters
    run = interpreters.create().exec
except ImportError:
    import _interpreters
    interp = _interpreters.create()
    run = lambda code: _interpreters.run_string(interp, code)
def main_wait():
    threading.Event().wait()
threading.Thread(target=main_wait, daemon=True).start()
def enter_sub():
    run(f"def sub_spin():\n    open({sys.argv[1]!r}, 'w').close()\n    while True: pass\nsub_spin()\n")
enter_sub()
"#;

#[test]
fn a_thread_in_a_subinterpreter_is_read_in_the_state_it_runs_in() {
    for version in ["3.13", "3.14", "3.15"] {
        let (target, mut process) = attach_running(version, SUBINTERPRETER);
        let main_tid = target.0.id();
        let states = process.thread_states().unwrap();
        let main_states: Vec<_> = states.iter().filter(|t| t.tid == main_tid).collect();
        assert_eq!(main_states.len(), 2, "{version}: the main thread has a state in each interpreter: {states:?}");
        assert!(main_states.iter().any(|t| t.interpreter == 0) && main_states.iter().any(|t| t.interpreter != 0), "{version}: {states:?}");
        let innermost = |process: &mut PyProcess, frame: u64| {
            let links = process.walk_frames(frame).unwrap().links;
            links.iter().find_map(|link| process.frame_info(link).unwrap()).map(|r| r.frame.qualname.to_string())
        };
        let threads = process.threads().unwrap();
        assert_eq!(threads.len(), 2, "{version}: one state per thread: {threads:?}");
        let main = threads.iter().find(|t| t.tid == main_tid).unwrap();
        assert!(main.active && main.interpreter != 0, "{version}: {main:?}");
        assert_eq!(innermost(&mut process, main.current_frame).as_deref(), Some("sub_spin"), "{version}");
        let parked = main_states.iter().find(|t| t.interpreter == 0).unwrap();
        assert!(!parked.active, "{version}: {parked:?}");
        assert_eq!(
            innermost(&mut process, parked.current_frame).as_deref(),
            Some(if version == "3.13" { "<lambda>" } else { "Interpreter.exec" }),
            "{version}"
        );
        let waiting = threads.iter().find(|t| t.tid != main_tid).unwrap();
        assert_eq!((waiting.interpreter, innermost(&mut process, waiting.current_frame).as_deref()), (0, Some("Condition.wait")), "{version}");
    }
}

/// pyebpf's own tables for 3.8 to 3.12 are used only once the live process bears them out:
/// pyenv's 3.8.18 to 3.12.1 and Debian 12's own 3.11.2 are attached with them, and the same table
/// with one thread-state or frame offset moved (as a debug or patched build would move it) is
/// refused in one line naming the version.
#[test]
fn a_builtin_table_is_proven_against_the_process() {
    let pyenv = std::path::PathBuf::from(pyebpf_tests::xtask_env("HOME")).join(".pyenv/versions");
    // Before 3.11 the version is known from the interpreter's name only.
    for (python, version, hex) in [
        (pyenv.join("3.8.18/bin/python3.8"), "3.8", 0x03080000),
        (pyenv.join("3.9.18/bin/python3.9"), "3.9", 0x03090000),
        (pyenv.join("3.10.13/bin/python3.10"), "3.10", 0x030a0000),
        (pyenv.join("3.11.7/bin/python3.11"), "3.11.7", 0x030b07f0),
        (std::path::PathBuf::from("/usr/bin/python3.11"), "3.11.2", 0x030b02f0),
        (pyenv.join("3.12.1/bin/python3.12"), "3.12.1", 0x030c01f0),
    ] {
        assert!(python.exists(), "CPython {version} is missing at {}", python.display());
        let dir = tempfile::tempdir().unwrap();
        let ready = dir.path().join("ready");
        let code = "import sys, threading\nhold = threading.Event()\nthreading.Thread(target=hold.wait, daemon=True).start()\nopen(sys.argv[1], 'w').close()\nhold.wait()";
        let target = Target(Command::new(&python).args(["-c", code]).arg(&ready).stdin(Stdio::null()).spawn().unwrap());
        let started = Instant::now();
        while !ready.exists() {
            assert!(started.elapsed() < Duration::from_secs(30), "{version} did not get ready");
            std::thread::sleep(Duration::from_millis(10));
        }
        let pid = target.0.id();
        let mut process = PyProcess::attach(pid).unwrap_or_else(|err| panic!("attach to {version}: {err}"));
        assert_eq!(process.version().0, hex);
        let frame_objects = hex < 0x030b0000;
        let waiting = if frame_objects { "wait" } else { "Condition.wait" };
        // The helper thread may not have reached its wait when the ready file appears.
        let innermost = loop {
            let threads = process.threads().unwrap();
            assert_eq!(threads.len(), 2, "{version}");
            let innermost: Vec<Option<String>> = threads
                .iter()
                .map(|thread| {
                    let links = process.walk_frames(thread.current_frame).unwrap().links;
                    links.iter().find_map(|link| process.frame_info(link).unwrap()).map(|r| r.frame.qualname.to_string())
                })
                .collect();
            if innermost.iter().all(|name| name.as_deref() == Some(waiting)) || started.elapsed() > Duration::from_secs(30) {
                break innermost;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(innermost, vec![Some(waiting.to_string()); 2], "{version}");
        let config = process.bpf_config();
        assert_eq!(config.tstate_cframe != NO_OFFSET, !frame_objects, "{version}: 3.11 and 3.12 read their frames through the _PyCFrame");
        // No co_version before 3.12: the eBPF program reads a fingerprint instead.
        assert_eq!(config.code_version == NO_OFFSET, hex < 0x030c0000, "{version}");
        assert_eq!(config.code_fingerprint != NO_OFFSET, hex < 0x030c0000, "{version}");
        let runtime = super::runtime::find_runtime(pid).unwrap();
        let mut wrong = super::offsets::builtin_offsets(process.version()).unwrap();
        wrong.tstate_native_thread_id += 8;
        let refused = PyProcess::with_offsets(pid, super::memory::ProcessMemory::new(pid), runtime.address, wrong).check_table();
        let err = refused.err().unwrap_or_else(|| panic!("{version}: a table with a wrong thread id offset was accepted"));
        assert!(matches!(err, PyError::TableMismatch { .. }), "{err}");
        assert!(err.to_string().starts_with(&format!("CPython {version} in this process is not laid out as pyebpf's table")), "{err}");
        let mut wrong = super::offsets::builtin_offsets(process.version()).unwrap();
        // A pointer to something else than a code object in all: the frame's type before 3.11, 3.11's
        // `f_globals`, 3.12's `previous`.
        wrong.frame_executable = 8;
        let refused = PyProcess::with_offsets(pid, super::memory::ProcessMemory::new(pid), runtime.address, wrong).check_table();
        assert!(matches!(refused, Err(PyError::TableMismatch { .. })), "{version}: a table with a wrong code offset was accepted");
    }
}

/// A program that links `libpython` but never starts it (as perf does, for its scripts) runs no
/// interpreter: pyebpf says so, rather than that its layout is unknown, and looks again later.
#[test]
fn a_libpython_never_started_runs_no_interpreter() {
    let lib = pyebpf_tests::pyenv_python("3.11.7").parent().and_then(|bin| bin.parent()).expect("pyenv's layout").join("lib");
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("embeds.c");
    std::fs::write(&source, "#include <unistd.h>\nint Py_IsInitialized(void);\nint main(void) { if (Py_IsInitialized()) return 1; pause(); }\n").unwrap();
    let exe = dir.path().join("embeds");
    let status = Command::new("gcc")
        .arg("-o")
        .arg(&exe)
        .arg(&source)
        .arg(lib.join("libpython3.11.so.1.0"))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .status()
        .unwrap_or_else(|err| panic!("this test compiles a program with gcc, which failed to run: {err}"));
    assert!(status.success(), "gcc failed to link {} against {}", source.display(), lib.display());
    let target = Target(Command::new(&exe).stdin(Stdio::null()).spawn().unwrap());
    let pid = target.0.id();
    let started = Instant::now();
    while !std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default().contains("libpython3.11") {
        assert!(started.elapsed() < Duration::from_secs(30), "the program did not map libpython3.11");
        std::thread::sleep(Duration::from_millis(10));
    }
    let err = PyProcess::attach(pid).err().expect("a process running no interpreter was attached to");
    assert!(matches!(err, PyError::NoInterpreter), "{err}");
    assert_eq!(err.unsupported_python(), None);
}

/// `Py_Version` is read from the interpreter's file, in the executable (Debian's) and in
/// `libpython` (pyenv's), and names the version the interpreter reports of itself.
#[test]
fn py_version_is_read_from_the_file() {
    let interpreters = [pyebpf_tests::pyenv_python("3.11.7"), pyebpf_tests::debian_python("3.13"), pyebpf_tests::debian_python("3.15")];
    for python in interpreters {
        let dir = tempfile::tempdir().unwrap();
        let ready = dir.path().join("ready");
        let code = "import sys\nopen(sys.argv[1], 'w').write(str(sys.hexversion))\nsys.stdin.read()";
        let target = Target(Command::new(&python).args(["-c", code]).arg(&ready).stdin(Stdio::piped()).spawn().unwrap());
        let started = Instant::now();
        let hexversion = loop {
            if let Some(hex) = std::fs::read_to_string(&ready).ok().and_then(|text| text.trim().parse::<u64>().ok()) {
                break hex;
            }
            assert!(started.elapsed() < Duration::from_secs(30), "{} did not get ready", python.display());
            std::thread::sleep(Duration::from_millis(10));
        };
        let runtime = super::runtime::find_runtime(target.0.id()).unwrap_or_else(|err| panic!("{}: {err}", python.display()));
        assert_eq!(runtime.version.map(|version| version.0), Some(hexversion), "{} in {}", python.display(), runtime.file.display());
    }
}
