//! asyncio tasks (CPython 3.14+, `--async-aware`): finding a process's task table, placing the
//! task chain a capture read around the running task's coroutine frame, and the stacks of the
//! tasks that wait.

use std::collections::HashMap;
use std::time::Duration;

use pyebpf_common::{py_proc_flags, task_status, PyFrameRecord, PyProcConfig, SampleRecord, TaskRecord, WaitingTasks, MAX_TASKS, MAX_WAITING_TASKS};

use super::frames::{Memory, PyItem, Resolver};
use crate::cpython::asyncio::{self, find_asyncio_offsets, AsyncioOffsets, TaskReader, TaskState};
use crate::cpython::offsets::ObjectOffsets;
use crate::cpython::{PyError, TRUNCATION_MARK};
use crate::maps::MapsCache;
use crate::merge::PyStackItem;
use crate::stack::{Frame, FrameId, FrameTable};
use crate::stats::Stats;

/// A stack of frame ids, innermost first, and whether it was cut.
pub type TaskStack = (Vec<FrameId>, bool);

/// Whether a process's asyncio tasks are read at its captures.
pub(super) enum Tasks {
    /// Not asked for, or the version has no asyncio debug offsets (before 3.14).
    Off,
    /// Asked for; the `_asyncio` table is not mapped yet (3.14 maps it when asyncio is first
    /// imported): looked for again at each upkeep, after the first look only in `_asyncio`
    /// modules (the interpreter's own files do not change).
    Pending { interpreter_searched: bool },
    /// Told to the eBPF program (boxed: a process without tasks keeps a small entry).
    On(Box<(ObjectOffsets, AsyncioOffsets)>),
}

impl Tasks {
    /// Looks for the process's asyncio table while it is pending; once found, sets it in `config`
    /// (true: `config` is to be told to the eBPF program), or says why it cannot be used.
    pub(super) fn find<M: Memory>(&mut self, resolver: &Resolver<M>, maps: &mut MapsCache, config: &mut PyProcConfig) -> Result<bool, String> {
        let Tasks::Pending { interpreter_searched } = *self else { return Ok(false) };
        let py = &resolver.py;
        let pid = py.pid();
        // Read now: a module loaded since the last look (one upkeep ago) must show.
        let maps = maps.newer_than(pid, Duration::ZERO).map_err(PyError::from);
        let table = match maps.and_then(|maps| find_asyncio_offsets(pid, maps, py.memory(), !interpreter_searched)) {
            Ok(Some(table)) => table,
            Ok(None) => {
                *self = Tasks::Pending { interpreter_searched: true };
                return Ok(false);
            }
            Err(err) => {
                *self = Tasks::Off;
                return Err(format!("pid {pid}: {err}"));
            }
        };
        let (Some(bpf), Some(objects)) = (asyncio::bpf_config(&table, py.offsets()), py.offsets().objects.clone()) else {
            *self = Tasks::Off;
            return Err(format!("{} (pid {pid})", py.python_name()));
        };
        config.asyncio = bpf;
        config.flags |= py_proc_flags::TASKS;
        *self = Tasks::On(Box::new((objects, table)));
        Ok(true)
    }

    pub(super) fn pending(&self) -> bool {
        matches!(self, Tasks::Pending { .. })
    }

    /// The running task's coroutine frame at the capture, where tasks were read.
    pub(super) fn running_task_frame(&self, record: &SampleRecord) -> Option<u64> {
        let tasks = &record.tasks;
        let running = matches!(self, Tasks::On(..)) && tasks.status & task_status::RUNNING != 0 && tasks.len > 0;
        running.then_some(tasks.tasks[0].coro_frame).filter(|&frame| frame != 0)
    }

    /// Inserts the task chain the capture read at `at` in `items` (innermost first, so right
    /// outside the running task's coroutine frame): each task's `[task NAME]` frame, with each
    /// awaiting task's suspended coroutine frames inside it. The chain is cut at the first
    /// awaiting frame whose code object cannot be proven.
    pub(super) fn insert<M: Memory>(
        &self,
        resolver: &mut Resolver<M>,
        record: &SampleRecord,
        at: usize,
        frames: &mut FrameTable,
        items: &mut Vec<PyItem>,
        stats: &mut Stats,
    ) {
        let Tasks::On(on) = self else { return };
        let captured = &record.tasks;
        let mut chain = Vec::new();
        let mut next = record.py.frames_len as usize;
        let mut cut = captured.status & (task_status::TOO_MANY | task_status::READ_FAILED | task_status::FRAMES_CUT) != 0;
        for task in &captured.tasks[..(captured.len as usize).min(MAX_TASKS)] {
            let coroutine = record.py_frames.get(next..next + task.frames_len as usize).unwrap_or_default();
            next += task.frames_len as usize;
            // The chain ends at a frame that cannot be proven: what is outside it is not known.
            if !task_frames(resolver, task, coroutine, frames, &mut chain) {
                cut = true;
                break;
            }
            chain.push(task_frame(resolver.pid(), task, &on.0, frames));
        }
        if captured.status & task_status::TOO_MANY != 0 {
            chain.push(frames.intern(Frame::Task(TRUNCATION_MARK.to_string().into())));
        }
        stats.tasks.placed += 1;
        stats.tasks.chains_cut += u64::from(cut);
        items.splice(at..at, chain.into_iter().map(PyStackItem::Frame));
    }

    /// The stacks of the waiting tasks a capture read, into `stacks`: each task's coroutine frames
    /// under its `[task NAME]` frame, under those of the tasks awaiting it that the same capture
    /// read.
    pub(super) fn waiting_stacks<M: Memory>(
        &self,
        resolver: &mut Resolver<M>,
        waiting: &WaitingTasks,
        frames: &mut FrameTable,
        stacks: &mut Vec<TaskStack>,
        stats: &mut Stats,
    ) {
        let Tasks::On(on) = self else { return };
        let read = &waiting.tasks[..(waiting.len as usize).min(MAX_WAITING_TASKS)];
        let mut parts: Vec<TaskPart> = Vec::with_capacity(read.len());
        let mut next = 0;
        for task in read {
            let coroutine = waiting.frames.get(next..next + task.frames_len as usize).unwrap_or_default();
            next += task.frames_len as usize;
            let mut part = Vec::with_capacity(coroutine.len() + 1);
            // A cut keeps what the task awaits; its outer frames and awaiters are not known.
            let cut = !task_frames(resolver, task, coroutine, frames, &mut part);
            part.push(task_frame(resolver.pid(), task, &on.0, frames));
            parts.push(TaskPart { task: task.task, awaited_by: task.awaited_by, frames: part, cut });
        }
        waiting_task_stacks(&parts, stacks);
        stats.tasks.waiting += stacks.len() as u64;
        stats.tasks.waiting_cut += u64::from(waiting.status & task_status::WAITING_CUT != 0);
    }

    /// The stacks of the waiting tasks of the thread with `tstate`, read now, as the eBPF program
    /// would have at a capture (see [`Self::waiting_stacks`]). Only for a thread that has not run
    /// since it left the CPU, so none of its tasks has (the caller proves that afterwards).
    pub(super) fn read_waiting_stacks<M: Memory>(
        &self,
        resolver: &mut Resolver<M>,
        tstate: u64,
        frames: &mut FrameTable,
        stacks: &mut Vec<TaskStack>,
        stats: &mut Stats,
    ) {
        let Tasks::On(on) = self else { return };
        let pid = resolver.pid();
        let list = match TaskReader::new(&mut resolver.py, Some(on.1), MAX_WAITING_TASKS).map(|mut reader| reader.thread_tasks(tstate)) {
            Ok(Ok(list)) => list,
            Ok(Err(err)) => return log::debug!("pid {pid} thread state {tstate:#x}: tasks: {err}"),
            Err(err) => return log::debug!("pid {pid}: tasks: {err}"),
        };
        let waiting = list.tasks.iter().filter(|task| task.state == TaskState::Waiting && task.error.is_none());
        let parts: Vec<TaskPart> = waiting
            .map(|task| {
                let mut part: Vec<FrameId> = task.frames.iter().rev().map(|resolved| frames.intern(Frame::Python(resolved.frame.clone()))).collect();
                part.push(frames.intern(Frame::Task(task.name.as_str().into())));
                let awaited_by = match task.awaited_by[..] {
                    [one] => one,
                    _ => 0,
                };
                TaskPart { task: task.addr, awaited_by, frames: part, cut: task.truncated }
            })
            .collect();
        waiting_task_stacks(&parts, stacks);
        stats.tasks.waiting += stacks.len() as u64;
        stats.tasks.waiting_cut += u64::from(list.total > list.tasks.len());
    }
}

/// A task's suspended coroutine frames as a capture read them (`coroutine`, outermost first),
/// resolved onto `out` innermost first; false at the first whose code cannot be proven (those
/// inside it are kept).
fn task_frames<M: Memory>(resolver: &mut Resolver<M>, task: &TaskRecord, coroutine: &[PyFrameRecord], frames: &mut FrameTable, out: &mut Vec<FrameId>) -> bool {
    for frame in coroutine.iter().rev() {
        match resolver.resolve_record(frame, frames) {
            Ok(Some(PyStackItem::Frame(id))) => out.push(id),
            Ok(_) => {}
            Err(err) => {
                log::debug!("pid {}: task {:#x}: {err}", resolver.pid(), task.task);
                return false;
            }
        }
    }
    true
}

/// The `[task NAME]` frame of a task a capture read (`[task ?]` if its name is malformed).
fn task_frame(pid: u32, task: &TaskRecord, objects: &ObjectOffsets, frames: &mut FrameTable) -> FrameId {
    let name = asyncio::captured_name(task, objects).unwrap_or_else(|err| {
        log::debug!("pid {pid}: task {:#x}: {err}", task.task);
        "?".into()
    });
    frames.intern(Frame::Task(name.into()))
}

/// A waiting task's own part of a stack, innermost first: its coroutine frames (`cut` where
/// unproven ones were dropped), then its task frame.
pub(super) struct TaskPart {
    pub(super) task: u64,
    pub(super) awaited_by: u64,
    pub(super) frames: Vec<FrameId>,
    pub(super) cut: bool,
}

/// Each task's stack: its part under those of the tasks awaiting it, as far as they are among
/// `parts` (read at the same moment); a chain that loops or runs past [`MAX_TASKS`] is cut.
pub(super) fn waiting_task_stacks(parts: &[TaskPart], stacks: &mut Vec<TaskStack>) {
    stacks.clear();
    let index: HashMap<u64, usize> = parts.iter().enumerate().map(|(i, part)| (part.task, i)).collect();
    for (i, part) in parts.iter().enumerate() {
        let mut stack = part.frames.clone();
        let mut truncated = part.cut;
        // A part cut short is not placed under its awaiters: its frames in between are unknown.
        let mut awaiter = if part.cut { 0 } else { part.awaited_by };
        let mut levels = 1;
        while let Some(&outer) = index.get(&awaiter) {
            if levels == MAX_TASKS || outer == i {
                truncated = true;
                break;
            }
            stack.extend_from_slice(&parts[outer].frames);
            if parts[outer].cut {
                truncated = true;
                break;
            }
            awaiter = parts[outer].awaited_by;
            levels += 1;
        }
        stacks.push((stack, truncated));
    }
}
