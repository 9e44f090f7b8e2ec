//! The consumer's side of PyTorch's `record_function` regions: region events
//! become `regions` rows, and (through `crate::regions`) step boundaries that
//! go through the step tracker like a step function's entry and return, with
//! the steps' data-wait and optimizer time.
use std::collections::HashMap;

use super::Consumer;
use crate::{
    events::{OrderedEvent, RegionEvent},
    regions::{Boundary, Region, RegionSteps, RegionTracker, StepStart},
    steps::{DepthChange, OpenStep, StepSched},
    store::{RegionRow, StoreMsg},
};

/// The step a thread was in when a region began.
type StepTag = Option<(&'static str, u64)>;

/// Regions in flight and rows not yet sent (a field of the consumer).
pub(in crate::session) struct RegionState {
    tracker: RegionTracker<StepTag>,
    rows: Vec<RegionRow>,
    optimizer: Option<u32>,
    /// The step each thread's optimizer markers last opened.
    marker_steps: HashMap<u32, u64>,
}

impl RegionState {
    pub(in crate::session) fn new(sources: RegionSteps) -> Self {
        let optimizer = sources.optimizer;
        Self { tracker: RegionTracker::new(sources), rows: Vec::new(), optimizer, marker_steps: HashMap::new() }
    }

    fn keep(&mut self, regions: impl IntoIterator<Item = Region<StepTag>>) {
        self.rows.extend(regions.into_iter().map(|r| RegionRow {
            tid: r.tid,
            name: r.name,
            truncated: r.truncated,
            start_ns: r.start_ns,
            end_ns: r.end_ns,
            step: r.tag,
        }));
    }
}

impl Consumer {
    /// A region began (`begin`) or ended.
    pub(super) fn region_event(&mut self, event: RegionEvent, begin: bool) {
        self.sequence(&event.as_ordered_event(), DepthChange::None);
        let mut boundaries = Vec::new();
        if begin {
            let tag = self.tracker.current_step(event.tid);
            let dropped = self.regions.tracker.begin(&event, tag, &mut boundaries);
            self.regions.keep(dropped);
        } else {
            let ended = self.regions.tracker.end(&event, &mut boundaries);
            self.regions.keep(ended);
        }
        for b in boundaries {
            self.boundary(event.tid, b);
        }
    }

    /// A step boundary from regions: a step function's entry or return, with
    /// no sequence of its own (the region record's was checked).
    fn boundary(&mut self, tid: u32, b: Boundary) {
        match b {
            Boundary::Enter { probe, ts_ns, at } => {
                let step = self.tracker.enter(tid, probe, ts_ns, at);
                if let Some(step) = step.filter(|_| Some(probe) == self.regions.optimizer) {
                    self.regions.marker_steps.insert(tid, step);
                }
            }
            Boundary::Exit { probe, ts_ns, at, phases, start } => {
                let e = OrderedEvent { ts_ns, tid, tgid: 0, probe, counters: at, seq: 0, depth: 0 };
                let Some((label, marked)) = self.step_exit(&e) else { return };
                let Some(step) = self.steps.last_mut() else { return };
                step.phases = phases;
                match start {
                    StepStart::Entered => {}
                    // Its first batch is its start; the time before it was the gap.
                    StepStart::Batch(ready_ns, then) if ready_ns > step.start_ns => {
                        let late = ready_ns - step.start_ns;
                        step.inter_step_ns = step.inter_step_ns.map(|g| g + late);
                        step.start_ns = ready_ns;
                        // Its thread's time from the new start (its launches still count from the old).
                        step.sched = step.sched.map(|_| StepSched::between(&then, &at));
                    }
                    StepStart::Batch(..) => {}
                    // Stored as incomplete: its start was not seen.
                    // (Once: a step a loss already marked is in the list.)
                    StepStart::Guessed if !marked => self.incomplete_steps.push((label, step.step)),
                    StepStart::Guessed => {}
                }
            }
        }
    }

    /// Whether a step still open at the session's (or its thread's) end is
    /// no step: opened by a DataLoader `__next__` (the last epoch's
    /// `StopIteration`) with nothing after it (see `RegionTracker::batch_only_step`).
    pub(super) fn batch_only_step(&self, s: &OpenStep) -> bool {
        self.regions.marker_steps.get(&s.tid) == Some(&s.step) && self.regions.tracker.batch_only_step(s.tid)
    }

    /// A thread exited: its open regions are stored with no end.
    pub(super) fn regions_thread_exited(&mut self, tid: u32) {
        self.regions.marker_steps.remove(&tid);
        let open = self.regions.tracker.thread_exited(tid);
        self.regions.keep(open);
    }

    /// The session is over: regions still open are stored with no end.
    pub(super) fn finish_regions(&mut self) {
        let open = self.regions.tracker.open_regions();
        self.regions.keep(open);
        if self.regions.tracker.unmatched_ends > 0 {
            log::info!("{} record_function ends had no begin seen", self.regions.tracker.unmatched_ends);
        }
    }

    /// Sends the region rows.
    pub(super) fn flush_regions(&mut self) {
        if !self.regions.rows.is_empty() {
            self.writer.send(StoreMsg::Regions(std::mem::take(&mut self.regions.rows)));
        }
    }
}
