//! The per-label part of a session's page: step time with its percentiles
//! and the inter-step gap, the PyTorch phases, energy per step by source,
//! launches, sync-wait share and FLOPs per step. Long sessions are
//! downsampled (min/max per bucket for lines, means per bar for stacks).
use std::collections::HashMap;

use super::super::build::LabelReport;
use super::{
    data::{PerStep, StepEnergy, why_missing},
    downsample::{BUCKETS, chunks, min_max},
    page::Page,
    plots::{Bar, Figure, Frame, LegendEntry, Line, LineChart, Mark, Stroke, line_chart, look, stacked_bars},
};
use crate::profile::{sessions::CapabilityRow, steps::StepRow};

/// Bars per stacked chart at most; more steps share a bar (their mean).
const BARS: usize = 400;

/// One label's steps in start order (the order `--skip` counts in) and what
/// the page needs besides.
pub struct LabelSteps<'a> {
    pub anchor: String,
    pub figures: &'a LabelReport,
    pub rows: Vec<&'a StepRow>,
    pub caps: &'a [CapabilityRow],
    /// GPU index → name, for the energy legend.
    pub gpu_names: Vec<(i64, String)>,
}

fn ms(ns: i64) -> f64 {
    ns as f64 / 1e6
}

impl LabelSteps<'_> {
    fn frame<'b>(&'b self, id: &'b str, title: &'b str, y_label: &'b str, desc: String) -> Frame<'b> {
        Frame { id, title, desc, x_label: "step (in start order)", y_label }
    }

    /// The warm-up steps' x interval, if any were skipped.
    fn warmup(&self) -> Option<(f64, f64)> {
        let k = self.figures.skipped as f64;
        (k > 0.0).then(|| (-0.5, k - 0.5))
    }

    /// (ordinal, value) of every step where `f` has a value.
    fn series(&self, f: impl Fn(&StepRow) -> Option<f64>) -> Vec<(f64, f64)> {
        self.rows.iter().enumerate().filter_map(|(i, s)| f(s).map(|v| (i as f64, v))).collect()
    }

    fn note(&self, kept: usize, n: usize) -> Option<String> {
        let warm = if self.figures.skipped > 0 {
            format!(
                "Shaded: the first {} steps, warm-up (--skip), left out of the text report's figures. ",
                self.figures.skipped
            )
        } else {
            String::new()
        };
        let sampled = if kept < n {
            format!(
                "{n} steps drawn as {kept} points: the smallest and largest value of each run of consecutive steps."
            )
        } else {
            String::new()
        };
        (!warm.is_empty() || !sampled.is_empty()).then(|| format!("{warm}{sampled}"))
    }

    /// Step time per step, p50/p90/p99 lines, and the inter-step gap.
    pub fn step_time(&self, page: &mut Page) -> anyhow::Result<()> {
        let id = format!("{}-step-time", self.anchor);
        let title = format!("Step time per step ({})", self.figures.label);
        let all = self.series(|s| s.duration_ns.map(ms));
        let gaps = self.series(|s| s.inter_step_ns.map(ms));
        let steps = min_max(&all, BUCKETS);
        let mut marks = Vec::new();
        if let Some(p) = &self.figures.step_time_ms {
            // Equal percentiles share one line, named by all of them.
            for (name, v) in [("p50", p.p50), ("p90", p.p90), ("p99", p.p99)] {
                match marks.last_mut() {
                    Some(m @ Mark { .. }) if m.value == v => m.name = format!("{name} = {}", m.name),
                    _ => marks.push(Mark { name: format!("{name} {v:.3} ms"), value: v }),
                }
            }
        }
        let desc = format!(
            "{} completed steps; step time p50 {}; the gap before each step is the second line.",
            all.len(),
            self.figures.step_time_ms.as_ref().map_or("not measured".into(), |p| format!("{:.3} ms", p.p50))
        );
        let kept = steps.len();
        let lines = vec![line(0, "step time", steps), line(1, "inter-step gap", min_max(&gaps, BUCKETS))];
        let chart = LineChart { lines, marks, warmup: self.warmup(), ..Default::default() };
        match line_chart(&self.frame(&id, &title, "time (ms)", desc), &chart)? {
            Some(svg) => {
                let mut legend = legend_of(&chart.lines);
                legend.push(LegendEntry {
                    name: "p50, p90, p99 of the measured steps".into(),
                    colour: plotters::style::RGBColor(90, 90, 90),
                    stroke: Stroke::Dashed,
                    filled: false,
                });
                page.figure(&Figure { id, title, svg, legend, note: self.note(kept, all.len()) });
            }
            None => page.missing(&id, &title, "no step of this label ended"),
        }
        Ok(())
    }

    /// Where each step's time went, stacked (see [`time_parts`]): drawn when
    /// the steps have any of the columns beyond their duration.
    pub fn phases(&self, page: &mut Page) -> anyhow::Result<()> {
        let any = |s: &&StepRow| {
            [s.data_wait_ns, s.copy_ns, s.sync_wait_ns, s.collective_ns, s.cpu_ns].iter().any(Option::is_some)
        };
        if !self.rows.iter().any(any) {
            return Ok(());
        }
        let id = format!("{}-phases", self.anchor);
        let title = format!("Where step time goes ({})", self.figures.label);
        let done: Vec<(usize, &StepRow)> =
            self.rows.iter().copied().enumerate().filter(|(_, s)| s.duration_ns.is_some()).collect();
        let bars = mean_bars(&done, |s| (time_parts(s), None));
        let desc = format!(
            "Per step, bottom to top: {}, in ms; each part takes what the ones below it leave of the step \
             (a wait spent spinning on a CPU counts once, as the wait).",
            TIME_PARTS.join(", ")
        );
        let frame = self.frame(&id, &title, "time (ms)", desc);
        if let Some(svg) = stacked_bars(&frame, &bars, self.warmup())? {
            let note = per_bar_note(done.len(), bars.len());
            page.figure(&Figure { id, title, svg, legend: stack_legend(&TIME_PARTS), note });
        }
        Ok(())
    }

    /// Energy per step stacked by source with its error bound; a source that
    /// was not measured is said so, with the reason, never drawn as zero.
    pub fn energy(&self, page: &mut Page, e: &StepEnergy) -> anyhow::Result<()> {
        let id = format!("{}-energy", self.anchor);
        let title = format!("Energy per step by source ({})", self.figures.label);
        let label = &self.figures.label;
        let mut sources: Vec<(String, &PerStep)> = Vec::new();
        for (gpu, per_step) in &e.gpus {
            let name = self.gpu_names.iter().find(|(g, _)| g == gpu).map_or(String::new(), |(_, n)| format!(" {n}"));
            sources.push((format!("GPU {gpu}{name}"), per_step));
        }
        if e.gpus.is_empty() {
            let why = why_missing(self.caps, "nvml", "GPU_0/energy")
                .unwrap_or_else(|| "no per-step GPU energy in this session".into());
            page.missing(&format!("{id}-gpu"), "GPU energy per step", &why);
        }
        for (name, metric, map) in [("CPU package", "cpu_energy", &e.cpu), ("DRAM", "ram_energy", &e.dram)] {
            if map.is_empty() {
                let why =
                    why_missing(self.caps, "rapl", metric).unwrap_or_else(|| "no RAPL readings in this session".into());
                page.missing(&format!("{id}-{metric}"), &format!("{name} energy per step"), &why);
            } else {
                sources.push((name.to_owned(), map));
            }
        }
        if sources.is_empty() {
            return Ok(());
        }
        let done: Vec<(usize, &StepRow)> =
            self.rows.iter().copied().enumerate().filter(|(_, s)| s.duration_ns.is_some()).collect();
        let bars = mean_bars(&done, |s| {
            let key = (label.clone(), s.step);
            let got: Vec<Option<(f64, Option<f64>)>> = sources.iter().map(|(_, m)| m.get(&key).copied()).collect();
            let err = got.iter().flatten().filter_map(|(_, e)| *e).reduce(|a, b| a + b);
            (got.iter().map(|g| g.map(|(j, _)| j)).collect(), err)
        });
        let names: Vec<&str> = sources.iter().map(|(n, _)| n.as_str()).collect();
        let total = self.figures.energy_per_step_j.map_or("not measured".into(), |j| format!("{j:.3} J per step"));
        let desc = format!("Per step, bottom to top: {}; total {total}; black bars: error bound.", names.join(", "));
        if let Some(svg) = stacked_bars(&self.frame(&id, &title, "energy (J)", desc), &bars, self.warmup())? {
            let mut note =
                format!("Total over the measured steps: {total} ({}). ", self.figures.energy_components.join(" + "));
            note.push_str(&per_bar_note(done.len(), bars.len()).unwrap_or_default());
            page.figure(&Figure { id, title, svg, legend: stack_legend(&names), note: Some(note) });
        }
        Ok(())
    }

    /// Launches, sync-wait share and FLOPs per step, each where recorded.
    pub fn launches_and_waits(&self, page: &mut Page, flops: &HashMap<(String, i64), i64>) -> anyhow::Result<()> {
        let label = &self.figures.label;
        let per_step = [
            (
                "launches",
                "Kernel launches per step",
                "launches",
                self.series(|s| s.launches.map(|n| n as f64)),
                "no launch counts",
            ),
            (
                "sync-wait",
                "Share of step time waiting on the GPU (sync wait)",
                "sync wait (% of step)",
                self.series(|s| match (s.sync_wait_ns, s.duration_ns) {
                    (Some(w), Some(d)) if d > 0 => Some(100.0 * w as f64 / d as f64),
                    _ => None,
                }),
                "no synchronisation calls were probed in this session",
            ),
        ];
        for (key, title, y, points, why) in per_step {
            self.simple(page, key, title, y, &points, why)?;
        }
        let flops = self.series(|s| flops.get(&(label.clone(), s.step)).map(|f| *f as f64));
        if !flops.is_empty() {
            self.simple(page, "flops", "GEMM FLOPs per step (a lower bound: cuBLAS GEMMs only)", "FLOP", &flops, "")?;
        }
        Ok(())
    }

    fn simple(
        &self,
        page: &mut Page,
        key: &str,
        what: &str,
        y: &str,
        points: &[(f64, f64)],
        why: &str,
    ) -> anyhow::Result<()> {
        let id = format!("{}-{key}", self.anchor);
        let title = format!("{what} ({})", self.figures.label);
        let kept = min_max(points, BUCKETS);
        let n = kept.len();
        let chart = LineChart { lines: vec![line(0, y, kept)], warmup: self.warmup(), ..Default::default() };
        let desc = format!("{} steps with a value.", points.len());
        match line_chart(&self.frame(&id, &title, y, desc), &chart)? {
            Some(svg) => page.figure(&Figure { id, title, svg, legend: Vec::new(), note: self.note(n, points.len()) }),
            None => page.missing(&id, &title, why),
        }
        Ok(())
    }
}

/// A line in [`look`]`(i)`.
pub fn line(i: usize, name: &str, points: Vec<(f64, f64)>) -> Line {
    let (colour, stroke) = look(i);
    Line { name: name.to_owned(), points, colour, stroke }
}

pub fn legend_of(lines: &[Line]) -> Vec<LegendEntry> {
    lines
        .iter()
        .filter(|l| !l.points.is_empty())
        .map(|l| LegendEntry { name: l.name.clone(), colour: l.colour, stroke: l.stroke, filled: false })
        .collect()
}

fn stack_legend(names: &[&str]) -> Vec<LegendEntry> {
    names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let place = if i == 0 {
                "bottom"
            } else if i + 1 == names.len() {
                "top"
            } else {
                "middle"
            };
            LegendEntry { name: format!("{n} ({place})"), colour: look(i).0, stroke: Stroke::Solid, filled: true }
        })
        .collect()
}

fn per_bar_note(steps: usize, bars: usize) -> Option<String> {
    (bars < steps)
        .then(|| format!("{steps} steps drawn as {bars} bars: each bar is the mean of its run of consecutive steps."))
}

/// Bars over `steps` ((ordinal, step) in start order): one per step, or the
/// per-step mean of each part over a run of steps when there are more than
/// [`BARS`]. `parts` gives a step's parts and its error bound.
/// The parts of a step's time the HTML report stacks, bottom to top.
const TIME_PARTS: [&str; 8] =
    ["data-loader wait", "copies", "sync wait", "NCCL", "runnable", "blocked", "on CPU", "remainder"];

/// A step's [`TIME_PARTS`] in ms: each column in turn, up to what the ones
/// before it leave of the step's duration (waits and on-CPU time overlap: a
/// spinning sync is both), then what is left; a NULL column is no part.
fn time_parts(s: &StepRow) -> Vec<Option<f64>> {
    let total = s.duration_ns.map_or(0.0, ms);
    let mut left = total;
    let mut take = |v: Option<i64>| {
        v.map(|v| {
            let part = ms(v).min(left).max(0.0);
            left -= part;
            part
        })
    };
    let columns = [s.data_wait_ns, s.copy_ns, s.sync_wait_ns, s.collective_ns, s.runnable_ns, s.blocked_ns, s.cpu_ns];
    let mut parts: Vec<Option<f64>> = columns.into_iter().map(&mut take).collect();
    parts.push(Some(left.max(0.0)));
    parts
}

fn mean_bars(steps: &[(usize, &StepRow)], parts: impl Fn(&StepRow) -> (Vec<Option<f64>>, Option<f64>)) -> Vec<Bar> {
    let mut bars = Vec::new();
    for run in chunks(steps, BARS) {
        let (Some(first), Some(last)) = (run.first(), run.last()) else { continue };
        let mut sums: Vec<(f64, usize)> = Vec::new();
        let (mut err, mut errs) = (0.0, 0usize);
        for (_, s) in run {
            let (p, e) = parts(s);
            sums.resize(sums.len().max(p.len()), (0.0, 0));
            for (sum, v) in sums.iter_mut().zip(p) {
                if let Some(v) = v {
                    *sum = (sum.0 + v, sum.1 + 1);
                }
            }
            if let Some(e) = e {
                err += e;
                errs += 1;
            }
        }
        let parts = sums.iter().map(|(s, n)| (*n > 0).then(|| s / *n as f64)).collect();
        let (x0, x1) = (first.0 as f64 - 0.4, last.0 as f64 + 0.4);
        bars.push(Bar { x: (x0, x1), parts, error: (errs > 0).then(|| err / errs as f64) });
    }
    bars
}
