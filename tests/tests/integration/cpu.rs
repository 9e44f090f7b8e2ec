//! Per-step CPU profiles (#34): the CPU sampler against a trainer whose
//! steps burn known shares of their CPU time in two known functions
//! (tests/fixtures/cpu_trainer.c, built with frame pointers, writing its own
//! per-function thread CPU times): the report's top functions and their
//! shares, the samples' count against the time the steps ran, their native
//! stacks, each sample's step, and the folded-stacks export.
use std::path::{Path, PathBuf};

use integration_tests::*;

/// Sampling rate of these tests: ~2000 samples over the trainer's 2 s of steps.
const HZ: u32 = 999;
/// How far a function's sampled share may be from its measured one.
const SHARE_BOUND: f64 = 0.05;

struct Run {
    db: PathBuf,
    session: i64,
    truth: TruthFile,
    stderr: String,
}

/// The trainer under `profiler run` with `profiler` flags.
fn run_trainer(test: &str, profiler: &[&str]) -> Run {
    run_fixture("cpu_trainer", test, profiler)
}

fn run_fixture(trainer: &str, test: &str, profiler: &[&str]) -> Run {
    let dir = workdir(test);
    let (db, truth) = (dir.join("p.db"), dir.join("truth.txt"));
    let mut args: Vec<String> = ["run", "-o", db.to_str().expect("utf-8"), "--no-gpu", "--step-symbol", "train_step"]
        .map(String::from)
        .to_vec();
    args.extend(profiler.iter().map(|s| s.to_string()));
    args.push("--".into());
    args.push(fixtures().join(trainer).display().to_string());
    args.extend(["--steps", "40", "--truth", truth.to_str().expect("utf-8")].map(String::from));
    let (status, stderr) = Agent::start(&args, false).finish();
    assert!(status.success(), "{stderr}");
    let session = last_session(&db).id;
    Run { db, session, truth: TruthFile::read(&truth), stderr }
}

/// (step CPU, heavy_work CPU, light_work CPU) summed over the trainer's steps, ns.
fn truth_cpu(truth: &TruthFile) -> (f64, f64, f64) {
    truth.records("step").fold((0.0, 0.0, 0.0), |(s, h, l), r| {
        (s + truth.num::<f64>(&r, 2), h + truth.num::<f64>(&r, 3), l + truth.num::<f64>(&r, 4))
    })
}

fn report_json(db: &Path) -> serde_json::Value {
    let out = std::process::Command::new(profiler_bin())
        .args(["report", db.to_str().expect("utf-8"), "--format", "json"])
        .output()
        .expect("run report");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("report JSON")
}

/// A function's `self_share` in a label's `by_self` list.
fn self_share(label: &serde_json::Value, function: &str) -> Option<f64> {
    label["by_self"].as_array()?.iter().find(|f| f["function"] == function).and_then(|f| f["self_share"].as_f64())
}

#[test]
fn the_reports_top_functions_are_the_trainers_two_at_their_measured_shares() {
    let hz = HZ.to_string();
    let run = run_trainer("cpu_shares", &["--cpu-sample", &hz]);
    let (step_ns, heavy_ns, light_ns) = truth_cpu(&run.truth);
    let report = report_json(&run.db);
    let cpu = &report["cpu"];
    assert_eq!(cpu["sample_hz"], HZ, "{cpu}");
    assert_eq!(cpu["lost_samples"], 0, "{cpu}\n{}", run.stderr);
    let train = cpu["labels"].as_array().and_then(|l| l.iter().find(|l| l["label"] == "train")).expect("train");
    let by_self: Vec<&str> =
        train["by_self"].as_array().expect("by_self").iter().filter_map(|f| f["function"].as_str()).collect();
    assert_eq!(by_self.get(..2), Some(&["heavy_work", "light_work"][..]), "{train}");
    for (function, ns) in [("heavy_work", heavy_ns), ("light_work", light_ns)] {
        let (got, want) = (self_share(train, function).expect("a share"), ns / step_ns);
        assert!((got - want).abs() <= SHARE_BOUND, "{function}: sampled {got:.3}, measured {want:.3}\n{train}");
    }
    // The sampler's own ground truth: one sample per 1/HZ s of the steps' CPU
    // time (their threads ran on some CPU all that time), give or take a few.
    let samples = train["samples"].as_f64().expect("samples");
    let expected = step_ns / 1e9 * f64::from(HZ);
    assert!((samples - expected).abs() <= 0.05 * expected + 5.0, "{samples} samples, {expected:.0} expected");
}

#[test]
fn without_frame_pointers_the_leaves_keep_their_shares_and_the_profiler_says_so() {
    let hz = HZ.to_string();
    let run = run_fixture("cpu_trainer_nofp", "cpu_nofp", &["--cpu-sample", &hz]);
    let (step_ns, heavy_ns, light_ns) = truth_cpu(&run.truth);
    let report = report_json(&run.db);
    let train =
        report["cpu"]["labels"].as_array().and_then(|l| l.iter().find(|l| l["label"] == "train")).expect("train");
    for (function, ns) in [("heavy_work", heavy_ns), ("light_work", light_ns)] {
        let (got, want) = (self_share(train, function).expect("a share"), ns / step_ns);
        assert!((got - want).abs() <= SHARE_BOUND, "{function}: sampled {got:.3}, measured {want:.3}\n{train}");
    }
    assert!(run.stderr.contains("no frame pointers"), "{}", run.stderr);
}

#[test]
fn samples_carry_the_native_stack_and_the_step_their_thread_was_in() {
    let hz = HZ.to_string();
    let run = run_trainer("cpu_stacks", &["--cpu-sample", &hz]);
    let conn = open(&run.db);
    // Frame pointers: a sample in heavy_work has heavy_work ← train_step ← main above it.
    let stacks: i64 = conn
        .query_row(
            "SELECT count(*) FROM cpu_samples c
             JOIN stacks s0 ON s0.session_id = c.session_id AND s0.stack_id = c.stack_id AND s0.depth = 0
             JOIN frames f0 ON f0.session_id = c.session_id AND f0.frame_id = s0.frame_id AND f0.function = 'heavy_work'
             JOIN stacks s1 ON s1.session_id = c.session_id AND s1.stack_id = c.stack_id AND s1.depth = 1
             JOIN frames f1 ON f1.session_id = c.session_id AND f1.frame_id = s1.frame_id AND f1.function = 'train_step'
             JOIN stacks s2 ON s2.session_id = c.session_id AND s2.stack_id = c.stack_id AND s2.depth = 2
             JOIN frames f2 ON f2.session_id = c.session_id AND f2.frame_id = s2.frame_id AND f2.function = 'main'
             WHERE c.session_id = ?1",
            [run.session],
            |r| r.get(0),
        )
        .expect("query");
    let in_heavy = count(
        &run.db,
        "SELECT count(*) FROM cpu_samples c JOIN stacks s ON s.session_id = c.session_id AND s.stack_id = c.stack_id
         AND s.depth = 0 JOIN frames f ON f.session_id = c.session_id AND f.frame_id = s.frame_id
         WHERE c.session_id = ?1 AND f.function = 'heavy_work'",
        run.session,
    );
    assert!(in_heavy > 0 && stacks == in_heavy, "{stacks} of {in_heavy} heavy_work samples have its whole stack");
    // Each sample in a step is within that step of its thread, and none
    // between steps falls within one of its thread's.
    let misplaced = count(
        &run.db,
        "SELECT count(*) FROM cpu_samples c JOIN steps s ON s.session_id = c.session_id AND s.label = c.label
         AND s.step = c.step WHERE c.session_id = ?1
         AND (s.tid != c.tid OR c.time_ns < s.start_ns OR c.time_ns > s.end_ns)",
        run.session,
    );
    let unassigned_in_a_step = count(
        &run.db,
        "SELECT count(*) FROM cpu_samples c JOIN steps s ON s.session_id = c.session_id AND s.tid = c.tid
         AND c.time_ns > s.start_ns AND c.time_ns < s.end_ns WHERE c.session_id = ?1 AND c.label IS NULL",
        run.session,
    );
    assert_eq!((misplaced, unassigned_in_a_step), (0, 0));
    let taken: i64 = conn
        .query_row("SELECT cpu_samples_taken FROM sessions WHERE id = ?1", [run.session], |r| r.get(0))
        .expect("taken");
    let stored = count(&run.db, "SELECT count(*) FROM cpu_samples WHERE session_id = ?1", run.session);
    assert_eq!(taken, stored, "every sample taken is stored (none lost)");
    // The kernel's own count of the sampling program's runs: each sample taken was one.
    let (runs, kernel_ns, why): (Option<i64>, Option<i64>, Option<String>) = conn
        .query_row(
            "SELECT cpu_sample_runs, cpu_sample_kernel_ns, (SELECT reason FROM capabilities c WHERE c.session_id = s.id
             AND c.source = 'cpu_sampler' AND c.metric = 'kernel_cost') FROM sessions s WHERE id = ?1",
            [run.session],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .expect("kernel cost");
    match (runs, kernel_ns) {
        (Some(runs), Some(ns)) => assert!(runs >= taken && ns > 0, "{runs} runs, {ns} ns for {taken} samples"),
        _ => skip(format!("the sampler's kernel cost: the kernel did not count it: {why:?}")),
    }
    // Frame pointers all the way: the profiler does not say they are missing.
    assert!(!run.stderr.contains("no frame pointers"), "{}", run.stderr);
}

#[test]
fn the_collapsed_export_parses_and_holds_every_sample() {
    let run = run_trainer("cpu_collapsed", &["--cpu-sample", "499"]);
    let out = std::process::Command::new(profiler_bin())
        .args(["export", run.db.to_str().expect("utf-8"), "--format", "collapsed"])
        .output()
        .expect("run export");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let mut total = 0;
    let mut heavy = 0;
    for line in text.lines() {
        let (stack, n) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no count: {line}"));
        let n: i64 = n.parse().unwrap_or_else(|e| panic!("{line}: {e}"));
        assert!(n > 0 && !stack.is_empty() && stack.split(';').all(|f| !f.is_empty()), "{line}");
        total += n;
        if stack.ends_with("main;train_step;heavy_work") {
            heavy += n;
        }
    }
    assert_eq!(total, count(&run.db, "SELECT count(*) FROM cpu_samples WHERE session_id = ?1", run.session));
    assert!(heavy > total / 2, "heavy_work's stack holds most samples: {heavy} of {total}\n{text}");
}

#[test]
fn no_cpu_samples_turns_the_sampler_off() {
    let run = run_trainer("cpu_off", &["--no-cpu-samples"]);
    let conn = open(&run.db);
    let hz: Option<i64> =
        conn.query_row("SELECT cpu_sample_hz FROM sessions WHERE id = ?1", [run.session], |r| r.get(0)).expect("hz");
    assert_eq!(hz, None);
    assert_eq!(count(&run.db, "SELECT count(*) FROM cpu_samples WHERE session_id = ?1", run.session), 0);
    assert_eq!(report_json(&run.db)["cpu"]["sample_hz"], serde_json::Value::Null);
}
