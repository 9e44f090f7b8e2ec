//! The `jit_calls` rows and, at the session's end, each JAX step's
//! `dispatch_ns` from the call that began it, and the launches other
//! threads of the process made during it.
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

/// XLA may launch from threads of its own, which have no step: a launch row
/// with no step of its thread's, made while a JAX step of the process was
/// open (the most recently begun one, on any thread), is that step's, and
/// counts in its `launches`. Launch rows only: with `--launches count` (or
/// once the size budget stops launch rows) a JAX step counts its own
/// thread's launches alone, as every other step does.
pub(super) fn write_step_launches(conn: &Connection, session_id: i64) -> rusqlite::Result<()> {
    let jax: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM steps WHERE session_id = ?1 AND dispatch_ns IS NOT NULL)",
        [session_id],
        |r| r.get(0),
    )?;
    if !jax {
        return Ok(());
    }
    conn.execute_batch("CREATE INDEX IF NOT EXISTS steps_by_start ON steps(session_id, start_ns);")?;
    conn.execute(
        "UPDATE launches SET (label, step) = (SELECT s.label, s.step FROM (SELECT label, step, end_ns FROM steps
                 WHERE session_id = ?1 AND dispatch_ns IS NOT NULL AND start_ns <= launches.ts_ns
                 ORDER BY start_ns DESC LIMIT 1) s WHERE s.end_ns > launches.ts_ns)
         WHERE session_id = ?1 AND step IS NULL",
        [session_id],
    )?;
    conn.execute_batch("DROP TABLE IF EXISTS temp.jax_step_launches;")?;
    conn.execute(
        "CREATE TEMP TABLE jax_step_launches AS SELECT label, step, tid, count(*) AS n FROM launches
         WHERE session_id = ?1 AND step IS NOT NULL GROUP BY label, step, tid",
        [session_id],
    )?;
    conn.execute(
        "UPDATE steps SET launches = launches + coalesce((SELECT sum(j.n) FROM temp.jax_step_launches j
             WHERE j.label = steps.label AND j.step = steps.step AND j.tid != steps.tid), 0)
         WHERE session_id = ?1 AND dispatch_ns IS NOT NULL AND launches IS NOT NULL",
        [session_id],
    )?;
    conn.execute_batch("DROP TABLE temp.jax_step_launches;")
}

#[cfg(test)]
mod tests {
    use super::super::{JitCallRow, LaunchRow, SessionEnd, StepRow, Store, StoreMsg, testing::*};

    /// Two JAX steps on thread 7 (100–200, 200–300) and an eval step of
    /// another source (a plain step, no jit call) on thread 7 at 400–500;
    /// launches by XLA's thread 9 at 150, 250, 350 (between steps) and 450
    /// (in the plain step's time, which is not a JAX step), one by 7 at 120.
    #[test]
    fn jax_steps_get_their_dispatch_and_other_threads_launches() {
        let (_d, p) = temp_db();
        let store = Store::open(&p).expect("open");
        let id = store.begin_session(&start()).expect("session");
        let w = store.spawn_writer(id);
        let span = |n, (start_ns, end): (u64, u64), launches| StepRow {
            step: n,
            start_ns,
            end_ns: Some(end),
            launches: Some(launches),
            ..step()
        };
        w.send(StoreMsg::Steps(vec![span(0, (100, 200), 1), span(1, (200, 300), 0)]));
        w.send(StoreMsg::Steps(vec![StepRow { label: "eval".into(), ..span(0, (400, 500), 0) }]));
        let call = |start_ns, end, step| JitCallRow {
            tid: 7,
            name: Some("train_step".into()),
            function: 0xabc,
            start_ns,
            end_ns: Some(end),
            depth: 0,
            step: Some(("train", step)),
        };
        let nested = JitCallRow { depth: 1, start_ns: 205, ..call(205, 206, 1) };
        w.send(StoreMsg::JitCalls(vec![call(100, 130, 0), call(200, 210, 1), nested]));
        let at = |tid, ts_ns, step| LaunchRow { tid, ts_ns, step, ..launch() };
        w.send(StoreMsg::Launches(vec![
            at(7, 120, Some(("train", 0))),
            at(9, 150, None),
            at(9, 250, None),
            at(9, 350, None),
            at(9, 450, None),
        ]));
        let end = SessionEnd {
            ended_ns: 600,
            end_reason: "target-exited".into(),
            lost_events: 0,
            total_launches: 5,
            unmatched_returns: 0,
        };
        w.finish(end, Vec::new()).expect("finish");
        let conn = rusqlite::Connection::open(&p).expect("reopen");
        let rows: Vec<(String, i64, Option<i64>, i64)> = conn
            .prepare("SELECT label, step, dispatch_ns, launches FROM steps ORDER BY start_ns")
            .expect("prepare")
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        let want = [("train", 0, Some(30), 2), ("train", 1, Some(10), 1), ("eval", 0, None, 0)];
        let want: Vec<(String, i64, Option<i64>, i64)> =
            want.iter().map(|&(l, s, d, n)| (l.to_owned(), s, d, n)).collect();
        assert_eq!(rows, want);
        let untagged: i64 =
            conn.query_row("SELECT count(*) FROM launches WHERE step IS NULL", [], |r| r.get(0)).expect("q");
        assert_eq!(untagged, 2, "the launches at 350 (between steps) and 450 (in no JAX step)");
    }
}
