//! The session's side of JAX before the event path: which jitted functions
//! make steps, and probing jaxlib's `libjax_common.so` when the target maps
//! it (now or after a lazy `import jax`). The calls themselves are the
//! consumer's (`consumer::jax`).
use std::{collections::HashSet, path::PathBuf};

use super::config::SessionConfig;
use crate::{
    jax_steps::JitSources,
    probes::{self, Probes, jax, maps},
    store::ProbedFileRow,
};

/// The label of the steps `--steps auto` takes from a jitted function.
const AUTO_LABEL: &str = "train";

/// Whether any step flag names a step source.
pub(super) fn named_sources(cfg: &SessionConfig) -> bool {
    !(cfg.steps.is_empty() && cfg.python_steps.is_empty() && cfg.step_regions.is_empty() && cfg.step_jits.is_empty())
}

/// `--steps auto` with no step flag: the step function is picked from the calls.
pub(super) fn auto(cfg: &SessionConfig) -> bool {
    cfg.step_mode == crate::regions::StepMode::Auto && !named_sources(cfg)
}

/// Adds the jit step sources to the step tracker's labels (after every other
/// source's, so the others' probe ids stay as they were).
pub(super) fn step_sources(cfg: &SessionConfig, labels: &mut Vec<&'static str>) -> JitSources {
    if !cfg.step_jits.is_empty() {
        let mut named = Vec::new();
        for spec in &cfg.step_jits {
            named.push((labels.len() as u32, spec.name.clone()));
            labels.push(Box::leak(spec.label.clone().into_boxed_str()));
        }
        return JitSources::Named(named);
    }
    if auto(cfg) {
        labels.push(AUTO_LABEL);
        return JitSources::Auto(labels.len() as u32 - 1);
    }
    JitSources::None
}

/// `sessions.step_source` with the jit sources appended.
pub(super) fn step_source_text(cfg: &SessionConfig, others: Option<String>) -> Option<String> {
    let mut parts: Vec<String> = others.into_iter().collect();
    parts.extend(cfg.step_jits.iter().map(|s| format!("jit:{s}")));
    if auto(cfg) {
        parts.push("jax:auto".into());
    }
    (!parts.is_empty()).then(|| parts.join(" "))
}

/// Finds `libjax_common.so` in the target's maps and probes it, once per file.
#[derive(Default)]
pub(super) struct JaxWatch {
    seen: HashSet<PathBuf>,
}

impl JaxWatch {
    pub(super) fn scan(
        &mut self,
        pid: u32,
        probes: &mut Probes,
        target_maps: &procfs::process::MemoryMaps,
        rows: &mut Vec<ProbedFileRow>,
        quiet: bool,
        how: &str,
    ) {
        for f in maps::mapped_files(target_maps).into_iter().filter(|f| jax::is_libjax_common(&f.path)) {
            if self.seen.insert(f.path.clone()) && probes.first_look(&probes::in_target_root(pid, &f.path)) {
                rows.push(probe(pid, probes, &f.path, quiet, how));
            }
        }
    }
}

fn probe(pid: u32, probes: &mut Probes, path: &std::path::Path, quiet: bool, how: &str) -> ProbedFileRow {
    let t0 = std::time::Instant::now();
    let resolved = probes::open_in_target(pid, path)
        .ok_or_else(|| "cannot read it".to_string())
        .and_then(|data| jax::resolve(&data));
    let row = |n: u32, text: String| ProbedFileRow::now(path, "jax", n, text);
    let call = match resolved {
        Ok(c) => c,
        Err(e) => {
            eprintln!("profiler: warning: JAX jit calls not recorded: {}: {e}", path.display());
            return row(0, format!("not probed ({how}): {e}"));
        }
    };
    match probes.attach_jax(&probes::in_target_root(pid, path), call) {
        Ok(placed) => {
            say!(quiet, "probing JAX's jit fast path in {}", path.display());
            log::info!("resolved and probed {} in {:?}", path.display(), t0.elapsed());
            let n = placed.len() as u32;
            ProbedFileRow { placed, ..row(n, format!("PjitFunction::Call at {call:#x} ({how})")) }
        }
        Err(e) => {
            eprintln!("profiler: warning: could not probe {}: {e}", path.display());
            row(0, format!("not probed ({how}): {e}"))
        }
    }
}
