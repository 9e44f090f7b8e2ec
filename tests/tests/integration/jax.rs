//! JAX steps (#25) on a real JAX (`jax[cpu]` from PyPI, 0.12.0.1 and 0.6.2,
//! in the environments `cargo xtask` makes: `PROFILER_JAX_PYTHONS`): a loop
//! that calls a jitted `train_step` and, every 10 steps, a jitted
//! `eval_step`, and writes its own stamps around each call
//! (tests/fixtures/jax_loop.py), compared with the database.
use std::{
    path::{Path, PathBuf},
    process::{Child, Command},
    time::{Duration, Instant},
};

use integration_tests::*;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/jax_loop.py")
}

/// One jitted call as the loop saw it: stamped before the call and once its result was ready.
#[derive(Clone, Debug)]
struct LoopCall {
    label: String,
    tid: u32,
    start_ns: i64,
    /// A call before the loop, which traced and compiled the function.
    compiling: bool,
    /// The loop thread's time on a run queue from before its stamp to the
    /// call's return (the dispatch, not the compute); 0 for a compiling call.
    queued_ns: i64,
}

struct Loop {
    child: Child,
    dir: PathBuf,
}

/// A loop left running by a failed test would keep its stdout (the test
/// runner's) open: it is killed with its `Loop`.
impl Drop for Loop {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Loop {
    /// Starts the loop and waits until its functions are compiled.
    fn start(python: &Path, name: &str, args: &[&str]) -> Loop {
        let dir = workdir(name);
        let child = Command::new(python)
            .arg(fixture())
            .args(args)
            .arg("--truth")
            .arg(dir.join("truth.txt"))
            .arg("--wait-file")
            .arg(dir.join("go"))
            .arg("--ready-file")
            .arg(dir.join("ready"))
            .spawn()
            .expect("python loop");
        let l = Loop { child, dir };
        let t0 = Instant::now();
        while !l.dir.join("ready").exists() {
            assert!(t0.elapsed() < Duration::from_secs(120), "the loop never got ready");
            std::thread::sleep(Duration::from_millis(20));
        }
        l
    }

    fn db(&self) -> PathBuf {
        self.dir.join("p.db")
    }

    /// The loop's calls in its loop (not its compiling calls before it).
    fn truth(&self) -> Vec<LoopCall> {
        loop_calls(&self.dir.join("truth.txt")).into_iter().filter(|c| !c.compiling).collect()
    }
}

/// Every call the loop stamped, its compiling calls before the loop too, in start order.
fn loop_calls(path: &Path) -> Vec<LoopCall> {
    let truth = TruthFile::read(path);
    let call = |r: &[&str], first: usize, compiling| LoopCall {
        label: r[0].to_owned(),
        tid: truth.num(r, first),
        start_ns: truth.num(r, first + 1),
        compiling,
        queued_ns: if compiling { 0 } else { truth.num(r, first + 3) },
    };
    let mut v: Vec<LoopCall> = truth.records("compile").map(|r| call(&r, 1, true)).collect();
    v.extend(truth.records("call").map(|r| call(&r, 2, false)));
    v.sort_by_key(|c| c.start_ns);
    v
}

/// Runs the loop under `profiler attach` from its first measured call to its end.
fn traced(python: &Path, name: &str, args: &[&str], flags: &[&str]) -> (Loop, String) {
    let mut l = Loop::start(python, name, args);
    let mut all = vec!["--no-gpu"];
    all.extend(flags);
    let agent = Agent::attach(l.child.id(), &l.db(), &all);
    std::fs::write(l.dir.join("go"), b"").expect("go");
    assert!(l.child.wait().expect("wait").success());
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    (l, stderr)
}

/// Every step of the session, in start order (the last one has no end).
fn all_steps(db: &Path) -> Vec<DbStep> {
    let s = last_session(db);
    let mut v = steps(db, s.id);
    v.sort_by_key(|d| d.start_ns);
    v
}

/// The database's steps are the loop's calls of `labels`, one for one: each
/// begins just after the loop's stamp before its call (the probe is at the
/// call's entry) and ends where the next step function's call begins.
/// Returns the p99 start error (ns).
fn compare(truth: &[LoopCall], db: &[DbStep]) -> i64 {
    assert_eq!(db.len(), truth.len(), "steps: database {} vs the loop's calls {}", db.len(), truth.len());
    let mut starts = Vec::new();
    for (i, (t, d)) in truth.iter().zip(db).enumerate() {
        assert_eq!(d.tid, t.tid, "thread of step {d:?}");
        assert_eq!(d.label, t.label, "label of step {d:?} vs {t:?}");
        // Late by no more than the bound and the time the loop's thread was
        // kept off a CPU meanwhile; the p99 is of the error net of that time.
        let ds = d.start_ns as i64 - t.start_ns;
        assert!(
            (0..STEP_TOLERANCE_NS + t.queued_ns).contains(&ds),
            "{d:?} starts {ds} ns after the loop's stamp {t:?} ({} ns runnable, not running)",
            t.queued_ns
        );
        starts.push((ds - t.queued_ns).max(0));
        // The gap since the same label's previous step: none after one of its own.
        if i > 0 && db[i - 1].label == d.label {
            assert_eq!(d.inter_step_ns, Some(0), "{d:?}: shared boundaries");
        }
        match (truth.get(i + 1), db.get(i + 1)) {
            (Some(_), Some(next)) => assert_eq!(d.end_ns, Some(next.start_ns), "{d:?} ends where the next step begins"),
            _ => assert_eq!(d.end_ns, None, "the last step ends with no next call: {d:?}"),
        }
    }
    BoundaryErrors::p99(&starts)
}

/// The p99 bound the issue sets for JAX step boundaries.
const P99_NS: i64 = 1_000_000;

#[test]
fn a_jitted_train_step_is_a_step_per_call_with_no_flags() {
    for (version, py) in jax_pythons() {
        let (l, stderr) = traced(&py, &format!("jax-auto-{version}"), &["--steps", "60"], &[]);
        let truth: Vec<LoopCall> = l.truth().into_iter().filter(|c| c.label == "train").collect();
        assert_eq!(truth.len(), 60);
        let p99 = compare(&truth, &all_steps(&l.db()));
        println!("JAX {version}: step start p99 {:.1} µs after the loop's stamp", p99 as f64 / 1e3);
        assert!(p99 < P99_NS, "JAX {version}: p99 start error {p99} ns");
        let said: Vec<&str> = stderr.lines().filter(|l| l.contains("steps from the jitted function")).collect();
        assert_eq!(said.len(), 1, "{stderr}");
        assert!(said[0].contains("train_step") && said[0].contains("--step-jit"), "{}", said[0]);
        // Each step's dispatch time is its own call's, inside the step.
        let conn = open(&l.db());
        let bad: i64 = conn
            .query_row(
                "SELECT count(*) FROM steps WHERE dispatch_ns IS NULL OR dispatch_ns <= 0
                     OR (end_ns IS NOT NULL AND dispatch_ns > end_ns - start_ns)",
                [],
                |r| r.get(0),
            )
            .expect("query");
        assert_eq!(bad, 0, "JAX {version}: steps without a dispatch time inside them");
    }
}

/// `profiler run` sees the loop from its first instruction, compiling calls
/// included, and `--steps auto` stores one step per call of `train_step`: as
/// many as the loop's own count of its calls (#35: 200 calls in the loop and
/// the one before it that compiles are 201 calls, and 201 steps, the first
/// of which begins at the compiling call). With no call before the loop, its
/// first call compiles and is its first step: 200 calls, 200 steps.
#[test]
fn run_stores_a_step_per_train_step_call_the_compiling_one_too() {
    let pythons = jax_pythons();
    for want in ["0.6.2", "0.12."] {
        if !pythons.iter().any(|(v, _)| v.starts_with(want)) {
            skip(format_args!("no JAX {want} environment in PROFILER_JAX_PYTHONS (see `cargo xtask jax-env`)"));
        }
    }
    for (version, py) in pythons {
        for (case, warmup) in [("compiled before the loop", true), ("compiled by the loop's first call", false)] {
            let dir = workdir(&format!("jax-run-{}-{version}", if warmup { "warm" } else { "cold" }));
            let (db, truth) = (dir.join("p.db"), dir.join("truth.txt"));
            let mut args: Vec<String> = ["run", "--no-gpu", "--steps", "auto", "-o"].map(String::from).into();
            args.push(db.display().to_string());
            args.extend(["--".into(), py.display().to_string(), fixture().display().to_string()]);
            args.extend(["--steps", "200", "--truth"].map(String::from));
            args.push(truth.display().to_string());
            if !warmup {
                args.push("--no-warmup".into());
            }
            let (status, stderr) = Agent::start(&args, false).finish();
            assert!(status.success(), "{stderr}");
            let calls: Vec<LoopCall> = loop_calls(&truth).into_iter().filter(|c| c.label == "train").collect();
            let before = calls.iter().filter(|c| c.compiling).count();
            assert_eq!((calls.len(), before), if warmup { (201, 1) } else { (200, 0) }, "the loop's calls");
            let db_steps = all_steps(&db);
            println!("JAX {version}, {case}: {} train_step calls, {} steps", calls.len(), db_steps.len());
            let p99 = compare(&calls, &db_steps);
            assert!(p99 < P99_NS, "JAX {version}, {case}: p99 start error {p99} ns");
            // The end line counts the last step, which no call ended, apart.
            let said = format!(": {} steps (mean", calls.len() - 1);
            assert!(stderr.contains(&said) && stderr.contains("and 1 open (stored with no end)"), "{stderr}");
        }
    }
}

#[test]
fn step_jit_gives_eval_steps_their_own_label() {
    let Some((_, py)) = jax_pythons().into_iter().next() else { return };
    let flags = ["--step-jit", "train_step", "--step-jit", "eval=eval_step"];
    let (l, _) = traced(&py, "jax-eval", &["--steps", "40"], &flags);
    let truth = l.truth();
    assert_eq!(truth.iter().filter(|c| c.label == "eval").count(), 4);
    let p99 = compare(&truth, &all_steps(&l.db()));
    assert!(p99 < P99_NS, "p99 start error {p99} ns");
    let source: String =
        open(&l.db()).query_row("SELECT step_source FROM sessions", [], |r| r.get(0)).expect("step_source");
    assert_eq!(source, "jit:train=train_step jit:eval=eval_step");
}

#[test]
fn a_step_that_runs_through_lax_scan() {
    let Some((_, py)) = jax_pythons().into_iter().next() else { return };
    let (l, _) = traced(&py, "jax-scan", &["--steps", "30", "--scan"], &[]);
    let truth: Vec<LoopCall> = l.truth().into_iter().filter(|c| c.label == "train").collect();
    let p99 = compare(&truth, &all_steps(&l.db()));
    assert!(p99 < P99_NS, "p99 start error {p99} ns");
}

#[test]
fn the_python_name_of_the_function_is_the_one_read() {
    let Some((_, py)) = jax_pythons().into_iter().next() else { return };
    // `train_step = jax.jit(_update)`: jax knows it as `_update`.
    let (l, _) = traced(&py, "jax-alias", &["--steps", "20", "--alias"], &["--step-jit", "_update"]);
    let truth: Vec<LoopCall> = l.truth().into_iter().filter(|c| c.label == "train").collect();
    let calls: i64 = open(&l.db())
        .query_row("SELECT count(*) FROM jit_calls WHERE name = '_update' AND depth = 0", [], |r| r.get(0))
        .expect("query");
    assert_eq!(calls, truth.len() as i64);
    compare(&truth, &all_steps(&l.db()));
}

#[test]
fn attach_to_a_running_jax_loop_records_its_steps() {
    let Some((_, py)) = jax_pythons().into_iter().next() else { return };
    let mut l = Loop::start(&py, "jax-running", &["--forever"]);
    std::fs::write(l.dir.join("go"), b"").expect("go");
    std::thread::sleep(Duration::from_millis(500));
    let agent = Agent::attach(l.child.id(), &l.db(), &["--no-gpu", "--duration", "3"]);
    let (status, stderr) = agent.finish();
    let _ = l.child.kill();
    let _ = l.child.wait();
    assert!(status.success(), "{stderr}");
    let truth: Vec<LoopCall> = l.truth().into_iter().filter(|c| c.label == "train").collect();
    let db: Vec<DbStep> = all_steps(&l.db()).into_iter().filter(|d| d.end_ns.is_some()).collect();
    assert!(db.len() > 10, "{} steps", db.len());
    // Each is one of the loop's calls, and ends where the loop's next call began.
    for d in db {
        // The loop's last call stamped before the step began.
        let i = truth.iter().rposition(|t| t.start_ns <= d.start_ns as i64);
        let Some(i) = i else { panic!("{d:?}: no loop call begins before it") };
        let ds = d.start_ns as i64 - truth[i].start_ns;
        assert!(ds < STEP_TOLERANCE_NS, "{d:?}: {ds} ns after the loop's call {:?}", truth[i]);
        let end = d.end_ns.expect("ended") as i64;
        let next = truth.get(i + 1).expect("a next call");
        assert!((0..STEP_TOLERANCE_NS).contains(&(end - next.start_ns)), "{d:?} vs next call {next:?}");
    }
}

/// The CUDA build: JAX 0.12 with `jax-cuda12-plugin` and `jax-cuda12-pjrt`
/// (the environment `cargo xtask jax-env` makes, without the NVIDIA
/// libraries: the plugin loads, finds no CUDA, and JAX runs on the CPU). The
/// loop's steps are recorded there as on the CPU build (the first test runs
/// it too), and `doctor` says the jit probe resolves in the process, which
/// maps the plugin's libraries.
#[test]
fn doctor_says_which_step_source_auto_takes_with_the_cuda_plugin_loaded() {
    let Some((_, py)) = jax_pythons().into_iter().find(|(v, _)| v.ends_with("+cuda12")) else {
        skip("no JAX environment with the CUDA plugin (see `cargo xtask jax-env`)");
        return;
    };
    let script = "import jax, time; jax.jit(lambda x: x + 1)(1); print(flush=True); time.sleep(60)";
    let mut child = Command::new(&py)
        .args(["-c", script])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("python");
    let mut line = String::new();
    let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().expect("stdout")), &mut line);
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", child.id())).unwrap_or_default();
    let out = Command::new(profiler_bin()).arg("doctor").arg(child.id().to_string()).output().expect("doctor");
    let _ = child.kill();
    let _ = child.wait();
    assert!(maps.contains("jax_cuda12_plugin/"), "the CUDA plugin is not loaded:\n{maps}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let auto = stdout.lines().find(|l| l.contains("--steps auto")).unwrap_or_default();
    assert!(auto.contains("jitted training step") && auto.contains("PjitFunction::Call at 0x"), "{stdout}");
}

/// The jitted call's native frames (#34): CPU samples taken in the loop's
/// `train_step` steps name jaxlib's C++ under the loop's Python frame: the
/// jitted function's call (`PjitFunction::Call`), called from `main` in
/// jax_loop.py, and XLA's CPU executable run beneath it. The names are the
/// files' own: most of jaxlib's frames are verbatim among the defined
/// symbols binutils' `nm -C` reads from the same file (the rest differ in
/// how the two demanglers spell template arguments: `1024u`, `(unsigned int)1024`).
#[test]
fn cpu_samples_of_a_jitted_call_name_jaxlibs_native_frames_under_the_python_caller() {
    for (version, py) in jax_pythons() {
        let (l, stderr) = traced(&py, &format!("jax-frames-{version}"), &["--steps", "600"], &["--cpu-sample", "999"]);
        let venv = py.parent().and_then(Path::parent).expect("a venv");
        let jaxlib: Vec<PathBuf> = site_packages(venv)
            .into_iter()
            .flat_map(|p| std::fs::read_dir(p.join("jaxlib")).into_iter().flatten().flatten())
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "so"))
            .collect();
        let file_of = |module: &str| jaxlib.iter().find(|p| p.file_name().is_some_and(|n| n == module));
        let conn = open(&l.db());
        // Each sample in a train step: its frames, leaf first.
        let mut q = conn
            .prepare(
                "SELECT s.rowid, st.depth, f.kind, f.module, f.function FROM cpu_samples s
                 JOIN stacks st ON st.session_id = s.session_id AND st.stack_id = s.stack_id
                 JOIN frames f ON f.session_id = st.session_id AND f.frame_id = st.frame_id
                 WHERE s.label = 'train' ORDER BY s.rowid, st.depth",
            )
            .expect("prepare");
        type Frame = (String, Option<String>, String);
        let mut samples: std::collections::BTreeMap<i64, Vec<Frame>> = Default::default();
        for row in q.query_map([], |r| Ok((r.get::<_, i64>(0)?, (r.get(2)?, r.get(3)?, r.get(4)?)))).expect("query") {
            let (id, frame) = row.expect("row");
            samples.entry(id).or_default().push(frame);
        }
        assert!(!samples.is_empty(), "JAX {version}: no CPU samples in the train steps: {stderr}");
        let is_jaxlib = |f: &Frame| f.0 == "native" && f.1.as_deref().is_some_and(|m| file_of(m).is_some());
        let call = |f: &Frame| is_jaxlib(f) && f.2.contains("PjitFunction::Call");
        let under_main = samples
            .values()
            .filter(|frames| {
                let Some(at) = frames.iter().position(call) else { return false };
                let caller = frames[at..].iter().any(|f| {
                    f.0 == "python" && f.1.as_deref().is_some_and(|m| m.ends_with("jax_loop.py")) && f.2 == "main"
                });
                let beneath = frames[..at].iter().any(|f| is_jaxlib(f) && f.2.contains("xla::"));
                caller && beneath
            })
            .count();
        let with_call = samples.values().filter(|f| f.iter().any(call)).count();
        println!(
            "JAX {version}: {} samples in train steps, {with_call} in the jitted call, {under_main} of those \
             from main with XLA's run beneath",
            samples.len()
        );
        assert!(under_main > 0, "JAX {version}: no sample of the jitted call under main with XLA beneath it");
        // The names against the files' own symbols.
        let mut names: std::collections::BTreeMap<&str, std::collections::BTreeSet<&str>> = Default::default();
        for f in samples.values().flatten().filter(|f| is_jaxlib(f)) {
            names.entry(f.1.as_deref().expect("a module")).or_default().insert(&f.2);
        }
        let (mut known, mut all) = (0, 0);
        for (module, functions) in &names {
            let path = file_of(module).expect("a jaxlib file");
            let out = std::process::Command::new("nm")
                .args(["-C", "--defined-only"])
                .arg(path)
                .output()
                .expect("nm (binutils)");
            let text = String::from_utf8_lossy(&out.stdout);
            let symbols: std::collections::HashSet<&str> =
                text.lines().filter_map(|l| l.splitn(3, ' ').nth(2)).collect();
            all += functions.len();
            known += functions.iter().filter(|f| symbols.contains(**f)).count();
            assert!(functions.iter().all(|f| !f.starts_with("0x")), "JAX {version}: an unnamed frame in {module}");
        }
        println!("JAX {version}: {known} of {all} jaxlib function names verbatim in nm -C's");
        assert!(known * 4 >= all * 3, "JAX {version}: {known} of {all} names among the files' symbols");
    }
}
