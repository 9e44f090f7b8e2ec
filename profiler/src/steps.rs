//! Turns step-function entry/return events into step intervals.
//!
//! Per thread, per step source and nesting-safe: a step is the outermost call
//! of its step function on a thread; a recursive or re-entrant call inside it
//! is part of it. Each step source (a `--step-symbol` or `--step-python`) has a
//! label; step numbers count from 0 per label, in the order steps begin.
//!
//! Each step-ring record carries its thread's sequence number and step depth
//! (see `profiler_common::StepRecord`). A gap in a thread's sequence means
//! records were lost: the thread's open steps are marked `incomplete` and the
//! tracker takes the thread's depth from the record, so one lost return costs
//! the step it ended, not every later step of the thread.
use std::collections::HashMap;

use profiler_common::copies::CopyDirection;

use crate::events::{CopyEvent, ThreadCounters};

/// How a step-ring record changes its thread's step depth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DepthChange {
    /// A step function's entry: one deeper.
    Enter,
    /// A step function's return: one shallower.
    Exit,
    /// A sync call or a thread's exit: no change.
    None,
}

/// Time a step's thread spent in PyTorch's DataLoader `__next__` (since the
/// previous optimizer step) and in the optimizer's step, ns
/// (`steps.data_wait_ns`, `steps.optimizer_ns`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepPhases {
    pub data_wait_ns: u64,
    pub optimizer_ns: u64,
}

/// A finished step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompletedStep {
    pub label: &'static str,
    pub step: u64,
    pub tid: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    /// Gap since the end of this thread's previous step of the same source;
    /// `None` for its first.
    pub inter_step_ns: Option<u64>,
    /// Launches the thread made between start and end.
    pub launches: u64,
    /// Time the thread spent in synchronisation calls during the step.
    pub sync_wait_ns: u64,
    /// Where the thread's time went (None without scheduler tracing).
    pub sched: Option<StepSched>,
    /// Copies and memsets the thread made during the step.
    pub copies: CopyTotals,
    /// Records of the thread were lost during the step or since its last one
    /// (stored as `steps.incomplete`: its `sync_wait_ns` may be low and its
    /// `inter_step_ns` may span steps never seen; its `launches`, counted in
    /// the kernel, stay exact when its start and end were seen).
    pub incomplete: bool,
}

/// A step that had begun but not ended when the session stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenStep {
    pub label: &'static str,
    pub step: u64,
    pub tid: u32,
    pub start_ns: u64,
    pub inter_step_ns: Option<u64>,
    /// Records of the thread were lost while it was open: with a gap, it
    /// ended unseen; at the session's end, it may have.
    pub incomplete: bool,
}

/// A step's thread's time by scheduler state, and the CPU time of its
/// process's other threads meanwhile (`steps.cpu_ns`, …, `steps.other_cpu_ns`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepSched {
    pub cpu_ns: u64,
    pub runnable_ns: u64,
    pub sleep_ns: u64,
    pub blocked_ns: u64,
    /// The process's CPU time less the thread's: its other threads' finished
    /// runs (runs still in progress at the step's end are not in it).
    pub other_cpu_ns: u64,
}

impl StepSched {
    /// The step's figures from the snapshots at its start and end.
    pub fn between(start: &ThreadCounters, end: &ThreadCounters) -> Self {
        let (a, b) = (&start.sched, &end.sched);
        let cpu_ns = b.cpu_ns.saturating_sub(a.cpu_ns);
        Self {
            cpu_ns,
            runnable_ns: b.runnable_ns.saturating_sub(a.runnable_ns),
            sleep_ns: b.sleep_ns.saturating_sub(a.sleep_ns),
            blocked_ns: b.blocked_ns.saturating_sub(a.blocked_ns),
            other_cpu_ns: b.process_cpu_ns.saturating_sub(a.process_cpu_ns).saturating_sub(cpu_ns),
        }
    }
}

/// A step's copies and memsets (`steps.h2d_bytes`, …, `steps.copy_ns`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyTotals {
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub d2d_bytes: u64,
    /// Calls of every kind, memsets and copies of unknown direction included.
    pub calls: u64,
    /// Host time in the calls.
    pub ns: u64,
}

impl CopyTotals {
    pub fn add(&mut self, c: &CopyEvent) {
        match c.direction {
            CopyDirection::HostToDevice => self.h2d_bytes += c.bytes,
            CopyDirection::DeviceToHost => self.d2h_bytes += c.bytes,
            CopyDirection::DeviceToDevice => self.d2d_bytes += c.bytes,
            CopyDirection::HostToHost | CopyDirection::Memset | CopyDirection::Unknown => {}
        }
        self.calls += 1;
        self.ns += c.ts_ns.saturating_sub(c.start_ns);
    }
}

#[derive(Default)]
struct SourceState {
    /// Calls of this source the thread is inside. More than 0 with `open`
    /// None: the outermost call's entry was lost; its return ends no step.
    depth: u32,
    open: Option<(u64, u64, ThreadCounters)>, // (step, start_ns, the thread's counters at start)
    sync_wait_ns: u64,
    copies: CopyTotals,
    last_end_ns: Option<u64>,
    /// Records of the thread were lost while this step was open, or since the
    /// last one ended (so the next one is marked too).
    incomplete: bool,
}

pub struct StepTracker {
    /// Label of each step source, by the probe id the kernel reports.
    labels: Vec<&'static str>,
    per_source: HashMap<(u32, u32), SourceState>,
    /// Open outermost steps per thread, innermost last: a launch belongs to
    /// the most recently begun step still open on its thread.
    open_by_thread: HashMap<u32, Vec<(u32, u64)>>,
    next_step: HashMap<&'static str, u64>,
    /// Returns seen with no matching entry (the kernel drops uretprobes nested
    /// deeper than 64 frames), or from an unknown source.
    pub unmatched_returns: u64,
    /// The sequence number each thread's next step-ring record should have.
    next_seq: HashMap<u32, u32>,
    /// Gaps seen in threads' sequences (each one or more records lost).
    pub gaps: u64,
    /// Steps whose entry was lost: their return ended no step.
    pub steps_without_start: u64,
    /// The scheduler programs are attached: the counters' snapshots mean something.
    pub sched: bool,
    /// When a CUDA driver's launch probes last went in for this process: a
    /// step begun before missed the launches made until then (`incomplete`).
    pub driver_probed_ns: u64,
}

impl StepTracker {
    /// `labels[i]` is the label of step source (probe id) `i`.
    pub fn new(labels: Vec<&'static str>) -> Self {
        Self {
            labels,
            per_source: HashMap::new(),
            open_by_thread: HashMap::new(),
            next_step: HashMap::new(),
            unmatched_returns: 0,
            next_seq: HashMap::new(),
            gaps: 0,
            steps_without_start: 0,
            sched: false,
            driver_probed_ns: 0,
        }
    }

    /// Checks a step-ring record's place in its thread's sequence, before the
    /// record itself is handled (`change`: what it does to the depth, `depth`:
    /// the thread's depth after it). On a gap, the thread's steps are marked
    /// incomplete and its depth is brought to what the record says it was
    /// before it: steps whose returns were lost end here, unseen (returned,
    /// to be stored with no end); a return whose entry was lost will end no
    /// step. Returns whether there was a gap.
    pub fn sequence(
        &mut self,
        tid: u32,
        probe: u32,
        seq: u32,
        depth: u32,
        change: DepthChange,
        ended_unseen: &mut Vec<OpenStep>,
    ) -> bool {
        if seq == 0 {
            return false; // the kernel kept no state for the thread: no sequence
        }
        let next = if seq == u32::MAX { 1 } else { seq + 1 };
        let expected = self.next_seq.insert(tid, next).unwrap_or(1);
        if seq == expected {
            return false;
        }
        self.gaps += 1;
        let sources: Vec<u32> = self.per_source.keys().filter(|(t, _)| *t == tid).map(|&(_, p)| p).collect();
        for p in &sources {
            if let Some(s) = self.per_source.get_mut(&(tid, *p)) {
                s.incomplete = true;
            }
        }
        let tracked: u32 = sources.iter().filter_map(|p| self.per_source.get(&(tid, *p))).map(|s| s.depth).sum();
        let before = match change {
            DepthChange::Enter => depth.saturating_sub(1),
            // The kernel does not go below 0, so a return at depth 0 may have
            // been at 0 before it too; after a gap, its entry is the likelier loss.
            DepthChange::Exit => depth + 1,
            DepthChange::None => depth,
        };
        if tracked > before {
            // Returns were lost: the innermost steps ended in the gap.
            let mut excess = tracked - before;
            let mut order: Vec<u32> =
                self.open_by_thread.get(&tid).map(|v| v.iter().rev().map(|&(p, _)| p).collect()).unwrap_or_default();
            let rest: Vec<u32> = sources.iter().copied().filter(|p| !order.contains(p)).collect();
            order.extend(rest);
            for p in order {
                if excess == 0 {
                    break;
                }
                let Some(s) = self.per_source.get_mut(&(tid, p)) else { continue };
                let take = s.depth.min(excess);
                s.depth -= take;
                excess -= take;
                if s.depth == 0 {
                    // Its next step's gap would span the unseen end.
                    s.last_end_ns = None;
                    if let Some((step, start_ns, _)) = s.open.take() {
                        let inter_step_ns = None;
                        if let Some(stack) = self.open_by_thread.get_mut(&tid) {
                            stack.retain(|&(q, st)| !(q == p && st == step));
                        }
                        if let Some(label) = self.label(p) {
                            ended_unseen.push(OpenStep { label, step, tid, start_ns, inter_step_ns, incomplete: true });
                        }
                    }
                }
            }
        } else if tracked < before && change != DepthChange::None {
            // Entries were lost: the record's own source is that much deeper,
            // inside a call whose entry was never seen.
            let s = self.per_source.entry((tid, probe)).or_default();
            s.depth += before - tracked;
            s.incomplete = true;
        }
        true
    }

    /// A thread exited: its steps still open are returned (to be stored with
    /// no end), and everything kept for it is dropped.
    pub fn thread_exited(&mut self, tid: u32) -> Vec<OpenStep> {
        let mut open = Vec::new();
        let sources: Vec<u32> = self.per_source.keys().filter(|(t, _)| *t == tid).map(|&(_, p)| p).collect();
        for p in sources {
            if let Some(s) = self.per_source.remove(&(tid, p))
                && let Some((step, start_ns, _)) = s.open
                && let Some(label) = self.label(p)
            {
                let inter_step_ns = s.last_end_ns.map(|e| start_ns.saturating_sub(e));
                open.push(OpenStep { label, step, tid, start_ns, inter_step_ns, incomplete: s.incomplete });
            }
        }
        open.sort_by_key(|s| s.step);
        self.open_by_thread.remove(&tid);
        self.next_seq.remove(&tid);
        open
    }

    /// The label of step source `probe`.
    fn label(&self, probe: u32) -> Option<&'static str> {
        self.labels.get(probe as usize).copied()
    }

    /// Entry of a step function. Returns the new step's number when this is
    /// an outermost call.
    pub fn enter(&mut self, tid: u32, probe: u32, ts_ns: u64, at: ThreadCounters) -> Option<u64> {
        let label = self.label(probe)?;
        let s = self.per_source.entry((tid, probe)).or_default();
        s.depth += 1;
        if s.depth > 1 {
            return None;
        }
        let counter = self.next_step.entry(label).or_insert(0);
        let step = *counter;
        *counter += 1;
        s.open = Some((step, ts_ns, at));
        s.sync_wait_ns = 0;
        s.copies = CopyTotals::default();
        self.open_by_thread.entry(tid).or_default().push((probe, step));
        Some(step)
    }

    /// Return of a step function. Returns the step when this closes an
    /// outermost call.
    pub fn exit(&mut self, tid: u32, probe: u32, ts_ns: u64, at: ThreadCounters) -> Option<CompletedStep> {
        let (traced_sched, probed_ns) = (self.sched, self.driver_probed_ns);
        let Some(s) = self.per_source.get_mut(&(tid, probe)).filter(|s| s.depth > 0) else {
            self.unmatched_returns += 1;
            return None;
        };
        s.depth -= 1;
        if s.depth > 0 {
            return None;
        }
        let Some((step, start_ns, at_start)) = s.open.take() else {
            // The step's entry was lost (see `sequence`).
            s.last_end_ns = Some(ts_ns);
            self.steps_without_start += 1;
            return None;
        };
        let inter_step_ns = s.last_end_ns.map(|e| start_ns.saturating_sub(e));
        s.last_end_ns = Some(ts_ns);
        let sync_wait_ns = s.sync_wait_ns;
        let copies = s.copies;
        // Records lost, or launches made before the driver's probes were in.
        let incomplete = std::mem::take(&mut s.incomplete) || start_ns < probed_ns;
        if let Some(stack) = self.open_by_thread.get_mut(&tid) {
            stack.retain(|&(p, st)| !(p == probe && st == step));
        }
        Some(CompletedStep {
            label: self.label(probe)?,
            step,
            tid,
            start_ns,
            end_ns: ts_ns,
            inter_step_ns,
            launches: at.launches.saturating_sub(at_start.launches),
            sync_wait_ns,
            sched: traced_sched.then(|| StepSched::between(&at_start, &at)),
            copies,
            incomplete,
        })
    }

    /// Adds a finished synchronisation call to the step `tid` is inside (the
    /// innermost), if any.
    pub fn add_sync_wait(&mut self, tid: u32, ns: u64) {
        if let Some(&(probe, _)) = self.open_by_thread.get(&tid).and_then(|s| s.last())
            && let Some(s) = self.per_source.get_mut(&(tid, probe))
        {
            s.sync_wait_ns += ns;
        }
    }

    /// Adds a finished copy or memset to the step `tid` is inside (the innermost), if any.
    pub fn add_copy(&mut self, c: &CopyEvent) {
        if let Some(&(probe, _)) = self.open_by_thread.get(&c.tid).and_then(|s| s.last())
            && let Some(s) = self.per_source.get_mut(&(c.tid, probe))
        {
            s.copies.add(c);
        }
    }

    /// The step `tid` is inside (the most recently begun one), if any.
    pub fn current_step(&self, tid: u32) -> Option<(&'static str, u64)> {
        let &(probe, step) = self.open_by_thread.get(&tid)?.last()?;
        Some((self.label(probe)?, step))
    }

    /// Steps begun and not ended, by label and step.
    pub fn open_steps(&self) -> Vec<OpenStep> {
        let mut v: Vec<OpenStep> = self
            .per_source
            .iter()
            .filter_map(|(&(tid, probe), s)| {
                let (step, start_ns, _) = s.open?;
                Some(OpenStep {
                    label: self.label(probe)?,
                    step,
                    tid,
                    start_ns,
                    inter_step_ns: s.last_end_ns.map(|e| start_ns.saturating_sub(e)),
                    incomplete: s.incomplete,
                })
            })
            .collect();
        v.sort_by_key(|s| (s.label, s.step));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counters with only a launch count.
    fn at(launches: u64) -> ThreadCounters {
        ThreadCounters::launches(launches)
    }

    fn tracker() -> StepTracker {
        StepTracker::new(vec!["train", "validate", "train"])
    }

    /// A step open when the driver's launch probes went in missed the launches
    /// before: it is incomplete; the next one is not.
    #[test]
    fn a_step_begun_before_the_drivers_probes_is_incomplete() {
        let mut t = tracker();
        t.enter(1, 0, 100, at(0));
        t.driver_probed_ns = 150;
        assert!(t.exit(1, 0, 200, at(3)).expect("closes").incomplete);
        t.enter(1, 0, 250, at(3));
        assert!(!t.exit(1, 0, 300, at(9)).expect("closes").incomplete);
    }

    #[test]
    fn sequential_steps_with_gaps_and_launches() {
        let mut t = tracker();
        assert_eq!(t.enter(1, 0, 100, at(0)), Some(0));
        assert_eq!(t.current_step(1), Some(("train", 0)));
        let s0 = t.exit(1, 0, 200, at(5)).expect("closes");
        assert_eq!(
            s0,
            CompletedStep {
                label: "train",
                step: 0,
                tid: 1,
                start_ns: 100,
                end_ns: 200,
                inter_step_ns: None,
                launches: 5,
                sync_wait_ns: 0,
                sched: None,
                copies: CopyTotals::default(),
                incomplete: false
            }
        );
        assert_eq!(t.current_step(1), None);
        assert_eq!(t.enter(1, 0, 250, at(7)), Some(1));
        let s1 = t.exit(1, 0, 400, at(10)).expect("closes");
        assert_eq!(s1.inter_step_ns, Some(50));
        assert_eq!(s1.launches, 3);
    }

    #[test]
    fn nesting_and_recursion_make_one_step() {
        let mut t = tracker();
        assert_eq!(t.enter(1, 0, 10, at(0)), Some(0));
        assert_eq!(t.enter(1, 0, 11, at(1)), None);
        assert_eq!(t.enter(1, 0, 12, at(2)), None);
        assert_eq!(t.exit(1, 0, 13, at(3)), None);
        assert_eq!(t.current_step(1), Some(("train", 0)));
        assert_eq!(t.exit(1, 0, 14, at(3)), None);
        let s = t.exit(1, 0, 15, at(4)).expect("outermost return closes");
        assert_eq!((s.start_ns, s.end_ns, s.launches), (10, 15, 4));
    }

    #[test]
    fn threads_are_independent_and_numbered_in_begin_order() {
        let mut t = tracker();
        assert_eq!(t.enter(1, 0, 10, at(0)), Some(0));
        assert_eq!(t.enter(2, 0, 11, at(100)), Some(1));
        assert_eq!(t.current_step(1), Some(("train", 0)));
        assert_eq!(t.current_step(2), Some(("train", 1)));
        let b = t.exit(2, 0, 20, at(103)).expect("thread 2 closes");
        assert_eq!((b.step, b.tid, b.launches), (1, 2, 3));
        let a = t.exit(1, 0, 30, at(2)).expect("thread 1 closes");
        assert_eq!((a.step, a.launches), (0, 2));
    }

    #[test]
    fn labels_count_separately_and_sources_can_share_a_label() {
        let mut t = tracker();
        assert_eq!(t.enter(1, 0, 10, at(0)), Some(0));
        assert_eq!(t.exit(1, 0, 20, at(0)).map(|s| s.label), Some("train"));
        assert_eq!(t.enter(1, 1, 30, at(0)), Some(0), "validate counts from 0");
        // A validate step inside which another source's train step runs: the
        // launch goes to the innermost.
        assert_eq!(t.enter(1, 2, 31, at(0)), Some(1), "source 2 shares the train counter");
        assert_eq!(t.current_step(1), Some(("train", 1)));
        let inner = t.exit(1, 2, 32, at(4)).expect("closes");
        assert_eq!((inner.label, inner.step, inner.launches), ("train", 1, 4));
        assert_eq!(t.current_step(1), Some(("validate", 0)));
        let outer = t.exit(1, 1, 40, at(6)).expect("closes");
        assert_eq!((outer.label, outer.launches), ("validate", 6));
    }

    #[test]
    fn sync_wait_goes_to_the_innermost_open_step() {
        let mut t = tracker();
        t.add_sync_wait(1, 7); // outside any step: dropped
        t.enter(1, 0, 10, at(0));
        t.add_sync_wait(1, 5);
        t.enter(1, 1, 11, at(0));
        t.add_sync_wait(1, 3);
        assert_eq!(t.exit(1, 1, 12, at(0)).map(|s| s.sync_wait_ns), Some(3));
        t.add_sync_wait(1, 2);
        assert_eq!(t.exit(1, 0, 20, at(0)).map(|s| s.sync_wait_ns), Some(7));
        t.enter(1, 0, 30, at(0));
        assert_eq!(t.exit(1, 0, 40, at(0)).map(|s| s.sync_wait_ns), Some(0), "reset per step");
    }

    #[test]
    fn unmatched_or_unknown_returns_are_counted_not_steps() {
        let mut t = tracker();
        assert_eq!(t.exit(1, 0, 5, at(0)), None);
        assert_eq!(t.exit(1, 9, 5, at(0)), None);
        assert_eq!(t.unmatched_returns, 2);
        assert_eq!(t.enter(1, 9, 5, at(0)), None, "unknown source");
        assert_eq!(t.enter(1, 0, 10, at(0)), Some(0));
    }

    #[test]
    fn open_steps_are_reported() {
        let mut t = tracker();
        t.enter(1, 0, 10, at(0));
        t.exit(1, 0, 20, at(0));
        t.enter(1, 0, 25, at(0));
        t.enter(3, 1, 26, at(0));
        let open = t.open_steps();
        assert_eq!(
            open,
            vec![
                OpenStep { label: "train", step: 1, tid: 1, start_ns: 25, inter_step_ns: Some(5), incomplete: false },
                OpenStep { label: "validate", step: 0, tid: 3, start_ns: 26, inter_step_ns: None, incomplete: false }
            ]
        );
    }

    /// A thread's records as the kernel numbers them: (kind, probe, ts, launches),
    /// with the sequence and depth filled in, and the chosen ones dropped.
    fn feed(
        t: &mut StepTracker,
        tid: u32,
        records: &[(DepthChange, u32, u64, u64)],
        lost: &[usize],
    ) -> (Vec<CompletedStep>, Vec<OpenStep>) {
        let (mut done, mut unseen) = (Vec::new(), Vec::new());
        let mut depth = 0u32;
        for (i, &(change, probe, ts, launches)) in records.iter().enumerate() {
            match change {
                DepthChange::Enter => depth += 1,
                DepthChange::Exit => depth = depth.saturating_sub(1),
                DepthChange::None => {}
            }
            if lost.contains(&i) {
                continue;
            }
            t.sequence(tid, probe, i as u32 + 1, depth, change, &mut unseen);
            match change {
                DepthChange::Enter => {
                    t.enter(tid, probe, ts, at(launches));
                }
                DepthChange::Exit => done.extend(t.exit(tid, probe, ts, at(launches))),
                DepthChange::None => {}
            }
        }
        (done, unseen)
    }

    /// Steps k = 0..n of 10 ns each, 5 ns apart, two launches each.
    fn plain_steps(n: u64) -> Vec<(DepthChange, u32, u64, u64)> {
        (0..n)
            .flat_map(|k| [(DepthChange::Enter, 0, 15 * k, 2 * k), (DepthChange::Exit, 0, 15 * k + 10, 2 * k + 2)])
            .collect()
    }

    #[test]
    fn a_lost_return_costs_its_step_not_every_later_one() {
        let mut t = tracker();
        // Step 2's return (record 5) is lost.
        let (done, unseen) = feed(&mut t, 1, &plain_steps(6), &[5]);
        assert_eq!(t.gaps, 1);
        assert_eq!(unseen.len(), 1, "step 2 ended unseen");
        assert_eq!((unseen[0].step, unseen[0].start_ns, unseen[0].incomplete), (2, 30, true));
        assert_eq!(done.len(), 5);
        assert!(done.iter().all(|s| s.launches == 2 && s.end_ns - s.start_ns == 10), "{done:?}");
        // The step after the gap is marked (its gap to the last seen end spans
        // the unseen one, so it has none); the others are not.
        let marked: Vec<u64> = done.iter().filter(|s| s.incomplete).map(|s| s.step).collect();
        assert_eq!(marked, vec![3]);
        assert_eq!(done.iter().find(|s| s.step == 3).map(|s| s.inter_step_ns), Some(None));
        assert!(t.open_steps().is_empty());
    }

    #[test]
    fn a_lost_entry_ends_no_step_and_the_rest_stay_exact() {
        let mut t = tracker();
        let (done, unseen) = feed(&mut t, 1, &plain_steps(5), &[4]);
        assert!(unseen.is_empty());
        assert_eq!(t.steps_without_start, 1);
        assert_eq!(t.unmatched_returns, 0);
        assert_eq!(done.len(), 4);
        assert!(done.iter().all(|s| s.launches == 2));
        assert_eq!(done.iter().filter(|s| s.incomplete).count(), 1, "the step after the gap: {done:?}");
    }

    #[test]
    fn a_lost_return_and_entry_make_one_marked_step() {
        let mut t = tracker();
        let (done, _) = feed(&mut t, 1, &plain_steps(4), &[3, 4]);
        let merged: Vec<&CompletedStep> = done.iter().filter(|s| s.incomplete).collect();
        assert_eq!(merged.len(), 1);
        assert_eq!((merged[0].start_ns, merged[0].end_ns, merged[0].launches), (15, 40, 4));
        assert_eq!(done.iter().filter(|s| !s.incomplete).count(), 2);
    }

    #[test]
    fn nested_losses_resynchronise_on_the_kernel_depth() {
        let mut t = tracker();
        use DepthChange::*;
        // Step 0 nests a call; its inner and outer returns are lost; step 1 is whole.
        let records =
            [(Enter, 0, 0, 0), (Enter, 0, 1, 0), (Exit, 0, 2, 1), (Exit, 0, 3, 1), (Enter, 0, 5, 1), (Exit, 0, 6, 3)];
        let (done, unseen) = feed(&mut t, 1, &records, &[2, 3]);
        assert_eq!(unseen.iter().map(|s| s.step).collect::<Vec<_>>(), vec![0]);
        assert_eq!(done.len(), 1);
        assert_eq!((done[0].step, done[0].launches, done[0].incomplete), (1, 2, true));
        // A sync record lost inside a step marks it, and changes nothing else.
        let mut t = tracker();
        let records =
            [(Enter, 0, 0, 0), (DepthChange::None, 101, 1, 0), (DepthChange::None, 101, 2, 0), (Exit, 0, 3, 4)];
        let (done, _) = feed(&mut t, 1, &records, &[1]);
        assert_eq!((done.len(), done[0].incomplete, done[0].launches), (1, true, 4));
    }

    #[test]
    fn records_without_a_sequence_and_thread_exits() {
        let mut t = tracker();
        let mut unseen = Vec::new();
        assert!(!t.sequence(1, 0, 0, 0, DepthChange::Enter, &mut unseen), "seq 0: no sequence");
        assert!(!t.sequence(1, 0, 1, 1, DepthChange::Enter, &mut unseen));
        t.enter(1, 0, 10, at(0));
        assert!(!t.sequence(1, 0, 2, 1, DepthChange::None, &mut unseen));
        let open = t.thread_exited(1);
        assert_eq!(open.len(), 1);
        assert!(!open[0].incomplete);
        assert!(t.open_steps().is_empty());
        // The tid comes back as another thread: its sequence starts at 1.
        assert!(!t.sequence(1, 0, 1, 1, DepthChange::Enter, &mut unseen));
        assert!(t.sequence(1, 0, 3, 1, DepthChange::Enter, &mut unseen), "a gap");
        // The sequence wraps past 0.
        let mut t = tracker();
        t.next_seq.insert(5, u32::MAX);
        assert!(!t.sequence(5, 0, u32::MAX, 0, DepthChange::None, &mut unseen));
        assert!(!t.sequence(5, 0, 1, 0, DepthChange::None, &mut unseen));
    }
}
