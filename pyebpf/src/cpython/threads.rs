//! The thread states of every interpreter of a process, which one each thread runs now, and which
//! one holds the GIL.
//!
//! A thread has a thread state in every interpreter it has entered: one that runs code in a
//! subinterpreter (`concurrent.interpreters`, `_interpreters`) keeps its main-interpreter state,
//! parked at the call that switched, beside the subinterpreter's, which runs.

use std::collections::HashSet;

use super::memory::{ReadExt, ReadMemory};
use super::{PyError, PyProcess};

/// Most interpreters and threads followed per process.
const MAX_INTERPRETERS: usize = 64;
const MAX_THREADS: usize = 4096;

/// `_status.active` (the fifth bit field of `PyThreadState._status` in 3.12 to 3.15; earlier versions have no `_status`): the thread
/// state is attached to its thread now. Running Python code needs an attached thread state.
pub(super) const STATUS_ACTIVE: u32 = 1 << 4;

/// A Python thread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PyThread {
    /// The kernel's thread id, as the host names it.
    pub tid: u32,
    /// Its id in its process's PID namespace (`native_thread_id`), as its thread states name it.
    pub ns_tid: u32,
    /// Address of its `PyThreadState`.
    pub tstate: u64,
    /// Its innermost interpreter frame, 0 when it runs no Python code.
    pub current_frame: u64,
    pub holds_gil: bool,
    /// The id of its interpreter (0: the main interpreter).
    pub interpreter: i64,
    /// Attached to its thread now: the thread runs in this thread state's interpreter (in a
    /// free-threaded build, attached is what lets a thread run Python code in parallel).
    pub active: bool,
}

impl<M: ReadMemory> PyProcess<M> {
    /// Every thread, each in the thread state it runs now: the attached one where a thread has
    /// several. Also refreshes the code-object cache when the process says code objects may have
    /// been freed.
    pub fn threads(&mut self) -> Result<Vec<PyThread>, PyError> {
        Ok(current_states(self.thread_states()?))
    }

    /// Every thread state of every interpreter: a thread that entered several interpreters is
    /// listed once in each. Also refreshes the code-object cache like [`Self::threads`].
    pub fn thread_states(&mut self) -> Result<Vec<PyThread>, PyError> {
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
            } else {
                self.subinterpreters = true;
            }
            self.interpreter_threads(interp, &mut seen, &mut threads)?;
            interp = self.mem.read_u64(interp.wrapping_add(self.offsets.interp_next))?;
        }
        self.translate_to_host_tids(&mut threads);
        Ok(threads)
    }

    /// `native_thread_id` is the id in the process's own PID namespace; the kernel (and the eBPF
    /// program) name threads by the host's ids. Threads with no host id (exited) are dropped.
    fn translate_to_host_tids(&mut self, threads: &mut Vec<PyThread>) {
        if self.shares_pid_namespace.is_none() {
            self.shares_pid_namespace = crate::process::shares_pid_namespace(self.pid);
        }
        if self.shares_pid_namespace != Some(false) {
            return;
        }
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

    /// The innermost frame `tstate` runs now (`frame` before 3.11; 3.11 and 3.12: through its `_PyCFrame`, which is 0
    /// while the thread is not running Python).
    pub fn current_frame(&self, tstate: u64) -> Result<u64, PyError> {
        let holder = match self.offsets.tstate_cframe {
            Some(cframe) => match self.mem.read_u64(tstate.wrapping_add(cframe))? {
                0 => return Ok(0),
                cframe => cframe,
            },
            None => tstate,
        };
        Ok(self.mem.read_u64(holder.wrapping_add(self.offsets.tstate_current_frame))?)
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
        let interpreter = self.mem.read_u64(interp.wrapping_add(o.interp_id))? as i64;
        let mut tstate = self.mem.read_u64(interp.wrapping_add(o.interp_threads_head))?;
        while tstate != 0 {
            // Thread states skipped (not started) count too: `seen` holds every one visited.
            if seen.len() >= MAX_THREADS + MAX_INTERPRETERS || !seen.insert(tstate) {
                return Err(PyError::Malformed("thread list too long or looping".into()));
            }
            let Some(tid) = self.thread_id(tstate)? else {
                tstate = self.mem.read_u64(tstate.wrapping_add(o.tstate_next))?;
                continue;
            };
            threads.push(PyThread {
                tid,
                ns_tid: tid,
                tstate,
                current_frame: self.current_frame(tstate)?,
                holds_gil: gil_holder == Some(tstate),
                interpreter,
                // Before 3.12 thread states do not say: they are taken as attached.
                active: match o.tstate_status {
                    Some(status) => self.mem.read_u32(tstate.wrapping_add(status))? & STATUS_ACTIVE != 0,
                    None => true,
                },
            });
            tstate = self.mem.read_u64(tstate.wrapping_add(o.tstate_next))?;
        }
        Ok(())
    }

    /// The id of the thread `tstate` belongs to, in the process's PID namespace: its
    /// `native_thread_id`, or before 3.11 the id in the C library's descriptor of its `pthread_t`;
    /// `None` for a thread state made for a thread that has not started yet (no `pthread_t`).
    fn thread_id(&self, tstate: u64) -> Result<Option<u32>, PyError> {
        let o = &self.offsets;
        let id = self.mem.read_u64(tstate.wrapping_add(o.tstate_native_thread_id))?;
        let tid = match o.pthread_tid {
            Some(_) if id == 0 => return Ok(None),
            Some(at) => u64::from(self.mem.read_u32(id.wrapping_add(at))?),
            None => id,
        };
        // 0 until the new thread binds its state (it is listed from its creation in the parent).
        if tid == 0 {
            return Ok(None);
        }
        u32::try_from(tid).map(Some).map_err(|_| PyError::Malformed(format!("native thread id {tid}")))
    }

    /// The thread state holding the GIL `interp` runs under, if it is held. `last_holder` stays set
    /// after a release, so it counts only while `locked` is set. Before 3.12 the runtime clears its pointer to the
    /// holder on release.
    fn gil_holder(&self, interp: u64) -> Result<Option<u64>, PyError> {
        if self.offsets.free_threaded {
            // The structure is there, but nothing takes it: whatever `last_holder` says is stale.
            return Ok(None);
        }
        if let Some(holder) = self.offsets.runtime_gil_holder {
            let holder = self.mem.read_u64(self.runtime.wrapping_add(holder))?;
            return Ok((holder != 0).then_some(holder));
        }
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

/// One thread state per thread, in list order: the active one, or where none (or, in a corrupt
/// list, several) is, the first listed. Interpreters are listed newest first, and a thread state
/// made to run code in a subinterpreter lives only while its thread is in there, so the first is
/// the innermost.
pub(super) fn current_states(states: Vec<PyThread>) -> Vec<PyThread> {
    let mut chosen: Vec<PyThread> = Vec::with_capacity(states.len());
    for state in states {
        match chosen.iter_mut().find(|kept| kept.tid == state.tid) {
            Some(kept) if state.active && !kept.active => *kept = state,
            Some(_) => {}
            None => chosen.push(state),
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(tid: u32, tstate: u64, interpreter: i64, active: bool) -> PyThread {
        PyThread { tid, ns_tid: tid, tstate, current_frame: 1, holds_gil: false, interpreter, active }
    }

    #[test]
    fn each_thread_keeps_the_state_it_runs_in() {
        // Newest interpreter first, as CPython lists them: thread 1 runs in interpreter 2 (which it
        // entered from interpreter 0), thread 3 in interpreter 0, thread 4 is detached in both.
        let states = vec![state(1, 0x10, 2, true), state(4, 0x40, 2, false), state(1, 0x11, 0, false), state(3, 0x30, 0, true), state(4, 0x41, 0, false)];
        let tstates: Vec<(u32, u64)> = current_states(states).iter().map(|t| (t.tid, t.tstate)).collect();
        assert_eq!(tstates, [(1, 0x10), (4, 0x40), (3, 0x30)]);
        // The active state wins wherever it is listed.
        let later = vec![state(1, 0x10, 2, false), state(1, 0x11, 0, true)];
        assert_eq!(current_states(later)[0].tstate, 0x11);
    }
}
