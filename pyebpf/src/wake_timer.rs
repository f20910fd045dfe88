//! A one-shot timer the kernel fires at its deadline, for the recording's periodic work. On its
//! way to a deadline seconds away tokio's timer wheel wakes the thread at each level it moves the
//! timer down (three wakeups for a 2 s sleep, measured here), and on a virtual machine a wakeup
//! costs tens of microseconds of CPU however little it does: a host-wide profiler left running
//! pays that every period, idle or not.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

pub struct WakeTimer {
    fd: AsyncFd<OwnedFd>,
    /// When it fires (or fired).
    deadline: Instant,
}

impl WakeTimer {
    /// A timer that fires `after` from now. Must be called inside the tokio runtime.
    pub fn after(after: Duration) -> io::Result<WakeTimer> {
        // SAFETY: no pointers; returns a new descriptor, or -1.
        let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just created, which nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: `fd` is owned here, open, and moves into the AsyncFd, which closes it.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }?;
        let mut timer = WakeTimer { fd, deadline: Instant::now() };
        timer.set(after)?;
        Ok(timer)
    }

    /// Fires once, `after` from now, in place of any deadline set before (and of a firing not
    /// waited for yet).
    pub fn set(&mut self, after: Duration) -> io::Result<()> {
        // A zero deadline would disarm it.
        let after = after.max(Duration::from_nanos(1));
        let zero = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        let value = libc::timespec { tv_sec: after.as_secs() as _, tv_nsec: after.subsec_nanos() as libc::c_long };
        let spec = libc::itimerspec { it_interval: zero, it_value: value };
        // SAFETY: a timerfd of ours and a valid itimerspec; the old setting is not asked for.
        if unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        self.deadline = Instant::now() + after;
        Ok(())
    }

    /// The time left before it fires: zero once it fired.
    pub fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// Waits until it fires; at once if it fired since it was set and this was not awaited.
    /// Cancel-safe: dropped before it fires, the firing waits for the next call.
    pub async fn fired(&self) {
        loop {
            let Ok(mut ready) = self.fd.readable().await else {
                return std::future::pending().await;
            };
            let mut expirations = 0u64;
            // SAFETY: a timerfd is read 8 bytes at a time, here into `expirations`; the
            // descriptor is non-blocking (EAGAIN when it has not fired).
            let read = unsafe { libc::read(self.fd.as_raw_fd(), (&mut expirations as *mut u64).cast(), 8) };
            if read == 8 {
                return;
            }
            ready.clear_ready();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::WakeTimer;

    #[tokio::test]
    async fn fires_once_at_its_deadline_and_a_new_deadline_replaces_the_old() {
        let started = Instant::now();
        let mut timer = WakeTimer::after(Duration::from_millis(50)).unwrap();
        assert!(timer.left() > Duration::from_millis(30) && timer.left() <= Duration::from_millis(50), "{:?}", timer.left());
        timer.fired().await;
        let first = started.elapsed();
        assert!(first >= Duration::from_millis(50), "fired after {first:?}");
        assert_eq!(timer.left(), Duration::ZERO);
        // Not again until set again.
        assert!(tokio::time::timeout(Duration::from_millis(120), timer.fired()).await.is_err(), "a one-shot timer fired twice");
        timer.set(Duration::from_secs(3600)).unwrap();
        timer.set(Duration::from_millis(20)).unwrap();
        let again = Instant::now();
        tokio::time::timeout(Duration::from_secs(5), timer.fired()).await.expect("the later setting replaces the hour-long one");
        assert!(again.elapsed() >= Duration::from_millis(20));
    }
}
