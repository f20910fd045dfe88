//! `cargo xtask bench`: what profiling costs the profiled program and the host, side by side in
//! one run (these machines are noisy, so only ratios within a run are reported).
//!
//! For each test interpreter, a fixed CPU workload 100 frames deep runs alone, under
//! `pyebpf record` and under py-spy, in interleaved rounds; the workload times its own work, so
//! start-up is not counted. pyebpf's `--stats` gives its own CPU time and the eBPF sampler's time
//! per sample, with and without the 3.15 marker. A second table gives the sampler's in-kernel time
//! per sample for stacks 5 and 100 frames deep.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::run;

const ROUNDS: usize = 3;
const ITERATIONS: &str = "40000000";
const FREQUENCY: &str = "99";

struct Setup {
    pyebpf: PathBuf,
    py_spy: PathBuf,
    script: PathBuf,
    out: PathBuf,
}

pub fn bench(root: &Path, pyebpf: PathBuf, pythons: &Path) -> Result<()> {
    let setup = Setup {
        pyebpf,
        py_spy: ensure_py_spy(root)?,
        script: root.join("tests/scripts/bench_work.py"),
        out: root.join("target/bench"),
    };
    std::fs::create_dir_all(&setup.out)?;
    println!("| interpreter | alone (s) | pyebpf (s, ratio) | py-spy (s, ratio) | pyebpf CPU per sample | eBPF time per sample: default / --no-cache |");
    println!("|---|---|---|---|---|---|");
    for version in ["3.13", "3.14", "3.15"] {
        let python = pythons.join(format!("usr/bin/python{version}"));
        let mut alone = Vec::new();
        let mut with_pyebpf = Vec::new();
        let mut with_py_spy = Vec::new();
        let mut stats = String::new();
        for _ in 0..ROUNDS {
            alone.push(workload_seconds(Command::new(&python).arg(&setup.script).arg(ITERATIONS))?);
            let (seconds, stderr) = under_pyebpf(&setup, &python, &[])?;
            with_pyebpf.push(seconds);
            stats = stderr;
            with_py_spy.push(workload_seconds(
                Command::new(&setup.py_spy)
                    .args(["record", "--rate", FREQUENCY, "--format", "raw", "-o"])
                    .arg(setup.out.join("py-spy.txt"))
                    .arg("--")
                    .arg(&python)
                    .arg(&setup.script)
                    .arg(ITERATIONS),
            )?);
        }
        let (_, uncached) = under_pyebpf(&setup, &python, &["--no-cache"])?;
        let base = median(&mut alone);
        let (pyebpf, py_spy) = (median(&mut with_pyebpf), median(&mut with_py_spy));
        println!(
            "| {version} | {base:.3} | {pyebpf:.3} ({:.3}) | {py_spy:.3} ({:.3}) | {} | {} / {} |",
            pyebpf / base,
            py_spy / base,
            stat_value(&stats, "pyebpf CPU time:", "per sample"),
            kernel_time(&stats),
            kernel_time(&uncached),
        );
    }
    kernel_cost(&setup, pythons, root)
}

/// The eBPF sampler's own time per sample, from `--stats`.
fn kernel_time(stats: &str) -> String {
    stats
        .lines()
        .find(|l| l.starts_with("eBPF program time:"))
        .and_then(|l| l.split_once('(').map(|(_, rest)| rest.split(" per recorded sample").next().unwrap_or("?").to_string()))
        .unwrap_or_else(|| "?".into())
}

/// In-kernel time per sample of a thread spinning DEPTH frames deep, recorded at 999 Hz.
fn kernel_cost(setup: &Setup, pythons: &Path, root: &Path) -> Result<()> {
    println!();
    println!("| interpreter | depth | eBPF time per sample | with --no-cache | share of one CPU at 99 Hz |");
    println!("|---|---|---|---|---|");
    for version in ["3.13", "3.14", "3.15"] {
        for depth in ["5", "100"] {
            let ready = setup.out.join("ready");
            let _ = std::fs::remove_file(&ready);
            let mut target = Command::new(pythons.join(format!("usr/bin/python{version}")))
                .arg(root.join("tests/scripts/sampling_deep.py"))
                .arg(&ready)
                .arg(depth)
                .spawn()?;
            while !ready.exists() {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let pid = target.id().to_string();
            let record = |extra: &[&str]| -> Result<String> {
                let output = Command::new(&setup.pyebpf)
                    .args(["record", "-p", &pid, "-F", "999", "-d", "4", "--stats", "-o"])
                    .arg(setup.out.join("kernel.folded"))
                    .args(extra)
                    .output()?;
                Ok(kernel_time(&String::from_utf8_lossy(&output.stderr)))
            };
            let (default, uncached) = (record(&[])?, record(&["--no-cache"])?);
            target.kill()?;
            target.wait()?;
            let us: f64 = default.trim_end_matches(" us").parse().unwrap_or(f64::NAN);
            println!("| {version} | {depth} | {default} | {uncached} | {:.3}% |", us * 99.0 / 1e4);
        }
    }
    Ok(())
}

fn under_pyebpf(setup: &Setup, python: &Path, extra: &[&str]) -> Result<(f64, String)> {
    let output = Command::new(&setup.pyebpf)
        .args(["record", "-F", FREQUENCY, "--stats", "-o"])
        .arg(setup.out.join("pyebpf.pb.gz"))
        .args(extra)
        .arg("--")
        .arg(python)
        .arg(&setup.script)
        .arg(ITERATIONS)
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    if !output.status.success() {
        bail!("pyebpf failed: {stderr}");
    }
    Ok((parse_seconds(&output.stdout)?, stderr))
}

fn workload_seconds(command: &mut Command) -> Result<f64> {
    let output = command.output().with_context(|| format!("start {command:?}"))?;
    if !output.status.success() {
        bail!("{command:?} failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    parse_seconds(&output.stdout)
}

fn parse_seconds(stdout: &[u8]) -> Result<f64> {
    let text = String::from_utf8_lossy(stdout);
    // Profilers may print around the workload's own line.
    text.lines().rev().find_map(|l| l.trim().parse().ok()).with_context(|| format!("no timing in workload output {text:?}"))
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The figure in parentheses on a `--stats` line, e.g. `12.3 per python sample`.
fn stat_value(stats: &str, label: &str, unit: &str) -> String {
    stats
        .lines()
        .find(|l| l.trim_start().starts_with(label))
        .and_then(|l| l.split_once('(').map(|(_, rest)| rest.trim_end_matches(')').to_string()))
        .map(|figure| figure.replace(unit, "").trim().to_string())
        .unwrap_or_else(|| "?".into())
}

/// py-spy from PyPI in a venv under target/, for the comparison.
fn ensure_py_spy(root: &Path) -> Result<PathBuf> {
    let venv = root.join("target/bench-venv");
    let py_spy = venv.join("bin/py-spy");
    if !py_spy.exists() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
        run(Command::new(venv.join("bin/pip")).args(["install", "-q", "py-spy==0.4.3"]))?;
    }
    Ok(py_spy)
}
