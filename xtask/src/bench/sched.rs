//! `cargo xtask bench sched`: what the scheduler programs cost per context
//! switch, for a traced thread and for any other thread of the machine (they
//! run on every switch), and what a traced copy call costs. Each is measured
//! inside one long-running loop (tests/fixtures/bench_loop.c, stamping every
//! thousand iterations): detached and attached windows alternate, and a
//! round's figure is its attached window's median time per iteration less
//! the mean of its two detached neighbours'. Prints a table; asserts nothing.
use std::{
    path::{Path, PathBuf},
    process::{Child, Command},
    time::Duration,
};

use anyhow::{Context, Result, bail};

use super::harness::{self, median, monotonic_ns};
use crate::{fixtures_dir, say};

const ROUNDS: usize = 5;
const WINDOW_S: u64 = 2;

/// A loop, killed and collected however the bench ends.
struct Loop(Child);

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(mode: &str, stamps: &Path) -> Result<Loop> {
    let _ = std::fs::remove_file(stamps);
    let child = Command::new(fixtures_dir().join("bench_loop"))
        .arg(mode)
        .arg("--stamps")
        .arg(stamps)
        // The stand-in driver that exports the copies, for `--copy`.
        .env("LD_LIBRARY_PATH", format!("{}:{}", fixtures_dir().join("copies").display(), fixtures_dir().display()))
        .spawn()
        .context("start bench_loop (cargo xtask fixtures builds it)")?;
    let running = Loop(child);
    if mode != "--idle" {
        let t0 = std::time::Instant::now();
        while std::fs::metadata(stamps).map_or(0, |m| m.len()) == 0 {
            if t0.elapsed() > Duration::from_secs(10) {
                bail!("bench_loop {mode} wrote no stamps");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    Ok(running)
}

/// A loop's stamps: (previous stretch's end, next stretch's start, iterations), ns.
type Stamps = Vec<(i64, i64, i64)>;

fn read_stamps(path: &Path) -> Result<Stamps> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let parse = |l: &str| -> Option<(i64, i64, i64)> {
        let mut f = l.strip_prefix("stamp ")?.split_whitespace().map(|v| v.parse().ok());
        Some((f.next()??, f.next()??, f.next()??))
    };
    Ok(text.lines().filter_map(parse).collect())
}

/// The median ns per iteration of the stretches inside `[start, end]`.
fn per_iteration(stamps: &Stamps, (start, end): (i64, i64)) -> f64 {
    let v: Vec<f64> = stamps
        .windows(2)
        .filter(|p| p[0].1 >= start && p[1].0 <= end)
        .map(|p| (p[1].0 - p[0].1) as f64 / (p[1].2 - p[0].2).max(1) as f64)
        .collect();
    if v.is_empty() { f64::NAN } else { median(v) }
}

fn sleep_window() -> (i64, i64) {
    let start = monotonic_ns();
    std::thread::sleep(Duration::from_secs(WINDOW_S));
    (start, monotonic_ns())
}

/// Alternates detached windows and windows with the profiler attached to
/// `pid` (with `args`); returns (detached ns/iteration, each round's attached
/// cost in ns/iteration over its neighbours' mean).
fn rounds(stamps: &Path, pid: u32, args: &[&str], work: &Path) -> Result<(f64, Vec<f64>)> {
    let mut detached = vec![sleep_window()];
    let mut attached = Vec::new();
    let duration = WINDOW_S.to_string();
    let mut all: Vec<&str> = vec!["--no-gpu", "--duration", &duration];
    all.extend(args);
    for _ in 0..ROUNDS {
        let agent = harness::attach_agent(pid, &all, &work.join("sched_bench.db"))?;
        let start = monotonic_ns();
        harness::wait_rusage(&agent)?;
        attached.push((start, monotonic_ns().min(start + WINDOW_S as i64 * 1_000_000_000)));
        harness::wait_until_detached();
        detached.push(sleep_window());
    }
    let s = read_stamps(stamps)?;
    let off: Vec<f64> = detached.iter().map(|&w| per_iteration(&s, w)).collect();
    let cost = attached.iter().enumerate().map(|(i, &w)| per_iteration(&s, w) - (off[i] + off[i + 1]) / 2.0).collect();
    Ok((median(off), cost))
}

pub fn sched_table(work: &Path) -> Result<()> {
    let work: PathBuf = work.join("sched");
    std::fs::create_dir_all(&work)?;
    say(format!(
        "bench: scheduler and copy programs ({ROUNDS} attached windows of {WINDOW_S} s between detached ones)"
    ));
    let switch_stamps = work.join("switch.txt");
    let switcher = start("--switch", &switch_stamps)?;
    say("bench: context switches of a traced thread (with its off-CPU records)");
    let (switch_ns, traced) = rounds(&switch_stamps, switcher.0.id(), &[], &work)?;
    say("bench: context switches of a traced thread, --launches count (no off-CPU records)");
    let (_, counted) = rounds(&switch_stamps, switcher.0.id(), &["--launches", "count"], &work)?;
    say("bench: context switches of a traced thread, --no-sched");
    let (_, untraced_off) = rounds(&switch_stamps, switcher.0.id(), &["--no-sched"], &work)?;
    let idle = start("--idle", &work.join("idle.txt"))?;
    say("bench: context switches of an untraced thread (the profiler attached to an idle process)");
    let (_, untraced) = rounds(&switch_stamps, idle.0.id(), &[], &work)?;
    drop((switcher, idle));
    let copy_stamps = work.join("copy.txt");
    let copier = start("--copy", &copy_stamps)?;
    say("bench: copy calls");
    let (copy_ns, copy_cost) = rounds(&copy_stamps, copier.0.id(), &[], &work)?;
    drop(copier);
    // Two context switches per round trip.
    let per_switch = |v: &[f64]| median(v.to_vec()) / 2.0;
    let range = |v: &[f64], div: f64| {
        let (lo, hi) = v.iter().fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x / div), b.max(x / div)));
        format!("{lo:.0} … {hi:.0}")
    };
    println!();
    println!(
        "Scheduler and copy programs (one loop each, {ROUNDS} attached windows of {WINDOW_S} s between detached ones; \
         two threads on one CPU passing a byte over pipes: {:.0} context switches/s detached)",
        2e9 / switch_ns
    );
    println!("| {:<52} | {:>10} | {:>14} |", "figure", "median", "min … max");
    println!("|{:-<54}|{:->12}|{:->16}|", "", "", "");
    let rows = [
        ("context switch, detached (ns)", format!("{:.0}", switch_ns / 2.0), String::new()),
        ("+ per switch of a traced thread (ns)", format!("{:.0}", per_switch(&traced)), range(&traced, 2.0)),
        ("+ per switch, traced, --launches count (ns)", format!("{:.0}", per_switch(&counted)), range(&counted, 2.0)),
        ("+ per switch of an untraced thread (ns)", format!("{:.0}", per_switch(&untraced)), range(&untraced, 2.0)),
        (
            "+ per switch, traced, with --no-sched (ns)",
            format!("{:.0}", per_switch(&untraced_off)),
            range(&untraced_off, 2.0),
        ),
        ("copy call (stand-in cuMemcpyHtoD_v2), detached (ns)", format!("{copy_ns:.0}"), String::new()),
        ("+ per copy call traced (ns)", format!("{:.0}", median(copy_cost.clone())), range(&copy_cost, 1.0)),
    ];
    for (k, v, r) in rows {
        println!("| {k:<52} | {v:>10} | {r:>14} |");
    }
    println!("(a traced thread's switch writes an off-CPU record for the Perfetto scheduler track, except with");
    println!("--launches count; an untraced thread's switch: the profiler attached to another, idle process; the");
    println!("programs run on every switch of the machine and return after the traced check)");
    Ok(())
}
