//! Root integration tests of multi-process jobs: the launcher fixture (a torchrun stand-in)
//! starting ranks of the synthetic trainer with RANK/LOCAL_RANK/WORLD_SIZE set, one of them
//! slower, profiled with `run` (children followed) and with `attach --children`; every rank's
//! steps against the ground truth it wrote, its rank read from its environment, and nothing from
//! a foreign trainer (same binary, same libraries) running meanwhile.
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use integration_tests::*;

const RANKS: u32 = 3;

/// A session row of a job.
#[derive(Debug)]
struct JobSession {
    id: i64,
    pid: u32,
    job: String,
    rank: Option<i64>,
    local_rank: Option<i64>,
    world_size: Option<i64>,
    parent_pid: Option<u32>,
    end_reason: Option<String>,
}

fn job_sessions(db: &Path) -> Vec<JobSession> {
    let conn = open(db);
    let mut q = conn
        .prepare("SELECT id, pid, job, rank, local_rank, world_size, parent_pid, end_reason FROM sessions ORDER BY id")
        .expect("prepare");
    q.query_map([], |r| {
        Ok(JobSession {
            id: r.get(0)?,
            pid: r.get(1)?,
            job: r.get(2)?,
            rank: r.get(3)?,
            local_rank: r.get(4)?,
            world_size: r.get(5)?,
            parent_pid: r.get(6)?,
            end_reason: r.get(7)?,
        })
    })
    .expect("query")
    .collect::<Result<Vec<_>, _>>()
    .expect("rows")
}

/// The launcher's own record: (rank, pid) of each rank it started.
fn launched_ranks(dir: &Path) -> Vec<(i64, u32)> {
    let file = TruthFile::read(&dir.join("launcher.txt"));
    file.records("rank").map(|f| (file.num(&f, 0), file.num(&f, 1))).collect()
}

/// `launcher --ranks 3 --dir DIR [extra] -- trainer --steps 30 --launches 40`, rank 1 slower
/// (each step 4 ms longer) and rank 2 dying in its step 20 when `with_death`.
fn launcher_args(dir: &Path, extra: &[&str], with_death: bool) -> Vec<String> {
    let mut a: Vec<String> = vec![
        fixtures().join("launcher").display().to_string(),
        "--ranks".into(),
        RANKS.to_string(),
        "--dir".into(),
        dir.display().to_string(),
        "--rank-args".into(),
        "1".into(),
        "--step-sleep-us 9000".into(),
    ];
    if with_death {
        a.extend(["--rank-args".into(), "2".into(), "--die-in-step 20".into()]);
    }
    a.extend(extra.iter().map(|s| s.to_string()));
    a.push("--".into());
    a.push(fixtures().join("trainer").display().to_string());
    // Ranks live a while (≥ 150 ms), as real ones do: the agent reads a rank's environment from
    // /proc after its exec, on its 20 ms tick.
    a.extend(["--steps", "30", "--launches", "40", "--gap-us", "500", "--step-sleep-us", "5000"].map(String::from));
    a
}

/// The step symbol in the trainer by path: the first target (the launcher) does not have it.
fn step_symbol() -> String {
    format!("{}:train_step", fixtures().join("trainer").display())
}

/// A trainer nobody traces, started from the test (not a child of the launcher), running the
/// same binary with the same libraries while the job runs.
fn foreign_trainer(dir: &Path) -> Trainer {
    let t = Trainer::spawn(dir, &["--forever", "--launches", "20", "--gap-us", "1000"]);
    t.go();
    t
}

/// Every rank's session: one job, its rank from its environment, its parent the launcher, its
/// steps and launches exactly its own ground truth; the dying rank's session ends
/// `target-exited` with the steps it completed. No session or step of the foreign trainer.
fn check_job(db: &Path, dir: &Path, launcher_pid: u32, foreign_pid: u32, died: Option<i64>) {
    let sessions = job_sessions(db);
    let launcher = sessions.iter().find(|s| s.pid == launcher_pid).expect("the launcher's session");
    assert!(sessions.iter().all(|s| s.job == launcher.job), "one job: {sessions:?}");
    assert!(sessions.iter().all(|s| s.pid != foreign_pid), "the foreign trainer has no session: {sessions:?}");
    let ranks = launched_ranks(dir);
    assert_eq!(ranks.len(), RANKS as usize);
    let mut traced_steps = 0;
    for (rank, pid) in ranks {
        let s = sessions.iter().find(|s| s.pid == pid).unwrap_or_else(|| panic!("rank {rank}: no session"));
        assert_eq!((s.rank, s.local_rank, s.world_size), (Some(rank), Some(rank), Some(i64::from(RANKS))), "{s:?}");
        assert_eq!(s.parent_pid, Some(launcher_pid), "{s:?}");
        assert_eq!(s.end_reason.as_deref(), Some("target-exited"), "{s:?}");
        let truth = Truth::read(&dir.join(format!("rank{rank}.txt")));
        let done: Vec<DbStep> = steps(db, s.id).into_iter().filter(|s| s.end_ns.is_some()).collect();
        assert_steps_match(&truth.steps, &done, STEP_TOLERANCE_NS);
        let expected = if died == Some(rank) { 20 } else { 30 };
        assert_eq!(truth.steps.len(), expected, "rank {rank}'s own count");
        let launches = count(db, "SELECT count(*) FROM launches WHERE session_id = ?1", s.id);
        // A dying rank's last step launched before it died: those launches are its too.
        let in_steps = count(
            db,
            "SELECT count(*) FROM launches WHERE session_id = ?1 AND step IN (SELECT step FROM steps WHERE session_id = ?1 AND end_ns IS NOT NULL)",
            s.id,
        );
        assert_eq!(in_steps as u64, truth.steps.iter().map(|t| t.launches).sum::<u64>(), "rank {rank}");
        assert!(launches >= in_steps);
        traced_steps += done.len();
    }
    // Nothing else has steps: not the launcher, not the foreign trainer.
    let all: i64 =
        open(db).query_row("SELECT count(*) FROM steps WHERE end_ns IS NOT NULL", [], |r| r.get(0)).expect("count");
    assert_eq!(all as usize, traced_steps, "steps outside the ranks' sessions");
    assert_eq!(count(db, "SELECT count(*) FROM steps WHERE session_id = ?1", launcher.id), 0);
}

fn profiler_cmd(args: &[String]) -> Command {
    let mut c = Command::new(profiler_bin());
    c.args(args).env("LD_LIBRARY_PATH", fixtures());
    c
}

#[test]
fn run_follows_every_rank_of_a_launcher() {
    let dir = workdir("mp_run");
    let db = dir.join("p.db");
    let foreign = foreign_trainer(&workdir("mp_run_foreign"));
    wait_for_probe_removal();
    // Three stand-in GPUs, sampled once for the job.
    let nvml = fixtures().join("libnvidia-ml.so.1").display().to_string();
    let mut args: Vec<String> =
        ["run", "-o", db.to_str().expect("utf-8"), "--nvml-lib", &nvml, "--step-symbol", &step_symbol(), "--"]
            .map(String::from)
            .to_vec();
    args.extend(launcher_args(&dir, &[], true));
    let out = profiler_cmd(&args).env("STANDIN_NVML_GPUS", "3").output().expect("run profiler");
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Rank 2 died (exit 3): the launcher says so, and `run` passes its status on.
    assert_eq!(out.status.code(), Some(1), "the launcher's exit code: {stderr}");
    let launcher_pid = job_sessions(&db).first().expect("a session").pid;
    check_job(&db, &dir, launcher_pid, foreign.pid(), Some(2));
    let job = &job_sessions(&db)[0].job;
    assert!(stderr.contains(&format!("job {job}")), "{stderr}");
    // Each rank's steps get the GPU its LOCAL_RANK names (the same visible GPUs as the launcher),
    // from the one series of samples, stored with the launcher's session.
    let conn = open(&db);
    for s in job_sessions(&db).iter().filter(|s| s.rank.is_some()) {
        let gpus = step_gpus(&conn, s.id);
        assert_eq!(gpus, vec![s.local_rank.expect("a local rank")], "{s:?}");
        let rows = count(&db, "SELECT count(*) FROM step_gpu WHERE session_id = ?1 AND energy_j IS NOT NULL", s.id);
        let steps = count(&db, "SELECT count(*) FROM steps WHERE session_id = ?1 AND end_ns IS NOT NULL", s.id);
        assert_eq!(rows, steps, "{s:?}: a GPU energy per completed step");
        assert_eq!(count(&db, "SELECT count(*) FROM gpu_samples WHERE session_id = ?1", s.id), 0);
    }
    assert!(count(&db, "SELECT count(*) FROM gpu_samples WHERE session_id = ?1", launcher_pid_session(&db)) > 0);
}

/// The GPUs session `id`'s steps have `step_gpu` rows for.
fn step_gpus(conn: &rusqlite::Connection, id: i64) -> Vec<i64> {
    conn.prepare("SELECT DISTINCT gpu FROM step_gpu WHERE session_id = ?1 ORDER BY gpu")
        .expect("prepare")
        .query_map([id], |r| r.get(0))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows")
}

/// The job's first session (the launcher's, which holds the machine's samples).
fn launcher_pid_session(db: &Path) -> i64 {
    job_sessions(db)[0].id
}

#[test]
fn attach_children_follows_ranks_started_after_it() {
    let dir = workdir("mp_attach");
    let db = dir.join("p.db");
    let go = dir.join("go");
    let foreign = foreign_trainer(&workdir("mp_attach_foreign"));
    let args = launcher_args(&dir, &["--wait-file", go.to_str().expect("utf-8"), "--late-rank-after-ms", "300"], false);
    let mut launcher =
        Command::new(&args[0]).args(&args[1..]).env("LD_LIBRARY_PATH", fixtures()).spawn().expect("launcher");
    let agent = Agent::attach(
        launcher.id(),
        &db,
        &["--children", "--no-gpu", "--step-symbol", &step_symbol(), "--job", "mp-test"],
    );
    std::fs::write(&go, b"").expect("go");
    assert!(launcher.wait().expect("wait launcher").success(), "launcher failed");
    let (status, stderr) = agent.finish();
    assert!(status.success(), "profiler failed: {stderr}");
    check_job(&db, &dir, launcher.id(), foreign.pid(), None);
    assert!(job_sessions(&db).iter().all(|s| s.job == "mp-test"));
}

/// NVML's process lists name the GPUs a rank runs on, ahead of its LOCAL_RANK:
/// the stand-in NVML lists rank r on the GPU LOCAL_RANK would not give it
/// (the reverse order), and each rank's `step_gpu` rows are that GPU's alone.
#[test]
fn a_ranks_gpus_are_those_nvml_lists_it_on() {
    let dir = workdir("mp_nvml_processes");
    let (db, go, listed) = (dir.join("p.db"), dir.join("go"), dir.join("nvml_processes.txt"));
    std::fs::write(&listed, b"").expect("the process list");
    let mut args = launcher_args(&dir, &["--wait-file", go.to_str().expect("utf-8")], false);
    // Ranks that live past two of the sampler's process scans (every 2 s).
    let at = args.iter().position(|a| a == "--steps").expect("the trainer's --steps");
    args[at + 1] = "800".into();
    let mut launcher =
        Command::new(&args[0]).args(&args[1..]).env("LD_LIBRARY_PATH", fixtures()).spawn().expect("launcher");
    let nvml = stand_in_nvml();
    let env = [("STANDIN_NVML_GPUS", "3"), ("STANDIN_NVML_PROCESSES", listed.to_str().expect("utf-8"))];
    let agent = Agent::attach_with_env(
        launcher.id(),
        &db,
        &["--children", "--nvml-lib", &nvml, "--step-symbol", &step_symbol()],
        &env,
    );
    std::fs::write(&go, b"").expect("go");
    let started = std::time::Instant::now();
    let pids = loop {
        // Written whole (renamed into place) once every rank is started.
        if dir.join("launcher.txt").exists() {
            break launched_ranks(&dir);
        }
        assert!(started.elapsed() < Duration::from_secs(30), "the launcher did not start its ranks");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(pids.len(), RANKS as usize, "the launcher's record of its ranks");
    let lines: String = pids.iter().map(|(r, pid)| format!("{} {pid}\n", i64::from(RANKS) - 1 - r)).collect();
    // Whole, as NVML would list them: written aside, then renamed over the empty list.
    let aside = dir.join("nvml_processes.tmp");
    std::fs::write(&aside, lines).expect("the process list");
    std::fs::rename(&aside, &listed).expect("the process list");
    assert!(launcher.wait().expect("wait launcher").success(), "launcher failed");
    let (status, stderr) = agent.finish();
    assert!(status.success(), "profiler failed: {stderr}");
    let conn = open(&db);
    let logical = |nvml_index: u32| -> i64 {
        conn.query_row("SELECT gpu FROM gpus WHERE nvml_index = ?1", [nvml_index], |r| r.get(0)).expect("the GPU")
    };
    let ranks: Vec<JobSession> = job_sessions(&db).into_iter().filter(|s| s.rank.is_some()).collect();
    assert_eq!(ranks.len(), RANKS as usize, "a session per rank");
    for s in &ranks {
        let rank = s.rank.expect("a rank") as u32;
        let gpus = step_gpus(&conn, s.id);
        assert_eq!(gpus, vec![logical(RANKS - 1 - rank)], "rank {rank}: the GPU NVML listed it on");
        assert_ne!(Some(gpus[0]), s.local_rank.filter(|_| rank != RANKS / 2), "rank {rank}: not its LOCAL_RANK's");
    }
}

#[test]
fn attach_several_pids_names_a_bad_one_once_and_traces_the_others() {
    let dirs: Vec<PathBuf> = (0..2).map(|i| workdir(&format!("mp_pids{i}"))).collect();
    let db = dirs[0].join("p.db");
    let mut trainers: Vec<Trainer> =
        dirs.iter().map(|d| Trainer::spawn(d, &["--steps", "20", "--launches", "30"])).collect();
    // Past any pid_max: no such process.
    let bad = "4294967295";
    let mut args: Vec<String> =
        vec!["attach".into(), trainers[0].pid().to_string(), bad.into(), trainers[1].pid().to_string()];
    args.extend(["-o", db.to_str().expect("utf-8"), "--no-gpu", "--step-symbol", "train_step"].map(String::from));
    let agent = Agent::start(&args, true);
    for t in &trainers {
        t.go();
    }
    for t in &mut trainers {
        assert!(t.wait().success(), "trainer failed");
    }
    let (status, stderr) = agent.finish();
    assert!(status.success(), "profiler failed: {stderr}");
    assert_eq!(stderr.matches(&format!("no process with PID {bad}")).count(), 1, "{stderr}");
    let sessions = job_sessions(&db);
    assert_eq!(sessions.len(), 2, "{sessions:?}");
    for t in &trainers {
        let s = sessions.iter().find(|s| s.pid == t.pid()).expect("a session per PID");
        assert_eq!((s.rank, s.parent_pid), (None, None), "no RANK in its environment, named on the command line");
        assert_eq!(s.end_reason.as_deref(), Some("target-exited"));
        assert_steps_match(&t.truth().steps, &steps(&db, s.id), STEP_TOLERANCE_NS);
    }
}

/// The PyTorch environment's python (`cargo xtask torch-env`), or None (said once).
fn torch_python() -> Option<PathBuf> {
    integration_tests::torch_python("python3.11")
}

/// `python -m torch.distributed.run --nproc-per-node 2 torch_loop.py …`: two CPU ranks, each
/// writing its own ground truth to DIR/truth<RANK>.txt.
fn torchrun_args(python: &Path, dir: &Path, port: u32, wait_file: Option<&Path>) -> Vec<String> {
    let mut a = vec![python.display().to_string(), "-m".into(), "torch.distributed.run".into()];
    a.extend(torchrun_options(dir, port, wait_file));
    a
}

/// The environment's `torchrun` script (its `#!` line names the environment's python), as users run it.
fn torchrun_script_args(python: &Path, dir: &Path, port: u32) -> Vec<String> {
    let script = python.parent().expect("the environment's bin/").join("torchrun");
    std::iter::once(script.display().to_string()).chain(torchrun_options(dir, port, None)).collect()
}

fn torchrun_options(dir: &Path, port: u32, wait_file: Option<&Path>) -> Vec<String> {
    let loop_py = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/torch_loop.py");
    [
        "--nproc-per-node".into(),
        "2".into(),
        "--master-port".into(),
        port.to_string(),
        loop_py.display().to_string(),
        "--steps".into(),
        "15".into(),
        "--truth".into(),
        format!("{}/truth{{rank}}.txt", dir.display()),
    ]
    .into_iter()
    .chain(wait_file.into_iter().flat_map(|w| ["--wait-file".to_string(), w.display().to_string()]))
    .collect()
}

/// Two rank sessions, their ranks from their environment, each with its own optimizer steps
/// (PyTorch's markers), on the threads its ground truth names.
/// `attempts`: how many workers each rank had (torchrun restarts); only the last one's trained.
/// `stderr`: the profiler's, for the failure's message.
fn check_torch_ranks(db: &Path, dir: &Path, attempts: usize, stderr: &str) {
    let sessions = job_sessions(db);
    assert!(sessions.iter().all(|s| s.job == sessions[0].job), "one job: {sessions:?}");
    let ranks: Vec<&JobSession> = sessions.iter().filter(|s| s.rank.is_some()).collect();
    assert_eq!(ranks.len(), 2 * attempts, "{sessions:?}\nthe profiler's stderr:\n{stderr}");
    let (failed, trained): (Vec<&JobSession>, Vec<&JobSession>) =
        ranks.into_iter().partition(|s| steps(db, s.id).is_empty());
    assert_eq!(failed.len(), 2 * (attempts - 1), "{sessions:?}");
    assert!(failed.iter().all(|s| s.end_reason.as_deref() == Some("target-exited")), "{failed:?}");
    for s in trained {
        let rank = s.rank.expect("a rank");
        assert_eq!((s.local_rank, s.world_size), (Some(rank), Some(2)), "{s:?}");
        let truth = TruthFile::read(&dir.join(format!("truth{rank}.txt")));
        let truth_tids: Vec<u32> = truth.records("step").map(|f| truth.num(&f, 1)).collect();
        let done: Vec<DbStep> = steps(db, s.id).into_iter().filter(|s| s.end_ns.is_some()).collect();
        assert_eq!(done.len(), truth_tids.len(), "rank {rank}'s optimizer steps");
        assert!(done.iter().all(|d| truth_tids.contains(&d.tid) && d.label == "train"), "rank {rank}: {done:?}");
    }
}

#[test]
fn torchrun_ranks_on_cpu_with_run_and_attach_children() {
    let Some(python) = torch_python() else { return };
    // `run -- torchrun …` (the script): torchrun's workers followed from their start.
    let dir = workdir("mp_torchrun");
    let db = dir.join("p.db");
    let mut args: Vec<String> = ["run", "-o", db.to_str().expect("utf-8"), "--no-gpu", "--"].map(String::from).to_vec();
    args.extend(torchrun_script_args(&python, &dir, 29500 + std::process::id() % 500));
    wait_for_probe_removal();
    let out = Command::new(profiler_bin()).args(&args).output().expect("run profiler");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    check_torch_ranks(&db, &dir, 1, &stderr);
    // `report` without --session shows a rank that trained, not torchrun itself (the first
    // session) nor another of its processes, and says how many processes the job has.
    let report =
        Command::new(profiler_bin()).args(["report", db.to_str().expect("utf-8"), "--format", "json"]).output();
    let report = report.expect("run report");
    assert!(report.status.success(), "{}", String::from_utf8_lossy(&report.stderr));
    let json: serde_json::Value = serde_json::from_slice(&report.stdout).expect("report JSON");
    let (id, sessions) = (json["session"]["id"].as_i64().expect("a session id"), job_sessions(&db));
    assert!(json["session"]["rank"].is_i64() && !steps(&db, id).is_empty(), "default session {id}: {sessions:?}");
    assert_eq!(json["session"]["job_processes"].as_i64(), Some(sessions.len() as i64));
    // `attach --children` right after torchrun starts: the workers it has started by then are
    // found in /proc, the later ones by the fork hook. They train once the agent is in.
    let dir = workdir("mp_torchrun_attach");
    let (db, go) = (dir.join("p.db"), dir.join("go"));
    let a = torchrun_args(&python, &dir, 30000 + std::process::id() % 500, Some(&go));
    let mut torchrun = Command::new(&a[0]).args(&a[1..]).spawn().expect("torchrun");
    let agent = Agent::attach(torchrun.id(), &db, &["--children", "--no-gpu"]);
    std::fs::write(&go, b"").expect("go");
    assert!(torchrun.wait().expect("wait torchrun").success(), "torchrun failed");
    let (status, stderr) = agent.finish();
    assert!(status.success(), "profiler failed: {stderr}");
    check_torch_ranks(&db, &dir, 1, &stderr);
}

/// An elastic restart: torchrun's first workers fail (once the agent is in), torchrun starts new
/// ones, which `attach --children` follows: their sessions have their ranks and their steps, and
/// the failed workers' sessions ended `target-exited` with none.
#[test]
fn torchrun_restarted_workers_are_traced() {
    let Some(python) = torch_python() else { return };
    let dir = workdir("mp_torchrun_restart");
    let (db, go) = (dir.join("p.db"), dir.join("go"));
    let mut a = torchrun_args(&python, &dir, 30500 + std::process::id() % 500, Some(&go));
    a.splice(3..3, ["--max-restarts".to_string(), "1".to_string()]);
    a.push("--fail-first-attempt".into());
    let mut torchrun = Command::new(&a[0]).args(&a[1..]).spawn().expect("torchrun");
    let agent = Agent::attach(torchrun.id(), &db, &["--children", "--no-gpu"]);
    std::fs::write(&go, b"").expect("go");
    assert!(torchrun.wait().expect("wait torchrun").success(), "torchrun failed");
    let (status, stderr) = agent.finish();
    assert!(status.success(), "profiler failed: {stderr}");
    check_torch_ranks(&db, &dir, 2, &stderr);
}
