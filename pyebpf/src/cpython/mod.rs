//! Reading CPython 3.13+ processes from outside, through `process_vm_readv` and the
//! `_Py_DebugOffsets` table: threads, interpreter frame chains and code objects.

mod code;
pub mod dump;
mod linetable;
pub mod memory;
pub mod offsets;
pub mod runtime;
mod strings;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use pyebpf_common::{PyProcConfig, NO_OFFSET};

use crate::chain::{walk_chain, CacheMode, Capture, FrameLink, LinkKind, LinkReader};
use crate::stack::PythonFrame;
pub use code::CodeInfo;
use memory::{field_u64, MemCounters, MemError, ProcessMemory, ReadExt, ReadMemory};
pub use offsets::{DebugOffsets, PyVersion};

/// Most interpreters and threads followed per process.
const MAX_INTERPRETERS: usize = 64;
const MAX_THREADS: usize = 4096;
/// Most frames followed in one chain.
pub const MAX_DEPTH: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum PyError {
    #[error("process {0} does not exist (or has exited)")]
    NoProcess(u32),
    #[error("process {0} is not a CPython process (no python3 executable or libpython3 mapped)")]
    NotPython(u32),
    #[error("no _Py_DebugOffsets in _PyRuntime: CPython older than 3.13?")]
    NoDebugOffsets,
    #[error("CPython {0} is not supported (3.13, 3.14 and 3.15.0b4 or later are)")]
    UnsupportedVersion(PyVersion),
    #[error("free-threaded CPython {0} is not supported")]
    FreeThreaded(PyVersion),
    #[error("implausible _Py_DebugOffsets: {0}")]
    BadOffsets(String),
    #[error("malformed interpreter state: {0}")]
    Malformed(String),
    #[error("refusing to write: {0}")]
    WriteRefused(String),
    #[error(transparent)]
    Memory(#[from] MemError),
    #[error("frame chain: {0}")]
    Chain(String),
}

/// A Python thread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PyThread {
    /// The kernel's thread id.
    pub tid: u32,
    /// Address of its `PyThreadState`.
    pub tstate: u64,
    pub current_frame: u64,
    pub holds_gil: bool,
}

/// An attached CPython process.
pub struct PyProcess<M = ProcessMemory> {
    pid: u32,
    mem: M,
    offsets: DebugOffsets,
    runtime: u64,
    codes: HashMap<u64, Arc<CodeInfo>>,
    code_types: HashSet<u64>,
    code_generation: Option<u64>,
    code_hits: u64,
    code_misses: u64,
    /// Thread states seen in the last `threads()`: the only places a marker may be written.
    tstates: HashSet<u64>,
}

impl PyProcess<ProcessMemory> {
    pub fn attach(pid: u32) -> Result<Self, PyError> {
        let runtime = runtime::find_runtime(pid)?;
        let mem = ProcessMemory::new(pid);
        Self::with_memory(pid, mem, runtime).map_err(|err| match err {
            PyError::Memory(_) if !std::path::Path::new(&format!("/proc/{pid}")).exists() => PyError::NoProcess(pid),
            other => other,
        })
    }

    /// Points `last_profiled_frame` of a listed thread state at `frame` (3.15 only). This is the
    /// only write pyebpf ever makes to another process.
    pub fn set_last_profiled_frame(&self, tstate: u64, frame: u64) -> Result<(), PyError> {
        let Some(offset) = self.offsets.tstate_last_profiled_frame else {
            return Err(PyError::WriteRefused(format!("CPython {} has no last_profiled_frame", self.offsets.version)));
        };
        if self.offsets.version.minor() != 15 || !self.tstates.contains(&tstate) {
            return Err(PyError::WriteRefused(format!("{tstate:#x} is not a listed 3.15 thread state")));
        }
        Ok(self.mem.write_u64(tstate.wrapping_add(offset), frame)?)
    }
}

impl<M: ReadMemory> PyProcess<M> {
    /// Reads and validates the debug offsets at `runtime` in `mem`.
    pub fn with_memory(pid: u32, mem: M, runtime: u64) -> Result<Self, PyError> {
        let offsets = offsets::read_debug_offsets(&mem, runtime)?;
        Ok(PyProcess {
            pid,
            mem,
            offsets,
            runtime,
            codes: HashMap::new(),
            code_types: HashSet::new(),
            code_generation: None,
            code_hits: 0,
            code_misses: 0,
            tstates: HashSet::new(),
        })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn version(&self) -> PyVersion {
        self.offsets.version
    }

    pub fn memory(&self) -> &M {
        &self.mem
    }

    pub fn remote_counters(&self) -> MemCounters {
        self.mem.counters()
    }

    /// Code-object cache hits and misses.
    pub fn code_cache_counters(&self) -> (u64, u64) {
        (self.code_hits, self.code_misses)
    }

    /// What the eBPF program needs to read this process's threads at sample time.
    pub fn bpf_config(&self) -> PyProcConfig {
        let o = &self.offsets;
        let narrow = |offset: Option<u64>| offset.map_or(NO_OFFSET, |v| v as u32);
        PyProcConfig {
            tstate_current_frame: o.tstate_current_frame as u32,
            tstate_last_profiled_frame: narrow(o.tstate_last_profiled_frame),
            tstate_last_profiled_seq: narrow(o.tstate_last_profiled_seq),
            frame_previous: o.frame_previous as u32,
            frame_executable: o.frame_executable as u32,
            frame_instr_ptr: o.frame_instr_ptr as u32,
            executable_tag_mask: o.executable_tag_mask,
        }
    }

    /// Every thread of every interpreter.
    pub fn threads(&mut self) -> Result<Vec<PyThread>, PyError> {
        let o = self.offsets.clone();
        let mut threads = Vec::new();
        let mut seen = HashSet::new();
        let mut interp = self.mem.read_u64(self.runtime.wrapping_add(o.interpreters_head))?;
        let mut interpreters = 0;
        while interp != 0 {
            interpreters += 1;
            if interpreters > MAX_INTERPRETERS || !seen.insert(interp) {
                return Err(PyError::Malformed("interpreter list too long or looping".into()));
            }
            if interpreters == 1 {
                let generation = o.code_object_generation.map(|offset| self.mem.read_u64(interp.wrapping_add(offset))).transpose()?;
                self.check_code_generation(generation);
            }
            let gil_holder = self.gil_holder(self.mem.read_u64(interp.wrapping_add(o.interp_ceval_gil))?);
            let mut tstate = self.mem.read_u64(interp.wrapping_add(o.interp_threads_head))?;
            while tstate != 0 {
                if threads.len() >= MAX_THREADS || !seen.insert(tstate) {
                    return Err(PyError::Malformed("thread list too long or looping".into()));
                }
                threads.push(PyThread {
                    tid: self.mem.read_u64(tstate.wrapping_add(o.tstate_native_thread_id))? as u32,
                    tstate,
                    current_frame: self.mem.read_u64(tstate.wrapping_add(o.tstate_current_frame))?,
                    holds_gil: gil_holder == Some(tstate),
                });
                tstate = self.mem.read_u64(tstate.wrapping_add(o.tstate_next))?;
            }
            interp = self.mem.read_u64(interp.wrapping_add(o.interp_next))?;
        }
        self.tstates = threads.iter().map(|t| t.tstate).collect();
        Ok(threads)
    }

    /// The thread state holding the GIL, if it is held.
    fn gil_holder(&self, gil: u64) -> Option<u64> {
        if gil == 0 {
            return None;
        }
        let locked = self.mem.read_u32(gil.wrapping_add(self.offsets.gil_locked)).ok()?;
        let holder = self.mem.read_u64(gil.wrapping_add(self.offsets.gil_holder)).ok()?;
        (locked != 0 && holder != 0).then_some(holder)
    }

    /// Code objects may be freed and their addresses reused once the generation moves.
    fn check_code_generation(&mut self, generation: Option<u64>) {
        if generation != self.code_generation {
            self.codes.clear();
            self.code_generation = generation;
        }
    }

    fn frame_read_len(&self) -> usize {
        let o = &self.offsets;
        (o.frame_previous.max(o.frame_executable).max(o.frame_instr_ptr).max(o.frame_owner) + 8) as usize
    }

    fn link_from(&self, addr: u64, buf: &[u8]) -> FrameLink {
        let o = &self.offsets;
        let owner = buf.get(o.frame_owner as usize).copied().unwrap_or(0);
        FrameLink {
            addr,
            previous: field_u64(buf, o.frame_previous),
            code: field_u64(buf, o.frame_executable) & !o.executable_tag_mask,
            instr_ptr: field_u64(buf, o.frame_instr_ptr),
            kind: if owner >= o.entry_owner_min { LinkKind::Entry } else { LinkKind::Code },
        }
    }

    /// The decoded code object at `addr` (cached).
    pub fn code(&mut self, addr: u64) -> Result<Arc<CodeInfo>, PyError> {
        if let Some(code) = self.codes.get(&addr) {
            self.code_hits += 1;
            return Ok(code.clone());
        }
        self.code_misses += 1;
        let code = Arc::new(code::read_code(&self.mem, &self.offsets, &mut self.code_types, addr)?);
        self.codes.insert(addr, code.clone());
        Ok(code)
    }

    /// The Python frame running `code` at `instr_ptr`.
    pub fn python_frame(&mut self, code: u64, instr_ptr: u64) -> Result<PythonFrame, PyError> {
        let info = self.code(code)?;
        Ok(PythonFrame {
            qualname: info.qualname.clone(),
            filename: info.filename.clone(),
            first_line: info.first_line,
            line: info.line_for(instr_ptr).unwrap_or(0),
        })
    }

    /// The frame chain from `frame`, innermost first, uncached.
    pub fn walk_frames(&mut self, frame: u64) -> Result<Vec<FrameLink>, PyError> {
        let capture = Capture { frame, ..Capture::default() };
        walk_chain(self, &capture, None, CacheMode::Off, MAX_DEPTH)
            .map(|walk| walk.links)
            .map_err(|err| PyError::Chain(err.to_string()))
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
