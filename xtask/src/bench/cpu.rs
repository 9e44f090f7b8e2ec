//! `cargo xtask bench cpu`: what the CPU sampler costs a thread that is on a
//! CPU all the time (tests/fixtures/bench_loop.c `--spin`, stamping every
//! thousand iterations), at 99 Hz (the default) and 999 Hz, against the
//! profiler attached without it (`--no-cpu-samples`). Detached and attached
//! windows alternate; a round's figure is its attached window's mean time
//! per iteration over the mean of its two detached neighbours' (a mean, not
//! a median: at 99 Hz most stretches hold no sample). The per-sample cost is
//! that share of a second over the samples a second. Prints a table;
//! asserts nothing.
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

/// The loop, killed and collected however the bench ends.
struct Loop(Child);

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(stamps: &Path) -> Result<Loop> {
    let _ = std::fs::remove_file(stamps);
    let child = Command::new(fixtures_dir().join("bench_loop"))
        .args(["--spin", "--stamps"])
        .arg(stamps)
        .spawn()
        .context("start bench_loop (cargo xtask fixtures builds it)")?;
    let running = Loop(child);
    let t0 = std::time::Instant::now();
    while std::fs::metadata(stamps).map_or(0, |m| m.len()) == 0 {
        if t0.elapsed() > Duration::from_secs(10) {
            bail!("bench_loop --spin wrote no stamps");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(running)
}

/// (stretch end, next stretch start, iterations) per stamp line, ns.
fn read_stamps(path: &Path) -> Result<Vec<(i64, i64, i64)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let parse = |l: &str| -> Option<(i64, i64, i64)> {
        let mut f = l.strip_prefix("stamp ")?.split_whitespace().map(|v| v.parse().ok());
        Some((f.next()??, f.next()??, f.next()??))
    };
    Ok(text.lines().filter_map(parse).collect())
}

/// The mean ns per iteration of the stretches inside `[start, end]`.
fn mean_per_iteration(stamps: &[(i64, i64, i64)], (start, end): (i64, i64)) -> f64 {
    let (ns, n) = stamps
        .windows(2)
        .filter(|p| p[0].1 >= start && p[1].0 <= end)
        .fold((0i64, 0i64), |(ns, n), p| (ns + p[1].0 - p[0].1, n + p[1].2 - p[0].2));
    if n == 0 { f64::NAN } else { ns as f64 / n as f64 }
}

fn sleep_window() -> (i64, i64) {
    let start = monotonic_ns();
    std::thread::sleep(Duration::from_secs(WINDOW_S));
    (start, monotonic_ns())
}

/// Each round's attached mean per iteration over its detached neighbours', as a share.
fn rounds(stamps: &Path, pid: u32, args: &[&str], work: &Path) -> Result<Vec<f64>> {
    let mut detached = vec![sleep_window()];
    let mut attached = Vec::new();
    let duration = WINDOW_S.to_string();
    let mut all: Vec<&str> = vec!["--no-gpu", "--no-sched", "--duration", &duration];
    all.extend(args);
    for _ in 0..ROUNDS {
        let agent = harness::attach_agent(pid, &all, &work.join("cpu_bench.db"))?;
        let start = monotonic_ns();
        harness::wait_rusage(&agent)?;
        attached.push((start, monotonic_ns().min(start + WINDOW_S as i64 * 1_000_000_000)));
        harness::wait_until_detached();
        detached.push(sleep_window());
    }
    let s = read_stamps(stamps)?;
    let off: Vec<f64> = detached.iter().map(|&w| mean_per_iteration(&s, w)).collect();
    Ok(attached
        .iter()
        .enumerate()
        .map(|(i, &w)| {
            let base = (off[i] + off[i + 1]) / 2.0;
            (mean_per_iteration(&s, w) - base) / base
        })
        .collect())
}

pub fn cpu_table(work: &Path) -> Result<()> {
    let work: PathBuf = work.join("cpu");
    std::fs::create_dir_all(&work)?;
    say(format!("bench: the CPU sampler ({ROUNDS} attached windows of {WINDOW_S} s between detached ones)"));
    let stamps = work.join("spin.txt");
    let spinner = start(&stamps)?;
    let pid = spinner.0.id();
    say("bench: attached, --no-cpu-samples");
    let off = rounds(&stamps, pid, &["--no-cpu-samples"], &work)?;
    say("bench: attached, --cpu-sample 99");
    let at_99 = rounds(&stamps, pid, &["--cpu-sample", "99"], &work)?;
    say("bench: attached, --cpu-sample 999");
    let at_999 = rounds(&stamps, pid, &["--cpu-sample", "999"], &work)?;
    drop(spinner);
    let pct = |v: &[f64]| format!("{:.3}", median(v.to_vec()) * 100.0);
    let range = |v: &[f64], scale: f64| {
        let (lo, hi) = v.iter().fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x * scale), b.max(x * scale)));
        format!("{lo:.3} … {hi:.3}")
    };
    // Over the attached-without-samples rounds: the sampler's own share.
    let over = |v: &[f64]| v.iter().zip(&off).map(|(a, b)| a - b).collect::<Vec<f64>>();
    let per_sample = |v: &[f64], hz: f64| format!("{:.0}", median(over(v)) * 1e9 / hz);
    println!();
    println!(
        "CPU sampler (a thread on a CPU all the time, {ROUNDS} attached windows of {WINDOW_S} s between detached \
         ones, --no-sched)"
    );
    println!("| {:<52} | {:>10} | {:>16} |", "figure", "median", "min … max");
    println!("|{:-<54}|{:->12}|{:->18}|", "", "", "");
    let rows = [
        ("attached, --no-cpu-samples: cost (%)", pct(&off), range(&off, 100.0)),
        ("attached, --cpu-sample 99: cost (%)", pct(&at_99), range(&at_99, 100.0)),
        ("attached, --cpu-sample 999: cost (%)", pct(&at_999), range(&at_999, 100.0)),
        ("per sample at 999 Hz, over --no-cpu-samples (ns)", per_sample(&at_999, 999.0), String::new()),
        ("per sample at 99 Hz, over --no-cpu-samples (ns)", per_sample(&at_99, 99.0), String::new()),
    ];
    for (k, v, r) in rows {
        println!("| {k:<52} | {v:>10} | {r:>16} |");
    }
    println!("(cost: the loop's mean time per iteration attached over detached; per sample: the sampler's share");
    println!("over --no-cpu-samples, of a second, over the samples a second; the 99 Hz figure is within noise)");
    Ok(())
}
