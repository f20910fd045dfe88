//! The user stack at a capture: the thread's user registers, the frame-pointer walk, the unwind
//! by rules userspace derived from call frame information, and the copy of the stack for CFI
//! unwinding in userspace where those rules do not reach.

use core::ffi::c_void;
use core::mem::size_of;

use aya_ebpf::{
    helpers::{bpf_get_current_task_btf, bpf_probe_read_kernel, bpf_probe_read_user, bpf_task_pt_regs, generated},
    EbpfContext,
};
use pyebpf_common::unwind::{
    unwind_row, UnwindPage, UnwindPageKey, UNWIND_PAGE_ROWS, UNWIND_PAGE_SIZE, UNWIND_STRETCHES, UNWIND_STRETCH_ROWS, UNWIND_STRETCH_SIZE,
};
use pyebpf_common::{config_flags, user_status, Config, SampleRecord, MAX_USER_FRAMES, STACK_CHUNK, STACK_SNAPSHOT_MAX};

use crate::{KNOWN_PROCS, SNAPSHOT_PROCS, UNWIND_PAGES};

/// What a sample's user stack needs beyond its frame-pointer walk.
pub enum StackCopy {
    /// Nothing: the walk is its stack.
    None,
    /// A copy: its walk broke in a process userspace has not decided for yet, which judges the
    /// walk against what the copy unwinds to.
    Undecided,
    /// Unwinding by rules, or a copy where they do not reach: every sample's (`--unwind dwarf`),
    /// or its process's, whose stacks userspace asked to be copied (it reads no walk of them).
    Settled,
}

/// What the sample of `tgid`, whose walk ended with `status`, needs beyond its walk.
pub fn stack_copy(config: &Config, tgid: u32, status: u32) -> StackCopy {
    if config.flags & config_flags::SNAPSHOT_ALL != 0 || SNAPSHOT_PROCS.get_ptr(tgid).is_some() {
        StackCopy::Settled
    } else if config.flags & config_flags::SNAPSHOT_UNKNOWN != 0 && status & user_status::FP_COMPLETE == 0 && KNOWN_PROCS.get_ptr(tgid).is_none() {
        StackCopy::Undecided
    } else {
        StackCopy::None
    }
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

/// An unwind by rules, shared between `unwind_by_rules` and its `bpf_loop` steps.
struct RulesWalk {
    record: *mut SampleRecord,
    key: UnwindPageKey,
    /// The frame being unwound: its instruction (or return) address and registers. Its index is
    /// the record's `frame_bases_len`: kept in map memory, which the verifier does not follow
    /// value by value, it checks one step for all frames rather than one per frame.
    pc: u64,
    sp: u64,
    bp: u64,
    /// Set once the walk reached the stack's root.
    root: bool,
}

/// Unwinds the user stack from `ip`, `sp`, `bp` by the rules in `UNWIND_PAGES`, into the
/// record's user stack and frame bases (CFA - 16, as userspace's unwinder reports them), with the
/// same steps and checks as that unwinder. True if it reached the stack's root; otherwise the
/// record's user stack is left part written, and the caller copies the stack instead. Not
/// inlined, and a `bpf_loop`: the verifier checks one step, not every path through 126.
#[inline(never)]
pub fn unwind_by_rules(tgid: u32, ip: u64, sp: u64, bp: u64, record: &mut SampleRecord) -> bool {
    record.user_stack[0] = ip;
    record.frame_bases_len = 0;
    let mut walk = RulesWalk { record, key: UnwindPageKey { tgid, _pad: 0, page: 0 }, pc: ip, sp, bp, root: false };
    // SAFETY: the callback is a BPF subprogram taking this context; the kernel bounds the count.
    unsafe { generated::bpf_loop((MAX_USER_FRAMES - 1) as u32, rules_step as *mut c_void, &mut walk as *mut RulesWalk as *mut c_void, 0) };
    walk.root
}

/// One frame of an unwind by rules: 0 goes on to its caller, 1 stops (at the root, or where a
/// page or rule is missing, a read fails or the stack does not grow).
///
/// # Safety
/// `context` must be the `RulesWalk` of `unwind_by_rules`, whose record outlives the loop.
#[inline(never)]
unsafe extern "C" fn rules_step(_index: u64, context: *mut c_void) -> i64 {
    // SAFETY: bpf_loop passes unwind_by_rules' `RulesWalk` back unchanged.
    let walk = unsafe { &mut *(context as *mut RulesWalk) };
    // SAFETY: unwind_by_rules' record, alive for the whole loop.
    let record = unsafe { &mut *walk.record };
    let frame = record.frame_bases_len as usize;
    if frame + 1 >= MAX_USER_FRAMES {
        return 1;
    }
    let first = frame == 0;
    // A caller's rule is that of its call instruction, just before the return address.
    let lookup = if first { walk.pc } else { walk.pc.wrapping_sub(1) };
    walk.key.page = lookup & !(UNWIND_PAGE_SIZE - 1);
    // SAFETY: a map value, read while this program runs; userspace replaces, never edits, one.
    let Some(page) = (unsafe { UNWIND_PAGES.get(walk.key) }) else { return 1 };
    let row = row_at(page, (lookup & (UNWIND_PAGE_SIZE - 1)) as u32);
    let (sp, bp) = (walk.sp, walk.bp);
    let (cfa, caller_bp) = match unwind_row::kind(row) {
        unwind_row::ROOT => return reached_root(walk, record),
        unwind_row::SP => (sp.wrapping_add(u64::from(unwind_row::cfa_words(row)) * 8), bp),
        unwind_row::SP_SAVED_BP => {
            let cfa = sp.wrapping_add(u64::from(unwind_row::cfa_words(row)) * 8);
            let saved = cfa.wrapping_sub(u64::from(unwind_row::bp_words(row)) * 8);
            // In an epilogue that popped rbp already, the slot lies below sp: rbp is the caller's.
            if first && saved < sp {
                (cfa, bp)
            } else {
                // SAFETY: a checked user read.
                let Ok(caller_bp) = (unsafe { bpf_probe_read_user(saved as *const u64) }) else { return 1 };
                (cfa, caller_bp)
            }
        }
        // A zero frame pointer ends the chain, as its root.
        unwind_row::FRAME_POINTER if bp == 0 => return reached_root(walk, record),
        unwind_row::FRAME_POINTER => {
            // SAFETY: a checked user read.
            let Ok(caller_bp) = (unsafe { bpf_probe_read_user(bp as *const u64) }) else { return 1 };
            (bp.wrapping_add(16), caller_bp)
        }
        _ => return 1,
    };
    // A stack only grows towards its root: anything else is a loop or garbage.
    if cfa <= sp {
        return 1;
    }
    // SAFETY: a checked user read.
    let Ok(ret) = (unsafe { bpf_probe_read_user((cfa - 8) as *const u64) }) else { return 1 };
    // A zero return address is the root (thread entry code clears it).
    if ret == 0 {
        return reached_root(walk, record);
    }
    record.user_frame_bases[frame] = cfa - 16;
    record.user_stack[frame + 1] = ret;
    record.frame_bases_len = frame as u32 + 1;
    (walk.pc, walk.sp, walk.bp) = (ret, cfa, caller_bp);
    0
}

/// Ends the walk at its root: the record holds its frames so far. Returns bpf_loop's "stop".
#[inline(always)]
fn reached_root(walk: &mut RulesWalk, record: &mut SampleRecord) -> i64 {
    // The frames unwound so far, and their bases: all but the root's.
    record.user_len = record.frame_bases_len + 1;
    record.user_status |= user_status::RULES_UNWOUND;
    walk.root = true;
    1
}

/// The row of `page` in force at `offset`: the last whose offset is at most it. The rows after
/// the last used stop the scan, so it needs no bound on the rows used (one the verifier would
/// follow into a path per row).
#[inline(always)]
fn row_at(page: &UnwindPage, offset: u32) -> u32 {
    let first = page.stretch_rows[(offset as u64 / UNWIND_STRETCH_SIZE) as usize & (UNWIND_STRETCHES - 1)] as usize;
    let mut row = page.rows[first & (UNWIND_PAGE_ROWS - 1)];
    for next in 1..=UNWIND_STRETCH_ROWS {
        let candidate = page.rows[(first + next) & (UNWIND_PAGE_ROWS - 1)];
        if unwind_row::offset(candidate) > offset {
            break;
        }
        row = candidate;
    }
    row
}
