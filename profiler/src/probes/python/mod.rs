//! Python step functions (`--step-python`), in one place: the spec
//! ([`spec`]), which files hold the target's CPython and what it is
//! ([`interpreter`]), the two routes that see its calls (CPython's USDT
//! probes, [`usdt`]; the PEP 523 frame hook, [`frame_hook`]), which route a
//! target gets ([`mechanism`]), what both share ([`targets`]: the kernel-side
//! name filter and program loading), and the attach calls on [`Probes`].
pub mod frame_hook;
pub mod interpreter;
pub mod mechanism;
pub mod spec;

pub mod targets;
pub mod usdt;

use std::path::Path;

use self::{
    frame_hook::{FrameHookAttachError, FrameHookSteps},
    interpreter::CPythonBuild,
    spec::PythonTarget,
    targets::PythonAttachError,
    usdt::{PythonProbes, PythonSteps},
};
use super::Probes;

impl Probes {
    /// [`PythonSteps::attach`] (the USDT route) with the loaded object and
    /// target of these probes. The returned handle must be dropped before
    /// [`Probes::detach`]: step probes go first.
    pub fn attach_python(
        &mut self,
        probes: &PythonProbes,
        targets: &[PythonTarget],
    ) -> Result<PythonSteps, PythonAttachError> {
        PythonSteps::attach(&mut self.ebpf, self.pid, self.scope, probes, targets)
    }

    /// [`FrameHookSteps::attach`] with the loaded object and target of these probes.
    pub fn attach_frame_hook(
        &mut self,
        path: &Path,
        build: &CPythonBuild,
        targets: &[PythonTarget],
    ) -> Result<FrameHookSteps, FrameHookAttachError> {
        FrameHookSteps::attach(&mut self.ebpf, self.pid, self.scope, path, build, targets)
    }
}
