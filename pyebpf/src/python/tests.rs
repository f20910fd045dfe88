//! The Python side of the sample path on real interpreters, with the kernel's maps faked
//! ([`FakeKernel`]): samples are built as the eBPF program builds them (the frames read here with
//! `frame_records`, as it reads them), and the process's memory is read through an overlay that
//! takes pyebpf's one write and any change a test makes, so nothing is ever written into the
//! interpreter. Covers the code-identity proof, the 3.15 marker protocol and task placement.

use std::cell::RefCell;
use std::time::Duration;

use pyebpf_common::{origin, py_status, task_status, type_flags, PyThreadEntry, SampleRecord};

use super::tasks::{waiting_task_stacks, TaskPart};
use super::*;
use crate::budget::SharedBudget;
use crate::cpython::asyncio::AsyncioOffsets;
use crate::cpython::memory::{MemCounters, MemError, ReadExt, ReadMemory, WriteMemory};
use crate::cpython::runtime;
use crate::kernel_maps::fake::FakeKernel;
use crate::ktime::monotonic_ns;
use crate::merge::PyStackItem;
use crate::stack::{Frame, FrameId};
use pyebpf_tests::Killed;

/// A live process's memory with test changes laid over it; writes go to the overlay only.
struct Overlay {
    base: ProcessMemory,
    patches: RefCell<Vec<(u64, Vec<u8>)>>,
    writes: RefCell<Vec<(u64, u64)>>,
    /// Laid over the memory right after the next write: the thread moving meanwhile.
    after_write: RefCell<Option<(u64, Vec<u8>)>>,
}

impl Overlay {
    fn new(pid: u32) -> Self {
        Overlay { base: ProcessMemory::new(pid), patches: RefCell::default(), writes: RefCell::default(), after_write: RefCell::default() }
    }

    fn patch(&self, addr: u64, bytes: &[u8]) {
        self.patches.borrow_mut().push((addr, bytes.to_vec()));
    }
}

impl ReadMemory for Overlay {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemError> {
        self.base.read(addr, buf)?;
        for (at, bytes) in self.patches.borrow().iter() {
            for (i, byte) in bytes.iter().enumerate() {
                if let Some(offset) = (at + i as u64).checked_sub(addr).filter(|&offset| offset < buf.len() as u64) {
                    buf[offset as usize] = *byte;
                }
            }
        }
        Ok(())
    }

    fn counters(&self) -> MemCounters {
        self.base.counters()
    }
}

impl WriteMemory for Overlay {
    fn write_u64(&self, addr: u64, value: u64) -> Result<(), MemError> {
        self.writes.borrow_mut().push((addr, value));
        self.patch(addr, &value.to_le_bytes());
        if let Some((at, bytes)) = self.after_write.borrow_mut().take() {
            self.patch(at, &bytes);
        }
        Ok(())
    }
}

/// Starts Debian's `python3.X` on `blocked_threads.py` (two threads stopped at known depths) and
/// attaches to it through an [`Overlay`].
fn start(version: &str) -> (Killed, tempfile::TempDir, PyProcess<Overlay>) {
    let python = pyebpf_tests::test_pythons().join(format!("usr/bin/python{version}"));
    assert!(python.exists(), "test interpreter missing: {}", python.display());
    let (target, dir) = pyebpf_tests::start_ready(&python, "blocked_threads.py", &[]);
    // The ready file is made just before the main thread's wait: let it reach it.
    std::thread::sleep(Duration::from_millis(200));
    let pid = target.pid();
    let address = runtime::find_runtime(pid).unwrap().address;
    let py = PyProcess::with_memory(pid, Overlay::new(pid), address).unwrap();
    (target, dir, py)
}

/// The process attached to and registered, as `Pythons::discover` does with a live one.
fn registered(py: PyProcess<Overlay>, options: SamplingOptions, kernel: &mut FakeKernel) -> Pythons<Overlay> {
    let pid = py.pid();
    let mut pythons = Pythons::new(options);
    pythons.insert(py, &mut Stats::default());
    pythons.register(pid, kernel, &mut MapsCache::default());
    assert!(kernel.processes.contains_key(&pid), "the process was not registered");
    pythons
}

const OPTIONS: SamplingOptions = SamplingOptions { marker: true, read_only: false, max_frames: 512, async_aware: false };

/// A sample of thread `tid` as the eBPF program records one that walked the whole chain.
fn sample(pythons: &mut Pythons<Overlay>, pid: u32, tid: u32) -> Box<SampleRecord> {
    // SAFETY: all-zero bytes are a valid SampleRecord (plain data).
    let mut record = unsafe { Box::<SampleRecord>::new_zeroed().assume_init() };
    record.tgid = pid;
    record.tid = tid;
    record.origin = origin::ON_CPU;
    assert!(pythons.capture_waiting(pid, tid, &mut record), "thread {tid} is not registered");
    assert_eq!(record.py.status & py_status::COMPLETE, py_status::COMPLETE, "the chain was not read whole");
    record
}

/// `record` as the eBPF program sends it when its walk stops at the marker of chain `gen`, which
/// sits on the innermost frame.
fn joined_at_marker(record: &SampleRecord, gen: u64) -> Box<SampleRecord> {
    let mut joined = Box::new(*record);
    joined.py.frames_len = 1;
    joined.py.status = py_status::THREAD_KNOWN | py_status::FRAME_READ | py_status::JOINED;
    joined.py.marker_gen = gen;
    joined.py.marker_position = 0;
    joined
}

/// Function names of a resolved stack, innermost first.
fn names(frames: &FrameTable, items: &[PyItem]) -> Vec<String> {
    items
        .iter()
        .filter_map(|item| match item {
            PyStackItem::Frame(id) => Some(frame_name(frames, *id)),
            PyStackItem::SegmentEnd { .. } => None,
        })
        .collect()
}

fn frame_name(frames: &FrameTable, id: FrameId) -> String {
    match frames.frame(id) {
        Frame::Python(frame) => frame.qualname.to_string(),
        Frame::Task(name) => format!("[task {name}]"),
        other => format!("{other:?}"),
    }
}

fn resolve(
    pythons: &mut Pythons<Overlay>,
    record: &SampleRecord,
    kernel: &mut FakeKernel,
    stats: &mut Stats,
    frames: &mut FrameTable,
) -> (PythonStack, Vec<String>) {
    let mut items = Vec::new();
    let outcome = pythons.python_stack(record, kernel, stats, frames, &mut items);
    (outcome, names(frames, &items))
}

/// The innermost frame's index in `record` running function `name`.
fn frame_running(pythons: &mut Pythons<Overlay>, record: &SampleRecord, name: &str) -> usize {
    let process = pythons.processes.get_mut(&record.tgid).unwrap();
    (0..record.py.frames_len as usize)
        .find(|&i| {
            let link = process.resolver.link(&record.py_frames[i]);
            process.resolver.py.frame_info(&link).ok().flatten().is_some_and(|resolved| &*resolved.frame.qualname == name)
        })
        .unwrap_or_else(|| panic!("no frame runs {name}"))
}

#[test]
fn a_code_object_is_named_only_while_it_is_the_one_the_sample_saw() {
    for version in ["3.13", "3.15"] {
        let (target, _dir, py) = start(version);
        let pid = target.pid();
        let mut kernel = FakeKernel::default();
        let mut pythons = registered(py, SamplingOptions { marker: false, ..OPTIONS }, &mut kernel);
        let record = sample(&mut pythons, pid, pid);
        let (mut stats, mut frames) = (Stats::default(), FrameTable::default());
        let (outcome, stack) = resolve(&mut pythons, &record, &mut kernel, &mut stats, &mut frames);
        assert_eq!(outcome, PythonStack::Whole, "{version}");
        let at = stack.iter().position(|name| name == "main_leaf").unwrap_or_else(|| panic!("{version}: {stack:?}"));
        assert_eq!(stack[at..], ["main_leaf", "main_mid", "main_top", "<module>"], "{version}");

        // The code object of `main_mid` freed and its address taken by another since the sample:
        // a new process (no cache) must not name it, and cuts the stack there.
        let (target, _dir, py) = start(version);
        let pid = target.pid();
        let mut pythons = registered(py, SamplingOptions { marker: false, ..OPTIONS }, &mut kernel);
        let record = sample(&mut pythons, pid, pid);
        let mid = record.py_frames[frame_running(&mut pythons, &record, "main_mid")];
        let process = pythons.processes.get_mut(&pid).unwrap();
        let crate::cpython::offsets::CodeIdentity::Version(at) = process.resolver.py.offsets().code_identity else { panic!("{version} has co_version") };
        process.resolver.py.memory().patch(mid.code + at, &(mid.code_version + 1).to_le_bytes());
        process.resolver.py.forget_code(mid.code);
        let mut stats = Stats::default();
        let (outcome, stack) = resolve(&mut pythons, &record, &mut kernel, &mut stats, &mut frames);
        assert_eq!(outcome, PythonStack::Cut, "{version}: {stack:?}");
        assert_eq!(stack.last().map(String::as_str), Some("main_leaf"), "{version}: the stack goes on past the freed code object: {stack:?}");
        assert_eq!(stats.truncated_samples, 1, "{version}");
    }
}

#[test]
fn a_process_the_kernel_has_no_room_for_is_sampled_natively() {
    let (target, _dir, py) = start("3.13");
    let pid = target.pid();
    let mut kernel = FakeKernel { processes_full: true, ..FakeKernel::default() };
    let mut pythons = Pythons::new(OPTIONS);
    pythons.insert(py, &mut Stats::default());
    pythons.register(pid, &mut kernel, &mut MapsCache::default());
    assert!(!pythons.is_python(pid) && kernel.threads.is_empty(), "a process without a PY_PROCS entry kept as Python");
}

/// A sample of `tid` taken at `time_ns` that found no registration in the kernel.
fn unknown_sample(pid: u32, tid: u32, time_ns: u64) -> Box<SampleRecord> {
    // SAFETY: all-zero bytes are a valid SampleRecord (plain data).
    let mut record = unsafe { Box::<SampleRecord>::new_zeroed().assume_init() };
    (record.tgid, record.tid, record.origin, record.time_ns) = (pid, tid, origin::ON_CPU, time_ns);
    record
}

#[test]
fn a_thread_whose_registration_the_kernel_dropped_is_registered_again() {
    let (target, _dir, py) = start("3.13");
    let pid = target.pid();
    let mut kernel = FakeKernel::default();
    let before = monotonic_ns();
    let mut pythons = registered(py, OPTIONS, &mut kernel);
    assert_eq!(kernel.threads.get(&pid).map(|thread| thread.tgid), Some(pid), "the main thread's entry names its process");
    let (mut stats, mut frames) = (Stats::default(), FrameTable::default());
    // What the eBPF program's exit hook does as a thread exits; its id goes to a new thread.
    kernel.threads.remove(&pid);
    std::thread::sleep(Duration::from_millis(30));
    // Taken before the registration, a sample says nothing of it: no re-read.
    resolve(&mut pythons, &unknown_sample(pid, pid, before), &mut kernel, &mut stats, &mut frames);
    assert!(!kernel.threads.contains_key(&pid), "a sample older than the registration re-read the thread list");
    // Taken after it, the registration is gone: the thread list is read again.
    resolve(&mut pythons, &unknown_sample(pid, pid, monotonic_ns()), &mut kernel, &mut stats, &mut frames);
    assert!(kernel.threads.contains_key(&pid), "the thread that took the id was not registered");
}

/// A thread state is listed from its creation in the thread that starts it, with `native_thread_id`
/// 0 until the new thread binds it: such a state names no thread yet and registers none (an
/// entry under id 0 would outlive it, since no thread 0 ever exits).
#[test]
fn a_thread_state_not_yet_bound_to_its_thread_registers_nothing() {
    for version in ["3.13", "3.15"] {
        let (target, _dir, mut py) = start(version);
        let pid = target.pid();
        let threads = py.threads().unwrap();
        let worker = threads.iter().find(|thread| thread.tid != pid).unwrap_or_else(|| panic!("{version}: no worker in {threads:?}"));
        let at = worker.tstate + py.offsets().tstate_native_thread_id;
        py.memory().patch(at, &0u64.to_le_bytes());
        let mut kernel = FakeKernel::default();
        registered(py, OPTIONS, &mut kernel);
        let tids: Vec<u32> = kernel.threads.keys().copied().collect();
        assert_eq!(tids, [pid], "{version}: registered threads");
    }
}

/// A thread missing from the thread lists (a C thread) is registered without a thread state, so
/// its samples wake nobody and the kernel looks its state up when it calls into Python; it is
/// registered again once the kernel dropped it, and goes with its process.
#[test]
fn a_thread_without_a_thread_state_is_registered_without_one() {
    let dir = tempfile::tempdir().unwrap();
    let python = pyebpf_tests::test_pythons().join("usr/bin/python3.13");
    let (target, threads) = pyebpf_tests::start_c_threads(&python, dir.path(), "spin", "60", &[]);
    let (pid, c_thread) = (target.pid(), threads[0].1);
    let py = PyProcess::with_memory(pid, Overlay::new(pid), runtime::find_runtime(pid).unwrap().address).unwrap();
    let mut kernel = FakeKernel::default();
    let mut pythons = registered(py, OPTIONS, &mut kernel);
    let (mut stats, mut frames) = (Stats::default(), FrameTable::default());
    std::thread::sleep(Duration::from_millis(30));
    resolve(&mut pythons, &unknown_sample(pid, c_thread, monotonic_ns()), &mut kernel, &mut stats, &mut frames);
    let stateless = PyThreadEntry { tstate: 0, ns_tid: c_thread, tgid: pid };
    assert_eq!(kernel.threads.get(&c_thread), Some(&stateless), "the C thread was not registered without a state");
    // The exit hook drops it; a sample taken before its registration says nothing of that.
    let registered_by = monotonic_ns();
    kernel.threads.remove(&c_thread);
    std::thread::sleep(Duration::from_millis(30));
    resolve(&mut pythons, &unknown_sample(pid, c_thread, registered_by - 1_000_000_000), &mut kernel, &mut stats, &mut frames);
    assert!(!kernel.threads.contains_key(&c_thread), "a sample older than the registration registered the thread again");
    resolve(&mut pythons, &unknown_sample(pid, c_thread, monotonic_ns()), &mut kernel, &mut stats, &mut frames);
    assert_eq!(kernel.threads.get(&c_thread), Some(&stateless), "a new thread with the id was not registered");
    // A thread gone by the time its sample is read is not registered: no exit hook would drop it.
    let gone = pid + 1_000_000;
    std::thread::sleep(Duration::from_millis(30));
    resolve(&mut pythons, &unknown_sample(pid, gone, monotonic_ns()), &mut kernel, &mut stats, &mut frames);
    assert!(!kernel.threads.contains_key(&gone), "a thread that had exited was registered");
    pythons.forget(pid, &mut kernel);
    assert!(kernel.threads.is_empty(), "registrations outlived their process: {:?}", kernel.threads);
}

/// A thread whose state leaves the thread lists while the thread runs on (a C thread between
/// calls into Python, its state freed by `PyGILState_Release`) keeps an entry, without a state:
/// the kernel looks up the state of its next call at each sample, where without an entry that
/// sample's frames went missing until the lists were read again.
#[test]
fn a_thread_whose_state_leaves_the_lists_stays_registered_without_one() {
    let (target, _dir, mut py) = start("3.13");
    let pid = target.pid();
    let threads = py.threads().unwrap();
    let worker = threads.iter().find(|thread| thread.tid != pid).unwrap_or_else(|| panic!("no worker in {threads:?}"));
    let (tid, tstate) = (worker.tid, worker.tstate);
    let mut kernel = FakeKernel::default();
    let mut pythons = registered(py, OPTIONS, &mut kernel);
    assert_eq!(kernel.threads.get(&tid).map(|thread| thread.tstate), Some(tstate), "the worker was not registered with its state");
    // Unlinks the worker's state, as deleting a thread state does.
    let py = &pythons.processes.get(&pid).unwrap().resolver.py;
    let offsets = py.offsets();
    let read = |addr: u64| py.memory().read_u64(addr).unwrap();
    let (prev, next) = (read(tstate + offsets.tstate_prev), read(tstate + offsets.tstate_next));
    let link = if prev == 0 { read(tstate + offsets.tstate_interp) + offsets.interp_threads_head } else { prev + offsets.tstate_next };
    py.memory().patch(link, &next.to_le_bytes());
    if next != 0 {
        py.memory().patch(next + offsets.tstate_prev, &prev.to_le_bytes());
    }
    // A sample of a thread the kernel does not know has the lists read again.
    std::thread::sleep(Duration::from_millis(30));
    let (mut stats, mut frames) = (Stats::default(), FrameTable::default());
    resolve(&mut pythons, &unknown_sample(pid, pid + 1_000_000, monotonic_ns()), &mut kernel, &mut stats, &mut frames);
    let stateless = PyThreadEntry { tstate: 0, ns_tid: tid, tgid: pid };
    assert_eq!(kernel.threads.get(&tid), Some(&stateless), "the worker's entry did not stay without a state");
    assert_eq!(kernel.threads.get(&pid).map(|thread| thread.tgid), Some(pid), "the main thread's entry went");
}

#[test]
fn a_marker_chain_is_proven_then_joined_and_a_moving_thread_gets_none() {
    let (target, _dir, py) = start("3.15");
    let pid = target.pid();
    let mut kernel = FakeKernel::default();
    let mut pythons = registered(py, OPTIONS, &mut kernel);
    let (mut stats, mut frames) = (Stats::default(), FrameTable::default());
    let record = sample(&mut pythons, pid, pid);
    let (outcome, whole) = resolve(&mut pythons, &record, &mut kernel, &mut stats, &mut frames);
    assert_eq!(outcome, PythonStack::Whole);
    // The chain read past the kernel's walk was proven, and told to the kernel.
    assert_eq!(stats.markers_established, 1, "{stats:?}");
    let chain = kernel.markers.get(&pid).copied().expect("no marker chain for the main thread");
    let walked: Vec<u64> = record.py_frames[..record.py.frames_len as usize].iter().map(|frame| frame.addr()).collect();
    assert_eq!(&chain.addrs[..chain.len as usize], &walked[..], "the chain is not the thread's frames");
    // The one write: the main thread state's marker, pointed at its current frame.
    let py = &pythons.processes[&pid].resolver.py;
    let tstate = pythons.processes[&pid].threads[&pid].tstate;
    assert_eq!(*py.memory().writes.borrow(), [(tstate + py.offsets().tstate_last_profiled_frame.unwrap(), walked[0])]);

    // The kernel stops at the marker: a sample that joined it there gets the chain's proven tail.
    let mut joined = joined_at_marker(&record, chain.gen);
    let (outcome, stack) = resolve(&mut pythons, &joined, &mut kernel, &mut stats, &mut frames);
    assert_eq!((outcome, &stack), (PythonStack::Whole, &whole));
    assert_eq!((stats.marker_joins, stats.frames_joined), (1, walked.len() as u64 - 1));
    // A chain the kernel names but userspace no longer has (a replaced one): cut, not guessed.
    joined.py.marker_gen = chain.gen + 100;
    let (outcome, stack) = resolve(&mut pythons, &joined, &mut kernel, &mut stats, &mut frames);
    assert_eq!((outcome, stack.len()), (PythonStack::Cut, 1));

    // A worker's thread state lives on the heap: never written, however deep its stack.
    let worker = *pythons.processes[&pid].threads.keys().find(|&&tid| tid != pid).expect("the worker thread is registered");
    let record = sample(&mut pythons, pid, worker);
    resolve(&mut pythons, &record, &mut kernel, &mut stats, &mut frames);
    assert!(!kernel.markers.contains_key(&worker));
    assert_eq!(pythons.processes[&pid].resolver.py.memory().writes.borrow().len(), 1);
}

#[test]
fn a_thread_that_moves_while_its_chain_is_read_gets_no_chain() {
    let (target, _dir, py) = start("3.15");
    let pid = target.pid();
    let mut kernel = FakeKernel::default();
    let mut pythons = registered(py, OPTIONS, &mut kernel);
    let process = &pythons.processes[&pid];
    let (tstate, offsets) = (process.threads[&pid].tstate, process.resolver.py.offsets());
    // Its marker frame returns right after the write: the sequence number moves.
    let seq = process.resolver.py.read_marker_state(tstate).unwrap().seq;
    let moved = (tstate + offsets.tstate_last_profiled_seq.unwrap(), (seq + 1).to_le_bytes().to_vec());
    *process.resolver.py.memory().after_write.borrow_mut() = Some(moved);
    let (mut stats, mut frames) = (Stats::default(), FrameTable::default());
    let record = sample(&mut pythons, pid, pid);
    let (outcome, _) = resolve(&mut pythons, &record, &mut kernel, &mut stats, &mut frames);
    assert_eq!(outcome, PythonStack::Whole, "the sample itself is whole");
    assert_eq!((stats.markers_established, stats.marker_races), (0, 1));
    assert!(kernel.markers.is_empty(), "a chain read while the thread moved was told to the kernel");
}

/// Samples are read late (a consumer behind, a wakeup still to come): one taken before a chain was
/// set says nothing of that chain and does not replace it, and one that joined a replaced chain
/// keeps its proven tail until samples of its thread taken after the replacement are read.
#[test]
fn samples_read_late_neither_replace_a_chain_nor_lose_theirs() {
    let (target, _dir, py) = start("3.15");
    let pid = target.pid();
    let mut kernel = FakeKernel::default();
    let mut pythons = registered(py, OPTIONS, &mut kernel);
    let (mut stats, mut frames) = (Stats::default(), FrameTable::default());
    let mut first = sample(&mut pythons, pid, pid);
    first.time_ns = monotonic_ns();
    let (_, whole) = resolve(&mut pythons, &first, &mut kernel, &mut stats, &mut frames);
    let chain = kernel.markers[&pid];
    std::thread::sleep(Duration::from_millis(15));
    // Taken with `first`, read now: it walked the whole chain, as no chain was set then.
    let mut in_flight = first.clone();
    in_flight.time_ns += 1;
    resolve(&mut pythons, &in_flight, &mut kernel, &mut stats, &mut frames);
    assert_eq!(stats.markers_established, 1, "a sample taken before the chain was set replaced it");
    // Taken now and still walking it all: the chain is set anew.
    let mut later = first.clone();
    later.time_ns = monotonic_ns();
    resolve(&mut pythons, &later, &mut kernel, &mut stats, &mut frames);
    assert_eq!(stats.markers_established, 2);
    assert_ne!(kernel.markers[&pid].gen, chain.gen);
    // One taken before the replacement, that joined the first chain, is read after it.
    let joined = joined_at_marker(&first, chain.gen);
    let (outcome, stack) = resolve(&mut pythons, &joined, &mut kernel, &mut stats, &mut frames);
    assert_eq!((outcome, &stack), (PythonStack::Whole, &whole));
    // Once a sample taken well after the replacement is read, nothing in flight can have joined
    // the first chain: it is dropped when the next one is set.
    let mut much_later = first.clone();
    much_later.time_ns = monotonic_ns() + 50_000_000;
    resolve(&mut pythons, &much_later, &mut kernel, &mut stats, &mut frames);
    assert_eq!(stats.markers_established, 3);
    let (outcome, _) = resolve(&mut pythons, &joined, &mut kernel, &mut stats, &mut frames);
    assert_eq!(outcome, PythonStack::Cut);
}

/// A captured task named `name`, running (or suspended) in the frame at `coro_frame`, its
/// coroutine's `frames` following in the record.
fn task(name: &str, coro_frame: u64, frames: u32) -> pyebpf_common::TaskRecord {
    // SAFETY: all-zero bytes are a valid TaskRecord (plain data).
    let mut task: pyebpf_common::TaskRecord = unsafe { std::mem::zeroed() };
    task.task = 0x1000 + name.len() as u64;
    task.coro_frame = coro_frame;
    task.name_flags = type_flags::UNICODE_SUBCLASS;
    task.name_len = name.len() as u64;
    // Compact ASCII, one byte per character.
    task.name_state = (1 << 5) | (1 << 2);
    task.name[..name.len()].copy_from_slice(name.as_bytes());
    task.frames_len = frames;
    task
}

#[test]
fn a_task_chain_goes_right_outside_its_coroutine_frame_and_ends_at_an_unproven_frame() {
    let (target, _dir, py) = start("3.14");
    let pid = target.pid();
    let mut kernel = FakeKernel::default();
    let mut pythons = registered(py, SamplingOptions { async_aware: true, ..OPTIONS }, &mut kernel);
    let process = pythons.processes.get_mut(&pid).unwrap();
    let objects = process.resolver.py.offsets().objects.clone().expect("3.14 has object offsets");
    let table = AsyncioOffsets {
        task_size: 0,
        task_name: 0,
        task_awaited_by: 0,
        task_is_task: 0,
        task_awaited_by_is_set: 0,
        task_coro: 0,
        task_node: 0,
        interp_tasks_head: 0,
        thread_running_loop: 0,
        thread_running_task: 0,
        thread_tasks_head: 0,
    };
    process.tasks = Tasks::On(Box::new((objects, table)));
    let mut record = sample(&mut pythons, pid, pid);
    // `main_mid` runs the running task's coroutine; the task awaiting it is suspended in a
    // coroutine frame (here the worker's `worker_mid`, any proven frame will do).
    let mid = frame_running(&mut pythons, &record, "main_mid");
    let worker = *pythons.processes[&pid].threads.keys().find(|&&tid| tid != pid).unwrap();
    let worker_record = sample(&mut pythons, pid, worker);
    let awaiting_frame = worker_record.py_frames[frame_running(&mut pythons, &worker_record, "worker_mid")];
    let walked = record.py.frames_len as usize;
    record.py_frames[walked] = awaiting_frame;
    record.tasks.len = 2;
    record.tasks.status = task_status::RUNNING;
    record.tasks.tasks[0] = task("inner", record.py_frames[mid].addr(), 0);
    record.tasks.tasks[1] = task("outer", 0, 1);
    let (mut stats, mut frames) = (Stats::default(), FrameTable::default());
    let (_, stack) = resolve(&mut pythons, &record, &mut kernel, &mut stats, &mut frames);
    let at = stack.iter().position(|name| name == "main_mid").unwrap();
    assert_eq!(stack[at..], ["main_mid", "[task inner]", "worker_mid", "[task outer]", "main_top", "<module>"], "{stack:?}");
    assert_eq!((stats.tasks.placed, stats.tasks.chains_cut, stats.tasks.unplaced), (1, 0, 0));

    // The awaiting task's frame no longer the code object the capture saw: the chain ends there.
    record.py_frames[walked].code_version += 1;
    let (_, stack) = resolve(&mut pythons, &record, &mut kernel, &mut stats, &mut frames);
    assert_eq!(stack[at..], ["main_mid", "[task inner]", "main_top", "<module>"], "{stack:?}");
    assert_eq!(stats.tasks.chains_cut, 1);

    // A running task whose coroutine frame is not in the stack (between two steps): not placed.
    record.tasks.tasks[0].coro_frame = 8;
    let (_, stack) = resolve(&mut pythons, &record, &mut kernel, &mut stats, &mut frames);
    assert!(!stack.iter().any(|name| name.starts_with("[task")), "{stack:?}");
    assert_eq!(stats.tasks.unplaced, 1);
}

#[test]
fn frame_ids_stay_within_their_own_bound_and_the_total() {
    static TOTAL: SharedBudget = SharedBudget::new(5);
    let bounded = || frames::FrameIds::bounded(3, &TOTAL);
    let (mut first, mut second) = (bounded(), bounded());
    for code in 0..4 {
        first.insert((code, 1, 0), None);
    }
    // The fourth went past the process's bound: the first three were forgotten.
    assert_eq!((first.len(), TOTAL.used()), (1, 1));
    first.insert((1, 1, 0), None);
    first.insert((2, 1, 0), None);
    second.insert((7, 1, 0), None);
    second.insert((8, 1, 0), None);
    assert_eq!(TOTAL.used(), 5);
    // At the total, the process inserting forgets its own; the other keeps what it has.
    second.insert((9, 1, 0), None);
    assert_eq!((first.len(), second.len(), TOTAL.used()), (3, 1, 4));
    assert_eq!(second.get(&(9, 1, 0)), Some(None));
    drop(first);
    assert_eq!(TOTAL.used(), 1);
}

fn part(task: u64, awaited_by: u64, frame: FrameId) -> TaskPart {
    TaskPart { task, awaited_by, frames: vec![frame, 100 + frame], cut: false }
}

#[test]
fn waiting_task_stacks_nest_under_the_awaiters_read_with_them() {
    // Task 1 awaits nothing, 2 awaits 1, 3 awaits 2, 4 awaits a task not read.
    let parts = [part(1, 0, 1), part(2, 1, 2), part(3, 2, 3), part(4, 9, 4)];
    let mut stacks = Vec::new();
    waiting_task_stacks(&parts, &mut stacks);
    assert_eq!(stacks[0], (vec![1, 101], false));
    assert_eq!(stacks[2], (vec![3, 103, 2, 102, 1, 101], false));
    assert_eq!(stacks[3], (vec![4, 104], false));
}

#[test]
fn waiting_task_chains_that_loop_or_run_deep_are_cut() {
    let looping = [part(1, 2, 1), part(2, 1, 2)];
    let mut stacks = Vec::new();
    waiting_task_stacks(&looping, &mut stacks);
    assert_eq!(stacks[0], (vec![1, 101, 2, 102], true));
    let deep: Vec<TaskPart> = (1..=12).map(|n| part(n, n + 1, n as FrameId)).collect();
    waiting_task_stacks(&deep, &mut stacks);
    assert_eq!((stacks[0].0.len(), stacks[0].1), (2 * pyebpf_common::MAX_TASKS, true));
    assert_eq!(stacks[11], (vec![12, 112], false));
}

/// A process without an interpreter mapped, sampled in its libraries' code, had every library
/// it needs mapped: it is classified at once (its samples need not come soon). Sampled in the
/// dynamic loader, or with no address, it may still map `libpython`: it stays unclassified while
/// its rechecks last.
#[test]
fn a_process_running_past_the_loader_without_python_is_classified_at_once() {
    let sleeper = Killed(std::process::Command::new("sleep").arg("60").spawn().unwrap());
    let pid = sleeper.pid();
    let mut maps = MapsCache::default();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    // Its code in the C library, once the loader mapped it.
    let code_in = |maps: &mut MapsCache, name: &str| {
        let snapshot = maps.newer_than(pid, Duration::ZERO).unwrap();
        let mapping = snapshot.executable().find(|mapping| mapping.file().is_some_and(|file| file.to_string_lossy().contains(name)));
        mapping.map(|mapping| mapping.start + 16)
    };
    let libc = loop {
        if let Some(addr) = code_in(&mut maps, "libc.so") {
            break addr;
        }
        assert!(std::time::Instant::now() < deadline, "sleep never mapped the C library");
        std::thread::sleep(Duration::from_millis(10));
    };
    let loader = code_in(&mut maps, "/ld-").expect("sleep maps the dynamic loader");
    let (mut kernel, mut stats) = (FakeKernel::default(), Stats::default());

    for ip in [None, Some(loader)] {
        let mut pythons = Pythons::<ProcessMemory>::new(OPTIONS);
        pythons.discover(pid, ip, &mut kernel, &mut maps, &mut stats);
        assert!(!pythons.is_python(pid) && !pythons.classified(pid), "classified after a sample at {ip:x?}");
    }
    // The vDSO's code runs only when the program calls it (a loop on `clock_gettime` spends its
    // time there).
    let vdso = maps.latest(pid).unwrap().mappings().iter().find(|mapping| mapping.path == procfs::process::MMapPath::Vdso).expect("a vDSO").start;
    for (ip, place) in [(libc, "the C library"), (vdso, "the vDSO")] {
        let mut pythons = Pythons::<ProcessMemory>::new(OPTIONS);
        pythons.discover(pid, Some(ip), &mut kernel, &mut maps, &mut stats);
        assert!(!pythons.is_python(pid) && pythons.classified(pid), "not classified after a sample in {place}");
    }
}

/// A kernel thread maps nothing and never runs a program of its own: classified at its first
/// sample, which has no user address, and not read again.
#[test]
fn a_kernel_thread_is_classified_at_once() {
    const PF_KTHREAD: u32 = 0x0020_0000;
    let kernel_thread = crate::process::all_pids()
        .into_iter()
        .find(|&pid| crate::process::stat(pid).is_ok_and(|stat| stat.flags & PF_KTHREAD != 0))
        .expect("no kernel thread in /proc (a PID namespace of its own hides them)");
    let (mut kernel, mut stats, mut maps) = (FakeKernel::default(), Stats::default(), MapsCache::default());
    let mut pythons = Pythons::<ProcessMemory>::new(OPTIONS);
    pythons.discover(kernel_thread, None, &mut kernel, &mut maps, &mut stats);
    assert!(!pythons.is_python(kernel_thread) && pythons.classified(kernel_thread), "kernel thread {kernel_thread} not classified at its first sample");
}

/// A program past its loader that later `dlopen`s libpython is checked again at its first sample
/// in the library's code, which has its maps re-read; if its interpreter has not started by then,
/// the maps will not change again, so it is checked again on the loader's timer rather than
/// classified.
#[test]
fn a_libpython_loaded_late_and_not_started_yet_is_checked_again() {
    check_late_libpython("libc.so");
}

/// So is one whose every timed check sampled it in the dynamic loader's code (or the vDSO before
/// its samples there told): classified once they are over, and checked again on new maps.
#[test]
fn a_libpython_loaded_after_the_timed_checks_is_checked_again() {
    check_late_libpython("/ld-");
}

/// A program that `dlopen`s libpython 3.11 on a byte on stdin and starts its interpreter on a
/// second, sampled first in the code of the file whose path has `first_samples_in` until it is
/// classified. Once the library's timed checks are over too, a sample in its code has it checked
/// again (not sooner than a second after the last check): starting the interpreter maps nothing
/// new, so the maps alone would never have it checked again.
fn check_late_libpython(first_samples_in: &str) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let home = pyebpf_tests::pyenv_python("3.11.7").parent().and_then(|bin| bin.parent()).expect("pyenv's layout").to_path_buf();
    let lib = home.join("lib/libpython3.11.so.1.0");
    let dir = tempfile::tempdir().unwrap();
    let program = "#include <dlfcn.h>\n#include <unistd.h>\nint main(int argc, char **argv) {\n\
                   char c; void *python;\n\
                   if (read(0, &c, 1) != 1 || !(python = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL))) return 1;\n\
                   void (*initialize)(void) = (void (*)(void))dlsym(python, \"Py_Initialize\");\n\
                   if (!initialize || read(0, &c, 1) != 1) return 1;\n\
                   initialize();\n\
                   pause();\n}\n";
    let exe = pyebpf_tests::compile_c(dir.path(), "loads_late", program, &[]);
    let mut child = Command::new(&exe).arg(&lib).env("PYTHONHOME", &home).stdin(Stdio::piped()).spawn().unwrap();
    let mut start = child.stdin.take().unwrap();
    let target = Killed(child);
    let pid = target.pid();
    // The test watches the program's maps in a cache of its own; the one pyebpf reads is read
    // only as samples have it read.
    let mut watched = MapsCache::default();
    let mut mapped = |name: &str| {
        let snapshot = watched.newer_than(pid, Duration::ZERO).unwrap();
        snapshot.executable().find(|mapping| mapping.file().is_some_and(|file| file.to_string_lossy().contains(name))).map(|mapping| mapping.start + 16)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let first = loop {
        if let Some(addr) = mapped("libc.so").and(mapped(first_samples_in)) {
            break addr;
        }
        assert!(std::time::Instant::now() < deadline, "the program never mapped the C library");
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut checks = LateChecks { pid, pythons: Pythons::new(OPTIONS), kernel: FakeKernel::default(), maps: MapsCache::default(), stats: Stats::default() };
    // The timed checks come 20 ms to 1.3 s apart, 2.5 s in all.
    checks.sample_until(first, |pythons| pythons.classified(pid), "still checked on a timer after 5 s");
    assert!(!checks.pythons.is_python(pid));

    start.write_all(b"x").unwrap();
    let libpython = loop {
        if let Some(addr) = mapped("libpython3.11") {
            break addr;
        }
        assert!(std::time::Instant::now() < deadline + Duration::from_secs(10), "the program did not dlopen libpython3.11");
        std::thread::sleep(Duration::from_millis(10));
    };
    std::thread::sleep(crate::maps::REFRESH_INTERVAL);
    checks.sample(libpython);
    assert!(checks.maps.latest(pid).is_some_and(|latest| latest.find(libpython).is_some()), "a sample in libpython did not have the maps re-read");
    assert!(!checks.pythons.is_python(pid), "attached to a libpython that runs no interpreter");
    assert!(!checks.pythons.classified(pid), "a libpython whose interpreter may yet start was classified: it would never be checked again");

    checks.sample_until(first, |pythons| pythons.classified(pid), "libpython still checked on a timer after 5 s");
    checks.sample(libpython);
    assert!(checks.pythons.classified(pid), "a sample in libpython had it checked again within a second of the last check");
    start.write_all(b"x").unwrap();
    checks.sample_until(libpython, |pythons| pythons.is_python(pid), "the interpreter it started not attached from samples in libpython's code after 5 s");
}

/// What [`check_late_libpython`] checks a process with.
struct LateChecks {
    pid: u32,
    pythons: Pythons<ProcessMemory>,
    kernel: FakeKernel,
    maps: MapsCache,
    stats: Stats,
}

impl LateChecks {
    /// A sample of the process at `ip`.
    fn sample(&mut self, ip: u64) {
        self.pythons.discover(self.pid, Some(ip), &mut self.kernel, &mut self.maps, &mut self.stats);
    }

    /// Samples at `ip` every [`FIRST_RECHECK`] until `done`; `failure` after 5 s.
    fn sample_until(&mut self, ip: u64, done: impl Fn(&Pythons<ProcessMemory>) -> bool, failure: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        self.sample(ip);
        while !done(&self.pythons) {
            assert!(std::time::Instant::now() < deadline, "{failure}");
            std::thread::sleep(FIRST_RECHECK);
            self.sample(ip);
        }
    }
}
