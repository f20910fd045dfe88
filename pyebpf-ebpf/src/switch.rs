//! Off-CPU intervals (`--mode wall` and `off-cpu`), from `sched_switch`, which runs in the thread
//! leaving the CPU. A thread of a watched process that leaves is captured there, as for a sample
//! (its user, Python and kernel stacks are those it waits with, until it comes back); when it comes
//! back, the same hook (then running in another thread) sends how long it was away. A thread that
//! switches often is captured, after a burst, at most once per `--off-cpu-min` of its time; the
//! intervals that begin without a capture are summed and sent with its next captured one of the
//! same kind (a wait, or a preemption), whose stacks stand for them (as a sample's stand for its
//! period). Every switch on the host runs this
//! hook: for threads that are not watched it is two plain loads of each thread's process id and
//! a bit of an array for each.

use aya_ebpf::{helpers::bpf_ktime_get_ns, macros::btf_tracepoint, programs::BtfTracePointContext};
use pyebpf_common::{carry_kind, origin, record_kind, Config, OffCpuEnd, OffCpuStart, OFF_CPU_BURST};

use crate::capture::{capture_and_emit, Origin};
use crate::emit::emit_or_count;
use crate::{task, BPF_RB_NO_WAKEUP, CONFIG, LOST_SAMPLES, OFF_CPU, SHORT_WAITS, WAIT_PROCS};

/// `TASK_DEAD` in `prev_state`: the thread is exiting and never comes back.
const TASK_DEAD: u32 = 0x80;

/// `sched_switch(preempt, prev, next, prev_state)`, in the context of `prev`.
#[btf_tracepoint(function = "sched_switch")]
pub fn switch(ctx: BtfTracePointContext) -> u32 {
    on_switch::<false>(ctx)
}

/// `switch`, also reading asyncio tasks (`--async-aware`).
#[btf_tracepoint(function = "sched_switch")]
pub fn switch_tasks(ctx: BtfTracePointContext) -> u32 {
    on_switch::<true>(ctx)
}

#[inline(always)]
fn on_switch<const TASKS: bool>(ctx: BtfTracePointContext) -> u32 {
    // Arguments 1 and 2 are the `task_struct`s of the thread leaving the CPU (the current one)
    // and of the one coming onto it.
    let (next_tid, next_tgid) = task::ids(ctx.arg(2));
    // The idle task (0) is never watched.
    if next_tid != 0 && watched(next_tgid) {
        came_back(next_tid);
    }
    let (tid, tgid) = task::ids(ctx.arg(1));
    if tgid == 0 || !watched(tgid) {
        return 0;
    }
    let Some(config) = CONFIG.get(0) else { return 0 };
    // Argument 3 is `prev_state`, an unsigned int.
    let state = ctx.arg::<u64>(3) as u32;
    let now = leaves(config, tid, tgid, state);
    if now != 0 {
        let leaving = Origin { origin: origin::OFF_CPU, time_ns: now, wait_state: state, scratch_half: 1, interrupted_regs: false };
        capture_and_emit::<_, TASKS>(&ctx, config, tgid, tid, &leaving, true);
    }
    0
}

/// Whether `tgid`'s off-CPU intervals are captured: its bit in `WAIT_PROCS`.
fn watched(tgid: u32) -> bool {
    WAIT_PROCS.get(tgid / 64).is_some_and(|word| word & (1u64 << (tgid % 64)) != 0)
}

/// Thread `tid` comes back onto the CPU: its interval ends. A subprogram of its own, as is
/// [`leaves`]: their records would otherwise sit in the hook's stack frame, under the capture's
/// calls, whose frames together the verifier bounds at 512 bytes.
#[inline(never)]
fn came_back(tid: u32) {
    let Some(entry) = OFF_CPU.get_ptr_mut(tid) else { return };
    // SAFETY: the entry of `tid`, which only switches of `tid` change, and one switch of a thread
    // runs at a time.
    let entry = unsafe { &mut *entry };
    if entry.start_ns == 0 {
        return;
    }
    // SAFETY: no preconditions. Read only for watched threads: the clock costs in a guest.
    let now = unsafe { bpf_ktime_get_ns() };
    let away = now.saturating_sub(entry.start_ns);
    // A constant index for each kind: the verifier checks it without a bound.
    let carried = if carry_kind(entry.state) == 0 { &mut entry.carried_ns[0] } else { &mut entry.carried_ns[1] };
    if entry.captured_ns == entry.start_ns {
        let end = OffCpuEnd { kind: record_kind::OFF_CPU_END, tid, start_ns: entry.start_ns, away_ns: away, carried_ns: *carried };
        emit_or_count::<OffCpuEnd>(&end, BPF_RB_NO_WAKEUP, LOST_SAMPLES);
        *carried = 0;
    } else {
        add_short(away);
        *carried += away;
    }
    entry.start_ns = 0;
}

/// Sums an interval that began without a capture: slot 0 its nanoseconds, slot 1 the count.
fn add_short(away: u64) {
    if let Some(sum) = SHORT_WAITS.get_ptr_mut(0) {
        // SAFETY: per-CPU slots only this hook writes, and it does not nest on a CPU.
        unsafe { *sum += away };
    }
    if let Some(count) = SHORT_WAITS.get_ptr_mut(1) {
        // SAFETY: as above.
        unsafe { *count += 1 };
    }
}

/// The current thread, of a watched process, leaves the CPU: its interval starts. Returns when,
/// if it is to be captured (it has a capture left, see [`OffCpuStart::tokens`]), else 0.
#[inline(never)]
fn leaves(config: &Config, tid: u32, tgid: u32, state: u32) -> u64 {
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if state & TASK_DEAD != 0 {
        let _ = OFF_CPU.remove(tid);
        return 0;
    }
    let existing = OFF_CPU.get_ptr_mut(tid);
    // SAFETY: as in came_back.
    let (mut tokens, mut earned_ns, carried_ns) =
        existing.map_or((OFF_CPU_BURST, now, [0; 2]), |entry| unsafe { ((*entry).tokens, (*entry).earned_ns, (*entry).carried_ns) });
    // A minimum of 0 restores the whole burst at every switch.
    let earned = now.saturating_sub(earned_ns).checked_div(config.off_cpu_min_ns).unwrap_or(OFF_CPU_BURST);
    if earned > 0 {
        tokens = if tokens + earned > OFF_CPU_BURST { OFF_CPU_BURST } else { tokens + earned };
        earned_ns = now;
    }
    let capture = tokens > 0;
    if capture {
        tokens -= 1;
    }
    let entry = OffCpuStart { start_ns: now, captured_ns: if capture { now } else { 0 }, tokens, earned_ns, state, tgid, carried_ns };
    match existing {
        // In place: a thread that switches often costs no map update.
        // SAFETY: as in came_back.
        Some(slot) => unsafe { *slot = entry },
        // Full (more threads watched than it holds): the interval goes uncounted.
        None => {
            if OFF_CPU.insert(tid, entry, 0).is_err() {
                return 0;
            }
        }
    }
    if capture {
        now
    } else {
        0
    }
}
