//! How long attaching and detaching take with every probe in: the genuine
//! NVIDIA 535 driver and the genuine CUDA runtime from PyTorch's wheels mapped
//! in a running trainer (launch, sync, copy and kernel-name probes, 200-odd),
//! one perf-event link per probe against uprobe-multi links
//! (`PROFILER_UPROBE_MULTI=0` or not). Each mode runs `ROUNDS` sessions on a
//! quiet machine (each once the last one's probes are off), then `ROUNDS`
//! back to back, each started as soon as the last one's agent has exited
//! (its probes still coming off), as a user re-attaching does.
//!
//! - attach → first step: from starting `profiler attach` to the start of the
//!   first step it recorded (the trainer steps every 2 ms); quiet, and right
//!   after the last session.
//! - Ctrl-C → exit: from SIGINT to the agent's exit.
//! - Ctrl-C → probes off: to the exit of the process the agent leaves to
//!   remove its probes (no `profiler` or `profiler-detach` process left).
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use super::harness::{self, median, monotonic_ns};
use crate::{fixtures_dir, profiler_bin, say, torch_env};

const ROUNDS: usize = 5;
/// How long each session traces before its Ctrl-C.
const TRACE: Duration = Duration::from_secs(2);

/// The genuine runtime of the first PyTorch environment.
fn genuine_cudart() -> Option<PathBuf> {
    let (_, python) = torch_env::ensure_all().into_iter().next()?;
    let venv = python.parent()?.parent()?.to_owned();
    let lib = std::fs::read_dir(venv.join("lib")).ok()?;
    lib.flatten().map(|e| e.path().join("site-packages/nvidia/cu13/lib/libcudart.so.13")).find(|p| p.exists())
}

/// What one session took.
struct Round {
    attach_to_step: f64,
    stop_to_exit: f64,
    /// None where the next session did not wait for it.
    stop_to_removed: Option<f64>,
    probes: Option<u64>,
}

/// Seconds from `t0` until no `profiler` or `profiler-detach` process is left (at most a minute).
fn until_no_profiler(t0: Instant) -> f64 {
    harness::wait_until_detached();
    t0.elapsed().as_secs_f64()
}

/// One session; `wait_removal`: returns once its probes are off too.
fn one_round(pid: u32, db: &Path, multi: bool, wait_removal: bool) -> Result<Round> {
    let _ = std::fs::remove_file(db);
    let started_ns = monotonic_ns();
    let mut agent: Child = Command::new(profiler_bin())
        .args(["attach", &pid.to_string(), "--step-symbol", "train_step", "--no-gpu", "-o"])
        .arg(db)
        .env("PROFILER_UPROBE_MULTI", if multi { "1" } else { "0" })
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("start the profiler")?;
    // The agent's lines, read in the background (it never blocks on a full pipe).
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let stderr = agent.stderr.take().context("stderr")?;
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stderr)).map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut probes = None;
    loop {
        let line = rx.recv_timeout(Duration::from_secs(300)).context("the agent never said it was tracing")?;
        // "N uprobes attached (Multi)", the agent's info line.
        if let Some((n, _)) = line.split_once(" uprobes attached") {
            probes = n.rsplit(' ').next().and_then(|n| n.parse().ok());
        }
        if line.contains("(Ctrl-C to stop)") {
            break;
        }
    }
    std::thread::sleep(TRACE);
    let stop = Instant::now();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(agent.id() as i32, libc::SIGINT) };
    let status = agent.wait()?;
    let stop_to_exit = stop.elapsed().as_secs_f64();
    anyhow::ensure!(status.success(), "the agent exited with {status}");
    let stop_to_removed = wait_removal.then(|| until_no_profiler(stop));
    let conn = rusqlite::Connection::open(db)?;
    let first: i64 = conn.query_row("SELECT min(start_ns) FROM steps", [], |r| r.get(0))?;
    Ok(Round { attach_to_step: (first - started_ns) as f64 / 1e9, stop_to_exit, stop_to_removed, probes })
}

pub fn attach_table(work: &Path) -> Result<()> {
    let Some(cudart) = genuine_cudart() else {
        say("bench: attach: SKIPPED (no PyTorch environment with libcudart.so.13: `cargo xtask torch-env`)");
        return Ok(());
    };
    let fx = fixtures_dir();
    let truth = work.join("attach_truth.txt");
    let mut trainer = Command::new(fx.join("sched_trainer"))
        .args(["--steps", "100000000", "--spin-us", "1000", "--sleep-us", "1000", "--truth"])
        .arg(&truth)
        .arg("--cudart")
        .arg(&cudart)
        .env("LD_LIBRARY_PATH", fx.join("nvidia/lib"))
        .stdout(Stdio::null())
        .spawn()
        .context("start sched_trainer")?;
    std::thread::sleep(Duration::from_millis(500));
    harness::wait_until_detached();
    let mut results = Vec::new();
    for (name, multi) in [("one link per probe", false), ("uprobe-multi links", true)] {
        let mut rounds = [Vec::new(), Vec::new()];
        for (i, quiet) in [true, false].into_iter().enumerate() {
            for round in 0..ROUNDS {
                let when = if quiet { "quiet" } else { "right after the last" };
                say(format!("bench: attach: {name}, {when}, session {}/{ROUNDS}", round + 1));
                let db = work.join(format!("attach_{multi}_{quiet}_{round}.db"));
                rounds[i].push(one_round(trainer.id(), &db, multi, quiet)?);
            }
        }
        results.push((name, rounds));
        // The next mode starts from a machine with no probe coming off (the
        // back-to-back sessions' removals queue: minutes one probe at a time).
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(600) && harness::profiler_running() {
            harness::wait_until_detached();
        }
    }
    let _ = trainer.kill();
    let _ = trainer.wait();
    println!();
    println!(
        "bench: attach and detach, genuine libcuda.so.1 (535) + {} in a running trainer, 2 × {ROUNDS} sessions \
         per mode",
        cudart.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned())
    );
    println!(
        "| {:<22} | {:>7} | {:>22} | {:>22} | {:>18} | {:>22} |",
        "mode", "probes", "attach → first step", "… right after the last", "Ctrl-C → exit", "Ctrl-C → probes off"
    );
    println!("|{:-<24}|{:->9}|{:->24}|{:->24}|{:->20}|{:->24}|", "", "", "", "", "", "");
    let cell = |v: Vec<f64>| {
        let max = v.iter().copied().fold(f64::MIN, f64::max);
        format!("{:.3} / {:.3} s", median(v), max)
    };
    for (name, [quiet, after]) in results {
        let probes = quiet.first().and_then(|r| r.probes).map_or("–".into(), |p| p.to_string());
        println!(
            "| {:<22} | {:>7} | {:>22} | {:>22} | {:>18} | {:>22} |",
            name,
            probes,
            cell(quiet.iter().map(|r| r.attach_to_step).collect()),
            cell(after.iter().map(|r| r.attach_to_step).collect()),
            cell(quiet.iter().chain(&after).map(|r| r.stop_to_exit).collect()),
            cell(quiet.iter().filter_map(|r| r.stop_to_removed).collect()),
        );
    }
    println!(
        "(median / max over the sessions; quiet: each session once the last one's probes are off; right after: as soon \
         as the last agent has exited, its probes still coming off)"
    );
    Ok(())
}
