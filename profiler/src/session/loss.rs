//! The end-of-session warnings that say what each kind of record loss cost,
//! from the kernel's loss counters and the step tracker's marks.
use crate::probes::KernelCounters;

/// What each kind of loss cost, one line each, for the end of a session
/// (empty when nothing was lost). `marked`: steps stored as incomplete;
/// `without_start`: steps whose entry was lost, which have no row.
///
/// The scheduler programs' mismatches are not among them: a few on a loaded
/// machine are nothing a user can act on at the end of a run. They are in
/// `sessions.sched_mismatches` and `profiler report`'s session block.
pub fn loss_warnings(kc: &KernelCounters, marked: u64, without_start: u64) -> Vec<String> {
    let mut lines = Vec::new();
    let launch_ring = kc.lost.saturating_sub(kc.lost_step_records).saturating_sub(kc.lost_off_cpu);
    if launch_ring > 0 {
        lines.push(format!(
            "{launch_ring} launch or kernel-name records were lost (launch ring full): those launches have no \
             `launches` row (or kernel no name); steps.launches and the session's total are still exact, counted in \
             the kernel"
        ));
    }
    if kc.lost_step_records > 0 {
        let mut line = format!(
            "{} step, sync or loader records were lost (step ring full): {marked} steps are marked \
             steps.incomplete = 1 (their sync_wait_ns may be low, inter_step_ns may span unseen steps, end_ns is \
             NULL where the end was lost, and a lost return with the next entry makes one step of two); every \
             other step is exact",
            kc.lost_step_records
        );
        if without_start > 0 {
            line.push_str(&format!("; {without_start} steps whose entry was lost have no row"));
        }
        lines.push(line);
    }
    if kc.lost_off_cpu > 0 {
        lines.push(format!(
            "{} off-CPU records were lost (launch ring full): each thread's scheduler track in the Perfetto export \
             misses those times off its CPU (a `running` slice spans them); the steps' scheduler columns are \
             still exact, counted in the kernel",
            kc.lost_off_cpu
        ));
    }
    if kc.map_failures > 0 {
        lines.push(format!(
            "{} kernel map updates failed (maps full): threads that got no state have their launches uncounted \
             (steps.launches too low, no sequence for their steps), a runtime launch may count twice, a \
             runtime sync may get two rows, a kernel name may be missing",
            kc.map_failures
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_lines_say_what_each_loss_cost() {
        let kc = |lost, steps, maps| KernelCounters {
            lost,
            lost_step_records: steps,
            lost_off_cpu: 0,
            map_failures: maps,
            launches: 0,
        };
        assert!(loss_warnings(&kc(0, 0, 0), 0, 0).is_empty());
        let l = loss_warnings(&kc(7, 0, 0), 0, 0);
        assert_eq!(l.len(), 1);
        assert!(l[0].starts_with("7 launch or kernel-name records were lost") && l[0].contains("still exact"));
        let l = loss_warnings(&kc(9, 4, 2), 3, 1);
        assert_eq!(l.len(), 3);
        assert!(l[0].starts_with("5 launch"), "{l:?}");
        assert!(
            l[1].starts_with("4 step") && l[1].contains("3 steps are marked") && l[1].contains("1 steps whose entry")
        );
        assert!(l[2].starts_with("2 kernel map updates failed"));
    }
}
