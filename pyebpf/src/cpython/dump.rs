//! `pyebpf dump`: every thread's Python stack, as tracebacks or JSON.
//!
//! Threads are read and printed one at a time, so what a dump holds is bounded by one thread's
//! stack (`MAX_DEPTH` frames, the innermost ones, marked truncated past that) whatever the number
//! of threads. A running thread's stack changes while it is read (a frame returns, its code object
//! is freed), so a read that fails is tried again from the thread's new current frame; a thread
//! whose stack still cannot be read (a looping chain, a malformed code object) is shown with what
//! was read up to the bad frame and the error. A process that exits during the dump ends it.

use std::collections::{HashMap, HashSet};
use std::io::{self, Write};
use std::sync::Arc;

use anyhow::{Context, Result};
use serde::Serialize;

use super::asyncio::{self, Task, TaskList, TaskReader, TaskState};
use super::memory::ReadMemory;
use super::threads::current_states;
use super::{runtime, PyError, PyProcess, PyThread, ResolvedFrame, MAX_DEPTH};
use crate::cli::DumpArgs;
use crate::maps::Maps;

#[derive(Serialize)]
struct ThreadDump {
    tid: u32,
    name: Option<String>,
    holds_gil: bool,
    /// Its thread state is attached: it may run Python code now (in a free-threaded build, in
    /// parallel with the other attached threads; with a GIL, attached is holding it or waiting).
    attached: bool,
    /// The id of the thread state's interpreter (0: the main one).
    interpreter: i64,
    /// Where the thread has a state in several interpreters: set on the state it does not run in
    /// now, parked at the call that entered the one it runs in.
    parked: bool,
    /// Innermost first.
    frames: Vec<FrameDump>,
    /// The stack is deeper than `MAX_DEPTH` frames: `frames` are its innermost ones.
    truncated: bool,
    /// Why the stack could not be read past `frames`.
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// One frame, with the fields of Python's `co_qualname`, `co_filename` and `co_positions()`.
#[derive(Serialize)]
struct FrameDump {
    qualname: Arc<str>,
    filename: Arc<str>,
    /// 0 where the location table gives none, as `frame.f_lineno` may.
    line: u32,
    end_line: Option<u32>,
    column: Option<u32>,
    end_column: Option<u32>,
}

impl From<ResolvedFrame> for FrameDump {
    fn from(resolved: ResolvedFrame) -> Self {
        FrameDump {
            qualname: resolved.frame.qualname,
            filename: resolved.frame.filename,
            line: resolved.frame.line,
            end_line: resolved.location.end_line,
            column: resolved.location.column,
            end_column: resolved.location.end_column,
        }
    }
}

pub fn run(args: DumpArgs) -> Result<()> {
    let pid = args.pid;
    let mut process = PyProcess::attach(pid).with_context(|| format!("cannot read process {pid}"))?;
    let mut out = io::BufWriter::new(io::stdout().lock());
    let dumped = if args.async_tasks {
        // Bounded by the option's range.
        dump_tasks(&mut process, args.json, args.max_tasks as usize, &mut out)
    } else {
        dump(&mut process, args.json, &mut out)
    };
    dumped.map_err(|err| {
        // A process that exits while it is read fails at whatever read came next: say what happened.
        let gone = err.chain().any(|cause| cause.downcast_ref::<PyError>().is_some_and(PyError::process_gone));
        if gone || runtime::has_exited(pid) {
            anyhow::anyhow!("process {pid} exited during the dump")
        } else {
            err
        }
    })?;
    out.flush().context("cannot write the dump")
}

fn dump<M: ReadMemory>(process: &mut PyProcess<M>, json: bool, out: &mut impl Write) -> Result<()> {
    let pid = process.pid();
    let version = process.version().to_string();
    let free_threaded = process.offsets().free_threaded;
    // Every thread state, so a thread in a subinterpreter also shows where it entered it.
    let threads = process.thread_states().with_context(|| format!("cannot list the threads of process {pid}"))?;
    let current = current_states(threads.clone());
    let several_interpreters = threads.iter().any(|thread| thread.interpreter != threads[0].interpreter);
    if json {
        let python = serde_json::to_string(&version)?;
        writeln!(out, "{{\n  \"pid\": {pid},\n  \"python\": {python},\n  \"free_threaded\": {free_threaded},\n  \"threads\": [")?;
    } else if free_threaded {
        writeln!(out, "Process {pid}: {} (no GIL: attached threads run Python in parallel)", process.python_name())?;
    } else {
        writeln!(out, "Process {pid}: {}", process.python_name())?;
    }
    for (index, thread) in threads.iter().enumerate() {
        let mut dump = dump_thread(process, thread)?;
        dump.parked = current.iter().any(|c| c.tid == thread.tid && c.tstate != thread.tstate);
        if json {
            let separator = if index + 1 < threads.len() { "," } else { "" };
            writeln!(out, "{}{separator}", serde_json::to_string_pretty(&dump)?)?;
        } else {
            print_traceback(&dump, Shown { several_interpreters, attached: free_threaded }, out)?;
        }
    }
    if json {
        writeln!(out, "  ]\n}}")?;
    }
    Ok(())
}

/// One thread's stack; an error that is this thread's alone is kept in the dump, one that comes
/// from the process having gone ends it.
/// Reads of one thread's stack before its error is shown.
const READ_ATTEMPTS: usize = 5;

fn dump_thread<M: ReadMemory>(process: &mut PyProcess<M>, thread: &PyThread) -> Result<ThreadDump> {
    let mut dump = ThreadDump {
        tid: thread.tid,
        name: process.thread_name(thread.tid),
        holds_gil: thread.holds_gil,
        attached: thread.active,
        interpreter: thread.interpreter,
        parked: false,
        frames: Vec::new(),
        truncated: false,
        error: None,
    };
    let mut current_frame = thread.current_frame;
    for attempt in 1..=READ_ATTEMPTS {
        let (frames, truncated, error) = thread_frames(process, current_frame);
        (dump.frames, dump.truncated) = (frames, truncated);
        let Some(err) = error else {
            dump.error = None;
            break;
        };
        if err.process_gone() {
            return Err(err).with_context(|| format!("cannot read the stack of thread {} of process {}", thread.tid, process.pid()));
        }
        dump.error = Some(err.to_string());
        if attempt < READ_ATTEMPTS {
            // Let the thread move on from whatever it was in the middle of.
            std::thread::sleep(std::time::Duration::from_millis(1));
            match process.current_frame(thread.tstate) {
                Ok(frame) => current_frame = frame,
                Err(err) if err.process_gone() => return Err(err).context("cannot read a thread state"),
                Err(_) => break,
            }
        }
    }
    Ok(dump)
}

/// The frames read from `current_frame`, the truncation mark, and the error that stopped the read
/// early, if one did (the frames before it are kept).
fn thread_frames<M: ReadMemory>(process: &mut PyProcess<M>, current_frame: u64) -> (Vec<FrameDump>, bool, Option<PyError>) {
    if current_frame == 0 {
        return (Vec::new(), false, None);
    }
    let walk = match process.walk_frames(current_frame) {
        Ok(walk) => walk,
        Err(err) => return (Vec::new(), false, Some(err)),
    };
    let mut frames = Vec::with_capacity(walk.links.len());
    for link in &walk.links {
        match process.frame_info(link) {
            Ok(Some(resolved)) => frames.push(FrameDump::from(resolved)),
            Ok(None) => {}
            Err(err) => return (frames, walk.truncated, Some(err)),
        }
    }
    (frames, walk.truncated, None)
}

/// What a traceback's heading says beyond the thread.
#[derive(Clone, Copy)]
struct Shown {
    several_interpreters: bool,
    /// Whether the thread is attached (free-threaded builds, where no GIL says who runs).
    attached: bool,
}

fn print_traceback(thread: &ThreadDump, shown: Shown, out: &mut impl Write) -> io::Result<()> {
    let name = thread.name.as_deref().unwrap_or("?");
    let interpreter = if shown.several_interpreters { format!(" in interpreter {}", thread.interpreter) } else { String::new() };
    let gil = if thread.holds_gil { " [holds the GIL]" } else { "" };
    let attached = if shown.attached && thread.attached { " [attached]" } else { "" };
    let parked = if thread.parked { " [parked: the thread runs in another interpreter]" } else { "" };
    writeln!(out, "\nThread {} ({name}){interpreter}{gil}{attached}{parked}", thread.tid)?;
    writeln!(out, "Traceback (most recent call last):")?;
    if let Some(error) = &thread.error {
        writeln!(out, "  <older frames unreadable: {error}>")?;
    }
    if thread.truncated {
        writeln!(out, "  ... older frames not shown (the stack is deeper than {MAX_DEPTH} frames)")?;
    }
    for frame in thread.frames.iter().rev() {
        writeln!(out, "  File \"{}\", line {}, in {}", frame.filename, frame.line, frame.qualname)?;
    }
    Ok(())
}

/// One thread's tasks (or, with no `tid`, those left by threads that are gone).
#[derive(Serialize)]
struct TasksDump {
    #[serde(skip_serializing_if = "Option::is_none")]
    tid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    loop_running: bool,
    /// The task the thread's loop runs now.
    running_task: Option<String>,
    /// Tasks in the list: counted up to `asyncio::MAX_COUNTED` past those read.
    tasks_total: usize,
    /// The list went on past what was counted.
    tasks_uncounted: bool,
    tasks: Vec<TaskDump>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

#[derive(Serialize)]
struct TaskDump {
    /// The task object's address, which `awaited_by` and `awaits` name tasks by.
    id: String,
    name: String,
    state: TaskState,
    /// Innermost first, as a thread's frames.
    frames: Vec<FrameDump>,
    /// The stack goes on past `frames`: deeper than 4,096 frames, or the process's tasks used up
    /// their frame budget (`asyncio::MAX_TASK_FRAMES`).
    truncated: bool,
    awaited_by: Vec<String>,
    awaits: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

fn task_id(addr: u64) -> String {
    format!("{addr:#x}")
}

impl TasksDump {
    fn new(thread: Option<(&PyThread, Option<String>)>, list: Result<TaskList, PyError>) -> Self {
        let (tid, name) = thread.map_or((None, None), |(thread, name)| (Some(thread.tid), name));
        let list = match list {
            Ok(list) => list,
            Err(err) => {
                let error = Some(err.to_string());
                return TasksDump { tid, name, loop_running: false, running_task: None, tasks_total: 0, tasks_uncounted: false, tasks: Vec::new(), error };
            }
        };
        let awaits = asyncio::awaits(&list.tasks);
        let ids = |addrs: &[u64]| addrs.iter().copied().map(task_id).collect();
        let tasks = list
            .tasks
            .into_iter()
            .map(|task: Task| TaskDump {
                id: task_id(task.addr),
                awaits: awaits.get(&task.addr).map_or_else(Vec::new, |addrs| ids(addrs)),
                awaited_by: ids(&task.awaited_by),
                name: task.name,
                state: task.state,
                frames: task.frames.into_iter().rev().map(FrameDump::from).collect(),
                truncated: task.truncated,
                error: task.error,
            })
            .collect();
        TasksDump {
            tid,
            name,
            loop_running: list.loop_running,
            running_task: list.running.map(task_id),
            tasks_total: list.total,
            tasks_uncounted: list.more,
            tasks,
            error: None,
        }
    }
}

/// `dump --async`: the tasks of every thread, then those of threads that are gone; at most
/// `max_tasks` read in all.
fn dump_tasks<M: ReadMemory>(process: &mut PyProcess<M>, json: bool, max_tasks: usize, out: &mut impl Write) -> Result<()> {
    let pid = process.pid();
    let version = process.version().to_string();
    let table = Maps::read(pid)
        .map_err(PyError::from)
        .and_then(|maps| asyncio::find_asyncio_offsets(pid, &maps, process.memory(), true))
        .with_context(|| format!("cannot read the asyncio table of process {pid}"))?;
    let threads = process.threads().with_context(|| format!("cannot list the threads of process {pid}"))?;
    let names: Vec<Option<String>> = threads.iter().map(|thread| process.thread_name(thread.tid)).collect();
    let mut reader = TaskReader::new(process, table, max_tasks)?;
    let mut dumps = Vec::with_capacity(threads.len() + 1);
    for (thread, name) in threads.iter().zip(names) {
        let list = reader.thread_tasks(thread.tstate);
        if let Err(err) = &list {
            if err.process_gone() {
                anyhow::bail!("process {pid} exited during the dump");
            }
        }
        dumps.push(TasksDump::new(Some((thread, name)), list));
    }
    let left = TasksDump::new(None, reader.interpreter_tasks());
    if json {
        let threads: Vec<&TasksDump> = dumps.iter().collect();
        let dump = serde_json::json!({ "pid": pid, "python": version, "max_tasks": max_tasks, "threads": threads, "tasks_of_exited_threads": left });
        writeln!(out, "{}", serde_json::to_string_pretty(&dump)?)?;
        return Ok(());
    }
    writeln!(out, "Process {pid}: CPython {version}")?;
    for dump in dumps.iter().chain((!left.tasks.is_empty() || left.error.is_some()).then_some(&left)) {
        print_tasks(dump, max_tasks, out)?;
    }
    Ok(())
}

fn print_tasks(dump: &TasksDump, max_tasks: usize, out: &mut impl Write) -> io::Result<()> {
    match dump.tid {
        Some(tid) => {
            let name = dump.name.as_deref().unwrap_or("?");
            let event_loop = if dump.loop_running { "event loop running" } else { "no event loop running" };
            writeln!(out, "\nThread {tid} ({name}): {event_loop}, {} tasks", count(dump))?;
        }
        None => writeln!(out, "\nTasks of threads that have exited: {}", count(dump))?,
    }
    if let Some(error) = &dump.error {
        return writeln!(out, "  <tasks unreadable: {error}>");
    }
    let by_id: HashMap<&str, &TaskDump> = dump.tasks.iter().map(|task| (task.id.as_str(), task)).collect();
    let mut shown = HashSet::new();
    // Roots first (tasks no task awaits), then whatever a cycle left unshown.
    let roots = dump.tasks.iter().filter(|task| task.awaited_by.is_empty()).chain(dump.tasks.iter());
    for task in roots {
        print_task(task, &by_id, &mut shown, 1, out)?;
    }
    let read = dump.tasks.len();
    if dump.tasks_uncounted || dump.tasks_total > read {
        let more = if dump.tasks_uncounted { "more than " } else { "" };
        writeln!(out, "  ... {more}{} more tasks not read (at most {max_tasks} are: see --max-tasks)", dump.tasks_total - read)?;
    }
    Ok(())
}

fn count(dump: &TasksDump) -> String {
    if dump.tasks_uncounted {
        format!("more than {}", dump.tasks_total)
    } else {
        dump.tasks_total.to_string()
    }
}

/// Levels of tasks awaiting tasks indented.
const MAX_TREE_DEPTH: usize = 64;

/// A task, its coroutine stack (outermost first, as a traceback), then the tasks it awaits,
/// indented under it; a task already shown (awaited by several) is named only.
fn print_task(task: &TaskDump, by_id: &HashMap<&str, &TaskDump>, shown: &mut HashSet<String>, depth: usize, out: &mut impl Write) -> io::Result<()> {
    let indent = "  ".repeat(depth);
    if depth > MAX_TREE_DEPTH {
        // Shown at the top level instead, after the roots.
        return writeln!(out, "{indent}... (tasks awaited deeper are listed below)");
    }
    if !shown.insert(task.id.clone()) {
        if depth > 1 {
            writeln!(out, "{indent}[task {}] (shown above)", task.name)?;
        }
        return Ok(());
    }
    let state = match task.state {
        TaskState::Running => "running",
        TaskState::Waiting => "waiting",
        TaskState::Created => "not started",
        TaskState::Done => "done",
    };
    writeln!(out, "{indent}[task {}] {state}", task.name)?;
    for frame in task.frames.iter().rev() {
        writeln!(out, "{indent}    File \"{}\", line {}, in {}", frame.filename, frame.line, frame.qualname)?;
    }
    if task.truncated {
        writeln!(out, "{indent}    ... inner frames not shown (deeper than {MAX_DEPTH}, or past {} frames for all tasks)", asyncio::MAX_TASK_FRAMES)?;
    }
    if let Some(error) = &task.error {
        writeln!(out, "{indent}    <unreadable: {error}>")?;
    }
    for awaited in task.awaits.iter().filter_map(|id| by_id.get(id.as_str())) {
        print_task(awaited, by_id, shown, depth + 1, out)?;
    }
    Ok(())
}
