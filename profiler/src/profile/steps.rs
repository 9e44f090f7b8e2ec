//! A session's steps as the report and its HTML page read them.
use std::collections::{HashMap, HashSet};

use super::ProfileDb;

/// One row of `steps`, as the report (and its HTML page) needs it.
pub struct StepRow {
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
    /// Where the thread's time went (NULL without scheduler tracing).
    pub cpu_ns: Option<i64>,
    pub runnable_ns: Option<i64>,
    pub blocked_ns: Option<i64>,
    /// Host time in copies and memsets.
    pub copy_ns: Option<i64>,
    pub collective_ns: Option<i64>,
    /// `steps.bound`, the step's verdict.
    pub bound: Option<String>,
    /// JAX steps: the host's dispatch of the call that began the step.
    pub dispatch_ns: Option<i64>,
}

/// Every step of the session, each label's in start order (the order
/// `--skip` counts in).
pub fn load_steps(db: &ProfileDb, session: i64) -> anyhow::Result<Vec<StepRow>> {
    let mut q = db.conn.prepare(
        "SELECT label, step, start_ns, end_ns, duration_ns, inter_step_ns, launches, sync_wait_ns, data_wait_ns,
                optimizer_ns, cpu_ns, runnable_ns, blocked_ns, copy_ns, collective_ns, bound, dispatch_ns
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
                cpu_ns: r.get(10)?,
                runnable_ns: r.get(11)?,
                blocked_ns: r.get(12)?,
                copy_ns: r.get(13)?,
                collective_ns: r.get(14)?,
                bound: r.get(15)?,
                dispatch_ns: r.get(16)?,
            })
        })?
        .collect::<rusqlite::Result<_>>()?;
    Ok(rows)
}

/// The steps (label, step) that are an epoch's first: PyTorch marker steps
/// whose start was moved past a DataLoader `__next__` that delivered no batch
/// of theirs (an epoch's `StopIteration`), seen as a `__next__` region of
/// their thread that ended in the gap before them (a step's own first batch
/// ends at its start, not before it). Needs the `regions` rows.
pub fn epoch_first_steps(db: &ProfileDb, session: i64) -> anyhow::Result<HashSet<(String, i64)>> {
    let mut ends: HashMap<u32, Vec<i64>> = HashMap::new();
    let mut q = db.conn.prepare(
        "SELECT tid, end_ns FROM regions
         WHERE session_id = ?1 AND end_ns IS NOT NULL AND name LIKE 'enumerate(DataLoader)#%'
         ORDER BY tid, end_ns",
    )?;
    let mut rows = q.query([session])?;
    while let Some(r) = rows.next()? {
        ends.entry(r.get(0)?).or_default().push(r.get(1)?);
    }
    if ends.is_empty() {
        return Ok(HashSet::new());
    }
    let mut q = db.conn.prepare(
        "SELECT label, step, tid, start_ns, inter_step_ns FROM steps
         WHERE session_id = ?1 AND data_wait_ns IS NOT NULL AND inter_step_ns IS NOT NULL",
    )?;
    let mut rows = q.query([session])?;
    let mut first = HashSet::new();
    while let Some(r) = rows.next()? {
        let (tid, start, gap): (u32, i64, i64) = (r.get(2)?, r.get(3)?, r.get(4)?);
        let Some(ends) = ends.get(&tid) else { continue };
        // The first `__next__` end at or after the previous step's end: before this start?
        let i = ends.partition_point(|&e| e < start - gap);
        if ends.get(i).is_some_and(|&e| e < start) {
            first.insert((r.get(0)?, r.get(1)?));
        }
    }
    Ok(first)
}
