//! GEMM FLOPs per step (#15): the GEMM trainer (tests/fixtures/gemm_trainer.c)
//! issues GEMMs of known shapes through every probed cuBLAS and cuBLASLt entry
//! point, on the stand-in libraries (cuBLAS calling cuBLASLt inside) and on
//! the genuine ones from PyTorch's NVIDIA wheels, and writes down each call
//! and each step's FLOPs; the database must hold exactly those.
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Child, Command},
};

use integration_tests::*;

/// The GEMM trainer, held before its steps until `go`.
struct GemmTrainer {
    child: Child,
    truth: PathBuf,
    go: PathBuf,
}

impl GemmTrainer {
    fn spawn(dir: &Path, args: &[&str]) -> GemmTrainer {
        let (truth, go) = (dir.join("truth.txt"), dir.join("go"));
        let mut c = Command::new(fixtures().join("gemm_trainer"));
        c.args(args).arg("--truth").arg(&truth).arg("--wait-file").arg(&go);
        // The stand-ins from the search path; a genuine cuBLAS (`--lib-dir`)
        // finds its own cuBLASLt and driver, not the stand-ins, through its RUNPATH.
        match args.contains(&"--lib-dir") {
            false => c.env("LD_LIBRARY_PATH", fixtures()),
            true => c.env_remove("LD_LIBRARY_PATH"),
        };
        let child = c.spawn().expect("start gemm_trainer");
        GemmTrainer { child, truth, go }
    }

    /// Lets it run its steps, and waits for it to finish.
    fn run(&mut self) -> TruthFile {
        std::fs::write(&self.go, b"").expect("write go file");
        let status = self.child.wait().expect("wait gemm_trainer");
        assert!(status.success(), "gemm_trainer: {status}");
        TruthFile::read(&self.truth)
    }
}

impl Drop for GemmTrainer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Per step: (FLOPs, calls), from the truth's `gstep` lines.
fn truth_steps(t: &TruthFile) -> BTreeMap<i64, (i64, i64)> {
    t.records("gstep").map(|r| (t.num(&r, 0), (t.num(&r, 1), t.num(&r, 2)))).collect()
}

/// Per step: (FLOPs, calls) as stored (NULL as -1).
fn db_steps(db: &Path, session: i64) -> BTreeMap<i64, (i64, i64)> {
    let conn = open(db);
    let mut stmt = conn
        .prepare("SELECT step, coalesce(flops, -1), coalesce(gemm_calls, -1) FROM steps WHERE session_id = ?1")
        .expect("query steps");
    stmt.query_map([session], |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?))))
        .expect("steps")
        .map(|r| r.expect("row"))
        .collect()
}

/// The precision class of a GEMM's (data type, compute type), as cuBLAS names them.
fn class(data: &str, compute: &str) -> &'static str {
    match () {
        _ if compute.contains("FAST_TF32") => "tf32",
        _ if compute.contains("FAST_16BF") || data.contains("16BF") => "bf16",
        _ if compute.contains("FAST_16F") || data.contains("16F") => "fp16",
        _ if data.contains("64F") => "fp64",
        _ => "fp32",
    }
}

/// Per step: the (data type, compute type) stored for it: of the precision
/// class that did most of its FLOPs, the pair that did most, from the truth's
/// `gemm` lines (asserting that one did: no tie to break).
fn truth_types(t: &TruthFile) -> BTreeMap<i64, (String, String)> {
    let mut by_step: BTreeMap<i64, BTreeMap<(String, String), u128>> = BTreeMap::new();
    for r in t.records("gemm") {
        let step: i64 = t.num(&r, 7);
        if step < 0 {
            continue;
        }
        let flops: u128 = 2 * (1..=4).map(|i| t.num::<u128>(&r, i)).product::<u128>();
        *by_step.entry(step).or_default().entry((r[5].to_owned(), r[6].to_owned())).or_default() += flops;
    }
    by_step
        .into_iter()
        .map(|(step, types)| {
            let mut classes: BTreeMap<&str, u128> = BTreeMap::new();
            for ((d, c), f) in &types {
                *classes.entry(class(d, c)).or_default() += f;
            }
            let most = classes.values().max().copied().unwrap_or(0);
            let top: Vec<&str> = classes.iter().filter(|(_, f)| **f == most).map(|(k, _)| *k).collect();
            assert_eq!(top.len(), 1, "step {step}: one precision does the most FLOPs: {classes:?}");
            let within: Vec<_> = types.into_iter().filter(|((d, c), _)| class(d, c) == top[0]).collect();
            let max = within.iter().map(|(_, f)| *f).max().unwrap_or(0);
            let pairs: Vec<_> = within.into_iter().filter(|(_, f)| *f == max).collect();
            assert_eq!(pairs.len(), 1, "step {step}: one type pair of {} does the most FLOPs: {pairs:?}", top[0]);
            (step, pairs[0].0.clone())
        })
        .collect()
}

fn db_types(db: &Path, session: i64) -> BTreeMap<i64, (String, String)> {
    let conn = open(db);
    let mut stmt = conn
        .prepare("SELECT step, gemm_data_type, gemm_compute_type FROM steps WHERE session_id = ?1")
        .expect("query steps");
    stmt.query_map([session], |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?))))
        .expect("steps")
        .map(|r| r.expect("row"))
        .collect()
}

/// Every call in order: `op m n k batch data_type compute_type step` (step -1: none).
fn truth_calls(t: &TruthFile) -> Vec<String> {
    t.records("gemm").map(|r| r.join(" ")).collect()
}

fn db_calls(db: &Path, session: i64) -> Vec<String> {
    let conn = open(db);
    let mut stmt = conn
        .prepare(
            "SELECT op || ' ' || m || ' ' || n || ' ' || k || ' ' || batch || ' ' || coalesce(data_type, '?') || ' '
                    || coalesce(compute_type, '?') || ' ' || coalesce(step, -1)
             FROM gemms WHERE session_id = ?1 ORDER BY ts_ns",
        )
        .expect("query gemms");
    stmt.query_map([session], |r| r.get(0)).expect("gemms").map(|r| r.expect("row")).collect()
}

/// Attaches with `extra` flags to a trainer started with `args`, runs it, and
/// returns its truth, the database and the session.
fn traced(name: &str, args: &[&str], extra: &[&str]) -> (TruthFile, PathBuf, i64, String) {
    let dir = workdir(name);
    let db = dir.join("p.db");
    let probed = dir.join("probed");
    let mut args = args.to_vec();
    if args.contains(&"--late") {
        args.extend(["--probed-file", probed.to_str().expect("utf-8")]);
    }
    let mut trainer = GemmTrainer::spawn(&dir, &args);
    let mut flags = vec!["--step-symbol", "train_step"];
    flags.extend(extra);
    let agent = Agent::attach(trainer.child.id(), &db, &flags);
    if args.contains(&"--late") {
        // Loaded after the attach: the trainer's GEMMs begin once both are probed.
        std::fs::write(&trainer.go, b"").expect("write go file");
        for lib in ["libcublas.so.13 for GEMMs", "libcublasLt.so.13 for GEMMs"] {
            agent.wait_for(lib, std::time::Duration::from_secs(60));
        }
        std::fs::write(&probed, b"").expect("write probed file");
    }
    let truth = trainer.run();
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    let s = last_session(&db);
    assert_eq!(s.end_reason.as_deref(), Some("target-exited"), "{stderr}");
    (truth, db, s.id, stderr)
}

#[test]
fn flops_per_step_are_exact_through_every_entry_point() {
    let (truth, db, session, stderr) = traced("flops", &["--steps", "6"], &[]);
    let expected = truth_steps(&truth);
    assert_eq!(expected.len(), 6);
    assert!(expected.values().all(|&(_, calls)| calls == 15), "15 entry points per step: {}", truth.text);
    assert_eq!(db_steps(&db, session), expected, "{stderr}");
    assert_eq!(db_types(&db, session), truth_types(&truth));
    // One row per call the trainer made, in order, with its shape, types and
    // step; cublasGemmEx's own cublasLtMatmul inside the stand-in cuBLAS is
    // not among them, nor its descriptors' calls.
    assert_eq!(db_calls(&db, session), truth_calls(&truth));
    let probed = count(&db, "SELECT count(*) FROM probes WHERE session_id = ?1 AND (symbol LIKE 'cublas%')", session);
    assert_eq!(probed, 21, "every entry point of both stand-ins is probed");
}

#[test]
fn flops_with_launches_count_and_a_late_dlopen_keep_only_the_sums() {
    // PyTorch loads cuBLAS on its first GEMM: the libraries come after the attach.
    let (truth, db, session, stderr) = traced("flops-count", &["--steps", "4", "--late"], &["--launches", "count"]);
    assert_eq!(db_steps(&db, session), truth_steps(&truth), "{stderr}");
    // The precision to set the FLOPs against, without the rows.
    assert_eq!(db_types(&db, session), truth_types(&truth));
    assert_eq!(count(&db, "SELECT count(*) FROM gemms WHERE session_id = ?1", session), 0);
    let late = count(
        &db,
        "SELECT count(*) FROM probed_files WHERE session_id = ?1 AND kind IN ('cublas', 'cublasLt') AND probes > 0",
        session,
    );
    assert_eq!(late, 2, "{stderr}");
}

#[test]
fn flops_are_null_where_no_blas_library_was_probed() {
    let dir = workdir("flops-none");
    let db = dir.join("p.db");
    let mut trainer = Trainer::spawn(&dir, &["--steps", "3", "--launches", "5"]);
    let agent = Agent::attach(trainer.pid(), &db, &["--step-symbol", "train_step"]);
    trainer.go();
    trainer.wait();
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    let s = last_session(&db);
    let steps = db_steps(&db, s.id);
    assert_eq!(steps.len(), 3);
    assert!(steps.values().all(|&v| v == (-1, -1)), "flops and gemm_calls NULL: {steps:?}");
}

/// The cuBLAS library directories of the PyTorch environments `cargo xtask`
/// made (`PROFILER_TORCH_PYTHONS`) and of their neighbours, one per soname
/// version: (directory, version).
fn genuine_blas_dirs() -> BTreeMap<String, PathBuf> {
    let venvs: std::collections::BTreeSet<PathBuf> = torch_pythons()
        .into_iter()
        .filter_map(|(_, python)| python.parent()?.parent()?.parent().map(Path::to_path_buf))
        .collect();
    let mut found = BTreeMap::new();
    let entries = |d: &Path| std::fs::read_dir(d).into_iter().flatten().flatten().map(|e| e.path());
    for parent in venvs {
        for venv in entries(&parent) {
            for packages in site_packages(&venv) {
                for wheel in entries(&packages.join("nvidia")) {
                    for lib in entries(&wheel.join("lib")) {
                        let name = lib.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
                        if let Some(version) = name.strip_prefix("libcublas.so.") {
                            found.entry(version.to_owned()).or_insert_with(|| wheel.join("lib"));
                        }
                    }
                }
            }
        }
    }
    found
}

#[test]
fn genuine_cublas_libraries_every_symbol_probed_and_counted() {
    let dirs = genuine_blas_dirs();
    if dirs.is_empty() {
        skip("no PyTorch environment with NVIDIA's cuBLAS wheels (see `cargo xtask torch-env`)");
        return;
    }
    for (version, lib) in dirs {
        let lib_dir = lib.display().to_string();
        let mut args = vec!["--steps", "3", "--lib-dir", &lib_dir, "--version", &version];
        if version.starts_with("12") {
            // Its cublasLtMatmul dereferences the NULL handle (13.x refuses it): descriptors only.
            args.push("--no-lt-matmul");
        }
        let (truth, db, session, stderr) = traced(&format!("flops-genuine-{version}"), &args, &[]);
        let lt_matmuls = truth.records("gemm").filter(|r| r[0] == "cublasLtMatmul").count();
        println!("cuBLAS {version} in {lib_dir}: {lt_matmuls} cublasLtMatmul calls");
        // Without a GPU (or a handle) every GEMM fails, and the probes fire on the real code anyway;
        // cuBLASLt's descriptors need no GPU.
        let lt_setup: Vec<i64> = truth.records("lt_setup").map(|r| truth.num(&r, 0)).collect();
        assert_eq!(lt_setup, [0], "cuBLASLt {version} makes descriptors on any host: {}", truth.text);
        let conn = open(&db);
        let mut stmt = conn
            .prepare(
                "SELECT p.symbol, p.offset, p.reason FROM probes p JOIN probed_files f
                   ON f.session_id = p.session_id AND f.path = p.library
                 WHERE p.session_id = ?1 AND f.kind IN ('cublas', 'cublasLt') ORDER BY p.symbol",
            )
            .expect("query probes");
        let placed: Vec<(String, i64, String)> = stmt
            .query_map([session], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .expect("probes")
            .map(|r| r.expect("row"))
            .collect();
        let symbols: Vec<&str> = placed.iter().map(|p| p.0.as_str()).collect();
        let mut expected: Vec<&str> = blas_symbols();
        expected.sort_unstable();
        assert_eq!(symbols, expected, "cuBLAS {version}: every listed symbol probed: {placed:#?}");
        for (symbol, offset, reason) in &placed {
            println!("cuBLAS {version}: {symbol} probed at +{offset:#x}: {reason}");
            // NVIDIA's entry points begin with a push: the probe stays there, emulated, not single-stepped.
            assert!(reason.contains("which the kernel emulates"), "cuBLAS {version}: {symbol}: {reason}");
        }
        assert_eq!(db_steps(&db, session), truth_steps(&truth), "cuBLAS {version}: {stderr}");
        assert_eq!(db_calls(&db, session), truth_calls(&truth), "cuBLAS {version}");
    }
}

/// The 21 symbols the profiler probes (`profiler_common::BlasCall`), spelled
/// out here so that a rename on either side shows.
fn blas_symbols() -> Vec<&'static str> {
    vec![
        "cublasGemmEx",
        "cublasGemmEx_64",
        "cublasSgemm_v2",
        "cublasSgemm_v2_64",
        "cublasDgemm_v2",
        "cublasDgemm_v2_64",
        "cublasHgemm",
        "cublasHgemm_64",
        "cublasSgemmEx",
        "cublasSgemmEx_64",
        "cublasGemmBatchedEx",
        "cublasGemmBatchedEx_64",
        "cublasGemmStridedBatchedEx",
        "cublasGemmStridedBatchedEx_64",
        "cublasLtMatmul",
        "cublasLtMatrixLayoutCreate",
        "cublasLtMatrixLayoutSetAttribute",
        "cublasLtMatrixLayoutDestroy",
        "cublasLtMatmulDescCreate",
        "cublasLtMatmulDescSetAttribute",
        "cublasLtMatmulDescDestroy",
    ]
}

/// MFU per step through the stand-in NVML (one GPU, "Stand-in H200"): the
/// step's FLOPs (the trainer's truth) ÷ (the dense peak of NVIDIA's H200 SXM
/// datasheet at the precision that did most of the step's FLOPs × the step's
/// time as stored); and the live gauge (`--prometheus`), scraped after the
/// last step, is the last step's.
#[test]
fn mfu_per_step_is_the_steps_flops_over_the_h200_peak_at_its_precision() {
    let dir = workdir("mfu");
    let db = dir.join("p.db");
    let end_file = dir.join("end");
    let mut trainer = GemmTrainer::spawn(&dir, &["--steps", "4", "--end-file", end_file.to_str().expect("utf-8")]);
    let nvml = stand_in_nvml();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let flags = ["--step-symbol", "train_step", "--nvml-lib", &nvml, "--prometheus", &addr, "--job", "mfu"];
    let agent = Agent::attach_with_env(trainer.child.id(), &db, &flags, &[("STANDIN_NVML_GPUS", "1")]);
    // The steps done (the trainer holds before exiting): the endpoint, once it counts all four.
    std::fs::write(&trainer.go, b"").expect("write go file");
    let t0 = std::time::Instant::now();
    let series = |text: &str, name: &str| exposed(text, name, &[("job", "mfu")]);
    let live_mfu = loop {
        let text = http_get(port, "/metrics").unwrap_or_default();
        if series(&text, "profiler_steps_total") == Some(4.0) {
            break series(&text, "profiler_last_step_mfu_ratio");
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(60), "never 4 steps: {text}\n{}", agent.stderr());
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    std::fs::write(&end_file, b"").expect("write end file");
    let truth = trainer.run();
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    let session = last_session(&db).id;
    // H200 SXM, dense TFLOP/s (NVIDIA's datasheet; sparse figures ÷ 2).
    let peak_tflops = |class: &str| match class {
        "fp64" | "fp32" => 67.0,
        "tf32" => 494.5,
        "bf16" | "fp16" => 989.5,
        other => panic!("the trainer uses no {other} GEMM"),
    };
    let mut by_step: BTreeMap<i64, BTreeMap<&str, u128>> = BTreeMap::new();
    for r in truth.records("gemm") {
        let step: i64 = truth.num(&r, 7);
        if step >= 0 {
            let flops: u128 = 2 * (1..=4).map(|i| truth.num::<u128>(&r, i)).product::<u128>();
            *by_step.entry(step).or_default().entry(class(r[5], r[6])).or_default() += flops;
        }
    }
    let conn = open(&db);
    let stored: Vec<(i64, i64, f64)> = conn
        .prepare(
            "SELECT s.flops, s.duration_ns, g.mfu_pct FROM steps s JOIN step_gpu g
               ON g.session_id = s.session_id AND g.label = s.label AND g.step = s.step
             WHERE s.session_id = ?1 AND s.end_ns IS NOT NULL ORDER BY s.start_ns",
        )
        .expect("prepare")
        .query_map([session], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("every step has FLOPs, a time and an MFU: {e}; {stderr}"));
    assert!(!by_step.is_empty(), "the trainer issued GEMMs in steps: {stderr}");
    assert_eq!(stored.len(), by_step.len(), "{stderr}");
    for ((step, classes), (flops, duration_ns, mfu)) in by_step.iter().zip(&stored) {
        let total: u128 = classes.values().sum();
        assert_eq!(*flops as u128, total, "step {step}");
        let (dominant, _) = classes.iter().max_by_key(|(_, f)| **f).expect("a GEMM");
        let expected = 100.0 * total as f64 / (peak_tflops(dominant) * 1e12 * *duration_ns as f64 / 1e9);
        assert!(
            (mfu - expected).abs() <= 1e-9 * expected,
            "step {step}: MFU {mfu} %, expected {expected} % ({dominant})"
        );
    }
    let last = stored.last().map(|s| s.2 / 100.0);
    assert!(
        live_mfu.zip(last).is_some_and(|(live, db)| (live - db).abs() <= 1e-9 * db),
        "the live gauge {live_mfu:?} is the last step's MFU {last:?}"
    );
}
