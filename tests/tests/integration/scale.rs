//! Root integration tests at the scale of real hosts and under loss: thread
//! ids above 65 536, more short-lived threads than the kernel maps hold, rings
//! too small on purpose, and the detach of many probes. Each compares the
//! database with the trainer's own ground truth.
use std::path::PathBuf;

use integration_tests::*;

struct Run {
    db: PathBuf,
    truth: Truth,
    session: Session,
    stderr: String,
}

/// The trainer (stand-in libraries in `lib` under the fixtures, "" for the
/// plain ones) with `trainer_args`, the profiler attached with
/// `--step-symbol train_step` and `env`, until the trainer exits.
fn traced(name: &str, lib: &str, trainer_args: &[&str], env: &[(&str, &str)]) -> Run {
    let dir = workdir(name);
    let db = dir.join("p.db");
    let ld = if lib.is_empty() {
        fixtures().display().to_string()
    } else {
        format!("{}:{}", fixtures().join(lib).display(), fixtures().display())
    };
    let mut trainer = Trainer::spawn_with(&dir, trainer_args, Some(PathBuf::from(ld)));
    let agent = Agent::attach_with_env(trainer.pid(), &db, &["--step-symbol", "train_step", "--no-gpu"], env);
    match trainer_args.contains(&"--after-dlopen-ms") {
        // The runtime, loaded after the attach, probed before the first launch.
        true => trainer.go_once_probed(&agent, &["libcudart.so.12"]),
        false => trainer.go(),
    }
    assert!(trainer.wait().success(), "trainer failed");
    let (status, stderr) = agent.finish();
    assert!(status.success(), "profiler failed: {stderr}");
    let truth = trainer.truth();
    let session = last_session(&db);
    assert_eq!(session.end_reason.as_deref(), Some("target-exited"), "{stderr}");
    Run { db, truth, session, stderr }
}

/// Every step, launch and launch row exact, and nothing lost or failed.
fn assert_exact(r: &Run) {
    let s = &r.session;
    assert_eq!(s.lost_events, Some(0), "{}", r.stderr);
    assert_eq!(session_losses(&r.db, s.id), (Some(0), Some(0)), "step records lost, map failures: {}", r.stderr);
    assert_eq!(s.total_launches, Some(r.truth.total as i64));
    assert_steps_match(&r.truth.steps, &steps(&r.db, s.id), STEP_TOLERANCE_NS);
    assert_eq!(count(&r.db, "SELECT count(*) FROM launches WHERE session_id = ?1", s.id), r.truth.total as i64);
    assert_eq!(launches_outside_their_step(&r.db, s.id), 0);
    assert_eq!(count(&r.db, "SELECT count(*) FROM steps WHERE session_id = ?1 AND incomplete != 0", s.id), 0);
}

#[test]
fn thread_ids_above_65536_keep_exact_counts() {
    // As on a host with pid_max 4 194 304: the trainer's 68 000 short-lived
    // threads get ids from 100 001 on, so their per-thread slots (65 536 of
    // them, indexed by tid) are each used by two threads in turn, the second
    // after the first has exited.
    let pid_max = PidMax::raise(4_194_304);
    pid_max.next_pid_after(100_000);
    let r = traced("high-tids", "", &["--threads", "2", "--waves", "34000", "--steps", "1", "--launches", "2"], &[]);
    drop(pid_max);
    let min_tid = r.truth.steps.iter().map(|s| s.tid).min().unwrap_or(0);
    let max_tid = r.truth.steps.iter().map(|s| s.tid).max().unwrap_or(0);
    println!("{} threads, tids {min_tid}..{max_tid}", r.truth.steps.len());
    assert!(min_tid > 65_536 && max_tid - min_tid > 65_536, "tids {min_tid}..{max_tid}");
    assert_eq!(r.truth.steps.len(), 68_000);
    assert_exact(&r);
}

#[test]
fn more_short_lived_threads_than_the_kernel_maps_hold() {
    // Two slots for eight live threads: at least six keep their state in the
    // fallback map, whose 1 024 entries hold 66 400 threads over the run only
    // because each exiting thread's entry is removed. Runtime launches (whose
    // driver launch must not count again) and runtime syncs (whose driver
    // sync must not get a row of its own) use that state too.
    let r = traced(
        "many-threads",
        "",
        &[
            "--threads",
            "8",
            "--waves",
            "8300",
            "--steps",
            "1",
            "--launches",
            "2",
            "--api",
            "runtime",
            "--sync-us",
            "1",
            "--runtime-sync",
            "--after-dlopen-ms",
            "500",
        ],
        &[("PROFILER_THREAD_SLOTS", "2")],
    );
    assert_eq!(r.truth.steps.len(), 66_400);
    assert_exact(&r);
    let syncs = count(&r.db, "SELECT count(*) FROM syncs WHERE session_id = ?1 AND step IS NOT NULL", r.session.id);
    assert_eq!(syncs, 66_400, "one sync row per step, the runtime's call counted once");
}

#[test]
fn a_full_launch_ring_costs_launch_rows_not_steps() {
    // A 16 KiB launch ring overflows at once; steps have their own ring.
    let r = traced(
        "launch-ring",
        "shaped",
        &["--threads", "2", "--steps", "100", "--launches", "2000", "--nest", "1"],
        &[("PROFILER_RING_BYTES", "16384")],
    );
    let s = &r.session;
    let (lost_steps, map_failures) = session_losses(&r.db, s.id);
    let lost = s.lost_events.expect("lost_events");
    println!("lost {lost} of {} launch records", r.truth.total);
    assert!(lost > 0, "the ring never overflowed");
    assert_eq!((lost_steps, map_failures), (Some(0), Some(0)));
    assert_eq!(s.total_launches, Some(r.truth.total as i64));
    assert_steps_match(&r.truth.steps, &steps(&r.db, s.id), STEP_TOLERANCE_NS);
    let rows = count(&r.db, "SELECT count(*) FROM launches WHERE session_id = ?1", s.id);
    // The ring also carries the threads' off-CPU records, counted apart.
    let off_cpu = count(&r.db, "SELECT lost_off_cpu_records FROM sessions WHERE id = ?1", s.id);
    assert_eq!(rows + lost - off_cpu, r.truth.total as i64, "every launch is a row or counted lost");
    assert_eq!(launches_outside_their_step(&r.db, s.id), 0);
    assert!(r.stderr.contains("steps.launches and the session's total are still exact"), "{}", r.stderr);
}

#[test]
fn a_full_step_ring_marks_the_steps_it_cost_and_no_others() {
    // A 4 KiB step ring (about 85 records) cannot hold a burst of 3 000
    // nested steps (four records each) between two drains; the 150 steps
    // after the burst, 2 ms apart (40 records a drain), fit. A lost return must cost the steps
    // around it, not merge every later step into one that never ends.
    let r = traced(
        "step-ring",
        "shaped",
        &["--steps", "3150", "--burst", "3000", "--gap-us", "2000", "--launches", "3", "--nest", "1"],
        &[("PROFILER_STEP_RING_BYTES", "4096")],
    );
    let s = &r.session;
    let (lost_steps, map_failures) = session_losses(&r.db, s.id);
    assert!(lost_steps.is_some_and(|n| n > 0), "the step ring never overflowed");
    assert_eq!(map_failures, Some(0));
    assert_eq!(s.total_launches, Some(r.truth.total as i64));
    let db = steps_with_marks(&r.db, s.id);
    let marked = db.iter().filter(|(_, m)| *m == Some(1)).count();
    assert!(marked > 0, "no step marked incomplete");
    assert!(db.iter().all(|(_, m)| m.is_some()), "every step of the session has its mark");
    // Every unmarked step is exactly one of the trainer's steps.
    let mut exact = 0;
    for (d, _) in db.iter().filter(|(_, m)| *m == Some(0)) {
        let end = d.end_ns.expect("an unmarked step has its end");
        let inside: Vec<&TruthStep> =
            r.truth.steps.iter().filter(|t| t.start_ns >= d.start_ns && t.end_ns <= end).collect();
        assert_eq!(inside.len(), 1, "unmarked step {d:?} holds {} of the trainer's steps", inside.len());
        let t = inside[0];
        assert_eq!(d.launches, Some(t.launches), "launches of {d:?}");
        assert!((t.start_ns - d.start_ns) < STEP_TOLERANCE_NS as u64 && (end - t.end_ns) < STEP_TOLERANCE_NS as u64);
        exact += 1;
    }
    // After the last step a loss marked, every step is there and exact; and
    // that is most of the 150 after the burst (the agent drains the ring on
    // its next 20 ms tick: not every later step merged into one that never ends).
    let cut = db.iter().filter(|(_, m)| *m == Some(1)).map(|(d, _)| d.end_ns.unwrap_or(d.start_ns)).max();
    let after: Vec<&TruthStep> = r.truth.steps.iter().filter(|t| cut.is_some_and(|c| t.start_ns > c)).collect();
    assert!(after.len() >= 100, "only {} steps after the last marked one", after.len());
    let matched = after
        .iter()
        .filter(|t| {
            db.iter().any(|(d, m)| *m == Some(0) && d.start_ns <= t.start_ns && d.end_ns.is_some_and(|e| e >= t.end_ns))
        })
        .count();
    println!(
        "{} of {} step-ring records lost: {} steps stored, {marked} marked incomplete, {exact} exact",
        lost_steps.unwrap_or(0),
        4 * r.truth.steps.len(),
        db.len()
    );
    assert_eq!(matched, after.len(), "steps after the last marked one missing or merged");
    assert!(r.stderr.contains("steps are marked steps.incomplete = 1"), "{}", r.stderr);
}

#[test]
fn detaching_many_probes_keeps_every_record_from_before_the_stop() {
    // Driver and runtime launch, sync and naming probes and six step
    // functions (two never called, one that does not return while traced):
    // 51 uprobes, closed at the end of a 2 s session while the trainer keeps
    // launching. (Not `thread_main`: the kernel's detach of a return probe
    // waits, here for minutes, while a thread inside a probed function that
    // has not returned keeps hitting other return probes.)
    let dir = workdir("detach");
    let db = dir.join("p.db");
    let mut trainer = Trainer::spawn(
        &dir,
        &[
            "--forever",
            "--threads",
            "2",
            "--launches",
            "16",
            "--api",
            "all",
            "--sync-us",
            "1",
            "--gap-us",
            "300",
            "--after-dlopen-ms",
            "500",
        ],
    );
    let mut args = vec!["attach".to_string(), trainer.pid().to_string(), "-o".into(), db.display().to_string()];
    for a in [
        "--no-gpu",
        "--duration",
        "2",
        "--step-symbol",
        "train_step",
        "--step-symbol",
        "s1=_Z12saxpy_kernelifPKfPf",
        "--step-symbol",
        "s2=_Z12scale_kernelPfi",
        "--step-symbol",
        "m=main",
        "--step-symbol",
        "o=open_lib",
        "--step-symbol",
        "u=usage",
    ] {
        args.push(a.into());
    }
    let agent = Agent::start_with_env(&args, &[("RUST_LOG", "info")], true);
    trainer.go_once_probed(&agent, &["libcudart.so.12"]);
    let (status, stderr) = agent.finish();
    assert!(status.success(), "profiler failed: {stderr}");
    // It finishes its step and writes its truth.
    trainer.signal(libc::SIGTERM);
    assert!(trainer.wait().success());
    let truth = trainer.truth();
    let s = last_session(&db);
    assert_eq!(s.end_reason.as_deref(), Some("duration"));
    let detached: u32 = stderr
        .lines()
        .find_map(|l| l.split("detached ").nth(1)?.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no detach line: {stderr}"));
    println!(
        "{} ({} steps before the stop)",
        stderr.lines().find(|l| l.contains("detached")).unwrap_or(""),
        truth.steps.len()
    );
    assert!(detached >= 50, "only {detached} uprobes");
    assert_eq!(s.lost_events, Some(0));
    let ended = s.ended_ns.expect("ended") as u64;
    let db_steps: Vec<DbStep> = steps(&db, s.id).into_iter().filter(|d| d.label == "train").collect();
    let first = db_steps.iter().map(|d| d.start_ns).min().expect("steps");
    // The trainer's steps wholly inside the session (probe boundaries lie
    // within microseconds of its own stamps; 1 ms keeps clear of the edges).
    let inside: Vec<TruthStep> = truth
        .steps
        .iter()
        .filter(|t| t.start_ns > first + 1_000_000 && t.end_ns + 1_000_000 < ended)
        .cloned()
        .collect();
    assert!(inside.len() > 100, "only {} steps inside the session", inside.len());
    let conn = open(&db);
    for t in &inside {
        let d = db_steps
            .iter()
            .find(|d| d.tid == t.tid && d.start_ns <= t.start_ns && d.end_ns.is_some_and(|e| e >= t.end_ns))
            .unwrap_or_else(|| panic!("no step for {t:?}"));
        assert_eq!(d.launches, Some(t.launches), "{d:?}");
        let rows_of_step = |table: &str| -> i64 {
            let sql = format!("SELECT count(*) FROM {table} WHERE session_id = ?1 AND label = 'train' AND step = ?2");
            conn.query_row(&sql, [s.id, d.step], |r| r.get(0)).expect(table)
        };
        assert_eq!(rows_of_step("launches") as u64, t.launches, "launch rows of step {}", d.step);
        assert_eq!(rows_of_step("syncs"), 1, "sync rows of step {}", d.step);
    }
}
