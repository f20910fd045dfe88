//! pyebpf's eBPF programs, one module per hook: the perf-event sampler (`sample`), the scheduler's
//! switch hooks for off-CPU time (`switch`) and the process lifecycle (`lifecycle`). Each hook that
//! captures stacks calls the one capture (`capture`) with its origin and weight; the maps they
//! share are defined here.
#![no_std]
#![no_main]

mod capture;
mod lifecycle;
mod python;
mod sample;
mod switch;
mod user_stack;

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
};
use pyebpf_common::{Config, MarkerChain, OffCpuStart, PyProcConfig, PyThreadEntry, SampleRecord, MAX_SNAPSHOT_PROCS};

/// Userspace sets the real size at load time (`--ring-buffer-kb`).
#[map]
static SAMPLES: RingBuf = RingBuf::with_byte_size(4096 * 1024, 0);

#[map]
static LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(2, 0);
/// Slot of `LOST` counting lifecycle events dropped (slot 0 counts samples).
const LOST_EVENTS: u32 = 1;

#[map]
static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

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

/// The record is built here (it is too large for the stack), then its used part is sent. One
/// entry per CPU and kind of hook (userspace sets the count), indexed by CPU: a per-CPU array's
/// values are limited to 32 KiB, less than a record with its stack copy.
#[map]
static SCRATCH: Array<SampleRecord> = Array::with_max_entries(1, 0);

/// Processes whose threads' off-CPU intervals are captured (`--mode wall`, `off-cpu`).
#[map]
static WAIT_PROCS: HashMap<u32, u8> = HashMap::with_max_entries(65536, 0);

/// Threads of `WAIT_PROCS` now off CPU, by tid. LRU: an entry whose thread never came back (it
/// exited some way the switch hook did not see) makes room rather than fill the map.
#[map]
static OFF_CPU: LruHashMap<u32, OffCpuStart> = LruHashMap::with_max_entries(65536, 0);

/// Off-CPU intervals not captured: slot 0 sums the nanoseconds of those shorter than
/// `--off-cpu-min` and slot 1 counts them; slot 2 counts those that did not end in the call they
/// began in.
#[map]
static SHORT_WAITS: PerCpuArray<u64> = PerCpuArray::with_max_entries(3, 0);

const BPF_F_NO_PREALLOC: u32 = 1;
const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
