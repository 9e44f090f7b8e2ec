//! The session's last transaction: the series the store holds handed to
//! `correlate`, its per-step figures written back, what was lost, and the
//! session's end.
use rusqlite::{Connection, Params, Statement, params};

use super::{
    StoreError, WriterStats, i,
    rows::{AtFinish, Losses, SessionEnd},
};
use crate::correlate::{
    CounterSeries,
    per_step::{self, GpuSeries, StepSpan, SystemSeries},
};

pub(super) fn finish_session(
    conn: &mut Connection,
    session_id: i64,
    end: &SessionEnd,
    work: &[AtFinish],
    stats: &mut WriterStats,
) -> Result<(), StoreError> {
    let mut tx = conn.transaction()?;
    derive_all(&mut tx, session_id, session_id, work, stats)?;
    tx.execute(
        "UPDATE sessions SET ended_ns = ?2, end_reason = ?3, lost_events = ?4, total_launches = ?5,
                             stored_launches = ?6, unmatched_returns = ?7 WHERE id = ?1",
        params![
            session_id,
            i(end.ended_ns),
            end.end_reason,
            i(end.lost_events),
            i(end.total_launches),
            i(stats.launches.saturating_sub(stats.member_launches)),
            i(end.unmatched_returns)
        ],
    )?;
    tx.commit()?;
    // Built once at the end: an index maintained during capture would slow every insert.
    conn.execute_batch(
        "CREATE INDEX IF NOT EXISTS launches_by_step ON launches(session_id, label, step);
         PRAGMA wal_checkpoint(TRUNCATE);",
    )?;
    Ok(())
}

/// Derives `work` for the session's steps, each item in a savepoint, from
/// the samples of session `samples_from` (itself, or a job's first session,
/// where a job's samples are).
pub(super) fn derive_all(
    tx: &mut rusqlite::Transaction<'_>,
    session_id: i64,
    samples_from: i64,
    work: &[AtFinish],
    stats: &mut WriterStats,
) -> Result<(), StoreError> {
    let ids = (session_id, samples_from);
    let (steps, work) = match step_spans(tx, session_id) {
        Ok(steps) => (steps, work),
        Err(e) => {
            stats.first_error.get_or_insert_with(|| format!("computing per-step figures: {e}"));
            (Vec::new(), &[][..])
        }
    };
    for w in work {
        saved(tx, stats, |sp| derive(sp, ids, &steps, w))?;
    }
    // Last: GPM and MFU read `step_gpu` rows and `steps.flops`, whichever work wrote them.
    if let Some(AtFinish::StepGpu { gpus, max_gap_ns, .. }) =
        work.iter().find(|w| matches!(w, AtFinish::StepGpu { .. }))
    {
        saved(tx, stats, |sp| super::step_flops::write(sp, ids, gpus, *max_gap_ns))?;
    }
    // One statement: it fails whole, losing those figures, not the session.
    if let Err(e) = super::collectives::write_step_collectives(tx, session_id) {
        stats.first_error.get_or_insert_with(|| format!("computing per-step collective figures: {e}"));
    }
    if let Err(e) = super::jax::write_step_dispatch(tx, session_id) {
        stats.first_error.get_or_insert_with(|| format!("computing JAX steps' dispatch times: {e}"));
    } else {
        saved(tx, stats, |sp| super::jax::write_step_launches(sp, session_id))?;
    }
    // Last of all: the verdict reads the collective figures.
    if let Err(e) = super::copies::write_step_bounds(tx, session_id) {
        stats.first_error.get_or_insert_with(|| format!("computing per-step verdicts: {e}"));
    }
    Ok(())
}

/// Runs `f` in a savepoint: a failed derivation loses its figures (rolled
/// back) and is recorded, not the session.
fn saved(
    tx: &mut rusqlite::Transaction<'_>,
    stats: &mut WriterStats,
    f: impl FnOnce(&Connection) -> rusqlite::Result<()>,
) -> Result<(), StoreError> {
    let sp = tx.savepoint()?;
    match f(&sp) {
        Ok(()) => sp.commit()?,
        Err(e) => {
            stats.first_error.get_or_insert_with(|| format!("computing per-step figures: {e}"));
        }
    }
    Ok(())
}

/// `ids`: (the session whose steps these are, the session whose samples to read).
fn derive(conn: &Connection, ids: (i64, i64), steps: &[StepSpan], work: &AtFinish) -> rusqlite::Result<()> {
    let session_id = ids.0;
    match work {
        AtFinish::StepGpu { gpus, max_gap_ns, energy_resolution_j } => {
            write_step_gpu(conn, ids, steps, gpus, *max_gap_ns, *energy_resolution_j)
        }
        AtFinish::StepEnergy { package_resolution_j, dram_resolution_j } => {
            write_step_energy(conn, ids, steps, *package_resolution_j, *dram_resolution_j)
        }
        AtFinish::StepSystem => write_step_system(conn, session_id, steps),
        AtFinish::Losses(losses) => write_losses(conn, session_id, losses),
        AtFinish::ContextSwitches(t) => conn
            .execute(
                "UPDATE sessions SET context_switches = ?2, preemptions = ?3, sched_mismatches = ?4 WHERE id = ?1",
                params![session_id, super::i(t.switches), super::i(t.preemptions), super::i(t.mismatches)],
            )
            .map(drop),
        // Read by `job::finish_processes`, which puts it in `StepGpu`.
        AtFinish::RankGpus(_) => Ok(()),
        AtFinish::CpuSampling(s) => super::cpu_samples::write_sampling(conn, session_id, s),
    }
}

/// Every step of the session, ended or not, ordered by (label, step).
fn step_spans(conn: &Connection, session_id: i64) -> rusqlite::Result<Vec<StepSpan>> {
    conn.prepare("SELECT label, step, start_ns, end_ns FROM steps WHERE session_id = ?1 ORDER BY label, step")?
        .query_map([session_id], |r| {
            Ok(StepSpan {
                label: r.get(0)?,
                step: r.get(1)?,
                start_ns: r.get::<_, i64>(2)? as u64,
                end_ns: r.get::<_, Option<i64>>(3)?.map(|e| e as u64),
            })
        })?
        .collect()
}

/// Every row's timestamp, and one series per value column, (ts_ns, value), its NULLs left out.
type SampleColumns = (Vec<u64>, Vec<Vec<(u64, f64)>>);

/// Runs `stmt` (first column ts_ns, then value columns) into [`SampleColumns`].
fn load_columns(stmt: &mut Statement<'_>, params: impl Params) -> rusqlite::Result<SampleColumns> {
    let n = stmt.column_count().saturating_sub(1);
    let (mut ts, mut columns) = (Vec::new(), vec![Vec::new(); n]);
    let mut rows = stmt.query(params)?;
    while let Some(r) = rows.next()? {
        let t = r.get::<_, i64>(0)? as u64;
        ts.push(t);
        for (k, series) in columns.iter_mut().enumerate() {
            if let Some(v) = r.get::<_, Option<f64>>(k + 1)? {
                series.push((t, v));
            }
        }
    }
    Ok((ts, columns))
}

/// `step_gpu` for each step and GPU, and each GPU's energy update period.
fn write_step_gpu(
    conn: &Connection,
    (session, samples_from): (i64, i64),
    steps: &[StepSpan],
    gpus: &[u32],
    max_gap_ns: u64,
    resolution_j: f64,
) -> rusqlite::Result<()> {
    let mut insert = conn.prepare(
        "INSERT INTO step_gpu(session_id, label, step, gpu, energy_j, energy_error_j, avg_power_w, below_resolution,
             utilization_gpu_start_pct, utilization_gpu_end_pct, memory_used_start_mib, memory_used_end_mib,
             memory_free_start_mib, memory_free_end_mib, utilization_memory_start_pct, utilization_memory_end_pct,
             fan_speed_end_pct, temperature_gpu_end_c, temperature_memory_end_c)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19)",
    )?;
    let mut samples = conn.prepare(
        "SELECT ts_ns, energy_j, utilization_gpu_pct, memory_used_mib, memory_free_mib, utilization_memory_pct,
                fan_speed_pct, temperature_gpu_c, temperature_memory_c
         FROM gpu_samples WHERE session_id = ?1 AND gpu = ?2 ORDER BY ts_ns",
    )?;
    for &gpu in gpus {
        let mut columns = load_columns(&mut samples, params![samples_from, gpu])?.1.into_iter();
        let mut next = || columns.next().unwrap_or_default();
        let series = GpuSeries {
            energy_j: next(),
            utilization_gpu_pct: next(),
            memory_used_mib: next(),
            memory_free_mib: next(),
            utilization_memory_pct: next(),
            fan_speed_pct: next(),
            temperature_gpu_c: next(),
            temperature_memory_c: next(),
        };
        let (rows, update_period_ns) = per_step::step_gpu(steps, series, max_gap_ns, resolution_j);
        for s in rows {
            let e = s.energy;
            insert.execute(params![
                session,
                s.label,
                s.step,
                gpu,
                e.map(|e| e.energy),
                e.map(|e| e.error),
                e.map(|e| e.avg_power),
                e.map(|e| e.below_resolution),
                s.utilization_gpu_pct[0],
                s.utilization_gpu_pct[1],
                s.memory_used_mib[0],
                s.memory_used_mib[1],
                s.memory_free_mib[0],
                s.memory_free_mib[1],
                s.utilization_memory_pct[0],
                s.utilization_memory_pct[1],
                s.fan_speed_end_pct,
                s.temperature_gpu_end_c,
                s.temperature_memory_end_c,
            ])?;
        }
        // The machine's GPU row, once: by the session that holds the samples.
        if let Some(period) = update_period_ns.filter(|_| session == samples_from) {
            conn.execute(
                "UPDATE gpus SET energy_update_period_ms = ?3 WHERE session_id = ?1 AND gpu = ?2",
                params![samples_from, gpu, period as f64 / 1e6],
            )?;
        }
    }
    Ok(())
}

/// `step_energy` for each step from the RAPL package and DRAM series.
fn write_step_energy(
    conn: &Connection,
    (session_id, samples_from): (i64, i64),
    steps: &[StepSpan],
    package_resolution_j: Option<f64>,
    dram_resolution_j: Option<f64>,
) -> rusqlite::Result<()> {
    // Built once at the end, as for launches: an index maintained during
    // capture would slow every insert.
    conn.execute_batch("CREATE INDEX IF NOT EXISTS rapl_samples_by_domain ON rapl_samples(session_id, domain, ts_ns)")?;
    let mut stmt =
        conn.prepare("SELECT ts_ns, energy_j FROM rapl_samples WHERE session_id = ?1 AND domain = ?2 ORDER BY ts_ns")?;
    let mut series = |domain: &str, resolution: Option<f64>| -> rusqlite::Result<Option<CounterSeries>> {
        let Some(resolution) = resolution else { return Ok(None) };
        let raw = load_columns(&mut stmt, params![samples_from, domain])?.1.pop().unwrap_or_default();
        Ok(Some(CounterSeries::from_samples(&raw, resolution)))
    };
    let package = series("package", package_resolution_j)?;
    let dram = series("dram", dram_resolution_j)?;
    let mut insert = conn.prepare(
        "INSERT INTO step_energy(session_id, label, step, cpu_energy_j, dram_energy_j, cpu_power_w, dram_power_w,
                                 cpu_energy_error_j, dram_energy_error_j, below_resolution, note)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
    )?;
    for s in per_step::step_energy(steps, package, dram) {
        let (c, d) = (s.cpu, s.dram);
        insert.execute(params![
            session_id,
            s.label,
            s.step,
            c.map(|e| e.energy),
            d.map(|e| e.energy),
            c.map(|e| e.avg_power),
            d.map(|e| e.avg_power),
            c.map(|e| e.error),
            d.map(|e| e.error),
            s.below_resolution,
            s.note
        ])?;
    }
    Ok(())
}

/// `step_system` for each step: the system values at its end.
fn write_step_system(conn: &Connection, session_id: i64, steps: &[StepSpan]) -> rusqlite::Result<()> {
    // The two rates first, then the levels (see `per_step::SystemSeries`).
    let mut stmt = conn.prepare(
        "SELECT ts_ns, cpu_usage_pct, process_cpu_pct, ram_used_gb, ram_usage_pct, process_rss_gb, disk_used_gb,
                disk_usage_pct
         FROM system_samples WHERE session_id = ?1 ORDER BY ts_ns",
    )?;
    let (ts, mut levels) = load_columns(&mut stmt, [session_id])?;
    let rates: Vec<_> = levels.drain(..2).collect();
    let mut insert = conn.prepare(
        "INSERT INTO step_system(session_id, label, step, ts_ns, cpu_usage_pct, process_cpu_pct,
                                 ram_used_gb, ram_usage_pct, process_rss_gb, disk_used_gb, disk_usage_pct)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
    )?;
    for s in per_step::step_system(steps, SystemSeries { ts, rates, levels }) {
        let (r, l) = (&s.rates, &s.levels);
        let ts_ns = s.ts_ns.map(i);
        insert.execute(params![session_id, s.label, s.step, ts_ns, r[0], r[1], l[0], l[1], l[2], l[3], l[4]])?;
    }
    Ok(())
}

/// What was lost (see migration 5): in the session's row, the step ring's
/// share of the lost records and the failed map updates; in `steps`, which
/// steps are incomplete (every other step of the session 0).
fn write_losses(conn: &Connection, session: i64, losses: &Losses) -> rusqlite::Result<()> {
    let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    conn.execute(
        "UPDATE sessions SET lost_step_records = ?2, map_failures = ?3, lost_off_cpu_records = ?4 WHERE id = ?1",
        params![session, n(losses.lost_step_records), n(losses.map_failures), n(losses.lost_off_cpu_records)],
    )?;
    let mut mark =
        conn.prepare("UPDATE steps SET incomplete = 1 WHERE session_id = ?1 AND label = ?2 AND step = ?3")?;
    for (label, step) in &losses.incomplete {
        mark.execute(params![session, label, n(*step)])?;
    }
    conn.execute("UPDATE steps SET incomplete = 0 WHERE session_id = ?1 AND incomplete IS NULL", [session])?;
    Ok(())
}
