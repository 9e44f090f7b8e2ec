//! The scheduler programs (`sched_switch`, `sched_wakeup`, `sched_wakeup_new`:
//! raw tracepoints, no tracefs) that count where each traced thread's time
//! goes, and the per-process totals they keep (`PROCESS_SCHED`). They fire on
//! every context switch of the machine; `--no-sched` leaves them out.
use aya::{Ebpf, maps::HashMap, programs::RawTracePoint};
use profiler_common::{ProcessSched, maps as map_names, programs};

use super::{ProbeError, Probes};

/// Loads and attaches the scheduler programs. The `sched_switch` tracepoint
/// has carried the previous task's state since Linux 5.18; an older kernel
/// fails here, and the caller records why.
pub(super) fn attach(ebpf: &mut Ebpf) -> Result<(), ProbeError> {
    let hooks = [(programs::SCHED_SWITCH, programs::SCHED_SWITCH_TRACEPOINT)]
        .into_iter()
        .chain(programs::SCHED_WAKEUP_TRACEPOINTS.map(|tp| (programs::SCHED_WAKEUP, tp)));
    let mut loaded = Vec::new();
    for (name, tracepoint) in hooks {
        let prog: &mut RawTracePoint = ebpf
            .program_mut(name)
            .ok_or(ProbeError::Missing(name))?
            .try_into()
            .map_err(|source| ProbeError::Program { name, source })?;
        if !loaded.contains(&name) {
            prog.load().map_err(|source| ProbeError::Program { name, source })?;
            loaded.push(name);
        }
        prog.attach(tracepoint).map_err(|source| ProbeError::Program { name, source })?;
    }
    Ok(())
}

impl Probes {
    /// Takes process `tgid`'s scheduler totals out of the kernel's map (its
    /// session is ending): None when the scheduler programs never saw it, or
    /// are not attached.
    pub fn take_process_sched(&mut self, tgid: u32) -> Option<ProcessSched> {
        let map = self.ebpf.map_mut(map_names::PROCESS_SCHED)?;
        let mut totals: HashMap<_, u32, ProcessSched> = HashMap::try_from(map).ok()?;
        let found = totals.get(&tgid, 0).ok();
        let _ = totals.remove(&tgid);
        found
    }
}
