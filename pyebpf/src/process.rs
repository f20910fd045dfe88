//! The processes a recording covers: every process, given PIDs, or a launched command.

use std::collections::{HashMap, HashSet};
use std::os::fd::AsFd;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cpython::runtime;

/// How often processes seen in samples are checked for having exited.
const EXIT_CHECK_INTERVAL: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("no such process: {0}")]
    NoSuchProcess(u32),
    #[error("cannot start `{command}`: {cause}")]
    Spawn { command: String, cause: std::io::Error },
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
    let spawn_error = |cause| TargetError::Spawn { command: command.join(" "), cause };
    let mut launched = Command::new(program);
    launched.args(args);
    if stdout_to_stderr {
        launched.stdout(Stdio::from(std::io::stderr().as_fd().try_clone_to_owned().map_err(spawn_error)?));
    }
    launched.spawn().map_err(spawn_error)
}

/// Raises the soft limit on open files to the hard limit: symbolization keeps the files of every
/// process sampled open (up to its own bound), and a host runs many.
pub fn raise_open_file_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write the struct they are given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// Finds the processes that have exited, so that what is kept about them can go. A process is
/// reported only once it was found gone at two checks in a row: its last samples, still in the
/// ring buffer when it exited, have been resolved by then.
pub struct ExitWatch {
    checked_at: Instant,
    gone: HashSet<u32>,
}

impl Default for ExitWatch {
    fn default() -> Self {
        ExitWatch { checked_at: Instant::now(), gone: HashSet::new() }
    }
}

impl ExitWatch {
    /// Of `pids`, those gone for a whole check interval; empty between checks.
    pub fn exited(&mut self, pids: impl IntoIterator<Item = u32>) -> Vec<u32> {
        if self.checked_at.elapsed() < EXIT_CHECK_INTERVAL {
            return Vec::new();
        }
        self.checked_at = Instant::now();
        let now_gone: HashSet<u32> = pids.into_iter().filter(|pid| runtime::has_exited(*pid)).collect();
        let exited = now_gone.intersection(&self.gone).copied().collect();
        self.gone = now_gone;
        exited
    }
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

    pub fn pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.names.keys().copied()
    }

    pub fn forget(&mut self, pids: &[u32]) {
        for pid in pids {
            self.names.remove(pid);
        }
    }
}

/// A kernel `comm` buffer as text, up to its terminating NUL.
pub fn comm_to_string(comm: &[u8]) -> String {
    let end = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
    String::from_utf8_lossy(&comm[..end]).into_owned()
}
