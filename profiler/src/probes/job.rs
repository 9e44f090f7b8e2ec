//! The kernel side's set of traced processes (`TRACED`) and the hooks that grow it: a traced
//! process's new child (`kernel_clone`'s entry and return) and its `exec`.
use std::num::NonZeroU32;

use aya::{
    Ebpf,
    maps::HashMap,
    programs::{KProbe, RawTracePoint},
};
use profiler_common::{maps as map_names, programs};

use super::ProbeError;

/// Puts `pids` in `TRACED`, before any probe is attached.
pub(super) fn trace(ebpf: &mut Ebpf, pids: &[NonZeroU32]) -> Result<(), ProbeError> {
    let name = map_names::TRACED;
    let map = ebpf.map_mut(name).ok_or(ProbeError::Missing(name))?;
    let mut traced: HashMap<_, u32, u32> = HashMap::try_from(map).map_err(|source| ProbeError::Map { name, source })?;
    for pid in pids {
        traced.insert(pid.get(), 0, 0).map_err(|source| ProbeError::Map { name, source })?;
    }
    Ok(())
}

/// The `exec` hook, and with `follow_children` the fork hooks. The fork hook
/// is a kprobe pair on `kernel_clone` (every fork, vfork and clone goes
/// through it): its argument's first field, `flags`, tells a process from a
/// thread without the kernel's type information, and its return value is the
/// child's pid. Raw tracepoints and kprobes need no tracefs.
pub(super) fn attach_process_hooks(ebpf: &mut Ebpf, follow_children: bool) -> Result<(), ProbeError> {
    let name = programs::PROCESS_EXEC;
    let exec: &mut RawTracePoint = ebpf
        .program_mut(name)
        .ok_or(ProbeError::Missing(name))?
        .try_into()
        .map_err(|source| ProbeError::Program { name, source })?;
    exec.load().map_err(|source| ProbeError::Program { name, source })?;
    exec.attach(programs::PROCESS_EXEC_TRACEPOINT).map_err(|source| ProbeError::Program { name, source })?;
    if !follow_children {
        return Ok(());
    }
    // The return first: an entry noted with no return probe yet would stay in `FORKING`.
    for name in [programs::FORK_EXIT, programs::FORK_ENTER] {
        let prog: &mut KProbe = ebpf
            .program_mut(name)
            .ok_or(ProbeError::Missing(name))?
            .try_into()
            .map_err(|source| ProbeError::Program { name, source })?;
        prog.load().map_err(|source| ProbeError::Program { name, source })?;
        prog.attach(programs::FORK_FUNCTION, 0).map_err(|source| ProbeError::Program { name, source })?;
    }
    Ok(())
}
