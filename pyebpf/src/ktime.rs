//! The kernel's sample clock (`bpf_ktime_get_ns`, i.e. `CLOCK_MONOTONIC`), read from userspace.

/// `CLOCK_MONOTONIC` now, in nanoseconds: comparable with a record's `time_ns`.
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime fills the timespec it is given.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) } != 0 {
        return 0;
    }
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}
