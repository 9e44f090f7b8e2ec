//! NVML GPM (GPU Performance Monitoring, Hopper and newer): tensor-core, SM
//! and DRAM-bandwidth activity of each GPU over the interval between two GPM
//! samples, taken on the GPU sampler's thread at least [`MIN_INTERVAL_NS`]
//! apart. A GPU without GPM gets NULLs and one reason per metric in
//! `capabilities`.
//!
//! Readings are the whole GPU's, like NVML's other readings (MIG instances
//! are not sampled one by one).
use nvml_wrapper::{Device, GpmSample, Nvml, enums::gpm::GpmMetricId, error::NvmlError, gpm::gpm_metrics_get};
use nvml_wrapper_sys::bindings::nvmlGpmSample_t;

use super::CapabilityLog;
use crate::store::GpmReadings;

/// NVML's advice: GPM metrics over shorter intervals are noisy; NVIDIA's own
/// tools (DCGM) use 100 ms or more.
pub const MIN_INTERVAL_NS: u64 = 100_000_000;

/// The metrics read, in [`GpmReadings`]' order, with their `capabilities` names.
const METRICS: [(GpmMetricId, &str); 6] = [
    (GpmMetricId::AnyTensorUtil, "gpm.tensor_util"),
    (GpmMetricId::HmmaTensorUtil, "gpm.hmma_util"),
    (GpmMetricId::DfmaTensorUtil, "gpm.dfma_util"),
    (GpmMetricId::SmUtil, "gpm.sm_util"),
    (GpmMetricId::SmOccupancy, "gpm.sm_occupancy"),
    (GpmMetricId::DramBwUtil, "gpm.dram_bw_util"),
];

/// The last GPM sample of one GPU, kept between ticks as its raw handle:
/// a `GpmSample` borrows the `Nvml` that the GPU sampler owns, so it cannot
/// sit beside it in the sampler.
struct Held {
    handle: nvmlGpmSample_t,
    ts_ns: u64,
}

struct GpmGpu {
    logical: u32,
    /// Err: why the GPU has no GPM readings.
    support: Result<(), String>,
    held: Option<Held>,
    /// The last tick that read this GPU: GPM after `held` up to it is not yet covered.
    last_tick_ns: u64,
}

/// GPM state of the sampled GPUs, in the GPU sampler's order.
#[derive(Default)]
pub struct GpmState {
    gpus: Vec<GpmGpu>,
}

// The raw handles are only touched on the sampler's thread, which owns this.
unsafe impl Send for GpmState {}

/// Why `dev` has no GPM, if it has none.
fn support(dev: &Device<'_>) -> Result<(), String> {
    match dev.gpm_support() {
        Ok(true) => Ok(()),
        Ok(false) => Err("the GPU has no GPM (NVML GPM needs Hopper or newer)".into()),
        Err(NvmlError::FailedToLoadSymbol(e)) => {
            Err(format!("this NVML has no GPM API ({e}); GPM needs driver 520 or newer"))
        }
        Err(e) => Err(format!("NVML GPM: {e}")),
    }
}

impl GpmState {
    /// Adds the next sampled GPU (logical number `logical`).
    pub fn add(&mut self, dev: &Device<'_>, logical: u32) {
        self.gpus.push(GpmGpu { logical, support: support(dev), held: None, last_tick_ns: 0 });
    }

    /// GPM readings of the `k`-th GPU (`dev`) over the interval since its
    /// previous GPM sample, when at least [`MIN_INTERVAL_NS`] have passed;
    /// None when no interval closes now (the first sample, too soon, no GPM).
    /// A failed sample keeps the previous one: the next interval is longer.
    pub fn read(
        &mut self,
        k: usize,
        nvml: &Nvml,
        dev: &Device<'_>,
        now_ns: u64,
        caps: &mut CapabilityLog,
    ) -> Option<GpmReadings> {
        let g = self.gpus.get_mut(k)?;
        let l = g.logical;
        if let Err(why) = &g.support {
            for (_, name) in METRICS {
                caps.record(&format!("GPU_{l}/{name}"), false, Some(why.clone()));
            }
            return None;
        }
        g.last_tick_ns = now_ns;
        if g.held.as_ref().is_some_and(|h| now_ns.saturating_sub(h.ts_ns) < MIN_INTERVAL_NS) {
            return None;
        }
        let new = match dev.gpm_sample() {
            Ok(s) => s,
            Err(e) => {
                caps.record(&format!("GPU_{l}/gpm.sample"), false, Some(format!("NVML GPM sample: {e}")));
                return None;
            }
        };
        let handle = new.into_handle();
        // The first sample opens the first interval.
        let prev = g.held.replace(Held { handle, ts_ns: now_ns })?;
        // SAFETY: both handles came from `into_handle` on samples of this
        // `nvml` and are wrapped once each here: `prev`, taken out of `held`,
        // is freed when `before` drops; `after` gives its handle back below.
        let (before, after) =
            unsafe { (GpmSample::from_handle(nvml, prev.handle), GpmSample::from_handle(nvml, handle)) };
        let ids = METRICS.map(|(id, _)| id);
        let results = gpm_metrics_get(nvml, &before, &after, &ids);
        // `after` stays held for the next interval.
        let _ = after.into_handle();
        let results = match results {
            Ok(r) => r,
            Err(e) => {
                caps.record(&format!("GPU_{l}/gpm.metrics"), false, Some(format!("NVML GPM metrics: {e}")));
                return None;
            }
        };
        let mut values = [None; 6];
        for ((v, r), (_, name)) in values.iter_mut().zip(&results).zip(METRICS) {
            let r = r.as_ref().map(|m| m.value).map_err(|e| format!("NVML GPM: {e}"));
            caps.note(&format!("GPU_{l}/{name}"), &r);
            *v = r.ok();
        }
        let [tensor_util_pct, hmma_util_pct, dfma_util_pct, sm_util_pct, sm_occupancy_pct, dram_bw_util_pct] = values;
        Some(GpmReadings {
            start_ns: prev.ts_ns,
            tensor_util_pct,
            hmma_util_pct,
            dfma_util_pct,
            sm_util_pct,
            sm_occupancy_pct,
            dram_bw_util_pct,
        })
    }

    /// How long until every held sample that the last tick could not close
    /// (too soon) is [`MIN_INTERVAL_NS`] old: one more tick then closes an
    /// interval on every GPU, so GPM covers the session up to its last tick.
    /// None when every GPU's GPM is covered up to its last tick.
    pub fn wait_to_close_ns(&self, now_ns: u64) -> Option<u64> {
        self.gpus
            .iter()
            .filter_map(|g| g.held.as_ref().filter(|h| h.ts_ns < g.last_tick_ns))
            .map(|h| (h.ts_ns + MIN_INTERVAL_NS).saturating_sub(now_ns))
            .max()
    }

    /// Frees the held samples; before `nvml` goes.
    pub fn release(&mut self, nvml: &Nvml) {
        for h in self.gpus.iter_mut().filter_map(|g| g.held.take()) {
            // SAFETY: taken out of `held`, so wrapped (and freed) once.
            drop(unsafe { GpmSample::from_handle(nvml, h.handle) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// A GPU whose last GPM sample was at `held_ms` and last tick at `tick_ms`.
    fn state(held_ms: u64, tick_ms: u64) -> GpmState {
        let held = Some(Held { handle: std::ptr::null_mut(), ts_ns: held_ms * MS });
        GpmState { gpus: vec![GpmGpu { logical: 0, support: Ok(()), held, last_tick_ns: tick_ms * MS }] }
    }

    #[test]
    fn the_end_is_waited_for_only_when_the_last_tick_closed_no_interval() {
        // The last tick took the sample: covered to it, no wait.
        assert_eq!(state(500, 500).wait_to_close_ns(510 * MS), None);
        // The last tick came 30 ms after the sample: 70 ms more from then, 60 from now.
        assert_eq!(state(500, 530).wait_to_close_ns(540 * MS), Some(60 * MS));
        assert_eq!(state(500, 530).wait_to_close_ns(700 * MS), Some(0));
        // Nothing held (no GPM, or not sampled yet): nothing to wait for.
        assert_eq!(GpmState::default().wait_to_close_ns(0), None);
    }
}
