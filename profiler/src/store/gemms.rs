//! GEMM rows (`gemms`) and the per-step GEMM sums (`steps.flops`,
//! `steps.gemm_calls`).
use rusqlite::{Transaction, params};

use super::i;

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

/// A step's GEMM sums, sent once the session's steps are all stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepGemms {
    pub label: &'static str,
    pub step: u64,
    pub flops: u64,
    pub calls: u64,
    /// The data and compute types of the GEMMs that did most of its FLOPs
    /// (`steps.gemm_data_type`, `steps.gemm_compute_type`).
    pub data_type: Option<String>,
    pub compute_type: Option<String>,
}

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
/// 0 for the others once a BLAS library was probed (its `probed_files` row,
/// in any session of the job: one file-wide probe serves them all), NULL
/// (left) where none was.
pub(super) fn write_step_gemms(tx: &Transaction<'_>, session_id: i64, sums: &[StepGemms]) -> rusqlite::Result<()> {
    zero_steps_without_gemms(tx, session_id)?;
    write_step_sums(tx, session_id, sums)
}

/// The 0 of [`write_step_gemms`], once, at the end (a scan of the session's
/// steps): steps whose sums came before (`StepGemmsSoFar`) keep them.
fn zero_steps_without_gemms(tx: &Transaction<'_>, session_id: i64) -> rusqlite::Result<()> {
    tx.execute(
        "UPDATE steps SET flops = 0, gemm_calls = 0 WHERE session_id = ?1 AND flops IS NULL AND EXISTS (
             SELECT 1 FROM probed_files WHERE kind IN ('cublas', 'cublasLt') AND probes > 0
               AND session_id IN (SELECT id FROM sessions WHERE job = (SELECT job FROM sessions WHERE id = ?1)))",
        params![session_id],
    )?;
    Ok(())
}

/// Sums of steps that ended (`StoreMsg::StepGemmsSoFar`), and at the end the rest.
pub(super) fn write_step_sums(tx: &Transaction<'_>, session_id: i64, sums: &[StepGemms]) -> rusqlite::Result<()> {
    let mut stmt = tx.prepare_cached(
        "UPDATE steps SET flops = ?4, gemm_calls = ?5, gemm_data_type = ?6, gemm_compute_type = ?7
         WHERE session_id = ?1 AND label = ?2 AND step = ?3",
    )?;
    for s in sums {
        let (flops, calls) = (i(s.flops), i(s.calls));
        stmt.execute(params![session_id, s.label, i(s.step), flops, calls, s.data_type, s.compute_type])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{super::testing::*, *};
    use crate::store::{ProbedFileRow, SessionEnd, StepRow, Store, StoreMsg};

    /// (step, flops, gemm_calls) as stored.
    type Stored = (i64, Option<i64>, Option<i64>);

    /// Steps 0 and 1; GEMM sums for step 1; with or without a probed cuBLAS:
    /// the steps as stored, and step 1's types.
    /// `so_far`: step 1's sums sent as it ended, then an empty `StepGemms` at the end.
    fn stored(blas_probed: bool, so_far: bool) -> (Vec<Stored>, (String, String)) {
        let (_d, p) = temp_db();
        let store = Store::open(&p).expect("open");
        let id = store.begin_session(&start()).expect("session");
        let w = store.spawn_writer(id);
        if blas_probed {
            w.send(StoreMsg::ProbedFile(ProbedFileRow {
                path: "/lib/libcublas.so.13".into(),
                placed: Vec::new(),
                kind: "cublas".into(),
                attached_ns: 1,
                probes: 14,
                how: "maps".into(),
            }));
        }
        w.send(StoreMsg::Steps(vec![step(), StepRow { step: 1, start_ns: 300, end_ns: Some(400), ..step() }]));
        w.send(StoreMsg::Gemms(vec![GemmRow {
            ts_ns: 350,
            tid: 7,
            op: "cublasGemmEx",
            m: 2,
            n: 3,
            k: 4,
            batch: 1,
            flops: 48,
            data_type: Some("CUDA_R_16BF".into()),
            compute_type: Some("CUBLAS_COMPUTE_32F".into()),
            step: Some(("train", 1)),
        }]));
        let sums = vec![StepGemms {
            label: "train",
            step: 1,
            flops: 48,
            calls: 1,
            data_type: Some("CUDA_R_16BF".into()),
            compute_type: Some("CUBLAS_COMPUTE_32F".into()),
        }];
        if so_far {
            w.send(StoreMsg::StepGemmsSoFar(sums));
            w.send(StoreMsg::StepGemms(Vec::new()));
        } else {
            w.send(StoreMsg::StepGemms(sums));
        }
        let end = SessionEnd {
            ended_ns: 500,
            end_reason: "target-exited".into(),
            lost_events: 0,
            total_launches: 0,
            unmatched_returns: 0,
        };
        let stats = w.finish(end, Vec::new()).expect("finish");
        assert_eq!(stats.failed_rows, 0, "{:?}", stats.first_error);
        let conn = rusqlite::Connection::open(&p).expect("reopen");
        let rows: i64 = conn.query_row("SELECT count(*) FROM gemms WHERE step = 1", [], |r| r.get(0)).expect("gemms");
        assert_eq!(rows, 1);
        let types = conn
            .query_row("SELECT gemm_data_type, gemm_compute_type FROM steps WHERE step = 1", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .expect("types");
        let mut stmt = conn.prepare("SELECT step, flops, gemm_calls FROM steps ORDER BY step").expect("query");
        let steps =
            stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).expect("rows").map(|r| r.expect("row"));
        (steps.collect(), types)
    }

    #[test]
    fn steps_without_gemms_are_0_once_blas_was_probed_and_null_otherwise() {
        for so_far in [false, true] {
            let (steps, types) = stored(true, so_far);
            assert_eq!(steps, [(0, Some(0), Some(0)), (1, Some(48), Some(1))], "so far: {so_far}");
            assert_eq!(types, ("CUDA_R_16BF".into(), "CUBLAS_COMPUTE_32F".into()));
            // The sums alone (no library row) say nothing about the other steps.
            assert_eq!(stored(false, so_far).0, [(0, None, None), (1, Some(48), Some(1))]);
        }
    }
}
