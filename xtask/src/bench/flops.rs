//! `cargo xtask bench`, GEMM part: what counting GEMM FLOPs costs the calling
//! thread, per GEMM, on the cuBLAS/cuBLASLt stand-ins. Prints a table;
//! asserts nothing.
//!
//! The GEMM trainer (`tests/fixtures/gemm_trainer.c --bench OP N`) times N
//! GEMMs of one kind: a classic `cublasSgemm_v2` (one probe, registers and
//! the stack copied), `cublasGemmStridedBatchedEx` (the same, its batch
//! count on the stack), and `cublasLtMatmul` as PyTorch's `gemm_and_bias`
//! drives it (a descriptor and four layouts created, set and destroyed around
//! each call: 14 probe hits, two of them return probes).
use std::{path::Path, process::Command};

use anyhow::{Context, Result, bail};

use super::harness;
use crate::{fixtures_dir, say};

const CALLS: u64 = 50_000;
const REPEATS: usize = 3;

/// (trainer's name, row label, probe hits per GEMM, the symbol a bare probe goes on).
const OPS: [(&str, &str, u32, Option<&str>); 3] = [
    ("sgemm", "cublasSgemm_v2", 1, Some("cublasSgemm_v2")),
    ("strided", "cublasGemmStridedBatchedEx", 1, Some("cublasGemmStridedBatchedEx")),
    ("lt", "cublasLtMatmul with its descriptors", 14, None),
];

/// What watches the trainer in a run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Untraced,
    /// An empty program where the profiler puts its probe on the GEMM: the floor.
    Bare,
    Profiler,
}

/// ns per GEMM of one run.
fn run_once(op: &str, symbol: &str, mode: Mode, work: &Path) -> Result<f64> {
    let (truth, go, db) = (work.join("gemm_truth.txt"), work.join("gemm_go"), work.join("gemm_bench.db"));
    for p in [&truth, &go, &db] {
        let _ = std::fs::remove_file(p);
    }
    let mut trainer = Command::new(fixtures_dir().join("gemm_trainer"))
        .args(["--bench", op, &CALLS.to_string(), "--truth"])
        .arg(&truth)
        .arg("--wait-file")
        .arg(&go)
        .env("LD_LIBRARY_PATH", fixtures_dir())
        .spawn()
        .context("start the GEMM trainer")?;
    let bare = if mode == Mode::Bare {
        Some(harness::bare_probe(trainer.id(), &fixtures_dir().join("libcublas.so.13"), symbol, true)?)
    } else {
        None
    };
    let agent = if mode == Mode::Profiler {
        Some(harness::attach_agent(trainer.id(), &["--no-gpu", "--step-symbol", "train_step"], &db)?)
    } else {
        None
    };
    std::fs::write(&go, b"")?;
    let status = trainer.wait()?;
    if !status.success() {
        bail!("GEMM trainer: {status}");
    }
    if let Some(a) = agent {
        // A profiler that failed would make the traced row a lie.
        harness::wait_rusage(&a)?;
    }
    if let Some(mut b) = bare {
        // It waits for a signal; its probe goes with it.
        b.kill()?;
        b.wait()?;
    }
    let text = std::fs::read_to_string(&truth).with_context(|| format!("read {}", truth.display()))?;
    let line = text.lines().find_map(|l| l.strip_prefix("bench ")).context("no 'bench' line in the truth")?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let [_, n, ns, _] = words[..] else { bail!("malformed 'bench' line: {line}") };
    Ok(ns.parse::<f64>()? / n.parse::<f64>()?)
}

/// Prints untraced vs traced ns per GEMM call.
pub fn flops_table(work: &Path) -> Result<()> {
    let mut rows = Vec::new();
    for (op, label, hits, bare_symbol) in OPS {
        say(format!("bench: GEMM calls: {label} ({REPEATS} runs of {CALLS}: untraced, bare uprobe, profiler)"));
        let runs = |mode| -> Result<f64> {
            Ok(harness::median(
                (0..REPEATS).map(|_| run_once(op, bare_symbol.unwrap_or(label), mode, work)).collect::<Result<_>>()?,
            ))
        };
        let untraced = runs(Mode::Untraced)?;
        let bare = bare_symbol.map(|_| runs(Mode::Bare)).transpose()?;
        let traced = runs(Mode::Profiler)?;
        rows.push((label, hits, untraced, bare, traced));
    }
    println!();
    println!("Host cost per traced GEMM call ({CALLS} calls on the stand-ins, ns per GEMM, median of {REPEATS})");
    println!(
        "| {:<36} | {:>6} | {:>9} | {:>9} | {:>9} | {:>9} |",
        "GEMM", "probes", "untraced", "bare", "profiler", "added ns"
    );
    println!("|{:-<38}|{:->8}|{:->11}|{:->11}|{:->11}|{:->11}|", "", "", "", "", "", "");
    for (label, hits, untraced, bare, traced) in rows {
        let bare = bare.map_or("-".to_string(), |b| format!("{b:.0}"));
        println!(
            "| {label:<36} | {hits:>6} | {untraced:>9.0} | {bare:>9} | {traced:>9.0} | {:>9.0} |",
            traced - untraced
        );
    }
    println!("(bare: an empty program where the profiler's probe goes; a real GEMM's launch costs microseconds more)");
    Ok(())
}
