//! Each thread's scheduler states as slices on a track of its own beside the
//! thread's (its step and region slices nest; these cross their boundaries):
//! `running`, then for each time off the CPU `sleeping` or `blocked` until its
//! wakeup and `runnable` until it ran again (only `runnable` when it was
//! preempted), from the `off_cpu` rows (`--launches all`).
use std::{collections::HashMap, io::Write};

use super::{SortAfter, Timeline, TraceWriter};
use crate::profile::ProfileDb;

/// Added to a thread id for its scheduler track (above Linux's largest pid,
/// 2^22, and apart from the regions' crossing tracks).
const SCHED_TRACK: i64 = 1 << 31;

/// Writes the scheduler slices; returns how many. Rows come in storage
/// order, which is each thread's time order (a thread's records are written
/// one after the other as it comes back to a CPU), so no sort is needed: the
/// `running` slice between two of a thread's rows is drawn from the last one's
/// `resumed_ns`, kept per thread.
pub(super) fn write_sched_slices<W: Write>(
    db: &ProfileDb,
    session: i64,
    t: Timeline,
    w: &mut TraceWriter<W>,
) -> anyhow::Result<u64> {
    if !db.has_table("off_cpu") {
        return Ok(0);
    }
    let mut q =
        db.conn.prepare("SELECT tid, state, left_ns, woken_ns, resumed_ns FROM off_cpu WHERE session_id = ?1")?;
    let mut rows = q.query([session])?;
    let mut resumed_at: HashMap<i64, i64> = HashMap::new();
    let mut n = 0;
    while let Some(r) = rows.next()? {
        let (tid, state): (i64, String) = (r.get(0)?, r.get(1)?);
        let (left, woken, resumed): (i64, Option<i64>, i64) = (r.get(2)?, r.get(3)?, r.get(4)?);
        let track = tid + SCHED_TRACK;
        let slice = |name: &'static str, start: i64, end: i64| t.span(name, "sched", track, start, Some(end), ());
        match resumed_at.insert(tid, resumed) {
            None => {
                w.event(&t.meta("thread_name", track, &format!("thread {tid}: scheduler")))?;
                w.event(&t.sort_index(track, tid, SortAfter::Scheduler))?;
            }
            Some(ran_from) if ran_from <= left => {
                w.event(&slice("running", ran_from, left))?;
                n += 1;
            }
            Some(_) => {}
        }
        let runnable_from = match woken {
            Some(woken) => {
                let waited = if state == "blocked" { "blocked" } else { "sleeping" };
                w.event(&slice(waited, left, woken))?;
                n += 1;
                woken
            }
            None => left,
        };
        w.event(&slice("runnable", runnable_from, resumed))?;
        n += 1;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::jobs::testing::job_profile;

    /// The slices of three off-CPU rows of one thread: each wait and its
    /// runnable tail, a preemption, and `running` between them, in order.
    #[test]
    fn a_threads_rows_become_its_scheduler_tracks_slices() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.db");
        let session = job_profile(&path)[0];
        let conn = rusqlite::Connection::open(&path).expect("open");
        let (pid, started): (i64, i64) = conn
            .query_row("SELECT pid, started_ns FROM sessions WHERE id = ?1", [session], |r| Ok((r.get(0)?, r.get(1)?)))
            .expect("session");
        let rows = [
            ("sleeping", 1_000, Some(3_000), 3_500),
            ("runnable", 5_000, None, 5_200),
            ("blocked", 8_000, Some(9_000), 9_100),
        ];
        for (state, left, woken, resumed) in rows {
            conn.execute(
                "INSERT INTO off_cpu(session_id, tid, state, left_ns, woken_ns, resumed_ns) VALUES (?1, 77, ?2, ?3, ?4, ?5)",
                rusqlite::params![session, state, started + left, woken.map(|w| started + w), started + resumed],
            )
            .expect("insert");
        }
        drop(conn);
        let db = ProfileDb::open(&path).expect("a profile");
        let mut out = Vec::new();
        let counts = super::super::export_perfetto(&db, session, &mut out).expect("export");
        assert_eq!(counts.sched, 7);
        let t: serde_json::Value = serde_json::from_slice(&out).expect("JSON");
        let events = t["traceEvents"].as_array().expect("events");
        let track = 77 + SCHED_TRACK;
        let slices: Vec<(&str, f64, f64)> = events
            .iter()
            .filter(|e| e["cat"] == "sched")
            .map(|e| {
                assert_eq!((e["pid"].as_i64(), e["tid"].as_i64()), (Some(pid), Some(track)));
                (e["name"].as_str().expect("name"), e["ts"].as_f64().expect("ts"), e["dur"].as_f64().expect("dur"))
            })
            .collect();
        assert_eq!(
            slices,
            [
                ("sleeping", 1.0, 2.0),
                ("runnable", 3.0, 0.5),
                ("running", 3.5, 1.5),
                ("runnable", 5.0, 0.2),
                ("running", 5.2, 2.8),
                ("blocked", 8.0, 1.0),
                ("runnable", 9.0, 0.1),
            ]
        );
        let meta: Vec<&serde_json::Value> = events.iter().filter(|e| e["tid"] == track && e["ph"] == "M").collect();
        assert_eq!(meta[0]["args"]["name"], "thread 77: scheduler");
        assert_eq!(meta[1]["args"]["sort_index"], 4 * 77 + 2);
    }
}
