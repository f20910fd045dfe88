//! One profiled CPython process: what the eBPF program was told of it (its layout, its threads),
//! kept in step with the process through its life: register, refresh, forget.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use pyebpf_common::{py_proc_flags, PyProcConfig, PyThreadEntry, NO_OFFSET};

use super::frames::{Memory, Resolver};
use super::marker::Thread;
use super::tasks::Tasks;
use crate::kernel_maps::KernelMaps;
use crate::ktime::monotonic_ns;
use crate::maps::MapsCache;
use crate::process::own_namespace_id;
use crate::stack::FrameCarry;

/// How often thread lists are re-read, a safety net: a new thread is registered when a sample of
/// it finds it unknown, and an exiting thread's registration goes with it in the kernel. What
/// this catches is rarer: a thread state replaced under a live thread, or a thread that exited
/// while its list was being read.
pub(super) const THREAD_REFRESH: Duration = Duration::from_secs(30);
/// A sample from an unregistered thread re-reads its process's threads at most this often.
const UNKNOWN_THREAD_REFRESH: Duration = Duration::from_millis(20);
/// Threads registered per process as running no Python, at most (then forgotten all at once).
const MAX_NOT_PYTHON_THREADS: usize = 4096;

pub(super) struct Process<M> {
    pub(super) resolver: Resolver<M>,
    /// What the eBPF program was told about the process (`PY_PROCS`).
    pub(super) config: PyProcConfig,
    pub(super) threads: HashMap<u32, Thread>,
    pub(super) threads_read: Instant,
    /// Threads sampled while missing from a non-empty interpreter thread list (C threads), and
    /// when each was registered with the eBPF program without a thread state: their samples look
    /// theirs up in the thread lists, so they wake nobody and have Python frames whenever the
    /// thread calls into Python.
    not_python: HashMap<u32, u64>,
    pub(super) tasks: Tasks,
    /// Changes to what a sample's stack is resolved with (its threads, their marker chains):
    /// with the process's serial, its [`super::Pythons::state`].
    pub(super) changes: u64,
    pub(super) serial: u64,
}

impl<M: Memory> Process<M> {
    pub(super) fn new(resolver: Resolver<M>, tasks: Tasks, serial: u64) -> Self {
        Process {
            config: resolver.py.bpf_config(),
            resolver,
            threads: HashMap::new(),
            threads_read: Instant::now(),
            not_python: HashMap::new(),
            tasks,
            changes: 0,
            serial,
        }
    }

    fn pid(&self) -> u32 {
        self.resolver.pid()
    }

    /// Tells the eBPF program about the process and its threads; false when its map is full.
    pub(super) fn register(&mut self, kernel: &mut dyn KernelMaps) -> bool {
        if kernel.set_py_process(self.pid(), &self.config).is_err() {
            return false;
        }
        self.refresh_threads(kernel);
        true
    }

    /// Looks for the asyncio table while pending, telling the eBPF program once found.
    pub(super) fn find_tasks(&mut self, kernel: &mut dyn KernelMaps, maps: &mut MapsCache) -> Result<(), String> {
        if self.tasks.find(&self.resolver, maps, &mut self.config)? && kernel.set_py_process(self.pid(), &self.config).is_err() {
            log::debug!("pid {}: PY_PROCS entry not updated", self.pid());
        }
        Ok(())
    }

    /// Forgets the threads registered with a sampler that is gone.
    pub(super) fn forget_registrations(&mut self) {
        self.changes += 1;
        self.threads.clear();
        self.not_python.clear();
    }

    /// Removes the process and its threads from the eBPF program's maps.
    pub(super) fn unregister(&self, kernel: &mut dyn KernelMaps) {
        for tid in self.threads.keys().chain(self.not_python.keys()) {
            kernel.remove_py_thread(*tid);
        }
        kernel.remove_py_process(self.pid());
    }

    pub(super) fn carry_frames(&mut self, carry: &mut FrameCarry<'_>) {
        self.resolver.carry_frames(carry);
        for thread in self.threads.values_mut() {
            thread.carry_frames(carry);
        }
    }

    /// Forgets every frame id and the chains that hold them.
    pub(super) fn clear_frame_ids(&mut self) {
        self.changes += 1;
        self.resolver.clear_frame_ids();
        for thread in self.threads.values_mut() {
            thread.clear();
        }
    }

    /// A sample of a thread the eBPF program does not know: a thread started since the last read
    /// of the thread list, or one that runs no Python (registered without a thread state).
    pub(super) fn unknown_thread_sampled(&mut self, tid: u32, sampled_ns: u64, kernel: &mut dyn KernelMaps) {
        // Registered before the sample yet unknown at it: that thread exited, taking its entry
        // along, and this is a new thread given its id.
        if self.threads.get(&tid).is_some_and(|thread| thread.registered_ns < sampled_ns) {
            self.threads.remove(&tid);
            self.changes += 1;
        }
        if self.not_python.get(&tid).is_some_and(|&registered_ns| registered_ns < sampled_ns) {
            self.not_python.remove(&tid);
        }
        if self.threads.contains_key(&tid) || self.not_python.contains_key(&tid) || self.threads_read.elapsed() < UNKNOWN_THREAD_REFRESH {
            return;
        }
        self.refresh_threads(kernel);
        // An empty list is an interpreter still starting up: its main thread is not bound yet.
        if !self.threads.contains_key(&tid) && !self.threads.is_empty() {
            self.register_not_python(tid, kernel);
        }
    }

    /// Registers `tid`, which has no thread state now, so its samples stop waking the reader.
    fn register_not_python(&mut self, tid: u32, kernel: &mut dyn KernelMaps) {
        // Native threads that come and go would otherwise pile up here for the process's life
        // (the kernel drops each entry as its thread exits).
        if self.not_python.len() >= MAX_NOT_PYTHON_THREADS {
            self.not_python.clear();
        }
        let entry = PyThreadEntry { tstate: 0, ns_tid: own_namespace_id(self.pid(), Some(tid)).unwrap_or(tid), tgid: self.pid() };
        if kernel.set_py_thread(tid, &entry).is_err() {
            return;
        }
        // A thread sampled as it exited (its state already gone) may have exited since, its exit
        // hook run before this entry was made: the entry would stay. Its task leaves /proc right
        // after the hook, so one gone is removed here (one caught between the two keeps it until
        // its process is forgotten).
        if std::path::Path::new(&format!("/proc/{}/task/{tid}", self.pid())).exists() {
            self.not_python.insert(tid, monotonic_ns());
        } else {
            kernel.remove_py_thread(tid);
        }
    }

    /// Registers new threads, and threads whose state left the lists as running without one (those
    /// gone are dropped); false when the process is gone.
    pub(super) fn refresh_threads(&mut self, kernel: &mut dyn KernelMaps) -> bool {
        self.threads_read = Instant::now();
        let Ok(threads) = self.resolver.py.threads() else {
            return std::path::Path::new(&format!("/proc/{}", self.pid())).exists();
        };
        let live: HashSet<u32> = threads.iter().map(|t| t.tid).collect();
        // A thread that ran no Python and runs it now is registered with its state below.
        self.not_python.retain(|tid, _| !live.contains(tid));
        let left: Vec<u32> = self.threads.keys().filter(|tid| !live.contains(tid)).copied().collect();
        let mut changed = !left.is_empty();
        // A thread whose state left the lists may still run (a C thread between calls into Python,
        // or about to exit): its entry stays, without a state, so the kernel looks up the next one
        // it gets at each sample rather than losing that sample's frames until the next read.
        for tid in left {
            self.threads.remove(&tid);
            kernel.remove_marker_chain(tid);
            self.register_not_python(tid, kernel);
        }
        self.find_attached_states(kernel);
        for thread in threads {
            let known = self.threads.get(&thread.tid).is_some_and(|t| t.tstate == thread.tstate);
            let entry = PyThreadEntry { tstate: thread.tstate, ns_tid: thread.ns_tid, tgid: self.pid() };
            if !known && kernel.set_py_thread(thread.tid, &entry).is_ok() {
                kernel.remove_marker_chain(thread.tid);
                self.threads.insert(thread.tid, Thread::new(thread.tstate, monotonic_ns()));
                changed = true;
            }
        }
        self.changes += u64::from(changed);
        true
    }

    /// Threads may switch interpreters between reads of the thread list: once the process has
    /// subinterpreters, the eBPF program looks up the thread state attached at each sample (where
    /// thread states say which one is: 3.12+).
    fn find_attached_states(&mut self, kernel: &mut dyn KernelMaps) {
        if self.resolver.py.has_subinterpreters() && self.config.tstate_status != NO_OFFSET && self.config.flags & py_proc_flags::FIND_ATTACHED == 0 {
            self.config.flags |= py_proc_flags::FIND_ATTACHED;
            if kernel.set_py_process(self.pid(), &self.config).is_err() {
                self.config.flags &= !py_proc_flags::FIND_ATTACHED;
            }
        }
    }
}
