//! An empty program on `sched_switch`, for `cargo xtask bench` only (never embedded in pyebpf): the
//! cost of any BPF hook on every context switch, the floor under pyebpf's own switch hook.
#![no_std]
#![no_main]

use aya_ebpf::{macros::btf_tracepoint, programs::BtfTracePointContext};

#[btf_tracepoint(function = "sched_switch")]
pub fn empty_switch(_ctx: BtfTracePointContext) -> u32 {
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
