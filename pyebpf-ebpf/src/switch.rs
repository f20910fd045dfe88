//! Off-CPU intervals (`--mode wall` and `off-cpu`). `sched_switch` notes when a thread of a
//! watched process blocks in a system call; `sys_exit` runs in the thread when that call returns,
//! before it runs any user code, so its user and Python stacks are still those it blocked with:
//! they are captured there and sent weighted by the time since it left the CPU. (These kernels
//! have neither kprobes nor fexit, and `sys_exit` is the first BTF-typed hook in the thread's own
//! context after it blocked.) A thread preempted outside a system call is runnable, not waiting,
//! and is not noted. Every switch and every system call on the host runs these hooks: for a thread
//! that is not watched, each is one map look-up.

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_get_current_task_btf, bpf_ktime_get_ns, bpf_probe_read_kernel, bpf_task_pt_regs},
    macros::btf_tracepoint,
    programs::BtfTracePointContext,
};
use pyebpf_common::{origin, OffCpuStart};

use crate::capture::{capture_and_emit, Origin};
use crate::{CONFIG, OFF_CPU, SHORT_WAITS, WAIT_PROCS};

/// `TASK_DEAD` in `prev_state`: the thread is exiting and never comes back.
const TASK_DEAD: u32 = 0x80;

/// `pt_regs` offsets on x86_64: the system call (-1 outside one), user instruction and stack.
const PT_REGS_ORIG_AX: usize = 15 * 8;
const PT_REGS_IP: usize = 16 * 8;
const PT_REGS_SP: usize = 19 * 8;

/// The system call, user instruction and stack pointer in the registers at `regs`.
fn call_site(regs: *const u8) -> Option<(u64, u64, u64)> {
    // SAFETY: checked kernel reads of a `pt_regs`.
    unsafe {
        let read = |offset: usize| bpf_probe_read_kernel(regs.add(offset) as *const u64).ok();
        Some((read(PT_REGS_ORIG_AX)?, read(PT_REGS_IP)?, read(PT_REGS_SP)?))
    }
}

/// `sched_switch(preempt, prev, next, prev_state)`, in the context of `prev`, the thread leaving.
#[btf_tracepoint(function = "sched_switch")]
pub fn switch_out(ctx: BtfTracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if tgid == 0 || WAIT_PROCS.get_ptr(tgid).is_none() {
        return 0;
    }
    // SAFETY: arguments 0 and 3 of sched_switch are a bool and an unsigned int.
    let (preempt, prev_state): (u64, u64) = (ctx.arg(0), ctx.arg(3));
    let state = prev_state as u32;
    // Preempted (runnable, not waiting), or exiting (never back).
    if preempt & 0xff != 0 || state == 0 || state & TASK_DEAD != 0 {
        return 0;
    }
    // SAFETY: the current task is valid during the program.
    let regs = unsafe { bpf_task_pt_regs(bpf_get_current_task_btf()) } as *const u8;
    let Some((syscall, user_ip, user_sp)) = call_site(regs) else { return 0 };
    if (syscall as i64) < 0 {
        return 0;
    }
    let tid = pid_tgid as u32;
    // Blocked again in the same call (a read woken before its data came): the interval goes on.
    // SAFETY: plain data; only this thread's own hooks write its entry.
    if unsafe { OFF_CPU.get(tid) }.is_some_and(|open| open.syscall == syscall && open.user_ip == user_ip && open.user_sp == user_sp) {
        return 0;
    }
    // SAFETY: no preconditions.
    let start = OffCpuStart { start_ns: unsafe { bpf_ktime_get_ns() }, state, tgid, syscall, user_ip, user_sp };
    // Full (more threads off CPU than it holds): the interval goes uncounted.
    let _ = OFF_CPU.insert(tid, start, 0);
    0
}

/// `sys_exit(regs, ret)`, in the context of the thread whose system call returns.
#[btf_tracepoint(function = "sys_exit")]
pub fn switch_in(ctx: BtfTracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    // SAFETY: plain data; only this thread's own hooks write its entry.
    let Some(start) = (unsafe { OFF_CPU.get(tid) }).copied() else { return 0 };
    let _ = OFF_CPU.remove(tid);
    let Some(config) = CONFIG.get(0) else { return 0 };
    // SAFETY: argument 0 of sys_exit is the thread's `pt_regs`.
    let regs: *const u8 = unsafe { ctx.arg(0) };
    // Another call than the one it blocked in (it left the CPU in a page fault, say): the stacks
    // now are not those it waited with.
    if call_site(regs) != Some((start.syscall, start.user_ip, start.user_sp)) {
        if let Some(unmatched) = SHORT_WAITS.get_ptr_mut(2) {
            // SAFETY: a per-CPU slot only this hook writes, and it does not nest on a CPU.
            unsafe { *unmatched += 1 };
        }
        return 0;
    }
    // SAFETY: no preconditions.
    let away = unsafe { bpf_ktime_get_ns() }.saturating_sub(start.start_ns);
    if away < config.off_cpu_min_ns {
        if let Some(sum) = SHORT_WAITS.get_ptr_mut(0) {
            // SAFETY: per-CPU slots only this hook writes, and it does not nest on a CPU.
            unsafe { *sum += away };
        }
        if let Some(count) = SHORT_WAITS.get_ptr_mut(1) {
            // SAFETY: as above.
            unsafe { *count += 1 };
        }
        return 0;
    }
    let off_cpu = Origin {
        origin: origin::OFF_CPU,
        weight_ns: away,
        wait_state: start.state,
        wait_syscall: start.syscall as u32,
        scratch_half: 1,
        interrupted_regs: false,
    };
    // The kernel stack here is the way out of the call, not where it waited: the call says why.
    capture_and_emit(&ctx, config, start.tgid, tid, &off_cpu, false);
    0
}
