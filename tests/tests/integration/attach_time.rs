//! Attaching while the target runs: through the genuine NVIDIA 535 driver and
//! the genuine CUDA runtime (every probe: launches, syncs, copies, names), a
//! trainer released 3 s after `attach` starts has every one of its steps,
//! also when the session starts right after another one's detach; and a
//! target that exits while the probes go in ends the session as a normal
//! target exit, with what the probes in place saw.
use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use integration_tests::*;

const STEPS: usize = 80;
/// Copies per step through the runtime (`sched_trainer`'s runtime list).
const COPIES_PER_STEP: i64 = 5;

/// `sched_trainer`'s steps: (start, end) CLOCK_MONOTONIC ns.
fn truth_steps(path: &Path) -> Vec<(i64, i64)> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter_map(|l| l.strip_prefix("step "))
        .map(|l| {
            let f: Vec<i64> = l.split_whitespace().map(|w| w.parse().expect("a number")).collect();
            (f[0], f[1])
        })
        .collect()
}

/// One round: the trainer waits; `attach` starts; 3 s later, whether or
/// not the agent has said it is tracing, the trainer goes. Returns how long
/// the agent took to say it was tracing.
fn released_after_three_seconds(dir: &Path, cudart: &Path, env: &[(&str, &str)]) -> Duration {
    let (go, truth, db) = (dir.join("go"), dir.join("truth.txt"), dir.join("p.db"));
    let mut trainer = Command::new(fixtures().join("sched_trainer"))
        .args(["--steps", &STEPS.to_string(), "--spin-us", "1000", "--sleep-us", "1000"])
        .arg("--cudart")
        .arg(cudart)
        .arg("--wait-file")
        .arg(&go)
        .arg("--truth")
        .arg(&truth)
        .env("LD_LIBRARY_PATH", fixtures().join("nvidia/lib"))
        .spawn()
        .expect("start sched_trainer");
    // Its libraries mapped before the attach, as in a running job.
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let args: Vec<String> = ["attach", &trainer.id().to_string(), "-o", db.to_str().expect("utf-8")]
        .into_iter()
        .map(String::from)
        .chain(["--step-symbol".into(), "train_step".into()])
        .collect();
    let agent = Agent::start_now(&args, env);
    let mut ready = None;
    while started.elapsed() < Duration::from_secs(3) {
        if ready.is_none() && agent.stderr().contains("(Ctrl-C to stop)") {
            ready = Some(started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    std::fs::write(&go, b"").expect("release the trainer");
    agent.wait_for("(Ctrl-C to stop)", Duration::from_secs(30));
    let ready = ready.unwrap_or_else(|| started.elapsed());
    assert!(trainer.wait().expect("wait trainer").success());
    let (status, stderr) = agent.finish_now();
    assert!(status.success(), "{stderr}");
    let s = last_session(&db);
    assert_eq!(s.end_reason.as_deref(), Some("target-exited"), "{stderr}");
    let truth = truth_steps(&truth);
    assert_eq!(truth.len(), STEPS);
    let conn = open(&db);
    let mut q = conn
        .prepare("SELECT start_ns, end_ns, copy_calls FROM steps WHERE session_id = ?1 ORDER BY start_ns")
        .expect("prepare");
    let rows: Vec<(i64, Option<i64>, Option<i64>)> = q
        .query_map([s.id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert_eq!(rows.len(), STEPS, "every step of the trainer, none more: {stderr}");
    for ((start, end), (db_start, db_end, copies)) in truth.iter().zip(&rows) {
        assert!((start - db_start).abs() < STEP_TOLERANCE_NS, "step start {db_start} vs the trainer's {start}");
        let db_end = db_end.unwrap_or_else(|| panic!("a step with no end: {stderr}"));
        assert!((end - db_end).abs() < STEP_TOLERANCE_NS, "step end {db_end} vs the trainer's {end}");
        assert_eq!(*copies, Some(COPIES_PER_STEP), "each step's copies, once each");
    }
    ready
}

#[test]
fn a_trainer_released_three_seconds_after_attach_has_every_step_also_right_after_another_session() {
    let Some(cudart) = genuine_cudart() else { return };
    let mode = std::env::var("PROFILER_UPROBE_MULTI").unwrap_or_default();
    // The second round attaches as soon as the first has exited: its
    // probes are still coming off then.
    for round in 1..=2 {
        let dir = workdir(&format!("attach-time-{round}"));
        let ready = released_after_three_seconds(&dir, &cudart, &[]);
        println!("round {round}: attach → tracing {:.3} s (PROFILER_UPROBE_MULTI={mode:?})", ready.as_secs_f64());
    }
    wait_for_probe_removal();
}

/// A test-only pause between the library probes and the step probes
/// (`profiler/src/session/attach.rs`), in which the target exits.
const PAUSE_ENV: &str = "PROFILER_TEST_ATTACH_PAUSE_MS";

#[test]
fn a_target_that_exits_while_attach_goes_on_ends_the_session_as_target_exited() {
    let dir = workdir("exit-during-attach");
    let db = dir.join("p.db");
    let mut trainer = Trainer::spawn(&dir, &["--steps", "20", "--launches", "100"]);
    let args: Vec<String> = ["attach", &trainer.pid().to_string(), "-o", db.to_str().expect("utf-8")]
        .into_iter()
        .map(String::from)
        .chain(["--step-symbol".into(), "train_step".into()])
        .collect();
    let agent = Agent::start_now(&args, &[(PAUSE_ENV, "60000")]);
    // The driver's probes are in (it is probed where the trainer will find
    // it); the trainer runs all its steps and exits during the pause.
    agent.wait_for("pausing before the step probes", Duration::from_secs(30));
    trainer.go();
    assert!(trainer.wait().success(), "trainer failed");
    let (status, stderr) = agent.finish_now();
    assert!(status.success(), "a target's exit during attach is not an error: {stderr}");
    assert!(!stderr.contains("error:"), "{stderr}");
    assert!(stderr.contains("exited while the probes were going in"), "{stderr}");
    let s = last_session(&db);
    assert_eq!(s.end_reason.as_deref(), Some("target-exited"), "{stderr}");
    let truth = trainer.truth();
    assert_eq!(truth.total, 2000);
    // Every launch it made, seen by the driver probes in place, counted and kept.
    assert_eq!(s.total_launches, Some(2000), "{stderr}");
    assert_eq!(count(&db, "SELECT count(*) FROM launches WHERE session_id = ?1", s.id), 2000);
}

/// A Ctrl-C while the probes go in stops the session there: the profiler
/// says so, the probes come off again, the session ends `sigint` with what
/// the probes in place saw, and the profiler exits 0; the target runs on,
/// undisturbed, to its last step.
#[test]
fn a_sigint_during_attach_detaches_cleanly_and_says_so() {
    let dir = workdir("sigint-during-attach");
    let db = dir.join("p.db");
    let mut trainer = Trainer::spawn(&dir, &["--steps", "20", "--launches", "100"]);
    let args: Vec<String> = ["attach", &trainer.pid().to_string(), "-o", db.to_str().expect("utf-8")]
        .into_iter()
        .map(String::from)
        .chain(["--step-symbol".into(), "train_step".into()])
        .collect();
    let agent = Agent::start_now(&args, &[(PAUSE_ENV, "1000")]);
    agent.wait_for("pausing before the step probes", Duration::from_secs(30));
    agent.signal(libc::SIGINT);
    let (status, stderr) = agent.finish();
    assert!(status.success(), "a Ctrl-C during attach is a clean stop: {stderr}");
    assert!(!stderr.contains("error:"), "{stderr}");
    assert!(stderr.contains("SIGINT while the probes went in"), "{stderr}");
    assert!(!stderr.contains("(Ctrl-C to stop)"), "it did not go on to trace: {stderr}");
    let s = last_session(&db);
    assert_eq!(s.end_reason.as_deref(), Some("sigint"), "{stderr}");
    assert_eq!(s.total_launches, Some(0), "the trainer had not launched yet: {stderr}");
    trainer.go();
    assert!(trainer.wait().success(), "the target runs on after the probes came off");
    assert_eq!(trainer.truth().total, 2000);
}
