//! `cargo xtask bench`: what profiling costs, side by side with py-spy and CPython's own sampler
//! (Tachyon, `python3.15 -m profiling.sampling`) in one run. These machines are noisy, so every
//! comparison is made within the run. Writes `bench/RESULTS.md`, `bench/results.json` and the
//! README's performance tables.
//!
//! - Profiler CPU per sample: each profiler attaches to a spinning process for a short and a long
//!   run; the difference of their CPU times over the difference of their sample counts is the steady
//!   state, and what remains of the short run is start-up.
//! - Slowdown: a fixed workload timing its own work, alone and under each profiler.
//! - Reads: pyebpf's remote reads and bytes per Python sample, with and without the 3.15 marker.
//! - Fidelity: a known 60/30/10 split and two alternating call paths.
//! - Scale: 1, 10 and 50 Python processes under `record -a`.
//! - Export: what `record --otlp` costs per period, 20 busy processes at 99 Hz.
//! - Always on: `record -a --otlp` beside the OpenTelemetry eBPF profiler, idle and with 20 and 50
//!   busy processes, at 19, 49 and 99 Hz: steady CPU and peak RSS.

mod always_on;
mod export;
mod fidelity;
mod measure;
mod report;
mod waits;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::run;
use measure::{collapsed_samples, median, run_measured, stat_line, Measured};

const VERSIONS: [&str; 6] = ["3.11", "3.12", "3.13", "3.13t", "3.14", "3.15"];
/// The free-threaded 3.13 (`python3.13t`), which `cargo xtask setup` builds.
const FREE_THREADED: &str = "3.13t";
/// The mix of `record -a`'s processes in the scale runs: the default builds.
const SCALE_VERSIONS: [&str; 5] = ["3.11", "3.12", "3.13", "3.14", "3.15"];
/// 3.11 and 3.12 have no Debian sid build: pyenv's (on every machine) stand in.
const PYENV_RELEASES: [&str; 2] = ["3.11.7", "3.12.1"];
const DEPTHS: [u32; 2] = [5, 100];
const FREQUENCIES: [u32; 2] = [99, 999];
/// Attach runs last ATTACH_S seconds (whole seconds: py-spy takes only those); their steady state is
/// the CPU they use in the window between WINDOW_FROM and WINDOW_TO after they start.
const ATTACH_S: u32 = 6;
const WINDOW_FROM: Duration = Duration::from_millis(1500);
const WINDOW_TO: Duration = Duration::from_millis(5000);
const SLOWDOWN_ROUNDS: usize = 3;
const SLOWDOWN_ITERATIONS: &str = "30000000";
const PY_SPY_VERSION: &str = "0.4.3";
/// The interpreter the static binary (`dist/pyebpf`, musl) is also measured on in the CPU per
/// sample runs: what it changes (the C library's allocator and `memcpy`) does not depend on the
/// version.
const STATIC_VERSION: &str = "3.15";
/// Its name in the figures.
const STATIC_PYEBPF: &str = "pyebpf (musl)";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Profiler {
    Pyebpf,
    PySpy,
    Tachyon,
}

impl Profiler {
    fn name(self) -> &'static str {
        match self {
            Profiler::Pyebpf => "pyebpf",
            Profiler::PySpy => "py-spy",
            Profiler::Tachyon => "Tachyon",
        }
    }

    /// Tachyon is new in 3.15 and attaches only to its own version; py-spy 0.4 reads no
    /// free-threaded build.
    fn supports(self, version: &str) -> bool {
        match self {
            Profiler::Pyebpf => true,
            Profiler::PySpy => version != FREE_THREADED,
            Profiler::Tachyon => version == "3.15",
        }
    }
}

const PROFILERS: [Profiler; 3] = [Profiler::Pyebpf, Profiler::PySpy, Profiler::Tachyon];

#[derive(Clone)]
struct Bench {
    root: PathBuf,
    /// The release build (glibc).
    pyebpf: PathBuf,
    /// The binary that ships (`dist/pyebpf`: static, musl).
    shipped: PathBuf,
    py_spy: PathBuf,
    pythons: PathBuf,
    free_threaded: PathBuf,
    out: PathBuf,
    /// The interpreters measured in this run: all of `VERSIONS`, or those `--versions` names.
    versions: Vec<&'static str>,
    /// Times each always-on cell is measured (`--rounds`).
    rounds: usize,
}

/// The parts of a bench run, by the name `--only` takes and the key of their figures.
pub const SECTIONS: [&str; 9] = ["cpu_per_sample", "profile", "kernel_and_reads", "slowdown", "fidelity", "scale", "export", "waits", "always_on"];

/// What to measure: every section and version, or (`--only`, `--versions`) some of them, whose
/// figures replace theirs in the last run's.
pub struct Selection {
    pub sections: Option<Vec<String>>,
    pub versions: Option<Vec<String>>,
    /// Times each always-on cell is measured.
    pub rounds: usize,
}

/// The pyebpf binaries measured.
pub struct Binaries {
    /// The release build (glibc), which most sections run.
    pub release: PathBuf,
    /// `dist/pyebpf` (static, musl): the always-on section and the CPU per sample on one version.
    pub shipped: PathBuf,
}

pub fn bench(root: &Path, binaries: Binaries, pythons: &Path, free_threaded: &Path, selection: &Selection) -> Result<()> {
    let versions = match &selection.versions {
        Some(names) => names
            .iter()
            .map(|name| VERSIONS.into_iter().find(|v| v == name).with_context(|| format!("no interpreter {name} in {VERSIONS:?}")))
            .collect::<Result<_>>()?,
        None => VERSIONS.to_vec(),
    };
    let bench = Bench {
        root: root.to_path_buf(),
        pyebpf: binaries.release,
        shipped: binaries.shipped,
        py_spy: ensure_py_spy(root)?,
        pythons: pythons.to_path_buf(),
        free_threaded: free_threaded.to_path_buf(),
        out: root.join("target/bench"),
        versions,
        rounds: selection.rounds.max(1),
    };
    std::fs::create_dir_all(&bench.out)?;
    crate::toolchain::ensure_apt_packages(&[("perf", "linux-perf")])?;
    bench.check_competitors()?;
    let started = Instant::now();
    let partial = selection.sections.is_some() || selection.versions.is_some();
    let mut results =
        if partial { serde_json::from_str(&std::fs::read_to_string(root.join("bench/results.json")).context("read bench/results.json")?)? } else { json!({}) };
    for section in SECTIONS.into_iter().filter(|s| selection.sections.as_ref().is_none_or(|only| only.iter().any(|o| o == s))) {
        eprintln!("bench: {section}");
        let figures = bench.section(section)?;
        merge(&mut results[section], figures, &bench.versions);
    }
    let machine = report::machine(&bench)?;
    if partial {
        // The interpreters' list is the current one; the rest describes the last full run.
        results["machine"]["pythons"] = machine["pythons"].clone();
        let note = json!({ "commit": machine["pyebpf_commit"], "sections": selection.sections, "versions": selection.versions });
        match results["machine"]["partial_runs"].as_array_mut() {
            Some(runs) => runs.push(note),
            None => results["machine"]["partial_runs"] = json!([note]),
        }
    } else {
        results["machine"] = machine;
        results["machine"]["bench_seconds"] = json!(started.elapsed().as_secs_f64().round());
    }
    report::write(&bench, &results)
}

/// Puts a section's new figures into the last run's: rows of the versions measured replace
/// theirs, the other versions' rows stay; a section without versions is replaced whole.
fn merge(old: &mut Value, new: Value, versions: &[&str]) {
    match (old.as_array_mut(), new) {
        (Some(rows), Value::Array(fresh)) if fresh.iter().all(|row| row["version"].is_string()) => {
            rows.retain(|row| !row["version"].as_str().is_some_and(|v| versions.contains(&v)));
            rows.extend(fresh);
        }
        (_, new) => *old = new,
    }
}

/// Rewrites the reports from the last run's raw figures (after a change to how they are shown).
pub fn report_only(root: &Path) -> Result<()> {
    let results: Value = serde_json::from_str(&std::fs::read_to_string(root.join("bench/results.json")).context("read bench/results.json")?)?;
    report::rewrite(root, &results)
}

impl Bench {
    fn section(&self, name: &str) -> Result<Value> {
        match name {
            "cpu_per_sample" => self.cpu_per_sample(),
            "profile" => self.profile_pyebpf(),
            "kernel_and_reads" => self.kernel_and_reads(),
            "slowdown" => self.slowdown(),
            "fidelity" => fidelity::fidelity(self),
            "scale" => self.scale(),
            "export" => export::export(self),
            "waits" => waits::waits(self),
            "always_on" => always_on::always_on(self),
            other => bail!("no bench section {other}"),
        }
    }

    fn python(&self, version: &str) -> PathBuf {
        if version == FREE_THREADED {
            return self.free_threaded.clone();
        }
        if let Some(release) = PYENV_RELEASES.iter().find(|release| release.starts_with(&format!("{version}."))) {
            let pyenv =
                std::env::var_os("PYENV_ROOT").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".pyenv"));
            return pyenv.join(format!("versions/{release}/bin/python{version}"));
        }
        self.pythons.join(format!("usr/bin/python{version}"))
    }

    fn script(&self, name: &str) -> PathBuf {
        self.root.join("tests/scripts").join(name)
    }

    /// Fails loudly, before any figure is taken, if a competitor cannot run.
    fn check_competitors(&self) -> Result<()> {
        let py_spy = Command::new(&self.py_spy).arg("--version").output().context("run py-spy")?;
        if !py_spy.status.success() {
            bail!("py-spy does not run: {}", String::from_utf8_lossy(&py_spy.stderr));
        }
        let tachyon = Command::new(self.python("3.15")).args(["-m", "profiling.sampling", "--help"]).output()?;
        if !tachyon.status.success() {
            bail!("python3.15 -m profiling.sampling does not run: {}", String::from_utf8_lossy(&tachyon.stderr));
        }
        Ok(())
    }

    /// Starts `script` under `version` with a ready file as its first argument; waits until ready.
    fn spawn_ready(&self, version: &str, script: &str, args: &[&str]) -> Result<Target> {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ready = self.out.join(format!("ready-{n}"));
        let _ = std::fs::remove_file(&ready);
        let child = Command::new(self.python(version)).arg(self.script(script)).arg(&ready).args(args).spawn()?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ready.exists() {
            if Instant::now() > deadline {
                bail!("{script} under python{version} never became ready");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Target { child })
    }

    /// One profiler attached to `pid` for `seconds`, writing collapsed stacks.
    fn attach(&self, profiler: Profiler, pid: u32, hz: u32, seconds: u32, extra: &[&str]) -> Result<Measured> {
        self.attach_measured(profiler, pid, hz, seconds, extra, None)
    }

    fn attach_measured(&self, profiler: Profiler, pid: u32, hz: u32, seconds: u32, extra: &[&str], window: Option<(Duration, Duration)>) -> Result<Measured> {
        let out = self.out.join(format!("{}.txt", profiler.name()));
        let _ = std::fs::remove_file(&out);
        let (pid, hz, seconds) = (pid.to_string(), hz.to_string(), seconds.to_string());
        let mut command = match profiler {
            Profiler::Pyebpf => {
                let mut c = Command::new(&self.pyebpf);
                c.args(["record", "--stats", "-p", &pid, "-F", &hz, "-d", &seconds, "-o"]).arg(&out).args(extra);
                c
            }
            Profiler::PySpy => {
                let mut c = Command::new(&self.py_spy);
                c.args(["record", "--format", "raw", "--pid", &pid, "--rate", &hz, "--duration", &seconds, "-o"]).arg(&out);
                c
            }
            Profiler::Tachyon => {
                let mut c = Command::new(self.python("3.15"));
                c.args(["-m", "profiling.sampling", "attach", "--collapsed", "-r", &hz, "-d", &seconds, "-o"]).arg(&out).arg(&pid);
                c
            }
        };
        let mut measured = run_measured(&mut command, window)?;
        measured.samples = collapsed_samples(&out)?;
        measured.collapsed = std::fs::read_to_string(&out)?;
        if measured.samples == 0 {
            bail!("{} recorded no samples of {pid}: {}", profiler.name(), measured.stderr);
        }
        Ok(measured)
    }

    /// Steady-state CPU per sample and start-up CPU of each profiler, for every version, depth and
    /// frequency.
    fn cpu_per_sample(&self) -> Result<Value> {
        let musl = Bench { pyebpf: self.shipped.clone(), ..self.clone() };
        let mut rows = Vec::new();
        for &version in &self.versions {
            for depth in DEPTHS {
                let target = self.spawn_ready(version, "sampling_deep.py", &[&depth.to_string()])?;
                for hz in FREQUENCIES {
                    let profilers = PROFILERS.into_iter().filter(|p| p.supports(version)).map(|p| (p.name(), self, p));
                    let statically = (version == STATIC_VERSION).then_some((STATIC_PYEBPF, &musl, Profiler::Pyebpf));
                    for (name, bench, profiler) in profilers.chain(statically) {
                        let long = bench.attach_measured(profiler, target.pid(), hz, ATTACH_S, &[], Some((WINDOW_FROM, WINDOW_TO)))?;
                        // Samples come at a steady rate over the run, so the window holds its share.
                        let rate = long.samples as f64 / f64::from(ATTACH_S);
                        let window_s = (WINDOW_TO - WINDOW_FROM).as_secs_f64();
                        let window_cpu = long.window_cpu_s.context("the profiler exited before the steady window ended")?;
                        let steady_us = window_cpu * 1e6 / (rate * window_s);
                        let startup_ms = (long.cpu_s - window_cpu / window_s * long.wall_s).max(0.0) * 1e3;
                        let mut row = json!({
                            "version": version, "depth": depth, "hz": hz, "profiler": name,
                            "steady_us_per_sample": steady_us, "startup_cpu_ms": startup_ms,
                            "samples": long.samples, "cpu_s": long.cpu_s, "max_rss_mb": long.max_rss_mb,
                        });
                        if profiler == Profiler::Pyebpf {
                            row["ebpf_us_per_sample"] =
                                json!(stat_line(&long.stderr, "eBPF program time:").and_then(|l| measure::figure_before(&l, "us per recorded sample")));
                        }
                        eprintln!("  {version} depth {depth} {hz} Hz {name}: {steady_us:.1} us/sample, start-up {startup_ms:.0} ms");
                        rows.push(row);
                    }
                }
            }
        }
        Ok(Value::Array(rows))
    }

    /// A `perf` profile of pyebpf attached to the 100-deep 3.15 workload at 999 Hz: the symbols
    /// taking most of its own time (children not counted), as `perf report` prints them.
    fn profile_pyebpf(&self) -> Result<Value> {
        let target = self.spawn_ready("3.15", "sampling_deep.py", &["100"])?;
        let data = self.out.join("perf.data");
        let out = self.out.join("profiled.txt");
        run_measured(
            Command::new("perf")
                .args(["record", "-q", "-F", "4999", "-g", "-o"])
                .arg(&data)
                .arg("--")
                .arg(&self.pyebpf)
                .args(["record", "-p", &target.pid().to_string(), "-F", "999", "-d", &ATTACH_S.to_string(), "-o"])
                .arg(&out),
            None,
        )?;
        let report = run_measured(
            Command::new("perf")
                .args(["report", "--no-children", "--sort", "comm,dso,sym", "--stdio", "-g", "none", "--percent-limit", "1.5", "-i"])
                .arg(&data),
            None,
        )?;
        let lines: Vec<&str> = report.stdout.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).take(25).collect();
        Ok(json!(lines))
    }

    /// In-kernel time per sample (default, `--no-cache`, `--kernel`) and remote reads per Python
    /// sample (default and `--no-cache`), 999 Hz.
    fn kernel_and_reads(&self) -> Result<Value> {
        let mut rows = Vec::new();
        for &version in &self.versions {
            for depth in DEPTHS {
                let target = self.spawn_ready(version, "sampling_deep.py", &[&depth.to_string()])?;
                let mut row = json!({ "version": version, "depth": depth });
                for (label, extra) in [("default", &[][..]), ("no_cache", &["--no-cache"][..]), ("kernel", &["--kernel"][..])] {
                    let run = self.attach(Profiler::Pyebpf, target.pid(), 999, 3, extra)?;
                    let per = |label: &str, unit: &str| stat_line(&run.stderr, label).and_then(|l| measure::figure_before(&l, unit));
                    row[label] = json!({
                        "ebpf_us_per_sample": per("eBPF program time:", "us per recorded sample"),
                        "remote_reads_per_python_sample": per("remote reads:", "per python sample"),
                        "remote_bytes_per_python_sample": per("remote bytes:", "per python sample"),
                    });
                }
                rows.push(row);
            }
        }
        Ok(Value::Array(rows))
    }

    /// The fixed workload's own time alone and under each profiler, in interleaved rounds.
    fn slowdown(&self) -> Result<Value> {
        let mut rows = Vec::new();
        let script = self.script("bench_work.py");
        for &version in &self.versions {
            let python = self.python(version);
            let workload = |profiler: Profiler, hz: u32| -> Result<f64> {
                let mut command = self.launch(profiler, hz);
                // Tachyon runs the script in an interpreter of its own version.
                if profiler != Profiler::Tachyon {
                    command.arg(&python);
                }
                run_measured(command.arg(&script).arg(SLOWDOWN_ITERATIONS), None)?.workload_seconds()
            };
            let mut alone = Vec::new();
            let mut under: Vec<(Profiler, u32, Vec<f64>)> = Vec::new();
            for _ in 0..SLOWDOWN_ROUNDS {
                alone.push(run_measured(Command::new(&python).arg(&script).arg(SLOWDOWN_ITERATIONS), None)?.workload_seconds()?);
                for hz in FREQUENCIES {
                    for profiler in PROFILERS.into_iter().filter(|p| p.supports(version)) {
                        let seconds = workload(profiler, hz)?;
                        match under.iter_mut().find(|(p, h, _)| *p == profiler && *h == hz) {
                            Some((_, _, times)) => times.push(seconds),
                            None => under.push((profiler, hz, vec![seconds])),
                        }
                    }
                }
            }
            let base = median(&mut alone);
            let mut row = json!({ "version": version, "alone_s": base, "under": [] });
            for (profiler, hz, mut times) in under {
                let seconds = median(&mut times);
                row["under"].as_array_mut().expect("array").push(json!({
                    "profiler": profiler.name(), "hz": hz, "seconds": seconds, "ratio": seconds / base,
                }));
            }
            eprintln!("  {version}: {row}");
            rows.push(row);
        }
        Ok(Value::Array(rows))
    }

    /// A profiler command that launches the program given after it.
    fn launch(&self, profiler: Profiler, hz: u32) -> Command {
        let out = self.out.join(format!("launch-{}.txt", profiler.name()));
        let hz = hz.to_string();
        match profiler {
            Profiler::Pyebpf => {
                let mut c = Command::new(&self.pyebpf);
                c.args(["record", "-F", &hz, "-o"]).arg(out).arg("--");
                c
            }
            Profiler::PySpy => {
                let mut c = Command::new(&self.py_spy);
                c.args(["record", "--format", "raw", "--rate", &hz, "-o"]).arg(out).arg("--");
                c
            }
            Profiler::Tachyon => {
                // `run` starts the script in a child interpreter and samples it, as `attach` does.
                let mut c = Command::new(self.python("3.15"));
                c.args(["-m", "profiling.sampling", "run", "--collapsed", "-r", &hz, "-o"]).arg(out);
                c
            }
        }
    }

    /// `record -a` with 1, 10 and 50 spinning Python processes: steady CPU, start-up CPU, max RSS,
    /// lost samples.
    fn scale(&self) -> Result<Value> {
        let mut rows = Vec::new();
        for count in [1usize, 10, 50] {
            let mut targets = Vec::new();
            for i in 0..count {
                targets.push(self.spawn_ready(SCALE_VERSIONS[i % SCALE_VERSIONS.len()], "sampling_deep.py", &["20"])?);
            }
            for hz in FREQUENCIES {
                let out = self.out.join("scale.txt");
                let measured = run_measured(
                    Command::new(&self.pyebpf).args(["record", "-a", "--stats", "-F", &hz.to_string(), "-d", &ATTACH_S.to_string(), "-o"]).arg(&out),
                    Some((WINDOW_FROM, WINDOW_TO)),
                )?;
                let value = |label: &str| stat_line(&measured.stderr, label).and_then(|l| measure::first_number(&l));
                let samples = value("samples:").unwrap_or(f64::NAN);
                let window_s = (WINDOW_TO - WINDOW_FROM).as_secs_f64();
                let steady_share = measured.window_cpu_s.context("pyebpf exited before the steady window ended")? / window_s;
                let row = json!({
                    "processes": count, "hz": hz, "cpu_s": measured.cpu_s, "wall_s": measured.wall_s,
                    "share_of_one_core": steady_share,
                    "us_per_sample": steady_share * 1e6 / (samples / f64::from(ATTACH_S)),
                    "startup_cpu_ms": (measured.cpu_s - steady_share * measured.wall_s).max(0.0) * 1e3,
                    "max_rss_mb": measured.max_rss_mb, "samples": samples,
                    "lost": value("lost samples:"), "python_processes": value("python processes:"),
                });
                eprintln!("  {count} processes, {hz} Hz: {row}");
                rows.push(row);
            }
        }
        Ok(Value::Array(rows))
    }
}

/// A spawned workload, killed when dropped.
struct Target {
    child: Child,
}

impl Target {
    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// py-spy from PyPI in a venv under target/, for the comparison.
fn ensure_py_spy(root: &Path) -> Result<PathBuf> {
    let venv = root.join("target/bench-venv");
    let py_spy = venv.join("bin/py-spy");
    if !py_spy.exists() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
        run(Command::new(venv.join("bin/pip")).args(["install", "-q", &format!("py-spy=={PY_SPY_VERSION}")]))?;
    }
    Ok(py_spy)
}
