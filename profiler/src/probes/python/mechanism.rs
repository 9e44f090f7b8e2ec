//! `--step-python` on any CPython 3.10–3.14: which route a target gets (its
//! USDT probes where the build has them, else the PEP 523 frame hook), and
//! the handle to whichever is attached.
use std::path::{Path, PathBuf};

use super::{
    frame_hook::FrameHookSteps,
    interpreter::{self as cpython, CPythonBuild},
    usdt::{PythonProbeError, PythonProbes, PythonSteps},
};

/// How the step functions of one target are seen.
#[derive(Clone, Debug)]
pub enum PythonMechanism {
    /// CPython's `python:function__entry/return` (no write into the target).
    Usdt(PythonProbes),
    /// The PEP 523 frame hook on the CPython in `path`.
    FrameHook { path: PathBuf, build: CPythonBuild },
}

#[derive(Debug, thiserror::Error)]
pub enum PythonResolveError {
    #[error(
        "{path}: CPython {major}.{minor} has no USDT function probes; the frame hook would write one pointer \
         into the target (PyInterpreterState.eval_frame), which --no-target-writes forbids. Drop \
         --no-target-writes, or mark steps in native code with --step-symbol"
    )]
    WritesRefused { path: PathBuf, major: u8, minor: u8 },
    #[error(
        "{usdt}; nor can the PEP 523 frame hook be used: {hook}. Run the training under CPython 3.10–3.14, \
         or mark steps in native code with --step-symbol"
    )]
    Neither { usdt: Box<PythonProbeError>, hook: String, none_is_cpython: bool },
}

impl PythonResolveError {
    /// No candidate is a CPython at all (not ELF, or no interpreter's
    /// symbols): a wrapper, not an interpreter the profiler cannot use.
    pub fn none_is_cpython(&self) -> bool {
        matches!(self, Self::Neither { none_is_cpython: true, .. })
    }
}

/// The mechanism for `candidates` (target-visible paths: the executable,
/// then the mapped `libpython*`s); `open` maps a path to its bytes.
pub fn resolve<B: AsRef<[u8]>>(
    candidates: &[PathBuf],
    mut open: impl FnMut(&Path) -> Option<B>,
    allow_writes: bool,
) -> Result<PythonMechanism, PythonResolveError> {
    let usdt = match super::usdt::resolve(candidates, &mut open) {
        Ok(p) => return Ok(PythonMechanism::Usdt(p)),
        Err(e) => e,
    };
    let mut reasons = Vec::new();
    let mut none_is_cpython = true;
    for path in candidates {
        let Some(bytes) = open(path) else { continue };
        let inspected = cpython::inspect(bytes.as_ref());
        none_is_cpython &= matches!(inspected, Err(cpython::CPythonError::NotElf | cpython::CPythonError::Missing(_)));
        match inspected {
            Ok(build) if build.needs_write() && !allow_writes => {
                let (major, minor) = build.version;
                return Err(PythonResolveError::WritesRefused { path: path.clone(), major, minor });
            }
            Ok(build) => return Ok(PythonMechanism::FrameHook { path: path.clone(), build }),
            Err(e) => reasons.push(format!("{}: {e}", path.display())),
        }
    }
    Err(PythonResolveError::Neither { usdt: Box::new(usdt), hook: reasons.join("; "), none_is_cpython })
}

/// What `--step-python` would use for process `pid` and why, for `doctor`:
/// None when no candidate is a CPython at all.
pub fn mechanism_for(pid: u32, candidates: &[PathBuf]) -> Option<Result<String, String>> {
    let open = |p: &Path| crate::probes::open_in_target(pid, p);
    let is_cpython = |p: &PathBuf| {
        open(p).is_some_and(|b| {
            !matches!(cpython::inspect(&b), Err(cpython::CPythonError::NotElf | cpython::CPythonError::Missing(_)))
        })
    };
    if !candidates.iter().any(is_cpython) {
        return None;
    }
    Some(resolve(candidates, open, true).map(|m| m.describe()).map_err(|e| e.to_string()))
}

impl PythonMechanism {
    /// One line for `doctor` and the session's output: what it is and what it costs.
    pub fn describe(&self) -> String {
        match self {
            Self::Usdt(p) => {
                let v = p.version.map(|(a, b)| format!("CPython {a}.{b}, ")).unwrap_or_default();
                format!("USDT python:function__entry/return ({v}{}): no write into the target", p.path.display())
            }
            Self::FrameHook { path, build } if build.needs_write() => format!(
                "PEP 523 frame hook (CPython {}.{}, {}, no USDT probes): writes one pointer into the target \
                 (eval_frame) and costs each Python call about 2 µs while attached; detach restores it",
                build.version.0,
                build.version.1,
                path.display()
            ),
            Self::FrameHook { path, .. } => format!(
                "probes on _PyEval_EvalFrameDefault (CPython 3.10, {}, no USDT probes): no write; each Python \
                 call costs about 2 µs while attached",
                path.display()
            ),
        }
    }
}

/// The Python step probes attached to one process, either mechanism.
#[derive(Debug)]
pub enum PythonStepProbes {
    Usdt(PythonSteps),
    FrameHook(FrameHookSteps),
}

impl PythonStepProbes {
    /// Detaches (and, for the frame hook, restores `eval_frame` first).
    pub fn detach(self) {
        match self {
            Self::Usdt(s) => s.detach(),
            Self::FrameHook(s) => s.detach(),
        }
    }
}
