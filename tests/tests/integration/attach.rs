//! Root integration tests: the real profiler attached to the synthetic trainer,
//! the database compared with the trainer's own ground truth.
use std::{path::Path, time::Duration};

use integration_tests::*;

fn report(name: &str, e: &BoundaryErrors) {
    println!(
        "{name}: boundary error p99 start {} ns, end {} ns (max {} / {} ns, {} steps)",
        BoundaryErrors::p99(&e.start),
        BoundaryErrors::p99(&e.end),
        e.start.iter().max().copied().unwrap_or(0),
        e.end.iter().max().copied().unwrap_or(0),
        e.start.len()
    );
}

fn attach_and_run(name: &str, trainer_args: &[&str], profiler_args: &[&str]) -> (std::path::PathBuf, Truth, Session) {
    attach_and_run_with_env(name, trainer_args, profiler_args, &[])
}

fn attach_and_run_with_env(
    name: &str,
    trainer_args: &[&str],
    profiler_args: &[&str],
    env: &[(&str, &str)],
) -> (std::path::PathBuf, Truth, Session) {
    let dir = workdir(name);
    let db = dir.join("p.db");
    let mut trainer = Trainer::spawn(&dir, trainer_args);
    let agent = Agent::attach_with_env(trainer.pid(), &db, profiler_args, env);
    match trainer_args.contains(&"--after-dlopen-ms") {
        // Every such trainer here loads the runtime after the attach.
        true => trainer.go_once_probed(&agent, &["libcudart.so.12"]),
        false => trainer.go(),
    }
    assert!(trainer.wait().success(), "trainer failed");
    let (status, stderr) = agent.finish();
    assert!(status.success(), "profiler failed: {stderr}");
    let truth = trainer.truth();
    let session = last_session(&db);
    assert_eq!(session.end_reason.as_deref(), Some("target-exited"), "{stderr}");
    (db, truth, session)
}

#[test]
fn counts_and_arguments_match_ground_truth() {
    let (db, truth, s) =
        attach_and_run("exact", &["--steps", "50", "--launches", "100"], &["--step-symbol", "train_step"]);
    assert_eq!(s.lost_events, Some(0));
    let steps = steps(&db, s.id);
    let e = assert_steps_match(&truth.steps, &steps, STEP_TOLERANCE_NS);
    report("single thread", &e);
    assert_eq!(s.total_launches, Some(5000));
    assert_eq!(count(&db, "SELECT count(*) FROM launches WHERE session_id = ?1", s.id), 5000);
    // Step numbers from 0; the first step has no inter-step gap, the others do.
    assert_eq!(steps.iter().map(|s| s.step).collect::<Vec<_>>(), (0..50).collect::<Vec<_>>());
    assert!(steps[0].inter_step_ns.is_none());
    assert!(steps[1..].iter().all(|s| s.inter_step_ns.is_some_and(|g| g >= 0)));
    // Every launch is inside its step, and its arguments are the trainer's
    // formula: function = 0x100000 + i, grid = {s+1, i+1, 1}, block = {32,2,1},
    // shared = 16 * (i % 64), stream = 0x7000.
    let bad = count(
        &db,
        "SELECT count(*) FROM launches l JOIN steps s USING (session_id, step)
         WHERE l.session_id = ?1 AND NOT (
             l.ts_ns BETWEEN s.start_ns AND s.end_ns
             AND l.function - 1048576 = l.grid_y - 1
             AND l.grid_x = s.step + 1 AND l.grid_z = 1
             AND l.block_x = 32 AND l.block_y = 2 AND l.block_z = 1
             AND l.shared_mem_bytes = 16 * ((l.grid_y - 1) % 64)
             AND l.stream = 28672 AND l.tid = s.tid AND l.api = 1)",
        s.id,
    );
    assert_eq!(bad, 0, "launch rows that disagree with the trainer's arguments");
    assert_eq!(count(&db, "SELECT count(*) FROM launches WHERE session_id = ?1 AND step IS NULL", s.id), 0);
}

#[test]
fn threads_nesting_and_every_driver_entry_point() {
    let (db, truth, s) = attach_and_run(
        "threads",
        &["--threads", "3", "--steps", "20", "--launches", "64", "--nest", "3", "--api", "driver-all"],
        &["--step-symbol", "train_step"],
    );
    assert_eq!(s.lost_events, Some(0));
    let e = assert_steps_match(&truth.steps, &steps(&db, s.id), STEP_TOLERANCE_NS);
    report("3 threads, nested", &e);
    assert_eq!(api_counts(&db, s.id), truth.apis);
    assert_eq!(truth.apis.len(), 8);
    // Graph launches carry the exec handle and no grid; Ex launches read the config struct.
    let graph_bad = count(
        &db,
        "SELECT count(*) FROM launches_named WHERE session_id = ?1 AND api_name LIKE 'cuGraphLaunch%' AND (grid_x != 0 OR function < 1048576)",
        s.id,
    );
    assert_eq!(graph_bad, 0);
    let ex_bad = count(
        &db,
        "SELECT count(*) FROM launches_named WHERE session_id = ?1 AND api_name LIKE 'cuLaunchKernelEx%'
         AND NOT (block_x = 32 AND block_y = 2 AND grid_z BETWEEN 1 AND 3 AND stream BETWEEN 28672 AND 28674)",
        s.id,
    );
    assert_eq!(ex_bad, 0);
}

#[test]
fn threads_sharing_a_counter_slot_keep_exact_counts() {
    // Two slots for five threads: at least three count in the kernel side's
    // fallback map, in both modes; every step's launches stay exact.
    for mode in ["all", "count"] {
        let (db, truth, s) = attach_and_run_with_env(
            &format!("slots-{mode}"),
            &["--threads", "5", "--steps", "20", "--launches", "40", "--nest", "2"],
            &["--step-symbol", "train_step", "--launches", mode],
            &[("PROFILER_THREAD_SLOTS", "2")],
        );
        assert_eq!(s.total_launches, Some(truth.total as i64), "{mode}");
        assert_steps_match(&truth.steps, &steps(&db, s.id), STEP_TOLERANCE_NS);
    }
}

/// All 16 entry points in turn: the driver launch the runtime makes inside
/// each runtime launch is not counted again, and the direct driver launches
/// that follow a runtime launch are counted, whether made at the depth where
/// the runtime was called or below it (`deeper`). There, after a runtime
/// launch the runtime rejected without reaching the driver (a NULL graph on
/// odd steps), only the return address check tells the finished runtime call
/// from one in progress.
fn runtime_launches_are_counted_once(name: &str, deeper: bool) {
    // The runtime is found in the maps after the loader's hook reports its
    // dlopen (its path is not predictable); the trainer launches once the
    // profiler says it probes it (attach_and_run).
    let mut args = vec!["--steps", "20", "--launches", "64", "--api", "all", "--after-dlopen-ms", "500"];
    if deeper {
        args.extend(["--driver-deeper", "--rejected-runtime"]);
    }
    let (db, truth, s) = attach_and_run(name, &args, &["--step-symbol", "train_step"]);
    assert_eq!(truth.apis.len(), 16);
    assert_eq!(api_counts(&db, s.id), truth.apis, "per entry point, runtime launches not doubled by the driver probe");
    assert_eq!(s.total_launches, Some(truth.total as i64));
    assert_steps_match(&truth.steps, &steps(&db, s.id), STEP_TOLERANCE_NS);
    let runtime_lib = count(
        &db,
        "SELECT count(*) FROM probed_files WHERE session_id = ?1 AND kind = 'runtime' AND how = 'dlopen'",
        s.id,
    );
    assert_eq!(runtime_lib, 1);
}

#[test]
fn runtime_launches_are_counted_once_and_driver_launches_after_them_too() {
    runtime_launches_are_counted_once("runtime", false);
}

#[test]
fn driver_launches_below_a_finished_runtime_launch_are_counted() {
    runtime_launches_are_counted_once("runtime-deeper", true);
}

#[test]
fn no_loss_above_100k_launches_per_second() {
    // The stand-in with the genuine driver's entry shape, so that probes sit
    // on emulated instructions as they do on the real libcuda.
    let dir = workdir("rate");
    let db = dir.join("p.db");
    let mut trainer = Trainer::spawn_with(
        &dir,
        &["--threads", "2", "--steps", "200", "--launches", "1000"],
        Some(fixtures().join("shaped")),
    );
    let agent = Agent::attach(trainer.pid(), &db, &["--step-symbol", "train_step"]);
    trainer.go();
    assert!(trainer.wait().success());
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    let truth = trainer.truth();
    let s = last_session(&db);
    let rate = truth.launch_rate();
    println!("sustained {rate:.0} launches/s into SQLite, lost {:?}", s.lost_events);
    assert!(
        rate >= 100_000.0,
        "the traced trainer only reached {rate:.0} launches/s; this machine cannot show the target"
    );
    assert_eq!(s.lost_events, Some(0));
    assert_eq!(count(&db, "SELECT count(*) FROM launches WHERE session_id = ?1", s.id), truth.total as i64);
    assert_steps_match(&truth.steps, &steps(&db, s.id), STEP_TOLERANCE_NS);
}

/// Probes moved past a RIP-relative compare or `push`es (see the `probes`
/// table) must read exactly what a probe on the entry reads.
fn placed_probes(name: &str, extra: &[&str]) -> (std::path::PathBuf, Session) {
    let dir = workdir(name);
    let db = dir.join("p.db");
    let mut trainer = Trainer::spawn_with(
        &dir,
        &["--steps", "20", "--launches", "64", "--api", "driver-all", "--threads", "2"],
        Some(fixtures().join("shaped")),
    );
    let mut args = vec!["--step-symbol", "train_step"];
    args.extend_from_slice(extra);
    let agent = Agent::attach(trainer.pid(), &db, &args);
    trainer.go();
    assert!(trainer.wait().success());
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    let s = last_session(&db);
    let truth = trainer.truth();
    assert_eq!(api_counts(&db, s.id), truth.apis);
    assert_steps_match(&truth.steps, &steps(&db, s.id), STEP_TOLERANCE_NS);
    // The trainer's formula, per thread k: function = 0x100000 + (k << 16) + i,
    // grid = {s+1, i+1, k+1}, block = {32, 2, 1}, shared = 16 (i % 64), stream = 0x7000 + k.
    let bad = count(
        &db,
        "SELECT count(*) FROM launches_named l JOIN steps s USING (session_id, label, step)
         WHERE l.session_id = ?1 AND l.api_name NOT LIKE 'cuGraph%' AND NOT (
             l.grid_x BETWEEN 1 AND 20
             AND (l.function - 1048576) % 65536 = l.grid_y - 1
             AND l.stream = 28672 + l.grid_z - 1
             AND l.block_x = 32 AND l.block_y = 2 AND l.block_z = 1
             AND l.shared_mem_bytes = 16 * ((l.grid_y - 1) % 64))",
        s.id,
    );
    assert_eq!(bad, 0, "launch arguments read at moved probes");
    (db, s)
}

#[test]
fn placed_probes_read_the_same_arguments_as_entry_probes() {
    let (db, s) = placed_probes("placed", &[]);
    let moved = count(&db, "SELECT count(*) FROM probes WHERE session_id = ?1 AND offset > 0", s.id);
    assert!(moved >= 4, "the shaped library's probes were moved: {moved}");
    let pushed = count(&db, "SELECT count(*) FROM probes WHERE session_id = ?1 AND reason LIKE '%stack +16%'", s.id);
    assert_eq!(pushed, 1, "cuLaunchCooperativeKernel_ptsz pushes two registers before its probe point");
}

#[test]
fn probe_at_entry_keeps_every_probe_on_the_first_instruction() {
    let (db, s) = placed_probes("at-entry", &["--probe-at-entry"]);
    assert_eq!(count(&db, "SELECT count(*) FROM probes WHERE session_id = ?1 AND offset != 0", s.id), 0);
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM probes WHERE session_id = ?1 AND (symbol LIKE 'cuLaunch%' OR symbol LIKE 'cuGraph%')",
            s.id
        ),
        8
    );
}

#[test]
fn count_mode_keeps_exact_counts_without_rows() {
    let (db, truth, s) = attach_and_run(
        "count",
        &["--steps", "30", "--launches", "50"],
        &["--step-symbol", "train_step", "--launches", "count"],
    );
    assert_eq!(count(&db, "SELECT count(*) FROM launches WHERE session_id = ?1", s.id), 0);
    assert_eq!(s.total_launches, Some(1500));
    assert_steps_match(&truth.steps, &steps(&db, s.id), STEP_TOLERANCE_NS);
}

#[test]
fn launches_still_staged_in_the_kernel_at_the_end_are_kept() {
    // No step probe, so nothing flushes a thread's staged launch records but
    // a full stage: 3 threads × 7 × 3 launches leave each thread 5 staged
    // when the target exits, which the agent reads from the map.
    let (db, truth, s) = attach_and_run("staged", &["--threads", "3", "--steps", "7", "--launches", "3"], &[]);
    assert_eq!(truth.total, 63);
    assert_eq!(s.lost_events, Some(0));
    assert_eq!(s.total_launches, Some(63));
    assert_eq!(count(&db, "SELECT count(*) FROM launches WHERE session_id = ?1", s.id), 63);
    let per_thread = count(
        &db,
        "SELECT count(*) FROM (SELECT tid FROM launches WHERE session_id = ?1 GROUP BY tid HAVING count(*) = 21
                                  AND count(DISTINCT grid_x * 1000 + grid_y) = 21)",
        s.id,
    );
    assert_eq!(per_thread, 3, "each thread's 21 launches, each once");
}

#[test]
fn late_dlopen_of_the_driver_is_probed_before_it_loads() {
    // The trainer loads libcuda only after the profiler is attached, and
    // launches at once: the driver was probed where dlopen would find it.
    let (db, truth, s) =
        attach_and_run("late", &["--steps", "10", "--launches", "20"], &["--step-symbol", "train_step"]);
    assert_eq!(s.total_launches, Some(200));
    assert_eq!(api_counts(&db, s.id).get("cuLaunchKernel"), Some(&200));
    assert_steps_match(&truth.steps, &steps(&db, s.id), STEP_TOLERANCE_NS);
    assert_eq!(count(&db, "SELECT count(*) FROM probed_files WHERE session_id = ?1 AND how = 'predicted'", s.id), 1);
}

/// A library loaded from a path nobody could predict is probed once the
/// dynamic loader's hook reports the dlopen (`how`), not by polling the maps
/// (every 10 s here); the trainer launches once the profiler says it probes it.
#[test]
fn late_dlopen_from_an_unpredictable_path_is_found_through_the_loader_hook() {
    let dir = workdir("hidden");
    let db = dir.join("p.db");
    let hidden = fixtures().join("hidden/libcuda.so.1");
    let hidden = hidden.to_str().expect("utf-8 path");
    let mut trainer = Trainer::spawn_with(
        &dir,
        &["--steps", "10", "--launches", "20", "--cuda", hidden, "--after-dlopen-ms", "200"],
        None,
    );
    let agent = Agent::attach(trainer.pid(), &db, &["--step-symbol", "train_step", "--maps-interval", "10000"]);
    trainer.go_once_probed(&agent, &["hidden/libcuda.so.1"]);
    assert!(trainer.wait().success());
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("no CUDA library mapped yet"), "{stderr}");
    let s = last_session(&db);
    assert_eq!(s.total_launches, Some(200));
    assert_steps_match(&trainer.truth().steps, &steps(&db, s.id), STEP_TOLERANCE_NS);
    let how: String = open(&db)
        .query_row("SELECT how FROM probed_files WHERE session_id = ?1 AND kind = 'driver'", [s.id], |r| r.get(0))
        .expect("driver library row");
    assert_eq!(how, "dlopen");
    let loader: String = open(&db)
        .query_row("SELECT how FROM probed_files WHERE session_id = ?1 AND kind = 'loader'", [s.id], |r| r.get(0))
        .expect("loader row");
    assert!(loader.starts_with("_dl_debug_state at file offset 0x"), "{loader}");
}

#[test]
fn target_exit_mid_step_keeps_the_open_step() {
    let dir = workdir("die");
    let db = dir.join("p.db");
    let mut trainer = Trainer::spawn(&dir, &["--steps", "20", "--launches", "10", "--die-in-step", "5"]);
    let agent = Agent::attach(trainer.pid(), &db, &["--step-symbol", "train_step"]);
    trainer.go();
    assert_eq!(trainer.wait().code(), Some(3));
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    let s = last_session(&db);
    assert_eq!(s.end_reason.as_deref(), Some("target-exited"));
    let all = steps(&db, s.id);
    let (done, open): (Vec<_>, Vec<_>) = all.into_iter().partition(|s| s.end_ns.is_some());
    assert_steps_match(&trainer.truth().steps, &done, STEP_TOLERANCE_NS);
    assert_eq!(open.len(), 1, "the step the target died in is kept, open");
    assert_eq!((open[0].step, open[0].launches), (5, None));
}

fn interrupted(name: &str, sig: i32, extra: &[&str], reason: &str) {
    let dir = workdir(name);
    let db = dir.join("p.db");
    let mut trainer = Trainer::spawn(&dir, &["--forever", "--launches", "10", "--gap-us", "2000"]);
    let mut args = vec!["--step-symbol", "train_step"];
    args.extend_from_slice(extra);
    let agent = Agent::attach(trainer.pid(), &db, &args);
    trainer.go();
    std::thread::sleep(Duration::from_millis(800));
    if sig != 0 {
        agent.signal(sig);
    }
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    // The trainer keeps running after the profiler leaves; stop it for its truth.
    trainer.signal(libc::SIGTERM);
    assert!(trainer.wait().success());
    let s = last_session(&db);
    assert_eq!(s.end_reason.as_deref(), Some(reason), "{stderr}");
    let truth = trainer.truth();
    let done: Vec<DbStep> = steps(&db, s.id).into_iter().filter(|s| s.end_ns.is_some()).collect();
    assert!(done.len() >= 20, "only {} steps recorded", done.len());
    // Every step the profiler saw is a real step with its exact launches; every
    // step that ended while it was attached was seen.
    let ended = s.ended_ns.expect("ended") as u64;
    let started = s.started_ns as u64;
    let expected: Vec<TruthStep> =
        truth.steps.iter().filter(|t| t.start_ns > started && t.end_ns < ended).cloned().collect();
    let seen: Vec<DbStep> =
        done.iter().filter(|d| d.start_ns > started && d.end_ns.is_some_and(|e| e < ended)).cloned().collect();
    let covered = expected.len().abs_diff(seen.len()) <= 1;
    assert!(covered, "{} steps ended while attached, {} recorded", expected.len(), seen.len());
    // One for one: per thread, the recorded steps are the run of truth steps
    // that begins with the first one starting after the first recorded entry
    // (steps recur every ~2 ms, so matching by a start within STEP_TOLERANCE_NS
    // could pair a neighbour; `assert_steps_match` pairs in order and requires
    // each truth step inside its database step, which a shifted pairing fails).
    let mut window: Vec<TruthStep> = Vec::new();
    let mut tids: Vec<u32> = done.iter().map(|d| d.tid).collect();
    tids.dedup();
    for tid in tids {
        let mine: Vec<&DbStep> = done.iter().filter(|d| d.tid == tid).collect();
        let theirs: Vec<&TruthStep> = truth.steps.iter().filter(|t| t.tid == tid).collect();
        let first = theirs
            .iter()
            .position(|t| t.start_ns >= mine[0].start_ns)
            .unwrap_or_else(|| panic!("recorded step {:?} is not in the ground truth", mine[0]));
        let run = theirs.get(first..first + mine.len()).unwrap_or_else(|| {
            panic!(
                "{} steps recorded on thread {tid}, only {} in the truth from the first",
                mine.len(),
                theirs.len() - first
            )
        });
        window.extend(run.iter().map(|t| (*t).clone()));
    }
    let e = assert_steps_match(&window, &done, STEP_TOLERANCE_NS);
    report(&format!("{} steps while attached", s.end_reason.as_deref().unwrap_or("?")), &e);
}

#[test]
fn sigint_flushes_and_records_why() {
    interrupted("sigint", libc::SIGINT, &[], "sigint");
}

#[test]
fn sigterm_flushes_and_records_why() {
    interrupted("sigterm", libc::SIGTERM, &[], "sigterm");
}

#[test]
fn duration_stops_by_itself() {
    interrupted("duration", 0, &["--duration", "0.8"], "duration");
}

#[test]
fn duration_zero_smoke_run_loads_and_attaches() {
    let dir = workdir("smoke");
    let db = dir.join("p.db");
    let trainer = Trainer::spawn(&dir, &["--steps", "1"]);
    let (code, stderr) = profiler_output(&[
        "attach",
        &trainer.pid().to_string(),
        "-o",
        db.to_str().expect("utf-8"),
        "--step-symbol",
        "train_step",
        "--duration",
        "0",
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(last_session(&db).end_reason.as_deref(), Some("duration"));
    let probes = count(&db, "SELECT sum(probes) FROM probed_files WHERE session_id = ?1", 1);
    assert_eq!(
        probes,
        2 + 8 + 4 + 3 + 1,
        "step entry+return, the 8 driver launch entry points, 4 sync calls, 3 kernel-naming calls and the loader's hook"
    );
}

#[test]
fn run_traces_a_command_from_its_start_and_passes_its_exit_code() {
    let dir = workdir("run");
    let db = dir.join("p.db");
    let truth = dir.join("truth.txt");
    let out = std::process::Command::new(profiler_bin())
        .args(["run", "-o", db.to_str().expect("utf-8"), "--step-symbol", "train_step", "--"])
        .arg(fixtures().join("trainer"))
        .args(["--steps", "15", "--launches", "30", "--die-in-step", "12", "--truth", truth.to_str().expect("utf-8")])
        .env("LD_LIBRARY_PATH", fixtures())
        .output()
        .expect("run profiler");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "the command's exit code: {stderr}");
    let s = last_session(&db);
    assert_eq!(s.end_reason.as_deref(), Some("target-exited"));
    assert_eq!(s.total_launches, Some(12 * 30));
    let done: Vec<DbStep> = steps(&db, s.id).into_iter().filter(|s| s.end_ns.is_some()).collect();
    assert_steps_match(&Truth::read(&truth).steps, &done, STEP_TOLERANCE_NS);
}

#[test]
fn genuine_nvidia_driver_library() {
    let dir = workdir("genuine");
    let db = dir.join("p.db");
    let truth = dir.join("truth.txt");
    let lib = fixtures().join("nvidia/lib");
    assert!(lib.join("libcuda.so.1").exists(), "genuine libcuda missing: run `cargo xtask fixtures`");
    let out = std::process::Command::new(profiler_bin())
        .args(["run", "-o", db.to_str().expect("utf-8"), "--"])
        .arg(fixtures().join("genuine_launch"))
        .args(["libcuda.so.1", "1000", truth.to_str().expect("utf-8")])
        .env("LD_LIBRARY_PATH", &lib)
        .output()
        .expect("run profiler");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let file = TruthFile::read(&truth);
    let t = &file.text;
    // cuInit returns what this host gives: 100 (no device) without the NVIDIA
    // driver; with it, whatever the 535 library makes of the host's driver.
    let init: i64 =
        file.records("cuInit").next().map(|f| file.num(&f, 0)).unwrap_or_else(|| panic!("no cuInit line: {t}"));
    match nvidia_driver() {
        None => assert_eq!(init, 100, "no NVIDIA driver here: cuInit must fail with 100 (no device): {t}"),
        Some(driver) => {
            skip(format!("cuInit's 100 (no device): this host has the NVIDIA driver ({driver}); cuInit gave {init}"))
        }
    }
    // No context is current on any host: every call fails, and the probes fired on the real code anyway.
    let failed: Vec<i64> = file.records("api").map(|f| file.num(&f, 3)).collect();
    assert!(failed.len() == 8 && failed.iter().all(|&rc| rc != 0), "every launch fails without a context: {t}");
    let expected = Truth::read(&truth).apis;
    assert_eq!(expected.len(), 8, "the genuine library exports all 8 driver launch entry points: {t}");
    let s = last_session(&db);
    assert_eq!(api_counts(&db, s.id), expected);
    assert_eq!(s.total_launches, Some(8000));
    // Every entry point begins `cmpl $imm, rip-relative; je`: the probes sit on the je.
    assert_eq!(count(&db, "SELECT count(*) FROM probes WHERE session_id = ?1 AND offset = 10", s.id), 8);
    // The probe read the real arguments the caller passed.
    let bad = count(
        &db,
        "SELECT count(*) FROM launches_named WHERE session_id = ?1 AND api_name NOT LIKE 'cuGraph%'
         AND NOT (grid_x = 7 AND grid_y = 8 AND grid_z = 9 AND block_x = 64 AND shared_mem_bytes = 512)",
        s.id,
    );
    assert_eq!(bad, 0);
}

#[test]
fn existing_database_gets_a_new_session() {
    let dir = workdir("twice");
    let db = dir.join("p.db");
    for round in 1..=2 {
        let round_dir = dir.join(format!("round{round}"));
        std::fs::create_dir_all(&round_dir).expect("mkdir");
        let mut trainer = Trainer::spawn(&round_dir, &["--steps", "3", "--launches", "5"]);
        let agent = Agent::attach(trainer.pid(), &db, &["--step-symbol", "train_step"]);
        trainer.go();
        trainer.wait();
        let (status, stderr) = agent.finish();
        assert!(status.success(), "{stderr}");
        assert_eq!(last_session(&db).id, round);
    }
    assert_eq!(count(&db, "SELECT count(*) FROM steps WHERE session_id = ?1", 1), 3);
    assert_eq!(count(&db, "SELECT count(*) FROM steps WHERE session_id = ?1", 2), 3);
}

#[test]
fn error_no_such_pid() {
    let (code, stderr) = profiler_output(&["attach", "999999999", "-o", "/tmp/never.db"]);
    one_error_line(code, &stderr, "no process with PID 999999999");
    assert!(!Path::new("/tmp/never.db").exists());
}

#[test]
fn error_without_privileges() {
    let dir = workdir("nopriv");
    let trainer = Trainer::spawn(&dir, &["--steps", "1"]);
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"])
        .arg(profiler_bin())
        .args(["attach", &trainer.pid().to_string(), "-o", "/tmp/nopriv.db"])
        .output()
        .expect("setpriv");
    one_error_line(out.status.code(), &String::from_utf8_lossy(&out.stderr), "run it with sudo");
}

#[test]
fn error_unknown_symbol_lists_near_matches() {
    let dir = workdir("nosym");
    let db = dir.join("p.db");
    let trainer = Trainer::spawn(&dir, &["--steps", "1"]);
    let (code, stderr) = profiler_output(&[
        "attach",
        &trainer.pid().to_string(),
        "-o",
        db.to_str().expect("utf-8"),
        "--step-symbol",
        "trian_step",
    ]);
    one_error_line(code, &stderr, "'trian_step' not found");
    assert!(stderr.contains("near matches: train_step"), "{stderr}");
    // Nothing was started: no session row.
    assert_eq!(count(&db, "SELECT count(*) FROM sessions WHERE id >= ?1", 0), 0);
}

#[test]
fn error_unwritable_output() {
    let dir = workdir("unwritable");
    let trainer = Trainer::spawn(&dir, &["--steps", "1"]);
    let (code, stderr) = profiler_output(&["attach", &trainer.pid().to_string(), "-o", "/proc/version/p.db"]);
    one_error_line(code, &stderr, "cannot open /proc/version/p.db");
}

#[test]
fn error_corrupt_output() {
    let dir = workdir("corrupt");
    let db = dir.join("p.db");
    std::fs::write(&db, vec![0x5au8; 4096]).expect("write");
    let trainer = Trainer::spawn(&dir, &["--steps", "1"]);
    let (code, stderr) = profiler_output(&["attach", &trainer.pid().to_string(), "-o", db.to_str().expect("utf-8")]);
    one_error_line(code, &stderr, "is not a SQLite database");
    assert_eq!(std::fs::read(&db).expect("read"), vec![0x5au8; 4096], "the file is left as it was");
}

#[test]
fn status_line_only_on_a_terminal() {
    let dir = workdir("status");
    let db = dir.join("p.db");
    let trainer = fixtures().join("trainer");
    let cmd = format!(
        "{} run -o {} --no-gpu --step-symbol train_step -- {} --steps 50 --launches 20 --step-sleep-us 40000",
        profiler_bin().display(),
        db.display(),
        trainer.display()
    );
    // `script` gives the profiler a pseudo-terminal.
    let out = std::process::Command::new("script")
        .args(["-qfec", &cmd, "/dev/null"])
        .env("LD_LIBRARY_PATH", fixtures())
        .output()
        .expect("script (util-linux)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let tty = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = tty.split('\r').filter(|l| l.contains("| launches ")).collect();
    assert!(lines.len() >= 2, "a status line about once a second: {tty}");
    assert!(lines.iter().any(|l| l.contains("steps ") && l.contains("/s, last ") && l.contains("| lost 0")), "{tty}");
    assert!(tty.contains("session 1 ended"), "the end summary follows: {tty}");
    // Piped: no status line.
    let out = std::process::Command::new(profiler_bin())
        .args(["run", "-o", db.to_str().expect("utf-8"), "--no-gpu", "--"])
        .arg(&trainer)
        .args(["--steps", "30", "--launches", "5", "--step-sleep-us", "40000"])
        .env("LD_LIBRARY_PATH", fixtures())
        .output()
        .expect("run profiler");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("| launches "), "{stderr}");
}

#[test]
fn sync_wait_is_counted_once_and_charged_to_its_step() {
    for (name, runtime, api) in
        [("sync-driver", false, "cuStreamSynchronize"), ("sync-runtime", true, "cudaStreamSynchronize")]
    {
        let mut args = vec!["--steps", "10", "--launches", "5", "--sync-us", "3000"];
        if runtime {
            // The runtime is found in the maps after its dlopen: attach_and_run waits for its probes.
            args.extend(["--runtime-sync", "--after-dlopen-ms", "500"]);
        }
        let (db, truth, s) = attach_and_run(name, &args, &["--step-symbol", "train_step"]);
        assert_steps_match(&truth.steps, &steps(&db, s.id), STEP_TOLERANCE_NS);
        let conn = open(&db);
        let apis: Vec<(String, i64)> = conn
            .prepare("SELECT api, count(*) FROM syncs WHERE session_id = ?1 GROUP BY api")
            .expect("prepare")
            .query_map([s.id], |r| Ok((r.get(0)?, r.get(1)?)))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(apis, vec![(api.to_string(), 10)], "one sync per step, counted once");
        // Each sync is the trainer's own call: its probes fired between the
        // trainer's clock readings around the call, it waited at least the
        // stand-in's 3 ms, and it is charged to the step it ran in.
        let rows: Vec<(i64, i64, i64, i64)> = conn
            .prepare("SELECT tid, step, start_ns, end_ns FROM syncs WHERE session_id = ?1 ORDER BY start_ns")
            .expect("prepare")
            .query_map([s.id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(truth.syncs.len(), 10, "the trainer timed one sync per step");
        for (row, t) in rows.iter().zip(&truth.syncs) {
            let (tid, step, start, end) = *row;
            assert!(
                tid == i64::from(t.tid)
                    && step == t.step
                    && start >= t.start_ns as i64
                    && end <= t.end_ns as i64
                    && end - start >= 3_000_000,
                "{name}: sync row (tid, step, start, end) {row:?} is not the trainer's {t:?}"
            );
        }
        let outside = count(
            &db,
            "SELECT count(*) FROM syncs y JOIN steps s USING (session_id, label, step)
             WHERE y.session_id = ?1 AND NOT (y.start_ns >= s.start_ns AND y.end_ns <= s.end_ns)",
            s.id,
        );
        assert_eq!(outside, 0, "{name}: syncs outside the step they are charged to");
        let waits = count(
            &db,
            "SELECT count(*) FROM steps s WHERE session_id = ?1 AND sync_wait_ns =
                 (SELECT sum(end_ns - start_ns) FROM syncs y WHERE y.session_id = s.session_id AND y.label = s.label AND y.step = s.step)",
            s.id,
        );
        assert_eq!(waits, 10, "steps.sync_wait_ns is the sum of the step's syncs");
    }
}

#[test]
fn kernel_names_for_driver_handles_and_runtime_host_stubs() {
    let names = |db: &std::path::Path, id: i64| -> Vec<(String, Option<String>, String)> {
        open(db)
            .prepare("SELECT name, demangled_name, source FROM kernels WHERE session_id = ?1 ORDER BY name, source")
            .expect("prepare")
            .query_map([id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows")
    };
    let unnamed = "SELECT count(*) FROM launches l LEFT JOIN kernels k USING (session_id, function)
                   WHERE l.session_id = ?1 AND k.name IS NULL";

    // Driver: handles from cuModuleGetFunction, and cuLibraryGetKernel + cuKernelGetFunction.
    let (db, truth, s) = attach_and_run("names-driver", &["--steps", "5", "--launches", "9", "--named"], &[]);
    assert_eq!(truth.total, 45);
    assert_eq!(
        names(&db, s.id),
        vec![
            ("_Z4reluPfi".into(), Some("relu(float*, int)".into()), "cuModuleGetFunction".into()),
            (
                "_Z6matmulPfS_S_i".into(),
                Some("matmul(float*, float*, float*, int)".into()),
                "cuModuleGetFunction".into()
            ),
            // The CUfunction of a library kernel, and the CUkernel itself (CUDA 12 launches either).
            ("_Z7softmaxPfi".into(), Some("softmax(float*, int)".into()), "cuKernelGetFunction".into()),
            ("_Z7softmaxPfi".into(), Some("softmax(float*, int)".into()), "cuLibraryGetKernel".into()),
        ]
    );
    assert_eq!(count(&db, "SELECT count(*) FROM launches WHERE session_id = ?1", s.id), 45);
    assert_eq!(count(&db, unnamed, s.id), 0, "every launch joins a name");

    // Runtime: the host stub's ELF symbol is the kernel's mangled name.
    let (db, _, s) = attach_and_run(
        "names-runtime",
        &["--steps", "5", "--launches", "4", "--stubs", "--after-dlopen-ms", "500"],
        &[],
    );
    let n = names(&db, s.id);
    assert_eq!(
        n.iter().map(|k| (k.0.as_str(), k.2.as_str())).collect::<Vec<_>>(),
        vec![("_Z12saxpy_kernelifPKfPf", "symbol"), ("_Z12scale_kernelPfi", "symbol")]
    );
    assert_eq!(n[0].1.as_deref(), Some("saxpy_kernel(int, float, float const*, float*)"));
    assert_eq!(count(&db, unnamed, s.id), 0, "every runtime launch joins a name");
}

/// `profiler report DB [ARGS]` → (exit code, stdout, stderr).
fn report_of(db: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(profiler_bin()).arg("report").arg(db).args(args).output().expect("run report");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The agent killed with SIGKILL mid-session: the database opens intact,
/// every step it committed is the trainer's own (each thread's first steps,
/// exact, with their launch rows), the session has no end, and `report` says
/// it did not end cleanly (and, while the agent lived, that it was running).
#[test]
fn sigkill_mid_session_keeps_every_committed_row_and_report_says_so() {
    use std::os::unix::process::ExitStatusExt;
    let dir = workdir("sigkill");
    let db = dir.join("p.db");
    let no_rapl = dir.join("no-rapl");
    std::fs::create_dir_all(&no_rapl).expect("empty powercap root");
    let mut trainer = Trainer::spawn(
        &dir,
        &["--forever", "--threads", "2", "--launches", "20", "--step-sleep-us", "5000", "--gap-us", "1000"],
    );
    let agent = Agent::attach(
        trainer.pid(),
        &db,
        &["--step-symbol", "train_step", "--no-gpu", "--powercap-root", no_rapl.to_str().expect("utf-8")],
    );
    trainer.go();
    // Until committed step rows show, read-only, beside the writer.
    let t0 = std::time::Instant::now();
    loop {
        let committed: i64 = rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .and_then(|c| c.query_row("SELECT count(*) FROM steps WHERE end_ns IS NOT NULL", [], |r| r.get(0)))
            .unwrap_or(0);
        if committed >= 40 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "no committed steps after 30 s: {}", agent.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    let json = |db: &Path| -> serde_json::Value {
        let (code, out, err) = report_of(db, &["--format", "json"]);
        assert_eq!(code, Some(0), "{err}");
        serde_json::from_str(&out).expect("report JSON")
    };
    let live = json(&db);
    assert_eq!(live["session"]["state"], "running", "{}", live["session"]);

    agent.signal(libc::SIGKILL);
    let (status, stderr) = agent.finish();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{stderr}");
    // The trainer runs on, untraced: its later steps are in its truth, not in the database.
    std::thread::sleep(Duration::from_millis(300));

    // The report, while the target still runs: the session did not end cleanly.
    let (code, table, err) = report_of(&db, &[]);
    assert_eq!(code, Some(0), "{err}");
    println!("{table}");
    assert!(table.contains("did not end cleanly (the profiler was killed?)"), "{table}");
    assert_fits_80_columns(&table);
    let killed = json(&db);
    assert_eq!(killed["session"]["state"], "unclean", "{}", killed["session"]);
    assert!(killed["session"]["end_reason"].is_null() && killed["session"]["duration_s"].is_null());
    let (_, csv, _) = report_of(&db, &["--format", "csv"]);
    assert!(csv.lines().any(|l| l == "session,,state,unclean,"), "{csv}");

    trainer.signal(libc::SIGTERM);
    assert!(trainer.wait().success(), "trainer failed");
    let truth = trainer.truth();

    let conn = open(&db);
    let check: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).expect("integrity_check");
    assert_eq!(check, "ok");
    let s = last_session(&db);
    assert_eq!((s.ended_ns, s.end_reason.as_deref(), s.total_launches), (None, None, None), "no end was written");
    let rows = steps(&db, s.id);
    let done: Vec<DbStep> = rows.iter().filter(|r| r.end_ns.is_some()).cloned().collect();
    // Each thread's committed steps are its first steps, exactly.
    let mut expected = Vec::new();
    let tids: std::collections::BTreeSet<u32> = done.iter().map(|d| d.tid).collect();
    for tid in &tids {
        let n = done.iter().filter(|d| d.tid == *tid).count();
        let of_thread: Vec<&TruthStep> = truth.steps.iter().filter(|t| t.tid == *tid).collect();
        assert!(of_thread.len() > n, "thread {tid}: the trainer ran on after the kill ({n} committed)");
        expected.extend(of_thread[..n].iter().map(|t| (*t).clone()));
    }
    assert_eq!(tids.len(), 2, "both threads' steps committed");
    let e = assert_steps_match(&expected, &done, STEP_TOLERANCE_NS);
    report("after SIGKILL", &e);
    // A step still open at the kill has no end, and starts after its thread's last committed one.
    for open_step in rows.iter().filter(|r| r.end_ns.is_none()) {
        let last = done.iter().filter(|d| d.tid == open_step.tid).map(|d| d.end_ns.unwrap_or(0)).max();
        assert!(last.is_none_or(|l| open_step.start_ns > l), "{open_step:?}");
    }
    // Every committed step's launch rows are there: the launches precede the step's end in the writer's queue.
    let short = count(
        &db,
        "SELECT count(*) FROM steps s WHERE session_id = ?1 AND end_ns IS NOT NULL
         AND launches != (SELECT count(*) FROM launches l WHERE l.session_id = s.session_id AND l.tid = s.tid
                          AND l.step = s.step)",
        s.id,
    );
    assert_eq!(short, 0, "committed steps missing launch rows");
    println!(
        "SIGKILL: {} committed steps of {} the trainer ran, {} launch rows",
        done.len(),
        truth.steps.len(),
        count(&db, "SELECT count(*) FROM launches WHERE session_id = ?1", s.id)
    );
}

/// A driver library whose probes attach only half way (its second launch
/// entry point lies past the end of the file, where the kernel refuses a
/// uprobe): none of its probes stay, one warning and a `probed_files` row say
/// why, and the session goes on.
#[test]
fn a_library_probed_half_way_keeps_no_probe_and_says_why() {
    let dir = workdir("halfway");
    let db = dir.join("p.db");
    let lib_dir = fixtures().join("halfway");
    let args: Vec<String> =
        ["run", "-o", db.to_str().expect("utf-8"), "--no-gpu", "--", "true"].iter().map(|s| s.to_string()).collect();
    let agent = Agent::start_with_env(&args, &[("LD_LIBRARY_PATH", lib_dir.to_str().expect("utf-8"))], false);
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    let s = last_session(&db);
    let lib = lib_dir.join("libcuda.so.1").display().to_string();
    let (kind, probes, how): (String, i64, String) = open(&db)
        .query_row(
            "SELECT kind, probes, how FROM probed_files WHERE session_id = ?1 AND path = ?2",
            rusqlite::params![s.id, lib],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .expect("a probed_files row for the library that could not be probed");
    assert_eq!((kind.as_str(), probes), ("driver", 0), "{how}");
    assert!(how.starts_with("not probed (predicted): "), "{how}");
    let placed: i64 = open(&db)
        .query_row(
            "SELECT count(*) FROM probes WHERE session_id = ?1 AND library = ?2",
            rusqlite::params![s.id, lib],
            |r| r.get(0),
        )
        .expect("probes");
    assert_eq!(placed, 0);
    assert_eq!(stderr.matches("could not probe").count(), 1, "{stderr}");
}
