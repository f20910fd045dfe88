//! Installs the real CPython interpreters the tests run against: Debian sid's 3.13, 3.14 and 3.15,
//! downloaded with a private apt state (the machine's apt configuration is not touched), unpacked
//! under a prefix and pointed at the glibc they were built for.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::run;
use crate::toolchain::ensure_apt_packages;

const VERSIONS: [&str; 3] = ["3.13", "3.14", "3.15"];
const SUITE: &str = "sid";
/// Shared libraries the interpreters need from the same suite.
const LIBRARIES: &[&str] = &[
    "libc6",
    "libexpat1",
    "libzstd1",
    "zlib1g",
    "libgcc-s1",
    "libffi8",
    "libssl3t64",
    "libbz2-1.0",
    "liblzma5",
    "libmpdec4",
    "libsqlite3-0",
    "libuuid1",
    "libreadline8t64",
    "libtinfo6",
    "libncursesw6",
];

/// Where test interpreters are cached: `$XDG_CACHE_HOME`, else `~/.cache`.
pub fn cache_dir() -> Result<PathBuf> {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .context("neither XDG_CACHE_HOME nor HOME is set")
}

fn prefix() -> Result<PathBuf> {
    if let Some(prefix) = std::env::var_os("PYEBPF_PYTHONS") {
        return Ok(PathBuf::from(prefix));
    }
    Ok(cache_dir()?.join("pyebpf-test-pythons"))
}

fn python(prefix: &Path, version: &str) -> PathBuf {
    prefix.join(format!("usr/bin/python{version}"))
}

/// Makes sure the test interpreters are installed; returns their prefix.
pub fn ensure_installed() -> Result<PathBuf> {
    let prefix = prefix()?;
    if VERSIONS.iter().all(|v| python(&prefix, v).exists()) {
        return Ok(prefix);
    }
    ensure_apt_packages(&[("patchelf", "patchelf"), ("dpkg", "dpkg")])?;
    eprintln!("xtask: installing CPython {} from Debian {SUITE} under {}", VERSIONS.join(", "), prefix.display());
    let work = std::env::temp_dir().join(format!("pyebpf-apt-{SUITE}"));
    for dir in ["lists/partial", "cache/archives/partial", "debs"] {
        std::fs::create_dir_all(work.join(dir))?;
    }
    std::fs::create_dir_all(&prefix)?;
    let sources = work.join("sources.list");
    std::fs::write(&sources, format!("deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian {SUITE} main\n"))?;
    let apt = |args: &[&str]| {
        let mut command = Command::new("apt-get");
        command
            .arg("-q")
            .arg("-o")
            .arg(format!("Dir::Etc::SourceList={}", sources.display()))
            .args(["-o", "Dir::Etc::SourceParts=/dev/null", "-o", "Dir::Etc::Preferences=/dev/null"])
            .args(["-o", "Dir::Etc::PreferencesParts=/dev/null", "-o", "APT::Sandbox::User=root"])
            .arg("-o")
            .arg(format!("Dir::State::Lists={}", work.join("lists").display()))
            .arg("-o")
            .arg(format!("Dir::Cache={}", work.join("cache").display()))
            .args(args)
            .current_dir(work.join("debs"));
        command
    };
    run(&mut apt(&["update"]))?;
    let mut packages: Vec<String> = LIBRARIES.iter().map(|p| p.to_string()).collect();
    for v in VERSIONS {
        for name in ["python{v}-minimal", "libpython{v}-minimal", "libpython{v}-stdlib", "python{v}", "libpython{v}", "libpython{v}-dev"] {
            packages.push(name.replace("{v}", v));
        }
    }
    let mut download = apt(&["download"]);
    download.args(&packages);
    run(&mut download)?;
    for entry in std::fs::read_dir(work.join("debs"))? {
        let deb = entry?.path();
        if deb.extension().is_some_and(|e| e == "deb") {
            run(Command::new("dpkg").arg("-x").arg(&deb).arg(&prefix))?;
        }
    }
    let libs = prefix.join("usr/lib/x86_64-linux-gnu");
    for v in VERSIONS {
        run(Command::new("patchelf")
            .arg("--set-interpreter")
            .arg(libs.join("ld-linux-x86-64.so.2"))
            .args(["--force-rpath", "--set-rpath"])
            .arg(&libs)
            .arg(python(&prefix, v)))?;
        run(Command::new(python(&prefix, v)).args(["-c", "import sys; print(sys.version)"]))?;
    }
    Ok(prefix)
}
