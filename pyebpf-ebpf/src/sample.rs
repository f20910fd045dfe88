//! The perf-event sampler: on every CPU, at one tick of each slot of its clock (see
//! [`ClockSlot`]), a sample of whatever thread runs there.

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_get_prandom_u32, bpf_ktime_get_ns},
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

/// Whether this tick is its slot's sample; if so, what the sample stands for: the last whole
/// slot's length (0 until one ended). The slot's length does not depend on which of its ticks
/// samples, so weighting by it favours no phase; the lengths add up to the time the clock ran.
#[inline(always)]
fn slot_sample(now: u64, ticks_per_slot: u32) -> Option<u64> {
    let slot = CLOCK.get_ptr_mut(0)?;
    // SAFETY: this CPU's entry; a program does not preempt itself on one CPU.
    let slot = unsafe { &mut *slot };
    let ticks_per_slot = ticks_per_slot.max(1);
    if slot.slot_start_ns == 0 || slot.tick >= ticks_per_slot {
        if slot.slot_start_ns == 0 {
            // SAFETY: no preconditions.
            slot.phase = unsafe { bpf_get_prandom_u32() };
        } else {
            slot.last_slot_ns = now.saturating_sub(slot.slot_start_ns);
            slot.phase = slot.phase.wrapping_add(ClockSlot::STEP);
        }
        slot.slot_start_ns = now;
        slot.tick = 0;
        slot.target = ClockSlot::target(slot.phase, ticks_per_slot);
    }
    let sampled = slot.tick == slot.target;
    slot.tick += 1;
    sampled.then_some(slot.last_slot_ns)
}

/// Counts a sample taken on this CPU, for the clock thread.
#[inline(always)]
fn count_taken() {
    if let Some(slot) = CLOCK.get_ptr_mut(0) {
        // SAFETY: as in `slot_sample`.
        unsafe { (*slot).taken += 1 };
    }
}

#[inline(always)]
fn sample_with<const TASKS: bool>(ctx: PerfEventContext) -> u32 {
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(config) = CONFIG.get(0) else { return 0 };
    let Some(weight_ns) = slot_sample(now, config.ticks_per_slot) else { return 0 };
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if tgid == 0 || tgid == config.own_tgid {
        return 0;
    }
    if config.flags & config_flags::FILTER_TARGETS != 0 && TARGETS.get_ptr(tgid).is_none() {
        return 0;
    }
    count_taken();
    let on_cpu = Origin { origin: origin::ON_CPU, time_ns: now, weight_ns, wait_state: 0, scratch_half: 0, interrupted_regs: true };
    capture_and_emit::<_, TASKS>(&ctx, config, tgid, pid_tgid as u32, &on_cpu, config.flags & config_flags::KERNEL_STACK != 0);
    0
}
