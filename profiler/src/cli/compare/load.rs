//! One side of a comparison read from its profile: which session or job it
//! is, its labels' measured steps, its kernels per step and the metadata that
//! explains a difference.
use std::path::PathBuf;

use anyhow::Context;
use serde::Serialize;

use crate::{
    compare::{SideSteps, StepValues},
    profile::{
        ProfileDb,
        jobs::{job_sessions, resolve_job},
        kernels::{kernel_display, kernel_names},
        sessions,
    },
};

/// `FILE`, `FILE:SESSION`, `FILE:job` (the file's newest job) or `FILE:job=NAME`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SideSpec {
    pub path: PathBuf,
    pub pick: Pick,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pick {
    /// The session `report` shows by default.
    Default,
    Session(i64),
    /// A job: per step, its slowest rank's step (None: the newest job).
    Job(Option<String>),
}

impl SideSpec {
    /// Parses a side; `jobs`: a plain FILE means its newest job (`--job`).
    pub fn parse(text: &str, jobs: bool) -> Self {
        let plain = || Self { path: text.into(), pick: if jobs { Pick::Job(None) } else { Pick::Default } };
        let Some((file, tail)) = text.rsplit_once(':') else { return plain() };
        let pick = if let Ok(id) = tail.parse() {
            Pick::Session(id)
        } else if tail == "job" {
            Pick::Job(None)
        } else if let Some(name) = tail.strip_prefix("job=") {
            Pick::Job(Some(name.to_owned()))
        } else {
            return plain();
        };
        Self { path: file.into(), pick }
    }
}

/// What the comparison says about a side.
#[derive(Clone, Debug, Serialize)]
pub struct SideInfo {
    pub database: String,
    /// The session compared, or for a job the session of its first rank.
    pub session: i64,
    pub job: Option<String>,
    pub command: String,
    /// Facts that can explain a difference, by name (GPU model, driver, …).
    pub metadata: Vec<(String, String)>,
}

/// A side opened: its profile, and the steps it compares.
pub struct Side {
    pub db: ProfileDb,
    pub info: SideInfo,
    /// WHERE clause on `steps s` that selects its steps, and its parameter.
    filter: Filter,
    /// `--launches` of its session: per-launch rows only under `all`.
    launch_mode: String,
}

enum Filter {
    Session(i64),
    Job(String),
}

impl Side {
    pub fn open(spec: &SideSpec) -> anyhow::Result<Self> {
        let db = ProfileDb::open(&spec.path)?;
        let (session, filter, job) = match &spec.pick {
            Pick::Default => {
                let s = db.session(None)?;
                (s, Filter::Session(s), None)
            }
            Pick::Session(n) => {
                let s = db.session(Some(*n))?;
                (s, Filter::Session(s), None)
            }
            Pick::Job(name) => {
                let job = resolve_job(&db, name.as_deref().unwrap_or(""))?;
                let first = job_sessions(&db, &job)?.first().map(|(id, _, _)| *id);
                let first = first.with_context(|| format!("{} has no session of job {job}", spec.path.display()))?;
                (first, Filter::Job(job.clone()), Some(job))
            }
        };
        let session_info = sessions::info(&db, session)?;
        let metadata = metadata(&db, &session_info).with_context(|| format!("reading {}", spec.path.display()))?;
        let database = spec.path.display().to_string();
        let info = SideInfo { database, session, job, command: session_info.command, metadata };
        Ok(Self { db, info, filter, launch_mode: session_info.launch_mode })
    }

    /// The labels this side has steps of.
    pub fn labels(&self) -> anyhow::Result<Vec<String>> {
        let (sql, param) = self.where_clause();
        let q = format!("SELECT DISTINCT s.label FROM steps s {sql} ORDER BY s.label");
        Ok(self.db.conn.prepare(&q)?.query_map([param], |r| r.get(0))?.collect::<rusqlite::Result<_>>()?)
    }

    fn where_clause(&self) -> (&'static str, rusqlite::types::Value) {
        match &self.filter {
            Filter::Session(id) => ("WHERE s.session_id = ?1", (*id).into()),
            Filter::Job(job) => (
                "JOIN job_steps j ON j.slowest_session = s.session_id AND j.label = s.label AND j.step = s.step \
                 WHERE j.job = ?1",
                job.clone().into(),
            ),
        }
    }

    /// The measured steps of `label`: completed ones after the first `skip` by start time.
    pub fn steps(&self, label: &str, skip: u64) -> anyhow::Result<SideSteps> {
        let columns = self.db.columns("steps").to_vec();
        let has = |c: &str| columns.iter().any(|x| x == c);
        let ns = |c: &str| if has(c) { format!("s.{c} / 1e6") } else { "NULL".into() };
        let bound = if has("bound") { "s.bound" } else { "NULL" };
        let (filter, param) = self.where_clause();
        let sql = format!(
            "SELECT s.duration_ns / 1e6, s.inter_step_ns / 1e6, s.data_wait_ns / 1e6, s.optimizer_ns / 1e6,
                    s.sync_wait_ns / 1e6, s.launches, s.flops, s.collective_bytes, s.collective_ns / 1e6,
                    (SELECT avg(g.mfu_pct) FROM step_gpu g WHERE g.session_id = s.session_id AND g.label = s.label AND g.step = s.step),
                    (SELECT sum(g.energy_j) FROM step_gpu g WHERE g.session_id = s.session_id AND g.label = s.label AND g.step = s.step),
                    e.cpu_energy_j, e.dram_energy_j, {}, {}, {}, {}, {bound}
             FROM steps s LEFT JOIN step_energy e USING (session_id, label, step)
             {filter} AND s.label = ?2
             ORDER BY s.start_ns LIMIT -1 OFFSET ?3",
            ns("cpu_ns"),
            ns("runnable_ns"),
            ns("sleep_ns"),
            ns("blocked_ns"),
        );
        let mut q = self.db.conn.prepare(&sql)?;
        let rows = q.query_map(rusqlite::params![param, label, skip as i64], |r| {
            let Some(duration_ms) = r.get::<_, Option<f64>>(0)? else { return Ok(None) };
            Ok(Some(StepValues {
                duration_ms,
                inter_step_ms: r.get(1)?,
                data_wait_ms: r.get(2)?,
                optimizer_ms: r.get(3)?,
                sync_wait_ms: r.get(4)?,
                launches: r.get(5)?,
                flops: r.get(6)?,
                collective_bytes: r.get(7)?,
                collective_ms: r.get(8)?,
                mfu_pct: r.get(9)?,
                gpu_energy_j: r.get(10)?,
                cpu_energy_j: r.get(11)?,
                dram_energy_j: r.get(12)?,
                energy_j: None,
                cpu_ms: r.get(13)?,
                runnable_ms: r.get(14)?,
                sleep_ms: r.get(15)?,
                blocked_ms: r.get(16)?,
                bound: r.get(17)?,
            }))
        })?;
        // Steps that never ended have no duration: not measured.
        let steps: Vec<StepValues> = rows.filter_map(Result::transpose).collect::<rusqlite::Result<_>>()?;
        let mut columns = columns;
        columns.extend(["step_gpu.mfu_pct", "step_gpu.energy_j"].map(String::from));
        columns.extend(["step_energy.cpu_energy_j", "step_energy.dram_energy_j"].map(String::from));
        let kernels = self.kernels(label, skip, steps.len())?;
        Ok(SideSteps { steps, columns, kernels })
    }

    /// Launches per measured step of each kernel; None without launch rows.
    fn kernels(&self, label: &str, skip: u64, measured: usize) -> anyhow::Result<Option<Vec<(String, f64)>>> {
        let Filter::Session(session) = self.filter else { return Ok(None) };
        if self.launch_mode != "all" || measured == 0 {
            return Ok(None);
        }
        // Each launch named as `report` names it: its handle's name at the launch's time.
        let (names, joins) = kernel_names(&self.db, session, "l.function", "l.ts_ns")?;
        let sql = format!(
            "SELECT {names}, l.function, count(*) FROM launches l {joins}
             WHERE l.session_id = ?1 AND l.label = ?2 AND l.step >= ?3
             GROUP BY 1, 2, l.function"
        );
        let mut per_name: std::collections::BTreeMap<String, f64> = std::collections::BTreeMap::new();
        let mut q = self.db.conn.prepare(&sql)?;
        let mut rows = q.query(rusqlite::params![session, label, skip as i64])?;
        while let Some(r) = rows.next()? {
            let (name, demangled): (Option<String>, Option<String>) = (r.get(0)?, r.get(1)?);
            let kernel = kernel_display(name.as_deref(), demangled.as_deref(), None, r.get(2)?);
            *per_name.entry(kernel).or_default() += r.get::<_, i64>(3)? as f64 / measured as f64;
        }
        Ok(Some(per_name.into_iter().collect()))
    }
}

/// Facts about a session's machine and software that can explain a difference.
fn metadata(db: &ProfileDb, s: &sessions::SessionInfo) -> anyhow::Result<Vec<(String, String)>> {
    let session = s.id;
    let world_size: Option<i64> =
        db.conn.query_row("SELECT world_size FROM sessions WHERE id = ?1", [session], |r| r.get(0))?;
    let facts = [
        ("hostname", s.hostname.clone()),
        ("kernel", s.kernel_release.clone()),
        ("profiler", Some(s.profiler_version.clone())),
        ("executable", s.exe.clone()),
        ("launches kept", Some(s.launch_mode.clone())),
        ("world size", world_size.map(|n| n.to_string())),
    ];
    let mut out: Vec<(String, String)> = facts.into_iter().filter_map(|(k, v)| Some((k.to_owned(), v?))).collect();
    let mut q = db.conn.prepare(
        "SELECT gpu, name, driver_version, power_limit_w, max_sm_clock_mhz, memory_total_mib
         FROM gpus WHERE session_id = ?1 ORDER BY gpu",
    )?;
    let gpus = q.query_map([session], |r| {
        let gpu: i64 = r.get(0)?;
        let num = |v: Option<f64>, unit: &str| v.map(|x| format!("{x:.0} {unit}"));
        Ok([
            (format!("GPU {gpu}"), r.get::<_, Option<String>>(1)?),
            (format!("GPU {gpu} driver"), r.get(2)?),
            (format!("GPU {gpu} power limit"), num(r.get(3)?, "W")),
            (format!("GPU {gpu} max SM clock"), num(r.get(4)?, "MHz")),
            (format!("GPU {gpu} memory"), num(r.get(5)?, "MiB")),
        ])
    })?;
    for g in gpus {
        out.extend(g?.into_iter().filter_map(|(k, v)| Some((k, v?))));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sides_name_a_file_a_session_or_a_job() {
        let p = |t: &str, jobs| SideSpec::parse(t, jobs);
        assert_eq!(p("a.db", false), SideSpec { path: "a.db".into(), pick: Pick::Default });
        assert_eq!(p("a.db", true).pick, Pick::Job(None));
        assert_eq!(p("a.db:3", false), SideSpec { path: "a.db".into(), pick: Pick::Session(3) });
        assert_eq!(p("runs/a.db:job", false).pick, Pick::Job(None));
        assert_eq!(p("a.db:job=run-42", false).pick, Pick::Job(Some("run-42".into())));
        // A colon that names neither is part of the file name.
        assert_eq!(p("C:x.db", false).path, PathBuf::from("C:x.db"));
    }
}
