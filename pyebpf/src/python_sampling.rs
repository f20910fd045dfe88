//! Python-aware sampling: tells the eBPF program which threads are Python threads and where their
//! thread states are, and turns the frame chain it walked at each sample into a Python stack.
//!
//! Every frame of a stack comes from the sample itself, or from a marker chain proven unchanged
//! since (3.15): nothing read later is attributed to a sample. A chain that cannot be completed
//! from those is cut at the first unproven frame and marked truncated.
//!
//! **Marker chains (3.15).** For a thread whose marker pyebpf may write (see `cpython::marker`), it
//! *establishes* a chain now and then: it reads the thread's current frame `F` and the marker's
//! sequence number, points the marker at `F`, reads the frames from `F` rootward (down to the
//! previous chain's marker, whose tail is already proven), then reads the sequence number again.
//! Unchanged, it proves `F` did not return while its ancestors were read, so they are exactly the
//! frames that stay frozen until `F` returns; from then on, `k` returns of the marker frame move the
//! marker `k` positions up that chain and the sequence number by `k`. The eBPF program checks
//! marker and sequence against the chain's addresses (`PY_MARKERS`) and stops its walk there.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use pyebpf_common::{
    py_proc_flags, py_status, task_status, MarkerChain, PyCapture, PyFrameRecord, PyProcConfig, PyThreadEntry, SampleRecord, TaskRecord, WaitingTasks,
    MARKER_POSITIONS, MAX_PY_FRAMES, MAX_TASKS, MAX_WAITING_TASKS, NO_OFFSET,
};

use crate::bpf::Sampler;
use crate::budget::SharedBudget;
use crate::chain::{FrameLink, LinkKind, LinkReader};
use crate::cpython::asyncio::{self, find_asyncio_offsets, AsyncioOffsets, TaskReader, TaskState};
use crate::cpython::memory::ProcessMemory;
use crate::cpython::offsets::ObjectOffsets;
use crate::cpython::TRUNCATION_MARK;
use crate::cpython::{PyError, PyProcess};
use crate::maps::MapsCache;
use crate::merge::PyStackItem;
use crate::stack::{Frame, FrameCarry, FrameId, FrameTable};
use crate::stats::{NamedProcesses, Stats};

/// How often thread lists are re-read to register new threads and drop dead ones.
const THREAD_REFRESH: Duration = Duration::from_millis(500);
/// A sample from an unregistered thread re-reads its process's threads at most this often.
const UNKNOWN_THREAD_REFRESH: Duration = Duration::from_millis(20);
/// A process found not to be Python is checked again this long after (doubling each time), at most
/// [`RECHECKS`] times: right after an exec the dynamic loader has not mapped `libpython` yet, and
/// the runtime is not set up yet.
const FIRST_RECHECK: Duration = Duration::from_millis(20);
const RECHECKS: u32 = 7;
/// A chain is re-established when the kernel walked more frames than this to reach the marker.
const ESTABLISH_AFTER_FRAMES: u32 = 4;
/// And at most this often per thread, so a thread whose calls come and go costs little.
const ESTABLISH_INTERVAL: Duration = Duration::from_millis(10);
/// A thread whose chain failed to read this many times in a row gets no more marker writes: its
/// memory is damaged or hostile (a race ends in `Ok(None)` and does not count).
const MAX_ESTABLISH_FAILURES: u32 = 3;

/// How Python frames are found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SamplingOptions {
    /// Use the 3.15 marker (off with `--no-cache`: the kernel walks every chain in full).
    pub marker: bool,
    /// Never write into a target (`--read-only`).
    pub read_only: bool,
    /// Frames the kernel walks at most per sample.
    pub max_frames: u32,
    /// Read each sample's asyncio task chain (`--async-aware`, CPython 3.14+).
    pub async_aware: bool,
}

/// Whether a process's asyncio tasks are read at its captures.
enum Tasks {
    /// Not asked for, or the version has no asyncio debug offsets (before 3.14).
    Off,
    /// Asked for; the `_asyncio` table is not mapped yet (3.14 maps it when asyncio is first
    /// imported): looked for again at each refresh of the thread list, after the first look only
    /// in `_asyncio` modules (the interpreter's own files do not change).
    Pending { interpreter_searched: bool },
    /// Told to the eBPF program (boxed: a process without tasks keeps a small entry).
    On(Box<(ObjectOffsets, AsyncioOffsets)>),
}

/// A chain pyebpf proved when it wrote the marker, innermost (the marker frame) first.
struct EstablishedChain {
    gen: u64,
    /// The marker's sequence number when the marker was pointed at `addrs[0]`.
    seq_base: u64,
    addrs: Vec<u64>,
    /// The resolved frame at each position (`None`: a frame Python's own view leaves out).
    items: Vec<Option<PyItem>>,
}

/// A Python stack entry with its frame interned.
pub type PyItem = PyStackItem<FrameId>;

/// Frames resolved per process at most (then forgotten, and resolved again on demand), and over all
/// processes together.
const MAX_FRAME_IDS: usize = 100_000;
static ALL_FRAME_IDS: SharedBudget = SharedBudget::new(1_000_000);

/// The frame of each (code object, `co_version`, instruction) seen in one process: versions are
/// never reused, so a hit is the same code object at the same place. `None`: a frame Python's own
/// view leaves out. Bounded per process and, with every other process's, in total.
struct FrameIds {
    ids: hashbrown::HashMap<(u64, u32, u64), Option<FrameId>>,
    max: usize,
    /// Ids held by every process's `FrameIds`.
    total: &'static SharedBudget,
}

impl FrameIds {
    fn new() -> Self {
        FrameIds { ids: hashbrown::HashMap::new(), max: MAX_FRAME_IDS, total: &ALL_FRAME_IDS }
    }

    fn get(&self, key: &(u64, u32, u64)) -> Option<Option<FrameId>> {
        self.ids.get(key).copied()
    }

    /// Keeps `id` under `key`. Past either bound this process forgets its ids first; while the
    /// others hold the whole total it keeps none.
    fn insert(&mut self, key: (u64, u32, u64), id: Option<FrameId>) {
        if self.ids.len() >= self.max || !self.total.fits(1) {
            self.clear();
        }
        if !self.total.take(1) {
            return;
        }
        if self.ids.insert(key, id).is_some() {
            self.total.release(1);
        }
    }

    fn clear(&mut self) {
        self.total.release(self.ids.len());
        self.ids.clear();
    }

    fn ids_mut(&mut self) -> impl Iterator<Item = &mut FrameId> {
        self.ids.values_mut().flatten()
    }
}

impl Drop for FrameIds {
    fn drop(&mut self) {
        self.clear();
    }
}

/// Threads remembered per process as running no Python, at most (then forgotten all at once).
const MAX_NOT_PYTHON_THREADS: usize = 4096;

/// Chains kept per thread, newest first: samples still in flight when a chain is replaced (a
/// consumer that fell behind) may have joined an older one.
const CHAINS_KEPT: usize = 8;

struct Thread {
    tstate: u64,
    chains: VecDeque<EstablishedChain>,
    established_at: Option<Instant>,
    /// Establishments in a row whose reads failed.
    establish_failures: u32,
}

impl Thread {
    fn chain(&self, gen: u64) -> Option<&EstablishedChain> {
        self.chains.iter().find(|c| c.gen == gen)
    }
}

struct PythonProcess {
    py: PyProcess<ProcessMemory>,
    /// What the eBPF program was told about the process (`PY_PROCS`).
    config: PyProcConfig,
    threads: HashMap<u32, Thread>,
    threads_read: Instant,
    /// Threads sampled while missing from a non-empty interpreter thread list: not Python threads,
    /// so their samples cost no re-reads until the thread list changes.
    not_python: HashSet<u32>,
    /// `co_version` of each code object decoded, by address: a different version at the same
    /// address is another code object.
    code_versions: HashMap<u64, u32>,
    frame_ids: FrameIds,
    tasks: Tasks,
}

/// A process found not to be CPython 3.8+ (or unreadable), until it execs or exits.
struct Other {
    checked_at: Instant,
    checks: u32,
    /// What was found cannot change without an exec (an unsupported version, say).
    settled: bool,
}

impl Other {
    fn recheck_due(&self) -> bool {
        !self.settled && self.checks < RECHECKS && self.checked_at.elapsed() >= FIRST_RECHECK * (1 << self.checks)
    }
}

pub struct PythonSampling {
    processes: HashMap<u32, PythonProcess>,
    /// What the code-object caches of processes forgotten since (exited, exec'd) counted.
    retired_code_cache: crate::cpython::CodeCacheCounters,
    others: HashMap<u32, Other>,
    options: SamplingOptions,
    next_gen: u64,
    /// Processes whose tasks cannot be read (`--async-aware`), for the summary.
    unreadable_tasks: NamedProcesses,
}

impl PythonSampling {
    pub fn new(options: SamplingOptions) -> Self {
        PythonSampling {
            processes: HashMap::new(),
            retired_code_cache: Default::default(),
            others: HashMap::new(),
            options,
            next_gen: 1,
            unreadable_tasks: NamedProcesses::default(),
        }
    }

    /// Attaches to `pid` if it is a CPython 3.8+ process not seen before, and registers its
    /// threads with the eBPF program.
    pub fn discover(&mut self, pid: u32, sampler: &mut Sampler, maps: &mut MapsCache, stats: &mut Stats) {
        if self.attach(pid, stats) {
            self.register(pid, sampler, maps);
        }
    }

    /// Whether `pid` is a CPython 3.8+ process attached to.
    pub fn is_python(&self, pid: u32) -> bool {
        self.processes.contains_key(&pid)
    }

    /// Attaches to processes before sampling starts (reading their ELF files takes time), so
    /// that their first samples already have Python frames; [`Self::register_all`] then tells
    /// the eBPF program.
    pub fn attach_all(&mut self, pids: impl IntoIterator<Item = u32>, stats: &mut Stats) {
        for pid in pids {
            self.attach(pid, stats);
        }
    }

    pub fn register_all(&mut self, sampler: &mut Sampler, maps: &mut MapsCache) {
        let pids: Vec<u32> = self.processes.keys().copied().collect();
        for pid in pids {
            self.register(pid, sampler, maps);
        }
    }

    /// True when `pid` was newly attached.
    fn attach(&mut self, pid: u32, stats: &mut Stats) -> bool {
        if self.processes.contains_key(&pid) || self.others.get(&pid).is_some_and(|other| !other.recheck_due()) {
            return false;
        }
        let checks = self.others.get(&pid).map_or(0, |other| other.checks + 1);
        let mut not_python = |settled: bool| {
            self.others.insert(pid, Other { checked_at: Instant::now(), checks, settled });
            false
        };
        let py = match PyProcess::attach(pid) {
            Ok(py) if py.fits_frame_window() => py,
            Ok(_) => {
                log::debug!("pid {pid}: frame fields beyond the eBPF program's window");
                return not_python(true);
            }
            Err(err) => {
                // Reported once; later checks (a late libpython) stay quiet.
                if checks == 0 {
                    log::debug!("pid {pid}: not profiled as Python: {err}");
                    if let Some(python) = err.unsupported_python() {
                        stats.unsupported_pythons.add(format!("{python} (pid {pid})"));
                    }
                }
                let settled = err.unsupported_python().is_some() || matches!(err, PyError::BadOffsets(_));
                return not_python(settled);
            }
        };
        self.others.remove(&pid);
        stats.python_processes += 1;
        let tasks = match (self.options.async_aware, &py.offsets().objects) {
            (false, _) => Tasks::Off,
            (true, None) => {
                self.unreadable_tasks.add(format!("CPython {} (pid {pid})", py.version()));
                Tasks::Off
            }
            (true, Some(_)) => Tasks::Pending { interpreter_searched: false },
        };
        let process = PythonProcess {
            config: py.bpf_config(),
            py,
            threads: HashMap::new(),
            threads_read: Instant::now(),
            not_python: HashSet::new(),
            code_versions: HashMap::new(),
            frame_ids: FrameIds::new(),
            tasks,
        };
        self.processes.insert(pid, process);
        true
    }

    fn register(&mut self, pid: u32, sampler: &mut Sampler, maps: &mut MapsCache) {
        let Some(process) = self.processes.get_mut(&pid) else { return };
        let config = &mut process.config;
        config.max_frames = self.options.max_frames.min(MAX_PY_FRAMES as u32);
        if self.options.marker && !self.options.read_only {
            config.flags |= py_proc_flags::USE_MARKER;
        }
        if let Err(problem) = process.find_tasks(maps) {
            self.unreadable_tasks.add(problem);
        }
        if sampler.set_py_process(pid, &process.config).is_err() {
            log::debug!("pid {pid}: PY_PROCS is full; sampled natively");
            self.processes.remove(&pid);
            self.others.insert(pid, Other { checked_at: Instant::now(), checks: RECHECKS, settled: true });
            return;
        }
        process.refresh_threads(sampler);
    }

    /// Forgets what was registered with a sampler that is gone (its threads and their marker
    /// chains): [`Self::register_all`] tells the next one afresh.
    pub fn forget_registrations(&mut self) {
        for process in self.processes.values_mut() {
            process.threads.clear();
            process.not_python.clear();
        }
    }

    /// Re-reads thread lists now and then; forgets processes that have exited.
    pub fn upkeep(&mut self, sampler: &mut Sampler, maps: &mut MapsCache) {
        let mut exited = Vec::new();
        for (&pid, process) in &mut self.processes {
            if process.threads_read.elapsed() < THREAD_REFRESH {
                continue;
            }
            match process.find_tasks(maps) {
                Ok(true) if sampler.set_py_process(pid, &process.config).is_err() => log::debug!("pid {pid}: PY_PROCS entry not updated"),
                Ok(_) => {}
                Err(problem) => self.unreadable_tasks.add(problem),
            }
            if !process.refresh_threads(sampler) {
                exited.push(pid);
            }
        }
        for pid in exited {
            self.forget(pid, sampler);
        }
    }

    /// Drops everything known of `pid` (it exited or replaced its program), its eBPF map entries
    /// included; its next sample classifies it afresh.
    pub fn forget(&mut self, pid: u32, sampler: &mut Sampler) {
        self.others.remove(&pid);
        if let Some(process) = self.processes.remove(&pid) {
            // Its counts stay in --stats; what its cache holds goes with it.
            let counters = process.py.code_cache_counters();
            self.retired_code_cache = self.retired_code_cache + crate::cpython::CodeCacheCounters { cached_entries: 0, cached_bytes: 0, ..counters };
            for tid in process.threads.keys() {
                sampler.remove_py_thread(*tid);
            }
            sampler.remove_py_process(pid);
        }
    }

    /// Moves the frames every process's caches and established chains hold into a new table.
    pub fn carry_frames(&mut self, carry: &mut FrameCarry<'_>) {
        for process in self.processes.values_mut() {
            process.carry_frames(carry);
        }
    }

    /// Forgets every frame id (they belong to a table that is gone): frames are resolved again,
    /// and chains re-established.
    pub fn clear_frame_ids(&mut self) {
        for process in self.processes.values_mut() {
            process.frame_ids.clear();
            for thread in process.threads.values_mut() {
                thread.chains.clear();
            }
        }
    }

    /// The Python stack of a sample into `items` (innermost first), if it is one of a Python
    /// thread; `Some(true)` when the chain was cut at the first frame that could not be proven.
    pub fn python_stack(
        &mut self,
        record: &SampleRecord,
        sampler: &mut Sampler,
        stats: &mut Stats,
        frames: &mut FrameTable,
        items: &mut Vec<PyItem>,
    ) -> Option<bool> {
        items.clear();
        let process = self.processes.get_mut(&record.tgid)?;
        let py = &record.py;
        if py.status & py_status::THREAD_KNOWN == 0 {
            process.unknown_thread_sampled(record.tid, sampler);
            return None;
        }
        if py.status & py_status::FRAME_READ == 0 || py.frame == 0 {
            return None;
        }
        let before = process.py.remote_counters();
        let walked = &record.py_frames[..(py.frames_len as usize).min(MAX_PY_FRAMES)];
        stats.kernel_frames += walked.len() as u64;
        // Where the running task's coroutine frame ends up in `items`: its tasks go right after.
        let task_frame = process.running_task_frame(record);
        let mut task_at = None;
        let mut truncated = process.resolve_walked(walked, task_frame, &mut task_at, frames, items);
        if !truncated {
            truncated = !process.complete_chain(record, task_frame, &mut task_at, items, stats);
        }
        if let Some(at) = task_at {
            process.insert_tasks(record, at, frames, items, stats);
        } else if task_frame.is_some() {
            stats.tasks.unplaced += 1;
        }
        stats.truncated_samples += u64::from(truncated);
        if self.options.marker && !self.options.read_only {
            let gen = self.next_gen;
            if process.maybe_establish(record, gen, sampler, stats, frames) {
                self.next_gen += 1;
            }
        }
        let after = process.py.remote_counters();
        stats.remote_reads += after.reads - before.reads;
        stats.remote_bytes += after.bytes - before.bytes;
        stats.python_samples += 1;
        Some(truncated)
    }

    /// The stacks of the waiting tasks of process `pid` the eBPF program read at a capture, into
    /// `stacks` (frame ids innermost first, and whether the task's frames were cut): each task's
    /// coroutine frames under its `[task NAME]` frame, under those of the tasks awaiting it that
    /// the same capture read.
    pub fn waiting_stacks(&mut self, pid: u32, waiting: &WaitingTasks, frames: &mut FrameTable, stacks: &mut Vec<(Vec<FrameId>, bool)>, stats: &mut Stats) {
        stacks.clear();
        let Some(process) = self.processes.get_mut(&pid) else { return };
        let Tasks::On(on) = &process.tasks else { return };
        let objects = on.0.clone();
        let read = &waiting.tasks[..(waiting.len as usize).min(MAX_WAITING_TASKS)];
        let mut parts: Vec<TaskPart> = Vec::with_capacity(read.len());
        let mut next = 0;
        for task in read {
            let coroutine = waiting.frames.get(next..next + task.frames_len as usize).unwrap_or_default();
            next += task.frames_len as usize;
            let mut part = Vec::with_capacity(coroutine.len() + 1);
            // A cut keeps what the task awaits; its outer frames and awaiters are not known.
            let cut = !process.task_frames(task, coroutine, frames, &mut part);
            part.push(process.task_frame(task, &objects, frames));
            parts.push(TaskPart { task: task.task, awaited_by: task.awaited_by, frames: part, cut });
        }
        waiting_task_stacks(&parts, stacks);
        stats.tasks.waiting += stacks.len() as u64;
        stats.tasks.waiting_cut += u64::from(waiting.status & task_status::WAITING_CUT != 0);
    }

    /// The stacks of the waiting tasks of thread `tid` of `tgid`, read now, as the eBPF program
    /// would have at a capture (see [`Self::waiting_stacks`]). Only for a thread that has not run
    /// since it left the CPU, so none of its tasks has (the caller proves that afterwards).
    pub fn read_waiting_stacks(&mut self, tgid: u32, tid: u32, frames: &mut FrameTable, stacks: &mut Vec<(Vec<FrameId>, bool)>, stats: &mut Stats) {
        stacks.clear();
        let Some(process) = self.processes.get_mut(&tgid) else { return };
        let (Some(thread), Tasks::On(on)) = (process.threads.get(&tid), &process.tasks) else { return };
        let (tstate, table) = (thread.tstate, on.1);
        let list = match TaskReader::new(&mut process.py, Some(table), MAX_WAITING_TASKS).map(|mut reader| reader.thread_tasks(tstate)) {
            Ok(Ok(list)) => list,
            Ok(Err(err)) => return log::debug!("pid {tgid} thread {tid}: tasks: {err}"),
            Err(err) => return log::debug!("pid {tgid}: tasks: {err}"),
        };
        let waiting = list.tasks.iter().filter(|task| task.state == TaskState::Waiting && task.error.is_none());
        let parts: Vec<TaskPart> = waiting
            .map(|task| {
                let mut part: Vec<FrameId> = task.frames.iter().rev().map(|resolved| frames.intern(Frame::Python(resolved.frame.clone()))).collect();
                part.push(frames.intern(Frame::Task(task.name.as_str().into())));
                let awaited_by = match task.awaited_by[..] {
                    [one] => one,
                    _ => 0,
                };
                TaskPart { task: task.addr, awaited_by, frames: part, cut: task.truncated }
            })
            .collect();
        waiting_task_stacks(&parts, stacks);
        stats.tasks.waiting += stacks.len() as u64;
        stats.tasks.waiting_cut += u64::from(list.total > list.tasks.len());
    }

    /// Fills `record`'s Python part for thread `tid` of `tgid`, read now, as the eBPF program would
    /// have at a capture; false when it is not a known Python thread or cannot be read. Only for a
    /// thread that has not run since it left the CPU (the caller proves that afterwards).
    pub fn capture_waiting(&mut self, tgid: u32, tid: u32, record: &mut SampleRecord) -> bool {
        let Some(process) = self.processes.get_mut(&tgid) else { return false };
        let Some(thread) = process.threads.get(&tid) else { return false };
        let max = (self.options.max_frames as usize).min(MAX_PY_FRAMES);
        // Tasks are read only at a capture in the kernel.
        record.tasks.len = 0;
        record.tasks.status = 0;
        record.tasks.frames_len = 0;
        let py = &mut record.py;
        *py = PyCapture { tstate: thread.tstate, status: py_status::THREAD_KNOWN, ..PyCapture::default() };
        let Ok(frame) = process.py.current_frame(thread.tstate) else { return true };
        py.frame = frame;
        py.status |= py_status::FRAME_READ;
        match process.py.frame_records(frame, &mut record.py_frames[..max]) {
            Ok((walked, complete)) => {
                py.frames_len = walked as u32;
                py.status |= if complete { py_status::COMPLETE } else { py_status::TOO_DEEP };
            }
            Err(err) => {
                log::debug!("pid {tgid} thread {tid}: {err}");
                py.status |= py_status::READ_FAILED;
            }
        }
        true
    }

    /// The processes whose tasks could not be read, into `stats`.
    pub fn unreadable_tasks(&self, stats: &mut Stats) {
        stats.tasks.unsupported = self.unreadable_tasks.clone();
    }

    /// Code-object cache counters summed over every process attached to (those that have exited
    /// too), for `--stats`; the entries and bytes cached are those of the processes attached now.
    pub fn code_cache_counters(&self) -> crate::cpython::CodeCacheCounters {
        self.processes.values().map(|p| p.py.code_cache_counters()).sum::<crate::cpython::CodeCacheCounters>() + self.retired_code_cache
    }
}

/// A waiting task's own part of a stack, innermost first: its coroutine frames (`cut` where
/// unproven ones were dropped), then its task frame.
struct TaskPart {
    task: u64,
    awaited_by: u64,
    frames: Vec<FrameId>,
    cut: bool,
}

/// Each task's stack: its part under those of the tasks awaiting it, as far as they are among
/// `parts` (read at the same moment); a chain that loops or runs past [`MAX_TASKS`] is cut.
fn waiting_task_stacks(parts: &[TaskPart], stacks: &mut Vec<(Vec<FrameId>, bool)>) {
    stacks.clear();
    let index: HashMap<u64, usize> = parts.iter().enumerate().map(|(i, part)| (part.task, i)).collect();
    for (i, part) in parts.iter().enumerate() {
        let mut stack = part.frames.clone();
        let mut truncated = part.cut;
        // A part cut short is not placed under its awaiters: its frames in between are unknown.
        let mut awaiter = if part.cut { 0 } else { part.awaited_by };
        let mut levels = 1;
        while let Some(&outer) = index.get(&awaiter) {
            if levels == MAX_TASKS || outer == i {
                truncated = true;
                break;
            }
            stack.extend_from_slice(&parts[outer].frames);
            if parts[outer].cut {
                truncated = true;
                break;
            }
            awaiter = parts[outer].awaited_by;
            levels += 1;
        }
        stacks.push((stack, truncated));
    }
}

fn link_of(py: &PyProcess<ProcessMemory>, frame: &PyFrameRecord) -> FrameLink {
    let offsets = py.offsets();
    FrameLink { addr: frame.addr(), previous: 0, code: frame.code, instr_ptr: offsets.instr_of(frame.instr_ptr), kind: offsets.link_kind(frame.owner()) }
}

impl PythonProcess {
    fn carry_frames(&mut self, carry: &mut FrameCarry<'_>) {
        for id in self.frame_ids.ids_mut() {
            *id = carry.carry(*id);
        }
        let chains = self.threads.values_mut().flat_map(|thread| thread.chains.iter_mut());
        for item in chains.flat_map(|chain| chain.items.iter_mut().flatten()) {
            if let PyStackItem::Frame(id) = item {
                *id = carry.carry(*id);
            }
        }
    }

    /// The frames the kernel walked, resolved into `items`; cut (and `true`) at the first frame
    /// whose code object cannot be proven to be the one that ran. `task_at` is set to where in
    /// `items` the frame at `task_frame` ends.
    fn resolve_walked(
        &mut self,
        walked: &[PyFrameRecord],
        task_frame: Option<u64>,
        task_at: &mut Option<usize>,
        frames: &mut FrameTable,
        items: &mut Vec<PyItem>,
    ) -> bool {
        for frame in walked {
            let link = link_of(&self.py, frame);
            match self.resolve_link(&link, frame.code_version, frames) {
                Ok(Some(item)) => items.push(item),
                Ok(None) => {}
                Err(err) => {
                    log::debug!("pid {}: frame {:#x}: {err}", self.py.pid(), link.addr);
                    return true;
                }
            }
            if task_frame == Some(link.addr) {
                *task_at = Some(items.len());
            }
            // Not on the C stack: no native frame's range can place it.
            if link.kind == LinkKind::EntryCode {
                items.push(PyStackItem::SegmentEnd { entry_frame: 0 });
            }
        }
        false
    }

    /// A frame link as a stack item; `Ok(None)` for frames Python's own view leaves out. The code
    /// object must still be the one with `version`, else the decode would name another function.
    fn resolve_link(&mut self, link: &FrameLink, version: u32, frames: &mut FrameTable) -> Result<Option<PyItem>, PyError> {
        if link.kind == LinkKind::Entry {
            return Ok(Some(PyStackItem::SegmentEnd { entry_frame: link.addr }));
        }
        if link.code == 0 {
            return Ok(None);
        }
        let key = (link.code, version, link.instr_ptr);
        if let Some(id) = self.frame_ids.get(&key) {
            return Ok(id.map(PyStackItem::Frame));
        }
        let resolved = self.decode_link(link, version)?;
        let id = resolved.map(|frame| frames.intern(Frame::Python(frame)));
        self.frame_ids.insert(key, id);
        Ok(id.map(PyStackItem::Frame))
    }

    /// Decodes a frame's function and line from its code object, checking the object is still
    /// the one with `version`.
    fn decode_link(&mut self, link: &FrameLink, version: u32) -> Result<Option<crate::stack::PythonFrame>, PyError> {
        if self.code_versions.get(&link.code) != Some(&version) {
            self.py.forget_code(link.code);
            self.code_versions.remove(&link.code);
            let resolved = self.py.frame_info(link)?;
            // Versions are never reused: the same one now means the object lived since the sample
            // (on 3.11, a fingerprint of its names: the same one means an object of the same name).
            let now = self.py.code_version(link.code)?;
            if now != version {
                self.py.forget_code(link.code);
                return Err(PyError::Chain(format!("code object {:#x} was freed since the sample", link.code)));
            }
            if self.code_versions.len() >= crate::cpython::MAX_CACHED_CODES {
                // Bounded like the code cache: versions are checked again after this.
                self.code_versions.clear();
            }
            self.code_versions.insert(link.code, now);
            return Ok(resolved.map(|r| r.frame));
        }
        Ok(self.py.frame_info(link)?.map(|r| r.frame))
    }

    /// Appends the proven rest of the chain; false when the walk ended on something unproven.
    /// `task_at` as in `resolve_walked`.
    fn complete_chain(
        &mut self,
        record: &SampleRecord,
        task_frame: Option<u64>,
        task_at: &mut Option<usize>,
        items: &mut Vec<PyItem>,
        stats: &mut Stats,
    ) -> bool {
        let py = &record.py;
        if py.status & py_status::COMPLETE != 0 {
            return true;
        }
        if py.status & py_status::JOINED == 0 {
            return false;
        }
        let Some(chain) = self.threads.get(&record.tid).and_then(|t| t.chain(py.marker_gen)) else {
            return false;
        };
        let from = py.marker_position as usize + 1;
        let tail = chain.items.get(from..).unwrap_or_default();
        stats.frames_joined += tail.len() as u64;
        stats.marker_joins += 1;
        for (item, addr) in tail.iter().zip(&chain.addrs[from..]) {
            items.extend(item);
            if task_frame == Some(*addr) && task_at.is_none() {
                *task_at = Some(items.len());
            }
        }
        true
    }

    /// Looks for the process's asyncio table while it is pending; once found, sets it in `config`
    /// (true: `config` is to be told to the eBPF program), or says why it cannot be used.
    fn find_tasks(&mut self, maps: &mut MapsCache) -> Result<bool, String> {
        let Tasks::Pending { interpreter_searched } = self.tasks else { return Ok(false) };
        let pid = self.py.pid();
        // Read now: a module loaded since the last look (one `THREAD_REFRESH` ago) must show.
        let maps = maps.newer_than(pid, Duration::ZERO).map_err(PyError::from);
        let table = match maps.and_then(|maps| find_asyncio_offsets(pid, maps, self.py.memory(), !interpreter_searched)) {
            Ok(Some(table)) => table,
            Ok(None) => {
                self.tasks = Tasks::Pending { interpreter_searched: true };
                return Ok(false);
            }
            Err(err) => {
                self.tasks = Tasks::Off;
                return Err(format!("pid {pid}: {err}"));
            }
        };
        let (Some(config), Some(objects)) = (asyncio::bpf_config(&table, self.py.offsets()), self.py.offsets().objects.clone()) else {
            self.tasks = Tasks::Off;
            return Err(format!("CPython {} (pid {pid})", self.py.version()));
        };
        self.config.asyncio = config;
        self.config.flags |= py_proc_flags::TASKS;
        self.tasks = Tasks::On(Box::new((objects, table)));
        Ok(true)
    }

    /// The running task's coroutine frame at the capture, where tasks were read.
    fn running_task_frame(&self, record: &SampleRecord) -> Option<u64> {
        let tasks = &record.tasks;
        let running = matches!(self.tasks, Tasks::On(..)) && tasks.status & task_status::RUNNING != 0 && tasks.len > 0;
        running.then_some(tasks.tasks[0].coro_frame).filter(|&frame| frame != 0)
    }

    /// Inserts the task chain the capture read at `at` in `items` (innermost first, so right
    /// outside the running task's coroutine frame): each task's `[task NAME]` frame, with each
    /// awaiting task's suspended coroutine frames inside it. The chain is cut at the first
    /// awaiting frame whose code object cannot be proven.
    fn insert_tasks(&mut self, record: &SampleRecord, at: usize, frames: &mut FrameTable, items: &mut Vec<PyItem>, stats: &mut Stats) {
        let Tasks::On(on) = &self.tasks else { return };
        let objects = on.0.clone();
        let captured = &record.tasks;
        let mut chain = Vec::new();
        let mut next = record.py.frames_len as usize;
        let mut cut = captured.status & (task_status::TOO_MANY | task_status::READ_FAILED | task_status::FRAMES_CUT) != 0;
        for task in &captured.tasks[..(captured.len as usize).min(MAX_TASKS)] {
            let coroutine = record.py_frames.get(next..next + task.frames_len as usize).unwrap_or_default();
            next += task.frames_len as usize;
            // The chain ends at a frame that cannot be proven: what is outside it is not known.
            if !self.task_frames(task, coroutine, frames, &mut chain) {
                cut = true;
                break;
            }
            chain.push(self.task_frame(task, &objects, frames));
        }
        if captured.status & task_status::TOO_MANY != 0 {
            chain.push(frames.intern(Frame::Task(TRUNCATION_MARK.to_string().into())));
        }
        stats.tasks.placed += 1;
        stats.tasks.chains_cut += u64::from(cut);
        items.splice(at..at, chain.into_iter().map(PyStackItem::Frame));
    }

    /// A task's suspended coroutine frames as a capture read them (`coroutine`, outermost first),
    /// resolved onto `out` innermost first; false at the first whose code cannot be proven (those
    /// inside it are kept).
    fn task_frames(&mut self, task: &TaskRecord, coroutine: &[PyFrameRecord], frames: &mut FrameTable, out: &mut Vec<FrameId>) -> bool {
        for frame in coroutine.iter().rev() {
            match self.resolve_link(&link_of(&self.py, frame), frame.code_version, frames) {
                Ok(Some(PyStackItem::Frame(id))) => out.push(id),
                Ok(_) => {}
                Err(err) => {
                    log::debug!("pid {}: task {:#x}: {err}", self.py.pid(), task.task);
                    return false;
                }
            }
        }
        true
    }

    /// The `[task NAME]` frame of a task a capture read (`[task ?]` if its name is malformed).
    fn task_frame(&self, task: &TaskRecord, objects: &ObjectOffsets, frames: &mut FrameTable) -> FrameId {
        let name = asyncio::captured_name(task, objects).unwrap_or_else(|err| {
            log::debug!("pid {}: task {:#x}: {err}", self.py.pid(), task.task);
            "?".into()
        });
        frames.intern(Frame::Task(name.into()))
    }

    /// Establishes a new marker chain for the sampled thread when the kernel had to walk far;
    /// true when `gen` was used.
    fn maybe_establish(&mut self, record: &SampleRecord, gen: u64, sampler: &mut Sampler, stats: &mut Stats, frames: &mut FrameTable) -> bool {
        let joined_near_leaf = record.py.status & py_status::JOINED != 0 && record.py.frames_len <= ESTABLISH_AFTER_FRAMES;
        // A chain deeper than the kernel walks could only be proven by reading all of it here.
        let too_deep = record.py.status & py_status::TOO_DEEP != 0;
        let Some(thread) = self.threads.get(&record.tid) else { return false };
        // A sample in another thread state of the thread (a subinterpreter's) says nothing of
        // the registered one, whose marker this would move.
        if record.py.tstate != thread.tstate
            || joined_near_leaf
            || too_deep
            || !self.py.marker_writable(thread.tstate)
            || !self.py.decoded_frames()
            || thread.established_at.is_some_and(|at| at.elapsed() < ESTABLISH_INTERVAL)
            || thread.establish_failures >= MAX_ESTABLISH_FAILURES
        {
            return false;
        }
        let tstate = thread.tstate;
        // While the marker moves, the eBPF program must not join the old chain: a marker moved
        // by returns of the new marker frame could land on an address the old chain also holds.
        sampler.remove_marker_chain(record.tid);
        let established = self.establish(record.tid, tstate, gen, frames);
        let thread = self.threads.get_mut(&record.tid).expect("looked up above");
        thread.established_at = Some(Instant::now());
        thread.establish_failures = if established.is_err() { thread.establish_failures + 1 } else { 0 };
        match established {
            Ok(Some(chain)) => {
                let mut value = MarkerChain { gen, seq_base: chain.seq_base, len: chain.addrs.len().min(MARKER_POSITIONS) as u32, ..Default::default() };
                for (slot, addr) in value.addrs.iter_mut().zip(&chain.addrs) {
                    *slot = *addr;
                }
                thread.chains.truncate(CHAINS_KEPT - 1);
                thread.chains.push_front(chain);
                stats.markers_established += 1;
                if let Err(err) = sampler.set_marker_chain(record.tid, &value) {
                    log::debug!("tid {}: {err}", record.tid);
                }
                true
            }
            Ok(None) => {
                stats.marker_races += 1;
                false
            }
            Err(err) => {
                log::debug!("pid {} tid {}: marker not established: {err}", self.py.pid(), record.tid);
                stats.marker_races += 1;
                false
            }
        }
    }

    /// The protocol in the module comment. `Ok(None)`: the thread moved while it was read.
    fn establish(&mut self, tid: u32, tstate: u64, gen: u64, frames: &mut FrameTable) -> Result<Option<EstablishedChain>, PyError> {
        let before = self.py.read_marker_state(tstate)?;
        if before.current_frame == 0 {
            return Ok(None);
        }
        // The previous chain's marker, if it sits where its frames' returns put it: its tail is proven.
        let anchor = self.threads.get(&tid).and_then(|t| t.chains.front()).and_then(|chain| {
            let position = usize::try_from(before.seq.wrapping_sub(chain.seq_base)).ok()?;
            (chain.addrs.get(position) == Some(&before.marker)).then(|| (chain.addrs[position + 1..].to_vec(), chain.items[position + 1..].to_vec()))
        });
        let anchor_addr = anchor.as_ref().map(|_| before.marker);
        // Read once before writing: a thread whose frames cannot be read (damaged or hostile
        // memory) never gets a write. The reads after the write are what prove the chain.
        self.check_chain(before.current_frame, anchor_addr)?;
        self.py.set_last_profiled_frame(tstate, before.current_frame)?;
        let mut addrs = Vec::new();
        let mut items = Vec::new();
        let mut addr = before.current_frame;
        let mut joined = None;
        let mut anchor = anchor;
        while addr != 0 {
            if addrs.len() >= MAX_PY_FRAMES || addrs.contains(&addr) {
                return Ok(None);
            }
            let link = self.py.read_link(addr)?;
            let version = if link.kind.runs_code() { self.py.code_version(link.code)? } else { 0 };
            addrs.push(addr);
            items.push(self.resolve_link(&link, version, frames)?);
            if Some(addr) == anchor_addr {
                joined = anchor.take();
                break;
            }
            addr = link.previous;
        }
        let after = self.py.read_marker_state(tstate)?;
        if after.seq != before.seq || after.marker != before.current_frame {
            return Ok(None);
        }
        if let Some((tail_addrs, tail_items)) = joined {
            addrs.extend(tail_addrs);
            items.extend(tail_items);
        }
        Ok(Some(EstablishedChain { gen, seq_base: before.seq, addrs, items }))
    }

    /// Errs unless the chain from `addr` reads to its root (or to `stop_at`) within the walk's depth.
    fn check_chain(&mut self, mut addr: u64, stop_at: Option<u64>) -> Result<(), PyError> {
        let mut walked = 0;
        while addr != 0 && Some(addr) != stop_at {
            if walked >= MAX_PY_FRAMES {
                return Err(PyError::Chain(format!("longer than {MAX_PY_FRAMES} frames, or looping")));
            }
            addr = self.py.read_link(addr)?.previous;
            walked += 1;
        }
        Ok(())
    }

    /// A sample of a thread the eBPF program does not know: a thread started since the last read
    /// of the thread list, or one that runs no Python (remembered, so it costs no more reads).
    fn unknown_thread_sampled(&mut self, tid: u32, sampler: &mut Sampler) {
        if self.threads.contains_key(&tid) || self.not_python.contains(&tid) || self.threads_read.elapsed() < UNKNOWN_THREAD_REFRESH {
            return;
        }
        self.refresh_threads(sampler);
        // An empty list is an interpreter still starting up: its main thread is not bound yet.
        if !self.threads.contains_key(&tid) && !self.threads.is_empty() {
            // Native threads that come and go would otherwise pile up here for the process's life.
            if self.not_python.len() >= MAX_NOT_PYTHON_THREADS {
                self.not_python.clear();
            }
            self.not_python.insert(tid);
        }
    }

    /// Registers new threads and drops dead ones; false when the process is gone.
    fn refresh_threads(&mut self, sampler: &mut Sampler) -> bool {
        self.threads_read = Instant::now();
        let Ok(threads) = self.py.threads() else {
            return std::path::Path::new(&format!("/proc/{}", self.py.pid())).exists();
        };
        let live: HashSet<u32> = threads.iter().map(|t| t.tid).collect();
        if live.len() != self.threads.len() || !live.iter().all(|tid| self.threads.contains_key(tid)) {
            // A thread that ran no Python may run it now.
            self.not_python.clear();
        }
        self.threads.retain(|tid, _| {
            let keep = live.contains(tid);
            if !keep {
                sampler.remove_py_thread(*tid);
            }
            keep
        });
        // Threads may switch interpreters between these reads: the eBPF program then looks up the
        // thread state attached at each sample (where thread states say which one is: 3.12+).
        if self.py.has_subinterpreters() && self.config.tstate_status != NO_OFFSET && self.config.flags & py_proc_flags::FIND_ATTACHED == 0 {
            self.config.flags |= py_proc_flags::FIND_ATTACHED;
            if sampler.set_py_process(self.py.pid(), &self.config).is_err() {
                self.config.flags &= !py_proc_flags::FIND_ATTACHED;
            }
        }
        for thread in threads {
            let known = self.threads.get(&thread.tid).is_some_and(|t| t.tstate == thread.tstate);
            let entry = PyThreadEntry { tstate: thread.tstate, ns_tid: thread.ns_tid, _pad: 0 };
            if !known && sampler.set_py_thread(thread.tid, &entry).is_ok() {
                sampler.remove_marker_chain(thread.tid);
                self.threads.insert(thread.tid, Thread { tstate: thread.tstate, chains: VecDeque::new(), established_at: None, establish_failures: 0 });
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_ids_stay_within_their_own_bound_and_the_total() {
        static TOTAL: SharedBudget = SharedBudget::new(5);
        let bounded = || FrameIds { ids: hashbrown::HashMap::new(), max: 3, total: &TOTAL };
        let (mut first, mut second) = (bounded(), bounded());
        for code in 0..4 {
            first.insert((code, 1, 0), None);
        }
        // The fourth went past the process's bound: the first three were forgotten.
        assert_eq!((first.ids.len(), TOTAL.used()), (1, 1));
        first.insert((1, 1, 0), None);
        first.insert((2, 1, 0), None);
        second.insert((7, 1, 0), None);
        second.insert((8, 1, 0), None);
        assert_eq!(TOTAL.used(), 5);
        // At the total, the process inserting forgets its own; the other keeps what it has.
        second.insert((9, 1, 0), None);
        assert_eq!((first.ids.len(), second.ids.len(), TOTAL.used()), (3, 1, 4));
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
        assert_eq!((stacks[0].0.len(), stacks[0].1), (2 * MAX_TASKS, true));
        assert_eq!(stacks[11], (vec![12, 112], false));
    }
}
