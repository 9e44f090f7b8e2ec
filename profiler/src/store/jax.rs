//! The `jit_calls` rows and, at the session's end, each JAX step's
//! `dispatch_ns` from the call that began it.
use rusqlite::{Connection, Transaction, params};

use super::{i, rows::JitCallRow};

pub(super) fn write_jit_calls(tx: &Transaction<'_>, session_id: i64, rows: &[JitCallRow]) -> rusqlite::Result<()> {
    let mut stmt = tx.prepare_cached(
        "INSERT INTO jit_calls(session_id, tid, name, function, start_ns, end_ns, depth, label, step)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
    )?;
    for r in rows {
        stmt.execute(params![
            session_id,
            r.tid,
            r.name,
            i(r.function),
            i(r.start_ns),
            r.end_ns.map(i),
            r.depth,
            r.step.map(|s| s.0),
            r.step.map(|s| i(s.1))
        ])?;
    }
    Ok(())
}

/// A JAX step begins with an outermost call on its thread at its start: that
/// call's duration is the step's host dispatch time. Other steps keep NULL.
pub(super) fn write_step_dispatch(conn: &Connection, session_id: i64) -> rusqlite::Result<()> {
    conn.execute(
        "UPDATE steps SET dispatch_ns = (SELECT c.end_ns - c.start_ns FROM jit_calls c
             WHERE c.session_id = steps.session_id AND c.tid = steps.tid AND c.start_ns = steps.start_ns
               AND c.depth = 0 AND c.label = steps.label AND c.step = steps.step)
         WHERE session_id = ?1 AND EXISTS (SELECT 1 FROM jit_calls c
             WHERE c.session_id = steps.session_id AND c.tid = steps.tid AND c.start_ns = steps.start_ns
               AND c.depth = 0 AND c.label = steps.label AND c.step = steps.step)",
        params![session_id],
    )?;
    Ok(())
}
