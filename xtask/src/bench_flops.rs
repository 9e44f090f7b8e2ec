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
use std::{
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use crate::{fixtures_dir, profiler_bin, say};

const CALLS: u64 = 50_000;
const REPEATS: usize = 3;

/// (trainer's name, row label, probe hits per GEMM).
const OPS: [(&str, &str, u32); 3] = [
    ("sgemm", "cublasSgemm_v2", 1),
    ("strided", "cublasGemmStridedBatchedEx", 1),
    ("lt", "cublasLtMatmul with its descriptors", 14),
];

/// ns per GEMM of one run, traced by the profiler when `traced`.
fn run_once(op: &str, traced: bool, work: &Path) -> Result<f64> {
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
    let agent = if traced {
        let mut c = Command::new(profiler_bin())
            .args(["attach", &trainer.id().to_string(), "--no-gpu", "--step-symbol", "train_step", "-o"])
            .arg(&db)
            .stderr(Stdio::piped())
            .spawn()
            .context("start the profiler")?;
        crate::bench::wait_for_line(c.stderr.take().context("stderr")?, "tracing PID")?;
        Some(c)
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
        crate::bench::wait_rusage(&a)?;
    }
    let text = std::fs::read_to_string(&truth).with_context(|| format!("read {}", truth.display()))?;
    let line = text.lines().find_map(|l| l.strip_prefix("bench ")).context("no 'bench' line in the truth")?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let [_, n, ns, _] = words[..] else { bail!("malformed 'bench' line: {line}") };
    Ok(ns.parse::<f64>()? / n.parse::<f64>()?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Prints untraced vs traced ns per GEMM call.
pub fn flops_table(work: &Path) -> Result<()> {
    let mut rows = Vec::new();
    for (op, label, hits) in OPS {
        say(format!("bench: GEMM calls: {label} ({REPEATS} runs of {CALLS}, untraced and traced)"));
        let untraced = median((0..REPEATS).map(|_| run_once(op, false, work)).collect::<Result<_>>()?);
        let traced = median((0..REPEATS).map(|_| run_once(op, true, work)).collect::<Result<_>>()?);
        rows.push((label, hits, untraced, traced));
    }
    println!();
    println!("Host cost per traced GEMM call ({CALLS} calls on the stand-ins, median of {REPEATS})");
    println!("| {:<36} | {:>6} | {:>10} | {:>10} | {:>10} |", "GEMM", "probes", "untraced", "traced", "added ns");
    println!("|{:-<38}|{:->8}|{:->12}|{:->12}|{:->12}|", "", "", "", "", "");
    for (label, hits, untraced, traced) in rows {
        println!("| {label:<36} | {hits:>6} | {untraced:>10.0} | {traced:>10.0} | {:>10.0} |", traced - untraced);
    }
    println!("(ns per GEMM; a real GEMM's kernel launch alone costs microseconds more)");
    Ok(())
}
