//! What userspace asks of the loaded eBPF program, as one small trait: the seam between the
//! sample path (`python`, `session`) and the kernel's maps. [`Sampler`] is the real one; tests use
//! `fake::FakeKernel`, which keeps what it was told, so the sample path is tested without eBPF.

use pyebpf_common::{MarkerChain, OffCpuStart, PyProcConfig, PyThreadEntry};

use crate::bpf::{BpfError, Sampler};
use crate::unwind::PageUpdate;

/// The maps through which userspace steers the eBPF program.
pub trait KernelMaps {
    /// Tells the program where `tgid`'s interpreter lives and how it is laid out.
    fn set_py_process(&mut self, tgid: u32, config: &PyProcConfig) -> Result<(), BpfError>;
    fn remove_py_process(&mut self, tgid: u32);
    /// Tells the program where thread `tid` keeps its thread state.
    fn set_py_thread(&mut self, tid: u32, thread: &PyThreadEntry) -> Result<(), BpfError>;
    /// Forgets thread `tid` and its marker chain.
    fn remove_py_thread(&mut self, tid: u32);
    /// The marker chain userspace proved for `tid` (CPython 3.15).
    fn set_marker_chain(&mut self, tid: u32, chain: &MarkerChain) -> Result<(), BpfError>;
    fn remove_marker_chain(&mut self, tid: u32);
    /// Has the program copy `tgid`'s user stacks at its samples, for CFI unwinding.
    fn copy_stacks_of(&mut self, tgid: u32) -> Result<(), BpfError>;
    fn stop_copying_stacks_of(&mut self, tgid: u32);
    /// Has the switch hooks capture the off-CPU intervals of `tgid`'s threads.
    fn watch_waits(&mut self, tgid: u32) -> Result<(), BpfError>;
    fn stop_watching_waits(&mut self, tgid: u32);
    /// Threads of watched processes the switch hook has seen leave the CPU.
    fn watched_threads(&self) -> Vec<(u32, OffCpuStart)>;
    /// Userspace knows `tgid` (or forgot it): whether its samples must reach it soon.
    fn set_known(&mut self, tgid: u32, known: bool);
    /// Sets and withdraws the rules the program unwinds copied processes' stacks by.
    fn update_unwind_pages(&mut self, updates: Vec<PageUpdate>);
}

impl KernelMaps for Sampler {
    fn set_py_process(&mut self, tgid: u32, config: &PyProcConfig) -> Result<(), BpfError> {
        Sampler::set_py_process(self, tgid, config)
    }

    fn remove_py_process(&mut self, tgid: u32) {
        Sampler::remove_py_process(self, tgid)
    }

    fn set_py_thread(&mut self, tid: u32, thread: &PyThreadEntry) -> Result<(), BpfError> {
        Sampler::set_py_thread(self, tid, thread)
    }

    fn remove_py_thread(&mut self, tid: u32) {
        Sampler::remove_py_thread(self, tid)
    }

    fn set_marker_chain(&mut self, tid: u32, chain: &MarkerChain) -> Result<(), BpfError> {
        Sampler::set_marker_chain(self, tid, chain)
    }

    fn remove_marker_chain(&mut self, tid: u32) {
        Sampler::remove_marker_chain(self, tid)
    }

    fn copy_stacks_of(&mut self, tgid: u32) -> Result<(), BpfError> {
        Sampler::copy_stacks_of(self, tgid)
    }

    fn stop_copying_stacks_of(&mut self, tgid: u32) {
        Sampler::stop_copying_stacks_of(self, tgid)
    }

    fn watch_waits(&mut self, tgid: u32) -> Result<(), BpfError> {
        Sampler::watch_waits(self, tgid)
    }

    fn stop_watching_waits(&mut self, tgid: u32) {
        Sampler::stop_watching_waits(self, tgid)
    }

    fn watched_threads(&self) -> Vec<(u32, OffCpuStart)> {
        Sampler::watched_threads(self)
    }

    fn set_known(&mut self, tgid: u32, known: bool) {
        if known {
            Sampler::set_known(self, tgid)
        } else {
            Sampler::forget_known(self, tgid)
        }
    }

    fn update_unwind_pages(&mut self, updates: Vec<PageUpdate>) {
        self.unwind_pages.update(updates);
    }
}

#[cfg(test)]
pub mod fake {
    use std::collections::{HashMap, HashSet};

    use super::*;

    /// The kernel's maps as plain collections: what the sample path told the program.
    #[derive(Default)]
    pub struct FakeKernel {
        pub processes: HashMap<u32, PyProcConfig>,
        pub threads: HashMap<u32, PyThreadEntry>,
        pub markers: HashMap<u32, MarkerChain>,
        pub copying: HashSet<u32>,
        pub watching: HashSet<u32>,
        /// The switch hook's view of watched threads, as a test sets it.
        pub off_cpu: Vec<(u32, OffCpuStart)>,
        /// `PY_PROCS` refuses new entries, as a full map does.
        pub processes_full: bool,
        /// `KNOWN_PROCS`.
        pub known: HashSet<u32>,
        /// `UNWIND_PAGES`, by process and page.
        pub unwind_pages: HashSet<(u32, u64)>,
    }

    impl KernelMaps for FakeKernel {
        fn set_py_process(&mut self, tgid: u32, config: &PyProcConfig) -> Result<(), BpfError> {
            if self.processes_full && !self.processes.contains_key(&tgid) {
                return Err(BpfError::Map { name: pyebpf_common::maps::PY_PROCS, cause: aya::maps::MapError::KeyNotFound });
            }
            self.processes.insert(tgid, *config);
            Ok(())
        }

        fn remove_py_process(&mut self, tgid: u32) {
            self.processes.remove(&tgid);
        }

        fn set_py_thread(&mut self, tid: u32, thread: &PyThreadEntry) -> Result<(), BpfError> {
            self.threads.insert(tid, *thread);
            Ok(())
        }

        fn remove_py_thread(&mut self, tid: u32) {
            self.threads.remove(&tid);
            self.markers.remove(&tid);
        }

        fn set_marker_chain(&mut self, tid: u32, chain: &MarkerChain) -> Result<(), BpfError> {
            self.markers.insert(tid, *chain);
            Ok(())
        }

        fn remove_marker_chain(&mut self, tid: u32) {
            self.markers.remove(&tid);
        }

        fn copy_stacks_of(&mut self, tgid: u32) -> Result<(), BpfError> {
            self.copying.insert(tgid);
            Ok(())
        }

        fn stop_copying_stacks_of(&mut self, tgid: u32) {
            self.copying.remove(&tgid);
        }

        fn watch_waits(&mut self, tgid: u32) -> Result<(), BpfError> {
            self.watching.insert(tgid);
            Ok(())
        }

        fn stop_watching_waits(&mut self, tgid: u32) {
            self.watching.remove(&tgid);
            self.off_cpu.retain(|(_, entry)| entry.tgid != tgid);
        }

        fn watched_threads(&self) -> Vec<(u32, OffCpuStart)> {
            self.off_cpu.clone()
        }

        fn set_known(&mut self, tgid: u32, known: bool) {
            if known {
                self.known.insert(tgid);
            } else {
                self.known.remove(&tgid);
            }
        }

        fn update_unwind_pages(&mut self, updates: Vec<PageUpdate>) {
            for update in updates {
                match update {
                    PageUpdate::Set(key, _) => self.unwind_pages.insert((key.tgid, key.page)),
                    PageUpdate::Remove(key) => self.unwind_pages.remove(&(key.tgid, key.page)),
                };
            }
        }
    }
}
