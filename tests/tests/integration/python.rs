//! Python step functions by name, through CPython's USDT probes: Debian's
//! /usr/bin/python3.11 runs the stdlib-only trainer, which launches through
//! the stand-in driver with ctypes and writes its own ground truth.
use std::path::{Path, PathBuf};

use integration_tests::*;

const PYTHON: &str = "/usr/bin/python3.11";

fn py_trainer() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/py_trainer.py")
}

#[test]
fn python_steps_by_name_with_labels_threads_nesting_and_exceptions() {
    assert!(Path::new(PYTHON).exists(), "{PYTHON} (Debian's python3.11, with USDT probes) is needed");
    let dir = workdir("python");
    let db = dir.join("p.db");
    let truth = dir.join("truth.txt");
    let go = dir.join("go");
    let mut child = std::process::Command::new(PYTHON)
        .arg(py_trainer())
        .args(["--steps", "12", "--launches", "8", "--val-every", "4", "--val-launches", "3", "--threads", "2"])
        .args(["--nest", "2", "--raise-every", "5", "--step-sleep-us", "2000"])
        .arg("--truth")
        .arg(&truth)
        .arg("--wait-file")
        .arg(&go)
        .env("LD_LIBRARY_PATH", fixtures())
        .spawn()
        .expect("python trainer");
    let agent = Agent::attach(
        child.id(),
        &db,
        &["--no-gpu", "--step-python", "train_step", "--step-python", "validate=validate"],
    );
    std::fs::write(&go, b"").expect("go");
    assert!(child.wait().expect("wait").success());
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    let s = last_session(&db);
    // The trainer loads libcuda lazily, right before its first launches: it
    // must have been probed where the target's LD_LIBRARY_PATH points.
    let predicted = count(
        &db,
        "SELECT count(*) FROM probed_files WHERE session_id = ?1 AND kind = 'driver' AND how = 'predicted'",
        s.id,
    );
    assert_eq!(predicted, 1, "libcuda probed before the target loaded it");
    let truth = Truth::read(&truth);
    let all = steps(&db, s.id);
    for label in ["train", "validate"] {
        let t: Vec<TruthStep> = truth.steps.iter().filter(|x| x.label == label).cloned().collect();
        let d: Vec<DbStep> = all.iter().filter(|x| x.label == label).cloned().collect();
        assert!(!t.is_empty(), "the trainer ran {label} steps");
        let e = assert_steps_match(&t, &d, STEP_TOLERANCE_NS);
        println!(
            "python {label}: {} steps, boundary p99 start {} ns, end {} ns",
            t.len(),
            BoundaryErrors::p99(&e.start),
            BoundaryErrors::p99(&e.end)
        );
        // Numbered from 0 per label.
        let mut nums: Vec<i64> = d.iter().map(|x| x.step).collect();
        nums.sort_unstable();
        assert_eq!(nums, (0..d.len() as i64).collect::<Vec<_>>());
    }
    assert_eq!(s.total_launches, Some(truth.total as i64));
}

/// Attaching `--step-python` to `python` (sleeping) fails with one line that says what to do.
fn no_usdt_probes_is_a_clear_error(name: &str, python: &Path, env: &[(&str, &str)]) {
    let dir = workdir(name);
    let db = dir.join("p.db");
    let mut child = std::process::Command::new(python)
        .args(["-c", "import time; time.sleep(30)"])
        .envs(env.iter().copied())
        .spawn()
        .expect("python");
    let (code, stderr) = profiler_output(&[
        "attach",
        &child.id().to_string(),
        "-o",
        db.to_str().expect("utf-8"),
        "--no-gpu",
        // Without it the PEP 523 frame hook would serve these (tests/tests/python_any.rs).
        "--no-target-writes",
        "--step-python",
        "train_step",
    ]);
    let _ = child.kill();
    let _ = child.wait();
    let error = the_error_line(code, &stderr);
    assert!(error.contains("--with-dtrace") || error.contains("--step-symbol"), "says what to do: {stderr}");
}

#[test]
fn interpreter_without_usdt_probes_is_a_clear_error() {
    // On any host: Debian's interpreter with its USDT notes removed.
    assert!(Path::new(PYTHON).exists(), "{PYTHON} (Debian's python3.11) is needed");
    let dir = workdir("python-stripped");
    let stripped = dir.join("python3.11");
    let out = std::process::Command::new("objcopy")
        .args(["--remove-section", ".note.stapsdt", PYTHON])
        .arg(&stripped)
        .output()
        .expect("objcopy (binutils)");
    assert!(out.status.success(), "objcopy: {}", String::from_utf8_lossy(&out.stderr));
    no_usdt_probes_is_a_clear_error("python-noprobes-stripped", &stripped, &[("PYTHONHOME", "/usr")]);

    // A python.org-style build (pyenv's are built without --with-dtrace), where this host has one.
    let pyenv = std::fs::read_dir("/root/.pyenv/versions")
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin/python3"))
        // 3.10 needs no write for the frame hook, so --no-target-writes does not stop it.
        .find(|p| p.exists() && !p.to_string_lossy().contains("/3.10."));
    match pyenv {
        Some(python) => no_usdt_probes_is_a_clear_error("python-noprobes-pyenv", &python, &[]),
        None => skip("a pyenv interpreter (built without USDT probes): none under /root/.pyenv/versions"),
    }
}
