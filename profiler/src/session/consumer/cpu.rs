//! CPU samples (`--cpu-sample`): each assigned to the step its thread is in
//! when it is taken (like a launch), and its stack named, in batches.
use std::time::{Duration, Instant};

use super::Consumer;
use crate::{
    events::CpuSampleEvent,
    session::{
        cpu_stacks::{CpuStacks, StackNamer},
        python_frames::PyCodeReader,
    },
    store::{CpuSampleRow, StoreMsg},
};

/// Samples held before their stacks are named and they are sent.
const BATCH: usize = 4096;

/// How often a drain names the samples held: each naming reads the
/// process's maps (1–2 ms for a PyTorch process), too much for every 20 ms
/// drain of every process of a job on the loop that also adopts new ranks.
const NAME_EVERY: Duration = Duration::from_millis(100);

#[derive(Default)]
pub(super) struct CpuSampleState {
    /// None: the sampler is off (no sample comes).
    stacks: Option<CpuStacks>,
    pending: Vec<(CpuSampleEvent, Option<(&'static str, u64)>)>,
    /// When the samples were last named (None: never).
    named_at: Option<Instant>,
}

impl Consumer {
    /// Samples come, their stacks in `map`.
    pub(in crate::session) fn sample_cpu(&mut self, namer: StackNamer) {
        self.cpu.stacks = Some(CpuStacks::new(namer, self.pid));
    }

    /// The process runs a CPython whose frames its samples carry from now on
    /// (again, after an exec: the code objects named before are forgotten).
    pub(in crate::session) fn read_python(&mut self, reader: PyCodeReader) {
        if let Some(stacks) = &mut self.cpu.stacks {
            stacks.read_python(reader);
        }
    }

    /// The process mapped or unmapped code: see [`CpuStacks::forget_user_addresses`].
    pub(in crate::session) fn code_changed(&mut self) {
        if let Some(stacks) = &mut self.cpu.stacks {
            stacks.forget_user_addresses();
        }
    }

    pub(super) fn cpu_sample(&mut self, c: CpuSampleEvent) {
        if self.cpu.stacks.is_none() {
            return;
        }
        let step = self.tracker.current_step(c.tid);
        self.cpu.pending.push((c, step));
        if self.cpu.pending.len() >= BATCH {
            self.flush_cpu_samples();
        }
    }

    /// Says, once at the end, when the process's stacks look cut short by code without frame pointers.
    pub(super) fn finish_cpu_samples(&mut self) {
        self.flush_cpu_samples();
        if let Some(share) = self.cpu.stacks.as_ref().and_then(CpuStacks::no_frame_pointers) {
            eprintln!(
                "profiler: PID {}: {:.0}% of the CPU samples' stacks end within two frames: its code likely has no \
                 frame pointers (build with -fno-omit-frame-pointer); their leaf functions (self shares) are exact, \
                 their callers (total shares) are not",
                self.pid,
                share * 100.0
            );
        }
    }

    /// [`Self::flush_cpu_samples`], at most every [`NAME_EVERY`].
    pub(super) fn flush_cpu_samples_due(&mut self) {
        if self.cpu.named_at.is_none_or(|at| at.elapsed() >= NAME_EVERY) {
            self.flush_cpu_samples();
        }
    }

    /// Names the pending samples' stacks and sends the new frames and
    /// stacks, then the samples that name them.
    pub(super) fn flush_cpu_samples(&mut self) {
        let Some(stacks) = &mut self.cpu.stacks else { return };
        if self.cpu.pending.is_empty() {
            return;
        }
        self.cpu.named_at = Some(Instant::now());
        let pending = std::mem::take(&mut self.cpu.pending);
        let events: Vec<&CpuSampleEvent> = pending.iter().map(|p| &p.0).collect();
        let ids = stacks.stack_ids(&events);
        let (frames, new_stacks) = stacks.take_new();
        if !frames.is_empty() || !new_stacks.is_empty() {
            self.writer.send(StoreMsg::CpuStacks(frames, new_stacks));
        }
        let rows = pending
            .into_iter()
            .zip(ids)
            .map(|((c, step), stack_id)| CpuSampleRow {
                tid: c.tid,
                time_ns: c.ts_ns,
                stack_id,
                in_kernel: c.in_kernel,
                step,
            })
            .collect();
        self.writer.send(StoreMsg::CpuSamples(rows));
    }
}
