//! GEMM rows (`gemms`) and the per-step GEMM sums (`steps.flops`,
//! `steps.gemm_calls`).
use rusqlite::{Transaction, params};

use super::writer::i;

/// One GEMM call seen on cuBLAS/cuBLASLt (`gemms`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GemmRow {
    pub ts_ns: u64,
    pub tid: u32,
    /// The entry point (`cublasGemmEx`, `cublasLtMatmul`, …).
    pub op: &'static str,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub batch: u64,
    /// 2·m·n·k·batch.
    pub flops: u64,
    /// cuBLAS's names (`CUDA_R_16BF`, `CUBLAS_COMPUTE_32F`); None where unknown.
    pub data_type: Option<String>,
    pub compute_type: Option<String>,
    /// The step the calling thread was in: (label, step).
    pub step: Option<(&'static str, u64)>,
}

/// A step's GEMM sums: (label, step, FLOPs, calls), sent once the session's
/// steps are all stored.
pub type StepGemms = (&'static str, u64, u64, u64);

pub(super) fn write_gemms(tx: &Transaction<'_>, session_id: i64, rows: &[GemmRow]) -> rusqlite::Result<()> {
    let mut stmt = tx.prepare_cached(
        "INSERT INTO gemms(session_id, tid, ts_ns, op, m, n, k, batch, flops, data_type, compute_type, label, step)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
    )?;
    for r in rows {
        stmt.execute(params![
            session_id,
            r.tid,
            i(r.ts_ns),
            r.op,
            i(r.m),
            i(r.n),
            i(r.k),
            i(r.batch),
            i(r.flops),
            r.data_type,
            r.compute_type,
            r.step.map(|s| s.0),
            r.step.map(|s| i(s.1))
        ])?;
    }
    Ok(())
}

/// `steps.flops` and `steps.gemm_calls`: the sums where a step issued GEMMs;
/// 0 for the others once a BLAS library was probed (its `probed_files` row),
/// NULL (left) where none was.
pub(super) fn write_step_gemms(tx: &Transaction<'_>, session_id: i64, sums: &[StepGemms]) -> rusqlite::Result<()> {
    tx.execute(
        "UPDATE steps SET flops = 0, gemm_calls = 0 WHERE session_id = ?1 AND EXISTS (
             SELECT 1 FROM probed_files WHERE session_id = ?1 AND kind IN ('cublas', 'cublasLt') AND probes > 0)",
        params![session_id],
    )?;
    let mut stmt = tx.prepare_cached(
        "UPDATE steps SET flops = ?4, gemm_calls = ?5 WHERE session_id = ?1 AND label = ?2 AND step = ?3",
    )?;
    for &(label, step, flops, calls) in sums {
        stmt.execute(params![session_id, label, i(step), i(flops), i(calls)])?;
    }
    Ok(())
}
