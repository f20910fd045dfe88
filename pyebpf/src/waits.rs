//! Off-CPU intervals (`--mode wall` and `off-cpu`): why a thread waited, from the system call it
//! waited in and the native frames around it; and the intervals still open when a recording ends
//! (a thread blocked on a lock throughout), whose stacks are read then, from a thread proven not to
//! have run since it left the CPU.

use std::collections::HashMap;

use pyebpf_common::{origin, OffCpuStart, SampleRecord, STACK_SNAPSHOT_MAX};

use crate::cpython::memory::{ProcessMemory, ReadMemory};
use crate::stack::{Frame, ThreadState};

/// Native functions a thread blocks in only while it waits to take the GIL.
const GIL_WAITS: [&str; 6] = ["take_gil", "PyEval_RestoreThread", "PyEval_AcquireThread", "PyEval_AcquireLock", "_PyThreadState_Attach", "PyGILState_Ensure"];

/// Native functions that sleep: `time.sleep` (`pysleep`) waits in `select` before 3.11.
const SLEEPS: [&str; 2] = ["pysleep", "time_sleep"];

/// Parts of kernel function names by what waiting under them means.
const KERNEL_SLEEPS: [&str; 1] = ["nanosleep"];
const KERNEL_LOCKS: [&str; 3] = ["futex", "rwsem", "mutex_lock"];
const KERNEL_IO: [&str; 12] = ["poll", "select", "pipe_", "sock_", "tcp_", "udp_", "unix_", "wait_woken", "io_schedule", "vfs_read", "vfs_write", "n_tty_"];

/// Why a thread was off CPU: preempted (waiting for a CPU), waiting for the GIL, sleeping, on a
/// lock, on I/O; from the task state it left the CPU in (0: still runnable) and the functions of
/// its stack.
pub fn wait_reason<'a>(state: u32, frames: impl Iterator<Item = &'a Frame> + Clone) -> ThreadState {
    if state == 0 {
        return ThreadState::Runqueue;
    }
    let native = |names: &[&str]| {
        frames.clone().any(|frame| matches!(frame, Frame::Native(native) if native.symbol.as_deref().is_some_and(|symbol| names.contains(&symbol))))
    };
    let kernel = |parts: &[&str]| {
        frames.clone().any(
            |frame| matches!(frame, Frame::Kernel(kernel) if kernel.symbol.as_deref().is_some_and(|symbol| parts.iter().any(|part| symbol.contains(part)))),
        )
    };
    if native(&GIL_WAITS) {
        ThreadState::Gil
    } else if native(&SLEEPS) || kernel(&KERNEL_SLEEPS) {
        ThreadState::Sleep
    } else if kernel(&KERNEL_LOCKS) {
        ThreadState::Lock
    } else if kernel(&KERNEL_IO) {
        ThreadState::Io
    } else {
        ThreadState::Other
    }
}

/// Builds the record of a thread off CPU since before the switch hook watched it, as the hook
/// would have captured it: weighted from `start` to `now_ns`, with its kernel stack
/// (`/proc/.../stack`, named symbols resolved through `kernel_symbols`), its user registers
/// (`/proc/.../syscall`) and a copy of its user stack for CFI unwinding. The Python part is the
/// caller's. None when the thread is gone or not in a system call.
pub fn waiting_record(tid: u32, start: &OffCpuStart, now_ns: u64, kernel_symbols: &KernelSymbols) -> Option<Box<SampleRecord>> {
    let task = format!("/proc/{}/task/{tid}", start.tgid);
    let (sp, pc) = syscall_registers(&std::fs::read_to_string(format!("{task}/syscall")).ok()?)?;
    // SAFETY: all-zero bytes are a valid SampleRecord (plain data).
    let mut record = unsafe { Box::<SampleRecord>::new_zeroed().assume_init() };
    record.kind = pyebpf_common::record_kind::SAMPLE;
    record.origin = origin::OFF_CPU;
    record.tgid = start.tgid;
    record.tid = tid;
    record.time_ns = now_ns;
    record.weight_ns = now_ns.saturating_sub(start.start_ns);
    record.wait_state = start.state;
    let comm = std::fs::read(format!("{task}/comm")).unwrap_or_default();
    let comm = comm.strip_suffix(b"\n").unwrap_or(&comm);
    let len = comm.len().min(record.comm.len());
    record.comm[..len].copy_from_slice(&comm[..len]);
    if let Ok(stack) = std::fs::read_to_string(format!("{task}/stack")) {
        let addrs: Vec<u64> = stack.lines().filter_map(|line| kernel_symbols.address_of(line)).take(record.kernel_stack.len()).collect();
        record.kernel_stack[..addrs.len()].copy_from_slice(&addrs);
        record.kernel_len = addrs.len() as u32;
    }
    record.user_stack[0] = pc;
    record.user_len = 1;
    record.user_sp = sp;
    record.stack_len = copy_stack(&ProcessMemory::new(start.tgid), sp, &mut record.stack_tail[..STACK_SNAPSHOT_MAX]) as u32;
    Some(record)
}

/// The stack and instruction pointers of a thread blocked in a system call, from its
/// `/proc/PID/task/TID/syscall` (`NR ARG1 ... ARG6 SP PC`); None when it is running or not in one.
fn syscall_registers(text: &str) -> Option<(u64, u64)> {
    let fields: Vec<&str> = text.split_whitespace().collect();
    if fields.len() != 9 {
        return None;
    }
    let hex = |field: &str| u64::from_str_radix(field.strip_prefix("0x")?, 16).ok();
    Some((hex(fields[7])?, hex(fields[8])?))
}

/// Copies the stack from `sp` up, page by page, until `out` is full or a page cannot be read;
/// returns the bytes copied.
fn copy_stack(memory: &ProcessMemory, sp: u64, out: &mut [u8]) -> usize {
    const PAGE: u64 = 4096;
    let mut copied = 0;
    while copied < out.len() {
        let at = sp + copied as u64;
        let len = ((PAGE - at % PAGE) as usize).min(out.len() - copied);
        if memory.read(at, &mut out[copied..copied + len]).is_err() {
            break;
        }
        copied += len;
    }
    copied
}

/// How many times each thread of the watched processes had left the CPU when the switch hooks
/// started watching: a thread blocked since before then never leaves the CPU again, so the hooks
/// never see it; one whose count has not moved by the end was off CPU throughout.
#[derive(Default)]
pub struct SwitchBaseline {
    /// `CLOCK_MONOTONIC` when the counts were read.
    taken_ns: u64,
    /// tid -> (tgid, context switches).
    threads: HashMap<u32, (u32, u64)>,
}

impl SwitchBaseline {
    pub fn take(pids: impl IntoIterator<Item = u32>, now_ns: u64) -> SwitchBaseline {
        let mut threads = HashMap::new();
        for pid in pids {
            let Ok(tasks) = procfs::process::Process::new(pid as i32).and_then(|process| process.tasks()) else { continue };
            for task in tasks.flatten() {
                if let Some(switches) = switches(&task) {
                    threads.insert(task.tid as u32, (pid, switches));
                }
            }
        }
        SwitchBaseline { taken_ns: now_ns, threads }
    }

    /// Threads off CPU since the counts were read, as intervals that started then (with the task
    /// state they are in now).
    pub fn blocked_throughout(&self) -> Vec<(u32, OffCpuStart)> {
        self.threads
            .iter()
            .filter(|(&tid, &(tgid, _))| self.unchanged(tgid, tid))
            .filter_map(|(&tid, &(tgid, _))| Some((tid, OffCpuStart { start_ns: self.taken_ns, state: blocked_state(tgid, tid)?, tgid, ..Default::default() })))
            .collect()
    }

    /// Whether `tid` has not left the CPU since the counts were read (so it has not run since).
    pub fn unchanged(&self, tgid: u32, tid: u32) -> bool {
        let Some(&(_, before)) = self.threads.get(&tid) else { return false };
        procfs::process::Process::new(tgid as i32).and_then(|process| process.task_from_tid(tid as i32)).ok().and_then(|task| switches(&task)) == Some(before)
    }
}

fn switches(task: &procfs::process::Task) -> Option<u64> {
    let status = task.status().ok()?;
    Some(status.voluntary_ctxt_switches? + status.nonvoluntary_ctxt_switches?)
}

/// The task state of a thread that is off CPU (`S` interruptible, `D` uninterruptible), as the
/// scheduler's `prev_state` spells it; None for one that runs or is runnable.
fn blocked_state(tgid: u32, tid: u32) -> Option<u32> {
    let task = procfs::process::Process::new(tgid as i32).and_then(|process| process.task_from_tid(tid as i32)).ok()?;
    match task.stat().ok()?.state {
        'S' => Some(1),
        'D' => Some(2),
        _ => None,
    }
}

/// Kernel function addresses by name, from /proc/kallsyms: /proc/PID/stack names frames
/// (`do_futex+0x134/0x1c0`) but hides their addresses.
#[derive(Default)]
pub struct KernelSymbols {
    addresses: HashMap<String, u64>,
}

impl KernelSymbols {
    pub fn read() -> KernelSymbols {
        let text = std::fs::read_to_string("/proc/kallsyms").unwrap_or_default();
        KernelSymbols::parse(&text)
    }

    fn parse(kallsyms: &str) -> KernelSymbols {
        let mut addresses = HashMap::new();
        for line in kallsyms.lines() {
            let mut fields = line.split_whitespace();
            let (Some(addr), Some(_), Some(name)) = (fields.next(), fields.next(), fields.next()) else { continue };
            if let Ok(addr) = u64::from_str_radix(addr, 16) {
                addresses.entry(name.to_string()).or_insert(addr);
            }
        }
        KernelSymbols { addresses }
    }

    /// The address of a `/proc/PID/stack` line's frame (`[<0>] do_futex+0x134/0x1c0`).
    fn address_of(&self, line: &str) -> Option<u64> {
        let frame = line.split_whitespace().nth(1)?;
        let (name, offsets) = frame.split_once('+')?;
        let offset = u64::from_str_radix(offsets.split('/').next()?.strip_prefix("0x")?, 16).ok()?;
        Some(self.addresses.get(name)? + offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stack::{KernelFrame, NativeFrame};

    fn kernel(name: &str) -> Frame {
        Frame::Kernel(KernelFrame { addr: 1, symbol: Some(name.into()) })
    }

    fn native(name: &str) -> Frame {
        Frame::Native(NativeFrame { addr: 1, module: None, symbol: Some(name.into()), file: None, line: None })
    }

    #[test]
    fn waits_are_told_apart_by_state_and_frames() {
        const INTERRUPTIBLE: u32 = 1;
        let reason = |state: u32, frames: &[Frame]| wait_reason(state, frames.iter());
        let futex = [kernel("futex_wait_queue"), kernel("do_futex"), native("sem_clockwait")];
        assert_eq!(reason(INTERRUPTIBLE, &futex), ThreadState::Lock);
        assert_eq!(reason(0, &futex), ThreadState::Runqueue);
        let gil = [kernel("futex_wait_queue"), native("pthread_cond_timedwait"), native("take_gil"), native("PyEval_RestoreThread")];
        assert_eq!(reason(INTERRUPTIBLE, &gil), ThreadState::Gil);
        assert_eq!(reason(INTERRUPTIBLE, &[kernel("do_nanosleep"), kernel("hrtimer_nanosleep")]), ThreadState::Sleep);
        // time.sleep before 3.11 waits in select().
        assert_eq!(reason(INTERRUPTIBLE, &[kernel("do_select"), native("select"), native("pysleep")]), ThreadState::Sleep);
        assert_eq!(reason(INTERRUPTIBLE, &[kernel("do_select"), native("select")]), ThreadState::Io);
        assert_eq!(reason(INTERRUPTIBLE, &[kernel("pipe_read"), kernel("vfs_read")]), ThreadState::Io);
        assert_eq!(reason(INTERRUPTIBLE, &[kernel("do_wait")]), ThreadState::Other);
    }

    #[test]
    fn blocked_threads_give_their_registers_and_kernel_frames() {
        let syscall = "202 0x7f0d2c0b0910 0x189 0x0 0x0 0x0 0xffffffff 0x7ffc6a3e8f18 0x7f0d2c9a4d36\n";
        assert_eq!(syscall_registers(syscall), Some((0x7ffc6a3e8f18, 0x7f0d2c9a4d36)));
        assert_eq!(syscall_registers("running\n"), None);
        assert_eq!(syscall_registers("-1 0x7ffc6a3e8f18 0x7f0d2c9a4d36\n"), None);
        let symbols = KernelSymbols::parse("ffffffff81200000 T do_futex\nffffffff81300000 t futex_wait_queue\n");
        assert_eq!(symbols.address_of("[<0>] do_futex+0x134/0x1c0"), Some(0xffffffff81200134));
        assert_eq!(symbols.address_of("[<0>] unknown_fn+0x1/0x2"), None);
        assert_eq!(symbols.address_of("garbage"), None);
    }
}
