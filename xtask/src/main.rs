//! Build, run and test automation: `cargo xtask build|run|test|setup`. Every command first installs
//! what it needs and is missing on a fresh machine, so a clean clone needs nothing else.

mod bench;
mod dist;
mod free_threaded;
mod house;
mod otelcol;
mod pythons;
mod toolchain;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "pyebpf build, run and test automation")]
struct Xtask {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install the eBPF toolchain if missing, build the eBPF object and the pyebpf binary embedding it
    Build {
        #[arg(long)]
        release: bool,
    },
    /// Build (release) and run pyebpf with these arguments, e.g. `cargo xtask run -- record -a -d 10`
    Run {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Measure what profiling costs, side by side with py-spy and Tachyon; writes bench/RESULTS.md
    Bench {
        /// Only rewrite bench/RESULTS.md and the README's tables from bench/results.json
        #[arg(long)]
        report_only: bool,
        /// Only measure these parts, keeping the other figures of bench/results.json
        #[arg(long, value_delimiter = ',', value_parser = bench::SECTIONS)]
        only: Option<Vec<String>>,
        /// Only measure these interpreters (e.g. `3.13t`), keeping the others' figures
        #[arg(long, value_delimiter = ',')]
        versions: Option<Vec<String>>,
        /// Measure each always-on cell this many times, the two profilers in turn; the tables
        /// show each profiler's median and the spread (a single run of either varies severalfold)
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=9))]
        rounds: u32,
    },
    /// Build what is shipped into dist/: a static binary, a Python wheel and a Debian package
    Dist,
    /// Install what the tests need on a fresh machine, if missing: Debian packages, rustup
    /// components, the eBPF toolchain, the test CPythons and a free-threaded CPython 3.13 built
    /// from Debian's sources (`cargo xtask test` does this first)
    Setup,
    /// Install test dependencies (as `setup`), build, and run every test (unit, fuzz, end-to-end, dist)
    Test {
        /// Extra arguments for the end-to-end test binary (a test name filter, for example)
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        filter: Vec<String>,
    },
}

fn main() -> Result<()> {
    let root = workspace_root();
    match Xtask::parse().command {
        Task::Build { release } => {
            build(&root, release)?;
        }
        Task::Run { args } => {
            let binary = build(&root, true)?;
            let status = Command::new(&binary).args(&args).status().with_context(|| format!("run {}", binary.display()))?;
            std::process::exit(status.code().unwrap_or(1));
        }
        Task::Dist => {
            dist::dist(&root)?;
        }
        Task::Setup => {
            setup(&root)?;
        }
        Task::Test { filter } => test(&root, &filter)?,
        Task::Bench { report_only: true, .. } => bench::report_only(&root)?,
        Task::Bench { report_only: false, only, versions, rounds } => {
            let installed = setup(&root)?;
            let selection = bench::Selection { sections: only, versions, rounds: rounds as usize };
            // The binary that ships is measured beside the release build: built here, so that
            // both are of the code benched.
            let shipped = dist::dist(&root)?.binary;
            bench::bench(&root, bench::Binaries { release: build(&root, true)?, shipped }, &installed.pythons, &installed.free_threaded, &selection)?;
        }
    }
    Ok(())
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask sits in the workspace").to_path_buf()
}

/// Builds the eBPF object, then pyebpf embedding it; returns the binary's path.
fn build(root: &Path, release: bool) -> Result<PathBuf> {
    let linker_bin = toolchain::ensure_ebpf_toolchain(root)?;
    let object = toolchain::build_ebpf(root, &linker_bin)?;
    let mut cargo = Command::new(env!("CARGO"));
    cargo.current_dir(root).args(["build", "--package", "pyebpf"]).env("PYEBPF_EBPF_OBJECT", &object);
    if release {
        cargo.arg("--release");
    }
    run(&mut cargo)?;
    Ok(root.join("target").join(if release { "release" } else { "debug" }).join("pyebpf"))
}

/// What `setup` installed outside the workspace, for the tests to find.
struct Installed {
    /// The Debian test CPythons' prefix.
    pythons: PathBuf,
    /// The free-threaded `python3.13t`.
    free_threaded: PathBuf,
    /// The OpenTelemetry Collector's prefix, with the sink's Python environment.
    otelcol: PathBuf,
}

/// Installs what the tests need and is missing (quick when nothing is).
fn setup(root: &Path) -> Result<Installed> {
    toolchain::ensure_apt_packages(&[
        ("go", "golang-go"),
        ("patchelf", "patchelf"),
        ("gcc", "gcc"),
        ("strace", "strace"),
        ("chromium", "chromium"),
        ("tmux", "tmux"),
        ("npm", "npm"),
        ("bpftool", "bpftool"),
        // Debian's own interpreter, beside pyenv's: the version tests name it, and the wheel is
        // installed into a virtual environment of it.
        ("/usr/bin/python3.11", "python3.11"),
        ("/usr/lib/python3.11/ensurepip/__init__.py", "python3.11-venv"),
        ("capsh", "libcap2-bin"),
        ("systemd-analyze", "systemd"),
        // The OTLP tests' certificates.
        ("openssl", "openssl"),
    ])?;
    toolchain::ensure_components(&["rustfmt", "clippy"])?;
    toolchain::ensure_ebpf_toolchain(root)?;
    Ok(Installed { pythons: pythons::ensure_installed()?, free_threaded: free_threaded::ensure_built(root)?, otelcol: otelcol::ensure_built(root)? })
}

fn test(root: &Path, filter: &[String]) -> Result<()> {
    let mut suite = Suite::new();
    let installed = setup(root)?;
    // The end-to-end tests run the binary that ships (dist/pyebpf, static), so its build is also
    // the suite's: one optimised build of pyebpf's dependencies fewer, and the artifacts checked
    // on every run (tests/tests/dist.rs).
    suite.step("dist");
    let dist = dist::dist(root)?;
    let object = toolchain::ebpf_object_path(root);
    let cargo = |args: &[&str]| {
        let mut cargo = Command::new(env!("CARGO"));
        cargo
            .current_dir(root)
            .args(args)
            .env("PYEBPF_EBPF_OBJECT", &object)
            .env("PYEBPF_BIN", &dist.binary)
            .env("PYEBPF_PYTHONS", &installed.pythons)
            .env("PYEBPF_FREE_THREADED", &installed.free_threaded)
            .env("PYEBPF_OTELCOL", &installed.otelcol)
            .env("PYEBPF_DIST_BINARY", &dist.binary)
            .env("PYEBPF_DIST_WHEEL", &dist.wheel)
            .env("PYEBPF_DIST_DEB", &dist.deb);
        cargo
    };
    // House gates first; every step below runs even when one before it failed.
    suite.gate("cargo fmt --check", &mut cargo(&["fmt", "--all", "--", "--check"]));
    suite.gate("cargo fmt --check (pyebpf-ebpf)", cargo(&["fmt", "--", "--check"]).current_dir(root.join("pyebpf-ebpf")));
    suite.gate("cargo clippy", &mut cargo(&["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]));
    suite.gate("cargo clippy (pyebpf-ebpf)", &mut toolchain::ebpf_cargo(root, &["clippy", "--", "-D", "warnings"]));
    suite.check("house rules", house::offenders(root));
    suite.gate("cargo doc", cargo(&["doc", "--workspace", "--no-deps", "--document-private-items"]).env("RUSTDOCFLAGS", "-D warnings"));
    // Unit, fuzz and allocation tests share one build, optimised with overflow checks in pyebpf's
    // code; xtask's own tests reuse the debug build `cargo xtask` runs from. Unit and fuzz tests
    // may share the CPUs; end-to-end tests measure sample counts, one at a time.
    suite.tests(
        "unit",
        &mut cargo(&["test", "--profile", "checked", "--workspace", "--exclude", "pyebpf-tests", "--exclude", "xtask", "--lib", "--bins", "--no-fail-fast"]),
    );
    suite.tests("xtask", &mut cargo(&["test", "--package", "xtask", "--bins"]));
    suite.tests(
        "fuzz",
        &mut cargo(&["test", "--profile", "checked", "--package", "pyebpf", "--test", "fuzz_reader", "--test", "fuzz_parsers", "--no-fail-fast"]),
    );
    // Real BPF and a real interpreter: needs the sampler to itself, like the end-to-end tests.
    suite.tests("alloc_free", &mut cargo(&["test", "--profile", "checked", "--package", "pyebpf", "--test", "alloc_free"]));
    for name in end_to_end_tests(root)? {
        let mut e2e = cargo(&["test", "--release", "--package", "pyebpf-tests", "--test", &name, "--", "--test-threads=1"]);
        e2e.args(filter);
        suite.tests(&name, &mut e2e);
    }
    suite.finish()
}

/// The end-to-end test binaries: one per file in tests/tests/.
fn end_to_end_tests(root: &Path) -> Result<Vec<String>> {
    let mut names: Vec<String> =
        std::fs::read_dir(root.join("tests/tests"))?.filter_map(|entry| entry.ok()?.file_name().to_str()?.strip_suffix(".rs").map(str::to_string)).collect();
    names.sort();
    Ok(names)
}

/// Passed, failed and ignored of libtest's `test result: ok. 101 passed; 0 failed; 0 ignored; ...`.
fn result_counts(line: &str) -> Option<(u64, u64, u64)> {
    let counts = line.strip_prefix("test result: ")?;
    let count = |label: &str| counts.split(';').find_map(|part| part.trim().strip_suffix(label)?.split_whitespace().last()?.parse::<u64>().ok()).unwrap_or(0);
    Some((count(" passed"), count(" failed"), count(" ignored")))
}

/// What `cargo xtask test` ran: totals over every step and the name of everything that failed.
struct Suite {
    /// When the suite began (set-up included): each step's line says how far in it starts, so a
    /// slow step shows in CI's log.
    started: Instant,
    passed: u64,
    failed: u64,
    ignored: u64,
    failures: Vec<String>,
}

impl Suite {
    fn new() -> Self {
        Suite { started: Instant::now(), passed: 0, failed: 0, ignored: 0, failures: Vec::new() }
    }

    fn step(&self, name: &str) {
        eprintln!("xtask: [{} s] {name}", self.started.elapsed().as_secs());
    }

    /// A check that passes or fails as a whole (fmt, clippy, doc).
    fn gate(&mut self, name: &str, command: &mut Command) {
        self.step(name);
        match command.status() {
            Ok(status) if status.success() => {}
            Ok(status) => self.fail(format!("{name} (exited with {status})")),
            Err(err) => self.fail(format!("{name} (could not start: {err})")),
        }
    }

    /// A `cargo test` run: its output is passed through and its result lines added up; a run that
    /// fails without a failed test (a build error, a test binary that crashed) is a failure too.
    fn tests(&mut self, step: &str, command: &mut Command) {
        self.step(&format!("tests: {step}"));
        let failed_before = self.failures.len();
        let mut child = match command.stdout(Stdio::piped()).spawn() {
            Ok(child) => child,
            Err(err) => return self.fail(format!("{step} (could not start cargo: {err})")),
        };
        let stdout = child.stdout.take().expect("piped");
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            println!("{line}");
            if let Some(test) = line.strip_prefix("test ").and_then(|rest| rest.strip_suffix(" ... FAILED")) {
                self.failures.push(format!("{step}: {test}"));
            } else if let Some((passed, failed, ignored)) = result_counts(&line) {
                self.passed += passed;
                self.failed += failed;
                self.ignored += ignored;
            }
        }
        match child.wait() {
            Ok(status) if !status.success() && self.failures.len() == failed_before => self.fail(format!("{step} (exited with {status})")),
            Ok(_) => {}
            Err(err) => self.fail(format!("{step} (could not wait for cargo: {err})")),
        }
    }

    /// A check xtask makes itself: each offender it names is a failure.
    fn check(&mut self, name: &str, offenders: Result<Vec<String>>) {
        self.step(name);
        match offenders {
            Ok(offenders) => offenders.into_iter().for_each(|offender| self.fail(format!("{name}: {offender}"))),
            Err(err) => self.fail(format!("{name} (could not check: {err:#})")),
        }
    }

    fn fail(&mut self, what: String) {
        self.failed += 1;
        self.failures.push(what);
    }

    /// Lists every failure, then the totals as the last line; exits with 1 if anything failed.
    fn finish(self) -> Result<()> {
        if !self.failures.is_empty() {
            eprintln!("xtask: {} failed:", self.failures.len());
            for failure in &self.failures {
                eprintln!("    {failure}");
            }
        }
        let skipped = if self.ignored > 0 { format!(", {} skipped", self.ignored) } else { String::new() };
        println!("xtask: {} passed, {} failed{skipped} in {} s", self.passed, self.failed, self.started.elapsed().as_secs());
        if !self.failures.is_empty() {
            std::process::exit(1);
        }
        Ok(())
    }
}

fn run(command: &mut Command) -> Result<()> {
    let status = command.status().with_context(|| format!("start {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed with {status}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::result_counts;

    #[test]
    fn result_lines_are_added_up() {
        let line = "test result: FAILED. 11 passed; 2 failed; 3 ignored; 0 measured; 0 filtered out; finished in 130.32s";
        assert_eq!(result_counts(line), Some((11, 2, 3)));
        assert_eq!(result_counts("test result: ok. 101 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.80s"), Some((101, 0, 0)));
        assert_eq!(result_counts("test foo ... ok"), None);
    }
}
