//! The consumer: drains the ring buffers, decodes the records, tracks steps, attributes launches and
//! sync waits to the step their thread is in, and hands the rows to the store's writer in batches.
mod blas;
mod collectives;
mod copies;
mod cpu;
mod jax;
mod regions;

use std::collections::HashMap;

use profiler_common::SyncApi;

use super::kernels::KernelNames;
use crate::{
    events::{self, Event, OrderedEvent},
    regions::RegionSteps,
    steps::{DepthChange, OpenStep, StepTracker},
    store::{LaunchRow, ProbedFileRow, RowSender, StepRow, StoreMsg, SyncRow},
};

/// A synchronisation call in progress: (SyncApi id, start ns, the step its thread was in).
type OpenSync = (u32, u64, Option<(&'static str, u64)>);

const BATCH: usize = 16 * 1024;

/// Turns records into rows, in batches.
pub(super) struct Consumer {
    /// To this process's session.
    writer: RowSender,
    tracker: StepTracker,
    launches: Vec<LaunchRow>,
    steps: Vec<StepRow>,
    syncs: Vec<SyncRow>,
    /// Target process, for symbolising runtime host stubs.
    pid: u32,
    pub kernels: KernelNames,
    /// Synchronisation calls in progress per thread.
    open_syncs: HashMap<u32, Vec<OpenSync>>,
    decode_errors: u64,
    pub completed_steps: u64,
    /// Steps stored with no end (`store_open_step`).
    open_steps: u64,
    step_ns_total: u128,
    pub last_step_ns: Option<u64>,
    /// Records stamped after this are dropped (see `teardown`).
    pub cutoff_ns: Option<u64>,
    /// The dynamic loader changed the target's libraries since the last look.
    pub loader_changed: bool,
    /// (label, step) of the steps stored as incomplete (`steps.incomplete`).
    incomplete_steps: Vec<(&'static str, u64)>,
    /// PyTorch `record_function` regions in flight and rows not yet sent.
    regions: regions::RegionState,
    /// `--prometheus`/`--otlp`: this session's live series, updated per batch.
    pub live: Option<crate::metrics::SessionMetrics>,
    /// NCCL calls not yet sent.
    collectives: Vec<crate::store::CollectiveRow>,
    /// cuBLAS/cuBLASLt descriptors, GEMM rows not yet sent and per-step sums.
    gemms: blas::GemmState,
    /// Copy rows not yet sent.
    copies: copies::CopyState,
    /// JAX's jitted calls in flight and rows not yet sent.
    jax: jax::JaxState,
    /// Off-CPU rows not yet sent (the kernel writes their records only with per-call rows).
    off_cpu: Vec<crate::store::OffCpuRow>,
    /// CPU samples waiting for their stacks' names.
    cpu: cpu::CpuSampleState,
}

/// What the consumer counted, for the summary line, once it is closed.
pub(super) struct ConsumerTotals {
    pub completed_steps: u64,
    /// Steps stored with no end (still open when the session ended).
    pub open_steps: u64,
    pub step_ns_total: u128,
    pub decode_errors: u64,
    pub unmatched_returns: u64,
}

impl Consumer {
    /// `labels`: every step source's label, by probe id; `sources`: the ones regions make.
    pub fn new(writer: RowSender, labels: Vec<&'static str>, sources: RegionSteps, pid: u32) -> Self {
        Self {
            writer,
            tracker: StepTracker::new(labels),
            launches: Vec::with_capacity(BATCH),
            steps: Vec::new(),
            syncs: Vec::new(),
            open_syncs: Default::default(),
            pid,
            kernels: KernelNames::default(),
            decode_errors: 0,
            completed_steps: 0,
            open_steps: 0,
            step_ns_total: 0,
            last_step_ns: None,
            cutoff_ns: None,
            loader_changed: false,
            incomplete_steps: Vec::new(),
            regions: regions::RegionState::new(sources),
            live: None,
            collectives: Vec::new(),
            gemms: blas::GemmState::default(),
            copies: copies::CopyState::default(),
            jax: jax::JaxState::default(),
            off_cpu: Vec::new(),
            cpu: cpu::CpuSampleState::default(),
        }
    }

    /// One decoded record of this process (see `drain::RingDrain`).
    pub fn take(&mut self, event: Result<Event, events::DecodeError>) {
        if let (Some(cutoff), Ok(e)) = (self.cutoff_ns, &event)
            && e.ts_ns() > cutoff
        {
            return;
        }
        match event {
            Ok(Event::Launch(l)) => self.launch(l),
            Ok(Event::LoaderChange { .. }) => {
                self.loader_changed = true;
                self.code_changed();
            }
            // Handled by the job (see `job::Job`), which never passes them on.
            Ok(Event::Process(_)) => {}
            Ok(Event::StepEnter(e)) => {
                self.sequence(&e, DepthChange::Enter);
                self.tracker.enter(e.tid, e.probe, e.ts_ns, e.counters);
            }
            Ok(Event::StepExit(e)) => {
                self.step_exit(&e);
            }
            Ok(Event::KernelName(k)) => self.kernels.named(k),
            Ok(Event::RegionEnter(r)) => self.region_event(r, true),
            Ok(Event::RegionExit(r)) => self.region_event(r, false),
            Ok(Event::Collective(c)) => self.collective(&c),
            Ok(Event::Blas(b)) => self.blas(&b),
            Ok(Event::Copy(c)) => self.copy(&c),
            Ok(Event::OffCpu(o)) => self.off_cpu.push(crate::store::OffCpuRow {
                tid: o.tid,
                state: o.state.as_str(),
                left_ns: o.left_ns,
                woken_ns: o.woken_ns,
                resumed_ns: o.resumed_ns,
            }),
            Ok(Event::CpuSample(c)) => self.cpu_sample(c),
            Ok(Event::JitEnter(j)) => self.jit_event(j, true),
            Ok(Event::JitExit(j)) => self.jit_event(j, false),
            Ok(Event::SyncEnter(e)) => {
                self.sequence(&e, DepthChange::None);
                let step = self.tracker.current_step(e.tid);
                self.open_syncs.entry(e.tid).or_default().push((e.probe, e.ts_ns, step));
            }
            Ok(Event::SyncExit(e)) => self.sync_exit(&e),
            Ok(Event::ThreadExit(e)) => {
                self.sequence(&e, DepthChange::None);
                self.open_syncs.remove(&e.tid);
                self.jit_thread_exited(e.tid);
                // Steps first: whether one is a step reads the thread's regions.
                for s in self.tracker.thread_exited(e.tid) {
                    self.store_open_step(s);
                }
                self.regions_thread_exited(e.tid);
            }
            Err(e) => {
                if self.decode_errors == 0 {
                    log::error!("undecodable record: {e}");
                }
                self.decode_errors += 1;
            }
        }
    }

    /// A launch, attributed to the step its thread is in.
    fn launch(&mut self, l: events::LaunchEvent) {
        if l.api.layer() == profiler_common::ApiLayer::Runtime {
            // Named at the end, off the event path (see `KernelNames::name_runtime_stubs`).
            self.kernels.runtime_launch(l.function);
        }
        // Launch records exist only in `--launches all`: in `count`
        // mode the kernel side never writes them.
        self.launches.push(LaunchRow {
            ts_ns: l.ts_ns,
            tid: l.tid,
            api: l.api,
            function: l.function,
            grid: l.grid,
            block: l.block,
            shared_mem_bytes: l.shared_mem_bytes,
            stream: l.stream,
            step: self.tracker.current_step(l.tid),
        });
        if self.launches.len() >= BATCH {
            self.flush_launches();
        }
    }

    /// Closes the thread's step, if one was open: returns its label and
    /// whether it is already stored as incomplete (the step is `self.steps`'s last).
    fn step_exit(&mut self, e: &OrderedEvent) -> Option<(&'static str, bool)> {
        self.sequence(e, DepthChange::Exit);
        let s = self.tracker.exit(e.tid, e.probe, e.ts_ns, e.counters)?;
        if s.incomplete {
            self.incomplete_steps.push((s.label, s.step));
        }
        self.completed_steps += 1;
        self.step_ns_total += u128::from(s.end_ns - s.start_ns);
        self.last_step_ns = Some(s.end_ns - s.start_ns);
        self.steps.push(StepRow {
            sync_wait_ns: Some(s.sync_wait_ns),
            label: s.label.to_owned(),
            step: s.step,
            tid: s.tid,
            start_ns: s.start_ns,
            end_ns: Some(s.end_ns),
            inter_step_ns: s.inter_step_ns,
            launches: Some(s.launches),
            phases: None,
            sched: s.sched,
            copies: s.copies,
        });
        self.gemm_step_ended(s.label, s.step);
        Some((s.label, s.incomplete))
    }

    /// The end of a synchronisation call: its wait counts toward the step
    /// its thread was in when it began.
    fn sync_exit(&mut self, e: &OrderedEvent) {
        self.sequence(e, DepthChange::None);
        let open = self.open_syncs.get_mut(&e.tid).and_then(Vec::pop);
        if let Some((probe, start_ns, step)) = open
            && let Some(api) = SyncApi::from_u32(probe)
        {
            let ns = e.ts_ns.saturating_sub(start_ns);
            self.tracker.add_sync_wait(e.tid, ns);
            self.syncs.push(SyncRow { tid: e.tid, api: api.symbol(), start_ns, end_ns: e.ts_ns, step });
        }
    }

    /// Checks a step-ring event's place in its thread's sequence; after a gap,
    /// stores the steps that ended unseen and forgets the thread's open syncs.
    fn sequence(&mut self, e: &OrderedEvent, change: DepthChange) {
        let mut ended = Vec::new();
        if self.tracker.sequence(e.tid, e.probe, e.seq, e.depth, change, &mut ended) {
            self.open_syncs.remove(&e.tid);
        }
        for s in ended {
            self.store_open_step(s);
        }
    }

    /// A step with no end: begun and not ended, or ended unseen.
    fn store_open_step(&mut self, s: OpenStep) {
        if self.batch_only_step(&s) {
            return;
        }
        if s.incomplete {
            self.incomplete_steps.push((s.label, s.step));
        }
        self.open_steps += 1;
        self.steps.push(StepRow {
            sync_wait_ns: None,
            label: s.label.to_owned(),
            step: s.step,
            tid: s.tid,
            start_ns: s.start_ns,
            end_ns: None,
            inter_step_ns: s.inter_step_ns,
            launches: None,
            phases: None,
            sched: None,
            copies: Default::default(),
        });
    }

    /// A CUDA driver's launch probes went in at `at_ns`: the steps open then
    /// missed its launches until then, and are stored `incomplete`.
    pub fn driver_probed(&mut self, at_ns: u64) {
        self.tracker.driver_probed_ns = self.tracker.driver_probed_ns.max(at_ns);
    }

    /// Hands `libraries` rows to the store.
    pub fn store_libraries(&self, rows: Vec<ProbedFileRow>) {
        for r in rows {
            self.writer.send(StoreMsg::ProbedFile(r));
        }
    }

    fn flush_launches(&mut self) {
        if !self.launches.is_empty() {
            let batch = std::mem::replace(&mut self.launches, Vec::with_capacity(BATCH));
            self.writer.send(StoreMsg::Launches(batch));
        }
    }

    /// Hands every pending row to the store (CPU samples at most every
    /// 100 ms: naming their stacks costs; the session's end hands the rest).
    pub fn flush(&mut self) {
        if let Some(live) = &mut self.live {
            live.steps_ended(&self.steps, &|label, step| self.gemms.step_flops(label, step));
        }
        self.flush_launches();
        if !self.steps.is_empty() {
            self.writer.send(StoreMsg::Steps(std::mem::take(&mut self.steps)));
        }
        if !self.syncs.is_empty() {
            self.writer.send(StoreMsg::Syncs(std::mem::take(&mut self.syncs)));
        }
        let kernels = self.kernels.take_rows();
        if !kernels.is_empty() {
            self.writer.send(StoreMsg::Kernels(kernels));
        }
        self.flush_regions();
        self.flush_jit_calls();
        self.flush_collectives();
        self.flush_gemms();
        self.flush_copies();
        if !self.off_cpu.is_empty() {
            self.writer.send(StoreMsg::OffCpu(std::mem::take(&mut self.off_cpu)));
        }
        self.flush_cpu_samples_due();
    }

    /// (steps stored as incomplete so far, step ends seen without a start),
    /// for the loss warnings.
    pub fn loss_counts(&self) -> (u64, u64) {
        (self.incomplete_steps.len() as u64, self.tracker.steps_without_start)
    }

    /// (label, step) of every incomplete step: those stored so far and those
    /// still open, for the session's loss rows.
    pub fn take_incomplete_steps(&mut self) -> Vec<(&'static str, u64)> {
        let open = self.tracker.open_steps().into_iter().filter(|s| s.incomplete).map(|s| (s.label, s.step));
        let mut incomplete = std::mem::take(&mut self.incomplete_steps);
        incomplete.extend(open);
        incomplete
    }

    /// Names the runtime launches' kernels, stores the steps still open (end
    /// NULL), flushes, and returns its totals, to finish the session.
    pub fn close(mut self) -> ConsumerTotals {
        self.kernels.name_runtime_stubs(self.pid);
        self.finish_jit();
        for s in self.tracker.open_steps() {
            self.store_open_step(s);
        }
        self.finish_regions();
        self.flush();
        self.finish_cpu_samples();
        // After the last step row: the sums update them.
        self.finish_gemms();
        ConsumerTotals {
            completed_steps: self.completed_steps,
            open_steps: self.open_steps,
            step_ns_total: self.step_ns_total,
            decode_errors: self.decode_errors,
            unmatched_returns: self.tracker.unmatched_returns,
        }
    }
}
