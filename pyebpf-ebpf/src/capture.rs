//! The one capture every hook shares: the current thread's stacks (native user, kernel, and the
//! Python chain walked in the kernel, with its asyncio tasks where asked) into a record of a given
//! origin and weight, sent through `SAMPLES`. It must run in the context of the thread it captures.

use core::ffi::c_void;
use core::mem::size_of;

use aya_ebpf::{
    helpers::{bpf_get_smp_processor_id, bpf_get_stack, bpf_ktime_get_ns, generated},
    programs::{BtfTracePointContext, PerfEventContext},
    EbpfContext,
};
use pyebpf_common::{
    config_flags, py_proc_flags, py_status, record_kind, task_status, user_status, Config, PyCapture, SampleRecord, MARKER_REESTABLISH_FRAMES,
    MAX_KERNEL_FRAMES, MAX_PY_FRAMES,
};

use crate::asyncio::{capture_tasks, clear_tasks, emit_waiting_tasks};
use crate::emit::{emit_or_count, wakeup_flags};
use crate::python::{capture_python, registered, uses_marker};
use crate::user_stack::{copy_stack, stack_copy, stack_len, unwind_by_rules, user_regs, walk_user_stack, StackCopy};
use crate::{KNOWN_PROCS, LOST_SAMPLES, PROC_SCRATCH, PY_PROCS, SCRATCH};

/// What a capture stands for: its [`pyebpf_common::origin`], when it is (0: now) and, off CPU,
/// the state the thread left the CPU in. A capture's weight is a period (a sample) or comes later
/// (an off-CPU interval).
pub struct Origin {
    pub origin: u32,
    pub time_ns: u64,
    pub wait_state: u32,
    /// Which half of `SCRATCH` the capture builds its record in: 0 for samples, 1 for switches,
    /// so neither overwrites the other's record on one CPU.
    pub scratch_half: u32,
    /// Whether `ctx` starts with the interrupted registers (a perf event's does); otherwise the
    /// user registers are those saved at kernel entry.
    pub interrupted_regs: bool,
}

/// A hook's context, as the capture uses it.
pub trait CaptureContext: EbpfContext {
    /// Whether the capture runs in a soft interrupt, above the frames of the code interrupted.
    const IN_SOFTIRQ: bool = false;

    /// Reads the current thread's kernel stack into `buf` (`size` bytes): the bytes written, or
    /// a negative error.
    #[inline(always)]
    fn kernel_stack(&self, buf: *mut c_void, size: u32) -> i64 {
        // SAFETY: a write of at most `size` bytes, the length of `buf`.
        unsafe { bpf_get_stack(self.as_ptr(), buf, size, 0) }
    }
}

impl CaptureContext for PerfEventContext {}

impl CaptureContext for BtfTracePointContext {}

/// Captures the current thread `tgid`/`tid` and sends the record; a full ring buffer is counted
/// as a lost sample. With `TASKS`, also its asyncio tasks, where its process's are read.
pub fn capture_and_emit<C: CaptureContext, const TASKS: bool>(ctx: &C, config: &Config, tgid: u32, tid: u32, origin: &Origin, kernel_stack: bool) {
    // SAFETY: no preconditions.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    // This CPU's entry of this origin in each scratch map.
    let slot = cpu + origin.scratch_half * config.cpus;
    let Some(record) = SCRATCH.get_ptr_mut(slot) else { return };
    // SAFETY: `record` points at this CPU's scratch record of this origin; a program does not
    // preempt itself on one CPU, so nothing else uses it meanwhile.
    let record = unsafe { &mut *record };
    start_record(record, cpu, tgid, tid, origin);
    capture_interpreter::<C, TASKS>(ctx, config, tgid, tid, slot, record);
    let (ip, sp) = capture_native(ctx, origin, kernel_stack, record);
    let frames = sent_frames(record);
    let copy = if ip == 0 { StackCopy::None } else { stack_copy(config, tgid, record.user_status) };
    // Unwound here where the rules reach the root; copied for userspace otherwise.
    let stack_len = match copy {
        StackCopy::Settled if unwind_by_rules(tgid, ip, sp, record.user_bp, record) => 0,
        StackCopy::Settled | StackCopy::Undecided => snapshot_stack(sp, frames, record),
        StackCopy::None => 0,
    };
    record.stack_len = stack_len as u32;
    emit_sample(config, record, frames, stack_len);
    if TASKS && record.tasks.status & task_status::WAITING_FOLLOWS != 0 {
        emit_waiting_tasks(tgid, tid, record.time_ns, record.py.tstate, origin.scratch_half);
    }
}

/// The record's header: whose capture it is, when, and what it stands for.
#[inline(always)]
fn start_record(record: &mut SampleRecord, cpu: u32, tgid: u32, tid: u32, origin: &Origin) {
    record.kind = record_kind::SAMPLE;
    record.tgid = tgid;
    record.tid = tid;
    record.cpu = cpu;
    // SAFETY: no preconditions.
    record.time_ns = if origin.time_ns == 0 { unsafe { bpf_ktime_get_ns() } } else { origin.time_ns };
    // Straight into the record: a copy on the stack would cost the timer clock's callback 16 of its
    // 512 bytes.
    // SAFETY: a write of at most the record's 16 comm bytes.
    if unsafe { generated::bpf_get_current_comm(record.comm.as_mut_ptr() as *mut c_void, record.comm.len() as u32) } != 0 {
        record.comm = [0; 16];
    }
    record.origin = origin.origin;
    record.weight_ns = 0;
    record.wait_state = origin.wait_state;
}

/// The thread's Python state where its process is registered, and with `TASKS` its asyncio tasks
/// where its process's are read (and, with `--async-aware` off CPU, that its waiting tasks follow).
/// `slot` is the capture's entry of the scratch maps.
#[inline(always)]
fn capture_interpreter<C: EbpfContext, const TASKS: bool>(ctx: &C, config: &Config, tgid: u32, tid: u32, slot: u32, record: &mut SampleRecord) {
    record.py = PyCapture::default();
    clear_tasks(&mut record.tasks);
    let Some((proc_config, thread)) = registered(tgid, tid) else { return };
    // A copy: userspace may replace the entry while the frames are read. In a map, not on the
    // stack, which the timer clock's callback has little of.
    let Some(copy) = PROC_SCRATCH.get_ptr_mut(slot) else { return };
    // SAFETY: this CPU's entry of this origin, as the record's.
    let proc_config = unsafe {
        *copy = *proc_config;
        &*copy
    };
    let gil = config.flags & config_flags::GIL != 0;
    if !capture_python(ctx, proc_config, *thread, tid, gil, &mut record.py, &mut record.py_frames) {
        return;
    }
    if TASKS && proc_config.flags & py_proc_flags::TASKS != 0 {
        if record.py.frame != 0 {
            capture_tasks(proc_config, &record.py, slot, &mut record.tasks, &mut record.py_frames);
        }
        if config.flags & config_flags::WAITING_TASKS != 0 {
            record.tasks.status |= task_status::WAITING_FOLLOWS;
        }
    }
}

/// The thread's native stacks: the frame-pointer walk of its user stack and (with
/// `kernel_stack`) its kernel stack; returns its user instruction and stack pointers.
#[inline(always)]
fn capture_native<C: CaptureContext>(ctx: &C, origin: &Origin, kernel_stack: bool, record: &mut SampleRecord) -> (u64, u64) {
    let (ip, sp, bp) = user_regs(ctx, origin.interrupted_regs);
    record.user_sp = sp;
    record.user_bp = bp;
    let (user_len, bases_len, fp_complete) = walk_user_stack(ip, sp, bp, &mut record.user_stack, &mut record.user_frame_bases);
    record.user_len = user_len;
    record.frame_bases_len = bases_len;
    record.user_status = if fp_complete { user_status::FP_COMPLETE } else { 0 };
    record.kernel_len = if kernel_stack { kernel_stack_len(ctx, record) } else { 0 };
    if kernel_stack && C::IN_SOFTIRQ {
        record.user_status |= user_status::KERNEL_IN_SOFTIRQ;
    }
    (ip, sp)
}

/// Copies the user stack from `sp` into the record, right after its `frames` Python frames that
/// are sent (for unwinding in userspace); returns the bytes copied.
#[inline(always)]
fn snapshot_stack(sp: u64, frames: usize, record: &mut SampleRecord) -> usize {
    // SAFETY: `frames` <= MAX_PY_FRAMES, and the record has room for a full copy after as many.
    let (copied, full) = unsafe { copy_stack(sp, record.py_frames.as_mut_ptr().add(frames) as *mut u8) };
    if full {
        record.user_status |= user_status::SNAPSHOT_FULL;
    }
    copied
}

/// Reads the thread's kernel stack into the record; returns its frames.
#[inline(always)]
fn kernel_stack_len<C: CaptureContext>(ctx: &C, record: &mut SampleRecord) -> u32 {
    let size = (MAX_KERNEL_FRAMES * size_of::<u64>()) as u32;
    stack_len(ctx.kernel_stack(record.kernel_stack.as_mut_ptr() as *mut c_void, size))
}

/// The Python frames the record sends: the walked frames, then the awaiting tasks' (together at
/// most MAX_PY_FRAMES).
#[inline(always)]
fn sent_frames(record: &SampleRecord) -> usize {
    let frames = record.py.frames_len as usize + record.tasks.frames_len as usize;
    if frames > MAX_PY_FRAMES {
        MAX_PY_FRAMES
    } else {
        frames
    }
}

/// Sends the record's used part: its first `frames` Python frames and the copied stack
/// (`stack_len` bytes), so a record is as long as what it carries.
#[inline(always)]
fn emit_sample(config: &Config, record: &SampleRecord, frames: usize, stack_len: usize) {
    let len = SampleRecord::sent_len(frames, stack_len);
    // SAFETY: `len` is at most the record's size.
    let bytes = unsafe { core::slice::from_raw_parts(record as *const SampleRecord as *const u8, len) };
    emit_or_count::<[u8]>(bytes, wakeup_flags(config, urgent(record)), LOST_SAMPLES);
}

/// Whether userspace must see the record soon: its process is not known yet (its Python state is
/// read from the live process), it is a Python process's thread not registered yet (a new
/// thread: its samples have Python frames once it is), or a 3.15 thread's whose walk was long
/// (its marker chain is re-established from it, and its samples join near their leaf after).
#[inline(always)]
fn urgent(record: &SampleRecord) -> bool {
    if KNOWN_PROCS.get_ptr(record.tgid).is_none() {
        return true;
    }
    let Some(proc_config) = PY_PROCS.get_ptr(record.tgid) else { return false };
    if record.py.status & py_status::THREAD_KNOWN == 0 {
        return true;
    }
    // SAFETY: a map value, read once. Only a version with a marker shortens a long walk.
    let uses_marker = uses_marker(unsafe { &*proc_config });
    // A walk this short costs little again, joined or whole: no hurry to shorten it.
    uses_marker && record.py.frames_len > MARKER_REESTABLISH_FRAMES && record.py.status & py_status::TOO_DEEP == 0
}
