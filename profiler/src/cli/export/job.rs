//! The Perfetto export of a whole job (`export --job`): each process of the
//! job on its own process track, named and ordered by its rank, on one time
//! axis (Unix time, so that sessions of several machines line up); and the
//! NCCL calls of a session as slices on their thread's track.
use std::io::Write;

use serde::Serialize;

use super::{EventCounts, Timeline, TraceWriter, TracedProcess, write_session};
use crate::profile::ProfileDb;

#[derive(Serialize)]
struct CollectiveArgs {
    count: Option<i64>,
    datatype: Option<String>,
    bytes: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    peer: Option<i64>,
    comm: Option<String>,
    stream: Option<String>,
    step: Option<i64>,
}

/// NCCL calls as slices, named by their op (host time in the call).
pub(super) fn write_collectives<W: Write>(
    db: &ProfileDb,
    session: i64,
    t: Timeline,
    w: &mut TraceWriter<W>,
) -> anyhow::Result<u64> {
    let mut q = db.conn.prepare(
        "SELECT op, tid, start_ns, end_ns, count, datatype, bytes, peer, comm, stream, step
         FROM collectives WHERE session_id = ?1",
    )?;
    let mut rows = q.query([session])?;
    let hex = |v: Option<i64>| v.map(|v| format!("{v:#x}"));
    let mut n = 0;
    while let Some(r) = rows.next()? {
        let op: String = r.get(0)?;
        let args = CollectiveArgs {
            count: r.get(4)?,
            datatype: r.get(5)?,
            bytes: r.get(6)?,
            peer: r.get(7)?,
            comm: hex(r.get(8)?),
            stream: hex(r.get(9)?),
            step: r.get(10)?,
        };
        w.event(&t.span(&op, "nccl", r.get(1)?, r.get(2)?, r.get(3)?, args))?;
        n += 1;
    }
    Ok(n)
}

/// `process_sort_index` metadata: where a process's tracks go in the viewer.
#[derive(Serialize)]
struct SortIndex {
    name: &'static str,
    ph: &'static str,
    pid: i64,
    args: SortArgs,
}

#[derive(Serialize)]
struct SortArgs {
    sort_index: i64,
}

/// What chrome://tracing shows under "metadata" for a job.
#[derive(Serialize)]
struct JobData<'a> {
    profiler_job: &'a str,
    profiler_sessions: Vec<i64>,
    started_unix_s: f64,
    timestamps: &'static str,
}

/// The machine a session ran on.
fn hostname(db: &ProfileDb, session: i64) -> rusqlite::Result<Option<String>> {
    db.conn.query_row("SELECT hostname FROM sessions WHERE id = ?1", [session], |r| r.get(0))
}

/// Writes every session of `job`, each as its own process (its pid; its
/// session id when pids of two machines coincide).
pub(super) fn export_job_perfetto(db: &ProfileDb, job: &str, out: impl Write) -> anyhow::Result<EventCounts> {
    let sessions = crate::profile::jobs::job_sessions(db, job)?;
    let mut processes =
        sessions.iter().map(|&(id, _, _)| TracedProcess::read(db, id)).collect::<rusqlite::Result<Vec<_>>>()?;
    // A merged profile's job spans machines: name each track's host, and
    // number tracks by session where two machines' pids coincide.
    let hosts: Vec<Option<String>> =
        sessions.iter().map(|&(id, _, _)| hostname(db, id)).collect::<rusqlite::Result<_>>()?;
    let several_hosts = hosts.iter().collect::<std::collections::HashSet<_>>().len() > 1;
    if several_hosts {
        processes.iter_mut().zip(hosts).for_each(|(p, h)| p.host = h);
    }
    let pids_unique =
        processes.iter().map(|p| p.pid).collect::<std::collections::HashSet<_>>().len() == processes.len();
    let track = |p: &TracedProcess| if pids_unique { p.pid } else { p.session };
    // The job's first start, as Unix ns: each session's clock is moved onto it.
    let base_unix_ns = processes.iter().map(|p| p.started_ns + p.unix_offset_ns).min().unwrap_or(0);
    let mut w = TraceWriter::new(out)?;
    let mut total = EventCounts::default();
    for (order, p) in processes.iter().enumerate() {
        let t = Timeline { pid: track(p), started_ns: base_unix_ns - p.unix_offset_ns };
        w.event(&SortIndex {
            name: "process_sort_index",
            ph: "M",
            pid: track(p),
            args: SortArgs { sort_index: order as i64 },
        })?;
        total += write_session(db, p, t, &mut w)?;
    }
    total.total = w.events;
    let mut out = w.finish(&JobData {
        profiler_job: job,
        profiler_sessions: processes.iter().map(|p| p.session).collect(),
        started_unix_s: base_unix_ns as f64 / 1e9,
        timestamps: "µs since the job's first session started",
    })?;
    out.flush()?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;
    use crate::profile::jobs::testing::{DURATIONS, job_profile};

    /// Job j1 written through the store, rank 1's clock a second later in
    /// Unix time; its Perfetto trace as JSON.
    fn trace() -> Value {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.db");
        let ids = job_profile(&path);
        rusqlite::Connection::open(&path)
            .expect("open")
            .execute("UPDATE sessions SET unix_offset_ns = unix_offset_ns + 1000000000 WHERE id = ?1", [ids[1]])
            .expect("shift");
        let db = ProfileDb::open(&path).expect("a profile");
        let mut out = Vec::new();
        let counts = export_job_perfetto(&db, "j1", &mut out).expect("export");
        assert_eq!((counts.steps, counts.collectives), (12, 4));
        serde_json::from_slice(&out).expect("JSON")
    }

    fn events<'a>(t: &'a Value, pred: impl Fn(&Value) -> bool + 'a) -> impl Iterator<Item = &'a Value> + 'a {
        t["traceEvents"].as_array().expect("events").iter().filter(move |e| pred(e))
    }

    #[test]
    fn each_process_of_the_job_is_a_process_track_named_by_its_rank() {
        let t = trace();
        let names: Vec<(i64, &str)> = events(&t, |e| e["name"] == "process_name")
            .map(|e| (e["pid"].as_i64().expect("pid"), e["args"]["name"].as_str().expect("name")))
            .collect();
        assert_eq!(
            names,
            [(101, "rank 0: trainer (pid 101)"), (202, "rank 1: trainer (pid 202)"), (303, "trainer (pid 303)")]
        );
        let order: Vec<(i64, i64)> = events(&t, |e| e["name"] == "process_sort_index")
            .map(|e| (e["pid"].as_i64().expect("pid"), e["args"]["sort_index"].as_i64().expect("index")))
            .collect();
        assert_eq!(order, [(101, 0), (202, 1), (303, 2)]);
        assert_eq!(t["otherData"]["profiler_job"], "j1");
    }

    #[test]
    fn every_rank_s_steps_are_on_its_track_on_one_time_axis() {
        let t = trace();
        for (_, pid, durations) in DURATIONS {
            let steps: Vec<(f64, f64)> = events(&t, |e| e["cat"] == "step" && e["pid"] == i64::from(pid))
                .map(|e| (e["ts"].as_f64().expect("ts"), e["dur"].as_f64().expect("dur")))
                .collect();
            // Rank 1 (pid 202) started a second later in Unix time.
            let offset_us = if pid == 202 { 1e6 } else { 0.0 };
            let expected: Vec<(f64, f64)> =
                (0..4).map(|k| (offset_us + k as f64 * 1e5, durations[k] as f64 * 1e3)).collect();
            assert_eq!(steps, expected, "pid {pid}");
        }
        let nccl: Vec<(i64, &str, f64)> = events(&t, |e| e["cat"] == "nccl")
            .map(|e| {
                (e["pid"].as_i64().expect("pid"), e["name"].as_str().expect("op"), e["dur"].as_f64().expect("dur"))
            })
            .collect();
        assert_eq!(nccl, vec![(101, "all_reduce", 2000.0); 4]);
    }
}
