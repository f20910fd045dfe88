//! The timer clock: a BPF timer on every CPU that fires once in each period asked for, at an
//! instant drawn at random within it (spread over blocks of periods as [`Strata`] says), and
//! samples whatever thread it interrupts there.
//!
//! Nothing in it is periodic, so no periodic program can lock on to it, and it costs one timer
//! interrupt per sample (the perf-event clock of `sample` ticks several times per period and
//! needs a user-space thread to move its grid). The timer's callback runs in the soft interrupt
//! that follows the timer's interrupt, on the CPU and in the context of the thread it
//! interrupted, whose user registers are those saved when it entered the kernel.
//!
//! Userspace starts each CPU's clock by renaming one of its own threads, pinned to that CPU
//! (`task_rename` runs `start_tick` there); the clock stops when its map entry is written or the
//! map freed.

use core::ffi::c_void;

use aya_ebpf::{
    bindings::bpf_timer,
    btf_maps::Array,
    helpers::{bpf_get_current_pid_tgid, bpf_get_prandom_u32, bpf_get_smp_processor_id, bpf_ktime_get_ns, generated},
    macros::{btf_map, btf_tracepoint},
    programs::BtfTracePointContext,
    EbpfContext,
};
use pyebpf_common::{config_flags, origin, tick_status, Config, Strata};

use crate::capture::{capture_and_emit, CaptureContext, Origin};
use crate::{CONFIG, TARGETS, TICK_RUN_TIME};

type Tick = pyebpf_common::Tick<bpf_timer>;

/// Indexed by CPU; userspace sets its size.
#[btf_map]
static TICKS: Array<Tick, 1> = Array::new();

const CLOCK_MONOTONIC: u64 = 1;
const BPF_F_TIMER_ABS: u64 = 1;
const BPF_F_TIMER_CPU_PIN: u64 = 2;

/// Starts this CPU's clock, sampling without asyncio tasks.
#[btf_tracepoint(function = "task_rename")]
pub fn start_tick(_ctx: BtfTracePointContext) -> u32 {
    start::<false>()
}

/// Starts this CPU's clock, sampling asyncio tasks too (`--async-aware`).
#[btf_tracepoint(function = "task_rename")]
pub fn start_tick_tasks(_ctx: BtfTracePointContext) -> u32 {
    start::<true>()
}

#[inline(always)]
fn start<const TASKS: bool>() -> u32 {
    let Some(config) = CONFIG.get(0) else { return 0 };
    // Only pyebpf's own renames start a clock (any process's run this hook while it is attached).
    if (bpf_get_current_pid_tgid() >> 32) as u32 != config.own_tgid {
        return 0;
    }
    // SAFETY: no preconditions.
    let Some(tick) = TICKS.get_ptr_mut(unsafe { bpf_get_smp_processor_id() }) else { return 0 };
    // SAFETY: this CPU's entry; only this hook and the timer's callback on this CPU write it.
    let tick = unsafe { &mut *tick };
    // Any of pyebpf's threads that names itself runs this: the first on a CPU starts its clock.
    if tick.status == tick_status::STARTED {
        return 0;
    }
    let map = core::ptr::from_ref(&TICKS).cast_mut().cast::<c_void>();
    // SAFETY: the timer of an entry of the map passed, and a callback taking that map's entries.
    let ready = unsafe {
        generated::bpf_timer_init(&mut tick.timer, map, CLOCK_MONOTONIC) == 0
            && generated::bpf_timer_set_callback(&mut tick.timer, on_tick::<TASKS> as *mut c_void) == 0
    };
    if !ready {
        tick.status = tick_status::FAILED;
        return 0;
    }
    // SAFETY: no preconditions.
    tick.period_start_ns = unsafe { bpf_ktime_get_ns() };
    tick.status = if schedule(tick, config.sample_period_ns) { tick_status::STARTED } else { tick_status::FAILED };
    0
}

/// Sets the timer for a random instant of the next period (in a stratum of it drawn as
/// [`Strata`] draws it); returns whether it is set. A clock that fell a whole period behind (its
/// CPU went offline) starts its periods again from now.
#[inline(never)]
fn schedule(tick: &mut Tick, period_ns: u64) -> bool {
    let period_ns = if period_ns == 0 { 1 } else { period_ns };
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    tick.period_start_ns += period_ns;
    if tick.period_start_ns + period_ns < now {
        tick.period_start_ns = now;
    }
    // SAFETY: no preconditions.
    let stratum = tick.strata.next(|| unsafe { bpf_get_prandom_u32() });
    // A uniform instant within the stratum, as a fraction of the period in 2^-32 steps.
    // SAFETY: no preconditions.
    let within = ((u64::from(stratum) << 32) | u64::from(unsafe { bpf_get_prandom_u32() })) / u64::from(Strata::COUNT);
    // In 2^-16 steps (a 1 s period's product still fits): the eBPF target has no 128-bit product.
    let at = tick.period_start_ns + (((within >> 16) * period_ns) >> 16);
    // SAFETY: an initialised timer of a map entry.
    unsafe { generated::bpf_timer_start(&mut tick.timer, at, BPF_F_TIMER_ABS | BPF_F_TIMER_CPU_PIN) == 0 }
}

/// The timer's callback has no context of its own.
struct TimerContext;

impl EbpfContext for TimerContext {
    fn as_ptr(&self) -> *mut c_void {
        core::ptr::null_mut()
    }
}

impl CaptureContext for TimerContext {
    const IN_SOFTIRQ: bool = true;

    #[inline(always)]
    fn kernel_stack(&self, buf: *mut c_void, size: u32) -> i64 {
        // SAFETY: the current task is valid while the callback runs; `buf` holds `size` bytes.
        unsafe { generated::bpf_get_task_stack(aya_ebpf::helpers::bpf_get_current_task_btf(), buf, size, 0) }
    }
}

/// The timer fired: the clock moves on, then samples. Nothing stays live across the sample (the
/// configuration is looked up again after it): a callback's stack is the 512 bytes of eBPF, with
/// the capture's on top.
///
/// # Safety
/// Called by the kernel with the entry whose timer fired.
#[inline(never)]
unsafe extern "C" fn on_tick<const TASKS: bool>(_map: *mut c_void, _key: *mut u32, tick: *mut Tick) -> i64 {
    let Some(config) = CONFIG.get(0) else { return 0 };
    if config.flags & config_flags::RUN_TIME != 0 {
        // SAFETY: no preconditions.
        set_run_time(RUN_STARTED, unsafe { bpf_ktime_get_ns() });
    }
    // SAFETY: the entry whose timer fired, on its own CPU.
    if !schedule(unsafe { &mut *tick }, config.sample_period_ns) {
        // SAFETY: as above.
        unsafe { (*tick).status = tick_status::STOPPED };
    }
    sample_current::<TASKS>(config);
    let Some(config) = CONFIG.get(0) else { return 0 };
    if config.flags & config_flags::RUN_TIME != 0 {
        count_run();
    }
    0
}

/// Samples the thread the timer interrupted, if it is one pyebpf profiles.
#[inline(always)]
fn sample_current<const TASKS: bool>(config: &Config) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if tgid == 0 || tgid == config.own_tgid {
        return;
    }
    if config.flags & config_flags::FILTER_TARGETS != 0 && TARGETS.get_ptr(tgid).is_none() {
        return;
    }
    let on_cpu = Origin { origin: origin::ON_CPU, time_ns: 0, wait_state: 0, scratch_half: 0, interrupted_regs: false };
    capture_and_emit::<_, TASKS>(&TimerContext, config, tgid, pid_tgid as u32, &on_cpu, config.flags & config_flags::KERNEL_STACK != 0);
}

/// Slots of `TICK_RUN_TIME` (`--stats`: the kernel's own run-time statistics do not see timer
/// callbacks): the callbacks' nanoseconds, their count, and when the current one started.
const RUN_NS: u32 = 0;
const RUNS: u32 = 1;
const RUN_STARTED: u32 = 2;

#[inline(always)]
fn set_run_time(slot: u32, value: u64) {
    if let Some(entry) = TICK_RUN_TIME.get_ptr_mut(slot) {
        // SAFETY: this CPU's value.
        unsafe { *entry = value };
    }
}

/// Adds the callback that is ending to `TICK_RUN_TIME`.
#[inline(always)]
fn count_run() {
    if let (Some(ns), Some(runs), Some(started)) = (TICK_RUN_TIME.get_ptr_mut(RUN_NS), TICK_RUN_TIME.get_ptr_mut(RUNS), TICK_RUN_TIME.get_ptr(RUN_STARTED)) {
        // SAFETY: this CPU's values; no preconditions for the clock.
        unsafe {
            *ns += bpf_ktime_get_ns() - *started;
            *runs += 1;
        }
    }
}
