//! The session's off-CPU accounting with the kernel's maps faked: what each capture counts, in
//! nanoseconds, when its interval ends, when it began before the recording, and when it is still
//! open at the end; and that forgetting a process drops its open captures. Also which processes
//! the kernel is told userspace knows.

use std::process::{Child, Command, Stdio};

use pyebpf_common::{origin, OffCpuEnd, OffCpuStart, ProcessEvent, SampleRecord};

use super::*;
use crate::kernel_maps::fake::FakeKernel;

const MS: u64 = 1_000_000;

/// A process to attribute records to: not pyebpf's own (whose waits are never watched), not Python.
struct Sleeper(Child);

impl Sleeper {
    fn start() -> Sleeper {
        Sleeper(Command::new("sleep").arg("60").stdin(Stdio::null()).spawn().expect("run sleep"))
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A session that only reads (never writes a marker), with native frames.
fn reading_session(filter: SampleFilter, unwind: UnwindMode, mode: Mode, kernel: bool) -> Session {
    let sampling = SamplingOptions { marker: false, read_only: true, max_frames: 512, async_aware: false };
    Session::new(SessionOptions { sampling, no_native: false, native_lines: false, filter, unwind, mode, kernel, details: None, timed: true })
}

fn wall_session() -> Session {
    let mut session = reading_session(SampleFilter::default(), UnwindMode::Fp, Mode::Wall, false);
    session.start_recording();
    session
}

/// A record of thread `tid` of `pid` at `time_ns`: on CPU, or a capture as it left the CPU
/// weighted `weight_ns` (0: its interval's end follows).
fn record(pid: u32, tid: u32, origin: u32, time_ns: u64, weight_ns: u64) -> Box<SampleRecord> {
    // SAFETY: all-zero bytes are a valid SampleRecord (plain data).
    let mut record = unsafe { Box::<SampleRecord>::new_zeroed().assume_init() };
    (record.tgid, record.tid, record.origin, record.time_ns, record.weight_ns) = (pid, tid, origin, time_ns, weight_ns);
    record.wait_state = 1;
    record
}

fn end(tid: u32, start_ns: u64, away_ns: u64, carried_ns: u64) -> OffCpuEnd {
    OffCpuEnd { kind: 0, tid, start_ns, away_ns, carried_ns }
}

#[test]
fn each_capture_counts_its_period_or_its_whole_interval_within_the_recording() {
    let sleeper = Sleeper::start();
    let (pid, tid) = (sleeper.pid(), sleeper.pid());
    let mut session = wall_session();
    let (mut kernel, mut stats, mut profile) = (FakeKernel::default(), Stats::default(), Profile::new(100));
    let start = monotonic_ns();
    session.off_cpu.start_recording(start);
    assert!(session.resolve(&record(pid, tid, origin::ON_CPU, start, 0), &mut kernel, &mut stats, &mut profile));
    assert_eq!(profile.total_ns(), 10 * MS, "a sample counts its period");
    assert!(kernel.watching.contains(&pid), "the process's waits are not watched");

    // Captured as it left at start + 5 ms; its end says 7 ms away, 2 ms carried from before.
    std::thread::sleep(Duration::from_millis(5));
    let left = monotonic_ns();
    session.resolve(&record(pid, tid, origin::OFF_CPU, left, 0), &mut kernel, &mut stats, &mut profile);
    assert_eq!(profile.total_ns(), 10 * MS, "an open interval counts nothing yet");
    session.end_wait(&end(tid, left - 1, 7 * MS, 0), &mut stats, &mut profile);
    assert_eq!(profile.total_ns(), 10 * MS, "the end of another interval of the thread was taken");
    session.end_wait(&end(tid, left, 7 * MS, 2 * MS), &mut stats, &mut profile);
    assert_eq!(profile.total_ns(), 19 * MS);
    assert_eq!((stats.off_cpu.intervals, stats.off_cpu.carried_ns), (1, 2 * MS));

    // A capture weighted whole in the kernel counts at once.
    session.resolve(&record(pid, tid, origin::OFF_CPU, left, 3 * MS), &mut kernel, &mut stats, &mut profile);
    assert_eq!((profile.total_ns(), stats.off_cpu.intervals), (22 * MS, 2));

    // Only what lies within the recording counts: an interval from 1 s before it, carried time
    // from before it.
    session.resolve(&record(pid, tid, origin::OFF_CPU, start - 1000 * MS, 0), &mut kernel, &mut stats, &mut profile);
    session.end_wait(&end(tid, start - 1000 * MS, 1001 * MS, 5000 * MS), &mut stats, &mut profile);
    assert_eq!(profile.total_ns(), 23 * MS);
}

#[test]
fn waits_still_open_at_the_end_count_up_to_then_and_go_with_their_process() {
    let sleeper = Sleeper::start();
    let (pid, tid, other) = (sleeper.pid(), sleeper.pid(), sleeper.pid() + 1);
    let mut session = wall_session();
    let (mut kernel, mut stats, mut profile) = (FakeKernel::default(), Stats::default(), Profile::new(100));
    let left = monotonic_ns();
    session.resolve(&record(pid, tid, origin::OFF_CPU, left, 0), &mut kernel, &mut stats, &mut profile);
    // The hook's view at the end: `tid` still off since its capture, `other` off since an
    // interval it did not capture.
    let open = |start_ns, captured_ns| OffCpuStart { start_ns, captured_ns, tgid: pid, ..Default::default() };
    kernel.off_cpu = vec![(tid, open(left, left)), (other, open(left, 0))];
    std::thread::sleep(Duration::from_millis(20));
    session.count_open_waits(&mut kernel, &mut stats, &mut profile);
    let counted = profile.total_ns();
    assert!((20 * MS..2000 * MS).contains(&counted), "counted {counted} ns of a wait of 20 ms and more");
    assert_eq!((stats.off_cpu.intervals, stats.off_cpu.open_at_end), (1, 1));
    assert_eq!(stats.off_cpu.short_intervals, 1, "the uncaptured interval is summed as short");

    // An exit drops what is open of the process: its interval's end counts nothing.
    let mut profile = Profile::new(100);
    session.resolve(&record(pid, tid, origin::OFF_CPU, left + 1, 0), &mut kernel, &mut stats, &mut profile);
    session.process_event(&ProcessEvent { kind: 0, tgid: pid, time_ns: 0, comm: [0; pyebpf_common::COMM_LEN] }, &mut kernel);
    assert!(!kernel.watching.contains(&pid), "the exited process is still watched");
    session.end_wait(&end(tid, left + 1, 7 * MS, 0), &mut stats, &mut profile);
    assert_eq!(profile.total_ns(), 0);
}

/// The eBPF program hands over samples of processes userspace does not know yet soon: a process
/// still checked for a late `libpython` stays unknown to it, one the filter drops is known at its
/// first sample, and an exit forgets it (its PID may name another process next).
#[test]
fn the_kernel_is_told_which_processes_are_known_until_they_exit() {
    let sleeper = Sleeper::start();
    let pid = sleeper.pid();
    let (mut kernel, mut stats, mut profile) = (FakeKernel::default(), Stats::default(), Profile::new(100));
    let mut session = wall_session();
    session.resolve(&record(pid, pid, origin::ON_CPU, monotonic_ns(), 0), &mut kernel, &mut stats, &mut profile);
    assert!(!kernel.known.contains(&pid), "a process checked again later is known already");

    let filter = SampleFilter { comm: Some(regex::Regex::new("^no-such-process$").unwrap()), python_only: false };
    let mut session = reading_session(filter, UnwindMode::Fp, Mode::Cpu, false);
    assert!(!session.resolve(&record(pid, pid, origin::ON_CPU, monotonic_ns(), 0), &mut kernel, &mut stats, &mut profile));
    assert!(kernel.known.contains(&pid), "a process the filter drops is not known");
    session.process_event(&ProcessEvent { kind: 0, tgid: pid, time_ns: 0, comm: [0; pyebpf_common::COMM_LEN] }, &mut kernel);
    assert!(!kernel.known.contains(&pid), "an exited process is still known");
}

/// A Python process's samples keep coming soon for its first second, so that one that lives less
/// than the batching latency is read while it runs; past it, the process is known.
#[test]
fn a_python_process_is_known_to_the_kernel_once_past_its_first_second() {
    let (target, _dir) = blocked_python();
    let pid = target.pid();
    let (mut kernel, mut stats, mut profile) = (FakeKernel::default(), Stats::default(), Profile::new(100));
    let mut session = cpu_session();
    let records = varied_records(&mut session, &mut kernel, pid);
    assert!(session.resolve(&records[0], &mut kernel, &mut stats, &mut profile));
    assert!(!kernel.known.contains(&pid), "a Python process is known at its first sample");
    std::thread::sleep(YOUNG_PYTHON);
    assert!(session.resolve(&records[1], &mut kernel, &mut stats, &mut profile));
    assert!(kernel.known.contains(&pid), "a Python process sampled for a second is not known yet");
}

/// A process the kernel was told is known before it was found to be Python (a `libpython`
/// mapped late: it ran past the dynamic loader without one) has its first samples as one soon.
#[test]
fn a_process_found_to_be_python_late_is_unknown_to_the_kernel_again() {
    let (target, _dir) = blocked_python();
    let pid = target.pid();
    let records = varied_records(&mut cpu_session(), &mut FakeKernel::default(), pid);
    let (mut kernel, mut stats, mut profile) = (FakeKernel::default(), Stats::default(), Profile::new(100));
    let mut session = cpu_session();
    session.processes.known(pid, &mut kernel);
    assert!(session.resolve(&records[0], &mut kernel, &mut stats, &mut profile));
    assert!(session.python.is_python(pid) && !kernel.known.contains(&pid), "a process found to be Python stays known");
}

fn cpu_session() -> Session {
    reading_session(SampleFilter::default(), UnwindMode::Fp, Mode::Cpu, true)
}

/// Debian's 3.13 running `blocked_threads.py`, settled in its waits.
fn blocked_python() -> (pyebpf_tests::Killed, tempfile::TempDir) {
    let python = pyebpf_tests::test_pythons().join("usr/bin/python3.13");
    let started = pyebpf_tests::start_ready(&python, "blocked_threads.py", &[]);
    std::thread::sleep(Duration::from_millis(200));
    started
}

/// Every stack of a profile with its weight and events, frames by what they name and events from
/// the profile's first: comparable across profiles whose tables numbered the frames otherwise, and
/// whose clocks were read a few nanoseconds apart.
fn rendered(profile: &Profile) -> Vec<String> {
    let first = profile.timed_stacks().flat_map(|(_, _, events)| events.unwrap_or_default().iter().map(|event| event.unix_ns)).min().unwrap_or_default();
    let mut stacks: Vec<String> = profile
        .timed_stacks()
        .map(|(stack, weight, events)| {
            let frames: Vec<&Frame> = stack.frames.iter().collect();
            let events: Option<Vec<(i64, u64)>> = events.map(|events| events.iter().map(|event| (event.unix_ns - first, event.ns)).collect());
            format!("{} {} {:?} {} {weight:?} {events:?} {frames:?}", stack.pid, stack.tid, stack.state, stack.truncated)
        })
        .collect();
    stacks.sort();
    stacks
}

/// Records of a live CPython's two threads, as the eBPF program builds them, varied as a hot loop's
/// are: the same frames again at other times, CPUs and weights, another instruction in the leaf,
/// other native and kernel frames, and the process forgotten (an exec) and found again.
fn varied_records(session: &mut Session, kernel: &mut FakeKernel, pid: u32) -> Vec<Box<SampleRecord>> {
    let mut stats = Stats::default();
    session.python.discover(pid, None, kernel, session.processes.maps(), &mut stats);
    let mut tids: Vec<u32> =
        std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().map(|e| e.unwrap().file_name().to_str().unwrap().parse().unwrap()).collect();
    tids.sort();
    let code = session.processes.maps().covering(pid, &[]).executable().next().expect("an executable mapping").start;
    let mut bases = Vec::new();
    for &tid in &tids {
        let mut base = record(pid, tid, origin::ON_CPU, 0, 0);
        assert!(session.python.capture_waiting(pid, tid, &mut base), "thread {tid} not known");
        assert!(base.py.frames_len > 2, "thread {tid}: {} frames", base.py.frames_len);
        base.comm[..7].copy_from_slice(b"python3");
        bases.push(base);
    }
    let mut leaf_moved = bases[0].clone();
    leaf_moved.py_frames[0].instr_ptr += 2;
    let mut native = bases[1].clone();
    native.user_stack[..3].copy_from_slice(&[code + 0x40, code + 0x1000, code + 0x2345]);
    native.user_len = 3;
    let mut in_kernel = bases[0].clone();
    in_kernel.kernel_stack[..2].copy_from_slice(&[0xffff_ffff_8100_0000, 0xffff_ffff_8100_1000]);
    in_kernel.kernel_len = 2;
    let mut copied = bases[1].clone();
    copy_stack(pid, tids[1], &mut copied);
    // The interpreter's eval loop at two addresses under one caller, and the second under
    // another; a function whose frames stay in the stack at two addresses.
    let eval = function_in_executable(pid, "_PyEval_EvalFrameDefault");
    let shown = function_in_executable(pid, "PyObject_GetAttr");
    let add = function_in_executable(pid, "PyNumber_Add");
    let called_from = |leaf: u64, caller: u64| {
        let mut sample = bases[0].clone();
        sample.user_stack[..2].copy_from_slice(&[leaf, caller]);
        sample.user_len = 2;
        sample
    };
    let eval_a = called_from(eval.start + 0x10, add.start + 0x21);
    let eval_b = called_from(eval.start + 0x30, add.start + 0x21);
    let eval_b_elsewhere = called_from(eval.start + 0x30, add.start + 0x41);
    let shown_a = called_from(shown.start + 0x8, add.start + 0x21);
    let shown_b = called_from(shown.start + 0x10, add.start + 0x21);
    let order = [0, 1, 0, 0, 2, 1, 0, 3, 3, 1, 4, 4, 0, 2, 0, 5, 5, 1, 5, 6, 10, 7, 7, 8, 9, 8, 9];
    let variants = [&bases[0], &bases[1], &leaf_moved, &native, &in_kernel, &copied, &eval_a, &eval_b, &shown_a, &shown_b, &eval_b_elsewhere];
    let mut records = Vec::new();
    for (n, &which) in order.iter().chain(&order).enumerate() {
        let mut sample = variants[which].clone();
        (sample.time_ns, sample.cpu, sample.weight_ns) = (1_000_000 * n as u64, n as u32 % 2, 0);
        records.push(sample);
    }
    records
}

/// Where the function `name` of `pid`'s executable lies in the process.
fn function_in_executable(pid: u32, name: &str) -> std::ops::Range<u64> {
    use object::{Object, ObjectSegment, ObjectSymbol};
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
    let data = std::fs::read(&exe).unwrap();
    let elf = object::File::parse(&*data).unwrap();
    let symbol = elf.dynamic_symbols().chain(elf.symbols()).find(|symbol| symbol.name() == Ok(name) && symbol.size() > 0).expect(name);
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let first = maps
        .lines()
        .find(|line| line.ends_with(exe.to_str().unwrap()) && line.split_whitespace().nth(2) == Some("00000000"))
        .expect("the executable's first page");
    let mapped_at = u64::from_str_radix(first.split('-').next().unwrap(), 16).unwrap();
    let first_page = elf.segments().map(|segment| segment.address()).min().unwrap() & !0xfff;
    let start = symbol.address() + mapped_at - first_page;
    start..start + symbol.size()
}

/// The thread's user stack copied as the eBPF program copies it (page by page from its stack
/// pointer up, while it waits in a system call), with its instruction and stack pointers.
fn copy_stack(pid: u32, tid: u32, record: &mut SampleRecord) {
    use crate::cpython::memory::{ProcessMemory, ReadMemory};
    let syscall = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall")).unwrap();
    let fields: Vec<u64> = syscall.split_whitespace().skip(7).map(|field| u64::from_str_radix(field.trim_start_matches("0x"), 16).unwrap()).collect();
    let (sp, ip) = (fields[0], fields[1]);
    let memory = ProcessMemory::new(pid);
    let mut len = 0;
    while len < pyebpf_common::STACK_SNAPSHOT_MAX {
        let chunk = pyebpf_common::STACK_CHUNK.min(pyebpf_common::STACK_SNAPSHOT_MAX - len) - if len == 0 { (sp % 4096) as usize } else { 0 };
        if memory.read(sp + len as u64, &mut record.stack_tail[len..len + chunk]).is_err() {
            break;
        }
        len += chunk;
    }
    assert!(len > 0, "thread {tid}: no stack read at {sp:#x}");
    (record.stack_len, record.user_sp, record.user_bp, record.user_stack[0], record.user_len) = (len as u32, sp, 0, ip, 1);
}

#[test]
fn repeats_count_as_resolving_each_sample_would() {
    let (target, _dir) = blocked_python();
    let pid = target.pid();
    let records = varied_records(&mut cpu_session(), &mut FakeKernel::default(), pid);
    let run = |repeats: Repeats| {
        let mut session = cpu_session();
        session.repeats = repeats;
        let (mut kernel, mut stats, mut profile) = (FakeKernel::default(), Stats::default(), Profile::new(100));
        profile.timeline = Some(Box::new(crate::stack::Timeline::new(1000)));
        for (n, sample) in records.iter().enumerate() {
            if n == records.len() / 2 {
                // An exec: what was resolved for the process no longer holds.
                session.process_event(&ProcessEvent { kind: 0, tgid: pid, time_ns: 0, comm: [0; pyebpf_common::COMM_LEN] }, &mut kernel);
            }
            stats.samples += 1;
            assert!(session.resolve(sample, &mut kernel, &mut stats, &mut profile));
        }
        (stats, profile)
    };
    let (mut cached, cached_profile) = run(Repeats::new());
    let (mut resolved, resolved_profile) = run(Repeats::disabled());
    // 54 samples; before the exec and after, 9 resolved: the 6 distinct records of the first 19,
    // then the eval loop's first address, the second elsewhere, and the first shown address. The
    // second address of each, under the first's caller, repeats the first's stack: the eval
    // loop's as it is, the shown function's with the second address's own frames.
    assert_eq!((cached.repeats, resolved.repeats), (36, 0));
    assert!(cached.python_samples == 54 && cached.kernel_frames > 0, "{cached}");
    assert!(cached.unwound_samples == 6 && cached.unwind_truncated == 0, "{cached}");
    // Counts, not the CPU time they took.
    (cached.repeats, cached.unwind_ns, resolved.unwind_ns) = (0, 0, 0);
    assert_eq!(cached.to_string(), resolved.to_string());
    assert_eq!(rendered(&cached_profile), rendered(&resolved_profile));
    assert_eq!(cached_profile.total_samples(), 54);
}

/// A stack that read a native level found in no mapping is resolved again once its process's
/// upkeep looks such levels up again (a library mapped there since names it); the process's other
/// stacks still repeat, and so does one whose walk went on into the stack (glibc's start code
/// leaves its frame pointer at `argv`), as no library can be mapped there.
#[test]
fn upkeep_has_only_stacks_that_read_an_unmapped_level_resolved_again() {
    let (target, _dir) = blocked_python();
    let pid = target.pid();
    let mut session = cpu_session();
    let (mut kernel, mut stats, mut profile) = (FakeKernel::default(), Stats::default(), Profile::new(100));
    let base = varied_records(&mut session, &mut kernel, pid).swap_remove(0);
    let (leaf, caller) = (function_in_executable(pid, "PyObject_GetAttr").start + 8, function_in_executable(pid, "PyNumber_Add").start + 0x21);
    let called_from = |callers: &[u64]| {
        let mut sample = base.clone();
        sample.user_stack[0] = leaf;
        sample.user_stack[1..=callers.len()].copy_from_slice(callers);
        sample.user_len = callers.len() as u32 + 1;
        sample
    };
    let maps = crate::maps::Maps::read(pid).unwrap();
    let stack = maps.mappings().iter().find(|mapping| mapping.path == procfs::process::MMapPath::Stack).expect("the target has a [stack] mapping");
    // A page below the lowest mapping: in none, but where a library could be mapped.
    let nowhere = maps.mappings()[0].start - 0x1000;
    assert!(nowhere >= 0x10000 && maps.find(nowhere).is_none());
    // Its caller's caller lies in no mapping, or in the stack (a frame-pointer walk gone astray).
    let (mapped, unmapped, in_stack) = (called_from(&[caller]), called_from(&[caller, nowhere]), called_from(&[caller, stack.limit - 0x20]));
    let mut repeats_of = |session: &mut Session| {
        for sample in [&mapped, &unmapped, &in_stack] {
            assert!(session.resolve(sample, &mut kernel, &mut stats, &mut profile));
        }
        stats.repeats
    };
    assert_eq!(repeats_of(&mut session), 0);
    assert_eq!(repeats_of(&mut session), 3);
    std::thread::sleep(crate::native_ids::UNMAPPED_RECHECK + Duration::from_millis(20));
    session.upkeep(&mut FakeKernel::default(), 0);
    assert_eq!(repeats_of(&mut session), 5, "the mapped and in-stack stacks repeat, the unmapped one is resolved again");
    assert_eq!(repeats_of(&mut session), 8);
}

/// `--unwind auto`, a process not settled yet: a copied sample whose frame-pointer walk ends in
/// the C library after two levels (as one in `clock_gettime`, called from an interpreter built
/// without frame pointers, ends) looks by its symbols like a walk that reached the start code.
/// The copy beside it, unwound to the root through the interpreter, shows that the walk broke:
/// the process's stacks are copied from then on, and the sample keeps its whole native stack. A
/// walk that reached the start code still holds.
#[test]
fn a_walk_ending_in_the_c_library_by_chance_is_judged_by_its_copy() {
    let (target, _dir) = blocked_python();
    let pid = target.pid();
    let auto_session = || reading_session(SampleFilter::default(), UnwindMode::Auto, Mode::Cpu, false);
    let mut copied = record(pid, pid, origin::ON_CPU, 0, 0);
    copy_stack(pid, pid, &mut copied);
    let stack = &copied.stack_tail[..copied.stack_len as usize];
    let snapshot = crate::unwind::Snapshot { ip: copied.user_stack[0], sp: copied.user_sp, bp: 0, stack };
    let mut maps = crate::maps::MapsCache::default();
    let unwound = crate::unwind::StackUnwinder::new().unwind(&mut maps, pid, &snapshot);
    assert!(unwound.complete && unwound.addrs.len() > 4, "the copy unwinds to the root: {unwound:?}");
    // The walk: the blocking call in the C library and its caller there.
    (copied.user_stack[1], copied.user_len, copied.user_status) = (unwound.addrs[1], 2, 0);
    let user_frames =
        |profile: &Profile| profile.timed_stacks().map(|(stack, _, _)| stack.frames.iter().filter(|f| matches!(f, Frame::Native(_))).count()).max();

    // Alone, the walk passes for one that reached the start code: it does not start copying.
    let mut walk_only = copied.clone();
    walk_only.stack_len = 0;
    let (mut kernel, mut stats, mut profile) = (FakeKernel::default(), Stats::default(), Profile::new(100));
    assert!(auto_session().resolve(&walk_only, &mut kernel, &mut stats, &mut profile));
    assert!(!kernel.copying.contains(&pid), "the walk alone was taken for a broken one");
    assert_eq!(user_frames(&profile), Some(2));

    let (mut kernel, mut stats, mut profile) = (FakeKernel::default(), Stats::default(), Profile::new(100));
    assert!(auto_session().resolve(&copied, &mut kernel, &mut stats, &mut profile));
    assert!(kernel.copying.contains(&pid), "the walk that ended in the C library by chance was trusted");
    assert!(user_frames(&profile) >= Some(unwound.addrs.len()), "the sample kept {:?} native frames of {}", user_frames(&profile), unwound.addrs.len());

    // A walk that got as far as the code calling `main` held: only the C library's start code
    // and the entry point lie past it (and past that, the garbage a walk goes on with there: an
    // address in the stack).
    let walked = unwound.addrs.len() - 2;
    copied.user_stack[..walked].copy_from_slice(&unwound.addrs[..walked]);
    copied.user_stack[walked] = copied.user_sp + 64;
    copied.user_len = walked as u32 + 1;
    let (mut kernel, mut stats, mut profile) = (FakeKernel::default(), Stats::default(), Profile::new(100));
    assert!(auto_session().resolve(&copied, &mut kernel, &mut stats, &mut profile));
    assert!(!kernel.copying.contains(&pid), "a walk that reached the start code was taken for a broken one");
}
