//! `profiler report`: one session's figures per step label (step and inter-step
//! time, launches, sync wait, energy per step) and its top kernels, as a table
//! for an 80-column terminal, JSON for scripts, or CSV; and the read-only view
//! of a profile that `export` shares.
//!
//! A profile written by an older profiler is migrated in memory when opened
//! (`store::open_for_reading`), so every query sees today's schema; what an
//! old file could not hold (labels, sync wait, kernel names, CPU/DRAM energy
//! came later) is NULL there, and reported as absent (`–`, `null`, an empty
//! CSV field), never as zero.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt::Write as _,
    io::Write,
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::{Context, anyhow, bail};
use clap::{Args, ValueEnum};
use comfy_table::{CellAlignment, ColumnConstraint, Row, Table, Width};
use rusqlite::{Connection, ErrorCode};
use serde::Serialize;
use unicode_width::{UnicodeWidthChar, UnicodeWidthStr};

/// Version of the JSON shape below; bumped only when a field changes meaning
/// or goes away (new fields may be added without a bump).
const REPORT_VERSION: u32 = 1;
/// Kernels listed under "top kernels".
const TOP_KERNELS: usize = 10;
/// `record_function` names in the report's top regions.
const TOP_REGIONS: usize = 10;
/// Unavailable metrics listed in the table before "… N more".
const CAPABILITY_LINES: usize = 8;
/// The table's width.
const WIDTH: usize = 80;

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// The profile to read.
    #[arg(default_value = "profile.db")]
    pub(super) db: PathBuf,
    /// Session id (default: of the newest job's processes, the one with the most steps).
    #[arg(long, value_name = "N")]
    pub(super) session: Option<i64>,
    /// Only steps with this label (default: every label).
    #[arg(long, value_name = "L")]
    pub(super) label: Option<String>,
    /// Leave out the first K steps of each label (warm-up).
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub(super) skip: u64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = ReportFormat::Table)]
    pub(super) format: ReportFormat,
    /// The ranks of a job side by side (default: the latest session's job):
    /// per step the slowest and fastest rank, the spread, each rank's wait share.
    /// With --html: every process of the job, ranks side by side.
    #[arg(long, value_name = "JOB", num_args = 0..=1, default_missing_value = "", conflicts_with = "session")]
    pub(super) job: Option<String>,
    /// Write one self-contained HTML page of plots (opens offline) instead.
    #[arg(long, conflicts_with = "format")]
    pub(super) html: bool,
    /// Where --html writes its page.
    #[arg(short, long, value_name = "FILE", default_value = "report.html", requires = "html")]
    pub(super) output: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum ReportFormat {
    Table,
    Json,
    Csv,
}

pub async fn main(args: ReportArgs) -> anyhow::Result<ExitCode> {
    let db = ProfileDb::open(&args.db)?;
    let session = db.session(args.session)?;
    let report = build(&db, session, args.label.as_deref(), args.skip)
        .with_context(|| format!("reading session {session} of {}", args.db.display()))?;
    print(&report, args.format, render_table, write_csv)
}

/// Standard output, buffered, as the reports write it.
pub(super) type Stdout = std::io::BufWriter<std::io::StdoutLock<'static>>;

/// Prints `report` in `format`: `table` renders it, JSON is its
/// serialisation, `csv` writes its rows. A reader that closed the pipe is not an error.
pub(super) fn print<R: Serialize>(
    report: &R,
    format: ReportFormat,
    table: impl FnOnce(&R) -> String,
    csv: impl FnOnce(&R, &mut Stdout) -> anyhow::Result<()>,
) -> anyhow::Result<ExitCode> {
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let written = (|| -> anyhow::Result<()> {
        match format {
            ReportFormat::Table => out.write_all(table(report).as_bytes())?,
            ReportFormat::Json => {
                serde_json::to_writer_pretty(&mut out, report)?;
                out.write_all(b"\n")?;
            }
            ReportFormat::Csv => csv(report, &mut out)?,
        }
        out.flush()?;
        Ok(())
    })();
    match written {
        Err(e) if reader_went_away(&e) => Ok(ExitCode::SUCCESS),
        r => r.context("writing the report").map(|()| ExitCode::SUCCESS),
    }
}

/// Whether writing failed because the reader closed the pipe (`| head`):
/// the reader has what it wanted, so that is not an error to report.
pub(super) fn reader_went_away(e: &anyhow::Error) -> bool {
    let pipe = |k: std::io::ErrorKind| k == std::io::ErrorKind::BrokenPipe;
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().is_some_and(|io| pipe(io.kind()))
            || c.downcast_ref::<serde_json::Error>().and_then(serde_json::Error::io_error_kind).is_some_and(pipe)
            || c.downcast_ref::<csv::Error>()
                .is_some_and(|e| matches!(e.kind(), csv::ErrorKind::Io(io) if pipe(io.kind())))
    })
}

/// A profile opened for reading at the current schema (see
/// [`crate::store::open_for_reading`]), with its tables and views and their
/// columns (for `export --format csv`, which names a table).
pub(super) struct ProfileDb {
    pub conn: Connection,
    pub path: PathBuf,
    /// Table or view → its columns, in order; read once at open.
    tables: BTreeMap<String, Vec<String>>,
    /// Whether a live profiler may still write the profile (checked before
    /// this process opened it): see [`crate::store::written_by_a_live_profiler`].
    pub written_by_a_live_profiler: bool,
}

impl ProfileDb {
    /// Opens `path` without writing it; a missing file, a file that is not
    /// SQLite, a database without the profiler's schema and one from a newer
    /// profiler each get one clear error.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        if !path.exists() {
            bail!("{} does not exist; pass the file written by `profiler attach/run -o FILE`", path.display());
        }
        // Looked at before this process opens the profile: closing the file
        // used to look would drop every fcntl lock this process holds on it,
        // its own connection's included.
        let written_by_a_live_profiler = crate::store::written_by_a_live_profiler(path);
        // A report must never create, migrate or lock a profile that a
        // running profiler may still be writing: an old one is migrated in memory.
        let conn = crate::store::open_for_reading(path).map_err(|e| {
            use crate::store::StoreError;
            let p = path.display();
            match e {
                StoreError::NotADatabase { .. } => {
                    anyhow!("{p} is not a SQLite database; pass a profile written by `profiler attach/run -o`")
                }
                StoreError::Foreign { .. } => {
                    anyhow!("{p} is a SQLite database but not a profile (it has no profiler schema)")
                }
                StoreError::TooNew { found, .. } => anyhow!(
                    "{p} has schema version {found}, newer than this profiler's {}; upgrade profiler to read it",
                    crate::store::SCHEMA_VERSION
                ),
                e => anyhow!("cannot read {p} ({e})"),
            }
        })?;
        let tables = read_schema(&conn).map_err(|e| anyhow!("cannot read {} ({e})", path.display()))?;
        Ok(Self { conn, path: path.to_owned(), tables, written_by_a_live_profiler })
    }

    pub fn has_table(&self, name: &str) -> bool {
        self.tables.contains_key(name)
    }

    /// Tables and views, sorted.
    pub fn tables(&self) -> impl Iterator<Item = &str> {
        self.tables.keys().map(String::as_str)
    }

    /// Column names of a table or view (none if it does not exist).
    pub fn columns(&self, table: &str) -> &[String] {
        self.tables.get(table).map_or(&[], Vec::as_slice)
    }

    /// The session asked for, or the latest.
    pub fn session(&self, requested: Option<i64>) -> anyhow::Result<i64> {
        let ids: Vec<i64> = self
            .conn
            .prepare("SELECT id FROM sessions ORDER BY id")
            .and_then(|mut q| q.query_map([], |r| r.get(0))?.collect())
            .with_context(|| format!("reading the sessions of {}", self.path.display()))?;
        if ids.is_empty() {
            bail!("{} has no sessions yet", self.path.display());
        }
        match requested {
            None => {
                self.newest_jobs_busiest().with_context(|| format!("reading the sessions of {}", self.path.display()))
            }
            Some(n) if ids.contains(&n) => Ok(n),
            Some(n) => bail!("{} has no session {n}; its sessions are {}", self.path.display(), id_list(&ids)),
        }
    }
}

impl ProfileDb {
    /// The session a report shows when none is named: of the newest job's
    /// processes (a `run` follows children: a launcher, its helpers, its
    /// ranks), the one with the most steps; the first of them (the target
    /// named) among equals.
    fn newest_jobs_busiest(&self) -> rusqlite::Result<i64> {
        self.conn.query_row(
            "SELECT s.id FROM sessions s
             WHERE s.job IS (SELECT job FROM sessions ORDER BY id DESC LIMIT 1)
             ORDER BY (SELECT count(*) FROM steps t WHERE t.session_id = s.id) DESC, s.id
             LIMIT 1",
            [],
            |r| r.get(0),
        )
    }
}

/// Every table and view with its columns, in one query. A view that no
/// longer compiles fails that query; then each is read on its own, and such a
/// view has no columns.
fn read_schema(conn: &Connection) -> rusqlite::Result<BTreeMap<String, Vec<String>>> {
    let mut tables: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let all = conn
        .prepare(
            "SELECT m.name, p.name FROM sqlite_master m, pragma_table_info(m.name) p
             WHERE m.type IN ('table', 'view') ORDER BY m.name, p.cid",
        )
        .and_then(|mut q| q.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect::<rusqlite::Result<Vec<_>>>());
    match all {
        Ok(pairs) => {
            for (table, column) in pairs {
                tables.entry(table).or_default().push(column);
            }
        }
        Err(e) if e.sqlite_error_code() == Some(ErrorCode::NotADatabase) => return Err(e),
        Err(_) => {
            let names: Vec<String> = conn
                .prepare("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")?
                .query_map([], |r| r.get(0))?
                .collect::<rusqlite::Result<_>>()?;
            for name in names {
                let columns = conn
                    .prepare("SELECT name FROM pragma_table_info(?1) ORDER BY cid")
                    .and_then(|mut q| q.query_map([&name], |r| r.get(0))?.collect())
                    .unwrap_or_default();
                tables.insert(name, columns);
            }
        }
    }
    Ok(tables)
}

/// "1, 2, 3" or "1–40 (40 sessions)".
fn id_list(ids: &[i64]) -> String {
    match ids {
        [] => String::new(),
        [a] => a.to_string(),
        _ if ids.len() <= 5 => ids.iter().map(i64::to_string).collect::<Vec<_>>().join(", "),
        [first, .., last] => format!("{first}–{last} ({} sessions)", ids.len()),
    }
}

/// The report. `--format json` prints exactly this, pretty-printed; the shape
/// is stable (`report_version` changes if a field changes meaning or is
/// removed). Times are ms, energies J, powers W; a figure the profile does not
/// have is `null`.
///
/// ```text
/// {
///   "report_version": 1,
///   "database": "profile.db",
///   "skip": 5,                        // --skip: leading steps left out per label
///   "label_filter": null,             // --label, if given
///   "session": {
///     "id": 1, "pid": 4242, "command": "python train.py", "exe": "/usr/bin/python3.11",
///     "mode": "attach", "launch_mode": "all", "step_symbol": "train_step",
///     "started_utc": "2025-06-01 12:00:03", "started_unix_s": 1748779203.5,
///     "duration_s": 61.2,             // null while running or if the profiler was killed
///     "state": "ended",               // "ended"; "running": not ended, its profiler is alive;
///                                     // "unclean": not ended and nobody writing it (the profiler was
///                                     // killed or crashed: what it committed is there, nothing after)
///     "end_reason": "sigint", "lost_events": 0, "total_launches": 10000,
///     "stored_launches": 10000, "unmatched_returns": 0,
///     "hostname": "gpu1", "kernel_release": "6.8.0", "profiler_version": "0.1.0"
///   },
///   "capabilities": [ { "source": "nvml", "metric": "GPU_0/fan.speed", "available": false, "reason": "…" } ],
///   "labels": [ {
///     "label": "train",
///     "steps": 100,                   // all steps with this label
///     "completed": 99,                // steps that ended
///     "skipped": 5,                   // the first --skip steps, by start time
///     "measured": 94,                 // completed steps after the skipped ones: the figures below
///     "steps_per_s": 9.8,             // measured / (last end − first start)
///     "step_time_ms":  { "p50": …, "p90": …, "p99": …, "max": …, "mean": … },   // null if none measured
///     "inter_step_ms": { … },         // null if no measured step has a gap (first step of each thread)
///     "launches_per_step": { … },
///     "sync_wait_share": 0.12,        // Σ sync wait / Σ step time; null if not recorded
///     "data_wait_ms": { … },          // PyTorch steps: time in the DataLoader's __next__; null otherwise
///     "optimizer_ms": { … },          // PyTorch steps: time in Optimizer.step; null otherwise
///     "gpus": [ { "gpu": 0, "name": "H200", "steps": 94, "energy_per_step_j": 61.5,
///                 "energy_error_per_step_j": 0.4, "avg_power_w": 615.0, "below_resolution": 0 } ],
///                                     // null if the session has no GPU figures
///     "cpu":  { "steps": 94, "energy_per_step_j": 8.1, "energy_error_per_step_j": 0.1,
///               "avg_power_w": 81.0, "below_resolution": 0 },   // RAPL package; null if not recorded
///     "dram": { … },                  // RAPL DRAM; null if not recorded
///     "energy_per_step_j": 69.6,      // sum of the per-step energies above that exist; null if none
///     "energy_components": ["GPU 0", "CPU"],  // which ones that sum includes
///     "tflops_per_s": { … },          // GEMM FLOPs (steps.flops) / step time, TFLOP/s; null without BLAS figures
///     "mfu_pct": { … },               // per step, mean step_gpu.mfu_pct over its GPUs; null if none
///     "mfu_gpm_pct": { … }            // the same for step_gpu.mfu_gpm_pct (an NVML GPM estimate)
///   } ],
///   "top_kernels": [ { "function": 1048576, "name": null, "demangled_name": null,
///                      "api": "cuLaunchKernel", "launches": 500, "share": 0.05 } ]
///                                     // whole session; null when launch rows were not kept (--launches count)
///   "top_regions": [ { "name": "Optimizer.step#AdamW.step", "count": 500, "total_ms": 310.2,
///                      "mean_ms": 0.62, "max_ms": 1.9, "open": 0 } ]
///                                     // PyTorch record_function regions by total time (ended ones;
///                                     // `open`: begun, end not seen); empty when none was recorded
/// }
/// ```
///
/// Percentiles are nearest-rank: the smallest value with at least p% of the
/// measured steps at or below it.
#[derive(Debug, Serialize)]
pub struct Report {
    pub report_version: u32,
    pub database: String,
    pub skip: u64,
    pub label_filter: Option<String>,
    pub session: SessionInfo,
    pub capabilities: Vec<CapabilityRow>,
    pub labels: Vec<LabelReport>,
    pub top_kernels: Option<Vec<KernelRow>>,
    pub top_regions: Vec<RegionStat>,
}

/// One PyTorch `record_function` name's regions over the whole session.
#[derive(Debug, Serialize)]
pub struct RegionStat {
    pub name: String,
    /// Regions of this name that ended.
    pub count: i64,
    pub total_ms: f64,
    pub mean_ms: f64,
    pub max_ms: f64,
    /// Regions begun whose end was not seen (not in the times).
    pub open: i64,
}

#[derive(Debug, Serialize)]
pub struct SessionInfo {
    pub id: i64,
    pub pid: i64,
    pub command: String,
    pub exe: Option<String>,
    pub mode: String,
    pub launch_mode: String,
    pub step_symbol: Option<String>,
    pub started_utc: Option<String>,
    pub started_unix_s: f64,
    pub duration_s: Option<f64>,
    /// `ended`, `running` or `unclean` (see [`SessionState`]).
    pub state: SessionState,
    pub end_reason: Option<String>,
    pub lost_events: Option<i64>,
    pub total_launches: Option<i64>,
    pub stored_launches: Option<i64>,
    pub unmatched_returns: Option<i64>,
    pub hostname: Option<String>,
    pub kernel_release: Option<String>,
    pub profiler_version: String,
    pub job: Option<String>,
    pub rank: Option<i64>,
    /// The processes (sessions) of its job, itself included.
    pub job_processes: i64,
}

/// Whether a session ended, is still being written, or stopped without an end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SessionState {
    /// Its end (time, reason, totals) was written.
    Ended,
    /// No end yet, and a process has the profile open: the profiler writing it.
    Running,
    /// No end, and nobody writing it: the profiler was killed or crashed. Every
    /// row it committed is there; what it had not committed, and the end, are not.
    Unclean,
}

impl SessionState {
    fn as_str(self) -> &'static str {
        match self {
            SessionState::Ended => "ended",
            SessionState::Running => "running",
            SessionState::Unclean => "unclean",
        }
    }
}

/// How `session` stands. Only the newest job of a file (the processes of
/// the newest session's profiler run) can still be running, and only while
/// its profiler lives.
fn session_state(db: &ProfileDb, session: i64, ended: bool) -> anyhow::Result<SessionState> {
    if ended {
        return Ok(SessionState::Ended);
    }
    let in_newest_job: bool = db.conn.query_row(
        "SELECT s.id = n.id OR s.job = n.job
         FROM sessions s, (SELECT id, job FROM sessions ORDER BY id DESC LIMIT 1) n WHERE s.id = ?1",
        [session],
        |r| r.get(0),
    )?;
    Ok(if in_newest_job && db.written_by_a_live_profiler { SessionState::Running } else { SessionState::Unclean })
}

#[derive(Debug, Serialize)]
pub struct CapabilityRow {
    pub source: String,
    pub metric: String,
    pub available: bool,
    pub reason: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct LabelReport {
    pub label: String,
    pub steps: u64,
    pub completed: u64,
    pub skipped: u64,
    pub measured: u64,
    pub steps_per_s: Option<f64>,
    pub step_time_ms: Option<Percentiles>,
    pub inter_step_ms: Option<Percentiles>,
    pub launches_per_step: Option<Percentiles>,
    pub sync_wait_share: Option<f64>,
    pub data_wait_ms: Option<Percentiles>,
    pub optimizer_ms: Option<Percentiles>,
    pub gpus: Option<Vec<GpuEnergy>>,
    pub cpu: Option<EnergyStat>,
    pub dram: Option<EnergyStat>,
    pub energy_per_step_j: Option<f64>,
    pub energy_components: Vec<String>,
    /// GEMM TFLOP/s per step (`steps.flops` / step time); None without BLAS figures.
    pub tflops_per_s: Option<Percentiles>,
    /// Per step, the mean `step_gpu.mfu_pct` over its GPUs.
    pub mfu_pct: Option<Percentiles>,
    /// Per step, the mean `step_gpu.mfu_gpm_pct` over its GPUs (an estimate from NVML GPM).
    pub mfu_gpm_pct: Option<Percentiles>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `values` (any order); None when empty.
    pub fn of(mut values: Vec<f64>) -> Option<Self> {
        if values.is_empty() {
            return None;
        }
        values.sort_by(f64::total_cmp);
        let n = values.len();
        // Rank ⌈p·n/100⌉, 1-based: integer arithmetic, so p99 of 100 values is the 99th.
        let at = |p: usize| values[((p * n).div_ceil(100)).clamp(1, n) - 1];
        Some(Self {
            p50: at(50),
            p90: at(90),
            p99: at(99),
            max: values[n - 1],
            mean: values.iter().sum::<f64>() / n as f64,
        })
    }
}

#[derive(Debug, Serialize)]
pub struct GpuEnergy {
    pub gpu: i64,
    pub name: Option<String>,
    #[serde(flatten)]
    pub energy: EnergyStat,
}

/// Energy of the measured steps that have a figure (`steps` of them).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct EnergyStat {
    pub steps: u64,
    pub energy_per_step_j: Option<f64>,
    pub energy_error_per_step_j: Option<f64>,
    /// Σ energy / Σ duration of those steps.
    pub avg_power_w: Option<f64>,
    pub below_resolution: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct KernelRow {
    pub function: i64,
    pub name: Option<String>,
    pub demangled_name: Option<String>,
    pub api: Option<String>,
    pub launches: i64,
    pub share: f64,
}

/// One row of `steps`, as the report (and its HTML page) needs it.
pub(super) struct StepRow {
    pub label: String,
    pub step: i64,
    pub start_ns: i64,
    pub end_ns: Option<i64>,
    pub duration_ns: Option<i64>,
    pub inter_step_ns: Option<i64>,
    pub launches: Option<i64>,
    pub sync_wait_ns: Option<i64>,
    pub data_wait_ns: Option<i64>,
    pub optimizer_ns: Option<i64>,
}

/// Sums for one energy series over the measured steps.
#[derive(Default)]
struct EnergySum {
    steps: u64,
    energy: f64,
    error: Option<f64>,
    duration_ns: i64,
    below: Option<u64>,
}

impl EnergySum {
    fn add(&mut self, energy: f64, error: Option<f64>, duration_ns: i64, below: Option<i64>) {
        self.steps += 1;
        self.energy += energy;
        if let Some(e) = error {
            *self.error.get_or_insert(0.0) += e;
        }
        self.duration_ns += duration_ns;
        if let Some(b) = below {
            *self.below.get_or_insert(0) += u64::from(b != 0);
        }
    }

    fn stat(&self) -> Option<EnergyStat> {
        (self.steps > 0).then(|| EnergyStat {
            steps: self.steps,
            energy_per_step_j: Some(self.energy / self.steps as f64),
            energy_error_per_step_j: self.error.map(|e| e / self.steps as f64),
            avg_power_w: (self.duration_ns > 0).then(|| self.energy / (self.duration_ns as f64 / 1e9)),
            below_resolution: self.below,
        })
    }
}

/// Measured steps of each label: (label, step) → duration.
type Measured = HashMap<(String, i64), i64>;

/// Computes the report for `session`.
pub fn build(db: &ProfileDb, session: i64, label: Option<&str>, skip: u64) -> anyhow::Result<Report> {
    let mut info = session_info(db, session)?;
    // duration_s is NULL exactly when ended_ns is (started_ns is NOT NULL).
    info.state = session_state(db, session, info.duration_s.is_some())?;
    let capabilities = db
        .conn
        .prepare(
            "SELECT source, metric, available, reason FROM capabilities WHERE session_id = ?1 ORDER BY source, metric",
        )?
        .query_map([session], |r| {
            Ok(CapabilityRow { source: r.get(0)?, metric: r.get(1)?, available: r.get(2)?, reason: r.get(3)? })
        })?
        .collect::<rusqlite::Result<_>>()?;

    let steps = load_steps(db, session)?;
    let mut by_label: BTreeMap<String, Vec<StepRow>> = BTreeMap::new();
    for s in steps {
        by_label.entry(s.label.clone()).or_default().push(s);
    }
    let all_labels: Vec<String> = by_label.keys().cloned().collect();
    if let Some(l) = label {
        if !by_label.contains_key(l) {
            let have = if all_labels.is_empty() { "none".to_string() } else { all_labels.join(", ") };
            bail!("session {session} has no steps labelled '{l}' (labels: {have})");
        }
        by_label.retain(|k, _| k == l);
    }

    // The measured steps of every label, for joining per-step energy rows.
    let mut measured: Measured = HashMap::new();
    let mut labels = Vec::new();
    for (name, rows) in &by_label {
        let used: Vec<&StepRow> = rows.iter().skip(skip as usize).filter(|s| s.end_ns.is_some()).collect();
        for s in &used {
            measured.insert((name.clone(), s.step), s.duration_ns.unwrap_or(0));
        }
        labels.push(label_figures(name, rows, &used, skip));
    }

    let gpu_sums = gpu_energy(db, session, &measured)?;
    let (cpu_sums, dram_sums) = cpu_dram_energy(db, session, &measured)?;
    let gpu_names = gpu_names(db, session)?;
    for l in &mut labels {
        if let Some(per_gpu) = &gpu_sums {
            l.gpus = Some(label_gpus(&l.label, per_gpu, &gpu_names));
        }
        l.cpu = cpu_sums.as_ref().and_then(|m| m.get(&l.label)).and_then(EnergySum::stat);
        l.dram = dram_sums.as_ref().and_then(|m| m.get(&l.label)).and_then(EnergySum::stat);
        l.add_up_energy();
    }
    flops_figures(db, session, &measured, &mut labels)?;

    let top_kernels = top_kernels(db, session, &info.launch_mode)?;
    let top_regions = top_regions(db, session)?;
    Ok(Report {
        report_version: REPORT_VERSION,
        database: db.path.display().to_string(),
        skip,
        label_filter: label.map(str::to_owned),
        session: info,
        capabilities,
        labels,
        top_kernels,
        top_regions,
    })
}

/// The session's `record_function` names with the most time in them.
fn top_regions(db: &ProfileDb, session: i64) -> anyhow::Result<Vec<RegionStat>> {
    let mut q = db.conn.prepare(&format!(
        "SELECT name, count(end_ns), coalesce(sum(end_ns - start_ns), 0), coalesce(max(end_ns - start_ns), 0),
                count(*) - count(end_ns)
         FROM regions WHERE session_id = ?1 GROUP BY name ORDER BY 3 DESC, name LIMIT {TOP_REGIONS}"
    ))?;
    let rows = q
        .query_map([session], |r| {
            let (count, total): (i64, i64) = (r.get(1)?, r.get(2)?);
            Ok(RegionStat {
                name: r.get(0)?,
                count,
                total_ms: total as f64 / 1e6,
                mean_ms: if count > 0 { total as f64 / 1e6 / count as f64 } else { 0.0 },
                max_ms: r.get::<_, i64>(3)? as f64 / 1e6,
                open: r.get(4)?,
            })
        })?
        .collect::<rusqlite::Result<_>>()?;
    Ok(rows)
}

/// One label's energy on every GPU the session saw (named or with figures);
/// a GPU without figures for the label has an empty [`EnergyStat`].
fn label_gpus(
    label: &str,
    per_gpu: &BTreeMap<(String, i64), EnergySum>,
    gpu_names: &BTreeMap<i64, Option<String>>,
) -> Vec<GpuEnergy> {
    let mut gpus: BTreeSet<i64> = gpu_names.keys().copied().collect();
    gpus.extend(per_gpu.keys().map(|(_, g)| *g));
    gpus.into_iter()
        .map(|g| GpuEnergy {
            gpu: g,
            name: gpu_names.get(&g).cloned().flatten(),
            energy: per_gpu.get(&(label.to_owned(), g)).and_then(EnergySum::stat).unwrap_or_default(),
        })
        .collect()
}

impl LabelReport {
    /// The energy per step over the parts that have a figure, and which they are.
    fn add_up_energy(&mut self) {
        let mut total = None;
        let mut parts = Vec::new();
        for g in self.gpus.iter().flatten() {
            if let Some(e) = g.energy.energy_per_step_j {
                *total.get_or_insert(0.0) += e;
                parts.push(format!("GPU {}", g.gpu));
            }
        }
        for (part, stat) in [("CPU", &self.cpu), ("DRAM", &self.dram)] {
            if let Some(e) = stat.as_ref().and_then(|s| s.energy_per_step_j) {
                *total.get_or_insert(0.0) += e;
                parts.push(part.to_string());
            }
        }
        self.energy_per_step_j = total;
        self.energy_components = parts;
    }
}

fn session_info(db: &ProfileDb, session: i64) -> anyhow::Result<SessionInfo> {
    Ok(db.conn.query_row(
        "SELECT id, pid, command, exe, mode, launch_mode, step_source,
                strftime('%Y-%m-%d %H:%M:%S', (started_ns + unix_offset_ns) / 1e9, 'unixepoch'),
                (started_ns + unix_offset_ns) / 1e9, (ended_ns - started_ns) / 1e9, end_reason, lost_events,
                total_launches, stored_launches, unmatched_returns, hostname, kernel_release, profiler_version,
                job, rank, (SELECT count(*) FROM sessions j WHERE j.job IS s.job)
         FROM sessions s WHERE id = ?1",
        [session],
        |r| {
            Ok(SessionInfo {
                id: r.get(0)?,
                pid: r.get(1)?,
                command: r.get(2)?,
                exe: r.get(3)?,
                mode: r.get(4)?,
                launch_mode: r.get(5)?,
                step_symbol: r.get(6)?,
                started_utc: r.get(7)?,
                started_unix_s: r.get(8)?,
                duration_s: r.get(9)?,
                state: SessionState::Ended,
                end_reason: r.get(10)?,
                lost_events: r.get(11)?,
                total_launches: r.get(12)?,
                stored_launches: r.get(13)?,
                unmatched_returns: r.get(14)?,
                hostname: r.get(15)?,
                kernel_release: r.get(16)?,
                profiler_version: r.get(17)?,
                job: r.get(18)?,
                rank: r.get(19)?,
                job_processes: r.get(20)?,
            })
        },
    )?)
}

/// Every step of the session, each label's in start order (the order
/// `--skip` counts in).
pub(super) fn load_steps(db: &ProfileDb, session: i64) -> anyhow::Result<Vec<StepRow>> {
    let mut q = db.conn.prepare(
        "SELECT label, step, start_ns, end_ns, duration_ns, inter_step_ns, launches, sync_wait_ns, data_wait_ns,
                optimizer_ns
         FROM steps WHERE session_id = ?1 ORDER BY 1, start_ns, step",
    )?;
    let rows = q
        .query_map([session], |r| {
            Ok(StepRow {
                label: r.get(0)?,
                step: r.get(1)?,
                start_ns: r.get(2)?,
                end_ns: r.get(3)?,
                duration_ns: r.get(4)?,
                inter_step_ns: r.get(5)?,
                launches: r.get(6)?,
                sync_wait_ns: r.get(7)?,
                data_wait_ns: r.get(8)?,
                optimizer_ns: r.get(9)?,
            })
        })?
        .collect::<rusqlite::Result<_>>()?;
    Ok(rows)
}

fn label_figures(name: &str, rows: &[StepRow], used: &[&StepRow], skip: u64) -> LabelReport {
    let ms = |ns: i64| ns as f64 / 1e6;
    let span = used.iter().filter_map(|s| s.end_ns).max().zip(used.iter().map(|s| s.start_ns).min());
    let steps_per_s =
        span.and_then(|(end, start)| (end > start).then(|| used.len() as f64 / ((end - start) as f64 / 1e9)));
    let (mut sync_sum, mut sync_dur, mut sync_seen) = (0i64, 0i64, false);
    for s in used {
        if let Some(w) = s.sync_wait_ns {
            sync_sum += w;
            sync_dur += s.duration_ns.unwrap_or(0);
            sync_seen = true;
        }
    }
    LabelReport {
        label: name.to_owned(),
        steps: rows.len() as u64,
        completed: rows.iter().filter(|s| s.end_ns.is_some()).count() as u64,
        skipped: skip.min(rows.len() as u64),
        measured: used.len() as u64,
        steps_per_s,
        step_time_ms: Percentiles::of(used.iter().filter_map(|s| s.duration_ns.map(ms)).collect()),
        inter_step_ms: Percentiles::of(used.iter().filter_map(|s| s.inter_step_ns.map(ms)).collect()),
        launches_per_step: Percentiles::of(used.iter().filter_map(|s| s.launches.map(|n| n as f64)).collect()),
        sync_wait_share: (sync_seen && sync_dur > 0).then(|| sync_sum as f64 / sync_dur as f64),
        data_wait_ms: Percentiles::of(used.iter().filter_map(|s| s.data_wait_ns.map(ms)).collect()),
        optimizer_ms: Percentiles::of(used.iter().filter_map(|s| s.optimizer_ns.map(ms)).collect()),
        gpus: None,
        cpu: None,
        dram: None,
        energy_per_step_j: None,
        energy_components: Vec::new(),
        tflops_per_s: None,
        mfu_pct: None,
        mfu_gpm_pct: None,
    }
}

/// Per-step TFLOP/s, MFU and its GPM estimate of the measured steps, into
/// each label's figures.
fn flops_figures(db: &ProfileDb, session: i64, measured: &Measured, labels: &mut [LabelReport]) -> anyhow::Result<()> {
    let mut stmt = db.conn.prepare(
        "SELECT s.label, s.step, s.flops, avg(g.mfu_pct), avg(g.mfu_gpm_pct)
         FROM steps s LEFT JOIN step_gpu g ON g.session_id = s.session_id AND g.label = s.label AND g.step = s.step
         WHERE s.session_id = ?1 GROUP BY s.label, s.step",
    )?;
    let mut per_label: HashMap<String, [Vec<f64>; 3]> = HashMap::new();
    let mut rows = stmt.query([session])?;
    while let Some(r) = rows.next()? {
        let (label, step): (String, i64) = (r.get(0)?, r.get(1)?);
        let Some(&duration_ns) = measured.get(&(label.clone(), step)) else { continue };
        let figures = per_label.entry(label).or_default();
        let tflops = r.get::<_, Option<i64>>(2)?.filter(|_| duration_ns > 0);
        figures[0].extend(tflops.map(|f| f as f64 / (duration_ns as f64 / 1e9) / 1e12));
        figures[1].extend(r.get::<_, Option<f64>>(3)?);
        figures[2].extend(r.get::<_, Option<f64>>(4)?);
    }
    for l in labels {
        if let Some([tflops, mfu, gpm]) = per_label.remove(&l.label) {
            (l.tflops_per_s, l.mfu_pct, l.mfu_gpm_pct) =
                (Percentiles::of(tflops), Percentiles::of(mfu), Percentiles::of(gpm));
        }
    }
    Ok(())
}

/// GPU energy of the measured steps, per (label, gpu); None when the profile
/// has no per-step GPU figures for this session.
fn gpu_energy(
    db: &ProfileDb,
    session: i64,
    measured: &Measured,
) -> anyhow::Result<Option<BTreeMap<(String, i64), EnergySum>>> {
    let mut q = db.conn.prepare(
        "SELECT label, step, gpu, energy_j, energy_error_j, below_resolution FROM step_gpu WHERE session_id = ?1",
    )?;
    let mut rows = q.query([session])?;
    let mut out: BTreeMap<(String, i64), EnergySum> = BTreeMap::new();
    let mut any = false;
    while let Some(r) = rows.next()? {
        any = true;
        let l: String = r.get(0)?;
        let step: i64 = r.get(1)?;
        let gpu: i64 = r.get(2)?;
        let sum = out.entry((l.clone(), gpu)).or_default();
        let (Some(&dur), Some(energy)) = (measured.get(&(l, step)), r.get::<_, Option<f64>>(3)?) else { continue };
        sum.add(energy, r.get(4)?, dur, r.get(5)?);
    }
    Ok(any.then_some(out))
}

fn gpu_names(db: &ProfileDb, session: i64) -> anyhow::Result<BTreeMap<i64, Option<String>>> {
    let mut q = db.conn.prepare("SELECT gpu, name FROM gpus WHERE session_id = ?1")?;
    let names = q.query_map([session], |r| Ok((r.get(0)?, r.get(1)?)))?.collect::<rusqlite::Result<_>>()?;
    Ok(names)
}

type LabelSums = Option<BTreeMap<String, EnergySum>>;

/// CPU package and DRAM energy of the measured steps, per label; each None
/// when the profile has no such figures for this session.
fn cpu_dram_energy(db: &ProfileDb, session: i64, measured: &Measured) -> anyhow::Result<(LabelSums, LabelSums)> {
    let mut q = db.conn.prepare(
        "SELECT label, step, cpu_energy_j, cpu_energy_error_j, dram_energy_j, dram_energy_error_j, below_resolution
         FROM step_energy WHERE session_id = ?1",
    )?;
    let mut rows = q.query([session])?;
    let (mut cpu, mut dram): (BTreeMap<String, EnergySum>, BTreeMap<String, EnergySum>) = Default::default();
    let (mut cpu_any, mut dram_any) = (false, false);
    while let Some(r) = rows.next()? {
        let l: String = r.get(0)?;
        let step: i64 = r.get(1)?;
        let below: Option<i64> = r.get(6)?;
        let dur = measured.get(&(l.clone(), step)).copied();
        for (energy_col, map, any) in [(2, &mut cpu, &mut cpu_any), (4, &mut dram, &mut dram_any)] {
            let energy: Option<f64> = r.get(energy_col)?;
            // A series with no value in any row of the session (no RAPL, or
            // no DRAM domain) is absent, not a zero.
            *any |= energy.is_some();
            let sum = map.entry(l.clone()).or_default();
            if let (Some(d), Some(e)) = (dur, energy) {
                sum.add(e, r.get(energy_col + 1)?, d, below);
            }
        }
    }
    Ok((cpu_any.then_some(cpu), dram_any.then_some(dram)))
}

/// The most launched kernels of the whole session; None when launch rows were
/// not kept.
fn top_kernels(db: &ProfileDb, session: i64, launch_mode: &str) -> anyhow::Result<Option<Vec<KernelRow>>> {
    if launch_mode == "count" {
        return Ok(None);
    }
    let sql = if handles_renamed(db, session)? {
        // Each launch counts for the kernel its handle named at the time: one
        // rename lookup per launch, only in sessions that renamed a handle.
        let rrow = rename_at("l.function", "l.ts_ns");
        format!(
            "SELECT t.function, t.n, t.total, a.name, {RENAMED_NAMES} FROM (
                 SELECT function, rrow, count(*) AS n, sum(count(*)) OVER () AS total, min(api) AS api FROM (
                     SELECT l.function, l.api, {rrow} AS rrow FROM launches l WHERE l.session_id = ?1
                 ) GROUP BY function, rrow ORDER BY n DESC, function LIMIT {TOP_KERNELS}
             ) t LEFT JOIN apis a ON a.id = t.api
               LEFT JOIN kernels k ON k.session_id = ?1 AND k.function = t.function
               LEFT JOIN kernel_renames r ON r.rowid = t.rrow
             ORDER BY t.n DESC, t.function"
        )
    } else {
        let (names, kernels) = kernel_names_given(false, "t.function", "0");
        format!(
            "SELECT t.function, t.n, t.total, a.name, {names} FROM (
                 SELECT function, count(*) AS n, sum(count(*)) OVER () AS total, min(api) AS api
                 FROM launches WHERE session_id = ?1 GROUP BY function ORDER BY n DESC, function LIMIT {TOP_KERNELS}
             ) t LEFT JOIN apis a ON a.id = t.api {kernels} ORDER BY t.n DESC, t.function"
        )
    };
    let mut q = db.conn.prepare(&sql)?;
    let rows = q
        .query_map([session], |r| {
            let n: i64 = r.get(1)?;
            let total: i64 = r.get(2)?;
            Ok(KernelRow {
                function: r.get(0)?,
                name: r.get(4)?,
                demangled_name: r.get(5)?,
                api: r.get(3)?,
                launches: n,
                share: n as f64 / total.max(1) as f64,
            })
        })?
        .collect::<rusqlite::Result<_>>()?;
    Ok(Some(rows))
}

/// The names of the kernel handle in `function` (a column) at time `at` (a
/// column), for a query whose `?1` is `session`: the two columns `name, demangled_name`, and the joins that provide
/// them. Each joins at most one row.
pub(super) fn kernel_names(
    db: &ProfileDb,
    session: i64,
    function: &str,
    at: &str,
) -> rusqlite::Result<(&'static str, String)> {
    Ok(kernel_names_given(handles_renamed(db, session)?, function, at))
}

/// [`kernel_names`] for a session whose renames are already known.
fn kernel_names_given(renamed: bool, function: &str, at: &str) -> (&'static str, String) {
    let first = format!("LEFT JOIN kernels k ON k.session_id = ?1 AND k.function = {function}");
    // The rename lookup costs one query per row: only for sessions that need it.
    if !renamed {
        return ("k.name, k.demangled_name", first);
    }
    (RENAMED_NAMES, format!("{first} LEFT JOIN kernel_renames r ON r.rowid = {}", rename_at(function, at)))
}

/// The name columns where `r` is the handle's rename at the time (NULL: none) and `k` its first name.
const RENAMED_NAMES: &str =
    "coalesce(r.name, k.name), CASE WHEN r.rowid IS NULL THEN k.demangled_name ELSE r.demangled_name END";

/// The `kernel_renames` row naming handle `function` at time `at` (SQL
/// expressions; `?1` the session): its latest rename at or before `at`; NULL
/// while the handle still has its first name (see the store's migration 6, `kernel_renames`).
fn rename_at(function: &str, at: &str) -> String {
    format!(
        "(SELECT r2.rowid FROM kernel_renames r2 WHERE r2.session_id = ?1 AND r2.function = {function}
          AND r2.named_ns <= {at} ORDER BY r2.named_ns DESC LIMIT 1)"
    )
}

/// Whether a handle of the session was named again (see [`rename_at`]).
fn handles_renamed(db: &ProfileDb, session: i64) -> rusqlite::Result<bool> {
    db.conn.query_row("SELECT EXISTS (SELECT 1 FROM kernel_renames WHERE session_id = ?1)", [session], |r| r.get(0))
}

/// How a kernel is shown: its (demangled) name, else its handle and entry point.
pub(super) fn kernel_display(name: Option<&str>, demangled: Option<&str>, api: Option<&str>, function: i64) -> String {
    match (demangled, name) {
        (Some(d), _) => d.to_owned(),
        (None, Some(n)) => n.to_owned(),
        (None, None) => match api {
            Some(a) => format!("{a} {function:#x}"),
            None => format!("{function:#x}"),
        },
    }
}

/// `s` cut to `width` terminal columns (a wide glyph counts two), with an
/// ellipsis if cut.
fn fit(s: &str, width: usize) -> String {
    if s.width() <= width {
        return s.to_owned();
    }
    let mut out = String::new();
    let mut used = 0;
    for c in s.chars() {
        let w = c.width().unwrap_or(0);
        // Room for the ellipsis, one column.
        if used + w + 1 > width {
            break;
        }
        used += w;
        out.push(c);
    }
    out.push('…');
    out
}

const ABSENT: &str = "–";

fn num(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| ABSENT.to_string(), |v| format!("{v:.decimals$}"))
}

fn int(v: Option<i64>) -> String {
    v.map_or_else(|| ABSENT.to_string(), |v| v.to_string())
}

/// One column of a [`block`]: its width in terminal columns (None: as wide as
/// its widest cell), alignment, and blank columns before it.
#[derive(Clone, Copy)]
struct Col(Option<u16>, CellAlignment, u16);

const LEFT: CellAlignment = CellAlignment::Left;
const RIGHT: CellAlignment = CellAlignment::Right;

/// `rows` as a borderless block of `cols`, indented two columns, appended to
/// `o`. comfy-table pads by terminal width (wide glyphs line up), wraps a cell
/// wider than its column at spaces, and shows at most `max_lines` lines of a
/// row, the last cut with an ellipsis.
fn block(o: &mut String, cols: &[Col], rows: Vec<Vec<String>>, max_lines: usize) {
    let mut t = Table::new();
    t.load_style(comfy_table::presets::NOTHING).set_truncation_indicator("…");
    for cells in rows {
        let mut row = Row::from(cells);
        row.max_height(max_lines);
        t.add_row(row);
    }
    for (column, &Col(width, align, gap)) in t.column_iter_mut().zip(cols) {
        column.set_padding((gap, 0)).set_cell_alignment(align);
        if let Some(w) = width {
            column.set_constraint(ColumnConstraint::Absolute(Width::Fixed(w + gap)));
        }
    }
    for line in t.lines() {
        let _ = writeln!(o, "  {}", line.trim_end());
    }
}

/// The table: readable in 80 columns.
pub fn render_table(r: &Report) -> String {
    let mut o = String::new();
    render_session(&mut o, r);
    render_capabilities(&mut o, &r.capabilities);
    if r.labels.is_empty() {
        let _ = writeln!(o, "\nno steps recorded (was --step-symbol given?)");
    }
    for l in &r.labels {
        o.push('\n');
        render_label(&mut o, l);
    }
    o.push('\n');
    render_kernels(&mut o, r.top_kernels.as_deref());
    render_regions(&mut o, &r.top_regions);
    o
}

fn render_regions(o: &mut String, regions: &[RegionStat]) {
    if regions.is_empty() {
        return;
    }
    let _ = writeln!(o, "\ntop PyTorch regions by total time (whole session; open: end not seen)");
    let mut rows = vec![["total ms", "count", "mean ms", "open", "region"].map(str::to_owned).to_vec()];
    for r in regions {
        // Indent 2, figures 10 + 9 + 10 + 7, gap 2.
        let name = fit(&r.name, WIDTH - 40);
        rows.push(vec![
            format!("{:.3}", r.total_ms),
            r.count.to_string(),
            format!("{:.3}", r.mean_ms),
            r.open.to_string(),
            name,
        ]);
    }
    let cols = [
        Col(Some(10), RIGHT, 0),
        Col(Some(7), RIGHT, 2),
        Col(Some(8), RIGHT, 2),
        Col(Some(5), RIGHT, 2),
        Col(None, LEFT, 2),
    ];
    block(o, &cols, rows, 1);
}

/// The key column of the session lines ("target", "traced", …).
const KEY: Col = Col(Some(10), LEFT, 0);
/// Width left for a value after the key column and the indent.
const VALUE_WIDTH: usize = WIDTH - 12;

fn render_session(o: &mut String, r: &Report) {
    let s = &r.session;
    let _ = writeln!(o, "{}", fit(&format!("session {} of {}", s.id, r.database), WIDTH));
    let started = s.started_utc.as_deref().map_or(String::new(), |t| format!("from {t} UTC, "));
    let traced = match (s.state, s.duration_s) {
        (SessionState::Ended, Some(d)) => {
            format!("{}, {started}{d:.3} s, ended: {}", s.mode, s.end_reason.as_deref().unwrap_or(ABSENT))
        }
        (SessionState::Running, _) => format!("{}, {started}still running", s.mode),
        _ => format!("{}, {started}not ended", s.mode),
    };
    let mut rows = vec![("target", format!("pid {}  {}", s.pid, s.command)), ("traced", traced)];
    if let Some(job) = s.job.as_deref().filter(|_| s.job_processes > 1) {
        let rank = s.rank.map_or(String::new(), |r| format!(", this one rank {r}"));
        let line = format!("{job} ({} processes{rank}; see --job)", s.job_processes);
        rows.push(("job", line));
    }
    if s.state == SessionState::Unclean {
        rows.push(("end", "did not end cleanly (the profiler was killed?)".into()));
        rows.push(("", "committed rows are all here; the end and totals are not".into()));
    }
    if let Some(sym) = &s.step_symbol {
        rows.push(("steps by", sym.clone()));
    }
    let launches = format!(
        "{} seen, {} stored ({}), {} lost events",
        int(s.total_launches),
        int(s.stored_launches),
        s.launch_mode,
        int(s.lost_events)
    );
    rows.push(("launches", launches));
    let rows = rows.into_iter().map(|(k, v)| vec![k.to_owned(), fit(&v, VALUE_WIDTH)]).collect();
    block(o, &[KEY, Col(None, LEFT, 0)], rows, 1);
}

fn render_capabilities(o: &mut String, caps: &[CapabilityRow]) {
    if caps.is_empty() {
        block(o, &[KEY, Col(None, LEFT, 0)], vec![vec!["sources".into(), format!("{ABSENT} (none recorded)")]], 1);
        return;
    }
    let mut per_source: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    // Metrics missing for one reason share a line (a machine without RAPL
    // loses all of its metrics for the same reason).
    let mut missing: BTreeMap<(&str, &str), Vec<&str>> = BTreeMap::new();
    for c in caps {
        let e = per_source.entry(&c.source).or_default();
        e.1 += 1;
        e.0 += usize::from(c.available);
        if !c.available {
            let why = c.reason.as_deref().unwrap_or("no reason recorded");
            missing.entry((&c.source, why)).or_default().push(&c.metric);
        }
    }
    let sources = per_source.iter().enumerate().map(|(i, (source, (ok, n)))| {
        vec![if i == 0 { "sources" } else { "" }.to_owned(), format!("{source}: {ok} of {n} metrics available")]
    });
    block(o, &[KEY, Col(None, LEFT, 0)], sources.collect(), 1);
    let reasons = missing.iter().take(CAPABILITY_LINES).map(|((source, why), metrics)| {
        let what = if metrics.len() > 3 { format!("{} metrics", metrics.len()) } else { metrics.join(", ") };
        vec![String::new(), "✗".to_owned(), format!("{source} {what}: {why}")]
    });
    // The reason is what the user acts on: up to two lines of it.
    block(o, &[KEY, Col(Some(2), LEFT, 0), Col(Some(VALUE_WIDTH as u16 - 4), LEFT, 0)], reasons.collect(), 2);
    if missing.len() > CAPABILITY_LINES {
        let _ = writeln!(o, "            … {} more (see the capabilities table)", missing.len() - CAPABILITY_LINES);
    }
}

fn render_label(o: &mut String, l: &LabelReport) {
    let rate = l.steps_per_s.map_or(String::new(), |v| format!(", {v:.1} steps/s"));
    let head = format!(
        "{}: {} steps, {} completed, {} skipped, {} measured{rate}",
        l.label, l.steps, l.completed, l.skipped, l.measured
    );
    let _ = writeln!(o, "{}", fit(&head, WIDTH));
    let mut rows = vec![["", "p50", "p90", "p99", "max", "mean"].map(str::to_owned).to_vec()];
    for (name, p, decimals) in [
        ("step time (ms)", &l.step_time_ms, 3),
        ("inter-step (ms)", &l.inter_step_ms, 3),
        ("launches/step", &l.launches_per_step, 0),
        ("data wait (ms)", &l.data_wait_ms, 3),
        ("optimizer (ms)", &l.optimizer_ms, 3),
        ("GEMM TFLOP/s", &l.tflops_per_s, 1),
        ("MFU (%)", &l.mfu_pct, 1),
        ("MFU est. GPM (%)", &l.mfu_gpm_pct, 1),
    ] {
        if p.is_none() && !matches!(name, "step time (ms)" | "inter-step (ms)" | "launches/step") {
            continue; // PyTorch's phases, FLOPs and MFU: only some steps have them
        }
        let cell = |f: fn(&Percentiles) -> f64, decimals| num(p.as_ref().map(f), decimals);
        rows.push(vec![
            name.to_owned(),
            cell(|p| p.p50, decimals),
            cell(|p| p.p90, decimals),
            cell(|p| p.p99, decimals),
            cell(|p| p.max, decimals),
            cell(|p| p.mean, decimals.max(1)),
        ]);
    }
    let figure = Col(Some(12), RIGHT, 0);
    block(o, &[Col(Some(18), LEFT, 0), figure, figure, figure, figure, figure], rows, 1);
    let sync = l
        .sync_wait_share
        .map_or_else(|| format!("{ABSENT:>12}  (not recorded)"), |v| format!("{:>11.1}%  of step time", 100.0 * v));
    let _ = writeln!(o, "  {:<18}{sync}", "sync wait");
    render_energy(o, l);
}

fn render_energy(o: &mut String, l: &LabelReport) {
    let row = |name: &str, e: Option<&EnergyStat>| {
        vec![
            fit(name, 31),
            num(e.and_then(|e| e.energy_per_step_j), 3),
            num(e.and_then(|e| e.energy_error_per_step_j), 3),
            num(e.and_then(|e| e.avg_power_w), 1),
            e.map_or_else(|| ABSENT.to_string(), |e| e.steps.to_string()),
        ]
    };
    let mut rows = vec![["energy per step", "J/step", "± J/step", "avg W", "steps"].map(str::to_owned).to_vec()];
    match &l.gpus {
        Some(gpus) if !gpus.is_empty() => rows.extend(gpus.iter().map(|g| {
            let name = g.name.as_ref().map_or_else(|| format!("GPU {}", g.gpu), |n| format!("GPU {} {n}", g.gpu));
            row(&name, Some(&g.energy))
        })),
        _ => rows.push(row("GPU", None)),
    }
    rows.push(row("CPU package", l.cpu.as_ref()));
    rows.push(row("DRAM", l.dram.as_ref()));
    let (j, w) = (Col(Some(12), RIGHT, 0), Col(Some(10), RIGHT, 0));
    block(o, &[Col(Some(32), LEFT, 0), j, j, w, Col(Some(6), RIGHT, 0)], rows, 1);
    let parts =
        if l.energy_components.is_empty() { String::new() } else { format!("  ({})", l.energy_components.join(" + ")) };
    let _ = writeln!(o, "{}", fit(&format!("  {:<32}{:>12}{parts}", "total", num(l.energy_per_step_j, 3)), WIDTH));
    let below = l
        .gpus
        .iter()
        .flatten()
        .map(|g| &g.energy)
        .chain(l.cpu.as_ref())
        .chain(l.dram.as_ref())
        .filter_map(|e| e.below_resolution)
        .max()
        .unwrap_or(0);
    if below > 0 {
        let _ = writeln!(
            o,
            "  {below} of {} steps are shorter than an energy counter's update period:\n  \
             their energy is an interpolated share (see ± J/step)",
            l.measured
        );
    }
}

fn render_kernels(o: &mut String, kernels: Option<&[KernelRow]>) {
    let Some(kernels) = kernels else {
        let _ = writeln!(o, "top kernels: {ABSENT} (launch rows not kept: --launches count)");
        return;
    };
    if kernels.is_empty() {
        let _ = writeln!(o, "top kernels: no launches recorded");
        return;
    }
    let _ = writeln!(o, "top kernels (whole session)");
    let mut rows = vec![["launches", "share", "kernel"].map(str::to_owned).to_vec()];
    for k in kernels {
        let name = kernel_display(k.name.as_deref(), k.demangled_name.as_deref(), k.api.as_deref(), k.function);
        rows.push(vec![k.launches.to_string(), format!("{:.1}%", 100.0 * k.share), fit(&name, WIDTH - 22)]);
    }
    block(o, &[Col(Some(10), RIGHT, 0), Col(Some(6), RIGHT, 2), Col(None, LEFT, 2)], rows, 1);
}

/// `--format csv`: one figure per row, `section,label,metric,value,unit`;
/// an absent figure has an empty value.
fn write_csv(r: &Report, out: &mut impl Write) -> anyhow::Result<()> {
    let mut w = csv::Writer::from_writer(out);
    w.write_record(["section", "label", "metric", "value", "unit"])?;
    let mut row = |section: &str, label: &str, metric: &str, value: Option<String>, unit: &str| {
        w.write_record([section, label, metric, value.as_deref().unwrap_or(""), unit])
    };
    let f = |v: Option<f64>| v.map(|v| v.to_string());
    let i = |v: Option<i64>| v.map(|v| v.to_string());
    let s = &r.session;
    row("session", "", "id", Some(s.id.to_string()), "")?;
    row("session", "", "pid", Some(s.pid.to_string()), "")?;
    row("session", "", "command", Some(s.command.clone()), "")?;
    row("session", "", "mode", Some(s.mode.clone()), "")?;
    row("session", "", "launch_mode", Some(s.launch_mode.clone()), "")?;
    row("session", "", "started_utc", s.started_utc.clone(), "")?;
    row("session", "", "duration", f(s.duration_s), "s")?;
    row("session", "", "state", Some(s.state.as_str().to_owned()), "")?;
    row("session", "", "end_reason", s.end_reason.clone(), "")?;
    row("session", "", "lost_events", i(s.lost_events), "")?;
    row("session", "", "total_launches", i(s.total_launches), "")?;
    row("session", "", "stored_launches", i(s.stored_launches), "")?;
    for c in &r.capabilities {
        row("capability", &c.source, &c.metric, Some(u8::from(c.available).to_string()), "")?;
    }
    for l in &r.labels {
        let n = |v: u64| Some(v.to_string());
        row("steps", &l.label, "steps", n(l.steps), "")?;
        row("steps", &l.label, "completed", n(l.completed), "")?;
        row("steps", &l.label, "skipped", n(l.skipped), "")?;
        row("steps", &l.label, "measured", n(l.measured), "")?;
        row("steps", &l.label, "steps_per_s", f(l.steps_per_s), "1/s")?;
        for (name, p, unit) in [
            ("step_time", &l.step_time_ms, "ms"),
            ("inter_step", &l.inter_step_ms, "ms"),
            ("launches_per_step", &l.launches_per_step, ""),
            ("data_wait", &l.data_wait_ms, "ms"),
            ("optimizer", &l.optimizer_ms, "ms"),
        ] {
            for (stat, get) in [
                ("p50", (|p: &Percentiles| p.p50) as fn(&Percentiles) -> f64),
                ("p90", |p| p.p90),
                ("p99", |p| p.p99),
                ("max", |p| p.max),
                ("mean", |p| p.mean),
            ] {
                row("steps", &l.label, &format!("{name}_{stat}"), f(p.as_ref().map(get)), unit)?;
            }
        }
        row("steps", &l.label, "sync_wait_share", f(l.sync_wait_share), "")?;
        let mut energy = |prefix: &str, e: Option<&EnergyStat>| -> csv::Result<()> {
            row("energy", &l.label, &format!("{prefix}_energy_per_step"), f(e.and_then(|e| e.energy_per_step_j)), "J")?;
            row(
                "energy",
                &l.label,
                &format!("{prefix}_energy_error_per_step"),
                f(e.and_then(|e| e.energy_error_per_step_j)),
                "J",
            )?;
            row("energy", &l.label, &format!("{prefix}_avg_power"), f(e.and_then(|e| e.avg_power_w)), "W")
        };
        for g in l.gpus.iter().flatten() {
            energy(&format!("gpu{}", g.gpu), Some(&g.energy))?;
        }
        energy("cpu", l.cpu.as_ref())?;
        energy("dram", l.dram.as_ref())?;
        row("energy", &l.label, "total_energy_per_step", f(l.energy_per_step_j), "J")?;
    }
    for k in r.top_kernels.iter().flatten() {
        let name = kernel_display(k.name.as_deref(), k.demangled_name.as_deref(), k.api.as_deref(), k.function);
        row("kernel", "", &name, Some(k.launches.to_string()), "launches")?;
    }
    for g in &r.top_regions {
        row("region", "", &g.name, Some(g.total_ms.to_string()), "ms")?;
    }
    w.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report with every section filled: an unclean session, capabilities
    /// with long reasons, two labels, named GPUs, wide glyphs in names.
    fn sample_report() -> Report {
        let stat = |j: f64| EnergyStat {
            steps: 47,
            energy_per_step_j: Some(j),
            energy_error_per_step_j: Some(j / 100.0),
            avg_power_w: Some(j * 10.0),
            below_resolution: Some(3),
        };
        let p = |v: f64| Percentiles { p50: v, p90: v * 1.5, p99: v * 2.0, max: v * 3.0, mean: v * 1.1 };
        let label = |name: &str, gpus: Option<Vec<GpuEnergy>>| LabelReport {
            label: name.into(),
            steps: 50,
            completed: 50,
            skipped: 3,
            measured: 47,
            steps_per_s: Some(9.87),
            step_time_ms: Some(p(101.2345)),
            inter_step_ms: None,
            launches_per_step: Some(p(20.0)),
            sync_wait_share: Some(0.25),
            data_wait_ms: None,
            optimizer_ms: None,
            gpus,
            cpu: Some(stat(8.0)),
            dram: None,
            energy_per_step_j: Some(69.6),
            energy_components: vec!["GPU 0".into(), "GPU 1".into(), "CPU".into()],
            tflops_per_s: Some(p(1234.5)),
            mfu_pct: Some(p(45.6)),
            mfu_gpm_pct: Some(p(38.9)),
        };
        let gpu = |gpu: i64, name: &str| GpuEnergy { gpu, name: Some(name.into()), energy: stat(61.5) };
        let cap = |source: &str, metric: &str, reason: Option<&str>| CapabilityRow {
            source: source.into(),
            metric: metric.into(),
            available: reason.is_none(),
            reason: reason.map(str::to_owned),
        };
        let kernel = |name: Option<&str>, launches: i64| KernelRow {
            function: 0x100000 + launches,
            name: name.map(str::to_owned),
            demangled_name: None,
            api: Some("cuLaunchKernel".into()),
            launches,
            share: launches as f64 / 1000.0,
        };
        Report {
            report_version: REPORT_VERSION,
            database: "/tmp/a/rather/long/path/to/the/profile/written/by/the/profiler/run/profile.db".into(),
            skip: 3,
            label_filter: None,
            session: SessionInfo {
                id: 2,
                pid: 4242,
                command: "python train.py --epochs 10 --batch-size 256 --learning-rate 0.001 --data /data/imagenet"
                    .into(),
                exe: None,
                mode: "attach".into(),
                launch_mode: "all".into(),
                step_symbol: Some("python:train.py:train_step".into()),
                started_utc: Some("2025-06-01 12:00:03".into()),
                started_unix_s: 0.0,
                duration_s: None,
                state: SessionState::Unclean,
                end_reason: None,
                lost_events: Some(0),
                total_launches: Some(1000),
                stored_launches: Some(1000),
                unmatched_returns: Some(0),
                hostname: None,
                kernel_release: None,
                profiler_version: "0.1.0".into(),
                job: Some("job-1".into()),
                rank: None,
                job_processes: 1,
            },
            capabilities: vec![
                cap("nvml", "GPU_0/power", None),
                cap("nvml", "GPU_0/fan.speed", Some("Not Supported: this GPU has no fan (passively cooled board)")),
                cap(
                    "rapl",
                    "package",
                    Some(
                        "no powercap tree at /sys/class/powercap and no perf power PMU: this machine (a VM?) does not expose RAPL to the guest",
                    ),
                ),
                cap(
                    "rapl",
                    "dram",
                    Some(
                        "no powercap tree at /sys/class/powercap and no perf power PMU: this machine (a VM?) does not expose RAPL to the guest",
                    ),
                ),
            ],
            labels: vec![
                label("train", Some(vec![gpu(0, "NVIDIA H200"), gpu(1, "显卡 H200 with a very long marketing name")])),
                label("validate", None),
            ],
            top_kernels: Some(vec![
                kernel(
                    Some(
                        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)",
                    ),
                    500,
                ),
                kernel(Some("核函数_核函数_核函数_核函数_核函数_核函数_核函数_核函数_核函数"), 300),
                kernel(None, 200),
            ]),
            top_regions: Vec::new(),
        }
    }

    /// The table fits 80 terminal columns, wide glyphs counted as two.
    #[test]
    fn table_fits_80_columns() {
        let table = render_table(&sample_report());
        println!("{table}");
        for line in table.lines() {
            assert!(line.width() <= WIDTH, "wider than {WIDTH}: {line:?}");
        }
    }

    #[test]
    fn nearest_rank_percentiles() {
        let p = Percentiles::of((1..=100).map(f64::from).rev().collect()).expect("values");
        assert_eq!((p.p50, p.p90, p.p99, p.max), (50.0, 90.0, 99.0, 100.0));
        assert_eq!(p.mean, 50.5);
        // Rank ⌈0.5·3⌉ = 2, ⌈0.9·3⌉ = 3.
        let p = Percentiles::of(vec![3.0, 1.0, 2.0]).expect("values");
        assert_eq!((p.p50, p.p90, p.p99), (2.0, 3.0, 3.0));
        let p = Percentiles::of(vec![7.0]).expect("one value");
        assert_eq!((p.p50, p.max), (7.0, 7.0));
        assert!(Percentiles::of(Vec::new()).is_none());
    }

    #[test]
    fn fit_cuts_with_an_ellipsis() {
        assert_eq!(fit("abcdef", 6), "abcdef");
        assert_eq!(fit("abcdefg", 6), "abcde…");
        assert_eq!(fit("µµµµ", 3), "µµ…");
    }

    #[test]
    fn fit_counts_terminal_columns() {
        assert_eq!(fit("显卡显卡", 8), "显卡显卡");
        assert_eq!(fit("显卡显卡", 7), "显卡显…");
        assert_eq!(fit("显卡显卡", 6), "显卡…");
    }

    /// A block wraps a cell at spaces within its column and keeps at most
    /// `max_lines` lines of a row, the last one cut with an ellipsis.
    #[test]
    fn blocks_wrap_and_cut_rows() {
        let mut o = String::new();
        let cols = [Col(Some(3), LEFT, 0), Col(Some(6), LEFT, 0)];
        block(&mut o, &cols, vec![vec!["k".into(), "a bb ccc dddd eeee".into()], vec![String::new(), "x".into()]], 2);
        assert_eq!(o, "  k  a bb\n     ccc…\n     x\n");
    }

    #[test]
    fn kernel_names_prefer_demangled() {
        assert_eq!(kernel_display(Some("_Z1fv"), Some("f()"), Some("cuLaunchKernel"), 1), "f()");
        assert_eq!(kernel_display(Some("_Z1fv"), None, None, 1), "_Z1fv");
        assert_eq!(kernel_display(None, None, Some("cuLaunchKernel"), 0x100000), "cuLaunchKernel 0x100000");
    }

    #[test]
    fn session_lists() {
        assert_eq!(id_list(&[1, 2, 3]), "1, 2, 3");
        assert_eq!(id_list(&(1..=40).collect::<Vec<_>>()), "1–40 (40 sessions)");
    }

    /// A profile written by the first schema (no labels, no GPU tables) reads
    /// with every later figure absent, and the file is left as it was.
    #[test]
    fn old_profile_reports_absent_figures() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("old.db");
        let conn = Connection::open(&path).expect("create");
        conn.execute_batch(crate::store::history::CORE_489E641).expect("schema");
        conn.execute_batch(
            "INSERT INTO apis VALUES (1, 'cuLaunchKernel', 'driver');
             INSERT INTO sessions VALUES (1, 9, 'x', NULL, 'run', 'all', 's', 0, 4000000000, 'target-exited',
                 0, 3, 3, 0, 0, NULL, NULL, '0.1.0');
             INSERT INTO steps VALUES (1, 0, 9, 0, 1000000000, 1000000000, NULL, 1),
                                      (1, 1, 9, 2000000000, 4000000000, 2000000000, 1000000000, 2),
                                      (1, 2, 9, 4000000000, NULL, NULL, NULL, NULL);
             INSERT INTO launches VALUES (1, 1, 9, 1, 16, 1, 1, 1, 1, 1, 1, 0, 0, 0),
                                         (1, 2, 9, 1, 16, 1, 1, 1, 1, 1, 1, 0, 0, 1),
                                         (1, 3, 9, 1, 17, 1, 1, 1, 1, 1, 1, 0, 0, 1);
             PRAGMA user_version = 1;",
        )
        .expect("rows");
        drop(conn);
        let bytes = std::fs::read(&path).expect("read");
        let db = ProfileDb::open(&path).expect("a profile");
        let r = build(&db, 1, None, 1).expect("report");
        assert_eq!(r.session.step_symbol.as_deref(), Some("s"));
        assert_eq!(r.labels.len(), 1);
        let l = &r.labels[0];
        assert_eq!((l.label.as_str(), l.steps, l.completed, l.skipped, l.measured), ("train", 3, 2, 1, 1));
        assert_eq!(l.step_time_ms.as_ref().map(|p| p.p50), Some(2000.0));
        assert_eq!(l.steps_per_s, Some(0.5));
        assert!(l.gpus.is_none() && l.cpu.is_none() && l.dram.is_none() && l.sync_wait_share.is_none());
        assert!(l.energy_per_step_j.is_none());
        let k = r.top_kernels.as_ref().expect("launch rows kept");
        assert_eq!((k[0].function, k[0].launches, k[0].api.as_deref()), (16, 2, Some("cuLaunchKernel")));
        let json = serde_json::to_value(&r).expect("serialises");
        assert!(json["labels"][0]["gpus"].is_null());
        assert!(render_table(&r).lines().all(|line| line.width() <= WIDTH));
        drop(db);
        assert_eq!(std::fs::read(&path).expect("read"), bytes, "reading wrote to the profile");
    }

    /// A profile with one session and no rows: (its directory, its path, the session).
    fn empty_session() -> (tempfile::TempDir, std::path::PathBuf, i64) {
        let (dir, path) = crate::store::testing::temp_db();
        let id = crate::store::Store::open(&path)
            .and_then(|s| s.begin_session(&crate::store::testing::start()))
            .expect("a session");
        (dir, path, id)
    }

    /// Without `--session`: of the newest job's processes, the one with the
    /// most steps (a launcher's rank, not its last helper), the first among
    /// equals; the text report names the job and its size.
    #[test]
    fn the_default_session_is_the_newest_jobs_busiest() {
        let (_dir, path) = crate::store::testing::temp_db();
        let store = crate::store::Store::open(&path).expect("store");
        let begin = |job: &str, rank: Option<i64>| {
            let start = crate::store::SessionStart { job: job.into(), rank, ..crate::store::testing::start() };
            store.begin_session(&start).expect("a session")
        };
        let old = begin("old", None);
        let (launcher, rank0, rank1, _helper) =
            (begin("new", None), begin("new", Some(0)), begin("new", Some(1)), begin("new", None));
        drop(store);
        let conn = Connection::open(&path).expect("open");
        let steps = |id: i64, n: i64| {
            for k in 0..n {
                conn.execute(
                    "INSERT INTO steps(session_id, label, step, tid, start_ns, end_ns) VALUES (?1, 'train', ?2, 1, ?2, ?2 + 1)",
                    [id, k],
                )
                .expect("step");
            }
        };
        let db = || ProfileDb::open(&path).expect("a profile");
        assert_eq!(db().session(None).expect("default"), launcher, "no steps: the job's first");
        steps(old, 9);
        steps(rank0, 3);
        steps(rank1, 5);
        assert_eq!(db().session(None).expect("default"), rank1);
        assert_eq!(db().session(Some(old)).expect("named"), old);
        let r = build(&db(), rank1, None, 0).expect("report");
        assert_eq!((r.session.job.as_deref(), r.session.rank, r.session.job_processes), (Some("new"), Some(1), 4));
        assert!(render_table(&r).contains("new (4 processes, this one rank 1; see --job)"), "{}", render_table(&r));
        // While its profiler writes the file, every unended process of the newest job is running; an older one is not.
        let mut live = db();
        live.written_by_a_live_profiler = true;
        let state = |id| build(&live, id, None, 0).expect("report").session.state;
        assert_eq!(
            (state(rank1), state(launcher), state(old)),
            (SessionState::Running, SessionState::Running, SessionState::Unclean)
        );
    }

    /// Steps from PyTorch's markers show their data wait and optimizer time,
    /// and the session's regions are ranked by their total time.
    #[test]
    fn pytorch_phases_and_top_regions() {
        let (_dir, path, id) = empty_session();
        let conn = Connection::open(&path).expect("open");
        conn.execute_batch(&format!(
            "INSERT INTO steps(session_id, label, step, tid, start_ns, end_ns, duration_ns, data_wait_ns, optimizer_ns)
                 VALUES ({id}, 'train', 0, 9, 0, 4000000, 4000000, 1000000, 2000000),
                        ({id}, 'train', 1, 9, 5000000, 9000000, 4000000, 3000000, 2000000);
             INSERT INTO regions(session_id, tid, name, truncated, start_ns, end_ns, label, step)
                 VALUES ({id}, 9, 'Optimizer.step#AdamW.step', 0, 1000000, 3000000, 'train', 0),
                        ({id}, 9, 'Optimizer.step#AdamW.step', 0, 6000000, 8000000, 'train', 1),
                        ({id}, 9, 'enumerate(DataLoader)#x.__next__', 0, 0, 1000000, NULL, NULL),
                        ({id}, 9, 'enumerate(DataLoader)#x.__next__', 0, 9500000, NULL, NULL, NULL);"
        ))
        .expect("rows");
        drop(conn);
        let db = ProfileDb::open(&path).expect("a profile");
        let r = build(&db, id, None, 0).expect("report");
        let l = &r.labels[0];
        assert_eq!(l.data_wait_ms.as_ref().map(|p| (p.p50, p.max)), Some((1.0, 3.0)));
        assert_eq!(l.optimizer_ms.as_ref().map(|p| p.mean), Some(2.0));
        let top: Vec<(&str, i64, f64, i64)> =
            r.top_regions.iter().map(|g| (g.name.as_str(), g.count, g.total_ms, g.open)).collect();
        assert_eq!(top, [("Optimizer.step#AdamW.step", 2, 4.0, 0), ("enumerate(DataLoader)#x.__next__", 1, 1.0, 1)]);
        let table = render_table(&r);
        assert!(table.contains("data wait (ms)") && table.contains("optimizer (ms)"), "{table}");
        assert!(table.contains("top PyTorch regions"), "{table}");
        assert!(table.lines().all(|line| line.width() <= WIDTH), "{table}");
    }

    #[test]
    fn tflops_and_mfu_per_step() {
        let (_dir, path, id) = empty_session();
        let conn = Connection::open(&path).expect("open");
        // Step 0: 2 TFLOP in 4 ms (500 TFLOP/s), MFU 40 % and 60 % on two GPUs; step 1: 3 TFLOP in 2 ms.
        conn.execute_batch(&format!(
            "INSERT INTO steps(session_id, label, step, tid, start_ns, end_ns, duration_ns, flops)
                 VALUES ({id}, 'train', 0, 9, 0, 4000000, 4000000, 2000000000000),
                        ({id}, 'train', 1, 9, 5000000, 7000000, 2000000, 3000000000000);
             INSERT INTO step_gpu(session_id, label, step, gpu, mfu_pct, mfu_gpm_pct)
                 VALUES ({id}, 'train', 0, 0, 40.0, 30.0), ({id}, 'train', 0, 1, 60.0, NULL),
                        ({id}, 'train', 1, 0, 70.0, 50.0), ({id}, 'train', 1, 1, 90.0, NULL);"
        ))
        .expect("rows");
        drop(conn);
        let db = ProfileDb::open(&path).expect("a profile");
        let r = build(&db, id, None, 0).expect("report");
        let l = &r.labels[0];
        let pm = |p: &Option<Percentiles>| p.as_ref().map(|p| (p.p50, p.max));
        assert_eq!(pm(&l.tflops_per_s), Some((500.0, 1500.0)));
        assert_eq!(pm(&l.mfu_pct), Some((50.0, 80.0)), "the mean over each step's GPUs");
        assert_eq!(pm(&l.mfu_gpm_pct), Some((30.0, 50.0)));
        let table = render_table(&r);
        assert!(
            table.contains("GEMM TFLOP/s") && table.contains("MFU (%)") && table.contains("MFU est. GPM"),
            "{table}"
        );
        // Without FLOPs or MFU figures the rows are left out.
        let r = build(&ProfileDb::open(&path).expect("again"), id, Some("train"), 2).expect("report");
        assert!(!render_table(&r).contains("TFLOP/s"));
    }

    /// The columns are read once at open; a view that no longer compiles
    /// (its table changed under it) leaves the rest readable.
    #[test]
    fn schema_is_read_at_open_despite_a_broken_view() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.db");
        drop(crate::store::Store::open(&path).expect("a profile"));
        Connection::open(&path)
            .expect("open")
            .execute_batch(
                "CREATE TABLE gone (x INTEGER);
                 CREATE VIEW broken AS SELECT x FROM gone;
                 DROP TABLE gone;",
            )
            .expect("schema");
        let db = ProfileDb::open(&path).expect("a profile");
        assert_eq!(&db.columns("steps")[..3], ["session_id", "label", "step"]);
        assert!(db.has_table("broken") && db.columns("broken").is_empty());
        assert!(db.columns("missing").is_empty() && !db.has_table("missing"));
    }

    #[test]
    fn not_a_profile_is_one_clear_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("missing.db");
        let e = ProfileDb::open(&missing).err().expect("missing file fails").to_string();
        assert!(e.contains("does not exist"), "{e}");
        let text = dir.path().join("text.db");
        std::fs::write(&text, "this is not a database, just some text that is long enough to have a header")
            .expect("write");
        let e = ProfileDb::open(&text).err().expect("text fails").to_string();
        assert!(e.contains("not a SQLite database"), "{e}");
        let other = dir.path().join("other.db");
        Connection::open(&other).expect("create").execute_batch("CREATE TABLE t (x)").expect("table");
        let e = ProfileDb::open(&other).err().expect("foreign fails").to_string();
        assert!(e.contains("not a profile"), "{e}");
    }

    /// A handle named twice (its address reused for another kernel): each
    /// launch counts for the kernel the handle named at its time, in the
    /// report's top kernels and in the export's per-launch names.
    #[test]
    fn a_reused_handle_names_each_launch_by_its_time() {
        use crate::store::{KernelRow, LaunchRow, StoreMsg};
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.db");
        let (store, id) = crate::samplers::testing::open_store(&path);
        let w = store.spawn_writer(id);
        let kernel = |named_ns, name: &str| KernelRow {
            function: 0x77,
            named_ns,
            name: name.into(),
            demangled_name: None,
            source: "cuModuleGetFunction",
        };
        w.send(StoreMsg::Kernels(vec![kernel(50, "first"), kernel(200, "second")]));
        let launch = |ts_ns| LaunchRow { ts_ns, tid: 1, function: 0x77, ..crate::store::testing::launch() };
        // One launch under the first name, two under the second; one before
        // any naming counts for the first.
        w.send(StoreMsg::Launches(vec![launch(10), launch(100), launch(250), launch(300)]));
        let end = crate::samplers::testing::end();
        w.finish(end, Vec::new()).expect("finish");
        let db = ProfileDb::open(&path).expect("a profile");
        let top = top_kernels(&db, id, "all").expect("query").expect("launch rows");
        let got: Vec<(Option<&str>, i64)> = top.iter().map(|k| (k.name.as_deref(), k.launches)).collect();
        assert_eq!(got, vec![(Some("first"), 2), (Some("second"), 2)]);
        let (names, join) = kernel_names(&db, id, "l.function", "l.ts_ns").expect("names");
        let per_launch: Vec<String> = db
            .conn
            .prepare(&format!("SELECT {names} FROM launches l {join} WHERE l.session_id = ?1 ORDER BY l.ts_ns"))
            .expect("prepare")
            .query_map([id], |r| r.get::<_, String>(0))
            .expect("query")
            .collect::<rusqlite::Result<_>>()
            .expect("rows");
        assert_eq!(per_launch, ["first", "first", "second", "second"]);
    }

    /// `--job` alone means the latest session's job; after the file, so
    /// that the file is not taken for a job's name.
    #[test]
    fn job_takes_an_optional_name() {
        #[derive(clap::Parser)]
        struct Cmd {
            #[command(flatten)]
            a: ReportArgs,
        }
        let parse = |args: &[&str]| <Cmd as clap::Parser>::try_parse_from(args).expect("parses").a;
        let a = parse(&["report", "p.db", "--job"]);
        assert_eq!((a.db, a.job.as_deref()), (PathBuf::from("p.db"), Some("")));
        assert_eq!(parse(&["report", "p.db", "--job", "j1", "--format", "json"]).job.as_deref(), Some("j1"));
        assert_eq!(parse(&["report", "p.db"]).job, None);
    }
}
