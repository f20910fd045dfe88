//! The thread states of every interpreter of a process, and which one holds the GIL.

use std::collections::HashSet;

use super::memory::{ReadExt, ReadMemory};
use super::{PyError, PyProcess};

/// Most interpreters and threads followed per process.
const MAX_INTERPRETERS: usize = 64;
const MAX_THREADS: usize = 4096;

/// A Python thread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PyThread {
    /// The kernel's thread id (`native_thread_id`).
    pub tid: u32,
    /// Address of its `PyThreadState`.
    pub tstate: u64,
    /// Its innermost interpreter frame, 0 when it runs no Python code.
    pub current_frame: u64,
    pub holds_gil: bool,
}

impl<M: ReadMemory> PyProcess<M> {
    /// Every thread of every interpreter. Also refreshes the code-object cache when the process
    /// says code objects may have been freed.
    pub fn threads(&mut self) -> Result<Vec<PyThread>, PyError> {
        let mut threads = Vec::new();
        let mut seen = HashSet::new();
        let mut interp = self.mem.read_u64(self.runtime.wrapping_add(self.offsets.interpreters_head))?;
        let mut interpreters = 0;
        while interp != 0 {
            interpreters += 1;
            if interpreters > MAX_INTERPRETERS || !seen.insert(interp) {
                return Err(PyError::Malformed("interpreter list too long or looping".into()));
            }
            if interpreters == 1 {
                self.refresh_code_generation(interp)?;
            }
            self.interpreter_threads(interp, &mut seen, &mut threads)?;
            interp = self.mem.read_u64(interp.wrapping_add(self.offsets.interp_next))?;
        }
        self.to_host_tids(&mut threads);
        Ok(threads)
    }

    /// `native_thread_id` is the id in the process's own PID namespace; the kernel (and the eBPF
    /// program) name threads by the host's ids. Threads with no host id (exited) are dropped.
    fn to_host_tids(&self, threads: &mut Vec<PyThread>) {
        if let Some(map) = crate::process::namespace_tids(self.pid) {
            threads.retain_mut(|thread| match map.get(&thread.tid) {
                Some(&host) => {
                    thread.tid = host;
                    true
                }
                None => false,
            });
        }
    }

    /// The innermost frame `tstate` runs now.
    pub fn current_frame(&self, tstate: u64) -> Result<u64, PyError> {
        Ok(self.mem.read_u64(tstate.wrapping_add(self.offsets.tstate_current_frame))?)
    }

    /// The name the kernel gives a thread of this process (`/proc/PID/task/TID/comm`); kept out of
    /// `threads()` so a sampler refreshing its thread list opens no files.
    pub fn thread_name(&self, tid: u32) -> Option<String> {
        let comm = std::fs::read_to_string(format!("/proc/{}/task/{tid}/comm", self.pid)).ok()?;
        Some(comm.trim_end_matches('\n').to_string())
    }

    fn interpreter_threads(&self, interp: u64, seen: &mut HashSet<u64>, threads: &mut Vec<PyThread>) -> Result<(), PyError> {
        let o = &self.offsets;
        let gil_holder = self.gil_holder(interp)?;
        let mut tstate = self.mem.read_u64(interp.wrapping_add(o.interp_threads_head))?;
        while tstate != 0 {
            if threads.len() >= MAX_THREADS || !seen.insert(tstate) {
                return Err(PyError::Malformed("thread list too long or looping".into()));
            }
            let tid = self.mem.read_u64(tstate.wrapping_add(o.tstate_native_thread_id))?;
            threads.push(PyThread {
                tid: u32::try_from(tid).map_err(|_| PyError::Malformed(format!("native thread id {tid}")))?,
                tstate,
                current_frame: self.mem.read_u64(tstate.wrapping_add(o.tstate_current_frame))?,
                holds_gil: gil_holder == Some(tstate),
            });
            tstate = self.mem.read_u64(tstate.wrapping_add(o.tstate_next))?;
        }
        Ok(())
    }

    /// The thread state holding the GIL `interp` runs under, if it is held. `last_holder` stays set
    /// after a release, so it counts only while `locked` is set.
    fn gil_holder(&self, interp: u64) -> Result<Option<u64>, PyError> {
        let gil = self.mem.read_u64(interp.wrapping_add(self.offsets.interp_ceval_gil))?;
        if gil == 0 {
            return Ok(None);
        }
        let locked = self.mem.read_u32(gil.wrapping_add(self.offsets.gil_locked))?;
        let holder = self.mem.read_u64(gil.wrapping_add(self.offsets.gil_holder))?;
        Ok((locked != 0 && holder != 0).then_some(holder))
    }

    /// Code objects may be freed and their addresses reused once the generation moves (3.14+).
    fn refresh_code_generation(&mut self, interp: u64) -> Result<(), PyError> {
        let Some(offset) = self.offsets.code_object_generation else { return Ok(()) };
        let generation = Some(self.mem.read_u64(interp.wrapping_add(offset))?);
        if generation != self.code_generation {
            self.codes.clear();
            self.code_generation = generation;
        }
        Ok(())
    }
}
