//! Two runs compared: per label, each metric's change from A to B with its
//! 95 % interval and a verdict, the kernels whose launches per step changed,
//! and the conditions of a `--fail-if` gate. No I/O: the CLI loads each
//! side's steps ([`SideSteps`]) and renders what [`compare_label`] returns.
pub mod gate;
pub mod stats;

use serde::Serialize;

use self::stats::{Series, Statistic};

/// One measured step's figures (NULL columns are None).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepValues {
    pub duration_ms: f64,
    pub inter_step_ms: Option<f64>,
    pub data_wait_ms: Option<f64>,
    pub optimizer_ms: Option<f64>,
    pub sync_wait_ms: Option<f64>,
    pub launches: Option<f64>,
    pub flops: Option<f64>,
    pub mfu_pct: Option<f64>,
    pub collective_bytes: Option<f64>,
    pub collective_ms: Option<f64>,
    pub gpu_energy_j: Option<f64>,
    pub cpu_energy_j: Option<f64>,
    pub dram_energy_j: Option<f64>,
    /// The domains both sides have, summed (set by [`compare_label`]).
    pub energy_j: Option<f64>,
    pub cpu_ms: Option<f64>,
    pub runnable_ms: Option<f64>,
    pub sleep_ms: Option<f64>,
    pub blocked_ms: Option<f64>,
    pub bound: Option<String>,
}

/// One side's measured steps of one label, in start order, and the columns
/// its profile has (an older profile lacks the newer ones).
#[derive(Clone, Debug, Default)]
pub struct SideSteps {
    pub steps: Vec<StepValues>,
    pub columns: Vec<String>,
    /// Launches per step of each kernel (by display name), when launch rows were kept.
    pub kernels: Option<Vec<(String, f64)>>,
}

/// The unit a metric is shown and thresholded in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Unit {
    Ms,
    Joule,
    Watt,
    /// Percent, compared in percentage points.
    Points,
    Count,
    Bytes,
    Flops,
}

impl Unit {
    pub fn symbol(self) -> &'static str {
        match self {
            Self::Ms => "ms",
            Self::Joule => "J",
            Self::Watt => "W",
            Self::Points => "%",
            Self::Count => "",
            Self::Bytes => "B",
            Self::Flops => "FLOP",
        }
    }
}

type Value = fn(&StepValues) -> Option<f64>;

/// A figure compared between the runs.
#[derive(Debug)]
pub struct Metric {
    /// The name `--fail-if` and the JSON use.
    pub name: &'static str,
    pub title: &'static str,
    pub unit: Unit,
    pub statistic: Statistic,
    /// A count the profiler takes exactly: any change is real, no interval.
    pub exact: bool,
    /// Time: its verdict says faster or slower.
    pub time: bool,
    /// The profile column it needs (`steps.` unless named otherwise).
    pub column: &'static str,
    pub value: Value,
    /// For [`Statistic::RatioOfSums`]: what the values are summed over.
    pub denominator: Option<Value>,
}

macro_rules! metric {
    ($name:literal, $title:literal, $unit:ident, $stat:expr, $column:literal, $value:expr) => {
        metric!($name, $title, $unit, $stat, $column, $value, None, false, matches!(Unit::$unit, Unit::Ms))
    };
    ($name:literal, $title:literal, $unit:ident, $stat:expr, $column:literal, $value:expr, exact) => {
        metric!($name, $title, $unit, $stat, $column, $value, None, true, false)
    };
    // Average power: Σ energy / Σ step time (s) over the steps with energy.
    ($name:literal, $title:literal, power of $field:ident, $column:literal) => {
        metric!(
            $name,
            $title,
            Watt,
            Statistic::RatioOfSums,
            $column,
            |s| s.$field,
            Some(|s| s.$field.map(|_| s.duration_ms / 1e3)),
            false,
            false
        )
    };
    ($name:literal, $title:literal, $unit:ident, $stat:expr, $column:literal, $value:expr, $den:expr, $exact:expr, $time:expr) => {
        Metric {
            name: $name,
            title: $title,
            unit: Unit::$unit,
            statistic: $stat,
            exact: $exact,
            time: $time,
            column: $column,
            value: $value,
            denominator: $den,
        }
    };
}

const P50: Statistic = Statistic::Quantile(0.5);
const MEAN: Statistic = Statistic::Mean;

/// Every metric, in the order the table shows them.
pub static METRICS: &[Metric] = &[
    metric!("step_p50", "step time p50", Ms, P50, "duration_ns", |s| Some(s.duration_ms)),
    metric!("step_p90", "step time p90", Ms, Statistic::Quantile(0.9), "duration_ns", |s| Some(s.duration_ms)),
    metric!("step_p99", "step time p99", Ms, Statistic::Quantile(0.99), "duration_ns", |s| Some(s.duration_ms)),
    metric!("step_mean", "step time mean", Ms, MEAN, "duration_ns", |s| Some(s.duration_ms)),
    metric!("inter_step_p50", "inter-step p50", Ms, P50, "inter_step_ns", |s| s.inter_step_ms),
    // From the previous step's end to this one's: the training loop's period,
    // which a slower DataLoader lengthens (its wait lies before the step).
    metric!("step_period_p50", "step period p50", Ms, P50, "inter_step_ns", |s| s
        .inter_step_ms
        .map(|gap| gap + s.duration_ms)),
    metric!("data_wait_p50", "data wait p50", Ms, P50, "data_wait_ns", |s| s.data_wait_ms),
    metric!("optimizer_p50", "optimizer p50", Ms, P50, "optimizer_ns", |s| s.optimizer_ms),
    metric!(
        "sync_wait_pct",
        "sync wait share",
        Points,
        Statistic::RatioOfSums,
        "sync_wait_ns",
        |s| s.sync_wait_ms.map(|w| 100.0 * w),
        Some(|s| s.sync_wait_ms.map(|_| s.duration_ms)),
        false,
        false
    ),
    metric!("launches_per_step", "launches/step", Count, MEAN, "launches", |s| s.launches, exact),
    metric!("flops_per_step", "GEMM FLOP/step", Flops, MEAN, "flops", |s| s.flops, exact),
    metric!("mfu_pct", "MFU", Points, MEAN, "step_gpu.mfu_pct", |s| s.mfu_pct),
    metric!(
        "collective_bytes_per_step",
        "NCCL bytes/step",
        Bytes,
        MEAN,
        "collective_bytes",
        |s| s.collective_bytes,
        exact
    ),
    metric!("collective_ms_per_step", "NCCL time/step", Ms, MEAN, "collective_ns", |s| s.collective_ms),
    metric!("energy_per_step", "energy/step", Joule, MEAN, "step_gpu.energy_j", |s| s.energy_j),
    metric!("gpu_energy_per_step", "GPU energy/step", Joule, MEAN, "step_gpu.energy_j", |s| s.gpu_energy_j),
    metric!("gpu_power", "GPU power", power of gpu_energy_j, "step_gpu.energy_j"),
    metric!("cpu_energy_per_step", "CPU energy/step", Joule, MEAN, "step_energy.cpu_energy_j", |s| s.cpu_energy_j),
    metric!("cpu_power", "CPU power", power of cpu_energy_j, "step_energy.cpu_energy_j"),
    metric!("dram_energy_per_step", "DRAM energy/step", Joule, MEAN, "step_energy.dram_energy_j", |s| s.dram_energy_j),
    metric!("dram_power", "DRAM power", power of dram_energy_j, "step_energy.dram_energy_j"),
    metric!("cpu_p50", "on CPU p50", Ms, P50, "cpu_ns", |s| s.cpu_ms),
    metric!("runnable_p50", "runnable p50", Ms, P50, "runnable_ns", |s| s.runnable_ms),
    metric!("sleep_p50", "sleeping p50", Ms, P50, "sleep_ns", |s| s.sleep_ms),
    metric!("blocked_p50", "blocked p50", Ms, P50, "blocked_ns", |s| s.blocked_ms),
];

/// Metrics are one each, by name.
impl PartialEq for Metric {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

/// The metric named `name`.
pub fn metric(name: &str) -> Option<&'static Metric> {
    METRICS.iter().find(|m| m.name == name)
}

/// One metric's change, as the table and the JSON give it. Figures are in
/// the metric's unit; `*_pct` are relative to A.
#[derive(Clone, Debug, Serialize)]
pub struct MetricChange {
    pub metric: &'static str,
    pub title: &'static str,
    pub unit: &'static str,
    pub a: Option<f64>,
    pub b: Option<f64>,
    pub change: Option<f64>,
    pub ci_low: Option<f64>,
    pub ci_high: Option<f64>,
    pub change_pct: Option<f64>,
    pub ci_low_pct: Option<f64>,
    pub ci_high_pct: Option<f64>,
    pub significant: bool,
    /// `faster`/`slower` (times), `higher`/`lower`, `no significant change`,
    /// or why there is none: `not in A`, `not in B`, `not in either`.
    pub verdict: String,
}

/// A kernel whose launches per step changed (appeared, disappeared, or a new count).
#[derive(Clone, Debug, Serialize)]
pub struct KernelChange {
    pub kernel: String,
    pub a_per_step: f64,
    pub b_per_step: f64,
    /// `appeared`, `disappeared` or `changed`.
    pub change: &'static str,
}

/// Share of steps per verdict (`steps.bound`), where a profile has them.
#[derive(Clone, Debug, Serialize)]
pub struct VerdictShare {
    pub bound: String,
    pub a_pct: f64,
    pub b_pct: f64,
}

/// One label compared.
#[derive(Clone, Debug, Serialize)]
pub struct LabelComparison {
    pub label: String,
    pub steps_a: usize,
    pub steps_b: usize,
    pub metrics: Vec<MetricChange>,
    /// None: neither profile has per-step verdicts.
    pub verdicts: Option<Vec<VerdictShare>>,
    /// None: a side kept no launch rows (`--launches count`).
    pub kernels: Option<Vec<KernelChange>>,
    /// Which energy domains `energy_per_step` sums (those both sides have).
    pub energy_domains: Vec<&'static str>,
    /// Per step, for the HTML page's plots: step time (ms) and energy (J) of A and of B.
    #[serde(skip)]
    pub plots: [PlotSeries; 2],
}

/// One side's per-step series for plots.
#[derive(Clone, Debug, Default)]
pub struct PlotSeries {
    pub step_ms: Vec<f64>,
    pub energy_j: Vec<f64>,
}

impl PlotSeries {
    fn of(side: &SideSteps) -> Self {
        Self {
            step_ms: side.steps.iter().map(|s| s.duration_ms).collect(),
            energy_j: side.steps.iter().filter_map(|s| s.energy_j).collect(),
        }
    }
}

/// A side's series of `m`, or why it has none.
fn series(side: &SideSteps, m: &Metric) -> Option<Series> {
    let column = m.column.rsplit('.').next().unwrap_or(m.column);
    let has_column = side.columns.iter().any(|c| c == m.column || c == column);
    if !has_column {
        return None;
    }
    let mut s = Series::default();
    for step in &side.steps {
        let Some(v) = (m.value)(step) else { continue };
        if let Some(den) = m.denominator {
            s.denominators.push(den(step).unwrap_or(0.0));
        }
        s.values.push(v);
    }
    (s.len() > 0).then_some(s)
}

fn no_change(m: &'static Metric, verdict: &str) -> MetricChange {
    MetricChange {
        metric: m.name,
        title: m.title,
        unit: m.unit.symbol(),
        a: None,
        b: None,
        change: None,
        ci_low: None,
        ci_high: None,
        change_pct: None,
        ci_low_pct: None,
        ci_high_pct: None,
        significant: false,
        verdict: verdict.to_owned(),
    }
}

/// One metric compared between the sides; changes within ±`noise_pct` % of
/// A are taken as run-to-run noise (exact counts have none).
pub fn compare_metric(m: &'static Metric, a: &SideSteps, b: &SideSteps, noise_pct: f64) -> MetricChange {
    let (sa, sb) = match (series(a, m), series(b, m)) {
        (Some(sa), Some(sb)) => (sa, sb),
        (None, None) => return no_change(m, "not in either"),
        (None, Some(_)) => return no_change(m, "not in A"),
        (Some(_), None) => return no_change(m, "not in B"),
    };
    let c = if m.exact {
        let mut scratch = Vec::new();
        let (va, vb) = (
            stats::statistic(&sa, m.statistic, None, &mut scratch),
            stats::statistic(&sb, m.statistic, None, &mut scratch),
        );
        stats::Change { a: va, b: vb, diff: vb - va, diff_low: vb - va, diff_high: vb - va }
    } else {
        stats::compare(&sa, &sb, m.statistic)
    };
    let significant = if m.exact { c.diff != 0.0 } else { c.significant(noise_pct) };
    let verdict = match (significant, c.diff > 0.0, m.time) {
        (false, _, _) if m.exact => "same",
        (false, _, _) => "no significant change",
        (true, true, true) => "slower",
        (true, false, true) => "faster",
        (true, true, false) => "higher",
        (true, false, false) => "lower",
    };
    let rel = c.relative_pct();
    MetricChange {
        a: Some(c.a),
        b: Some(c.b),
        change: Some(c.diff),
        ci_low: (!m.exact).then_some(c.diff_low),
        ci_high: (!m.exact).then_some(c.diff_high),
        change_pct: rel.map(|r| r.0),
        ci_low_pct: rel.filter(|_| !m.exact).map(|r| r.1),
        ci_high_pct: rel.filter(|_| !m.exact).map(|r| r.2),
        significant,
        verdict: verdict.to_owned(),
        ..no_change(m, "")
    }
}

/// Sets `energy_j` on every step to the sum of the domains both sides have;
/// returns their names.
fn common_energy(a: &mut SideSteps, b: &mut SideSteps) -> Vec<&'static str> {
    type Domain = (&'static str, fn(&StepValues) -> Option<f64>);
    let domains: [Domain; 3] =
        [("GPU", |s| s.gpu_energy_j), ("CPU", |s| s.cpu_energy_j), ("DRAM", |s| s.dram_energy_j)];
    let has = |side: &SideSteps, f: fn(&StepValues) -> Option<f64>| side.steps.iter().any(|s| f(s).is_some());
    let common: Vec<Domain> = domains.into_iter().filter(|(_, f)| has(a, *f) && has(b, *f)).collect();
    for side in [a, b] {
        for s in &mut side.steps {
            let parts: Option<Vec<f64>> = common.iter().map(|(_, f)| f(s)).collect();
            s.energy_j = parts.filter(|p| !p.is_empty()).map(|p| p.iter().sum());
        }
    }
    common.iter().map(|(n, _)| *n).collect()
}

fn verdict_mix(a: &SideSteps, b: &SideSteps) -> Option<Vec<VerdictShare>> {
    let share = |side: &SideSteps, bound: &str| {
        let n = side.steps.iter().filter(|s| s.bound.as_deref() == Some(bound)).count();
        100.0 * n as f64 / side.steps.len().max(1) as f64
    };
    let mut bounds: Vec<String> = a.steps.iter().chain(&b.steps).filter_map(|s| s.bound.clone()).collect();
    bounds.sort();
    bounds.dedup();
    (!bounds.is_empty()).then(|| {
        bounds.into_iter().map(|v| VerdictShare { a_pct: share(a, &v), b_pct: share(b, &v), bound: v }).collect()
    })
}

/// Kernels whose launches per step differ by more than half a launch.
fn kernel_changes(a: &SideSteps, b: &SideSteps) -> Option<Vec<KernelChange>> {
    let (ka, kb) = (a.kernels.as_ref()?, b.kernels.as_ref()?);
    let mut names: Vec<&String> = ka.iter().chain(kb).map(|(n, _)| n).collect();
    names.sort();
    names.dedup();
    let rate = |k: &[(String, f64)], n: &str| k.iter().find(|(m, _)| m == n).map_or(0.0, |(_, r)| *r);
    let mut out: Vec<KernelChange> = names
        .into_iter()
        .filter_map(|n| {
            let (ra, rb) = (rate(ka, n), rate(kb, n));
            let change = match (ra, rb) {
                _ if (ra - rb).abs() < 0.5 => return None,
                (0.0, _) => "appeared",
                (_, 0.0) => "disappeared",
                _ => "changed",
            };
            Some(KernelChange { kernel: n.clone(), a_per_step: ra, b_per_step: rb, change })
        })
        .collect();
    out.sort_by(|x, y| (y.b_per_step - y.a_per_step).abs().total_cmp(&(x.b_per_step - x.a_per_step).abs()));
    out.truncate(20);
    Some(out)
}

/// Every metric of one label compared (`noise_pct`: see [`compare_metric`]).
pub fn compare_label(label: &str, mut a: SideSteps, mut b: SideSteps, noise_pct: f64) -> LabelComparison {
    let energy_domains = common_energy(&mut a, &mut b);
    LabelComparison {
        label: label.to_owned(),
        steps_a: a.steps.len(),
        steps_b: b.steps.len(),
        metrics: METRICS.iter().map(|m| compare_metric(m, &a, &b, noise_pct)).collect(),
        verdicts: verdict_mix(&a, &b),
        kernels: kernel_changes(&a, &b),
        energy_domains,
        plots: [PlotSeries::of(&a), PlotSeries::of(&b)],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side(durations: &[f64], launches: f64, columns: &[&str]) -> SideSteps {
        SideSteps {
            steps: durations
                .iter()
                .map(|&d| StepValues {
                    duration_ms: d,
                    launches: Some(launches),
                    gpu_energy_j: Some(d),
                    ..Default::default()
                })
                .collect(),
            columns: columns.iter().map(|c| c.to_string()).collect(),
            kernels: None,
        }
    }

    fn change<'a>(l: &'a LabelComparison, name: &str) -> &'a MetricChange {
        l.metrics.iter().find(|m| m.metric == name).expect("metric")
    }

    #[test]
    fn a_slower_run_reads_slower_and_exact_counts_read_exactly() {
        let cols = ["duration_ns", "launches", "energy_j"];
        let a: Vec<f64> = (0..200).map(|i| 10.0 + (i % 7) as f64 * 0.1).collect();
        let b: Vec<f64> = a.iter().map(|d| d + 2.0).collect();
        let l = compare_label("train", side(&a, 50.0, &cols), side(&b, 50.0, &cols), 0.0);
        let p50 = change(&l, "step_p50");
        assert_eq!(p50.verdict, "slower");
        assert!((p50.change.expect("change") - 2.0).abs() < 1e-9);
        assert!(p50.ci_low.expect("ci") <= 2.0 && p50.ci_high.expect("ci") >= 2.0);
        assert_eq!(change(&l, "launches_per_step").verdict, "same");
        assert_eq!(change(&l, "gpu_energy_per_step").verdict, "higher");
        assert_eq!(l.energy_domains, vec!["GPU"]);
        let l = compare_label("train", side(&a, 50.0, &cols), side(&a, 51.0, &cols), 0.0);
        let launches = change(&l, "launches_per_step");
        assert_eq!((launches.verdict.as_str(), launches.change), ("higher", Some(1.0)));
        assert_eq!(change(&l, "step_p50").verdict, "no significant change");
    }

    #[test]
    fn a_column_one_profile_lacks_reads_not_in_that_side() {
        let a = side(&[1.0, 2.0], 3.0, &["duration_ns", "launches"]);
        let mut b = side(&[1.0, 2.0], 3.0, &["duration_ns", "launches", "cpu_ns"]);
        b.steps[0].cpu_ms = Some(0.5);
        let l = compare_label("train", a, b, 0.0);
        assert_eq!(change(&l, "cpu_p50").verdict, "not in A");
        assert_eq!(change(&l, "blocked_p50").verdict, "not in either");
        assert_eq!(change(&l, "data_wait_p50").verdict, "not in either");
        assert!(l.verdicts.is_none() && l.kernels.is_none());
    }

    #[test]
    fn kernels_that_appear_disappear_or_change_are_listed() {
        let mut a = side(&[1.0], 3.0, &["duration_ns"]);
        let mut b = a.clone();
        a.kernels = Some(vec![("gemm".into(), 4.0), ("relu".into(), 2.0), ("old".into(), 1.0)]);
        b.kernels = Some(vec![("gemm".into(), 8.0), ("relu".into(), 2.2), ("new".into(), 3.0)]);
        let k = compare_label("train", a, b, 0.0).kernels.expect("kernels");
        let got: Vec<(&str, &str)> = k.iter().map(|c| (c.kernel.as_str(), c.change)).collect();
        assert_eq!(got, vec![("gemm", "changed"), ("new", "appeared"), ("old", "disappeared")]);
    }
}
