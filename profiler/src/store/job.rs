//! A job's sessions beyond the first: one per traced process, made (and updated after an `exec`)
//! by `StoreMsg::Process`, fed by `ForProcess`, ended by `EndProcess`, and finished at the job's
//! end with per-step figures from the first session's samples (GPUs, RAPL: sampled once per
//! machine, stored once).
use std::collections::HashMap;

use rusqlite::{Connection, OptionalExtension, Transaction, params};

use super::{
    StoreError, StoreMsg, WriterStats,
    finish::derive_all,
    i,
    rows::{AtFinish, SessionEnd, SessionStart},
};

/// Inserts a session row; returns its id.
pub(super) fn insert_session(conn: &Connection, s: &SessionStart) -> rusqlite::Result<i64> {
    conn.execute(
        "INSERT INTO sessions(pid, command, exe, mode, launch_mode, step_source, started_ns, unix_offset_ns,
                              hostname, kernel_release, profiler_version, job, rank, local_rank, world_size,
                              parent_pid)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
        params![
            s.pid,
            s.command,
            s.exe,
            s.mode,
            s.launch_mode,
            s.step_source,
            i(s.started_ns),
            s.unix_offset_ns,
            s.hostname,
            s.kernel_release,
            env!("CARGO_PKG_VERSION"),
            s.job,
            s.rank,
            s.local_rank,
            s.world_size,
            s.parent_pid
        ],
    )?;
    Ok(conn.last_insert_rowid())
}

/// `StoreMsg::Process`: the process's session row, made the first time,
/// brought up to date after an `exec` (same pid and start: the same process).
pub(super) fn upsert_process(tx: &Transaction<'_>, first: i64, s: &SessionStart) -> rusqlite::Result<()> {
    let existing: Option<i64> = tx
        .prepare_cached(
            "SELECT id FROM sessions WHERE job = (SELECT job FROM sessions WHERE id = ?1) AND id != ?1
                 AND pid = ?2 AND started_ns = ?3",
        )?
        .query_row(params![first, s.pid, i(s.started_ns)], |r| r.get(0))
        .optional()?;
    match existing {
        None => insert_session(tx, s).map(drop),
        Some(id) => tx
            .execute(
                "UPDATE sessions SET command = ?2, exe = ?3, rank = ?4, local_rank = ?5, world_size = ?6,
                                     parent_pid = coalesce(parent_pid, ?7)
                 WHERE id = ?1",
                params![id, s.command, s.exe, s.rank, s.local_rank, s.world_size, s.parent_pid],
            )
            .map(drop),
    }
}

/// The session of the job's process `pid`: the latest with that pid (a pid
/// reused by a later process of the job gets a later session, and the earlier
/// process's rows were all sent before it ended). None: no such session.
fn latest_session(tx: &Connection, first: i64, pid: u32) -> rusqlite::Result<Option<i64>> {
    tx.prepare_cached(
        "SELECT id FROM sessions WHERE job = (SELECT job FROM sessions WHERE id = ?1) AND id != ?1 AND pid = ?2
         ORDER BY id DESC LIMIT 1",
    )?
    .query_row(params![first, pid], |r| r.get(0))
    .optional()
}

/// `StoreMsg::ForProcess`: `inner` written for the process's session (for the
/// first session when the process has none, which the agent never sends).
pub(super) fn session_of(tx: &Transaction<'_>, first: i64, pid: u32) -> rusqlite::Result<i64> {
    Ok(latest_session(tx, first, pid)?.unwrap_or(first))
}

/// A process's end, kept until the job's end: (pid, end, its own work).
pub(super) type Ended = (u32, SessionEnd, Vec<AtFinish>);

/// Moves the `EndProcess` messages out of `batch` into `ended`.
pub(super) fn take_ended(batch: &mut Vec<StoreMsg>, ended: &mut Vec<Ended>) {
    if !batch.iter().any(|m| matches!(m, StoreMsg::EndProcess(..))) {
        return;
    }
    for m in std::mem::take(batch) {
        match m {
            StoreMsg::EndProcess(pid, end, work) => ended.push((pid, end, work)),
            m => batch.push(m),
        }
    }
}

/// At the job's end (before the first session's own finish): every other
/// session of the job ends, with its own end when the agent sent one, else
/// the job's, and gets its per-step figures from the first session's samples.
pub(super) fn finish_processes(
    conn: &mut Connection,
    first: i64,
    job_end: &SessionEnd,
    job_work: &[AtFinish],
    ended: Vec<Ended>,
    stats: &mut WriterStats,
) {
    // Each session's stored launches in one pass: the launch index is built
    // after this, and a count per session would scan every launch row each.
    let (stored, mut result) = match stored_launches(conn, first) {
        Ok(stored) => (stored, Ok(())),
        Err(e) => (HashMap::new(), Err(e)),
    };
    for (pid, end, work) in ended {
        if result.is_err() {
            break;
        }
        // The oldest unended session with that pid: its process ended first.
        let id: rusqlite::Result<Option<i64>> = conn
            .query_row(
                "SELECT id FROM sessions WHERE job = (SELECT job FROM sessions WHERE id = ?1) AND id != ?1
                     AND pid = ?2 AND ended_ns IS NULL ORDER BY id LIMIT 1",
                params![first, pid],
                |r| r.get(0),
            )
            .optional();
        result = match id {
            Ok(Some(id)) => finish_one(conn, first, id, &end, &process_work(job_work, work), &stored, stats),
            Ok(None) => Ok(()),
            Err(e) => Err(e.into()),
        };
    }
    if result.is_ok() {
        result = finish_unended(conn, first, job_end, job_work, &stored, stats);
    }
    if let Err(e) = result {
        stats.first_error.get_or_insert_with(|| format!("finishing the job's sessions: {e}"));
    }
}

/// Launch rows of each of the job's other sessions.
fn stored_launches(conn: &Connection, first: i64) -> Result<HashMap<i64, i64>, StoreError> {
    let mut q = conn.prepare(
        "SELECT session_id, count(*) FROM launches WHERE session_id IN
             (SELECT id FROM sessions WHERE job = (SELECT job FROM sessions WHERE id = ?1) AND id != ?1)
         GROUP BY session_id",
    )?;
    let counts = q.query_map([first], |r| Ok((r.get(0)?, r.get(1)?)))?.collect::<rusqlite::Result<_>>()?;
    Ok(counts)
}

/// Sessions of the job no `EndProcess` came for: the job's end is theirs.
fn finish_unended(
    conn: &mut Connection,
    first: i64,
    end: &SessionEnd,
    work: &[AtFinish],
    stored: &HashMap<i64, i64>,
    stats: &mut WriterStats,
) -> Result<(), StoreError> {
    let ids: Vec<i64> = conn
        .prepare(
            "SELECT id FROM sessions WHERE job = (SELECT job FROM sessions WHERE id = ?1) AND id != ?1
                 AND ended_ns IS NULL",
        )?
        .query_map([first], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    for id in ids {
        finish_one(conn, first, id, end, &process_work(work, Vec::new()), stored, stats)?;
    }
    Ok(())
}

/// A process's work at the end: the job's GPU and RAPL figures (on its own
/// GPUs when it sent `RankGpus`), and its own losses and context switches. The system figures
/// (the first target's process CPU and RSS) are not its own: none.
fn process_work(job_work: &[AtFinish], own: Vec<AtFinish>) -> Vec<AtFinish> {
    let gpus = own.iter().find_map(|w| match w {
        AtFinish::RankGpus(g) => Some(g.clone()),
        _ => None,
    });
    let mut work: Vec<AtFinish> = job_work
        .iter()
        .filter_map(|w| match w {
            AtFinish::StepGpu { gpus: all, max_gap_ns, energy_resolution_j } => Some(AtFinish::StepGpu {
                gpus: gpus.clone().unwrap_or_else(|| all.clone()),
                max_gap_ns: *max_gap_ns,
                energy_resolution_j: *energy_resolution_j,
            }),
            AtFinish::StepEnergy { package_resolution_j, dram_resolution_j } => Some(AtFinish::StepEnergy {
                package_resolution_j: *package_resolution_j,
                dram_resolution_j: *dram_resolution_j,
            }),
            _ => None,
        })
        .collect();
    work.extend(own.into_iter().filter(|w| matches!(w, AtFinish::Losses(_) | AtFinish::ContextSwitches(_))));
    work
}

/// One process's session: its figures, then its end. The kernel's counters
/// (lost records, launches seen, failed map updates) are the job's, on the
/// first session: NULL here.
fn finish_one(
    conn: &mut Connection,
    first: i64,
    id: i64,
    end: &SessionEnd,
    work: &[AtFinish],
    stored: &HashMap<i64, i64>,
    stats: &mut WriterStats,
) -> Result<(), StoreError> {
    let mut tx = conn.transaction()?;
    derive_all(&mut tx, id, first, work, stats)?;
    let stored = stored.get(&id).copied().unwrap_or(0);
    tx.execute(
        "UPDATE sessions SET ended_ns = ?2, end_reason = ?3, lost_events = NULL, total_launches = NULL,
                             stored_launches = ?4, unmatched_returns = ?5, lost_step_records = NULL, lost_off_cpu_records = NULL,
                             map_failures = NULL
         WHERE id = ?1",
        params![id, i(end.ended_ns), end.end_reason, stored, i(end.unmatched_returns)],
    )?;
    tx.commit()?;
    stats.member_launches += stored.max(0) as u64;
    Ok(())
}
