//! `--step-python` on every CPython 3.10–3.14 on this host, USDT probes or
//! not: pyenv's builds (no USDT: the PEP 523 frame hook) and Debian's
//! python3.11 (USDT) run the stdlib-only trainer (a method, a plain
//! function, two threads, recursion, exceptions, two labels), which writes
//! its own ground truth.
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use integration_tests::*;

/// The bound on step boundaries (probe vs the trainer's own stamps), at p99.
const BOUNDARY_P99_NS: i64 = 50_000;

fn py_trainer() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/py_trainer.py")
}

/// `(interpreter, mechanism the `how` text must name)`, for those this host has.
fn interpreters() -> Vec<(PathBuf, &'static str)> {
    let mut out = Vec::new();
    for v in ["3.10.13", "3.11.7", "3.12.1", "3.13.0"] {
        let p = PathBuf::from(format!("/root/.pyenv/versions/{v}/bin/python3"));
        let how = if v.starts_with("3.10") { "no write (3.10" } else { "eval_frame written" };
        if p.exists() {
            out.push((p, how));
        } else {
            skip(format!("{} not installed", p.display()));
        }
    }
    for (p, how) in [("/usr/bin/python3.11", "USDT"), ("/usr/bin/python3.13", "")] {
        if Path::new(p).exists() {
            out.push((p.into(), how));
        }
    }
    out
}

fn trainer(python: &Path, dir: &Path, steps: &str) -> (std::process::Child, PathBuf, PathBuf) {
    let (truth, go) = (dir.join("truth.txt"), dir.join("go"));
    let _ = std::fs::remove_file(&go);
    let child = Command::new(python)
        .arg(py_trainer())
        .args(["--steps", steps, "--launches", "4", "--val-every", "4", "--val-launches", "2", "--threads", "2"])
        .args(["--nest", "2", "--raise-every", "5", "--step-sleep-us", "500", "--gap-us", "200"])
        .arg("--truth")
        .arg(&truth)
        .arg("--wait-file")
        .arg(&go)
        .env("LD_LIBRARY_PATH", fixtures())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python trainer");
    (child, truth, go)
}

#[test]
fn any_cpython_steps_match_truth_with_or_without_usdt() {
    for (python, how) in interpreters() {
        let name = python.display().to_string().replace('/', "_");
        let dir = workdir(&format!("python-any{name}"));
        let db = dir.join("p.db");
        let (child, truth, go) = trainer(&python, &dir, "100");
        let agent = Agent::attach(
            child.id(),
            &db,
            &["--no-gpu", "--step-python", "train_step", "--step-python", "validate=validate"],
        );
        std::fs::write(&go, b"").expect("go");
        let out = child.wait_with_output().expect("wait");
        assert!(out.status.success(), "{}: the target failed under the profiler", python.display());
        let (status, stderr) = agent.finish();
        assert!(status.success(), "{stderr}");
        let s = last_session(&db);
        let row: String = open(&db)
            .query_row("SELECT how FROM probed_files WHERE session_id = ?1 AND kind = 'step'", [s.id], |r| r.get(0))
            .expect("the step probes' row");
        assert!(row.contains(how), "{}: {row}", python.display());
        let truth = Truth::read(&truth);
        let all = steps(&db, s.id);
        for label in ["train", "validate"] {
            let t: Vec<TruthStep> = truth.steps.iter().filter(|x| x.label == label).cloned().collect();
            let d: Vec<DbStep> = all.iter().filter(|x| x.label == label).cloned().collect();
            assert!(!t.is_empty(), "the trainer ran {label} steps");
            let e = assert_steps_match(&t, &d, STEP_TOLERANCE_NS);
            let (p50, p99) = (
                median(&e.start.iter().chain(&e.end).copied().collect::<Vec<_>>()),
                BoundaryErrors::p99(&[e.start.clone(), e.end.clone()].concat()),
            );
            println!(
                "{} {label}: {} steps, boundary error p50 {p50} ns, p99 {p99} ns ({row})",
                python.display(),
                t.len()
            );
            assert!(p99 < BOUNDARY_P99_NS, "{}: boundary p99 {p99} ns", python.display());
        }
        assert_eq!(s.total_launches, Some(truth.total as i64));
    }
}

fn median(v: &[i64]) -> i64 {
    let mut s = v.to_vec();
    s.sort_unstable();
    s.get(s.len() / 2).copied().unwrap_or(0)
}

/// The target's output is the same with and without the profiler, and a
/// profiler killed with SIGKILL mid-run leaves it running to a clean exit.
#[test]
fn any_cpython_frame_hook_leaves_the_target_unharmed() {
    let Some((python, _)) = interpreters().into_iter().find(|(_, how)| *how == "eval_frame written") else {
        skip("no CPython 3.11+ without USDT probes on this host");
        return;
    };
    let dir = workdir("python-any-kill");
    let db = dir.join("p.db");
    let (child, _, go) = trainer(&python, &dir, "60");
    let agent = Agent::attach(child.id(), &db, &["--no-gpu", "--step-python", "train_step"]);
    std::fs::write(&go, b"").expect("go");
    std::thread::sleep(Duration::from_millis(100));
    agent.signal(libc::SIGKILL);
    let out = child.wait_with_output().expect("wait");
    let (_, _) = agent.finish();
    assert!(out.status.success(), "the target failed after the profiler was killed");
    let (alone, _, go) = trainer(&python, &dir, "60");
    std::fs::write(&go, b"").expect("go");
    let plain = alone.wait_with_output().expect("wait");
    assert!(plain.status.success());
    assert_eq!(out.stdout, plain.stdout, "the target's output with and without the profiler");
}

/// `--no-target-writes` refuses the hook with one line that says what to do.
#[test]
fn any_cpython_no_target_writes_refuses_the_frame_hook() {
    let Some((python, _)) = interpreters().into_iter().find(|(_, how)| *how == "eval_frame written") else {
        skip("no CPython 3.11+ without USDT probes on this host");
        return;
    };
    let mut child = Command::new(&python).args(["-c", "import time; time.sleep(30)"]).spawn().expect("python");
    let dir = workdir("python-any-nowrites");
    let db = dir.join("p.db");
    let pid = child.id().to_string();
    let args =
        ["attach", &pid, "-o", db.to_str().expect("utf-8"), "--no-gpu", "--no-target-writes", "--step-python", "f"];
    let (code, stderr) = profiler_output(&args);
    let _ = child.kill();
    let _ = child.wait();
    one_error_line(code, &stderr, "--no-target-writes");
}
