//! PyTorch `record_function` regions: pairs each thread's region ends
//! with their begins, and turns PyTorch's own markers (or any region named by
//! `--step-region`) into step boundaries for the step tracker.
//!
//! No I/O: the consumer hands in decoded events and stores what comes out.
//!
//! Pairing is by key (the region's `PythonRecordFunction*`), not by order: an
//! end whose begin was lost matches nothing and is counted; a begin whose end
//! was lost stays open (stored with no end) and cannot capture a later end,
//! because the later region's begin, with the same key if the address was
//! reused, sits above it on the thread's stack and is found first.
//!
//! Training steps from PyTorch's markers, with GPUStatsMonitor's meaning: a
//! step starts when its first batch is ready (the end of the first
//! `enumerate(DataLoader)#…__next__` after the previous optimizer step) and
//! ends at the end of the outermost `Optimizer.step#…`. A thread that has shown
//! no DataLoader starts its next step where the previous optimizer step ended,
//! and its first at its first `Optimizer.zero_grad` (or other non-step
//! optimizer region), since nothing earlier marks it: that start is a guess,
//! and the step says so ([`StepStart::Guessed`], stored as incomplete).
//!
//! Whether a thread uses a DataLoader is only known once its `__next__` is
//! seen: a step opened before that (the loop's first, whose `zero_grad` comes
//! before its first batch, or the first after an attach in mid-iteration) is
//! opened early, so that its launches are counted, and its start is moved to
//! its first batch's if one comes ([`StepStart::Batch`]). A first region that
//! is an `Optimizer.step` (attached in mid-iteration) opens nothing: the step
//! it ends began unseen.
//!
//! An epoch's last `__next__` raises `StopIteration` in a region like a
//! batch's, so the step opened at its end is only known for what it was when
//! the optimizer step ends: a step that held more `__next__`s than its
//! thread's usual number (its gradient accumulation) starts at the first of
//! its last usual number, and the time before is data wait
//! ([`StepStart::Batch`]). A step opened that way with nothing after it when
//! the session ends (the last epoch's end) is no step
//! ([`RegionTracker::batch_only_step`]).
use std::collections::HashMap;

use crate::{
    events::{RegionEvent, ThreadCounters},
    steps::StepPhases as Phases,
};

/// The optimizer's step (`torch.optim.Optimizer`'s `profile_hook_step`).
pub const OPTIMIZER_STEP: &str = "Optimizer.step#";
/// Any of the optimizer's regions (`step`, `zero_grad`).
const OPTIMIZER_ANY: &str = "Optimizer.";
/// The DataLoader iterator's `__next__` (`_BaseDataLoaderIter`).
const DATALOADER_PREFIX: &str = "enumerate(DataLoader)#";
const DATALOADER_SUFFIX: &str = ".__next__";

/// Regions open on one thread beyond this are taken as never ending (their
/// ends lost): the oldest is stored with no end.
const MAX_OPEN_PER_THREAD: usize = 256;

/// Batches per optimizer step counted per thread up to this (a larger
/// gradient accumulation is counted as this many).
const MAX_BATCHES_PER_STEP: usize = 64;

/// `--steps`: where steps come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum StepMode {
    /// The named step sources if any are given, else PyTorch's optimizer markers.
    #[default]
    Auto,
    /// PyTorch's optimizer markers (waits for libtorch if it is not loaded yet).
    Torch,
    /// No steps (regions are still recorded).
    None,
}

impl StepMode {
    /// Whether the optimizer's markers make steps, given whether other step sources were named.
    pub fn optimizer_steps(self, named_sources: bool) -> bool {
        match self {
            Self::Auto => !named_sources,
            Self::Torch => true,
            Self::None => false,
        }
    }
}

/// `--step-region [LABEL=]NAME_PREFIX` (the prefix as
/// [`crate::step_label`] reads it): regions whose name starts with the
/// prefix are steps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionStepSpec {
    pub label: String,
    pub prefix: String,
}

impl RegionStepSpec {
    pub fn parse(s: &str) -> Result<Self, String> {
        let (label, prefix) = crate::step_label::split(s)
            .map_err(|e| format!("--step-region '{s}': {e} (a region name prefix, e.g. ProfilerStep#)"))?;
        Ok(Self { label, prefix: prefix.to_owned() })
    }
}

impl std::fmt::Display for RegionStepSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.label, self.prefix)
    }
}

/// What makes steps from regions: the step tracker's probe ids.
#[derive(Clone, Debug, Default)]
pub struct RegionSteps {
    /// Steps from the optimizer's markers, with this probe id.
    pub optimizer: Option<u32>,
    /// (probe id, name prefix) of each `--step-region`.
    pub prefixes: Vec<(u32, String)>,
}

/// A step boundary for the step tracker (as a step function's entry or return).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Boundary {
    /// `at`: the thread's counters when the step began.
    Enter {
        probe: u32,
        ts_ns: u64,
        at: ThreadCounters,
    },
    Exit {
        probe: u32,
        ts_ns: u64,
        at: ThreadCounters,
        phases: Option<Phases>,
        start: StepStart,
    },
}

/// Where the step an [`Boundary::Exit`] ends really began.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepStart {
    /// At its [`Boundary::Enter`].
    Entered,
    /// Later, when its first batch was ready (ns, and the thread's counters
    /// then): it was entered before the thread was known to use a DataLoader,
    /// or an epoch's end came first.
    Batch(u64, ThreadCounters),
    /// Unseen: it was entered at its first optimizer region, a guess.
    Guessed,
}

/// How the open step of a thread was entered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Opened {
    /// At a DataLoader `__next__`'s end: its first batch.
    Batch,
    /// At the previous optimizer step's end (no DataLoader seen yet).
    OptimizerEnd,
    /// At the thread's first non-step optimizer region (no DataLoader seen yet).
    FirstRegion,
}

/// A region, ended or not. `T` is what the caller tags it with at its begin
/// (the step its thread was in).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region<T> {
    pub tid: u32,
    pub name: String,
    pub truncated: bool,
    pub start_ns: u64,
    pub end_ns: Option<u64>,
    pub tag: T,
}

struct ThreadState<T> {
    open: Vec<(u64, Region<T>)>,
    dataloader_seen: bool,
    /// How the open step was entered; None: no step open.
    opened: Option<Opened>,
    /// When the open step's first batch was ready, if it was entered before.
    batch_ready: Option<(u64, ThreadCounters)>,
    /// Outermost `Optimizer.step` / DataLoader `__next__` regions open.
    optimizer_depth: u32,
    next_depth: u32,
    data_wait_ns: u64,
    optimizer_ns: u64,
    batches: Batches,
    /// A region began since the open step was entered at a `__next__`'s end.
    active_since_batch: bool,
}

/// The DataLoader `__next__` calls of a thread since its previous optimizer
/// step, and how many each of its steps held: the usual number is its
/// gradient accumulation, and the `__next__`s before the last that many are
/// no batch of the step (an epoch's `StopIteration`).
#[derive(Default)]
struct Batches {
    /// (begin, end, the thread's counters at the end) of the outermost
    /// `__next__`s, the last [`MAX_BATCHES_PER_STEP`].
    spans: std::collections::VecDeque<(u64, u64, ThreadCounters)>,
    /// All of them, and when the first began.
    count: usize,
    first_begin: Option<u64>,
    /// Steps that held n `__next__`s, at `n - 1` (up to [`MAX_BATCHES_PER_STEP`]).
    per_step: Vec<u32>,
}

impl Batches {
    fn push(&mut self, begin: u64, end: u64, at: ThreadCounters) {
        if self.spans.len() == MAX_BATCHES_PER_STEP {
            self.spans.pop_front();
        }
        self.spans.push_back((begin, end, at));
        self.count += 1;
        self.first_begin.get_or_insert(begin);
    }

    /// The thread's usual `__next__`s per step: the most common count (the
    /// smaller on a tie), once a step has been counted.
    fn usual(&self) -> Option<usize> {
        let (i, &n) = self.per_step.iter().enumerate().rev().max_by_key(|&(_, n)| *n)?;
        (n > 0).then_some(i + 1)
    }

    /// The optimizer step ended: when its first batch was ready and its data
    /// wait, if `__next__`s before its last usual number came first (their
    /// time, and the time between them, is data wait). Counts the step.
    fn step_ended(&mut self, counted: bool) -> Option<((u64, ThreadCounters), u64)> {
        let moved = self.usual().filter(|&u| self.count > u && u <= self.spans.len()).map(|u| {
            let later = self.spans.range(self.spans.len() - u..);
            let ready = later.clone().next().map_or((0, ThreadCounters::default()), |&(_, end, at)| (end, at));
            let first = self.first_begin.unwrap_or(ready.0);
            let wait = ready.0.saturating_sub(first) + later.skip(1).map(|&(b, e, _)| e.saturating_sub(b)).sum::<u64>();
            (ready, wait)
        });
        if counted && self.count > 0 {
            let i = self.count.min(MAX_BATCHES_PER_STEP) - 1;
            if self.per_step.len() <= i {
                self.per_step.resize(i + 1, 0);
            }
            self.per_step[i] += 1;
        }
        self.spans.clear();
        self.count = 0;
        self.first_begin = None;
        moved
    }
}

impl<T> Default for ThreadState<T> {
    fn default() -> Self {
        Self {
            open: Vec::new(),
            dataloader_seen: false,
            opened: None,
            batch_ready: None,
            optimizer_depth: 0,
            next_depth: 0,
            data_wait_ns: 0,
            optimizer_ns: 0,
            batches: Batches::default(),
            active_since_batch: false,
        }
    }
}

pub struct RegionTracker<T> {
    steps: RegionSteps,
    threads: HashMap<u32, ThreadState<T>>,
    /// Ends whose begin was never seen.
    pub unmatched_ends: u64,
}

fn is_dataloader_next(name: &str) -> bool {
    name.starts_with(DATALOADER_PREFIX) && name.ends_with(DATALOADER_SUFFIX)
}

impl<T: Clone> RegionTracker<T> {
    pub fn new(steps: RegionSteps) -> Self {
        Self { steps, threads: HashMap::new(), unmatched_ends: 0 }
    }

    /// A region began. Returns a region taken as never ending (a thread
    /// with too many open), to be stored with no end.
    pub fn begin(&mut self, e: &RegionEvent, tag: T, out: &mut Vec<Boundary>) -> Option<Region<T>> {
        let t = self.threads.entry(e.tid).or_default();
        t.active_since_batch = true;
        for (probe, prefix) in &self.steps.prefixes {
            if e.name.starts_with(prefix.as_str()) {
                out.push(Boundary::Enter { probe: *probe, ts_ns: e.ts_ns, at: e.counters });
            }
        }
        if let Some(probe) = self.steps.optimizer {
            if is_dataloader_next(&e.name) {
                t.dataloader_seen = true;
                t.next_depth += 1;
            } else if e.name.starts_with(OPTIMIZER_ANY)
                && !e.name.starts_with(OPTIMIZER_STEP)
                && t.opened.is_none()
                && !t.dataloader_seen
            {
                // No DataLoader seen (yet): nothing marks this step's start earlier.
                t.opened = Some(Opened::FirstRegion);
                out.push(Boundary::Enter { probe, ts_ns: e.ts_ns, at: e.counters });
            }
            if e.name.starts_with(OPTIMIZER_STEP) {
                t.optimizer_depth += 1;
            }
        }
        let region =
            Region { tid: e.tid, name: e.name.clone(), truncated: e.truncated, start_ns: e.ts_ns, end_ns: None, tag };
        t.open.push((e.key, region));
        (t.open.len() > MAX_OPEN_PER_THREAD).then(|| t.open.remove(0).1)
    }

    /// A region ended: returns it with its end, or None when its begin was not seen.
    pub fn end(&mut self, e: &RegionEvent, out: &mut Vec<Boundary>) -> Option<Region<T>> {
        let Some(t) = self.threads.get_mut(&e.tid) else {
            self.unmatched_ends += 1;
            return None;
        };
        let Some(i) = t.open.iter().rposition(|(k, _)| *k == e.key) else {
            self.unmatched_ends += 1;
            return None;
        };
        let (_, mut region) = t.open.remove(i);
        region.end_ns = Some(e.ts_ns);
        let at = e.counters;
        for (probe, prefix) in self.steps.prefixes.iter().rev() {
            if region.name.starts_with(prefix.as_str()) {
                let start = StepStart::Entered;
                out.push(Boundary::Exit { probe: *probe, ts_ns: e.ts_ns, at, phases: None, start });
            }
        }
        if let Some(probe) = self.steps.optimizer {
            optimizer_end(t, probe, &region, e.ts_ns, at, out);
        }
        Some(region)
    }

    /// Whether `tid`'s open step was entered at a DataLoader `__next__`'s end
    /// and the thread has begun no region since: at the session's end such a
    /// step is no step (the last epoch's `StopIteration`, or a batch no
    /// optimizer step used) and is not stored.
    pub fn batch_only_step(&self, tid: u32) -> bool {
        self.threads.get(&tid).is_some_and(|t| t.opened == Some(Opened::Batch) && !t.active_since_batch)
    }

    /// A thread exited: its open regions, to be stored with no end.
    pub fn thread_exited(&mut self, tid: u32) -> Vec<Region<T>> {
        self.threads.remove(&tid).map(|t| t.open.into_iter().map(|(_, r)| r).collect()).unwrap_or_default()
    }

    /// Every region still open (the session is over), oldest first per thread.
    pub fn open_regions(&mut self) -> Vec<Region<T>> {
        let mut out: Vec<Region<T>> =
            self.threads.values_mut().flat_map(|t| std::mem::take(&mut t.open)).map(|(_, r)| r).collect();
        out.sort_by_key(|r| (r.start_ns, r.tid));
        out
    }
}

/// The optimizer-marker steps' side of a region's end.
fn optimizer_end<T>(
    t: &mut ThreadState<T>,
    probe: u32,
    region: &Region<T>,
    ts_ns: u64,
    at: ThreadCounters,
    out: &mut Vec<Boundary>,
) {
    let took = ts_ns.saturating_sub(region.start_ns);
    if is_dataloader_next(&region.name) {
        t.next_depth = t.next_depth.saturating_sub(1);
        if t.next_depth == 0 {
            t.data_wait_ns += took;
            t.batches.push(region.start_ns, ts_ns, at);
            match t.opened {
                None => {
                    // The first batch after the previous optimizer step is
                    // ready, or an epoch ended: which one, the optimizer
                    // step tells (`Batches::step_ended`).
                    t.opened = Some(Opened::Batch);
                    t.active_since_batch = false;
                    out.push(Boundary::Enter { probe, ts_ns, at });
                }
                Some(Opened::Batch) => {}
                Some(_) => {
                    // Entered before the DataLoader was known: this is its real start.
                    t.batch_ready.get_or_insert((ts_ns, at));
                }
            }
        }
        return;
    }
    if !region.name.starts_with(OPTIMIZER_STEP) {
        return;
    }
    t.optimizer_depth = t.optimizer_depth.saturating_sub(1);
    if t.optimizer_depth > 0 {
        return; // an optimizer stepping another inside its own step
    }
    t.optimizer_ns += took;
    let opened = t.opened.take();
    let moved = t.batches.step_ended(opened.is_some());
    if let Some(opened) = opened {
        let (ready, data_wait_ns) = match moved {
            Some((at, wait)) => (Some(at), wait),
            None => (t.batch_ready, t.data_wait_ns),
        };
        t.batch_ready = None;
        let phases = Some(Phases { data_wait_ns, optimizer_ns: t.optimizer_ns });
        let start = match (ready, opened) {
            (Some((ready_ns, then)), _) => StepStart::Batch(ready_ns, then),
            (None, Opened::FirstRegion) => StepStart::Guessed,
            (None, _) => StepStart::Entered,
        };
        out.push(Boundary::Exit { probe, ts_ns, at, phases, start });
    }
    t.data_wait_ns = 0;
    t.optimizer_ns = 0;
    if !t.dataloader_seen {
        // No DataLoader (seen yet): the next step starts where this one ended.
        t.opened = Some(Opened::OptimizerEnd);
        out.push(Boundary::Enter { probe, ts_ns, at });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(tid: u32, ts_ns: u64, key: u64, name: &str) -> RegionEvent {
        RegionEvent {
            ts_ns,
            tid,
            tgid: 0,
            key,
            counters: ThreadCounters::launches(ts_ns),
            seq: 0,
            depth: 0,
            name: name.into(),
            truncated: false,
        }
    }

    const NEXT: &str = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__";
    const STEP: &str = "Optimizer.step#AdamW.step";
    const ZERO: &str = "Optimizer.zero_grad#AdamW.zero_grad";

    /// Runs (begin?, ts, key, name) events through a tracker; returns the boundaries and ended regions.
    fn run(
        steps: RegionSteps,
        events: &[(bool, u64, u64, &str)],
    ) -> (Vec<Boundary>, Vec<Region<()>>, RegionTracker<()>) {
        let mut t = RegionTracker::new(steps);
        let (mut out, mut ended) = (Vec::new(), Vec::new());
        for &(begin, ts, key, name) in events {
            if begin {
                assert!(t.begin(&ev(1, ts, key, name), (), &mut out).is_none());
            } else {
                ended.extend(t.end(&ev(1, ts, key, ""), &mut out));
            }
        }
        (out, ended, t)
    }

    fn torch() -> RegionSteps {
        RegionSteps { optimizer: Some(0), prefixes: Vec::new() }
    }

    fn spans(b: &[Boundary]) -> Vec<(char, u64)> {
        b.iter()
            .map(|b| match b {
                Boundary::Enter { ts_ns, .. } => ('[', *ts_ns),
                Boundary::Exit { ts_ns, .. } => (']', *ts_ns),
            })
            .collect()
    }

    #[test]
    fn dataloader_loop_steps_start_when_the_batch_is_ready_and_end_with_the_optimizer_step() {
        let mut events = Vec::new();
        for i in 0..3u64 {
            let t = i * 100;
            events.extend([
                (true, t, 1, NEXT),
                (false, t + 10, 1, ""),
                (true, t + 20, 2, ZERO),
                (false, t + 22, 2, ""),
                (true, t + 60, 3, STEP),
                (false, t + 90, 3, ""),
            ]);
        }
        let (b, ended, _) = run(torch(), &events);
        assert_eq!(spans(&b), vec![('[', 10), (']', 90), ('[', 110), (']', 190), ('[', 210), (']', 290)]);
        assert!(b.iter().all(|x| match x {
            Boundary::Exit { phases, .. } => *phases == Some(Phases { data_wait_ns: 10, optimizer_ns: 30 }),
            _ => true,
        }));
        assert_eq!(ended.len(), 9);
        assert_eq!(ended[0].name, NEXT);
        assert_eq!((ended[0].start_ns, ended[0].end_ns), (0, Some(10)));
    }

    #[test]
    fn gradient_accumulation_is_one_step_per_optimizer_step_with_all_its_batches_waits() {
        let events = [
            (true, 0, 1, NEXT),
            (false, 5, 1, ""),
            (true, 20, 1, NEXT),
            (false, 27, 1, ""),
            (true, 40, 2, STEP),
            (false, 50, 2, ""),
        ];
        let (b, _, _) = run(torch(), &events);
        assert_eq!(spans(&b), vec![('[', 5), (']', 50)]);
        assert!(matches!(b[1], Boundary::Exit { phases: Some(Phases { data_wait_ns: 12, optimizer_ns: 10 }), .. }));
    }

    /// Steps of `batches` `__next__`s each (one `__next__` 10 ns, then 10 ns of
    /// work, then a 10 ns optimizer step), 100 ns apart; `extra[i]` more
    /// `__next__`s (an epoch's end: 1 ns, then 20 ns to the next) come first in step i.
    fn batched_steps(batches: u64, extra: &[u64]) -> Vec<(bool, u64, u64, &'static str)> {
        let mut events = Vec::new();
        for (i, &x) in extra.iter().enumerate() {
            let mut t = i as u64 * 1000;
            for _ in 0..x {
                events.extend([(true, t, 1, NEXT), (false, t + 1, 1, "")]);
                t += 21;
            }
            for _ in 0..batches {
                events.extend([(true, t, 1, NEXT), (false, t + 10, 1, "")]);
                t += 20;
            }
            events.extend([(true, t, 3, STEP), (false, t + 10, 3, "")]);
        }
        events
    }

    /// (start, end, data wait) of each step.
    fn step_spans(b: &[Boundary]) -> Vec<(u64, u64, u64)> {
        let mut out = Vec::new();
        let mut entered = 0;
        for x in b {
            match x {
                Boundary::Enter { ts_ns, .. } => entered = *ts_ns,
                Boundary::Exit { ts_ns, start, phases, .. } => {
                    let s = if let StepStart::Batch(at, _) = start { *at } else { entered };
                    out.push((s, *ts_ns, phases.map_or(0, |p| p.data_wait_ns)));
                }
            }
        }
        out
    }

    #[test]
    fn an_epoch_end_starts_no_step_its_first_batch_does() {
        let (b, _, t) = run(torch(), &batched_steps(1, &[0, 0, 1, 0, 1]));
        let s = step_spans(&b);
        assert_eq!(s.len(), 5);
        assert_eq!(s[1], (1010, 1030, 10));
        // The StopIteration `__next__` at 2000..2001 and the new iterator
        // (to 2021) are data wait and inter-step time.
        assert_eq!(s[2], (2031, 2051, 31));
        assert_eq!(s[3], (3010, 3030, 10));
        assert_eq!(s[4], (4031, 4051, 31));
        assert!(!t.batch_only_step(1), "no step open");
    }

    #[test]
    fn gradient_accumulation_across_an_epoch_end_starts_at_the_first_of_its_batches() {
        // Four batches a step; the third step's first `__next__` ends the epoch.
        let (b, _, _) = run(torch(), &batched_steps(4, &[0, 0, 1, 0]));
        let s = step_spans(&b);
        assert_eq!(s[0], (10, 90, 40));
        assert_eq!(s[2], (2031, 2111, 31 + 30));
        assert_eq!(s[3], (3010, 3090, 40));
    }

    #[test]
    fn the_first_step_with_no_usual_count_yet_keeps_its_first_next() {
        let (b, _, _) = run(torch(), &batched_steps(1, &[1, 0]));
        assert_eq!(step_spans(&b)[0].0, 1);
    }

    #[test]
    fn the_last_epochs_end_is_no_step() {
        let mut events = batched_steps(1, &[0, 0]);
        events.extend([(true, 5000, 1, NEXT), (false, 5001, 1, "")]);
        let (b, _, mut t) = run(torch(), &events);
        assert_eq!(b.last(), Some(&Boundary::Enter { probe: 0, ts_ns: 5001, at: ThreadCounters::launches(5001) }));
        assert!(t.batch_only_step(1));
        // A region after it: a step in progress (a detach in mid-step).
        let mut out = Vec::new();
        t.begin(&ev(1, 5100, 7, "fwd"), (), &mut out);
        assert!(!t.batch_only_step(1));
    }

    #[test]
    fn without_a_dataloader_steps_are_back_to_back_from_the_first_optimizer_region() {
        let events = [
            (true, 10, 2, ZERO),
            (false, 12, 2, ""),
            (true, 40, 3, STEP),
            (false, 50, 3, ""),
            (true, 60, 2, ZERO),
            (false, 61, 2, ""),
            (true, 80, 3, STEP),
            (false, 95, 3, ""),
        ];
        let (b, _, _) = run(torch(), &events);
        // The last Enter opens the step in progress at the end.
        assert_eq!(spans(&b), vec![('[', 10), (']', 50), ('[', 50), (']', 95), ('[', 95)]);
    }

    /// (start kind, ts) of each Exit.
    fn starts(b: &[Boundary]) -> Vec<StepStart> {
        b.iter()
            .filter_map(|b| match b {
                Boundary::Exit { start, .. } => Some(*start),
                Boundary::Enter { .. } => None,
            })
            .collect()
    }

    #[test]
    fn a_first_step_entered_at_zero_grad_starts_at_its_first_batch() {
        // A loop's iteration: zero_grad, then the batch, then the step.
        let mut events = Vec::new();
        for i in 0..2u64 {
            let t = i * 100;
            events.extend([
                (true, t, 2, ZERO),
                (false, t + 2, 2, ""),
                (true, t + 10, 1, NEXT),
                (false, t + 20, 1, ""),
                (true, t + 60, 3, STEP),
                (false, t + 90, 3, ""),
            ]);
        }
        let (b, _, _) = run(torch(), &events);
        // Entered at zero_grad (launches count from there), started at the batch.
        assert_eq!(spans(&b), vec![('[', 0), (']', 90), ('[', 120), (']', 190)]);
        assert_eq!(starts(&b), vec![StepStart::Batch(20, ThreadCounters::launches(20)), StepStart::Entered]);
    }

    #[test]
    fn attached_in_mid_iteration_the_step_begun_unseen_is_not_a_step() {
        // The batch's begin and the optimizer step's begin came before the probes.
        let events = [
            (false, 5, 1, ""),
            (true, 60, 3, STEP),
            (false, 90, 3, ""),
            (true, 100, 2, ZERO),
            (false, 102, 2, ""),
            (true, 110, 1, NEXT),
            (false, 120, 1, ""),
            (true, 160, 3, STEP),
            (false, 190, 3, ""),
        ];
        let (b, _, t) = run(torch(), &events);
        // Entered at the first step's end (no DataLoader seen yet), started at the batch.
        assert_eq!(spans(&b), vec![('[', 90), (']', 190)]);
        assert_eq!(starts(&b), vec![StepStart::Batch(120, ThreadCounters::launches(120))]);
        assert_eq!(t.unmatched_ends, 1);
    }

    #[test]
    fn without_a_dataloader_the_first_start_is_a_guess_and_says_so() {
        let events = [(true, 10, 2, ZERO), (false, 12, 2, ""), (true, 40, 3, STEP), (false, 50, 3, "")];
        let (b, _, _) = run(torch(), &events);
        assert_eq!(starts(&b), vec![StepStart::Guessed]);
    }

    #[test]
    fn a_lost_end_leaves_its_region_open_and_later_pairs_intact() {
        // Key 1's first end is lost; the address is reused by the next region.
        let events = [(true, 0, 1, "a"), (true, 10, 1, "b"), (false, 20, 1, ""), (false, 30, 9, "")];
        let (_, ended, mut t) = run(RegionSteps::default(), &events);
        assert_eq!(ended.len(), 1);
        assert_eq!((ended[0].name.as_str(), ended[0].end_ns), ("b", Some(20)));
        assert_eq!(t.unmatched_ends, 1, "the end with no begin is counted, not paired");
        let open = t.open_regions();
        assert_eq!(open.len(), 1);
        assert_eq!((open[0].name.as_str(), open[0].end_ns), ("a", None));
    }

    #[test]
    fn regions_nest_and_step_regions_make_steps_per_prefix() {
        let steps = RegionSteps { optimizer: None, prefixes: vec![(4, "ProfilerStep#".into()), (5, "fwd".into())] };
        let events = [
            (true, 0, 1, "ProfilerStep#0"),
            (true, 5, 2, "fwd"),
            (true, 6, 3, "inner"),
            (false, 7, 3, ""),
            (false, 9, 2, ""),
            (false, 10, 1, ""),
        ];
        let (b, ended, _) = run(steps, &events);
        let probes: Vec<(char, u32)> = b
            .iter()
            .map(|x| match x {
                Boundary::Enter { probe, .. } => ('[', *probe),
                Boundary::Exit { probe, .. } => (']', *probe),
            })
            .collect();
        assert_eq!(probes, vec![('[', 4), ('[', 5), (']', 5), (']', 4)]);
        assert_eq!(ended.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), vec!["inner", "fwd", "ProfilerStep#0"]);
    }

    #[test]
    fn an_optimizer_inside_an_optimizer_ends_one_step() {
        let events = [
            (true, 0, 1, NEXT),
            (false, 1, 1, ""),
            (true, 10, 2, "Optimizer.step#Wrapper.step"),
            (true, 11, 3, STEP),
            (false, 19, 3, ""),
            (false, 20, 2, ""),
        ];
        let (b, _, _) = run(torch(), &events);
        assert_eq!(spans(&b), vec![('[', 1), (']', 20)]);
    }

    #[test]
    fn too_many_open_regions_give_up_the_oldest() {
        let mut t = RegionTracker::new(RegionSteps::default());
        let mut out = Vec::new();
        for i in 0..MAX_OPEN_PER_THREAD as u64 {
            assert!(t.begin(&ev(1, i, i + 1, "x"), i, &mut out).is_none());
        }
        let dropped = t.begin(&ev(1, 999, 999, "y"), 999, &mut out).expect("the oldest goes");
        assert_eq!((dropped.start_ns, dropped.tag, dropped.end_ns), (0, 0, None));
        assert_eq!(t.thread_exited(1).len(), MAX_OPEN_PER_THREAD);
        assert!(t.thread_exited(1).is_empty());
    }

    #[test]
    fn step_region_specs_parse() {
        assert_eq!(
            RegionStepSpec::parse("ProfilerStep#"),
            Ok(RegionStepSpec { label: "train".into(), prefix: "ProfilerStep#".into() })
        );
        assert_eq!(
            RegionStepSpec::parse("eval=eval_step"),
            Ok(RegionStepSpec { label: "eval".into(), prefix: "eval_step".into() })
        );
        assert!(RegionStepSpec::parse("").is_err());
        assert!(RegionStepSpec::parse("x=").is_err());
    }
}
