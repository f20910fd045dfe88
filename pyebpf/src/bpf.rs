//! Loading the embedded eBPF sampler, attaching it to every CPU, and reading its samples.

use crate::kernel_btf::{Btf, VMLINUX_BTF};
use std::os::fd::AsFd;
use std::time::Duration;

use aya::maps::{Array, HashMap, MapData, PerCpuArray, RingBuf};
use aya::programs::tp_btf::BtfTracePointLinkId;
use aya::programs::{BtfTracePoint, PerfEvent};
use aya::{Ebpf, EbpfLoader};
use pyebpf_common::{config_flags, globals, maps, programs, Config, MarkerChain, OffCpuStart, PyProcConfig, PyThreadEntry, SampleRecord, STACK_SNAPSHOT_MAX};

use crate::reader::{wakeup_latency, RecordBatch, RingReader, URGENT_LATENCY};
use crate::sampling_clock::{ClockPlan, SamplingClock};
use crate::timer_clock::TimerClock;

/// The object built by `cargo xtask build`; empty when the crate was built without it.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/pyebpf-ebpf.o"));

#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    #[error("this pyebpf was built without its eBPF object; build it with `cargo xtask build --release`")]
    NoObject,
    #[error("the embedded eBPF object has no {0}: it was built from other sources; rebuild with `cargo xtask build --release`")]
    StaleObject(&'static str),
    #[error("permission denied: pyebpf needs root (or CAP_BPF, CAP_PERFMON and CAP_SYS_PTRACE)")]
    NotPermitted,
    #[error("permission denied: pyebpf lacks {0} (it needs root, or CAP_BPF, CAP_PERFMON and CAP_SYS_PTRACE)")]
    MissingCapabilities(String),
    #[error("--ring-buffer-kb must be a power of two from 4 to {max}, not {0}", max = MAX_RING_BUFFER_KB)]
    RingBufferSize(u32),
    #[error("cannot load the eBPF sampler (is BPF available in this kernel?): {0}")]
    Load(aya::EbpfError),
    #[error("cannot attach the eBPF sampler: {0}")]
    Program(aya::programs::ProgramError),
    #[error("eBPF map {name}: {cause}")]
    Map { name: &'static str, cause: aya::maps::MapError },
    #[error("cannot list online CPUs: {0}")]
    Cpus(std::io::Error),
    #[error("cannot start the sampling clock on every CPU: {0}")]
    Clock(std::io::Error),
    #[error(transparent)]
    KernelBtf(#[from] crate::kernel_btf::BtfError),
    #[error("cannot parse the kernel's BTF ({VMLINUX_BTF}): {0}")]
    AyaBtf(#[source] aya::BtfError),
    #[error("cannot start the ring-buffer reader: {0}")]
    Poll(std::io::Error),
    #[error("the ring-buffer reader stopped (it could not poll the ring buffer)")]
    ReaderStopped,
}

fn map_error(name: &'static str) -> impl FnOnce(aya::maps::MapError) -> BpfError {
    move |cause| BpfError::Map { name, cause }
}

/// The largest ring buffer: its pages stay locked in kernel memory for the whole recording.
pub const MAX_RING_BUFFER_KB: u32 = 256 * 1024;

/// Whether a ring buffer of `kb` KiB can be made: a power of two from 4 KiB (a page) to
/// [`MAX_RING_BUFFER_KB`].
pub fn ring_buffer_kb_fits(kb: u32) -> bool {
    (4..=MAX_RING_BUFFER_KB).contains(&kb) && kb.is_power_of_two()
}

/// The ring buffer's size unless one is asked for: half a wakeup latency ([`wakeup_latency`]) of
/// the largest samples (a stack copy each, about 20 KiB) at `frequency_hz` on each of `cpus`, so
/// that a batch of typical samples (a third of that) is delivered by the latency bound or by half
/// the buffer filling, whichever comes first; from 1 MiB (room for the copies of processes not
/// known yet, see [`copies_fit`]) to 4 MiB. The buffer's pages are mapped into pyebpf twice, so
/// they are much of its memory at fleet rates (1 MiB at 19 Hz, 2 MiB at 49 and 99 Hz on 2 CPUs).
pub fn ring_buffer_kb_for(frequency_hz: u64, cpus: u32) -> u32 {
    const LARGEST_SAMPLE: u64 = (SampleRecord::HEADER_LEN + STACK_SNAPSHOT_MAX) as u64;
    let per_second = frequency_hz.saturating_mul(u64::from(cpus)).saturating_mul(LARGEST_SAMPLE);
    let half_latency = u64::try_from(u128::from(per_second) * wakeup_latency(frequency_hz).as_millis() / 2000).unwrap_or(u64::MAX);
    let kb = half_latency.div_ceil(1024).clamp(1024, 4096) as u32;
    kb.next_power_of_two()
}

/// [`ring_buffer_kb_for`] the possible CPUs of this machine (the largest size where they are not
/// known).
pub fn default_ring_buffer_kb(frequency_hz: u64) -> u32 {
    aya::util::nr_cpus().map_or(4096, |cpus| ring_buffer_kb_for(frequency_hz, cpus as u32))
}

/// How native user stacks are unwound (`--unwind`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnwindMode {
    /// Frame pointers only, in the kernel: cheapest; stops in code built without them
    Fp,
    /// Every sampled stack is copied and unwound in userspace from the call frame information
    /// (.eh_frame, .debug_frame) of each mapped file
    Dwarf,
    /// Frame pointers, switched to CFI for a process once one of its frame-pointer stacks ends
    /// before the stack's root
    Auto,
}

/// What to sample.
#[derive(Debug, Clone)]
pub struct SamplerOptions {
    pub frequency_hz: u64,
    pub kernel_stacks: bool,
    /// Only these processes (`None`: every process).
    pub targets: Option<Vec<u32>>,
    /// Children forked by a target become targets.
    pub follow_forks: bool,
    pub ring_buffer_kb: u32,
    /// Have the kernel account the sampler's run time (for `--stats`; costs a little per run).
    pub program_stats: bool,
    /// Which user stacks are copied for CFI unwinding: every one (`--unwind dwarf`), or those of
    /// processes added with [`Sampler::copy_stacks_of`] and (`--unwind auto`) of processes not
    /// known yet whose frame-pointer walk broke.
    pub unwind: UnwindMode,
    /// Read at each sample whether the thread holds the GIL (`--mode gil`).
    pub gil: bool,
    /// Load the programs that read asyncio tasks (`--async-aware`).
    pub tasks: bool,
    /// Send the waiting asyncio tasks of a thread with each of its captures, where its process's
    /// tasks are read (`--mode wall|off-cpu --async-aware`).
    pub waiting_tasks: bool,
    /// Capture off-CPU intervals of the processes added with [`Sampler::watch_waits`], those
    /// shorter than this only summed (`--mode wall` and `off-cpu`); `None`: no switch hooks.
    pub off_cpu_min: Option<Duration>,
}

/// Names of the sampler, switch hook and timer clock start a sampler loads.
#[derive(Clone, Copy, Debug)]
pub struct Programs {
    pub sample: &'static str,
    pub switch: &'static str,
    pub start_tick: &'static str,
}

impl Programs {
    fn for_options(options: &SamplerOptions) -> Self {
        if options.tasks {
            Programs { sample: programs::SAMPLE_TASKS, switch: programs::SWITCH_TASKS, start_tick: programs::START_TICK_TASKS }
        } else {
            Programs { sample: programs::SAMPLE, switch: programs::SWITCH, start_tick: programs::START_TICK }
        }
    }
}

/// Set (to anything) to sample with the perf-event clock, as kernels before 6.7 do.
const PERF_CLOCK_VAR: &str = "PYEBPF_PERF_CLOCK";

/// The running sampler. Dropping it detaches the programs.
pub struct Sampler {
    /// The clock sampling every CPU once started, the timer clock or where it cannot run the
    /// perf-event clock; dropped first, so sampling stops first.
    timer_clock: Option<TimerClock>,
    perf_clock: Option<SamplingClock>,
    /// Why the timer clock does not sample, where it cannot (its start hook is then not loaded,
    /// or it did not start): the perf-event clock samples instead.
    no_timer_clock: Option<String>,
    ebpf: Ebpf,
    frequency_hz: u64,
    /// The sampler and switch hook loaded (with or without asyncio tasks).
    programs: Programs,
    /// Keeps the kernel's run-time accounting on while held.
    _program_stats: Option<std::os::fd::OwnedFd>,
    /// The eBPF programs' own diagnostics, with debug logging on.
    kernel_log: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
    samples: RingReader,
    lost: PerCpuArray<MapData, u64>,
    targets: HashMap<MapData, u32, u8>,
    py_procs: HashMap<MapData, u32, PyProcConfig>,
    py_threads: HashMap<MapData, u32, PyThreadEntry>,
    py_markers: HashMap<MapData, u32, MarkerChain>,
    snapshot_procs: HashMap<MapData, u32, u8>,
    known_procs: HashMap<MapData, u32, u8>,
    wait_procs: Array<MapData, u64>,
    /// Processes in `WAIT_PROCS`; the switch hook is attached while there are some.
    waits_watched: std::collections::HashSet<u32>,
    switch_link: Option<BtfTracePointLinkId>,
    off_cpu: HashMap<MapData, u32, OffCpuStart>,
    short_waits: PerCpuArray<MapData, u64>,
    pub(crate) unwind_pages: crate::unwind::UnwindPagesMap,
}

/// Whether this process may load BPF programs, sample all CPUs and read other processes; when
/// not, the error names the capabilities it lacks.
pub fn check_privileges() -> Result<(), BpfError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return Ok(());
    }
    // CAP_BPF loads the programs and maps, CAP_PERFMON opens the CPU clock events of every
    // process and attaches tracing programs, CAP_SYS_PTRACE reads other users' processes.
    const NEEDED: [(u32, &str); 3] = [(39, "CAP_BPF"), (38, "CAP_PERFMON"), (19, "CAP_SYS_PTRACE")];
    let effective = procfs::process::Process::myself().and_then(|me| me.status()).ok().map(|status| status.capeff).unwrap_or(0);
    let missing: Vec<&str> = NEEDED.iter().filter(|(bit, _)| effective & (1 << bit) == 0).map(|(_, name)| *name).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(BpfError::MissingCapabilities(missing.join(", ")))
    }
}

/// Whether a system call under `err` was refused (EPERM, EACCES), however deeply aya wraps it.
fn is_permission_error(err: &aya::EbpfError) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(error) = cause {
        if error.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::PermissionDenied) {
            return true;
        }
        cause = error.source();
    }
    false
}

/// The map `name` of the object, taken out of it; an object without it is stale.
fn take_map(ebpf: &mut Ebpf, name: &'static str) -> Result<aya::maps::Map, BpfError> {
    ebpf.take_map(name).ok_or(BpfError::StaleObject(name))
}

/// The program `name` of the object, as its kind `P`; an object without it is stale.
fn program_mut<'a, P>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut P, BpfError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    ebpf.program_mut(name).ok_or(BpfError::StaleObject(name))?.try_into().map_err(BpfError::Program)
}

/// The eBPF programs' diagnostics are compiled in but off (and removed by the verifier) unless
/// debug logging is on.
fn kernel_log_level() -> u8 {
    if log::log_enabled!(log::Level::Debug) {
        aya_log::Level::Debug as u8
    } else {
        0
    }
}

/// Loads the object with its globals and map sizes set; returns it, the kernel's BTF as aya reads
/// it (to load the BTF-typed hooks) and the number of possible CPUs.
fn load_object(kb: u32, log_level: u8) -> Result<(Ebpf, aya::Btf, u32), BpfError> {
    // Every program reads kernel types, so a kernel without BTF is reported here, in one line. The
    // hooks read task ids at these offsets, constants to the verifier (the eBPF crate's `task`).
    // The types take megabytes parsed; two copies at once would set pyebpf's peak memory, so this
    // one and the loader's own are dropped before the one kept to attach the hooks is parsed.
    let (task_pid_offset, task_tgid_offset) = {
        let kernel_btf = Btf::from_kernel()?;
        (kernel_btf.member_offset("task_struct", "pid")?, kernel_btf.member_offset("task_struct", "tgid")?)
    };
    let mut loader = EbpfLoader::new();
    loader.btf(None);
    let aya_btf = aya::Btf::from_sys_fs().map_err(BpfError::AyaBtf)?;
    let cpus = aya::util::nr_cpus().map_err(|(_, err)| BpfError::Cpus(err))? as u32;
    let ebpf = loader
        .btf(Some(&aya_btf))
        .override_global(aya_log::LEVEL, &log_level, false)
        .override_global(globals::TASK_PID_OFFSET, &task_pid_offset, true)
        .override_global(globals::TASK_TGID_OFFSET, &task_tgid_offset, true)
        .map_max_entries(maps::SAMPLES, kb * 1024)
        // One record per CPU for samples, one for the switch hooks.
        .map_max_entries(maps::SCRATCH, 2 * cpus)
        .map_max_entries(maps::PROC_SCRATCH, 2 * cpus)
        .map_max_entries(maps::TASK_WINDOWS, 2 * cpus)
        .map_max_entries(maps::CLOCK, cpus)
        .map_max_entries(maps::TICKS, cpus)
        .load(EBPF_OBJECT)
        .map_err(|err| if is_permission_error(&err) { BpfError::NotPermitted } else { BpfError::Load(err) })?;
    Ok((ebpf, aya_btf, cpus))
}

/// Gives freed memory back to the system: the kernel's types, parsed to load the object, are
/// megabytes glibc's allocator would keep for the whole recording (musl's returns them itself).
fn release_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only returns free memory of the allocator to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Whether the ring buffer holds a few records with a whole stack copy: the copies of processes not
/// known yet are a help, not worth losing those processes' samples for in a tiny buffer.
fn copies_fit(ring_buffer_kb: u32) -> bool {
    ring_buffer_kb as usize * 1024 >= 16 * std::mem::size_of::<SampleRecord>()
}

/// The configuration flags `options` ask for.
fn flags_for(options: &SamplerOptions) -> u32 {
    let wanted = [
        (options.kernel_stacks, config_flags::KERNEL_STACK),
        (options.unwind == UnwindMode::Dwarf, config_flags::SNAPSHOT_ALL),
        (options.unwind == UnwindMode::Auto && copies_fit(options.ring_buffer_kb), config_flags::SNAPSHOT_UNKNOWN),
        (options.gil, config_flags::GIL),
        (options.waiting_tasks, config_flags::WAITING_TASKS),
        (options.targets.is_some(), config_flags::FILTER_TARGETS),
        (options.follow_forks, config_flags::FOLLOW_FORKS),
        (options.program_stats, config_flags::RUN_TIME),
    ];
    wanted.iter().filter(|(on, _)| *on).fold(0, |flags, (_, flag)| flags | flag)
}

/// Fills the target set and the configuration the programs read; returns the target set.
fn configure(ebpf: &mut Ebpf, options: &SamplerOptions, cpus: u32) -> Result<HashMap<MapData, u32, u8>, BpfError> {
    let mut targets: HashMap<MapData, u32, u8> = HashMap::try_from(take_map(ebpf, maps::TARGETS)?).map_err(map_error(maps::TARGETS))?;
    for pid in options.targets.iter().flatten() {
        targets.insert(pid, 1, 0).map_err(map_error(maps::TARGETS))?;
    }
    let off_cpu_min_ns = options.off_cpu_min.map_or(0, |min| min.as_nanos().try_into().unwrap_or(u64::MAX));
    let kb = options.ring_buffer_kb;
    let config = Config {
        own_tgid: std::process::id(),
        flags: flags_for(options),
        // Half: woken at once, the reader still has half the buffer to spare while it gets a CPU
        // (a deep stack at 999 Hz fills 2 MiB in an eighth of a second); each wake-up costs both
        // threads tens of microseconds, and a larger batch is resolved with warmer caches.
        wakeup_bytes: kb * 1024 / 2,
        cpus,
        off_cpu_min_ns,
        wakeup_latency_ns: wakeup_latency(options.frequency_hz).as_nanos() as u64,
        urgent_latency_ns: URGENT_LATENCY.as_nanos() as u64,
        ticks_per_slot: ClockPlan::new(options.frequency_hz).ticks_per_slot,
        _pad: 0,
        sample_period_ns: 1_000_000_000 / options.frequency_hz.max(1),
    };
    let mut config_map: Array<_, Config> =
        Array::try_from(ebpf.map_mut(maps::CONFIG).ok_or(BpfError::StaleObject(maps::CONFIG))?).map_err(map_error(maps::CONFIG))?;
    config_map.set(0, config, 0).map_err(map_error(maps::CONFIG))?;
    Ok(targets)
}

/// Loads the BTF-typed program `name` for the kernel's `tracepoint` and attaches it.
fn attach_tracepoint(ebpf: &mut Ebpf, name: &'static str, tracepoint: &str, btf: &aya::Btf) -> Result<(), BpfError> {
    let program: &mut BtfTracePoint = program_mut(ebpf, name)?;
    program.load(tracepoint, btf).map_err(BpfError::Program)?;
    program.attach().map_err(BpfError::Program)?;
    Ok(())
}

/// Attaches the fork, exec and exit hooks and, for off-CPU intervals, loads the switch hook;
/// returns the programs `options` choose.
fn attach_hooks(ebpf: &mut Ebpf, options: &SamplerOptions, btf: &aya::Btf) -> Result<Programs, BpfError> {
    if options.follow_forks {
        attach_tracepoint(ebpf, programs::FOLLOW_FORK, "sched_process_fork", btf)?;
    }
    // exec and exit tell userspace when a process's state stops being valid.
    for (name, tracepoint) in [(programs::PROCESS_EXEC, "sched_process_exec"), (programs::PROCESS_EXIT, "sched_process_exit")] {
        attach_tracepoint(ebpf, name, tracepoint, btf)?;
    }
    let loaded = Programs::for_options(options);
    if options.off_cpu_min.is_some() {
        // BTF-typed: no kprobes (these kernels have none) or tracefs are needed. Attached only
        // while some process is watched (see `Sampler::watch_waits`): it would run at every
        // context switch on the host.
        let program: &mut BtfTracePoint = program_mut(ebpf, loaded.switch)?;
        program.load("sched_switch", btf).map_err(BpfError::Program)?;
    }
    Ok(loaded)
}

/// Loads the timer clock's start hook (attached only while the clock starts); returns why the
/// timer clock cannot sample, if it cannot.
fn load_timer_clock(ebpf: &mut Ebpf, programs: Programs, btf: &aya::Btf) -> Result<Option<String>, BpfError> {
    if std::env::var_os(PERF_CLOCK_VAR).is_some() {
        return Ok(Some(format!("{PERF_CLOCK_VAR} is set")));
    }
    let program: &mut BtfTracePoint = program_mut(ebpf, programs.start_tick)?;
    // The verifier's whole log follows the first line.
    Ok(program.load("task_rename", btf).err().map(|err| format!("this kernel does not load the timer clock: {}", err.to_string().lines().next().unwrap_or(""))))
}

impl Sampler {
    /// Loads and configures the programs and attaches the lifecycle hooks; [`Sampler::start_sampling`]
    /// then starts the sampling.
    pub fn start(options: &SamplerOptions) -> Result<Sampler, BpfError> {
        if EBPF_OBJECT.is_empty() {
            return Err(BpfError::NoObject);
        }
        let kb = options.ring_buffer_kb;
        if !ring_buffer_kb_fits(kb) {
            return Err(BpfError::RingBufferSize(kb));
        }
        let log_level = kernel_log_level();
        let (mut ebpf, aya_btf, cpus) = load_object(kb, log_level)?;
        let targets = configure(&mut ebpf, options, cpus)?;
        let loaded = attach_hooks(&mut ebpf, options, &aya_btf)?;
        let no_timer_clock = load_timer_clock(&mut ebpf, loaded, &aya_btf)?;
        drop(aya_btf);
        release_freed_memory();
        let program_stats = options.program_stats.then(|| aya::sys::enable_stats(aya::sys::Stats::RunTime).ok()).flatten();
        let mut sampler = Sampler::with_maps(ebpf, options, loaded, program_stats, log_level, targets)?;
        sampler.no_timer_clock = no_timer_clock;
        Ok(sampler)
    }

    /// The sampler of the loaded object: the maps userspace reads and writes taken out of it, and
    /// the ring-buffer reader started.
    fn with_maps(
        mut ebpf: Ebpf,
        options: &SamplerOptions,
        programs: Programs,
        program_stats: Option<std::os::fd::OwnedFd>,
        log_level: u8,
        targets: HashMap<MapData, u32, u8>,
    ) -> Result<Sampler, BpfError> {
        let kernel_log =
            if log_level == 0 { None } else { aya_log::EbpfLogger::init(&mut ebpf).map_err(|err| log::debug!("eBPF diagnostics unavailable: {err}")).ok() };
        let samples = RingBuf::try_from(take_map(&mut ebpf, maps::SAMPLES)?).map_err(map_error(maps::SAMPLES))?;
        let lost = PerCpuArray::try_from(take_map(&mut ebpf, maps::LOST)?).map_err(map_error(maps::LOST))?;
        let py_procs = HashMap::try_from(take_map(&mut ebpf, maps::PY_PROCS)?).map_err(map_error(maps::PY_PROCS))?;
        let py_threads = HashMap::try_from(take_map(&mut ebpf, maps::PY_THREADS)?).map_err(map_error(maps::PY_THREADS))?;
        let py_markers = HashMap::try_from(take_map(&mut ebpf, maps::PY_MARKERS)?).map_err(map_error(maps::PY_MARKERS))?;
        let snapshot_procs = HashMap::try_from(take_map(&mut ebpf, maps::SNAPSHOT_PROCS)?).map_err(map_error(maps::SNAPSHOT_PROCS))?;
        let known_procs = HashMap::try_from(take_map(&mut ebpf, maps::KNOWN_PROCS)?).map_err(map_error(maps::KNOWN_PROCS))?;
        let wait_procs = Array::try_from(take_map(&mut ebpf, maps::WAIT_PROCS)?).map_err(map_error(maps::WAIT_PROCS))?;
        let off_cpu = HashMap::try_from(take_map(&mut ebpf, maps::OFF_CPU)?).map_err(map_error(maps::OFF_CPU))?;
        let short_waits = PerCpuArray::try_from(take_map(&mut ebpf, maps::SHORT_WAITS)?).map_err(map_error(maps::SHORT_WAITS))?;
        let unwind_pages = crate::unwind::UnwindPagesMap::new(take_map(&mut ebpf, maps::UNWIND_PAGES)?).map_err(map_error(maps::UNWIND_PAGES))?;
        Ok(Sampler {
            timer_clock: None,
            perf_clock: None,
            no_timer_clock: None,
            ebpf,
            frequency_hz: options.frequency_hz,
            programs,
            _program_stats: program_stats,
            kernel_log,
            samples: RingReader::start(samples, options.ring_buffer_kb as usize * 1024, wakeup_latency(options.frequency_hz)).map_err(BpfError::Poll)?,
            lost,
            targets,
            py_procs,
            py_threads,
            py_markers,
            snapshot_procs,
            known_procs,
            wait_procs,
            waits_watched: std::collections::HashSet::new(),
            switch_link: None,
            off_cpu,
            short_waits,
            unwind_pages,
        })
    }

    /// Waits until the reader thread hands over records, then takes all it has into `out` (the
    /// records `out` held before are done with).
    pub async fn read_samples(&mut self, out: &mut RecordBatch) -> Result<(), BpfError> {
        if let Some(kernel_log) = &mut self.kernel_log {
            kernel_log.flush();
        }
        if self.samples.read(out).await {
            Ok(())
        } else {
            Err(BpfError::ReaderStopped)
        }
    }

    /// Takes every record the kernel has sent so far into `out`, at once (see
    /// [`RingReader::drain`]).
    pub async fn drain_samples(&mut self, out: &mut RecordBatch) -> Result<(), BpfError> {
        if self.samples.drain(out).await {
            Ok(())
        } else {
            Err(BpfError::ReaderStopped)
        }
    }

    /// Batches the reader thread handed over that were not read yet.
    pub fn queued_batches(&self) -> usize {
        self.samples.queued()
    }

    /// The sampler and switch hook loaded.
    pub fn programs(&self) -> Programs {
        self.programs
    }

    /// Batches and samples the reader thread dropped because the consumer was behind.
    pub fn reader_drops(&self) -> (u64, u64) {
        let drops = self.samples.drops();
        (drops.batches.load(std::sync::atomic::Ordering::Relaxed), drops.samples.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Attaches the sampler to every online CPU: sampling starts. Separate from [`Sampler::start`]
    /// so the processes attached beforehand are registered first and their first samples
    /// already carry Python frames.
    pub fn start_sampling(&mut self) -> Result<(), BpfError> {
        let cpus = aya::util::online_cpus().map_err(|(_, err)| BpfError::Cpus(err))?;
        self.timer_clock = self.start_timer_clock(&cpus)?;
        if self.timer_clock.is_none() {
            self.perf_clock = Some(self.start_perf_clock(&cpus)?);
        }
        Ok(())
    }

    /// The timer clock on every CPU of `cpus`, or `None` where it cannot run here.
    fn start_timer_clock(&mut self, cpus: &[u32]) -> Result<Option<TimerClock>, BpfError> {
        if self.no_timer_clock.is_some() {
            return Ok(None);
        }
        let ticks = take_map(&mut self.ebpf, maps::TICKS)?;
        let program: &mut BtfTracePoint = program_mut(&mut self.ebpf, self.programs.start_tick)?;
        match TimerClock::start(program, ticks, cpus) {
            Ok(clock) => Ok(Some(clock)),
            Err(err) => {
                self.no_timer_clock = Some(err.to_string());
                Ok(None)
            }
        }
    }

    /// The perf-event clock (see `sampling_clock`) on every CPU of `cpus`; its program is loaded
    /// only then (verifying it costs start-up time that the timer clock does not need).
    fn start_perf_clock(&mut self, cpus: &[u32]) -> Result<SamplingClock, BpfError> {
        let aya::maps::Map::Array(slots) = take_map(&mut self.ebpf, maps::CLOCK)? else { return Err(BpfError::StaleObject(maps::CLOCK)) };
        let program: &mut PerfEvent = program_mut(&mut self.ebpf, self.programs.sample)?;
        program.load().map_err(BpfError::Program)?;
        let program = program.fd().map_err(BpfError::Program)?.as_fd();
        SamplingClock::start(program, cpus, ClockPlan::new(self.frequency_hz), slots).map_err(|err| match err.kind() {
            std::io::ErrorKind::PermissionDenied => BpfError::NotPermitted,
            _ => BpfError::Clock(err),
        })
    }

    /// Whether the timer clock samples (rather than the perf-event clock).
    pub fn timer_clock(&self) -> bool {
        self.timer_clock.is_some()
    }

    /// Which clock samples, and why not the timer clock where it does not.
    pub fn clock(&self) -> String {
        match &self.no_timer_clock {
            None => "timer (one instant drawn at random in each period, on each CPU)".into(),
            Some(why) => format!("perf-event ({why})"),
        }
    }

    /// Time the sampling clock's program ran in the kernel and how often, with `program_stats`:
    /// the timer clock counts its callbacks itself (the kernel's statistics do not see them).
    pub fn sampler_run_time(&self) -> Option<(std::time::Duration, u64)> {
        if !self.timer_clock() {
            return self.program_run_time(self.programs.sample);
        }
        let run_time: PerCpuArray<_, u64> = PerCpuArray::try_from(self.ebpf.map(maps::TICK_RUN_TIME)?).ok()?;
        let sum = |index: u32| run_time.get(&index, 0).map(|per_cpu| per_cpu.iter().sum::<u64>()).unwrap_or(0);
        Some((std::time::Duration::from_nanos(sum(0)), sum(1)))
    }

    /// Time the sampler program ran in the kernel and how often, with `program_stats`.
    pub fn program_run_time(&self, name: &str) -> Option<(std::time::Duration, u64)> {
        let info = self.ebpf.program(name)?.info().ok()?;
        Some((info.run_time(), info.run_count()))
    }

    /// Samples lost: dropped in the kernel because the ring buffer was full (summed over CPUs),
    /// or by the reader thread because the consumer was behind.
    pub fn lost_samples(&self) -> u64 {
        let in_kernel: u64 = self.lost.get(&0, 0).map(|per_cpu| per_cpu.iter().sum()).unwrap_or(0);
        in_kernel + self.reader_drops().1
    }

    /// Exec and exit events dropped in the kernel because the ring buffer was full, or by the
    /// reader thread: a process they were about may keep stale state until the periodic check finds it.
    pub fn lost_events(&self) -> u64 {
        let in_kernel: u64 = self.lost.get(&1, 0).map(|per_cpu| per_cpu.iter().sum()).unwrap_or(0);
        in_kernel + self.samples.drops().events.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Adds a process to the sampled set (only matters when sampling is filtered).
    pub fn add_target(&mut self, pid: u32) -> Result<(), BpfError> {
        self.targets.insert(pid, 1, 0).map_err(map_error(maps::TARGETS))
    }

    /// Whether `pid` is in the sampled set (only meaningful when sampling is filtered).
    pub fn is_target(&self, pid: u32) -> bool {
        self.targets.get(&pid, 0).is_ok()
    }

    pub fn set_py_process(&mut self, tgid: u32, config: &PyProcConfig) -> Result<(), BpfError> {
        self.py_procs.insert(tgid, config, 0).map_err(map_error(maps::PY_PROCS))
    }

    pub fn remove_py_process(&mut self, tgid: u32) {
        let _ = self.py_procs.remove(&tgid);
    }

    pub fn set_py_thread(&mut self, tid: u32, thread: &PyThreadEntry) -> Result<(), BpfError> {
        self.py_threads.insert(tid, thread, 0).map_err(map_error(maps::PY_THREADS))
    }

    pub fn remove_py_thread(&mut self, tid: u32) {
        let _ = self.py_threads.remove(&tid);
        self.remove_marker_chain(tid);
    }

    /// Has the eBPF program copy `tgid`'s user stack at its samples, for CFI unwinding.
    pub fn copy_stacks_of(&mut self, tgid: u32) -> Result<(), BpfError> {
        self.snapshot_procs.insert(tgid, 1, 0).map_err(map_error(maps::SNAPSHOT_PROCS))
    }

    pub fn stop_copying_stacks_of(&mut self, tgid: u32) {
        let _ = self.snapshot_procs.remove(&tgid);
    }

    /// Userspace knows `tgid`: its samples need not wake the reader soon.
    pub fn set_known(&mut self, tgid: u32) {
        // A full map only makes the process's samples wake the reader sooner.
        let _ = self.known_procs.insert(tgid, 1, 0);
    }

    pub fn forget_known(&mut self, tgid: u32) {
        let _ = self.known_procs.remove(&tgid);
    }

    pub fn remove_marker_chain(&mut self, tid: u32) {
        let _ = self.py_markers.remove(&tid);
    }

    /// Has the switch hooks capture the off-CPU intervals of `tgid`'s threads; the first process
    /// watched attaches them.
    pub fn watch_waits(&mut self, tgid: u32) -> Result<(), BpfError> {
        self.set_wait_bit(tgid, true)?;
        self.waits_watched.insert(tgid);
        if self.switch_link.is_none() {
            let program: &mut BtfTracePoint = program_mut(&mut self.ebpf, self.programs.switch)?;
            self.switch_link = Some(program.attach().map_err(BpfError::Program)?);
        }
        Ok(())
    }

    /// The last process watched detaches the switch hooks.
    pub fn stop_watching_waits(&mut self, tgid: u32) {
        let _ = self.set_wait_bit(tgid, false);
        if self.waits_watched.remove(&tgid) && self.waits_watched.is_empty() {
            if let (Some(link), Ok(program)) = (self.switch_link.take(), program_mut::<BtfTracePoint>(&mut self.ebpf, self.programs.switch)) {
                let _ = program.detach(link);
            }
        }
        let threads: Vec<u32> = self.off_cpu.iter().filter_map(Result::ok).filter(|(_, entry)| entry.tgid == tgid).map(|(tid, _)| tid).collect();
        for tid in threads {
            let _ = self.off_cpu.remove(&tid);
        }
    }

    /// Sets or clears `tgid`'s bit in the `WAIT_PROCS` bitmap. Only userspace writes it, so the
    /// word read here is the word in the map.
    fn set_wait_bit(&mut self, tgid: u32, on: bool) -> Result<(), BpfError> {
        let (word, bit) = (tgid / 64, 1u64 << (tgid % 64));
        let old = self.wait_procs.get(&word, 0).map_err(map_error(maps::WAIT_PROCS))?;
        let new = if on { old | bit } else { old & !bit };
        if new != old {
            self.wait_procs.set(word, new, 0).map_err(map_error(maps::WAIT_PROCS))?;
        }
        Ok(())
    }

    /// Threads of watched processes the switch hook has seen leave the CPU (those off it now have
    /// a `start_ns`).
    pub fn watched_threads(&self) -> Vec<(u32, OffCpuStart)> {
        self.off_cpu.iter().filter_map(Result::ok).collect()
    }

    /// Off-CPU intervals that began without a capture: how many, and their nanoseconds.
    pub fn short_waits(&self) -> (u64, u64) {
        let sum = |slot: u32| self.short_waits.get(&slot, 0).map(|per_cpu| per_cpu.iter().sum()).unwrap_or(0);
        (sum(1), sum(0))
    }

    /// Tells the eBPF program the marker chain userspace established for `tid`.
    pub fn set_marker_chain(&mut self, tid: u32, chain: &MarkerChain) -> Result<(), BpfError> {
        self.py_markers.insert(tid, chain, 0).map_err(map_error(maps::PY_MARKERS))
    }
}

#[cfg(test)]
mod tests {
    use object::{Object, ObjectSymbol};
    use pyebpf_common::{globals, maps, programs};

    use super::{copies_fit, ring_buffer_kb_for};

    #[test]
    fn the_ring_buffer_grows_with_the_rate_and_the_cpus_within_its_bounds() {
        assert_eq!(ring_buffer_kb_for(19, 2), 1024);
        assert_eq!(ring_buffer_kb_for(19, 1), 1024);
        assert_eq!(ring_buffer_kb_for(49, 2), 2048);
        assert_eq!(ring_buffer_kb_for(99, 2), 2048);
        assert_eq!(ring_buffer_kb_for(99, 4), 4096);
        assert_eq!(ring_buffer_kb_for(999, 2), 4096);
        assert_eq!(ring_buffer_kb_for(u64::MAX, u32::MAX), 4096);
        assert!(copies_fit(ring_buffer_kb_for(1, 1)), "the smallest default leaves no room for stack copies");
    }

    #[test]
    fn the_embedded_object_has_every_map_program_and_global_the_loader_takes() {
        if super::EBPF_OBJECT.is_empty() {
            pyebpf_tests::needs_xtask("this pyebpf was built without its eBPF object");
        }
        let object = object::File::parse(super::EBPF_OBJECT).expect("the embedded eBPF object is ELF");
        let symbols: Vec<&str> = object.symbols().filter_map(|symbol| symbol.name().ok()).collect();
        for name in maps::ALL.iter().chain(&programs::ALL).chain(&globals::ALL) {
            assert!(symbols.contains(name), "the eBPF object has no symbol {name}: {symbols:?}");
        }
    }
}
