//! Interpreter frames: reading one frame at a time (so a caller can stop at a frame it already
//! knows), resolving a frame to its function and location, and bounded walks of whole chains.

use std::collections::HashSet;

use pyebpf_common::PyFrameRecord;

use crate::chain::{FrameLink, LinkReader};
use crate::stack::PythonFrame;

use super::code::Location;
use super::memory::{field_u64, ReadExt, ReadMemory};
use super::{PyError, PyProcess};

/// Most frames followed in one chain: a deeper chain gives its innermost `MAX_DEPTH` frames.
pub const MAX_DEPTH: usize = 4096;

/// A thread's frame chain, innermost first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FrameWalk {
    pub links: Vec<FrameLink>,
    /// The chain goes on past `MAX_DEPTH` frames: `links` are only its innermost ones.
    pub truncated: bool,
}

/// A frame resolved to its function and where it is in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedFrame {
    pub frame: PythonFrame,
    pub location: Location,
}

impl<M: ReadMemory> PyProcess<M> {
    /// Bytes of a frame that cover every field read from it.
    fn frame_read_len(&self) -> usize {
        let o = &self.offsets;
        // Offsets were checked against the frame size, itself bounded.
        (o.frame_previous.max(o.frame_executable).max(o.frame_instr_ptr).max(o.frame_owner.unwrap_or(0)).max(o.frame_is_entry.unwrap_or(0)) + 8) as usize
    }

    /// Reads and decodes the frame at `addr` (see [`Self::decode_frame`]).
    fn read_frame(&self, addr: u64) -> Result<(PyFrameRecord, u64), PyError> {
        if !addr.is_multiple_of(8) {
            return Err(PyError::Chain(format!("a frame at the unaligned address {addr:#x}")));
        }
        let buf = self.mem.read_vec(addr, self.frame_read_len())?;
        Ok(self.decode_frame(addr, &buf))
    }

    /// The one decoder of a frame read from the process: its fields as the eBPF program records
    /// them (the code object's identity not read), and the frame before it.
    fn decode_frame(&self, addr: u64, buf: &[u8]) -> (PyFrameRecord, u64) {
        let o = &self.offsets;
        let byte = |at: u64| usize::try_from(at).ok().and_then(|at| buf.get(at)).copied().unwrap_or(0);
        let entry = o.frame_is_entry.is_some_and(|at| byte(at) != 0);
        // Owners fit the low 3 bits of the aligned address, as the eBPF program packs them.
        let owner = o.frame_owner.map_or(0, byte) & 7 | if entry { pyebpf_common::ENTRY_FLAG } else { 0 };
        let record = PyFrameRecord {
            addr_owner: addr | u64::from(owner),
            code: field_u64(buf, o.frame_executable) & !o.executable_tag_mask,
            instr_ptr: field_u64(buf, o.frame_instr_ptr),
            code_version: 0,
            _pad: 0,
        };
        (record, field_u64(buf, o.frame_previous))
    }

    /// A recorded frame (by the eBPF program at a sample, or [`Self::decode_frame`]) as a link of
    /// its chain; `previous` is the frame before it where known, else 0.
    pub fn link_of(&self, frame: &PyFrameRecord, previous: u64) -> FrameLink {
        let o = &self.offsets;
        FrameLink { addr: frame.addr(), previous, code: frame.code, instr_ptr: o.instr_of(frame.instr_ptr), kind: o.link_kind(frame.owner()) }
    }

    /// The Python frame running `code` at `instr_ptr` (an `instr_ptr` captured earlier, by the
    /// kernel for example, works as long as the code object lives).
    pub fn python_frame(&mut self, code: u64, instr_ptr: u64) -> Result<PythonFrame, PyError> {
        let info = self.code(code)?;
        Ok(PythonFrame {
            qualname: info.qualname.clone(),
            filename: info.filename.clone(),
            first_line: info.first_line,
            line: info.line_for(instr_ptr).unwrap_or(0),
        })
    }

    /// What a frame link runs and where: `None` for entry frames and for frames the interpreter
    /// pushes for itself, which Python's own view of the stack leaves out too.
    pub fn frame_info(&mut self, link: &FrameLink) -> Result<Option<ResolvedFrame>, PyError> {
        // A frame without a code object is being set up or torn down: not a Python call yet/any more.
        if !link.kind.runs_code() || link.code == 0 {
            return Ok(None);
        }
        let info = self.code(link.code)?;
        if info.is_interpreter_shim(link.instr_ptr) {
            return Ok(None);
        }
        let location = info.location_for(link.instr_ptr).unwrap_or_default();
        let frame =
            PythonFrame { qualname: info.qualname.clone(), filename: info.filename.clone(), first_line: info.first_line, line: location.line.unwrap_or(0) };
        Ok(Some(ResolvedFrame { frame, location }))
    }

    /// The frame chain from `frame`, innermost first, entry frames included: its innermost
    /// `MAX_DEPTH` frames, marked truncated when it goes on. A chain that loops (within those
    /// frames) is an error.
    pub fn walk_frames(&mut self, frame: u64) -> Result<FrameWalk, PyError> {
        let mut walk = FrameWalk::default();
        let mut seen = HashSet::new();
        let mut addr = frame;
        while addr != 0 {
            if walk.links.len() == MAX_DEPTH {
                walk.truncated = true;
                break;
            }
            if !seen.insert(addr) {
                return Err(PyError::Chain(format!("frame chain loops back to frame {addr:#x}")));
            }
            let link = self.read_link(addr)?;
            addr = link.previous;
            walk.links.push(link);
        }
        Ok(walk)
    }
}

impl<M: ReadMemory> PyProcess<M> {
    /// The chain from `frame` as the eBPF program records it (raw fields, each code object's
    /// identity read now) into `out`, innermost first; returns the frames written and whether the
    /// chain ended within them. For a thread that cannot have run since (off CPU throughout).
    pub fn frame_records(&mut self, frame: u64, out: &mut [PyFrameRecord]) -> Result<(usize, bool), PyError> {
        let mut seen = HashSet::new();
        let mut addr = frame;
        for (written, slot) in out.iter_mut().enumerate() {
            if addr == 0 {
                return Ok((written, true));
            }
            if !seen.insert(addr) {
                return Err(PyError::Chain(format!("frame chain loops back to frame {addr:#x}")));
            }
            let (mut record, previous) = self.read_frame(addr)?;
            if record.code != 0 {
                record.code_version = self.code_version(record.code)?;
            }
            *slot = record;
            addr = previous;
        }
        Ok((out.len(), addr == 0))
    }
}

impl<M: ReadMemory> LinkReader for PyProcess<M> {
    type Error = PyError;

    fn read_link(&mut self, addr: u64) -> Result<FrameLink, PyError> {
        let (record, previous) = self.read_frame(addr)?;
        Ok(self.link_of(&record, previous))
    }
}
