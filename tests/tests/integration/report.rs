//! What users see: `profiler report` checked against SQL computed here and the
//! trainer's own ground truth, the Perfetto export parsed and validated event
//! by event, CSV exports, a large export within bounded memory, and `doctor`
//! on this machine, for a process, and without privileges.
use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use integration_tests::*;
use rusqlite::{Connection, params};
use serde_json::Value;

const SKIP: i64 = 3;

/// Runs `profiler ARGS`; returns (exit code, stdout, stderr).
fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(profiler_bin()).args(args).output().expect("run profiler");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `profiler ARGS` and expects success; returns stdout.
fn stdout_of(args: &[&str]) -> String {
    let (code, out, err) = run(args);
    assert_eq!(code, Some(0), "profiler {args:?} failed: {err}");
    out
}

/// A CTE of the measured steps: label 'train', after the first `skip` by
/// start time, completed. Parameters: ?1 session, ?2 skip.
fn used_cte() -> &'static str {
    "WITH ranked AS (SELECT s.*, label AS lbl,
                            ROW_NUMBER() OVER (PARTITION BY label ORDER BY start_ns, step) AS rn
                     FROM steps s WHERE session_id = ?1),
          used AS (SELECT * FROM ranked WHERE rn > ?2 AND end_ns IS NOT NULL AND lbl = 'train')"
}

/// Nearest-rank percentile of `expr` over the measured steps, by SQL.
fn sql_percentile(conn: &Connection, session: i64, expr: &str, p: i64) -> Option<f64> {
    let cte = used_cte();
    let n: i64 = conn
        .query_row(&format!("{cte} SELECT count(*) FROM used WHERE {expr} IS NOT NULL"), params![session, SKIP], |r| {
            r.get(0)
        })
        .expect("count");
    if n == 0 {
        return None;
    }
    let rank = (p * n + 99) / 100;
    Some(
        conn.query_row(
            &format!("{cte} SELECT {expr} FROM used WHERE {expr} IS NOT NULL ORDER BY {expr} LIMIT 1 OFFSET ?3"),
            params![session, SKIP, rank - 1],
            |r| r.get(0),
        )
        .expect("percentile"),
    )
}

fn close(a: f64, b: f64, what: &str) {
    assert!((a - b).abs() <= 1e-9 * b.abs().max(1.0), "{what}: report {a} vs SQL {b}");
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("a number, got {v}"))
}

#[test]
fn report_matches_sql_and_ground_truth() {
    let dir = workdir("report");
    let db = dir.join("p.db");
    // Session 1 keeps only counts; session 2 (the latest) keeps every launch row.
    profile_into(&dir, &db, &["--steps", "5", "--launches", "10"], &["--launches", "count"]);
    let truth = profile_into(
        &dir,
        &db,
        &["--threads", "2", "--steps", "25", "--launches", "40", "--step-sleep-us", "3000", "--gap-us", "1000"],
        &["--gpu-interval", "10"],
    );
    let dbs = db.display().to_string();
    let conn = open(&db);
    let session = last_session(&db);
    assert_eq!(session.id, 2);

    let json: Value =
        serde_json::from_str(&stdout_of(&["report", &dbs, "--skip", &SKIP.to_string(), "--format", "json"]))
            .expect("report JSON parses");
    assert_eq!(json["report_version"], 1);
    assert_eq!(json["skip"], SKIP);
    let s = &json["session"];
    assert_eq!(s["id"], 2, "the latest session by default");
    assert_eq!(s["pid"], session.pid);
    assert_eq!(s["lost_events"], 0);
    assert_eq!(s["total_launches"].as_i64(), session.total_launches);
    assert_eq!(s["end_reason"], "target-exited");
    close(
        f(&s["duration_s"]),
        (session.ended_ns.expect("ended") - session.started_ns) as f64 / 1e9,
        "session duration",
    );
    let caps: i64 = count(&db, "SELECT count(*) FROM capabilities WHERE session_id = ?1", session.id);
    assert_eq!(json["capabilities"].as_array().map(Vec::len), Some(caps as usize));

    let labels = json["labels"].as_array().expect("labels");
    assert_eq!(labels.len(), 1);
    let l = &labels[0];
    assert_eq!(l["label"], "train");
    // Ground truth: 2 threads × 25 steps, 40 launches each, all completed.
    assert_eq!(l["steps"].as_u64(), Some(truth.steps.len() as u64));
    assert_eq!(l["steps"], 50);
    assert_eq!(l["completed"], 50);
    assert_eq!(l["skipped"], SKIP);
    assert_eq!(l["measured"], 50 - SKIP);
    for stat in ["p50", "p90", "p99", "max", "mean"] {
        assert_eq!(f(&l["launches_per_step"][stat]), 40.0, "launches per step {stat}");
    }

    // Percentiles against SQL.
    for (key, expr) in [("step_time_ms", "duration_ns / 1e6"), ("inter_step_ms", "inter_step_ns / 1e6")] {
        for (stat, p) in [("p50", 50), ("p90", 90), ("p99", 99), ("max", 100)] {
            let want = sql_percentile(&conn, session.id, expr, p).expect("values");
            close(f(&l[key][stat]), want, &format!("{key}.{stat}"));
        }
    }
    let cte = used_cte();
    let (n, mean_ms, first, last): (i64, f64, i64, i64) = conn
        .query_row(
            &format!("{cte} SELECT count(*), avg(duration_ns) / 1e6, min(start_ns), max(end_ns) FROM used"),
            params![session.id, SKIP],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .expect("aggregate");
    assert_eq!(n, 50 - SKIP);
    close(f(&l["step_time_ms"]["mean"]), mean_ms, "step time mean");
    close(f(&l["steps_per_s"]), n as f64 / ((last - first) as f64 / 1e9), "steps/s");

    // Against the trainer's own clock: the median of the very steps the report
    // used (each database step paired with its truth step, the first SKIP by
    // start left out as the report does), within the probes' boundary error
    // (p99 ~20 µs; 0.3 ms leaves room for a preempted probe on a loaded machine).
    let db_steps = steps(&db, session.id);
    assert_steps_match(&truth.steps, &db_steps, STEP_TOLERANCE_NS);
    let mut pairs: Vec<(&DbStep, &TruthStep)> = db_steps.iter().zip(&truth.steps).collect();
    pairs.sort_by_key(|(d, _)| (d.start_ns, d.step));
    let truth_ms: Vec<f64> =
        pairs.iter().skip(SKIP as usize).map(|(_, t)| (t.end_ns - t.start_ns) as f64 / 1e6).collect();
    let truth_p50 = percentile(&truth_ms, 50.0).expect("measured steps");
    let p50 = f(&l["step_time_ms"]["p50"]);
    println!("step p50: report {p50:.4} ms, trainer {truth_p50:.4} ms, Δ {:.1} µs", 1e3 * (p50 - truth_p50));
    assert!((p50 - truth_p50).abs() < 0.3, "step p50 {p50} ms vs the trainer's {truth_p50} ms");

    // Sync wait.
    let share: Option<f64> = conn
        .query_row(
            &format!(
                "{cte} SELECT sum(sync_wait_ns) * 1.0 / sum(duration_ns) FROM used WHERE sync_wait_ns IS NOT NULL"
            ),
            params![session.id, SKIP],
            |r| r.get(0),
        )
        .expect("share");
    assert_eq!(l["sync_wait_share"].as_f64(), share);

    // GPU energy per step against SQL, and against the stand-in's known power (100 + 50 g W).
    let mut q = conn
        .prepare(&format!(
            "{cte} SELECT g.gpu, count(g.energy_j), avg(g.energy_j), avg(g.energy_error_j),
                          sum(g.energy_j) / (sum(u.duration_ns) / 1e9)
             FROM step_gpu g JOIN used u ON u.step = g.step AND g.label = u.lbl
             WHERE g.session_id = ?1 AND g.energy_j IS NOT NULL GROUP BY g.gpu ORDER BY g.gpu"
        ))
        .expect("prepare");
    let want: Vec<(i64, i64, f64, f64, f64)> = q
        .query_map(params![session.id, SKIP], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    let gpus = l["gpus"].as_array().expect("GPU figures with the stand-in NVML");
    assert_eq!(gpus.len(), want.len());
    assert_eq!(want.len(), 2, "the stand-in has 2 GPUs");
    let mut total = 0.0;
    for (g, (gpu, n, energy, error, power)) in gpus.iter().zip(&want) {
        assert_eq!(g["gpu"].as_i64(), Some(*gpu));
        assert_eq!(g["steps"].as_i64(), Some(*n));
        assert_eq!(*n, 50 - SKIP);
        assert_eq!(g["name"], "Stand-in H200");
        close(f(&g["energy_per_step_j"]), *energy, "GPU energy per step");
        close(f(&g["energy_error_per_step_j"]), *error, "GPU energy error per step");
        close(f(&g["avg_power_w"]), *power, "GPU average power");
        let known = 100.0 + 50.0 * *gpu as f64;
        // Within the stated bound (as power: the energy bound over the mean step time), or 3 %.
        let tolerance = (error * power / energy).max(0.03 * known);
        assert!(
            (power - known).abs() <= tolerance,
            "GPU {gpu}: {power} W vs the stand-in's {known} W (tolerance {tolerance} W)"
        );
        total += energy;
    }
    // No RAPL (an empty powercap root): CPU and DRAM absent, not zero.
    assert!(l["cpu"].is_null(), "{}", l["cpu"]);
    assert!(l["dram"].is_null(), "{}", l["dram"]);
    close(f(&l["energy_per_step_j"]), total, "total energy per step");
    assert_eq!(l["energy_components"], serde_json::json!(["GPU 0", "GPU 1"]));

    // Top kernels against SQL.
    let mut q = conn
        .prepare(
            "SELECT function, count(*), count(*) * 1.0 / (SELECT count(*) FROM launches WHERE session_id = ?1)
             FROM launches WHERE session_id = ?1 GROUP BY function ORDER BY 2 DESC, 1 LIMIT 10",
        )
        .expect("prepare");
    let top: Vec<(i64, i64, f64)> = q
        .query_map([session.id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    let kernels = json["top_kernels"].as_array().expect("top kernels");
    assert_eq!(kernels.len(), top.len());
    for (k, (function, n, share)) in kernels.iter().zip(&top) {
        assert_eq!(k["function"].as_i64(), Some(*function));
        assert_eq!(k["launches"].as_i64(), Some(*n));
        close(f(&k["share"]), *share, "kernel share");
        assert_eq!(k["api"], "cuLaunchKernel", "the trainer's default entry point");
    }

    // The table: 80 columns, the same figures.
    let table = stdout_of(&["report", &dbs, "--skip", &SKIP.to_string()]);
    println!("{table}");
    assert_fits_80_columns(&table);
    let row = |name: &str| table.lines().find(|line| line.trim_start().starts_with(name)).map(str::to_owned);
    let step_row = row("step time (ms)").expect("step time row");
    assert!(step_row.contains(&format!("{:.3}", f(&l["step_time_ms"]["p50"]))), "{step_row}");
    assert!(step_row.contains(&format!("{:.3}", f(&l["step_time_ms"]["p99"]))), "{step_row}");
    let cpu_row = row("CPU package").expect("CPU row");
    assert!(cpu_row.contains('–') && !cpu_row.contains('0'), "CPU energy absent: {cpu_row}");
    let gpu_row = row("GPU 1").expect("GPU 1 row");
    assert!(gpu_row.contains(&format!("{:.3}", f(&gpus[1]["energy_per_step_j"]))), "{gpu_row}");
    assert!(table.contains(&format!("train: 50 steps, 50 completed, {SKIP} skipped, {} measured", 50 - SKIP)));

    // CSV: one figure per row, the same values.
    let csv_text = stdout_of(&["report", &dbs, "--skip", &SKIP.to_string(), "--format", "csv"]);
    let mut rdr = csv::Reader::from_reader(csv_text.as_bytes());
    assert_eq!(
        rdr.headers().expect("header").iter().collect::<Vec<_>>(),
        ["section", "label", "metric", "value", "unit"]
    );
    let figures: BTreeMap<(String, String), String> = rdr
        .records()
        .map(|r| r.expect("record"))
        .map(|r| ((r[0].to_string(), r[2].to_string()), r[3].to_string()))
        .collect();
    let fig = |section: &str, metric: &str| figures.get(&(section.into(), metric.into())).cloned();
    assert_eq!(fig("steps", "measured").as_deref(), Some("47"));
    let p90: f64 = fig("steps", "step_time_p90").expect("p90").parse().expect("number");
    close(p90, f(&l["step_time_ms"]["p90"]), "CSV p90");
    assert_eq!(fig("energy", "cpu_energy_per_step").as_deref(), Some(""), "absent is an empty field");
    assert_eq!(fig("session", "pid"), Some(session.pid.to_string()));

    // --session, --label.
    let first: Value =
        serde_json::from_str(&stdout_of(&["report", &dbs, "--session", "1", "--format", "json"])).expect("JSON");
    assert_eq!(first["session"]["id"], 1);
    assert_eq!(first["session"]["launch_mode"], "count");
    assert!(first["top_kernels"].is_null(), "launch rows not kept: absent, not an empty list");
    assert_eq!(first["labels"][0]["steps"], 5);
    assert_eq!(first["labels"][0]["launches_per_step"]["max"], 10.0);
    let t1 = stdout_of(&["report", &dbs, "--session", "1"]);
    assert!(t1.contains("launch rows not kept"), "{t1}");
    let by_label: Value =
        serde_json::from_str(&stdout_of(&["report", &dbs, "--label", "train", "--format", "json"])).expect("JSON");
    assert_eq!(by_label["label_filter"], "train");
    assert_eq!(by_label["labels"][0]["measured"], 50);
    let (code, _, err) = run(&["report", &dbs, "--label", "validate"]);
    assert_eq!(code, Some(1));
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains("no steps labelled 'validate'") && err.contains("train"), "{err}");
    let (code, _, err) = run(&["report", &dbs, "--session", "9"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("has no session 9; its sessions are 1, 2"), "{err}");
}

#[test]
fn report_and_export_reject_what_is_not_a_profile() {
    let dir = workdir("not-a-profile");
    let missing = dir.join("missing.db").display().to_string();
    let text = dir.join("text.db");
    std::fs::write(&text, "not a database, but long enough to have what would be a SQLite header....").expect("write");
    let other = dir.join("other.db");
    Connection::open(&other).expect("create").execute_batch("CREATE TABLE t (x); INSERT INTO t VALUES (1)").expect("t");
    for (path, message) in [
        (missing.clone(), "does not exist"),
        (text.display().to_string(), "is not a SQLite database"),
        (other.display().to_string(), "not a profile"),
    ] {
        for cmd in [vec!["report", &path], vec!["export", &path, "-o", "/dev/null"]] {
            let (code, out, err) = run(&cmd);
            assert_eq!(code, Some(1), "{cmd:?}");
            assert!(out.is_empty(), "{cmd:?} printed {out}");
            assert_eq!(err.lines().count(), 1, "{cmd:?}: one line, got {err}");
            assert!(err.starts_with("profiler: error: ") && err.contains(message), "{cmd:?}: {err}");
        }
    }
    // Read-only: nothing was created or changed.
    assert!(!Path::new(&missing).exists());
    let n: i64 = open(&other).query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0)).expect("count");
    assert_eq!(n, 1);
}

/// One parsed trace event.
#[derive(Debug)]
struct Ev {
    ph: String,
    name: String,
    cat: Option<String>,
    ts: f64,
    dur: Option<f64>,
    tid: i64,
    args: Value,
}

/// Parses the trace and checks that every event is well-formed for its phase.
fn parse_trace(path: &Path, pid: i64) -> Vec<Ev> {
    let text = std::fs::read_to_string(path).expect("read trace");
    let v: Value = serde_json::from_str(&text).expect("the trace is JSON");
    let events = v["traceEvents"].as_array().expect("traceEvents array");
    events
        .iter()
        .map(|e| {
            let o = e.as_object().unwrap_or_else(|| panic!("event is an object: {e}"));
            let ph = o["ph"].as_str().unwrap_or_else(|| panic!("ph: {e}")).to_string();
            let name = o["name"].as_str().unwrap_or_else(|| panic!("name: {e}")).to_string();
            assert!(!name.is_empty(), "{e}");
            let ts = o["ts"].as_f64().unwrap_or_else(|| panic!("ts: {e}"));
            assert!(ts.is_finite(), "{e}");
            assert_eq!(o["pid"].as_i64(), Some(pid), "{e}");
            let tid = o["tid"].as_i64().unwrap_or_else(|| panic!("tid: {e}"));
            let dur = o.get("dur").map(|d| d.as_f64().unwrap_or_else(|| panic!("dur: {e}")));
            match ph.as_str() {
                "M" if name == "thread_sort_index" => assert!(o["args"]["sort_index"].is_i64(), "{e}"),
                "M" => {
                    assert!(["process_name", "thread_name"].contains(&name.as_str()), "{e}");
                    assert!(o["args"]["name"].is_string(), "{e}");
                }
                "X" => assert!(dur.is_some_and(|d| d >= 0.0), "complete event with a duration: {e}"),
                "B" => assert!(dur.is_none(), "{e}"),
                "i" => assert_eq!(o["s"], "t", "thread-scoped instant: {e}"),
                "C" => {
                    let args = o["args"].as_object().unwrap_or_else(|| panic!("counter args: {e}"));
                    assert_eq!(args.len(), 1, "one series per counter: {e}");
                    assert!(args.values().all(|v| v.as_f64().is_some_and(f64::is_finite)), "numeric: {e}");
                }
                other => panic!("unexpected phase {other}: {e}"),
            }
            Ev {
                ph,
                name,
                cat: o.get("cat").and_then(Value::as_str).map(str::to_owned),
                ts,
                dur,
                tid,
                args: o.get("args").cloned().unwrap_or(Value::Null),
            }
        })
        .collect()
}

/// Per thread, slices (steps, and syncs inside them) nest properly: sorted
/// by start, each one either ends before the next starts or contains it; an
/// unfinished one ("B") is the thread's last.
/// A thread's scheduler track: its tid plus this.
const SCHED_TRACK: i64 = 1 << 31;

/// Each thread with `off_cpu` rows has a scheduler track whose slices follow
/// one another: per row a `runnable` slice (after a `sleeping` or `blocked`
/// one for a row with a wakeup), and `running` between two rows.
fn assert_sched_slices(events: &[Ev], conn: &rusqlite::Connection, session: i64) {
    let want: BTreeMap<i64, (i64, i64)> = conn
        .prepare("SELECT tid, count(*), count(woken_ns) FROM off_cpu WHERE session_id = ?1 GROUP BY tid")
        .expect("prepare")
        .query_map([session], |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?))))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert!(!want.is_empty(), "the trainer's threads left their CPU while traced");
    let mut tracks: BTreeMap<i64, Vec<&Ev>> = BTreeMap::new();
    for e in events.iter().filter(|e| e.cat.as_deref() == Some("sched")) {
        assert_eq!(e.ph, "X", "{}", e.name);
        tracks.entry(e.tid - SCHED_TRACK).or_default().push(e);
    }
    assert_eq!(tracks.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
    for (tid, slices) in &mut tracks {
        let (rows, woken) = want[tid];
        let by = |name: &str| slices.iter().filter(|e| e.name == name).count() as i64;
        assert_eq!(by("runnable"), rows, "thread {tid}");
        assert_eq!(by("sleeping") + by("blocked"), woken, "thread {tid}");
        assert_eq!(by("running"), rows - 1, "thread {tid}");
        slices.sort_by(|a, b| a.ts.total_cmp(&b.ts));
        for w in slices.windows(2) {
            let end = w[0].ts + w[0].dur.expect("dur");
            assert!(end <= w[1].ts + 1e-3, "thread {tid}: {} overlaps the next {}", w[0].name, w[1].name);
        }
        let names = events.iter().filter(|e| e.tid == tid + SCHED_TRACK && e.name == "thread_name").count();
        assert_eq!(names, 1, "thread {tid}: its scheduler track is named");
    }
}

fn assert_nested(events: &[Ev]) {
    let mut per_thread: BTreeMap<i64, Vec<&Ev>> = BTreeMap::new();
    // Scheduler states follow one another on their own track (`assert_sched_slices`).
    for e in events.iter().filter(|e| (e.ph == "X" || e.ph == "B") && e.cat.as_deref() != Some("sched")) {
        per_thread.entry(e.tid).or_default().push(e);
    }
    let end_of = |e: &Ev| e.dur.map_or(f64::INFINITY, |d| e.ts + d);
    for (tid, mut v) in per_thread {
        // By start; of two starting together, the longer one encloses the other.
        v.sort_by(|a, b| a.ts.total_cmp(&b.ts).then(end_of(b).total_cmp(&end_of(a))));
        // A thread runs one step at a time: its steps follow one another.
        let steps: Vec<&&Ev> = v.iter().filter(|e| e.cat.as_deref() == Some("step")).collect();
        for w in steps.windows(2) {
            assert!(end_of(w[0]) <= w[1].ts, "thread {tid}: step {} overlaps {}", w[0].name, w[1].name);
        }
        let mut open_ends: Vec<f64> = Vec::new();
        for (i, e) in v.iter().enumerate() {
            while open_ends.last().is_some_and(|&end| end <= e.ts) {
                open_ends.pop();
            }
            let end = end_of(e);
            if let Some(&parent_end) = open_ends.last() {
                assert!(end <= parent_end, "thread {tid}: {} overlaps its enclosing slice", e.name);
            }
            if e.ph == "B" {
                assert_eq!(i, v.len() - 1, "thread {tid}: an unfinished step is the thread's last slice");
            }
            open_ends.push(end);
        }
    }
}

#[test]
fn perfetto_export_is_well_formed_and_matches_the_database() {
    let dir = workdir("perfetto");
    let db = dir.join("p.db");
    // Stopped with SIGINT while the trainer runs: each thread's last step is
    // still running (20 ms steps, no gap), so the trace has unfinished steps too.
    let trainer =
        Trainer::spawn(&dir, &["--forever", "--threads", "2", "--launches", "20", "--step-sleep-us", "20000"]);
    let nvml = stand_in_nvml();
    let no_rapl = no_rapl_root(&dir);
    let agent = Agent::attach(
        trainer.pid(),
        &db,
        &["--step-symbol", "train_step", "--nvml-lib", &nvml, "--gpu-interval", "20", "--powercap-root", &no_rapl],
    );
    trainer.go();
    std::thread::sleep(Duration::from_millis(1500));
    agent.signal(libc::SIGINT);
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    drop(trainer);
    let s = last_session(&db);
    let pid = i64::from(s.pid);
    let trace = dir.join("trace.json");
    let (code, _, err) =
        run(&["export", &db.display().to_string(), "--format", "perfetto", "-o", &trace.display().to_string()]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("ui.perfetto.dev"), "{err}");
    let events = parse_trace(&trace, pid);
    let conn = open(&db);

    // Thread tracks: one name per thread that stepped or launched.
    let threads: BTreeSet<i64> = conn
        .prepare("SELECT tid FROM steps WHERE session_id = ?1 UNION SELECT tid FROM launches WHERE session_id = ?1")
        .expect("prepare")
        .query_map([s.id], |r| r.get(0))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    let named: BTreeSet<i64> =
        events.iter().filter(|e| e.name == "thread_name" && e.tid < SCHED_TRACK).map(|e| e.tid).collect();
    assert_eq!(named, threads);
    assert_eq!(threads.len(), 2);
    assert_eq!(events.iter().filter(|e| e.name == "process_name").count(), 1);

    // Steps: one slice per row, named and placed as the database says.
    let steps = steps(&db, s.id);
    let slices: Vec<&Ev> = events.iter().filter(|e| e.cat.as_deref() == Some("step")).collect();
    assert_eq!(slices.len(), steps.len());
    let unfinished = steps.iter().filter(|s| s.end_ns.is_none()).count();
    assert!(unfinished >= 1, "stopped mid-step: some step has no end");
    assert_eq!(slices.iter().filter(|e| e.ph == "B").count(), unfinished);
    assert_eq!(slices.iter().filter(|e| e.ph == "X").count(), steps.len() - unfinished);
    let by_name: BTreeMap<(i64, &str), &Ev> = slices.iter().map(|e| ((e.tid, e.name.as_str()), *e)).collect();
    assert_eq!(by_name.len(), slices.len(), "step names are unique per thread");
    for st in &steps {
        let name = format!("train #{}", st.step);
        let e = by_name.get(&(i64::from(st.tid), name.as_str())).unwrap_or_else(|| panic!("no slice {name}"));
        let want_ts = (st.start_ns as i64 - s.started_ns) as f64 / 1e3;
        assert!((e.ts - want_ts).abs() < 1e-3, "{name}: ts {} vs {want_ts} µs", e.ts);
        match st.end_ns {
            Some(end) => assert!((e.dur.expect("dur") - (end - st.start_ns) as f64 / 1e3).abs() < 1e-3),
            None => assert_eq!(e.ph, "B"),
        }
        assert_eq!(e.args["step"].as_i64(), Some(st.step));
        assert_eq!(e.args["launches"].as_u64(), st.launches);
    }
    assert_nested(&events);

    assert_sched_slices(&events, &conn, s.id);

    // Launches: one instant per row, each inside its step's slice.
    let launches: Vec<&Ev> = events.iter().filter(|e| e.ph == "i").collect();
    let rows = count(&db, "SELECT count(*) FROM launches WHERE session_id = ?1", s.id);
    assert_eq!(launches.len() as i64, rows);
    assert!(rows >= 40 * 20, "at least 20 steps per thread ran: {rows} launches");
    for e in &launches {
        assert_eq!(e.cat.as_deref(), Some("launch"));
        assert!(e.name.starts_with("cuLaunchKernel 0x"), "no kernel names known: api + handle, got {}", e.name);
        let step = e.args["step"].as_i64().expect("trainer launches are inside steps");
        let slice = by_name[&(e.tid, format!("train #{step}").as_str())];
        let end = slice.dur.map_or(f64::INFINITY, |d| slice.ts + d);
        assert!(slice.ts <= e.ts && e.ts <= end, "launch at {} outside step {step} [{}, {end}]", e.ts, slice.ts);
    }

    // Counters: one event per non-NULL GPU reading, none for what is NULL.
    let mut want_counters = 0;
    for col in ["utilization_gpu_pct", "power_w", "memory_used_mib", "temperature_gpu_c"] {
        want_counters += count(&db, &format!("SELECT count({col}) FROM gpu_samples WHERE session_id = ?1"), s.id);
    }
    let counters: Vec<&Ev> = events.iter().filter(|e| e.ph == "C").collect();
    let gpu_counters = counters.iter().filter(|e| e.name.starts_with("GPU ")).count();
    assert_eq!(gpu_counters as i64, want_counters);
    assert!(want_counters > 0);
    // No RAPL (an empty powercap root): no power counters for CPU or DRAM, not zeros.
    assert_eq!(counters.iter().filter(|e| e.name.contains("power") && !e.name.starts_with("GPU ")).count(), 0);
    // System usage: one event per non-NULL reading.
    let mut want_system = 0;
    for col in ["cpu_usage_pct", "process_cpu_pct", "ram_used_gb", "process_rss_gb"] {
        want_system += count(&db, &format!("SELECT count({col}) FROM system_samples WHERE session_id = ?1"), s.id);
    }
    assert_eq!((counters.len() - gpu_counters) as i64, want_system, "system counters");
    let power: Vec<f64> = counters.iter().filter(|e| e.name == "GPU 1 power").map(|e| f(&e.args["W"])).collect();
    assert!(!power.is_empty() && power.iter().all(|&w| w == 150.0), "stand-in GPU 1 draws 150 W: {power:?}");
    assert_eq!(
        counters.iter().filter(|e| e.name == "GPU 0 temperature").count() as i64,
        count(&db, "SELECT count(temperature_gpu_c) FROM gpu_samples WHERE session_id = ?1 AND gpu = 0", s.id)
    );

    // CSV export of a table and a view: a header and the session's rows.
    for table in ["steps", "launches_named", "gpu_stats_monitor", "sessions", "apis"] {
        let out = stdout_of(&["export", &db.display().to_string(), "--format", "csv", "--table", table]);
        let mut rdr = csv::Reader::from_reader(out.as_bytes());
        let header: Vec<String> = rdr.headers().expect("header").iter().map(str::to_owned).collect();
        let columns: Vec<String> = conn
            .prepare("SELECT name FROM pragma_table_info(?1)")
            .expect("prepare")
            .query_map([table], |r| r.get(0))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(header, columns, "{table}");
        let records: Vec<csv::StringRecord> = rdr.records().collect::<Result<_, _>>().expect("records");
        let filter = match table {
            "sessions" => "WHERE id = ?1",
            "apis" => "WHERE ?1 IS NOT NULL",
            _ => "WHERE session_id = ?1",
        };
        assert_eq!(
            records.len() as i64,
            count(&db, &format!("SELECT count(*) FROM {table} {filter}"), s.id),
            "{table}"
        );
        if table == "steps" {
            let i = header.iter().position(|h| h == "end_ns").expect("end_ns");
            assert_eq!(records.iter().filter(|r| r[i].is_empty()).count(), unfinished, "NULL is an empty field");
        }
    }
    let (code, _, err) = run(&["export", &db.display().to_string(), "--format", "csv", "--table", "nope"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no table or view 'nope'") && err.contains("steps"), "{err}");
}

/// Peak RSS (KiB) of `profiler ARGS` alone (the whole process: its binary's
/// touched pages, libraries, heap), from wait4's rusage, and its run time.
///
/// A child's `ru_maxrss` is never below the RSS of the process it was forked
/// from when it exec'd (exec keeps the old address space's high-water mark),
/// so spawned from here it would count this test too. A small shell starts
/// the profiler in the background and exits; the orphan comes to this
/// process, a subreaper (as every test process is: `adopt_orphans`),
/// which reaps it with wait4.
fn peak_rss_kib(args: &[&str]) -> (i64, Duration) {
    let t0 = Instant::now();
    // SAFETY: prctl on this process with plain integer arguments.
    assert_eq!(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) }, 0, "PR_SET_CHILD_SUBREAPER");
    let out = Command::new("/bin/sh")
        .arg("-c")
        .arg(r#""$@" >/dev/null 2>&1 </dev/null & echo $!"#)
        .arg("sh")
        .arg(profiler_bin())
        .args(args)
        .output()
        .expect("start profiler through sh");
    let pid: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().expect("the profiler's PID from sh");
    let mut status = 0;
    // SAFETY: waiting for our own (adopted) child; rusage is plain data the kernel fills in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid, "wait4: {}", std::io::Error::last_os_error());
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "profiler {args:?} failed: status {status}");
    (usage.ru_maxrss, t0.elapsed())
}

#[test]
fn a_large_session_exports_in_bounded_memory() {
    const EXTRA: i64 = 2_000_000;
    // The README: a 2-million-launch session exports "in at most 4 MiB more
    // memory than a tiny one" (whole-process peak RSS, against the same
    // binary's export of the session before the two million rows: the
    // binary's own pages are most of either). `report` is not covered by
    // that sentence (~12 MiB measured, absolute).
    const EXPORT_GROWTH_LIMIT_KIB: i64 = 4 * 1024;
    const REPORT_LIMIT_KIB: i64 = 16 * 1024;
    let dir = workdir("large");
    let db = dir.join("big.db");
    profile_into(&dir, &db, &["--steps", "10", "--launches", "100"], &[]);
    let s = last_session(&db);
    let small_trace = dir.join("small.json").display().to_string();
    let (baseline_kib, _) = peak_rss_kib(&["export", &db.display().to_string(), "-o", &small_trace]);
    {
        // Two million more launch rows in the real profile, spread over its
        // steps and threads and over 5000 kernels.
        let mut conn = open(&db);
        let tx = conn.transaction().expect("tx");
        let st: Vec<(i64, i64, i64)> = tx
            .prepare("SELECT step, tid, start_ns FROM steps WHERE session_id = ?1")
            .expect("prepare")
            .query_map([s.id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        let mut ins = tx
            .prepare(
                "INSERT INTO launches(session_id, ts_ns, tid, api, function, grid_x, grid_y, grid_z, block_x, block_y,
                                      block_z, shared_mem_bytes, stream, step, label)
                 VALUES (?1, ?2, ?3, 1, ?4, 1, 2, 3, 32, 2, 1, 0, 28672, ?5, 'train')",
            )
            .expect("prepare");
        for i in 0..EXTRA {
            let (step, tid, start) = st[(i as usize) % st.len()];
            ins.execute(params![s.id, start + i % 1000, tid, 0x200000 + i % 5000, step]).expect("insert");
        }
        drop(ins);
        tx.commit().expect("commit");
    }
    let total = count(&db, "SELECT count(*) FROM launches WHERE session_id = ?1", s.id);
    assert_eq!(total, EXTRA + 1000);

    let trace = dir.join("big.json");
    let dbs = db.display().to_string();
    let (perfetto_kib, perfetto_t) = peak_rss_kib(&["export", &dbs, "-o", &trace.display().to_string()]);
    let size = std::fs::metadata(&trace).expect("trace").len();
    // One event per line: count the launch instants without loading 500 MB of JSON.
    let mut instants = 0i64;
    let mut lines = 0i64;
    for line in BufReader::new(std::fs::File::open(&trace).expect("open")).lines() {
        let line = line.expect("line");
        lines += 1;
        if line.contains("\"ph\":\"i\"") {
            instants += 1;
        }
    }
    assert_eq!(instants, total, "every launch exported");
    assert!(lines > total);
    let _ = std::fs::remove_file(&trace);

    let csv_path = dir.join("big.csv");
    let (csv_kib, csv_t) = peak_rss_kib(&[
        "export",
        &dbs,
        "--format",
        "csv",
        "--table",
        "launches_named",
        "-o",
        &csv_path.display().to_string(),
    ]);
    let csv_lines = BufReader::new(std::fs::File::open(&csv_path).expect("open")).lines().count() as i64;
    assert_eq!(csv_lines, total + 1, "header + every row");
    let _ = std::fs::remove_file(&csv_path);

    let (report_kib, report_t) = peak_rss_kib(&["report", &dbs]);
    println!(
        "large session ({total} launches): perfetto export {:.1} MiB peak RSS (tiny session: {:.1} MiB), {:.1} s, \
         {:.0} MB; CSV export {:.1} MiB, {:.1} s; report {:.1} MiB, {:.1} s",
        perfetto_kib as f64 / 1024.0,
        baseline_kib as f64 / 1024.0,
        perfetto_t.as_secs_f64(),
        size as f64 / 1e6,
        csv_kib as f64 / 1024.0,
        csv_t.as_secs_f64(),
        report_kib as f64 / 1024.0,
        report_t.as_secs_f64()
    );
    for (what, kib, limit) in [
        ("perfetto export", perfetto_kib, baseline_kib + EXPORT_GROWTH_LIMIT_KIB),
        ("CSV export", csv_kib, baseline_kib + EXPORT_GROWTH_LIMIT_KIB),
        ("report", report_kib, REPORT_LIMIT_KIB),
    ] {
        assert!(kib < limit, "{what}: peak RSS {kib} KiB, over {limit} KiB");
    }
}

/// `profiler doctor ARGS` → (exit code, stdout).
fn doctor(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let out =
        Command::new(profiler_bin()).arg("doctor").args(args).envs(env.iter().copied()).output().expect("run doctor");
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The check line named `name` and the line after it.
fn check<'a>(out: &'a str, name: &str) -> (&'a str, Option<&'a str>) {
    let lines: Vec<&str> = out.lines().collect();
    let i = lines
        .iter()
        .position(|l| l.split_once(' ').is_some_and(|(mark, rest)| !mark.is_empty() && rest.starts_with(name)))
        .unwrap_or_else(|| panic!("no '{name}' check in:\n{out}"));
    (lines[i], lines.get(i + 1).copied())
}

fn fix_of<'a>(out: &'a str, name: &str) -> &'a str {
    let (line, next) = check(out, name);
    next.filter(|n| n.trim_start().starts_with("fix: ")).unwrap_or_else(|| panic!("'{line}' has no fix line:\n{out}"))
}

#[test]
fn doctor_on_this_machine() {
    let dir = workdir("doctor");
    let missing_nvml = dir.join("libnvidia-ml.so.1").display().to_string();
    let (code, out) = doctor(&["--nvml-lib", &missing_nvml], &[]);
    println!("{out}");
    assert_eq!(code, Some(0), "root on a 6.x kernel with BTF can attach:\n{out}");
    for name in ["kernel", "BTF", "privileges", "BPF syscall", "attach cookies", "uprobe PMU", "ring buffer"] {
        assert!(check(&out, name).0.starts_with("✓ "), "{name}:\n{out}");
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("release");
    assert!(check(&out, "kernel").0.contains(release.trim()));
    let uprobe_type = std::fs::read_to_string("/sys/bus/event_source/devices/uprobe/type").expect("uprobe PMU");
    assert!(check(&out, "uprobe PMU").0.contains(&format!("type {}", uprobe_type.trim())));
    // NVML missing: a warning with its fix, which does not fail the run.
    assert!(check(&out, "NVML").0.starts_with("! ") && check(&out, "NVML").0.contains("cannot load"), "{out}");
    assert!(fix_of(&out, "NVML").contains("--nvml-lib"));
    // RAPL as this host has it: absent, with the fix, where it has neither the perf power PMU nor powercap zones.
    let rapl = check(&out, "RAPL").0;
    match host_rapl() {
        None => {
            assert!(rapl.starts_with("! ") && rapl.contains("RAPL unavailable: no perf power PMU"), "{out}");
            assert!(fix_of(&out, "RAPL").contains("modprobe"));
        }
        Some(what) => {
            // Read, or a reason that is not "absent" (a permission, an unusable file).
            assert!(rapl.starts_with("✓ ") || rapl.starts_with("! "), "{out}");
            assert!(!rapl.contains("RAPL unavailable: no perf power PMU"), "this host has {what}:\n{out}");
            skip(format!("doctor's no-RAPL verdict: this host has {what}"));
        }
    }
    // NVML missing is a warning whatever the host has: attach works, some figures will be absent.
    assert!(out.trim_end().ends_with("attach would work; some figures will be absent (warnings above)"), "{out}");

    // With the stand-in NVML (3 GPUs) and a powercap tree this test writes.
    let powercap = dir.join("powercap");
    for (zone, name, uj) in [("intel-rapl:0", "package-0", "123456"), ("intel-rapl:0:0", "dram", "789")] {
        std::fs::create_dir_all(powercap.join(zone)).expect("zone");
        std::fs::write(powercap.join(zone).join("name"), format!("{name}\n")).expect("name");
        std::fs::write(powercap.join(zone).join("energy_uj"), format!("{uj}\n")).expect("energy");
        std::fs::write(powercap.join(zone).join("max_energy_range_uj"), "262143328850\n").expect("range");
    }
    let (code, out) = doctor(
        &["--nvml-lib", &stand_in_nvml(), "--powercap-root", &powercap.display().to_string()],
        &[("STANDIN_NVML_GPUS", "3")],
    );
    assert_eq!(code, Some(0), "{out}");
    let nvml = check(&out, "NVML").0;
    assert!(nvml.starts_with("✓ ") && nvml.contains("3 GPUs"), "{out}");
    // Both domains of the zones above: doctor reads the named tree alone, as the sampler does.
    let rapl = check(&out, "RAPL").0;
    assert!(
        rapl.starts_with("✓ ") && rapl.contains(&powercap.display().to_string()) && rapl.contains("package, dram"),
        "{out}"
    );

    // The stand-in NVML that fails as NVML does without a driver (NVML_ERROR_DRIVER_NOT_LOADED).
    let (code, out) = doctor(&["--nvml-lib", &stand_in_nvml()], &[("STANDIN_NVML_INIT_ERROR", "9")]);
    assert_eq!(code, Some(0), "{out}");
    assert!(check(&out, "NVML").0.starts_with("! ") && check(&out, "NVML").0.contains("did not initialise"), "{out}");
    assert!(fix_of(&out, "NVML").contains("driver"));
    // The genuine NVIDIA library: it loads; without a driver it does not initialise.
    let genuine = fixtures().join("nvidia/lib/libnvidia-ml.so.1");
    let (code, out) = doctor(&["--nvml-lib", &genuine.display().to_string()], &[]);
    assert_eq!(code, Some(0), "{out}");
    assert!(!check(&out, "NVML").0.contains("cannot load"), "{out}");
    match nvidia_driver() {
        None => {
            assert!(check(&out, "NVML").0.contains("did not initialise"), "{out}");
            assert!(fix_of(&out, "NVML").contains("driver"));
        }
        Some(driver) => skip(format!("doctor on the genuine NVML without a driver: this host has one ({driver})")),
    }
}

/// The libraries a process maps whose file name starts with `prefix`, read here from /proc.
fn mapped(pid: u32, prefix: &str) -> BTreeSet<String> {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .expect("maps")
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|p| Path::new(p).file_name().is_some_and(|n| n.to_string_lossy().starts_with(prefix)))
        .map(str::to_owned)
        .collect()
}

#[test]
fn doctor_for_a_process() {
    let dir = workdir("doctor-pid");
    let trainer = Trainer::spawn(&dir, &["--forever", "--launches", "1", "--step-sleep-us", "10000"]);
    let pid = trainer.pid();
    // Held before it loads CUDA: nothing mapped yet, which is not a failure.
    let (code, out) = doctor(&[&pid.to_string()], &[]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains(&format!("PID {pid} ({})", fixtures().join("trainer").display())), "{out}");
    assert!(check(&out, "CUDA libraries").0.contains("none mapped yet"), "{out}");
    assert!(check(&out, "CPython").0.contains("not a Python interpreter"), "{out}");
    trainer.go();
    let t0 = Instant::now();
    while mapped(pid, "libcuda.so").is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(10), "the trainer never loaded the stand-in driver");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (code, out) = doctor(&[&pid.to_string()], &[]);
    assert_eq!(code, Some(0), "{out}");
    let line = check(&out, "CUDA libraries").0;
    assert!(line.starts_with("✓ "), "{out}");
    for path in mapped(pid, "libcuda.so") {
        assert!(line.contains(&format!("driver {path}")), "{path} not in: {line}");
    }
    drop(trainer);

    // Debian's python3.11 is built with --with-dtrace: its function probe sites
    // are counted as readelf counts them.
    let python = Path::new("/usr/bin/python3.11");
    let readelf = Command::new("readelf").arg("--notes").arg(python).output().expect("readelf");
    let notes = String::from_utf8_lossy(&readelf.stdout).into_owned();
    let sites = |name: &str| notes.lines().filter(|l| l.trim() == format!("Name: {name}")).count();
    let (entries, returns) = (sites("function__entry"), sites("function__return"));
    assert!(entries > 0 && returns > 0, "readelf finds no function probes in {}", python.display());
    let mut child = Command::new(python).args(["-c", "import time; time.sleep(30)"]).spawn().expect("python");
    std::thread::sleep(Duration::from_millis(300));
    let (code, out) = doctor(&[&child.id().to_string()], &[]);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(code, Some(0), "{out}");
    let line = check(&out, "CPython").0;
    let want = format!("/usr/bin/python3.11 (CPython 3.11): {entries} function__entry and {returns} function__return");
    assert!(line.starts_with("✓ ") && line.contains(&want) && line.contains("python:line semaphore"), "{out}");

    // A PID that is not there: attaching would fail.
    let (code, out) = doctor(&["999999999"], &[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(check(&out, "process").0.starts_with("✗ ") && !fix_of(&out, "process").is_empty(), "{out}");
}

#[test]
fn doctor_without_privileges_fails_with_the_capability_fix() {
    // A copy that user nobody can execute wherever the build put the original.
    let dir = workdir("doctor-unprivileged");
    let bin: PathBuf = dir.join("profiler");
    std::fs::copy(profiler_bin(), &bin).expect("copy profiler");
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"])
        .arg(&bin)
        .args(["doctor", "--nvml-lib", &dir.join("none.so").display().to_string()])
        .current_dir(&dir)
        .output()
        .expect("setpriv");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let (line, _) = check(&stdout, "privileges");
    assert!(line.starts_with("✗ ") && line.contains("uid 65534"), "{stdout}");
    assert!(fix_of(&stdout, "privileges").contains("setcap cap_bpf,cap_perfmon+ep"), "{stdout}");
    assert!(check(&stdout, "BPF syscall").0.starts_with("✗ "), "{stdout}");
    // What does not need privileges still passes.
    assert!(check(&stdout, "kernel").0.starts_with("✓ "), "{stdout}");
    assert!(check(&stdout, "uprobe PMU").0.starts_with("✓ "), "{stdout}");
    assert!(stdout.contains("attach would fail"), "{stdout}");
}

/// Figures the stand-ins do not produce (labels other than train, sync waits,
/// kernel names, CPU energy, RAPL samples), written here into a real profile
/// with known values: the report and the trace use them.
#[test]
fn report_and_export_use_what_later_profilers_record() {
    let dir = workdir("later");
    let db = dir.join("p.db");
    profile_into(&dir, &db, &["--steps", "50", "--launches", "20", "--step-sleep-us", "2000"], &[]);
    let s = last_session(&db);
    const CPU_W: f64 = 50.0;
    {
        let conn = open(&db);
        // The last 10 steps become validation steps (numbers stay unique per label).
        for table in ["steps", "step_gpu", "launches"] {
            conn.execute(
                &format!("UPDATE {table} SET label = 'validate' WHERE session_id = ?1 AND step >= 40"),
                [s.id],
            )
            .expect("relabel");
        }
        conn.execute("UPDATE steps SET sync_wait_ns = duration_ns / 4 WHERE session_id = ?1", [s.id]).expect("sync");
        // A sync wait in the second quarter of every completed step.
        conn.execute(
            "INSERT INTO syncs (session_id, tid, api, start_ns, end_ns, step)
             SELECT session_id, tid, 'cuStreamSynchronize', start_ns + duration_ns / 4, start_ns + duration_ns / 2, step
             FROM steps WHERE session_id = ?1 AND end_ns IS NOT NULL",
            [s.id],
        )
        .expect("syncs");
        // Names for the first five kernels (the trainer's handles are 0x100000 + i).
        for i in 0..5i64 {
            conn.execute(
                "INSERT INTO kernels (session_id, function, name, demangled_name, source)
                 VALUES (?1, ?2, ?3, ?4, 'cuModuleGetFunction')",
                params![s.id, 0x100000 + i, format!("_Z6kernelILi{i}EEvv"), format!("void kernel<{i}>()")],
            )
            .expect("kernel");
        }
        // CPU package at a constant 50 W; no DRAM domain (as on AMD).
        conn.execute("DELETE FROM step_energy WHERE session_id = ?1", [s.id]).expect("clear");
        conn.execute(
            &format!(
                "INSERT INTO step_energy (session_id, label, step, cpu_energy_j, cpu_energy_error_j, below_resolution)
                 SELECT session_id, label, step, {CPU_W} * duration_ns / 1e9, 0.001, 0
                 FROM steps WHERE session_id = ?1 AND end_ns IS NOT NULL"
            ),
            [s.id],
        )
        .expect("step_energy");
        conn.execute("DELETE FROM rapl_samples WHERE session_id = ?1", [s.id]).expect("clear");
        let end = s.ended_ns.expect("ended");
        let mut t = s.started_ns;
        while t <= end {
            conn.execute(
                "INSERT INTO rapl_samples (session_id, ts_ns, domain, energy_j) VALUES (?1, ?2, 'package', ?3)",
                params![s.id, t, CPU_W * (t - s.started_ns) as f64 / 1e9],
            )
            .expect("rapl");
            t += 10_000_000;
        }
    }
    let conn = open(&db);
    let dbs = db.display().to_string();

    let json: Value =
        serde_json::from_str(&stdout_of(&["report", &dbs, "--skip", &SKIP.to_string(), "--format", "json"]))
            .expect("JSON");
    let labels = json["labels"].as_array().expect("labels");
    let names: Vec<&str> = labels.iter().map(|l| l["label"].as_str().expect("label")).collect();
    assert_eq!(names, ["train", "validate"]);
    for (l, steps) in labels.iter().zip([40, 10]) {
        assert_eq!(l["steps"], steps);
        assert_eq!(l["skipped"], SKIP, "--skip counts per label");
        assert_eq!(l["measured"], steps - SKIP);
        let label = l["label"].as_str().expect("label");
        // Against SQL: the label's steps after the first SKIP by start time.
        let (share, cpu_j, dur_s): (f64, f64, f64) = conn
            .query_row(
                "WITH u AS (SELECT * FROM (SELECT *, ROW_NUMBER() OVER (ORDER BY start_ns, step) AS rn
                                           FROM steps WHERE session_id = ?1 AND label = ?2) WHERE rn > ?3)
                 SELECT sum(sync_wait_ns) * 1.0 / sum(duration_ns), avg(e.cpu_energy_j), sum(u.duration_ns) / 1e9
                 FROM u JOIN step_energy e ON e.session_id = u.session_id AND e.step = u.step AND e.label = u.label",
                params![s.id, label, SKIP],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .expect("SQL");
        close(f(&l["sync_wait_share"]), share, "sync wait share");
        assert!((share - 0.25).abs() < 1e-6, "{share}");
        close(f(&l["cpu"]["energy_per_step_j"]), cpu_j, "CPU energy per step");
        close(f(&l["cpu"]["avg_power_w"]), CPU_W, "CPU power");
        close(f(&l["cpu"]["avg_power_w"]) * dur_s / (steps - SKIP) as f64, cpu_j, "CPU energy = power × time");
        assert!(l["dram"].is_null(), "no DRAM figures: absent, not zero");
        assert_eq!(l["energy_components"], serde_json::json!(["GPU 0", "GPU 1", "CPU"]));
    }
    let only: Value =
        serde_json::from_str(&stdout_of(&["report", &dbs, "--label", "validate", "--format", "json"])).expect("JSON");
    assert_eq!(only["labels"].as_array().map(Vec::len), Some(1));
    assert_eq!(only["labels"][0]["measured"], 10);
    let named: BTreeMap<i64, String> = json["top_kernels"]
        .as_array()
        .expect("kernels")
        .iter()
        .filter_map(|k| Some((k["function"].as_i64()?, k["demangled_name"].as_str()?.to_owned())))
        .collect();
    assert_eq!(named.len(), 5, "{}", json["top_kernels"]);
    assert_eq!(named[&0x100002], "void kernel<2>()");
    let table = stdout_of(&["report", &dbs]);
    assert!(table.contains("validate: 10 steps") && table.contains("void kernel<0>()"), "{table}");
    assert!(table.lines().any(|l| l.contains("sync wait") && l.contains("25.0%")), "{table}");
    assert_fits_80_columns(&table);

    let trace = dir.join("trace.json");
    stdout_of(&["export", &dbs, "-o", &trace.display().to_string()]);
    let events = parse_trace(&trace, i64::from(s.pid));
    let syncs: Vec<&Ev> = events.iter().filter(|e| e.cat.as_deref() == Some("sync")).collect();
    assert_eq!(syncs.len() as i64, count(&db, "SELECT count(*) FROM syncs WHERE session_id = ?1", s.id));
    assert!(syncs.iter().all(|e| e.name == "cuStreamSynchronize" && e.ph == "X"));
    // Each sync inside its step's slice, on the same thread.
    let step_slices: BTreeMap<(i64, String), &Ev> =
        events.iter().filter(|e| e.cat.as_deref() == Some("step")).map(|e| ((e.tid, e.name.clone()), e)).collect();
    assert!(step_slices.contains_key(&(i64::from(steps(&db, s.id)[45].tid), "validate #45".to_string())));
    for e in &syncs {
        let step = e.args["step"].as_i64().expect("step");
        let label = if step >= 40 { "validate" } else { "train" };
        let slice = step_slices[&(e.tid, format!("{label} #{step}"))];
        assert!(
            slice.ts < e.ts && e.ts + e.dur.expect("dur") < slice.ts + slice.dur.expect("dur"),
            "{e:?} in {slice:?}"
        );
    }
    let launch_names: BTreeMap<&str, usize> =
        events.iter().filter(|e| e.ph == "i").fold(BTreeMap::new(), |mut m, e| {
            *m.entry(e.name.as_str()).or_default() += 1;
            m
        });
    assert_eq!(launch_names.get("void kernel<3>()"), Some(&50), "named kernels, once per step");
    assert_eq!(launch_names.get("cuLaunchKernel 0x100005"), Some(&50), "unnamed: entry point and handle");
    let cpu_power: Vec<f64> =
        events.iter().filter(|e| e.name == "CPU package power").map(|e| f(&e.args["W"])).collect();
    let samples = count(&db, "SELECT count(*) FROM rapl_samples WHERE session_id = ?1", s.id);
    assert_eq!(cpu_power.len() as i64, samples - 1, "one power value per interval between samples");
    assert!(cpu_power.iter().all(|w| (w - CPU_W).abs() < 1e-6), "{cpu_power:?}");
    assert!(!events.iter().any(|e| e.name == "DRAM power"));
    assert_nested(&events);
}
