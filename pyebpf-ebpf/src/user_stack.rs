//! The user stack at a capture: the thread's user registers, the frame-pointer walk, and the copy
//! of the stack for CFI unwinding in userspace.

use core::ffi::c_void;
use core::mem::size_of;

use aya_ebpf::{
    helpers::{bpf_get_current_task_btf, bpf_probe_read_kernel, bpf_probe_read_user, bpf_task_pt_regs, generated},
    EbpfContext,
};
use pyebpf_common::{config_flags, user_status, Config, MAX_USER_FRAMES, STACK_CHUNK, STACK_SNAPSHOT_MAX};

use crate::{KNOWN_PROCS, SNAPSHOT_PROCS};

/// Whether the sample carries a copy of its user stack: every sample's, a process's that
/// userspace asked for, or one whose frame-pointer walk broke in a process userspace has not
/// decided for yet.
pub fn wants_snapshot(config: &Config, tgid: u32, status: u32) -> bool {
    config.flags & config_flags::SNAPSHOT_ALL != 0
        || SNAPSHOT_PROCS.get_ptr(tgid).is_some()
        || (config.flags & config_flags::SNAPSHOT_UNKNOWN != 0 && status & user_status::FP_COMPLETE == 0 && KNOWN_PROCS.get_ptr(tgid).is_none())
}

/// Copies the user stack from `sp` up into `tail`, in chunks that end at page boundaries, until
/// [`STACK_SNAPSHOT_MAX`] bytes or a page that cannot be read (the stack's end). Returns the bytes
/// copied and whether the limit, not the stack's end, stopped the copy.
///
/// # Safety
/// `tail` must have room for `STACK_SNAPSHOT_MAX + STACK_CHUNK` bytes.
pub unsafe fn copy_stack(sp: u64, tail: *mut u8) -> (usize, bool) {
    let mut copied = 0usize;
    let mut src = sp;
    for _ in 0..(STACK_SNAPSHOT_MAX / STACK_CHUNK + 1) {
        if copied >= STACK_SNAPSHOT_MAX {
            break;
        }
        let to_page_end = STACK_CHUNK - (src as usize & (STACK_CHUNK - 1));
        let left = STACK_SNAPSHOT_MAX - copied;
        let len = if to_page_end < left { to_page_end } else { left };
        // In 1..=STACK_CHUNK, in a form the verifier can bound.
        let len = ((len.wrapping_sub(1)) & (STACK_CHUNK - 1)) + 1;
        let at = copied & (STACK_SNAPSHOT_MAX - 1);
        // SAFETY: `at + len` is within the room the caller guarantees; the user read is checked.
        if unsafe { generated::bpf_probe_read_user(tail.add(at) as *mut c_void, len as u32, src as *const c_void) } < 0 {
            break;
        }
        copied += len;
        src += len as u64;
    }
    if copied >= STACK_SNAPSHOT_MAX {
        (STACK_SNAPSHOT_MAX, true)
    } else {
        (copied, false)
    }
}

/// Frames written by `bpf_get_stack` (it returns bytes, or a negative error).
pub fn stack_len(bytes: i64) -> u32 {
    if bytes > 0 {
        (bytes as u64 / size_of::<u64>() as u64) as u32
    } else {
        0
    }
}

/// `pt_regs` field offsets on x86_64.
const PT_REGS_BP: usize = 4 * 8;
const PT_REGS_IP: usize = 16 * 8;
const PT_REGS_CS: usize = 17 * 8;
const PT_REGS_SP: usize = 19 * 8;

/// The user instruction, stack and frame pointers of the current thread, also when the sample hit
/// it in the kernel, or the capture runs in a kernel hook (then they come from the registers
/// saved at kernel entry). With `interrupted`, `ctx` starts with the interrupted registers (a
/// perf event's does).
pub fn user_regs<C: EbpfContext>(ctx: &C, interrupted: bool) -> (u64, u64, u64) {
    let regs = ctx.as_ptr() as *const u8;
    // SAFETY: with `interrupted`, the context starts with the interrupted registers.
    if interrupted && unsafe { *(regs.add(PT_REGS_CS) as *const u64) } & 3 == 3 {
        // SAFETY: as above.
        return unsafe { (*(regs.add(PT_REGS_IP) as *const u64), *(regs.add(PT_REGS_SP) as *const u64), *(regs.add(PT_REGS_BP) as *const u64)) };
    }
    // SAFETY: the current task is valid during the program; its saved user registers are read
    // with a checked kernel read.
    unsafe {
        let saved = bpf_task_pt_regs(bpf_get_current_task_btf()) as *const u8;
        if saved.is_null() {
            return (0, 0, 0);
        }
        let read = |offset: usize| bpf_probe_read_kernel(saved.add(offset) as *const u64).unwrap_or(0);
        (read(PT_REGS_IP), read(PT_REGS_SP), read(PT_REGS_BP))
    }
}

/// Unwinds the user stack through saved frame pointers, as the kernel's own user unwinder does,
/// in one pass that records each frame's return address and its frame base (the merge places
/// Python segments by the bases): one 16-byte read per frame. Stops where the chain leaves the
/// stack or stops growing towards its root. Returns (return addresses, frame bases) recorded, and
/// whether the chain ended at a zero frame pointer (its root).
pub fn walk_user_stack(ip: u64, sp: u64, mut bp: u64, stack: &mut [u64; MAX_USER_FRAMES], bases: &mut [u64; MAX_USER_FRAMES]) -> (u32, u32, bool) {
    if ip == 0 {
        return (0, 0, false);
    }
    stack[0] = ip;
    let mut frames = 1;
    let mut based = 0;
    let mut floor = sp;
    let mut complete = false;
    for (base, ret) in bases.iter_mut().zip(stack[1..].iter_mut()) {
        if bp == 0 {
            complete = true;
            break;
        }
        if bp < floor || bp & 7 != 0 {
            break;
        }
        *base = bp;
        based += 1;
        // SAFETY: a checked user read of the saved frame pointer and return address.
        let Ok(frame) = (unsafe { bpf_probe_read_user(bp as *const [u64; 2]) }) else { break };
        if frame[1] == 0 {
            break;
        }
        *ret = frame[1];
        frames += 1;
        floor = bp + 16;
        bp = frame[0];
    }
    (frames, based, complete)
}
