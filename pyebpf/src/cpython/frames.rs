//! Interpreter frames: reading one frame at a time (so a caller can stop at a frame it already
//! knows), resolving a frame to its function and location, and bounded walks of whole chains.

use crate::chain::{walk_chain, CacheMode, Capture, ChainError, FrameLink, LinkKind, LinkReader};
use crate::stack::PythonFrame;

use super::code::Location;
use super::memory::{field_u64, ReadExt, ReadMemory};
use super::{PyError, PyProcess};

/// Most frames followed in one chain.
pub const MAX_DEPTH: usize = 4096;

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
        (o.frame_previous.max(o.frame_executable).max(o.frame_instr_ptr).max(o.frame_owner) + 8) as usize
    }

    fn link_from(&self, addr: u64, buf: &[u8]) -> FrameLink {
        let o = &self.offsets;
        let owner = usize::try_from(o.frame_owner).ok().and_then(|at| buf.get(at)).copied().unwrap_or(0);
        FrameLink {
            addr,
            previous: field_u64(buf, o.frame_previous),
            code: field_u64(buf, o.frame_executable) & !o.executable_tag_mask,
            instr_ptr: field_u64(buf, o.frame_instr_ptr),
            kind: if owner >= o.entry_owner_min { LinkKind::Entry } else { LinkKind::Code },
        }
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
        if link.kind != LinkKind::Code {
            return Ok(None);
        }
        let info = self.code(link.code)?;
        if info.is_interpreter_shim(link.instr_ptr) {
            return Ok(None);
        }
        let location = info.location_for(link.instr_ptr).unwrap_or_default();
        let frame = PythonFrame {
            qualname: info.qualname.clone(),
            filename: info.filename.clone(),
            first_line: info.first_line,
            line: location.line.unwrap_or(0),
        };
        Ok(Some(ResolvedFrame { frame, location }))
    }

    /// The frame chain from `frame`, innermost first, entry frames included; at most `MAX_DEPTH`
    /// frames, and a chain that loops is an error.
    pub fn walk_frames(&mut self, frame: u64) -> Result<Vec<FrameLink>, PyError> {
        let capture = Capture { frame, ..Capture::default() };
        match walk_chain(self, &capture, None, CacheMode::Off, MAX_DEPTH) {
            Ok(walk) => Ok(walk.links),
            Err(ChainError::Read(err)) => Err(err),
            Err(shape) => Err(PyError::Chain(shape.to_string())),
        }
    }
}

impl<M: ReadMemory> LinkReader for PyProcess<M> {
    type Error = PyError;

    fn read_link(&mut self, addr: u64) -> Result<FrameLink, PyError> {
        let buf = self.mem.read_vec(addr, self.frame_read_len())?;
        Ok(self.link_from(addr, &buf))
    }

    fn read_links(&mut self, addrs: &[u64]) -> Result<Vec<FrameLink>, PyError> {
        let len = self.frame_read_len();
        let mut buffers = vec![vec![0u8; len]; addrs.len()];
        let mut requests: Vec<(u64, &mut [u8])> = addrs.iter().copied().zip(buffers.iter_mut().map(Vec::as_mut_slice)).collect();
        let filled = self.mem.read_many(&mut requests);
        Ok(addrs.iter().zip(&buffers).take(filled).map(|(&addr, buf)| self.link_from(addr, buf)).collect())
    }
}
