//! `pyebpf dump`: every thread's Python stack, as tracebacks or JSON.

use anyhow::{Context, Result};
use serde::Serialize;

use super::PyProcess;
use crate::chain::LinkKind;
use crate::cli::DumpArgs;

#[derive(Serialize)]
struct ThreadDump {
    tid: u32,
    name: String,
    holds_gil: bool,
    /// Innermost first.
    frames: Vec<FrameDump>,
}

#[derive(Serialize)]
struct FrameDump {
    qualname: String,
    filename: String,
    line: u32,
}

pub fn run(args: DumpArgs) -> Result<()> {
    let pid = args.pid;
    let mut process = PyProcess::attach(pid).with_context(|| format!("cannot read process {pid}"))?;
    let threads = process.threads().with_context(|| format!("cannot list the threads of process {pid}"))?;
    let mut dumps = Vec::new();
    for thread in threads {
        let links = process.walk_frames(thread.current_frame).with_context(|| format!("cannot read thread {}", thread.tid))?;
        let mut frames = Vec::new();
        for link in links.iter().filter(|l| l.kind == LinkKind::Code) {
            let frame = process.python_frame(link.code, link.instr_ptr).with_context(|| format!("cannot read a frame of thread {}", thread.tid))?;
            frames.push(FrameDump { qualname: frame.qualname.to_string(), filename: frame.filename.to_string(), line: frame.line });
        }
        let name = std::fs::read_to_string(format!("/proc/{pid}/task/{}/comm", thread.tid)).map(|n| n.trim_end().to_string()).unwrap_or_default();
        dumps.push(ThreadDump { tid: thread.tid, name, holds_gil: thread.holds_gil, frames });
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "pid": pid, "python": process.version().to_string(), "threads": dumps }))?);
        return Ok(());
    }
    println!("Process {pid}: CPython {}", process.version());
    for thread in &dumps {
        println!("\nThread {} ({}){}", thread.tid, thread.name, if thread.holds_gil { " [has the GIL]" } else { "" });
        println!("Traceback (most recent call last):");
        for frame in thread.frames.iter().rev() {
            println!("  File \"{}\", line {}, in {}", frame.filename, frame.line, frame.qualname);
        }
    }
    Ok(())
}
