//! Per step and GPU: NVML GPM readings over the step, the step's GEMM FLOPs
//! share, MFU and its GPM estimate (`step_gpu`'s GPM and MFU columns).
//!
//! A step's FLOPs are split across the GPUs the target used (NVML's process
//! list: `gpus.used_by_target`); when NVML named none (a PID namespace hides
//! the target, or it had not yet made a CUDA context when the list was read),
//! across every sampled GPU. The other GPUs get no FLOPs and no MFU.
use super::{
    GaugeSeries,
    gpm::{Reading, held_mean, interval_mean},
    mfu::{DEFAULT_PRECISION, Peaks, Precision, mfu_gpm_pct, mfu_pct, split},
    per_step::StepSpan,
};

/// A step, its GEMM FLOPs, and its dominant precision (see [`super::mfu::dominant`]).
#[derive(Clone, Debug, PartialEq)]
pub struct StepFlops {
    pub span: StepSpan,
    /// `steps.flops`: None when no BLAS library was probed.
    pub flops: Option<i64>,
    /// None: the step has no GEMM rows; `Some(None)`: an unknown precision.
    pub precision: Option<Option<Precision>>,
}

/// A sampled GPU as MFU needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuForMfu {
    pub gpu: u32,
    pub name: Option<String>,
    pub max_sm_clock_mhz: Option<f64>,
    pub used_by_target: bool,
}

/// One GPU's GPM readings, one series per metric in `GpmReadings`' order, and its SM clock.
#[derive(Clone, Debug, Default)]
pub struct GpmSeries {
    pub readings: [Vec<Reading>; 6],
    pub sm_clock_mhz: GaugeSeries,
}

/// One step's GPM and MFU figures on one GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct StepGpuMfu {
    pub label: String,
    pub step: i64,
    pub gpu: u32,
    /// Time-weighted over the step, in `GpmReadings`' order.
    pub gpm: [Option<f64>; 6],
    pub flops: Option<i64>,
    pub mfu_pct: Option<f64>,
    pub mfu_gpm_pct: Option<f64>,
}

/// Figures for every step on every GPU (`gpus[i]`'s readings in `series[i]`).
/// The SM clock counts within `max_gap_ns` of a moment.
pub fn step_mfu(steps: &[StepFlops], gpus: &[GpuForMfu], series: &[GpmSeries], max_gap_ns: u64) -> Vec<StepGpuMfu> {
    let any_used = gpus.iter().any(|g| g.used_by_target);
    let attributed: Vec<bool> = gpus.iter().map(|g| g.used_by_target || !any_used).collect();
    let n = attributed.iter().filter(|&&a| a).count();
    let mut out = Vec::with_capacity(steps.len() * gpus.len());
    for s in steps {
        let span = &s.span;
        let ended = span.end_ns.map(|e| (span.start_ns, e));
        let duration_ns = ended.map(|(a, b)| b.saturating_sub(a));
        let precision = s.precision.unwrap_or(Some(DEFAULT_PRECISION));
        let mut shares = s.flops.map(|f| split(f, n)).unwrap_or_default().into_iter();
        for ((g, gs), &counted) in gpus.iter().zip(series).zip(&attributed) {
            let gpm = gs.readings.each_ref().map(|r| ended.and_then(|(a, b)| interval_mean(r, a, b)));
            let flops = if counted { shares.next() } else { None };
            let peak = g.name.as_deref().and_then(Peaks::of_gpu).zip(precision).and_then(|(p, x)| p.flops_per_s(x));
            let clock = ended.and_then(|(a, b)| held_mean(&gs.sm_clock_mhz, a, b, max_gap_ns));
            let gpm_estimate = match (counted, gpm[0], clock, g.max_sm_clock_mhz) {
                (true, Some(tensor), Some(clock), Some(max)) => mfu_gpm_pct(tensor, clock, max),
                _ => None,
            };
            out.push(StepGpuMfu {
                label: span.label.clone(),
                step: span.step,
                gpu: g.gpu,
                gpm,
                flops,
                mfu_pct: flops.zip(peak).zip(duration_ns).and_then(|((f, p), d)| mfu_pct(f, p, d)),
                mfu_gpm_pct: gpm_estimate,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn step(step: i64, start_ms: u64, end_ms: Option<u64>, flops: Option<i64>) -> StepFlops {
        let span = StepSpan { label: "train".into(), step, start_ns: start_ms * MS, end_ns: end_ms.map(|e| e * MS) };
        StepFlops { span, flops, precision: None }
    }

    fn gpu(gpu: u32, name: &str, used_by_target: bool) -> GpuForMfu {
        GpuForMfu { gpu, name: Some(name.into()), max_sm_clock_mhz: Some(1980.0), used_by_target }
    }

    /// Tensor activity 40 % over (0, 100 ms], 80 % over (100, 200 ms]; other
    /// metrics 1..5 %; the SM clock 1485 MHz throughout.
    fn series() -> GpmSeries {
        let two = |a: f64, b: f64| {
            vec![
                Reading { start_ns: 0, end_ns: 100 * MS, value: a },
                Reading { start_ns: 100 * MS, end_ns: 200 * MS, value: b },
            ]
        };
        let readings = [two(40.0, 80.0), two(1.0, 1.0), two(2.0, 2.0), two(3.0, 3.0), two(4.0, 4.0), two(5.0, 5.0)];
        GpmSeries { readings, sm_clock_mhz: GaugeSeries { points: vec![(0, 1485.0), (150 * MS, 1485.0)] } }
    }

    #[test]
    fn flops_split_across_the_used_gpus_and_mfu_is_exact() {
        // 50 ms on two H100 SXM at BF16 (989.5 TFLOP/s): 49.475 TFLOP each is 100 %.
        let steps = [step(0, 75, Some(125), Some(2 * 24_737_500_000_000))];
        let gpus = [gpu(0, "NVIDIA H100 80GB HBM3", true), gpu(1, "NVIDIA H100 80GB HBM3", true)];
        let rows = step_mfu(&steps, &gpus, &[series(), series()], 100 * MS);
        assert_eq!(rows.len(), 2);
        for r in &rows {
            assert_eq!(r.flops, Some(24_737_500_000_000));
            assert!((r.mfu_pct.expect("mfu") - 50.0).abs() < 1e-9, "{r:?}");
            // 25 ms at 40 %, 25 ms at 80 %: 60 %; times 1485 / 1980.
            assert_eq!(r.gpm, [Some(60.0), Some(1.0), Some(2.0), Some(3.0), Some(4.0), Some(5.0)]);
            assert!((r.mfu_gpm_pct.expect("estimate") - 45.0).abs() < 1e-9, "{r:?}");
        }
    }

    #[test]
    fn only_gpus_the_target_used_get_flops() {
        let steps = [step(0, 10, Some(20), Some(1_000_000_000_001))];
        let gpus = [gpu(0, "NVIDIA A100-SXM4-80GB", false), gpu(1, "NVIDIA A100-SXM4-80GB", true)];
        let rows = step_mfu(&steps, &gpus, &[series(), series()], 100 * MS);
        assert_eq!((rows[0].flops, rows[0].mfu_pct, rows[0].mfu_gpm_pct), (None, None, None));
        assert_eq!(rows[0].gpm[0], Some(40.0), "GPM readings stay on every GPU");
        assert_eq!(rows[1].flops, Some(1_000_000_000_001));
        // 1 TFLOP in 10 ms on a 312 TFLOP/s A100: 100 / 3.12 %.
        assert!((rows[1].mfu_pct.expect("mfu") - 100.0 / 3.12).abs() < 1e-6);
        // None named by NVML: every sampled GPU shares, the remainder on the first.
        let gpus = [gpu(0, "NVIDIA A100-SXM4-80GB", false), gpu(1, "NVIDIA A100-SXM4-80GB", false)];
        let rows = step_mfu(&steps, &gpus, &[series(), series()], 100 * MS);
        assert_eq!((rows[0].flops, rows[1].flops), (Some(500_000_000_001), Some(500_000_000_000)));
    }

    #[test]
    fn unknown_gpus_precisions_and_missing_flops_give_no_mfu() {
        let mut s = step(0, 10, Some(20), Some(1_000_000));
        let rows = step_mfu(&[s.clone()], &[gpu(0, "Tesla T4", true)], &[series()], 100 * MS);
        assert_eq!((rows[0].flops, rows[0].mfu_pct), (Some(1_000_000), None), "T4 is not in the table");
        s.precision = Some(None);
        let h100 = [gpu(0, "NVIDIA H100 PCIe", true)];
        assert_eq!(step_mfu(&[s.clone()], &h100, &[series()], 100 * MS)[0].mfu_pct, None, "unknown precision");
        // FP32 GEMMs on an H100 PCIe: 51 TFLOP/s.
        s.precision = Some(Some(Precision::Fp32));
        let mfu = step_mfu(&[s], &h100, &[series()], 100 * MS)[0].mfu_pct.expect("mfu");
        assert!((mfu - 100.0 * 1e6 / (51e12 * 0.01)).abs() < 1e-12, "{mfu}");
        // No BLAS library: no FLOPs, no MFU; the GPM estimate still there.
        let rows = step_mfu(&[step(0, 10, Some(20), None)], &h100, &[series()], 100 * MS);
        assert_eq!((rows[0].flops, rows[0].mfu_pct), (None, None));
        assert_eq!(rows[0].mfu_gpm_pct, Some(30.0));
        // A step that never ended has no figures at all.
        let rows = step_mfu(&[step(0, 10, None, Some(5))], &h100, &[series()], 100 * MS);
        assert_eq!((rows[0].gpm[0], rows[0].mfu_pct, rows[0].mfu_gpm_pct), (None, None, None));
    }
}
