//! `profiler export --job NAME`: every session of a job (its ranks, on one
//! node or, in a merged profile, on several) in one Perfetto trace, on one
//! time axis: Unix time, each session's monotonic clock carried over by its
//! own `unix_offset_ns`.
use std::io::Write;

use anyhow::bail;
use serde::Serialize;

use super::{EventCounts, ProfileDb, Timeline, TraceWriter, program_name, write_session};

/// What chrome://tracing shows under "metadata" for a job.
#[derive(Serialize)]
struct JobData<'a> {
    job: &'a str,
    profiler_sessions: &'a [i64],
    started_unix_s: f64,
    timestamps: &'static str,
}

/// One session of the job, as its process is named in the trace.
struct JobSession {
    id: i64,
    pid: i64,
    process: String,
    /// Unix time of a monotonic ns of this session: ns + unix_offset_ns.
    unix_offset_ns: i64,
    started_unix_ns: i64,
}

/// A job's sessions, ranks first in rank order.
pub(super) struct Job {
    pub name: String,
    sessions: Vec<JobSession>,
}

impl Job {
    /// The sessions of job `name`; none is an error that lists the jobs the profile has.
    pub(super) fn read(db: &ProfileDb, name: &str) -> anyhow::Result<Self> {
        let mut q = db.conn.prepare(
            "SELECT id, pid, command, exe, hostname, rank, unix_offset_ns, started_ns + unix_offset_ns
             FROM sessions WHERE job = ?1 ORDER BY rank, started_ns + unix_offset_ns, id",
        )?;
        let rows = q.query_map([name], |r| {
            let (id, pid): (i64, i64) = (r.get(0)?, r.get(1)?);
            let (command, exe): (String, Option<String>) = (r.get(2)?, r.get(3)?);
            let (host, rank): (Option<String>, Option<i64>) = (r.get(4)?, r.get(5)?);
            let mut process = format!("{} (pid {pid}, session {id})", program_name(exe.as_deref(), &command));
            if let Some(rank) = rank {
                process = format!("rank {rank}: {process}");
            }
            if let Some(host) = host {
                process = format!("{host} {process}");
            }
            Ok(JobSession { id, pid, process, unix_offset_ns: r.get(6)?, started_unix_ns: r.get(7)? })
        })?;
        let sessions: Vec<JobSession> = rows.collect::<rusqlite::Result<_>>()?;
        if sessions.is_empty() {
            let jobs: Vec<String> = db
                .conn
                .prepare("SELECT DISTINCT job FROM sessions WHERE job IS NOT NULL ORDER BY job")?
                .query_map([], |r| r.get(0))?
                .collect::<rusqlite::Result<_>>()?;
            bail!("{} has no sessions of job '{name}'; its jobs: {}", db.path.display(), jobs.join(", "));
        }
        Ok(Self { name: name.to_owned(), sessions })
    }
}

/// Writes every session of `job` as its own trace process (numbered by
/// session id: pids of different nodes may be equal), timestamps in µs since
/// the job's first session started, in Unix time.
pub(super) fn export_perfetto_job(db: &ProfileDb, job: &Job, out: impl Write) -> anyhow::Result<EventCounts> {
    let origin = job.sessions.iter().map(|s| s.started_unix_ns).min().unwrap_or_default();
    let mut w = TraceWriter::new(out)?;
    let mut counts = EventCounts::default();
    for s in &job.sessions {
        // us(ns) = ns - started_ns = (ns + unix_offset_ns) - origin.
        let t = Timeline { pid: s.id, started_ns: origin - s.unix_offset_ns };
        let c = write_session(db, s.id, t, s.pid, &s.process, &mut w)?;
        counts.steps += c.steps;
        counts.regions += c.regions;
        counts.syncs += c.syncs;
        counts.launches += c.launches;
        counts.counters += c.counters;
    }
    counts.total = w.events;
    let ids: Vec<i64> = job.sessions.iter().map(|s| s.id).collect();
    let mut out = w.finish(&JobData {
        job: &job.name,
        profiler_sessions: &ids,
        started_unix_s: origin as f64 / 1e9,
        timestamps: "µs since the job's first session started, each session's clock put on Unix time",
    })?;
    out.flush()?;
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::Value;

    use super::*;
    use crate::store::{MergeInput, merge_into, merge_testing::two_nodes, open_for_reading};

    /// Two nodes merged, then job `j` exported: each rank's step slices sit
    /// at their session's Unix time since the job's first start, as the
    /// sessions' rows say, so the nodes' steps line up in one trace.
    #[test]
    fn a_job_of_two_nodes_is_one_trace_on_unix_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b) = two_nodes(dir.path());
        let merged = dir.path().join("job.db");
        let (ca, cb) = (open_for_reading(&a).expect("a"), open_for_reading(&b).expect("b"));
        let inputs = [MergeInput { path: &a, conn: &ca }, MergeInput { path: &b, conn: &cb }];
        merge_into(&merged, &inputs, None).expect("merge");

        let db = ProfileDb::open(&merged).expect("open");
        let job = Job::read(&db, "j").expect("job j");
        let mut buf = Vec::new();
        let counts = export_perfetto_job(&db, &job, &mut buf).expect("export");
        assert_eq!(counts.steps, 6, "three steps of each rank");

        // Ground truth: steps' start_ns put on Unix time by their session's offset.
        let origin: i64 = db
            .conn
            .query_row("SELECT min(started_ns + unix_offset_ns) FROM sessions WHERE job = 'j'", [], |r| r.get(0))
            .expect("origin");
        let mut want = BTreeMap::new();
        let mut q = db
            .conn
            .prepare(
                "SELECT st.session_id, st.step, st.start_ns + s.unix_offset_ns FROM steps st
                 JOIN sessions s ON s.id = st.session_id WHERE s.job = 'j'",
            )
            .expect("q");
        let mut rows = q.query([]).expect("q");
        while let Some(r) = rows.next().expect("row") {
            let unix_ns: i64 = r.get(2).expect("ns");
            want.insert(
                (r.get::<_, i64>(0).expect("id"), r.get::<_, i64>(1).expect("step")),
                (unix_ns - origin) as f64 / 1e3,
            );
        }
        assert_eq!(want.keys().map(|k| k.0).collect::<std::collections::BTreeSet<_>>().len(), 2);

        let trace: Value = serde_json::from_slice(&buf).expect("JSON");
        let mut have = BTreeMap::new();
        for e in trace["traceEvents"].as_array().expect("events") {
            if e["cat"] == "step" {
                have.insert(
                    (e["pid"].as_i64().expect("pid"), e["args"]["step"].as_i64().expect("step")),
                    e["ts"].as_f64().expect("ts"),
                );
            }
        }
        assert_eq!(have, want);
        // Node B started 123.456789 s after node A, on the Unix clock.
        assert!((have[&(3, 0)] - have[&(2, 0)] - 123_456_789.0).abs() < 1.0, "{have:?}");
        let names: Vec<&str> = trace["traceEvents"]
            .as_array()
            .expect("events")
            .iter()
            .filter(|e| e["name"] == "process_name")
            .filter_map(|e| e["args"]["name"].as_str())
            .collect();
        assert_eq!(names.len(), 2);
        assert!(names[0].starts_with("node-a rank 0:") && names[1].starts_with("node-b rank 1:"), "{names:?}");

        let err = Job::read(&db, "nope").err().expect("no such job").to_string();
        assert!(err.contains("its jobs: earlier, j"), "{err}");
    }
}
