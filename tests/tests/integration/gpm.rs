//! NVML GPM and MFU: the real profiler with the stand-in NVML, whose GPM
//! readings are constants per GPU (tests/fixtures/fake_nvml.c): GPU g reads
//! ANY_TENSOR_UTIL 37.5 + 10 g, HMMA 25 + 10 g, DFMA 0.5 + g, SM_UTIL 80 + g,
//! SM_OCCUPANCY 45 + g, DRAM_BW_UTIL 20 + g over any interval, and GPU 1 has
//! no GPM. So every step's time-weighted figure is exactly its GPU's constant.
use integration_tests::*;

const MS: i64 = 1_000_000;

/// The stand-in's GPM readings of NVML device `g`, in `gpu_samples`' column order.
fn readings(g: i64) -> [f64; 6] {
    let g = g as f64;
    [37.5 + 10.0 * g, 25.0 + 10.0 * g, 0.5 + g, 80.0 + g, 45.0 + g, 20.0 + g]
}

/// step, gpu, GPM columns, mfu_gpm_pct, flops, mfu_pct of a `step_gpu` row.
type StepGpuRow = (i64, i64, [Option<f64>; 6], Option<f64>, Option<i64>, Option<f64>);

const GPM: &str = "tensor_util_pct, hmma_util_pct, dfma_util_pct, sm_util_pct, sm_occupancy_pct, dram_bw_util_pct";

#[test]
fn gpm_readings_and_the_mfu_estimate_are_exact_per_step() {
    let dir = workdir("gpm");
    let db = dir.join("p.db");
    let mut trainer =
        Trainer::spawn(&dir, &["--steps", "12", "--launches", "5", "--step-sleep-us", "60000", "--gap-us", "5000"]);
    let nvml = fixtures().join("libnvidia-ml.so.1").display().to_string();
    let args = ["--step-symbol", "train_step", "--nvml-lib", &nvml, "--gpu-interval", "20"];
    // Three GPUs, the SM clock at 1485 of its 1980 MHz.
    let env = [("STANDIN_NVML_GPUS", "3"), ("STANDIN_NVML_SM_CLOCK", "1485")];
    let agent = Agent::attach_with_env(trainer.pid(), &db, &args, &env);
    trainer.go();
    assert!(trainer.wait().success());
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    let s = last_session(&db);
    let conn = open(&db);

    // GPU 0's GPM intervals: back to back, each at least 100 ms, each reading the stand-in's values.
    let rows: Vec<(i64, i64, [f64; 6])> = conn
        .prepare(&format!(
            "SELECT gpm_start_ns, ts_ns, {GPM} FROM gpu_samples
             WHERE session_id = ?1 AND gpu = 0 AND gpm_start_ns IS NOT NULL ORDER BY ts_ns"
        ))
        .expect("prepare")
        .query_map([s.id], |r| {
            let mut v = [0.0; 6];
            for (k, x) in v.iter_mut().enumerate() {
                *x = r.get(2 + k)?;
            }
            Ok((r.get(0)?, r.get(1)?, v))
        })
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert!(rows.len() >= 2, "12 steps of 65 ms span several GPM intervals: {rows:?}");
    for w in rows.windows(2) {
        assert_eq!(w[1].0, w[0].1, "each interval starts where the last ended");
    }
    for &(start, end, v) in &rows {
        assert!(end - start >= 100 * MS, "GPM samples at least 100 ms apart: {start}..{end}");
        assert_eq!(v, readings(0));
    }
    // GPU 1 has no GPM: NULLs, and one reason per metric.
    let gpu1: i64 = conn
        .query_row(
            "SELECT count(*) FROM gpu_samples WHERE session_id = ?1 AND gpu = 1
               AND coalesce(gpm_start_ns, tensor_util_pct, hmma_util_pct, dram_bw_util_pct) IS NOT NULL",
            [s.id],
            |r| r.get(0),
        )
        .expect("gpu 1");
    assert_eq!(gpu1, 0);
    let why: String = conn
        .query_row(
            "SELECT reason FROM capabilities WHERE session_id = ?1 AND metric = 'GPU_1/gpm.tensor_util' AND available = 0",
            [s.id],
            |r| r.get(0),
        )
        .expect("a reason for GPU 1");
    assert!(why.contains("no GPM"), "{why}");

    // Per step: every step on GPUs 0 and 2 gets its GPU's constants; the estimate is tensor × 1485 / 1980.
    let per_step: Vec<StepGpuRow> = conn
        .prepare(&format!(
            "SELECT step, gpu, {GPM}, mfu_gpm_pct, flops, mfu_pct FROM step_gpu WHERE session_id = ?1 ORDER BY step, gpu"
        ))
        .expect("prepare")
        .query_map([s.id], |r| {
            let mut v = [None; 6];
            for (k, x) in v.iter_mut().enumerate() {
                *x = r.get(2 + k)?;
            }
            Ok((r.get(0)?, r.get(1)?, v, r.get(8)?, r.get(9)?, r.get(10)?))
        })
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    let truth = trainer.truth();
    assert_eq!(per_step.len(), truth.steps.len() * 3, "every step on every GPU");
    for (step, gpu, gpm, estimate, flops, mfu) in per_step {
        // No BLAS library in the trainer: no FLOPs, no MFU.
        assert_eq!((flops, mfu), (None, None), "step {step} GPU {gpu}");
        if gpu == 1 {
            assert_eq!((gpm, estimate), ([None; 6], None), "step {step}");
            continue;
        }
        for (got, want) in gpm.iter().zip(readings(gpu)) {
            let got = got.unwrap_or_else(|| panic!("step {step} GPU {gpu}: {gpm:?}"));
            assert!((got - want).abs() < 1e-9, "step {step} GPU {gpu}: {got} vs {want}");
        }
        let want = readings(gpu)[0] * 1485.0 / 1980.0;
        let got = estimate.unwrap_or_else(|| panic!("step {step} GPU {gpu}: no estimate"));
        assert!((got - want).abs() < 1e-9, "step {step} GPU {gpu}: {got} vs {want}");
    }
    let max_clock: Option<f64> = conn
        .query_row("SELECT max_sm_clock_mhz FROM gpus WHERE session_id = ?1 AND gpu = 0", [s.id], |r| r.get(0))
        .expect("gpus");
    assert_eq!(max_clock, Some(1980.0));
}
