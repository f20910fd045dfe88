//! Loading the embedded eBPF sampler, attaching it to every CPU, and reading its samples.

use std::mem::size_of;

use aya::maps::{Array, HashMap, MapData, PerCpuArray, RingBuf};
use aya::programs::perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent};
use aya::programs::{BtfTracePoint, PerfEvent};
use aya::{Ebpf, EbpfLoader};
use crate::kernel_btf::{Btf, VMLINUX_BTF};
use pyebpf_common::{config_flags, maps, Config, PyProcConfig, SampleRecord};
use tokio::io::unix::AsyncFd;

/// The object built by `cargo xtask build`; empty when the crate was built without it.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/pyebpf-ebpf.o"));

#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    #[error("this pyebpf was built without its eBPF object; build it with `cargo xtask build --release`")]
    NoObject,
    #[error("permission denied: pyebpf needs root (or CAP_BPF, CAP_PERFMON and CAP_SYS_PTRACE)")]
    NotPermitted,
    #[error("--ring-buffer-kb must be a power of two of at least 4, not {0}")]
    RingBufferSize(u32),
    #[error("cannot load the eBPF sampler (is BPF available in this kernel?): {0}")]
    Load(#[source] aya::EbpfError),
    #[error("cannot attach the eBPF sampler: {0}")]
    Program(#[source] aya::programs::ProgramError),
    #[error("eBPF map {name}: {source}")]
    Map { name: &'static str, source: aya::maps::MapError },
    #[error("cannot list online CPUs: {0}")]
    Cpus(std::io::Error),
    #[error(transparent)]
    KernelBtf(#[from] crate::kernel_btf::BtfError),
    #[error("cannot parse the kernel's BTF ({VMLINUX_BTF}): {0}")]
    AyaBtf(#[source] aya::BtfError),
    #[error("cannot poll the sample ring buffer: {0}")]
    Poll(std::io::Error),
}

fn map_error(name: &'static str) -> impl FnOnce(aya::maps::MapError) -> BpfError {
    move |source| BpfError::Map { name, source }
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
}

/// The running sampler. Dropping it detaches the programs.
pub struct Sampler {
    _ebpf: Ebpf,
    samples: AsyncFd<RingBuf<MapData>>,
    lost: PerCpuArray<MapData, u64>,
    targets: HashMap<MapData, u32, u8>,
    py_procs: HashMap<MapData, u32, PyProcConfig>,
    py_threads: HashMap<MapData, u32, u64>,
}

/// Whether this process may load BPF programs, sample all CPUs and read other processes.
pub fn check_privileges() -> Result<(), BpfError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return Ok(());
    }
    const NEEDED: [u32; 3] = [19 /* SYS_PTRACE */, 38 /* PERFMON */, 39 /* BPF */];
    let effective = procfs::process::Process::myself()
        .and_then(|me| me.status())
        .ok()
        .map(|status| status.capeff)
        .unwrap_or(0);
    if NEEDED.iter().all(|bit| effective & (1 << bit) != 0) {
        Ok(())
    } else {
        Err(BpfError::NotPermitted)
    }
}

fn is_permission_error(err: &aya::EbpfError) -> bool {
    let text = format!("{err:?}");
    text.contains("PermissionDenied") || text.contains("EPERM")
}

impl Sampler {
    /// Loads the programs, configures them and attaches them to every online CPU.
    pub fn start(options: &SamplerOptions) -> Result<Sampler, BpfError> {
        if EBPF_OBJECT.is_empty() {
            return Err(BpfError::NoObject);
        }
        let kb = options.ring_buffer_kb;
        if kb < 4 || !kb.is_power_of_two() {
            return Err(BpfError::RingBufferSize(kb));
        }
        // Every program reads kernel types (the current task, fork's task_structs), so a kernel
        // without BTF is reported here, in one line, rather than as a verifier log.
        let kernel_btf = Btf::from_kernel()?;
        let aya_btf = aya::Btf::from_sys_fs().map_err(BpfError::AyaBtf)?;
        let mut ebpf = EbpfLoader::new()
            .btf(Some(&aya_btf))
            .map_max_entries(maps::SAMPLES, kb * 1024)
            .load(EBPF_OBJECT)
            .map_err(|err| if is_permission_error(&err) { BpfError::NotPermitted } else { BpfError::Load(err) })?;

        let mut flags = 0;
        if options.kernel_stacks {
            flags |= config_flags::KERNEL_STACK;
        }
        let mut targets: HashMap<MapData, u32, u8> =
            HashMap::try_from(ebpf.take_map(maps::TARGETS).expect("TARGETS is in the object")).map_err(map_error(maps::TARGETS))?;
        if let Some(pids) = &options.targets {
            flags |= config_flags::FILTER_TARGETS;
            for pid in pids {
                targets.insert(pid, 1, 0).map_err(map_error(maps::TARGETS))?;
            }
        }
        let task_tgid_offset = if options.follow_forks {
            flags |= config_flags::FOLLOW_FORKS;
            kernel_btf.member_offset("task_struct", "tgid")?
        } else {
            0
        };
        let config = Config { own_tgid: std::process::id(), flags, task_tgid_offset, _pad: 0 };
        let mut config_map: Array<_, Config> =
            Array::try_from(ebpf.map_mut(maps::CONFIG).expect("CONFIG is in the object")).map_err(map_error(maps::CONFIG))?;
        config_map.set(0, config, 0).map_err(map_error(maps::CONFIG))?;

        if options.follow_forks {
            let program: &mut BtfTracePoint =
                ebpf.program_mut("follow_fork").expect("follow_fork is in the object").try_into().map_err(BpfError::Program)?;
            program.load("sched_process_fork", &aya_btf).map_err(BpfError::Program)?;
            program.attach().map_err(BpfError::Program)?;
        }
        let program: &mut PerfEvent = ebpf.program_mut("sample").expect("sample is in the object").try_into().map_err(BpfError::Program)?;
        program.load().map_err(BpfError::Program)?;
        let cpus = aya::util::online_cpus().map_err(|(_, err)| BpfError::Cpus(err))?;
        for cpu in cpus {
            program
                .attach(
                    PerfEventConfig::Software(SoftwareEvent::CpuClock),
                    PerfEventScope::AllProcessesOneCpu { cpu },
                    SamplePolicy::Frequency(options.frequency_hz),
                    false,
                )
                .map_err(BpfError::Program)?;
        }

        let samples = RingBuf::try_from(ebpf.take_map(maps::SAMPLES).expect("SAMPLES is in the object")).map_err(map_error(maps::SAMPLES))?;
        let lost = PerCpuArray::try_from(ebpf.take_map(maps::LOST).expect("LOST is in the object")).map_err(map_error(maps::LOST))?;
        let py_procs = HashMap::try_from(ebpf.take_map(maps::PY_PROCS).expect("PY_PROCS is in the object")).map_err(map_error(maps::PY_PROCS))?;
        let py_threads = HashMap::try_from(ebpf.take_map(maps::PY_THREADS).expect("PY_THREADS is in the object")).map_err(map_error(maps::PY_THREADS))?;
        Ok(Sampler {
            _ebpf: ebpf,
            // SAFETY: the ring buffer owns its map fd, which stays open and unchanged as long as
            // the AsyncFd owns the ring buffer.
            samples: unsafe { AsyncFd::register_with_interest(samples, tokio::io::Interest::READABLE) }
                .map_err(|err| BpfError::Poll(err.into()))?,
            lost,
            targets,
            py_procs,
            py_threads,
        })
    }

    /// Waits until samples are available, then moves all of them into `out`.
    pub async fn read_samples(&mut self, out: &mut Vec<SampleRecord>) -> Result<(), BpfError> {
        let mut guard = self.samples.readable_mut().await.map_err(BpfError::Poll)?;
        let ring = guard.get_inner_mut();
        while let Some(item) = ring.next() {
            if item.len() >= size_of::<SampleRecord>() {
                // SAFETY: the kernel wrote a whole SampleRecord (plain data) into this slot; the
                // slot need not be aligned for it, hence read_unaligned.
                out.push(unsafe { std::ptr::read_unaligned(item.as_ptr() as *const SampleRecord) });
            }
        }
        guard.clear_ready();
        Ok(())
    }

    /// Samples dropped in the kernel because the ring buffer was full, summed over CPUs.
    pub fn lost_samples(&self) -> u64 {
        self.lost.get(&0, 0).map(|per_cpu| per_cpu.iter().sum()).unwrap_or(0)
    }

    /// Adds a process to the sampled set (only matters when sampling is filtered).
    pub fn add_target(&mut self, pid: u32) -> Result<(), BpfError> {
        self.targets.insert(pid, 1, 0).map_err(map_error(maps::TARGETS))
    }

    pub fn set_py_process(&mut self, tgid: u32, config: &PyProcConfig) -> Result<(), BpfError> {
        self.py_procs.insert(tgid, config, 0).map_err(map_error(maps::PY_PROCS))
    }

    pub fn remove_py_process(&mut self, tgid: u32) {
        let _ = self.py_procs.remove(&tgid);
    }

    pub fn set_py_thread(&mut self, tid: u32, tstate: u64) -> Result<(), BpfError> {
        self.py_threads.insert(tid, tstate, 0).map_err(map_error(maps::PY_THREADS))
    }

    pub fn remove_py_thread(&mut self, tid: u32) {
        let _ = self.py_threads.remove(&tid);
    }
}
