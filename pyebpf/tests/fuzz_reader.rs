//! Fuzzing the CPython reader: every read `dump` makes of a real 3.10, 3.11, 3.13 and 3.15 process
//! is recorded (pyebpf's own tables: frame objects and old line tables, entry flags and
//! fingerprints; and the two debug-offset layouts furthest apart: untagged and tagged frames, no
//! marker and marker), then the reader runs over randomly mutated copies of that memory through an
//! in-memory `ReadMemory`. Any outcome is fine except a panic, a hang or an unbounded allocation.
//! `PYEBPF_FUZZ_CASES` sets the number of cases (default 800 000: about a minute on two cores in
//! the `checked` profile; each recorded image gets a quarter, the random-memory test all of them).

use std::cell::RefCell;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use pyebpf::cpython::memory::{MemCounters, MemError, MemoryImage, ProcessMemory, ReadMemory};
use pyebpf::cpython::{offsets, runtime, DebugOffsets, PyProcess, PyVersion};

/// A real process's memory, remembering every range read.
struct Recorder {
    inner: ProcessMemory,
    image: RefCell<MemoryImage>,
}

impl ReadMemory for Recorder {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemError> {
        self.inner.read(addr, buf)?;
        self.image.borrow_mut().insert(addr, buf.to_vec());
        Ok(())
    }

    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> usize {
        let filled = self.inner.read_many(requests);
        for (addr, buf) in &requests[..filled] {
            self.image.borrow_mut().insert(*addr, buf.to_vec());
        }
        filled
    }

    fn counters(&self) -> MemCounters {
        self.inner.counters()
    }
}

/// What `dump` and the sampler do: every thread, every frame, every code object, the marker.
fn read_everything<M: ReadMemory>(process: &mut PyProcess<M>) -> usize {
    let Ok(threads) = process.threads() else { return 0 };
    let mut frames = 0;
    for thread in threads {
        let _ = process.read_marker_state(thread.tstate);
        let Ok(walk) = process.walk_frames(thread.current_frame) else { continue };
        for link in &walk.links {
            frames += usize::from(matches!(process.frame_info(link), Ok(Some(_))));
            let _ = process.python_frame(link.code, link.instr_ptr);
        }
    }
    frames
}

struct Target(Child);

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The interpreter of `version`: pyenv's 3.10, Debian 12's own 3.11, the test set-up's Debian
/// builds after, and its free-threaded 3.13 (`3.13t`).
fn interpreter(version: &str) -> PathBuf {
    match version {
        "3.10" => pyebpf_tests::pyenv_python("3.10.13"),
        "3.11" => PathBuf::from("/usr/bin/python3.11"),
        "3.13t" => pyebpf_tests::free_threaded_python(),
        _ => pyebpf_tests::test_pythons().join(format!("usr/bin/python{version}")),
    }
}

/// The process read with its own debug offsets, or before 3.13 with pyebpf's table of its version.
fn attach_with<M: ReadMemory>(pid: u32, memory: M, runtime: u64, table: Option<&DebugOffsets>) -> Option<PyProcess<M>> {
    match table {
        Some(table) => Some(PyProcess::with_offsets(pid, memory, runtime, table.clone())),
        None => PyProcess::with_memory(pid, memory, runtime).ok(),
    }
}

/// Records a real process of `python{version}` holding several threads, deep stacks and non-ASCII
/// names; with the table it was read with, where it is pyebpf's own.
fn recorded_image(version: &str) -> (MemoryImage, u32, u64, Option<DebugOffsets>) {
    let dir = tempfile::tempdir().unwrap();
    let view = dir.path().join("view.json");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/scripts/dump_state.py");
    let target = Target(Command::new(interpreter(version)).arg(script).arg(&view).stdin(Stdio::null()).spawn().unwrap());
    let started = Instant::now();
    while !view.exists() {
        assert!(started.elapsed() < Duration::from_secs(30), "the fuzz target process did not get ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let pid = target.0.id();
    let found = runtime::find_runtime(pid).unwrap();
    let named = found.version.or_else(|| PyVersion::from_name(version)).unwrap();
    let table = if named.minor() < 13 { Some(offsets::builtin_offsets(named).expect("a table of the version")) } else { None };
    let recorder = Recorder { inner: ProcessMemory::new(pid), image: RefCell::default() };
    let mut process = attach_with(pid, recorder, found.address, table.as_ref()).unwrap();
    let frames = read_everything(&mut process);
    assert!(frames > 500, "only {frames} frames read from the fuzz target");
    drop(process.threads());
    let image = std::mem::take(&mut *process_memory(&process).image.borrow_mut());
    (image, pid, found.address, table)
}

fn process_memory<M: ReadMemory>(process: &PyProcess<M>) -> &M {
    process.memory()
}

fn cases() -> u32 {
    std::env::var("PYEBPF_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(800_000)
}

#[derive(Clone, Debug)]
enum Mutation {
    /// Overwrite one byte.
    Byte { at: usize, value: u8 },
    /// Overwrite an aligned 8-byte word: a pointer, a size or an offset.
    Word { at: usize, value: u64 },
    /// Make a word point back into recorded memory, to build cycles and aliasing.
    Alias { at: usize, to: usize },
    /// Overwrite one field of the `_Py_DebugOffsets` table: offsets and sizes the reader must check.
    Table { field: usize, value: u64 },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(at, value)| Mutation::Byte { at, value }),
        (any::<usize>(), prop_oneof![any::<u64>(), Just(0u64), Just(u64::MAX), 0u64..4096, Just(1u64 << 40)])
            .prop_map(|(at, value)| Mutation::Word { at, value }),
        (any::<usize>(), any::<usize>()).prop_map(|(at, to)| Mutation::Alias { at, to }),
        (0usize..128, prop_oneof![any::<u64>(), Just(u64::MAX), 0u64..65536, Just(16u64 << 20)]).prop_map(|(field, value)| Mutation::Table { field, value }),
    ]
}

fn apply(image: &mut MemoryImage, runtime: u64, mutation: &Mutation) {
    // Region first, then offset: small structures (thread states, frames) matter most.
    let addresses: Vec<(u64, usize)> = image.ranges().collect();
    let locate = |at: usize| {
        let (addr, len) = addresses[at % addresses.len()];
        (addr, (at / addresses.len()) % len.max(1))
    };
    let (value, at) = match *mutation {
        Mutation::Byte { at, value } => {
            let (region, offset) = locate(at);
            image.range_mut(region).unwrap()[offset] = value;
            return;
        }
        Mutation::Word { at, value } => (value, at),
        Mutation::Table { field, value } => {
            if let Some(word) = image.range_mut(runtime).and_then(|table| table.get_mut(field * 8..field * 8 + 8)) {
                word.copy_from_slice(&value.to_le_bytes());
            }
            return;
        }
        Mutation::Alias { at, to } => {
            let (region, offset) = locate(to);
            (region + offset as u64, at)
        }
    };
    let (region, offset) = locate(at);
    let bytes = image.range_mut(region).unwrap();
    let offset = offset & !7;
    if let Some(word) = bytes.get_mut(offset..offset + 8) {
        word.copy_from_slice(&value.to_le_bytes());
    }
}

/// Runs the reader over `cases` mutated copies of a recording of `python{version}`.
fn fuzz_mutated(version: &str, cases: u32) {
    let (image, pid, runtime, table) = recorded_image(version);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() });
    runner
        .run(&proptest::collection::vec(mutation(), 1..16), |mutations| {
            let mut mutated = image.clone();
            for m in &mutations {
                apply(&mut mutated, runtime, m);
            }
            if let Some(mut process) = attach_with(pid, mutated, runtime, table.as_ref()) {
                read_everything(&mut process);
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn reader_survives_mutated_3_10_memory() {
    fuzz_mutated("3.10", cases() / 4);
}

#[test]
fn reader_survives_mutated_3_11_memory() {
    fuzz_mutated("3.11", cases() / 4);
}

#[test]
fn reader_survives_mutated_3_13_memory() {
    fuzz_mutated("3.13", cases() / 4);
}

/// Free-threaded 3.13: the same structures behind a larger object header.
#[test]
fn reader_survives_mutated_free_threaded_3_13_memory() {
    fuzz_mutated("3.13t", cases() / 8);
}

#[test]
fn reader_survives_mutated_3_15_memory() {
    fuzz_mutated("3.15", cases() / 4);
}

#[test]
fn reader_survives_random_memory() {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() });
    runner
        .run(&(proptest::collection::vec(any::<u8>(), 0..4096), any::<bool>()), |(bytes, with_cookie)| {
            let mut bytes = bytes;
            if with_cookie && bytes.len() >= 24 {
                bytes[..8].copy_from_slice(b"xdebugpy");
                bytes[8..16].copy_from_slice(&0x030f02f0u64.to_le_bytes());
                bytes[16..24].fill(0);
            }
            let mut image = MemoryImage::default();
            image.insert(0x1000, bytes);
            if let Ok(mut process) = PyProcess::with_memory(1, image, 0x1000) {
                read_everything(&mut process);
            }
            Ok(())
        })
        .unwrap();
}
