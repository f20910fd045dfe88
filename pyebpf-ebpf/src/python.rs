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
    py.tstate = thread_state(config, &thread);
    if py.tstate == UNKNOWN_STATE {
        debug!(ctx, "tid {}: cannot look up its thread state", tid);
        return false;
    }
    py.status |= py_status::THREAD_KNOWN;
    if gil && py.tstate != 0 && holds_gil(config, py.tstate) {
        py.status |= py_status::HOLDS_GIL;
    }
    // No thread state names the thread: it runs no Python code now (a C thread between calls
    // into Python, whose state goes at each `PyGILState_Release`).
    let frame = if py.tstate == 0 { Some(0) } else { current_frame(config, py.tstate) };
    let Some(frame) = frame else {
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

/// What [`thread_state`] and [`find_state`] give where the thread lists cannot be read to their
/// end (no thread state lies there). A plain value, not an `Option`: the verifier refuses reads of
/// the undefined payload of a `None` that the compiler may make.
const UNKNOWN_STATE: u64 = u64::MAX;

/// The thread state the thread runs in now, 0 if none is its, or [`UNKNOWN_STATE`]. The
/// registered one, if it is still the thread's (a C thread calling into Python gets a new state
/// at each `PyGILState_Ensure`, and the old one's memory may be another thread's state by then)
/// and, with `FIND_ATTACHED`, still attached; otherwise the one the interpreters' thread lists
/// give the thread (attached, with `FIND_ATTACHED`), or else the registered one while it is
/// still the thread's (parked at the call that switched interpreters).
#[inline(always)]
fn thread_state(config: &PyProcConfig, thread: &PyThreadEntry) -> u64 {
    let find_attached = config.flags & py_proc_flags::FIND_ATTACHED != 0;
    let owned = names_thread(config, thread.tstate, thread.ns_tid) && is_listed(config, thread.tstate);
    if owned && (!find_attached || is_attached(config, thread.tstate)) {
        return thread.tstate;
    }
    let found = find_state(config, thread.ns_tid, find_attached);
    if found != 0 && found != UNKNOWN_STATE {
        found
    } else if owned {
        thread.tstate
    } else {
        found
    }
}

/// Whether the thread state at `tstate` names thread `ns_tid` as its own: `native_thread_id`, or
/// before 3.11 the thread id in the C library's descriptor its `thread_id` points at.
fn names_thread(config: &PyProcConfig, tstate: u64, ns_tid: u32) -> bool {
    let Some(id) = read_u64(tstate + config.tstate_native_thread_id as u64) else { return false };
    if config.pthread_tid == NO_OFFSET {
        return id == ns_tid as u64;
    }
    read_u32(id + config.pthread_tid as u64).is_some_and(|tid| tid == ns_tid)
}

/// Whether the thread state at `tstate` is in its interpreter's thread list: the `next` of the
/// state before it, or the list's head. A freed state keeps the thread id it had, and is not
/// (a state being added beside it may make this false for a moment: a look-up settles that).
fn is_listed(config: &PyProcConfig, tstate: u64) -> bool {
    let Some(prev) = read_u64(tstate + config.tstate_prev as u64) else { return false };
    let link = if prev == 0 {
        let Some(interp) = read_u64(tstate + config.tstate_interp as u64) else { return false };
        interp + config.interp_threads_head as u64
    } else {
        prev + config.tstate_next as u64
    };
    read_u64(link).is_some_and(|linked| linked == tstate)
}

fn is_attached(config: &PyProcConfig, tstate: u64) -> bool {
    read_u32(tstate + config.tstate_status as u64).is_some_and(|status| status & config.status_attached != 0)
}

/// A look-up of a thread's state in the interpreters' thread lists, shared between `find_state`
/// and its `bpf_loop` steps.
struct StateSearch {
    config: *const PyProcConfig,
    ns_tid: u32,
    attached_only: bool,
    /// The interpreter whose thread list comes next.
    next_interp: u64,
    /// The thread state to look at next; 0 at the end of an interpreter's list.
    tstate: u64,
    found: u64,
    /// The lists were read to their end.
    ended: bool,
}

/// The thread state of thread `ns_tid` (attached to it, with `attached_only`) in the interpreters'
/// thread lists: 0 if none is, [`UNKNOWN_STATE`] if the lists cannot be read to their end.
fn find_state(config: &PyProcConfig, ns_tid: u32, attached_only: bool) -> u64 {
    let Some(head) = read_u64(config.interpreters_head) else { return UNKNOWN_STATE };
    let mut search = StateSearch { config, ns_tid, attached_only, next_interp: head, tstate: 0, found: 0, ended: false };
    // SAFETY: the callback is a BPF subprogram taking this context; the kernel bounds the count,
    // which also ends a list that loops.
    unsafe { generated::bpf_loop(MAX_ATTACHED_STEPS, state_step as *mut c_void, &mut search as *mut StateSearch as *mut c_void, 0) };
    if search.found != 0 || search.ended {
        search.found
    } else {
        UNKNOWN_STATE
    }
}

/// One thread state, or the start of the next interpreter's list: 0 goes on, 1 stops.
///
/// # Safety
/// `context` must be the `StateSearch` of `find_state`, whose `config` outlives the loop.
#[inline(never)]
unsafe extern "C" fn state_step(_index: u64, context: *mut c_void) -> i64 {
    // SAFETY: bpf_loop passes find_state's `StateSearch` back unchanged.
    let search = unsafe { &mut *(context as *mut StateSearch) };
    // SAFETY: find_state's caller's copy, alive for the whole loop.
    let config = unsafe { &*search.config };
    if search.tstate == 0 {
        let interp = search.next_interp;
        if interp == 0 {
            search.ended = true;
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
    let Some(next) = read_u64(tstate + config.tstate_next as u64) else { return 1 };
    if names_thread(config, tstate, search.ns_tid) && (!search.attached_only || is_attached(config, tstate)) {
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
