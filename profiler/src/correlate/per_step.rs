//! Per-step figures from a session's steps and sample series: GPU energy and
//! GPUStatsMonitor's values at step start and end (`step_gpu`), RAPL package
//! and DRAM energy (`step_energy`), and the system values at each step's end
//! (`step_system`).
//!
//! Every step gets a row, ended or not: a step that never ended gets its
//! start-side values and None for whatever needs its end.
use super::{CounterSeries, GaugeSeries, IntervalEnergy, interval_energy, median};

/// One row of `steps`: the interval a step's figures describe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepSpan {
    pub label: String,
    pub step: i64,
    pub start_ns: u64,
    /// None: the step never ended.
    pub end_ns: Option<u64>,
}

/// One GPU's samples, one series per reading, (ts_ns, value) with its gaps left out.
#[derive(Clone, Debug, Default)]
pub struct GpuSeries {
    pub energy_j: Vec<(u64, f64)>,
    pub utilization_gpu_pct: Vec<(u64, f64)>,
    pub memory_used_mib: Vec<(u64, f64)>,
    pub memory_free_mib: Vec<(u64, f64)>,
    pub utilization_memory_pct: Vec<(u64, f64)>,
    pub fan_speed_pct: Vec<(u64, f64)>,
    pub temperature_gpu_c: Vec<(u64, f64)>,
    pub temperature_memory_c: Vec<(u64, f64)>,
}

/// A gauge at a step's start and at its end.
pub type StartEnd = [Option<f64>; 2];

/// One step's figures for one GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct StepGpu {
    pub label: String,
    pub step: i64,
    pub energy: Option<IntervalEnergy>,
    pub utilization_gpu_pct: StartEnd,
    pub memory_used_mib: StartEnd,
    pub memory_free_mib: StartEnd,
    pub utilization_memory_pct: StartEnd,
    pub fan_speed_end_pct: Option<f64>,
    pub temperature_gpu_end_c: Option<f64>,
    pub temperature_memory_end_c: Option<f64>,
}

/// Each step's figures for one GPU, and the energy counter's update period
/// (None with fewer than two distinct readings). A gauge reading counts within
/// `max_gap_ns` of the moment; the energy counter counts in `resolution_j`.
pub fn step_gpu(
    steps: &[StepSpan],
    series: GpuSeries,
    max_gap_ns: u64,
    resolution_j: f64,
) -> (Vec<StepGpu>, Option<u64>) {
    let energy = CounterSeries::from_samples(&series.energy_j, resolution_j);
    let gauge = |points: Vec<(u64, f64)>| GaugeSeries { points };
    let [util, used, free, umem, fan, temp, tmem] = [
        series.utilization_gpu_pct,
        series.memory_used_mib,
        series.memory_free_mib,
        series.utilization_memory_pct,
        series.fan_speed_pct,
        series.temperature_gpu_c,
        series.temperature_memory_c,
    ]
    .map(gauge);
    let rows = steps
        .iter()
        .map(|s| {
            let at_end = |g: &GaugeSeries| s.end_ns.and_then(|end| g.at(end, max_gap_ns));
            let both = |g: &GaugeSeries| [g.at(s.start_ns, max_gap_ns), at_end(g)];
            StepGpu {
                label: s.label.clone(),
                step: s.step,
                energy: s.end_ns.and_then(|end| interval_energy(&energy, s.start_ns, end)),
                utilization_gpu_pct: both(&util),
                memory_used_mib: both(&used),
                memory_free_mib: both(&free),
                utilization_memory_pct: both(&umem),
                fan_speed_end_pct: at_end(&fan),
                temperature_gpu_end_c: at_end(&temp),
                temperature_memory_end_c: at_end(&tmem),
            }
        })
        .collect();
    (rows, (!energy.is_empty()).then_some(energy.update_period_ns))
}

/// One step's CPU package and DRAM energy.
#[derive(Clone, Debug, PartialEq)]
pub struct StepEnergy {
    pub label: String,
    pub step: i64,
    pub cpu: Option<IntervalEnergy>,
    pub dram: Option<IntervalEnergy>,
    /// Whether either figure is below its counter's resolution; None without figures.
    pub below_resolution: Option<bool>,
    /// Why the step has no figure, when the reason is the step's own.
    pub note: Option<&'static str>,
}

/// Package and DRAM energy interpolated at each step's boundaries. Each
/// series is None when its domain was not read, and may hold fewer than two
/// samples.
pub fn step_energy(steps: &[StepSpan], package: Option<CounterSeries>, dram: Option<CounterSeries>) -> Vec<StepEnergy> {
    let (cpu_read, dram_read) = (package.is_some(), dram.is_some());
    let cpu = package.filter(|s| !s.is_empty());
    let dram = dram.filter(|s| !s.is_empty());
    let mut out = Vec::with_capacity(steps.len());
    for StepSpan { label, step, start_ns: start, end_ns } in steps {
        let (c, d, note) = match *end_ns {
            None => (None, None, Some("step never ended")),
            Some(end) => {
                let c = cpu.as_ref().and_then(|s| interval_energy(s, *start, end));
                let d = dram.as_ref().and_then(|s| interval_energy(s, *start, end));
                // Only reasons that belong to this step; a domain that is not
                // there at all is in capabilities.
                let note = if (cpu_read && cpu.is_none()) || (dram_read && dram.is_none()) {
                    Some("fewer than two RAPL samples in the session")
                } else if (cpu_read && c.is_none()) || (dram_read && d.is_none()) {
                    Some("step not inside the sampled range")
                } else {
                    None
                };
                (c, d, note)
            }
        };
        let below = (c.is_some() || d.is_some()).then(|| [c, d].iter().flatten().any(|e| e.below_resolution));
        out.push(StepEnergy { label: label.clone(), step: *step, cpu: c, dram: d, below_resolution: below, note });
    }
    out
}

/// System samples: every row's timestamp, and one series per column, split
/// into rates (each describes the interval that ends at its timestamp) and
/// levels (each the moment of its timestamp).
#[derive(Clone, Debug, Default)]
pub struct SystemSeries {
    pub ts: Vec<u64>,
    pub rates: Vec<Vec<(u64, f64)>>,
    pub levels: Vec<Vec<(u64, f64)>>,
}

/// The system values at one step's end, in [`SystemSeries`]' column order.
#[derive(Clone, Debug, PartialEq)]
pub struct StepSystem {
    pub label: String,
    pub step: i64,
    /// The sample the levels are read from, by the levels' rule.
    pub ts_ns: Option<u64>,
    pub rates: Vec<Option<f64>>,
    pub levels: Vec<Option<f64>>,
}

/// The sample whose interval (previous sample, this sample] contains `t`,
/// if it is within `max_gap_ns` after `t`. For rates, which describe the
/// interval that ends at their timestamp.
fn covering(points: &[(u64, f64)], t: u64, max_gap_ns: u64) -> Option<f64> {
    let i = points.partition_point(|&(pt, _)| pt < t);
    points.get(i).filter(|&&(pt, _)| pt - t <= max_gap_ns).map(|&(_, v)| v)
}

/// Each step's system values at its end: for a rate, the sample whose interval
/// contains the end; for a level, the latest sample at or before it (or the
/// first after it when there is none). A sample counts only within two
/// sampling intervals of the end; a step that never ended gets None throughout.
pub fn step_system(steps: &[StepSpan], series: SystemSeries) -> Vec<StepSystem> {
    // Two sampling intervals: a value further from the step's end than that
    // describes another moment, and is left None.
    let max_gap = median(series.ts.windows(2).map(|w| w[1] - w[0]).collect()) * 2;
    let levels: Vec<GaugeSeries> = series.levels.into_iter().map(|points| GaugeSeries { points }).collect();
    // Which sample a level is read from, by the levels' rule: its index
    // (exact as f64) stands in for the value, so ts_ns stays an integer.
    let samples = GaugeSeries { points: series.ts.iter().enumerate().map(|(i, &t)| (t, i as f64)).collect() };
    steps
        .iter()
        .map(|s| StepSystem {
            label: s.label.clone(),
            step: s.step,
            ts_ns: s.end_ns.and_then(|end| samples.at(end, max_gap)).map(|i| series.ts[i as usize]),
            rates: series.rates.iter().map(|r| s.end_ns.and_then(|end| covering(r, end, max_gap))).collect(),
            levels: levels.iter().map(|g| s.end_ns.and_then(|end| g.at(end, max_gap))).collect(),
        })
        .collect()
}
