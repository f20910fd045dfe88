//! Types shared by the eBPF programs and userspace: the sample record, map values and the
//! per-process configuration. Every type here is `#[repr(C)]` and plain data, so both sides agree on
//! the byte layout; map names are defined once, here.
#![no_std]

/// Most user frames captured per sample (the kernel's own limit for `bpf_get_stack` is 127).
pub const MAX_USER_FRAMES: usize = 127;
/// Most kernel frames captured per sample.
pub const MAX_KERNEL_FRAMES: usize = 127;
/// Length of a task's `comm`.
pub const COMM_LEN: usize = 16;

/// Map names, shared so the loader and the programs cannot drift apart.
pub mod maps {
    pub const SAMPLES: &str = "SAMPLES";
    pub const LOST: &str = "LOST";
    pub const CONFIG: &str = "CONFIG";
    pub const TARGETS: &str = "TARGETS";
    pub const PY_PROCS: &str = "PY_PROCS";
    pub const PY_THREADS: &str = "PY_THREADS";
}

/// Bits of [`Config::flags`].
pub mod config_flags {
    /// Capture the kernel stack too (`--kernel`).
    pub const KERNEL_STACK: u32 = 1 << 0;
    /// Only sample processes whose tgid is in `TARGETS` (`-p` and `-- COMMAND`).
    pub const FILTER_TARGETS: u32 = 1 << 1;
    /// Add children forked by a target to `TARGETS` (`-- COMMAND`).
    pub const FOLLOW_FORKS: u32 = 1 << 2;
}

/// Global settings, the single entry of the `CONFIG` array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Config {
    /// pyebpf's own tgid: its samples are dropped in the kernel.
    pub own_tgid: u32,
    pub flags: u32,
    /// Byte offset of `tgid` in the kernel's `struct task_struct` (from the kernel's BTF: the
    /// layout differs between kernel builds).
    pub task_tgid_offset: u32,
    pub _pad: u32,
}

/// Bits of [`PyCapture::status`].
pub mod py_status {
    /// The thread is a known Python thread and its thread state was read.
    pub const THREAD_KNOWN: u32 = 1 << 0;
    /// `current_frame` was read (it may be 0: the thread runs no Python code).
    pub const FRAME_READ: u32 = 1 << 1;
    /// The leaf frame's code object and instruction pointer were read.
    pub const LEAF_READ: u32 = 1 << 2;
    /// `last_profiled_frame` and its sequence number were read (3.15).
    pub const MARKER_READ: u32 = 1 << 3;
}

/// What the eBPF program reads of a Python thread at sample time.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PyCapture {
    /// Address of the thread's `PyThreadState`.
    pub tstate: u64,
    /// `tstate->current_frame`: the innermost `_PyInterpreterFrame`, 0 if none.
    pub frame: u64,
    /// The leaf frame's `f_executable`, tag bits cleared.
    pub code: u64,
    /// The leaf frame's `instr_ptr`.
    pub instr_ptr: u64,
    /// `tstate->last_profiled_frame` (3.15), else 0.
    pub last_profiled_frame: u64,
    /// `tstate->last_profiled_frame_seq` (3.15), else 0.
    pub last_profiled_seq: u64,
    /// `py_status` bits.
    pub status: u32,
    pub _pad: u32,
}

/// One sample, as sent through the `SAMPLES` ring buffer.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SampleRecord {
    pub tgid: u32,
    pub tid: u32,
    pub cpu: u32,
    /// Number of valid entries in `user_stack`.
    pub user_len: u32,
    /// Number of valid entries in `kernel_stack`.
    pub kernel_len: u32,
    /// Number of valid entries in `user_frame_bases`.
    pub frame_bases_len: u32,
    /// `bpf_ktime_get_ns()` at the sample.
    pub time_ns: u64,
    pub comm: [u8; COMM_LEN],
    pub py: PyCapture,
    /// The user stack pointer at the sample.
    pub user_sp: u64,
    /// Return addresses, innermost first.
    pub user_stack: [u64; MAX_USER_FRAMES],
    /// The frame pointer of each user frame, innermost first: entry `i` is the frame base of the
    /// function at `user_stack[i]`, so its locals lie between entry `i - 1` (or `user_sp`) and it.
    /// The merge finds which native frame holds each interpreter entry frame with these.
    pub user_frame_bases: [u64; MAX_USER_FRAMES],
    pub kernel_stack: [u64; MAX_KERNEL_FRAMES],
}

/// Marks a field that a CPython version does not have.
pub const NO_OFFSET: u32 = u32::MAX;

/// Where to read a Python process's thread and frame fields: one `PY_PROCS` entry per tgid.
/// Offsets are byte offsets; [`NO_OFFSET`] marks a field the version does not have.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PyProcConfig {
    pub tstate_current_frame: u32,
    pub tstate_last_profiled_frame: u32,
    pub tstate_last_profiled_seq: u32,
    pub frame_previous: u32,
    pub frame_executable: u32,
    pub frame_instr_ptr: u32,
    /// Bits cleared from `f_executable` before use (its tag bits; 0 where it is not tagged).
    pub executable_tag_mask: u64,
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all are repr(C) plain data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::PyProcConfig {}
    unsafe impl aya::Pod for super::PyCapture {}
}
