//! `profiler merge` and `export --job` on real profiles: the synthetic
//! trainer profiled twice, the second file made another node's (host, rank,
//! a Unix offset 5 s later), merged by the binary; every row there once, the
//! job views and the job's Perfetto trace checked against the two inputs.
use std::{collections::BTreeMap, path::Path, process::Command};

use integration_tests::*;
use serde_json::Value;

/// Profiles `trainer --steps N` run by `profiler run` into `db`, then makes
/// the session node `host`'s rank `rank` of job `it-job`, its clock `shift_ns` later.
fn node(db: &Path, steps: &str, host: &str, rank: i64, shift_ns: i64) {
    let truth = db.with_extension("truth");
    let out = Command::new(profiler_bin())
        .args(["run", "-o", db.to_str().expect("utf-8"), "--no-gpu", "--step-symbol", "train_step", "--"])
        .arg(fixtures().join("trainer"))
        .args(["--steps", steps, "--launches", "5", "--truth", truth.to_str().expect("utf-8")])
        .env("LD_LIBRARY_PATH", fixtures())
        .output()
        .expect("run profiler");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    wait_for_probe_removal();
    open(db)
        .execute(
            "UPDATE sessions SET hostname = ?1, rank = ?2, world_size = 2, job = 'it-job',
                                 unix_offset_ns = unix_offset_ns + ?3",
            rusqlite::params![host, rank, shift_ns],
        )
        .expect("make it a node's");
}

fn count(db: &Path, table: &str) -> i64 {
    open(db).query_row(&format!("SELECT count(*) FROM \"{table}\""), [], |r| r.get(0)).expect("count")
}

/// (step → duration_ns) of the one session in `db`.
fn durations(db: &Path) -> BTreeMap<i64, i64> {
    let c = open(db);
    let mut q = c.prepare("SELECT step, duration_ns FROM steps WHERE duration_ns > 0").expect("q");
    q.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).expect("q").collect::<rusqlite::Result<_>>().expect("q")
}

#[test]
fn two_nodes_merge_into_one_job() {
    let dir = workdir("merge");
    let (a, b, job) = (dir.join("node0.db"), dir.join("node1.db"), dir.join("job.db"));
    node(&a, "8", "node-0", 0, 0);
    node(&b, "6", "node-1", 1, 5_000_000_000);

    let (code, stderr) = profiler_output(&[
        "merge",
        a.to_str().expect("utf-8"),
        b.to_str().expect("utf-8"),
        "-o",
        job.to_str().expect("utf-8"),
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("merged 2 sessions"), "{stderr}");

    // Every table: the two inputs' rows, once (apis: shared, once in all).
    let tables: Vec<String> = open(&job)
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
        .expect("q")
        .query_map([], |r| r.get(0))
        .expect("q")
        .collect::<rusqlite::Result<_>>()
        .expect("q");
    assert!(tables.len() > 15, "{tables:?}");
    for t in &tables {
        let want = if t == "apis" { count(&a, t) } else { count(&a, t) + count(&b, t) };
        assert_eq!(count(&job, t), want, "{t}");
    }
    assert!(count(&job, "launches") > 0 && count(&job, "steps") >= 14);

    // job_steps: per step number both ranks, the spread the inputs say.
    let (d0, d1) = (durations(&a), durations(&b));
    let c = open(&job);
    let mut q = c
        .prepare(
            "SELECT step, ranks, max_ns, min_ns, slowest_rank FROM job_steps WHERE job = 'it-job' AND label = 'train'",
        )
        .expect("q");
    let rows: Vec<(i64, i64, i64, i64, i64)> = q
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
        .expect("q")
        .collect::<rusqlite::Result<_>>()
        .expect("q");
    for (step, ranks, max_ns, min_ns, slowest) in rows {
        let both: Vec<i64> = [d0.get(&step), d1.get(&step)].into_iter().flatten().copied().collect();
        assert_eq!(ranks, both.len() as i64, "step {step}");
        assert_eq!(
            (max_ns, min_ns),
            (*both.iter().max().expect("one"), *both.iter().min().expect("one")),
            "step {step}"
        );
        if both.len() == 2 && both[0] != both[1] {
            assert_eq!(slowest, i64::from(both[1] > both[0]), "step {step}");
        }
    }

    // The job in one trace: each step at its node's Unix time since the job's first start.
    let trace = dir.join("job.json");
    let (code, stderr) = profiler_output(&[
        "export",
        job.to_str().expect("utf-8"),
        "--job",
        "it-job",
        "-o",
        trace.to_str().expect("utf-8"),
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    let starts = |db: &Path| -> Vec<(i64, i64, i64, i64)> {
        let c = open(db);
        let mut q = c
            .prepare("SELECT st.step, st.start_ns + s.unix_offset_ns, s.started_ns + s.unix_offset_ns, s.pid FROM steps st JOIN sessions s ON s.id = st.session_id")
            .expect("q");
        q.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .expect("q")
            .collect::<rusqlite::Result<_>>()
            .expect("q")
    };
    let (s0, s1) = (starts(&a), starts(&b));
    let origin = s0[0].2.min(s1[0].2);
    let mut want = BTreeMap::new();
    // Each process's track is its pid, or its session id where the two nodes' pids coincide.
    let pids_coincide = s0[0].3 == s1[0].3;
    for (session, steps) in [(1, &s0), (2, &s1)] {
        for (step, unix_ns, _, pid) in steps {
            let track = if pids_coincide { session } else { *pid };
            want.insert((track, *step), (unix_ns - origin) as f64 / 1e3);
        }
    }
    let v: Value = serde_json::from_slice(&std::fs::read(&trace).expect("trace")).expect("JSON");
    let mut have = BTreeMap::new();
    for e in v["traceEvents"].as_array().expect("events").iter().filter(|e| e["cat"] == "step") {
        have.insert(
            (e["pid"].as_i64().expect("pid"), e["args"]["step"].as_i64().expect("step")),
            e["ts"].as_f64().expect("ts"),
        );
    }
    assert_eq!(have, want);

    // Never into an input, even with --force: one line, the input untouched.
    let before = std::fs::read(&a).expect("read");
    let (code, stderr) = profiler_output(&[
        "merge",
        a.to_str().expect("utf-8"),
        b.to_str().expect("utf-8"),
        "-o",
        a.to_str().expect("utf-8"),
        "--force",
    ]);
    one_error_line(code, &stderr, "is the input");
    assert_eq!(std::fs::read(&a).expect("read"), before);
}
