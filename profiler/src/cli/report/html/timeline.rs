//! The whole-session part of a page: GPU utilisation, memory, power and
//! temperature and CPU/DRAM power over time with the steps shaded behind
//! them, and the top kernels by launches and GEMM shapes by FLOPs.
use std::collections::BTreeMap;

use super::{
    data::{GemmShape, GpuSeries, why_missing},
    downsample::{BUCKETS, min_max},
    page::Page,
    plots::{Figure, Frame, LineChart, ranked_bars, si},
    steps::{legend_of, line},
};
use crate::profile::{
    kernels::{TopKernel, kernel_display},
    sessions::CapabilityRow,
    steps::StepRow,
};

/// Shaded intervals behind a timeline at most (a pixel column each, at worst).
const BANDS: usize = 500;

/// The session's step intervals, in s from its start, for shading: steps
/// whose gap is below a pixel are merged; if that still leaves more than
/// [`BANDS`] intervals, the time axis is cut in columns and a column counts as
/// in a step when steps cover half of it.
pub fn step_bands(steps: &[StepRow], started_ns: i64) -> Vec<(f64, f64)> {
    let mut spans: Vec<(f64, f64)> = steps
        .iter()
        .filter_map(|s| s.end_ns.map(|e| ((s.start_ns - started_ns) as f64 / 1e9, (e - started_ns) as f64 / 1e9)))
        .collect();
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (Some(first), Some(last)) = (spans.first(), spans.iter().map(|s| s.1).reduce(f64::max)) else {
        return Vec::new();
    };
    let (t0, pixel) = (first.0, (last - first.0) / 1000.0);
    let mut merged: Vec<(f64, f64)> = Vec::new();
    for (a, b) in spans.iter().copied() {
        match merged.last_mut() {
            Some(m) if a - m.1 < pixel => m.1 = m.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    if merged.len() <= BANDS {
        return merged;
    }
    let width = (last - t0) / BANDS as f64;
    let mut covered = vec![0.0; BANDS];
    for (a, b) in merged {
        let (i0, i1) = (((a - t0) / width) as usize, (((b - t0) / width) as usize).min(BANDS - 1));
        for (i, c) in covered.iter_mut().enumerate().take(i1 + 1).skip(i0) {
            let (c0, c1) = (t0 + i as f64 * width, t0 + (i + 1) as f64 * width);
            *c += (b.min(c1) - a.max(c0)).max(0.0);
        }
    }
    let mut bands: Vec<(f64, f64)> = Vec::new();
    for (i, c) in covered.iter().enumerate() {
        if *c < width / 2.0 {
            continue;
        }
        let (c0, c1) = (t0 + i as f64 * width, t0 + (i + 1) as f64 * width);
        match bands.last_mut() {
            Some(b) if (b.1 - c0).abs() < width / 2.0 => b.1 = c1,
            _ => bands.push((c0, c1)),
        }
    }
    bands
}

/// Utilisation, memory, power and temperature: one chart each, a line per GPU.
pub fn gpus(
    page: &mut Page,
    anchor: &str,
    series: &BTreeMap<i64, GpuSeries>,
    bands: &[(f64, f64)],
    caps: &[CapabilityRow],
) -> anyhow::Result<()> {
    type Pick = fn(&GpuSeries) -> &Vec<(f64, f64)>;
    let metrics: [(&str, &str, &str, Pick); 4] = [
        ("gpu-util", "GPU utilisation", "utilization.gpu", |g| &g.utilization_pct),
        ("gpu-memory", "GPU memory used", "memory.used", |g| &g.memory_used_mib),
        ("gpu-power", "GPU power", "power", |g| &g.power_w),
        ("gpu-temperature", "GPU temperature", "temperature.gpu", |g| &g.temperature_c),
    ];
    let units = ["utilisation (%)", "memory used (MiB)", "power (W)", "temperature (°C)"];
    for ((key, title, metric, pick), unit) in metrics.into_iter().zip(units) {
        let id = format!("{anchor}-{key}");
        let lines: Vec<_> = series
            .iter()
            .filter(|(_, g)| !pick(g).is_empty())
            .enumerate()
            .map(|(i, (gpu, g))| line(i, &format!("GPU {gpu}"), min_max(pick(g), BUCKETS)))
            .collect();
        let drawn = timeline(page, &id, title, unit, LineChart { lines, bands: bands.to_vec(), ..Default::default() })?;
        if !drawn {
            let first = series.keys().next().copied().unwrap_or(0);
            let why = why_missing(caps, "nvml", &format!("GPU_{first}/{metric}"))
                .unwrap_or_else(|| "no GPU samples in this session (--no-gpu, or no GPU)".into());
            page.missing(&id, title, &why);
        }
    }
    Ok(())
}

/// CPU package and DRAM power over time.
pub fn rapl(
    page: &mut Page,
    anchor: &str,
    power: [Vec<(f64, f64)>; 2],
    bands: &[(f64, f64)],
    caps: &[CapabilityRow],
) -> anyhow::Result<()> {
    let [package, dram] = power;
    for (name, metric, points) in [("CPU package", "cpu_power", &package), ("DRAM", "ram_power", &dram)] {
        if points.is_empty() {
            let why = why_missing(caps, "rapl", metric).unwrap_or_else(|| "no RAPL readings in this session".into());
            page.missing(&format!("{anchor}-{metric}"), &format!("{name} power"), &why);
        }
    }
    let lines = vec![line(0, "CPU package", min_max(&package, BUCKETS)), line(1, "DRAM", min_max(&dram, BUCKETS))];
    let chart = LineChart { lines, bands: bands.to_vec(), ..Default::default() };
    timeline(page, &format!("{anchor}-rapl-power"), "CPU package and DRAM power", "power (W)", chart)?;
    Ok(())
}

/// A chart over session time; false when it has nothing to draw.
fn timeline(page: &mut Page, id: &str, title: &str, unit: &str, chart: LineChart) -> anyhow::Result<bool> {
    let n: usize = chart.lines.iter().map(|l| l.points.len()).sum();
    let desc = format!("{title} over the session, {n} points; shaded: time inside steps.");
    let frame = Frame { id, title, desc, x_label: "time since the session started (s)", y_label: unit };
    let Some(svg) = super::plots::line_chart(&frame, &chart)? else { return Ok(false) };
    let note = Some(format!(
        "Shaded: time inside steps. At most {} points per line: the smallest and largest sample of each run.",
        2 * BUCKETS
    ));
    page.figure(&Figure { id: id.to_owned(), title: title.to_owned(), svg, legend: legend_of(&chart.lines), note });
    Ok(true)
}

/// The most launched kernels, and the GEMM shapes with the most FLOPs where
/// the session recorded GEMMs.
pub fn kernels(page: &mut Page, anchor: &str, top: Option<&[TopKernel]>, gemms: &[GemmShape]) -> anyhow::Result<()> {
    let id = format!("{anchor}-top-kernels");
    let title = "Top kernels by launches (whole session)";
    match top {
        None => page.missing(&id, title, "launch rows were not kept (--launches count)"),
        Some([]) => page.missing(&id, title, "no launches were recorded"),
        Some(top) => {
            let values: Vec<f64> = top.iter().map(|k| k.launches as f64).collect();
            let names: Vec<String> = top
                .iter()
                .map(|k| kernel_display(k.name.as_deref(), k.demangled_name.as_deref(), k.api.as_deref(), k.function))
                .collect();
            let desc = format!("{} kernels ranked by launches; names in the table below.", top.len());
            let frame = Frame { id: &id, title, desc, x_label: "launches", y_label: "rank" };
            if let Some(svg) = ranked_bars(&frame, &values, "")? {
                page.figure(&Figure { id: id.clone(), title: title.into(), svg, legend: Vec::new(), note: None });
            }
            let rows: Vec<Vec<String>> = top
                .iter()
                .zip(names)
                .enumerate()
                .map(|(i, (k, n))| {
                    vec![format!("#{}", i + 1), k.launches.to_string(), format!("{:.1}%", 100.0 * k.share), n]
                })
                .collect();
            page.table(&format!("{id}-names"), "Top kernels", &["rank", "launches", "share", "kernel"], &rows);
        }
    }
    if gemms.is_empty() {
        return Ok(());
    }
    let id = format!("{anchor}-top-gemms");
    let title = "Top GEMM shapes by FLOPs (cuBLAS calls, whole session)";
    let values: Vec<f64> = gemms.iter().map(|g| g.flops).collect();
    let desc = format!("{} GEMM shapes ranked by FLOPs; shapes in the table below.", gemms.len());
    let frame = Frame { id: &id, title, desc, x_label: "FLOP", y_label: "rank" };
    if let Some(svg) = ranked_bars(&frame, &values, "FLOP")? {
        page.figure(&Figure { id: id.clone(), title: title.into(), svg, legend: Vec::new(), note: None });
    }
    let rows: Vec<Vec<String>> = gemms
        .iter()
        .enumerate()
        .map(|(i, g)| vec![format!("#{}", i + 1), si(g.flops, "FLOP"), g.calls.to_string(), g.shape.clone()])
        .collect();
    page.table(&format!("{id}-names"), "Top GEMM shapes", &["rank", "FLOPs", "calls", "op m×n×k type"], &rows);
    Ok(())
}
