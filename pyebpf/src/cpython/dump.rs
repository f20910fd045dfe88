//! `pyebpf dump`: every thread's Python stack, as tracebacks or JSON.

use anyhow::{Context, Result};
use serde::Serialize;

use super::memory::ReadMemory;
use super::{runtime, PyError, PyProcess, PyThread};
use crate::cli::DumpArgs;

#[derive(Serialize)]
struct ThreadDump {
    tid: u32,
    name: Option<String>,
    holds_gil: bool,
    /// Innermost first.
    frames: Vec<FrameDump>,
}

/// One frame, with the fields of Python's `co_qualname`, `co_filename` and `co_positions()`.
#[derive(Serialize)]
struct FrameDump {
    qualname: String,
    filename: String,
    /// 0 where the location table gives none, as `frame.f_lineno` may.
    line: u32,
    end_line: Option<u32>,
    column: Option<u32>,
    end_column: Option<u32>,
}

pub fn run(args: DumpArgs) -> Result<()> {
    let pid = args.pid;
    let mut process = PyProcess::attach(pid).with_context(|| format!("cannot read process {pid}"))?;
    let dumps = dump_threads(&mut process).map_err(|err| {
        // A process that exits while it is read fails at whatever read came next: say what happened.
        let gone = err.chain().any(|cause| cause.downcast_ref::<PyError>().is_some_and(PyError::process_gone));
        if gone || runtime::has_exited(pid) {
            anyhow::anyhow!("process {pid} exited during the dump")
        } else {
            err
        }
    })?;
    if args.json {
        let document = serde_json::json!({ "pid": pid, "python": process.version().to_string(), "threads": dumps });
        println!("{}", serde_json::to_string_pretty(&document)?);
    } else {
        print_tracebacks(pid, &process.version().to_string(), &dumps);
    }
    Ok(())
}

fn dump_threads<M: ReadMemory>(process: &mut PyProcess<M>) -> Result<Vec<ThreadDump>> {
    let pid = process.pid();
    let threads = process.threads().with_context(|| format!("cannot list the threads of process {pid}"))?;
    threads
        .iter()
        .map(|thread| dump_thread(process, thread).with_context(|| format!("cannot read the stack of thread {} of process {pid}", thread.tid)))
        .collect()
}

fn dump_thread<M: ReadMemory>(process: &mut PyProcess<M>, thread: &PyThread) -> Result<ThreadDump> {
    let mut frames = Vec::new();
    let links = if thread.current_frame == 0 { Vec::new() } else { process.walk_frames(thread.current_frame)? };
    for link in &links {
        if let Some(resolved) = process.frame_info(link)? {
            frames.push(FrameDump {
                qualname: resolved.frame.qualname.to_string(),
                filename: resolved.frame.filename.to_string(),
                line: resolved.frame.line,
                end_line: resolved.location.end_line,
                column: resolved.location.column,
                end_column: resolved.location.end_column,
            });
        }
    }
    Ok(ThreadDump { tid: thread.tid, name: process.thread_name(thread.tid), holds_gil: thread.holds_gil, frames })
}

fn print_tracebacks(pid: u32, version: &str, threads: &[ThreadDump]) {
    println!("Process {pid}: CPython {version}");
    for thread in threads {
        let name = thread.name.as_deref().unwrap_or("?");
        println!("\nThread {} ({name}){}", thread.tid, if thread.holds_gil { " [holds the GIL]" } else { "" });
        println!("Traceback (most recent call last):");
        for frame in thread.frames.iter().rev() {
            println!("  File \"{}\", line {}, in {}", frame.filename, frame.line, frame.qualname);
        }
    }
}
