//! `profiler compare` (#27) on pairs of real profiles with known
//! differences: the native trainer with exact launches per step and a known
//! sleep, ten pairs of identical runs, a real PyTorch loop whose DataLoader
//! sleeps a known time per batch, and mismatched inputs.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use integration_tests::*;
use serde_json::Value;

const STEPS: &str = "80";

/// Profiles the native trainer: `launches` per step, a `sleep_us` step; its
/// own truth goes to `NAME.txt` beside the profile.
fn trainer_profile(dir: &Path, name: &str, launches: u32, sleep_us: u32, extra: &[&str]) -> PathBuf {
    let db = dir.join(format!("{name}.db"));
    let truth = dir.join(format!("{name}.txt"));
    let out = Command::new(profiler_bin())
        .args(["run", "-o", db.to_str().expect("utf-8")])
        .args(extra)
        .arg("--")
        .arg(fixtures().join("trainer"))
        .args(["--steps", STEPS, "--launches", &launches.to_string(), "--step-sleep-us", &sleep_us.to_string()])
        .args(["--gap-us", "300", "--truth", truth.to_str().expect("utf-8")])
        .env("LD_LIBRARY_PATH", fixtures())
        .output()
        .expect("run profiler");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    db
}

fn traced(dir: &Path, name: &str, launches: u32, sleep_us: u32) -> PathBuf {
    let nvml = stand_in_nvml();
    trainer_profile(dir, name, launches, sleep_us, &["--step-symbol", "train_step", "--nvml-lib", &nvml])
}

/// `profiler compare` with `args`: exit code, stdout, stderr.
fn compare(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(profiler_bin()).arg("compare").args(args).output().expect("run profiler compare");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// The median step time the trainer measured itself, ms.
fn truth_p50_ms(truth: &Path) -> f64 {
    let durations: Vec<u64> = Truth::read(truth).steps.iter().map(|s| s.end_ns - s.start_ns).collect();
    percentile(&durations, 50.0).expect("the trainer's steps") as f64 / 1e6
}

fn json(a: &Path, b: &Path, extra: &[&str]) -> Value {
    let (a, b) = (a.to_str().expect("utf-8"), b.to_str().expect("utf-8"));
    let (code, out, err) = compare(&[&[a, b, "--format", "json"], extra].concat());
    assert_eq!(code, Some(0), "{err}");
    serde_json::from_str(&out).expect("compare JSON")
}

fn metric<'a>(c: &'a Value, label: &str, name: &str) -> &'a Value {
    let l = c["labels"].as_array().expect("labels").iter().find(|l| l["label"] == label).expect("the label");
    l["metrics"].as_array().expect("metrics").iter().find(|m| m["metric"] == name).expect("the metric")
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} in {v}"))
}

#[test]
fn known_differences_of_the_native_trainer_read_as_they_were_made() {
    let dir = workdir("compare_known");
    let a = traced(&dir, "a", 40, 2000);
    let b = traced(&dir, "b", 50, 3000);
    let c = json(&a, &b, &[]);
    assert_eq!(c["compare_version"], 1);
    let launches = metric(&c, "train", "launches_per_step");
    assert_eq!((num(launches, "a"), num(launches, "b"), num(launches, "change")), (40.0, 50.0, 10.0));
    assert_eq!(launches["verdict"], "higher");
    // The kernels' launches per step, named as `report` names them, add up to
    // the 10 more launches per step (a kernel whose count moved by less than
    // half a launch is not listed).
    let label = &c["labels"][0];
    let kernels = label["kernels"].as_array().expect("kernels compared (launch rows in both)");
    let more: f64 = kernels.iter().map(|k| num(k, "b_per_step") - num(k, "a_per_step")).sum();
    assert!((more - 10.0).abs() < 0.5 * kernels.len().max(1) as f64, "{more} more launches per step: {kernels:?}");
    assert!(kernels.iter().all(|k| !k["kernel"].as_str().expect("a name").is_empty()));
    // Each step sleeps 1 ms longer and launches 10 more: the change's interval
    // holds the change of the trainers' own median step time (their stamps lie
    // within the probes' boundary error of the profile's).
    let p50 = metric(&c, "train", "step_p50");
    assert_eq!(p50["verdict"], "slower", "{p50}");
    let (lo, hi) = (num(p50, "ci_low"), num(p50, "ci_high"));
    let truth = truth_p50_ms(&dir.join("b.txt")) - truth_p50_ms(&dir.join("a.txt"));
    // The probes fire within tens of µs of the trainer's stamps (the bench's
    // boundary error); a median moves by less.
    let slack = 0.1;
    assert!(lo - slack <= truth && truth <= hi + slack, "the trainers' change {truth} ms outside [{lo}, {hi}]");
    // The trainers' own change is the 1 ms less what this VM's timers and
    // steal take from it (0.900 ms and an interval 0.52 ms wide were seen on
    // 2 cores): a change this size is found, and told apart from none.
    assert!(truth > 0.8 && lo > 0.0 && hi - lo < 0.6, "1 ms more sleep: {truth} ms, interval [{lo}, {hi}]");
    // The table fits 80 columns and names what changed.
    let (code, table, err) = compare(&[a.to_str().expect("utf-8"), b.to_str().expect("utf-8")]);
    assert_eq!(code, Some(0), "{err}");
    assert_fits_80_columns(&table);
    assert!(table.contains("step time p50") && table.contains("slower") && table.contains("launches/step"), "{table}");
    // The gate: 10 more launches fail `> 0`; +50 % is within `+100%`.
    let (a, b) = (a.to_str().expect("utf-8"), b.to_str().expect("utf-8"));
    let (code, _, err) = compare(&[a, b, "--fail-if", "launches_per_step > 0"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("fail-if: launches_per_step > 0 (train)"), "{err}");
    let (code, _, err) = compare(&[a, b, "--fail-if", "step_p50 > +100%", "--fail-if", "launches_per_step < 0"]);
    assert_eq!(code, Some(0), "{err}");
    // The HTML page: the table and both runs' plots, offline.
    let page = dir.join("compare.html");
    let (code, _, err) = compare(&[a, b, "--html", page.to_str().expect("utf-8")]);
    assert_eq!(code, Some(0), "{err}");
    let html = std::fs::read_to_string(&page).expect("page");
    assert_eq!(html.matches("<svg").count(), 4, "step time and energy, distribution and series");
    assert!(!html.contains("<script src") && !html.contains("<link"), "the page loads nothing");
}

#[test]
fn identical_runs_pass_a_five_percent_gate() {
    let dir = workdir("compare_identical");
    let mut gate_failures = 0;
    let mut changed = Vec::new();
    for pair in 0..10 {
        let a = traced(&dir, &format!("a{pair}"), 20, 2000);
        let b = traced(&dir, &format!("b{pair}"), 20, 2000);
        let (a, b) = (a.to_str().expect("utf-8"), b.to_str().expect("utf-8"));
        let (code, out, err) = compare(&[a, b, "--skip", "5", "--format", "json", "--fail-if", "step_p50 > +5%"]);
        assert!(matches!(code, Some(0 | 1)), "{err}");
        gate_failures += usize::from(code == Some(1));
        let c: Value = serde_json::from_str(&out).expect("compare JSON");
        let p50 = metric(&c, "train", "step_p50");
        if p50["verdict"] != "no significant change" {
            changed.push(format!("pair {pair}: {p50}"));
        }
        assert_eq!(metric(&c, "train", "launches_per_step")["verdict"], "same");
    }
    println!("identical pairs: gate failed {gate_failures} of 10; step p50 read as changed in {}", changed.len());
    assert!(gate_failures <= 1, "the gate failed {gate_failures} of 10 identical pairs");
    assert!(changed.len() <= 1, "identical runs read as changed: {changed:#?}");
}

#[test]
fn mismatched_inputs_get_one_line_each() {
    let dir = workdir("compare_mismatched");
    let nvml = stand_in_nvml();
    let a = traced(&dir, "a", 10, 1000);
    let eval = trainer_profile(&dir, "eval", 10, 1000, &["--step-symbol", "eval=train_step", "--nvml-lib", &nvml]);
    let no_gpu = trainer_profile(&dir, "no_gpu", 10, 1000, &["--step-symbol", "train_step", "--no-gpu"]);
    let (a, eval_s, no_gpu_s) =
        (a.to_str().expect("utf-8"), eval.to_str().expect("utf-8"), no_gpu.to_str().expect("utf-8"));
    // No label in common; a label one side lacks.
    let (code, _, err) = compare(&[a, eval_s]);
    one_error_line(code, &err, "none in common");
    assert_eq!(code, Some(2));
    let (code, _, err) = compare(&[a, eval_s, "--label", "train"]);
    one_error_line(code, &err, "has no steps labelled 'train'");
    assert_eq!(code, Some(2));
    // One side without energy: compared, energy reads "not in B", a gate on it is bad input.
    let c = json(Path::new(a), &no_gpu, &[]);
    assert_eq!(metric(&c, "train", "gpu_energy_per_step")["verdict"], "not in B");
    assert_eq!(metric(&c, "train", "launches_per_step")["verdict"], "same");
    let (code, _, err) = compare(&[a, no_gpu_s, "--fail-if", "gpu_energy_per_step > +3%"]);
    one_error_line(code, &err, "gate on a metric both runs have");
    assert_eq!(code, Some(2));
    // Bad conditions and a missing file: clap's usage error, or one line; exit 2 either way.
    let (code, _, err) = compare(&[a, no_gpu_s, "--fail-if", "step_p5 > 5%"]);
    assert!(code == Some(2) && err.contains("not a metric compare knows"), "{err}");
    let (code, _, err) = compare(&[a, "/nonexistent.db"]);
    one_error_line(code, &err, "does not exist");
    assert_eq!(code, Some(2));
    // --skip past every step.
    let (code, _, err) = compare(&[a, no_gpu_s, "--skip", "100000"]);
    one_error_line(code, &err, "lower --skip");
    // An older profile (the first four migrations only): read, its missing figures "not in A".
    let old = old_profile(&dir);
    let c = json(&old, Path::new(a), &[]);
    assert_eq!(metric(&c, "train", "launches_per_step")["verdict"], "higher");
    assert_eq!(metric(&c, "train", "gpu_energy_per_step")["verdict"], "not in A");
    assert_eq!(metric(&c, "train", "step_p50")["verdict"], "slower");
}

/// A profile as the first profiler releases wrote it (migrations 0–3), with
/// 50 steps of 0.5 ms and 2 launches each.
fn old_profile(dir: &Path) -> PathBuf {
    let path = dir.join("old.db");
    let _ = std::fs::remove_file(&path);
    let conn = rusqlite::Connection::open(&path).expect("create");
    for sql in [
        include_str!("../../../profiler/src/store/migrations/0000_core.sql"),
        include_str!("../../../profiler/src/store/migrations/0001_gpu.sql"),
        include_str!("../../../profiler/src/store/migrations/0002_rapl.sql"),
        include_str!("../../../profiler/src/store/migrations/0003_system.sql"),
    ] {
        conn.execute_batch(sql).expect("old schema");
    }
    conn.pragma_update(None, "user_version", 4).expect("version");
    conn.execute(
        "INSERT INTO sessions (id, pid, command, mode, launch_mode, step_symbol, started_ns, unix_offset_ns, profiler_version)
         VALUES (1, 42, 'old trainer', 'run', 'all', 'train_step', 0, 0, '0.0.1')",
        [],
    )
    .expect("session");
    for k in 0..50i64 {
        let start = k * 1_000_000;
        conn.execute(
            "INSERT INTO steps (session_id, label, step, tid, start_ns, end_ns, duration_ns, inter_step_ns, launches, sync_wait_ns)
             VALUES (1, 'train', ?1, 42, ?2, ?3, 500000, 500000, 2, 0)",
            [k, start, start + 500_000],
        )
        .expect("step");
    }
    path
}

#[test]
fn a_slow_dataloader_reads_as_data_wait_and_a_longer_period() {
    // torch_python says SKIPPED when there is none.
    let Some(python) = torch_python("python3.11") else { return };
    let dir = workdir("compare_torch");
    let run = |name: &str, extra: &[&str]| {
        let db = dir.join(format!("{name}.db"));
        let truth = dir.join(format!("{name}.txt"));
        let out = Command::new(profiler_bin())
            .args(["run", "-o", db.to_str().expect("utf-8"), "--no-gpu", "--"])
            .arg(&python)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/torch_loop.py"))
            .args(["--steps", "40", "--truth", truth.to_str().expect("utf-8")])
            .args(extra)
            .output()
            .expect("run profiler");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        db
    };
    let a = run("a", &[]);
    let b = run("b", &["--batch-sleep-ms", "20"]);
    let c = json(&a, &b, &["--skip", "3"]);
    for name in ["data_wait_p50", "step_period_p50"] {
        let m = metric(&c, "train", name);
        assert_eq!(m["verdict"], "slower", "{name}: {m}");
        let (lo, hi) = (num(m, "ci_low"), num(m, "ci_high"));
        // The sleep itself, plus the scheduler's wake-up latency.
        assert!(lo - 2.0 <= 20.0 && 20.0 <= hi + 2.0, "{name}: 20 ms outside [{lo}, {hi}]");
    }
    let (a, b) = (a.to_str().expect("utf-8"), b.to_str().expect("utf-8"));
    let (code, _, err) = compare(&[a, b, "--skip", "3", "--fail-if", "step_period_p50 > +5%"]);
    assert_eq!(code, Some(1), "the period gate fails: {err}");
    let (code, _, err) = compare(&[a, b, "--skip", "3", "--fail-if", "launches_per_step > 0"]);
    assert_eq!(code, Some(0), "the launches gate passes: {err}");
}
