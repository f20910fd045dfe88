//! The one capture every hook shares: the current thread's stacks (native user, kernel, and the
//! Python chain walked in the kernel) into a record of a given origin and weight, sent through
//! `SAMPLES`. It must run in the context of the thread it captures.

use core::ffi::c_void;
use core::mem::size_of;

use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_get_smp_processor_id, bpf_get_stack, bpf_ktime_get_ns},
    EbpfContext,
};
use pyebpf_common::{config_flags, record_kind, task_status, user_status, Config, SampleRecord, MAX_KERNEL_FRAMES, MAX_PY_FRAMES};

use crate::asyncio::emit_waiting_tasks;
use crate::python::capture_python;
use crate::user_stack::{copy_stack, stack_len, user_regs, walk_user_stack, wants_snapshot};
use crate::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, LOST, SAMPLES, SCRATCH};

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

/// Captures the current thread `tgid`/`tid` and sends the record; a full ring buffer is counted
/// as a lost sample. With `TASKS`, also its asyncio tasks, where its process's are read.
pub fn capture_and_emit<C: EbpfContext, const TASKS: bool>(ctx: &C, config: &Config, tgid: u32, tid: u32, origin: &Origin, kernel_stack: bool) {
    // SAFETY: no preconditions.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let Some(record) = SCRATCH.get_ptr_mut(cpu + origin.scratch_half * config.cpus) else { return };
    // SAFETY: `record` points at this CPU's scratch record of this origin; a program does not
    // preempt itself on one CPU, so nothing else uses it meanwhile.
    let (frames, stack_len) = unsafe {
        (*record).kind = record_kind::SAMPLE;
        (*record).tgid = tgid;
        (*record).tid = tid;
        (*record).cpu = cpu;
        (*record).time_ns = if origin.time_ns == 0 { bpf_ktime_get_ns() } else { origin.time_ns };
        (*record).comm = bpf_get_current_comm().unwrap_or([0; 16]);
        (*record).origin = origin.origin;
        (*record).weight_ns = 0;
        (*record).wait_state = origin.wait_state;
        capture_python::<C, TASKS>(
            ctx,
            tgid,
            tid,
            config.flags & config_flags::GIL != 0,
            config.flags & config_flags::WAITING_TASKS != 0,
            &mut (*record).py,
            &mut (*record).tasks,
            &mut (*record).py_frames,
        );
        let (ip, sp, bp) = user_regs(ctx, origin.interrupted_regs);
        (*record).user_sp = sp;
        (*record).user_bp = bp;
        let (user_len, bases_len, fp_complete) = walk_user_stack(ip, sp, bp, &mut (*record).user_stack, &mut (*record).user_frame_bases);
        (*record).user_len = user_len;
        (*record).frame_bases_len = bases_len;
        let mut status = if fp_complete { user_status::FP_COMPLETE } else { 0 };
        (*record).kernel_len = if kernel_stack {
            stack_len(bpf_get_stack(ctx.as_ptr(), (*record).kernel_stack.as_mut_ptr() as *mut c_void, (MAX_KERNEL_FRAMES * size_of::<u64>()) as u32, 0))
        } else {
            0
        };
        // The walked frames, then the awaiting tasks' (together at most MAX_PY_FRAMES).
        let frames = (*record).py.frames_len as usize + (*record).tasks.frames_len as usize;
        let frames = if frames > MAX_PY_FRAMES { MAX_PY_FRAMES } else { frames };
        let stack_len = if ip != 0 && wants_snapshot(config, tgid) {
            // The copy goes right after the Python frames that are sent.
            let tail = (*record).py_frames.as_mut_ptr().add(frames) as *mut u8;
            let (copied, full) = copy_stack(sp, tail);
            if full {
                status |= user_status::SNAPSHOT_FULL;
            }
            copied
        } else {
            0
        };
        (*record).user_status = status;
        (*record).stack_len = stack_len as u32;
        (frames, stack_len)
    };
    // Only the walked frames and the copied stack are sent: a record is as long as what it carries.
    let len = SampleRecord::sent_len(frames, stack_len);
    // SAFETY: `len` is at most the record's size.
    let bytes = unsafe { core::slice::from_raw_parts(record as *const u8, len) };
    // Waking the reader costs more than the rest of the capture (an interrupt, a VM exit in a
    // guest): it is woken only once a batch is pending, and otherwise polls on a short timer.
    let flags = if SAMPLES.query(BPF_RB_AVAIL_DATA) >= config.wakeup_bytes as u64 { BPF_RB_FORCE_WAKEUP } else { BPF_RB_NO_WAKEUP };
    if SAMPLES.output::<[u8]>(bytes, flags).is_err() {
        if let Some(lost) = LOST.get_ptr_mut(0) {
            // SAFETY: per-CPU slot; a program that counts here is not preempted by another that
            // does on its CPU (perf events interrupt neither the switch hooks, which run with
            // interrupts off, nor a lost count of their own, which is one instruction).
            unsafe { *lost += 1 };
        }
    }
    // SAFETY: this CPU's record, as above.
    let (waiting, time_ns, tstate) = unsafe { ((*record).tasks.status & task_status::WAITING_FOLLOWS != 0, (*record).time_ns, (*record).py.tstate) };
    if TASKS && waiting {
        emit_waiting_tasks(tgid, tid, time_ns, tstate, origin.scratch_half);
    }
}
