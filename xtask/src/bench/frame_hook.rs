//! `cargo xtask bench`, frame-hook part: what the PEP 523 frame hook costs
//! a Python call on each CPython this host has without USDT probes
//! (pyenv's; Debian's 3.13 and 3.14 as `cargo xtask fixtures` unpacks them):
//! untraced, with `eval_frame` written but no probes (the target writes it
//! itself through `_PyInterpreterState_SetEvalFrameFunc`: what a SIGKILLed
//! profiler leaves behind), and traced by `--step-python`; and how far the
//! step boundaries the probes see are from the trainer's own stamps. Prints
//! a table; asserts nothing.
use std::{
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use super::harness;
use crate::say;

const CALLS: u64 = 300_000;
const REPEATS: usize = 3;
const VERSIONS: [&str; 4] = ["3.10.13", "3.11.7", "3.12.1", "3.13.0"];
/// Steps of the boundary run.
const STEPS: &str = "200";

/// Times CALLS calls of a trivial function; argv: mode (plain|hook), go file ('-': none).
const SCRIPT: &str = r#"
import ctypes, os, sys, time
def tiny(x):
    return x
def loop(n):
    for i in range(n):
        tiny(i)
mode, n, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if mode == "hook":
    api = ctypes.pythonapi
    api.PyInterpreterState_Get.restype = ctypes.c_void_p
    api._PyInterpreterState_SetEvalFrameFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    api._PyInterpreterState_SetEvalFrameFunc(api.PyInterpreterState_Get(), ctypes.cast(api._PyEval_EvalFrameDefault, ctypes.c_void_p))
while go != "-" and not os.path.exists(go):
    time.sleep(0.01)
loop(1000)
t = time.monotonic_ns()
loop(n)
print((time.monotonic_ns() - t) / n)
"#;

/// A CPython to measure: its name in the table, and the command that starts it.
struct Python {
    name: String,
    argv: Vec<String>,
}

impl Python {
    fn command(&self) -> Command {
        let mut c = Command::new(&self.argv[0]);
        c.args(&self.argv[1..]);
        c
    }
}

/// pyenv's builds, then Debian's run through their own glibc's loader.
fn pythons() -> Vec<Python> {
    let mut out: Vec<Python> = VERSIONS
        .iter()
        .map(|v| (v, format!("/root/.pyenv/versions/{v}/bin/python3")))
        .filter(|(_, p)| Path::new(p).exists())
        .map(|(v, p)| Python { name: format!("{v} pyenv"), argv: vec![p] })
        .collect();
    for (suite, v) in crate::debian_python::PYTHONS {
        let root = crate::fixtures_dir().join("debian-python").join(suite).join("root");
        let (python, lib) = (root.join(format!("usr/bin/python{v}")), root.join("usr/lib/x86_64-linux-gnu"));
        if python.exists() {
            let path = format!("{}:{}:/lib/x86_64-linux-gnu", lib.display(), crate::fixtures_dir().display());
            let argv = [lib.join("ld-linux-x86-64.so.2").display().to_string(), "--library-path".into(), path];
            let mut argv = argv.to_vec();
            argv.push(python.display().to_string());
            out.push(Python { name: format!("{v} {suite}"), argv });
        }
    }
    out
}

fn run_once(python: &Python, mode: &str, work: &Path) -> Result<f64> {
    let go = work.join("fh_go");
    let db = work.join("fh_bench.db");
    let _ = std::fs::remove_file(&go);
    let _ = std::fs::remove_file(&db);
    let traced = mode == "traced";
    let script_mode = if mode == "hook" { "hook" } else { "plain" };
    let go_arg = if traced { go.display().to_string() } else { "-".into() };
    let target = python
        .command()
        .args(["-c", SCRIPT, script_mode, &CALLS.to_string(), &go_arg])
        .stdout(Stdio::piped())
        .spawn()
        .context("start python")?;
    let agent = if traced {
        let c = attach(target.id(), &db, &["--step-python", "train_step"])?;
        std::fs::write(&go, b"")?;
        Some(c)
    } else {
        None
    };
    let out = target.wait_with_output()?;
    if !out.status.success() {
        bail!("{}: {}", python.name, out.status);
    }
    if let Some(a) = agent {
        harness::wait_rusage(&a)?;
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse::<f64>()?)
}

/// Starts the profiler on `pid` with `args` (no GPU) and waits until it traces.
fn attach(pid: u32, db: &Path, args: &[&str]) -> Result<std::process::Child> {
    harness::attach_agent(pid, &[&["--no-gpu"], args].concat(), db)
}

/// Step boundary error, p50 and p99 in ns: the Python trainer's own stamps
/// against the steps the probes recorded (entry before the first stamp,
/// return after the last).
fn boundary_errors(python: &Python, work: &Path) -> Result<(i64, i64)> {
    let (truth, go, db) = (work.join("fh_truth.txt"), work.join("fh_go"), work.join("fh_steps.db"));
    for p in [&truth, &go, &db] {
        let _ = std::fs::remove_file(p);
    }
    let target = python
        .command()
        .arg(crate::root().join("tests/fixtures/py_trainer.py"))
        .args(["--steps", STEPS, "--launches", "4", "--step-sleep-us", "500", "--gap-us", "200", "--truth"])
        .arg(&truth)
        .arg("--wait-file")
        .arg(&go)
        .env("LD_LIBRARY_PATH", crate::fixtures_dir())
        .stdout(Stdio::null())
        .spawn()
        .context("start the Python trainer")?;
    let agent = attach(target.id(), &db, &["--step-python", "train_step"])?;
    std::fs::write(&go, b"")?;
    let out = target.wait_with_output()?;
    harness::wait_rusage(&agent)?;
    if !out.status.success() {
        bail!("{}: the trainer: {}", python.name, out.status);
    }
    let mut stamps: Vec<(i64, i64, i64)> = std::fs::read_to_string(&truth)?
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.strip_prefix("step ")?.split_whitespace().collect();
            Some((f.first()?.parse().ok()?, f.get(1)?.parse().ok()?, f.get(2)?.parse().ok()?))
        })
        .collect();
    stamps.sort_unstable();
    let conn = rusqlite::Connection::open(&db)?;
    let mut q =
        conn.prepare("SELECT tid, start_ns, end_ns FROM steps WHERE end_ns IS NOT NULL ORDER BY tid, start_ns")?;
    let seen: Vec<(i64, i64, i64)> =
        q.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?.collect::<Result<_, _>>()?;
    if seen.len() != stamps.len() {
        bail!("{}: {} steps recorded, {} run", python.name, seen.len(), stamps.len());
    }
    let mut errors: Vec<i64> = stamps.iter().zip(&seen).flat_map(|(t, d)| [t.1 - d.1, d.2 - t.2]).collect();
    errors.sort_unstable();
    let at = |p: usize| errors.get((errors.len() * p / 100).min(errors.len().saturating_sub(1))).copied();
    Ok((at(50).unwrap_or(0), at(99).unwrap_or(0)))
}

/// Prints ns per Python call: untraced / hook written without probes /
/// traced, and the step boundary error, per version.
pub fn frame_hook_table(work: &Path) -> Result<()> {
    let pythons = pythons();
    if pythons.is_empty() {
        say("bench: no CPython without USDT probes here (pyenv, or `cargo xtask fixtures`'s Debian ones)");
        return Ok(());
    }
    say(format!("bench: frame hook ({REPEATS} runs of {CALLS} calls per cell)"));
    println!();
    println!("Cost per Python call under the PEP 523 frame hook (median of {REPEATS} runs of {CALLS} calls)");
    println!("and step boundary error (probe vs the trainer's stamps, {STEPS} steps)");
    println!(
        "| {:<13} | {:>9} | {:>14} | {:>9} | {:>10} | {:>10} |",
        "CPython", "untraced", "hook, no probe", "traced", "bound. p50", "bound. p99"
    );
    println!("|{:-<15}|{:->11}|{:->16}|{:->11}|{:->12}|{:->12}|", "", "", "", "", "", "");
    for python in &pythons {
        let mut cells = Vec::new();
        for mode in ["plain", "hook", "traced"] {
            cells.push(harness::median((0..REPEATS).map(|_| run_once(python, mode, work)).collect::<Result<_>>()?));
        }
        let (p50, p99) = boundary_errors(python, work)?;
        println!(
            "| {:<13} | {:>9.0} | {:>14.0} | {:>9.0} | {:>7.1} µs | {:>7.1} µs |",
            python.name,
            cells[0],
            cells[1],
            cells[2],
            p50 as f64 / 1e3,
            p99 as f64 / 1e3
        );
    }
    println!("(ns per call; traced: an entry uprobe and a return probe per call, names filtered in the kernel)");
    Ok(())
}
