//! Process lifecycle hooks (BTF-typed tracepoints, so no tracefs is needed): forks extend the
//! targets, execs and exits end what userspace knew of a process, a thread's exit its registration.

use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::btf_tracepoint,
    programs::BtfTracePointContext,
};
use aya_log_ebpf::debug;
use pyebpf_common::{config_flags, record_kind, ProcessEvent};

use crate::emit::{emit_or_count, wakeup_flags};
use crate::{task, CONFIG, KNOWN_PROCS, LOST_EVENTS, PY_MARKERS, PY_THREADS, TARGETS};

/// `sched_process_fork`: with `FOLLOW_FORKS`, a child of a target becomes a target. Its arguments are the parent's and the child's `task_struct`.
#[btf_tracepoint(function = "sched_process_fork")]
pub fn follow_fork(ctx: BtfTracePointContext) -> u32 {
    let Some(config) = CONFIG.get(0) else { return 0 };
    if config.flags & config_flags::FOLLOW_FORKS == 0 {
        return 0;
    }
    let parent_tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if TARGETS.get_ptr(parent_tgid).is_none() {
        return 0;
    }
    let (_, child_tgid) = task::ids(ctx.arg(1));
    if TARGETS.insert(child_tgid, 1, 0).is_err() {
        debug!(&ctx, "TARGETS is full: child {} of {} is not followed", child_tgid, parent_tgid);
    }
    0
}

/// `sched_process_exec`: the current task has just replaced its program, so everything
/// userspace knew of its process (classification, symbols, Python state) is stale from here on.
#[btf_tracepoint(function = "sched_process_exec")]
pub fn process_exec(ctx: BtfTracePointContext) -> u32 {
    send_process_event(&ctx, record_kind::EXEC, false);
    0
}

/// `sched_process_exit`, run as each thread exits: the thread's Python registration goes with
/// it (so userspace need not re-read thread lists to drop dead threads, and a later thread given
/// its id is not read as it). A process's main thread exiting is sent as an event, after that
/// process's last samples in the ring buffer.
#[btf_tracepoint(function = "sched_process_exit")]
pub fn process_exit(ctx: BtfTracePointContext) -> u32 {
    let tid = bpf_get_current_pid_tgid() as u32;
    // Absent entries (most exits) make these a failed look-up each.
    let _ = PY_THREADS.remove(tid);
    let _ = PY_MARKERS.remove(tid);
    send_process_event(&ctx, record_kind::EXIT, true);
    0
}

/// Sends a lifecycle event for the current process (if it is sampled) through `SAMPLES`, in order
/// with its samples; an exited target leaves `TARGETS`, so a process that reuses its PID is not one.
fn send_process_event(ctx: &BtfTracePointContext, kind: u32, leader_only: bool) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let Some(config) = CONFIG.get(0) else { return };
    if tgid == 0 || tgid == config.own_tgid || (leader_only && pid_tgid as u32 != tgid) {
        return;
    }
    if config.flags & config_flags::FILTER_TARGETS != 0 {
        if TARGETS.get_ptr(tgid).is_none() {
            return;
        }
        if kind == record_kind::EXIT {
            let _ = TARGETS.remove(tgid);
        }
    }
    // Its next samples are of a new program (or of another process reusing the PID later).
    let _ = KNOWN_PROCS.remove(tgid);
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    let time_ns = unsafe { bpf_ktime_get_ns() };
    let event = ProcessEvent { kind, tgid, time_ns, comm: bpf_get_current_comm().unwrap_or([0; 16]) };
    // Not urgent: the samples after an exec are of an unknown process, and urgent themselves.
    // Its own slot: the sampler may interrupt this program on its CPU and count samples lost.
    if !emit_or_count::<ProcessEvent>(&event, wakeup_flags(config, false), LOST_EVENTS) {
        debug!(ctx, "ring buffer full: event {} of process {} dropped", kind, tgid);
    }
}
