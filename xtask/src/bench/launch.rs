//! `cargo xtask bench`, launch part: what tracing a CUDA launch costs the
//! target, and how much the agent sustains. Prints tables; asserts nothing.
//!
//! The synthetic trainer times its own launch loops (CLOCK_MONOTONIC around
//! each step's launches), so "ns per launch" is the host-side cost of one
//! `cuLaunchKernel` call into the stand-in driver, with or without probes.
//! The genuine-library workload calls each of its 8 launch entry points in a
//! timed loop of its own: "ns per launch" is its `cuLaunchKernel` loop, while
//! the launch count, events/s and the agent's CPU % cover all 8 loops, as the
//! profiler traces all of them.
use std::{
    path::{Path, PathBuf},
    process::{Child, Command},
    time::Instant,
};

use anyhow::{Context, Result, bail};

use super::harness::{attach_agent, bare_probe, wait_rusage};
use crate::{fixtures_dir, say};

const STEPS: u32 = 200;
const LAUNCHES: u32 = 1000;
const REPEATS: usize = 5;
/// Calls per entry point by `genuine_launch`.
const GENUINE_CALLS: u32 = 50_000;

#[derive(Clone, Copy, PartialEq)]
enum Probe {
    None,
    /// An empty program on `cuLaunchKernel`, at its entry or where the
    /// profiler would place its probe.
    Bare {
        placed: bool,
    },
    Profiler {
        count_only: bool,
        at_entry: bool,
    },
}

/// The profiler as it runs by default, and counting launches only.
const ALL: Probe = Probe::Profiler { count_only: false, at_entry: false };
const COUNT: Probe = Probe::Profiler { count_only: true, at_entry: false };

/// A table row: its name, what probes the target, and what the target runs.
type Scenario = (&'static str, Probe, Workload);

/// What runs the launches.
#[derive(Clone, Copy, PartialEq)]
enum Workload {
    /// The synthetic trainer on a stand-in driver (`lib` under the fixtures:
    /// "" for the plain one, "shaped" for the one with the genuine entry shape),
    /// launching through the driver, or with `runtime` through the stand-in
    /// runtime (`libcudart.so.12`, which calls the driver's entry points).
    Trainer { lib: &'static str, runtime: bool, threads: u32, steps: u32, launches: u32 },
    /// The 8 launch entry points of the genuine NVIDIA 535 library, each
    /// called `GENUINE_CALLS` times in a loop of its own (no GPU: they fail fast).
    Genuine,
}

#[derive(Clone, Default)]
struct Measured {
    ns_per_launch: f64,
    /// The 10th percentile over the run's steps (genuine library: its chunks
    /// of `cuLaunchKernel` calls) of their ns per launch: the cost with the
    /// least interference from the rest of this shared host.
    quiet_ns_per_launch: f64,
    launches: u64,
    events_per_s: f64,
    lost: Option<i64>,
    agent_cpu_pct: Option<f64>,
    agent_rss_mib: Option<f64>,
}

struct Truth {
    /// Host time of the timed launches: the trainer's, or `genuine_launch`'s
    /// `cuLaunchKernel` loop.
    launch_ns: u64,
    /// How many calls `launch_ns` covers.
    launch_calls: u64,
    /// Every launch the target made: the trainer's, or `genuine_launch`'s
    /// calls to all its entry points.
    total: u64,
    steps: u64,
    /// The target's busy span: first step start to last step end for the
    /// trainer, the sum of all entry points' loop times for `genuine_launch`.
    span_ns: u64,
    /// ns per launch of each of the trainer's steps, or of each chunk of
    /// `genuine_launch`'s `cuLaunchKernel` calls.
    per_part: Vec<f64>,
}

fn read_truth(path: &Path) -> Result<Truth> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let mut t = Truth { launch_ns: 0, launch_calls: 0, total: 0, steps: 0, span_ns: 0, per_part: Vec::new() };
    let (mut first, mut last) = (u64::MAX, 0u64);
    // `genuine_launch`: one `api NAME COUNT rc RC ns NS` line per entry point.
    let (mut api_calls, mut api_ns) = (0u64, 0u64);
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["step", _, s, e, n] => {
                let (s, e, n): (u64, u64, u64) = (s.parse()?, e.parse()?, n.parse()?);
                t.steps += 1;
                first = first.min(s);
                last = last.max(e);
                if n > 0 {
                    t.per_part.push(e.saturating_sub(s) as f64 / n as f64);
                }
            }
            ["chunk", "cuLaunchKernel", n, "ns", ns] => {
                let (n, ns): (u64, u64) = (n.parse()?, ns.parse()?);
                t.per_part.push(ns as f64 / n.max(1) as f64);
            }
            ["total", n] => t.total = n.parse()?,
            ["api", name, n, "rc", _, "ns", ns] => {
                let (n, ns): (u64, u64) = (n.parse()?, ns.parse()?);
                api_calls += n;
                api_ns += ns;
                if *name == "cuLaunchKernel" {
                    t.launch_calls = n;
                    t.launch_ns = ns;
                }
            }
            ["launch_ns", n] => t.launch_ns = n.parse()?,
            _ => {}
        }
    }
    if api_calls > 0 {
        t.total = api_calls;
        t.span_ns = api_ns;
    } else {
        t.launch_calls = t.total;
        t.span_ns = last.saturating_sub(first);
    }
    Ok(t)
}

fn measure(probe: Probe, workload: Workload, work: &Path) -> Result<Measured> {
    let truth = work.join("truth.txt");
    let go = work.join("go");
    let db = work.join("bench.db");
    for p in [&truth, &go, &db] {
        let _ = std::fs::remove_file(p);
    }
    let (mut target, lib_dir) = start_target(workload, &truth, &go)?;
    let agent = start_agent(probe, workload, target.id(), &lib_dir, &db)?;
    std::fs::write(&go, b"")?;
    let status = target.wait()?;
    if !status.success() {
        bail!("target failed: {status}");
    }
    let mut m = Measured::default();
    let mut t = read_truth(&truth)?;
    m.ns_per_launch = t.launch_ns as f64 / t.launch_calls.max(1) as f64;
    t.per_part.sort_by(f64::total_cmp);
    m.quiet_ns_per_launch = t.per_part.get(t.per_part.len() / 10).copied().unwrap_or(m.ns_per_launch);
    m.launches = t.total;
    if let Some(agent) = agent {
        agent_figures(probe, agent, &t, &db, &mut m)?;
    }
    Ok(m)
}

/// Starts the workload, held until `go` exists, writing its truth to `truth`;
/// returns it and the directory of the `libcuda.so.1` it loads.
fn start_target(workload: Workload, truth: &Path, go: &Path) -> Result<(Child, PathBuf)> {
    let fx = fixtures_dir();
    match workload {
        Workload::Trainer { lib, runtime, threads, steps, launches } => {
            let dir = fx.join(lib);
            let mut c = Command::new(fx.join("trainer"));
            c.args(["--steps", &steps.to_string(), "--launches", &launches.to_string()])
                .args(["--threads", &threads.to_string(), "--truth"])
                .arg(truth)
                .arg("--wait-file")
                .arg(go);
            if runtime {
                // The runtime (in the fixtures' top directory) is found after
                // its dlopen: give the agent time to probe it before the timed
                // launches.
                c.args(["--api", "runtime", "--after-dlopen-ms", "300"])
                    .env("LD_LIBRARY_PATH", format!("{}:{}", dir.display(), fx.display()));
            } else {
                c.env("LD_LIBRARY_PATH", &dir);
            }
            Ok((c.spawn().context("start trainer")?, dir))
        }
        Workload::Genuine => {
            let dir = fx.join("nvidia/lib");
            let child = Command::new(fx.join("genuine_launch"))
                .args(["libcuda.so.1", &GENUINE_CALLS.to_string()])
                .arg(truth)
                .arg(go)
                .env("LD_LIBRARY_PATH", &dir)
                .spawn()
                .context("start genuine_launch")?;
            Ok((child, dir))
        }
    }
}

/// Starts what `probe` says on the target `pid`, and waits until it is attached.
fn start_agent(probe: Probe, workload: Workload, pid: u32, lib_dir: &Path, db: &Path) -> Result<Option<Child>> {
    match probe {
        Probe::None => Ok(None),
        Probe::Bare { placed } => Ok(Some(bare_probe(pid, &lib_dir.join("libcuda.so.1"), "cuLaunchKernel", placed)?)),
        Probe::Profiler { count_only, at_entry } => {
            let mut args = vec!["--no-gpu"];
            if matches!(workload, Workload::Trainer { .. }) {
                args.extend(["--step-symbol", "train_step"]);
            }
            if count_only {
                args.extend(["--launches", "count"]);
            }
            if at_entry {
                args.push("--probe-at-entry");
            }
            Ok(Some(attach_agent(pid, &args, db)?))
        }
    }
}

/// Stops the agent (the profiler stops by itself when the target exits) and,
/// for the profiler, fills in its figures: loss, events/s, CPU and memory.
fn agent_figures(probe: Probe, agent: Child, t: &Truth, db: &Path, m: &mut Measured) -> Result<()> {
    if matches!(probe, Probe::Bare { .. }) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    }
    let waited = Instant::now();
    let (cpu, rss_kib) = wait_rusage(&agent)?;
    if let Probe::Profiler { .. } = probe {
        let conn = rusqlite::Connection::open(db)?;
        let lost: i64 =
            conn.query_row("SELECT lost_events FROM sessions ORDER BY id DESC LIMIT 1", [], |r| r.get(0))?;
        m.lost = Some(lost);
        let events = t.total + 2 * t.steps;
        let span = if t.span_ns > 0 { t.span_ns } else { t.launch_ns };
        m.events_per_s = events as f64 / (span as f64 / 1e9);
        m.agent_cpu_pct = Some(100.0 * cpu / (span as f64 / 1e9 + waited.elapsed().as_secs_f64()));
        m.agent_rss_mib = Some(rss_kib / 1024.0);
    }
    Ok(())
}

/// The run with the median ns per launch, with the median of the runs' quiet
/// ns per launch.
fn median(mut runs: Vec<Measured>) -> Measured {
    runs.sort_by(|a, b| a.quiet_ns_per_launch.total_cmp(&b.quiet_ns_per_launch));
    let quiet = runs[runs.len() / 2].quiet_ns_per_launch;
    runs.sort_by(|a, b| a.ns_per_launch.total_cmp(&b.ns_per_launch));
    Measured { quiet_ns_per_launch: quiet, ..runs[runs.len() / 2].clone() }
}

/// Prints the launch-cost tables and what their columns mean.
pub fn launch_tables(work: &Path) -> Result<()> {
    println!();
    println!("Host cost per launch, median of {REPEATS} runs; kernel {}", kernel());
    for (title, scenarios) in launch_sections() {
        let mut results = Vec::new();
        for (name, probe, workload) in scenarios {
            say(format!("bench: {title}: {name}"));
            let runs = (0..REPEATS).map(|_| measure(probe, workload, work)).collect::<Result<Vec<_>>>()?;
            results.push((name, probe, median(runs)));
        }
        print_launch_section(title, &results);
    }
    print_launch_notes();
    Ok(())
}

/// The launch-cost tables: a title each, and their rows.
fn launch_sections() -> Vec<(&'static str, Vec<Scenario>)> {
    let plain = |threads| Workload::Trainer { lib: "", runtime: false, threads, steps: STEPS, launches: LAUNCHES };
    let shaped =
        |threads, steps, launches| Workload::Trainer { lib: "shaped", runtime: false, threads, steps, launches };
    let runtime = Workload::Trainer { lib: "shaped", runtime: true, threads: 1, steps: STEPS, launches: LAUNCHES };
    vec![
        (
            "stand-in driver, entry `addq $1, counter(%rip)` (RIP-relative: single-stepped, not movable)",
            vec![
                ("(a) untraced", Probe::None, plain(1)),
                ("(b) bare uprobe at entry", Probe::Bare { placed: false }, plain(1)),
                ("(c) profiler, --launches all", ALL, plain(1)),
                ("(c) profiler, --launches count", COUNT, plain(1)),
                ("(c) profiler, all, 2 threads", ALL, plain(2)),
            ],
        ),
        (
            "stand-in with the genuine entry shape (`cmpl $imm, rip; je; jmp *rip`)",
            vec![
                ("(a) untraced", Probe::None, shaped(1, STEPS, LAUNCHES)),
                ("(b) bare uprobe at entry", Probe::Bare { placed: false }, shaped(1, STEPS, LAUNCHES)),
                ("(b') bare uprobe at chosen offset", Probe::Bare { placed: true }, shaped(1, STEPS, LAUNCHES)),
                (
                    "(c) profiler, --probe-at-entry",
                    Probe::Profiler { count_only: false, at_entry: true },
                    shaped(1, STEPS, LAUNCHES),
                ),
                ("(c) profiler, --launches all", ALL, shaped(1, STEPS, LAUNCHES)),
                ("(c) profiler, --launches count", COUNT, shaped(1, STEPS, LAUNCHES)),
                ("(c) profiler, all, 2 threads", ALL, shaped(2, STEPS, LAUNCHES)),
                ("launch-bound step (10 000), untraced", Probe::None, shaped(1, 20, 10_000)),
                ("launch-bound step (10 000), profiler", ALL, shaped(1, 20, 10_000)),
            ],
        ),
        (
            "stand-in runtime: cudaLaunchKernel (stand-in libcudart.so.12) calling cuLaunchKernel (genuine shape): \
             two probes fire, the driver's skipped",
            vec![
                ("(a) untraced", Probe::None, runtime),
                ("(c) profiler, --launches all", ALL, runtime),
                ("(c) profiler, --launches count", COUNT, runtime),
            ],
        ),
        (
            "genuine NVIDIA 535 libcuda.so.1, no GPU: every call returns an error at once \
             (ns / launch: cuLaunchKernel; launches and events/s: all 8 launch entry points)",
            vec![
                ("(a) untraced", Probe::None, Workload::Genuine),
                ("(b) bare uprobe at entry", Probe::Bare { placed: false }, Workload::Genuine),
                ("(b') bare uprobe at chosen offset", Probe::Bare { placed: true }, Workload::Genuine),
                ("(c) profiler, --launches all", ALL, Workload::Genuine),
                ("(c) profiler, --launches count", COUNT, Workload::Genuine),
            ],
        ),
    ]
}

/// Prints one launch-cost table, and the profiler's ratio to the bare uprobe.
fn print_launch_section(title: &str, results: &[(&str, Probe, Measured)]) {
    let opt = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |v| format!("{v:.prec$}"));
    println!();
    println!("{title}");
    println!(
        "| {:<38} | {:>11} | {:>9} | {:>9} | {:>10} | {:>4} | {:>11} | {:>13} |",
        "scenario", "ns / launch", "quiet ns", "launches", "events/s", "lost", "agent CPU %", "agent RSS MiB"
    );
    println!("|{:-<40}|{:->13}|{:->11}|{:->11}|{:->12}|{:->6}|{:->13}|{:->15}|", "", "", "", "", "", "", "", "");
    for (name, _, m) in results {
        println!(
            "| {:<38} | {:>11.0} | {:>9.0} | {:>9} | {:>10} | {:>4} | {:>11} | {:>13} |",
            name,
            m.ns_per_launch,
            m.quiet_ns_per_launch,
            m.launches,
            if m.events_per_s > 0.0 { format!("{:.0}", m.events_per_s) } else { "-".into() },
            m.lost.map_or("-".into(), |l| l.to_string()),
            opt(m.agent_cpu_pct, 1),
            opt(m.agent_rss_mib, 1),
        );
    }
    let find = |p: Probe| results.iter().find(|r| r.1 == p).map(|r| &r.2);
    let floor = find(Probe::Bare { placed: true }).or(find(Probe::Bare { placed: false }));
    if let (Some(floor), Some(a), Some(c)) = (floor, find(ALL), find(COUNT)) {
        println!(
            "ratio profiler ÷ bare uprobe at the profiler's offset: all {:.2}, count {:.2} (quiet: all {:.2}, count {:.2})",
            a.ns_per_launch / floor.ns_per_launch,
            c.ns_per_launch / floor.ns_per_launch,
            a.quiet_ns_per_launch / floor.quiet_ns_per_launch,
            c.quiet_ns_per_launch / floor.quiet_ns_per_launch,
        );
    }
}

/// What the launch-cost tables' columns mean.
fn print_launch_notes() {
    println!();
    println!("ns / launch: over the whole run (the trainer's steps, or genuine_launch's cuLaunchKernel loop);");
    println!("quiet ns: the 10th percentile of ns per launch over the run's steps (genuine: chunks of 1000 calls),");
    println!("the cost with the least interference from the rest of the host; both the median over runs.");
    println!("events/s: launch records plus step entry/return records over the target's busy span");
    println!("(genuine library: the calls to all 8 entry points over the sum of their loops' times);");
    println!("agent CPU %: the agent's CPU time over that span plus its drain-and-flush time after the target exits.");
}

fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_owned()).unwrap_or_default()
}
