//! One session's (one process's, one rank's) live series: steps by label, launches and losses.
use std::{collections::HashMap, sync::Arc, time::Instant};

use super::{
    Families, SeriesLabels,
    series::{Labels, LiveCounter, LiveGauge, LiveHistogram},
};
use crate::{
    correlate::mfu::Precision,
    probes::KernelCounters,
    store::StepRow,
    verdict::{Bound, Evidence, verdict},
};

/// The process's GPUs' summed dense peak, FLOP/s, at a precision; None when
/// a GPU or the precision is unknown (no GPU, a name the peak table lacks).
/// Asked at each step's end: a rank's GPUs are known once NVML lists it.
pub type PeakFlops = Box<dyn Fn(Precision) -> Option<f64> + Send>;

/// A step's GEMMs as the consumer counted them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlopsAt {
    pub flops: u64,
    /// The precision that did most of its FLOPs; the default one
    /// (`correlate::mfu::DEFAULT_PRECISION`) for a step without GEMMs; None:
    /// types no peak is known for.
    pub precision: Option<Precision>,
}

/// The rate gauge is recomputed once this much time has passed.
const RATE_WINDOW_S: f64 = 1.0;

/// A step's verdict from what is known when it ends: its columns but NCCL
/// time, which the store sums from the `collectives` rows at the session's end
/// (live, a communication-bound step counts under the next rule that holds).
fn live_verdict(r: &StepRow) -> Option<Bound> {
    let end = r.end_ns?;
    let sched = r.sched;
    verdict(&Evidence {
        duration_ns: end.saturating_sub(r.start_ns),
        inter_step_ns: r.inter_step_ns,
        data_wait_ns: r.phases.map(|p| p.data_wait_ns),
        collective_ns: None,
        sync_wait_ns: r.sync_wait_ns,
        copy_ns: Some(r.copies.ns),
        h2d_bytes: Some(r.copies.h2d_bytes),
        runnable_ns: sched.map(|s| s.runnable_ns),
        blocked_ns: sched.map(|s| s.blocked_ns),
        cpu_ns: sched.map(|s| s.cpu_ns),
    })
}

/// One step label's series.
struct StepSeries {
    steps: LiveCounter,
    duration: LiveHistogram,
    last: LiveGauge,
    rate: LiveGauge,
    sync_wait: LiveCounter,
    sync_share: LiveGauge,
    flops_rate: LiveGauge,
    /// Made with the first MFU known: absent, not 0, where it never is.
    mfu: Option<LiveGauge>,
    /// Steps by verdict, each made with its first step.
    bound: HashMap<Bound, LiveCounter>,
    /// Its series' labels (the MFU gauge's when it is made).
    labels: Labels,
    /// Steps ended since `since` (for the rate gauge).
    ended: u64,
    /// Ended a step here once: only then does this process set the rate (a
    /// process without a rank shares its series with others of the job, and
    /// one that ends no steps must not zero their rate).
    ever: bool,
}

impl StepSeries {
    fn new(f: &Families, labels: &SeriesLabels, label: &str) -> Self {
        let l = labels.with(Some(("label", label.to_owned())));
        Self {
            steps: f.steps.series(&l),
            duration: f.step_duration.series(&l),
            last: f.last_step.series(&l),
            rate: f.step_rate.series(&l),
            sync_wait: f.sync_wait.series(&l),
            sync_share: f.sync_share.series(&l),
            flops_rate: f.last_step_flops_rate.series(&l),
            mfu: None,
            bound: HashMap::new(),
            labels: l,
            ended: 0,
            ever: false,
        }
    }
}

/// `label`'s series in `steps`, made on its first use (no allocation once it exists).
fn step_series<'a>(
    steps: &'a mut HashMap<String, StepSeries>,
    families: &Families,
    labels: &SeriesLabels,
    label: &str,
) -> &'a mut StepSeries {
    if !steps.contains_key(label) {
        steps.insert(label.to_owned(), StepSeries::new(families, labels, label));
    }
    steps.get_mut(label).expect("inserted above")
}

/// A session's live series. Owned by its consumer; updated once per drained batch.
pub struct SessionMetrics {
    families: Arc<Families>,
    labels: SeriesLabels,
    steps: HashMap<String, StepSeries>,
    launches: LiveCounter,
    lost: LiveCounter,
    /// Created with the first GEMM: a process that issues none has no FLOPs series.
    gemm_flops: Option<LiveCounter>,
    /// The kernel counters' values already published.
    published: (u64, u64),
    since: Instant,
    /// For the MFU gauge; None: not exported.
    peak: Option<PeakFlops>,
}

impl SessionMetrics {
    pub(super) fn new(families: Arc<Families>, labels: &SeriesLabels, step_labels: &[&'static str]) -> Self {
        let process = labels.with(None);
        let mut me = Self {
            launches: families.launches.series(&process),
            lost: families.lost.series(&process),
            gemm_flops: None,
            steps: HashMap::new(),
            labels: labels.clone(),
            published: (0, 0),
            since: Instant::now(),
            peak: None,
            families,
        };
        // Every known label has its series from the start (0 steps is a value).
        for label in step_labels {
            me.step_series(label);
        }
        me
    }

    /// The process's GPUs' peak, for the MFU gauge.
    pub fn with_peak(mut self, peak: PeakFlops) -> Self {
        self.peak = Some(peak);
        self
    }

    fn step_series(&mut self, label: &str) -> &mut StepSeries {
        step_series(&mut self.steps, &self.families, &self.labels, label)
    }

    /// Counts one GEMM's FLOPs.
    pub fn gemm(&mut self, flops: u64) {
        let (families, labels) = (&self.families, &self.labels);
        self.gemm_flops.get_or_insert_with(|| families.gemm_flops.series(&labels.with(None))).add(flops as f64);
    }

    /// Publishes the steps of a batch that ended (rows with an end; those
    /// without are stored open and never counted), and the step rate.
    /// `gemms` gives a step's GEMMs (label, number), None where no BLAS call
    /// was seen in the process.
    pub fn steps_ended(&mut self, rows: &[StepRow], gemms: &dyn Fn(&str, u64) -> Option<FlopsAt>) {
        for r in rows {
            let Some(end_ns) = r.end_ns else { continue };
            let secs = end_ns.saturating_sub(r.start_ns) as f64 / 1e9;
            let step = gemms(&r.label, r.step).filter(|_| secs > 0.0);
            let mfu = step.and_then(|g| Some(g.flops as f64 / (self.peak.as_ref()?(g.precision?)? * secs)));
            let families = &self.families;
            let s = step_series(&mut self.steps, families, &self.labels, &r.label);
            if let Some(g) = step {
                s.flops_rate.set(g.flops as f64 / secs);
            }
            match mfu.filter(|m| m.is_finite()) {
                Some(mfu) => s.mfu.get_or_insert_with(|| families.last_step_mfu.series(&s.labels)).set(mfu),
                // Unknown for this step (no peak for its GPUs or precision): not the last one's figure.
                None if step.is_some() => s.mfu.iter().for_each(|g| g.set(f64::NAN)),
                None => {}
            }
            if let Some(b) = live_verdict(r) {
                let (family, labels) = (&families.steps_bound, &s.labels);
                s.bound
                    .entry(b)
                    .or_insert_with(|| {
                        let mut l = labels.clone();
                        l.push(("bound", b.as_str().to_owned()));
                        family.series(&l)
                    })
                    .add(1.0);
            }
            s.steps.add(1.0);
            s.ended += 1;
            s.ever = true;
            s.duration.observe(secs);
            s.last.set(secs);
            if let Some(wait) = r.sync_wait_ns {
                let wait = wait as f64 / 1e9;
                s.sync_wait.add(wait);
                s.sync_share.set(if secs > 0.0 { (wait / secs).min(1.0) } else { 0.0 });
            }
        }
        let elapsed = self.since.elapsed().as_secs_f64();
        if elapsed >= RATE_WINDOW_S {
            for s in self.steps.values_mut().filter(|s| s.ever) {
                s.rate.set(std::mem::take(&mut s.ended) as f64 / elapsed);
            }
            self.since = Instant::now();
        }
    }

    /// Publishes the kernel side's totals (launches seen, records lost).
    pub fn kernel_counters(&mut self, kc: &KernelCounters) {
        let (launches, lost) = self.published;
        self.launches.add(kc.launches.saturating_sub(launches) as f64);
        self.lost.add(kc.lost.saturating_sub(lost) as f64);
        self.published = (kc.launches.max(launches), kc.lost.max(lost));
    }
}
