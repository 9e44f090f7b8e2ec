//! The machine's live series: per GPU (NVML) and per RAPL domain, updated by the samplers'
//! threads after each sample.
use std::{collections::HashMap, sync::Arc};

use super::{
    Families, SeriesLabels,
    series::{GaugeFamily, Labels, LiveCounter, LiveGauge},
};
use crate::{
    correlate::power::mean_power_w,
    store::{GpuSampleRow, RaplSampleRow},
};

const MIB: f64 = 1024.0 * 1024.0;

/// A GPU's series, each made on its first value: one NVML never gave is absent, not 0.
#[derive(Default)]
struct GpuSeries {
    util: Option<LiveGauge>,
    memory: Option<LiveGauge>,
    power: Option<LiveGauge>,
    energy: Option<LiveCounter>,
    temp: Option<LiveGauge>,
    /// The energy reading already published (J since the session's first).
    energy_j: f64,
}

/// Sets `v` in the series `slot` holds, made from `family` when `v` is the first.
fn set(slot: &mut Option<LiveGauge>, family: &GaugeFamily, labels: &Labels, v: Option<f64>) {
    if let Some(v) = v {
        slot.get_or_insert_with(|| family.series(labels)).set(v);
    }
}

struct DomainSeries {
    power: LiveGauge,
    energy: LiveCounter,
    /// (ns, J) of the last reading.
    last: Option<(u64, f64)>,
}

/// The GPU and RAPL series; each sampler owns a clone, which holds the series it publishes.
pub struct MachineMetrics {
    families: Arc<Families>,
    labels: SeriesLabels,
    gpus: HashMap<u32, GpuSeries>,
    domains: HashMap<&'static str, DomainSeries>,
}

impl Clone for MachineMetrics {
    fn clone(&self) -> Self {
        Self::new(self.families.clone(), self.labels.clone())
    }
}

impl MachineMetrics {
    pub(super) fn new(families: Arc<Families>, labels: SeriesLabels) -> Self {
        Self { families, labels, gpus: HashMap::new(), domains: HashMap::new() }
    }

    /// Publishes one GPU sample.
    pub fn gpu_sample(&mut self, row: &GpuSampleRow) {
        let f = &self.families;
        let l = self.labels.machine(("gpu", row.gpu.to_string()));
        let s = self.gpus.entry(row.gpu).or_default();
        set(&mut s.util, &f.gpu_util, &l, row.utilization_gpu_pct.map(|p| p / 100.0));
        set(&mut s.memory, &f.gpu_memory, &l, row.memory_used_mib.map(|m| m * MIB));
        set(&mut s.power, &f.gpu_power, &l, row.power_w);
        set(&mut s.temp, &f.gpu_temp, &l, row.temperature_gpu_c);
        if let Some(j) = row.energy_j {
            s.energy.get_or_insert_with(|| f.gpu_energy.series(&l)).add(j - s.energy_j);
            s.energy_j = s.energy_j.max(j);
        }
    }

    /// Publishes one RAPL reading per domain: its energy, and the power since the last reading.
    pub fn rapl_sample(&mut self, rows: &[RaplSampleRow]) {
        for r in rows {
            let (f, labels) = (&self.families, &self.labels);
            let d = self.domains.entry(r.domain).or_insert_with(|| {
                let l = labels.machine(("domain", r.domain.to_owned()));
                DomainSeries { power: f.cpu_power.series(&l), energy: f.cpu_energy.series(&l), last: None }
            });
            if let Some((ns, j)) = d.last {
                d.energy.add(r.energy_j - j);
                if let Some(w) = mean_power_w((ns, j), (r.ts_ns, r.energy_j)) {
                    d.power.set(w);
                }
            } else {
                d.energy.add(r.energy_j);
            }
            d.last = Some((r.ts_ns, r.energy_j));
        }
    }
}
