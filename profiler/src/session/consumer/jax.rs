//! The consumer's side of JAX's jitted calls: each call's name is read from
//! the target (`probes::jax::SharedJitNames`, mostly by then read early), calls become `jit_calls` rows, and
//! (through `crate::jax_steps`) the step functions' calls become step
//! boundaries that go through the step tracker like a step function's entry
//! and return.
use super::Consumer;
use crate::{
    events::{JitEvent, OrderedEvent},
    jax_steps::{JitBoundary, JitSources, JitSteps, OpenCall},
    probes::jax::SharedJitNames,
    steps::DepthChange,
    store::{JitCallRow, StoreMsg},
};

/// The step a thread was in when a call began.
type StepTag = Option<(&'static str, u64)>;

/// Calls in flight, the names read, and rows not yet sent (a field of the consumer).
pub(in crate::session) struct JaxState {
    steps: JitSteps<StepTag>,
    /// The session's, read early by its `NameReader`.
    names: SharedJitNames,
    rows: Vec<JitCallRow>,
    quiet: bool,
    /// Whether `auto`'s pick was said.
    said: bool,
}

impl Default for JaxState {
    fn default() -> Self {
        Self::new(JitSources::None, SharedJitNames::default(), true)
    }
}

impl JaxState {
    pub(in crate::session) fn new(sources: JitSources, names: SharedJitNames, quiet: bool) -> Self {
        Self { steps: JitSteps::new(sources), names, rows: Vec::new(), quiet, said: false }
    }

    fn keep(&mut self, call: OpenCall<StepTag>, end_ns: Option<u64>, tid: u32) {
        self.rows.push(JitCallRow {
            tid,
            name: call.name,
            function: call.function,
            start_ns: call.start_ns,
            end_ns,
            depth: call.depth,
            step: call.tag,
        });
    }
}

impl Consumer {
    /// Which jitted functions make steps, and the session's names of them
    /// (`quiet`: say nothing of `auto`'s pick).
    pub(in crate::session) fn use_jit_steps(&mut self, sources: JitSources, names: SharedJitNames, quiet: bool) {
        self.jax = JaxState::new(sources, names, quiet);
    }

    /// A jitted call began (`begin`) or returned.
    pub(super) fn jit_event(&mut self, event: JitEvent, begin: bool) {
        self.sequence(&event.as_ordered_event(), DepthChange::None);
        if !begin {
            if let Some(call) = self.jax.steps.exit(event.tid) {
                self.jax.keep(call, Some(event.ts_ns), event.tid);
            }
            return;
        }
        let name = self.jax.names.name(self.pid, event.function);
        let mut boundaries = Vec::new();
        let call = (name, event.ts_ns, event.counters);
        self.jax.steps.enter(event.tid, event.function, call, None, &mut boundaries);
        self.jit_boundaries(boundaries);
        // Tagged after its boundaries: the call that begins a step is in it.
        let tag = self.tracker.current_step(event.tid);
        self.jax.steps.tag_innermost(event.tid, tag);
        self.say_jit_pick();
    }

    fn jit_boundaries(&mut self, boundaries: Vec<JitBoundary>) {
        for b in boundaries {
            match b {
                JitBoundary::Enter { tid, probe, ts_ns, at } => {
                    self.tracker.enter(tid, probe, ts_ns, at);
                }
                JitBoundary::Exit { tid, probe, ts_ns, at } => {
                    let e = OrderedEvent { ts_ns, tid, tgid: 0, probe, counters: at, seq: 0, depth: 0 };
                    self.step_exit(&e);
                }
            }
        }
    }

    /// Says, once, which function `--steps auto` took and how to name another.
    fn say_jit_pick(&mut self) {
        if let (false, Some((name, why))) = (self.jax.said, &self.jax.steps.picked) {
            self.jax.said = true;
            say!(
                self.jax.quiet,
                "steps from the jitted function {name} (label train): {}; name another with \
                 --step-jit [LABEL=]NAME, or --steps none",
                why.text()
            );
        }
    }

    /// A thread exited: its open calls are stored with no end.
    pub(super) fn jit_thread_exited(&mut self, tid: u32) {
        for call in self.jax.steps.thread_exited(tid) {
            self.jax.keep(call, None, tid);
        }
    }

    /// The session is over: `auto` picks if it has not, and calls still
    /// open are stored with no end. Before the tracker's open steps are.
    pub(super) fn finish_jit(&mut self) {
        let mut boundaries = Vec::new();
        self.jax.steps.finish(&mut boundaries);
        self.jit_boundaries(boundaries);
        self.say_jit_pick();
        for (tid, call) in self.jax.steps.open_calls() {
            self.jax.keep(call, None, tid);
        }
        if self.jax.steps.unmatched_returns > 0 {
            log::info!("{} jitted-call returns had no begin seen", self.jax.steps.unmatched_returns);
        }
    }

    /// Sends the `jit_calls` rows.
    pub(super) fn flush_jit_calls(&mut self) {
        if !self.jax.rows.is_empty() {
            self.writer.send(StoreMsg::JitCalls(std::mem::take(&mut self.jax.rows)));
        }
    }
}
