//! Installs the real OpenTelemetry Collector the OTLP tests export to: the collector core built
//! from Debian sid's Go sources by `xtask/scripts/build-otelcol.sh` (offline from Go's module
//! proxy; minutes the first time, then cached), and a Python virtual environment with the official
//! `opentelemetry-proto` package, which the tests' sink (`tests/scripts/otlp_sink.py`) decodes
//! what the collector forwards with.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Result;

use crate::run;
use crate::toolchain::ensure_apt_packages;

/// The collector binary, under the prefix.
pub const BINARY: &str = "bin/otelcol-profiles";
/// The release of `opentelemetry-proto` whose profiles messages are opentelemetry-proto v1.10.0's
/// (`ProfilesDictionary.stack_table`, `Sample.stack_index`), the version pyebpf exports.
const PROTO_PACKAGE: &str = "opentelemetry-proto==1.44.0";
/// What the virtual environment must import for the sink to decode what pyebpf sends.
const PROTO_CHECK: &str = "from opentelemetry.proto.profiles.v1development import profiles_pb2 as pb; \
                           from opentelemetry.proto.collector.profiles.v1development import profiles_service_pb2; \
                           assert 'stack_table' in pb.ProfilesDictionary.DESCRIPTOR.fields_by_name; \
                           assert 'stack_index' in pb.Sample.DESCRIPTOR.fields_by_name";
/// Debian's interpreter the environment is made from (`setup` installs it with its venv module).
const BASE_PYTHON: &str = "/usr/bin/python3.11";

/// `$PYEBPF_OTELCOL`, or the user's cache folder.
fn prefix() -> Result<PathBuf> {
    if let Some(prefix) = std::env::var_os("PYEBPF_OTELCOL") {
        return Ok(PathBuf::from(prefix));
    }
    Ok(crate::pythons::cache_dir()?.join("pyebpf-otelcol"))
}

/// Makes sure the collector and the sink's virtual environment are installed; returns their
/// prefix (`bin/otelcol-profiles`, `venv/bin/python`).
pub fn ensure_built(root: &Path) -> Result<PathBuf> {
    let prefix = prefix()?;
    if !prefix.join(BINARY).exists() {
        ensure_apt_packages(&[("dpkg", "dpkg"), ("ionice", "util-linux")])?;
        eprintln!("xtask: building the OpenTelemetry Collector under {} (a few minutes, once)", prefix.display());
        std::fs::create_dir_all(&prefix)?;
        run(Command::new("bash").arg(root.join("xtask/scripts/build-otelcol.sh")).env("OTELCOL_PREFIX", &prefix))?;
    }
    ensure_venv(&prefix.join("venv"))?;
    Ok(prefix)
}

fn ensure_venv(venv: &Path) -> Result<()> {
    let python = venv.join("bin/python");
    let ready = || Command::new(&python).args(["-c", PROTO_CHECK]).output().is_ok_and(|out| out.status.success());
    if ready() {
        return Ok(());
    }
    eprintln!("xtask: installing {PROTO_PACKAGE} into {}", venv.display());
    if !python.exists() {
        run(Command::new(BASE_PYTHON).args(["-m", "venv"]).arg(venv))?;
    }
    run(Command::new("nice").args(["-n", "19"]).arg(venv.join("bin/pip")).args(["install", "--quiet", PROTO_PACKAGE]))?;
    run(Command::new(&python).args(["-c", PROTO_CHECK]))
}
