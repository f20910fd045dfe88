//! What the eBPF program reads of asyncio tasks (`--async-aware`, CPython 3.14+): the tasks of a
//! capture, and where in a process to find them.

use crate::PyFrameRecord;

/// Tasks read per sample at most: the running task and the tasks awaiting it in turn (a deeper
/// chain is cut there and marked).
pub const MAX_TASKS: usize = 8;
/// Bytes of a task's name captured at the sample (64 ASCII or Latin-1 characters; a longer name is
/// cut there).
pub const TASK_NAME_BYTES: usize = 64;
/// Frames of the awaiting tasks' suspended coroutines read per sample at most, all tasks together.
pub const MAX_AWAITER_FRAMES: usize = 32;
/// Links of one awaiting task's coroutine chain followed at most.
pub const MAX_AWAITER_LINKS: u32 = 8;
/// Waiting tasks read per capture at most (`--mode wall|off-cpu --async-aware`): the first ones of
/// the thread's task list, oldest first.
pub const MAX_WAITING_TASKS: usize = 16;
/// Frames of the waiting tasks' coroutines read per capture at most, all tasks together.
pub const MAX_WAITING_FRAMES: usize = 64;

/// Bits of [`TaskCapture::status`].
pub mod task_status {
    /// The thread ran a task at the capture: `tasks` starts with it.
    pub const RUNNING: u32 = 1 << 0;
    /// The outermost task read is awaited by several tasks (a set): the chain stops there.
    pub const AWAITERS_SET: u32 = 1 << 1;
    /// The chain went on past [`super::MAX_TASKS`] tasks.
    pub const TOO_MANY: u32 = 1 << 2;
    /// A task or its awaiter could not be read: the chain ends there.
    pub const READ_FAILED: u32 = 1 << 3;
    /// Awaiting tasks' coroutine frames went past [`super::MAX_AWAITER_FRAMES`] (or the record's
    /// room): the tasks after that have none.
    pub const FRAMES_CUT: u32 = 1 << 4;
    /// A [`super::WaitingTasks`] record of this capture follows, unless no task of the thread waits.
    pub const WAITING_FOLLOWS: u32 = 1 << 5;
    /// The thread's task list goes on past what was read: [`super::MAX_WAITING_TASKS`] waiting
    /// tasks, or the walk's steps.
    pub const WAITING_CUT: u32 = 1 << 6;
}

/// One asyncio task as read at the capture.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskRecord {
    /// The task object.
    pub task: u64,
    /// Its coroutine's interpreter frame (the coroutine's address plus `gi_iframe`): for the
    /// running task, the frame of the thread's chain where the task begins.
    pub coro_frame: u64,
    /// The one task awaiting it, where it is one (0: none, or a set of several).
    pub awaited_by: u64,
    /// `tp_flags` of its name's type: a `str`, or an `int` N for the default `Task-N`.
    pub name_flags: u64,
    /// A `str` name: its length in characters and its state word; its first characters are in
    /// `name`. An `int`: `name` holds its tag and first digits.
    pub name_len: u64,
    pub name_state: u32,
    /// Frames of its coroutine chain (awaiting tasks only), outermost first; they follow the
    /// walked frames in [`crate::SampleRecord::py_frames`], task after task.
    pub frames_len: u32,
    pub name: [u8; TASK_NAME_BYTES],
}

/// The running task and the tasks awaiting it in turn, innermost (running) first.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskCapture {
    pub len: u32,
    /// `task_status` bits.
    pub status: u32,
    /// Awaiting tasks' frames, all tasks together.
    pub frames_len: u32,
    pub _pad: u32,
    pub tasks: [TaskRecord; MAX_TASKS],
}

/// The suspended tasks of a thread at a capture, sent right after it (`task_status` in `status`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct WaitingTasks {
    /// [`crate::record_kind::WAITING_TASKS`].
    pub kind: u32,
    pub tid: u32,
    /// The capture's `time_ns`.
    pub time_ns: u64,
    pub len: u32,
    pub status: u32,
    pub frames_len: u32,
    pub _pad: u32,
    /// Each task's coroutine frames are in `frames`, outermost first, task after task.
    pub tasks: [TaskRecord; MAX_WAITING_TASKS],
    pub frames: [PyFrameRecord; MAX_WAITING_FRAMES],
}

/// Where to read asyncio tasks (CPython 3.14+): the `_asyncio` module's offsets and the object
/// layouts a task's name and coroutines need.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AsyncioConfig {
    pub thread_running_task: u32,
    pub task_name: u32,
    pub task_awaited_by: u32,
    pub task_awaited_by_is_set: u32,
    pub task_is_task: u32,
    pub task_coro: u32,
    /// A coroutine's own frame and `gi_frame_state`.
    pub gen_iframe: u32,
    pub gen_frame_state: u32,
    /// The frame states of a suspended coroutine, and of one suspended in `await` (unused slots
    /// repeat the first).
    pub suspended_states: [i8; 4],
    pub yield_from_states: [i8; 4],
    /// An interpreter frame's stack top, and how far below it the awaited object sits.
    pub frame_stackpointer: u32,
    pub awaited_below_top: u32,
    pub object_type: u32,
    pub type_flags: u32,
    pub unicode_length: u32,
    pub unicode_state: u32,
    pub unicode_ascii_size: u32,
    pub unicode_compact_size: u32,
    pub long_tag: u32,
    /// The thread state's task list, and a task's and a list node's links in it.
    pub thread_tasks_head: u32,
    pub task_node: u32,
    pub llist_next: u32,
}

/// `tp_flags` bits that tell a task's name apart: `Py_TPFLAGS_LONG_SUBCLASS` and
/// `Py_TPFLAGS_UNICODE_SUBCLASS`.
pub mod type_flags {
    pub const LONG_SUBCLASS: u64 = 1 << 24;
    pub const UNICODE_SUBCLASS: u64 = 1 << 28;
}
