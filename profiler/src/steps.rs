//! Turns step-function entry/return events into step intervals.
//!
//! Per thread, per step source and nesting-safe: a step is the outermost call
//! of its step function on a thread; a recursive or re-entrant call inside it
//! is part of it. Each step source (a `--step-symbol` or `--step-python`) has a
//! label; step numbers count from 0 per label, in the order steps begin.
use std::collections::HashMap;

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
}

/// A step that had begun but not ended when the session stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenStep {
    pub label: &'static str,
    pub step: u64,
    pub tid: u32,
    pub start_ns: u64,
    pub inter_step_ns: Option<u64>,
}

#[derive(Default)]
struct SourceState {
    depth: u32,
    open: Option<(u64, u64, u64)>, // (step, start_ns, thread_launches at start)
    sync_wait_ns: u64,
    last_end_ns: Option<u64>,
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
        }
    }

    fn label(&self, probe: u32) -> Option<&'static str> {
        self.labels.get(probe as usize).copied()
    }

    /// Entry of a step function. Returns the new step's number when this is
    /// an outermost call.
    pub fn enter(&mut self, tid: u32, probe: u32, ts_ns: u64, thread_launches: u64) -> Option<u64> {
        let label = self.label(probe)?;
        let s = self.per_source.entry((tid, probe)).or_default();
        s.depth += 1;
        if s.depth > 1 {
            return None;
        }
        let counter = self.next_step.entry(label).or_insert(0);
        let step = *counter;
        *counter += 1;
        s.open = Some((step, ts_ns, thread_launches));
        s.sync_wait_ns = 0;
        self.open_by_thread.entry(tid).or_default().push((probe, step));
        Some(step)
    }

    /// Return of a step function. Returns the step when this closes an
    /// outermost call.
    pub fn exit(&mut self, tid: u32, probe: u32, ts_ns: u64, thread_launches: u64) -> Option<CompletedStep> {
        let Some(s) = self.per_source.get_mut(&(tid, probe)).filter(|s| s.depth > 0) else {
            self.unmatched_returns += 1;
            return None;
        };
        s.depth -= 1;
        if s.depth > 0 {
            return None;
        }
        let (step, start_ns, launches_at_start) = s.open.take()?;
        let inter_step_ns = s.last_end_ns.map(|e| start_ns.saturating_sub(e));
        s.last_end_ns = Some(ts_ns);
        let sync_wait_ns = s.sync_wait_ns;
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
            launches: thread_launches.saturating_sub(launches_at_start),
            sync_wait_ns,
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

    fn tracker() -> StepTracker {
        StepTracker::new(vec!["train", "validate", "train"])
    }

    #[test]
    fn sequential_steps_with_gaps_and_launches() {
        let mut t = tracker();
        assert_eq!(t.enter(1, 0, 100, 0), Some(0));
        assert_eq!(t.current_step(1), Some(("train", 0)));
        let s0 = t.exit(1, 0, 200, 5).expect("closes");
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
                sync_wait_ns: 0
            }
        );
        assert_eq!(t.current_step(1), None);
        assert_eq!(t.enter(1, 0, 250, 7), Some(1));
        let s1 = t.exit(1, 0, 400, 10).expect("closes");
        assert_eq!(s1.inter_step_ns, Some(50));
        assert_eq!(s1.launches, 3);
    }

    #[test]
    fn nesting_and_recursion_make_one_step() {
        let mut t = tracker();
        assert_eq!(t.enter(1, 0, 10, 0), Some(0));
        assert_eq!(t.enter(1, 0, 11, 1), None);
        assert_eq!(t.enter(1, 0, 12, 2), None);
        assert_eq!(t.exit(1, 0, 13, 3), None);
        assert_eq!(t.current_step(1), Some(("train", 0)));
        assert_eq!(t.exit(1, 0, 14, 3), None);
        let s = t.exit(1, 0, 15, 4).expect("outermost return closes");
        assert_eq!((s.start_ns, s.end_ns, s.launches), (10, 15, 4));
    }

    #[test]
    fn threads_are_independent_and_numbered_in_begin_order() {
        let mut t = tracker();
        assert_eq!(t.enter(1, 0, 10, 0), Some(0));
        assert_eq!(t.enter(2, 0, 11, 100), Some(1));
        assert_eq!(t.current_step(1), Some(("train", 0)));
        assert_eq!(t.current_step(2), Some(("train", 1)));
        let b = t.exit(2, 0, 20, 103).expect("thread 2 closes");
        assert_eq!((b.step, b.tid, b.launches), (1, 2, 3));
        let a = t.exit(1, 0, 30, 2).expect("thread 1 closes");
        assert_eq!((a.step, a.launches), (0, 2));
    }

    #[test]
    fn labels_count_separately_and_sources_can_share_a_label() {
        let mut t = tracker();
        assert_eq!(t.enter(1, 0, 10, 0), Some(0));
        assert_eq!(t.exit(1, 0, 20, 0).map(|s| s.label), Some("train"));
        assert_eq!(t.enter(1, 1, 30, 0), Some(0), "validate counts from 0");
        // A validate step inside which another source's train step runs: the
        // launch goes to the innermost.
        assert_eq!(t.enter(1, 2, 31, 0), Some(1), "source 2 shares the train counter");
        assert_eq!(t.current_step(1), Some(("train", 1)));
        let inner = t.exit(1, 2, 32, 4).expect("closes");
        assert_eq!((inner.label, inner.step, inner.launches), ("train", 1, 4));
        assert_eq!(t.current_step(1), Some(("validate", 0)));
        let outer = t.exit(1, 1, 40, 6).expect("closes");
        assert_eq!((outer.label, outer.launches), ("validate", 6));
    }

    #[test]
    fn sync_wait_goes_to_the_innermost_open_step() {
        let mut t = tracker();
        t.add_sync_wait(1, 7); // outside any step: dropped
        t.enter(1, 0, 10, 0);
        t.add_sync_wait(1, 5);
        t.enter(1, 1, 11, 0);
        t.add_sync_wait(1, 3);
        assert_eq!(t.exit(1, 1, 12, 0).map(|s| s.sync_wait_ns), Some(3));
        t.add_sync_wait(1, 2);
        assert_eq!(t.exit(1, 0, 20, 0).map(|s| s.sync_wait_ns), Some(7));
        t.enter(1, 0, 30, 0);
        assert_eq!(t.exit(1, 0, 40, 0).map(|s| s.sync_wait_ns), Some(0), "reset per step");
    }

    #[test]
    fn unmatched_or_unknown_returns_are_counted_not_steps() {
        let mut t = tracker();
        assert_eq!(t.exit(1, 0, 5, 0), None);
        assert_eq!(t.exit(1, 9, 5, 0), None);
        assert_eq!(t.unmatched_returns, 2);
        assert_eq!(t.enter(1, 9, 5, 0), None, "unknown source");
        assert_eq!(t.enter(1, 0, 10, 0), Some(0));
    }

    #[test]
    fn open_steps_are_reported() {
        let mut t = tracker();
        t.enter(1, 0, 10, 0);
        t.exit(1, 0, 20, 0);
        t.enter(1, 0, 25, 0);
        t.enter(3, 1, 26, 0);
        let open = t.open_steps();
        assert_eq!(
            open,
            vec![
                OpenStep { label: "train", step: 1, tid: 1, start_ns: 25, inter_step_ns: Some(5) },
                OpenStep { label: "validate", step: 0, tid: 3, start_ns: 26, inter_step_ns: None }
            ]
        );
    }
}
