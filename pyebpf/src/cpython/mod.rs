//! Reading CPython 3.8+ processes from outside, through `process_vm_readv` and the
//! `_Py_DebugOffsets` table (3.13+) or pyebpf's own table of the version, proven against the live
//! process (3.8 to 3.12): threads, interpreter frame chains and code objects.
//!
//! Everything read is sized by the target, so every read and everything kept has a budget:
//! - per code object: its location table up to 64 KiB (`code::MAX_LINETABLE`; later instructions
//!   get line 0), each name up to 4 KiB of characters (`strings::MAX_STRING_BYTES`; cut names end
//!   with "…"): at most about 80 KiB decoded;
//! - per process: at most 16,384 decoded code objects and 32 MiB (`code_cache::MAX_ENTRIES`,
//!   `code_cache::MAX_BYTES`), evicted in CLOCK order past either;
//! - in total: 256 MiB of decoded code objects over all processes (`code_cache::MAX_TOTAL_BYTES`);
//! - per walk: `MAX_DEPTH` frames (the innermost ones), 4,096 threads and 64 interpreters per
//!   process (`threads`);
//! - asyncio tasks (`asyncio`): `--max-tasks` read per process, the rest only counted.
//!
//! What the budgets drop is counted in `CodeCacheCounters`, which `record --stats` prints.

pub mod asyncio;
mod code;
mod code_cache;
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

use std::collections::HashSet;
use std::iter::Sum;
use std::ops::Add;
use std::sync::Arc;

use pyebpf_common::{PyProcConfig, NO_OFFSET};

use crate::chain::LinkReader;

pub use code::{CodeInfo, Location};
use code_cache::BoundedCache;
pub use code_cache::MAX_ENTRIES as MAX_CACHED_CODES;
pub use frames::{FrameWalk, ResolvedFrame, MAX_DEPTH};
use memory::{MemCounters, MemError, ProcessMemory, ReadExt, ReadMemory};
use offsets::{narrow, CodeIdentity};
pub use offsets::{DebugOffsets, PyVersion};
pub use strings::TRUNCATION_MARK;
pub use threads::PyThread;

#[derive(Debug, thiserror::Error)]
pub enum PyError {
    #[error("process {0} does not exist (or has exited)")]
    NoProcess(u32),
    #[error("permission denied (reading another user's process needs root or CAP_SYS_PTRACE)")]
    PermissionDenied(u32),
    #[error("process {0} is not a CPython process (no python3 executable or libpython3 mapped)")]
    NotPython(u32),
    #[error("cannot open {}, the interpreter of process {pid}: {cause} (files in directories pyebpf's user cannot enter need CAP_DAC_READ_SEARCH)", path.display())]
    InterpreterUnreadable { pid: u32, path: std::path::PathBuf, cause: std::io::Error },
    /// No `xdebugpy` cookie at `_PyRuntime`. Before 3.13 there is none, and [`PyProcess::attach`]
    /// reads the process with pyebpf's table of its version instead: the error remains only when
    /// that version is unknown too.
    #[error("no _Py_DebugOffsets in _PyRuntime, and neither Py_Version nor the interpreter's file name tells the CPython version")]
    NoDebugOffsets,
    #[error("CPython {0} is not supported (3.8 to 3.14 and 3.15.0b4 or later are)")]
    UnsupportedVersion(PyVersion),
    /// A version known only by its interpreter's file name (`MAJOR.MINOR`): before 3.11.
    #[error("CPython {0} is not supported (3.8 to 3.14 and 3.15.0b4 or later are)")]
    UnsupportedRelease(String),
    /// 3.14t and later: a thread may run its own copy of a code object's bytecode, which pyebpf
    /// does not read yet (3.13t is read).
    #[error("free-threaded CPython {0} is not supported (free-threaded 3.13 is; from 3.14 threads run their own copies of the bytecode, which pyebpf does not read yet)")]
    FreeThreaded(PyVersion),
    #[error("implausible _Py_DebugOffsets: {0}")]
    BadOffsets(String),
    #[error("CPython {version} in this process is not laid out as pyebpf's table for it says ({why}): a debug or patched build?")]
    TableMismatch { version: PyVersion, why: String },
    #[error("malformed interpreter state: {0}")]
    Malformed(String),
    /// `_PyRuntime` lists no interpreter: a program that links `libpython` without starting it
    /// (perf, for its scripts), or one caught before `Py_Initialize`.
    #[error("libpython is loaded but runs no interpreter")]
    NoInterpreter,
    #[error("refusing to write: {0}")]
    WriteRefused(String),
    #[error(transparent)]
    Memory(#[from] MemError),
    #[error("frame chain: {0}")]
    Chain(String),
}

impl PyError {
    /// The CPython this error names as one pyebpf does not read (`CPython 3.11.2`), if it does.
    pub fn unsupported_python(&self) -> Option<String> {
        match self {
            PyError::UnsupportedVersion(version) => Some(format!("CPython {version}")),
            PyError::UnsupportedRelease(version) => Some(format!("CPython {version}")),
            PyError::FreeThreaded(version) => Some(format!("free-threaded CPython {version}")),
            PyError::TableMismatch { version, .. } => Some(format!("CPython {version} (a layout pyebpf does not know)")),
            _ => None,
        }
    }

    /// Whether this error comes from the process having exited.
    pub fn process_gone(&self) -> bool {
        match self {
            PyError::NoProcess(_) => true,
            PyError::Memory(err) => err.process_gone(),
            _ => false,
        }
    }
}

/// The code-object cache of a process, and what the budgets dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CodeCacheCounters {
    pub hits: u64,
    pub misses: u64,
    /// Code objects evicted to keep the cache within its bounds.
    pub evictions: u64,
    /// Location tables read only up to `MAX_LINETABLE`.
    pub truncated_linetables: u64,
    /// Names and file names read only up to `MAX_STRING_BYTES`.
    pub truncated_strings: u64,
    /// Code objects and bytes the cache holds now.
    pub cached_entries: u64,
    pub cached_bytes: u64,
}

impl Add for CodeCacheCounters {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        CodeCacheCounters {
            hits: self.hits + other.hits,
            misses: self.misses + other.misses,
            evictions: self.evictions + other.evictions,
            truncated_linetables: self.truncated_linetables + other.truncated_linetables,
            truncated_strings: self.truncated_strings + other.truncated_strings,
            cached_entries: self.cached_entries + other.cached_entries,
            cached_bytes: self.cached_bytes + other.cached_bytes,
        }
    }
}

impl Sum for CodeCacheCounters {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::default(), Add::add)
    }
}

/// An attached CPython process.
pub struct PyProcess<M = ProcessMemory> {
    pid: u32,
    mem: M,
    offsets: DebugOffsets,
    runtime: u64,
    codes: BoundedCache<Arc<CodeInfo>>,
    /// Type objects already confirmed to be `code`.
    code_types: HashSet<u64>,
    code_generation: Option<u64>,
    code_counters: CodeCacheCounters,
    /// A code object of this process was decoded: its table is CPython's, not a look-alike.
    decoded: bool,
    /// A code object of this process was malformed: its memory is corrupt or hostile, so nothing
    /// is ever written into it.
    malformed: bool,
    /// A thread list read found more than one interpreter.
    subinterpreters: bool,
    /// Whether the process is in pyebpf's PID namespace, once read (thread lists need no id
    /// mapping then).
    shares_pid_namespace: Option<bool>,
}

impl PyProcess<ProcessMemory> {
    /// Attaches to `pid`, its maps read now.
    pub fn attach(pid: u32) -> Result<Self, PyError> {
        Self::attach_mapped(pid, &crate::maps::Maps::read(pid)?)
    }

    /// Attaches to `pid`, whose interpreter is found among the files its `maps` name.
    pub fn attach_mapped(pid: u32, maps: &crate::maps::Maps) -> Result<Self, PyError> {
        let runtime = runtime::find_runtime_in(pid, maps)?;
        // Before 3.11 the interpreter's file name is all that tells its version.
        let version = runtime.version.or_else(|| runtime.named_version.as_deref().and_then(PyVersion::from_name));
        let attached = match Self::with_memory(pid, ProcessMemory::new(pid), runtime.address) {
            // A version without debug offsets whose layout pyebpf has a table of.
            Err(PyError::NoDebugOffsets) => match version.and_then(offsets::builtin_offsets) {
                Some(table) => Self::with_offsets(pid, ProcessMemory::new(pid), runtime.address, table).check_table(),
                None => Err(PyError::NoDebugOffsets),
            },
            attached => attached,
        };
        attached.map_err(|err| match err {
            PyError::Memory(err) if err.process_gone() || runtime::has_exited(pid) => PyError::NoProcess(pid),
            PyError::Memory(err) if err.permission_denied() => PyError::PermissionDenied(pid),
            // No cookie in an interpreter whose version has debug offsets: the table was damaged.
            PyError::NoDebugOffsets => match runtime.version {
                Some(version) if offsets::is_supported(version) => {
                    PyError::BadOffsets(format!("no `xdebugpy` cookie in _PyRuntime, yet the interpreter is CPython {version}"))
                }
                Some(version) => PyError::UnsupportedVersion(version),
                None => runtime.named_version.clone().map_or(PyError::NoDebugOffsets, PyError::UnsupportedRelease),
            },
            other => other,
        })
    }
}

impl<M: ReadMemory> PyProcess<M> {
    /// Reads and validates the debug offsets at `runtime` (the address of `_PyRuntime`) in `mem`.
    pub fn with_memory(pid: u32, mem: M, runtime: u64) -> Result<Self, PyError> {
        let offsets = offsets::read_debug_offsets(&mem, runtime)?;
        Ok(Self::with_offsets(pid, mem, runtime, offsets))
    }

    /// A process read with `offsets` (from its debug offsets, or pyebpf's table of its version).
    pub fn with_offsets(pid: u32, mem: M, runtime: u64, offsets: DebugOffsets) -> Self {
        PyProcess {
            pid,
            mem,
            offsets,
            runtime,
            codes: BoundedCache::new(code_cache::MAX_ENTRIES, code_cache::MAX_BYTES, &code_cache::ALL_PROCESSES),
            code_types: HashSet::new(),
            code_generation: None,
            code_counters: CodeCacheCounters::default(),
            decoded: false,
            malformed: false,
            subinterpreters: false,
            shares_pid_namespace: None,
        }
    }

    /// Proves a table pyebpf brought (not the process's own debug offsets) against the live
    /// process before anything is read with it: its thread lists hold threads of this process and
    /// end, one interpreter is the main one, current frames are aligned, and the frames there are
    /// read and run code objects. A build laid out otherwise is refused in one line. Before 3.11,
    /// where thread ids are read through the C library's thread descriptors, the first place of the
    /// id ([`offsets::PTHREAD_TID_OFFSETS`]: glibc's, musl's) that names the process's threads is kept.
    pub fn check_table(mut self) -> Result<Self, PyError> {
        if self.offsets.pthread_tid.is_none() {
            self.prove_table_again()?;
            return Ok(self);
        }
        let mut refused = None;
        for at in offsets::PTHREAD_TID_OFFSETS {
            self.offsets.pthread_tid = Some(at);
            match self.prove_table_again() {
                Ok(()) => return Ok(self),
                Err(err @ PyError::TableMismatch { .. }) => refused = refused.or(Some(err)),
                Err(err) => return Err(err),
            }
        }
        Err(refused.expect("at least one place was tried"))
    }

    /// [`Self::prove_table`], tried again after a mismatch: the threads run while their frames are
    /// read, and a frame read as it is pushed or popped can name no code object yet. A wrong table
    /// fails every time.
    fn prove_table_again(&mut self) -> Result<(), PyError> {
        const ATTEMPTS: usize = 3;
        let mut attempt = 1;
        loop {
            match self.prove_table() {
                Err(PyError::TableMismatch { .. }) if attempt < ATTEMPTS => {
                    attempt += 1;
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                proven => return proven,
            }
        }
    }

    fn prove_table(&mut self) -> Result<(), PyError> {
        let version = self.offsets.version;
        let mismatch = |why: String| PyError::TableMismatch { version, why };
        let states = match self.thread_states() {
            Ok(states) => states,
            Err(PyError::Malformed(why)) => return Err(mismatch(why)),
            // The table led to memory that is not there.
            Err(PyError::Memory(err)) if !err.process_gone() && !err.permission_denied() => return Err(mismatch(err.to_string())),
            Err(err) => return Err(err),
        };
        if states.is_empty() {
            if self.mem.read_u64(self.runtime.wrapping_add(self.offsets.interpreters_head))? == 0 {
                return Err(PyError::NoInterpreter);
            }
            return Err(mismatch("no thread state names a thread of the process".into()));
        }
        let tasks: HashSet<u32> = std::fs::read_dir(format!("/proc/{}/task", self.pid))
            .map_err(|_| PyError::NoProcess(self.pid))?
            .filter_map(|task| task.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        if let Some(stranger) = states.iter().find(|state| !tasks.contains(&state.tid)) {
            return Err(mismatch(format!("thread id {} is no thread of the process", stranger.tid)));
        }
        if !states.iter().any(|state| state.interpreter == 0) {
            return Err(mismatch("no main interpreter".into()));
        }
        for state in &states {
            if !state.current_frame.is_multiple_of(8) {
                return Err(mismatch(format!("a current frame at {:#x}", state.current_frame)));
            }
            let mut frame = state.current_frame;
            // The innermost frames that run code must name code objects.
            for _ in 0..4 {
                if frame == 0 {
                    break;
                }
                let link = self.read_link(frame).map_err(|err| mismatch(format!("frame {frame:#x}: {err}")))?;
                if link.kind.runs_code() && link.code != 0 {
                    self.code(link.code).map_err(|err| mismatch(format!("frame {frame:#x}: {err}")))?;
                }
                frame = link.previous;
            }
        }
        Ok(())
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the process has had subinterpreters, as far as its thread lists showed.
    pub fn has_subinterpreters(&self) -> bool {
        self.subinterpreters
    }

    pub fn version(&self) -> PyVersion {
        self.offsets.version
    }

    /// The interpreter as users name it: `CPython 3.13.15`, `free-threaded CPython 3.13.15`.
    pub fn python_name(&self) -> String {
        let flavour = if self.offsets.free_threaded { "free-threaded " } else { "" };
        format!("{flavour}CPython {}", self.offsets.version)
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

    /// The code-object cache's hits, misses and size, and what the budgets dropped.
    pub fn code_cache_counters(&self) -> CodeCacheCounters {
        CodeCacheCounters { cached_entries: self.codes.len() as u64, cached_bytes: self.codes.bytes() as u64, ..self.code_counters }
    }

    /// What the eBPF program needs to read this process's threads at sample time.
    pub fn bpf_config(&self) -> PyProcConfig {
        let o = &self.offsets;
        let (code_version, code_fingerprint, str_hash) = match o.code_identity {
            CodeIdentity::Version(at) => (narrow(at), NO_OFFSET, NO_OFFSET),
            CodeIdentity::Fingerprint { words, str_hash } => (NO_OFFSET, narrow(words), narrow(str_hash)),
        };
        PyProcConfig {
            flags: 0,
            max_frames: pyebpf_common::MAX_PY_FRAMES as u32,
            frame_owner: o.frame_owner.map_or(NO_OFFSET, narrow),
            frame_is_entry: o.frame_is_entry.map_or(NO_OFFSET, narrow),
            code_version,
            code_fingerprint,
            str_hash,
            runtime_gil_holder: o.runtime_gil_holder.map_or(0, |at| self.runtime.wrapping_add(at)),
            interp_ceval_gil: if o.runtime_gil_holder.is_some() { NO_OFFSET } else { narrow(o.interp_ceval_gil) },
            gil_locked: narrow(o.gil_locked),
            gil_holder: narrow(o.gil_holder),
            frame_window: narrow(
                o.frame_previous
                    .max(o.frame_executable)
                    .max(o.frame_instr_ptr)
                    .wrapping_add(8)
                    .max(o.frame_owner.map_or(0, |at| at + 1))
                    .max(o.frame_is_entry.map_or(0, |at| at + 1)),
            ),
            tstate_cframe: o.tstate_cframe.map_or(NO_OFFSET, narrow),
            tstate_current_frame: narrow(o.tstate_current_frame),
            tstate_last_profiled_frame: o.tstate_last_profiled_frame.map_or(NO_OFFSET, narrow),
            tstate_last_profiled_seq: o.tstate_last_profiled_seq.map_or(NO_OFFSET, narrow),
            frame_previous: narrow(o.frame_previous),
            frame_executable: narrow(o.frame_executable),
            frame_instr_ptr: narrow(o.frame_instr_ptr),
            executable_tag_mask: o.executable_tag_mask,
            interpreters_head: self.runtime.wrapping_add(o.interpreters_head),
            interp_next: narrow(o.interp_next),
            interp_threads_head: narrow(o.interp_threads_head),
            tstate_prev: narrow(o.tstate_prev),
            tstate_next: narrow(o.tstate_next),
            tstate_interp: narrow(o.tstate_interp),
            tstate_native_thread_id: narrow(o.tstate_native_thread_id),
            pthread_tid: o.pthread_tid.map_or(NO_OFFSET, narrow),
            _pad: 0,
            tstate_status: o.tstate_status.map_or(NO_OFFSET, narrow),
            status_attached: threads::STATUS_ACTIVE,
            asyncio: Default::default(),
        }
    }

    /// The decoded code object at `addr` (cached by address until the code-object generation moves
    /// or the cache's budget evicts it).
    pub fn code(&mut self, addr: u64) -> Result<Arc<CodeInfo>, PyError> {
        if let Some(code) = self.codes.get(addr) {
            self.code_counters.hits += 1;
            return Ok(code);
        }
        self.code_counters.misses += 1;
        let code = code::read_code(&self.mem, &self.offsets, &mut self.code_types, addr, &mut self.code_counters)
            .inspect_err(|err| self.malformed |= matches!(err, PyError::Malformed(_)))?;
        let code = Arc::new(code);
        self.code_counters.evictions += self.codes.insert(addr, code.clone(), code.heap_bytes());
        self.decoded = true;
        Ok(code)
    }

    /// Whether every frame field the eBPF program reads lies in the window it reads per frame.
    pub fn fits_frame_window(&self) -> bool {
        let o = &self.offsets;
        let window = pyebpf_common::PY_FRAME_WINDOW as u64;
        [o.frame_previous, o.frame_executable, o.frame_instr_ptr].iter().all(|&f| f % 8 == 0 && f + 8 <= window)
            && o.frame_owner.is_none_or(|at| at < window)
            && o.frame_is_entry.is_none_or(|at| at < window)
    }

    pub fn decoded_frames(&self) -> bool {
        self.decoded
    }

    pub fn seen_malformed(&self) -> bool {
        self.malformed
    }

    /// Drops the cached decode of the code object at `addr` (another may live there now).
    pub fn forget_code(&mut self, addr: u64) {
        self.codes.remove(addr);
    }

    /// The `co_version` (or before 3.12 the fingerprint) of the code object at `addr` now: with the
    /// address, its identity, as the eBPF program reads it.
    pub fn code_version(&self, addr: u64) -> Result<u32, PyError> {
        match self.offsets.code_identity {
            CodeIdentity::Version(at) => Ok(self.mem.read_u32(addr.wrapping_add(at))?),
            CodeIdentity::Fingerprint { words, str_hash } => {
                let raw = self.mem.read_vec(addr.wrapping_add(words), 8 * pyebpf_common::CODE_FINGERPRINT_WORDS)?;
                let words: [u64; pyebpf_common::CODE_FINGERPRINT_WORDS] = std::array::from_fn(|i| memory::field_u64(&raw, 8 * i as u64));
                let name_hash = self.mem.read_u64(words[pyebpf_common::FINGERPRINT_NAME_WORD].wrapping_add(str_hash))?;
                Ok(pyebpf_common::code_fingerprint(&words, name_hash))
            }
        }
    }
}
