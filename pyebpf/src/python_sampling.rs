//! Python-aware sampling: tells the eBPF program which threads are Python threads and where their
//! thread states are, and turns each sample's captured frame pointer into a Python stack.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use pyebpf_common::{py_status, SampleRecord};

use crate::bpf::Sampler;
use crate::chain::{walk_chain, CacheMode, CachedChain, Capture, LinkKind, Marker, Walk};
use crate::merge::PyStackItem;
use crate::cpython::memory::ProcessMemory;
use crate::cpython::PyProcess;
use crate::stats::Stats;

/// Frames followed at most per chain; a deeper chain is an error for that sample.
const MAX_CHAIN_DEPTH: usize = 4096;
/// How often thread lists are re-read to register new threads and drop dead ones.
const THREAD_REFRESH: Duration = Duration::from_millis(500);
/// A sample from an unregistered thread re-reads its process's threads at most this often.
const UNKNOWN_THREAD_REFRESH: Duration = Duration::from_millis(20);

struct Thread {
    tstate: u64,
    chain: Option<CachedChain>,
}

struct PythonProcess {
    py: PyProcess<ProcessMemory>,
    threads: HashMap<u32, Thread>,
    threads_read: Instant,
    mode: CacheMode,
}

/// The Python side of a sample.
pub struct PythonStack {
    pub items: Vec<PyStackItem>,
    pub moved: bool,
}

pub struct PythonSampling {
    processes: HashMap<u32, PythonProcess>,
    /// Processes found not to be CPython 3.13+ (or unreadable); not tried again.
    others: HashSet<u32>,
    caching: bool,
}

impl PythonSampling {
    pub fn new(caching: bool) -> Self {
        PythonSampling { processes: HashMap::new(), others: HashSet::new(), caching }
    }

    /// Attaches to `pid` if it is a CPython 3.13+ process not seen before, and registers its
    /// threads with the eBPF program.
    pub fn discover(&mut self, pid: u32, sampler: &mut Sampler, stats: &mut Stats) {
        if self.attach(pid, stats) {
            self.register(pid, sampler);
        }
    }

    /// Attaches to processes before sampling starts (reading their ELF files takes time), so
    /// that their first samples already have Python frames; [`Self::register_all`] then tells
    /// the eBPF program.
    pub fn attach_all(&mut self, pids: impl IntoIterator<Item = u32>, stats: &mut Stats) {
        for pid in pids {
            self.attach(pid, stats);
        }
    }

    pub fn register_all(&mut self, sampler: &mut Sampler) {
        let pids: Vec<u32> = self.processes.keys().copied().collect();
        for pid in pids {
            self.register(pid, sampler);
        }
    }

    /// True when `pid` was newly attached.
    fn attach(&mut self, pid: u32, stats: &mut Stats) -> bool {
        if self.processes.contains_key(&pid) || self.others.contains(&pid) {
            return false;
        }
        let py = match PyProcess::attach(pid) {
            Ok(py) => py,
            Err(err) => {
                log::debug!("pid {pid}: not profiled as Python: {err}");
                self.others.insert(pid);
                return false;
            }
        };
        let has_marker = py.bpf_config().tstate_last_profiled_frame != pyebpf_common::NO_OFFSET;
        let mode = match (self.caching, has_marker) {
            (false, _) => CacheMode::Off,
            (true, true) => CacheMode::Marker,
            (true, false) => CacheMode::AddressBatch,
        };
        stats.python_processes += 1;
        self.processes.insert(pid, PythonProcess { py, threads: HashMap::new(), threads_read: Instant::now(), mode });
        true
    }

    fn register(&mut self, pid: u32, sampler: &mut Sampler) {
        let Some(process) = self.processes.get_mut(&pid) else { return };
        if sampler.set_py_process(pid, &process.py.bpf_config()).is_err() {
            self.processes.remove(&pid);
            self.others.insert(pid);
            return;
        }
        process.refresh_threads(sampler);
        if process.mode == CacheMode::Marker {
            // A marker left by an earlier profiler points at frames pyebpf never saw.
            for thread in process.threads.values() {
                let _ = process.py.set_last_profiled_frame(thread.tstate, 0);
            }
        }
    }

    /// Re-reads thread lists now and then; forgets processes that have exited.
    pub fn upkeep(&mut self, sampler: &mut Sampler) {
        let mut exited = Vec::new();
        for (&pid, process) in &mut self.processes {
            if process.threads_read.elapsed() >= THREAD_REFRESH && !process.refresh_threads(sampler) {
                exited.push(pid);
            }
        }
        for pid in exited {
            if let Some(process) = self.processes.remove(&pid) {
                for tid in process.threads.keys() {
                    sampler.remove_py_thread(*tid);
                }
            }
            sampler.remove_py_process(pid);
        }
    }

    /// The Python stack of a sample, if it is one of a Python thread.
    pub fn python_stack(&mut self, record: &SampleRecord, sampler: &mut Sampler, stats: &mut Stats) -> Option<PythonStack> {
        let process = self.processes.get_mut(&record.tgid)?;
        let py = &record.py;
        if py.status & py_status::THREAD_KNOWN == 0 {
            if process.threads_read.elapsed() >= UNKNOWN_THREAD_REFRESH && !process.threads.contains_key(&record.tid) {
                process.refresh_threads(sampler);
            }
            return None;
        }
        if py.status & py_status::FRAME_READ == 0 || py.frame == 0 {
            return None;
        }
        let thread = process.threads.get_mut(&record.tid)?;
        let capture = Capture {
            frame: py.frame,
            leaf_code: if py.status & py_status::LEAF_READ != 0 { py.code } else { 0 },
            leaf_instr_ptr: py.instr_ptr,
            marker: (py.status & py_status::MARKER_READ != 0)
                .then_some(Marker { frame: py.last_profiled_frame, seq: py.last_profiled_seq }),
        };
        let before = process.py.remote_counters();
        let walk = walk_chain(&mut process.py, &capture, thread.chain.as_ref(), process.mode, MAX_CHAIN_DEPTH);
        let result = match walk {
            Ok(walk) => {
                stats.count_walk(&walk);
                let items = resolve_links(&mut process.py, &walk);
                if process.mode != CacheMode::Off {
                    if process.mode == CacheMode::Marker {
                        let _ = process.py.set_last_profiled_frame(thread.tstate, capture.frame);
                    }
                    thread.chain = Some(CachedChain::new(walk.links, capture.marker.map_or(0, |m| m.seq)));
                }
                Some(PythonStack { items, moved: walk.moved })
            }
            Err(err) => {
                log::debug!("pid {} tid {}: {err}", record.tgid, record.tid);
                stats.chain_errors += 1;
                thread.chain = None;
                None
            }
        };
        let after = process.py.remote_counters();
        stats.remote_reads += after.reads - before.reads;
        stats.remote_bytes += after.bytes - before.bytes;
        if result.is_some() {
            stats.python_samples += 1;
        }
        result
    }

    /// Code-object cache counters summed over processes, for `--stats`.
    pub fn code_cache_counters(&self) -> crate::cpython::CodeCacheCounters {
        self.processes.values().map(|p| p.py.code_cache_counters()).sum()
    }
}

impl PythonProcess {
    /// Registers new threads and drops dead ones; false when the process is gone.
    fn refresh_threads(&mut self, sampler: &mut Sampler) -> bool {
        self.threads_read = Instant::now();
        let Ok(threads) = self.py.threads() else {
            return std::path::Path::new(&format!("/proc/{}", self.py.pid())).exists();
        };
        let live: HashSet<u32> = threads.iter().map(|t| t.tid).collect();
        self.threads.retain(|tid, _| {
            let keep = live.contains(tid);
            if !keep {
                sampler.remove_py_thread(*tid);
            }
            keep
        });
        for thread in threads {
            let known = self.threads.get(&thread.tid).is_some_and(|t| t.tstate == thread.tstate);
            if !known && sampler.set_py_thread(thread.tid, thread.tstate).is_ok() {
                self.threads.insert(thread.tid, Thread { tstate: thread.tstate, chain: None });
            }
        }
        true
    }
}

/// Turns frame links into Python frames and segment ends; links that cannot be decoded are left out.
fn resolve_links(py: &mut PyProcess<ProcessMemory>, walk: &Walk) -> Vec<PyStackItem> {
    walk.links
        .iter()
        .filter_map(|link| match link.kind {
            LinkKind::Entry => Some(PyStackItem::SegmentEnd { entry_frame: link.addr }),
            LinkKind::Internal => None,
            LinkKind::Code => py.frame_info(link).ok().flatten().map(|resolved| PyStackItem::Frame(resolved.frame)),
        })
        .collect()
}
