//! CPython 3.15's `last_profiled_frame` marker: a profiler points it at the frame it last saw, and
//! the interpreter clears it when that frame returns, so unchanged stack tails need not be re-read.
//! Writing it is the only write pyebpf makes to another process.

use super::memory::{ProcessMemory, ReadExt, ReadMemory};
use super::{PyError, PyProcess};

impl<M: ReadMemory> PyProcess<M> {
    /// The marker of a thread state and its sequence number, for versions that have it.
    pub fn read_last_profiled(&self, tstate: u64) -> Result<Option<(u64, u64)>, PyError> {
        let (Some(frame), Some(seq)) = (self.offsets.tstate_last_profiled_frame, self.offsets.tstate_last_profiled_seq) else {
            return Ok(None);
        };
        Ok(Some((self.mem.read_u64(tstate.wrapping_add(frame))?, self.mem.read_u64(tstate.wrapping_add(seq))?)))
    }
}

impl PyProcess<ProcessMemory> {
    /// Points `last_profiled_frame` of a thread state listed by the last `threads()` at `frame`.
    /// Refused for anything but a CPython 3.15 whose offsets table has the field.
    pub fn set_last_profiled_frame(&self, tstate: u64, frame: u64) -> Result<(), PyError> {
        let version = self.offsets.version;
        let Some(offset) = self.offsets.tstate_last_profiled_frame.filter(|_| version.major() == 3 && version.minor() == 15) else {
            return Err(PyError::WriteRefused(format!("CPython {version} has no last_profiled_frame")));
        };
        if !self.tstates.contains(&tstate) {
            return Err(PyError::WriteRefused(format!("{tstate:#x} is not a thread state listed by threads()")));
        }
        Ok(self.mem.write_u64(tstate.wrapping_add(offset), frame)?)
    }
}
