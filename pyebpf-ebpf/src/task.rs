//! Fields of the kernel's `task_struct`, read from the task pointers the BTF-typed tracepoints
//! receive. Their offsets differ between kernel builds: userspace takes them from the kernel's BTF
//! and sets them at load time, in read-only globals the verifier sees as constants. So a read is a
//! plain load the verifier checks against the type (and the JIT guards), not a helper call: the
//! switch hook makes two for every context switch on the host.

use aya_ebpf::Global;

#[no_mangle]
static TASK_PID_OFFSET: Global<u32> = Global::new(0);
#[no_mangle]
static TASK_TGID_OFFSET: Global<u32> = Global::new(0);

/// `task`'s thread id (`pid`) and process id (`tgid`).
#[inline(always)]
pub fn ids(task: *const u8) -> (u32, u32) {
    // SAFETY: `task` is a `struct task_struct *` argument of a BTF-typed tracepoint and the
    // offsets are its members' (from the kernel's BTF); the verifier checks both.
    unsafe {
        (
            core::ptr::read_volatile(task.add(TASK_PID_OFFSET.load() as usize) as *const u32),
            core::ptr::read_volatile(task.add(TASK_TGID_OFFSET.load() as usize) as *const u32),
        )
    }
}
