//! `cargo xtask bench`, frame-hook part: what the PEP 523 frame hook costs
//! a Python call on each CPython this host has without USDT probes
//! (pyenv's): untraced, with `eval_frame` written but no probes (the target
//! writes it itself through `_PyInterpreterState_SetEvalFrameFunc`: what a
//! SIGKILLed profiler leaves behind), and traced by `--step-python`. Prints
//! a table; asserts nothing.
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use crate::{profiler_bin, say};

const CALLS: u64 = 300_000;
const REPEATS: usize = 3;
const VERSIONS: [&str; 4] = ["3.10.13", "3.11.7", "3.12.1", "3.13.0"];

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

fn run_once(python: &Path, mode: &str, work: &Path) -> Result<f64> {
    let go = work.join("fh_go");
    let db = work.join("fh_bench.db");
    let _ = std::fs::remove_file(&go);
    let _ = std::fs::remove_file(&db);
    let traced = mode == "traced";
    let script_mode = if mode == "hook" { "hook" } else { "plain" };
    let go_arg = if traced { go.display().to_string() } else { "-".into() };
    let target = Command::new(python)
        .args(["-c", SCRIPT, script_mode, &CALLS.to_string(), &go_arg])
        .stdout(Stdio::piped())
        .spawn()
        .context("start python")?;
    let agent = if traced {
        let mut c = Command::new(profiler_bin())
            .args(["attach", &target.id().to_string(), "--no-gpu", "--step-python", "train_step", "-o"])
            .arg(&db)
            .stderr(Stdio::piped())
            .spawn()
            .context("start the profiler")?;
        crate::bench::wait_for_line(c.stderr.take().context("stderr")?, "tracing PID")?;
        std::fs::write(&go, b"")?;
        Some(c)
    } else {
        None
    };
    let out = target.wait_with_output()?;
    if !out.status.success() {
        bail!("{}: {}", python.display(), out.status);
    }
    if let Some(a) = agent {
        crate::bench::wait_rusage(&a)?;
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse::<f64>()?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Prints ns per Python call: untraced / hook written without probes / traced, per version.
pub fn frame_hook_table(work: &Path) -> Result<()> {
    let pythons: Vec<(&str, PathBuf)> = VERSIONS
        .iter()
        .map(|v| (*v, PathBuf::from(format!("/root/.pyenv/versions/{v}/bin/python3"))))
        .filter(|(_, p)| p.exists())
        .collect();
    if pythons.is_empty() {
        say("bench: no pyenv CPython, skipping the frame-hook table");
        return Ok(());
    }
    say(format!("bench: frame hook ({REPEATS} runs of {CALLS} calls per cell)"));
    println!();
    println!("Cost per Python call under the PEP 523 frame hook (median of {REPEATS} runs of {CALLS} calls)");
    println!("| {:<8} | {:>9} | {:>14} | {:>9} |", "CPython", "untraced", "hook, no probe", "traced");
    println!("|{:-<10}|{:->11}|{:->16}|{:->11}|", "", "", "", "");
    for (v, python) in pythons {
        let mut cells = Vec::new();
        for mode in ["plain", "hook", "traced"] {
            cells.push(median((0..REPEATS).map(|_| run_once(&python, mode, work)).collect::<Result<_>>()?));
        }
        println!("| {v:<8} | {:>9.0} | {:>14.0} | {:>9.0} |", cells[0], cells[1], cells[2]);
    }
    println!("(ns per call; traced: an entry uprobe and a return probe per call, names filtered in the kernel)");
    Ok(())
}
