//! Build, run and test automation: `cargo xtask build|run|test`. Every command first installs what
//! is missing on a fresh machine, so a clean clone needs nothing else.

mod bench;
mod pythons;
mod toolchain;

use std::path::{Path, PathBuf};
use std::process::Command;

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
    },
    /// Install test dependencies, build, and run every test (unit, fuzz, end-to-end)
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
        Task::Test { filter } => test(&root, &filter)?,
        Task::Bench { report_only: true } => bench::report_only(&root)?,
        Task::Bench { report_only: false } => {
            let pythons = pythons::ensure_installed()?;
            bench::bench(&root, build(&root, true)?, &pythons)?;
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

fn test(root: &Path, filter: &[String]) -> Result<()> {
    toolchain::ensure_apt_packages(&[
        ("go", "golang-go"),
        ("patchelf", "patchelf"),
        ("gcc", "gcc"),
        ("strace", "strace"),
        ("chromium", "chromium"),
        ("tmux", "tmux"),
        ("npm", "npm"),
        ("bpftool", "bpftool"),
    ])?;
    let pythons = pythons::ensure_installed()?;
    let binary = build(root, true)?;
    let object = toolchain::ebpf_object_path(root);
    let cargo_test = |args: &[&str]| -> Result<()> {
        let mut cargo = Command::new(env!("CARGO"));
        cargo.current_dir(root).arg("test").args(args).env("PYEBPF_EBPF_OBJECT", &object).env("PYEBPF_BIN", &binary).env("PYEBPF_PYTHONS", &pythons);
        run(&mut cargo)
    };
    // Unit and fuzz tests may share the CPUs; end-to-end tests measure sample counts, one at a time.
    cargo_test(&["--release", "--workspace", "--exclude", "pyebpf-tests", "--lib", "--bins"])?;
    cargo_test(&["--profile", "fuzz", "--package", "pyebpf", "--test", "fuzz_reader", "--test", "fuzz_parsers"])?;
    // Real BPF and a real interpreter: needs the sampler to itself, like the end-to-end tests.
    cargo_test(&["--release", "--package", "pyebpf", "--test", "alloc_free"])?;
    let mut e2e = vec!["--release", "--package", "pyebpf-tests", "--", "--test-threads=1"];
    e2e.extend(filter.iter().map(String::as_str));
    cargo_test(&e2e)
}

fn run(command: &mut Command) -> Result<()> {
    let status = command.status().with_context(|| format!("start {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed with {status}");
    }
    Ok(())
}
