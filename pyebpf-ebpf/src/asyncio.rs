//! The thread's asyncio tasks at the capture (CPython 3.14+): the task its event loop runs, and
//! the tasks awaiting it in turn, each with its name and, for the awaiting ones, the frames of
//! their suspended coroutines. Read here, at the capture, because a task's name, its awaiters and
//! its suspended frames change (or are freed and reused) as soon as the loop moves on.

use core::ffi::c_void;

use aya_ebpf::helpers::{bpf_probe_read_user, generated};
use pyebpf_common::{
    task_status, type_flags, AsyncioConfig, PyFrameRecord, PyProcConfig, TaskCapture, TaskRecord, MAX_AWAITER_FRAMES, MAX_AWAITER_LINKS, MAX_PY_FRAMES,
    MAX_TASKS, PY_FRAME_WINDOW, TASK_NAME_BYTES,
};

use crate::python::{frame_record, read_u32, read_u64};

fn read_u8(addr: u64) -> Option<u8> {
    // SAFETY: bpf_probe_read_user checks the address; a fault is an error, not a crash.
    unsafe { bpf_probe_read_user(addr as *const u8).ok() }
}

/// A `_PyStackRef`'s tag bits.
const STACKREF_TAG: u64 = 3;

/// One task chain read, shared between `capture_tasks` and its `bpf_loop` steps.
struct TaskWalk {
    config: *const PyProcConfig,
    tasks: *mut TaskCapture,
    frames: *mut PyFrameRecord,
    /// Where the next awaiting task's frame goes in `frames`.
    next_frame: u32,
    /// The task to read next; 0 once the chain has ended.
    task: u64,
    /// The coroutine whose frame comes next in the last task's chain (0: none), the type every
    /// coroutine of the chain has, and the links it may still follow.
    coro: u64,
    coro_type: u64,
    links: u32,
    window: [u8; PY_FRAME_WINDOW],
}

/// Reads the running task of the thread state at `tstate` and the tasks awaiting it into
/// `tasks`; the awaiting tasks' frames go into `frames` from `first_frame` on. Not inlined: its
/// frame window and the frame walk's must not share one BPF stack frame.
#[inline(never)]
pub fn capture_tasks(config: &PyProcConfig, tstate: u64, first_frame: u32, tasks: &mut TaskCapture, frames: &mut [PyFrameRecord; MAX_PY_FRAMES]) {
    let Some(running) = read_u64(tstate + config.asyncio.thread_running_task as u64) else {
        tasks.status |= task_status::READ_FAILED;
        return;
    };
    if running == 0 {
        return;
    }
    tasks.status |= task_status::RUNNING;
    let mut walk = TaskWalk {
        config,
        tasks,
        frames: frames.as_mut_ptr(),
        next_frame: first_frame,
        task: running,
        coro: 0,
        coro_type: 0,
        links: 0,
        window: [0; PY_FRAME_WINDOW],
    };
    // One step per task or per awaiting task's frame; a step past MAX_TASKS tasks marks the cut.
    let steps = (MAX_TASKS + 1 + MAX_AWAITER_FRAMES) as u32;
    // SAFETY: the callback is a BPF subprogram taking this context; the kernel bounds the count,
    // which also ends a chain that loops.
    unsafe { generated::bpf_loop(steps, task_step as *mut c_void, &mut walk as *mut TaskWalk as *mut c_void, 0) };
}

/// One task, or one frame of the last task's coroutine chain: 0 goes on, 1 stops.
#[inline(never)]
unsafe extern "C" fn task_step(_index: u64, context: *mut c_void) -> i64 {
    // SAFETY: bpf_loop passes capture_tasks' `TaskWalk` back unchanged.
    let walk = unsafe { &mut *(context as *mut TaskWalk) };
    // SAFETY: capture_tasks' caller's values, alive for the whole loop.
    let (config, tasks) = unsafe { (&*walk.config, &mut *walk.tasks) };
    if walk.coro != 0 {
        awaiter_frame(walk, config, tasks);
        return 0;
    }
    if walk.task == 0 {
        return 1;
    }
    if tasks.len >= MAX_TASKS as u32 {
        tasks.status |= task_status::TOO_MANY;
        return 1;
    }
    let a = &config.asyncio;
    let task = walk.task;
    walk.task = 0;
    // An awaiter that is a plain future, not a task, ends the chain.
    if tasks.len > 0 && read_u8(task + a.task_is_task as u64).is_none_or(|is_task| is_task == 0) {
        return 1;
    }
    let (Some(coro), Some(name), Some(awaited_by), Some(is_set)) = (
        read_u64(task + a.task_coro as u64),
        read_u64(task + a.task_name as u64),
        read_u64(task + a.task_awaited_by as u64),
        read_u8(task + a.task_awaited_by_is_set as u64),
    ) else {
        tasks.status |= task_status::READ_FAILED;
        return 1;
    };
    let index = tasks.len as usize & (MAX_TASKS - 1);
    let slot = &mut tasks.tasks[index];
    slot.task = task;
    slot.coro_frame = if coro == 0 { 0 } else { coro + a.gen_iframe as u64 };
    slot.frames_len = 0;
    read_name(a, name, slot);
    // The running task's frames are the thread's own; an awaiting task's are its coroutine's.
    if tasks.len > 0 && coro != 0 {
        walk.coro = coro;
        walk.coro_type = read_u64(coro + a.object_type as u64).unwrap_or(0);
        walk.links = MAX_AWAITER_LINKS;
    }
    tasks.len += 1;
    if awaited_by != 0 {
        if is_set != 0 {
            tasks.status |= task_status::AWAITERS_SET;
        } else {
            walk.task = awaited_by;
        }
    }
    0
}

/// The frame of `walk.coro`, suspended in the last task read, and the coroutine it awaits if
/// that is one of the same type.
fn awaiter_frame(walk: &mut TaskWalk, config: &PyProcConfig, tasks: &mut TaskCapture) {
    let a = &config.asyncio;
    let coro = walk.coro;
    walk.coro = 0;
    if tasks.len == 0 {
        return;
    }
    if tasks.frames_len >= MAX_AWAITER_FRAMES as u32 || walk.next_frame >= MAX_PY_FRAMES as u32 {
        tasks.status |= task_status::FRAMES_CUT;
        return;
    }
    let Some(state) = read_u8(coro + a.gen_frame_state as u64).map(|state| state as i8) else { return };
    if !a.suspended_states.contains(&state) {
        return;
    }
    let frame = coro + a.gen_iframe as u64;
    let Some(record) = frame_record(config, frame, &mut walk.window) else { return };
    // Checked above; the mask is for the verifier, which reloads the field.
    let slot = walk.next_frame as usize & (MAX_PY_FRAMES - 1);
    // SAFETY: `slot` < MAX_PY_FRAMES, the length of the array `frames` points into.
    unsafe { *walk.frames.add(slot) = record };
    walk.next_frame += 1;
    tasks.frames_len += 1;
    tasks.tasks[(tasks.len as usize - 1) & (MAX_TASKS - 1)].frames_len += 1;
    walk.links = walk.links.saturating_sub(1);
    if walk.links == 0 || !a.yield_from_states.contains(&state) {
        return;
    }
    // Suspended in `await`: the awaited object sits just below the top of the frame's stack.
    let Some(top) = read_u64(frame + a.frame_stackpointer as u64) else { return };
    let Some(awaited) = read_u64(top.wrapping_sub(a.awaited_below_top as u64)).map(|raw| raw & !STACKREF_TAG) else { return };
    if awaited != 0 && read_u64(awaited + a.object_type as u64) == Some(walk.coro_type) {
        walk.coro = awaited;
    }
}

/// The task's name object at `name` into `slot`: a `str`'s length, state and first characters,
/// or an `int`'s tag and first digits.
fn read_name(a: &AsyncioConfig, name: u64, slot: &mut TaskRecord) {
    slot.name_flags = 0;
    slot.name_len = 0;
    slot.name_state = 0;
    let Some(flags) = read_u64(name + a.object_type as u64).and_then(|ty| read_u64(ty + a.type_flags as u64)) else { return };
    let name_buf = slot.name.as_mut_ptr() as *mut c_void;
    if flags & type_flags::UNICODE_SUBCLASS != 0 {
        let (Some(len), Some(state)) = (read_u64(name + a.unicode_length as u64), read_u32(name + a.unicode_state as u64)) else { return };
        // state: interned (2 bits), kind (3 bits: bytes per character), compact, ascii.
        let width = ((state >> 2) & 7) as u64;
        let data = name + if state & (1 << 6) != 0 { a.unicode_ascii_size } else { a.unicode_compact_size } as u64;
        if len > 0 && width > 0 {
            // In 1..=TASK_NAME_BYTES, a form the verifier can bound (and no 128-bit product).
            let read = if len > TASK_NAME_BYTES as u64 { TASK_NAME_BYTES as u32 } else { (len * width).min(TASK_NAME_BYTES as u64) as u32 };
            let read = (read.wrapping_sub(1) & (TASK_NAME_BYTES as u32 - 1)) + 1;
            // SAFETY: a checked user read of at most the buffer's size into it.
            if unsafe { generated::bpf_probe_read_user(name_buf, read, data as *const c_void) } < 0 {
                return;
            }
        }
        slot.name_len = len;
        slot.name_state = state;
    } else if flags & type_flags::LONG_SUBCLASS != 0 {
        // SAFETY: a checked user read of 16 bytes into the 64-byte buffer.
        if unsafe { generated::bpf_probe_read_user(name_buf, 16, (name + a.long_tag as u64) as *const c_void) } < 0 {
            return;
        }
    }
    slot.name_flags = flags;
}
