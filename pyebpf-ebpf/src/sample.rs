//! The perf-event sampler: on every CPU, a sample of whatever thread runs there.

use aya_ebpf::{helpers::bpf_get_current_pid_tgid, macros::perf_event, programs::PerfEventContext};
use pyebpf_common::{config_flags, origin};

use crate::capture::{capture_and_emit, Origin};
use crate::{CONFIG, TARGETS};

#[perf_event]
pub fn sample(ctx: PerfEventContext) -> u32 {
    sample_with::<false>(ctx)
}

/// `sample`, also reading asyncio tasks (`--async-aware`).
#[perf_event]
pub fn sample_tasks(ctx: PerfEventContext) -> u32 {
    sample_with::<true>(ctx)
}

#[inline(always)]
fn sample_with<const TASKS: bool>(ctx: PerfEventContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let Some(config) = CONFIG.get(0) else { return 0 };
    if tgid == 0 || tgid == config.own_tgid {
        return 0;
    }
    if config.flags & config_flags::FILTER_TARGETS != 0 && TARGETS.get_ptr(tgid).is_none() {
        return 0;
    }
    let on_cpu = Origin { origin: origin::ON_CPU, time_ns: 0, wait_state: 0, scratch_half: 0, interrupted_regs: true };
    capture_and_emit::<_, TASKS>(&ctx, config, tgid, pid_tgid as u32, &on_cpu, config.flags & config_flags::KERNEL_STACK != 0);
    0
}
