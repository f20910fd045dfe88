//! The bench's outputs: `bench/results.json` (raw figures), `bench/RESULTS.md` (tables, machine,
//! versions, commands, targets) and the README's performance tables between their markers.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};
use serde_json::{json, Value};

use super::{Bench, PROFILERS, PY_SPY_VERSION, STATIC_PYEBPF, STATIC_VERSION, VERSIONS};

const README_START: &str = "<!-- bench:start -->";
const README_END: &str = "<!-- bench:end -->";

fn output_of(command: &mut Command) -> String {
    command.output().map(|o| String::from_utf8_lossy(if o.stdout.is_empty() { &o.stderr } else { &o.stdout }).trim().to_string()).unwrap_or_default()
}

pub fn machine(bench: &Bench) -> Result<Value> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo.lines().find_map(|l| l.strip_prefix("model name")).map(|m| m.trim_start_matches([' ', '\t', ':']).to_string());
    let pythons: Vec<String> = VERSIONS.iter().map(|v| output_of(Command::new(bench.python(v)).arg("-VV"))).collect();
    Ok(json!({
        "kernel": output_of(Command::new("uname").arg("-r")),
        "cpu": model, "cpus": std::thread::available_parallelism()?.get(),
        "memory": output_of(Command::new("sh").args(["-c", "free -h | awk '/Mem:/ {print $2}'"])),
        "pyebpf_commit": output_of(Command::new("git").current_dir(&bench.root).args(["describe", "--always", "--dirty"])),
        "pythons": pythons,
        "py_spy": output_of(Command::new(&bench.py_spy).arg("--version")),
        "date": output_of(Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"])),
    }))
}

fn num(v: &Value) -> String {
    match v.as_f64() {
        Some(x) if x.abs() >= 100.0 || x.fract() == 0.0 => format!("{x:.0}"),
        Some(x) if x.abs() >= 10.0 => format!("{x:.1}"),
        Some(x) => format!("{x:.2}"),
        None => "–".into(),
    }
}

fn find(rows: &Value, pred: impl Fn(&Value) -> bool) -> Option<&Value> {
    rows.as_array()?.iter().find(|r| pred(r))
}

fn cpu_table(results: &Value) -> String {
    let rows = &results["cpu_per_sample"];
    let mut md = String::from(
        "| interpreter | depth | Hz | pyebpf µs/sample | static binary (musl) µs/sample | py-spy µs/sample | Tachyon µs/sample | pyebpf ÷ Tachyon | pyebpf ÷ py-spy | start-up CPU ms: pyebpf / py-spy / Tachyon |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for version in VERSIONS {
        for depth in super::DEPTHS {
            for hz in super::FREQUENCIES {
                let cell = |p: &str| find(rows, |r| r["version"] == version && r["depth"] == depth && r["hz"] == hz && r["profiler"] == p);
                let steady = |p: &str| cell(p).map(|r| r["steady_us_per_sample"].clone()).unwrap_or(Value::Null);
                let startup = |p: &str| cell(p).map(|r| num(&r["startup_cpu_ms"])).unwrap_or_else(|| "n/a".into());
                let ratio = |p: &str| match (steady("pyebpf").as_f64(), steady(p).as_f64()) {
                    (Some(a), Some(b)) if b > 0.0 => format!("{:.3}", a / b),
                    _ => "n/a".into(),
                };
                let tachyon = if version == "3.15" { num(&steady("Tachyon")) } else { "n/a (3.15 only)".into() };
                let musl = if version == STATIC_VERSION { num(&steady(STATIC_PYEBPF)) } else { format!("n/a ({STATIC_VERSION} only)") };
                let _ = writeln!(
                    md,
                    "| {version} | {depth} | {hz} | {} | {musl} | {} | {tachyon} | {} | {} | {} / {} / {} |",
                    num(&steady("pyebpf")),
                    num(&steady("py-spy")),
                    ratio("Tachyon"),
                    ratio("py-spy"),
                    startup("pyebpf"),
                    startup("py-spy"),
                    startup("Tachyon"),
                );
            }
        }
    }
    md
}

fn kernel_table(results: &Value) -> String {
    let mut md = String::from(
        "| interpreter | depth | eBPF µs/sample | `--no-cache` | `--kernel` | remote reads / Python sample | `--no-cache` | remote bytes / Python sample | `--no-cache` |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for row in results["kernel_and_reads"].as_array().into_iter().flatten() {
        let f = |mode: &str, key: &str| num(&row[mode][key]);
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            row["version"].as_str().unwrap_or("?"),
            row["depth"],
            f("default", "ebpf_us_per_sample"),
            f("no_cache", "ebpf_us_per_sample"),
            f("kernel", "ebpf_us_per_sample"),
            f("default", "remote_reads_per_python_sample"),
            f("no_cache", "remote_reads_per_python_sample"),
            f("default", "remote_bytes_per_python_sample"),
            f("no_cache", "remote_bytes_per_python_sample"),
        );
    }
    md
}

fn slowdown_table(results: &Value) -> String {
    let mut md = String::from("| interpreter | alone (s) |");
    let mut columns = Vec::new();
    for hz in super::FREQUENCIES {
        for p in PROFILERS {
            columns.push((p.name(), hz));
            let _ = write!(md, " {} {hz} Hz |", p.name());
        }
    }
    md.push('\n');
    md.push_str(&"|---".repeat(columns.len() + 2));
    md.push_str("|\n");
    for row in results["slowdown"].as_array().into_iter().flatten() {
        let _ = write!(md, "| {} | {} |", row["version"].as_str().unwrap_or("?"), num(&row["alone_s"]));
        for (p, hz) in &columns {
            match find(&row["under"], |u| u["profiler"] == *p && u["hz"] == *hz) {
                Some(u) => {
                    let _ = write!(md, " {:.3} |", u["ratio"].as_f64().unwrap_or(f64::NAN));
                }
                None => md.push_str(" n/a |"),
            }
        }
        md.push('\n');
    }
    md
}

fn fidelity_table(results: &Value) -> String {
    let mut md = String::from(
        "| interpreter | profiler | 60/30/10 split: error, median (pp) | worst (pp) | stacks mixing both alternating paths: median | worst |\n|---|---|---|---|---|---|\n",
    );
    for row in results["fidelity"].as_array().into_iter().flatten() {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {}% | {}% |",
            // Runs before versions were recorded were all of 3.15.
            row["version"].as_str().unwrap_or("3.15"),
            row["profiler"].as_str().unwrap_or("?"),
            num(&row["split_error_pp_median"]),
            num(&row["split_error_pp_worst"]),
            num(&row["mixed_percent_median"]),
            num(&row["mixed_percent_worst"]),
        );
    }
    md
}

fn scale_table(results: &Value) -> String {
    let mut md = String::from(
        "| Python processes | Hz | samples | lost | Python processes resolved | pyebpf CPU, steady (share of one core) | µs/sample | start-up CPU (ms) | max RSS (MB) |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for row in results["scale"].as_array().into_iter().flatten() {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {:.2}% | {} | {} | {} |",
            row["processes"],
            row["hz"],
            num(&row["samples"]),
            num(&row["lost"]),
            num(&row["python_processes"]),
            row["share_of_one_core"].as_f64().unwrap_or(f64::NAN) * 100.0,
            num(&row["us_per_sample"]),
            num(&row["startup_cpu_ms"]),
            num(&row["max_rss_mb"]),
        );
    }
    md
}

fn export_table(results: &Value) -> String {
    let row = &results["export"];
    if row.is_null() {
        return "(not measured in this run)\n".to_string();
    }
    format!(
        "| Python processes | Hz | period (s) | periods sent | export thread CPU per period (ms) | whole pyebpf CPU per period (ms) | export, share of one core | pyebpf, share of one core |\n|---|---|---|---|---|---|---|---|\n| {} | {} | {} | {} | {} | {} | {:.3}% | {:.2}% |\n",
        row["processes"],
        row["hz"],
        row["period_s"],
        num(&row["periods"]),
        num(&row["export_ms_per_period"]),
        num(&row["process_ms_per_period"]),
        row["export_share_of_one_core"].as_f64().unwrap_or(f64::NAN) * 100.0,
        row["process_share_of_one_core"].as_f64().unwrap_or(f64::NAN) * 100.0,
    )
}

fn waits_tables(results: &Value) -> String {
    let waits = &results["waits"];
    if waits.is_null() {
        return "(not measured in this run)\n".to_string();
    }
    let mut md = format!(
        "The switch hook's own time, from the kernel's BPF statistics (`record --stats`, which add clock reads of their own) while pyebpf profiled other processes: {} ns per context switch (median of the runs). \
         Idle CPUs poll rather than halt while these run (`/dev/cpu_dma_latency` held at 0): in this virtual machine waking a halted CPU goes through the hypervisor, \
         and a profiler's own load keeps CPUs from halting, which made programs faster beside a profiler than alone. \
         Each program runs pinned to one CPU (`taskset -c 1`), where every hop is a direct switch and the hook's cost is all that differs, and across two CPUs, \
         where the scheduler's placement of the two ends still moves a run by ±20%.\n\n\
         | program | CPUs | runs | round trips/s (median) | share of alone |\n|---|---|---|---|---|\n",
        num(&waits["switch_hook_ns_median"])
    );
    for row in waits["throughput"].as_array().into_iter().flatten() {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {:.1}% |",
            row["program"].as_str().unwrap_or("pingpong.py"),
            row["cpus"].as_str().unwrap_or("two"),
            row["setting"].as_str().unwrap_or("?"),
            num(&row["round_trips_per_s"]),
            row["share_of_alone"].as_f64().unwrap_or(f64::NAN) * 100.0
        );
    }
    md.push_str("\n| profiler (wall-clock mode) | Hz | `wait_io` (true: 70%) | `compute` (true: 30%) | lock waiter, as a share of the serving thread (true: 100%) | profiler CPU (s) for 4 s |\n|---|---|---|---|---|---|\n");
    for row in waits["shares"].as_array().into_iter().flatten() {
        let _ = writeln!(
            md,
            "| {} | {} | {:.1}% | {:.1}% | {:.1}% | {} |",
            row["profiler"].as_str().unwrap_or("?"),
            row["hz"].as_str().unwrap_or("99"),
            row["wait_io_percent"].as_f64().unwrap_or(f64::NAN),
            row["compute_percent"].as_f64().unwrap_or(f64::NAN),
            row["lock_waiter_percent_of_serving"].as_f64().unwrap_or(f64::NAN),
            num(&row["cpu_s"]),
        );
    }
    md
}

/// Each target of the performance issue beside the figure measured for it.
fn targets_table(results: &Value) -> String {
    let cpu = &results["cpu_per_sample"];
    let steady = |v: &str, d: u32, hz: u32, p: &str| {
        find(cpu, |r| r["version"] == v && r["depth"] == d && r["hz"] == hz && r["profiler"] == p).and_then(|r| r["steady_us_per_sample"].as_f64())
    };
    let kernel = find(&results["kernel_and_reads"], |r| r["version"] == "3.15" && r["depth"] == 100);
    let kernel_us = kernel.and_then(|r| r["default"]["ebpf_us_per_sample"].as_f64());
    let ours = steady("3.15", 100, 999, "pyebpf");
    let tachyon = steady("3.15", 100, 999, "Tachyon");
    let py_spy = steady("3.15", 100, 999, "py-spy");
    let startup = cpu.as_array().into_iter().flatten().filter(|r| r["profiler"] == "pyebpf").filter_map(|r| r["startup_cpu_ms"].as_f64()).fold(0.0, f64::max);
    let fifty = find(&results["scale"], |r| r["processes"] == 50 && r["hz"] == 999);
    let fidelity = results["fidelity"].as_array().cloned().unwrap_or_default();
    let split = |p: &str| {
        fidelity.iter().find(|r| r["profiler"] == p && r["version"].as_str().is_none_or(|v| v == "3.15")).and_then(|r| r["split_error_pp_median"].as_f64())
    };
    let best_other = ["py-spy", "Tachyon"].iter().filter_map(|p| split(p)).fold(f64::INFINITY, f64::min);
    let check = |ok: Option<bool>| match ok {
        Some(true) => "met",
        Some(false) => "missed",
        None => "–",
    };
    let f = |x: Option<f64>| x.map(|x| format!("{x:.2}")).unwrap_or_else(|| "–".into());
    let ratio = |a: Option<f64>, b: Option<f64>| Some(a? / b?);
    let mut md = String::from("| target | measured | |\n|---|---|---|\n");
    let mut line = |target: &str, measured: String, ok: Option<bool>| {
        let _ = writeln!(md, "| {target} | {measured} | {} |", check(ok));
    };
    line("in-kernel ≤ 3 µs/sample, 3.15, 100 deep", format!("{} µs", f(kernel_us)), kernel_us.map(|k| k <= 3.0));
    line("steady CPU ≤ 3 µs/sample, 999 Hz, 3.15, 100 deep", format!("{} µs", f(ours)), ours.map(|o| o <= 3.0));
    let musl = steady(STATIC_VERSION, 100, 999, STATIC_PYEBPF);
    line("the same, the static binary (musl)", format!("{} µs", f(musl)), musl.map(|m| m <= 3.0));
    let t = ratio(ours, tachyon);
    line("≤ 0.05× Tachyon (same run)", format!("{}×", f(t)), t.map(|t| t <= 0.05));
    let p = ratio(ours, py_spy);
    line("≤ 0.01× py-spy (same run)", format!("{}×", f(p)), p.map(|p| p <= 0.01));
    line("start-up: whole start-up CPU of one attach (worst run; loading the eBPF programs included)", format!("{startup:.0} ms"), None);
    // With 50 spinning processes on 2 CPUs pyebpf waits for a CPU during start-up, which the
    // steady-rate estimate cannot tell apart; 10 against 1 is not starved.
    let startup_at = |n: u32| find(&results["scale"], |r| r["processes"] == n && r["hz"] == 99).and_then(|r| r["startup_cpu_ms"].as_f64());
    let per_process = ratio(startup_at(10).zip(startup_at(1)).map(|(a, b)| a - b), Some(9.0)).filter(|p| *p >= 0.0);
    line("start-up < 50 ms per attached process (`record -a`, 10 processes vs 1, 99 Hz)", format!("{} ms", f(per_process)), per_process.map(|p| p < 50.0));
    let lost = fifty.and_then(|r| r["lost"].as_f64());
    line("50 processes at 999 Hz: 0 lost", f(lost), lost.map(|l| l == 0.0));
    let share = fifty.and_then(|r| r["share_of_one_core"].as_f64()).map(|s| s * 100.0);
    line("50 processes at 999 Hz: under 2% of one core", format!("{}%", f(share)), share.map(|s| s < 2.0));
    let rss = fifty.and_then(|r| r["max_rss_mb"].as_f64());
    line("50 processes at 999 Hz: max RSS under 100 MB", format!("{} MB", f(rss)), rss.map(|r| r < 100.0));
    let ours_split = split("pyebpf");
    line("split error no worse than the best competitor", format!("{} pp vs {best_other:.2} pp", f(ours_split)), ours_split.map(|o| o <= best_other + 0.5));
    md
}

pub fn tables(results: &Value) -> String {
    format!(
        "Profiler CPU per sample, steady state (a {secs_attach} s attach to a process spinning at that depth; the CPU its threads ran from {from:.1} s to {to:.1} s after its start, over that window's share of its samples), and start-up CPU apart (what its whole run used beyond the steady rate):\n\n{}\n\
         The profiled program's time for fixed work under each profiler, as a ratio to its time alone (median of {rounds} interleaved rounds; the profiler launches the program):\n\n{}\n\
         In-kernel time per sample (`record --stats`, from the kernel's BPF run-time statistics) and remote reads per Python sample, `record -p PID -F 999 -d 3`:\n\n{}\n\
         Fidelity at 999 Hz on Python {fidelity_versions} (3.11 and 3.12 are pyenv's 3.11.7 and 3.12.1; 3.13t is the free-threaded 3.13 built from Debian's sources, which py-spy 0.4 cannot read; Tachyon attaches only to 3.15), {runs} runs of {secs} s per profiler: the largest error of the three functions' shares, and the share of samples of the alternating workload whose stack mixes both paths:\n\n{}\n\
         Host-wide: `record -a -d {secs_attach}` with N spinning Python processes ({versions} in turn), steady CPU measured as above:\n\n{}\n\
         Sending profiles (`record -a -F {export_hz} -d {export_s} --otlp http://... --otlp-period {export_period}` with {export_processes} busy Python processes, to a local sink that answers at once): the export thread's CPU (encoding, compressing, sending) per period, from the kernel's per-thread run time, beside the whole process's:\n\n{}\n\
         {}\n\
         Off-CPU time (`--mode wall`): switch-heavy programs (`pingpong.py {pingpong_s}` on Python 3.15, two processes bouncing a byte over pipes, and `perf bench sched pipe -l {perf_loops}`) alone and under each profiler at {waits_hz} Hz, median of {waits_rounds} interleaved rounds \
         (\"profiling other processes\": `record -a --mode wall --comm` naming a bystander Python process that spins 5 ms every 100 ms: pyebpf watches it, so the switch hook is attached and every switch on the host runs it; \
         \"an empty BPF program\": the bench attaches a program that returns at once to `sched_switch`, what any hook run at every switch costs here, the floor under pyebpf's); \
         then `waits.py` (a thread sleeping 7 ms in `wait_io` and spinning 3 ms in `compute` every 10 ms, beside a thread blocked on a lock) profiled for {share_s} s in each profiler's wall-clock mode \
         (`pyebpf record --mode wall`, `py-spy record --idle`, `profiling.sampling attach --mode wall -a`), at 99 Hz and at 97 Hz \
         (the workload's cycle is close to 99 Hz's period: a clock ticking at exact multiples of its period samples a few phases of the cycle; pyebpf's does not):\n\n{}\n\
         Targets:\n\n{}\n\
         Where pyebpf's time goes: `perf record -F 4999 -g` of `pyebpf record -p PID -F 999 -d {secs_attach}` on the 3.15 workload 100 deep, \
         own time per thread, library and symbol (`perf report --no-children --sort comm,dso,sym`, entries of 1.5% or more; start-up included):\n\n```\n{}\n```\n",
        cpu_table(results),
        slowdown_table(results),
        kernel_table(results),
        fidelity_table(results),
        scale_table(results),
        export_table(results),
        super::always_on::table(results),
        waits_tables(results),
        targets_table(results),
        results["profile"].as_array().into_iter().flatten().filter_map(Value::as_str).collect::<Vec<_>>().join("\n"),
        secs_attach = super::ATTACH_S,
        export_hz = super::export::HZ,
        export_s = super::export::SECONDS,
        export_period = super::export::PERIOD_S,
        export_processes = super::export::PROCESSES,
        versions = super::SCALE_VERSIONS.join("/"),
        from = super::WINDOW_FROM.as_secs_f64(),
        to = super::WINDOW_TO.as_secs_f64(),
        rounds = super::SLOWDOWN_ROUNDS,
        runs = super::fidelity::RUNS,
        fidelity_versions = super::fidelity::VERSIONS.join(", "),
        secs = super::fidelity::SECONDS,
        pingpong_s = super::waits::PINGPONG_S,
        perf_loops = super::waits::PERF_LOOPS,
        waits_hz = super::waits::HZ,
        waits_rounds = super::waits::ROUNDS,
        share_s = super::waits::SHARE_SECONDS,
    )
}

pub fn write(bench: &Bench, results: &Value) -> Result<()> {
    let dir = bench.root.join("bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("results.json"), serde_json::to_string_pretty(results)? + "\n")?;
    rewrite(&bench.root, results)
}

/// RESULTS.md and the README's tables from the raw figures.
pub fn rewrite(root: &Path, results: &Value) -> Result<()> {
    let dir = root.join("bench");
    let m = &results["machine"];
    let pythons: Vec<&str> = m["pythons"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    let tables = tables(results);
    let md = format!(
        "# pyebpf benchmark results\n\n\
         Generated by `sudo cargo xtask bench` ({secs} s) on {date}; raw figures in `results.json`.\n\n\
         - Machine: {cpus} CPUs ({cpu}), {mem} memory, kernel {kernel}\n\
         - pyebpf {commit}; {py_spy} (PyPI, in `target/bench-venv`, default mode: it pauses the target to read it); \
         Tachyon = `python3.15 -m profiling.sampling`\n\
         - Interpreters: {pythons}\n\
         - Workloads (`tests/scripts/`): `sampling_deep.py READY DEPTH` (one thread spinning DEPTH frames deep), \
         `bench_work.py N` (fixed work 100 frames deep, timing itself), `sampling_proportions.py`, `alternating.py READY 10`\n\
         - Commands: `pyebpf record --stats -p PID -F HZ -d S -o out.txt`; `py-spy record --format raw --pid PID --rate HZ --duration S -o out.txt`; \
         `python3.15 -m profiling.sampling attach --collapsed -r HZ -d S -o out.txt PID`; to launch: `pyebpf record -F HZ -o out -- CMD`, \
         `py-spy record --rate HZ -o out -- CMD`, `python3.15 -m profiling.sampling run --collapsed -r HZ -o out SCRIPT`\n\
         - CPU is user + system time of the profiler's process (`wait4`), samples are those in its output.\n{partial}\n{tables}",
        secs = m["bench_seconds"],
        date = m["date"].as_str().unwrap_or("?"),
        cpus = m["cpus"],
        cpu = m["cpu"].as_str().unwrap_or("?"),
        mem = m["memory"].as_str().unwrap_or("?"),
        kernel = m["kernel"].as_str().unwrap_or("?"),
        commit = m["pyebpf_commit"].as_str().unwrap_or("?"),
        py_spy = m["py_spy"].as_str().unwrap_or(PY_SPY_VERSION),
        pythons = pythons.join("; "),
        partial = partial_runs(m),
    );
    std::fs::write(dir.join("RESULTS.md"), md)?;
    splice_readme(root, &tables)?;
    println!("{tables}");
    Ok(())
}

/// The lines naming the parts measured again since the full run (`--only`, `--versions`).
fn partial_runs(machine: &Value) -> String {
    let mut lines = String::new();
    for run in machine["partial_runs"].as_array().into_iter().flatten() {
        let list = |key: &str| run[key].as_array().map(|items| items.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(", "));
        let sections = list("sections").unwrap_or_else(|| "every part".into());
        let versions = list("versions").map(|v| format!(" of {v}")).unwrap_or_default();
        let _ = writeln!(
            lines,
            "- Measured again at {}: {sections}{versions} (`cargo xtask bench --only ... --versions ...`)",
            run["commit"].as_str().unwrap_or("?")
        );
    }
    lines
}

/// Replaces the README's performance tables (between the bench markers) with this run's.
fn splice_readme(root: &Path, tables: &str) -> Result<()> {
    let path = root.join("README.md");
    let readme = std::fs::read_to_string(&path)?;
    let start = readme.find(README_START).context("README has no bench:start marker")? + README_START.len();
    let end = readme.find(README_END).context("README has no bench:end marker")?;
    let updated = format!("{}\n{tables}\n{}", &readme[..start], &readme[end..]);
    std::fs::write(&path, updated)?;
    Ok(())
}
