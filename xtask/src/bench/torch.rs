//! `cargo xtask bench`, PyTorch part: steps from PyTorch's own
//! `record_function` markers on a real training loop (tests/fixtures/torch_loop.py
//! `--forever`, AdamW with a DataLoader, CPU). Prints a table; asserts nothing.
//!
//! Everything is measured inside one process, since separate runs of the
//! loop on a shared VM differ from one another by more than tracing costs:
//! the loop trains on, and the profiler is attached (`--duration`) and gone
//! in alternating windows.
//! - What tracing costs the loop: each attached window's median step period
//!   over the mean of its two detached neighbours' medians; the figure is
//!   the median of those ratios over the rounds.
//! - How far each step's start and end are from the loop's own stamps (taken
//!   right after `next()` and `optimizer.step()` return, so a little after
//!   the probes that fire inside them: the error is that distance).
//! - How long `profiler attach` takes to record a first step of the running
//!   loop: from the command's start to that step's end.
use std::{
    path::{Path, PathBuf},
    process::{Child, Command},
    time::Duration,
};

use anyhow::{Context, Result, bail};

use super::harness::{self, monotonic_ns};
use crate::{root, say, torch_env};

/// Attached windows; a detached window comes before each and after the last.
const ROUNDS: usize = 5;
/// Each window's length (≈1.5 ms a step on one CPU core: about 2000 steps).
const WINDOW_S: u64 = 3;

/// One loop step as it wrote it: (start, end) in CLOCK_MONOTONIC ns.
type Stamps = Vec<(i64, i64)>;

/// The loop's `step` lines; a last line cut short by the kill is left out.
fn read_stamps(path: &Path) -> Result<Stamps> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let step = |l: &str| -> Option<(i64, i64)> {
        let f: Vec<i64> = l.strip_prefix("step ")?.split_whitespace().map(|v| v.parse().ok()).collect::<Option<_>>()?;
        (f.len() == 6).then(|| (f[2], f[3]))
    };
    Ok(text.lines().filter_map(step).collect())
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

/// The loop, killed and collected however the bench ends.
struct Loop(Child);

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the loop, training from the start, once it has imported torch.
fn start_loop(python: &Path, work: &Path) -> Result<Loop> {
    for f in ["truth.txt", "go", "ready"] {
        let _ = std::fs::remove_file(work.join(f));
    }
    let child = Command::new(python)
        .arg(root().join("tests/fixtures/torch_loop.py"))
        .args(["--forever", "--optimizer", "adamw", "--truth"])
        .arg(work.join("truth.txt"))
        .arg("--wait-file")
        .arg(work.join("go"))
        .arg("--ready-file")
        .arg(work.join("ready"))
        .spawn()
        .context("start the PyTorch loop")?;
    let running = Loop(child);
    let t0 = std::time::Instant::now();
    while !work.join("ready").exists() {
        if t0.elapsed() > Duration::from_secs(120) {
            bail!("the PyTorch loop never got ready");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::write(work.join("go"), b"")?;
    Ok(running)
}

/// A stretch of the loop's time, in CLOCK_MONOTONIC ns.
#[derive(Clone, Copy)]
struct Window {
    start: i64,
    end: i64,
}

impl Window {
    /// A window of `WINDOW_S` from now, slept through.
    fn detached() -> Window {
        let start = monotonic_ns();
        std::thread::sleep(Duration::from_secs(WINDOW_S));
        Window { start, end: monotonic_ns() }
    }

    fn holds(self, (start, end): (i64, i64)) -> bool {
        start >= self.start && end <= self.end
    }
}

/// One attached window: when the attach began, the window it traced, its
/// database, the agent's CPU time (s) and the loop's (its processes', ns) over it.
struct Attached {
    began: i64,
    window: Window,
    db: PathBuf,
    agent_cpu_s: f64,
    loop_cpu_ns: u64,
}

/// Attaches for `WINDOW_S` (the profiler stops itself, `extra` its further
/// flags) and waits for it to be gone.
fn attached(pid: u32, db: PathBuf, extra: &[&str]) -> Result<Attached> {
    let began = monotonic_ns();
    let duration = WINDOW_S.to_string();
    let args = [&["--no-gpu", "--duration", &duration][..], extra].concat();
    let cpu_before = harness::tree_cpu_ns(pid);
    let agent = harness::attach_agent(pid, &args, &db)?;
    let start = monotonic_ns();
    let (agent_cpu_s, _) = harness::wait_rusage(&agent)?;
    let loop_cpu_ns = harness::tree_cpu_ns(pid).saturating_sub(cpu_before);
    let end = monotonic_ns().min(start + WINDOW_S as i64 * 1_000_000_000);
    Ok(Attached { began, window: Window { start, end }, db, agent_cpu_s, loop_cpu_ns })
}

/// What one loop gave: its stamps, the detached windows (one more than the
/// attached ones, around them) and the attached ones.
struct Rounds {
    stamps: Stamps,
    detached: Vec<Window>,
    attached: Vec<Attached>,
}

/// Runs the loop through `ROUNDS` rounds of three attached windows (as by
/// default, with `--no-sched`, with `--no-cpu-samples`), each between two
/// detached ones.
fn run_rounds(python: &Path, work: &Path) -> Result<Rounds> {
    let running = start_loop(python, work)?;
    // Past the first steps' warm-up (allocator, DataLoader workers' start).
    std::thread::sleep(Duration::from_secs(1));
    let pid = running.0.id();
    let mut detached = vec![Window::detached()];
    let mut rounds = Vec::new();
    for round in 0..ROUNDS {
        say(format!(
            "bench: PyTorch round {}/{ROUNDS}: attached, detached, attached --no-sched, detached, attached \
             --no-cpu-samples, detached",
            round + 1
        ));
        rounds.push(attached(pid, work.join(format!("torch_bench_{round}.db")), &[])?);
        detached.push(Window::detached());
        rounds.push(attached(pid, work.join(format!("torch_bench_{round}_nosched.db")), &["--no-sched"])?);
        detached.push(Window::detached());
        let db = work.join(format!("torch_bench_{round}_nosamples.db"));
        rounds.push(attached(pid, db, &["--no-cpu-samples"])?);
        detached.push(Window::detached());
    }
    drop(running);
    Ok(Rounds { stamps: read_stamps(&work.join("truth.txt"))?, detached, attached: rounds })
}

/// The sampling program's runs and their kernel time (ns) in a session's row.
fn sampler_kernel_cost(db: &Path) -> Result<(i64, i64)> {
    let conn = rusqlite::Connection::open(db)?;
    let (runs, ns): (Option<i64>, Option<i64>) =
        conn.query_row("SELECT cpu_sample_runs, cpu_sample_kernel_ns FROM sessions", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })?;
    match (runs, ns) {
        (Some(r), Some(n)) => Ok((r, n)),
        _ => bail!("{}: the kernel did not count the sampler's runs (see its capabilities row)", db.display()),
    }
}

/// Median time between consecutive step ends inside `w`, ns.
fn period(stamps: &Stamps, w: Window) -> f64 {
    let gaps = stamps.windows(2).filter(|p| w.holds((p[0].1, p[1].1))).map(|p| (p[1].1 - p[0].1) as f64);
    percentile(gaps.collect(), 50)
}

fn percentile(mut v: Vec<f64>, p: usize) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[(p * v.len()).div_ceil(100).clamp(1, v.len()) - 1]
}

/// Boundary errors of one attached window: (start errors, end errors, loop
/// steps inside the window without a database step ending in them), ns:
/// each database step against the loop step whose end follows it first.
fn errors(stamps: &Stamps, a: &Attached) -> Result<(Vec<f64>, Vec<f64>, usize)> {
    let db = db_steps(&a.db)?;
    let (mut starts, mut ends) = (Vec::new(), Vec::new());
    for &(s, e) in &db {
        let Some(&(ts, te)) = stamps.iter().find(|&&(_, te)| te >= e) else { continue };
        ends.push((te - e) as f64);
        starts.push((ts - s) as f64);
    }
    let missed = stamps
        .iter()
        .filter(|&&step| a.window.holds(step))
        .filter(|&&(ts, te)| !db.iter().any(|&(_, e)| e > ts && e <= te))
        .count();
    Ok((starts, ends, missed))
}

/// Each round's attached period over its detached neighbours' mean, and the
/// periods: (ratios, detached medians, attached medians).
fn ratios(r: &Rounds) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let off: Vec<f64> = r.detached.iter().map(|&w| period(&r.stamps, w)).collect();
    let on: Vec<f64> = r.attached.iter().map(|a| period(&r.stamps, a.window)).collect();
    let ratios = on.iter().enumerate().map(|(i, t)| t / ((off[i] + off[i + 1]) / 2.0)).collect();
    (ratios, off, on)
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
        "bench: PyTorch {} steps on {name} (one loop, {ROUNDS} attached windows of {WINDOW_S} s between detached ones)",
        torch_env::TORCH_VERSION
    ));
    let r = run_rounds(&python, &work)?;
    let (mut starts, mut ends, mut missed, mut attach) = (Vec::new(), Vec::new(), 0, Vec::new());
    for a in &r.attached {
        let (s, e, m) = errors(&r.stamps, a)?;
        starts.extend(s);
        ends.extend(e);
        missed += m;
        let first = db_steps(&a.db)?.first().map(|&(_, e)| e).context("no step recorded after attach")?;
        attach.push((first - a.began) as f64 / 1e9);
    }
    let (all_ratios, off, all_on) = ratios(&r);
    // Each round: as by default, --no-sched, --no-cpu-samples.
    let every_third = |v: &[f64], k: usize| v.iter().skip(k).step_by(3).copied().collect::<Vec<f64>>();
    let (ratios, no_sched) = (every_third(&all_ratios, 0), every_third(&all_ratios, 1));
    let no_samples = every_third(&all_ratios, 2);
    // The sampler's own cost (99 Hz, Python frames): a round's default window over its --no-cpu-samples one.
    let sampler: Vec<f64> = ratios.iter().zip(&no_samples).map(|(a, b)| a / b).collect();
    let on = every_third(&all_on, 0);
    // The sampler in the kernel, as the kernel counts it, in the default windows:
    // per run, and all runs' time over the loop's CPU time then (an upper
    // bound of its cost to the loop: runs on other threads' ticks count too).
    let (mut per_run_us, mut kernel_share, mut agent_share) = (Vec::new(), Vec::new(), Vec::new());
    for (i, a) in r.attached.iter().enumerate() {
        let window_s = (a.window.end - a.window.start) as f64 / 1e9;
        agent_share.push((i % 3, a.agent_cpu_s / window_s * 100.0));
        if i % 3 != 0 {
            continue;
        }
        let (runs, ns) = sampler_kernel_cost(&a.db)?;
        per_run_us.push(ns as f64 / runs.max(1) as f64 / 1e3);
        kernel_share.push(ns as f64 / a.loop_cpu_ns.max(1) as f64 * 100.0);
    }
    let agent = |k: usize| percentile(agent_share.iter().filter(|(j, _)| *j == k).map(|(_, v)| *v).collect(), 50);
    println!();
    println!(
        "PyTorch {} steps from record_function markers ({name}, AdamW + DataLoader on CPU, one loop: \
         {ROUNDS} attached windows of {WINDOW_S} s, each between detached ones)",
        torch_env::TORCH_VERSION
    );
    println!("| {:<48} | {:>12} |", "figure", "value");
    println!("|{:-<50}|{:->14}|", "", "");
    let us = |v: f64| format!("{:.1} µs", v / 1e3);
    let rows = [
        ("step start error p50 (loop stamp − start)", us(percentile(starts.clone(), 50))),
        ("step start error p99", us(percentile(starts, 99))),
        ("step end error p50 (loop stamp − end)", us(percentile(ends.clone(), 50))),
        ("step end error p99", us(percentile(ends, 99))),
        ("loop steps with no complete database step", missed.to_string()),
        ("step period detached (median of windows)", format!("{:.3} ms", percentile(off, 50) / 1e6)),
        ("step period attached (median of windows)", format!("{:.3} ms", percentile(on, 50) / 1e6)),
        ("attached ÷ detached (median of rounds)", format!("{:.3}", percentile(ratios.clone(), 50))),
        (
            "attached ÷ detached (min … max)",
            format!("{:.3} … {:.3}", percentile(ratios.clone(), 0), percentile(ratios, 100)),
        ),
        ("attached --no-sched ÷ detached (median)", format!("{:.3}", percentile(no_sched.clone(), 50))),
        (
            "attached --no-sched ÷ detached (min … max)",
            format!("{:.3} … {:.3}", percentile(no_sched.clone(), 0), percentile(no_sched, 100)),
        ),
        ("attached --no-cpu-samples ÷ detached", format!("{:.3}", percentile(no_samples.clone(), 50))),
        ("sampler 99 Hz: default ÷ --no-cpu-samples", format!("{:.3}", percentile(sampler.clone(), 50))),
        (
            "sampler 99 Hz (min … max of rounds)",
            format!("{:.3} … {:.3}", percentile(sampler.clone(), 0), percentile(sampler, 100)),
        ),
        ("sampler 99 Hz in the kernel, per run (median)", format!("{:.1} µs", percentile(per_run_us, 50))),
        ("sampler 99 Hz in the kernel ÷ loop CPU (median)", format!("{:.3} %", percentile(kernel_share.clone(), 50))),
        ("  the same (max of rounds)", format!("{:.3} %", percentile(kernel_share, 100))),
        ("agent CPU ÷ window, default (median)", format!("{:.1} %", agent(0))),
        ("agent CPU ÷ window, --no-cpu-samples (median)", format!("{:.1} %", agent(2))),
        ("attach → first step recorded (median)", format!("{:.3} s", percentile(attach.clone(), 50))),
        ("attach → first step recorded (max)", format!("{:.3} s", percentile(attach, 100))),
    ];
    for (k, v) in rows {
        println!("| {k:<48} | {v:>12} |");
    }
    println!("(errors include the loop's own time from the probe to its stamp: the Python return and a clock read;");
    println!("a round's ratio: its attached window's median step period over its two detached neighbours' mean)");
    Ok(())
}
