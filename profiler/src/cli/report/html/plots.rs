//! The HTML report's charts, drawn by plotters into SVG strings: lines over
//! steps or time (with reference lines, shaded intervals and a marked warm-up),
//! stacked bars with error bars, and ranked bars. Each series differs from the
//! others by its dash pattern or marker as well as its colour, and each SVG
//! carries a `<title>` and `<desc>` for screen readers.
use std::ops::Range;

use anyhow::anyhow;
use plotters::{
    coord::types::RangedCoordf64,
    prelude::*,
    style::text_anchor::{HPos, Pos, VPos},
};

const WIDTH: u32 = 1000;
const HEIGHT: u32 = 340;
/// Colour-blind-safe colours (Okabe–Ito), darkest first so that a stack
/// also reads in grey.
const COLOURS: [RGBColor; 6] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
];
const GREY: RGBColor = RGBColor(90, 90, 90);

/// How a series is drawn, besides its colour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stroke {
    Solid,
    Dashed,
    Dotted,
    /// A circle per point, no line.
    Points,
}

/// The look of series number `i`: a colour and a stroke that differ from the
/// series before it.
pub fn look(i: usize) -> (RGBColor, Stroke) {
    const STROKES: [Stroke; 3] = [Stroke::Solid, Stroke::Dashed, Stroke::Dotted];
    (COLOURS[i % COLOURS.len()], STROKES[i % STROKES.len()])
}

/// CSS colour of `c`, for the HTML legend.
pub fn css(c: RGBColor) -> String {
    format!("#{:02x}{:02x}{:02x}", c.0, c.1, c.2)
}

/// One entry of a figure's legend (drawn in HTML under the plot).
pub struct LegendEntry {
    pub name: String,
    pub colour: RGBColor,
    pub stroke: Stroke,
    /// Filled swatch (a bar or a band) rather than a line.
    pub filled: bool,
}

/// A chart ready for the page.
pub struct Figure {
    pub id: String,
    pub title: String,
    pub svg: String,
    pub legend: Vec<LegendEntry>,
    /// A sentence under the legend (what was downsampled, what is marked).
    pub note: Option<String>,
}

/// What every chart has: where it goes and what it says.
pub struct Frame<'a> {
    pub id: &'a str,
    pub title: &'a str,
    /// What the chart shows, in words, for screen readers.
    pub desc: String,
    pub x_label: &'a str,
    pub y_label: &'a str,
}

pub struct Line {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub colour: RGBColor,
    pub stroke: Stroke,
}

/// A horizontal reference line (p50, p90, p99), labelled at its right end.
pub struct Mark {
    pub name: String,
    pub value: f64,
}

#[derive(Default)]
pub struct LineChart {
    pub lines: Vec<Line>,
    pub marks: Vec<Mark>,
    /// x intervals shaded behind the lines (steps behind a timeline).
    pub bands: Vec<(f64, f64)>,
    /// The x interval of the warm-up steps (`--skip`), marked and labelled.
    pub warmup: Option<(f64, f64)>,
    /// The y values are whole numbers (ranks): ticks only there.
    pub whole_y: bool,
}

type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Draws `chart` in `frame`; `None` when no line has a point.
pub fn line_chart(frame: &Frame, chart: &LineChart) -> anyhow::Result<Option<String>> {
    let xs = chart.lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
    let ys = chart.lines.iter().flat_map(|l| l.points.iter().map(|p| p.1)).chain(chart.marks.iter().map(|m| m.value));
    let (Some(x), Some(y)) = (span(xs), span(ys.chain([0.0]))) else { return Ok(None) };
    let y = if chart.whole_y { y.start - 0.5..y.end + 0.5 } else { y.start..y.end + (y.end - y.start) * 0.08 };
    draw(frame, x, y, chart.whole_y, |c, y| {
        let y0 = y.start;
        let y1 = y.end;
        for &(a, b) in &chart.bands {
            c.draw_series([Rectangle::new([(a, y0), (b, y1)], RGBColor(225, 225, 225).filled())])?;
        }
        if let Some((a, b)) = chart.warmup {
            c.draw_series([Rectangle::new([(a, y0), (b, y1)], RGBColor(200, 200, 200).mix(0.6).filled())])?;
            c.draw_series([Text::new("warm-up (--skip)", (a, y1), ("sans-serif", 13).into_font().color(&GREY))])?;
        }
        for l in chart.lines.iter().filter(|l| !l.points.is_empty()) {
            draw_line(c, l)?;
        }
        for (i, m) in chart.marks.iter().enumerate() {
            let x = c.x_range();
            let style = ShapeStyle::from(&GREY).stroke_width(1);
            let spacing = 3 + 3 * i as u32;
            c.draw_series(DashedLineSeries::new([(x.start, m.value), (x.end, m.value)], 6, spacing, style))?;
            let font = ("sans-serif", 12).into_font().color(&GREY).pos(Pos::new(HPos::Right, VPos::Bottom));
            c.draw_series([EmptyElement::at((x.end, m.value)) + Text::new(m.name.clone(), (-4, -2), font)])?;
        }
        Ok(())
    })
    .map(Some)
}

fn draw_line(c: &mut Chart, l: &Line) -> anyhow::Result<()> {
    let style = ShapeStyle::from(&l.colour).stroke_width(2);
    let points = l.points.iter().copied();
    match l.stroke {
        Stroke::Solid => drop(c.draw_series(LineSeries::new(points, style))?),
        Stroke::Dashed => drop(c.draw_series(DashedLineSeries::new(points, 8, 5, style))?),
        Stroke::Dotted => drop(c.draw_series(DashedLineSeries::new(points, 2, 4, style))?),
        Stroke::Points => drop(c.draw_series(points.map(|p| Circle::new(p, 3, style.filled())))?),
    }
    Ok(())
}

/// One bar of a stacked bar chart: an x interval, its parts (bottom to top;
/// None: not measured for this bar) and an error bound on the total.
pub struct Bar {
    pub x: (f64, f64),
    pub parts: Vec<Option<f64>>,
    pub error: Option<f64>,
}

/// Stacked bars, part `i` in [`look`]`(i)`'s colour; `None` when there are none.
pub fn stacked_bars(frame: &Frame, bars: &[Bar], warmup: Option<(f64, f64)>) -> anyhow::Result<Option<String>> {
    let total = |b: &Bar| b.parts.iter().flatten().sum::<f64>();
    let x = span(bars.iter().flat_map(|b| [b.x.0, b.x.1]));
    let y = span(bars.iter().map(|b| total(b) + b.error.unwrap_or(0.0)).chain([0.0]));
    let (Some(x), Some(y)) = (x, y) else { return Ok(None) };
    let y = 0.0..y.end * 1.08;
    draw(frame, x, y, false, |c, y| {
        if let Some((a, b)) = warmup {
            c.draw_series([Rectangle::new([(a, y.start), (b, y.end)], RGBColor(200, 200, 200).mix(0.6).filled())])?;
            c.draw_series([Text::new("warm-up (--skip)", (a, y.end), ("sans-serif", 13).into_font().color(&GREY))])?;
        }
        for b in bars {
            let mut bottom = 0.0;
            for (i, part) in b.parts.iter().enumerate() {
                let Some(v) = part else { continue };
                let colour = look(i).0;
                c.draw_series([Rectangle::new([(b.x.0, bottom), (b.x.1, bottom + v)], colour.filled())])?;
                bottom += v;
            }
            if let Some(e) = b.error.filter(|e| *e > 0.0) {
                let mid = (b.x.0 + b.x.1) / 2.0;
                c.draw_series([ErrorBar::new_vertical(mid, bottom - e, bottom, bottom + e, BLACK, 4)])?;
            }
        }
        Ok(())
    })
    .map(Some)
}

/// Ranked horizontal bars, largest first, each labelled `#rank value` (the
/// names go in a table beside the chart: they are too long for an axis).
pub fn ranked_bars(frame: &Frame, values: &[f64], unit: &str) -> anyhow::Result<Option<String>> {
    let Some(max) = values.iter().copied().reduce(f64::max) else { return Ok(None) };
    let n = values.len() as f64;
    draw(frame, 0.0..max * 1.25, 0.0..n, false, |c, _| {
        for (i, v) in values.iter().enumerate() {
            let top = n - i as f64;
            c.draw_series([Rectangle::new([(0.0, top - 0.85), (*v, top - 0.15)], COLOURS[0].filled())])?;
            let font = ("sans-serif", 12).into_font().color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center));
            let text = Text::new(format!("#{} {}", i + 1, si(*v, unit)), (4, 0), font);
            c.draw_series([EmptyElement::at((*v, top - 0.5)) + text])?;
        }
        Ok(())
    })
    .map(Some)
}

/// The smallest interval holding every value (widened when they are all equal).
fn span(values: impl Iterator<Item = f64>) -> Option<Range<f64>> {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold(None, |acc: Option<(f64, f64)>, v| Some(acc.map_or((v, v), |(lo, hi)| (lo.min(v), hi.max(v)))))?;
    Some(match (hi > lo, lo == 0.0) {
        (true, _) => lo..hi,
        // All zero: the axis starts at zero, as every other does.
        (false, true) => 0.0..1.0,
        (false, false) => lo - 0.5..hi + 0.5,
    })
}

/// A chart area of `x` × `y` with labelled axes, `body` drawn into it, as an
/// SVG string with a title and description.
fn draw(
    frame: &Frame,
    x: Range<f64>,
    y: Range<f64>,
    whole_y: bool,
    body: impl FnOnce(&mut Chart, Range<f64>) -> anyhow::Result<()>,
) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        let mut c = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(78)
            .build_cartesian_2d(x, y.clone())
            .map_err(|e| anyhow!("drawing {}: {e}", frame.id))?;
        c.configure_mesh()
            .x_desc(frame.x_label)
            .y_desc(frame.y_label)
            // Two light lines between labelled ones: a guide, not a third of the page's bytes.
            .max_light_lines(2)
            .light_line_style(RGBColor(238, 238, 238))
            .bold_line_style(RGBColor(215, 215, 215))
            .axis_desc_style(("sans-serif", 14))
            .label_style(("sans-serif", 12))
            // Whole-number axes (ranks) have a tick per number and no fractions.
            .y_labels(if whole_y { ((y.end - y.start).ceil() as usize + 1).min(21) } else { 10 })
            .y_label_formatter(&|v| if whole_y && v.fract() != 0.0 { String::new() } else { short(*v) })
            .x_label_formatter(&|v| short(*v))
            .draw()
            .map_err(|e| anyhow!("drawing {}: {e}", frame.id))?;
        body(&mut c, y)?;
        root.present().map_err(|e| anyhow!("drawing {}: {e}", frame.id))?;
    }
    Ok(accessible(&svg, frame))
}

/// `svg` with `role="img"`, a `<title>` and a `<desc>` that name it, and
/// scaling to the page's width.
fn accessible(svg: &str, frame: &Frame) -> String {
    let Some(open_end) = svg.find("<svg").and_then(|s| svg[s..].find('>').map(|e| s + e)) else {
        return svg.to_owned();
    };
    let id = escape(frame.id);
    format!(
        "{} role=\"img\" aria-labelledby=\"{id}-title {id}-desc\" preserveAspectRatio=\"xMinYMin meet\">\
         <title id=\"{id}-title\">{}</title><desc id=\"{id}-desc\">{}</desc>{}",
        &svg[..open_end],
        escape(frame.title),
        escape(&frame.desc),
        &svg[open_end + 1..]
    )
}

/// `v` scaled to below ten thousand, with its SI prefix.
fn scaled(v: f64) -> (f64, &'static str) {
    let a = v.abs();
    match a {
        _ if a >= 1e13 => (v / 1e12, "T"),
        _ if a >= 1e10 => (v / 1e9, "G"),
        _ if a >= 1e7 => (v / 1e6, "M"),
        _ if a >= 1e4 => (v / 1e3, "k"),
        _ => (v, ""),
    }
}

/// At most three decimals, trailing zeros dropped.
fn plain(v: f64) -> String {
    let text = if v.fract() == 0.0 || v.abs() >= 100.0 { format!("{v:.0}") } else { format!("{v:.3}") };
    if text.contains('.') { text.trim_end_matches('0').trim_end_matches('.').to_owned() } else { text }
}

/// An axis tick: thousands as k, M, G, T.
fn short(v: f64) -> String {
    let (v, prefix) = scaled(v);
    format!("{}{prefix}", plain(v))
}

/// `v unit` with an SI prefix for large values (FLOPs, launches).
pub fn si(v: f64, unit: &str) -> String {
    let (v, prefix) = scaled(v);
    let sep = if unit.is_empty() && prefix.is_empty() { "" } else { " " };
    format!("{}{sep}{prefix}{unit}", plain(v))
}

/// `s` with the characters HTML gives a meaning escaped.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame() -> Frame<'static> {
        Frame { id: "t", title: "A <test>", desc: "d".into(), x_label: "step", y_label: "ms" }
    }

    /// One polyline per solid line, holding every point; the title is escaped.
    #[test]
    fn a_solid_line_is_one_polyline_of_its_points() {
        let (colour, stroke) = look(0);
        let line = Line { name: "x".into(), points: (0..7).map(|i| (i as f64, i as f64)).collect(), colour, stroke };
        let chart = LineChart { lines: vec![line], ..Default::default() };
        let svg = line_chart(&frame(), &chart).expect("draws").expect("has points");
        // The axes are thin polylines; a series is drawn 2 wide.
        let series: Vec<&str> =
            svg.lines().filter(|l| l.contains("<polyline") && l.contains("stroke-width=\"2\"")).collect();
        assert_eq!(series.len(), 1, "{svg}");
        let points = series[0].split("points=\"").nth(1).and_then(|s| s.split('"').next()).expect("points");
        assert_eq!(points.split_whitespace().count(), 7);
        assert!(svg.contains("<title id=\"t-title\">A &lt;test&gt;</title>"), "{svg}");
        assert!(line_chart(&frame(), &LineChart::default()).expect("draws").is_none());
    }

    #[test]
    fn bars_are_one_rect_per_measured_part() {
        let bars = [
            Bar { x: (0.0, 1.0), parts: vec![Some(1.0), Some(2.0)], error: Some(0.1) },
            Bar { x: (1.0, 2.0), parts: vec![Some(1.5), None], error: None },
        ];
        let svg = stacked_bars(&frame(), &bars, None).expect("draws").expect("bars");
        assert_eq!(svg.matches("<rect").count(), 3, "{svg}");
    }

    #[test]
    fn ticks_are_short() {
        assert_eq!(short(12.5), "12.5");
        assert_eq!(short(20_000_000.0), "20M");
        assert_eq!(short(100.0), "100");
        assert_eq!(si(3.2e13, "FLOP"), "32 TFLOP");
        assert_eq!(si(12.0, ""), "12");
    }
}
