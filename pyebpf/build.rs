use std::env;
use std::path::PathBuf;

fn main() {
    embed_ebpf_object();
    version_line();
    compile_profile_proto();
    compile_otlp_protos();
}

/// Copies the eBPF object built by `cargo xtask build` into OUT_DIR so the binary embeds it: the
/// one named by PYEBPF_EBPF_OBJECT, else the one xtask leaves under target/. Without one, a
/// release build (`cargo install --path pyebpf`, `cargo build --release`) stops here, since its
/// binary could not sample; a debug build or check (`cargo check`, an editor) embeds an empty
/// file and `record` says how to build it.
fn embed_ebpf_object() {
    println!("cargo:rerun-if-env-changed=PYEBPF_EBPF_OBJECT");
    let out = PathBuf::from(env::var_os("OUT_DIR").unwrap()).join("pyebpf-ebpf.o");
    let default = manifest_dir().join("../target/ebpf/bpfel-unknown-none/release/pyebpf");
    let source = env::var_os("PYEBPF_EBPF_OBJECT").map(PathBuf::from).unwrap_or(default);
    println!("cargo:rerun-if-changed={}", source.display());
    let object = match std::fs::read(&source) {
        Ok(object) => object,
        Err(_) if env::var("PROFILE").as_deref() == Ok("release") => {
            println!(
                "cargo::error=pyebpf's eBPF object is not built ({}): build pyebpf with `cargo xtask build --release` (it installs the eBPF toolchain)",
                source.display()
            );
            return;
        }
        Err(_) => Vec::new(),
    };
    std::fs::write(&out, object).expect("write OUT_DIR");
}

/// `pyebpf --version`: the crate's version, the commit it was built from, and the CPythons it reads.
fn version_line() {
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(manifest_dir())
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map_or_else(|| "unknown".to_string(), |commit| commit.trim().to_string());
    let version = env::var("CARGO_PKG_VERSION").unwrap_or_default();
    println!("cargo:rustc-env=PYEBPF_LONG_VERSION={version} (commit {commit}; reads CPython 3.8 to 3.15, and free-threaded 3.13)");
    // A new commit moves the branch HEAD names (or, packed, packed-refs), not HEAD itself. git
    // says where each lives: in a worktree, HEAD is the worktree's and the refs are shared.
    let head = git_path("HEAD");
    let branch = head.as_ref().and_then(|head| std::fs::read_to_string(head).ok()).and_then(|head| git_path(head.trim().strip_prefix("ref: ")?));
    for watched in [head, git_path("packed-refs"), branch].into_iter().flatten().filter(|file| file.exists()) {
        println!("cargo:rerun-if-changed={}", watched.display());
    }
}

/// This crate's directory, as cargo says when it runs the script: not as it was when the script was
/// built, which a target directory shared by two checkouts would take from the other.
fn manifest_dir() -> PathBuf {
    PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR for build scripts"))
}

/// Where `name` (`HEAD`, a ref, `packed-refs`) is in the repository holding this crate.
fn git_path(name: &str) -> Option<PathBuf> {
    let out = std::process::Command::new("git")
        .args(["rev-parse", "--path-format=absolute", "--git-path", name])
        .current_dir(manifest_dir())
        .output()
        .ok()
        .filter(|out| out.status.success())?;
    Some(PathBuf::from(String::from_utf8(out.stdout).ok()?.trim()))
}

fn compile_profile_proto() {
    println!("cargo:rerun-if-changed=proto/profile.proto");
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc for this host");
    prost_build::Config::new().protoc_executable(protoc).compile_protos(&["proto/profile.proto"], &["proto"]).expect("compile proto/profile.proto");
}

/// OTLP profiles (opentelemetry-proto v1.10.0, vendored under `proto/opentelemetry`) for `record
/// --otlp`: messages only, into one file of nested modules (`otlp.rs`) since the packages refer to
/// each other by relative paths; the gRPC call is made by hand with tonic's generic client.
fn compile_otlp_protos() {
    const ROOT: &str = "proto/opentelemetry/proto";
    let files = [
        "collector/profiles/v1development/profiles_service.proto",
        "profiles/v1development/profiles.proto",
        "common/v1/common.proto",
        "resource/v1/resource.proto",
    ]
    .map(|file| format!("{ROOT}/{file}"));
    for file in &files {
        println!("cargo:rerun-if-changed={file}");
    }
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc for this host");
    prost_build::Config::new().protoc_executable(protoc).include_file("otlp.rs").compile_protos(&files, &["proto"]).expect("compile the OTLP protos");
}
