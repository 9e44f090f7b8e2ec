//! The `copies` rows and, at the session's end, each step's verdict
//! (`steps.bound`, see `crate::verdict`) from its stored columns.
use rusqlite::{Connection, Transaction, params};

use super::{i, rows::CopyRow};
use crate::verdict::{Evidence, verdict};

pub(super) fn write_copies(tx: &Transaction<'_>, session_id: i64, rows: &[CopyRow]) -> rusqlite::Result<()> {
    let mut stmt = tx.prepare_cached(
        "INSERT INTO copies(session_id, tid, api, direction, bytes, result, start_ns, end_ns, label, step)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
    )?;
    for r in rows {
        stmt.execute(params![
            session_id,
            r.tid,
            r.api,
            r.direction,
            i(r.bytes),
            r.result,
            i(r.start_ns),
            i(r.end_ns),
            r.step.map(|s| s.0),
            r.step.map(|s| i(s.1))
        ])?;
    }
    Ok(())
}

/// The copy columns go NULL where no CUDA library of the session's job was
/// probed (nothing could have been seen), then every ended step gets its verdict.
pub(super) fn write_step_bounds(conn: &Connection, session_id: i64) -> rusqlite::Result<()> {
    conn.execute(
        "UPDATE steps SET h2d_bytes = NULL, d2h_bytes = NULL, d2d_bytes = NULL, copy_calls = NULL, copy_ns = NULL
         WHERE session_id = ?1
           AND NOT EXISTS (SELECT 1 FROM probed_files f WHERE f.session_id IN (SELECT id FROM sessions
                               WHERE job = (SELECT job FROM sessions WHERE id = ?1))
                           AND f.kind IN ('driver', 'runtime') AND f.probes > 0)",
        params![session_id],
    )?;
    let mut read = conn.prepare(
        "SELECT label, step, duration_ns, inter_step_ns, data_wait_ns, collective_ns, sync_wait_ns, copy_ns,
                h2d_bytes, runnable_ns, blocked_ns, cpu_ns
         FROM steps WHERE session_id = ?1 AND duration_ns IS NOT NULL",
    )?;
    let u = |v: Option<i64>| v.map(|v| v.max(0) as u64);
    let bounds: Vec<(String, i64, &'static str)> = read
        .query_map(params![session_id], |r| {
            let e = Evidence {
                duration_ns: u(r.get(2)?).unwrap_or(0),
                inter_step_ns: u(r.get(3)?),
                data_wait_ns: u(r.get(4)?),
                collective_ns: u(r.get(5)?),
                sync_wait_ns: u(r.get(6)?),
                copy_ns: u(r.get(7)?),
                h2d_bytes: u(r.get(8)?),
                runnable_ns: u(r.get(9)?),
                blocked_ns: u(r.get(10)?),
                cpu_ns: u(r.get(11)?),
            };
            Ok((r.get(0)?, r.get(1)?, verdict(&e).map(|b| b.as_str())))
        })?
        .filter_map(|row| match row {
            Ok((label, step, Some(bound))) => Some(Ok((label, step, bound))),
            Ok(_) => None,
            Err(e) => Some(Err(e)),
        })
        .collect::<rusqlite::Result<_>>()?;
    let mut write = conn.prepare("UPDATE steps SET bound = ?4 WHERE session_id = ?1 AND label = ?2 AND step = ?3")?;
    for (label, step, bound) in bounds {
        write.execute(params![session_id, label, step, bound])?;
    }
    Ok(())
}
