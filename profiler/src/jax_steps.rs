//! JAX steps: pairs each thread's jitted-call returns with their begins and
//! turns the calls of the step functions into step boundaries for the step
//! tracker. No I/O: the consumer hands in calls with their names read.
//!
//! A jitted call returns once its work is dispatched, before the device has
//! run it, so a JAX step is defined by the call period: a step begins at the
//! start of an outermost call of a step function and ends where the next one
//! (of any step function) on the same thread begins. Consecutive steps share
//! their boundary (`inter_step_ns` 0); the last stays open (stored with no
//! end). The host's dispatch time, the begin call's own duration, is kept
//! apart (`steps.dispatch_ns`, from `jit_calls`).
//!
//! `--steps auto` with no step flags picks the step function itself, by the
//! rule in docs/steps.md: the first jitted function called outermost whose
//! name contains `train`; failing that, once [`AUTO_WINDOW`] outermost calls
//! have been seen (or at the session's end), the most-called one whose name
//! contains `step` (called at least three times), else the most-called one
//! called at a steady period. The
//! calls seen before a pick are replayed into steps once it is made.
use std::collections::HashMap;

use crate::events::ThreadCounters;

/// `--step-jit [LABEL=]NAME`: the jitted function whose Python name is NAME
/// makes steps with that label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JitStepSpec {
    pub label: String,
    pub name: String,
}

impl JitStepSpec {
    pub fn parse(s: &str) -> Result<Self, String> {
        let (label, name) = crate::step_label::split(s)
            .map_err(|e| format!("--step-jit '{s}': {e} (a jitted function's Python name, e.g. train_step)"))?;
        Ok(Self { label, name: name.to_owned() })
    }
}

impl std::fmt::Display for JitStepSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.label, self.name)
    }
}

/// Which jitted functions make steps: the step tracker's probe ids.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum JitSources {
    /// No JAX steps.
    #[default]
    None,
    /// (probe id, function name) of each `--step-jit`.
    Named(Vec<(u32, String)>),
    /// `--steps auto`: the function the rule picks, with this probe id.
    Auto(u32),
}

/// Outermost calls seen before `auto` picks by call counts.
pub const AUTO_WINDOW: usize = 20;

/// A step boundary for the step tracker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JitBoundary {
    /// `at`: the thread's counters at the call that makes the boundary.
    Enter {
        tid: u32,
        probe: u32,
        ts_ns: u64,
        at: ThreadCounters,
    },
    Exit {
        tid: u32,
        probe: u32,
        ts_ns: u64,
        at: ThreadCounters,
    },
}

/// Why `auto` took the function it took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PickReason {
    TrainName,
    StepName,
    SteadyPeriod,
}

impl PickReason {
    pub fn text(self) -> &'static str {
        match self {
            Self::TrainName => "its name contains 'train'",
            Self::StepName => "no name contains 'train'; it is the most-called one whose name contains 'step'",
            Self::SteadyPeriod => "no name contains 'train' or 'step'; it is the most-called one at a steady period",
        }
    }
}

/// One outermost call of a jitted function, as `auto` keeps it until it picks.
#[derive(Clone, Debug)]
struct SeenCall {
    tid: u32,
    name: Option<String>,
    ts_ns: u64,
    at: ThreadCounters,
}

/// A jitted call in progress on a thread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenCall<T> {
    pub function: u64,
    pub name: Option<String>,
    pub start_ns: u64,
    /// Jitted calls it is inside (a call made while tracing another).
    pub depth: u32,
    pub tag: T,
}

pub struct JitSteps<T> {
    sources: JitSources,
    stacks: HashMap<u32, Vec<OpenCall<T>>>,
    /// The step source whose step is open on each thread.
    open_step: HashMap<u32, u32>,
    /// `auto`'s pick, once made.
    pub picked: Option<(String, PickReason)>,
    seen: Vec<SeenCall>,
    /// Returns seen with no call open on their thread.
    pub unmatched_returns: u64,
}

impl<T: Clone> JitSteps<T> {
    pub fn new(sources: JitSources) -> Self {
        Self {
            sources,
            stacks: HashMap::new(),
            open_step: HashMap::new(),
            picked: None,
            seen: Vec::new(),
            unmatched_returns: 0,
        }
    }

    /// A call began. Boundaries it makes go to `out`.
    pub fn enter(
        &mut self,
        tid: u32,
        function: u64,
        call: (Option<String>, u64, ThreadCounters),
        tag: T,
        out: &mut Vec<JitBoundary>,
    ) {
        let (name, ts_ns, at) = call;
        let stack = self.stacks.entry(tid).or_default();
        let depth = stack.len() as u32;
        stack.push(OpenCall { function, name: name.clone(), start_ns: ts_ns, depth, tag });
        if depth == 0 {
            self.outermost(SeenCall { tid, name, ts_ns, at }, out);
        }
    }

    /// A call returned: the call it ends, if its begin was seen.
    pub fn exit(&mut self, tid: u32) -> Option<OpenCall<T>> {
        let call = self.stacks.get_mut(&tid).and_then(Vec::pop);
        if call.is_none() {
            self.unmatched_returns += 1;
        }
        call
    }

    /// Tags the thread's innermost open call (the one just begun).
    pub fn tag_innermost(&mut self, tid: u32, tag: T) {
        if let Some(c) = self.stacks.get_mut(&tid).and_then(|s| s.last_mut()) {
            c.tag = tag;
        }
    }

    /// The thread exited: its open calls, and its step is over (the tracker
    /// stores it with no end).
    pub fn thread_exited(&mut self, tid: u32) -> Vec<OpenCall<T>> {
        self.open_step.remove(&tid);
        self.stacks.remove(&tid).unwrap_or_default()
    }

    /// Every call still open, with its thread (the session is over).
    pub fn open_calls(&mut self) -> Vec<(u32, OpenCall<T>)> {
        self.stacks.drain().flat_map(|(tid, s)| s.into_iter().map(move |c| (tid, c))).collect()
    }

    /// The session is over: `auto` picks from what it saw, if it has not yet.
    pub fn finish(&mut self, out: &mut Vec<JitBoundary>) {
        if matches!(self.sources, JitSources::Auto(_)) && self.picked.is_none() {
            self.pick_by_counts(out);
        }
    }

    fn outermost(&mut self, call: SeenCall, out: &mut Vec<JitBoundary>) {
        match &self.sources {
            JitSources::None => {}
            JitSources::Named(names) => {
                let probe = names.iter().find(|(_, n)| call.name.as_deref() == Some(n.as_str())).map(|(p, _)| *p);
                if let Some(probe) = probe {
                    self.boundary(&call, probe, out);
                }
            }
            &JitSources::Auto(probe) => match &self.picked {
                Some((name, _)) => {
                    if call.name.as_deref() == Some(name.as_str()) {
                        self.boundary(&call, probe, out);
                    }
                }
                None => {
                    let train = call.name.as_deref().is_some_and(|n| n.to_lowercase().contains("train"));
                    self.seen.push(call);
                    if train {
                        let name = self.seen.last().and_then(|c| c.name.clone()).unwrap_or_default();
                        self.pick(name, PickReason::TrainName, out);
                    } else if self.seen.len() >= AUTO_WINDOW {
                        self.pick_by_counts(out);
                    }
                }
            },
        }
    }

    /// Ends the thread's open step and begins one of `probe` at the call.
    fn boundary(&mut self, c: &SeenCall, probe: u32, out: &mut Vec<JitBoundary>) {
        if let Some(open) = self.open_step.insert(c.tid, probe) {
            out.push(JitBoundary::Exit { tid: c.tid, probe: open, ts_ns: c.ts_ns, at: c.at });
        }
        out.push(JitBoundary::Enter { tid: c.tid, probe, ts_ns: c.ts_ns, at: c.at });
    }

    /// Picks `name` and replays the calls seen so far.
    fn pick(&mut self, name: String, why: PickReason, out: &mut Vec<JitBoundary>) {
        let JitSources::Auto(probe) = self.sources else { return };
        for c in std::mem::take(&mut self.seen) {
            if c.name.as_deref() == Some(name.as_str()) {
                self.boundary(&c, probe, out);
            }
        }
        self.picked = Some((name, why));
    }

    fn pick_by_counts(&mut self, out: &mut Vec<JitBoundary>) {
        if let Some((name, why)) = pick_by_counts(&self.seen) {
            self.pick(name, why, out);
        }
    }
}

/// The most-called name containing `step`, else the most-called one whose
/// calls come at a steady period (see [`steady`]).
fn pick_by_counts(seen: &[SeenCall]) -> Option<(String, PickReason)> {
    let mut counts: Vec<(String, Vec<u64>)> = Vec::new();
    for c in seen {
        let Some(n) = &c.name else { continue };
        match counts.iter_mut().find(|(m, _)| m == n) {
            Some((_, ts)) => ts.push(c.ts_ns),
            None => counts.push((n.clone(), vec![c.ts_ns])),
        }
    }
    // Most calls first; ties: the first seen.
    counts.sort_by_key(|(_, ts)| std::cmp::Reverse(ts.len()));
    if let Some((n, _)) = counts.iter().find(|(n, ts)| ts.len() >= 3 && n.to_lowercase().contains("step")) {
        return Some((n.clone(), PickReason::StepName));
    }
    counts.iter().find(|(_, ts)| steady(ts)).map(|(n, _)| (n.clone(), PickReason::SteadyPeriod))
}

/// Whether calls at `ts` (ns, in order) come at a steady period: at least
/// three calls, and four in five periods within half of the median period.
fn steady(ts: &[u64]) -> bool {
    if ts.len() < 3 {
        return false;
    }
    let mut periods: Vec<u64> = ts.windows(2).map(|w| w[1].saturating_sub(w[0])).collect();
    periods.sort_unstable();
    let median = periods[periods.len() / 2];
    let near = periods.iter().filter(|&&p| p.abs_diff(median) <= median / 2).count();
    median > 0 && near * 5 >= periods.len() * 4
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(steps: &mut JitSteps<()>, calls: &[(&str, u64)]) -> Vec<JitBoundary> {
        let mut out = Vec::new();
        for &(name, ts) in calls {
            steps.enter(1, 0x100, (Some(name.to_owned()), ts, ThreadCounters::launches(ts / 10)), (), &mut out);
            steps.exit(1);
        }
        out
    }

    fn enters(out: &[JitBoundary]) -> Vec<(u32, u64)> {
        out.iter()
            .filter_map(|b| match *b {
                JitBoundary::Enter { probe, ts_ns, .. } => Some((probe, ts_ns)),
                JitBoundary::Exit { .. } => None,
            })
            .collect()
    }

    #[test]
    fn a_step_runs_from_one_call_to_the_next_of_any_step_function() {
        let mut s = JitSteps::new(JitSources::Named(vec![(0, "train_step".into()), (1, "eval_step".into())]));
        let out = run(&mut s, &[("train_step", 100), ("other", 150), ("train_step", 200), ("eval_step", 300)]);
        assert_eq!(enters(&out), vec![(0, 100), (0, 200), (1, 300)]);
        let exits: Vec<(u32, u64)> = out
            .iter()
            .filter_map(|b| match *b {
                JitBoundary::Exit { probe, ts_ns, .. } => Some((probe, ts_ns)),
                JitBoundary::Enter { .. } => None,
            })
            .collect();
        assert_eq!(exits, vec![(0, 200), (0, 300)]);
    }

    #[test]
    fn calls_inside_a_call_make_no_step() {
        let mut s = JitSteps::new(JitSources::Named(vec![(0, "inner".into())]));
        let mut out = Vec::new();
        s.enter(1, 1, (Some("outer".into()), 10, ThreadCounters::default()), (), &mut out);
        s.enter(1, 2, (Some("inner".into()), 11, ThreadCounters::default()), (), &mut out);
        assert_eq!(s.exit(1).map(|c| c.depth), Some(1));
        assert_eq!(s.exit(1).map(|c| c.depth), Some(0));
        assert!(out.is_empty());
        assert_eq!(s.exit(1), None);
        assert_eq!(s.unmatched_returns, 1);
    }

    #[test]
    fn auto_takes_a_train_name_at_once_and_replays_what_came_before() {
        let mut s = JitSteps::new(JitSources::Auto(3));
        let out = run(&mut s, &[("init", 5), ("eval_step", 10), ("train_step", 20), ("train_step", 30)]);
        assert_eq!(enters(&out), vec![(3, 20), (3, 30)]);
        assert_eq!(s.picked, Some(("train_step".into(), PickReason::TrainName)));
    }

    #[test]
    fn auto_without_a_train_name_takes_a_step_name_then_a_steady_period() {
        let mut s = JitSteps::new(JitSources::Auto(0));
        let calls: Vec<(&str, u64)> =
            (0..AUTO_WINDOW as u64).map(|i| (if i % 4 == 0 { "my_step" } else { "f" }, i * 100)).collect();
        let out = run(&mut s, &calls);
        assert_eq!(s.picked.as_ref().map(|p| p.1), Some(PickReason::StepName));
        assert_eq!(enters(&out).len(), AUTO_WINDOW / 4);

        let mut s = JitSteps::new(JitSources::Auto(0));
        // `update` every 100 ns; `log` at irregular times, more often.
        let mut calls: Vec<(&str, u64)> = (0..8).map(|i| ("update", i * 100)).collect();
        calls.extend([("log", 1), ("log", 2), ("log", 3), ("log", 90), ("log", 91), ("log", 400)]);
        calls.extend([("log", 401), ("log", 402), ("log", 700)]);
        calls.sort_by_key(|c| c.1);
        let out = run(&mut s, &calls[..calls.len().min(AUTO_WINDOW)]);
        let mut end = Vec::new();
        s.finish(&mut end);
        assert_eq!(s.picked, Some(("update".into(), PickReason::SteadyPeriod)));
        assert_eq!(enters(&[out, end].concat()).len(), 8);
    }

    #[test]
    fn steady_needs_most_periods_near_the_median() {
        assert!(steady(&[0, 100, 200, 310, 400]));
        assert!(!steady(&[0, 100]));
        assert!(!steady(&[0, 1, 2, 300, 301, 900]));
    }

    #[test]
    fn the_flag_takes_the_label_prefix() {
        assert_eq!(
            JitStepSpec::parse("eval=eval_step"),
            Ok(JitStepSpec { label: "eval".into(), name: "eval_step".into() })
        );
        assert_eq!(JitStepSpec::parse("train_step").map(|s| s.label), Ok("train".into()));
        assert!(JitStepSpec::parse("").is_err());
    }
}
