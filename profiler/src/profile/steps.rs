//! A session's steps as the report and its HTML page read them.
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
