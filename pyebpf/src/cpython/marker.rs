//! CPython 3.15's `last_profiled_frame` marker: a profiler points it at a frame, and when that
//! frame returns the interpreter moves it to the parent and bumps `last_profiled_frame_seq`, so a
//! profiler knows which frames have not run since it looked.
//!
//! Writing the marker is the only write pyebpf makes to another process, and it is made only where
//! it cannot land on freed memory: into a thread state that lies inside `_PyRuntime` itself (the
//! main interpreter's initial thread, static storage that lives as long as the image), of a
//! CPython whose exact version and flavour were tested, after the debug-offsets cookie was read again in the
//! same batch as the marker. Threads whose states live on the heap get no marker: a thread state is
//! freed before its thread exits, so any list of them may already name freed memory.

use super::memory::{ReadMemory, WriteMemory};
use super::{PyError, PyProcess};

/// Debug-offsets versions the marker write was tested against (3.15.2 final, GIL build).
const MARKER_WRITE_VERSIONS: &[u64] = &[0x030f_02f0];

const COOKIE: &[u8; 8] = b"xdebugpy";

/// A thread state's marker fields and the frame it runs, read in one batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MarkerState {
    pub current_frame: u64,
    pub marker: u64,
    pub seq: u64,
}

impl<M: ReadMemory> PyProcess<M> {
    /// Whether pyebpf may write the marker of `tstate` (see the module comment).
    pub fn marker_writable(&self, tstate: u64) -> bool {
        let o = &self.offsets;
        let Some(frame_field) = o.tstate_last_profiled_frame else { return false };
        // A free-threaded build shares the version number but not the marker's tested behaviour.
        MARKER_WRITE_VERSIONS.contains(&o.version.0)
            && !o.free_threaded
            && tstate >= self.runtime
            && tstate.wrapping_add(frame_field).wrapping_add(8) <= self.runtime.wrapping_add(o.runtime_size)
            && tstate.checked_add(o.tstate_size).is_some()
    }

    /// `current_frame`, the marker and its sequence number of `tstate`, with the debug cookie
    /// checked in the same read (the image is still the one attached to).
    pub fn read_marker_state(&self, tstate: u64) -> Result<MarkerState, PyError> {
        let o = &self.offsets;
        let (Some(marker), Some(seq)) = (o.tstate_last_profiled_frame, o.tstate_last_profiled_seq) else {
            return Err(PyError::WriteRefused(format!("CPython {} has no last_profiled_frame", o.version)));
        };
        let mut cookie = [0u8; 16];
        let mut fields = [[0u8; 8]; 3];
        let [current, marker_buf, seq_buf] = &mut fields;
        let mut requests: Vec<(u64, &mut [u8])> = vec![
            (self.runtime, &mut cookie),
            (tstate.wrapping_add(o.tstate_current_frame), current),
            (tstate.wrapping_add(marker), marker_buf),
            (tstate.wrapping_add(seq), seq_buf),
        ];
        let wanted = requests.len();
        if self.mem.read_many(&mut requests) != wanted {
            return Err(PyError::Malformed(format!("thread state {tstate:#x} unreadable")));
        }
        if &cookie[..8] != COOKIE || u64::from_le_bytes(cookie[8..].try_into().unwrap()) != o.version.0 {
            return Err(PyError::WriteRefused("the debug offsets changed: the process exec'd".into()));
        }
        Ok(MarkerState { current_frame: u64::from_le_bytes(fields[0]), marker: u64::from_le_bytes(fields[1]), seq: u64::from_le_bytes(fields[2]) })
    }
}

impl<M: ReadMemory + WriteMemory> PyProcess<M> {
    /// Points the marker of `tstate` at `frame`, re-checking just before that the write is allowed
    /// and the image unchanged. Refused unless [`Self::marker_writable`] and frames of this process
    /// were decoded (so its table is not a look-alike) and none was malformed (corrupt memory).
    pub fn set_last_profiled_frame(&self, tstate: u64, frame: u64) -> Result<(), PyError> {
        if !self.marker_writable(tstate) {
            return Err(PyError::WriteRefused(format!("{tstate:#x} is not a static thread state of a tested CPython 3.15")));
        }
        if !self.decoded_frames() {
            return Err(PyError::WriteRefused("no frame of this process was decoded yet".into()));
        }
        if self.seen_malformed() {
            return Err(PyError::WriteRefused("a code object of this process was malformed".into()));
        }
        self.read_marker_state(tstate)?;
        let offset = self.offsets.tstate_last_profiled_frame.expect("checked by marker_writable");
        Ok(self.mem.write_u64(tstate.wrapping_add(offset), frame)?)
    }
}
