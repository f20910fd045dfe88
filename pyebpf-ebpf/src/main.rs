//! The sampler: a perf-event program on every CPU sends one `SampleRecord` per sample through a
//! ring buffer, with the native stacks and, for known Python threads, the interpreter's frame
//! pointer read at the sample itself.
#![no_std]
#![no_main]

use core::ffi::c_void;
use core::mem::size_of;

use aya_ebpf::{
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_current_task_btf, bpf_get_smp_processor_id,
        bpf_get_stack, bpf_ktime_get_ns, bpf_probe_read_kernel, bpf_probe_read_user, bpf_task_pt_regs,
    },
    macros::{btf_tracepoint, map, perf_event},
    maps::{Array, HashMap, PerCpuArray, RingBuf},
    programs::{BtfTracePointContext, PerfEventContext},
    EbpfContext,
};
use pyebpf_common::{
    config_flags, py_status, Config, PyCapture, PyProcConfig, SampleRecord, MAX_KERNEL_FRAMES,
    MAX_USER_FRAMES, NO_OFFSET,
};

/// `bpf_get_stack` flag for the user stack.
const BPF_F_USER_STACK: u64 = 1 << 8;

/// Userspace sets the real size at load time (`--ring-buffer-kb`).
#[map(name = "SAMPLES")]
static SAMPLES: RingBuf = RingBuf::with_byte_size(4096 * 1024, 0);

#[map(name = "LOST")]
static LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

#[map(name = "CONFIG")]
static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

#[map(name = "TARGETS")]
static TARGETS: HashMap<u32, u8> = HashMap::with_max_entries(65536, 0);

#[map(name = "PY_PROCS")]
static PY_PROCS: HashMap<u32, PyProcConfig> = HashMap::with_max_entries(4096, 0);

#[map(name = "PY_THREADS")]
static PY_THREADS: HashMap<u32, u64> = HashMap::with_max_entries(65536, 0);

#[perf_event]
pub fn sample(ctx: PerfEventContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let tid = pid_tgid as u32;
    let Some(config) = CONFIG.get(0) else { return 0 };
    if tgid == 0 || tgid == config.own_tgid {
        return 0;
    }
    if config.flags & config_flags::FILTER_TARGETS != 0 && TARGETS.get_ptr(tgid).is_none() {
        return 0;
    }
    let Some(mut entry) = SAMPLES.reserve::<SampleRecord>(0) else {
        if let Some(lost) = LOST.get_ptr_mut(0) {
            // SAFETY: per-CPU slot, and this program cannot preempt itself on one CPU.
            unsafe { *lost += 1 };
        }
        return 0;
    };
    let record = entry.as_mut_ptr();
    // SAFETY: `record` points at a reserved ring-buffer slot of the record's size.
    unsafe {
        (*record).tgid = tgid;
        (*record).tid = tid;
        (*record).cpu = bpf_get_smp_processor_id();
        (*record).time_ns = bpf_ktime_get_ns();
        (*record).comm = bpf_get_current_comm().unwrap_or([0; 16]);
        (*record).py = capture_python(tgid, tid);
        let (sp, bp) = user_sp_bp(&ctx);
        (*record).user_sp = sp;
        (*record).frame_bases_len = walk_frame_bases(bp, sp, &mut (*record).user_frame_bases);
        (*record).user_len = stack_len(bpf_get_stack(
            ctx.as_ptr(),
            (*record).user_stack.as_mut_ptr() as *mut c_void,
            (MAX_USER_FRAMES * size_of::<u64>()) as u32,
            BPF_F_USER_STACK,
        ));
        (*record).kernel_len = if config.flags & config_flags::KERNEL_STACK != 0 {
            stack_len(bpf_get_stack(
                ctx.as_ptr(),
                (*record).kernel_stack.as_mut_ptr() as *mut c_void,
                (MAX_KERNEL_FRAMES * size_of::<u64>()) as u32,
                0,
            ))
        } else {
            0
        };
    }
    entry.submit(0);
    0
}

/// Frames written by `bpf_get_stack` (it returns bytes, or a negative error).
fn stack_len(bytes: i64) -> u32 {
    if bytes > 0 {
        (bytes as u64 / size_of::<u64>() as u64) as u32
    } else {
        0
    }
}

/// `pt_regs` field offsets on x86_64.
const PT_REGS_BP: usize = 4 * 8;
const PT_REGS_CS: usize = 17 * 8;
const PT_REGS_SP: usize = 19 * 8;

/// The user stack and frame pointers of the sampled thread, also when the sample hit it in the
/// kernel (then they come from the registers saved at kernel entry).
fn user_sp_bp(ctx: &PerfEventContext) -> (u64, u64) {
    let regs = ctx.as_ptr() as *const u8;
    // SAFETY: the context starts with the interrupted registers.
    let cs = unsafe { *(regs.add(PT_REGS_CS) as *const u64) };
    if cs & 3 == 3 {
        // SAFETY: as above.
        return unsafe { (*(regs.add(PT_REGS_SP) as *const u64), *(regs.add(PT_REGS_BP) as *const u64)) };
    }
    // SAFETY: the current task is valid during the program; its saved user registers are read
    // with a checked kernel read.
    unsafe {
        let saved = bpf_task_pt_regs(bpf_get_current_task_btf()) as *const u8;
        if saved.is_null() {
            return (0, 0);
        }
        let sp = bpf_probe_read_kernel(saved.add(PT_REGS_SP) as *const u64).unwrap_or(0);
        let bp = bpf_probe_read_kernel(saved.add(PT_REGS_BP) as *const u64).unwrap_or(0);
        (sp, bp)
    }
}

/// Follows the saved frame-pointer chain as the kernel's user unwinder does, recording each
/// frame's base; stops where the chain leaves the stack or stops growing towards its root.
fn walk_frame_bases(mut bp: u64, sp: u64, bases: &mut [u64; MAX_USER_FRAMES]) -> u32 {
    let mut len = 0;
    let mut floor = sp;
    for slot in bases.iter_mut() {
        if bp < floor || bp & 7 != 0 {
            break;
        }
        *slot = bp;
        len += 1;
        floor = bp + 16;
        match read_u64(bp) {
            Some(next) => bp = next,
            None => break,
        }
    }
    len
}

fn read_u64(addr: u64) -> Option<u64> {
    // SAFETY: bpf_probe_read_user checks the address; a fault is an error, not a crash.
    unsafe { bpf_probe_read_user(addr as *const u64).ok() }
}

/// Reads the thread's interpreter state at the sample: the innermost frame, its code object and
/// instruction pointer, and on 3.15 the `last_profiled_frame` marker.
fn capture_python(tgid: u32, tid: u32) -> PyCapture {
    let mut py = PyCapture::default();
    // SAFETY: plain-data values; a concurrent update from userspace at worst gives a stale entry,
    // which the reads below tolerate.
    let (Some(proc_config), Some(tstate)) = (unsafe { PY_PROCS.get(tgid) }, unsafe { PY_THREADS.get(tid) }) else {
        return py;
    };
    let proc_config = *proc_config;
    py.tstate = *tstate;
    py.status |= py_status::THREAD_KNOWN;
    let Some(frame) = read_u64(py.tstate + proc_config.tstate_current_frame as u64) else {
        return py;
    };
    py.frame = frame;
    py.status |= py_status::FRAME_READ;
    if frame != 0 {
        if let (Some(code), Some(instr_ptr)) = (
            read_u64(frame + proc_config.frame_executable as u64),
            read_u64(frame + proc_config.frame_instr_ptr as u64),
        ) {
            py.code = code & !proc_config.executable_tag_mask;
            py.instr_ptr = instr_ptr;
            py.status |= py_status::LEAF_READ;
        }
    }
    if proc_config.tstate_last_profiled_frame != NO_OFFSET && proc_config.tstate_last_profiled_seq != NO_OFFSET {
        if let (Some(marker), Some(seq)) = (
            read_u64(py.tstate + proc_config.tstate_last_profiled_frame as u64),
            read_u64(py.tstate + proc_config.tstate_last_profiled_seq as u64),
        ) {
            py.last_profiled_frame = marker;
            py.last_profiled_seq = seq;
            py.status |= py_status::MARKER_READ;
        }
    }
    py
}

/// `sched_process_fork` (BTF-typed, so no tracefs is needed): with `FOLLOW_FORKS`, a child of a
/// target becomes a target. Its arguments are the parent's and the child's `task_struct`.
#[btf_tracepoint(function = "sched_process_fork")]
pub fn follow_fork(ctx: BtfTracePointContext) -> u32 {
    let Some(config) = CONFIG.get(0) else { return 0 };
    if config.flags & config_flags::FOLLOW_FORKS == 0 {
        return 0;
    }
    let parent_tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    if TARGETS.get_ptr(parent_tgid).is_none() {
        return 0;
    }
    let child: *const u8 = ctx.arg(1);
    // SAFETY: the offset comes from the kernel's BTF; the read is checked by the kernel.
    if let Ok(child_tgid) = unsafe { bpf_probe_read_kernel(child.add(config.task_tgid_offset as usize) as *const i32) } {
        let _ = TARGETS.insert(child_tgid as u32, 1, 0);
    }
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
