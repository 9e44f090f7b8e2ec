//! `step_gpu`'s GPM and MFU columns, filled at the session's end once every
//! other per-step figure is in (`steps.flops` among them): the rows are read
//! here, the figures derived by `correlate::step_mfu`, and written back.
use std::collections::HashMap;

use rusqlite::{Connection, OptionalExtension, params};

use crate::correlate::{
    GaugeSeries,
    gpm::Reading,
    mfu::{Precision, dominant},
    per_step::StepSpan,
    step_mfu::{GpmSeries, GpuForMfu, StepFlops, step_mfu},
};

/// Fills the GPM and MFU columns of the session's `step_gpu` rows for the
/// sampled GPUs `gpus`; an SM clock reading counts within `max_gap_ns`.
/// `ids`: (the session whose steps these are, the session whose GPUs and
/// samples to read: a job's first). Another process of a job has its FLOPs go
/// to its own GPUs (`AtFinish::RankGpus`: those NVML listed it on, else its
/// LOCAL_RANK's, else every sampled one), evenly; the `gpus.used_by_target`
/// flags are the first target's alone.
pub(super) fn write(conn: &Connection, ids: (i64, i64), gpus: &[u32], max_gap_ns: u64) -> rusqlite::Result<()> {
    let (session, samples_from) = ids;
    let steps = load_steps(conn, session)?;
    let mut info = Vec::new();
    let mut series = Vec::new();
    for &gpu in gpus {
        // A GPU without its `gpus` row is one nobody can name: no peak, no MFU.
        let unnamed = GpuForMfu { gpu, name: None, max_sm_clock_mhz: None, used_by_target: false };
        info.push(
            conn.query_row(
                "SELECT name, max_sm_clock_mhz, used_by_target FROM gpus WHERE session_id = ?1 AND gpu = ?2",
                params![samples_from, gpu],
                |r| {
                    let used_by_target = session != samples_from || r.get::<_, bool>(2)?;
                    Ok(GpuForMfu { gpu, name: r.get(0)?, max_sm_clock_mhz: r.get(1)?, used_by_target })
                },
            )
            .optional()?
            .unwrap_or(unnamed),
        );
        series.push(load_gpm(conn, samples_from, gpu)?);
    }
    let mut update = conn.prepare(
        "UPDATE step_gpu SET tensor_util_pct = ?5, hmma_util_pct = ?6, dfma_util_pct = ?7, sm_util_pct = ?8,
                             sm_occupancy_pct = ?9, dram_bw_util_pct = ?10, flops = ?11, mfu_pct = ?12,
                             mfu_gpm_pct = ?13
         WHERE session_id = ?1 AND label = ?2 AND step = ?3 AND gpu = ?4",
    )?;
    for r in step_mfu(&steps, &info, &series, max_gap_ns) {
        let g = r.gpm;
        update.execute(params![
            session,
            r.label,
            r.step,
            r.gpu,
            g[0],
            g[1],
            g[2],
            g[3],
            g[4],
            g[5],
            r.flops,
            r.mfu_pct,
            r.mfu_gpm_pct
        ])?;
    }
    Ok(())
}

/// (precision, FLOPs) of each group of a step's GEMM rows, by (label, step).
type GemmGroups = HashMap<(String, i64), Vec<(Option<Precision>, i64)>>;

/// Every step with its FLOPs and the precision of its GEMM rows (see [`dominant`]).
fn load_steps(conn: &Connection, session: i64) -> rusqlite::Result<Vec<StepFlops>> {
    let mut groups = GemmGroups::new();
    let mut stmt = conn.prepare(
        "SELECT label, step, data_type, compute_type, sum(flops) FROM gemms
         WHERE session_id = ?1 AND label IS NOT NULL AND step IS NOT NULL
         GROUP BY label, step, data_type, compute_type",
    )?;
    let mut rows = stmt.query([session])?;
    while let Some(r) = rows.next()? {
        let (data, compute): (Option<String>, Option<String>) = (r.get(2)?, r.get(3)?);
        let precision = Precision::of(data.as_deref(), compute.as_deref());
        groups.entry((r.get(0)?, r.get(1)?)).or_default().push((precision, r.get(4)?));
    }
    // Without GEMM rows (`--launches count`), the types the cuBLAS probes
    // noted per step: those of the GEMMs that did most of its FLOPs.
    conn.prepare(
        "SELECT label, step, start_ns, end_ns, flops, gemm_data_type, gemm_compute_type
         FROM steps WHERE session_id = ?1 ORDER BY label, step",
    )?
    .query_map([session], |r| {
        let span = StepSpan {
            label: r.get(0)?,
            step: r.get(1)?,
            start_ns: r.get::<_, i64>(2)? as u64,
            end_ns: r.get::<_, Option<i64>>(3)?.map(|e| e as u64),
        };
        let (data, compute): (Option<String>, Option<String>) = (r.get(5)?, r.get(6)?);
        let precision = match groups.get(&(span.label.clone(), span.step)) {
            Some(g) => dominant(g),
            None if data.is_none() && compute.is_none() => None,
            None => Some(Precision::of(data.as_deref(), compute.as_deref())),
        };
        Ok(StepFlops { span, flops: r.get(4)?, precision })
    })?
    .collect()
}

/// One GPU's GPM intervals and SM clock readings.
fn load_gpm(conn: &Connection, session: i64, gpu: u32) -> rusqlite::Result<GpmSeries> {
    let mut stmt = conn.prepare(
        "SELECT ts_ns, sm_clock_mhz, gpm_start_ns, tensor_util_pct, hmma_util_pct, dfma_util_pct, sm_util_pct,
                sm_occupancy_pct, dram_bw_util_pct
         FROM gpu_samples WHERE session_id = ?1 AND gpu = ?2 ORDER BY ts_ns",
    )?;
    let mut out = GpmSeries::default();
    let mut clock = Vec::new();
    let mut rows = stmt.query(params![session, gpu])?;
    while let Some(r) = rows.next()? {
        let ts = r.get::<_, i64>(0)? as u64;
        if let Some(mhz) = r.get::<_, Option<f64>>(1)? {
            clock.push((ts, mhz));
        }
        let Some(start) = r.get::<_, Option<i64>>(2)? else { continue };
        for (k, series) in out.readings.iter_mut().enumerate() {
            if let Some(value) = r.get::<_, Option<f64>>(3 + k)? {
                series.push(Reading { start_ns: start as u64, end_ns: ts, value });
            }
        }
    }
    out.sm_clock_mhz = GaugeSeries { points: clock };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::*;
    use crate::{
        samplers::testing::{end, open_store, step_row},
        store::{AtFinish, GpmReadings, GpuRow, GpuSampleRow, StoreMsg},
    };

    const MS: u64 = 1_000_000;

    fn h100(gpu: u32) -> GpuRow {
        GpuRow {
            gpu,
            nvml_index: gpu,
            uuid: format!("GPU-{gpu}"),
            name: Some("NVIDIA H100 80GB HBM3".into()),
            memory_total_mib: None,
            power_limit_w: None,
            driver_version: None,
            power_source: "instant",
            max_sm_clock_mhz: Some(1980.0),
        }
    }

    /// GPU `gpu` every 50 ms from 0 to 400 ms at 1485 MHz; GPM every 100 ms:
    /// tensor activity 20 % over (0, 100], 40 % over (100, 200], …
    fn samples(gpu: u32) -> Vec<GpuSampleRow> {
        (0..=8u64)
            .map(|k| GpuSampleRow {
                gpu,
                ts_ns: 50 * MS * k,
                sm_clock_mhz: Some(1485.0),
                gpm: (k > 0 && k % 2 == 0).then(|| GpmReadings {
                    start_ns: 50 * MS * (k - 2),
                    tensor_util_pct: Some(10.0 * k as f64),
                    hmma_util_pct: Some(1.0),
                    dfma_util_pct: None,
                    sm_util_pct: Some(90.0),
                    sm_occupancy_pct: Some(30.0),
                    dram_bw_util_pct: Some(12.5),
                }),
                ..Default::default()
            })
            .collect()
    }

    type Row = (i64, i64, [Option<f64>; 6], Option<i64>, Option<f64>, Option<f64>);

    fn rows(conn: &Connection) -> Vec<Row> {
        conn.prepare(
            "SELECT step, gpu, tensor_util_pct, hmma_util_pct, dfma_util_pct, sm_util_pct, sm_occupancy_pct,
                    dram_bw_util_pct, flops, mfu_pct, mfu_gpm_pct
             FROM step_gpu ORDER BY step, gpu",
        )
        .expect("prepare")
        .query_map([], |r| {
            let mut g = [None; 6];
            for (k, v) in g.iter_mut().enumerate() {
                *v = r.get(2 + k)?;
            }
            Ok((r.get(0)?, r.get(1)?, g, r.get(8)?, r.get(9)?, r.get(10)?))
        })
        .expect("q")
        .collect::<rusqlite::Result<_>>()
        .expect("rows")
    }

    #[test]
    fn gpm_readings_and_mfu_reach_step_gpu() {
        let (_dir, path) = crate::store::testing::temp_db();
        let (store, id) = open_store(&path);
        let w = store.spawn_writer(id);
        w.send(StoreMsg::Gpus(vec![h100(0), h100(1)]));
        w.send(StoreMsg::GpuSamples([samples(0), samples(1)].concat()));
        w.send(StoreMsg::GpusUsedByTarget(vec![1]));
        // Step 0 inside one GPM interval, step 1 across two, step 2 never ended.
        let steps = vec![
            step_row(0, 20 * MS, Some(70 * MS)),
            step_row(1, 150 * MS, Some(250 * MS)),
            step_row(2, 300 * MS, None),
        ];
        w.send(StoreMsg::Steps(steps));
        let work = AtFinish::StepGpu { gpus: vec![0, 1], max_gap_ns: 100 * MS, energy_resolution_j: 0.001 };
        let stats = w.finish(end(), vec![work]).expect("finish");
        assert_eq!(stats.first_error, None);

        let conn = Connection::open(&path).expect("reopen");
        let got = rows(&conn);
        assert_eq!(got.len(), 6);
        let gpm = |tensor| [Some(tensor), Some(1.0), None, Some(90.0), Some(30.0), Some(12.5)];
        // No BLAS library: no FLOPs and no MFU; the GPM estimate only on the GPU the target used.
        assert_eq!(got[0], (0, 0, gpm(20.0), None, None, None));
        assert_eq!(got[1], (0, 1, gpm(20.0), None, None, Some(15.0)));
        // Half of step 1 at 40 %, half at 60 %.
        assert_eq!(got[3], (1, 1, gpm(50.0), None, None, Some(37.5)));
        assert_eq!(got[5], (2, 1, [None; 6], None, None, None));

        // The step's FLOPs, as the cuBLAS probes write them: 98.95 TFLOP in 100 ms on an H100 at
        // BF16 (989.5 TFLOP/s, the default without GEMM rows) is 100 %; then FP32 GEMM rows (67 TFLOP/s).
        conn.execute("UPDATE steps SET flops = 98950000000000 WHERE step = 1", []).expect("flops");
        write(&conn, (id, id), &[0, 1], 100 * MS).expect("derive");
        let got = rows(&conn);
        assert_eq!((got[2].3, got[2].4), (None, None), "GPU 0 was not the target's");
        assert_eq!(got[3].3, Some(98_950_000_000_000));
        assert!((got[3].4.expect("mfu") - 100.0).abs() < 1e-9, "{:?}", got[3]);
        conn.execute(
            "INSERT INTO gemms(session_id, tid, ts_ns, op, m, n, k, batch, flops, data_type, compute_type, label, step)
             VALUES (?1, 1, 0, 'cublasSgemm_v2', 1, 1, 1, 1, 2, 'CUDA_R_32F', 'CUBLAS_COMPUTE_32F', 'train', 1)",
            [id],
        )
        .expect("gemm");
        write(&conn, (id, id), &[0, 1], 100 * MS).expect("derive");
        let mfu = rows(&conn)[3].4.expect("mfu");
        assert!((mfu - 100.0 * 989.5 / 67.0).abs() < 1e-9, "{mfu}");
        // `--launches count`: no rows, the step's dominant types instead.
        conn.execute_batch(
            "DELETE FROM gemms; UPDATE steps SET gemm_data_type = 'CUDA_R_32F', gemm_compute_type = 'CUBLAS_COMPUTE_32F' WHERE step = 1",
        )
        .expect("types");
        write(&conn, (id, id), &[0, 1], 100 * MS).expect("derive");
        assert_eq!(rows(&conn)[3].4, Some(mfu));
    }

    /// Another process of a job: its FLOPs go to the GPUs it was given (its
    /// `RankGpus`), evenly, whichever GPUs the first target was seen on; its
    /// MFU is measured against its own share.
    #[test]
    fn a_ranks_flops_go_evenly_to_its_own_gpus() {
        let (_dir, path) = crate::store::testing::temp_db();
        let (store, first) = open_store(&path);
        let w = store.spawn_writer(first);
        w.send(StoreMsg::Gpus(vec![h100(0), h100(1), h100(2)]));
        w.send(StoreMsg::GpusUsedByTarget(vec![0]));
        let work = AtFinish::StepGpu { gpus: vec![0, 1, 2], max_gap_ns: 100 * MS, energy_resolution_j: 0.001 };
        w.finish(end(), vec![work]).expect("finish");

        let conn = Connection::open(&path).expect("reopen");
        conn.execute_batch(&format!(
            "INSERT INTO sessions (id, pid, command, mode, launch_mode, started_ns, unix_offset_ns, profiler_version, job)
             SELECT {first} + 1, 2, 'rank 1', mode, launch_mode, started_ns, unix_offset_ns, profiler_version, job
             FROM sessions WHERE id = {first};
             INSERT INTO steps (session_id, label, step, tid, start_ns, end_ns, flops)
             VALUES ({first} + 1, 'train', 0, 2, 0, 100000000, 98950000000000);
             INSERT INTO step_gpu (session_id, label, step, gpu)
             VALUES ({first} + 1, 'train', 0, 0), ({first} + 1, 'train', 0, 1), ({first} + 1, 'train', 0, 2);"
        ))
        .expect("a second process's session");
        let rank = first + 1;
        let flops_and_mfu = |gpus: &[u32]| -> Vec<(i64, Option<i64>, Option<f64>)> {
            conn.execute("UPDATE step_gpu SET flops = NULL, mfu_pct = NULL WHERE session_id = ?1", [rank])
                .expect("clear");
            write(&conn, (rank, first), gpus, 100 * MS).expect("derive");
            conn.prepare("SELECT gpu, flops, mfu_pct FROM step_gpu WHERE session_id = ?1 ORDER BY gpu")
                .expect("prepare")
                .query_map([rank], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                .expect("query")
                .collect::<rusqlite::Result<_>>()
                .expect("rows")
        };
        // Its GPUs 1 and 2 (not the first target's GPU 0): half each, 50 % of an H100's BF16 peak.
        let got = flops_and_mfu(&[1, 2]);
        assert_eq!(got[0], (0, None, None));
        for (gpu, row) in [1, 2].into_iter().zip(&got[1..]) {
            assert_eq!((row.0, row.1), (gpu, Some(49_475_000_000_000)));
            assert!((row.2.expect("mfu") - 50.0).abs() < 1e-9, "{row:?}");
        }
        // GPUs 0 and 1, GPU 0 shared with the first target: still half each.
        let got = flops_and_mfu(&[0, 1]);
        assert_eq!((got[0].1, got[1].1, got[2].1), (Some(49_475_000_000_000), Some(49_475_000_000_000), None));
        // One GPU of its own: all of it there, 100 %.
        let got = flops_and_mfu(&[2]);
        assert_eq!((got[0].1, got[1].1, got[2].1), (None, None, Some(98_950_000_000_000)));
        assert!((got[2].2.expect("mfu") - 100.0).abs() < 1e-9, "{:?}", got[2]);
    }
}
