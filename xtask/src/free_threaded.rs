//! Builds the free-threaded CPython the tests run against (`python3.13t`, `--disable-gil`) from
//! Debian's `python3.13` source package, with the project's own recipe
//! (`xtask/scripts/build-free-threaded.sh`), cached like the other test interpreters.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::run;

fn prefix() -> Result<PathBuf> {
    if let Some(prefix) = std::env::var_os("PYEBPF_FREE_THREADED_PREFIX") {
        return Ok(PathBuf::from(prefix));
    }
    Ok(crate::pythons::cache_dir()?.join("pyebpf-free-threaded"))
}

/// Makes sure `python3.13t` is built; returns its path.
pub fn ensure_built(root: &Path) -> Result<PathBuf> {
    let prefix = prefix()?;
    let python = prefix.join("py313t/bin/python3.13t");
    if python.exists() {
        return Ok(python);
    }
    eprintln!("xtask: building free-threaded CPython 3.13 from Debian's source package under {} (a few minutes)", prefix.display());
    let script = root.join("xtask/scripts/build-free-threaded.sh");
    run(Command::new("bash").arg(&script).env("PREFIX", &prefix).env("VERSIONS", "3.13")).context("build free-threaded CPython 3.13")?;
    anyhow::ensure!(python.exists(), "{} did not produce {}", script.display(), python.display());
    Ok(python)
}
