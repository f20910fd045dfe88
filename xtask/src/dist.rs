//! `cargo xtask dist`: what a host needs to run pyebpf without building it, in `dist/`: one static
//! binary (musl, the eBPF object embedded), a Python wheel carrying it, and a Debian package with the
//! manual pages and a systemd unit for continuous profiling.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use base64::Engine;
use sha2::{Digest, Sha256};

use crate::{run, toolchain};

/// The target of the static binary: musl links statically, so the binary needs no C library.
const STATIC_TARGET: &str = "x86_64-unknown-linux-musl";

/// The wheel's platform tags: a static binary runs wherever pip runs on x86_64 Linux, glibc or musl.
const WHEEL_PLATFORMS: [&str; 3] = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "musllinux_1_1_x86_64"];

/// What `dist` built.
pub struct Artifacts {
    pub binary: PathBuf,
    pub wheel: PathBuf,
    pub deb: PathBuf,
}

/// Builds every artifact into `ROOT/dist`, replacing what an earlier `dist` left there.
pub fn dist(root: &Path) -> Result<Artifacts> {
    let version = env!("CARGO_PKG_VERSION");
    let out = root.join("dist");
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("remove {}", out.display()))?;
    }
    std::fs::create_dir_all(&out)?;
    let binary = static_binary(root, &out)?;
    let wheel = wheel(&binary, &out, version)?;
    let deb = deb(root, &binary, &out, version)?;
    for artifact in [&binary, &wheel, &deb] {
        eprintln!("xtask: dist: {} ({} KiB)", artifact.display(), std::fs::metadata(artifact)?.len() / 1024);
    }
    Ok(Artifacts { binary, wheel, deb })
}

/// `dist/pyebpf`: stripped, statically linked, the eBPF object embedded.
fn static_binary(root: &Path, out: &Path) -> Result<PathBuf> {
    toolchain::ensure_target(STATIC_TARGET)?;
    // ring (TLS for `record --otlp`) compiles C and assembly for the target: musl-gcc does it
    // against musl's headers. jemalloc, the binary's allocator, is configured and built with make.
    toolchain::ensure_apt_packages(&[("musl-gcc", "musl-tools"), ("make", "make")])?;
    let linker_bin = toolchain::ensure_ebpf_toolchain(root)?;
    let object = toolchain::build_ebpf(root, &linker_bin)?;
    run(Command::new(env!("CARGO"))
        .current_dir(root)
        .args(["build", "--package", "pyebpf", "--profile", "dist", "--target", STATIC_TARGET])
        .env("PYEBPF_EBPF_OBJECT", &object))?;
    let binary = out.join("pyebpf");
    std::fs::copy(root.join("target").join(STATIC_TARGET).join("dist/pyebpf"), &binary)?;
    Ok(binary)
}

/// A wheel whose only content is the binary, as a script: pip puts it on the environment's PATH.
fn wheel(binary: &Path, out: &Path, version: &str) -> Result<PathBuf> {
    let name = format!("pyebpf-{version}-py3-none-{}.whl", WHEEL_PLATFORMS.join("."));
    let path = out.join(&name);
    let dist_info = format!("pyebpf-{version}.dist-info");
    let metadata = format!(
        "Metadata-Version: 2.1\nName: pyebpf\nVersion: {version}\nSummary: {}\nLicense: MIT OR Apache-2.0\nRequires-Python: >=3.8\n",
        "System-wide sampling profiler for Python on Linux, built on eBPF"
    );
    let tags: String = WHEEL_PLATFORMS.iter().map(|platform| format!("Tag: py3-none-{platform}\n")).collect();
    let wheel = format!("Wheel-Version: 1.0\nGenerator: pyebpf xtask\nRoot-Is-Purelib: false\n{tags}");
    let mut files: Vec<(String, Vec<u8>, u32)> = vec![
        (format!("pyebpf-{version}.data/scripts/pyebpf"), std::fs::read(binary)?, 0o755),
        (format!("{dist_info}/METADATA"), metadata.into_bytes(), 0o644),
        (format!("{dist_info}/WHEEL"), wheel.into_bytes(), 0o644),
    ];
    // RECORD lists every file with its hash and size, and itself without them.
    let mut record = String::new();
    for (file, data, _) in &files {
        let hash = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(Sha256::digest(data));
        record.push_str(&format!("{file},sha256={hash},{}\n", data.len()));
    }
    record.push_str(&format!("{dist_info}/RECORD,,\n"));
    files.push((format!("{dist_info}/RECORD"), record.into_bytes(), 0o644));
    let mut zip = zip::ZipWriter::new(std::fs::File::create(&path)?);
    for (file, data, mode) in &files {
        let options = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated).unix_permissions(*mode);
        zip.start_file(file.as_str(), options)?;
        zip.write_all(data)?;
    }
    zip.finish()?;
    Ok(path)
}

/// A Debian package: the binary, its manual pages, the unit for continuous profiling with its
/// settings in /etc/default, and the copyright file.
fn deb(root: &Path, binary: &Path, out: &Path, version: &str) -> Result<PathBuf> {
    let packaging = root.join("packaging");
    let tree = tempfile_dir(out, "deb")?;
    let put = |relative: &str, data: &[u8], mode: u32| -> Result<()> {
        let path = tree.join(relative);
        std::fs::create_dir_all(path.parent().context("a file in a folder")?)?;
        std::fs::write(&path, data)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
        Ok(())
    };
    put("usr/bin/pyebpf", &std::fs::read(binary)?, 0o755)?;
    let man = tree.join("usr/share/man/man1");
    std::fs::create_dir_all(&man)?;
    run(Command::new(binary).arg("man").arg(&man))?;
    for page in std::fs::read_dir(&man)? {
        run(Command::new("gzip").args(["-9", "-n"]).arg(page?.path()))?;
    }
    put("lib/systemd/system/pyebpf.service", &std::fs::read(packaging.join("pyebpf.service"))?, 0o644)?;
    put("etc/default/pyebpf", &std::fs::read(packaging.join("pyebpf.default"))?, 0o644)?;
    put("usr/share/doc/pyebpf/copyright", &std::fs::read(packaging.join("copyright"))?, 0o644)?;
    let installed_kib = std::fs::metadata(binary)?.len() / 1024 + 16;
    let control = std::fs::read_to_string(packaging.join("control"))?.replace("@VERSION@", version).replace("@INSTALLED_SIZE@", &installed_kib.to_string());
    put("DEBIAN/control", control.as_bytes(), 0o644)?;
    put("DEBIAN/conffiles", b"/etc/default/pyebpf\n", 0o644)?;
    let deb = out.join(format!("pyebpf_{version}_amd64.deb"));
    run(Command::new("dpkg-deb").args(["--root-owner-group", "-Zxz", "--build"]).arg(&tree).arg(&deb))?;
    std::fs::remove_dir_all(&tree)?;
    Ok(deb)
}

/// A fresh folder `out/.NAME` to assemble an artifact in.
fn tempfile_dir(out: &Path, name: &str) -> Result<PathBuf> {
    let dir = out.join(format!(".{name}"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    // dpkg-deb wants the package's folders 0755 whatever the umask.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
    Ok(dir)
}
