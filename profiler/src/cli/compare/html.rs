//! `compare --html FILE`: one offline page: the table, then per label both
//! runs' step-time and energy distributions overlaid and their per-step
//! series side by side, drawn by plotters as inline SVG.
use plotters::{coord::types::RangedCoordf64, prelude::*};

use super::{Comparison, render};
use crate::compare::PlotSeries;

const SIZE: (u32, u32) = (900, 300);
/// Okabe–Ito blue (A) and vermilion (B): apart for colour-blind readers too.
const A: RGBColor = RGBColor(0, 114, 178);
const B: RGBColor = RGBColor(213, 94, 0);
const BINS: usize = 40;

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Counts of `v` in `BINS` equal bins over `range`.
fn histogram(v: &[f64], range: (f64, f64)) -> Vec<u32> {
    let mut bins = vec![0; BINS];
    let width = (range.1 - range.0).max(f64::MIN_POSITIVE);
    for x in v {
        let i = (((x - range.0) / width) * BINS as f64) as usize;
        bins[i.min(BINS - 1)] += 1;
    }
    bins
}

/// The lowest and highest value of both sides, widened a little.
fn span(a: &[f64], b: &[f64]) -> (f64, f64) {
    let lo = a.iter().chain(b).copied().fold(f64::INFINITY, f64::min);
    let hi = a.iter().chain(b).copied().fold(f64::NEG_INFINITY, f64::max);
    if lo == hi { (lo - 0.5, hi + 0.5) } else { (lo, hi + (hi - lo) * 1e-9) }
}

type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// One chart as SVG: its frame and axes, the series `draw` adds, a legend.
fn chart(
    title: &str,
    (x, y): (std::ops::Range<f64>, std::ops::Range<f64>),
    (x_desc, y_desc): (&str, &str),
    draw: impl FnOnce(&mut Chart<'_, '_>) -> Result<(), String>,
) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x, y)
            .map_err(|e| e.to_string())?;
        chart.configure_mesh().x_desc(x_desc).y_desc(y_desc).draw().map_err(|e| e.to_string())?;
        draw(&mut chart)?;
        chart.configure_series_labels().border_style(BLACK).draw().map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

/// Adds a side's line, named in the legend.
fn line(
    chart: &mut Chart<'_, '_>,
    points: impl IntoIterator<Item = (f64, f64)>,
    colour: RGBColor,
    name: &str,
) -> Result<(), String> {
    chart
        .draw_series(LineSeries::new(points, colour.stroke_width(2)))
        .map_err(|e| e.to_string())?
        .label(name)
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2)));
    Ok(())
}

/// Both sides' distributions of one figure, as outlined step histograms.
fn distributions(title: &str, unit: &str, a: &[f64], b: &[f64]) -> Result<String, String> {
    let range = span(a, b);
    let share =
        |v: &[f64]| histogram(v, range).iter().map(|&c| 100.0 * c as f64 / v.len().max(1) as f64).collect::<Vec<_>>();
    let (pa, pb) = (share(a), share(b));
    let top = pa.iter().chain(&pb).copied().fold(1.0, f64::max) * 1.1;
    let width = (range.1 - range.0) / BINS as f64;
    chart(title, (range.0..range.1, 0.0..top), (unit, "% of steps"), |c| {
        for (p, colour, name) in [(&pa, A, "A"), (&pb, B, "B")] {
            let steps = p.iter().enumerate().flat_map(|(i, &y)| {
                let x = range.0 + i as f64 * width;
                [(x, y), (x + width, y)]
            });
            line(c, steps, colour, name)?;
        }
        Ok(())
    })
}

/// Both sides' per-step series of one figure, over step number.
fn series(title: &str, unit: &str, a: &[f64], b: &[f64]) -> Result<String, String> {
    let (lo, hi) = span(a, b);
    let steps = a.len().max(b.len()).max(2) as f64;
    chart(title, (0.0..steps, lo.min(0.0)..hi * 1.05), ("measured step", unit), |c| {
        for (v, colour, name) in [(a, A, "A"), (b, B, "B")] {
            // At most ~2 000 points a side: a page stays small for long runs.
            let stride = (v.len() / 2000).max(1);
            line(c, v.iter().enumerate().step_by(stride).map(|(i, &y)| (i as f64, y)), colour, name)?;
        }
        Ok(())
    })
}

fn plots(o: &mut String, label: &str, p: &[PlotSeries; 2]) {
    let [a, b] = p;
    let mut figure = |svg: Result<String, String>| match svg {
        Ok(svg) => o.push_str(&format!("<figure>{svg}</figure>\n")),
        Err(e) => o.push_str(&format!("<p>plot not drawn: {}</p>\n", escape(&e))),
    };
    figure(distributions(&format!("{label}: step time, A and B"), "ms", &a.step_ms, &b.step_ms));
    figure(series(&format!("{label}: step time per step"), "ms", &a.step_ms, &b.step_ms));
    if !a.energy_j.is_empty() && !b.energy_j.is_empty() {
        figure(distributions(&format!("{label}: energy per step, A and B"), "J", &a.energy_j, &b.energy_j));
        figure(series(&format!("{label}: energy per step"), "J", &a.energy_j, &b.energy_j));
    } else {
        o.push_str("<p>No energy per step in both runs: no energy plots.</p>\n");
    }
}

/// The page: the table as text, then the plots of each label.
pub fn page(c: &Comparison) -> String {
    let mut o = String::from(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>profiler compare</title>\
         <style>body{font-family:sans-serif;max-width:960px;margin:auto}pre{font-size:13px}\
         figure{margin:1em 0}</style></head><body>\n<h1>profiler compare</h1>\n",
    );
    o.push_str(&format!("<pre>{}</pre>\n", escape(&render::table(c))));
    for l in &c.labels {
        o.push_str(&format!("<h2>{}</h2>\n", escape(&l.label)));
        plots(&mut o, &l.label, &l.plots);
    }
    o.push_str("</body></html>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_count_every_value_once() {
        let v = [1.0, 1.0, 2.0, 3.0, 3.0, 3.0];
        let h = histogram(&v, span(&v, &[]));
        assert_eq!(h.iter().sum::<u32>(), 6);
        assert_eq!((h[0], h[BINS - 1]), (2, 3));
        let svg = distributions("t", "ms", &v, &[2.0; 4]).expect("drawn");
        assert!(svg.starts_with("<svg") && svg.contains("</svg>"));
    }
}
