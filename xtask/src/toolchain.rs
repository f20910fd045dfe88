//! Installing and using the eBPF toolchain: rust-src for `build-std`, and bpf-linker built
//! against the Rust toolchain's own LLVM (no system LLVM needed).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::run;

const BPF_LINKER_VERSION: &str = "0.13.0";

fn output(command: &mut Command) -> Result<String> {
    let out = command.output().with_context(|| format!("start {command:?}"))?;
    if !out.status.success() {
        bail!("{command:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?)
}

fn rustc_field(verbose_version: &str, key: &str) -> Result<String> {
    verbose_version.lines().find_map(|line| line.strip_prefix(key)).map(|value| value.trim().to_string()).with_context(|| format!("`rustc -vV` has no `{key}`"))
}

/// Makes sure rust-src and a matching bpf-linker are installed; returns bpf-linker's bin folder.
pub fn ensure_ebpf_toolchain(root: &Path) -> Result<PathBuf> {
    let sysroot = PathBuf::from(output(Command::new("rustc").args(["--print", "sysroot"]))?.trim());
    if !sysroot.join("lib/rustlib/src/rust/library/core").exists() {
        eprintln!("xtask: installing rust-src");
        run(Command::new("rustup").args(["component", "add", "rust-src"]))?;
    }
    let version = output(Command::new("rustc").arg("-vV"))?;
    let commit = rustc_field(&version, "commit-hash:")?;
    let llvm_major = rustc_field(&version, "LLVM version:")?.split('.').next().unwrap_or_default().to_string();
    // bpf-linker's runpath points into this prefix, so it lives as long as the target folder.
    let prefix = root.join("target").join(format!("bpf-linker-{}", &commit[..12.min(commit.len())]));
    let bin = prefix.join("bin");
    if bin.join("bpf-linker").exists() {
        return Ok(bin);
    }
    eprintln!("xtask: building bpf-linker {BPF_LINKER_VERSION} against the toolchain's LLVM {llvm_major}");
    let lib = prefix.join("lib");
    std::fs::create_dir_all(&lib)?;
    let llvm = std::fs::read_dir(sysroot.join("lib"))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|path| path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libLLVM.so")))
        .context("the Rust toolchain ships no libLLVM.so")?;
    for name in [std::ffi::OsString::from("libLLVM.so"), llvm.file_name().unwrap_or_default().to_os_string()] {
        let link = lib.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&llvm, &link)?;
    }
    run(Command::new(env!("CARGO"))
        .args(["install", &format!("bpf-linker@{BPF_LINKER_VERSION}"), "--locked", "--no-default-features"])
        .args(["--features", &format!("llvm-{llvm_major}")])
        .arg("--root")
        .arg(&prefix)
        .env("LLVM_PREFIX", &prefix))?;
    Ok(bin)
}

/// Installs the rustup components (`rustfmt`, `clippy`) the test command's gates run.
pub fn ensure_components(components: &[&str]) -> Result<()> {
    let installed = output(Command::new("rustup").args(["component", "list", "--installed"]))?;
    let missing: Vec<&str> = components.iter().copied().filter(|c| !installed.lines().any(|line| line.starts_with(&format!("{c}-")))).collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing {}", missing.join(" "));
    run(Command::new("rustup").args(["component", "add"]).args(&missing))
}

pub fn ebpf_object_path(root: &Path) -> PathBuf {
    root.join("target/ebpf/bpfel-unknown-none/release/pyebpf")
}

/// Cargo with `args` on the eBPF crate, from its own folder (its config selects the BPF target
/// and build-std, which needs `RUSTC_BOOTSTRAP` on stable).
pub fn ebpf_cargo(root: &Path, args: &[&str]) -> Command {
    let mut cargo = Command::new(env!("CARGO"));
    cargo.current_dir(root.join("pyebpf-ebpf")).args(args).env("RUSTC_BOOTSTRAP", "1").env("CARGO_TARGET_DIR", root.join("target/ebpf"));
    cargo
}

/// Builds the eBPF crate; only linking needs bpf-linker (from `linker_bin`), so clippy runs without.
pub fn build_ebpf(root: &Path, linker_bin: &Path) -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![linker_bin.to_path_buf()];
    paths.extend(std::env::split_paths(&path));
    run(ebpf_cargo(root, &["build", "--release"]).env("PATH", std::env::join_paths(paths)?))?;
    Ok(ebpf_object_path(root))
}

/// Installs the Debian packages whose commands (names on PATH, or absolute paths) are missing
/// (`(command, package)` pairs).
pub fn ensure_apt_packages(needed: &[(&str, &str)]) -> Result<()> {
    let missing: Vec<&str> = needed
        .iter()
        .filter(|(command, _)| !Command::new("sh").args(["-c", &format!("command -v {command}")]).output().is_ok_and(|o| o.status.success()))
        .map(|(_, package)| *package)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing {}", missing.join(" "));
    run(Command::new("apt-get").args(["update", "-q"]))?;
    run(Command::new("apt-get").args(["install", "-y", "-q"]).args(&missing).env("DEBIAN_FRONTEND", "noninteractive"))
}

/// Installs the standard library of another target (`rustup target add`) if missing.
pub fn ensure_target(target: &str) -> Result<()> {
    let installed = output(Command::new("rustup").args(["target", "list", "--installed"]))?;
    if installed.lines().any(|line| line.trim() == target) {
        return Ok(());
    }
    eprintln!("xtask: installing the {target} target");
    run(Command::new("rustup").args(["target", "add", target]))
}
