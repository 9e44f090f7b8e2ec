//! CPU package / DRAM energy from a fake powercap tree whose counters the test
//! advances at known power, and system usage checked against /proc.
use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use integration_tests::*;

/// (zone, name, watts). Two packages with DRAM, and a psys zone (which
/// overlaps the packages and must not be added to them).
const ZONES: [(&str, &str, f64); 5] = [
    ("intel-rapl:0", "package-0", 30.0),
    ("intel-rapl:0:0", "dram", 4.0),
    ("intel-rapl:1", "package-1", 20.0),
    ("intel-rapl:1:0", "dram", 6.0),
    ("intel-rapl:2", "psys", 200.0),
];
const CPU_W: f64 = 50.0;
const DRAM_W: f64 = 10.0;
/// Small enough that package-0 wraps during the run (30 W ⇒ every 2 s).
const MAX_RANGE_UJ: u64 = 60_000_000;

/// Writes the zones and keeps their counters at `start + P·t` (µJ, wrapping)
/// every millisecond, as the hardware would, until dropped.
struct FakeRapl {
    root: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeRapl {
    fn start(dir: &Path) -> FakeRapl {
        let root = dir.join("powercap");
        for (zone, name, _) in ZONES {
            let z = root.join(zone);
            std::fs::create_dir_all(&z).expect("mkdir");
            std::fs::write(z.join("name"), format!("{name}\n")).expect("name");
            std::fs::write(z.join("max_energy_range_uj"), format!("{MAX_RANGE_UJ}\n")).expect("max");
            std::fs::write(z.join("energy_uj"), format!("{:020}\n", 0)).expect("energy");
        }
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let r = root.clone();
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                let t = monotonic_ns() as f64 / 1e9;
                for (i, (zone, _, watts)) in ZONES.iter().enumerate() {
                    // Each counter starts at a different phase, near its wrap.
                    let start = MAX_RANGE_UJ as f64 * (0.9 - 0.1 * i as f64);
                    let uj = (start + watts * 1e6 * t) as u64 % MAX_RANGE_UJ;
                    // In place and fixed width, as sysfs behaves: the sampler
                    // keeps the file open and re-reads it.
                    use std::os::unix::fs::FileExt;
                    let f = std::fs::OpenOptions::new().write(true).open(r.join(zone).join("energy_uj")).expect("open");
                    f.write_all_at(format!("{uj:020}\n").as_bytes(), 0).expect("write");
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        FakeRapl { root, stop, thread: Some(thread) }
    }
}

impl Drop for FakeRapl {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn step_energy_from_rapl_is_within_its_bound_across_a_wrap() {
    let dir = workdir("rapl");
    let db = dir.join("p.db");
    let rapl = FakeRapl::start(&dir);
    let root = rapl.root.display().to_string();
    // ~4.5 s: package-0 wraps twice, package-1 once.
    let mut trainer =
        Trainer::spawn(&dir, &["--steps", "90", "--launches", "5", "--step-sleep-us", "40000", "--gap-us", "10000"]);
    let agent =
        Agent::attach(trainer.pid(), &db, &["--step-symbol", "train_step", "--powercap-root", &root, "--no-gpu"]);
    trainer.go();
    assert!(trainer.wait().success());
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    drop(rapl);
    let s = last_session(&db);
    let conn = open(&db);
    let rows: Vec<(i64, f64, f64, f64, f64, f64)> = conn
        .prepare(
            "SELECT e.step, s.duration_ns / 1e9, e.cpu_energy_j, e.cpu_energy_error_j, e.dram_energy_j, e.dram_energy_error_j
             FROM step_energy e JOIN steps s USING (session_id, label, step) WHERE e.session_id = ?1 ORDER BY e.step",
        )
        .expect("prepare")
        .query_map([s.id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows: energy for every step");
    assert_eq!(rows.len(), 90);
    let (mut rel, mut total, mut truth_total) = (Vec::new(), 0.0, 0.0);
    for &(step, secs, cpu, cpu_err, dram, dram_err) in &rows {
        assert!(cpu >= 0.0 && dram >= 0.0, "step {step}: negative energy across a wrap");
        let (cpu_truth, dram_truth) = (CPU_W * secs, DRAM_W * secs);
        assert!(
            (cpu - cpu_truth).abs() <= cpu_err,
            "step {step}: CPU {cpu:.4} J vs {cpu_truth:.4} J (bound {cpu_err:.4})"
        );
        assert!(
            (dram - dram_truth).abs() <= dram_err,
            "step {step}: DRAM {dram:.4} J vs {dram_truth:.4} J (bound {dram_err:.4})"
        );
        rel.push((cpu - cpu_truth).abs() / cpu_truth);
        total += cpu;
        truth_total += cpu_truth;
    }
    let at = |p| percentile(&rel, p).expect("steps measured");
    let (median, p90, worst) = (at(50.0), at(90.0), at(100.0));
    println!(
        "RAPL per step: CPU relative error median {:.3}%, p90 {:.3}%, worst {:.2}%, steps' CPU energy {total:.3} J vs true {truth_total:.3} J",
        100.0 * median,
        100.0 * p90,
        100.0 * worst
    );
    // The fake counters advance every ~1 ms from a thread of this test, so each
    // boundary is read up to ~1 ms stale: ~0.7–0.9 % median error on a 40 ms
    // step (README: worst 2.4 %). A late tick of that thread or of the sampler
    // on a loaded 2-core machine made the worst step 9.9 %, within its bound
    // (checked above), so the figure asserted is the median; a wrong domain or
    // psys added in is off by far more.
    assert!(median < 0.03, "median per-step CPU energy error {:.3}%", 100.0 * median);
    // psys (200 W) is never added to the packages: 50 W, not 250 W.
    assert!((total / truth_total - 1.0).abs() < 0.02, "{total} vs {truth_total}");
    // The cumulative series is monotone across the wraps.
    let back: i64 = count(
        &db,
        "SELECT count(*) FROM (SELECT energy_j - lag(energy_j) OVER (PARTITION BY domain ORDER BY ts_ns) AS d
         FROM rapl_samples WHERE session_id = ?1) WHERE d < 0",
        s.id,
    );
    assert_eq!(back, 0);
}

/// Profiles 5 steps with `extra` and checks what no RAPL leaves behind: one
/// "RAPL unavailable" line, NULL CPU energy for every step, the reason on record.
fn no_rapl_is_one_line_and_nulls(name: &str, extra: &[&str]) {
    let dir = workdir(name);
    let db = dir.join("p.db");
    let mut trainer = Trainer::spawn(&dir, &["--steps", "5", "--launches", "2", "--step-sleep-us", "20000"]);
    let mut args = vec!["--step-symbol", "train_step", "--no-gpu"];
    args.extend_from_slice(extra);
    let agent = Agent::attach(trainer.pid(), &db, &args);
    trainer.go();
    assert!(trainer.wait().success());
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    assert_eq!(stderr.lines().filter(|l| l.contains("RAPL unavailable")).count(), 1, "{stderr}");
    let s = last_session(&db);
    assert_eq!(count(&db, "SELECT count(*) FROM step_energy WHERE session_id = ?1 AND cpu_energy_j IS NULL", s.id), 5);
    assert!(
        count(
            &db,
            "SELECT count(*) FROM capabilities WHERE session_id = ?1 AND source = 'rapl' AND available = 0 AND reason LIKE 'RAPL unavailable%'",
            s.id
        ) >= 1
    );
}

#[test]
fn no_rapl_is_one_line_and_nulls_on_any_host() {
    // A powercap root with no zones: no RAPL, whatever this host has.
    let empty = workdir("no-rapl-root");
    no_rapl_is_one_line_and_nulls("no-rapl-named", &["--powercap-root", &empty.display().to_string()]);
    // The default sources (perf power PMU, /sys/class/powercap): the same where the host has neither.
    match host_rapl() {
        None => no_rapl_is_one_line_and_nulls("no-rapl", &[]),
        Some(what) => skip(format!("no RAPL from the default sources: this host has {what}")),
    }
}

fn meminfo_kb(key: &str) -> f64 {
    let text = std::fs::read_to_string("/proc/meminfo").expect("meminfo");
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.trim().strip_suffix("kB")?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{key} in /proc/meminfo"))
}

#[test]
fn system_values_agree_with_proc() {
    let dir = workdir("system");
    let db = dir.join("p.db");
    let mut trainer = Trainer::spawn(&dir, &["--steps", "20", "--launches", "2", "--step-sleep-us", "50000"]);
    let agent = Agent::attach(trainer.pid(), &db, &["--step-symbol", "train_step", "--no-gpu"]);
    let t0 = Instant::now();
    trainer.go();
    // Our own reading while the trainer runs.
    std::thread::sleep(Duration::from_millis(300));
    let used_gb = (meminfo_kb("MemTotal:") - meminfo_kb("MemAvailable:")) * 1024.0 / 1e9;
    assert!(trainer.wait().success());
    // The session ends with the trainer (finish also waits for the probes' removal).
    let traced_s = t0.elapsed().as_secs_f64();
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    let s = last_session(&db);
    let conn = open(&db);
    let (ram, disk_pct, n): (f64, f64, i64) = conn
        .query_row(
            "SELECT avg(ram_used_gb), avg(disk_usage_pct), count(*) FROM system_samples WHERE session_id = ?1",
            [s.id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .expect("system samples");
    assert!(n as f64 >= 0.8 * traced_s * 10.0, "{n} samples at 10 Hz over {traced_s:.1} s");
    assert!((ram - used_gb).abs() / used_gb < 0.2, "RAM used: sampler {ram:.3} GB vs /proc/meminfo {used_gb:.3} GB");
    assert!((0.0..=100.0).contains(&disk_pct));
    // prov4ml's names, one value per step each.
    let metrics: Vec<String> = conn
        .prepare("SELECT DISTINCT metric FROM system_metrics WHERE session_id = ?1 ORDER BY metric")
        .expect("prepare")
        .query_map([s.id], |r| r.get(0))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    for m in [
        "cpu_usage_pct",
        "cpu_power",
        "cpu_energy",
        "ram_usage_pct",
        "ram_usage_gb",
        "ram_power",
        "ram_energy",
        "disk_usage_gb",
        "disk_usage_pct",
    ] {
        assert!(metrics.iter().any(|x| x == m), "{m} missing from {metrics:?}");
    }
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM system_metrics WHERE session_id = ?1 AND metric = 'ram_usage_gb' AND value > 0",
            s.id
        ),
        20
    );
}
