//! Python frames in CPU samples (#34): a loop whose step burns known shares
//! of its CPU time in a pure-Python function and in native code
//! (tests/fixtures/cpu_py_loop.py, which measures both with its thread's CPU
//! clock), on every CPython this host has (pyenv's 3.10–3.13, Debian's 3.11,
//! trixie's 3.13, sid's 3.14), and on a real PyTorch 2.15 (torch.matmul)
//! under pyenv's 3.12 and 3.13, checked against py-spy's view of the same
//! loop. The report must name both functions at their measured shares, each
//! Python frame must carry its file and first line, and the stacks must run
//! from the module through the step to the function.
use std::{
    collections::BTreeMap,
    ffi::OsString,
    path::{Path, PathBuf},
    process::Command,
};

use integration_tests::*;

const HZ: u32 = 199;
/// How far a function's sampled share may be from its measured one.
const SHARE_BOUND: f64 = 0.05;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/cpu_py_loop.py")
}

/// The line `def NAME(` is on in the fixture.
fn def_line(name: &str) -> i64 {
    let text = std::fs::read_to_string(fixture()).expect("fixture");
    let at = text.lines().position(|l| l.starts_with(&format!("def {name}("))).expect("def");
    at as i64 + 1
}

/// A CPython on this host, as a command line's first words.
struct Interp {
    name: String,
    argv: Vec<OsString>,
}

/// pyenv's, Debian's, and trixie's/sid's as `cargo xtask fixtures` unpacks
/// them (run through their own glibc's loader).
fn interpreters() -> Vec<Interp> {
    let mut out = Vec::new();
    for v in ["3.10.13", "3.11.7", "3.12.1", "3.13.0"] {
        let python = PathBuf::from(format!("/root/.pyenv/versions/{v}/bin/python3"));
        match python.exists() {
            true => out.push(Interp { name: format!("pyenv {v}"), argv: vec![python.into()] }),
            false => skip(format!("{} not installed", python.display())),
        }
    }
    match Path::new("/usr/bin/python3.11").exists() {
        true => out.push(Interp { name: "Debian 3.11".into(), argv: vec!["/usr/bin/python3.11".into()] }),
        false => skip("Debian's /usr/bin/python3.11 not installed"),
    }
    for (suite, v) in [("trixie", "3.13"), ("sid", "3.14")] {
        let root = fixtures().join("debian-python").join(suite).join("root");
        let (python, lib) = (root.join(format!("usr/bin/python{v}")), root.join("usr/lib/x86_64-linux-gnu"));
        if !python.exists() {
            skip(format!("Debian {suite}'s python{v} not unpacked (cargo xtask fixtures could not fetch it)"));
            continue;
        }
        let path = format!("{}:/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu", lib.display());
        let argv = vec![lib.join("ld-linux-x86-64.so.2").into(), "--library-path".into(), path.into(), python.into()];
        out.push(Interp { name: format!("Debian {suite} {v}"), argv });
    }
    out
}

struct Run {
    db: PathBuf,
    /// (pure-Python share, native share) of the steps' CPU time, as the loop measured them.
    truth: (f64, f64),
    stderr: String,
}

fn loop_args(native: &str, truth: &Path) -> Vec<OsString> {
    loop_args_with(native, truth, &[])
}

fn loop_args_with(native: &str, truth: &Path, extra: &[&str]) -> Vec<OsString> {
    let mut a: Vec<OsString> = vec![fixture().into()];
    a.extend(["--native", native, "--steps", "40", "--truth"].map(OsString::from));
    a.push(truth.into());
    a.extend(extra.iter().map(OsString::from));
    a
}

fn truth_shares(truth: &Path) -> (f64, f64) {
    let t = TruthFile::read(truth);
    let (step, py, native) = t.records("step").fold((0.0, 0.0, 0.0), |(s, p, n), r| {
        (s + t.num::<f64>(&r, 2), p + t.num::<f64>(&r, 3), n + t.num::<f64>(&r, 4))
    });
    (py / step, native / step)
}

/// The loop, calibrated and waiting, under `profiler attach`; its steps the
/// calls of `train_step`.
fn profiled(test: &str, argv: &[OsString], native: &str) -> Run {
    profiled_with(test, argv, native, &[])
}

fn profiled_with(test: &str, argv: &[OsString], native: &str, extra: &[&str]) -> Run {
    let dir = workdir(test);
    let (db, truth, go, ready) = (dir.join("p.db"), dir.join("truth.txt"), dir.join("go"), dir.join("ready"));
    let mut command = Command::new(&argv[0]);
    command
        .args(&argv[1..])
        .args(loop_args_with(native, &truth, extra))
        .arg("--wait-file")
        .arg(&go)
        .arg("--ready-file")
        .arg(&ready);
    let mut child = command.spawn().expect("start the loop");
    let t0 = std::time::Instant::now();
    while !ready.exists() {
        assert!(t0.elapsed().as_secs() < 120, "{test}: the loop never got ready");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let hz = HZ.to_string();
    let agent = Agent::attach(child.id(), &db, &["--no-gpu", "--step-python", "train_step", "--cpu-sample", &hz]);
    std::fs::write(&go, "").expect("go");
    let exited = child.wait().expect("the loop");
    let (status, stderr) = agent.finish();
    assert!(exited.success() && status.success(), "{test}: {exited}, {status}: {stderr}");
    Run { db, truth: truth_shares(&truth), stderr }
}

/// The `train` label's CPU section of the report.
fn train_cpu(db: &Path) -> serde_json::Value {
    let out = Command::new(profiler_bin())
        .args(["report", db.to_str().expect("utf-8"), "--format", "json"])
        .output()
        .expect("run report");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("report JSON");
    let labels = report["cpu"]["labels"].as_array().cloned().unwrap_or_default();
    labels.into_iter().find(|l| l["label"] == "train").unwrap_or_else(|| panic!("no train label: {report}"))
}

/// A Python function's total share in the report's lists.
fn total_share(train: &serde_json::Value, function: &str) -> Option<f64> {
    ["by_total", "by_self"]
        .iter()
        .filter_map(|list| train[list].as_array())
        .flatten()
        .find(|f| f["kind"] == "python" && f["function"] == function)
        .and_then(|f| f["total_share"].as_f64())
}

fn collapsed(db: &Path) -> String {
    let out = Command::new(profiler_bin())
        .args(["export", db.to_str().expect("utf-8"), "--format", "collapsed", "--label", "train"])
        .output()
        .expect("run export");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

/// Samples in `folded` whose stack holds `frames` in this order, one after another.
fn samples_through(folded: &str, frames: &str) -> u64 {
    folded
        .lines()
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(stack, _)| format!(";{stack};").contains(&format!(";{frames};")))
        .map(|(_, n)| n.parse::<u64>().expect("count"))
        .sum()
}

/// What every run must show: both functions named as Python frames (file,
/// first line) at their measured shares, under the step, under the module.
fn check(name: &str, run: &Run, native_function: &str) {
    assert!(!run.stderr.contains("native frames only"), "{name}: {}", run.stderr);
    let train = train_cpu(&run.db);
    for (function, want) in [("python_part", run.truth.0), (native_function, run.truth.1)] {
        let got = total_share(&train, function).unwrap_or_else(|| panic!("{name}: no {function} in\n{train}"));
        assert!((got - want).abs() <= SHARE_BOUND, "{name}: {function}: sampled {got:.3}, measured {want:.3}\n{train}");
    }
    let conn = open(&run.db);
    for function in ["python_part", native_function, "train_step", "<module>"] {
        let sql = "SELECT module, line FROM frames WHERE kind = 'python' AND function = ?1 AND module LIKE '%/cpu_py_loop.py'";
        let (module, line): (String, i64) = conn
            .query_row(sql, [function], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap_or_else(|e| panic!("{name}: no Python frame {function} of the loop: {e}"));
        assert_eq!(Path::new(&module), fixture(), "{name}: {function}'s file");
        if function != "<module>" {
            assert_eq!(line, def_line(function), "{name}: {function}'s first line");
        }
    }
    // Every sample of the step is under the module's frame, then the step's.
    let folded = collapsed(&run.db);
    let total: u64 =
        folded.lines().filter_map(|l| l.rsplit_once(' ')).map(|(_, n)| n.parse::<u64>().expect("count")).sum();
    let under = samples_through(&folded, "train_step;python_part") + samples_through(&folded, "train_step;native_part");
    assert!(under as f64 >= 0.9 * total as f64, "{name}: {under} of {total} samples under the step\n{folded}");
    let first = folded.lines().filter_map(|l| l.split(';').next()).all(|root| root == "<module>");
    assert!(first, "{name}: a stack that does not start at <module>\n{folded}");
}

#[test]
fn python_frames_name_the_functions_at_their_shares_on_every_cpython() {
    for interp in interpreters() {
        let run = profiled(&format!("cpu_py_{}", interp.name.replace(' ', "_")), &interp.argv, "hashlib");
        check(&interp.name, &run, "native_part");
        eprintln!("{}: python_part {:.3}, native_part {:.3} measured: ok", interp.name, run.truth.0, run.truth.1);
    }
}

#[test]
fn an_unknown_cpython_keeps_its_native_frames_and_the_profiler_says_so() {
    let python = Path::new("/root/.pyenv/versions/3.9.18/bin/python3");
    if !python.exists() {
        skip(format!("{} not installed", python.display()));
        return;
    }
    let dir = workdir("cpu_py_39");
    let (db, truth) = (dir.join("p.db"), dir.join("truth.txt"));
    let hz = HZ.to_string();
    let mut args: Vec<String> =
        ["run", "-o", db.to_str().expect("utf-8"), "--no-gpu", "--cpu-sample", &hz, "--"].map(String::from).to_vec();
    args.push(python.display().to_string());
    args.extend(loop_args("hashlib", &truth).iter().map(|a| a.to_string_lossy().into_owned()));
    let (status, stderr) = Agent::start(&args, false).finish();
    assert!(status.success(), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| l.contains("native frames only")).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains("CPython 3.9"), "{}", lines[0]);
    let samples = count(&db, "SELECT count(*) FROM cpu_samples WHERE session_id = ?1", last_session(&db).id);
    assert!(samples > 0, "native samples are kept");
    let python = "SELECT count(*) FROM frames WHERE kind = 'python' AND session_id = ?1";
    assert_eq!(count(&db, python, last_session(&db).id), 0);
}

/// py-spy (PyPI), as `cargo xtask` installs it: `PROFILER_PY_SPY`.
fn py_spy() -> Option<PathBuf> {
    let p = std::env::var_os("PROFILER_PY_SPY").map(PathBuf::from).filter(|p| p.exists());
    if p.is_none() {
        skip("no py-spy (PROFILER_PY_SPY: `cargo xtask test` installs it from PyPI)");
    }
    p
}

/// py-spy's (python_part, native_part) shares of the samples under
/// `train_step`, the loop's own measure of that run (it calibrates afresh,
/// under py-spy's reads), and how many samples py-spy took in the steps.
fn py_spy_shares(py_spy: &Path, python: &Path, test: &str) -> ((f64, f64), (f64, f64), u64) {
    let dir = workdir(test);
    let (raw, truth) = (dir.join("spy.txt"), dir.join("truth.txt"));
    let hz = HZ.to_string();
    let out = Command::new(py_spy)
        .args(["record", "-r", &hz, "-f", "raw", "-o"])
        .arg(&raw)
        .arg("--")
        .arg(python)
        .args(loop_args("torch", &truth))
        .output()
        .expect("run py-spy");
    let text = std::fs::read_to_string(&raw)
        .unwrap_or_else(|e| panic!("py-spy wrote no profile ({e}): {}", String::from_utf8_lossy(&out.stderr)));
    let (mut step, mut py, mut native) = (0u64, 0u64, 0u64);
    for (stack, n) in text.lines().filter_map(|l| l.rsplit_once(' ')) {
        let n: u64 = n.parse().expect("count");
        if stack.contains("train_step (") {
            step += n;
            py += if stack.contains("python_part (") { n } else { 0 };
            native += if stack.contains("native_part (") { n } else { 0 };
        }
    }
    assert!(step > 50, "py-spy sampled the steps {step} times:\n{text}");
    ((py as f64 / step as f64, native as f64 / step as f64), truth_shares(&truth), step)
}

#[test]
fn a_pytorch_loop_names_its_python_function_and_torch_matmul_and_agrees_with_py_spy() {
    for name in ["python3.12", "python3.13"] {
        let Some(python) = torch_python(name) else { continue };
        let run = profiled(&format!("cpu_torch_{name}"), &[python.clone().into()], "torch");
        check(name, &run, "native_part");
        // torch.matmul's own work: samples whose leaf is libtorch's code, under native_part.
        let session = last_session(&run.db).id;
        let in_step =
            count(&run.db, "SELECT count(*) FROM cpu_samples WHERE session_id = ?1 AND label = 'train'", session);
        let in_torch = count(
            &run.db,
            "SELECT count(*) FROM cpu_samples c \
             JOIN stacks s ON s.session_id = c.session_id AND s.stack_id = c.stack_id AND s.depth = 0 \
             JOIN frames f ON f.session_id = s.session_id AND f.frame_id = s.frame_id \
             WHERE c.session_id = ?1 AND c.label = 'train' AND f.kind = 'native' AND f.module LIKE 'libtorch%'",
            session,
        );
        assert!(
            in_torch as f64 >= 0.5 * run.truth.1 * in_step as f64,
            "{name}: {in_torch} of {in_step} step samples in libtorch's code, native_part measured {:.3}",
            run.truth.1
        );
        let train = train_cpu(&run.db);
        let ours = (
            total_share(&train, "python_part").expect("a share"),
            total_share(&train, "native_part").expect("a share"),
        );
        if let Some(spy) = py_spy() {
            // Each profiler against its own run's measure; both name the same two functions.
            let (theirs, their_truth, n) = py_spy_shares(&spy, &python, &format!("cpu_torch_spy_{name}"));
            for (function, got, want) in
                [("python_part", theirs.0, their_truth.0), ("native_part", theirs.1, their_truth.1)]
            {
                // py-spy's own sampling error at its count, three standard
                // errors of a share, where that is more than our bound (its
                // errors in nine runs: 0.000 … 0.050, with ≈ 300 samples).
                let bound = SHARE_BOUND.max(3.0 * (want * (1.0 - want) / n as f64).sqrt());
                assert!(
                    (got - want).abs() <= bound,
                    "{name}: py-spy's {function} {got:.3}, measured {want:.3} (bound {bound:.3} at {n} samples)"
                );
            }
            // Not compared with each other: the loop calibrates its split per
            // run, near half and half, so the runs' top functions may differ.
            eprintln!(
                "{name}: python_part measured {:.3}, sampled {:.3}; under py-spy measured {:.3}, py-spy {:.3}; \
                 native_part {:.3}, {:.3}; {:.3}, {:.3} (py-spy: {n} samples in the steps)",
                run.truth.0, ours.0, their_truth.0, theirs.0, run.truth.1, ours.1, their_truth.1, theirs.1
            );
        }
    }
}

fn profiler_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(profiler_bin()).args(args).output().expect("run profiler");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// Function names in a list of share changes.
fn changed(list: &serde_json::Value) -> Vec<String> {
    list.as_array().into_iter().flatten().filter_map(|c| c["function"].as_str().map(str::to_owned)).collect()
}

#[test]
fn slow_steps_compare_html_and_pprof_name_what_changed() {
    let python = PathBuf::from("/root/.pyenv/versions/3.12.1/bin/python3");
    if !python.exists() {
        skip(format!("{} not installed", python.display()));
        return;
    }
    let argv = [python.into_os_string()];
    // Every 10th step also runs slow_part: the slow steps (≥ p90) are those, and only they hold it.
    let slow = profiled_with("cpu_views_slow", &argv, "hashlib", &["--slow-every", "10"]);
    let train = train_cpu(&slow.db);
    let s = &train["slow_steps"];
    assert_eq!(s["enough_samples"], true, "{train}");
    let names = changed(&s["changes"]);
    assert_eq!(names.first().map(String::as_str), Some("slow_part"), "{s}");
    let first = &s["changes"][0];
    let (a, b) = (first["share_a"].as_f64().expect("a"), first["share_b"].as_f64().expect("b"));
    assert!(b > a + 0.2, "{first}");
    // The page: a flame graph of the label and one of its slow steps, slow_part in the second.
    let html = workdir("cpu_views_html").join("r.html");
    let db = slow.db.to_str().expect("utf-8");
    let out = Command::new(profiler_bin()).args(["report", db, "--html", "-o"]).arg(&html).output().expect("html");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let page = std::fs::read_to_string(&html).expect("page");
    let figure = |id: &str| {
        let at = page.find(&format!("-cpu-train-{id}\"")).unwrap_or_else(|| panic!("no {id} flame graph"));
        let end = page[at..].find("</figure>").expect("figure end") + at;
        page[at..end].to_owned()
    };
    let (all, slow_figure) = (figure("all"), figure("slow"));
    assert!(all.contains("python_part (cpu_py_loop.py:") && all.contains("native_part"), "{all}");
    assert!(slow_figure.contains("<title>slow_part (cpu_py_loop.py:"), "{slow_figure}");
    // pprof: a gzip stream, as the format is.
    let pb = workdir("cpu_views_pprof").join("p.pb.gz");
    let out =
        Command::new(profiler_bin()).args(["export", db, "--format", "pprof", "-o"]).arg(&pb).output().expect("pprof");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bytes = std::fs::read(&pb).expect("pprof file");
    assert!(bytes.len() > 100 && bytes[..2] == [0x1f, 0x8b], "not gzip");
    pprof_reads_back_as_the_database_holds(&slow.db, &pb);
    // compare: three times the pure Python moves both parts' shares; the same work moves neither.
    let sized = |iters: &'static str| ["--python-iters", iters, "--native-reps", "100"];
    let base = profiled_with("cpu_views_a", &argv, "hashlib", &sized("200000"));
    let more = profiled_with("cpu_views_b", &argv, "hashlib", &sized("600000"));
    let same = profiled_with("cpu_views_c", &argv, "hashlib", &sized("200000"));
    let cmp = |b: &Run| {
        let c = profiler_json(&[
            "compare",
            base.db.to_str().expect("utf-8"),
            b.db.to_str().expect("utf-8"),
            "--format",
            "json",
        ]);
        c["cpu"].as_array().and_then(|l| l.iter().find(|l| l["label"] == "train")).cloned().expect("train's CPU")
    };
    let moved = cmp(&more);
    let names = changed(&moved["changes"]);
    assert!(names.contains(&"python_part".to_owned()) && names.contains(&"native_part".to_owned()), "{moved}");
    let still = cmp(&same);
    let python_changes: Vec<String> = changed(&still["changes"]).into_iter().filter(|n| n.ends_with("_part")).collect();
    assert!(python_changes.is_empty(), "the same loop twice: {still}");
}

/// The pprof export, decoded by pprof-format (npm, `PROFILER_PPROF_FORMAT`;
/// tests/fixtures/read_pprof.js), holds the session's samples as the
/// database does: the same total, the same count by leaf function (a kernel
/// frame's name with ` [k]`), a period of 1/HZ.
fn pprof_reads_back_as_the_database_holds(db: &Path, pb: &Path) {
    let package = std::env::var_os("PROFILER_PPROF_FORMAT").map(PathBuf::from).unwrap_or_default();
    if !package.join("package.json").exists() {
        skip("pprof-format is not installed (`cargo xtask test` installs it from npm): the pprof export not read back");
        return;
    }
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/read_pprof.js");
    let out = match Command::new("node").arg(fixture).arg(&package).arg(pb).output() {
        Ok(out) => out,
        Err(e) => {
            skip(format!("node cannot run ({e}): the pprof export not read back"));
            return;
        }
    };
    assert!(out.status.success(), "pprof-format: {}", String::from_utf8_lossy(&out.stderr));
    let read: serde_json::Value = serde_json::from_slice(&out.stdout).expect("read_pprof.js's JSON");
    let conn = open(db);
    let s = last_session(db).id;
    let (total, hz): (i64, i64) = conn
        .query_row(
            "SELECT (SELECT count(*) FROM cpu_samples WHERE session_id = ?1), cpu_sample_hz FROM sessions WHERE id = ?1",
            [s],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .expect("the session's samples");
    assert_eq!(read["types"], serde_json::json!(["samples/count", "cpu/nanoseconds"]), "{read}");
    assert_eq!(read["period"], 1_000_000_000 / hz, "{read}");
    assert_eq!(read["total"], total, "pprof-format's total against the database's samples");
    let mut q = conn
        .prepare(
            "SELECT CASE f.kind WHEN 'kernel' THEN f.function || ' [k]' ELSE f.function END, count(*)
             FROM cpu_samples c
             JOIN stacks st ON st.session_id = c.session_id AND st.stack_id = c.stack_id AND st.depth = 0
             JOIN frames f ON f.session_id = st.session_id AND f.frame_id = st.frame_id
             WHERE c.session_id = ?1 GROUP BY 1",
        )
        .expect("prepare");
    let leaves: BTreeMap<String, i64> =
        q.query_map([s], |r| Ok((r.get(0)?, r.get(1)?))).expect("query").map(|r| r.expect("row")).collect();
    let from_pprof: BTreeMap<String, i64> = read["leaf"]
        .as_object()
        .expect("leaf counts")
        .iter()
        .filter(|(name, _)| !name.is_empty())
        .map(|(name, n)| (name.clone(), n.as_i64().expect("a count")))
        .collect();
    assert_eq!(from_pprof, leaves, "samples by leaf function: pprof-format's against the database's");
    println!("pprof-format read {total} samples over {} leaf functions, as the database holds them", leaves.len());
}
