//! Always on: what a host-wide profiler left running costs, pyebpf beside the OpenTelemetry eBPF
//! profiler (the fleet agent Grafana Alloy and Parca Agent fork), on the same workloads in the same
//! run, one profiler at a time. Each runs as a service would: pyebpf `record -a --otlp grpc://...`,
//! the OpenTelemetry profiler with its collection agent, both sending OTLP profiles over gRPC to a
//! real collector, whose sink checks what arrived (requests, samples, Python frames per process).
//!
//! Steady state: after start-up and a warm-up, the CPU its threads ran over the measured window
//! (per-thread `schedstat`, in ns), as a share of one core, and its peak RSS (`VmHWM`).

mod receiver;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::measure::threads_cpu_ns;
use super::{Bench, Target};
use receiver::{wait_for, Receiver};

/// 19 Hz is Parca's and Grafana's default (the OpenTelemetry profiler's is 20), 99 Hz
/// `pyebpf.service`'s.
pub const RATES: [u32; 3] = [19, 49, 99];
/// Busy Python processes on the host (0: only what else runs there).
pub const WORKLOADS: [usize; 3] = [0, 20, 50];
/// After the profiler has started (the OpenTelemetry profiler: once it logs `ATTACHED`), before
/// the window. Its first minute is not steady state: with 20 busy processes the OpenTelemetry
/// profiler ran 1.8 to 2.6 times the CPU over 6-46 s that it ran over 46-86 s and 86-126 s (0.49%
/// of a core, then 0.27%, at 19 Hz; 1.26%, then 0.50-0.58%, at 99 Hz), both flat after 45 s.
pub const WARMUP_S: u64 = 45;
/// The measured window: one of pyebpf's default OTLP periods, so it holds one export of pyebpf's
/// as any minute of a service does (the OpenTelemetry profiler reports every 5 s).
pub const MEASURE_S: u64 = 60;
/// The busy processes' interpreters, in turn (3.11 and 3.12 pyenv's, the others Debian's).
const MIX: [&str; 5] = ["3.11", "3.12", "3.13", "3.14", "3.15"];
/// The OpenTelemetry profiler walks CPython 3.6-3.14 only.
const OTEL_UNREAD: &str = "3.15";
const OTEL_ENV: &str = "PYEBPF_OTEL_PROFILER";
/// Where it is by default, from the repository's root.
const OTEL_DEFAULT: &str = "../shared/peers/otel-ebpf-profiler/ebpf-profiler";
/// The OpenTelemetry profiler's log line once sampling has begun.
const ATTACHED: &str = "Attached sched monitor";
/// pyebpf's, at `RUST_LOG` info.
const SAMPLING: &str = "sampling at";
/// How long a profiler may take to start sampling: under 50 busy processes on 2 CPUs pyebpf's
/// start-up (loading its eBPF programs, mostly the kernel's verifier) takes 10 to 13 s of wall time.
const START_LIMIT: Duration = Duration::from_secs(300);
const TRACEFS: &str = "/sys/kernel/tracing";
const BUSY_SCRIPT: &str = "always_busy.py";
/// How long pyebpf waits at its stop for its last period to be delivered, and the collector for
/// the sink to take it.
const FLUSH_TIMEOUT_S: &str = "120";
/// How long a run waits, before it starts, for the collector and the sink to finish with the last.
const RECEIVER_SETTLE_S: u64 = 120;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Agent {
    Pyebpf,
    Otel,
}

impl Agent {
    fn key(self) -> &'static str {
        match self {
            Agent::Pyebpf => "pyebpf",
            Agent::Otel => "otel",
        }
    }

    /// The line each logs once it samples: its start-up ends there, and its warm-up begins.
    fn started_line(self) -> &'static str {
        match self {
            Agent::Pyebpf => SAMPLING,
            Agent::Otel => ATTACHED,
        }
    }
}

/// In the order each round runs them.
const AGENTS: [Agent; 2] = [Agent::Pyebpf, Agent::Otel];

/// The two profilers' binaries: pyebpf's is the one that ships.
struct Agents {
    pyebpf: PathBuf,
    otel: PathBuf,
}

impl Agents {
    fn find(bench: &Bench) -> Result<Agents> {
        let otel = std::env::var_os(OTEL_ENV).map(PathBuf::from).unwrap_or_else(|| bench.root.join(OTEL_DEFAULT));
        if !otel.is_file() {
            bail!(
                "the OpenTelemetry eBPF profiler is missing at {}: it is built from its sources (see {}/README.md), or set {OTEL_ENV} to its binary",
                otel.display(),
                Path::new(OTEL_DEFAULT).parent().expect("a folder").display()
            );
        }
        Ok(Agents { pyebpf: bench.shipped.clone(), otel })
    }

    /// The program and arguments of `agent` sampling at `hz` (a rate or a placeholder), sending to
    /// `endpoint` (`HOST:PORT`).
    fn command(&self, agent: Agent, hz: &str, endpoint: &str) -> (PathBuf, Vec<String>) {
        match agent {
            // At the stop pyebpf sends its one period, which the sink decodes before the collector
            // answers: on a loaded host that takes longer than the default 10 s of waiting for it.
            Agent::Pyebpf => (
                self.pyebpf.clone(),
                ["record", "-a", "-F", hz, "--otlp", &format!("grpc://{endpoint}"), "--otlp-flush-timeout", FLUSH_TIMEOUT_S].map(String::from).to_vec(),
            ),
            Agent::Otel => (self.otel.clone(), ["-samples-per-second", hz, "-collection-agent", endpoint, "-disable-tls"].map(String::from).to_vec()),
        }
    }

    fn command_line(&self, agent: Agent, hz: &str, endpoint: &str) -> String {
        let (program, args) = self.command(agent, hz, endpoint);
        format!("{} {}", program.display(), args.join(" "))
    }
}

pub fn always_on(bench: &Bench) -> Result<Value> {
    let agents = Agents::find(bench)?;
    let mix: Vec<&str> = MIX.into_iter().filter(|v| bench.versions.contains(v)).collect();
    if mix.is_empty() {
        bail!("always_on runs busy processes of {MIX:?}: --versions names none of them");
    }
    let _tracefs = Tracefs::mount()?;
    let receiver = Receiver::start(&bench.root, &bench.out)?;
    let started = Instant::now();
    let mut rows = Vec::new();
    for processes in WORKLOADS {
        let mut targets = Vec::new();
        for i in 0..processes {
            let version = mix[i % mix.len()];
            targets.push((bench.spawn_ready(version, BUSY_SCRIPT, &[])?, version));
        }
        for hz in RATES {
            let mut row = json!({ "processes": processes, "versions": if processes > 0 { mix.clone() } else { Vec::new() }, "hz": hz });
            let mut runs = [Vec::new(), Vec::new()];
            for _ in 0..bench.rounds {
                for (agent, runs) in AGENTS.into_iter().zip(&mut runs) {
                    // A profiler that fails to start or stop is a row of the table, not the end of the run.
                    let run = measure(bench, &agents, agent, hz, &receiver, &targets).unwrap_or_else(|err| {
                        eprintln!("  {}: {err:#}", agent.key());
                        json!({ "problem": format!("{err:#}").lines().next().unwrap_or_default() })
                    });
                    eprintln!("  {processes} busy processes, {hz} Hz, {}: {run}", agent.key());
                    runs.push(run);
                }
            }
            for (agent, runs) in AGENTS.into_iter().zip(runs) {
                row[agent.key()] = median_run(runs);
            }
            rows.push(row);
        }
    }
    let version = Command::new(&agents.pyebpf).arg("--version").output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default();
    Ok(json!({
        "pyebpf_binary": "dist/pyebpf (static, musl)", "pyebpf_version": version,
        // Paths from the repository's root, as the README shows them.
        "commands": {
            "pyebpf": agents.command_line(Agent::Pyebpf, "HZ", "127.0.0.1:PORT").replace(&format!("{}/", bench.root.display()), ""),
            "otel": agents.command_line(Agent::Otel, "HZ", "127.0.0.1:PORT").replace(&format!("{}/", bench.root.display()), ""),
        },
        "warmup_s": WARMUP_S, "measure_s": MEASURE_S, "rounds": bench.rounds, "section_seconds": started.elapsed().as_secs_f64().round(),
        "rows": rows,
    }))
}

/// One profiler on the workload `targets` (with their versions) at `hz`: its steady CPU, peak
/// RSS, and what reached the collector.
fn measure(bench: &Bench, agents: &Agents, agent: Agent, hz: u32, receiver: &Receiver, targets: &[(Target, &str)]) -> Result<Value> {
    if !receiver.settle(Duration::from_secs(RECEIVER_SETTLE_S)) {
        eprintln!("  the collector and the sink were still busy after {RECEIVER_SETTLE_S} s: the window may include their work");
    }
    let mark = receiver.mark();
    let since_ns = u64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos())?;
    let endpoint = format!("127.0.0.1:{}", receiver.grpc_port);
    let hz = hz.to_string();
    let (program, args) = agents.command(agent, &hz, &endpoint);
    let mut running = Running::start(&program, &args, &bench.out.join(format!("always_on-{}.log", agent.key())))?;
    let launched = Instant::now();
    running.wait_for_line(agent.started_line(), START_LIMIT)?;
    let pid = running.pid();
    let startup_s = launched.elapsed().as_secs_f64();
    let startup_cpu_ms = threads_cpu_ns(pid).context("read its CPU time at start")? as f64 / 1e6;
    std::thread::sleep(Duration::from_secs(WARMUP_S));
    let (share, receiver_share) = window_shares(agent, &running, receiver)?;
    let max_rss_mb = vm_hwm_kb(pid).context("read VmHWM")? as f64 / 1024.0;
    let load_1m = std::fs::read_to_string("/proc/loadavg").ok().and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok());
    running.stop()?;
    let pids: Vec<u32> = targets.iter().map(|(target, _)| target.pid()).collect();
    let delivered = receiver.delivered_since(mark, since_ns, &pids)?;
    let readable = targets.iter().filter(|(_, version)| agent == Agent::Pyebpf || *version != OTEL_UNREAD).count();
    let problem = check(agent, &delivered, readable, &running, receiver);
    Ok(json!({
        "problem": problem,
        "share_of_one_core": share, "max_rss_mb": max_rss_mb, "load_1m": load_1m, "receiver_share_of_one_core": receiver_share,
        "startup_s": startup_s, "startup_cpu_ms": startup_cpu_ms,
        "command": agents.command_line(agent, &hz, &endpoint),
        "delivered": delivered.to_json(), "readable_processes": readable,
    }))
}

/// One profiler's rounds of a cell as one: the round whose share is the median (of two, the lower,
/// with the share their mean), with every round's share in `round_shares` and the highest peak
/// RSS of any. A round that failed has no share; a problem of any round is kept.
fn median_run(runs: Vec<Value>) -> Value {
    let share = |run: &Value| run["share_of_one_core"].as_f64();
    let mut measured: Vec<&Value> = runs.iter().filter(|run| share(run).is_some()).collect();
    let problem = runs.iter().find_map(|run| run["problem"].as_str().map(str::to_string));
    if measured.is_empty() {
        return runs.into_iter().next().unwrap_or_else(|| json!({ "problem": "not measured" }));
    }
    measured.sort_by(|a, b| share(a).unwrap_or(0.0).total_cmp(&share(b).unwrap_or(0.0)));
    let n = measured.len();
    let lower = measured[(n - 1) / 2];
    let median = (share(lower).unwrap_or(0.0) + share(measured[n / 2]).unwrap_or(0.0)) / 2.0;
    let mut run = lower.clone();
    run["share_of_one_core"] = json!(median);
    run["round_shares"] = json!(runs.iter().map(share).collect::<Vec<_>>());
    run["max_rss_mb"] = json!(measured.iter().filter_map(|run| run["max_rss_mb"].as_f64()).fold(0.0, f64::max));
    run["problem"] = json!(problem);
    run
}

/// The CPU the running profiler and the receiver ran over the measured window, each as a share of
/// one core.
fn window_shares(agent: Agent, running: &Running, receiver: &Receiver) -> Result<(f64, f64)> {
    let pid = running.pid();
    let before = threads_cpu_ns(pid).with_context(|| format!("{} exited during its warm-up: {}", agent.key(), running.log_tail()))?;
    let receiver_before = receiver.cpu_ns();
    let window = Instant::now();
    std::thread::sleep(Duration::from_secs(MEASURE_S));
    let after = threads_cpu_ns(pid).with_context(|| format!("{} exited during the measurement: {}", agent.key(), running.log_tail()))?;
    let window_ns = window.elapsed().as_nanos() as f64;
    Ok((after.saturating_sub(before) as f64 / window_ns, receiver.cpu_ns().saturating_sub(receiver_before) as f64 / window_ns))
}

/// What is wrong with what a run delivered, if anything: no profiles, refused requests, or no
/// Python frames where the profiler reads the busy processes. The run's figures are kept and the
/// problem shown beside them (a profiler starved by the host's load can lag behind), with the
/// logs on stderr; a process missed out of many is shown as a count.
fn check(agent: Agent, delivered: &receiver::Delivered, readable: usize, running: &Running, receiver: &Receiver) -> Option<String> {
    let problem = if delivered.requests == 0 {
        "no profiles reached the collector".to_string()
    } else if delivered.refused > 0 {
        format!("the collector or sink refused {} of {} requests", delivered.refused, delivered.requests)
    } else if readable > 0 && delivered.python_pids.is_empty() {
        format!("no Python frames from any of the {readable} busy processes it reads")
    } else {
        if delivered.python_pids.len() < readable {
            eprintln!("  {}: Python frames from {} of {readable} busy processes", agent.key(), delivered.python_pids.len());
        }
        return None;
    };
    eprintln!(
        "  {}: {problem}
{}
collector: {}",
        agent.key(),
        running.log_tail(),
        receiver.collector_log()
    );
    Some(problem)
}

/// A profiler writing its output to a log file; killed if dropped before [`Running::stop`].
struct Running {
    child: Child,
    log: PathBuf,
}

impl Running {
    fn start(program: &Path, args: &[String], log: &Path) -> Result<Running> {
        let file = File::create(log)?;
        let child = Command::new(program)
            .args(args)
            // pyebpf logs when it starts sampling (only its own info lines: aya's are many).
            .env("RUST_LOG", "pyebpf=info")
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("start {}", program.display()))?;
        Ok(Running { child, log: log.to_path_buf() })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    fn wait_for_line(&mut self, needle: &str, limit: Duration) -> Result<()> {
        let found = wait_for(
            || {
                if std::fs::read_to_string(&self.log).is_ok_and(|log| log.contains(needle)) {
                    return Some(true);
                }
                self.child.try_wait().ok().flatten().map(|_| false)
            },
            limit,
        );
        match found {
            Some(true) => Ok(()),
            Some(false) => bail!("{} exited before logging {needle:?}:\n{}", self.log.display(), self.log_tail()),
            None => bail!("no {needle:?} in {} after {} s:\n{}", self.log.display(), limit.as_secs(), self.log_tail()),
        }
    }

    /// SIGINT, as both take to stop (pyebpf sends its last period then); waits for the exit.
    fn stop(&mut self) -> Result<()> {
        // SAFETY: kill takes a pid and a signal; the child is ours and not reaped yet.
        unsafe { libc::kill(self.pid() as libc::pid_t, libc::SIGINT) };
        match wait_for(|| self.child.try_wait().ok().flatten(), Duration::from_secs(180)) {
            Some(status) if status.success() => Ok(()),
            Some(status) => bail!("{} after SIGINT:\n{}", status, self.log_tail()),
            None => bail!("still running 180 s after SIGINT:\n{}", self.log_tail()),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Peak resident set of `pid`, in kB.
fn vm_hwm_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|line| line.strip_prefix("VmHWM:"))?.split_whitespace().next()?.parse().ok()
}

/// tracefs at /sys/kernel/tracing, which the OpenTelemetry profiler attaches through: mounted if it
/// was not, and then unmounted when dropped.
struct Tracefs {
    mounted_here: bool,
}

impl Tracefs {
    fn mount() -> Result<Tracefs> {
        let mounts = std::fs::read_to_string("/proc/self/mounts")?;
        if mounts.lines().any(|line| line.split_whitespace().nth(1) == Some(TRACEFS)) {
            return Ok(Tracefs { mounted_here: false });
        }
        crate::run(Command::new("mount").args(["-t", "tracefs", "tracefs", TRACEFS])).context("mount tracefs for the OpenTelemetry profiler")?;
        Ok(Tracefs { mounted_here: true })
    }
}

impl Drop for Tracefs {
    fn drop(&mut self) {
        if self.mounted_here {
            let _ = Command::new("umount").arg(TRACEFS).status();
        }
    }
}

/// The interpreters the busy processes ran, as the run recorded them.
fn busy_versions(section: &Value) -> String {
    let rows = section["rows"].as_array().into_iter().flatten();
    let versions = rows.filter_map(|row| row["versions"].as_array()).find(|versions| !versions.is_empty());
    versions.into_iter().flatten().filter_map(Value::as_str).collect::<Vec<_>>().join(", ")
}

/// The section's table and how it was measured, for RESULTS.md and the README.
pub fn table(results: &Value) -> String {
    let section = &results["always_on"];
    if section.is_null() {
        return "(not measured in this run)\n".to_string();
    }
    let mut md = format!(
        "Always on: each profiler alone, host-wide, on the same workload, {warmup} s after it starts sampling (after it logs so: the OpenTelemetry profiler `{ATTACHED}`, \
         pyebpf `{SAMPLING} HZ Hz` with `RUST_LOG=pyebpf=info`), for {measure} s: \
         the CPU all its threads ran (per-thread `schedstat`) as a share of one core, and its peak RSS (`VmHWM`). Its start-up is apart: the seconds from its launch to that line \
         and the CPU its threads ran by then (on a loaded host a start-up takes longer than its CPU, since the busy processes share the CPUs with it). Both send OTLP profiles over gRPC to an OpenTelemetry Collector, \
         whose sink decodes each request; \"Python frames from\" counts the busy processes with samples carrying Python frames. \
         pyebpf is `{build}`; {export}, \
         while the OpenTelemetry profiler reports every 5 s (its default). The busy processes are `tests/scripts/{BUSY_SCRIPT}` (a loop four frames deep) on {versions} in turn; \
         the OpenTelemetry profiler does not read CPython 3.15, so its 3.15 processes have native frames only. \"Idle\" runs nothing of the bench's: the host's 1-minute load average shows what else ran. \
         {rounds}Each run starts once the collector and the sink are quiet (done with the last run's export); \"receiver\" is the CPU they ran during the window, which the profiler samples too.\n\n\
         - pyebpf: `{pyebpf}`\n- OpenTelemetry eBPF profiler: `{otel}`\n\n\
         | host workload | rate | pyebpf CPU, % of a core | pyebpf max RSS (MB) | otel CPU, % of a core | otel max RSS (MB) | pyebpf ÷ otel (CPU) | Python frames from: pyebpf / otel | start-up s, CPU ms: pyebpf / otel | load (1 min): pyebpf / otel runs | receiver CPU: pyebpf / otel runs |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
        rounds = match section["rounds"].as_u64() {
            Some(n) if n > 1 => format!(
                "Each cell was measured {n} times, the two profilers in turn; a share is the median of its {n} runs (the range in brackets), the ratio that of the medians, \
                 the RSS the highest, and the other columns are of the median run. "
            ),
            _ => String::new(),
        },
        warmup = section["warmup_s"],
        measure = section["measure_s"],
        export = window_exports(section),
        build = section["pyebpf_binary"].as_str().unwrap_or("?"),
        versions = busy_versions(section),
        pyebpf = section["commands"]["pyebpf"].as_str().unwrap_or("?"),
        otel = section["commands"]["otel"].as_str().unwrap_or("?"),
    );
    for row in section["rows"].as_array().into_iter().flatten() {
        md.push_str(&table_row(row));
    }
    md
}

/// What the window holds of pyebpf's OTLP exports, by its length.
fn window_exports(section: &Value) -> &'static str {
    if section["measure_s"].as_u64().is_some_and(|s| s >= 60) {
        "the window is one of its default 60 s OTLP periods, so it holds one of its exports, as any minute of a service does"
    } else {
        "its default 60 s OTLP period ends after the window (it sends at its stop), so the window holds no export of its (the `export` table has that cost)"
    }
}

/// One row of the always-on table: a workload at a rate, both profilers.
fn table_row(row: &Value) -> String {
    let percent = |v: &Value| v.as_f64().map_or("–".into(), |s| format!("{:.3}%", s * 100.0));
    // With rounds, the median and the range of all rounds.
    let share = |run: &Value| {
        let rounds: Vec<f64> = run["round_shares"].as_array().into_iter().flatten().filter_map(Value::as_f64).collect();
        let (low, high) = rounds.iter().fold((f64::MAX, f64::MIN), |(low, high), &s| (low.min(s), high.max(s)));
        match rounds.len() {
            0 | 1 => percent(&run["share_of_one_core"]),
            _ => format!("{} ({:.3}–{:.3})", percent(&run["share_of_one_core"]), low * 100.0, high * 100.0),
        }
    };
    let mb = |v: &Value| v.as_f64().map_or("–".into(), |m| format!("{m:.0}"));
    let (ours, otel) = (&row["pyebpf"], &row["otel"]);
    let ratio = match (ours["share_of_one_core"].as_f64(), otel["share_of_one_core"].as_f64()) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "–".into(),
    };
    let processes = row["processes"].as_u64().unwrap_or(0);
    let workload = if processes == 0 { "idle".to_string() } else { format!("{processes} busy Python processes") };
    let seen = |run: &Value| {
        if processes == 0 {
            return "–".to_string();
        }
        let unread = processes - run["readable_processes"].as_u64().unwrap_or(0);
        let note = if unread > 0 { format!(" ({unread} on 3.15: not read)") } else { String::new() };
        format!("{}/{processes}{note}", run["delivered"]["python_processes"])
    };
    let seen = |run: &Value| match run["problem"].as_str() {
        Some(problem) => format!("{} ({problem})", seen(run)),
        None => seen(run),
    };
    let load = |run: &Value| run["load_1m"].as_f64().map_or("–".into(), |l| format!("{l:.1}"));
    let startup = |run: &Value| match (run["startup_s"].as_f64(), run["startup_cpu_ms"].as_f64()) {
        (Some(s), Some(ms)) => format!("{s:.1} s, {ms:.0} ms"),
        _ => "–".into(),
    };
    format!(
        "| {workload} | {} Hz | {} | {} | {} | {} | {ratio} | {} / {} | {} / {} | {} / {} | {} / {} |\n",
        row["hz"],
        share(ours),
        mb(&ours["max_rss_mb"]),
        share(otel),
        mb(&otel["max_rss_mb"]),
        seen(ours),
        seen(otel),
        startup(ours),
        startup(otel),
        load(ours),
        load(otel),
        percent(&ours["receiver_share_of_one_core"]),
        percent(&otel["receiver_share_of_one_core"]),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_names_what_the_otel_profiler_cannot_read() {
        let run = |share: f64, seen: u64, readable: u64| json!({ "share_of_one_core": share, "max_rss_mb": 50.4, "readable_processes": readable, "delivered": { "python_processes": seen }, "receiver_share_of_one_core": share / 10.0, "startup_s": 11.04, "startup_cpu_ms": 612.4 });
        let results = json!({ "always_on": {
            "pyebpf_binary": "dist/pyebpf (static, musl)", "warmup_s": 8, "measure_s": 40,
            "commands": { "pyebpf": "dist/pyebpf record -a -F HZ", "otel": "ebpf-profiler -samples-per-second HZ" },
            "rows": [
                { "processes": 0, "versions": [], "hz": 19, "pyebpf": run(0.0004, 0, 0), "otel": run(0.01, 0, 0) },
                { "processes": 20, "versions": MIX, "hz": 99, "pyebpf": run(0.005, 20, 20), "otel": run(0.02, 16, 16) },
            ],
        }});
        let md = table(&results);
        assert!(md.contains("| idle | 19 Hz | 0.040% | 50 | 1.000% | 50 | 0.04 | – / – | 11.0 s, 612 ms / 11.0 s, 612 ms | – / – | 0.004% / 0.100% |"), "{md}");
        assert!(md.contains("| 20 busy Python processes | 99 Hz | 0.500% | 50 | 2.000% | 50 | 0.25 | 20/20 / 16/20 (4 on 3.15: not read) |"), "{md}");
        assert!(md.contains("on 3.11, 3.12, 3.13, 3.14, 3.15 in turn"), "{md}");
        assert!(md.contains("holds no export of its"), "{md}");
        let minute = json!({ "always_on": { "warmup_s": 45, "measure_s": 60, "rows": [] } });
        assert!(table(&minute).contains("45 s after it starts sampling") && table(&minute).contains("holds one of its exports"));
    }

    #[test]
    fn rounds_give_the_median_share_the_highest_rss_and_the_spread() {
        let run = |share: f64, rss: f64, startup: f64| json!({ "share_of_one_core": share, "max_rss_mb": rss, "startup_s": startup, "problem": null });
        let three = median_run(vec![run(0.003, 40.0, 1.0), run(0.001, 45.0, 2.0), run(0.002, 38.0, 3.0)]);
        assert_eq!(three["share_of_one_core"], json!(0.002));
        assert_eq!(three["startup_s"], json!(3.0), "the other figures are the median run's");
        assert_eq!(three["max_rss_mb"], json!(45.0));
        assert_eq!(three["round_shares"], json!([0.003, 0.001, 0.002]));
        let two = median_run(vec![run(0.004, 40.0, 1.0), run(0.002, 41.0, 2.0)]);
        assert!((two["share_of_one_core"].as_f64().unwrap() - 0.003).abs() < 1e-12, "{two}");
        assert_eq!(two["startup_s"], json!(2.0));
        let failed = median_run(vec![json!({ "problem": "no profiles reached the collector" }), run(0.002, 41.0, 2.0)]);
        assert_eq!(failed["share_of_one_core"], json!(0.002));
        assert_eq!(failed["problem"], json!("no profiles reached the collector"));
        assert_eq!(failed["round_shares"], json!([null, 0.002]));

        let results = json!({ "always_on": {
            "pyebpf_binary": "dist/pyebpf (static, musl)", "warmup_s": 6, "measure_s": 40, "rounds": 3,
            "commands": { "pyebpf": "dist/pyebpf record -a -F HZ", "otel": "ebpf-profiler -samples-per-second HZ" },
            "rows": [{ "processes": 0, "versions": [], "hz": 99, "pyebpf": three, "otel": median_run(vec![run(0.01, 50.0, 2.0), run(0.03, 60.0, 2.0), run(0.02, 55.0, 2.0)]) }],
        }});
        let md = table(&results);
        assert!(md.contains("| idle | 99 Hz | 0.200% (0.100–0.300) | 45 | 2.000% (1.000–3.000) | 60 | 0.10 |"), "{md}");
        assert!(md.contains("measured 3 times"), "{md}");
    }
}
