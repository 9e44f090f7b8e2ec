//! Turns step-function entry/return events into step intervals.
//!
//! Per thread and nesting-safe: a step is the outermost call on a thread; a
//! recursive or re-entrant call inside it is part of it. Step numbers count
//! from 0 per session in the order the steps begin.
use std::collections::HashMap;

/// A finished step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompletedStep {
    pub step: u64,
    pub tid: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    /// Gap since the end of this thread's previous step; `None` for its first.
    pub inter_step_ns: Option<u64>,
    /// Launches the thread made between start and end.
    pub launches: u64,
}

/// A step that had begun but not ended when the session stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenStep {
    pub step: u64,
    pub tid: u32,
    pub start_ns: u64,
    pub inter_step_ns: Option<u64>,
}

#[derive(Default)]
struct ThreadSteps {
    depth: u32,
    open: Option<(u64, u64, u64)>, // (step, start_ns, thread_launches at start)
    last_end_ns: Option<u64>,
}

#[derive(Default)]
pub struct StepTracker {
    threads: HashMap<u32, ThreadSteps>,
    next_step: u64,
    /// Returns seen with no matching entry (the kernel drops uretprobes nested
    /// deeper than 64 frames).
    pub unmatched_returns: u64,
}

impl StepTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Entry of the step function. Returns the new step's number when this is
    /// an outermost call.
    pub fn enter(&mut self, tid: u32, ts_ns: u64, thread_launches: u64) -> Option<u64> {
        let t = self.threads.entry(tid).or_default();
        t.depth += 1;
        if t.depth > 1 {
            return None;
        }
        let step = self.next_step;
        self.next_step += 1;
        t.open = Some((step, ts_ns, thread_launches));
        Some(step)
    }

    /// Return of the step function. Returns the step when this closes an
    /// outermost call.
    pub fn exit(&mut self, tid: u32, ts_ns: u64, thread_launches: u64) -> Option<CompletedStep> {
        let Some(t) = self.threads.get_mut(&tid).filter(|t| t.depth > 0) else {
            self.unmatched_returns += 1;
            return None;
        };
        t.depth -= 1;
        if t.depth > 0 {
            return None;
        }
        let (step, start_ns, launches_at_start) = t.open.take()?;
        let inter_step_ns = t.last_end_ns.map(|e| start_ns.saturating_sub(e));
        t.last_end_ns = Some(ts_ns);
        Some(CompletedStep {
            step,
            tid,
            start_ns,
            end_ns: ts_ns,
            inter_step_ns,
            launches: thread_launches.saturating_sub(launches_at_start),
        })
    }

    /// The step `tid` is inside, if any.
    pub fn current_step(&self, tid: u32) -> Option<u64> {
        self.threads.get(&tid).and_then(|t| t.open.map(|(s, _, _)| s))
    }

    /// Steps begun and not ended, in step order.
    pub fn open_steps(&self) -> Vec<OpenStep> {
        let mut v: Vec<OpenStep> = self
            .threads
            .iter()
            .filter_map(|(tid, t)| {
                t.open.map(|(step, start_ns, _)| OpenStep {
                    step,
                    tid: *tid,
                    start_ns,
                    inter_step_ns: t.last_end_ns.map(|e| start_ns.saturating_sub(e)),
                })
            })
            .collect();
        v.sort_by_key(|s| s.step);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_steps_with_gaps_and_launches() {
        let mut t = StepTracker::new();
        assert_eq!(t.enter(1, 100, 0), Some(0));
        assert_eq!(t.current_step(1), Some(0));
        let s0 = t.exit(1, 200, 5).expect("closes");
        assert_eq!(s0, CompletedStep { step: 0, tid: 1, start_ns: 100, end_ns: 200, inter_step_ns: None, launches: 5 });
        assert_eq!(t.current_step(1), None);
        assert_eq!(t.enter(1, 250, 7), Some(1));
        let s1 = t.exit(1, 400, 10).expect("closes");
        assert_eq!(s1.inter_step_ns, Some(50));
        assert_eq!(s1.launches, 3);
    }

    #[test]
    fn nesting_and_recursion_make_one_step() {
        let mut t = StepTracker::new();
        assert_eq!(t.enter(1, 10, 0), Some(0));
        assert_eq!(t.enter(1, 11, 1), None);
        assert_eq!(t.enter(1, 12, 2), None);
        assert_eq!(t.exit(1, 13, 3), None);
        assert_eq!(t.current_step(1), Some(0));
        assert_eq!(t.exit(1, 14, 3), None);
        let s = t.exit(1, 15, 4).expect("outermost return closes");
        assert_eq!((s.start_ns, s.end_ns, s.launches), (10, 15, 4));
    }

    #[test]
    fn threads_are_independent_and_numbered_in_begin_order() {
        let mut t = StepTracker::new();
        assert_eq!(t.enter(1, 10, 0), Some(0));
        assert_eq!(t.enter(2, 11, 100), Some(1));
        assert_eq!(t.current_step(1), Some(0));
        assert_eq!(t.current_step(2), Some(1));
        let b = t.exit(2, 20, 103).expect("thread 2 closes");
        assert_eq!((b.step, b.tid, b.launches), (1, 2, 3));
        assert_eq!(t.current_step(1), Some(0));
        let a = t.exit(1, 30, 2).expect("thread 1 closes");
        assert_eq!((a.step, a.launches), (0, 2));
    }

    #[test]
    fn unmatched_return_is_counted_not_a_step() {
        let mut t = StepTracker::new();
        assert_eq!(t.exit(1, 5, 0), None);
        assert_eq!(t.unmatched_returns, 1);
        assert_eq!(t.enter(1, 10, 0), Some(0));
    }

    #[test]
    fn open_steps_are_reported() {
        let mut t = StepTracker::new();
        t.enter(1, 10, 0);
        t.exit(1, 20, 0);
        t.enter(1, 25, 0);
        t.enter(3, 26, 0);
        let open = t.open_steps();
        assert_eq!(
            open,
            vec![
                OpenStep { step: 1, tid: 1, start_ns: 25, inter_step_ns: Some(5) },
                OpenStep { step: 2, tid: 3, start_ns: 26, inter_step_ns: None }
            ]
        );
    }
}
