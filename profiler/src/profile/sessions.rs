//! A session's own row (its target, how it was traced, whether it ended) and
//! what its samplers could and could not measure (`capabilities`).
use serde::Serialize;

use super::ProfileDb;

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
    /// Context switches that did not fit a thread's state as the scheduler
    /// programs kept it (NULL: `--no-sched`, or a session that did not end).
    pub sched_mismatches: Option<i64>,
    pub hostname: Option<String>,
    pub kernel_release: Option<String>,
    pub profiler_version: String,
    pub job: Option<String>,
    pub rank: Option<i64>,
    /// The processes (sessions) of its job, itself included.
    pub job_processes: i64,
    /// What the size budget or `--launches auto` stopped, and when (None: nothing).
    pub budget: Option<String>,
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
    pub fn as_str(self) -> &'static str {
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

/// What the session's samplers recorded about each metric, by source and metric.
pub fn capabilities(db: &ProfileDb, session: i64) -> anyhow::Result<Vec<CapabilityRow>> {
    Ok(db
        .conn
        .prepare(
            "SELECT source, metric, available, reason FROM capabilities WHERE session_id = ?1 ORDER BY source, metric",
        )?
        .query_map([session], |r| {
            Ok(CapabilityRow { source: r.get(0)?, metric: r.get(1)?, available: r.get(2)?, reason: r.get(3)? })
        })?
        .collect::<rusqlite::Result<_>>()?)
}

/// The session's row, with how it stands ([`SessionState`]).
pub fn info(db: &ProfileDb, session: i64) -> anyhow::Result<SessionInfo> {
    let mut info = db.conn.query_row(
        "SELECT id, pid, command, exe, mode, launch_mode, step_source,
                strftime('%Y-%m-%d %H:%M:%S', (started_ns + unix_offset_ns) / 1e9, 'unixepoch'),
                (started_ns + unix_offset_ns) / 1e9, (ended_ns - started_ns) / 1e9, end_reason, lost_events,
                total_launches, stored_launches, unmatched_returns, hostname, kernel_release, profiler_version,
                job, rank, (SELECT count(*) FROM sessions j WHERE j.job IS s.job), sched_mismatches
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
                sched_mismatches: r.get(21)?,
                budget: None,
            })
        },
    )?;
    // duration_s is NULL exactly when ended_ns is (started_ns is NOT NULL).
    info.state = session_state(db, session, info.duration_s.is_some())?;
    info.budget = budget(db, session)?;
    Ok(info)
}

/// The budget's columns: when launch, per-call and all rows stopped (s into the
/// session), why, and the rows dropped.
type BudgetColumns = (Option<f64>, Option<f64>, Option<f64>, Option<String>, Option<i64>);

/// "launch rows stopped at 12.3 s, per-call rows at 40.1 s (N rows not stored): why".
fn budget(db: &ProfileDb, session: i64) -> anyhow::Result<Option<String>> {
    let (launch, per_call, all, reason, dropped): BudgetColumns = db.conn.query_row(
        "SELECT (launch_rows_stopped_ns - started_ns) / 1e9, (per_call_rows_stopped_ns - started_ns) / 1e9,
                    (all_rows_stopped_ns - started_ns) / 1e9, budget_reason, per_call_rows_dropped
             FROM sessions WHERE id = ?1",
        [session],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
    )?;
    let stops: Vec<String> =
        [(launch, "launch rows (--launches auto)"), (per_call, "per-call rows"), (all, "all rows")]
            .into_iter()
            .filter_map(|(at, what)| at.map(|at| format!("{what} stopped at {at:.1} s")))
            .collect();
    if stops.is_empty() {
        return Ok(None);
    }
    let dropped = dropped.map_or(String::new(), |n| format!(" ({n} rows not stored)"));
    Ok(Some(format!("{}{dropped}: {}", stops.join(", "), reason.unwrap_or_default())))
}
