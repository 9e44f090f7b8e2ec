//! Building a session's [`Report`]: per step label, the step, inter-step and
//! phase times, launches, sync wait, energy per step, FLOPs and MFU; the
//! session's top kernels and PyTorch regions.
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use anyhow::bail;
use serde::Serialize;

use crate::profile::{
    ProfileDb,
    kernels::{TopKernel, top_kernels},
    sessions::{self, CapabilityRow, SessionInfo},
    steps::{StepRow, epoch_first_steps, load_steps},
};
use crate::verdict::{Bound, summarize};

/// Version of the JSON shape below; bumped only when a field changes meaning
/// or goes away (new fields may be added without a bump).
pub(super) const REPORT_VERSION: u32 = 1;
/// Kernels listed under "top kernels".
const TOP_KERNELS: usize = 10;
/// `record_function` names in the report's top regions.
const TOP_REGIONS: usize = 10;

/// The report. `--format json` prints exactly this, pretty-printed; the shape
/// is stable (`report_version` changes if a field changes meaning or is
/// removed). Times are ms, energies J, powers W; a figure the profile does not
/// have is `null`.
///
/// ```text
/// {
///   "report_version": 1,
///   "database": "profile.db",
///   "skip": 5,                        // --skip: leading steps left out per label
///   "label_filter": null,             // --label, if given
///   "session": {
///     "id": 1, "pid": 4242, "command": "python train.py", "exe": "/usr/bin/python3.11",
///     "mode": "attach", "launch_mode": "all", "step_symbol": "train_step",
///     "started_utc": "2025-06-01 12:00:03", "started_unix_s": 1748779203.5,
///     "duration_s": 61.2,             // null while running or if the profiler was killed
///     "state": "ended",               // "ended"; "running": not ended, its profiler is alive;
///                                     // "unclean": not ended and nobody writing it (the profiler was
///                                     // killed or crashed: what it committed is there, nothing after)
///     "end_reason": "sigint", "lost_events": 0, "total_launches": 10000,
///     "stored_launches": 10000, "unmatched_returns": 0,
///     "hostname": "gpu1", "kernel_release": "6.8.0", "profiler_version": "0.1.0"
///   },
///   "capabilities": [ { "source": "nvml", "metric": "GPU_0/fan.speed", "available": false, "reason": "…" } ],
///   "labels": [ {
///     "label": "train",
///     "steps": 100,                   // all steps with this label
///     "completed": 99,                // steps that ended
///     "skipped": 5,                   // the first --skip steps, by start time
///     "measured": 94,                 // completed steps after the skipped ones: the figures below
///     "steps_per_s": 9.8,             // measured / (last end − first start)
///     "step_time_ms":  { "p50": …, "p90": …, "p99": …, "max": …, "mean": … },   // null if none measured
///     "inter_step_ms": { … },         // null if no measured step has a gap (first step of each thread)
///     "launches_per_step": { … },
///     "sync_wait_share": 0.12,        // Σ sync wait / Σ step time; null if not recorded
///     "data_wait_ms": { … },          // PyTorch steps: time in the DataLoader's __next__; null otherwise
///     "optimizer_ms": { … },          // PyTorch steps: time in Optimizer.step; null otherwise
///     "dispatch_ms": { … },           // JAX steps: the host's dispatch of the step's jitted call; null otherwise
///     "epochs": { "boundaries": 4, "first_batch_wait_ms": { … }, "other_wait_ms": { … } },
///                                     // PyTorch steps that are an epoch's first (docs/steps.md): their data
///                                     // wait apart, when its p50 is at least twice the other steps'; null
///                                     // otherwise (other_wait_ms: null when every step is one)
///     "gpus": [ { "gpu": 0, "name": "H200", "steps": 94, "energy_per_step_j": 61.5,
///                 "energy_error_per_step_j": 0.4, "avg_power_w": 615.0, "below_resolution": 0 } ],
///                                     // null if the session has no GPU figures
///     "cpu":  { "steps": 94, "energy_per_step_j": 8.1, "energy_error_per_step_j": 0.1,
///               "avg_power_w": 81.0, "below_resolution": 0 },   // RAPL package; null if not recorded
///     "dram": { … },                  // RAPL DRAM; null if not recorded
///     "energy_per_step_j": 69.6,      // sum of the per-step energies above that exist; null if none
///     "energy_components": ["GPU 0", "CPU"],  // which ones that sum includes
///     "tflops_per_s": { … },          // GEMM FLOPs (steps.flops) / step time, TFLOP/s; null without BLAS figures
///     "mfu_pct": { … },               // per step, mean step_gpu.mfu_pct over its GPUs; null if none
///     "mfu_gpm_pct": { … }            // the same for step_gpu.mfu_gpm_pct (an NVML GPM estimate)
///   } ],
///   "top_kernels": [ { "function": 1048576, "name": null, "demangled_name": null,
///                      "api": "cuLaunchKernel", "launches": 500, "share": 0.05 } ]
///                                     // whole session; null when launch rows were not kept (--launches count)
///   "top_regions": [ { "name": "Optimizer.step#AdamW.step", "count": 500, "total_ms": 310.2,
///                      "mean_ms": 0.62, "max_ms": 1.9, "open": 0 } ]
///                                     // PyTorch record_function regions by total time (ended ones;
///                                     // `open`: begun, end not seen); empty when none was recorded
///   "cpu": { "sample_hz": 99, "samples_taken": 2000, "lost_samples": 0, "stack_failures": 0,
///            "labels": [ { "label": "train", "samples": 1990,
///                          "by_self": [ { "function": "heavy_work", "module": "trainer", "kind": "native",
///                                         "self_share": 0.7, "total_share": 0.7, "self_samples": 1393,
///                                         "total_samples": 1393 } ],
///                          "by_total": [ … ] } ] }
///                                     // CPU samples in each label's measured steps (--cpu-sample); null for
///                                     // a profile from before the sampler; sample_hz null: it was off
/// }
/// ```
///
/// Percentiles are nearest-rank: the smallest value with at least p% of the
/// measured steps at or below it.
#[derive(Debug, Serialize)]
pub struct Report {
    pub report_version: u32,
    pub database: String,
    pub skip: u64,
    pub label_filter: Option<String>,
    pub session: SessionInfo,
    pub capabilities: Vec<CapabilityRow>,
    pub labels: Vec<LabelReport>,
    pub top_kernels: Option<Vec<TopKernel>>,
    pub top_regions: Vec<RegionStat>,
    /// CPU samples' top functions per label (`--cpu-sample`); null for a
    /// profile without the sampler's columns.
    pub cpu: Option<super::cpu::CpuReport>,
}

/// One PyTorch `record_function` name's regions over the whole session.
#[derive(Debug, Serialize)]
pub struct RegionStat {
    pub name: String,
    /// Regions of this name that ended.
    pub count: i64,
    pub total_ms: f64,
    pub mean_ms: f64,
    pub max_ms: f64,
    /// Regions begun whose end was not seen (not in the times).
    pub open: i64,
}

#[derive(Debug, Serialize)]
pub struct LabelReport {
    pub label: String,
    pub steps: u64,
    pub completed: u64,
    pub skipped: u64,
    pub measured: u64,
    pub steps_per_s: Option<f64>,
    pub step_time_ms: Option<Percentiles>,
    pub inter_step_ms: Option<Percentiles>,
    pub launches_per_step: Option<Percentiles>,
    pub sync_wait_share: Option<f64>,
    pub data_wait_ms: Option<Percentiles>,
    pub optimizer_ms: Option<Percentiles>,
    pub dispatch_ms: Option<Percentiles>,
    pub epochs: Option<EpochWaits>,
    pub gpus: Option<Vec<GpuEnergy>>,
    pub cpu: Option<EnergyStat>,
    pub dram: Option<EnergyStat>,
    pub energy_per_step_j: Option<f64>,
    pub energy_components: Vec<String>,
    /// GEMM TFLOP/s per step (`steps.flops` / step time); None without BLAS figures.
    pub tflops_per_s: Option<Percentiles>,
    /// Per step, the mean `step_gpu.mfu_pct` over its GPUs.
    pub mfu_pct: Option<Percentiles>,
    /// Per step, the mean `step_gpu.mfu_gpm_pct` over its GPUs (an estimate from NVML GPM).
    pub mfu_gpm_pct: Option<Percentiles>,
    /// What bound the measured steps (`steps.bound`); None when none has a verdict.
    pub bound: Option<BoundReport>,
}

/// A label's verdicts: each one's share, and the long runs of steps bound otherwise.
#[derive(Debug, Serialize)]
pub struct BoundReport {
    /// Most common first.
    pub verdicts: Vec<BoundShare>,
    pub runs: Vec<BoundRun>,
}

#[derive(Debug, Serialize)]
pub struct BoundShare {
    pub verdict: &'static str,
    pub steps: u64,
    /// Of the steps with a verdict.
    pub pct: f64,
    /// The p50, over these steps, of the column the verdict rests on.
    pub evidence: Option<BoundEvidence>,
}

/// Consecutive steps (by number) with the same verdict, other than the label's most common.
#[derive(Debug, Serialize)]
pub struct BoundRun {
    pub first_step: i64,
    pub last_step: i64,
    pub verdict: &'static str,
    pub evidence: Option<BoundEvidence>,
}

#[derive(Debug, Serialize)]
pub struct BoundEvidence {
    /// What was measured: `data wait`, `sync wait`, `on CPU`, …
    pub name: &'static str,
    pub p50_ms: f64,
}

/// The column a verdict rests on, and what the report calls it.
fn evidence_of(bound: Bound, s: &StepRow) -> (&'static str, Option<i64>) {
    match bound {
        Bound::Data => ("data wait", s.data_wait_ns),
        Bound::Communication => ("NCCL", s.collective_ns),
        Bound::Gpu => ("sync wait", s.sync_wait_ns),
        Bound::InputCopy => ("copies", s.copy_ns),
        Bound::CpuStarved => ("runnable", s.runnable_ns),
        Bound::Blocked => ("blocked", s.blocked_ns),
        Bound::HostCpu | Bound::Mixed => ("on CPU", s.cpu_ns),
    }
}

/// The p50 of the verdict's evidence over `steps`.
fn evidence(bound: Bound, steps: &[&StepRow]) -> Option<BoundEvidence> {
    let mut name = "";
    let values = steps
        .iter()
        .filter_map(|s| {
            let (n, v) = evidence_of(bound, s);
            name = n;
            v.map(|v| v as f64 / 1e6)
        })
        .collect();
    Percentiles::of(values).map(|p| BoundEvidence { name, p50_ms: p.p50 })
}

fn bound_report(used: &[&StepRow]) -> Option<BoundReport> {
    let judged: Vec<(&StepRow, Option<Bound>)> =
        used.iter().map(|s| (*s, s.bound.as_deref().and_then(Bound::parse))).collect();
    let summary = summarize(&judged.iter().map(|(s, b)| (s.step, *b)).collect::<Vec<_>>())?;
    let with = |b: Bound| judged.iter().filter(|(_, v)| *v == Some(b)).map(|(s, _)| *s).collect::<Vec<_>>();
    let verdicts = summary
        .counts
        .iter()
        .map(|&(b, n)| BoundShare {
            verdict: b.as_str(),
            steps: n,
            pct: 100.0 * n as f64 / summary.judged as f64,
            evidence: evidence(b, &with(b)),
        })
        .collect();
    let runs = summary
        .runs
        .iter()
        .map(|r| {
            let inside: Vec<&StepRow> =
                with(r.bound).into_iter().filter(|s| (r.first..=r.last).contains(&s.step)).collect();
            BoundRun {
                first_step: r.first,
                last_step: r.last,
                verdict: r.bound.as_str(),
                evidence: evidence(r.bound, &inside),
            }
        })
        .collect();
    Some(BoundReport { verdicts, runs })
}

/// The data wait of the measured steps that are an epoch's first, apart from
/// the others' (see [`epoch_waits`]).
#[derive(Debug, Serialize)]
pub struct EpochWaits {
    pub boundaries: u64,
    pub first_batch_wait_ms: Percentiles,
    pub other_wait_ms: Option<Percentiles>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `values` (any order); None when empty.
    pub fn of(mut values: Vec<f64>) -> Option<Self> {
        if values.is_empty() {
            return None;
        }
        values.sort_by(f64::total_cmp);
        let n = values.len();
        // Rank ⌈p·n/100⌉, 1-based: integer arithmetic, so p99 of 100 values is the 99th.
        let at = |p: usize| values[((p * n).div_ceil(100)).clamp(1, n) - 1];
        Some(Self {
            p50: at(50),
            p90: at(90),
            p99: at(99),
            max: values[n - 1],
            mean: values.iter().sum::<f64>() / n as f64,
        })
    }
}

#[derive(Debug, Serialize)]
pub struct GpuEnergy {
    pub gpu: i64,
    pub name: Option<String>,
    #[serde(flatten)]
    pub energy: EnergyStat,
}

/// Energy of the measured steps that have a figure (`steps` of them).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct EnergyStat {
    pub steps: u64,
    pub energy_per_step_j: Option<f64>,
    pub energy_error_per_step_j: Option<f64>,
    /// Σ energy / Σ duration of those steps.
    pub avg_power_w: Option<f64>,
    pub below_resolution: Option<u64>,
}

/// Sums for one energy series over the measured steps.
#[derive(Default)]
struct EnergySum {
    steps: u64,
    energy: f64,
    error: Option<f64>,
    duration_ns: i64,
    below: Option<u64>,
}

impl EnergySum {
    fn add(&mut self, energy: f64, error: Option<f64>, duration_ns: i64, below: Option<i64>) {
        self.steps += 1;
        self.energy += energy;
        if let Some(e) = error {
            *self.error.get_or_insert(0.0) += e;
        }
        self.duration_ns += duration_ns;
        if let Some(b) = below {
            *self.below.get_or_insert(0) += u64::from(b != 0);
        }
    }

    fn stat(&self) -> Option<EnergyStat> {
        (self.steps > 0).then(|| EnergyStat {
            steps: self.steps,
            energy_per_step_j: Some(self.energy / self.steps as f64),
            energy_error_per_step_j: self.error.map(|e| e / self.steps as f64),
            avg_power_w: (self.duration_ns > 0).then(|| self.energy / (self.duration_ns as f64 / 1e9)),
            below_resolution: self.below,
        })
    }
}

/// Measured steps of each label: (label, step) → duration.
type Measured = HashMap<(String, i64), i64>;

/// Computes the report for `session`.
pub fn build(db: &ProfileDb, session: i64, label: Option<&str>, skip: u64) -> anyhow::Result<Report> {
    let info = sessions::info(db, session)?;
    let capabilities = sessions::capabilities(db, session)?;

    let steps = load_steps(db, session)?;
    let mut by_label: BTreeMap<String, Vec<StepRow>> = BTreeMap::new();
    for s in steps {
        by_label.entry(s.label.clone()).or_default().push(s);
    }
    let all_labels: Vec<String> = by_label.keys().cloned().collect();
    if let Some(l) = label {
        if !by_label.contains_key(l) {
            let have = if all_labels.is_empty() { "none".to_string() } else { all_labels.join(", ") };
            bail!("session {session} has no steps labelled '{l}' (labels: {have})");
        }
        by_label.retain(|k, _| k == l);
    }

    let epoch_firsts = epoch_first_steps(db, session)?;
    // The measured steps of every label, for joining per-step energy rows.
    let mut measured: Measured = HashMap::new();
    let mut labels = Vec::new();
    for (name, rows) in &by_label {
        let used: Vec<&StepRow> = rows.iter().skip(skip as usize).filter(|s| s.end_ns.is_some()).collect();
        for s in &used {
            measured.insert((name.clone(), s.step), s.duration_ns.unwrap_or(0));
        }
        let mut figures = label_figures(name, rows, &used, skip);
        figures.epochs = epoch_waits(name, &used, &epoch_firsts);
        labels.push(figures);
    }

    let gpu_sums = gpu_energy(db, session, &measured)?;
    let (cpu_sums, dram_sums) = cpu_dram_energy(db, session, &measured)?;
    let gpu_names = gpu_names(db, session)?;
    for l in &mut labels {
        if let Some(per_gpu) = &gpu_sums {
            l.gpus = Some(label_gpus(&l.label, per_gpu, &gpu_names));
        }
        l.cpu = cpu_sums.as_ref().and_then(|m| m.get(&l.label)).and_then(EnergySum::stat);
        l.dram = dram_sums.as_ref().and_then(|m| m.get(&l.label)).and_then(EnergySum::stat);
        l.add_up_energy();
    }
    flops_figures(db, session, &measured, &mut labels)?;

    let top_kernels = top_kernels(db, session, &info.launch_mode, TOP_KERNELS)?;
    let top_regions = top_regions(db, session)?;
    let cpu = super::cpu::build(db, session, &measured)?;
    Ok(Report {
        report_version: REPORT_VERSION,
        database: db.path.display().to_string(),
        skip,
        label_filter: label.map(str::to_owned),
        session: info,
        capabilities,
        labels,
        top_kernels,
        top_regions,
        cpu,
    })
}

/// The session's `record_function` names with the most time in them.
fn top_regions(db: &ProfileDb, session: i64) -> anyhow::Result<Vec<RegionStat>> {
    let mut q = db.conn.prepare(&format!(
        "SELECT name, count(end_ns), coalesce(sum(end_ns - start_ns), 0), coalesce(max(end_ns - start_ns), 0),
                count(*) - count(end_ns)
         FROM regions WHERE session_id = ?1 GROUP BY name ORDER BY 3 DESC, name LIMIT {TOP_REGIONS}"
    ))?;
    let rows = q
        .query_map([session], |r| {
            let (count, total): (i64, i64) = (r.get(1)?, r.get(2)?);
            Ok(RegionStat {
                name: r.get(0)?,
                count,
                total_ms: total as f64 / 1e6,
                mean_ms: if count > 0 { total as f64 / 1e6 / count as f64 } else { 0.0 },
                max_ms: r.get::<_, i64>(3)? as f64 / 1e6,
                open: r.get(4)?,
            })
        })?
        .collect::<rusqlite::Result<_>>()?;
    Ok(rows)
}

/// One label's energy on every GPU the session saw (named or with figures);
/// a GPU without figures for the label has an empty [`EnergyStat`].
fn label_gpus(
    label: &str,
    per_gpu: &BTreeMap<(String, i64), EnergySum>,
    gpu_names: &BTreeMap<i64, Option<String>>,
) -> Vec<GpuEnergy> {
    let mut gpus: BTreeSet<i64> = gpu_names.keys().copied().collect();
    gpus.extend(per_gpu.keys().map(|(_, g)| *g));
    gpus.into_iter()
        .map(|g| GpuEnergy {
            gpu: g,
            name: gpu_names.get(&g).cloned().flatten(),
            energy: per_gpu.get(&(label.to_owned(), g)).and_then(EnergySum::stat).unwrap_or_default(),
        })
        .collect()
}

impl LabelReport {
    /// The energy per step over the parts that have a figure, and which they are.
    fn add_up_energy(&mut self) {
        let mut total = None;
        let mut parts = Vec::new();
        for g in self.gpus.iter().flatten() {
            if let Some(e) = g.energy.energy_per_step_j {
                *total.get_or_insert(0.0) += e;
                parts.push(format!("GPU {}", g.gpu));
            }
        }
        for (part, stat) in [("CPU", &self.cpu), ("DRAM", &self.dram)] {
            if let Some(e) = stat.as_ref().and_then(|s| s.energy_per_step_j) {
                *total.get_or_insert(0.0) += e;
                parts.push(part.to_string());
            }
        }
        self.energy_per_step_j = total;
        self.energy_components = parts;
    }
}

fn label_figures(name: &str, rows: &[StepRow], used: &[&StepRow], skip: u64) -> LabelReport {
    let ms = |ns: i64| ns as f64 / 1e6;
    let span = used.iter().filter_map(|s| s.end_ns).max().zip(used.iter().map(|s| s.start_ns).min());
    let steps_per_s =
        span.and_then(|(end, start)| (end > start).then(|| used.len() as f64 / ((end - start) as f64 / 1e9)));
    let (mut sync_sum, mut sync_dur, mut sync_seen) = (0i64, 0i64, false);
    for s in used {
        if let Some(w) = s.sync_wait_ns {
            sync_sum += w;
            sync_dur += s.duration_ns.unwrap_or(0);
            sync_seen = true;
        }
    }
    LabelReport {
        label: name.to_owned(),
        steps: rows.len() as u64,
        completed: rows.iter().filter(|s| s.end_ns.is_some()).count() as u64,
        skipped: skip.min(rows.len() as u64),
        measured: used.len() as u64,
        steps_per_s,
        step_time_ms: Percentiles::of(used.iter().filter_map(|s| s.duration_ns.map(ms)).collect()),
        inter_step_ms: Percentiles::of(used.iter().filter_map(|s| s.inter_step_ns.map(ms)).collect()),
        launches_per_step: Percentiles::of(used.iter().filter_map(|s| s.launches.map(|n| n as f64)).collect()),
        sync_wait_share: (sync_seen && sync_dur > 0).then(|| sync_sum as f64 / sync_dur as f64),
        data_wait_ms: Percentiles::of(used.iter().filter_map(|s| s.data_wait_ns.map(ms)).collect()),
        optimizer_ms: Percentiles::of(used.iter().filter_map(|s| s.optimizer_ns.map(ms)).collect()),
        dispatch_ms: Percentiles::of(used.iter().filter_map(|s| s.dispatch_ns.map(ms)).collect()),
        epochs: None,
        gpus: None,
        cpu: None,
        dram: None,
        energy_per_step_j: None,
        energy_components: Vec::new(),
        tflops_per_s: None,
        mfu_pct: None,
        mfu_gpm_pct: None,
        bound: bound_report(used),
    }
}

/// The data wait of `used` steps that are an epoch's first (`firsts`), apart
/// from the others', when it stands out: its p50 at least twice theirs.
fn epoch_waits(name: &str, used: &[&StepRow], firsts: &HashSet<(String, i64)>) -> Option<EpochWaits> {
    let ms = |ns: i64| ns as f64 / 1e6;
    let (mut first, mut other) = (Vec::new(), Vec::new());
    for s in used {
        let Some(wait) = s.data_wait_ns else { continue };
        if firsts.contains(&(name.to_owned(), s.step)) { &mut first } else { &mut other }.push(ms(wait));
    }
    let boundaries = first.len() as u64;
    let first_batch_wait_ms = Percentiles::of(first)?;
    let other_wait_ms = Percentiles::of(other);
    if other_wait_ms.as_ref().is_some_and(|o| first_batch_wait_ms.p50 < 2.0 * o.p50) {
        return None;
    }
    Some(EpochWaits { boundaries, first_batch_wait_ms, other_wait_ms })
}

/// Per-step TFLOP/s, MFU and its GPM estimate of the measured steps, into
/// each label's figures.
fn flops_figures(db: &ProfileDb, session: i64, measured: &Measured, labels: &mut [LabelReport]) -> anyhow::Result<()> {
    let mut stmt = db.conn.prepare(
        "SELECT s.label, s.step, s.flops, avg(g.mfu_pct), avg(g.mfu_gpm_pct)
         FROM steps s LEFT JOIN step_gpu g ON g.session_id = s.session_id AND g.label = s.label AND g.step = s.step
         WHERE s.session_id = ?1 GROUP BY s.label, s.step",
    )?;
    let mut per_label: HashMap<String, [Vec<f64>; 3]> = HashMap::new();
    let mut rows = stmt.query([session])?;
    while let Some(r) = rows.next()? {
        let (label, step): (String, i64) = (r.get(0)?, r.get(1)?);
        let Some(&duration_ns) = measured.get(&(label.clone(), step)) else { continue };
        let figures = per_label.entry(label).or_default();
        let tflops = r.get::<_, Option<i64>>(2)?.filter(|_| duration_ns > 0);
        figures[0].extend(tflops.map(|f| f as f64 / (duration_ns as f64 / 1e9) / 1e12));
        figures[1].extend(r.get::<_, Option<f64>>(3)?);
        figures[2].extend(r.get::<_, Option<f64>>(4)?);
    }
    for l in labels {
        if let Some([tflops, mfu, gpm]) = per_label.remove(&l.label) {
            (l.tflops_per_s, l.mfu_pct, l.mfu_gpm_pct) =
                (Percentiles::of(tflops), Percentiles::of(mfu), Percentiles::of(gpm));
        }
    }
    Ok(())
}

/// GPU energy of the measured steps, per (label, gpu); None when the profile
/// has no per-step GPU figures for this session.
fn gpu_energy(
    db: &ProfileDb,
    session: i64,
    measured: &Measured,
) -> anyhow::Result<Option<BTreeMap<(String, i64), EnergySum>>> {
    let mut q = db.conn.prepare(
        "SELECT label, step, gpu, energy_j, energy_error_j, below_resolution FROM step_gpu WHERE session_id = ?1",
    )?;
    let mut rows = q.query([session])?;
    let mut out: BTreeMap<(String, i64), EnergySum> = BTreeMap::new();
    let mut any = false;
    while let Some(r) = rows.next()? {
        any = true;
        let l: String = r.get(0)?;
        let step: i64 = r.get(1)?;
        let gpu: i64 = r.get(2)?;
        let sum = out.entry((l.clone(), gpu)).or_default();
        let (Some(&dur), Some(energy)) = (measured.get(&(l, step)), r.get::<_, Option<f64>>(3)?) else { continue };
        sum.add(energy, r.get(4)?, dur, r.get(5)?);
    }
    Ok(any.then_some(out))
}

fn gpu_names(db: &ProfileDb, session: i64) -> anyhow::Result<BTreeMap<i64, Option<String>>> {
    let mut q = db.conn.prepare("SELECT gpu, name FROM gpus WHERE session_id = ?1")?;
    let names = q.query_map([session], |r| Ok((r.get(0)?, r.get(1)?)))?.collect::<rusqlite::Result<_>>()?;
    Ok(names)
}

type LabelSums = Option<BTreeMap<String, EnergySum>>;

/// CPU package and DRAM energy of the measured steps, per label; each None
/// when the profile has no such figures for this session.
fn cpu_dram_energy(db: &ProfileDb, session: i64, measured: &Measured) -> anyhow::Result<(LabelSums, LabelSums)> {
    let mut q = db.conn.prepare(
        "SELECT label, step, cpu_energy_j, cpu_energy_error_j, dram_energy_j, dram_energy_error_j, below_resolution
         FROM step_energy WHERE session_id = ?1",
    )?;
    let mut rows = q.query([session])?;
    let (mut cpu, mut dram): (BTreeMap<String, EnergySum>, BTreeMap<String, EnergySum>) = Default::default();
    let (mut cpu_any, mut dram_any) = (false, false);
    while let Some(r) = rows.next()? {
        let l: String = r.get(0)?;
        let step: i64 = r.get(1)?;
        let below: Option<i64> = r.get(6)?;
        let dur = measured.get(&(l.clone(), step)).copied();
        for (energy_col, map, any) in [(2, &mut cpu, &mut cpu_any), (4, &mut dram, &mut dram_any)] {
            let energy: Option<f64> = r.get(energy_col)?;
            // A series with no value in any row of the session (no RAPL, or
            // no DRAM domain) is absent, not a zero.
            *any |= energy.is_some();
            let sum = map.entry(l.clone()).or_default();
            if let (Some(d), Some(e)) = (dur, energy) {
                sum.add(e, r.get(energy_col + 1)?, d, below);
            }
        }
    }
    Ok((cpu_any.then_some(cpu), dram_any.then_some(dram)))
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;
    use unicode_width::UnicodeWidthStr;

    use super::{
        super::render::{WIDTH, render_table},
        *,
    };
    use crate::profile::sessions::SessionState;

    #[test]
    fn nearest_rank_percentiles() {
        let p = Percentiles::of((1..=100).map(f64::from).rev().collect()).expect("values");
        assert_eq!((p.p50, p.p90, p.p99, p.max), (50.0, 90.0, 99.0, 100.0));
        assert_eq!(p.mean, 50.5);
        // Rank ⌈0.5·3⌉ = 2, ⌈0.9·3⌉ = 3.
        let p = Percentiles::of(vec![3.0, 1.0, 2.0]).expect("values");
        assert_eq!((p.p50, p.p90, p.p99), (2.0, 3.0, 3.0));
        let p = Percentiles::of(vec![7.0]).expect("one value");
        assert_eq!((p.p50, p.max), (7.0, 7.0));
        assert!(Percentiles::of(Vec::new()).is_none());
    }

    /// A profile written by the first schema (no labels, no GPU tables) reads
    /// with every later figure absent, and the file is left as it was.
    #[test]
    fn old_profile_reports_absent_figures() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("old.db");
        let conn = Connection::open(&path).expect("create");
        conn.execute_batch(crate::store::history::CORE_489E641).expect("schema");
        conn.execute_batch(
            "INSERT INTO apis VALUES (1, 'cuLaunchKernel', 'driver');
             INSERT INTO sessions VALUES (1, 9, 'x', NULL, 'run', 'all', 's', 0, 4000000000, 'target-exited',
                 0, 3, 3, 0, 0, NULL, NULL, '0.1.0');
             INSERT INTO steps VALUES (1, 0, 9, 0, 1000000000, 1000000000, NULL, 1),
                                      (1, 1, 9, 2000000000, 4000000000, 2000000000, 1000000000, 2),
                                      (1, 2, 9, 4000000000, NULL, NULL, NULL, NULL);
             INSERT INTO launches VALUES (1, 1, 9, 1, 16, 1, 1, 1, 1, 1, 1, 0, 0, 0),
                                         (1, 2, 9, 1, 16, 1, 1, 1, 1, 1, 1, 0, 0, 1),
                                         (1, 3, 9, 1, 17, 1, 1, 1, 1, 1, 1, 0, 0, 1);
             PRAGMA user_version = 1;",
        )
        .expect("rows");
        drop(conn);
        let bytes = std::fs::read(&path).expect("read");
        let db = ProfileDb::open(&path).expect("a profile");
        let r = build(&db, 1, None, 1).expect("report");
        assert_eq!(r.session.step_symbol.as_deref(), Some("s"));
        assert_eq!(r.labels.len(), 1);
        let l = &r.labels[0];
        assert_eq!((l.label.as_str(), l.steps, l.completed, l.skipped, l.measured), ("train", 3, 2, 1, 1));
        assert_eq!(l.step_time_ms.as_ref().map(|p| p.p50), Some(2000.0));
        assert_eq!(l.steps_per_s, Some(0.5));
        assert!(l.gpus.is_none() && l.cpu.is_none() && l.dram.is_none() && l.sync_wait_share.is_none());
        assert!(l.energy_per_step_j.is_none());
        let k = r.top_kernels.as_ref().expect("launch rows kept");
        assert_eq!((k[0].function, k[0].launches, k[0].api.as_deref()), (16, 2, Some("cuLaunchKernel")));
        let json = serde_json::to_value(&r).expect("serialises");
        assert!(json["labels"][0]["gpus"].is_null());
        assert!(render_table(&r).lines().all(|line| line.width() <= WIDTH));
        drop(db);
        assert_eq!(std::fs::read(&path).expect("read"), bytes, "reading wrote to the profile");
    }

    /// A profile with one session and no rows: (its directory, its path, the session).
    fn empty_session() -> (tempfile::TempDir, std::path::PathBuf, i64) {
        let (dir, path) = crate::store::testing::temp_db();
        let id = crate::store::Store::open(&path)
            .and_then(|s| s.begin_session(&crate::store::testing::start()))
            .expect("a session");
        (dir, path, id)
    }

    /// Without `--session`: of the newest job's processes, the one with the
    /// most steps (a launcher's rank, not its last helper), the first among
    /// equals; the text report names the job and its size.
    #[test]
    fn the_default_session_is_the_newest_jobs_busiest() {
        let (_dir, path) = crate::store::testing::temp_db();
        let store = crate::store::Store::open(&path).expect("store");
        let begin = |job: &str, rank: Option<i64>| {
            let start = crate::store::SessionStart { job: job.into(), rank, ..crate::store::testing::start() };
            store.begin_session(&start).expect("a session")
        };
        let old = begin("old", None);
        let (launcher, rank0, rank1, _helper) =
            (begin("new", None), begin("new", Some(0)), begin("new", Some(1)), begin("new", None));
        drop(store);
        let conn = Connection::open(&path).expect("open");
        let steps = |id: i64, n: i64| {
            for k in 0..n {
                conn.execute(
                    "INSERT INTO steps(session_id, label, step, tid, start_ns, end_ns) VALUES (?1, 'train', ?2, 1, ?2, ?2 + 1)",
                    [id, k],
                )
                .expect("step");
            }
        };
        let db = || ProfileDb::open(&path).expect("a profile");
        assert_eq!(db().session(None).expect("default"), launcher, "no steps: the job's first");
        steps(old, 9);
        steps(rank0, 3);
        steps(rank1, 5);
        assert_eq!(db().session(None).expect("default"), rank1);
        assert_eq!(db().session(Some(old)).expect("named"), old);
        let r = build(&db(), rank1, None, 0).expect("report");
        assert_eq!((r.session.job.as_deref(), r.session.rank, r.session.job_processes), (Some("new"), Some(1), 4));
        assert!(render_table(&r).contains("new (4 processes, this one rank 1; see --job)"), "{}", render_table(&r));
        // While its profiler writes the file, every unended process of the newest job is running; an older one is not.
        let mut live = db();
        live.written_by_a_live_profiler = true;
        let state = |id| build(&live, id, None, 0).expect("report").session.state;
        assert_eq!(
            (state(rank1), state(launcher), state(old)),
            (SessionState::Running, SessionState::Running, SessionState::Unclean)
        );
    }

    /// Steps from PyTorch's markers show their data wait and optimizer time,
    /// and the session's regions are ranked by their total time.
    #[test]
    fn pytorch_phases_and_top_regions() {
        let (_dir, path, id) = empty_session();
        let conn = Connection::open(&path).expect("open");
        conn.execute_batch(&format!(
            "INSERT INTO steps(session_id, label, step, tid, start_ns, end_ns, duration_ns, data_wait_ns, optimizer_ns)
                 VALUES ({id}, 'train', 0, 9, 0, 4000000, 4000000, 1000000, 2000000),
                        ({id}, 'train', 1, 9, 5000000, 9000000, 4000000, 3000000, 2000000);
             INSERT INTO regions(session_id, tid, name, truncated, start_ns, end_ns, label, step)
                 VALUES ({id}, 9, 'Optimizer.step#AdamW.step', 0, 1000000, 3000000, 'train', 0),
                        ({id}, 9, 'Optimizer.step#AdamW.step', 0, 6000000, 8000000, 'train', 1),
                        ({id}, 9, 'enumerate(DataLoader)#x.__next__', 0, 0, 1000000, NULL, NULL),
                        ({id}, 9, 'enumerate(DataLoader)#x.__next__', 0, 9500000, NULL, NULL, NULL);"
        ))
        .expect("rows");
        drop(conn);
        let db = ProfileDb::open(&path).expect("a profile");
        let r = build(&db, id, None, 0).expect("report");
        let l = &r.labels[0];
        assert_eq!(l.data_wait_ms.as_ref().map(|p| (p.p50, p.max)), Some((1.0, 3.0)));
        assert_eq!(l.optimizer_ms.as_ref().map(|p| p.mean), Some(2.0));
        let top: Vec<(&str, i64, f64, i64)> =
            r.top_regions.iter().map(|g| (g.name.as_str(), g.count, g.total_ms, g.open)).collect();
        assert_eq!(top, [("Optimizer.step#AdamW.step", 2, 4.0, 0), ("enumerate(DataLoader)#x.__next__", 1, 1.0, 1)]);
        let table = render_table(&r);
        assert!(table.contains("data wait (ms)") && table.contains("optimizer (ms)"), "{table}");
        assert!(table.contains("top PyTorch regions"), "{table}");
        assert!(table.lines().all(|line| line.width() <= WIDTH), "{table}");
    }

    /// A step whose thread ended a DataLoader `__next__` in the gap before it
    /// (an epoch's StopIteration) is an epoch's first: its data wait apart.
    #[test]
    fn an_epochs_first_batch_wait_is_shown_apart() {
        let (_dir, path, id) = empty_session();
        let conn = Connection::open(&path).expect("open");
        let next = "'enumerate(DataLoader)#x.__next__'";
        let mut sql = String::new();
        for k in 0..6i64 {
            // 10 ms a step; step 3's first batch comes 5 ms after an epoch's end.
            let (t, wait) = (k * 10_000_000, if k == 3 { 6_000_000 } else { 1_000_000 });
            let start = t + wait;
            sql += &format!(
                "INSERT INTO steps(session_id, label, step, tid, start_ns, end_ns, duration_ns, inter_step_ns, data_wait_ns)
                     VALUES ({id}, 'train', {k}, 9, {start}, {t} + 9000000, {t} + 9000000 - {start}, {gap}, {wait});
                 INSERT INTO regions(session_id, tid, name, truncated, start_ns, end_ns)
                     VALUES ({id}, 9, {next}, 0, {start} - 1000000, {start});",
                gap = if k == 0 { "NULL".into() } else { (start - (t - 1_000_000)).to_string() },
            );
            if k == 3 {
                sql += &format!(
                    "INSERT INTO regions(session_id, tid, name, truncated, start_ns, end_ns)
                                     VALUES ({id}, 9, {next}, 0, {t}, {t} + 100);"
                );
            }
        }
        conn.execute_batch(&sql).expect("rows");
        drop(conn);
        let r = build(&ProfileDb::open(&path).expect("a profile"), id, None, 0).expect("report");
        let e = r.labels[0].epochs.as_ref().expect("epoch figures");
        assert_eq!(
            (e.boundaries, e.first_batch_wait_ms.p50, e.other_wait_ms.as_ref().map(|p| p.p50)),
            (1, 6.0, Some(1.0))
        );
        let table = render_table(&r);
        assert!(table.contains("epoch boundaries: 1, first-batch wait p50 6.000 ms vs 1.000 ms otherwise"), "{table}");
        assert!(table.lines().all(|line| line.width() <= WIDTH), "{table}");
    }

    #[test]
    fn tflops_and_mfu_per_step() {
        let (_dir, path, id) = empty_session();
        let conn = Connection::open(&path).expect("open");
        // Step 0: 2 TFLOP in 4 ms (500 TFLOP/s), MFU 40 % and 60 % on two GPUs; step 1: 3 TFLOP in 2 ms.
        conn.execute_batch(&format!(
            "INSERT INTO steps(session_id, label, step, tid, start_ns, end_ns, duration_ns, flops)
                 VALUES ({id}, 'train', 0, 9, 0, 4000000, 4000000, 2000000000000),
                        ({id}, 'train', 1, 9, 5000000, 7000000, 2000000, 3000000000000);
             INSERT INTO step_gpu(session_id, label, step, gpu, mfu_pct, mfu_gpm_pct)
                 VALUES ({id}, 'train', 0, 0, 40.0, 30.0), ({id}, 'train', 0, 1, 60.0, NULL),
                        ({id}, 'train', 1, 0, 70.0, 50.0), ({id}, 'train', 1, 1, 90.0, NULL);"
        ))
        .expect("rows");
        drop(conn);
        let db = ProfileDb::open(&path).expect("a profile");
        let r = build(&db, id, None, 0).expect("report");
        let l = &r.labels[0];
        let pm = |p: &Option<Percentiles>| p.as_ref().map(|p| (p.p50, p.max));
        assert_eq!(pm(&l.tflops_per_s), Some((500.0, 1500.0)));
        assert_eq!(pm(&l.mfu_pct), Some((50.0, 80.0)), "the mean over each step's GPUs");
        assert_eq!(pm(&l.mfu_gpm_pct), Some((30.0, 50.0)));
        let table = render_table(&r);
        assert!(
            table.contains("GEMM TFLOP/s") && table.contains("MFU (%)") && table.contains("MFU est. GPM"),
            "{table}"
        );
        // Without FLOPs or MFU figures the rows are left out.
        let r = build(&ProfileDb::open(&path).expect("again"), id, Some("train"), 2).expect("report");
        assert!(!render_table(&r).contains("TFLOP/s"));
    }
}
