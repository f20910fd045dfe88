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
/// Most Python frames the eBPF program walks per sample; a deeper chain is cut there and marked.
pub const MAX_PY_FRAMES: usize = 512;
/// Bytes of a frame (`_PyInterpreterFrame`, or before 3.11 `PyFrameObject`) read per frame: every
/// field the walk needs lies in them.
pub const PY_FRAME_WINDOW: usize = 128;
/// Positions of an established marker chain the eBPF program can check a moved marker against.
pub const MARKER_POSITIONS: usize = 16;
/// A 3.15 thread's marker chain is re-established from a sample whose walk went further than this
/// many frames before joining one (or joined none).
pub const MARKER_REESTABLISH_FRAMES: u32 = 4;
/// Most bytes of the user stack (from the stack pointer up) copied per sample for unwinding from
/// call frame information in userspace.
pub const STACK_SNAPSHOT_MAX: usize = 16 * 1024;
/// The stack is copied in page-aligned chunks, so a copy that meets the stack's end keeps every
/// page before it.
pub const STACK_CHUNK: usize = 4096;
/// Processes whose user stacks are copied at most (`--unwind auto`).
pub const MAX_SNAPSHOT_PROCS: u32 = 16384;
/// Words of the `WAIT_PROCS` bitmap: one bit for each tgid below the kernel's `PID_MAX_LIMIT`
/// (4,194,304 on 64-bit).
pub const WAIT_PROCS_WORDS: u32 = 4_194_304 / 64;

mod asyncio;
mod clock;
pub mod unwind;

pub use asyncio::{
    task_status, type_flags, AsyncioConfig, TaskCapture, TaskRecord, WaitingTasks, MAX_AWAITER_FRAMES, MAX_AWAITER_LINKS, MAX_TASKS, MAX_WAITING_FRAMES,
    MAX_WAITING_TASKS, TASK_NAME_BYTES,
};
pub use clock::{tick_status, ClockSlot, Strata, Tick};

/// Map names: the eBPF crate's map statics are named so (a map is named after its static), and
/// the loader takes them by these names; a unit test checks the embedded object has every one.
pub mod maps {
    pub const SAMPLES: &str = "SAMPLES";
    pub const LOST: &str = "LOST";
    pub const CONFIG: &str = "CONFIG";
    pub const TARGETS: &str = "TARGETS";
    pub const PY_PROCS: &str = "PY_PROCS";
    pub const PY_THREADS: &str = "PY_THREADS";
    pub const PY_MARKERS: &str = "PY_MARKERS";
    pub const SCRATCH: &str = "SCRATCH";
    pub const SNAPSHOT_PROCS: &str = "SNAPSHOT_PROCS";
    pub const WAIT_PROCS: &str = "WAIT_PROCS";
    pub const OFF_CPU: &str = "OFF_CPU";
    pub const SHORT_WAITS: &str = "SHORT_WAITS";
    pub const WAITING_SCRATCH: &str = "WAITING_SCRATCH";
    pub const KNOWN_PROCS: &str = "KNOWN_PROCS";
    pub const LAST_WAKEUP: &str = "LAST_WAKEUP";
    pub const CLOCK: &str = "CLOCK";
    pub const TICKS: &str = "TICKS";
    pub const TICK_RUN_TIME: &str = "TICK_RUN_TIME";
    pub const PROC_SCRATCH: &str = "PROC_SCRATCH";
    pub const TASK_WINDOWS: &str = "TASK_WINDOWS";
    pub const UNWIND_PAGES: &str = "UNWIND_PAGES";
    pub const ALL: [&str; 21] = [
        SAMPLES,
        LOST,
        CONFIG,
        TARGETS,
        PY_PROCS,
        PY_THREADS,
        PY_MARKERS,
        SCRATCH,
        SNAPSHOT_PROCS,
        WAIT_PROCS,
        OFF_CPU,
        SHORT_WAITS,
        WAITING_SCRATCH,
        KNOWN_PROCS,
        LAST_WAKEUP,
        CLOCK,
        TICKS,
        TICK_RUN_TIME,
        PROC_SCRATCH,
        TASK_WINDOWS,
        UNWIND_PAGES,
    ];
}

/// Program names: the eBPF crate's program functions are named so, and the loader takes them by
/// these names; a unit test checks the embedded object has every one.
pub mod programs {
    /// The perf-event sampler.
    pub const SAMPLE: &str = "sample";
    /// `sched_process_fork`: children of targets become targets.
    pub const FOLLOW_FORK: &str = "follow_fork";
    /// `sched_process_exec` and `sched_process_exit`: a process's state ends.
    pub const PROCESS_EXEC: &str = "process_exec";
    pub const PROCESS_EXIT: &str = "process_exit";
    /// `sched_switch`: a thread of a watched process leaves the CPU (its stacks are captured as it
    /// leaves) or comes back (the interval's length is sent).
    pub const SWITCH: &str = "switch";
    /// The sampler and the switch hook that also read asyncio tasks (`--async-aware`): loaded
    /// instead, so the others' verification does not pay for the task walks.
    pub const SAMPLE_TASKS: &str = "sample_tasks";
    pub const SWITCH_TASKS: &str = "switch_tasks";
    /// `task_rename` of pyebpf's own threads: starts the timer clock of the CPU it runs on (with
    /// or without asyncio tasks).
    pub const START_TICK: &str = "start_tick";
    pub const START_TICK_TASKS: &str = "start_tick_tasks";
    pub const ALL: [&str; 9] = [SAMPLE, FOLLOW_FORK, PROCESS_EXEC, PROCESS_EXIT, SWITCH, SAMPLE_TASKS, SWITCH_TASKS, START_TICK, START_TICK_TASKS];
}

/// Global constants the loader sets before verification: the eBPF crate's statics of these names
/// (a unit test checks the embedded object has every one).
pub mod globals {
    /// Byte offsets of `pid` and `tgid` in the kernel's `struct task_struct` (from its BTF).
    pub const TASK_PID_OFFSET: &str = "TASK_PID_OFFSET";
    pub const TASK_TGID_OFFSET: &str = "TASK_TGID_OFFSET";
    pub const ALL: [&str; 2] = [TASK_PID_OFFSET, TASK_TGID_OFFSET];
}

/// Bits of [`Config::flags`].
pub mod config_flags {
    /// Capture the kernel stack too (`--kernel`).
    pub const KERNEL_STACK: u32 = 1 << 0;
    /// Only sample processes whose tgid is in `TARGETS` (`-p` and `-- COMMAND`).
    pub const FILTER_TARGETS: u32 = 1 << 1;
    /// Add children forked by a target to `TARGETS` (`-- COMMAND`, `--subprocesses`).
    pub const FOLLOW_FORKS: u32 = 1 << 2;
    /// Copy the user stack of every sampled process (`--unwind dwarf`); otherwise only of those in
    /// `SNAPSHOT_PROCS`.
    pub const SNAPSHOT_ALL: u32 = 1 << 3;
    /// Read at each sample whether the thread holds the GIL (`--mode gil`).
    pub const GIL: u32 = 1 << 4;
    /// With a process's `py_proc_flags::TASKS`: send the thread's waiting tasks after each capture
    /// (`--mode wall|off-cpu --async-aware`).
    pub const WAITING_TASKS: u32 = 1 << 5;
    /// Copy the user stack where the frame-pointer walk broke and the process is not in
    /// `KNOWN_PROCS` (`--unwind auto`): until userspace has seen the process and decided, its
    /// samples keep their native part.
    pub const SNAPSHOT_UNKNOWN: u32 = 1 << 6;
    /// The timer clock adds its callbacks' run time to `TICK_RUN_TIME` (`--stats`).
    pub const RUN_TIME: u32 = 1 << 7;
}

/// Bits of [`SampleRecord::user_status`].
pub mod user_status {
    /// The frame-pointer walk ended at a zero frame pointer: the root of a stack built with frame
    /// pointers (`_start` and thread entry clear it). Otherwise the chain broke somewhere.
    pub const FP_COMPLETE: u32 = 1 << 0;
    /// The copy of the stack stopped at [`super::STACK_SNAPSHOT_MAX`], not at the stack's end.
    pub const SNAPSHOT_FULL: u32 = 1 << 1;
    /// The kernel stack was read in the timer clock's soft interrupt: it starts with the clock's
    /// own frames and the interrupt's, down to the code interrupted.
    pub const KERNEL_IN_SOFTIRQ: u32 = 1 << 2;
    /// The eBPF program unwound the user stack to its root by the rules in `UNWIND_PAGES`.
    pub const RULES_UNWOUND: u32 = 1 << 3;
}

/// Global settings, the single entry of the `CONFIG` array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Config {
    /// pyebpf's own tgid: its samples are dropped in the kernel.
    pub own_tgid: u32,
    pub flags: u32,
    /// Pending bytes in the ring buffer from which a record wakes the reader at once.
    pub wakeup_bytes: u32,
    /// SCRATCH entries per origin: the CPU count (an off-CPU capture uses the second half, so it
    /// never shares a record with a sample on its CPU).
    pub cpus: u32,
    /// A thread's stacks are captured as it leaves the CPU at most once per this many nanoseconds;
    /// intervals that begin without a capture are only summed in `SHORT_WAITS`.
    pub off_cpu_min_ns: u64,
    /// Below `wakeup_bytes`, a record wakes the reader only when the last wakeup is at least this
    /// old: records wait about this long at most while more keep coming, and an idle host wakes
    /// no one.
    pub wakeup_latency_ns: u64,
    /// The same for a record userspace must see soon: of a process it does not know yet (not in
    /// `KNOWN_PROCS`: its Python state is read while it lives), or of a thread of a Python
    /// process it has not registered (a new thread, whose next samples need its thread state).
    pub urgent_latency_ns: u64,
    /// Ticks of the sampling clock per sampling slot: one tick of each slot samples (see
    /// [`ClockSlot`]); 0 counts as 1.
    pub ticks_per_slot: u32,
    pub _pad: u32,
    /// The period asked for, in nanoseconds: the timer clock samples each CPU once in each.
    pub sample_period_ns: u64,
}

/// Bits of [`PyCapture::status`].
pub mod py_status {
    /// The thread is a known Python thread and its thread state was read.
    pub const THREAD_KNOWN: u32 = 1 << 0;
    /// `current_frame` was read (it may be 0: the thread runs no Python code).
    pub const FRAME_READ: u32 = 1 << 1;
    /// The walk reached the root of the chain: `frames` is the whole chain.
    pub const COMPLETE: u32 = 1 << 2;
    /// The walk stopped at the `last_profiled_frame` marker of an established chain
    /// ([`PyCapture::marker_gen`](super::PyCapture::marker_gen), position
    /// [`PyCapture::marker_position`](super::PyCapture::marker_position)): the frames rootward of it
    /// are that chain's.
    pub const JOINED: u32 = 1 << 3;
    /// The walk stopped at the depth limit.
    pub const TOO_DEEP: u32 = 1 << 4;
    /// A frame could not be read: the chain ends there.
    pub const READ_FAILED: u32 = 1 << 5;
    /// The thread held the GIL at the sample (read only with `config_flags::GIL`).
    pub const HOLDS_GIL: u32 = 1 << 6;
}

/// One interpreter frame as the eBPF program read it at the sample.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyFrameRecord {
    /// The frame's address; its owner (`_PyInterpreterFrame.owner`) in the low 3 bits (frames are
    /// 8-byte aligned). On 3.11, whose owners are 0 to 2, [`ENTRY_FLAG`] there marks `is_entry`.
    pub addr_owner: u64,
    /// `f_executable`, tag bits cleared.
    pub code: u64,
    pub instr_ptr: u64,
    /// The code object's `co_version` (3.12+), or its [`code_fingerprint`] (before), read at the
    /// sample: with the address, it identifies the code object (addresses are reused once a code
    /// object is freed; versions are not, and a fingerprint of the object's names rarely is).
    pub code_version: u32,
    pub _pad: u32,
}

/// Set in [`PyFrameRecord::addr_owner`]'s owner bits of a 3.11 frame whose `is_entry` is set: it
/// is the first frame of an interpreter activation.
pub const ENTRY_FLAG: u8 = 4;

/// 64-bit words of a code object read for its [`code_fingerprint`].
pub const CODE_FINGERPRINT_WORDS: usize = 3;
/// The fingerprint word that points at a name of the code object (a `str`).
pub const FINGERPRINT_NAME_WORD: usize = 1;

/// A code object's identity where it has no `co_version` (before 3.12): three of its words (3.11:
/// the addresses of its name, qualified name and line table; before: of its file name, name and
/// line table) and the hash the name the second word points at caches, folded to 32 bits.
/// Addresses alone do not do: a program that makes and frees functions in a loop gets the same
/// addresses for all three objects every time, but their names differ. The eBPF program and
/// userspace compute it alike.
pub fn code_fingerprint(words: &[u64; CODE_FINGERPRINT_WORDS], name_hash: u64) -> u32 {
    let mixed = words[0] ^ words[1].rotate_left(21) ^ words[2].rotate_left(42) ^ name_hash.rotate_left(11);
    (mixed ^ (mixed >> 32)) as u32
}

impl PyFrameRecord {
    pub fn addr(&self) -> u64 {
        self.addr_owner & !7
    }

    pub fn owner(&self) -> u8 {
        (self.addr_owner & 7) as u8
    }
}

/// What the eBPF program reads of a Python thread at sample time.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PyCapture {
    /// Address of the thread's `PyThreadState`: the one userspace registered or, with
    /// [`py_proc_flags::FIND_ATTACHED`] when that one is not attached, the one attached now.
    pub tstate: u64,
    /// The thread's innermost frame (0 if it runs no Python code), read from `tstate`: on 3.13+
    /// `tstate->current_frame` and on 3.11 and 3.12 `tstate->cframe->current_frame` (both a
    /// `_PyInterpreterFrame`), before 3.11 `tstate->frame` (a `PyFrameObject`). Only meaningful
    /// with [`py_status::FRAME_READ`].
    pub frame: u64,
    /// `tstate->last_profiled_frame` and `last_profiled_frame_seq` (3.15), else 0.
    pub last_profiled_frame: u64,
    pub last_profiled_seq: u64,
    /// With `JOINED`: the established chain the walk joined and the marker's position in it.
    pub marker_gen: u64,
    pub marker_position: u32,
    /// `py_status` bits.
    pub status: u32,
    /// Frames walked, innermost first, in [`SampleRecord::py_frames`].
    pub frames_len: u32,
    pub _pad: u32,
}

/// The leading `u32` of every record in the `SAMPLES` ring buffer: samples and process events
/// travel in one buffer, so userspace reads them in the order they happened.
pub mod record_kind {
    pub const SAMPLE: u32 = 1;
    /// The process replaced its program (`execve`); the record is a [`super::ProcessEvent`].
    pub const EXEC: u32 = 2;
    /// The process's main thread exited; the record is a [`super::ProcessEvent`].
    pub const EXIT: u32 = 3;
    /// A thread whose stacks were captured as it left the CPU came back; the record is a
    /// [`super::OffCpuEnd`].
    pub const OFF_CPU_END: u32 = 4;
    /// The waiting tasks of a thread, read at the capture just sent before it; the record is a
    /// [`super::WaitingTasks`].
    pub const WAITING_TASKS: u32 = 5;
}

/// The end of an off-CPU interval whose capture was sent when it began.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffCpuEnd {
    /// [`record_kind::OFF_CPU_END`].
    pub kind: u32,
    pub tid: u32,
    /// The capture's `time_ns`: which capture of the thread this ends.
    pub start_ns: u64,
    /// How long the thread was off CPU.
    pub away_ns: u64,
    /// How long it was off CPU, since its capture before, in intervals that began without one
    /// ([`OffCpuStart::carried_ns`]): counted with this capture's stacks.
    pub carried_ns: u64,
}

/// What a [`SampleRecord`] stands for ([`SampleRecord::origin`]).
pub mod origin {
    /// A sample of a thread on CPU (the perf event).
    pub const ON_CPU: u32 = 1;
    /// A thread leaving the CPU, captured as it left; an [`super::OffCpuEnd`] with the same tid and
    /// `time_ns` follows when it comes back, with the interval's length.
    pub const OFF_CPU: u32 = 2;
}

/// A thread of a watched process, the value of `OFF_CPU` (keyed by tid): when it last left the
/// CPU, whether its stacks were captured then, and what it may still capture.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffCpuStart {
    /// `bpf_ktime_get_ns()` when it left the CPU; 0 while it is on it.
    pub start_ns: u64,
    /// `start_ns` if its stacks were captured as it left, else 0.
    pub captured_ns: u64,
    /// Captures it may make now (at most [`OFF_CPU_BURST`]); one more is earned every
    /// `off_cpu_min_ns` since `earned_ns`.
    pub tokens: u64,
    pub earned_ns: u64,
    /// Its task state when it left (`prev_state`; 0: preempted, still runnable).
    pub state: u32,
    pub tgid: u32,
    /// The length of its intervals that began without a capture, by [`carry_kind`], since its
    /// last capture of that kind: sent with the end of its next captured interval of the kind,
    /// whose stacks stand for them, as a sample's stacks stand for its period.
    pub carried_ns: [u64; 2],
}

impl OffCpuStart {
    /// The uncaptured time its interval, if captured, stands for.
    pub fn carried_for_capture(&self) -> u64 {
        self.carried_ns[carry_kind(self.state)]
    }
}

/// Which of [`OffCpuStart::carried_ns`] holds an interval left in task state `state`: preemptions
/// (0) apart from waits, so short sleeps never count under a preemption's stacks, nor the reverse.
pub const fn carry_kind(state: u32) -> usize {
    (state == 0) as usize
}

/// Captures a thread may make in a row as it leaves the CPU before it is held to one per
/// `--off-cpu-min`: a thread preempted just before it sleeps still has its sleep captured.
pub const OFF_CPU_BURST: u64 = 16;

/// An exec or exit of a (targeted) process, as sent through the `SAMPLES` ring buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessEvent {
    /// [`record_kind::EXEC`] or [`record_kind::EXIT`].
    pub kind: u32,
    pub tgid: u32,
    /// `bpf_ktime_get_ns()` at the event.
    pub time_ns: u64,
    /// The new program's `comm` (after exec) or the exiting one's.
    pub comm: [u8; COMM_LEN],
}

/// One sample, as sent through the `SAMPLES` ring buffer.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SampleRecord {
    /// [`record_kind::SAMPLE`].
    pub kind: u32,
    pub tgid: u32,
    pub tid: u32,
    pub cpu: u32,
    /// Number of valid entries in `user_stack`.
    pub user_len: u32,
    /// Number of valid entries in `kernel_stack`.
    pub kernel_len: u32,
    /// Number of valid entries in `user_frame_bases`.
    pub frame_bases_len: u32,
    /// `user_status` bits.
    pub user_status: u32,
    /// `bpf_ktime_get_ns()` at the sample.
    pub time_ns: u64,
    pub comm: [u8; COMM_LEN],
    pub py: PyCapture,
    /// The user stack pointer at the sample.
    pub user_sp: u64,
    /// The user frame pointer (rbp) at the sample: CFI unwinding starts from ip, sp and it.
    pub user_bp: u64,
    /// Bytes of the user stack copied from `user_sp` up; they follow the Python frames sent.
    pub stack_len: u32,
    /// [`origin`] constant.
    pub origin: u32,
    /// Nanoseconds the record stands for, where known when it is sent: 0 for a sample (it stands
    /// for a period) and for a capture as a thread leaves the CPU (its [`OffCpuEnd`] says).
    pub weight_ns: u64,
    /// Off CPU: the task state the thread left the CPU in (0: preempted, still runnable).
    pub wait_state: u32,
    pub _pad2: u32,
    /// Return addresses, innermost first.
    pub user_stack: [u64; MAX_USER_FRAMES],
    /// The frame pointer of each user frame, innermost first: entry `i` is the frame base of the
    /// function at `user_stack[i]`, so its locals lie between entry `i - 1` (or `user_sp`) and it.
    /// The merge finds which native frame holds each interpreter entry frame with these.
    pub user_frame_bases: [u64; MAX_USER_FRAMES],
    pub kernel_stack: [u64; MAX_KERNEL_FRAMES],
    /// The running asyncio task and those awaiting it (`py_proc_flags::TASKS`).
    pub tasks: TaskCapture,
    /// The Python frames walked at the sample, then the awaiting tasks' coroutine frames
    /// (`tasks`); only `py.frames_len` plus `tasks.frames_len` of them are sent.
    pub py_frames: [PyFrameRecord; MAX_PY_FRAMES],
    /// Room for the stack copy, which is sent right after the Python frames sent: a record is
    /// [`SampleRecord::sent_len`] bytes long. One chunk more than the most copied, so the eBPF
    /// program's writes are in bounds by construction.
    pub stack_tail: [u8; STACK_SNAPSHOT_MAX + STACK_CHUNK],
}

impl SampleRecord {
    /// Bytes before `py_frames`: every record carries at least these.
    pub const HEADER_LEN: usize = core::mem::offset_of!(SampleRecord, py_frames);

    /// Python frames the record carries: the walked ones and the awaiting tasks' (at most
    /// [`MAX_PY_FRAMES`] together, in a well-formed record).
    pub fn frames_sent(&self) -> usize {
        self.py.frames_len as usize + self.tasks.frames_len as usize
    }

    /// Bytes sent for a record carrying `frames` Python frames and `stack` bytes of stack.
    pub const fn sent_len(frames: usize, stack: usize) -> usize {
        Self::HEADER_LEN + frames * core::mem::size_of::<PyFrameRecord>() + stack
    }
}

/// Bits of [`PyProcConfig::flags`].
pub mod py_proc_flags {
    /// Stop the walk at a `last_profiled_frame` marker that matches the thread's `PY_MARKERS` entry.
    pub const USE_MARKER: u32 = 1 << 0;
    /// The process has subinterpreters: a thread may have a thread state in each, and switch
    /// between them faster than userspace reads the thread list. At each sample, the thread state
    /// attached to the thread is looked up in the interpreters' thread lists.
    pub const FIND_ATTACHED: u32 = 1 << 1;
    /// Read the thread's running asyncio task and the tasks awaiting it (`--async-aware`; the
    /// `asyncio` fields are set).
    pub const TASKS: u32 = 1 << 2;
}

/// Steps of the look-up of a thread's state in the thread lists at most (when the registered one
/// is no longer the thread's, or with `FIND_ATTACHED` not attached): one per thread state or
/// interpreter visited.
pub const MAX_ATTACHED_STEPS: u32 = 256;

/// A Python thread, the value of `PY_THREADS` (keyed by the host's thread id).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyThreadEntry {
    /// The thread state userspace found the thread in when it last read the thread list.
    pub tstate: u64,
    /// The thread's id in its process's PID namespace (`native_thread_id`): how its thread states
    /// name it, for `FIND_ATTACHED`.
    pub ns_tid: u32,
    /// The thread's process: the entry holds for no other process's thread of that id.
    pub tgid: u32,
}

/// A thread's established marker chain, the value of `PY_MARKERS` (keyed by tid). Userspace
/// proved, when it wrote the marker, that the frames rootward of `addrs[0]` are the chain it keeps
/// for generation `gen`; after `k` pops of the marker frame the interpreter has moved the marker to
/// `addrs[k]` and bumped the sequence number by `k`. A value is never read half-written: the map
/// is not preallocated, so an update links a new element and the old one is freed only after the
/// readers' RCU grace period.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MarkerChain {
    pub gen: u64,
    pub seq_base: u64,
    pub len: u32,
    pub _pad: u32,
    pub addrs: [u64; MARKER_POSITIONS],
}

/// Marks a field that a CPython version does not have.
pub const NO_OFFSET: u32 = u32::MAX;

/// Where to read a Python process's thread and frame fields: one `PY_PROCS` entry per tgid.
/// Offsets are byte offsets; [`NO_OFFSET`] marks a field the version does not have.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PyProcConfig {
    /// `py_proc_flags` bits.
    pub flags: u32,
    /// Frames walked at most (at most [`MAX_PY_FRAMES`]).
    pub max_frames: u32,
    pub tstate_current_frame: u32,
    pub tstate_last_profiled_frame: u32,
    pub tstate_last_profiled_seq: u32,
    pub frame_previous: u32,
    pub frame_executable: u32,
    pub frame_instr_ptr: u32,
    /// `owner` (3.11+); [`NO_OFFSET`] before.
    pub frame_owner: u32,
    /// `co_version` in a code object; [`NO_OFFSET`] before 3.12 (see `code_fingerprint`).
    pub code_version: u32,
    /// Bytes read per frame: up to the last field the walk needs (at most [`PY_FRAME_WINDOW`]), so a
    /// read never runs past the frame into memory that may not be mapped.
    pub frame_window: u32,
    /// 3.11 and 3.12: where the `_PyCFrame` pointer sits in the thread state; the current frame is
    /// then read at `tstate_current_frame` in the `_PyCFrame`. [`NO_OFFSET`] from 3.13 on.
    pub tstate_cframe: u32,
    /// Bits cleared from `f_executable` before use (its tag bits; 0 where it is not tagged).
    pub executable_tag_mask: u64,
    /// The address of `_PyRuntime.interpreters.head`, and where to read the interpreter and
    /// thread lists (whether the registered state is still listed, which state is a thread's when
    /// it is not), a thread state's thread id and, for `FIND_ATTACHED`, its attached bit
    /// (`_status`, `status_attached`).
    pub interpreters_head: u64,
    pub interp_next: u32,
    pub interp_threads_head: u32,
    pub tstate_prev: u32,
    pub tstate_next: u32,
    pub tstate_interp: u32,
    pub tstate_native_thread_id: u32,
    /// Before 3.11: `tstate_native_thread_id` is `thread_id`, the thread's `pthread_t`, and this is
    /// where the C library's thread descriptor it points at keeps the thread's id. [`NO_OFFSET`]
    /// from 3.11 on.
    pub pthread_tid: u32,
    pub _pad: u32,
    pub tstate_status: u32,
    pub status_attached: u32,
    /// Before 3.12: where the code object's [`code_fingerprint`] words start (`code_version` is
    /// then [`NO_OFFSET`]); [`NO_OFFSET`] from 3.12 on.
    pub code_fingerprint: u32,
    /// 3.11: the `is_entry` byte of a frame, reported as [`ENTRY_FLAG`]; [`NO_OFFSET`] from 3.12
    /// on (entry frames have their own owner).
    pub frame_is_entry: u32,
    /// With `code_fingerprint`: where a `str` caches its hash.
    pub str_hash: u32,
    /// For `config_flags::GIL`, 3.12+: where the interpreter points at its GIL, and where the GIL
    /// keeps `locked` and `last_holder` (the interpreter is the first listed at `interpreters_head`).
    pub interp_ceval_gil: u32,
    pub gil_locked: u32,
    pub gil_holder: u32,
    /// Before 3.12: the address of `_PyRuntime.gilstate.tstate_current` (the holder, 0 when none);
    /// 0 from 3.12 on.
    pub runtime_gil_holder: u64,
    /// With `py_proc_flags::TASKS`.
    pub asyncio: AsyncioConfig,
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C) plain data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::Config {}
    // SAFETY: repr(C) plain data, no padding beyond the explicit field.
    unsafe impl aya::Pod for super::ClockSlot {}
    // SAFETY: repr(C) plain data without padding (the timer's 16 bytes, then 8-byte fields).
    unsafe impl aya::Pod for super::Tick<[u64; 2]> {}
    // SAFETY: repr(C) plain data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::PyProcConfig {}
    // SAFETY: repr(C) plain data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::PyCapture {}
    // SAFETY: repr(C) plain data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::PyThreadEntry {}
    // SAFETY: repr(C) plain data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::MarkerChain {}
    // SAFETY: repr(C) plain data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::OffCpuStart {}
    // SAFETY: repr(C) plain data with explicit padding and no invalid bit patterns.
    unsafe impl aya::Pod for super::TaskCapture {}
}
