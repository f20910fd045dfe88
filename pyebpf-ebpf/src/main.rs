//! pyebpf's eBPF programs, one module per hook: the timer clock (`tick`), the perf-event sampler
//! of kernels without it (`sample`), the scheduler's
//! switch hooks for off-CPU time (`switch`) and the process lifecycle (`lifecycle`). Each hook that
//! captures stacks calls the one capture (`capture`) with its origin and weight; the maps they
//! share are defined here, and every record leaves through one door (`emit`).
#![no_std]
#![no_main]

mod asyncio;
mod capture;
mod emit;
mod frame;
mod lifecycle;
mod python;
mod read;
mod sample;
mod switch;
mod task;
mod tick;
mod user_stack;

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, PerCpuArray, RingBuf},
};
use pyebpf_common::unwind::{UnwindPage, UnwindPageKey, MAX_UNWIND_PAGES};
use pyebpf_common::{
    ClockSlot, Config, MarkerChain, OffCpuStart, PyProcConfig, PyThreadEntry, SampleRecord, WaitingTasks, MAX_SNAPSHOT_PROCS, PY_FRAME_WINDOW, WAIT_PROCS_WORDS,
};

/// Userspace sets the real size at load time (`--ring-buffer-kb`).
#[map]
static SAMPLES: RingBuf = RingBuf::with_byte_size(4096 * 1024, 0);

#[map]
static LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(2, 0);
/// Slot of `LOST` counting samples and the records that go with them dropped.
const LOST_SAMPLES: u32 = 0;
/// Slot of `LOST` counting lifecycle events dropped.
const LOST_EVENTS: u32 = 1;

#[map]
static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

/// Per CPU (indexed by CPU; userspace sizes it), where its sampling clock is within the current
/// slot. Mapped into userspace, so the clock thread sees which CPUs sample without a syscall.
#[map]
static CLOCK: Array<ClockSlot> = Array::with_max_entries(1, BPF_F_MMAPABLE);

#[map]
static TARGETS: HashMap<u32, u8> = HashMap::with_max_entries(65536, 0);

#[map]
static PY_PROCS: HashMap<u32, PyProcConfig> = HashMap::with_max_entries(4096, 0);

#[map]
static PY_THREADS: HashMap<u32, PyThreadEntry> = HashMap::with_max_entries(65536, 0);

/// Not preallocated: a replaced entry is freed only after programs reading it are done, so a
/// lookup never sees a value half overwritten by the next one.
#[map]
static PY_MARKERS: HashMap<u32, MarkerChain> = HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// Processes whose user stack is copied at each sample (`--unwind auto` adds them).
#[map]
static SNAPSHOT_PROCS: HashMap<u32, u8> = HashMap::with_max_entries(MAX_SNAPSHOT_PROCS, 0);

/// The rules the program unwinds copied processes' stacks by, a page of code each. Not
/// preallocated, for the same reason as `PY_MARKERS`, and so unused room costs nothing.
#[map]
static UNWIND_PAGES: HashMap<UnwindPageKey, UnwindPage> = HashMap::with_max_entries(MAX_UNWIND_PAGES, BPF_F_NO_PREALLOC);

/// The record is built here (it is too large for the stack), then its used part is sent. One
/// entry per CPU and kind of hook (userspace sets the count), indexed by CPU: a per-CPU array's
/// values are limited to 32 KiB, less than a record with its stack copy.
#[map]
static SCRATCH: Array<SampleRecord> = Array::with_max_entries(1, 0);

/// The timer clock's run time (`--stats`): slot 0 sums its callbacks' nanoseconds, slot 1
/// counts them, slot 2 is when the current one started.
#[map]
static TICK_RUN_TIME: PerCpuArray<u64> = PerCpuArray::with_max_entries(3, 0);

/// The capture's copy of its process's configuration, indexed as `SCRATCH`.
#[map]
static PROC_SCRATCH: Array<PyProcConfig> = Array::with_max_entries(1, 0);

/// The frame window of an asyncio task walk (`--async-aware`), indexed as `SCRATCH`.
#[map]
static TASK_WINDOWS: Array<[u8; PY_FRAME_WINDOW]> = Array::with_max_entries(1, 0);

/// A thread's waiting tasks are built here (`--async-aware` in off-CPU modes): one entry per kind
/// of hook, as in `SCRATCH`.
#[map]
static WAITING_SCRATCH: PerCpuArray<WaitingTasks> = PerCpuArray::with_max_entries(2, 0);

/// Processes whose threads' off-CPU intervals are captured (`--mode wall`, `off-cpu`): bit
/// `tgid % 64` of word `tgid / 64`. The verifier inlines an array's look-up, so the switch hook
/// passes over a thread of another process without a helper call or a hash.
#[map]
static WAIT_PROCS: Array<u64> = Array::with_max_entries(WAIT_PROCS_WORDS, 0);

/// Threads of `WAIT_PROCS`, by tid: when each left the CPU and whether it was captured. A plain
/// hash, updated in place (an LRU map's look-ups write, and every switch on the host looks up);
/// an exiting thread's entry goes with its last switch, those of forgotten processes with userspace.
#[map]
static OFF_CPU: HashMap<u32, OffCpuStart> = HashMap::with_max_entries(65536, 0);

/// Off-CPU intervals that began without a capture (the thread's last one was more recent than
/// `--off-cpu-min`): slot 0 sums their nanoseconds, slot 1 counts them.
#[map]
static SHORT_WAITS: PerCpuArray<u64> = PerCpuArray::with_max_entries(2, 0);

/// Processes userspace knows (it set what their samples need, or found they need nothing): a
/// sample of any other wakes the reader soon (`Config::urgent_latency_ns`). The exec and exit
/// hooks take a process out.
#[map]
static KNOWN_PROCS: HashMap<u32, u8> = HashMap::with_max_entries(65536, 0);

/// When a record last woke the reader (`bpf_ktime_get_ns`).
#[map]
static LAST_WAKEUP: Array<u64> = Array::with_max_entries(1, 0);

const BPF_F_NO_PREALLOC: u32 = 1;
const BPF_F_MMAPABLE: u32 = 1 << 10;
const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
