//! The session's side of PyTorch's `record_function` regions before the
//! event path: which step sources the regions make, and probing
//! `libtorch_cpu.so` when the target maps it (now or after a lazy `import
//! torch`). The events themselves are the consumer's (`consumer::regions`).
use std::{
    collections::HashSet,
    path::{Path, PathBuf},
};

use super::config::SessionConfig;
use crate::{
    probes::{self, Probes, maps, torch},
    regions::{OPTIMIZER_STEP, RegionSteps, StepMode},
    store::ProbedFileRow,
};

/// The label of steps made from the optimizer's markers.
const OPTIMIZER_LABEL: &str = "train";

/// Adds the region step sources to the step tracker's labels (their probe
/// ids follow the named sources'), and says where steps will come from.
pub(super) fn step_sources(cfg: &SessionConfig, labels: &mut Vec<&'static str>) -> RegionSteps {
    let named = super::jax::named_sources(cfg);
    let mut sources = RegionSteps::default();
    if cfg.step_mode.optimizer_steps(named) {
        sources.optimizer = Some(labels.len() as u32);
        labels.push(OPTIMIZER_LABEL);
    }
    for spec in &cfg.step_regions {
        sources.prefixes.push((labels.len() as u32, spec.prefix.clone()));
        labels.push(Box::leak(spec.label.clone().into_boxed_str()));
    }
    if cfg.step_mode == StepMode::None && !named {
        say!(cfg.quiet, "no steps will be recorded (--steps none); PyTorch regions still are");
    }
    sources
}

/// `sessions.step_source`: the named sources, then the region ones.
pub(super) fn step_source_text(cfg: &SessionConfig, named: Option<String>, sources: &RegionSteps) -> Option<String> {
    let mut parts: Vec<String> = named.into_iter().collect();
    if sources.optimizer.is_some() {
        parts.push(format!("torch:{OPTIMIZER_STEP}"));
    }
    parts.extend(cfg.step_regions.iter().map(|s| format!("region:{s}")));
    (!parts.is_empty()).then(|| parts.join(" "))
}

/// Finds `libtorch_cpu.so` in the target's maps and probes it, once per file.
#[derive(Default)]
pub(super) struct TorchWatch {
    seen: HashSet<PathBuf>,
    /// Whether steps come from the optimizer's markers (what to say when none is mapped).
    optimizer_steps: bool,
    /// `--steps torch` rather than `auto`.
    forced: bool,
    looked: bool,
}

impl TorchWatch {
    pub(super) fn new(cfg: &SessionConfig, sources: &RegionSteps) -> Self {
        let (optimizer_steps, forced) = (sources.optimizer.is_some(), cfg.step_mode == StepMode::Torch);
        Self { optimizer_steps, forced, ..Default::default() }
    }

    pub(super) fn scan(
        &mut self,
        pid: u32,
        probes: &mut Probes,
        target_maps: &procfs::process::MemoryMaps,
        rows: &mut Vec<ProbedFileRow>,
        quiet: bool,
        how: &str,
    ) {
        let files: Vec<maps::MappedFile> =
            maps::mapped_files(target_maps).into_iter().filter(|f| torch::is_libtorch_cpu(&f.path)).collect();
        if files.is_empty() && !self.looked && self.optimizer_steps {
            if self.forced {
                say!(quiet, "PID {pid} has not loaded PyTorch (libtorch_cpu.so) yet: waiting for it (--steps torch)");
            } else {
                say!(
                    quiet,
                    "PID {pid} has not loaded PyTorch yet: steps will come from its optimizer markers if it does \
                     (or from a JAX program's jitted training step); otherwise no steps will be recorded (name them \
                     with --step-symbol, --step-python, --step-region or --step-jit)"
                );
            }
        }
        self.looked = true;
        for f in files {
            // A job's other process maps the same file: its file-wide probes serve both.
            if self.seen.insert(f.path.clone()) && probes.first_look(&probes::in_target_root(pid, &f.path)) {
                rows.extend(self.probe(pid, probes, &f.path, quiet, how));
            }
        }
    }

    fn probe(&self, pid: u32, probes: &mut Probes, path: &Path, quiet: bool, how: &str) -> Option<ProbedFileRow> {
        let t0 = std::time::Instant::now();
        let resolved = probes::open_in_target(pid, path)
            .ok_or_else(|| "cannot read it".to_string())
            .and_then(|data| torch::resolve(&data));
        let row = |probes: u32, text: String| ProbedFileRow::now(path, "torch", probes, text);
        let syms = match resolved {
            Ok(s) => s,
            Err(e) => {
                eprintln!("profiler: warning: PyTorch regions not recorded: {}: {e}", path.display());
                return Some(row(0, format!("not probed ({how}): {e}")));
            }
        };
        let visible = probes::in_target_root(pid, path);
        match probes.attach_torch(&visible, &syms) {
            Ok(placed) => {
                let exit = match syms.exit {
                    Some(o) => format!("record_function_exit_new at {o:#x}"),
                    None => {
                        eprintln!(
                            "profiler: warning: {} has no record_function_exit_new symbol (stripped build): \
                             regions are recorded with no end, and no steps come from them",
                            path.display()
                        );
                        "no record_function_exit_new symbol: enters only".into()
                    }
                };
                if self.optimizer_steps {
                    say!(quiet, "steps from PyTorch's optimizer markers in {} (label train)", path.display());
                }
                log::info!("resolved and probed {} in {:?}", path.display(), t0.elapsed());
                let text = format!("record_function_enter_new at {:#x}, {exit} ({how})", syms.enter);
                let probes = placed.len() as u32;
                Some(ProbedFileRow { placed, ..row(probes, text) })
            }
            Err(e) => {
                eprintln!("profiler: warning: could not probe {}: {e}", path.display());
                Some(row(0, format!("not probed ({how}): {e}")))
            }
        }
    }
}
