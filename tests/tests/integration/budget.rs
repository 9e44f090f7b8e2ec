//! Root integration tests of the size budget: a small filesystem shared with
//! a checkpoint writer (`--min-free`), `--max-size` on a high-rate run, and
//! `--launches auto`. Each compares the steps with the trainer's own ground
//! truth: the budget stops per-call rows, never steps or their counts.
use std::{
    path::{Path, PathBuf},
    process::{Child, Command},
    time::Duration,
};

use integration_tests::*;

/// What `--max-size` may be exceeded by at the end: the last batch admitted on
/// an estimate (a few hundred KiB at these rates) and SQLite's page rounding.
const MAX_SIZE_SLACK: u64 = 1 << 20;

/// A tmpfs of `mib` MiB at `dir/fs`, unmounted when dropped.
struct SmallFs(PathBuf);

impl SmallFs {
    fn mount(dir: &Path, mib: u64) -> Option<SmallFs> {
        let at = dir.join("fs");
        std::fs::create_dir_all(&at).expect("mount point");
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(&at)
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(SmallFs(at))
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A training job's checkpoint writer: every 0.5 s, 4 MiB to a new file
/// renamed over the last one (as `torch.save` users do), one line per write
/// (`ok` or `FAIL`) in `log`, until `stop` exists.
fn checkpoint_writer(fs: &Path, log: &Path, stop: &Path) -> CheckpointWriter {
    let script = format!(
        "cd '{fs}'; while [ ! -e '{stop}' ]; do
           if head -c 4194304 /dev/zero > ckpt.tmp 2>/dev/null && mv ckpt.tmp ckpt; then echo ok; else echo FAIL; rm -f ckpt.tmp; fi
           sleep 0.5
         done >> '{log}'",
        fs = fs.display(),
        stop = stop.display(),
        log = log.display()
    );
    CheckpointWriter(Command::new("sh").arg("-c").arg(script).spawn().expect("start the checkpoint writer"))
}

/// Killed when dropped (a failed assertion leaves no writer behind).
struct CheckpointWriter(Child);

impl Drop for CheckpointWriter {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The trainer with `args`, the profiler attached with `--step-symbol
/// train_step` and `extra`, until the trainer exits (or, when `stop_on` is
/// given, until the profiler prints it and 1 s more: then SIGTERM).
fn traced(dir: &Path, db: &Path, args: &[&str], extra: &[&str], stop_on: Option<&str>) -> (Truth, String) {
    let mut trainer = Trainer::spawn(dir, args);
    let mut profiler_args = vec!["--step-symbol", "train_step", "--no-gpu"];
    let no_rapl = no_rapl_root(dir);
    profiler_args.extend(["--powercap-root", &no_rapl]);
    profiler_args.extend_from_slice(extra);
    let agent = Agent::attach(trainer.pid(), db, &profiler_args);
    trainer.go();
    if let Some(needle) = stop_on {
        agent.wait_for(needle, Duration::from_secs(120));
        std::thread::sleep(Duration::from_secs(1));
        trainer.signal(libc::SIGTERM);
    }
    assert!(trainer.wait().success(), "trainer failed");
    let (status, stderr) = agent.finish();
    assert!(status.success(), "profiler failed: {stderr}");
    (trainer.truth(), stderr)
}

/// The budget's record of the session: (launch_rows_stopped_ns,
/// per_call_rows_stopped_ns, all_rows_stopped_ns, budget_reason, per_call_rows_dropped).
type BudgetRecord = (Option<i64>, Option<i64>, Option<i64>, Option<String>, Option<i64>);

fn budget_record(db: &Path, session: i64) -> BudgetRecord {
    open(db)
        .query_row(
            "SELECT launch_rows_stopped_ns, per_call_rows_stopped_ns, all_rows_stopped_ns, budget_reason,
                    per_call_rows_dropped FROM sessions WHERE id = ?1",
            [session],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
        )
        .expect("the session's budget columns")
}

/// Every step exact (count, thread, launches per step) against the trainer's
/// truth, and every launch counted, whatever rows the budget stopped.
fn assert_steps_exact(db: &Path, truth: &Truth, stderr: &str) -> Session {
    let s = last_session(db);
    assert_eq!(s.lost_events, Some(0), "{stderr}");
    assert_eq!(s.total_launches, Some(truth.total as i64), "{stderr}");
    assert_steps_match(&truth.steps, &steps(db, s.id), STEP_TOLERANCE_NS);
    s
}

/// The stored launch rows are those from before the stop at `stopped_ns`,
/// and fewer than the launches seen.
fn assert_rows_end_at(db: &Path, s: &Session, stopped_ns: i64) {
    let (rows, last): (i64, Option<i64>) = open(db)
        .query_row("SELECT count(*), max(ts_ns) FROM launches WHERE session_id = ?1", [s.id], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .expect("launch rows");
    assert!(rows > 0 && rows < s.total_launches.expect("total"), "{rows} rows of {:?}", s.total_launches);
    assert!(last.is_some_and(|t| t <= stopped_ns), "last row at {last:?}, rows stopped at {stopped_ns}");
}

fn report_text(db: &Path) -> String {
    let out = Command::new(profiler_bin()).arg("report").arg(db).output().expect("run profiler report");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_checkpoint_writer_beside_the_profile_never_fails() {
    let dir = workdir("budget-fs");
    let Some(fs) = SmallFs::mount(&dir, 64) else {
        skip("cannot mount a tmpfs (needs root and mount(8))");
        return;
    };
    // The job's own data: half the filesystem.
    std::fs::write(fs.0.join("dataset"), vec![1u8; 32 << 20]).expect("the job's data");
    let (log, stop) = (dir.join("ckpt.log"), dir.join("ckpt.stop"));
    let mut writer = checkpoint_writer(&fs.0, &log, &stop);
    let db = fs.0.join("profile.db");
    // 800 000 launches: ≈70 MiB of launch rows, more than the filesystem has.
    let (truth, stderr) = traced(&dir, &db, &["--steps", "2000", "--launches", "200", "--threads", "2"], &[], None);
    std::fs::write(&stop, b"").expect("stop the writer");
    writer.0.wait().expect("wait for the checkpoint writer");
    let writes = std::fs::read_to_string(&log).expect("checkpoint log");
    assert!(writes.lines().count() >= 2, "the checkpoint writer ran: {writes}");
    assert!(!writes.contains("FAIL"), "a checkpoint write failed beside the profile:\n{writes}\n{stderr}");
    let s = assert_steps_exact(&db, &truth, &stderr);
    let (_, per_call, all, reason, dropped) = budget_record(&db, s.id);
    let per_call = per_call.unwrap_or_else(|| panic!("per-call rows never stopped: {stderr}"));
    assert!(all.is_none_or(|a| a >= per_call), "{all:?}");
    assert!(reason.as_deref().is_some_and(|r| r.contains("--min-free")), "{reason:?}");
    assert!(dropped.is_some_and(|d| d > 0), "{dropped:?}");
    assert_rows_end_at(&db, &s, per_call);
    assert!(stderr.contains("warning:") && stderr.contains("per-call rows"), "{stderr}");
    let caps = count(
        &db,
        "SELECT count(*) FROM capabilities WHERE session_id = ?1 AND source = 'store' AND metric = 'per_call_rows'",
        s.id,
    );
    assert_eq!(caps, 1);
    let report = report_text(&db);
    assert!(report.contains("per-call rows stopped"), "report does not say it:\n{report}");
}

#[test]
fn max_size_is_honoured_on_a_high_rate_run() {
    let dir = workdir("budget-max");
    let db = dir.join("p.db");
    let max: u64 = 8 << 20;
    let (truth, stderr) =
        traced(&dir, &db, &["--steps", "1500", "--launches", "200", "--threads", "2"], &["--max-size", "8M"], None);
    let s = assert_steps_exact(&db, &truth, &stderr);
    let size: u64 = profile_files(&db).iter().map(|p| std::fs::metadata(p).map_or(0, |m| m.len())).sum();
    assert!(size <= max + MAX_SIZE_SLACK, "the profile is {size} bytes, --max-size {max} + slack {MAX_SIZE_SLACK}");
    let (_, per_call, _, reason, _) = budget_record(&db, s.id);
    let per_call = per_call.unwrap_or_else(|| panic!("per-call rows never stopped: {stderr}"));
    assert!(reason.as_deref().is_some_and(|r| r.contains("--max-size")), "{reason:?}");
    assert_rows_end_at(&db, &s, per_call);
    // The rows stored filled most of the budget: the stop was not early.
    // (≈20 000 launches/s: the first 5 s window's rows fit in 64 MiB.)
    let rows = count(&db, "SELECT count(*) FROM launches WHERE session_id = ?1", s.id) as u64;
    assert!(rows * 64 > max / 4, "{rows} launch rows in an 8 MiB budget");
}

#[test]
fn launches_auto_switches_to_counts_and_says_so() {
    let dir = workdir("budget-auto");
    let db = dir.join("p.db");
    let (truth, stderr) = traced(
        &dir,
        &db,
        &["--forever", "--launches", "100", "--step-sleep-us", "5000"],
        &["--launches", "auto", "--max-size", "64M", "--duration", "600"],
        Some("--launches auto:"),
    );
    let s = assert_steps_exact(&db, &truth, &stderr);
    let (launch, per_call, _, reason, dropped) = budget_record(&db, s.id);
    let launch = launch.unwrap_or_else(|| panic!("--launches auto never switched: {stderr}"));
    assert!(per_call.is_none_or(|p| p >= launch), "{per_call:?}");
    assert!(reason.as_deref().is_some_and(|r| r.contains("launches/s")), "{reason:?}");
    assert!(dropped.is_some_and(|d| d > 0), "{dropped:?}");
    assert_rows_end_at(&db, &s, launch);
    let mode: String =
        open(&db).query_row("SELECT launch_mode FROM sessions WHERE id = ?1", [s.id], |r| r.get(0)).expect("mode");
    assert_eq!(mode, "auto");
    let report = report_text(&db);
    assert!(report.contains("launch rows (--launches auto) stopped"), "report does not say it:\n{report}");
}

/// The profile and its SQLite side files.
fn profile_files(db: &Path) -> [PathBuf; 3] {
    let side = |s: &str| PathBuf::from(format!("{}{s}", db.display()));
    [db.to_owned(), side("-wal"), side("-shm")]
}

/// (anonymous resident KiB, profile + `-wal` bytes, `-wal` bytes) now.
fn bounds(agent: u32, db: &Path) -> (u64, u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{agent}/status")).unwrap_or_default();
    let anon = status.lines().find_map(|l| l.strip_prefix("RssAnon:")).and_then(|v| v.split_whitespace().next());
    let files = profile_files(db).map(|p| std::fs::metadata(p).map_or(0, |m| m.len()));
    (anon.and_then(|v| v.parse().ok()).unwrap_or(0), files.iter().sum(), files[1])
}

/// `cargo xtask soak`'s short version: a minute of thread churn at a high
/// launch rate under `--max-size 32M`, looked at every 5 s: the profile stays
/// within its budget, the `-wal` within a few batches of its limit, the
/// agent's memory flat after warm-up, and every step exact at the end.
#[test]
fn a_minute_of_thread_churn_stays_within_its_bounds() {
    let dir = workdir("budget-soak");
    let db = dir.join("p.db");
    let churn = ["--steps", "20", "--launches", "100", "--threads", "2", "--waves", "6000", "--step-sleep-us", "5000"];
    let mut trainer = Trainer::spawn(&dir, &churn);
    let agent = Agent::attach(trainer.pid(), &db, &["--step-symbol", "train_step", "--no-gpu", "--max-size", "32M"]);
    trainer.go();
    let mut seen = Vec::new();
    for _ in 0..12 {
        std::thread::sleep(Duration::from_secs(5));
        seen.push(bounds(agent.child.id(), &db));
    }
    trainer.signal(libc::SIGTERM);
    assert!(trainer.wait().success(), "trainer failed");
    let (status, stderr) = agent.finish();
    assert!(status.success(), "profiler failed: {stderr}");
    let truth = trainer.truth();
    assert!(truth.steps.len() > 5_000, "{} steps in a minute", truth.steps.len());
    assert_steps_exact(&db, &truth, &stderr);
    for &(_, size, wal) in &seen {
        assert!(size <= (32 << 20) + MAX_SIZE_SLACK, "the profile reached {size} bytes: {seen:?}");
        // Its limit (2 MiB, a 16th of the budget) and a batch or two.
        assert!(wal <= 4 << 20, "the -wal reached {wal} bytes: {seen:?}");
    }
    // After the first 20 s (the budget reached, every buffer grown): flat.
    let warm = seen[3].0;
    let last = seen.last().expect("samples").0;
    assert!(last <= warm + 16 * 1024, "agent anonymous RSS {warm} KiB at 20 s, {last} KiB at 60 s: {seen:?}");
}
