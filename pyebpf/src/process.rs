//! The processes a recording covers: every process, given PIDs (watched until they exit), or a
//! launched command.

use std::collections::HashMap;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::process::{Child, Command, Stdio};

#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("no such process: {0}")]
    NoSuchProcess(u32),
    #[error("cannot watch process {pid}: {cause}")]
    Watch { pid: u32, cause: std::io::Error },
    #[error("cannot start `{command}`: {cause}")]
    Spawn { command: String, cause: std::io::Error },
}

/// The processes given with `-p`, held by pidfds: a pidfd refers to its process only, so a PID
/// reused after the process exited is never mistaken for it.
pub struct Watched {
    pidfds: Vec<OwnedFd>,
}

impl Watched {
    /// Opens every PID; fails on the first that names no running process.
    pub fn open(pids: &[u32]) -> Result<Watched, TargetError> {
        let pidfds = pids.iter().map(|&pid| pidfd_open(pid)).collect::<Result<_, _>>()?;
        Ok(Watched { pidfds })
    }

    /// Their pidfds, for [`exits`].
    pub fn pidfds(&self) -> std::io::Result<Vec<OwnedFd>> {
        self.pidfds.iter().map(OwnedFd::try_clone).collect()
    }
}

/// Completes once the launched command has exited, or every watched process has (each pidfd
/// becomes readable when its process exits, also while it is an unreaped zombie); never without
/// them. Nothing is polled meanwhile.
pub async fn exits(command: Option<OwnedFd>, watched: Vec<OwnedFd>) -> std::io::Result<()> {
    tokio::select! {
        result = all_exited(command.into_iter().collect()) => result,
        result = all_exited(watched) => result,
    }
}

async fn all_exited(pidfds: Vec<OwnedFd>) -> std::io::Result<()> {
    if pidfds.is_empty() {
        return std::future::pending().await;
    }
    for pidfd in pidfds {
        // SAFETY: `pidfd` is owned here, open, and moves into the AsyncFd, which closes it.
        let pidfd = unsafe { tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE) }?;
        let _ = pidfd.readable().await?;
    }
    Ok(())
}

fn pidfd_open(pid: u32) -> Result<OwnedFd, TargetError> {
    let Ok(raw_pid) = libc::pid_t::try_from(pid) else { return Err(TargetError::NoSuchProcess(pid)) };
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw_pid, 0) };
    if fd < 0 {
        let err = std::io::Error::last_os_error();
        return Err(match err.raw_os_error() {
            Some(libc::ESRCH) | Some(libc::EINVAL) => TargetError::NoSuchProcess(pid),
            _ => TargetError::Watch { pid, cause: err },
        });
    }
    // SAFETY: the descriptor was just created and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Every process running now.
pub fn all_pids() -> Vec<u32> {
    procfs::process::all_processes().map_or_else(|_| Vec::new(), |all| all.filter_map(|p| p.ok().map(|p| p.pid as u32)).collect())
}

/// The launched `COMMAND`: the first stop signal pyebpf gets is passed on to it, as perf and
/// py-spy do, and the recording goes on until it exits.
pub struct Launched {
    child: Child,
    signalled: bool,
}

impl Launched {
    /// Starts `COMMAND [ARGS...]` as pyebpf's child. With `stdout_to_stderr` (the profile goes to
    /// standard output) the command's own output goes to standard error, so it cannot mix into
    /// the profile.
    pub fn start(command: &[String], stdout_to_stderr: bool) -> Result<Launched, TargetError> {
        let (program, args) = command.split_first().expect("clap requires a command here");
        let spawn_error = |cause| TargetError::Spawn { command: command.join(" "), cause };
        let mut launched = Command::new(program);
        launched.args(args);
        crate::stop_signals::as_inherited(&mut launched);
        if stdout_to_stderr {
            launched.stdout(Stdio::from(std::io::stderr().as_fd().try_clone_to_owned().map_err(spawn_error)?));
        }
        let child = launched.spawn().map_err(spawn_error)?;
        Ok(Launched { child, signalled: false })
    }

    /// Passes `signal` to the command unless one was passed already (a command that ignored it
    /// should not keep pyebpf from stopping); returns whether it was passed.
    pub fn pass_signal(&mut self, signal: i32) -> bool {
        if self.signalled {
            return false;
        }
        self.signalled = true;
        // SAFETY: kill has no memory preconditions; pyebpf never reaps the child while it
        // records, so its PID still names it.
        unsafe { libc::kill(self.child.id() as libc::pid_t, signal) == 0 }
    }

    /// A pidfd of the command, for [`exits`].
    pub fn pidfd(&self) -> Result<OwnedFd, TargetError> {
        // Its PID names it until it is reaped, which only pyebpf does.
        pidfd_open(self.child.id())
    }
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

/// A kernel `comm` buffer as text, up to its terminating NUL.
pub fn comm_to_string(comm: &[u8]) -> String {
    let end = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
    String::from_utf8_lossy(&comm[..end]).into_owned()
}

/// Whether `pid` is in pyebpf's PID namespace; None if that cannot be read (it exited). A process
/// never changes its PID namespace, so the answer holds for its life.
pub fn shares_pid_namespace(pid: u32) -> Option<bool> {
    let ns = |path: String| std::fs::read_link(path).ok();
    let theirs = ns(format!("/proc/{pid}/ns/pid"))?;
    Some(Some(&theirs) == ns("/proc/self/ns/pid".into()).as_ref())
}

/// `/proc/PID/stat`, read without opening the process's directory first (as
/// `procfs::process::Process::stat` does): it is read for each process new to a recording.
pub fn stat(pid: u32) -> procfs::ProcResult<procfs::process::Stat> {
    use procfs::FromRead;
    procfs::process::Stat::from_file(format!("/proc/{pid}/stat"))
}

/// The id of a task (a process, or a thread with `tid`) in its own PID namespace: the last of
/// `NSpid` in its status, as the process itself and its thread states name it. None where the
/// task is gone or the kernel does not say.
pub fn own_namespace_id(pid: u32, tid: Option<u32>) -> Option<u32> {
    let path = match tid {
        Some(tid) => format!("/proc/{pid}/task/{tid}/status"),
        None => format!("/proc/{pid}/status"),
    };
    let status = std::fs::read_to_string(path).ok()?;
    status.lines().find_map(|line| line.strip_prefix("NSpid:"))?.split_whitespace().last()?.parse().ok()
}

/// For a process in a PID namespace other than pyebpf's (a container, see
/// [`shares_pid_namespace`]), its threads' ids as the process sees them mapped to the host's.
pub fn namespace_tids(pid: u32) -> Option<HashMap<u32, u32>> {
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
