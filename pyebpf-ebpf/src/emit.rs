//! Sending a record to userspace: through `SAMPLES`, or counted in `LOST` when the ring buffer is
//! full, so userspace can say how much it missed; and when a record wakes the reader.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use pyebpf_common::Config;

use crate::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, LAST_WAKEUP, LOST, SAMPLES};

/// The ring buffer's flags for a record: wake the reader once a batch is pending, or once the last
/// wakeup is older than the latency bound (`urgent`: the short one). Waking the reader costs more
/// than the rest of a capture (an interrupt, a VM exit in a guest), so records otherwise wait for
/// the next wakeup; the reader, once woken, also looks again after a while on its own (see the
/// reader), so the last records of a burst do not wait for the next burst.
#[inline(always)]
pub fn wakeup_flags(config: &Config, urgent: bool) -> u64 {
    let Some(last) = LAST_WAKEUP.get_ptr_mut(0) else { return BPF_RB_FORCE_WAKEUP };
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let bound = if urgent { config.urgent_latency_ns } else { config.wakeup_latency_ns };
    // SAFETY: the array's one slot; CPUs race on it, and a lost update only wakes the reader
    // once more or once less.
    let due = now.wrapping_sub(unsafe { *last }) >= bound;
    if !due && SAMPLES.query(BPF_RB_AVAIL_DATA) < config.wakeup_bytes as u64 {
        return BPF_RB_NO_WAKEUP;
    }
    // SAFETY: as above.
    unsafe { *last = now };
    BPF_RB_FORCE_WAKEUP
}

/// Sends `record` through `SAMPLES` with the ring buffer's `flags`; if it is full, counts the
/// record in slot `lost_slot` of `LOST` instead. Returns whether the record was sent.
#[inline(always)]
pub fn emit_or_count<T: ?Sized>(record: &T, flags: u64, lost_slot: u32) -> bool {
    if SAMPLES.output::<T>(record, flags).is_ok() {
        return true;
    }
    if let Some(lost) = LOST.get_ptr_mut(lost_slot) {
        // SAFETY: a per-CPU slot, which no other program counting in it preempts on its CPU:
        // samples and switch hooks count in `LOST_SAMPLES`, and perf events interrupt neither the
        // switch hooks (which run with interrupts off) nor a count of their own (one
        // instruction); lifecycle programs, which a sample may interrupt, have `LOST_EVENTS`.
        unsafe { *lost += 1 };
    }
    false
}
