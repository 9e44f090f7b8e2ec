//! `cargo xtask soak [DURATION]`: the profiler left running on a churning job
//! with a small `--max-size`, one table row a minute: the agent's memory and
//! CPU, the profile and its `-wal`, rows written, lost events, how many of the
//! finished trainers' steps the profile holds exactly, and how many of the
//! others nothing marks (a thread with no step stored `incomplete` or without
//! an end: a silent loss). Prints; asserts nothing.
//!
//! The job: `sh` starting trainers one after another on the stand-in libcuda
//! with the genuine driver's entry shape (`shaped/`; the genuine 535 library
//! dereferences the trainer's made-up handles, and `genuine_launch` has no step
//! function), each 4 threads × 5 waves (thread churn; a new process every few
//! seconds: process churn), and a DataLoader-like stream of short-lived children.
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use crate::{fixtures_dir, profiler_bin, root, say};

/// The profile's budget: small, so that per-call rows stop within minutes
/// (≈40 000 launches/s) and the steps (≈200/s) fill the rest in about 20.
const MAX_SIZE: &str = "256M";

/// (anonymous, file-backed) resident KiB of `pid`.
fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (field("RssAnon:"), field("RssFile:"))
}

/// CPU seconds `pid` has used (user + system).
fn cpu_s(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis: utime is the 12th, stime the 13th.
    let rest = stat.rsplit_once(')').map_or("", |r| r.1);
    let f: Vec<f64> = rest.split_whitespace().filter_map(|v| v.parse().ok()).collect();
    // In USER_HZ ticks, 100 a second on every Linux ABI.
    (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) / 100.0
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).map_or(0, |m| m.len())
}

/// Steps of the trainers that have finished (their truth files).
#[derive(Clone, Copy, Default)]
struct Exactness {
    total: u64,
    /// Held with the same thread, count and launch count.
    exact: u64,
    /// Of the others, those of a thread that the profile marks: a step stored
    /// `incomplete`, or with no end.
    marked: u64,
}

/// One thread of one finished trainer, from its truth file.
#[derive(Default)]
struct TruthThread {
    steps: i64,
    launches: i64,
    first_start_ns: i64,
    last_end_ns: i64,
}

/// A stored step: (start, end, launches, incomplete).
type HeldStep = (i64, Option<i64>, i64, bool);

/// The finished trainers' steps as the profile holds them, thread by thread
/// (a thread is its tid within its trainer's time: tids come round again on a
/// machine whose `pid_max` is 32768).
fn steps_exact(db: &Path, work: &Path) -> Exactness {
    let mut truth: Vec<TruthThread> = Vec::new();
    let mut tids: Vec<i64> = Vec::new();
    for e in std::fs::read_dir(work).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("truth.") || name.ends_with(".tmp") {
            continue;
        }
        let mut threads: BTreeMap<i64, TruthThread> = BTreeMap::new();
        for l in std::fs::read_to_string(e.path()).unwrap_or_default().lines() {
            let w: Vec<&str> = l.split_whitespace().collect();
            if let ["step", tid, start, end, launches] = w[..] {
                let num = |v: &str| v.parse::<i64>().unwrap_or(0);
                let t =
                    threads.entry(num(tid)).or_insert(TruthThread { first_start_ns: i64::MAX, ..Default::default() });
                t.steps += 1;
                t.launches += num(launches);
                t.first_start_ns = t.first_start_ns.min(num(start));
                t.last_end_ns = t.last_end_ns.max(num(end));
            }
        }
        for (tid, t) in threads {
            tids.push(tid);
            truth.push(t);
        }
    }
    let mut e = Exactness { total: truth.iter().map(|t| t.steps as u64).sum(), ..Exactness::default() };
    let Ok(held) = held_steps(db) else { return e };
    // A step's probes fire around the trainer's own clock reads.
    const SLACK_NS: i64 = 5_000_000;
    for (tid, t) in tids.iter().zip(&truth) {
        let Some(steps) = held.get(tid) else { continue };
        let from = steps.partition_point(|s| s.0 < t.first_start_ns - SLACK_NS);
        let to = steps.partition_point(|s| s.0 <= t.last_end_ns);
        let mine = &steps[from..to];
        let ended: Vec<&HeldStep> = mine.iter().filter(|s| s.1.is_some()).collect();
        let launches: i64 = ended.iter().map(|s| s.2).sum();
        if (ended.len() as i64, launches) == (t.steps, t.launches) {
            e.exact += t.steps as u64;
        } else if mine.iter().any(|s| s.3 || s.1.is_none()) {
            e.marked += t.steps as u64;
        }
    }
    e
}

/// Every stored step by thread, in start order: one pass over the table.
fn held_steps(db: &Path) -> rusqlite::Result<BTreeMap<i64, Vec<HeldStep>>> {
    let conn = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)?;
    let mut q =
        conn.prepare("SELECT tid, start_ns, end_ns, coalesce(launches, 0), coalesce(incomplete, 0) FROM steps")?;
    let mut held: BTreeMap<i64, Vec<HeldStep>> = BTreeMap::new();
    let mut rows = q.query([])?;
    while let Some(r) = rows.next()? {
        held.entry(r.get(0)?).or_default().push((r.get(1)?, r.get(2)?, r.get(3)?, r.get::<_, i64>(4)? != 0));
    }
    for v in held.values_mut() {
        v.sort_unstable_by_key(|s| s.0);
    }
    Ok(held)
}

/// (launch rows, step rows, lost events of the sessions that ended).
fn rows(db: &Path) -> (i64, i64, i64) {
    let q = || -> rusqlite::Result<(i64, i64, i64)> {
        let c = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)?;
        c.query_row(
            "SELECT (SELECT count(*) FROM launches), (SELECT count(*) FROM steps),
                    (SELECT coalesce(max(lost_events), 0) FROM sessions)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
    };
    q().unwrap_or((-1, -1, -1))
}

/// The job `profiler run` starts: trainers one after another, and short-lived children.
fn job_script(work: &Path) -> String {
    let fx = fixtures_dir();
    format!(
        "cd '{w}'; (while [ ! -e STOP ]; do sleep 0.5; done) &
         i=0; while [ ! -e STOP ]; do
           '{trainer}' --cuda '{cuda}' --steps 50 --launches 200 --threads 4 --waves 5 --step-sleep-us 20000 --truth truth.$i
           i=$((i+1))
         done; wait",
        w = work.display(),
        trainer = fx.join("trainer").display(),
        cuda = fx.join("shaped/libcuda.so.1").display(),
    )
}

/// `DURATION`: seconds, or with a unit (`90s`, `5m`, `1h`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num.parse().map_err(|_| format!("'{s}' is not a duration (e.g. 300, 5m, 1h)"))?;
    match unit {
        "" | "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        "h" => Ok(Duration::from_secs(n * 3600)),
        _ => Err(format!("'{s}' is not a duration (e.g. 300, 5m, 1h)")),
    }
}

pub fn main(duration: Duration) -> Result<()> {
    let work = root().join("target/soak");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(work.join("no-rapl")).context("soak dir")?;
    let db = work.join("soak.db");
    let step = format!("{}:train_step", fixtures_dir().join("trainer").display());
    let mut agent = Command::new(profiler_bin())
        .args(["run", "-q", "--no-gpu", "--max-size", MAX_SIZE, "--step-symbol", &step, "--powercap-root"])
        .arg(work.join("no-rapl"))
        .arg("-o")
        .arg(&db)
        .args(["--", "sh", "-c", &job_script(&work)])
        .spawn()
        .context("start the profiler")?;
    let pid = agent.id();
    say(format!(
        "soak: {} s of the churning trainer, --max-size {MAX_SIZE}, into {}",
        duration.as_secs(),
        db.display()
    ));
    println!(
        "min  anon MiB  file MiB  CPU %  profile MiB  -wal MiB  launch rows  step rows  lost  steps exact  unmarked"
    );
    let (t0, mut last_cpu, mut last_t) = (Instant::now(), cpu_s(pid), Instant::now());
    let mut minute = 0;
    while t0.elapsed() < duration {
        std::thread::sleep(Duration::from_secs(60).min(duration.saturating_sub(t0.elapsed())));
        minute += 1;
        let (anon, file) = rss_kib(pid);
        let cpu = cpu_s(pid);
        let pct = 100.0 * (cpu - last_cpu) / last_t.elapsed().as_secs_f64();
        (last_cpu, last_t) = (cpu, Instant::now());
        let (launches, steps, lost) = rows(&db);
        let e = steps_exact(&db, &work);
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        println!(
            "{minute:>3}  {:>8.1}  {:>8.1}  {pct:>5.1}  {:>11.1}  {:>8.1}  {launches:>11}  {steps:>9}  {lost:>4}  {:>11}  {:>8}",
            anon as f64 / 1024.0,
            file as f64 / 1024.0,
            mib(file_len(&db)),
            mib(file_len(&PathBuf::from(format!("{}-wal", db.display())))),
            format!("{}/{}", e.exact, e.total),
            e.total - e.exact - e.marked,
        );
    }
    std::fs::write(work.join("STOP"), b"").context("stop the job")?;
    let status = agent.wait().context("wait for the profiler")?;
    let e = steps_exact(&db, &work);
    let (launches, steps, lost) = rows(&db);
    println!(
        "end: profiler {status}; profile {:.1} MiB, {launches} launch rows, {steps} step rows, {lost} lost; \
         steps exact {}/{}, the rest marked but {}",
        file_len(&db) as f64 / (1u64 << 20) as f64,
        e.exact,
        e.total,
        e.total - e.exact - e.marked,
    );
    println!(
        "(unmarked: steps of threads held inexactly with no step marked incomplete or endless; a job's processes' \
         marks are written at the job's end, so only this line's figure is final)"
    );
    Ok(())
}
