//! Embeds the eBPF object built by `cargo xtask build-ebpf`.
//!
//! The object is optional at build time so that plain `cargo build` and
//! `cargo test` work on a machine without the eBPF toolchain; a binary built
//! without it says so, and what to run, when asked to attach.
use std::{env, fs, path::PathBuf};

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let object = env::var_os("PROFILER_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest.join("../profiler-ebpf/target/bpfel-unknown-none/release/profiler-ebpf"));
    println!("cargo:rerun-if-env-changed=PROFILER_EBPF_OBJECT");
    println!("cargo:rerun-if-changed={}", object.display());
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("profiler-ebpf.o");
    match fs::read(&object) {
        Ok(bytes) => fs::write(&out, bytes).expect("write OUT_DIR/profiler-ebpf.o"),
        Err(_) => {
            println!(
                "cargo:warning=eBPF object not found at {}: the binary cannot attach; run `cargo xtask build`",
                object.display()
            );
            fs::write(&out, []).expect("write OUT_DIR/profiler-ebpf.o");
        }
    }
}
