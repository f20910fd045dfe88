//! Reading CPython 3.13+ processes from outside, through `process_vm_readv` and the
//! `_Py_DebugOffsets` table: threads, interpreter frame chains and code objects.

mod code;
pub mod dump;
mod frames;
mod linetable;
mod marker;
pub mod memory;
pub mod offsets;
pub mod runtime;
mod strings;
#[cfg(test)]
mod tests;
mod threads;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use pyebpf_common::{PyProcConfig, NO_OFFSET};

pub use code::{CodeInfo, Location};
pub use frames::{ResolvedFrame, MAX_DEPTH};
use memory::{MemCounters, MemError, ProcessMemory, ReadExt, ReadMemory};
pub use offsets::{DebugOffsets, PyVersion};
pub use threads::PyThread;

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

impl PyError {
    /// Whether this error comes from the process having exited.
    pub fn process_gone(&self) -> bool {
        match self {
            PyError::NoProcess(_) => true,
            PyError::Memory(err) => err.process_gone(),
            _ => false,
        }
    }
}

/// An attached CPython process.
pub struct PyProcess<M = ProcessMemory> {
    pid: u32,
    mem: M,
    offsets: DebugOffsets,
    runtime: u64,
    codes: HashMap<u64, Arc<CodeInfo>>,
    /// Type objects already confirmed to be `code`.
    code_types: HashSet<u64>,
    code_generation: Option<u64>,
    code_hits: u64,
    code_misses: u64,
    /// A code object of this process was decoded: its table is CPython's, not a look-alike.
    decoded: bool,
}

impl PyProcess<ProcessMemory> {
    pub fn attach(pid: u32) -> Result<Self, PyError> {
        let runtime = runtime::find_runtime(pid)?;
        Self::with_memory(pid, ProcessMemory::new(pid), runtime.address).map_err(|err| match err {
            PyError::Memory(err) if err.process_gone() || runtime::has_exited(pid) => PyError::NoProcess(pid),
            PyError::NoDebugOffsets => runtime.version.map_or(PyError::NoDebugOffsets, PyError::UnsupportedVersion),
            other => other,
        })
    }
}

impl<M: ReadMemory> PyProcess<M> {
    /// Reads and validates the debug offsets at `runtime` (the address of `_PyRuntime`) in `mem`.
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
            decoded: false,
        })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn version(&self) -> PyVersion {
        self.offsets.version
    }

    pub fn offsets(&self) -> &DebugOffsets {
        &self.offsets
    }

    pub fn memory(&self) -> &M {
        &self.mem
    }

    /// Remote reads made and bytes read so far.
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
        // Offsets were checked against structure sizes of at most 16 MiB.
        let narrow = |offset: u64| offset as u32;
        PyProcConfig {
            flags: 0,
            max_frames: pyebpf_common::MAX_PY_FRAMES as u32,
            frame_owner: narrow(o.frame_owner),
            code_version: narrow(o.code_version),
            tstate_current_frame: narrow(o.tstate_current_frame),
            tstate_last_profiled_frame: o.tstate_last_profiled_frame.map_or(NO_OFFSET, narrow),
            tstate_last_profiled_seq: o.tstate_last_profiled_seq.map_or(NO_OFFSET, narrow),
            frame_previous: narrow(o.frame_previous),
            frame_executable: narrow(o.frame_executable),
            frame_instr_ptr: narrow(o.frame_instr_ptr),
            executable_tag_mask: o.executable_tag_mask,
        }
    }

    /// The decoded code object at `addr` (cached by address until the code-object generation moves).
    pub fn code(&mut self, addr: u64) -> Result<Arc<CodeInfo>, PyError> {
        if let Some(code) = self.codes.get(&addr) {
            self.code_hits += 1;
            return Ok(code.clone());
        }
        self.code_misses += 1;
        let code = Arc::new(code::read_code(&self.mem, &self.offsets, &mut self.code_types, addr)?);
        self.codes.insert(addr, code.clone());
        self.decoded = true;
        Ok(code)
    }

    /// Whether every frame field the eBPF program reads lies in the window it reads per frame.
    pub fn fits_frame_window(&self) -> bool {
        let o = &self.offsets;
        let window = pyebpf_common::PY_FRAME_WINDOW as u64;
        [o.frame_previous, o.frame_executable, o.frame_instr_ptr].iter().all(|&f| f % 8 == 0 && f + 8 <= window) && o.frame_owner < window
    }

    pub fn decoded_frames(&self) -> bool {
        self.decoded
    }

    /// Drops the cached decode of the code object at `addr` (another may live there now).
    pub fn forget_code(&mut self, addr: u64) {
        self.codes.remove(&addr);
    }

    /// The `co_version` of the code object at `addr` now: with the address, its identity.
    pub fn code_version(&self, addr: u64) -> Result<u32, PyError> {
        Ok(self.mem.read_u32(addr.wrapping_add(self.offsets.code_version))?)
    }
}
