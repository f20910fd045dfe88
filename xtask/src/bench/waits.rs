//! Off-CPU time: what `--mode wall` costs switch-heavy programs (a Python pipe ping-pong, and
//! `perf bench sched pipe`), when pyebpf profiles them and when pyebpf runs host-wide but profiles
//! other processes, beside py-spy `--idle` and Tachyon `--mode wall` (Python only). Each program
//! runs pinned to one CPU, where every hop is a direct switch and the hook's cost is all there is
//! to see, and across two CPUs, where idle CPUs waking dominate on a virtual machine. And the shares
//! each profiler gives on waits.py, whose serving thread sleeps 70% and computes 30% of its time
//! beside a thread blocked on a lock throughout.

use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::fidelity::holds;
use super::measure::{figure_before, median, run_measured, stat_line, Measured};
use super::{Bench, Profiler, PROFILERS};

pub const ROUNDS: usize = 5;
/// `perf bench sched pipe` round trips per run.
pub const PERF_LOOPS: &str = "300000";
/// Seconds each ping-pong runs.
pub const PINGPONG_S: &str = "4";
pub const HZ: &str = "99";
/// The shares are also taken at 97 Hz: waits.py's cycle (7 + 3 ms and a little) is close to 99 Hz's
/// period, and a clock ticking at exact multiples of its period samples a few phases of it
/// (aliasing).
pub const SHARE_HZ: [&str; 2] = ["99", "97"];
pub const SHARE_SECONDS: &str = "4";
const VERSION: &str = "3.15";

/// How the ping-pong runs in each setting.
#[derive(Clone, Copy)]
enum Setting {
    Alone,
    /// The bench's `empty_switch` program on `sched_switch`, no profiler: what any program run at
    /// every context switch costs, the floor under pyebpf's hook.
    EmptyHook,
    /// `record -a --comm` naming a bystander (see [`Bystander`]), in cpu mode: what sampling the
    /// host costs alone.
    PyebpfOthersCpu,
    /// `record -a --mode wall --comm` naming the bystander: the switch hook is attached while
    /// pyebpf watches some process, and then every switch on the host goes through it.
    PyebpfOthers,
    PyebpfProfiling,
    PySpyIdle,
    TachyonWall,
}

const SETTINGS: [Setting; 7] =
    [Setting::Alone, Setting::EmptyHook, Setting::PyebpfOthersCpu, Setting::PyebpfOthers, Setting::PyebpfProfiling, Setting::PySpyIdle, Setting::TachyonWall];
/// Those that apply to a native program.
const NATIVE_SETTINGS: [Setting; 5] = [Setting::Alone, Setting::EmptyHook, Setting::PyebpfOthersCpu, Setting::PyebpfOthers, Setting::PyebpfProfiling];

/// The switch-heavy programs.
#[derive(Clone, Copy)]
enum Program {
    PythonPingPong,
    PerfPipe,
}

impl Program {
    fn name(self) -> &'static str {
        match self {
            Program::PythonPingPong => "pingpong.py",
            Program::PerfPipe => "perf bench sched pipe",
        }
    }

    /// Tachyon's `run` starts the script itself, so it cannot pin only the program.
    fn settings(self, pinned: bool) -> &'static [Setting] {
        match self {
            Program::PythonPingPong if pinned => &SETTINGS[..SETTINGS.len() - 1],
            Program::PythonPingPong => &SETTINGS,
            Program::PerfPipe => &NATIVE_SETTINGS,
        }
    }

    /// The command line (pinned to CPU 1 through `taskset`, which execs it), and how its round
    /// trips per second are read from its output.
    fn command(self, bench: &Bench, pinned: bool) -> Vec<std::ffi::OsString> {
        let mut argv: Vec<std::ffi::OsString> = if pinned { vec!["taskset".into(), "-c".into(), "1".into()] } else { Vec::new() };
        match self {
            Program::PythonPingPong => argv.extend([bench.python(VERSION).into(), bench.script("pingpong.py").into(), PINGPONG_S.into()]),
            Program::PerfPipe => argv.extend(["perf", "bench", "sched", "pipe", "-l", PERF_LOOPS].map(Into::into)),
        }
        argv
    }

    fn round_trips_per_s(self, measured: &Measured) -> Result<f64> {
        match self {
            Program::PythonPingPong => measured.workload_seconds(),
            Program::PerfPipe => {
                let line = measured.stdout.lines().find(|line| line.contains("usecs/op")).with_context(|| format!("no usecs/op in {:?}", measured.stdout))?;
                let usecs: f64 = line.split_whitespace().next().and_then(|n| n.parse().ok()).with_context(|| format!("no figure in {line:?}"))?;
                Ok(1e6 / usecs)
            }
        }
    }
}

impl Setting {
    fn name(self) -> &'static str {
        match self {
            Setting::Alone => "alone",
            Setting::EmptyHook => "an empty BPF program on sched_switch, no profiler",
            Setting::PyebpfOthersCpu => "pyebpf record -a --mode cpu, profiling other processes",
            Setting::PyebpfOthers => "pyebpf record -a --mode wall, profiling other processes",
            Setting::PyebpfProfiling => "pyebpf record --mode wall, profiling it",
            Setting::PySpyIdle => "py-spy record --idle --subprocesses",
            Setting::TachyonWall => "Tachyon run --mode wall -a",
        }
    }
}

pub fn waits(bench: &Bench) -> Result<Value> {
    let _polling = IdlePolling::hold();
    let mut throughput = Vec::new();
    for (program, pinned) in [(Program::PythonPingPong, true), (Program::PerfPipe, true), (Program::PythonPingPong, false), (Program::PerfPipe, false)] {
        let settings = program.settings(pinned);
        let cpus = if pinned { "one (pinned)" } else { "two" };
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); settings.len()];
        for _ in 0..ROUNDS {
            for (at, setting) in settings.iter().enumerate() {
                let (rate, _) = switch_heavy(bench, program, pinned, *setting, false)?;
                eprintln!("  {} on {cpus} CPU(s), {}: {rate:.0} round trips/s", program.name(), setting.name());
                rates[at].push(rate);
            }
        }
        let alone = median(&mut rates[0].clone());
        for (setting, rates) in settings.iter().zip(&rates) {
            let rate = median(&mut rates.clone());
            throughput.push(
                json!({ "program": program.name(), "cpus": cpus, "setting": setting.name(), "round_trips_per_s": rate, "share_of_alone": rate / alone, "runs": rates }),
            );
        }
    }
    let target = bench.spawn_ready(VERSION, "waits.py", &[])?;
    let mut shares = Vec::new();
    for hz in SHARE_HZ {
        for profiler in PROFILERS {
            let run = wall_profile(bench, profiler, target.pid(), hz)?;
            let mut row = shares_of(profiler, &run)?;
            row["hz"] = json!(hz);
            eprintln!("  {row}");
            shares.push(row);
        }
    }
    // Apart from the throughput runs: the statistics add clock reads to every run of the hook.
    let mut hook_ns = Vec::new();
    for _ in 0..ROUNDS {
        hook_ns.extend(switch_heavy(bench, Program::PerfPipe, true, Setting::PyebpfOthers, true)?.1);
    }
    let switch_hook_ns = (!hook_ns.is_empty()).then(|| median(&mut hook_ns.clone()));
    Ok(json!({ "throughput": throughput, "shares": shares, "switch_hook_ns_median": switch_hook_ns, "switch_hook_ns": hook_ns }))
}

/// While held, idle CPUs poll rather than halt (a PM QoS request of 0 µs through
/// `/dev/cpu_dma_latency`): in a virtual machine waking a halted CPU is a trip through the
/// hypervisor, and any other load (a profiler) keeps CPUs from halting, so a switch-heavy program
/// ran faster beside a profiler than alone.
struct IdlePolling {
    _request: Option<std::fs::File>,
}

impl IdlePolling {
    fn hold() -> IdlePolling {
        use std::io::Write;
        let request =
            std::fs::OpenOptions::new().write(true).open("/dev/cpu_dma_latency").and_then(|mut file| file.write_all(&0i32.to_ne_bytes()).map(|()| file));
        if let Err(err) = &request {
            eprintln!("  idle CPUs may halt (/dev/cpu_dma_latency: {err}): switch-heavy throughput varies with how fast they wake");
        }
        IdlePolling { _request: request.ok() }
    }
}

/// Round trips per second of one run of `program` in `setting`, and with pyebpf host-wide in wall
/// mode and `stats`, the switch hook's time per context switch (`--stats`, from the kernel's BPF
/// statistics).
fn switch_heavy(bench: &Bench, program: Program, pinned: bool, setting: Setting, stats: bool) -> Result<(f64, Option<f64>)> {
    let argv = program.command(bench, pinned);
    let out = bench.out.join("waits-switch-heavy.txt");
    let mut command = match setting {
        Setting::Alone | Setting::EmptyHook | Setting::PyebpfOthersCpu | Setting::PyebpfOthers => {
            let mut c = Command::new(&argv[0]);
            c.args(&argv[1..]);
            c
        }
        Setting::PyebpfProfiling => {
            let mut c = Command::new(&bench.pyebpf);
            c.args(["record", "--mode", "wall", "-F", HZ, "-o"]).arg(&out).arg("--").args(&argv);
            c
        }
        Setting::PySpyIdle => {
            let mut c = Command::new(&bench.py_spy);
            c.args(["record", "--idle", "--subprocesses", "--format", "raw", "--rate", HZ, "-o"]).arg(&out).arg("--").args(&argv);
            c
        }
        Setting::TachyonWall => {
            let mut c = Command::new(&argv[0]);
            c.args(["-m", "profiling.sampling", "run", "--mode", "wall", "-a", "--collapsed", "-r", HZ, "-o"]).arg(&out).args(&argv[1..]);
            c
        }
    };
    // Host-wide, for as long as the ping-pong runs (after a second to load and attach).
    let host_wide_mode = match setting {
        Setting::PyebpfOthersCpu => Some("cpu"),
        Setting::PyebpfOthers => Some("wall"),
        _ => None,
    };
    let bystander = host_wide_mode.map(|_| Bystander::start()).transpose()?;
    let host_wide = match host_wide_mode {
        Some(mode) => Some(
            Command::new(&bench.pyebpf)
                .args(["record", "-a", "--mode", mode, "--comm", Bystander::COMM, "-F", HZ, "-d", "7", "-o", "/dev/null"])
                .args(stats.then_some("--stats"))
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .context("start pyebpf")?,
        ),
        None => None,
    };
    if host_wide.is_some() {
        std::thread::sleep(Duration::from_secs(2));
    }
    let empty_hook = matches!(setting, Setting::EmptyHook).then(|| EmptyHook::attach(&bench.root)).transpose()?;
    let measured = run_measured(&mut command, None)?;
    drop(empty_hook);
    drop(bystander);
    let mut hook_ns = None;
    if let Some(pyebpf) = host_wide {
        let output = pyebpf.wait_with_output()?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() {
            bail!("pyebpf record -a failed: {}: {stderr}", output.status);
        }
        hook_ns = stat_line(&stderr, "switch hook time:").and_then(|line| figure_before(&line, "ns per context switch"));
    }
    Ok((program.round_trips_per_s(&measured)?, hook_ns))
}

/// The process pyebpf profiles host-wide while the switch-heavy program runs beside it: Debian's
/// Python 3.11 (a name no measured program has) spinning 5 ms every 100 ms, so that pyebpf samples
/// it, watches it in wall mode and has the switch hook attached.
struct Bystander(std::process::Child);

impl Bystander {
    const COMM: &'static str = "^python3\\.11$";
    const SCRIPT: &'static str =
        "import time\nwhile True:\n    end = time.perf_counter() + 0.005\n    while time.perf_counter() < end:\n        pass\n    time.sleep(0.1)\n";

    fn start() -> Result<Bystander> {
        let child = Command::new("/usr/bin/python3.11").args(["-c", Self::SCRIPT]).spawn().context("start /usr/bin/python3.11 as the bystander")?;
        Ok(Bystander(child))
    }
}

impl Drop for Bystander {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The eBPF crate's `empty_switch` program, attached to `sched_switch` while this is held.
struct EmptyHook {
    _ebpf: aya::Ebpf,
}

impl EmptyHook {
    fn attach(root: &std::path::Path) -> Result<EmptyHook> {
        let object = crate::toolchain::ebpf_object_path(root).with_file_name("empty_switch");
        let mut ebpf = aya::Ebpf::load_file(&object).with_context(|| format!("load {}", object.display()))?;
        let btf = aya::Btf::from_sys_fs().context("the kernel's BTF")?;
        let program: &mut aya::programs::BtfTracePoint =
            ebpf.program_mut("empty_switch").context("no empty_switch program in the object")?.try_into().context("empty_switch is not a tp_btf program")?;
        program.load("sched_switch", &btf).context("load empty_switch")?;
        program.attach().context("attach empty_switch to sched_switch")?;
        Ok(EmptyHook { _ebpf: ebpf })
    }
}

/// A wall-clock profile of `pid` by `profiler`, with its CPU cost.
fn wall_profile(bench: &Bench, profiler: Profiler, pid: u32, hz: &str) -> Result<Measured> {
    let out = bench.out.join(format!("waits-{}.txt", profiler.name()));
    let _ = std::fs::remove_file(&out);
    let pid = pid.to_string();
    let mut command = match profiler {
        Profiler::Pyebpf => {
            let mut c = Command::new(&bench.pyebpf);
            c.args(["record", "--mode", "wall", "-p", &pid, "-F", hz, "-d", SHARE_SECONDS, "-o"]).arg(&out);
            c
        }
        Profiler::PySpy => {
            let mut c = Command::new(&bench.py_spy);
            c.args(["record", "--idle", "--format", "raw", "--pid", &pid, "--rate", hz, "--duration", SHARE_SECONDS, "-o"]).arg(&out);
            c
        }
        Profiler::Tachyon => {
            let mut c = Command::new(bench.python("3.15"));
            c.args(["-m", "profiling.sampling", "attach", "--mode", "wall", "-a", "--collapsed", "-r", hz, "-d", SHARE_SECONDS, "-o"]).arg(&out).arg(&pid);
            c
        }
    };
    let mut measured = run_measured(&mut command, None)?;
    measured.collapsed = std::fs::read_to_string(&out).with_context(|| format!("{} wrote no profile: {}", profiler.name(), measured.stderr))?;
    Ok(measured)
}

/// `wait_io` and `compute` as shares of the serving thread's time, and the lock waiter's weight
/// as a share of the serving thread's (they run equally long: about 100% when it is counted).
fn shares_of(profiler: Profiler, run: &Measured) -> Result<Value> {
    let weight = |function: &str| -> f64 {
        run.collapsed
            .lines()
            .filter_map(|line| line.rsplit_once(' '))
            .filter(|(stack, _)| holds(&stack.split(';').collect::<Vec<_>>(), function))
            .filter_map(|(_, count)| count.trim().parse::<f64>().ok())
            .sum()
    };
    let serve = weight("serve");
    if serve == 0.0 {
        bail!("{} has no stacks of the serving thread", profiler.name());
    }
    Ok(json!({
        "profiler": profiler.name(),
        "wait_io_percent": 100.0 * weight("wait_io") / serve,
        "compute_percent": 100.0 * weight("compute") / serve,
        "lock_waiter_percent_of_serving": 100.0 * weight("lock_waiter") / serve,
        "cpu_s": run.cpu_s,
        "wall_s": run.wall_s,
    }))
}
