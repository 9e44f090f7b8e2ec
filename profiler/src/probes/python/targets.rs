//! What both routes of `--step-python` share in the kernel: the name filter
//! (`PY_TARGETS`) filled from the targets, their programs loaded once, and
//! the error either attach can end in.
use aya::{
    Ebpf,
    maps::{Array, MapError},
    programs::{ProgramError, UProbe},
};
use profiler_common::{PY_MAX_TARGETS, PyTarget, maps as map_names};

use super::spec::PythonTarget;
use crate::probes::usdt::attach::AttachError;

#[derive(Debug, thiserror::Error)]
pub enum PythonAttachError {
    #[error("{count} --step-python functions; the kernel-side filter holds at most {max}")]
    TooManyTargets { count: usize, max: u32 },
    #[error("--step-python {0} is given twice")]
    Duplicate(String),
    #[error("eBPF object has no {0}; rebuild with `cargo xtask build`")]
    Missing(&'static str),
    #[error("map {name}: {source}")]
    Map { name: &'static str, source: MapError },
    #[error("eBPF program {name}: {source}")]
    Program { name: &'static str, source: ProgramError },
    #[error("{probe}: {source}")]
    Attach { probe: String, source: AttachError },
    /// A site whose arguments the programs cannot read: only possible when
    /// the probes did not come from `usdt::resolve`, which checks the same.
    #[error("{0}")]
    Probe(String),
}

/// Fills `PY_TARGETS` of `ebpf`, for either route.
///
/// Targets that name a file go first in the kernel's list, which stops at
/// the first match: `helper.py:train_step` wins over a bare `train_step`.
pub(crate) fn fill_targets(ebpf: &mut Ebpf, targets: &[PythonTarget]) -> Result<(), PythonAttachError> {
    if targets.len() > PY_MAX_TARGETS as usize {
        return Err(PythonAttachError::TooManyTargets { count: targets.len(), max: PY_MAX_TARGETS });
    }
    let mut ordered: Vec<&PythonTarget> = targets.iter().collect();
    ordered.sort_by_key(|t| t.spec.file_suffix.is_none());
    for (i, t) in ordered.iter().enumerate() {
        let same = |o: &&PythonTarget| o.spec.function == t.spec.function && o.spec.file_suffix == t.spec.file_suffix;
        if ordered[..i].iter().any(same) {
            return Err(PythonAttachError::Duplicate(t.spec.to_string()));
        }
    }
    let map = ebpf.map_mut(map_names::PY_TARGETS).ok_or(PythonAttachError::Missing(map_names::PY_TARGETS))?;
    let mut array: Array<_, PyTarget> =
        Array::try_from(map).map_err(|source| PythonAttachError::Map { name: map_names::PY_TARGETS, source })?;
    for i in 0..PY_MAX_TARGETS {
        let value = ordered.get(i as usize).map_or_else(PyTarget::default, |t| t.spec.target(t.label_id));
        array.set(i, value, 0).map_err(|source| PythonAttachError::Map { name: map_names::PY_TARGETS, source })?;
    }
    Ok(())
}

/// The uprobe program `name` of `ebpf`, loaded (once) into the kernel.
pub(crate) fn loaded_uprobe<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut UProbe, PythonAttachError> {
    let prog: &mut UProbe = ebpf
        .program_mut(name)
        .ok_or(PythonAttachError::Missing(name))?
        .try_into()
        .map_err(|source| PythonAttachError::Program { name, source })?;
    if prog.fd().is_err() {
        prog.load().map_err(|source| PythonAttachError::Program { name, source })?;
    }
    Ok(prog)
}
