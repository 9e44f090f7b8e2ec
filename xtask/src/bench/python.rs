//! `cargo xtask bench`, Python part: what `--step-python` costs a
//! Python-heavy loop. Prints a table; asserts nothing.
//!
//! The stdlib trainer (`tests/fixtures/py_trainer.py --calls N`) times N
//! calls of a trivial function with `time.monotonic_ns()`; every call fires
//! CPython's `function__entry` and `function__return` once the profiler has
//! set their semaphores (and, on CPython 3.11, the `line` semaphore that puts
//! the interpreter into the tracing dispatch those entries need).
use std::{path::Path, process::Command};

use anyhow::{Context, Result, bail};

use super::harness;
use crate::{fixtures_dir, root, say};

/// Debian's interpreter, built with --with-dtrace.
const PYTHON: &str = "/usr/bin/python3.11";
const CALLS: u64 = 1_000_000;
const REPEATS: usize = 5;

/// ns per call of one run, traced by the profiler when `traced`.
fn run_once(traced: bool, work: &Path) -> Result<f64> {
    let truth = work.join("py_truth.txt");
    let go = work.join("py_go");
    let db = work.join("py_bench.db");
    for p in [&truth, &go, &db] {
        let _ = std::fs::remove_file(p);
    }
    let mut trainer = Command::new(PYTHON)
        .arg(root().join("tests/fixtures/py_trainer.py"))
        .args(["--steps", "0", "--calls", &CALLS.to_string(), "--truth"])
        .arg(&truth)
        .arg("--wait-file")
        .arg(&go)
        .env("LD_LIBRARY_PATH", fixtures_dir())
        .spawn()
        .context("start the Python trainer")?;
    let agent = if traced {
        Some(harness::attach_agent(trainer.id(), &["--no-gpu", "--step-python", "train_step"], &db)?)
    } else {
        None
    };
    std::fs::write(&go, b"")?;
    let status = trainer.wait()?;
    if !status.success() {
        bail!("Python trainer: {status}");
    }
    if let Some(a) = agent {
        // A profiler that failed would make the traced row a lie.
        harness::wait_rusage(&a)?;
    }
    let text = std::fs::read_to_string(&truth).with_context(|| format!("read {}", truth.display()))?;
    let line = text.lines().find_map(|l| l.strip_prefix("calls ")).context("no 'calls' line in the truth")?;
    let (n, ns) = line.split_once(' ').context("malformed 'calls' line")?;
    Ok(ns.trim().parse::<f64>()? / n.parse::<f64>()?)
}

/// Prints untraced vs `--step-python` ns per Python call.
pub fn python_table(work: &Path) -> Result<()> {
    if !Path::new(PYTHON).exists() {
        say(format!("bench: {PYTHON} not installed, skipping the Python table"));
        return Ok(());
    }
    say(format!("bench: Python calls ({REPEATS} runs of {CALLS} calls, untraced and with --step-python)"));
    let untraced = harness::median((0..REPEATS).map(|_| run_once(false, work)).collect::<Result<_>>()?);
    let traced = harness::median((0..REPEATS).map(|_| run_once(true, work)).collect::<Result<_>>()?);
    println!();
    println!("Cost per Python call ({CALLS} calls of a trivial function, median of {REPEATS}), {PYTHON}");
    println!("| {:<36} | {:>9} | {:>12} |", "scenario", "ns / call", "calls / s");
    println!("|{:-<38}|{:->11}|{:->14}|", "", "", "");
    for (name, ns) in [("untraced", untraced), ("profiler --step-python train_step", traced)] {
        println!("| {name:<36} | {ns:>9.0} | {:>12.0} |", 1e9 / ns);
    }
    println!("ratio traced/untraced: {:.1}", traced / untraced);
    println!("(every Python call traps twice into the kernel; CPython 3.11 also runs its slower tracing dispatch)");
    Ok(())
}
