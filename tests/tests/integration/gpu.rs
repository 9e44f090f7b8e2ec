//! GPU telemetry: the real profiler with the stand-in NVML (readings that are
//! known functions of time; see tests/fixtures/fake_nvml.c) and with the
//! genuine NVIDIA library (whose "driver not loaded" is checked where the host
//! has no NVIDIA driver, and skipped visibly where it has one).
use std::path::PathBuf;

use integration_tests::*;

fn stand_in_nvml() -> String {
    fixtures().join("libnvidia-ml.so.1").display().to_string()
}

/// The stand-in's constant power of NVML device `g`, W.
fn power_w(nvml_index: i64) -> f64 {
    100.0 + 50.0 * nvml_index as f64
}

/// Runs the trainer under `profiler attach` with the stand-in NVML exposing 3
/// GPUs and the target seeing physical GPUs 2 and 1 (its logical 0 and 1).
fn profiled(name: &str, trainer: &[&str], extra: &[&str]) -> (PathBuf, Session, String) {
    let dir = workdir(name);
    let db = dir.join("p.db");
    let truth = dir.join("truth.txt");
    let go = dir.join("go");
    let mut child = std::process::Command::new(fixtures().join("trainer"))
        .args(trainer)
        .arg("--truth")
        .arg(&truth)
        .arg("--wait-file")
        .arg(&go)
        .env("LD_LIBRARY_PATH", fixtures())
        .env("CUDA_VISIBLE_DEVICES", "2,1")
        .spawn()
        .expect("trainer");
    let nvml = stand_in_nvml();
    let mut args = vec!["--step-symbol", "train_step", "--nvml-lib", &nvml];
    args.extend_from_slice(extra);
    let agent = Agent::attach_with_env(child.id(), &db, &args, &[("STANDIN_NVML_GPUS", "3")]);
    std::fs::write(&go, b"").expect("go");
    assert!(child.wait().expect("wait").success());
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    let s = last_session(&db);
    (db, s, stderr)
}

#[test]
fn per_step_gpu_energy_is_within_its_bound_and_gpus_follow_cuda_visible_devices() {
    let (db, s, _) = profiled(
        "gpu-energy",
        &["--steps", "30", "--launches", "10", "--step-sleep-us", "40000", "--gap-us", "5000"],
        &["--gpu-interval", "10"],
    );
    let conn = open(&db);
    let gpus: Vec<(i64, i64, String)> = conn
        .prepare("SELECT gpu, nvml_index, uuid FROM gpus WHERE session_id = ?1 ORDER BY gpu")
        .expect("prepare")
        .query_map([s.id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert_eq!(gpus.iter().map(|g| (g.0, g.1)).collect::<Vec<_>>(), vec![(0, 2), (1, 1)], "logical → NVML index");
    assert!(gpus[0].2.ends_with("000000000002"));

    let rows: Vec<(i64, i64, f64, f64, f64, i64, i64)> = conn
        .prepare(
            "SELECT g.gpu, n.nvml_index, g.energy_j, g.energy_error_j, s.duration_ns / 1e9, g.below_resolution, s.step
             FROM step_gpu g JOIN steps s USING (session_id, label, step) JOIN gpus n USING (session_id, gpu)
             WHERE g.session_id = ?1 ORDER BY s.step, g.gpu",
        )
        .expect("prepare")
        .query_map([s.id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert_eq!(rows.len(), 60, "30 steps × 2 GPUs");
    let (mut rel, mut bound_sum, mut err_sum) = (Vec::new(), 0.0, 0.0);
    for &(gpu, nvml, energy, bound, secs, below, step) in &rows {
        let truth = power_w(nvml) * secs;
        let err = (energy - truth).abs();
        assert!(err <= bound, "step {step} GPU {gpu}: {energy:.3} J vs true {truth:.3} J, bound {bound:.3} J");
        assert_eq!(below, 0, "40 ms steps are longer than the 20 ms counter period");
        rel.push(err / truth);
        bound_sum += bound;
        err_sum += err;
    }
    let at = |p| percentile(&rel, p).expect("steps measured");
    let (median, p90, worst) = (at(50.0), at(90.0), at(100.0));
    println!(
        "GPU energy per step: relative error median {:.3}%, p90 {:.3}%, worst {:.2}%, mean error {:.3} J, mean bound {:.3} J",
        100.0 * median,
        100.0 * p90,
        100.0 * worst,
        err_sum / rows.len() as f64,
        bound_sum / rows.len() as f64
    );
    // Constant power and a sampler on an absolute schedule: the counter is seen
    // with the same lag at both boundaries, which cancels (README: worst 0.2 %,
    // measured 0.08–0.18 % on an idle machine). A late sampler tick breaks the
    // cancellation for the steps around it: on a loaded 2-core machine the worst
    // step reached 7.9 %, within its bound (checked above), which allows for that
    // lag. The median step is not moved by a few late ticks (≤ 0.04 % measured
    // under load), and a wrong power, GPU or interval is off by far more than 1 %.
    assert!(median < 0.01, "median per-step GPU energy error {:.3}%", 100.0 * median);
    let period: f64 = conn
        .query_row("SELECT energy_update_period_ms FROM gpus WHERE session_id = ?1 AND gpu = 0", [s.id], |r| r.get(0))
        .expect("period");
    assert!((15.0..=30.0).contains(&period), "counter period seen: {period} ms (stand-in: 20 ms)");
}

#[test]
fn missing_readings_are_null_with_a_reason_and_the_view_uses_gpustatsmonitor_names() {
    let (db, s, _) = profiled("gpu-null", &["--steps", "10", "--launches", "5", "--step-sleep-us", "20000"], &[]);
    // Logical GPU 1 is NVML device 1, which has no fan, no memory temperature and no instant power.
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM step_gpu WHERE session_id = ?1 AND gpu = 1 AND fan_speed_end_pct IS NOT NULL",
            s.id
        ),
        0
    );
    assert_eq!(
        count(&db, "SELECT count(*) FROM step_gpu WHERE session_id = ?1 AND gpu = 0 AND fan_speed_end_pct = 32", s.id),
        10
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM gpu_samples WHERE session_id = ?1 AND gpu = 1 AND temperature_memory_c IS NOT NULL",
            s.id
        ),
        0
    );
    assert_eq!(
        count(&db, "SELECT count(*) FROM gpus WHERE session_id = ?1 AND gpu = 1 AND power_source = 'average'", s.id),
        1
    );
    let reason: String = open(&db)
        .query_row(
            "SELECT reason FROM capabilities WHERE session_id = ?1 AND metric = 'GPU_1/fan.speed' AND available = 0",
            [s.id],
            |r| r.get(0),
        )
        .expect("a recorded reason for the missing fan speed");
    assert!(!reason.is_empty());
    // GPUStatsMonitor's names, exactly.
    let conn = open(&db);
    let names: Vec<String> = conn
        .prepare("SELECT DISTINCT metric FROM gpu_stats_monitor WHERE session_id = ?1 ORDER BY metric")
        .expect("prepare")
        .query_map([s.id], |r| r.get(0))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    let mut expected: Vec<String> = [
        "utilization.gpu - percent",
        "memory.used - MB",
        "memory.free - MB",
        "utilization.memory - percent",
        "fan.speed - percent",
        "temperature.gpu - °C",
        "temperature.memory - °C",
    ]
    .iter()
    .flat_map(|m| (0..2).map(move |g| format!("GPU_{g}/{m}")))
    .chain(["batch_time/intra_step (ms)".to_string(), "batch_time/inter_step (ms)".to_string()])
    .collect();
    expected.sort();
    assert_eq!(names, expected);
    // Values at step start and end of a known function: memory.used is 1000 + 100 g MiB.
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM gpu_stats_monitor WHERE session_id = ?1 AND metric = 'GPU_0/memory.used - MB' AND value = 1200",
            s.id
        ),
        20
    );
}

#[test]
fn steps_shorter_than_the_counter_period_are_flagged_not_zero() {
    let (db, s, _) = profiled(
        "gpu-short",
        &["--steps", "40", "--launches", "5", "--step-sleep-us", "2000", "--gap-us", "3000"],
        &["--gpu-interval", "10"],
    );
    assert_eq!(count(&db, "SELECT count(*) FROM step_gpu WHERE session_id = ?1", s.id), 80);
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM step_gpu WHERE session_id = ?1 AND below_resolution = 1 AND energy_j > 0",
            s.id
        ),
        80
    );
}

/// `profiler run -o DB --nvml-lib LIB [EXTRA] -- /bin/true` with `env`; returns (exit code, stderr).
fn run_true(db: &str, lib: &str, extra: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let out = std::process::Command::new(profiler_bin())
        .args(["run", "-o", db, "--nvml-lib", lib])
        .args(extra)
        .args(["--", "/bin/true"])
        .envs(env.iter().copied())
        .output()
        .expect("run profiler");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// NVML that will not initialise because the driver is not loaded: tracing goes
/// on, one line and a capability row say why, `--require-gpu` makes it an error.
fn driver_not_loaded_is_one_clear_line(db: &std::path::Path, lib: &str, env: &[(&str, &str)]) {
    let db_s = db.display().to_string();
    let (code, stderr) = run_true(&db_s, lib, &[], env);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stderr.lines().filter(|l| l.contains("NVIDIA driver not loaded")).count(), 1, "{stderr}");
    let s = last_session(db);
    let reason: String = open(db)
        .query_row(
            "SELECT reason FROM capabilities WHERE session_id = ?1 AND source = 'nvml' AND metric = '*'",
            [s.id],
            |r| r.get(0),
        )
        .expect("capability row");
    assert!(reason.contains("NVIDIA driver not loaded"), "{reason}");
    let (code, stderr) = run_true(&db_s, lib, &["--require-gpu"], env);
    one_error_line(code, &stderr, "NVIDIA driver not loaded");
}

/// NVML_ERROR_DRIVER_NOT_LOADED from the stand-in (on any host), and from the
/// genuine library where this host has no NVIDIA driver.
#[test]
fn nvml_without_a_driver_is_one_clear_line() {
    let dir = workdir("gpu-genuine");
    driver_not_loaded_is_one_clear_line(&dir.join("standin.db"), &stand_in_nvml(), &[("STANDIN_NVML_INIT_ERROR", "9")]);

    let lib = fixtures().join("nvidia/lib/libnvidia-ml.so.1");
    assert!(lib.exists(), "genuine libnvidia-ml missing: run `cargo xtask fixtures`");
    let lib = lib.display().to_string();
    let db = dir.join("genuine.db");
    match nvidia_driver() {
        None => driver_not_loaded_is_one_clear_line(&db, &lib, &[]),
        Some(driver) => {
            // The 535 library against this host's driver: GPUs, or a reason on record; tracing goes on either way.
            let (code, stderr) = run_true(&db.display().to_string(), &lib, &[], &[]);
            assert_eq!(code, Some(0), "{stderr}");
            let s = last_session(&db);
            let gpus = count(&db, "SELECT count(*) FROM gpus WHERE session_id = ?1", s.id);
            let why = count(
                &db,
                "SELECT count(*) FROM capabilities WHERE session_id = ?1 AND source = 'nvml' AND metric = '*' AND available = 0",
                s.id,
            );
            assert!(gpus > 0 || why == 1, "neither GPUs nor a reason: {stderr}");
            skip(format!("the genuine NVML's 'driver not loaded': this host has the NVIDIA driver ({driver})"));
        }
    }
}

/// What `profiler run /bin/true` chose with the stand-in NVML and `env` (the
/// command inherits the profiler's environment, so these are the target's
/// CUDA_* variables): the `gpus` rows (logical, NVML index, name), the NVML
/// `capabilities` rows (metric, available, reason), the exit code and stderr.
type Chosen = (Vec<(i64, i64, String)>, Vec<(String, bool, String)>, Option<i32>, String);

fn chosen(name: &str, env: &[(&str, &str)], extra: &[&str]) -> Chosen {
    let db = workdir(name).join("p.db");
    let mut cmd = std::process::Command::new(profiler_bin());
    cmd.args(["run", "-o", &db.display().to_string(), "--nvml-lib", &stand_in_nvml()]).args(extra);
    cmd.args(["--", "/bin/true"]);
    for var in ["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "STANDIN_NVML_SLOW", "STANDIN_NVML_MIG"] {
        cmd.env_remove(var);
    }
    let out = cmd.env("STANDIN_NVML_GPUS", "3").envs(env.iter().copied()).output().expect("run profiler");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if out.status.code() != Some(0) {
        return (Vec::new(), Vec::new(), out.status.code(), stderr);
    }
    let s = last_session(&db);
    let conn = open(&db);
    let gpus = conn
        .prepare("SELECT gpu, nvml_index, name FROM gpus WHERE session_id = ?1 ORDER BY gpu")
        .expect("prepare")
        .query_map([s.id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    let caps = conn
        .prepare("SELECT metric, available, coalesce(reason, '') FROM capabilities WHERE session_id = ?1 AND source = 'nvml'")
        .expect("prepare")
        .query_map([s.id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    (gpus, caps, out.status.code(), stderr)
}

fn capability(caps: &[(String, bool, String)], metric: &str) -> (String, bool, String) {
    caps.iter().find(|c| c.0 == metric).cloned().unwrap_or_else(|| panic!("no '{metric}' capability row: {caps:?}"))
}

#[test]
fn gpu_numbers_follow_cuda_device_order_and_a_guess_says_so() {
    let (a10, h200) = ("Stand-in A10".to_string(), "Stand-in H200".to_string());
    // NVML device 0 is the slower model: CUDA's default order puts the first H200 (NVML 1) first.
    let (gpus, caps, code, stderr) = chosen("gpu-order-fastest", &[("STANDIN_NVML_SLOW", "0")], &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(gpus, [(0, 1, h200.clone()), (1, 0, a10.clone()), (2, 2, h200.clone())]);
    let (_, exact, why) = capability(&caps, "gpu_order");
    assert!(!exact && why.contains("approximate"), "{why}");

    let (gpus, _, code, stderr) =
        chosen("gpu-order-fastest-cvd", &[("STANDIN_NVML_SLOW", "0"), ("CUDA_VISIBLE_DEVICES", "1,0")], &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(gpus, [(0, 0, a10.clone()), (1, 1, h200.clone())]);

    let env = [("STANDIN_NVML_SLOW", "0"), ("CUDA_VISIBLE_DEVICES", "0"), ("CUDA_DEVICE_ORDER", "PCI_BUS_ID")];
    let (gpus, caps, code, stderr) = chosen("gpu-order-pci", &env, &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(gpus, [(0, 0, a10)]);
    let (_, exact, why) = capability(&caps, "gpu_order");
    assert!(exact && why.contains("PCI_BUS_ID"), "{why}");

    // One model: CUDA's order is PCI bus order, exactly (what the other tests rely on).
    let (gpus, caps, code, stderr) = chosen("gpu-order-same", &[("CUDA_VISIBLE_DEVICES", "2,0")], &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(gpus, [(0, 2, h200.clone()), (1, 0, h200)]);
    assert!(capability(&caps, "gpu_order").1);
}

#[test]
fn a_mig_uuid_samples_its_parent_gpu_and_says_so() {
    let mig = "MIG-5ca1ab1e-0000-4000-9000-000000000201";
    let env = [("STANDIN_NVML_MIG", "2"), ("CUDA_VISIBLE_DEVICES", &format!("{mig},0")[..])];
    let (gpus, caps, code, stderr) = chosen("gpu-mig", &env, &[]);
    assert_eq!(code, Some(0), "{stderr}");
    let got: Vec<(i64, i64)> = gpus.iter().map(|g| (g.0, g.1)).collect();
    assert_eq!(got, [(0, 2), (1, 0)], "the MIG device's parent is NVML device 2");
    let (_, available, why) = capability(&caps, "GPU_0/mig");
    assert!(!available && why.contains(mig) && why.contains("whole GPU"), "{why}");
    assert!(caps.iter().all(|c| c.0 != "GPU_1/mig"), "GPU 0 is not in MIG mode: {caps:?}");
}

#[test]
fn a_cuda_visible_devices_that_names_no_gpu_is_one_warning_line() {
    let env = [("CUDA_VISIBLE_DEVICES", "7,0")];
    let (gpus, caps, code, stderr) = chosen("gpu-none", &env, &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(gpus, []);
    let lines: Vec<&str> = stderr.lines().filter(|l| l.contains("CUDA_VISIBLE_DEVICES")).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains("CUDA_VISIBLE_DEVICES='7,0' names no GPU"), "{stderr}");
    let (_, available, why) = capability(&caps, "*");
    assert!(!available && why.contains("names no GPU"), "{why}");
    // --require-gpu makes it the error.
    let (_, _, code, stderr) = chosen("gpu-none-required", &env, &["--require-gpu"]);
    one_error_line(code, &stderr, "names no GPU");
}
