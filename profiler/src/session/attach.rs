//! Attaching, in order: the CUDA libraries the target maps, the dynamic loader's hook, the driver
//! library where the target will find it, then the step functions, native and Python.
use super::{
    config::SessionConfig,
    setup::{StepFunctions, TargetProcess},
    watcher::{LibraryWatcher, library_row},
};
use crate::{
    probes::{
        self, Probes,
        maps::{self, LibraryKind},
        python::{
            frame_hook::write::FieldState,
            mechanism::{PythonMechanism, PythonStepProbes},
            spec::PythonTarget,
            usdt::PythonProbes,
        },
    },
    store::ProbedFileRow,
};

/// Probes the CUDA libraries the target maps or will load, then the step
/// functions, native and Python. Returns the `probed_files` rows and the Python
/// probes' handle (dropped before the rest detach).
pub(super) fn attach_all(
    cfg: &SessionConfig,
    target: &TargetProcess,
    probes: &mut Probes,
    watcher: &mut LibraryWatcher,
    steps: &StepFunctions,
) -> anyhow::Result<(Vec<ProbedFileRow>, Option<PythonStepProbes>)> {
    let mut libraries: Vec<ProbedFileRow> = Vec::new();
    if target.mode == "attach" {
        watcher.scan_into(probes, &mut libraries, cfg.quiet, "maps");
    }
    attach_loader(target, probes, watcher, &mut libraries);
    attach_predicted_driver(target, probes, watcher, &mut libraries);
    pause_for_tests(TEST_PAUSE_ENV, target.pid, "the step probes");
    // The step probes go in last, so that every step they see has the launch
    // probes of the libraries known now in place for its whole span.
    attach_step_symbols(cfg, target.pid, probes, steps, &mut libraries)?;
    log::info!("{} uprobes attached ({:?})", probes.attached(), probes.attach_mode());
    let python_steps = match &steps.python {
        Some(py) => Some(attach_python(cfg, probes, py, steps.symbols.len(), &mut libraries)?),
        None => None,
    };
    if !libraries.iter().any(|l| l.kind == "driver" || l.kind == "runtime") {
        let pid = target.pid;
        say!(
            cfg.quiet,
            "PID {pid} has no CUDA library mapped yet; launches will appear once it loads libcuda or libcudart"
        );
    }
    Ok((libraries, python_steps))
}

/// Tests only: `PROFILER_TEST_ATTACH_PAUSE_MS=N` holds the attach between
/// the library probes and the step probes for up to N ms, or until the target
/// exits, so that a test can end its target while attach is under way.
const TEST_PAUSE_ENV: &str = "PROFILER_TEST_ATTACH_PAUSE_MS";
/// Tests only: `PROFILER_TEST_LIBRARY_PAUSE_MS=N` holds the probing of each
/// CUDA library found after attach likewise, as the kernel does when the
/// probes wait behind another session's removal (issue 35).
pub(super) const TEST_LIBRARY_PAUSE_ENV: &str = "PROFILER_TEST_LIBRARY_PAUSE_MS";

/// Holds for the `env` test pause, if it is set, before `what`.
pub(super) fn pause_for_tests(env: &str, pid: u32, what: &str) {
    let Some(ms) = std::env::var(env).ok().and_then(|v| v.trim().parse::<u64>().ok()) else { return };
    eprintln!("profiler: {env}: pausing before {what}");
    let until = std::time::Instant::now() + std::time::Duration::from_millis(ms);
    while std::time::Instant::now() < until && probes::is_alive(pid) {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The loader's hook: libraries loaded from now on are looked for as soon
/// as it fires. In `run` the target has not exec'ed yet: the probe is on
/// the file, and the kernel puts it in whatever maps it later.
fn attach_loader(
    target: &TargetProcess,
    probes: &mut Probes,
    watcher: &mut LibraryWatcher,
    libraries: &mut Vec<ProbedFileRow>,
) {
    let (pid, exe) = (target.pid, &target.exe);
    match probes::loader::loader_of(pid, exe) {
        Some(loader) => match probes.attach_loader(&probes::in_target_root(pid, &loader)) {
            Ok(Some(offset)) => {
                libraries.push(ProbedFileRow::now(
                    &loader,
                    "loader",
                    1,
                    format!("{} at file offset {offset:#x}", probes::loader::LOADER_HOOK),
                ));
                watcher.loader_hooked = true;
            }
            Ok(None) => log::warn!(
                "{} exports no {}: new CUDA libraries are found by polling the maps",
                loader.display(),
                probes::loader::LOADER_HOOK
            ),
            Err(e) => log::warn!("could not probe the dynamic loader {}: {e}", loader.display()),
        },
        None => log::info!("{} has no dynamic loader: new CUDA libraries are found by polling the maps", exe.display()),
    }
}

/// Probes the driver library where the target would find it, before it loads
/// it: PyTorch initialises CUDA lazily, and the first launches follow at once.
fn attach_predicted_driver(
    target: &TargetProcess,
    probes: &mut Probes,
    watcher: &mut LibraryWatcher,
    libraries: &mut Vec<ProbedFileRow>,
) {
    for cand in maps::driver_candidates(target.var("LD_LIBRARY_PATH").as_deref(), &ldconfig_cache()) {
        let visible = probes::in_target_root(target.pid, &cand);
        if !visible.is_file() {
            continue;
        }
        match probes.attach_cuda_library(LibraryKind::Driver, &visible, &[], target.pid) {
            Ok(None) => {}
            Ok(Some(placed)) if placed.is_empty() => {}
            Ok(Some(placed)) => {
                watcher.seen.insert(cand.clone());
                libraries.push(library_row(&cand, LibraryKind::Driver, placed, "predicted"));
            }
            Err(e) => libraries.extend(watcher.not_probed(&cand, LibraryKind::Driver, "predicted", &e)),
        }
    }
}

fn ldconfig_cache() -> String {
    ["/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"]
        .iter()
        .find_map(|p| std::process::Command::new(p).arg("-p").output().ok())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// The `--step-symbol` probes; each one's index is its probe id.
fn attach_step_symbols(
    cfg: &SessionConfig,
    pid: u32,
    probes: &mut Probes,
    steps: &StepFunctions,
    libraries: &mut Vec<ProbedFileRow>,
) -> anyhow::Result<()> {
    for (probe_id, step) in steps.symbols.iter().enumerate() {
        let visible = if step.path.is_relative() { step.path.clone() } else { probes::in_target_root(pid, &step.path) };
        let visible = if visible.exists() { visible } else { step.path.clone() };
        probes.attach_step(&visible, step.file_offset, probe_id as u32)?;
        let how = format!("symbol {} at file offset {:#x}", step.symbol, step.file_offset);
        libraries.push(ProbedFileRow::now(&step.path, "step", 2, how));
        say!(cfg.quiet, "step function {} in {}", step.symbol, step.path.display());
    }
    Ok(())
}

/// The `--step-python`s, whose probe ids follow the `first_label` symbol
/// ones, through the mechanism `setup` chose.
fn attach_python(
    cfg: &SessionConfig,
    probes: &mut Probes,
    py: &PythonMechanism,
    first_label: usize,
    libraries: &mut Vec<ProbedFileRow>,
) -> anyhow::Result<PythonStepProbes> {
    let targets: Vec<PythonTarget> = cfg
        .python_steps
        .iter()
        .enumerate()
        .map(|(i, spec)| PythonTarget { spec: spec.clone(), label_id: (first_label + i) as u32 })
        .collect();
    match py {
        PythonMechanism::Usdt(usdt) => attach_usdt_python(cfg, probes, usdt, &targets, libraries),
        PythonMechanism::FrameHook { path, build } => {
            let handle = probes.attach_frame_hook(path, build, &targets)?;
            say!(cfg.quiet, "--step-python: {}", py.describe());
            if let Some(FieldState::Other(v)) = handle.found {
                say!(
                    cfg.quiet,
                    "eval_frame already holds another PEP 523 hook ({v:#x}): left alone; calls it does not pass to \
                     _PyEval_EvalFrameDefault are not seen until it is NULL again"
                );
            }
            libraries.push(ProbedFileRow::now(path, "step", 2, format!("{build}{}", handle.alias_text())));
            Ok(PythonStepProbes::FrameHook(handle))
        }
    }
}

/// CPython's USDT probes for the `--step-python`s.
fn attach_usdt_python(
    cfg: &SessionConfig,
    probes: &mut Probes,
    py: &PythonProbes,
    targets: &[PythonTarget],
    libraries: &mut Vec<ProbedFileRow>,
) -> anyhow::Result<PythonStepProbes> {
    let handle = probes.attach_python(py, targets)?;
    let everywhere = if probes.file_wide() {
        ", in every process of this interpreter on the machine (a job's probes are file-wide)"
    } else {
        ""
    };
    let mut how = match py.version {
        Some((major, minor)) => format!("USDT python:function__entry/return (CPython {major}.{minor})"),
        None => "USDT python:function__entry/return".to_string(),
    };
    if handle.tracing_switched() {
        how.push_str(" + line semaphore (CPython 3.11)");
        say!(
            cfg.quiet,
            "CPython 3.11 fires function__entry only on its tracing path: Python calls now cost about 2 µs more each while attached{everywhere}"
        );
    }
    libraries.push(ProbedFileRow::now(&py.path, "step", handle.sites() as u32, how));
    Ok(PythonStepProbes::Usdt(handle))
}
