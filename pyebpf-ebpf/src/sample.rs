//! The perf-event sampler: on every CPU, at one tick of each slot of its clock (see
//! [`ClockSlot`]), a sample of whatever thread runs there.

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_get_prandom_u32, bpf_get_smp_processor_id},
    macros::perf_event,
    programs::PerfEventContext,
};
use pyebpf_common::{config_flags, origin, ClockSlot};

use crate::capture::{capture_and_emit, Origin};
use crate::{CLOCK, CONFIG, TARGETS};

#[perf_event]
pub fn sample(ctx: PerfEventContext) -> u32 {
    sample_with::<false>(ctx)
}

/// `sample`, also reading asyncio tasks (`--async-aware`).
#[perf_event]
pub fn sample_tasks(ctx: PerfEventContext) -> u32 {
    sample_with::<true>(ctx)
}

/// Whether this tick is its slot's sample: each sample stands for one period asked for.
#[inline(always)]
fn slot_sample(ticks_per_slot: u32) -> bool {
    let Some(slot) = this_cpus_slot() else { return false };
    // SAFETY: this CPU's entry; a program does not preempt itself on one CPU.
    let slot = unsafe { &mut *slot };
    let ticks_per_slot = ticks_per_slot.max(1);
    if slot.started == 0 || slot.tick >= ticks_per_slot {
        if slot.started == 0 {
            // SAFETY: no preconditions.
            slot.phase = unsafe { bpf_get_prandom_u32() };
            slot.started = 1;
        }
        // SAFETY: no preconditions.
        slot.start_slot(ticks_per_slot, unsafe { bpf_get_prandom_u32() });
    }
    let sampled = slot.tick == slot.target;
    slot.tick += 1;
    sampled
}

/// This CPU's entry of `CLOCK`.
#[inline(always)]
fn this_cpus_slot() -> Option<*mut ClockSlot> {
    // SAFETY: no preconditions.
    CLOCK.get_ptr_mut(unsafe { bpf_get_smp_processor_id() })
}

/// Counts a sample taken on this CPU, for the clock thread.
#[inline(always)]
fn count_taken() {
    if let Some(slot) = this_cpus_slot() {
        // SAFETY: as in `slot_sample`.
        unsafe { (*slot).taken += 1 };
    }
}

#[inline(always)]
fn sample_with<const TASKS: bool>(ctx: PerfEventContext) -> u32 {
    let Some(config) = CONFIG.get(0) else { return 0 };
    if !slot_sample(config.ticks_per_slot) {
        return 0;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if tgid == 0 || tgid == config.own_tgid {
        return 0;
    }
    if config.flags & config_flags::FILTER_TARGETS != 0 && TARGETS.get_ptr(tgid).is_none() {
        return 0;
    }
    count_taken();
    let on_cpu = Origin { origin: origin::ON_CPU, time_ns: 0, wait_state: 0, scratch_half: 0, interrupted_regs: true };
    capture_and_emit::<_, TASKS>(&ctx, config, tgid, pid_tgid as u32, &on_cpu, config.flags & config_flags::KERNEL_STACK != 0);
    0
}
