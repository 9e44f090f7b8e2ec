//! The `off_cpu` rows: each time a traced thread was off its CPU.
use rusqlite::{Transaction, params};

use super::{i, rows::OffCpuRow};

pub(super) fn write_off_cpu(tx: &Transaction<'_>, session_id: i64, rows: &[OffCpuRow]) -> rusqlite::Result<()> {
    let mut stmt = tx.prepare_cached(
        "INSERT INTO off_cpu(session_id, tid, state, left_ns, woken_ns, resumed_ns) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?;
    for r in rows {
        stmt.execute(params![session_id, r.tid, r.state, i(r.left_ns), r.woken_ns.map(i), i(r.resumed_ns)])?;
    }
    Ok(())
}
