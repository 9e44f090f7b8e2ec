//! The scheduler programs (`sched_switch`, `sched_wakeup`, `sched_wakeup_new`:
//! raw tracepoints, no tracefs) that count where each traced thread's time
//! goes, and the per-process totals they keep (`PROCESS_SCHED`). They fire on
//! every context switch of the machine; `--no-sched` leaves them out.
use aya::{
    Ebpf,
    maps::{Array, HashMap},
    programs::RawTracePoint,
};
use profiler_common::{ProcessSched, SchedHistoryEntry, SchedMismatch, maps as map_names, mismatch_site, programs};

/// A file to write the scheduler programs' debug history to (each CPU's last
/// [`HISTORY_PER_CPU`] switches and wakeups of any task, up to the first
/// mismatch) at the end of the session: for finding why a switch went unseen.
const HISTORY_ENV: &str = "PROFILER_SCHED_HISTORY";
const HISTORY_PER_CPU: u32 = 4096;

/// Entries per CPU of the debug history: 0 (off) unless [`HISTORY_ENV`] names a file.
pub(super) fn history_per_cpu() -> u32 {
    if std::env::var_os(HISTORY_ENV).is_some() { HISTORY_PER_CPU } else { 0 }
}

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

    /// Writes the scheduler programs' mismatches by site to the debug log
    /// (`RUST_LOG=profiler=debug`): how many, and the last one's thread and
    /// state (`SchedMismatch`), the evidence for where switches went unseen.
    pub fn log_sched_mismatches(&self) {
        let Some(map) = self.ebpf.map(map_names::SCHED_MISMATCHES) else { return };
        let Ok(sites) = Array::<_, SchedMismatch>::try_from(map) else { return };
        for (site, name) in (0..mismatch_site::COUNT).zip(mismatch_site::NAMES) {
            let Ok(d) = sites.get(&site, 0) else { continue };
            if d.count == 0 {
                continue;
            }
            log::debug!(
                "scheduler mismatches, {name}: {} (the last: tid {} on CPU {} at {} ns, state {} since {} ns, \
                 last left {} ns)",
                d.count,
                d.tid,
                d.cpu,
                d.at_ns,
                d.found,
                d.since_ns,
                d.left_ns
            );
        }
    }

    /// Writes the debug history to the file [`HISTORY_ENV`] names, in time
    /// order: one line per event (`at_ns cpu switch prev next prev_state
    /// preempt`, or `at_ns cpu wakeup waker woken`), the first mismatch's
    /// time first.
    pub fn write_sched_history(&self) {
        let Some(path) = std::env::var_os(HISTORY_ENV) else { return };
        let (Some(history), Some(frozen)) =
            (self.ebpf.map(map_names::SCHED_HISTORY), self.ebpf.map(map_names::SCHED_HISTORY_FROZEN))
        else {
            return;
        };
        let (Ok(history), Ok(frozen)) =
            (Array::<_, SchedHistoryEntry>::try_from(history), Array::<_, u64>::try_from(frozen))
        else {
            return;
        };
        let mut events: Vec<SchedHistoryEntry> = history.iter().flatten().filter(|e| e.at_ns != 0).collect();
        events.sort_by_key(|e| e.at_ns);
        let (at, who) = (frozen.get(&0, 0).unwrap_or(0), frozen.get(&1, 0).unwrap_or(0));
        let site = mismatch_site::NAMES.get((who >> 32) as usize).unwrap_or(&"?");
        let mut text = match at {
            0 => "first mismatch at 0 ns: none\n".to_owned(),
            _ => format!("first mismatch at {at} ns: tid {}, {site}\n", who as u32),
        };
        for e in events {
            text += &match e.kind {
                0 => format!("{} {} switch {} {} {:#x} {}\n", e.at_ns, e.cpu, e.prev, e.next, e.prev_state, e.preempt),
                _ => format!("{} {} wakeup {} {}\n", e.at_ns, e.cpu, e.prev, e.next),
            };
        }
        let path = std::path::Path::new(&path);
        let made = !path.exists();
        match std::fs::write(path, text) {
            // Under sudo, a file this run made is the user's, as a profile is.
            Ok(()) if made => crate::ownership::give_to_invoking_user(&[path]),
            Ok(()) => {}
            Err(e) => log::warn!("writing the scheduler history to {}: {e}", path.display()),
        }
    }
}
