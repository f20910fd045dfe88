//! The thread's interpreter state, read in the kernel at the capture: its frame chain from the
//! innermost frame (on 3.15 only down to a marker userspace proved it knows) and whether it holds
//! the GIL.

use core::ffi::c_void;

use aya_ebpf::{helpers::generated, EbpfContext};
use aya_log_ebpf::debug;
use pyebpf_common::{
    py_proc_flags, py_status, PyCapture, PyFrameRecord, PyProcConfig, PyThreadEntry, MARKER_POSITIONS, MAX_ATTACHED_STEPS, MAX_PY_FRAMES, NO_OFFSET,
    PY_FRAME_WINDOW,
};

use crate::frame::{frame_record, window_u64};
use crate::read::{read_u32, read_u64};
use crate::{PY_MARKERS, PY_PROCS, PY_THREADS};

/// The Python process `tgid` and its thread `tid` as userspace registered them, if it did.
#[inline(always)]
pub fn registered(tgid: u32, tid: u32) -> Option<(&'static PyProcConfig, &'static PyThreadEntry)> {
    // SAFETY: plain-data values; a concurrent update from userspace at worst gives a stale entry,
    // which the reads of the capture tolerate.
    let (config, thread) = unsafe { (PY_PROCS.get(tgid)?, PY_THREADS.get(tid)?) };
    (thread.tgid == tgid).then_some((config, thread))
}

/// Reads the state of thread `tid` (registered as `thread`) and walks its frame chain from the
/// innermost frame: to the root, to the depth limit, or (3.15) to a marker whose established
/// chain userspace holds, so at steady state only the frames that ran since the last capture are
/// read. With `gil`, also whether the thread holds the GIL. Returns whether its innermost frame
/// was read.
#[inline(always)]
pub fn capture_python<C: EbpfContext>(
    ctx: &C,
    config: &PyProcConfig,
    thread: PyThreadEntry,
    tid: u32,
    gil: bool,
    py: &mut PyCapture,
    frames: &mut [PyFrameRecord; MAX_PY_FRAMES],
) -> bool {
    py.tstate = thread.tstate;
    // The registered state, still attached, needs no look-up (a thread mostly stays put).
    if config.flags & py_proc_flags::FIND_ATTACHED != 0
        && read_u32(thread.tstate + config.tstate_status as u64).is_none_or(|status| status & config.status_attached == 0)
    {
        let attached = find_attached(config, thread.ns_tid);
        if attached != 0 {
            py.tstate = attached;
        }
    }
    py.status |= py_status::THREAD_KNOWN;
    if gil && holds_gil(config, py.tstate) {
        py.status |= py_status::HOLDS_GIL;
    }
    let Some(frame) = current_frame(config, py.tstate) else {
        debug!(ctx, "tid {}: cannot read its thread state at {:x}", tid, py.tstate);
        return false;
    };
    py.frame = frame;
    py.status |= py_status::FRAME_READ;
    // The thread's marker chain belongs to the thread state userspace registered.
    let stop_at = if py.tstate == thread.tstate { marker_stop(tid, config, py) } else { 0 };
    walk_frames(config, frame, stop_at, py, frames);
    true
}

/// Whether the GIL is held by `tstate`: before 3.12 the runtime points at its holder (0 once
/// released); from 3.12 the first interpreter's GIL is `locked` with `last_holder` set to it.
fn holds_gil(config: &PyProcConfig, tstate: u64) -> bool {
    if config.runtime_gil_holder != 0 {
        return read_u64(config.runtime_gil_holder) == Some(tstate);
    }
    if config.interp_ceval_gil == NO_OFFSET {
        return false;
    }
    let Some(interp) = read_u64(config.interpreters_head) else { return false };
    let Some(gil) = read_u64(interp + config.interp_ceval_gil as u64) else { return false };
    gil != 0 && read_u32(gil + config.gil_locked as u64).is_some_and(|locked| locked != 0) && read_u64(gil + config.gil_holder as u64) == Some(tstate)
}
/// The innermost frame of a thread state: `tstate->current_frame` (3.13+; `tstate->frame` before
/// 3.11), or on 3.11 and 3.12 `tstate->cframe->current_frame` (no `_PyCFrame`, no Python running: 0).
fn current_frame(config: &PyProcConfig, tstate: u64) -> Option<u64> {
    let holder = if config.tstate_cframe == NO_OFFSET {
        tstate
    } else {
        match read_u64(tstate + config.tstate_cframe as u64)? {
            0 => return Some(0),
            cframe => cframe,
        }
    };
    read_u64(holder + config.tstate_current_frame as u64)
}

/// A look-up of the thread state attached to a thread, shared between `find_attached` and its
/// `bpf_loop` steps.
struct AttachedSearch {
    config: *const PyProcConfig,
    ns_tid: u64,
    /// The interpreter whose thread list comes next.
    next_interp: u64,
    /// The thread state to look at next; 0 at the end of an interpreter's list.
    tstate: u64,
    found: u64,
}

/// The thread state of thread `ns_tid` that is attached to it now (the one whose interpreter it
/// runs in), found in the interpreters' thread lists; 0 if none is (the thread is between
/// interpreters or waits without one) or the lists cannot be read.
fn find_attached(config: &PyProcConfig, ns_tid: u32) -> u64 {
    let Some(head) = read_u64(config.interpreters_head) else { return 0 };
    let mut search = AttachedSearch { config, ns_tid: ns_tid as u64, next_interp: head, tstate: 0, found: 0 };
    // SAFETY: the callback is a BPF subprogram taking this context; the kernel bounds the count,
    // which also ends a list that loops.
    unsafe { generated::bpf_loop(MAX_ATTACHED_STEPS, attached_step as *mut c_void, &mut search as *mut AttachedSearch as *mut c_void, 0) };
    search.found
}

/// One thread state, or the start of the next interpreter's list: 0 goes on, 1 stops.
///
/// # Safety
/// `context` must be the `AttachedSearch` of `find_attached`, whose `config` outlives the loop.
#[inline(never)]
unsafe extern "C" fn attached_step(_index: u64, context: *mut c_void) -> i64 {
    // SAFETY: bpf_loop passes find_attached's `AttachedSearch` back unchanged.
    let search = unsafe { &mut *(context as *mut AttachedSearch) };
    // SAFETY: find_attached's caller's copy, alive for the whole loop.
    let config = unsafe { &*search.config };
    if search.tstate == 0 {
        let interp = search.next_interp;
        if interp == 0 {
            return 1;
        }
        let (Some(head), Some(next)) = (read_u64(interp + config.interp_threads_head as u64), read_u64(interp + config.interp_next as u64)) else {
            return 1;
        };
        search.tstate = head;
        search.next_interp = next;
        return 0;
    }
    let tstate = search.tstate;
    let (Some(id), Some(status), Some(next)) = (
        read_u64(tstate + config.tstate_native_thread_id as u64),
        read_u32(tstate + config.tstate_status as u64),
        read_u64(tstate + config.tstate_next as u64),
    ) else {
        return 1;
    };
    if id == search.ns_tid && status & config.status_attached != 0 {
        search.found = tstate;
        return 1;
    }
    search.tstate = next;
    0
}

/// Whether the thread's walk may stop at the marker: userspace asks for it, and the version has
/// one (3.15's `last_profiled_frame`).
#[inline(always)]
pub fn uses_marker(config: &PyProcConfig) -> bool {
    config.flags & py_proc_flags::USE_MARKER != 0 && config.tstate_last_profiled_frame != NO_OFFSET && config.tstate_last_profiled_seq != NO_OFFSET
}

/// The frame at which the walk may stop: the current marker, when it sits where the thread's
/// established chain says `k` pops of the marker frame put it (the sequence number moved by `k`).
fn marker_stop(tid: u32, config: &PyProcConfig, py: &mut PyCapture) -> u64 {
    if !uses_marker(config) {
        return 0;
    }
    let (Some(marker), Some(seq)) =
        (read_u64(py.tstate + config.tstate_last_profiled_frame as u64), read_u64(py.tstate + config.tstate_last_profiled_seq as u64))
    else {
        return 0;
    };
    py.last_profiled_frame = marker;
    py.last_profiled_seq = seq;
    // SAFETY: plain data; entries are replaced whole (the map is not preallocated).
    let Some(chain) = (unsafe { PY_MARKERS.get(tid) }) else { return 0 };
    let position = seq.wrapping_sub(chain.seq_base);
    if marker == 0 || chain.gen == 0 || position >= chain.len as u64 || position >= MARKER_POSITIONS as u64 {
        return 0;
    }
    if chain.addrs[position as usize & (MARKER_POSITIONS - 1)] != marker {
        return 0;
    }
    py.marker_gen = chain.gen;
    py.marker_position = position as u32;
    marker
}

/// One frame-chain walk, shared between `walk_frames` and its `bpf_loop` steps.
struct Walk {
    config: *const PyProcConfig,
    frames: *mut PyFrameRecord,
    addr: u64,
    stop_at: u64,
    walked: u32,
    end: u32,
    /// Here rather than in the step, so it is not cleared for every frame.
    window: [u8; PY_FRAME_WINDOW],
}

#[inline(never)]
fn walk_frames(config: &PyProcConfig, addr: u64, stop_at: u64, py: &mut PyCapture, frames: &mut [PyFrameRecord; MAX_PY_FRAMES]) {
    let max = if config.max_frames as usize > MAX_PY_FRAMES { MAX_PY_FRAMES } else { config.max_frames as usize };
    let mut walk = Walk { config, frames: frames.as_mut_ptr(), addr, stop_at, walked: 0, end: py_status::TOO_DEEP, window: [0; PY_FRAME_WINDOW] };
    // bpf_loop, not a bounded loop: the verifier checks one step instead of every iteration (the
    // 512-iteration loop cost about 0.3 s of verification at each start).
    // SAFETY: the callback is a BPF subprogram taking this context; the kernel bounds the count.
    unsafe { generated::bpf_loop(max as u32, walk_step as *mut c_void, &mut walk as *mut Walk as *mut c_void, 0) };
    py.frames_len = walk.walked;
    // A chain of exactly `max` frames ended with the last step.
    py.status |= if walk.end == py_status::TOO_DEEP && walk.addr == 0 { py_status::COMPLETE } else { walk.end };
}

/// One frame of the walk: 0 goes on to the next frame, 1 stops.
///
/// # Safety
/// `context` must be the `Walk` of `walk_frames`, whose `config` outlives the loop and whose
/// `frames` points at `MAX_PY_FRAMES` records.
#[inline(never)]
unsafe extern "C" fn walk_step(index: u64, context: *mut c_void) -> i64 {
    // SAFETY: bpf_loop passes walk_frames' `Walk` back unchanged.
    let walk = unsafe { &mut *(context as *mut Walk) };
    if walk.addr == 0 {
        walk.end = py_status::COMPLETE;
        return 1;
    }
    if index >= MAX_PY_FRAMES as u64 {
        return 1;
    }
    // SAFETY: walk_frames' caller's copy, alive for the whole loop.
    let config = unsafe { &*walk.config };
    let addr = walk.addr;
    let Some(record) = frame_record(config, addr, &mut walk.window) else {
        walk.end = py_status::READ_FAILED;
        return 1;
    };
    // SAFETY: `index` < MAX_PY_FRAMES, the length of the array `frames` points into.
    unsafe { *walk.frames.add(index as usize) = record };
    walk.walked = index as u32 + 1;
    if addr == walk.stop_at {
        walk.end = py_status::JOINED;
        return 1;
    }
    walk.addr = window_u64(&walk.window, config.frame_previous);
    0
}
