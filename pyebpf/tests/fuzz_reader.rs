//! Fuzzing the CPython reader: every read `dump` makes of a real 3.15 process is recorded, then the
//! reader runs over randomly mutated copies of that memory through an in-memory `ReadMemory`. Any
//! outcome is fine except a panic, a hang or an unbounded allocation. `PYEBPF_FUZZ_CASES` sets the
//! number of cases (default 250 000, about a minute; run with `--profile fuzz` for overflow checks).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use pyebpf::chain::LinkKind;
use pyebpf::cpython::memory::{MemCounters, MemError, ProcessMemory, ReadMemory};
use pyebpf::cpython::{runtime, PyProcess};

/// Memory as a set of byte ranges; reads outside them fail like reads of unmapped memory.
#[derive(Clone, Default)]
struct Image {
    regions: BTreeMap<u64, Vec<u8>>,
}

impl Image {
    fn slice(&self, addr: u64, len: usize) -> Option<&[u8]> {
        let (start, bytes) = self.regions.range(..=addr).next_back()?;
        let from = usize::try_from(addr - start).ok()?;
        bytes.get(from..from.checked_add(len)?)
    }
}

impl ReadMemory for Image {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemError> {
        let bytes = self.slice(addr, buf.len()).ok_or(MemError::Short { addr, len: buf.len() })?;
        buf.copy_from_slice(bytes);
        Ok(())
    }

    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> usize {
        let mut filled = 0;
        for (addr, buf) in requests.iter_mut() {
            if self.read(*addr, buf).is_err() {
                break;
            }
            filled += 1;
        }
        filled
    }

    fn counters(&self) -> MemCounters {
        MemCounters::default()
    }
}

/// A real process's memory, remembering every range read.
struct Recorder {
    inner: ProcessMemory,
    image: RefCell<Image>,
}

impl ReadMemory for Recorder {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemError> {
        self.inner.read(addr, buf)?;
        self.image.borrow_mut().regions.insert(addr, buf.to_vec());
        Ok(())
    }

    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> usize {
        let filled = self.inner.read_many(requests);
        for (addr, buf) in &requests[..filled] {
            self.image.borrow_mut().regions.insert(*addr, buf.to_vec());
        }
        filled
    }

    fn counters(&self) -> MemCounters {
        self.inner.counters()
    }
}

/// What `dump` does: every thread, every frame, every code object.
fn read_everything<M: ReadMemory>(process: &mut PyProcess<M>) -> usize {
    let Ok(threads) = process.threads() else { return 0 };
    let mut frames = 0;
    for thread in threads {
        let Ok(links) = process.walk_frames(thread.current_frame) else { continue };
        for link in links.iter().filter(|l| l.kind == LinkKind::Code) {
            frames += usize::from(process.python_frame(link.code, link.instr_ptr).is_ok());
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

/// Records a real 3.15 process holding several threads, deep stacks and non-ASCII names.
fn recorded_image() -> (Image, u32, u64) {
    let prefix = PathBuf::from(std::env::var("PYEBPF_PYTHONS").expect("PYEBPF_PYTHONS must name the test Pythons' prefix (cargo xtask test sets it)"));
    let dir = tempfile::tempdir().unwrap();
    let view = dir.path().join("view.json");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/scripts/dump_state.py");
    let target = Target(Command::new(prefix.join("usr/bin/python3.15")).arg(script).arg(&view).stdin(Stdio::null()).spawn().unwrap());
    let started = Instant::now();
    while !view.exists() {
        assert!(started.elapsed() < Duration::from_secs(30), "the fuzz target process did not get ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let pid = target.0.id();
    let runtime = runtime::find_runtime(pid).unwrap();
    let recorder = Recorder { inner: ProcessMemory::new(pid), image: RefCell::default() };
    let mut process = PyProcess::with_memory(pid, recorder, runtime).unwrap();
    let frames = read_everything(&mut process);
    assert!(frames > 500, "only {frames} frames read from the fuzz target");
    drop(process.threads());
    let image = std::mem::take(&mut *process_memory(&process).image.borrow_mut());
    (image, pid, runtime)
}

fn process_memory<M: ReadMemory>(process: &PyProcess<M>) -> &M {
    process.memory()
}

fn cases() -> u32 {
    std::env::var("PYEBPF_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(250_000)
}

#[derive(Clone, Debug)]
enum Mutation {
    /// Overwrite one byte.
    Byte { at: usize, value: u8 },
    /// Overwrite an aligned 8-byte word: a pointer, a size or an offset.
    Word { at: usize, value: u64 },
    /// Make a word point back into recorded memory, to build cycles and aliasing.
    Alias { at: usize, to: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(at, value)| Mutation::Byte { at, value }),
        (any::<usize>(), prop_oneof![any::<u64>(), Just(0u64), Just(u64::MAX), 0u64..4096, Just(1u64 << 40)])
            .prop_map(|(at, value)| Mutation::Word { at, value }),
        (any::<usize>(), any::<usize>()).prop_map(|(at, to)| Mutation::Alias { at, to }),
    ]
}

fn apply(image: &mut Image, mutation: &Mutation) {
    // Region first, then offset: small structures (thread states, frames) matter most.
    let addresses: Vec<(u64, usize)> = image.regions.iter().map(|(a, b)| (*a, b.len())).collect();
    let locate = |at: usize| {
        let (addr, len) = addresses[at % addresses.len()];
        (addr, (at / addresses.len()) % len.max(1))
    };
    let (value, at) = match *mutation {
        Mutation::Byte { at, value } => {
            let (region, offset) = locate(at);
            image.regions.get_mut(&region).unwrap()[offset] = value;
            return;
        }
        Mutation::Word { at, value } => (value, at),
        Mutation::Alias { at, to } => {
            let (region, offset) = locate(to);
            (region + offset as u64, at)
        }
    };
    let (region, offset) = locate(at);
    let bytes = image.regions.get_mut(&region).unwrap();
    let offset = offset & !7;
    if let Some(word) = bytes.get_mut(offset..offset + 8) {
        word.copy_from_slice(&value.to_le_bytes());
    }
}

#[test]
fn reader_survives_mutated_memory() {
    let (image, pid, runtime) = recorded_image();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() });
    runner
        .run(&proptest::collection::vec(mutation(), 1..16), |mutations| {
            let mut mutated = image.clone();
            for m in &mutations {
                apply(&mut mutated, m);
            }
            if let Ok(mut process) = PyProcess::with_memory(pid, mutated, runtime) {
                read_everything(&mut process);
            }
            Ok(())
        })
        .unwrap();
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
            let image = Image { regions: BTreeMap::from([(0x1000, bytes)]) };
            if let Ok(mut process) = PyProcess::with_memory(1, image, 0x1000) {
                read_everything(&mut process);
            }
            Ok(())
        })
        .unwrap();
}
