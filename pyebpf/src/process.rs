//! The processes a recording covers: every process, given PIDs, or a launched command.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("no such process: {0}")]
    NoSuchProcess(u32),
    #[error("cannot start `{command}`: {source}")]
    Spawn { command: String, source: std::io::Error },
}

/// Checks that every PID names a running process.
pub fn check_pids(pids: &[u32]) -> Result<(), TargetError> {
    match pids.iter().find(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists()) {
        Some(&pid) => Err(TargetError::NoSuchProcess(pid)),
        None => Ok(()),
    }
}

/// Every process running now.
pub fn all_pids() -> Vec<u32> {
    procfs::process::all_processes().map_or_else(|_| Vec::new(), |all| all.filter_map(|p| p.ok().map(|p| p.pid as u32)).collect())
}

/// Starts `COMMAND [ARGS...]` as pyebpf's child. With `stdout_to_stderr` (the profile goes to
/// standard output) the command's own output goes to standard error, so it cannot mix into the profile.
pub fn launch(command: &[String], stdout_to_stderr: bool) -> Result<Child, TargetError> {
    let (program, args) = command.split_first().expect("clap requires a command here");
    let spawn_error = |source| TargetError::Spawn { command: command.join(" "), source };
    let mut launched = Command::new(program);
    launched.args(args);
    if stdout_to_stderr {
        launched.stdout(Stdio::from(std::io::stderr().as_fd().try_clone_to_owned().map_err(spawn_error)?));
    }
    launched.spawn().map_err(spawn_error)
}

/// Process names, read once per process so every thread of a process shares one root frame.
#[derive(Default)]
pub struct ProcessNames {
    names: HashMap<u32, Arc<str>>,
}

impl ProcessNames {
    /// The process's `comm`, or `fallback` (the sampled thread's) when it has already exited.
    pub fn name(&mut self, pid: u32, fallback: &[u8]) -> Arc<str> {
        self.names
            .entry(pid)
            .or_insert_with(|| {
                std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .map(|comm| comm.trim_end().into())
                    .unwrap_or_else(|_| comm_to_string(fallback).into())
            })
            .clone()
    }
}

/// A kernel `comm` buffer as text, up to its terminating NUL.
pub fn comm_to_string(comm: &[u8]) -> String {
    let end = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
    String::from_utf8_lossy(&comm[..end]).into_owned()
}

/// For a process in a PID namespace other than pyebpf's (a container), its threads' ids as the
/// process sees them mapped to the host's; `None` when it shares pyebpf's namespace.
pub fn namespace_tids(pid: u32) -> Option<HashMap<u32, u32>> {
    let ns = |path: String| std::fs::read_link(path).ok();
    let theirs = ns(format!("/proc/{pid}/ns/pid"))?;
    if Some(&theirs) == ns("/proc/self/ns/pid".into()).as_ref() {
        return None;
    }
    let tasks = procfs::process::Process::new(pid as i32).ok()?.tasks().ok()?;
    let map = tasks
        .filter_map(|task| {
            let ids = task.ok()?.status().ok()?.nspid?;
            // NSpid lists the id in each namespace from the host's down to the process's own.
            Some((*ids.last()? as u32, *ids.first()? as u32))
        })
        .collect();
    Some(map)
}
