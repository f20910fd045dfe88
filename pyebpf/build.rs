use std::env;
use std::path::PathBuf;

fn main() {
    embed_ebpf_object();
    compile_profile_proto();
}

/// Copies the eBPF object built by `cargo xtask build` into OUT_DIR so the binary embeds it: the
/// one named by PYEBPF_EBPF_OBJECT, else the one xtask leaves under target/. Without one (a plain
/// `cargo check` on a fresh clone), an empty file is embedded and `record` says how to build it.
fn embed_ebpf_object() {
    println!("cargo:rerun-if-env-changed=PYEBPF_EBPF_OBJECT");
    let out = PathBuf::from(env::var_os("OUT_DIR").unwrap()).join("pyebpf-ebpf.o");
    let default = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/ebpf/bpfel-unknown-none/release/pyebpf");
    let source = env::var_os("PYEBPF_EBPF_OBJECT").map(PathBuf::from).unwrap_or(default);
    println!("cargo:rerun-if-changed={}", source.display());
    match std::fs::read(&source) {
        Ok(object) => std::fs::write(&out, object).expect("write OUT_DIR"),
        Err(_) => std::fs::write(&out, b"").expect("write OUT_DIR"),
    }
}

fn compile_profile_proto() {
    println!("cargo:rerun-if-changed=proto/profile.proto");
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc for this host");
    prost_build::Config::new().protoc_executable(protoc).compile_protos(&["proto/profile.proto"], &["proto"]).expect("compile proto/profile.proto");
}
