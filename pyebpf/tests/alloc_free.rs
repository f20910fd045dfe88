//! The steady state allocates nothing: resolving and aggregating a sample whose stack was seen
//! before (its code objects, native and kernel addresses already resolved, its stack already
//! counted) makes no heap allocation.
//!
//! Real samples of a real CPython 3.15 process 100 frames deep, taken by the real eBPF sampler,
//! go through the real session into a real profile; then the same samples are resolved again
//! with every allocation counted. Needs root (BPF) and `PYEBPF_PYTHONS` (`cargo xtask test` sets it).

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pyebpf::bpf::{Sampler, SamplerOptions, UnwindMode};
use pyebpf::filter::SampleFilter;
use pyebpf::mode::Mode;
use pyebpf::python::SamplingOptions;
use pyebpf::reader::{Record, RecordBatch};
use pyebpf::session::{Session, SessionOptions};
use pyebpf::stack::Profile;
use pyebpf::stats::Stats;
use pyebpf_common::{py_status, SampleRecord};

/// Counts allocations (and reallocations) made while counting is on.
struct Counting;

thread_local! {
    // Per thread, so another test's sampling in parallel is not counted; a const-initialised Cell
    // needs no allocation to be reached from inside the allocator.
    static COUNTING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.with(std::cell::Cell::get) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: the caller's layout is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from System with this layout (every allocation goes there).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.with(std::cell::Cell::get) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: as for dealloc; the new size is the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Allocations `f` makes on this thread and any other (the reader thread is idle meanwhile:
/// sampling of the process has stopped).
fn allocations_of(f: impl FnOnce()) -> u64 {
    ALLOCATIONS.store(0, Ordering::Relaxed);
    COUNTING.with(|counting| counting.set(true));
    f();
    COUNTING.with(|counting| counting.set(false));
    ALLOCATIONS.load(Ordering::Relaxed)
}

fn python315() -> PathBuf {
    let python = pyebpf_tests::test_pythons().join("usr/bin/python3.15");
    assert!(python.exists(), "{} is missing: run `cargo xtask test` to install the test interpreters", python.display());
    python
}

/// A CPython 3.15 process spinning 100 frames deep; killed when dropped.
struct Deep {
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Deep {
    fn start() -> Deep {
        let dir = tempfile::tempdir().unwrap();
        let ready = dir.path().join("ready");
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/scripts/sampling_deep.py");
        let child = std::process::Command::new(python315()).arg(script).arg(&ready).arg("100").spawn().expect("start python3.15");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ready.exists() {
            assert!(Instant::now() < deadline, "the workload did not get 100 frames deep in 20 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        Deep { child, _dir: dir }
    }
}

impl Drop for Deep {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Samples the process for `duration`, resolving every sample into `profile` as `record` does;
/// returns copies of the samples.
fn sample(session: &mut Session, sampler: &mut Sampler, profile: &mut Profile, stats: &mut Stats, duration: Duration) -> Vec<Box<SampleRecord>> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut samples = Vec::new();
    let mut batch = RecordBatch::default();
    let deadline = Instant::now() + duration;
    runtime.block_on(async {
        while Instant::now() < deadline {
            sampler.read_samples(&mut batch).await.expect("read the ring buffer");
            while let Some(record) = batch.next() {
                if let Record::Sample(record) = record {
                    session.resolve(record, sampler, stats, profile);
                    samples.push(Box::new(*record));
                }
            }
        }
    });
    samples
}

/// Resolves already-seen samples again, counting allocations; returns (allocations, samples).
/// Only frame-pointer samples are replayed: the first samples of a process pyebpf does not know
/// yet carry a copy of the stack, and unwinding a copy builds its frames anew.
fn replay(marker: bool, keep: impl Fn(&SampleRecord) -> bool) -> (u64, usize, Profile) {
    let deep = Deep::start();
    let pid = deep.child.id();
    let options = SamplingOptions { marker, read_only: false, max_frames: 512, async_aware: false };
    let mut session = Session::new(SessionOptions {
        sampling: options,
        no_native: false,
        native_lines: false,
        filter: SampleFilter::default(),
        unwind: UnwindMode::Auto,
        mode: Mode::Cpu,
        kernel: true,
        details: None,
        timed: false,
    });
    let mut stats = Stats::default();
    let mut sampler = session
        .start_sampler(
            &SamplerOptions {
                frequency_hz: 999,
                kernel_stacks: true,
                targets: Some(vec![pid]),
                follow_forks: false,
                ring_buffer_kb: 4096,
                program_stats: false,
                unwind: UnwindMode::Auto,
                gil: false,
                tasks: false,
                waiting_tasks: false,
                off_cpu_min: None,
            },
            &mut stats,
        )
        .expect("start the eBPF sampler (run as root)");
    let mut profile = Profile::new(999);
    let samples = sample(&mut session, &mut sampler, &mut profile, &mut stats, Duration::from_secs(2));
    // Stop the process, so the reader thread has nothing to hand over while counting.
    // SAFETY: kill on the child's own pid.
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    std::thread::sleep(Duration::from_millis(50));
    let replayed: Vec<&SampleRecord> = samples.iter().map(|s| &**s).filter(|s| s.stack_len == 0 && keep(s)).collect();
    let before = profile.total_samples();
    let allocations = allocations_of(|| {
        for record in &replayed {
            session.resolve(record, &mut sampler, &mut stats, &mut profile);
        }
    });
    assert_eq!(profile.total_samples(), before + replayed.len() as u64, "every replayed sample was counted");
    (allocations, replayed.len(), profile)
}

fn python_frames(profile: &Profile) -> usize {
    profile.stacks().map(|(stack, _)| stack.frames.iter().filter(|f| matches!(f, pyebpf::stack::Frame::Python(_))).count()).max().unwrap_or(0)
}

#[test]
fn resolving_a_seen_stack_allocates_nothing_with_full_kernel_walks() {
    let (allocations, replayed, profile) = replay(false, |s| s.py.status & py_status::COMPLETE != 0);
    assert!(replayed >= 200, "only {replayed} complete Python samples in 2 s at 999 Hz");
    assert!(python_frames(&profile) >= 100, "the stacks lack their 100 Python frames");
    assert_eq!(allocations, 0, "{allocations} allocations resolving {replayed} samples seen before");
}

#[test]
fn resolving_a_seen_stack_allocates_nothing_with_marker_joins() {
    // The steady state of 3.15: the kernel walks a frame or two and joins an established chain.
    let joined_near_leaf = |s: &SampleRecord| s.py.status & py_status::JOINED != 0 && s.py.frames_len <= 4;
    let (allocations, replayed, profile) = replay(true, joined_near_leaf);
    assert!(replayed >= 200, "only {replayed} marker-joined samples in 2 s at 999 Hz");
    assert!(python_frames(&profile) >= 100, "the stacks lack their 100 Python frames");
    assert_eq!(allocations, 0, "{allocations} allocations resolving {replayed} samples seen before");
}
