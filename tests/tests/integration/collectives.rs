//! NCCL collectives (#14): a trainer whose steps call every probed entry
//! point of a `libnccl.so.2` it loads after the profiler attached
//! (tests/fixtures/nccl_trainer.c, writing its own ground truth), against
//! the stand-in with NCCL's real signatures and against NCCL's own library
//! from the PyTorch wheels (no GPU: calls NCCL answers without one).
use std::{
    path::{Path, PathBuf},
    process::{Child, Command},
    time::Duration,
};

use integration_tests::*;

/// Every probed entry point, as the `probes` rows name them.
const SYMBOLS: [&str; 9] = [
    "ncclAllGather",
    "ncclAllReduce",
    "ncclBroadcast",
    "ncclGroupEnd",
    "ncclGroupStart",
    "ncclRecv",
    "ncclReduce",
    "ncclReduceScatter",
    "ncclSend",
];

/// One call as the trainer saw it, or as the database has it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Call {
    op: String,
    count: Option<i64>,
    datatype: Option<String>,
    bytes: Option<i64>,
    peer: Option<i64>,
    comm: Option<i64>,
    stream: Option<i64>,
}

/// NCCL's names and sizes (nccl.h, 2.30), as the truth's numbers map to them.
fn datatype(n: i64) -> (Option<String>, Option<i64>) {
    const TYPES: [(&str, i64); 12] = [
        ("int8", 1),
        ("uint8", 1),
        ("int32", 4),
        ("uint32", 4),
        ("int64", 8),
        ("uint64", 8),
        ("float16", 2),
        ("float32", 4),
        ("float64", 8),
        ("bfloat16", 2),
        ("float8e4m3", 1),
        ("float8e5m2", 1),
    ];
    match usize::try_from(n).ok().and_then(|i| TYPES.get(i)) {
        Some((name, size)) => (Some(name.to_string()), Some(*size)),
        None if n < 0 => (None, None),
        None => (Some(n.to_string()), None),
    }
}

struct TruthCall {
    step: usize,
    call: Call,
    before_ns: i64,
    after_ns: i64,
}

fn truth_calls(truth: &TruthFile) -> Vec<TruthCall> {
    truth
        .records("coll")
        .map(|r| {
            let op = r[1].to_string();
            let group = op.starts_with("group_");
            let count: i64 = truth.num(&r, 2);
            let (name, size) = datatype(truth.num(&r, 3));
            let peer: i64 = truth.num(&r, 4);
            TruthCall {
                step: truth.num(&r, 0),
                call: Call {
                    op,
                    count: (!group).then_some(count),
                    datatype: name,
                    bytes: size.map(|s| s * count),
                    peer: (peer >= 0).then_some(peer),
                    comm: (!group).then(|| truth.num::<u64>(&r, 5) as i64),
                    stream: (!group).then(|| truth.num::<u64>(&r, 6) as i64),
                },
                before_ns: truth.num(&r, 7),
                after_ns: truth.num(&r, 8),
            }
        })
        .collect()
}

/// (call, start_ns, end_ns, step number) of every collective of the session, in time order.
fn db_calls(db: &Path, session: i64) -> Vec<(Call, i64, i64, Option<i64>)> {
    let conn = open(db);
    let mut q = conn
        .prepare(
            "SELECT op, count, datatype, bytes, peer, comm, stream, start_ns, end_ns, step FROM collectives
             WHERE session_id = ?1 ORDER BY start_ns",
        )
        .expect("prepare");
    q.query_map([session], |r| {
        Ok((
            Call {
                op: r.get(0)?,
                count: r.get(1)?,
                datatype: r.get(2)?,
                bytes: r.get(3)?,
                peer: r.get(4)?,
                comm: r.get(5)?,
                stream: r.get(6)?,
            },
            r.get(7)?,
            r.get(8)?,
            r.get(9)?,
        ))
    })
    .expect("query")
    .collect::<Result<Vec<_>, _>>()
    .expect("rows")
}

struct Run {
    db: PathBuf,
    truth: TruthFile,
    session: i64,
    stderr: String,
}

/// Attaches to the trainer (its step function `train_step`), lets it load
/// `nccl` and run `steps` steps, and reads back both sides.
fn profile(test: &str, nccl: &Path, extra: &[&str], steps: u32) -> Run {
    let dir = workdir(test);
    let (db, truth, go, end) = (dir.join("p.db"), dir.join("truth.txt"), dir.join("go"), dir.join("end"));
    let probed = dir.join("probed");
    let mut trainer: Child = Command::new(fixtures().join("nccl_trainer"))
        .args(["--steps", &steps.to_string(), "--nccl"])
        .arg(nccl)
        .args(extra)
        .arg("--truth")
        .arg(&truth)
        .arg("--wait-file")
        .arg(&go)
        .arg("--end-file")
        .arg(&end)
        .arg("--probed-file")
        .arg(&probed)
        .spawn()
        .expect("start nccl_trainer");
    let agent = Agent::attach(trainer.id(), &db, &["--step-symbol", "train_step", "--no-gpu"]);
    std::fs::write(&go, b"").expect("go");
    // Until the library is probed (it is loaded after the attach): then the steps.
    agent.wait_for("NCCL entry points", Duration::from_secs(60));
    std::fs::write(&probed, b"").expect("probed");
    let t0 = std::time::Instant::now();
    while !truth.exists() {
        assert!(t0.elapsed() < Duration::from_secs(60), "the trainer never finished; {}", agent.stderr());
        std::thread::sleep(Duration::from_millis(10));
    }
    std::fs::write(&end, b"").expect("end");
    let status = trainer.wait().expect("wait trainer");
    assert!(status.success(), "trainer: {status}");
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    let session = last_session(&db).id;
    Run { truth: TruthFile::read(&truth), db, session, stderr }
}

/// Every call exact, in its step, inside the trainer's stamps; per step the bytes exact.
fn assert_matches_truth(run: &Run, steps: usize) {
    let truth = truth_calls(&run.truth);
    let db = db_calls(&run.db, run.session);
    assert_eq!(db.len(), truth.len(), "collectives: {db:#?}\n{}", run.stderr);
    // The steps in time order, against the truth's numbering.
    let db_steps: Vec<i64> = steps_of(&run.db, run.session);
    assert_eq!(db_steps.len(), steps, "steps");
    for (t, (call, start, end, step)) in truth.iter().zip(&db) {
        assert_eq!(call, &t.call);
        assert!(t.before_ns <= *start && start <= end && *end <= t.after_ns, "{call:?}: {start}..{end}");
        assert_eq!(*step, Some(db_steps[t.step]), "{call:?} in the wrong step");
    }
    for (k, step) in db_steps.iter().enumerate() {
        let expected: i64 = truth.iter().filter(|t| t.step == k).filter_map(|t| t.call.bytes).sum();
        let (bytes, ns): (Option<i64>, Option<i64>) = open(&run.db)
            .query_row(
                "SELECT collective_bytes, collective_ns FROM steps WHERE session_id = ?1 AND step = ?2",
                [run.session, *step],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .expect("step row");
        assert_eq!(bytes, Some(expected), "step {k}");
        let in_calls: i64 = db.iter().filter(|c| c.3 == Some(*step)).map(|c| c.2 - c.1).sum();
        assert_eq!(ns, Some(in_calls), "step {k}");
    }
}

/// The session's step numbers, in time order.
fn steps_of(db: &Path, session: i64) -> Vec<i64> {
    let conn = open(db);
    let mut q = conn.prepare("SELECT step FROM steps WHERE session_id = ?1 ORDER BY start_ns").expect("prepare");
    q.query_map([session], |r| r.get(0)).expect("query").collect::<Result<Vec<_>, _>>().expect("rows")
}

/// The `probes` rows of the session's NCCL library: (symbol, offset, reason).
fn placed(db: &Path, session: i64) -> Vec<(String, i64, String)> {
    let conn = open(db);
    let mut q = conn
        .prepare(
            "SELECT p.symbol, p.offset, p.reason FROM probes p JOIN probed_files f
             ON f.session_id = p.session_id AND f.path = p.library
             WHERE p.session_id = ?1 AND f.kind = 'nccl' ORDER BY p.symbol",
        )
        .expect("prepare");
    q.query_map([session], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .expect("query")
        .collect::<Result<Vec<_>, _>>()
        .expect("rows")
}

#[test]
fn every_collective_of_the_stand_in_is_recorded_exactly() {
    // 12 steps: every datatype NCCL defines once (reduce_scatter's).
    let run = profile("stand-in", &fixtures().join("libnccl.so.2"), &[], 12);
    assert_matches_truth(&run, 12);
    let symbols: Vec<String> = placed(&run.db, run.session).into_iter().map(|p| p.0).collect();
    assert_eq!(symbols, SYMBOLS);
}

/// NCCL's genuine library from the PyTorch wheels.
fn genuine_nccl() -> Option<PathBuf> {
    for (_, python) in torch_pythons() {
        // venv/bin/python -> venv/lib/python3.X/site-packages/nvidia/nccl/lib/libnccl.so.2
        let Some(venv) = python.parent().and_then(Path::parent) else { continue };
        let found =
            site_packages(venv).into_iter().map(|s| s.join("nvidia/nccl/lib/libnccl.so.2")).find(|p| p.exists());
        if found.is_some() {
            return found;
        }
    }
    skip("no PyTorch environment with NCCL's libnccl.so.2 (see `cargo xtask torch-env`)");
    None
}

#[test]
fn the_genuine_libnccl_is_probed_at_every_entry_point() {
    let Some(lib) = genuine_nccl() else { return };
    let run = profile("genuine", &lib, &["--genuine"], 3);
    let placed = placed(&run.db, run.session);
    let symbols: Vec<&str> = placed.iter().map(|p| p.0.as_str()).collect();
    assert_eq!(symbols, SYMBOLS, "{}", run.stderr);
    // At their entries, where the stack arguments are at rsp+8.
    assert!(placed.iter().all(|p| p.1 == 0 && p.2.starts_with("entry")), "{placed:?}");
    // The calls NCCL answers without a GPU: the group calls, and a send it refuses.
    assert_matches_truth(&run, 3);
}

/// A job of three ranks (the launcher fixture, a torchrun stand-in), each
/// loading the stand-in NCCL after `attach --children`: every rank's calls
/// exact in its own session, its per-step figures exact (one file-wide probe
/// serves them all), and the slower rank named by `report --job`.
#[test]
fn every_rank_of_a_job_has_its_own_collectives_and_the_slow_one_is_named() {
    const RANKS: usize = 3;
    const STEPS: usize = 8;
    let dir = workdir("nccl_job");
    let (db, go, probed, end) = (dir.join("p.db"), dir.join("go"), dir.join("probed"), dir.join("end"));
    let path = |p: &Path| p.to_str().expect("utf-8").to_owned();
    let trainer = fixtures().join("nccl_trainer");
    let nccl = fixtures().join("libnccl.so.2");
    let steps = STEPS.to_string();
    let mut launcher = Command::new(fixtures().join("launcher"))
        .args(["--ranks", &RANKS.to_string(), "--dir", &path(&dir), "--wait-file", &path(&go)])
        .args(["--rank-args", "1", "--step-sleep-us 6000", "--"])
        .arg(&trainer)
        .args(["--steps", &steps, "--nccl", &path(&nccl), "--probed-file", &path(&probed), "--end-file", &path(&end)])
        .spawn()
        .expect("start the launcher");
    let symbol = format!("{}:train_step", trainer.display());
    let agent =
        Agent::attach(launcher.id(), &db, &["--children", "--no-gpu", "--step-symbol", &symbol, "--job", "nccl"]);
    std::fs::write(&go, b"").expect("go");
    // The first rank's late load probes the file for the whole job.
    agent.wait_for("NCCL entry points", Duration::from_secs(60));
    std::fs::write(&probed, b"").expect("probed");
    let truths: Vec<PathBuf> = (0..RANKS).map(|r| dir.join(format!("rank{r}.txt"))).collect();
    let t0 = std::time::Instant::now();
    while !truths.iter().all(|t| t.exists()) {
        assert!(t0.elapsed() < Duration::from_secs(60), "the ranks never finished; {}", agent.stderr());
        std::thread::sleep(Duration::from_millis(10));
    }
    std::fs::write(&end, b"").expect("end");
    assert!(launcher.wait().expect("wait launcher").success());
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");

    // The launcher's own record: `rank R PID`.
    let launched = std::fs::read_to_string(dir.join("launcher.txt")).expect("launcher.txt");
    let pids: Vec<(usize, i64)> = launched
        .lines()
        .filter_map(|l| l.strip_prefix("rank "))
        .map(|l| {
            let (r, p) = l.split_once(' ').expect("rank R PID");
            (r.parse().expect("rank"), p.trim().parse().expect("pid"))
        })
        .collect();
    assert_eq!(pids.len(), RANKS);
    let conn = open(&db);
    for (rank, pid) in pids {
        let session: i64 = conn
            .query_row("SELECT id FROM sessions WHERE pid = ?1 AND job = 'nccl'", [pid], |r| r.get(0))
            .unwrap_or_else(|e| panic!("rank {rank} (pid {pid}): no session: {e}; {stderr}"));
        let truth = TruthFile::read(&truths[rank]);
        let run = Run { db: db.clone(), truth, session, stderr: stderr.clone() };
        assert_matches_truth(&run, STEPS);
    }
    let json = Command::new(profiler_bin())
        .args(["report", &path(&db), "--job", "nccl", "--format", "json"])
        .output()
        .expect("report --job");
    assert!(json.status.success(), "{}", String::from_utf8_lossy(&json.stderr));
    let report: serde_json::Value = serde_json::from_slice(&json.stdout).expect("JSON");
    assert_eq!(report["slowest_most_often"], serde_json::json!(["rank 1"]), "{report}");
}
