//! What the HTML report reads beyond the text report's figures: per-step
//! energy, the samplers' time series, GEMM FLOPs, and a job's ranks. The
//! steps themselves, the session's header and its percentiles come from
//! the text report's `build` and the read model (`crate::profile`).
use std::collections::{BTreeMap, HashMap};

use crate::profile::{ProfileDb, series, sessions::CapabilityRow};

/// One source's energy per step: (label, step) → (J, ± J).
pub type PerStep = HashMap<(String, i64), (f64, Option<f64>)>;

/// Per-step energy by source.
#[derive(Default)]
pub struct StepEnergy {
    /// By GPU index.
    pub gpus: BTreeMap<i64, PerStep>,
    pub cpu: PerStep,
    pub dram: PerStep,
}

pub fn step_energy(db: &ProfileDb, session: i64) -> anyhow::Result<StepEnergy> {
    let mut e = StepEnergy::default();
    let mut q = db.conn.prepare(
        "SELECT label, step, gpu, energy_j, energy_error_j FROM step_gpu
         WHERE session_id = ?1 AND energy_j IS NOT NULL",
    )?;
    let mut rows = q.query([session])?;
    while let Some(r) = rows.next()? {
        e.gpus.entry(r.get(2)?).or_default().insert((r.get(0)?, r.get(1)?), (r.get(3)?, r.get(4)?));
    }
    let mut q = db.conn.prepare(
        "SELECT label, step, cpu_energy_j, cpu_energy_error_j, dram_energy_j, dram_energy_error_j
         FROM step_energy WHERE session_id = ?1",
    )?;
    let mut rows = q.query([session])?;
    while let Some(r) = rows.next()? {
        let key: (String, i64) = (r.get(0)?, r.get(1)?);
        if let Some(j) = r.get::<_, Option<f64>>(2)? {
            e.cpu.insert(key.clone(), (j, r.get(3)?));
        }
        if let Some(j) = r.get::<_, Option<f64>>(4)? {
            e.dram.insert(key, (j, r.get(5)?));
        }
    }
    Ok(e)
}

/// One GPU's samples over time: (seconds since the session start, value) per metric.
#[derive(Default)]
pub struct GpuSeries {
    pub utilization_pct: Vec<(f64, f64)>,
    pub memory_used_mib: Vec<(f64, f64)>,
    pub power_w: Vec<(f64, f64)>,
    pub temperature_c: Vec<(f64, f64)>,
}

/// Every GPU's samples, by GPU index; times in s from `started_ns`.
pub fn gpu_series(db: &ProfileDb, session: i64, started_ns: i64) -> anyhow::Result<BTreeMap<i64, GpuSeries>> {
    let mut q = db.conn.prepare(
        "SELECT gpu, ts_ns, utilization_gpu_pct, memory_used_mib, power_w, temperature_gpu_c
         FROM gpu_samples WHERE session_id = ?1 ORDER BY gpu, ts_ns",
    )?;
    let mut rows = q.query([session])?;
    let mut out: BTreeMap<i64, GpuSeries> = BTreeMap::new();
    while let Some(r) = rows.next()? {
        let g = out.entry(r.get(0)?).or_default();
        let t = (r.get::<_, i64>(1)? - started_ns) as f64 / 1e9;
        for (col, series) in
            [(2, &mut g.utilization_pct), (3, &mut g.memory_used_mib), (4, &mut g.power_w), (5, &mut g.temperature_c)]
        {
            if let Some(v) = r.get::<_, Option<f64>>(col)? {
                series.push((t, v));
            }
        }
    }
    Ok(out)
}

/// CPU package and DRAM power over time (W, from consecutive RAPL counter
/// readings), times in s from `started_ns`.
pub fn rapl_power(db: &ProfileDb, session: i64, started_ns: i64) -> anyhow::Result<[Vec<(f64, f64)>; 2]> {
    let mut out: [Vec<(f64, f64)>; 2] = Default::default();
    series::rapl_power(db, session, |p| {
        let series = match p.domain {
            "package" => &mut out[0],
            "dram" => &mut out[1],
            _ => return Ok(()),
        };
        series.push(((p.end_ns - started_ns) as f64 / 1e9, p.watts));
        Ok(())
    })?;
    Ok(out)
}

/// FLOPs per step, where the session probed a BLAS library.
pub fn step_flops(db: &ProfileDb, session: i64) -> anyhow::Result<HashMap<(String, i64), i64>> {
    let mut q = db.conn.prepare("SELECT label, step, flops FROM steps WHERE session_id = ?1 AND flops IS NOT NULL")?;
    let rows = q.query_map([session], |r| Ok(((r.get(0)?, r.get(1)?), r.get(2)?)))?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// A GEMM shape and what it added up to over the session.
pub struct GemmShape {
    pub shape: String,
    pub calls: i64,
    pub flops: f64,
}

/// The GEMM shapes with the most FLOPs (empty when none was recorded).
pub fn top_gemms(db: &ProfileDb, session: i64, limit: usize) -> anyhow::Result<Vec<GemmShape>> {
    let mut q = db.conn.prepare(
        "SELECT op, m, n, k, batch, coalesce(data_type, '?'), count(*), sum(flops) FROM gemms WHERE session_id = ?1
         GROUP BY op, m, n, k, batch, data_type ORDER BY 8 DESC, 7 DESC LIMIT ?2",
    )?;
    let rows = q.query_map(rusqlite::params![session, limit as i64], |r| {
        let (op, m, n, k, batch, dtype): (String, i64, i64, i64, i64, String) =
            (r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?);
        let batch = if batch > 1 { format!(" ×{batch}") } else { String::new() };
        Ok(GemmShape { shape: format!("{op} {m}×{n}×{k}{batch} {dtype}"), calls: r.get(6)?, flops: r.get(7)? })
    })?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// One process of a job.
pub struct JobMember {
    pub session: i64,
    pub rank: Option<i64>,
    pub pid: i64,
}

/// The sessions of job `job`, in the text report's order (by rank, those
/// without one last).
pub fn job_members(db: &ProfileDb, job: &str) -> anyhow::Result<Vec<JobMember>> {
    let sessions = crate::profile::jobs::job_sessions(db, job)?;
    Ok(sessions.into_iter().map(|(session, rank, pid)| JobMember { session, rank, pid }).collect())
}

/// The job of `session` and how many sessions share it.
pub fn job_of(db: &ProfileDb, session: i64) -> anyhow::Result<(Option<String>, i64)> {
    Ok(db.conn.query_row(
        "SELECT job, (SELECT count(*) FROM sessions t WHERE t.job = s.job) FROM sessions s WHERE id = ?1",
        [session],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?)
}

/// One step number of a job across its ranks (the `job_steps` view).
pub struct JobStep {
    pub step: i64,
    pub ranks: i64,
    pub slowest_rank: Option<i64>,
    pub slowest_session: i64,
    pub max_ms: f64,
    pub min_ms: f64,
}

/// The job's steps of `label`, in step order.
pub fn job_steps(db: &ProfileDb, job: &str, label: &str) -> anyhow::Result<Vec<JobStep>> {
    let mut q = db.conn.prepare(
        "SELECT step, ranks, slowest_rank, slowest_session, max_ns / 1e6, min_ns / 1e6 FROM job_steps
         WHERE job = ?1 AND label = ?2 ORDER BY step",
    )?;
    let rows = q.query_map([job, label], |r| {
        Ok(JobStep {
            step: r.get(0)?,
            ranks: r.get(1)?,
            slowest_rank: r.get(2)?,
            slowest_session: r.get(3)?,
            max_ms: r.get(4)?,
            min_ms: r.get(5)?,
        })
    })?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// Each session's step times of `label` in the job (`job_step_ranks`):
/// session → (step, ms), in step order.
pub fn job_rank_steps(db: &ProfileDb, job: &str, label: &str) -> anyhow::Result<BTreeMap<i64, Vec<(f64, f64)>>> {
    let mut q = db.conn.prepare(
        "SELECT session_id, step, duration_ns / 1e6 FROM job_step_ranks WHERE job = ?1 AND label = ?2
         ORDER BY session_id, step",
    )?;
    let mut rows = q.query([job, label])?;
    let mut out: BTreeMap<i64, Vec<(f64, f64)>> = BTreeMap::new();
    while let Some(r) = rows.next()? {
        out.entry(r.get(0)?).or_default().push((r.get::<_, i64>(1)? as f64, r.get(2)?));
    }
    Ok(out)
}

/// Whether session `id` has a step labelled `label`.
pub fn has_label(db: &ProfileDb, id: i64, label: &str) -> anyhow::Result<bool> {
    let mut q = db.conn.prepare_cached("SELECT EXISTS (SELECT 1 FROM steps WHERE session_id = ?1 AND label = ?2)")?;
    Ok(q.query_row(rusqlite::params![id, label], |r| r.get(0))?)
}

/// The labels the job's steps have.
pub fn job_labels(db: &ProfileDb, job: &str) -> anyhow::Result<Vec<String>> {
    let mut q = db.conn.prepare("SELECT DISTINCT label FROM job_steps WHERE job = ?1 ORDER BY label")?;
    let rows = q.query_map([job], |r| r.get(0))?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// Why `source`'s `metric` was not measured, from the `capabilities` table:
/// the metric's own reason, else the source's reason for all of its metrics
/// (`*`), else any reason the source gave.
pub fn why_missing(caps: &[CapabilityRow], source: &str, metric: &str) -> Option<String> {
    let unavailable = |m: &dyn Fn(&CapabilityRow) -> bool| {
        caps.iter().find(|c| c.source == source && !c.available && m(c)).map(|c| c.reason.clone())
    };
    unavailable(&|c| c.metric == metric)
        .or_else(|| unavailable(&|c| c.metric == "*"))
        .or_else(|| unavailable(&|_| true))
        .map(|r| r.unwrap_or_else(|| "no reason recorded".into()))
}
