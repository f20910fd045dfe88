//! The sampler: a perf-event program on every CPU sends one `SampleRecord` per sample through a
//! ring buffer, with the native stacks and, for known Python threads, the interpreter's frame
//! chain walked at the sample itself (on 3.15 only down to a marker userspace proved it knows).
#![no_std]
#![no_main]

use core::ffi::c_void;
use core::mem::size_of;

use aya_ebpf::{
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_current_task_btf, bpf_get_smp_processor_id, bpf_get_stack, bpf_ktime_get_ns,
        bpf_probe_read_kernel, bpf_probe_read_user, bpf_task_pt_regs, generated,
    },
    macros::{btf_tracepoint, map, perf_event},
    maps::{Array, HashMap, PerCpuArray, RingBuf},
    programs::{BtfTracePointContext, PerfEventContext},
    EbpfContext,
};
// Diagnostics only on rare failure paths; userspace sets their level at load time (off unless
// RUST_LOG enables debug), and with it off the verifier removes them.
use aya_log_ebpf::debug;
use pyebpf_common::{
    code_fingerprint, config_flags, py_proc_flags, py_status, record_kind, user_status, Config, MarkerChain, ProcessEvent, PyCapture, PyFrameRecord,
    PyProcConfig, PyThreadEntry, SampleRecord, CODE_FINGERPRINT_WORDS, ENTRY_FLAG, FINGERPRINT_NAME_WORD, MARKER_POSITIONS, MAX_ATTACHED_STEPS,
    MAX_KERNEL_FRAMES, MAX_PY_FRAMES, MAX_SNAPSHOT_PROCS, MAX_USER_FRAMES, NO_OFFSET, PY_FRAME_WINDOW, STACK_CHUNK, STACK_SNAPSHOT_MAX,
};

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
/// entry per CPU (userspace sets the count), indexed by CPU: a per-CPU array's values are limited to
/// 32 KiB, less than a record with its stack copy.
#[map]
static SCRATCH: Array<SampleRecord> = Array::with_max_entries(1, 0);

const BPF_F_NO_PREALLOC: u32 = 1;
const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;

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
    // SAFETY: no preconditions.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let Some(record) = SCRATCH.get_ptr_mut(cpu) else { return 0 };
    // SAFETY: `record` points at this CPU's scratch record; this program cannot preempt itself on
    // one CPU, so nothing else uses it meanwhile.
    let (frames, stack_len) = unsafe {
        (*record).kind = record_kind::SAMPLE;
        (*record).tgid = tgid;
        (*record).tid = tid;
        (*record).cpu = cpu;
        (*record).time_ns = bpf_ktime_get_ns();
        (*record).comm = bpf_get_current_comm().unwrap_or([0; 16]);
        capture_python(&ctx, tgid, tid, &mut (*record).py, &mut (*record).py_frames);
        let (ip, sp, bp) = user_regs(&ctx);
        (*record).user_sp = sp;
        (*record).user_bp = bp;
        let (user_len, bases_len, fp_complete) = walk_user_stack(ip, sp, bp, &mut (*record).user_stack, &mut (*record).user_frame_bases);
        (*record).user_len = user_len;
        (*record).frame_bases_len = bases_len;
        let mut status = if fp_complete { user_status::FP_COMPLETE } else { 0 };
        (*record).kernel_len = if config.flags & config_flags::KERNEL_STACK != 0 {
            stack_len(bpf_get_stack(ctx.as_ptr(), (*record).kernel_stack.as_mut_ptr() as *mut c_void, (MAX_KERNEL_FRAMES * size_of::<u64>()) as u32, 0))
        } else {
            0
        };
        let frames = (*record).py.frames_len as usize;
        let frames = if frames > MAX_PY_FRAMES { MAX_PY_FRAMES } else { frames };
        let stack_len = if ip != 0 && wants_snapshot(config, tgid) {
            // The copy goes right after the Python frames that are sent.
            let tail = (*record).py_frames.as_mut_ptr().add(frames) as *mut u8;
            let (copied, full) = copy_stack(sp, tail);
            if full {
                status |= user_status::SNAPSHOT_FULL;
            }
            copied
        } else {
            0
        };
        (*record).user_status = status;
        (*record).stack_len = stack_len as u32;
        (frames, stack_len)
    };
    // Only the walked frames and the copied stack are sent: a record is as long as what it carries.
    let len = SampleRecord::sent_len(frames, stack_len);
    // SAFETY: `len` is at most the record's size.
    let bytes = unsafe { core::slice::from_raw_parts(record as *const u8, len) };
    // Waking the reader costs more than the rest of the sample (an interrupt, a VM exit in a
    // guest): it is woken only once a batch is pending, and otherwise polls on a short timer.
    let flags = if SAMPLES.query(BPF_RB_AVAIL_DATA) >= config.wakeup_bytes as u64 { BPF_RB_FORCE_WAKEUP } else { BPF_RB_NO_WAKEUP };
    if SAMPLES.output::<[u8]>(bytes, flags).is_err() {
        if let Some(lost) = LOST.get_ptr_mut(0) {
            // SAFETY: per-CPU slot, and this program cannot preempt itself on one CPU.
            unsafe { *lost += 1 };
        }
    }
    0
}

fn wants_snapshot(config: &Config, tgid: u32) -> bool {
    config.flags & config_flags::SNAPSHOT_ALL != 0 || SNAPSHOT_PROCS.get_ptr(tgid).is_some()
}

/// Copies the user stack from `sp` up into `tail`, in chunks that end at page boundaries, until
/// [`STACK_SNAPSHOT_MAX`] bytes or a page that cannot be read (the stack's end). Returns the bytes
/// copied and whether the limit, not the stack's end, stopped the copy.
///
/// # Safety
/// `tail` must have room for `STACK_SNAPSHOT_MAX + STACK_CHUNK` bytes.
unsafe fn copy_stack(sp: u64, tail: *mut u8) -> (usize, bool) {
    let mut copied = 0usize;
    let mut src = sp;
    for _ in 0..(STACK_SNAPSHOT_MAX / STACK_CHUNK + 1) {
        if copied >= STACK_SNAPSHOT_MAX {
            break;
        }
        let to_page_end = STACK_CHUNK - (src as usize & (STACK_CHUNK - 1));
        let left = STACK_SNAPSHOT_MAX - copied;
        let len = if to_page_end < left { to_page_end } else { left };
        // In 1..=STACK_CHUNK, in a form the verifier can bound.
        let len = ((len.wrapping_sub(1)) & (STACK_CHUNK - 1)) + 1;
        let at = copied & (STACK_SNAPSHOT_MAX - 1);
        // SAFETY: `at + len` is within the room the caller guarantees; the user read is checked.
        if generated::bpf_probe_read_user(tail.add(at) as *mut c_void, len as u32, src as *const c_void) < 0 {
            break;
        }
        copied += len;
        src += len as u64;
    }
    if copied >= STACK_SNAPSHOT_MAX {
        (STACK_SNAPSHOT_MAX, true)
    } else {
        (copied, false)
    }
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
const PT_REGS_IP: usize = 16 * 8;
const PT_REGS_CS: usize = 17 * 8;
const PT_REGS_SP: usize = 19 * 8;

/// The user instruction, stack and frame pointers of the sampled thread, also when the sample hit
/// it in the kernel (then they come from the registers saved at kernel entry).
fn user_regs(ctx: &PerfEventContext) -> (u64, u64, u64) {
    let regs = ctx.as_ptr() as *const u8;
    // SAFETY: the context starts with the interrupted registers.
    let cs = unsafe { *(regs.add(PT_REGS_CS) as *const u64) };
    if cs & 3 == 3 {
        // SAFETY: as above.
        return unsafe { (*(regs.add(PT_REGS_IP) as *const u64), *(regs.add(PT_REGS_SP) as *const u64), *(regs.add(PT_REGS_BP) as *const u64)) };
    }
    // SAFETY: the current task is valid during the program; its saved user registers are read
    // with a checked kernel read.
    unsafe {
        let saved = bpf_task_pt_regs(bpf_get_current_task_btf()) as *const u8;
        if saved.is_null() {
            return (0, 0, 0);
        }
        let read = |offset: usize| bpf_probe_read_kernel(saved.add(offset) as *const u64).unwrap_or(0);
        (read(PT_REGS_IP), read(PT_REGS_SP), read(PT_REGS_BP))
    }
}

/// Unwinds the user stack through saved frame pointers, as the kernel's own user unwinder does,
/// in one pass that records each frame's return address and its frame base (the merge places
/// Python segments by the bases): one 16-byte read per frame. Stops where the chain leaves the
/// stack or stops growing towards its root. Returns (return addresses, frame bases) recorded, and
/// whether the chain ended at a zero frame pointer (its root).
fn walk_user_stack(ip: u64, sp: u64, mut bp: u64, stack: &mut [u64; MAX_USER_FRAMES], bases: &mut [u64; MAX_USER_FRAMES]) -> (u32, u32, bool) {
    if ip == 0 {
        return (0, 0, false);
    }
    stack[0] = ip;
    let mut frames = 1;
    let mut based = 0;
    let mut floor = sp;
    let mut complete = false;
    for (base, ret) in bases.iter_mut().zip(stack[1..].iter_mut()) {
        if bp == 0 {
            complete = true;
            break;
        }
        if bp < floor || bp & 7 != 0 {
            break;
        }
        *base = bp;
        based += 1;
        // SAFETY: a checked user read of the saved frame pointer and return address.
        let Ok(frame) = (unsafe { bpf_probe_read_user(bp as *const [u64; 2]) }) else { break };
        if frame[1] == 0 {
            break;
        }
        *ret = frame[1];
        frames += 1;
        floor = bp + 16;
        bp = frame[0];
    }
    (frames, based, complete)
}

fn read_u64(addr: u64) -> Option<u64> {
    // SAFETY: bpf_probe_read_user checks the address; a fault is an error, not a crash.
    unsafe { bpf_probe_read_user(addr as *const u64).ok() }
}

fn read_u32(addr: u64) -> Option<u32> {
    // SAFETY: as in read_u64.
    unsafe { bpf_probe_read_user(addr as *const u32).ok() }
}

/// Reads the thread's interpreter state at the sample and walks its frame chain from the innermost
/// frame: to the root, to the depth limit, or (3.15) to a marker whose established chain userspace
/// holds, so at steady state only the frames that ran since the last sample are read.
fn capture_python(ctx: &PerfEventContext, tgid: u32, tid: u32, py: &mut PyCapture, frames: &mut [PyFrameRecord; MAX_PY_FRAMES]) {
    *py = PyCapture::default();
    // SAFETY: plain-data values; a concurrent update from userspace at worst gives a stale entry,
    // which the reads below tolerate.
    let (Some(proc_config), Some(thread)) = (unsafe { PY_PROCS.get(tgid) }, unsafe { PY_THREADS.get(tid) }) else {
        return;
    };
    let config = *proc_config;
    let thread = *thread;
    py.tstate = thread.tstate;
    // The registered state, still attached, needs no look-up (a thread mostly stays put).
    if config.flags & py_proc_flags::FIND_ATTACHED != 0
        && read_u32(thread.tstate + config.tstate_status as u64).is_none_or(|status| status & config.status_attached == 0)
    {
        let attached = find_attached(&config, thread.ns_tid);
        if attached != 0 {
            py.tstate = attached;
        }
    }
    py.status |= py_status::THREAD_KNOWN;
    let Some(frame) = current_frame(&config, py.tstate) else {
        debug!(ctx, "tid {}: cannot read its thread state at {:x}", tid, py.tstate);
        return;
    };
    py.frame = frame;
    py.status |= py_status::FRAME_READ;
    // The thread's marker chain belongs to the thread state userspace registered.
    let stop_at = if py.tstate == thread.tstate { marker_stop(tid, &config, py) } else { 0 };
    walk_frames(&config, frame, stop_at, py, frames);
}

/// The innermost frame of a thread state: `tstate->current_frame` (3.13+; `tstate->frame` before
/// 3.11), or on 3.11 and 3.12 `tstate->cframe->current_frame` (no `_PyCFrame`, no Python running: 0).
fn current_frame(config: &PyProcConfig, tstate: u64) -> Option<u64> {
    let holder = if config.tstate_cframe == NO_OFFSET {
        tstate
    } else {
        match read_u64(tstate + config.tstate_cframe as u64)? {
            0 => return Some(0),
            cframe => cframe,
        }
    };
    read_u64(holder + config.tstate_current_frame as u64)
}

/// A look-up of the thread state attached to a thread, shared between `find_attached` and its
/// `bpf_loop` steps.
struct AttachedSearch {
    config: *const PyProcConfig,
    ns_tid: u64,
    /// The interpreter whose thread list comes next.
    next_interp: u64,
    /// The thread state to look at next; 0 at the end of an interpreter's list.
    tstate: u64,
    found: u64,
}

/// The thread state of thread `ns_tid` that is attached to it now (the one whose interpreter it
/// runs in), found in the interpreters' thread lists; 0 if none is (the thread is between
/// interpreters or waits without one) or the lists cannot be read.
fn find_attached(config: &PyProcConfig, ns_tid: u32) -> u64 {
    let Some(head) = read_u64(config.interpreters_head) else { return 0 };
    let mut search = AttachedSearch { config, ns_tid: ns_tid as u64, next_interp: head, tstate: 0, found: 0 };
    // SAFETY: the callback is a BPF subprogram taking this context; the kernel bounds the count,
    // which also ends a list that loops.
    unsafe { generated::bpf_loop(MAX_ATTACHED_STEPS, attached_step as *mut c_void, &mut search as *mut AttachedSearch as *mut c_void, 0) };
    search.found
}

/// One thread state, or the start of the next interpreter's list: 0 goes on, 1 stops.
#[inline(never)]
unsafe extern "C" fn attached_step(_index: u64, context: *mut c_void) -> i64 {
    // SAFETY: bpf_loop passes find_attached's `AttachedSearch` back unchanged.
    let search = unsafe { &mut *(context as *mut AttachedSearch) };
    // SAFETY: find_attached's caller's copy, alive for the whole loop.
    let config = unsafe { &*search.config };
    if search.tstate == 0 {
        let interp = search.next_interp;
        if interp == 0 {
            return 1;
        }
        let (Some(head), Some(next)) = (read_u64(interp + config.interp_threads_head as u64), read_u64(interp + config.interp_next as u64)) else {
            return 1;
        };
        search.tstate = head;
        search.next_interp = next;
        return 0;
    }
    let tstate = search.tstate;
    let (Some(id), Some(status), Some(next)) = (
        read_u64(tstate + config.tstate_native_thread_id as u64),
        read_u32(tstate + config.tstate_status as u64),
        read_u64(tstate + config.tstate_next as u64),
    ) else {
        return 1;
    };
    if id == search.ns_tid && status & config.status_attached != 0 {
        search.found = tstate;
        return 1;
    }
    search.tstate = next;
    0
}

/// The frame at which the walk may stop: the current marker, when it sits where the thread's
/// established chain says `k` pops of the marker frame put it (the sequence number moved by `k`).
fn marker_stop(tid: u32, config: &PyProcConfig, py: &mut PyCapture) -> u64 {
    if config.flags & py_proc_flags::USE_MARKER == 0 || config.tstate_last_profiled_frame == NO_OFFSET || config.tstate_last_profiled_seq == NO_OFFSET {
        return 0;
    }
    let (Some(marker), Some(seq)) =
        (read_u64(py.tstate + config.tstate_last_profiled_frame as u64), read_u64(py.tstate + config.tstate_last_profiled_seq as u64))
    else {
        return 0;
    };
    py.last_profiled_frame = marker;
    py.last_profiled_seq = seq;
    // SAFETY: plain data; entries are replaced whole (the map is not preallocated).
    let Some(chain) = (unsafe { PY_MARKERS.get(tid) }) else { return 0 };
    let position = seq.wrapping_sub(chain.seq_base);
    if marker == 0 || chain.gen == 0 || position >= chain.len as u64 || position >= MARKER_POSITIONS as u64 {
        return 0;
    }
    if chain.addrs[position as usize & (MARKER_POSITIONS - 1)] != marker {
        return 0;
    }
    py.marker_gen = chain.gen;
    py.marker_position = position as u32;
    marker
}

/// One frame-chain walk, shared between `walk_frames` and its `bpf_loop` steps.
struct Walk {
    config: *const PyProcConfig,
    frames: *mut PyFrameRecord,
    addr: u64,
    stop_at: u64,
    walked: u32,
    read_len: u32,
    end: u32,
    /// Here rather than in the step, so it is not cleared for every frame.
    window: [u8; PY_FRAME_WINDOW],
}

fn walk_frames(config: &PyProcConfig, addr: u64, stop_at: u64, py: &mut PyCapture, frames: &mut [PyFrameRecord; MAX_PY_FRAMES]) {
    let max = if config.max_frames as usize > MAX_PY_FRAMES { MAX_PY_FRAMES } else { config.max_frames as usize };
    let mut walk = Walk {
        config,
        frames: frames.as_mut_ptr(),
        addr,
        stop_at,
        walked: 0,
        // In 1..=PY_FRAME_WINDOW by construction (an out-of-range value reads the whole window).
        read_len: config.frame_window,
        end: py_status::TOO_DEEP,
        window: [0; PY_FRAME_WINDOW],
    };
    // bpf_loop, not a bounded loop: the verifier checks one step instead of every iteration (the
    // 512-iteration loop cost about 0.3 s of verification at each start).
    // SAFETY: the callback is a BPF subprogram taking this context; the kernel bounds the count.
    unsafe { generated::bpf_loop(max as u32, walk_step as *mut c_void, &mut walk as *mut Walk as *mut c_void, 0) };
    py.frames_len = walk.walked;
    // A chain of exactly `max` frames ended with the last step.
    py.status |= if walk.end == py_status::TOO_DEEP && walk.addr == 0 { py_status::COMPLETE } else { walk.end };
}

/// One frame of the walk: 0 goes on to the next frame, 1 stops.
#[inline(never)]
unsafe extern "C" fn walk_step(index: u64, context: *mut c_void) -> i64 {
    // SAFETY: bpf_loop passes walk_frames' `Walk` back unchanged.
    let walk = unsafe { &mut *(context as *mut Walk) };
    if walk.addr == 0 {
        walk.end = py_status::COMPLETE;
        return 1;
    }
    if index >= MAX_PY_FRAMES as u64 {
        return 1;
    }
    // SAFETY: walk_frames' caller's copy, alive for the whole loop.
    let config = unsafe { &*walk.config };
    let window = &mut walk.window;
    // A form the verifier can bound: in 1..=PY_FRAME_WINDOW.
    let read_len = (walk.read_len.wrapping_sub(1) & (PY_FRAME_WINDOW as u32 - 1)) + 1;
    let addr = walk.addr;
    // SAFETY: a checked user read of at most the stack buffer's size into it.
    if unsafe { generated::bpf_probe_read_user(window.as_mut_ptr() as *mut c_void, read_len, addr as *const c_void) } < 0 {
        walk.end = py_status::READ_FAILED;
        return 1;
    }
    let code = window_u64(window, config.frame_executable) & !config.executable_tag_mask;
    let mut owner = if config.frame_owner == NO_OFFSET { 0 } else { window[config.frame_owner as usize & (PY_FRAME_WINDOW - 1)] & 7 };
    if config.frame_is_entry != NO_OFFSET && window[config.frame_is_entry as usize & (PY_FRAME_WINDOW - 1)] != 0 {
        owner |= ENTRY_FLAG;
    }
    // SAFETY: `index` < MAX_PY_FRAMES, the length of the array `frames` points into.
    let slot = unsafe { &mut *walk.frames.add(index as usize) };
    *slot = PyFrameRecord {
        addr_owner: addr | owner as u64,
        code,
        instr_ptr: window_u64(window, config.frame_instr_ptr),
        code_version: code_identity(config, code),
        _pad: 0,
    };
    walk.walked = index as u32 + 1;
    if addr == walk.stop_at {
        walk.end = py_status::JOINED;
        return 1;
    }
    walk.addr = window_u64(&walk.window, config.frame_previous);
    0
}

/// What identifies the code object at `code` with its address: its `co_version`, or where there
/// is none (3.11) its fingerprint; 0 if it cannot be read.
fn code_identity(config: &PyProcConfig, code: u64) -> u32 {
    if code == 0 {
        return 0;
    }
    if config.code_version != NO_OFFSET {
        return read_u32(code + config.code_version as u64).unwrap_or(0);
    }
    if config.code_fingerprint == NO_OFFSET {
        return 0;
    }
    // SAFETY: checked user reads.
    let Ok(words) = (unsafe { bpf_probe_read_user((code + config.code_fingerprint as u64) as *const [u64; CODE_FINGERPRINT_WORDS]) }) else {
        return 0;
    };
    let Some(name_hash) = read_u64(words[FINGERPRINT_NAME_WORD] + config.str_hash as u64) else { return 0 };
    code_fingerprint(&words, name_hash)
}

/// The u64 at `offset` in a frame window; userspace checked every offset fits in the window.
fn window_u64(window: &[u8; PY_FRAME_WINDOW], offset: u32) -> u64 {
    let at = offset as usize & (PY_FRAME_WINDOW - 8);
    // SAFETY: `at + 8 <= PY_FRAME_WINDOW`; the window need not be aligned, hence read_unaligned.
    unsafe { core::ptr::read_unaligned(window.as_ptr().add(at) as *const u64) }
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
        if TARGETS.insert(child_tgid as u32, 1, 0).is_err() {
            debug!(&ctx, "TARGETS is full: child {} of {} is not followed", child_tgid, parent_tgid);
        }
    }
    0
}

/// `sched_process_exec` (BTF-typed): the current task has just replaced its program, so everything
/// userspace knew of its process (classification, symbols, Python state) is stale from here on.
#[btf_tracepoint(function = "sched_process_exec")]
pub fn process_exec(ctx: BtfTracePointContext) -> u32 {
    send_process_event(&ctx, record_kind::EXEC, false);
    0
}

/// `sched_process_exit` (BTF-typed): sent when a process's main thread exits, after that
/// process's last samples in the ring buffer. Other threads exiting are no lifecycle event.
#[btf_tracepoint(function = "sched_process_exit")]
pub fn process_exit(ctx: BtfTracePointContext) -> u32 {
    send_process_event(&ctx, record_kind::EXIT, true);
    0
}

/// Sends a lifecycle event for the current process (if it is sampled) through `SAMPLES`, in order
/// with its samples; an exited target leaves `TARGETS`, so a process that reuses its PID is not one.
fn send_process_event(ctx: &BtfTracePointContext, kind: u32, leader_only: bool) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let Some(config) = CONFIG.get(0) else { return };
    if tgid == 0 || tgid == config.own_tgid || (leader_only && pid_tgid as u32 != tgid) {
        return;
    }
    if config.flags & config_flags::FILTER_TARGETS != 0 {
        if TARGETS.get_ptr(tgid).is_none() {
            return;
        }
        if kind == record_kind::EXIT {
            let _ = TARGETS.remove(&tgid);
        }
    }
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    let time_ns = unsafe { bpf_ktime_get_ns() };
    let event = ProcessEvent { kind, tgid, time_ns, comm: bpf_get_current_comm().unwrap_or([0; 16]) };
    if SAMPLES.output::<ProcessEvent>(&event, BPF_RB_FORCE_WAKEUP).is_err() {
        debug!(ctx, "ring buffer full: event {} of process {} dropped", kind, tgid);
        // Its own slot: the sampler may interrupt this program on its CPU and count in slot 0.
        if let Some(lost) = LOST.get_ptr_mut(LOST_EVENTS) {
            // SAFETY: per-CPU slot only lifecycle programs (which do not nest) touch.
            unsafe { *lost += 1 };
        }
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
