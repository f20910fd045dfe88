//! asyncio tasks (CPython 3.14+): every thread's task list, which task each thread's loop runs,
//! who awaits each task, and each task's coroutine stack.
//!
//! The `_asyncio` module keeps its own table of offsets (`_Py_AsyncioModuleDebugOffsets`) in an
//! ELF section, `.AsyncioDebug`: in `_asyncio.cpython-314-*.so` in 3.14 (mapped once asyncio is
//! imported), in the interpreter itself from 3.15. Tasks are linked through `task_node` into a
//! list per thread state (and one per interpreter for tasks whose thread is gone).
//!
//! Everything is bounded: at most `max_tasks` tasks are read per process (more are only counted,
//! up to [`MAX_COUNTED`]), a coroutine chain is followed for [`MAX_DEPTH`] links, the tasks of a
//! process keep [`MAX_TASK_FRAMES`] frames between them, and a set of awaiters is read for
//! [`MAX_SET_SLOTS`] slots; lists and chains that loop are errors.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use object::{Object, ObjectSection};
use pyebpf_common::{AsyncioConfig, TaskRecord, TASK_NAME_BYTES};

use crate::chain::LinkReader;
use crate::maps::Maps;

use super::memory::{field_u64, ReadExt, ReadMemory};
use super::offsets::{narrow, DebugOffsets, ObjectOffsets};
use super::{runtime, strings, PyError, PyProcess, ResolvedFrame, MAX_DEPTH};

/// Tasks counted (not read) past the ones read, per list.
pub const MAX_COUNTED: usize = 1 << 20;
/// Frames kept for all the tasks of a process: a task past it shows its outermost frames only.
pub const MAX_TASK_FRAMES: usize = 1 << 18;
/// Slots of a set of awaiters read (16 bytes each).
const MAX_SET_SLOTS: u64 = 1 << 16;
/// Reads of a list before its errors are shown.
const READ_ATTEMPTS: usize = 5;
/// Largest task object and `_PyThreadStateImpl` accepted from the table.
const MAX_TASK_SIZE: u64 = 4096;
const MAX_TSTATE_SIZE: u64 = 64 << 10;
use pyebpf_common::type_flags::{LONG_SUBCLASS, UNICODE_SUBCLASS};
/// Tag bits of a `_PyStackRef` on a frame's value stack.
const STACKREF_TAG: u64 = 3;

/// `_Py_AsyncioModuleDebugOffsets`, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AsyncioOffsets {
    pub task_size: u64,
    pub task_name: u64,
    pub task_awaited_by: u64,
    pub task_is_task: u64,
    pub task_awaited_by_is_set: u64,
    pub task_coro: u64,
    pub task_node: u64,
    pub interp_tasks_head: u64,
    pub thread_running_loop: u64,
    pub thread_running_task: u64,
    pub thread_tasks_head: u64,
}

/// Fields of the table, in order: the task object's seven, the interpreter state's two, the
/// thread state's four.
const TABLE_FIELDS: usize = 13;

impl AsyncioOffsets {
    /// Decodes and checks the table's 13 fields.
    pub fn from_table(raw: &[u8]) -> Result<Self, PyError> {
        let at = |index: usize| field_u64(raw, 8 * index as u64);
        let bad = |why: String| PyError::BadOffsets(format!("asyncio table: {why}"));
        let (task_size, interp_size, thread_size) = (at(0), at(7), at(9));
        if task_size == 0 || task_size > MAX_TASK_SIZE {
            return Err(bad(format!("task size {task_size}")));
        }
        if interp_size == 0 || interp_size > 16 << 20 || thread_size == 0 || thread_size > MAX_TSTATE_SIZE {
            return Err(bad(format!("state sizes {interp_size} and {thread_size}")));
        }
        let within = |index: usize, size: u64, width: u64| {
            let offset = at(index);
            if offset.checked_add(width).is_some_and(|end| end <= size) {
                Ok(offset)
            } else {
                Err(bad(format!("field {index} at {offset} beyond size {size}")))
            }
        };
        Ok(AsyncioOffsets {
            task_size,
            task_name: within(1, task_size, 8)?,
            task_awaited_by: within(2, task_size, 8)?,
            task_is_task: within(3, task_size, 1)?,
            task_awaited_by_is_set: within(4, task_size, 1)?,
            task_coro: within(5, task_size, 8)?,
            task_node: within(6, task_size, 16)?,
            interp_tasks_head: within(8, interp_size, 16)?,
            thread_running_loop: within(10, thread_size, 8)?,
            thread_running_task: within(11, thread_size, 8)?,
            thread_tasks_head: within(12, thread_size, 16)?,
        })
    }
}

/// Why a process's tasks cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum AsyncioError {
    #[error("asyncio tasks are read from CPython 3.14 on (its _asyncio module's debug offsets); process {pid} runs CPython {version}")]
    TooOld { pid: u32, version: String },
    #[error("process {0} has not imported asyncio (no _asyncio module with debug offsets is mapped)")]
    NotImported(u32),
    #[error(transparent)]
    Python(#[from] PyError),
}

/// Where the `.AsyncioDebug` section of a file `pid` maps lies in its memory.
fn section_in_file(pid: u32, path: &Path, mapped_at: u64) -> Option<u64> {
    let data = runtime::open_elf(pid, path).ok()??;
    let elf = object::File::parse(&data).ok()?;
    let section = elf.section_by_name(".AsyncioDebug")?;
    (section.size() >= 8 * TABLE_FIELDS as u64).then(|| section.address().wrapping_add(runtime::load_bias(&elf, mapped_at)))
}

/// The asyncio table of `pid`, read from its memory where the section is mapped (as `maps`, its
/// maps, show): in an `_asyncio` module or (with `in_interpreter`) the interpreter's own files.
pub fn find_asyncio_offsets(pid: u32, maps: &Maps, mem: &impl ReadMemory, in_interpreter: bool) -> Result<Option<AsyncioOffsets>, PyError> {
    let holds_table = |path: &Path| {
        path.file_name().and_then(|name| name.to_str()).is_some_and(|name| name.starts_with("_asyncio")) || (in_interpreter && runtime::is_python_file(path))
    };
    for (path, mapped_at) in runtime::mapped_files(maps, holds_table) {
        if let Some(addr) = section_in_file(pid, &path, mapped_at) {
            let raw = mem.read_vec(addr, 8 * TABLE_FIELDS)?;
            return AsyncioOffsets::from_table(&raw).map(Some);
        }
    }
    Ok(None)
}

/// A task as read.
#[derive(Clone, Debug)]
pub struct Task {
    pub addr: u64,
    pub name: String,
    pub state: TaskState,
    /// Its coroutine stack, outermost first: for a task that runs, the thread's frames from the
    /// task's coroutine in; for one that waits, the chain of coroutines it awaits.
    pub frames: Vec<ResolvedFrame>,
    /// Its innermost frames are not in `frames`: the stack is deeper than [`MAX_DEPTH`], or the
    /// process's tasks used up [`MAX_TASK_FRAMES`].
    pub truncated: bool,
    /// The tasks (of those read) that await this one.
    pub awaited_by: Vec<u64>,
    /// Why the task could not be read in full.
    pub error: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskState {
    /// The thread's loop runs it now.
    Running,
    /// Suspended in an `await`.
    Waiting,
    /// Created, not started yet.
    Created,
    /// Its coroutine has finished.
    Done,
}

/// One task list: a thread's, or the interpreter's (tasks whose thread is gone).
#[derive(Clone, Debug, Default)]
pub struct TaskList {
    pub tasks: Vec<Task>,
    /// Tasks in the list, counted up to [`MAX_COUNTED`] past the ones read.
    pub total: usize,
    /// The list goes on past what was counted.
    pub more: bool,
    /// The task the thread's loop runs now.
    pub running: Option<u64>,
    /// Whether an event loop runs in the thread.
    pub loop_running: bool,
}

/// Reads tasks with the process's offsets and the asyncio table.
pub struct TaskReader<'p, M: ReadMemory> {
    process: &'p mut PyProcess<M>,
    table: AsyncioOffsets,
    objects: ObjectOffsets,
    /// Task objects still to be read in this process.
    budget: usize,
    /// Frames the process's tasks may still keep.
    frames_left: usize,
}

impl<'p, M: ReadMemory> TaskReader<'p, M> {
    /// A reader for `process`, or why its tasks cannot be read.
    pub fn new(process: &'p mut PyProcess<M>, table: Option<AsyncioOffsets>, max_tasks: usize) -> Result<Self, AsyncioError> {
        let pid = process.pid();
        let Some(objects) = process.offsets().objects.clone() else {
            return Err(AsyncioError::TooOld { pid, version: process.version().to_string() });
        };
        let table = table.ok_or(AsyncioError::NotImported(pid))?;
        Ok(TaskReader { process, table, objects, budget: max_tasks, frames_left: MAX_TASK_FRAMES })
    }

    /// The tasks of the thread whose state is at `tstate`.
    pub fn thread_tasks(&mut self, tstate: u64) -> Result<TaskList, PyError> {
        self.task_list(tstate.wrapping_add(self.table.thread_tasks_head), Some(tstate))
    }

    /// The tasks left by threads that are gone, in the main interpreter.
    pub fn interpreter_tasks(&mut self) -> Result<TaskList, PyError> {
        let interp = self.process.mem.read_u64(self.process.runtime.wrapping_add(self.process.offsets.interpreters_head))?;
        self.task_list(interp.wrapping_add(self.table.interp_tasks_head), None)
    }

    /// A list read whole, again when a task in it changed under the read (it finished and was
    /// freed, or the running one moved on): a list being changed reads inconsistently.
    fn task_list(&mut self, head: u64, tstate: Option<u64>) -> Result<TaskList, PyError> {
        let mut attempt = 1;
        let frames_left = self.frames_left;
        loop {
            self.frames_left = frames_left;
            let list = self.read_list(head, tstate);
            let changed = match &list {
                Ok(list) => list.tasks.iter().any(|task| task.error.is_some()),
                Err(err) => !err.process_gone(),
            };
            if !changed || attempt == READ_ATTEMPTS {
                if let Ok(list) = &list {
                    self.budget -= list.tasks.len();
                }
                return list;
            }
            attempt += 1;
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    fn read_list(&mut self, head: u64, tstate: Option<u64>) -> Result<TaskList, PyError> {
        let mut list = TaskList::default();
        let mut current_frame = 0;
        if let Some(tstate) = tstate {
            let mem = &self.process.mem;
            list.loop_running = mem.read_u64(tstate.wrapping_add(self.table.thread_running_loop))? != 0;
            if list.loop_running {
                list.running = Some(mem.read_u64(tstate.wrapping_add(self.table.thread_running_task))?).filter(|&task| task != 0);
                current_frame = self.process.current_frame(tstate)?;
            }
        }
        let addresses;
        (addresses, list.total, list.more) = self.task_addresses(head)?;
        let listed: HashSet<u64> = addresses.iter().copied().collect();
        list.tasks.reserve(addresses.len());
        for addr in addresses {
            let running = (list.running == Some(addr)).then_some(current_frame);
            list.tasks.push(self.task(addr, &listed, running));
        }
        Ok(list)
    }

    /// The addresses of the tasks in the circular list whose head is at `head`: the first ones
    /// (as many as the budget allows), and how many there are in all.
    fn task_addresses(&mut self, head: u64) -> Result<(Vec<u64>, usize, bool), PyError> {
        let mem = self.process.memory();
        let next_of = |node: u64| mem.read_u64(node.wrapping_add(self.objects.llist_next));
        let mut seen = HashSet::new();
        let mut addresses = Vec::new();
        let mut total = 0;
        let mut node = next_of(head)?;
        while node != head {
            if node == 0 || !node.is_multiple_of(8) {
                return Err(PyError::Malformed(format!("task list link {node:#x}")));
            }
            if total == self.budget + MAX_COUNTED {
                return Ok((addresses, total, true));
            }
            if addresses.len() < self.budget {
                // Only the tasks read are remembered: a loop among the ones only counted ends at
                // the count's bound.
                if !seen.insert(node) {
                    return Err(PyError::Chain(format!("task list loops back to {node:#x}")));
                }
                addresses.push(node.wrapping_sub(self.table.task_node));
            }
            total += 1;
            node = next_of(node)?;
        }
        Ok((addresses, total, false))
    }

    /// One task; what cannot be read of it is its `error`. `current_frame` is its thread's
    /// innermost frame when it is the task the thread runs.
    fn task(&mut self, addr: u64, listed: &HashSet<u64>, current_frame: Option<u64>) -> Task {
        let mut task = Task { addr, name: String::new(), state: TaskState::Done, frames: Vec::new(), truncated: false, awaited_by: Vec::new(), error: None };
        if let Err(err) = self.read_task(&mut task, listed, current_frame) {
            task.error = Some(err.to_string());
        }
        task
    }

    fn read_task(&mut self, task: &mut Task, listed: &HashSet<u64>, current_frame: Option<u64>) -> Result<(), PyError> {
        let t = self.table;
        let raw = self.process.memory().read_vec(task.addr, t.task_size as usize)?;
        let byte = |at: u64| raw.get(at as usize).copied().unwrap_or(0);
        task.name = self.task_name(field_u64(&raw, t.task_name))?;
        if byte(t.task_is_task) == 0 {
            return Err(PyError::Malformed("a future, not a task, in the task list".into()));
        }
        let awaited_by = field_u64(&raw, t.task_awaited_by);
        task.awaited_by = match (awaited_by, byte(t.task_awaited_by_is_set)) {
            (0, _) => Vec::new(),
            (one, 0) => vec![one],
            (set, _) => self.set_members(set)?,
        };
        // Futures and dummy slots of a set are not tasks of this list.
        task.awaited_by.retain(|waiter| listed.contains(waiter) && *waiter != task.addr);
        let coro = field_u64(&raw, t.task_coro);
        if coro == 0 {
            return Ok(());
        }
        let state = self.frame_state(coro)?;
        task.state = if state == self.objects.states.executing {
            TaskState::Running
        } else if self.objects.states.suspended.contains(&state) {
            TaskState::Waiting
        } else if state == self.objects.states.created {
            TaskState::Created
        } else {
            TaskState::Done
        };
        (task.frames, task.truncated) = match (task.state, current_frame) {
            (TaskState::Done, _) => (Vec::new(), false),
            (TaskState::Running, Some(frame)) => self.running_frames(frame, coro.wrapping_add(self.objects.gen_iframe))?,
            _ => self.coroutine_chain(coro)?,
        };
        self.frames_left -= task.frames.len();
        Ok(())
    }

    /// A task's name: a `str`, or an `int` N for the default `Task-N` (made into text only when
    /// Python asks for it).
    fn task_name(&mut self, name: u64) -> Result<String, PyError> {
        let o = self.process.offsets();
        let mem = self.process.memory();
        let ty = mem.read_u64(name.wrapping_add(o.object_type))?;
        let flags = mem.read_u64(ty.wrapping_add(self.objects.type_flags))?;
        if flags & UNICODE_SUBCLASS != 0 {
            return Ok(strings::read_str(mem, o, name)?.text);
        }
        if flags & LONG_SUBCLASS != 0 {
            return Ok(format!("Task-{}", self.small_int(name)?));
        }
        Err(PyError::Malformed(format!("task name at {name:#x} is neither a str nor an int")))
    }

    /// A non-negative `int` of at most two 30-bit digits.
    fn small_int(&self, addr: u64) -> Result<u64, PyError> {
        let mem = self.process.memory();
        let tag = mem.read_u64(addr.wrapping_add(self.objects.long_tag))?;
        let digits = if tag & 3 == 0 { (tag >> 3).min(2) as usize } else { 0 };
        small_int(tag, &mem.read_vec(addr.wrapping_add(self.objects.long_digits), 4 * digits)?)
    }

    /// The keys of the set at `addr`, at most `MAX_SET_SLOTS` slots of it read.
    fn set_members(&self, addr: u64) -> Result<Vec<u64>, PyError> {
        let mem = self.process.memory();
        let o = &self.objects;
        let used = mem.read_u64(addr.wrapping_add(o.set_used))?;
        let mask = mem.read_u64(addr.wrapping_add(o.set_mask))?;
        let table = mem.read_u64(addr.wrapping_add(o.set_table))?;
        if mask >= MAX_SET_SLOTS || !(mask + 1).is_power_of_two() || used > mask + 1 {
            return Err(PyError::Malformed(format!("set of awaiters with mask {mask:#x} and {used} used")));
        }
        // Each slot is a key and its hash.
        let raw = mem.read_vec(table, 16 * (mask as usize + 1))?;
        Ok(raw.chunks(16).map(|slot| field_u64(slot, 0)).filter(|&key| key != 0).collect())
    }

    fn frame_state(&self, coro: u64) -> Result<i8, PyError> {
        let mut byte = [0u8];
        self.process.memory().read(coro.wrapping_add(self.objects.gen_frame_state), &mut byte)?;
        Ok(byte[0] as i8)
    }

    /// The running task's frames: the thread's chain from its innermost frame out to the task's
    /// coroutine frame (`task_frame`), outermost first, as many as the frame budget allows.
    fn running_frames(&mut self, current_frame: u64, task_frame: u64) -> Result<(Vec<ResolvedFrame>, bool), PyError> {
        let walk = self.process.walk_frames(current_frame)?;
        let Some(end) = walk.links.iter().position(|link| link.addr == task_frame) else {
            return Err(PyError::Chain("the running task's coroutine is not on its thread's stack (it moved on)".into()));
        };
        let mut frames = Vec::with_capacity(end + 1);
        for link in walk.links[..=end].iter().rev() {
            if frames.len() == self.frames_left {
                return Ok((frames, true));
            }
            frames.extend(self.process.frame_info(link)?);
        }
        Ok((frames, false))
    }

    /// The coroutine `coro` and those it awaits in turn, outermost first, as far as they are
    /// coroutines of the same type (an awaited future or iterator ends the chain), and whether
    /// the chain was cut (at [`MAX_DEPTH`] links or the frame budget).
    fn coroutine_chain(&mut self, coro: u64) -> Result<(Vec<ResolvedFrame>, bool), PyError> {
        let object_type = self.process.offsets().object_type;
        let o = self.objects.clone();
        let mut frames = Vec::new();
        let mut seen = HashSet::new();
        let mut addr = coro;
        let ty = self.process.memory().read_u64(coro.wrapping_add(object_type))?;
        for _ in 0..MAX_DEPTH {
            if frames.len() == self.frames_left {
                return Ok((frames, true));
            }
            if !seen.insert(addr) {
                return Err(PyError::Chain(format!("coroutine chain loops back to {addr:#x}")));
            }
            let state = self.frame_state(addr)?;
            if !o.states.suspended.contains(&state) && state != o.states.created {
                return Ok((frames, false));
            }
            let frame = addr.wrapping_add(o.gen_iframe);
            let link = self.process.read_link(frame)?;
            frames.extend(self.process.frame_info(&link)?);
            if !o.states.yield_from.contains(&state) {
                return Ok((frames, false));
            }
            // Suspended in `await`: the awaited object is near the top of the frame's stack.
            let mem = self.process.memory();
            let top = mem.read_u64(frame.wrapping_add(o.frame_stackpointer))?;
            if top == 0 {
                return Ok((frames, false));
            }
            let awaited = mem.read_u64(top.wrapping_sub(o.awaited_below_top))? & !STACKREF_TAG;
            if awaited == 0 || mem.read_u64(awaited.wrapping_add(object_type))? != ty {
                return Ok((frames, false));
            }
            addr = awaited;
        }
        // Still awaiting after MAX_DEPTH links.
        Ok((frames, true))
    }
}

/// The value of an `int` from its tag and digits: non-negative, of at most two 30-bit digits
/// (`digits` holds at least as many as the tag says).
fn small_int(tag: u64, digits: &[u8]) -> Result<u64, PyError> {
    let (sign, count) = (tag & 3, tag >> 3);
    match (sign, count) {
        (1, _) => Ok(0),
        (0, 1 | 2) if digits.len() >= 4 * count as usize => Ok(digits[..4 * count as usize]
            .chunks(4)
            .rev()
            .fold(0, |value, digit| value << 30 | u64::from(u32::from_le_bytes(digit.try_into().unwrap_or_default())))),
        _ => Err(PyError::Malformed(format!("task number with tag {tag:#x}"))),
    }
}

/// What the eBPF program needs to read a thread's running task and its awaiters at a capture;
/// `None` for a version without the object layouts (before 3.14).
pub fn bpf_config(table: &AsyncioOffsets, offsets: &DebugOffsets) -> Option<AsyncioConfig> {
    let o = offsets.objects.as_ref()?;
    let states = |list: &[i8]| {
        let mut slots = [list.first().copied().unwrap_or(i8::MIN); 4];
        for (slot, state) in slots.iter_mut().zip(list) {
            *slot = *state;
        }
        slots
    };
    Some(AsyncioConfig {
        thread_running_task: narrow(table.thread_running_task),
        task_name: narrow(table.task_name),
        task_awaited_by: narrow(table.task_awaited_by),
        task_awaited_by_is_set: narrow(table.task_awaited_by_is_set),
        task_is_task: narrow(table.task_is_task),
        task_coro: narrow(table.task_coro),
        gen_iframe: narrow(o.gen_iframe),
        gen_frame_state: narrow(o.gen_frame_state),
        suspended_states: states(o.states.suspended),
        yield_from_states: states(o.states.yield_from),
        frame_stackpointer: narrow(o.frame_stackpointer),
        awaited_below_top: narrow(o.awaited_below_top),
        object_type: narrow(offsets.object_type),
        type_flags: narrow(o.type_flags),
        unicode_length: narrow(offsets.unicode_length),
        unicode_state: narrow(offsets.unicode_state),
        unicode_ascii_size: narrow(offsets.unicode_ascii_size),
        unicode_compact_size: narrow(offsets.unicode_compact_size),
        long_tag: narrow(o.long_tag),
        thread_tasks_head: narrow(table.thread_tasks_head),
        task_node: narrow(table.task_node),
        llist_next: narrow(o.llist_next),
    })
}

/// A task's name from what the eBPF program read of it at the capture: `Task-N`, or the `str`'s
/// first characters (a longer name ends in `…`).
pub fn captured_name(record: &TaskRecord, objects: &ObjectOffsets) -> Result<String, PyError> {
    if record.name_flags & UNICODE_SUBCLASS != 0 {
        let state = record.name_state;
        let width = ((state >> 2) & 7) as usize;
        if state & (1 << 5) == 0 || !matches!(width, 1 | 2 | 4) {
            return Err(PyError::Malformed(format!("task name with string state {state:#x}")));
        }
        let bytes = record.name_len.saturating_mul(width as u64);
        let kept = bytes.min(TASK_NAME_BYTES as u64) as usize;
        let mut text = strings::decode(&record.name[..kept], width).ok_or_else(|| PyError::Malformed("task name with an invalid code point".into()))?;
        if bytes > kept as u64 {
            text.push(strings::TRUNCATION_MARK);
        }
        return Ok(text);
    }
    if record.name_flags & LONG_SUBCLASS != 0 {
        let tag = field_u64(&record.name, 0);
        let digits = record.name.get(objects.long_digits.wrapping_sub(objects.long_tag) as usize..16).unwrap_or_default();
        return Ok(format!("Task-{}", small_int(tag, digits)?));
    }
    Err(PyError::Malformed("task name neither a str nor an int, or not read".into()))
}

/// For each task, the tasks it awaits (the inverse of `awaited_by`).
pub fn awaits(tasks: &[Task]) -> HashMap<u64, Vec<u64>> {
    let mut awaits: HashMap<u64, Vec<u64>> = HashMap::new();
    for task in tasks {
        for &waiter in &task.awaited_by {
            awaits.entry(waiter).or_default().push(task.addr);
        }
    }
    awaits
}

#[cfg(test)]
mod tests;
