//! Sending a record to userspace: through `SAMPLES`, or counted in `LOST` when the ring buffer is
//! full, so userspace can say how much it missed.

use crate::{LOST, SAMPLES};

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
