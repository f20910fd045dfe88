//! Python-aware sampling: tells the eBPF program which threads are Python threads and where their
//! thread states are, and turns the frame chain it walked at each sample into a Python stack.
//!
//! Every frame of a stack comes from the sample itself, or from a marker chain proven unchanged
//! since (3.15, [`marker`]): nothing read later is attributed to a sample. A chain that cannot be
//! completed from those is cut at the first unproven frame and marked truncated.
//!
//! One [`process::Process`] per CPython process, with its lifecycle (attach, register, refresh,
//! forget); its [`frames::Resolver`] owns the code-identity proof, which the marker chains and the
//! asyncio tasks ([`tasks`]) use to resolve their frames. The eBPF program is reached through
//! [`KernelMaps`], so all of this runs in tests without it.

mod frames;
mod marker;
mod process;
mod tasks;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use procfs::process::MMapPath;
use pyebpf_common::{py_proc_flags, py_status, PyCapture, SampleRecord, WaitingTasks, MAX_PY_FRAMES};

pub use frames::{Memory, PyItem};
use process::{Process, THREAD_REFRESH};
pub use tasks::TaskStack;
use tasks::Tasks;

use crate::cpython::memory::{MemCounters, ProcessMemory};
use crate::cpython::{CodeCacheCounters, PyError, PyProcess};
use crate::kernel_maps::KernelMaps;
use crate::maps::{Maps, MapsCache, MapsError};
use crate::stack::{FrameCarry, FrameTable};
use crate::stats::{NamedProcesses, Stats};

/// A process found not to be Python while it may still be in its dynamic loader is checked again
/// this long after (doubling each time), at most [`RECHECKS`] times: right after an exec the loader
/// has not mapped `libpython` yet, and the runtime is not set up yet.
const FIRST_RECHECK: Duration = Duration::from_millis(20);
const RECHECKS: u32 = 7;
/// How often a sample in the code of an interpreter that had not started has it checked again
/// (an embedding program may call into the library long before it starts the interpreter).
const PYTHON_CODE_RECHECK: Duration = Duration::from_secs(1);

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

impl SamplingOptions {
    fn writes_markers(&self) -> bool {
        self.marker && !self.read_only
    }
}

/// What a sample's Python part came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PythonStack {
    /// Not a sample of a known Python thread, or no frame was read: native frames only.
    None,
    /// Every frame proven.
    Whole,
    /// Cut at the first frame that could not be proven (counted in the stats).
    Cut,
}

impl PythonStack {
    pub fn is_python(self) -> bool {
        self != PythonStack::None
    }

    pub fn is_cut(self) -> bool {
        self == PythonStack::Cut
    }
}

/// A process found not to be CPython 3.8+ (or unreadable), until it execs or exits.
struct Other {
    checked_at: Instant,
    checks: u32,
    recheck: Recheck,
}

/// When a process found not to be Python is checked again.
enum Recheck {
    /// It may still be in its dynamic loader: at [`FIRST_RECHECK`], doubling, [`RECHECKS`] times.
    Timed,
    /// It ran code past the dynamic loader with no interpreter mapped, or its timed checks are
    /// over: the libraries it needs were all mapped, none of them Python (or its interpreter did
    /// not start in their time). Only a `dlopen` can map one, and a sample in its code
    /// has the maps re-read ([`MapsCache::explaining`]): checked again when they differ from
    /// these, as often as that happens, and its samples need not come soon. An interpreter
    /// mapped and not started can start only by running its own code, which maps nothing new: a
    /// sample there has it checked again too, at most every [`PYTHON_CODE_RECHECK`].
    OnNewMaps(Arc<Maps>),
    /// What was found cannot change without an exec: an unsupported version, or a kernel thread.
    Never,
}

impl Other {
    /// The maps to check it against, when a check is due: read now while it may be in its loader,
    /// or when the sample's instruction `ip` lies outside the maps checked.
    fn recheck_due(&self, maps: &mut MapsCache, pid: u32, ip: Option<u64>) -> Option<Result<Arc<Maps>, MapsError>> {
        match &self.recheck {
            Recheck::Timed => (self.checks < RECHECKS && self.checked_at.elapsed() >= FIRST_RECHECK * (1 << self.checks))
                .then(|| maps.newer_than(pid, Duration::ZERO).cloned()),
            Recheck::OnNewMaps(checked) => {
                let latest = match ip {
                    Some(ip) => maps.explaining(pid, ip),
                    None => maps.latest(pid),
                };
                if let Some(latest) = latest.filter(|latest| !Arc::ptr_eq(latest, checked)) {
                    return Some(Ok(latest.clone()));
                }
                let in_interpreter = ip.is_some_and(|ip| crate::cpython::runtime::is_python_code(checked, ip));
                (in_interpreter && self.checked_at.elapsed() >= PYTHON_CODE_RECHECK).then(|| maps.newer_than(pid, Duration::ZERO).cloned())
            }
            Recheck::Never => None,
        }
    }

    /// Whether its samples need not come soon: it will not be checked again before its maps change.
    fn classified(&self) -> bool {
        !matches!(self.recheck, Recheck::Timed) || self.checks >= RECHECKS
    }
}

/// Every CPython process profiled, by PID.
pub struct Pythons<M = ProcessMemory> {
    processes: HashMap<u32, Process<M>>,
    /// What the code-object caches of processes forgotten since (exited, exec'd) counted.
    retired_code_cache: CodeCacheCounters,
    others: HashMap<u32, Other>,
    options: SamplingOptions,
    next_gen: u64,
    /// Numbers the processes attached to, so that a process attached again has another state.
    next_serial: u64,
    /// Processes whose tasks cannot be read (`--async-aware`), for the summary.
    unreadable_tasks: NamedProcesses,
}

impl Pythons<ProcessMemory> {
    /// Attaches to `pid` if it is a CPython 3.8+ process not seen before, and registers its
    /// threads with the eBPF program.
    /// `ip`: the user instruction pointer of the sample that found it. True when it was attached now.
    pub fn discover(&mut self, pid: u32, ip: Option<u64>, kernel: &mut dyn KernelMaps, maps: &mut MapsCache, stats: &mut Stats) -> bool {
        let attached = self.attach(pid, ip, maps, stats);
        if attached {
            self.register(pid, kernel, maps);
        }
        attached
    }

    /// Attaches to processes before sampling starts (reading their ELF files takes time), so
    /// that their first samples already have Python frames; [`Self::register_all`] then tells
    /// the eBPF program.
    pub fn attach_all(&mut self, pids: impl IntoIterator<Item = u32>, maps: &mut MapsCache, stats: &mut Stats) {
        for pid in pids {
            self.attach(pid, None, maps, stats);
        }
    }

    /// True when `pid` was newly attached. Its maps are read afresh (a library the loader maps
    /// after an exec must show) into the snapshot the symbolizer and unwinder share.
    fn attach(&mut self, pid: u32, ip: Option<u64>, maps: &mut MapsCache, stats: &mut Stats) -> bool {
        if self.processes.contains_key(&pid) {
            return false;
        }
        let (checks, snapshot, was_loaded) = match self.others.get(&pid) {
            None => (0, maps.newer_than(pid, Duration::ZERO).cloned(), false),
            Some(other) => match other.recheck_due(maps, pid, ip) {
                Some(snapshot) => (other.checks.saturating_add(1), snapshot, matches!(other.recheck, Recheck::OnNewMaps(_))),
                None => return false,
            },
        };
        let snapshot = match snapshot {
            Ok(snapshot) => snapshot,
            Err(err) => {
                if checks == 0 {
                    log::debug!("pid {pid}: not profiled as Python: {}", PyError::from(err));
                }
                self.not_python(pid, checks, Recheck::Timed);
                return false;
            }
        };
        match PyProcess::attach_mapped(pid, &snapshot) {
            Ok(py) if py.fits_frame_window() => {
                self.insert(py, stats);
                true
            }
            Ok(_) => {
                log::debug!("pid {pid}: frame fields beyond the eBPF program's window");
                self.not_python(pid, checks, Recheck::Never);
                false
            }
            Err(err) => {
                // Reported once; later checks (a late libpython) stay quiet.
                if checks == 0 {
                    log::debug!("pid {pid}: not profiled as Python: {err}");
                    if let Some(python) = err.unsupported_python() {
                        stats.unsupported_pythons.add(format!("{python} (pid {pid})"));
                    }
                }
                let python_mapped = crate::cpython::runtime::maps_python_file(&snapshot);
                let (checks, recheck) = if err.unsupported_python().is_some() || matches!(err, PyError::BadOffsets(_)) || is_kernel_thread(&err, &snapshot) {
                    (checks, Recheck::Never)
                } else if was_loaded && python_mapped {
                    // A libpython a late dlopen mapped, its interpreter not started yet: the maps
                    // will not change again, so it has the loader's timed checks from the start.
                    (0, Recheck::Timed)
                } else if was_loaded || checks >= RECHECKS || (!python_mapped && ran_past_loader(&snapshot, ip)) {
                    // Past its loader, or its timed checks are over (every one of them sampled
                    // it in the loader's code, or none told): only a `dlopen` can change it now.
                    (checks, Recheck::OnNewMaps(snapshot))
                } else {
                    (checks, Recheck::Timed)
                };
                self.not_python(pid, checks, recheck);
                false
            }
        }
    }
}

/// A process that has not exited (so not [`PyError::NoProcess`]) with nothing mapped: a kernel
/// thread, which never runs a program of its own.
fn is_kernel_thread(err: &PyError, maps: &Maps) -> bool {
    matches!(err, PyError::NotPython(_)) && maps.mappings().is_empty()
}

/// Whether the instruction pointer lies in a file's code other than the dynamic loader's, or in
/// the vDSO (which the program's code calls, not the loader): the loader maps every library a
/// program needs before any of them runs, so with no interpreter mapped by then, none will be
/// but by a `dlopen`.
fn ran_past_loader(maps: &Maps, ip: Option<u64>) -> bool {
    let Some(mapping) = ip.and_then(|ip| maps.find(ip)).filter(|mapping| mapping.is_executable()) else {
        return false;
    };
    match mapping.file() {
        Some(file) => !file.file_name().and_then(|name| name.to_str()).is_some_and(|name| name.starts_with("ld-") || name.starts_with("ld64")),
        None => mapping.path == MMapPath::Vdso,
    }
}

impl<M: Memory> Pythons<M> {
    pub fn new(options: SamplingOptions) -> Self {
        Pythons {
            processes: HashMap::new(),
            retired_code_cache: Default::default(),
            others: HashMap::new(),
            options,
            next_gen: 1,
            next_serial: 0,
            unreadable_tasks: NamedProcesses::default(),
        }
    }

    /// What `pid`'s samples are resolved with besides the record: 0 while it is not attached to,
    /// then another value each time its threads or their marker chains change.
    pub fn state(&self, pid: u32) -> u64 {
        self.processes.get(&pid).map_or(0, |process| process.serial << 32 ^ process.changes)
    }

    /// Whether `pid` is a CPython 3.8+ process attached to.
    pub fn is_python(&self, pid: u32) -> bool {
        self.processes.contains_key(&pid)
    }

    /// Whether what `pid` is was settled: a CPython attached to, or a process that will not be
    /// checked again before it execs or its maps change. One still checked must have its samples soon.
    pub fn classified(&self, pid: u32) -> bool {
        self.processes.contains_key(&pid) || self.others.get(&pid).is_some_and(Other::classified)
    }

    /// Whether `pid` is a free-threaded CPython attached to: it has no GIL to hold.
    pub fn is_free_threaded(&self, pid: u32) -> bool {
        self.processes.get(&pid).is_some_and(|process| process.resolver.py.offsets().free_threaded)
    }

    /// The CPython version of `pid`, if it is a Python process attached to.
    pub fn version(&self, pid: u32) -> Option<crate::cpython::PyVersion> {
        self.processes.get(&pid).map(|process| process.resolver.py.version())
    }

    /// Keeps a process attached to (not registered yet).
    fn insert(&mut self, py: PyProcess<M>, stats: &mut Stats) {
        let pid = py.pid();
        self.others.remove(&pid);
        stats.python_processes += 1;
        if py.offsets().free_threaded {
            stats.free_threaded.add(format!("{} (pid {pid})", py.python_name()));
        }
        let tasks = match (self.options.async_aware, &py.offsets().objects) {
            (false, _) => Tasks::Off,
            (true, None) => {
                self.unreadable_tasks.add(format!("{} (pid {pid})", py.python_name()));
                Tasks::Off
            }
            (true, Some(_)) => Tasks::Pending { interpreter_searched: false },
        };
        self.next_serial += 1;
        self.processes.insert(pid, Process::new(frames::Resolver::new(py), tasks, self.next_serial));
    }

    fn not_python(&mut self, pid: u32, checks: u32, recheck: Recheck) {
        self.others.insert(pid, Other { checked_at: Instant::now(), checks, recheck });
    }

    pub fn register_all(&mut self, kernel: &mut dyn KernelMaps, maps: &mut MapsCache) {
        let pids: Vec<u32> = self.processes.keys().copied().collect();
        for pid in pids {
            self.register(pid, kernel, maps);
        }
    }

    fn register(&mut self, pid: u32, kernel: &mut dyn KernelMaps, maps: &mut MapsCache) {
        let Some(process) = self.processes.get_mut(&pid) else { return };
        process.config.max_frames = self.options.max_frames.min(MAX_PY_FRAMES as u32);
        if self.options.writes_markers() {
            process.config.flags |= py_proc_flags::USE_MARKER;
        }
        if let Err(problem) = process.tasks.find(&process.resolver, maps, &mut process.config) {
            self.unreadable_tasks.add(problem);
        }
        if !process.register(kernel) {
            log::debug!("pid {pid}: PY_PROCS is full; sampled natively");
            self.processes.remove(&pid);
            self.not_python(pid, RECHECKS, Recheck::Never);
        }
    }

    /// Forgets what was registered with a sampler that is gone (its threads and their marker
    /// chains): [`Self::register_all`] tells the next one afresh.
    pub fn forget_registrations(&mut self) {
        for process in self.processes.values_mut() {
            process.forget_registrations();
        }
    }

    /// Looks for asyncio tables still pending; re-reads thread lists now and then (a safety net:
    /// see [`THREAD_REFRESH`]); forgets processes that have exited.
    pub fn upkeep(&mut self, kernel: &mut dyn KernelMaps, maps: &mut MapsCache) {
        let mut exited = Vec::new();
        for (&pid, process) in &mut self.processes {
            if let Err(problem) = process.find_tasks(kernel, maps) {
                self.unreadable_tasks.add(problem);
            }
            if process.threads_read.elapsed() < THREAD_REFRESH {
                continue;
            }
            if !process.refresh_threads(kernel) {
                exited.push(pid);
            }
        }
        for pid in exited {
            self.forget(pid, kernel);
        }
    }

    /// Whether some process's asyncio table is still looked for.
    pub fn tasks_pending(&self) -> bool {
        self.processes.values().any(|process| process.tasks.pending())
    }

    /// Drops everything known of `pid` (it exited or replaced its program), its eBPF map entries
    /// included; its next sample classifies it afresh.
    pub fn forget(&mut self, pid: u32, kernel: &mut dyn KernelMaps) {
        self.others.remove(&pid);
        if let Some(process) = self.processes.remove(&pid) {
            // Its counts stay in --stats; what its cache holds goes with it.
            let counters = process.resolver.py.code_cache_counters();
            self.retired_code_cache = self.retired_code_cache + CodeCacheCounters { cached_entries: 0, cached_bytes: 0, ..counters };
            process.unregister(kernel);
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
            process.clear_frame_ids();
        }
    }

    /// The Python stack of a sample into `items` (innermost first), if it is one of a Python
    /// thread.
    pub fn python_stack(
        &mut self,
        record: &SampleRecord,
        kernel: &mut dyn KernelMaps,
        stats: &mut Stats,
        frames: &mut FrameTable,
        items: &mut Vec<PyItem>,
    ) -> PythonStack {
        items.clear();
        let Some(process) = self.processes.get_mut(&record.tgid) else { return PythonStack::None };
        if !has_frames(process, record, kernel) {
            return PythonStack::None;
        }
        let before = process.resolver.py.remote_counters();
        let truncated = process_stack(process, record, frames, items, stats);
        stats.truncated_samples += u64::from(truncated);
        stats.python_samples += 1;
        self.next_gen += u64::from(establish_marker(self.options, self.next_gen, process, record, kernel, stats, frames));
        count_reads(process, before, stats);
        if truncated {
            PythonStack::Cut
        } else {
            PythonStack::Whole
        }
    }

    /// What a sample does besides its stack, for a repeat of one resolved before: a thread not
    /// registered yet is looked for, and a marker chain established when due.
    pub fn repeat(&mut self, record: &SampleRecord, kernel: &mut dyn KernelMaps, stats: &mut Stats, frames: &mut FrameTable) {
        let Some(process) = self.processes.get_mut(&record.tgid) else { return };
        if !has_frames(process, record, kernel) {
            return;
        }
        let before = process.resolver.py.remote_counters();
        self.next_gen += u64::from(establish_marker(self.options, self.next_gen, process, record, kernel, stats, frames));
        count_reads(process, before, stats);
    }

    /// The stacks of the waiting tasks of process `pid` the eBPF program read at a capture, into
    /// `stacks` (frame ids innermost first, and whether the task's frames were cut): each task's
    /// coroutine frames under its `[task NAME]` frame, under those of the tasks awaiting it that
    /// the same capture read.
    pub fn waiting_stacks(&mut self, pid: u32, waiting: &WaitingTasks, frames: &mut FrameTable, stacks: &mut Vec<TaskStack>, stats: &mut Stats) {
        stacks.clear();
        if let Some(process) = self.processes.get_mut(&pid) {
            process.tasks.waiting_stacks(&mut process.resolver, waiting, frames, stacks, stats);
        }
    }

    /// The stacks of the waiting tasks of thread `tid` of `tgid`, read now, as the eBPF program
    /// would have at a capture (see [`Self::waiting_stacks`]). Only for a thread that has not run
    /// since it left the CPU, so none of its tasks has (the caller proves that afterwards).
    pub fn read_waiting_stacks(&mut self, tgid: u32, tid: u32, frames: &mut FrameTable, stacks: &mut Vec<TaskStack>, stats: &mut Stats) {
        stacks.clear();
        let Some(process) = self.processes.get_mut(&tgid) else { return };
        if let Some(thread) = process.threads.get(&tid) {
            process.tasks.read_waiting_stacks(&mut process.resolver, thread.tstate, frames, stacks, stats);
        }
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
        let reader = &mut process.resolver.py;
        let Ok(frame) = reader.current_frame(thread.tstate) else { return true };
        py.frame = frame;
        py.status |= py_status::FRAME_READ;
        match reader.frame_records(frame, &mut record.py_frames[..max]) {
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
    pub fn code_cache_counters(&self) -> CodeCacheCounters {
        self.processes.values().map(|p| p.resolver.py.code_cache_counters()).sum::<CodeCacheCounters>() + self.retired_code_cache
    }
}

/// Whether the sample read frames of a registered thread (a thread not registered yet is looked for).
fn has_frames<M: Memory>(process: &mut Process<M>, record: &SampleRecord, kernel: &mut dyn KernelMaps) -> bool {
    let py = &record.py;
    if py.status & py_status::THREAD_KNOWN == 0 {
        process.unknown_thread_sampled(record.tid, record.time_ns, kernel);
        return false;
    }
    py.status & py_status::FRAME_READ != 0 && py.frame != 0
}

/// Establishes a marker chain for the sampled thread when due; true when `gen` was used.
fn establish_marker<M: Memory>(
    options: SamplingOptions,
    gen: u64,
    process: &mut Process<M>,
    record: &SampleRecord,
    kernel: &mut dyn KernelMaps,
    stats: &mut Stats,
    frames: &mut FrameTable,
) -> bool {
    let Some(thread) = process.threads.get_mut(&record.tid).filter(|_| options.writes_markers()) else { return false };
    let established = marker::maybe_establish(&mut process.resolver, thread, record, gen, kernel, stats, frames);
    process.changes += u64::from(established);
    established
}

/// The remote reads made for a sample since `before`, into `stats`.
fn count_reads<M: Memory>(process: &Process<M>, before: MemCounters, stats: &mut Stats) {
    let after = process.resolver.py.remote_counters();
    stats.remote_reads += after.reads - before.reads;
    stats.remote_bytes += after.bytes - before.bytes;
}

/// A sample's stack from the frames the kernel walked and, past them, a marker chain's proven
/// tail, with its asyncio task chain placed; true when cut at an unproven frame.
fn process_stack<M: Memory>(process: &mut Process<M>, record: &SampleRecord, frames: &mut FrameTable, items: &mut Vec<PyItem>, stats: &mut Stats) -> bool {
    let walked = &record.py_frames[..(record.py.frames_len as usize).min(MAX_PY_FRAMES)];
    stats.kernel_frames += walked.len() as u64;
    // Where the running task's coroutine frame ends up in `items`: its tasks go right after.
    let task_frame = process.tasks.running_task_frame(record);
    let mut task_at = None;
    let mut truncated = process.resolver.resolve_walked(walked, task_frame, &mut task_at, frames, items);
    if !truncated {
        truncated = !marker::complete_chain(process.threads.get(&record.tid), record, task_frame, &mut task_at, items, stats);
    }
    if let Some(at) = task_at {
        process.tasks.insert(&mut process.resolver, record, at, frames, items, stats);
    } else if task_frame.is_some() {
        stats.tasks.unplaced += 1;
    }
    truncated
}
