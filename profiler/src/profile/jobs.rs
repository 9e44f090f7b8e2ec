//! The jobs of a profile: the one asked for (or the latest session's), and
//! its sessions in rank order.
use anyhow::{Context, bail};

use super::ProfileDb;

/// The job asked for (`""`: the latest session's), checked against the file.
pub fn resolve_job(db: &ProfileDb, requested: &str) -> anyhow::Result<String> {
    let p = db.path.display();
    let jobs: Vec<String> = db
        .conn
        .prepare("SELECT job FROM sessions WHERE job IS NOT NULL GROUP BY job ORDER BY max(id)")
        .and_then(|mut q| q.query_map([], |r| r.get(0))?.collect())
        .with_context(|| format!("reading the jobs of {p}"))?;
    if !requested.is_empty() {
        if jobs.iter().any(|j| j == requested) {
            return Ok(requested.to_owned());
        }
        bail!(
            "{p} has no job {requested}; its jobs are: {}",
            if jobs.is_empty() { "none".into() } else { jobs.join(", ") }
        );
    }
    let latest: Option<(i64, Option<String>)> = db
        .conn
        .query_row("SELECT id, job FROM sessions ORDER BY id DESC LIMIT 1", [], |r| Ok((r.get(0)?, r.get(1)?)))
        .map(Some)
        .or_else(|e| if e == rusqlite::Error::QueryReturnedNoRows { Ok(None) } else { Err(e) })?;
    match latest {
        None => bail!("{p} has no sessions yet"),
        Some((_, Some(job))) => Ok(job),
        Some((id, None)) => bail!(
            "session {id} of {p} belongs to no job (its profiler recorded none); name one with --job JOB, or \
             see that session alone with `profiler report --session {id}`"
        ),
    }
}

/// The sessions of `job`, by rank (those without one last, by session id):
/// (session, rank, pid).
pub fn job_sessions(db: &ProfileDb, job: &str) -> rusqlite::Result<Vec<(i64, Option<i64>, i64)>> {
    db.conn
        .prepare("SELECT id, rank, pid FROM sessions WHERE job = ?1 ORDER BY rank IS NULL, rank, id")?
        .query_map([job], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
        .collect()
}

#[cfg(test)]
pub(crate) mod testing {
    //! A profile of a three-process job written through the store, with the
    //! job and ranks set as the multi-process agent sets them.
    use std::path::Path;

    use super::ProfileDb;
    use crate::store::{CollectiveRow, ProbedFileRow, SessionStart, StepRow, Store, StoreMsg};

    pub(crate) const MS: u64 = 1_000_000;
    /// Step times (ms) of steps 0–3: rank 0, rank 1, and a process without a
    /// rank (pid 303). Rank 1 is slowest in steps 0 and 3, pid 303 in 1 and 2.
    pub(crate) const DURATIONS: [(Option<i64>, u32, [u64; 4]); 3] =
        [(Some(0), 101, [10, 10, 10, 10]), (Some(1), 202, [14, 12, 9, 15]), (None, 303, [11, 13, 11, 8])];

    /// One session of `pid`; rank 0's steps each wait 1 ms in syncs and
    /// spend 2 ms in one all-reduce (its NCCL library probed); the others
    /// neither. Returns the session id.
    fn session(path: &Path, pid: u32, durations: [u64; 4]) -> i64 {
        let store = Store::open(path).expect("a profile");
        // Its own profiler run, so its own job until the UPDATEs below group them.
        let start = SessionStart { pid, job: format!("run-{pid}"), ..crate::store::testing::start() };
        let id = store.begin_session(&start).expect("session");
        let w = store.spawn_writer(id);
        let nccl = pid == 101;
        let steps = (0..4u64)
            .map(|k| StepRow {
                step: k,
                start_ns: 1000 + k * 100 * MS,
                end_ns: Some(1000 + k * 100 * MS + durations[k as usize] * MS),
                sync_wait_ns: Some(if nccl { MS } else { 0 }),
                ..crate::store::testing::step()
            })
            .collect::<Vec<_>>();
        if nccl {
            w.send(StoreMsg::ProbedFile(ProbedFileRow {
                path: "/x/libnccl.so.2".into(),
                placed: Vec::new(),
                kind: crate::store::NCCL_KIND.into(),
                attached_ns: 0,
                probes: 9,
                how: "test".into(),
            }));
            let calls = steps
                .iter()
                .map(|s| CollectiveRow {
                    tid: 7,
                    op: "all_reduce",
                    count: Some(1000),
                    datatype: Some("float32".into()),
                    bytes: Some(4000),
                    peer: None,
                    comm: Some(1),
                    stream: Some(2),
                    start_ns: s.start_ns + MS,
                    end_ns: s.start_ns + 3 * MS,
                    step: Some(("train", s.step)),
                })
                .collect();
            w.send(StoreMsg::Collectives(calls));
        }
        w.send(StoreMsg::Steps(steps));
        w.finish(crate::samplers::testing::end(), Vec::new()).expect("finish");
        id
    }

    /// An older one-process job `j0`, then job `j1` of [`DURATIONS`]; returns j1's session ids.
    pub(crate) fn job_profile(path: &Path) -> Vec<i64> {
        let old = session(path, 99, [5, 5, 5, 5]);
        let ids: Vec<i64> = DURATIONS.iter().map(|(_, pid, d)| session(path, *pid, *d)).collect();
        let conn = rusqlite::Connection::open(path).expect("open");
        conn.execute("UPDATE sessions SET job = 'j0', rank = 0 WHERE id = ?1", [old]).expect("j0");
        for (id, (rank, _, _)) in ids.iter().zip(DURATIONS) {
            conn.execute("UPDATE sessions SET job = 'j1', rank = ?2 WHERE id = ?1", rusqlite::params![id, rank])
                .expect("j1");
        }
        ids
    }

    /// [`job_profile`] in a temporary directory, opened: (the directory, the profile, j1's session ids).
    pub(crate) fn open() -> (tempfile::TempDir, ProfileDb, Vec<i64>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.db");
        let ids = job_profile(&path);
        (dir, ProfileDb::open(&path).expect("a profile"), ids)
    }
}

#[cfg(test)]
mod tests {
    use super::{testing::open, *};

    #[test]
    fn the_latest_job_is_the_default_and_an_unknown_one_is_named() {
        let (_dir, db, _) = open();
        assert_eq!(resolve_job(&db, "").expect("latest"), "j1");
        assert_eq!(resolve_job(&db, "j0").expect("j0"), "j0");
        let e = resolve_job(&db, "nope").expect_err("unknown").to_string();
        assert!(e.contains("no job nope") && e.contains("j0, j1"), "{e}");
        // A session its profiler gave no job (before multi-process tracing).
        let path = db.path.clone();
        drop(db);
        rusqlite::Connection::open(&path)
            .expect("open")
            .execute("UPDATE sessions SET job = NULL WHERE id = (SELECT max(id) FROM sessions)", [])
            .expect("update");
        let db = ProfileDb::open(&path).expect("a profile");
        let e = resolve_job(&db, "").expect_err("no job").to_string();
        assert!(e.contains("belongs to no job") && e.contains("--session"), "{e}");
    }
}
