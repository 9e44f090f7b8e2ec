//! `cargo xtask bench`, job part: one agent tracing an 8-rank job of the
//! stand-in trainer (the launcher fixture, a torchrun stand-in), each rank
//! launching about 10 000 kernels a second. Prints the time `attach
//! --children` takes to trace the job already running, the agent's CPU,
//! events/s and lost records. Asserts nothing.
//!
//! The ranks start at once and wait (`--wait-file`) so that the attach finds
//! all eight running; the agent is attached to the launcher, so its rusage
//! (`wait4`) is its own, not the job's.
use std::{
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context, Result, bail};

use super::harness;
use crate::{fixtures_dir, say};

const RANKS: u32 = 8;
/// Steps of `LAUNCHES` launches and `STEP_SLEEP_US` of sleep: ≈10 000 launches/s per rank.
const STEPS: u32 = 400;
const LAUNCHES: u32 = 100;
const STEP_SLEEP_US: u32 = 10_000;
const REPEATS: usize = 3;

/// One run's figures.
struct JobRun {
    attach_s: f64,
    traced_s: f64,
    agent_cpu_s: f64,
    launches: i64,
    lost: i64,
    sessions: i64,
}

fn run_once(work: &Path) -> Result<JobRun> {
    let (dir, go, db) = (work.join("job"), work.join("job_go"), work.join("job_bench.db"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    for p in [&go, &db] {
        let _ = std::fs::remove_file(p);
    }
    let fx = fixtures_dir();
    let trainer = fx.join("trainer");
    let mut launcher = Command::new(fx.join("launcher"))
        .args(["--ranks", &RANKS.to_string(), "--dir"])
        .arg(&dir)
        .arg("--")
        .arg(&trainer)
        .args(["--steps", &STEPS.to_string(), "--launches", &LAUNCHES.to_string()])
        .args(["--step-sleep-us", &STEP_SLEEP_US.to_string(), "--wait-file"])
        .arg(&go)
        .env("LD_LIBRARY_PATH", &fx)
        .stdout(Stdio::null())
        .spawn()
        .context("start the launcher")?;
    // Every rank started (each writes its truth file only at its end: wait for the processes).
    wait_for_ranks(launcher.id())?;
    let started = Instant::now();
    let symbol = format!("{}:train_step", trainer.display());
    let agent = harness::attach_agent(launcher.id(), &["--children", "--no-gpu", "--step-symbol", &symbol], &db)?;
    let attach_s = started.elapsed().as_secs_f64();
    let traced = Instant::now();
    std::fs::write(&go, b"")?;
    let status = launcher.wait()?;
    if !status.success() {
        bail!("launcher: {status}");
    }
    let (agent_cpu_s, _) = harness::wait_rusage(&agent)?;
    let traced_s = traced.elapsed().as_secs_f64();
    let conn = rusqlite::Connection::open(&db)?;
    let (launches, lost, sessions) = conn.query_row(
        "SELECT (SELECT count(*) FROM launches), (SELECT coalesce(sum(lost_events), 0) FROM sessions), \
         (SELECT count(*) FROM sessions)",
        [],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )?;
    Ok(JobRun { attach_s, traced_s, agent_cpu_s, launches, lost, sessions })
}

/// Waits (≤ 10 s) until the launcher has its `RANKS` children.
fn wait_for_ranks(launcher: u32) -> Result<()> {
    let children = format!("/proc/{launcher}/task/{launcher}/children");
    for _ in 0..1000 {
        let text = std::fs::read_to_string(&children).unwrap_or_default();
        if text.split_whitespace().count() as u32 >= RANKS {
            // The ranks' exec and library loads.
            std::thread::sleep(std::time::Duration::from_millis(300));
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    bail!("the launcher never had {RANKS} ranks")
}

/// Prints the job table: the median run by agent CPU, and each run's attach time.
pub fn jobs_table(work: &Path) -> Result<()> {
    say(format!(
        "bench: job of {RANKS} ranks × {} launches/s ({REPEATS} runs)",
        LAUNCHES as u64 * 1_000_000 / u64::from(STEP_SLEEP_US)
    ));
    let mut runs = (0..REPEATS).map(|_| run_once(work)).collect::<Result<Vec<_>>>()?;
    runs.sort_by(|a, b| (a.agent_cpu_s / a.traced_s).total_cmp(&(b.agent_cpu_s / b.traced_s)));
    println!();
    println!(
        "One agent, {RANKS}-rank job of the stand-in trainer (launcher fixture), `attach LAUNCHER --children`, \
         {REPEATS} runs sorted by agent CPU"
    );
    println!(
        "| {:>8} | {:>8} | {:>10} | {:>10} | {:>11} | {:>4} | {:>9} |",
        "attach s", "traced s", "launches", "events/s", "agent CPU %", "lost", "sessions"
    );
    println!("|{:->10}|{:->10}|{:->12}|{:->12}|{:->13}|{:->6}|{:->11}|", "", "", "", "", "", "", "");
    for r in &runs {
        println!(
            "| {:>8.2} | {:>8.2} | {:>10} | {:>10.0} | {:>11.1} | {:>4} | {:>9} |",
            r.attach_s,
            r.traced_s,
            r.launches,
            r.launches as f64 / r.traced_s,
            100.0 * r.agent_cpu_s / r.traced_s,
            r.lost,
            r.sessions
        );
    }
    println!(
        "(attach s: start of `profiler attach` to its 'tracing' line, every rank already running; agent CPU %: \
         of one core, over the traced time; sessions: the launcher and its ranks)"
    );
    Ok(())
}
