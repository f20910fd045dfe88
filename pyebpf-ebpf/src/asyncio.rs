//! The thread's asyncio tasks at the capture (CPython 3.14+): the task its event loop runs and the
//! tasks awaiting it in turn, each with its name and, for the awaiting ones, the frames of their
//! suspended coroutines; and (`--mode wall|off-cpu`) the thread's waiting tasks. Read here, at the
//! capture, because a task's name, its awaiters and its suspended frames change (or are freed and
//! reused) as soon as the loop moves on.

use core::ffi::c_void;

use aya_ebpf::helpers::{bpf_get_smp_processor_id, generated};
use pyebpf_common::{
    record_kind, task_status, type_flags, AsyncioConfig, PyCapture, PyFrameRecord, PyProcConfig, TaskCapture, TaskRecord, WaitingTasks, MAX_AWAITER_FRAMES,
    MAX_AWAITER_LINKS, MAX_PY_FRAMES, MAX_TASKS, MAX_WAITING_FRAMES, MAX_WAITING_TASKS, PY_FRAME_WINDOW, TASK_NAME_BYTES,
};

use crate::emit::emit_or_count;
use crate::frame::frame_record;
use crate::read::{read_u32, read_u64, read_u8};
use crate::{BPF_RB_NO_WAKEUP, CONFIG, LOST_SAMPLES, PY_PROCS, TASK_WINDOWS, WAITING_SCRATCH};

/// A `_PyStackRef`'s tag bits.
const STACKREF_TAG: u64 = 3;

/// The coroutine whose frame comes next in a task's chain (0: none), the type every coroutine of
/// the chain has, and the links it may still follow.
struct Coroutines {
    coro: u64,
    coro_type: u64,
    links: u32,
}

impl Coroutines {
    fn start(a: &AsyncioConfig, coro: u64) -> Self {
        Coroutines { coro, coro_type: read_u64(coro + a.object_type as u64).unwrap_or(0), links: MAX_AWAITER_LINKS }
    }

    /// The frame of the suspended coroutine next in the chain, read into `window`; moves on to the
    /// coroutine it awaits if that is one of the same type. `None` where the chain ends.
    fn next_frame(&mut self, config: &PyProcConfig, window: &mut [u8; PY_FRAME_WINDOW]) -> Option<PyFrameRecord> {
        let a = &config.asyncio;
        let coro = self.coro;
        self.coro = 0;
        let state = read_u8(coro + a.gen_frame_state as u64)? as i8;
        if !a.suspended_states.contains(&state) {
            return None;
        }
        let frame = coro + a.gen_iframe as u64;
        let record = frame_record(config, frame, window)?;
        self.links = self.links.saturating_sub(1);
        if self.links > 0 && a.yield_from_states.contains(&state) {
            // Suspended in `await`: the awaited object sits just below the top of the frame's stack.
            let awaited = read_u64(frame + a.frame_stackpointer as u64)
                .and_then(|top| read_u64(top.wrapping_sub(a.awaited_below_top as u64)))
                .map_or(0, |raw| raw & !STACKREF_TAG);
            if awaited != 0 && read_u64(awaited + a.object_type as u64) == Some(self.coro_type) {
                self.coro = awaited;
            }
        }
        Some(record)
    }
}

/// One task chain read, shared between `capture_tasks` and its `bpf_loop` steps.
struct TaskWalk {
    config: *const PyProcConfig,
    tasks: *mut TaskCapture,
    frames: *mut PyFrameRecord,
    /// Where the next awaiting task's frame goes in `frames`.
    next_frame: u32,
    /// The task to read next; 0 once the chain has ended.
    task: u64,
    coroutines: Coroutines,
    /// In `TASK_WINDOWS`, not on the stack, which the timer clock's callback has little of.
    window: *mut [u8; PY_FRAME_WINDOW],
}

/// Forgets the tasks of an earlier capture: only the tasks counted are sent, the rest of the array
/// may hold an earlier capture's.
#[inline(always)]
pub fn clear_tasks(tasks: &mut TaskCapture) {
    tasks.len = 0;
    tasks.status = 0;
    tasks.frames_len = 0;
}

/// Reads the running task of the thread state of `py` and the tasks awaiting it into `tasks`;
/// the awaiting tasks' frames go into `frames` after the thread's own, each read through
/// entry `window` of `TASK_WINDOWS`. Not inlined: its stack frame and the frame walk's must not
/// add up.
#[inline(never)]
pub fn capture_tasks(config: &PyProcConfig, py: &PyCapture, window: u32, tasks: &mut TaskCapture, frames: &mut [PyFrameRecord; MAX_PY_FRAMES]) {
    let Some(window) = TASK_WINDOWS.get_ptr_mut(window) else { return };
    let (tstate, first_frame) = (py.tstate, py.frames_len);
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
        coroutines: Coroutines { coro: 0, coro_type: 0, links: 0 },
        window,
    };
    // One step per task or per awaiting task's frame; a step past MAX_TASKS tasks marks the cut.
    let steps = (MAX_TASKS + 1 + MAX_AWAITER_FRAMES) as u32;
    // SAFETY: the callback is a BPF subprogram taking this context; the kernel bounds the count,
    // which also ends a chain that loops.
    unsafe { generated::bpf_loop(steps, task_step as *mut c_void, &mut walk as *mut TaskWalk as *mut c_void, 0) };
}

/// One task, or one frame of the last task's coroutine chain: 0 goes on, 1 stops.
///
/// # Safety
/// `context` must be the `TaskWalk` of `capture_tasks`, whose `config` and `tasks` outlive the
/// loop and whose `frames` points at `MAX_PY_FRAMES` records.
#[inline(never)]
unsafe extern "C" fn task_step(_index: u64, context: *mut c_void) -> i64 {
    // SAFETY: bpf_loop passes capture_tasks' `TaskWalk` back unchanged.
    let walk = unsafe { &mut *(context as *mut TaskWalk) };
    // SAFETY: capture_tasks' caller's values, alive for the whole loop.
    let (config, tasks) = unsafe { (&*walk.config, &mut *walk.tasks) };
    if walk.coroutines.coro != 0 {
        if tasks.frames_len >= MAX_AWAITER_FRAMES as u32 || walk.next_frame >= MAX_PY_FRAMES as u32 || tasks.len == 0 {
            tasks.status |= task_status::FRAMES_CUT;
            walk.coroutines.coro = 0;
            return 0;
        }
        // SAFETY: capture_tasks' entry of `TASK_WINDOWS`, this CPU's for this origin.
        if let Some(record) = walk.coroutines.next_frame(config, unsafe { &mut *walk.window }) {
            // Checked above; the mask is for the verifier, which reloads the field.
            let slot = walk.next_frame as usize & (MAX_PY_FRAMES - 1);
            // SAFETY: `slot` < MAX_PY_FRAMES, the length of the array `frames` points into.
            unsafe { *walk.frames.add(slot) = record };
            walk.next_frame += 1;
            tasks.frames_len += 1;
            tasks.tasks[(tasks.len as usize - 1) & (MAX_TASKS - 1)].frames_len += 1;
        }
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
    let slot = &mut tasks.tasks[tasks.len as usize & (MAX_TASKS - 1)];
    let mut several = false;
    let Some(coro) = read_task(a, task, slot, &mut several) else {
        tasks.status |= task_status::READ_FAILED;
        return 1;
    };
    walk.task = slot.awaited_by;
    if several {
        tasks.status |= task_status::AWAITERS_SET;
    }
    // The running task's frames are the thread's own; an awaiting task's are its coroutine's.
    if tasks.len > 0 && coro != 0 {
        walk.coroutines = Coroutines::start(a, coro);
    }
    tasks.len += 1;
    0
}

/// Reads the task at `task` into `slot` (its frames not yet): its coroutine's frame, its one
/// awaiter (0 for none or several) and its name; returns its coroutine, and sets `several` when
/// several tasks await it.
fn read_task(a: &AsyncioConfig, task: u64, slot: &mut TaskRecord, several: &mut bool) -> Option<u64> {
    let coro = read_u64(task + a.task_coro as u64)?;
    let name = read_u64(task + a.task_name as u64)?;
    let awaited_by = read_u64(task + a.task_awaited_by as u64)?;
    let is_set = read_u8(task + a.task_awaited_by_is_set as u64)?;
    slot.task = task;
    slot.coro_frame = if coro == 0 { 0 } else { coro + a.gen_iframe as u64 };
    slot.awaited_by = if is_set != 0 { 0 } else { awaited_by };
    slot.frames_len = 0;
    read_name(a, name, slot);
    *several = is_set != 0 && awaited_by != 0;
    Some(coro)
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

/// One walk of a thread's task list, shared between `emit_waiting_tasks` and its steps.
struct WaitingWalk {
    config: *const PyProcConfig,
    out: *mut WaitingTasks,
    /// The list's head, and the node to read next.
    head: u64,
    node: u64,
    coroutines: Coroutines,
    /// In `TASK_WINDOWS`, not on the stack, which the timer clock's callback has little of.
    window: *mut [u8; PY_FRAME_WINDOW],
}

/// Sends the suspended tasks of thread `tid` of `tgid` (thread state `tstate`) as they are now, at
/// the capture sent just before; `half` is the capture's half of the scratch space (and of
/// `TASK_WINDOWS`).
#[inline(never)]
pub fn emit_waiting_tasks(tgid: u32, tid: u32, time_ns: u64, tstate: u64, half: u32) {
    // SAFETY: plain data; see python::registered.
    let Some(config) = (unsafe { PY_PROCS.get(tgid) }) else { return };
    let Some(out) = WAITING_SCRATCH.get_ptr_mut(half) else { return };
    let Some(cpus) = CONFIG.get(0).map(|config| config.cpus) else { return };
    // SAFETY: no preconditions.
    let Some(window) = TASK_WINDOWS.get_ptr_mut(unsafe { bpf_get_smp_processor_id() } + half * cpus) else { return };
    // SAFETY: this CPU's scratch record of this half; a program does not preempt itself on one
    // CPU, so nothing else uses it meanwhile.
    unsafe {
        (*out).kind = record_kind::WAITING_TASKS;
        (*out).tid = tid;
        (*out).time_ns = time_ns;
        (*out).len = 0;
        (*out).status = 0;
        (*out).frames_len = 0;
    }
    let Some(first) = read_u64(tstate + config.asyncio.thread_tasks_head as u64 + config.asyncio.llist_next as u64) else { return };
    let mut walk = WaitingWalk {
        config,
        out,
        head: tstate + config.asyncio.thread_tasks_head as u64,
        node: first,
        coroutines: Coroutines { coro: 0, coro_type: 0, links: 0 },
        window,
    };
    let steps = (MAX_WAITING_TASKS + 1 + MAX_WAITING_FRAMES) as u32;
    // SAFETY: as in capture_tasks; the count also ends a list that loops.
    unsafe { generated::bpf_loop(steps, waiting_step as *mut c_void, &mut walk as *mut WaitingWalk as *mut c_void, 0) };
    // SAFETY: this CPU's record, as above.
    let status = unsafe { &mut (*out).status };
    // The steps ran out before the list's end (tasks not waiting take steps too): a cut as well.
    if walk.node != walk.head && *status & task_status::READ_FAILED == 0 {
        *status |= task_status::WAITING_CUT;
    }
    // SAFETY: this CPU's record, as above.
    if unsafe { (*out).len == 0 && (*out).status == 0 } {
        // No task waits (a thread without an event loop): nothing to count.
        return;
    }
    // SAFETY: the whole record, plain data.
    emit_or_count::<WaitingTasks>(unsafe { &*out }, BPF_RB_NO_WAKEUP, LOST_SAMPLES);
}

/// One list node (a task, skipped unless suspended), or one frame of the last task's coroutine
/// chain: 0 goes on, 1 stops.
///
/// # Safety
/// `context` must be the `WaitingWalk` of `emit_waiting_tasks`, whose `config` and `out` outlive
/// the loop.
#[inline(never)]
unsafe extern "C" fn waiting_step(_index: u64, context: *mut c_void) -> i64 {
    // SAFETY: bpf_loop passes emit_waiting_tasks' `WaitingWalk` back unchanged.
    let walk = unsafe { &mut *(context as *mut WaitingWalk) };
    // SAFETY: emit_waiting_tasks' values, alive for the whole loop.
    let (config, out) = unsafe { (&*walk.config, &mut *walk.out) };
    let a = &config.asyncio;
    if walk.coroutines.coro != 0 {
        if out.frames_len >= MAX_WAITING_FRAMES as u32 || out.len == 0 {
            out.status |= task_status::FRAMES_CUT;
            walk.coroutines.coro = 0;
            return 0;
        }
        // SAFETY: emit_waiting_tasks' entry of `TASK_WINDOWS`, this CPU's for this origin.
        if let Some(record) = walk.coroutines.next_frame(config, unsafe { &mut *walk.window }) {
            out.frames[out.frames_len as usize & (MAX_WAITING_FRAMES - 1)] = record;
            out.frames_len += 1;
            out.tasks[(out.len as usize - 1) & (MAX_WAITING_TASKS - 1)].frames_len += 1;
        }
        return 0;
    }
    let node = walk.node;
    if node == walk.head {
        return 1;
    }
    let Some(next) = read_u64(node + a.llist_next as u64).filter(|_| node != 0) else {
        out.status |= task_status::READ_FAILED;
        return 1;
    };
    walk.node = next;
    let task = node.wrapping_sub(a.task_node as u64);
    let Some(coro) = read_u64(task + a.task_coro as u64) else {
        out.status |= task_status::READ_FAILED;
        return 1;
    };
    // The running task and those done or not started are not waiting.
    let suspended = coro != 0 && read_u8(coro + a.gen_frame_state as u64).is_some_and(|state| a.suspended_states.contains(&(state as i8)));
    if !suspended {
        return 0;
    }
    if out.len >= MAX_WAITING_TASKS as u32 {
        out.status |= task_status::WAITING_CUT;
        return 1;
    }
    let slot = &mut out.tasks[out.len as usize & (MAX_WAITING_TASKS - 1)];
    if read_task(a, task, slot, &mut false).is_none() {
        out.status |= task_status::READ_FAILED;
        return 1;
    }
    out.len += 1;
    walk.coroutines = Coroutines::start(a, coro);
    0
}
