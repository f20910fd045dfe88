//! `pyebpf dump`: every thread's Python stack, as tracebacks or JSON.
//!
//! Threads are read and printed one at a time, so what a dump holds is bounded by one thread's
//! stack (`MAX_DEPTH` frames, the innermost ones, marked truncated past that) whatever the number
//! of threads. A running thread's stack changes while it is read (a frame returns, its code object
//! is freed), so a read that fails is tried again from the thread's new current frame; a thread
//! whose stack still cannot be read (a looping chain, a malformed code object) is shown with what
//! was read up to the bad frame and the error. A process that exits during the dump ends it.

use std::io::{self, Write};
use std::sync::Arc;

use anyhow::{Context, Result};
use serde::Serialize;

use super::memory::ReadMemory;
use super::threads::current_states;
use super::{runtime, PyError, PyProcess, PyThread, MAX_DEPTH};
use crate::cli::DumpArgs;

#[derive(Serialize)]
struct ThreadDump {
    tid: u32,
    name: Option<String>,
    holds_gil: bool,
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

pub fn run(args: DumpArgs) -> Result<()> {
    let pid = args.pid;
    let mut process = PyProcess::attach(pid).with_context(|| format!("cannot read process {pid}"))?;
    let mut out = io::BufWriter::new(io::stdout().lock());
    dump(&mut process, args.json, &mut out).map_err(|err| {
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
    // Every thread state, so a thread in a subinterpreter also shows where it entered it.
    let threads = process.thread_states().with_context(|| format!("cannot list the threads of process {pid}"))?;
    let current = current_states(threads.clone());
    let several_interpreters = threads.iter().any(|thread| thread.interpreter != threads[0].interpreter);
    if json {
        writeln!(out, "{{\n  \"pid\": {pid},\n  \"python\": {},\n  \"threads\": [", serde_json::to_string(&version)?)?;
    } else {
        writeln!(out, "Process {pid}: CPython {version}")?;
    }
    for (index, thread) in threads.iter().enumerate() {
        let mut dump = dump_thread(process, thread)?;
        dump.parked = current.iter().any(|c| c.tid == thread.tid && c.tstate != thread.tstate);
        if json {
            let separator = if index + 1 < threads.len() { "," } else { "" };
            writeln!(out, "{}{separator}", serde_json::to_string_pretty(&dump)?)?;
        } else {
            print_traceback(&dump, several_interpreters, out)?;
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
            Ok(Some(resolved)) => frames.push(FrameDump {
                qualname: resolved.frame.qualname,
                filename: resolved.frame.filename,
                line: resolved.frame.line,
                end_line: resolved.location.end_line,
                column: resolved.location.column,
                end_column: resolved.location.end_column,
            }),
            Ok(None) => {}
            Err(err) => return (frames, walk.truncated, Some(err)),
        }
    }
    (frames, walk.truncated, None)
}

fn print_traceback(thread: &ThreadDump, several_interpreters: bool, out: &mut impl Write) -> io::Result<()> {
    let name = thread.name.as_deref().unwrap_or("?");
    let interpreter = if several_interpreters { format!(" in interpreter {}", thread.interpreter) } else { String::new() };
    let gil = if thread.holds_gil { " [holds the GIL]" } else { "" };
    let parked = if thread.parked { " [parked: the thread runs in another interpreter]" } else { "" };
    writeln!(out, "\nThread {} ({name}){interpreter}{gil}{parked}", thread.tid)?;
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
