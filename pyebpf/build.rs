use std::env;
use std::path::PathBuf;

fn main() {
    embed_ebpf_object();
    compile_profile_proto();
}

/// Copies the eBPF object built by `cargo xtask build` into OUT_DIR so the binary embeds it.
/// Without one (a plain `cargo check`), an empty file is embedded and `record` says how to build it.
fn embed_ebpf_object() {
    println!("cargo:rerun-if-env-changed=PYEBPF_EBPF_OBJECT");
    let out = PathBuf::from(env::var_os("OUT_DIR").unwrap()).join("pyebpf-ebpf.o");
    match env::var_os("PYEBPF_EBPF_OBJECT") {
        Some(src) => {
            println!("cargo:rerun-if-changed={}", PathBuf::from(&src).display());
            std::fs::copy(&src, &out).expect("copy the eBPF object named by PYEBPF_EBPF_OBJECT");
        }
        None => std::fs::write(&out, b"").expect("write OUT_DIR"),
    }
}

/// Generates the pprof message types from `proto/profile.proto` with the vendored protoc, so no
/// system protoc is needed.
fn compile_profile_proto() {
    println!("cargo:rerun-if-changed=proto/profile.proto");
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc for this host");
    prost_build::Config::new()
        .protoc_executable(protoc)
        .compile_protos(&["proto/profile.proto"], &["proto"])
        .expect("compile proto/profile.proto");
}
