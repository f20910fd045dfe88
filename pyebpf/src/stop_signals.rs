//! Stop signals: one policy, in force from the first line of `main` to the exit.
//!
//! - SIGTERM and SIGINT stop pyebpf, which then writes what it has, whatever its parent left them
//!   at: a script's background job starts with SIGINT ignored, and `kill -INT` still stops it.
//! - SIGHUP stops it the same way, unless its parent left SIGHUP ignored (`nohup`): then it stays
//!   ignored for the whole run, so the recording outlives the terminal.
//! - A stop signal the parent left blocked is unblocked, so it is not held back for ever.
//!
//! The handler only writes the signal's number into a pipe, so a signal that arrives while pyebpf
//! is still loading is kept, and the recording loop acts on it as soon as it runs. A signal sent
//! before pyebpf's first instruction (during the exec itself) meets its parent's disposition: the
//! default ends pyebpf before it has recorded anything; an ignored one is dropped by the kernel.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// The signals that stop pyebpf.
const STOP_SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

static PIPE_READ: AtomicI32 = AtomicI32::new(-1);
static PIPE_WRITE: AtomicI32 = AtomicI32::new(-1);
/// Off for commands with nothing to write (`dump`): a stop signal ends them at once.
static GRACEFUL: AtomicBool = AtomicBool::new(true);
/// Bit `1 << signal` of each stop signal the parent left ignored.
static INHERITED_IGNORED: AtomicU32 = AtomicU32::new(0);

/// Installs the policy; the first thing `main` does.
pub fn install() -> io::Result<()> {
    let mut fds = [-1; 2];
    // SAFETY: pipe2 fills the two descriptors it is given.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    PIPE_READ.store(fds[0], Ordering::Relaxed);
    PIPE_WRITE.store(fds[1], Ordering::Relaxed);
    let mut unblock = empty_set();
    for signal in STOP_SIGNALS {
        if disposition(signal)? == libc::SIG_IGN {
            INHERITED_IGNORED.fetch_or(1 << signal, Ordering::Relaxed);
            if signal == libc::SIGHUP {
                continue;
            }
        }
        set_disposition(signal, on_stop as *const () as libc::sighandler_t)?;
        // SAFETY: the set was initialised by sigemptyset.
        unsafe { libc::sigaddset(&mut unblock, signal) };
    }
    // SAFETY: a valid set; the old mask is not wanted. Unblocked after the handlers are in place,
    // so a signal already pending reaches the handler.
    if unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &unblock, std::ptr::null_mut()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// For commands that write nothing at the end (`dump`): from now on a stop signal ends pyebpf at
/// once, as its default action would, and one that came before does so now.
pub fn exit_at_once() {
    GRACEFUL.store(false, Ordering::SeqCst);
    if let Some(signal) = read_pending() {
        // SAFETY: _exit ends the process; nothing is left to write.
        unsafe { libc::_exit(128 + signal) };
    }
}

/// Has `command` start with the stop signals as pyebpf's parent left them (exec resets handled
/// signals to the default, and would undo an inherited ignore): a launched command behaves as it
/// would without pyebpf in between.
pub fn as_inherited(command: &mut Command) {
    let ignored = INHERITED_IGNORED.load(Ordering::Relaxed);
    // SAFETY: the closure only calls sigaction, which is async-signal-safe, between fork and exec.
    unsafe {
        command.pre_exec(move || {
            for signal in STOP_SIGNALS {
                let handler = if ignored & (1 << signal) != 0 { libc::SIG_IGN } else { libc::SIG_DFL };
                set_disposition(signal, handler)?;
            }
            Ok(())
        });
    }
}

/// The stop signals that arrive, in order, for the async loops of `record` and `top`.
pub struct StopSignals {
    pipe: AsyncFd<OwnedFd>,
}

impl StopSignals {
    /// Must be called inside the tokio runtime, after [`install`].
    pub fn new() -> io::Result<StopSignals> {
        let fd = PIPE_READ.load(Ordering::Relaxed);
        if fd < 0 {
            return Err(io::Error::other("the stop-signal handlers are not installed"));
        }
        // SAFETY: the pipe's read end stays open for the whole run (nothing closes it).
        let read_end = unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned()?;
        // SAFETY: `read_end` is owned here, open, and moves into the AsyncFd, which closes it.
        let pipe = unsafe { AsyncFd::register_with_interest(read_end, Interest::READABLE) }?;
        Ok(StopSignals { pipe })
    }

    /// The next stop signal (one that came before this was called included).
    pub async fn next(&mut self) -> i32 {
        loop {
            let Ok(mut ready) = self.pipe.readable().await else {
                return std::future::pending().await;
            };
            match read_pending() {
                Some(signal) => return signal,
                None => ready.clear_ready(),
            }
        }
    }
}

/// One signal number from the pipe, if one is there.
fn read_pending() -> Option<i32> {
    let mut byte = 0u8;
    // SAFETY: reads at most one byte into `byte`; the descriptor is non-blocking.
    let read = unsafe { libc::read(PIPE_READ.load(Ordering::Relaxed), (&mut byte as *mut u8).cast(), 1) };
    (read == 1).then_some(i32::from(byte))
}

extern "C" fn on_stop(signal: libc::c_int) {
    if !GRACEFUL.load(Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(128 + signal) };
    }
    // SAFETY: errno is thread-local; the handler restores what it found, as handlers must.
    let errno = unsafe { *libc::__errno_location() };
    let byte = signal as u8;
    // SAFETY: write is async-signal-safe; one byte from a local. A full pipe (hundreds of unread
    // signals) drops this one, which changes nothing: the loop stops at the first.
    unsafe { libc::write(PIPE_WRITE.load(Ordering::Relaxed), (&byte as *const u8).cast(), 1) };
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

fn empty_set() -> libc::sigset_t {
    let mut set = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigemptyset initialises the set it is given.
    unsafe {
        libc::sigemptyset(set.as_mut_ptr());
        set.assume_init()
    }
}

/// The handler `signal` has now.
fn disposition(signal: libc::c_int) -> io::Result<libc::sighandler_t> {
    let mut old = std::mem::MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: with no new action, sigaction only fills `old`.
    if unsafe { libc::sigaction(signal, std::ptr::null(), old.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: filled by sigaction above.
    Ok(unsafe { old.assume_init() }.sa_sigaction)
}

fn set_disposition(signal: libc::c_int, handler: libc::sighandler_t) -> io::Result<()> {
    let mut action = std::mem::MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: a zeroed sigaction is valid; its mask is then emptied and its fields set.
    let mut action = unsafe {
        libc::sigemptyset(&mut (*action.as_mut_ptr()).sa_mask);
        action.assume_init()
    };
    action.sa_sigaction = handler;
    // Interrupted system calls resume: pyebpf's threads never see EINTR from a stop.
    action.sa_flags = libc::SA_RESTART;
    // SAFETY: a valid action; the old one is not wanted.
    if unsafe { libc::sigaction(signal, &action, std::ptr::null_mut()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
