//! The CPU samples' rows: `cpu_samples`, and the `frames` and `stacks` they
//! name (deduplicated by the session before they come here), and the
//! sampler's columns of `sessions`.
use rusqlite::{Connection, Transaction, params};

use super::{
    i,
    rows::{CpuSampleRow, CpuSampling, FrameRow, StackRow},
};

pub(super) fn write_samples(tx: &Transaction<'_>, session_id: i64, rows: &[CpuSampleRow]) -> rusqlite::Result<()> {
    let mut stmt = tx.prepare_cached(
        "INSERT INTO cpu_samples(session_id, tid, time_ns, stack_id, mode, label, step) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?;
    for r in rows {
        let mode = if r.in_kernel { "kernel" } else { "user" };
        let (label, step) = (r.step.map(|s| s.0), r.step.map(|s| i(s.1)));
        stmt.execute(params![session_id, r.tid, i(r.time_ns), r.stack_id, mode, label, step])?;
    }
    Ok(())
}

pub(super) fn write_stacks(
    tx: &Transaction<'_>,
    session_id: i64,
    frames: &[FrameRow],
    stacks: &[StackRow],
) -> rusqlite::Result<()> {
    let mut frame = tx.prepare_cached(
        "INSERT INTO frames(session_id, frame_id, kind, module, function, line) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?;
    for f in frames {
        frame.execute(params![session_id, f.frame_id, f.kind, f.module, f.function, f.line])?;
    }
    let mut stack =
        tx.prepare_cached("INSERT INTO stacks(session_id, stack_id, depth, frame_id) VALUES (?1, ?2, ?3, ?4)")?;
    for s in stacks {
        for (depth, frame_id) in s.frames.iter().enumerate() {
            stack.execute(params![session_id, s.stack_id, depth as i64, frame_id])?;
        }
    }
    Ok(())
}

pub(super) fn write_sampling(conn: &Connection, session_id: i64, s: &CpuSampling) -> rusqlite::Result<()> {
    let (runs, ns) = match &s.kernel {
        Ok(k) => (Some(i(k.runs)), Some(i(k.ns))),
        Err(_) => (None, None),
    };
    conn.execute(
        "UPDATE sessions SET cpu_sample_hz = ?2, cpu_samples_taken = ?3, lost_cpu_samples = ?4, cpu_stack_failures = ?5,
         cpu_sample_runs = ?6, cpu_sample_kernel_ns = ?7 WHERE id = ?1",
        params![session_id, s.hz, i(s.counts.taken), i(s.counts.lost), i(s.counts.stack_failures), runs, ns],
    )?;
    conn.execute(
        "INSERT OR IGNORE INTO capabilities(session_id, source, metric, available, reason)
         VALUES (?1, 'cpu_sampler', 'kernel_cost', ?2, ?3)",
        params![session_id, s.kernel.is_ok(), s.kernel.as_ref().err()],
    )
    .map(drop)
}
