//! The `collectives` rows and, at the session's end, each step's
//! `collective_bytes` / `collective_ns` summed from them.
use rusqlite::{Connection, Transaction, params};

use super::{i, rows::CollectiveRow};

pub(super) fn write_collectives(tx: &Transaction<'_>, session_id: i64, rows: &[CollectiveRow]) -> rusqlite::Result<()> {
    let mut stmt = tx.prepare_cached(
        "INSERT INTO collectives(session_id, tid, op, count, datatype, bytes, peer, comm, stream, start_ns, end_ns,
                                 label, step)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
    )?;
    for r in rows {
        stmt.execute(params![
            session_id,
            r.tid,
            r.op,
            r.count.map(i),
            r.datatype,
            r.bytes.map(i),
            r.peer,
            r.comm.map(i),
            r.stream.map(i),
            i(r.start_ns),
            i(r.end_ns),
            r.step.map(|s| s.0),
            r.step.map(|s| i(s.1))
        ])?;
    }
    Ok(())
}

/// Per step: the bytes its collectives moved (those of known size) and the
/// host time in them; 0 for a step without any. Left NULL when no NCCL
/// library was probed in the session's job (one file-wide probe serves every
/// process of a job; its row is the first process's): nothing could have been seen.
pub(super) fn write_step_collectives(conn: &Connection, session_id: i64) -> rusqlite::Result<()> {
    conn.execute(
        "UPDATE steps SET
             collective_bytes = coalesce((SELECT sum(c.bytes) FROM collectives c
                 WHERE c.session_id = steps.session_id AND c.label = steps.label AND c.step = steps.step), 0),
             collective_ns = coalesce((SELECT sum(c.end_ns - c.start_ns) FROM collectives c
                 WHERE c.session_id = steps.session_id AND c.label = steps.label AND c.step = steps.step), 0)
         WHERE session_id = ?1
           AND EXISTS (SELECT 1 FROM probed_files f WHERE f.session_id IN (SELECT id FROM sessions
                           WHERE job = (SELECT job FROM sessions WHERE id = ?1)) AND f.kind = ?2 AND f.probes > 0)",
        params![session_id, NCCL_KIND],
    )?;
    Ok(())
}

/// `probed_files.kind` of an NCCL library (`session::nccl` writes it).
pub const NCCL_KIND: &str = "nccl";
