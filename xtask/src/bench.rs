//! `cargo xtask bench`: what tracing costs the target, and how much the agent
//! sustains. Prints a table; asserts nothing.
//!
//! The synthetic trainer times its own launch loops (CLOCK_MONOTONIC around
//! each step's launches), so "ns per launch" is the host-side cost of one
//! `cuLaunchKernel` call into the stand-in driver, with or without probes.
use std::{
    io::{BufRead, BufReader},
    os::unix::process::ExitStatusExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::{fixtures_dir, profiler_bin, say};

const STEPS: u32 = 200;
const LAUNCHES: u32 = 1000;
const REPEATS: usize = 3;

#[derive(Clone, Copy)]
enum Probe {
    None,
    Bare,
    Profiler { count_only: bool },
}

#[derive(Clone, Default)]
struct Measured {
    ns_per_launch: f64,
    launches: u64,
    events_per_s: f64,
    lost: Option<i64>,
    agent_cpu_pct: Option<f64>,
    agent_rss_mib: Option<f64>,
}

struct Truth {
    launch_ns: u64,
    total: u64,
    steps: u64,
    span_ns: u64,
}

fn read_truth(path: &Path) -> Result<Truth> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let mut t = Truth { launch_ns: 0, total: 0, steps: 0, span_ns: 0 };
    let (mut first, mut last) = (u64::MAX, 0u64);
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["step", _, s, e, _] => {
                t.steps += 1;
                first = first.min(s.parse()?);
                last = last.max(e.parse()?);
            }
            ["total", n] => t.total = n.parse()?,
            ["launch_ns", n] => t.launch_ns = n.parse()?,
            _ => {}
        }
    }
    t.span_ns = last.saturating_sub(first);
    Ok(t)
}

/// Waits for `child` and returns (CPU seconds, peak RSS in KiB).
fn wait_rusage(child: &Child) -> Result<(f64, f64)> {
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: zeroed rusage is a valid out-value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waiting on our own child with valid out-pointers.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    if r != pid {
        bail!("wait4: {}", std::io::Error::last_os_error());
    }
    let exit = std::process::ExitStatus::from_raw(status);
    if !exit.success() {
        bail!("agent exited with {exit}");
    }
    let cpu = ru.ru_utime.tv_sec as f64
        + ru.ru_utime.tv_usec as f64 / 1e6
        + ru.ru_stime.tv_sec as f64
        + ru.ru_stime.tv_usec as f64 / 1e6;
    Ok((cpu, ru.ru_maxrss as f64))
}

/// Reads lines of `stream` until one contains `needle`; the rest is drained
/// in the background so the agent never blocks on a full pipe.
fn wait_for_line(stream: impl std::io::Read + Send + 'static, needle: &'static str) -> Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut seen = false;
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if !seen && line.contains(needle) {
                seen = true;
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(60)).with_context(|| format!("agent never printed '{needle}'"))
}

fn measure(probe: Probe, threads: u32, work: &Path) -> Result<Measured> {
    let fx = fixtures_dir();
    let truth = work.join("truth.txt");
    let go = work.join("go");
    let db = work.join("bench.db");
    for p in [&truth, &go, &db] {
        let _ = std::fs::remove_file(p);
    }
    let mut trainer = Command::new(fx.join("trainer"))
        .args(["--steps", &STEPS.to_string(), "--launches", &LAUNCHES.to_string(), "--threads", &threads.to_string()])
        .arg("--truth")
        .arg(&truth)
        .arg("--wait-file")
        .arg(&go)
        .env("LD_LIBRARY_PATH", &fx)
        .spawn()
        .context("start trainer")?;
    let pid = trainer.id().to_string();
    let agent = match probe {
        Probe::None => None,
        Probe::Bare => {
            let mut c = Command::new(profiler_bin())
                .args(["bare-probe", &pid])
                .arg(fx.join("libcuda.so.1"))
                .arg("cuLaunchKernel")
                .stdout(Stdio::piped())
                .spawn()?;
            wait_for_line(c.stdout.take().context("stdout")?, "attached")?;
            Some(c)
        }
        Probe::Profiler { count_only } => {
            let mut c = Command::new(profiler_bin());
            c.args(["attach", &pid, "--step-symbol", "train_step", "-o"]).arg(&db).stderr(Stdio::piped());
            if count_only {
                c.args(["--launches", "count"]);
            }
            let mut c = c.spawn()?;
            wait_for_line(c.stderr.take().context("stderr")?, "tracing PID")?;
            Some(c)
        }
    };
    std::fs::write(&go, b"")?;
    let status = trainer.wait()?;
    if !status.success() {
        bail!("trainer failed: {status}");
    }
    let mut m = Measured::default();
    let t = read_truth(&truth)?;
    m.ns_per_launch = t.launch_ns as f64 / t.total as f64;
    m.launches = t.total;
    if let Some(agent) = agent {
        if matches!(probe, Probe::Bare) {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
        }
        // The profiler stops by itself when the target exits.
        let waited = Instant::now();
        let (cpu, rss_kib) = wait_rusage(&agent)?;
        if let Probe::Profiler { .. } = probe {
            let conn = rusqlite::Connection::open(&db)?;
            let lost: i64 =
                conn.query_row("SELECT lost_events FROM sessions ORDER BY id DESC LIMIT 1", [], |r| r.get(0))?;
            m.lost = Some(lost);
            let events = t.total + 2 * t.steps;
            m.events_per_s = events as f64 / (t.span_ns as f64 / 1e9);
            m.agent_cpu_pct = Some(100.0 * cpu / (t.span_ns as f64 / 1e9 + waited.elapsed().as_secs_f64()));
            m.agent_rss_mib = Some(rss_kib / 1024.0);
        }
    }
    Ok(m)
}

fn median(mut runs: Vec<Measured>) -> Measured {
    runs.sort_by(|a, b| a.ns_per_launch.total_cmp(&b.ns_per_launch));
    runs[runs.len() / 2].clone()
}

pub fn main() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the benchmark loads eBPF programs and needs root: run `sudo cargo xtask bench`");
    }
    let work: PathBuf = crate::root().join("target/bench");
    std::fs::create_dir_all(&work)?;
    let scenarios: [(&str, Probe, u32); 5] = [
        ("(a) untraced", Probe::None, 1),
        ("(b) bare uprobe, empty program", Probe::Bare, 1),
        ("(c) profiler, --launches all", Probe::Profiler { count_only: false }, 1),
        ("(c) profiler, --launches count", Probe::Profiler { count_only: true }, 1),
        ("(c) profiler, all, 2 threads", Probe::Profiler { count_only: false }, 2),
    ];
    let mut results = Vec::new();
    for (name, probe, threads) in scenarios {
        say(format!("bench: {name} ({REPEATS} runs of {threads}×{STEPS} steps × {LAUNCHES} launches)"));
        let runs = (0..REPEATS).map(|_| measure(probe, threads, &work)).collect::<Result<Vec<_>>>()?;
        results.push((name, median(runs)));
    }
    let opt = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |v| format!("{v:.prec$}"));
    println!();
    println!("Host cost per cuLaunchKernel (stand-in driver), median of {REPEATS} runs; kernel {}", kernel());
    println!(
        "| {:<32} | {:>12} | {:>9} | {:>12} | {:>4} | {:>10} | {:>13} |",
        "scenario", "ns / launch", "launches", "events/s", "lost", "agent CPU %", "agent RSS MiB"
    );
    println!("|{:-<34}|{:->14}|{:->11}|{:->14}|{:->6}|{:->12}|{:->15}|", "", "", "", "", "", "", "");
    for (name, m) in &results {
        println!(
            "| {:<32} | {:>12.0} | {:>9} | {:>12} | {:>4} | {:>11} | {:>13} |",
            name,
            m.ns_per_launch,
            m.launches,
            if m.events_per_s > 0.0 { format!("{:.0}", m.events_per_s) } else { "-".into() },
            m.lost.map_or("-".into(), |l| l.to_string()),
            opt(m.agent_cpu_pct, 1),
            opt(m.agent_rss_mib, 1),
        );
    }
    let bare = results[1].1.ns_per_launch;
    println!();
    println!("ratio (c)/(b), --launches all:   {:.2}", results[2].1.ns_per_launch / bare);
    println!("ratio (c)/(b), --launches count: {:.2}", results[3].1.ns_per_launch / bare);
    println!("events/s counts launch records plus step entry/return records over the trainer's busy span;");
    println!(
        "agent CPU % is the agent's CPU time over that span plus its drain-and-flush time after the target exits."
    );
    sampler_table(&work)
}

/// The agent's CPU time over a fixed window on an idle target, with the
/// stand-in NVML exposing `gpus` GPUs sampled every `interval_ms` (None: --no-gpu).
fn sampler_cost(work: &Path, gpus: u32, interval_ms: Option<u32>) -> Result<(f64, f64, u64)> {
    const WINDOW_S: f64 = 3.0;
    let db = work.join("sampler.db");
    let _ = std::fs::remove_file(&db);
    let mut idle = Command::new("sleep").arg("60").spawn()?;
    let mut c = Command::new(profiler_bin());
    c.args(["attach", &idle.id().to_string(), "-q", "--duration", &WINDOW_S.to_string(), "-o"]).arg(&db);
    match interval_ms {
        Some(ms) => {
            c.arg("--nvml-lib").arg(fixtures_dir().join("libnvidia-ml.so.1"));
            c.args(["--gpu-interval", &ms.to_string()]).env("STANDIN_NVML_GPUS", gpus.to_string());
        }
        None => {
            c.arg("--no-gpu");
        }
    }
    let t0 = Instant::now();
    let agent = c.spawn()?;
    let (cpu, _) = wait_rusage(&agent)?;
    let wall = t0.elapsed().as_secs_f64();
    let _ = idle.kill();
    let _ = idle.wait();
    let conn = rusqlite::Connection::open(&db)?;
    let samples: i64 = conn.query_row("SELECT count(*) FROM gpu_samples", [], |r| r.get(0)).unwrap_or(0);
    Ok((cpu, wall, samples as u64 / u64::from(gpus.max(1))))
}

fn sampler_table(work: &Path) -> Result<()> {
    say("bench: GPU sampler cost (stand-in NVML, idle target, 3 s windows)");
    let (base_cpu, base_wall, _) = sampler_cost(work, 1, None)?;
    println!();
    println!("GPU sampler (stand-in NVML): agent CPU over a 3 s window, minus the same window with --no-gpu");
    println!("| {:<6} | {:>8} | {:>6} | {:>12} | {:>14} |", "GPUs", "rate", "ticks", "µs per tick", "agent CPU %");
    println!("|{:-<8}|{:->10}|{:->8}|{:->14}|{:->16}|", "", "", "", "", "");
    for gpus in [1u32, 8] {
        for (hz, ms) in [(10u32, 100u32), (100, 10)] {
            let (cpu, wall, ticks) = sampler_cost(work, gpus, Some(ms))?;
            let extra = (cpu - base_cpu * wall / base_wall).max(0.0);
            println!(
                "| {:<6} | {:>5} Hz | {:>6} | {:>12.0} | {:>14.2} |",
                gpus,
                hz,
                ticks,
                1e6 * extra / ticks.max(1) as f64,
                100.0 * cpu / wall
            );
        }
    }
    println!("(µs per tick includes writing the rows to SQLite; the agent CPU % is the whole agent's.)");
    Ok(())
}

fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_owned()).unwrap_or_default()
}
