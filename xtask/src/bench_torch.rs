//! `cargo xtask bench`, PyTorch part: steps from PyTorch's own
//! `record_function` markers on a real training loop (tests/fixtures/torch_loop.py,
//! AdamW with a DataLoader, CPU). Prints a table; asserts nothing.
//!
//! - How far each step's start and end are from the loop's own stamps (taken
//!   right after `next()` and `optimizer.step()` return, so a little after
//!   the probes that fire inside them: the error is that distance).
//! - What tracing costs the loop: its step period traced ÷ untraced.
//! - How long `profiler attach` takes to record a first step of a loop that
//!   is already running: from the command's start to that step's end.
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context, Result, bail};

use crate::{profiler_bin, root, say, torch_env};

/// Optimizer steps per run (≈1.5 ms each on one CPU core).
const STEPS: usize = 1500;
const REPEATS: usize = 3;

/// One loop step as it wrote it: (start, end) in CLOCK_MONOTONIC ns.
type Stamps = Vec<(i64, i64)>;

fn monotonic_ns() -> i64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

/// The loop's `step` lines.
fn read_stamps(path: &Path) -> Result<Stamps> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    text.lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| {
            let f: Vec<i64> = l.split_whitespace().skip(1).map(str::parse).collect::<Result<_, _>>()?;
            Ok((f[2], f[3]))
        })
        .collect()
}

/// The session's completed `train` steps that are not marked incomplete.
fn db_steps(db: &Path) -> Result<Stamps> {
    let conn = rusqlite::Connection::open(db)?;
    let mut q = conn.prepare(
        "SELECT start_ns, end_ns FROM steps WHERE label = 'train' AND end_ns IS NOT NULL
         AND coalesce(incomplete, 0) = 0 ORDER BY start_ns",
    )?;
    let rows = q.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect::<Result<_, _>>()?;
    Ok(rows)
}

struct Run {
    stamps: Stamps,
    db: Option<Stamps>,
}

/// Starts the loop, waiting until it has imported torch and is about to train.
fn start_loop(python: &Path, work: &Path, args: &[&str]) -> Result<Child> {
    for f in ["truth.txt", "go", "ready"] {
        let _ = std::fs::remove_file(work.join(f));
    }
    let child = Command::new(python)
        .arg(root().join("tests/fixtures/torch_loop.py"))
        .args(args)
        .arg("--truth")
        .arg(work.join("truth.txt"))
        .arg("--wait-file")
        .arg(work.join("go"))
        .arg("--ready-file")
        .arg(work.join("ready"))
        .spawn()
        .context("start the PyTorch loop")?;
    let t0 = std::time::Instant::now();
    while !work.join("ready").exists() {
        if t0.elapsed() > Duration::from_secs(120) {
            bail!("the PyTorch loop never got ready");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(child)
}

fn attach(pid: u32, db: &Path, extra: &[&str]) -> Result<Child> {
    let _ = std::fs::remove_file(db);
    Command::new(profiler_bin())
        .args(["attach", &pid.to_string(), "--no-gpu", "-o"])
        .arg(db)
        .args(extra)
        .stderr(Stdio::piped())
        .spawn()
        .context("start the profiler")
}

/// One run of STEPS steps, traced (from before its first step) or not.
fn run_once(python: &Path, work: &Path, traced: bool) -> Result<Run> {
    let steps = STEPS.to_string();
    let mut child = start_loop(python, work, &["--steps", &steps, "--optimizer", "adamw"])?;
    let db = work.join("torch_bench.db");
    let agent = if traced {
        let _ = std::fs::remove_file(&db);
        Some(crate::bench::attach_agent(child.id(), &["--no-gpu"], &db)?)
    } else {
        None
    };
    std::fs::write(work.join("go"), b"")?;
    let status = child.wait()?;
    if !status.success() {
        bail!("PyTorch loop: {status}");
    }
    if let Some(a) = agent {
        crate::bench::wait_rusage(&a)?;
    }
    let stamps = read_stamps(&work.join("truth.txt"))?;
    Ok(Run { stamps, db: if traced { Some(db_steps(&db)?) } else { None } })
}

/// Median time between consecutive step ends, ns.
fn period(stamps: &Stamps) -> f64 {
    let gaps: Vec<f64> = stamps.windows(2).map(|w| (w[1].1 - w[0].1) as f64).collect();
    percentile(gaps, 50)
}

fn percentile(mut v: Vec<f64>, p: usize) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[(p * v.len()).div_ceil(100).clamp(1, v.len()) - 1]
}

/// (start errors, end errors, loop steps without a database step), ns: each
/// database step against the loop step whose end follows it first.
fn errors(run: &Run) -> (Vec<f64>, Vec<f64>, usize) {
    let (mut starts, mut ends) = (Vec::new(), Vec::new());
    let db = run.db.as_deref().unwrap_or_default();
    for &(s, e) in db {
        let Some(&(ts, te)) = run.stamps.iter().find(|&&(_, te)| te >= e) else { continue };
        ends.push((te - e) as f64);
        starts.push((ts - s) as f64);
    }
    (starts, ends, run.stamps.len().saturating_sub(db.len()))
}

/// From `profiler attach` to the end of the first step it records, on a loop
/// already running, s.
fn attach_to_first_step(python: &Path, work: &Path) -> Result<f64> {
    let mut child = start_loop(python, work, &["--forever"])?;
    std::fs::write(work.join("go"), b"")?;
    std::thread::sleep(Duration::from_millis(1000));
    let db = work.join("torch_attach.db");
    let t0 = monotonic_ns();
    let agent = attach(child.id(), &db, &["--duration", "3"])?;
    let done = crate::bench::wait_rusage(&agent);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let _ = child.wait();
    done?;
    let first = db_steps(&db)?.first().map(|&(_, e)| e).context("no step recorded after attach")?;
    Ok((first - t0) as f64 / 1e9)
}

/// Prints the PyTorch table, with the first Python that has a PyTorch environment.
pub fn torch_table(work: &Path) -> Result<()> {
    let Some((name, python)) = torch_env::ensure_all().into_iter().next() else {
        say("bench: no PyTorch environment (see `cargo xtask torch-env`): skipping the PyTorch table");
        return Ok(());
    };
    let work: PathBuf = work.join("torch");
    std::fs::create_dir_all(&work)?;
    say(format!(
        "bench: PyTorch {} steps on {name} ({REPEATS} runs of {STEPS} steps each way)",
        torch_env::TORCH_VERSION
    ));
    let mut untraced = Vec::new();
    let mut traced = Vec::new();
    // Interleaved, so that a change in the machine's load hits both alike.
    for _ in 0..REPEATS {
        untraced.push(run_once(&python, &work, false)?);
        traced.push(run_once(&python, &work, true)?);
    }
    let attach: Vec<f64> = (0..REPEATS).map(|_| attach_to_first_step(&python, &work)).collect::<Result<_>>()?;
    let (mut starts, mut ends, mut missed) = (Vec::new(), Vec::new(), 0);
    for r in &traced {
        let (s, e, m) = errors(r);
        starts.extend(s);
        ends.extend(e);
        missed += m;
    }
    let med = |runs: &[Run]| percentile(runs.iter().map(|r| period(&r.stamps)).collect(), 50);
    let (u, t) = (med(&untraced), med(&traced));
    println!();
    println!(
        "PyTorch {} steps from record_function markers ({name}, AdamW + DataLoader on CPU, {REPEATS}×{STEPS} steps)",
        torch_env::TORCH_VERSION
    );
    println!("| {:<44} | {:>12} |", "figure", "value");
    println!("|{:-<46}|{:->14}|", "", "");
    let us = |v: f64| format!("{:.1} µs", v / 1e3);
    let rows = [
        ("step start error p50 (loop stamp − start)", us(percentile(starts.clone(), 50))),
        ("step start error p99", us(percentile(starts, 99))),
        ("step end error p50 (loop stamp − end)", us(percentile(ends.clone(), 50))),
        ("step end error p99", us(percentile(ends, 99))),
        ("loop steps with no complete database step", missed.to_string()),
        ("step period untraced (median)", format!("{:.3} ms", u / 1e6)),
        ("step period traced (median)", format!("{:.3} ms", t / 1e6)),
        ("traced ÷ untraced", format!("{:.3}", t / u)),
        ("attach → first step recorded (median)", format!("{:.3} s", percentile(attach.clone(), 50))),
        ("attach → first step recorded (max)", format!("{:.3} s", percentile(attach, 100))),
    ];
    for (k, v) in rows {
        println!("| {k:<44} | {v:>12} |");
    }
    println!("(errors include the loop's own time from the probe to its stamp: the Python return and a clock read)");
    Ok(())
}
