//! Checked reads of the profiled process's memory: a fault is `None`, not a crash.

use aya_ebpf::helpers::bpf_probe_read_user;

pub fn read_u64(addr: u64) -> Option<u64> {
    // SAFETY: bpf_probe_read_user checks the address; a fault is an error, not a crash.
    unsafe { bpf_probe_read_user(addr as *const u64).ok() }
}

pub fn read_u32(addr: u64) -> Option<u32> {
    // SAFETY: as in read_u64.
    unsafe { bpf_probe_read_user(addr as *const u32).ok() }
}

pub fn read_u8(addr: u64) -> Option<u8> {
    // SAFETY: as in read_u64.
    unsafe { bpf_probe_read_user(addr as *const u8).ok() }
}
