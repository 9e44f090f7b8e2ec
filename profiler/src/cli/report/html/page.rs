//! The HTML report's page: one self-contained document (inline CSS and SVG,
//! no script, no external resource, a Content-Security-Policy that forbids
//! loading any), its header from the text report's session figures, figures
//! with their legends, "not measured" notes and tables.
use std::fmt::Write as _;

use super::super::build::Report;
use super::plots::{Figure, Stroke, css, escape};
use crate::profile::sessions::SessionState;

const STYLE: &str = "body{font-family:sans-serif;margin:1.5em auto;max-width:1040px;color:#222;line-height:1.4}
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
dl.head{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}dl.head dt{font-weight:bold}
figure{margin:1.5em 0}figcaption{font-weight:bold;margin-bottom:.3em}
svg{width:100%;height:auto;background:#fff;border:1px solid #eee}
ul.legend{list-style:none;padding:0;margin:.3em 0;display:flex;flex-wrap:wrap;gap:.3em 1.5em}
.swatch{display:inline-block;width:2.2em;height:0;vertical-align:middle;margin-right:.4em}
.swatch.filled{height:.9em;border:1px solid #555}
p.note{color:#555;font-size:.9em;margin:.2em 0}
.missing{background:#fff4e5;border-left:4px solid #b35900;padding:.4em .8em;margin:1em 0}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ddd;padding:.2em .5em;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}";

/// The document being written.
pub struct Page {
    html: String,
}

impl Page {
    pub fn new(title: &str) -> Self {
        let mut html = String::new();
        let _ = write!(
            html,
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
             <meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">\
             <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
             <title>{}</title><style>{STYLE}</style></head><body><main>\n<h1>{}</h1>\n",
            escape(title),
            escape(title)
        );
        Self { html }
    }

    pub fn heading(&mut self, level: u8, id: &str, text: &str) {
        let _ = writeln!(self.html, "<h{level} id=\"{}\">{}</h{level}>", escape(id), escape(text));
    }

    pub fn paragraph(&mut self, text: &str) {
        let _ = writeln!(self.html, "<p>{}</p>", escape(text));
    }

    /// A figure: caption, plot, legend (name + line style in words, so the
    /// series read without colour), note.
    pub fn figure(&mut self, f: &Figure) {
        let _ = write!(
            self.html,
            "<figure id=\"{}\"><figcaption>{}</figcaption>\n{}\n",
            escape(&f.id),
            escape(&f.title),
            f.svg
        );
        if !f.legend.is_empty() {
            self.html.push_str("<ul class=\"legend\">");
            for e in &f.legend {
                let (class, style, words) = swatch(e.colour, e.stroke, e.filled);
                let _ = write!(
                    self.html,
                    "<li><span class=\"{class}\" style=\"{style}\" aria-hidden=\"true\"></span>{} <small>({words})</small></li>",
                    escape(&e.name)
                );
            }
            self.html.push_str("</ul>");
        }
        if let Some(n) = &f.note {
            let _ = write!(self.html, "<p class=\"note\">{}</p>", escape(n));
        }
        self.html.push_str("</figure>\n");
    }

    /// What a figure would have shown was not measured, and why.
    /// A figure of ready-made inline SVG.
    pub fn figure_raw(&mut self, id: &str, caption: &str, svg: &str) {
        let _ = writeln!(
            self.html,
            "<figure id=\"{}\">{svg}<figcaption>{}</figcaption></figure>",
            escape(id),
            escape(caption)
        );
    }

    pub fn missing(&mut self, id: &str, what: &str, why: &str) {
        let _ = writeln!(
            self.html,
            "<div class=\"missing\" id=\"{}\" role=\"note\"><strong>{}: not measured.</strong> {}</div>",
            escape(id),
            escape(what),
            escape(why)
        );
    }

    /// A table; cells that parse as numbers are right-aligned.
    pub fn table(&mut self, id: &str, caption: &str, head: &[&str], rows: &[Vec<String>]) {
        let _ = write!(self.html, "<table id=\"{}\"><caption>{}</caption><tr>", escape(id), escape(caption));
        for h in head {
            let _ = write!(self.html, "<th scope=\"col\">{}</th>", escape(h));
        }
        self.html.push_str("</tr>\n");
        for row in rows {
            self.html.push_str("<tr>");
            for cell in row {
                let numeric = cell.trim_end_matches(['%', ' ']).replace(',', "").parse::<f64>().is_ok();
                let class = if numeric { " class=\"n\"" } else { "" };
                let _ = write!(self.html, "<td{class}>{}</td>", escape(cell));
            }
            self.html.push_str("</tr>\n");
        }
        self.html.push_str("</table>\n");
    }

    pub fn finish(mut self) -> String {
        self.html.push_str("</main></body></html>\n");
        self.html
    }
}

/// The legend swatch of a series: CSS class, inline style, and its look in words.
fn swatch(colour: plotters::style::RGBColor, stroke: Stroke, filled: bool) -> (&'static str, String, &'static str) {
    let c = css(colour);
    if filled {
        return ("swatch filled", format!("background:{c}"), "bar");
    }
    match stroke {
        Stroke::Solid => ("swatch", format!("border-top:3px solid {c}"), "solid line"),
        Stroke::Dashed => ("swatch", format!("border-top:3px dashed {c}"), "dashed line"),
        Stroke::Dotted => ("swatch", format!("border-top:3px dotted {c}"), "dotted line"),
        Stroke::Points => ("swatch", format!("border-top:6px dotted {c}"), "dots"),
    }
}

/// The session's header, as the text report gives it: target, how long, how
/// it ended, launches and lost events, and every metric that was not available
/// with the reason.
pub fn header(page: &mut Page, r: &Report, anchor: &str) {
    let s = &r.session;
    let mut rows: Vec<(&str, String)> = vec![("target", format!("pid {}  {}", s.pid, s.command))];
    if let Some(exe) = &s.exe {
        rows.push(("executable", exe.clone()));
    }
    let started = s.started_utc.as_deref().map_or(String::new(), |t| format!("from {t} UTC, "));
    let traced = match (s.state, s.duration_s) {
        (SessionState::Ended, Some(d)) => format!("{} mode, {started}{d:.3} s", s.mode),
        (SessionState::Running, _) => format!("{} mode, {started}still running", s.mode),
        _ => format!(
            "{} mode, {started}did not end cleanly (the profiler was killed?): the end and totals are missing",
            s.mode
        ),
    };
    rows.push(("traced", traced));
    rows.push(("end reason", s.end_reason.clone().unwrap_or_else(|| "not recorded".into())));
    if let Some(sym) = &s.step_symbol {
        rows.push(("steps from", sym.clone()));
    }
    let n = |v: Option<i64>| v.map_or_else(|| "not recorded".to_owned(), |v| v.to_string());
    rows.push((
        "launches",
        format!("{} seen, {} stored ({})", n(s.total_launches), n(s.stored_launches), s.launch_mode),
    ));
    rows.push(("lost events", n(s.lost_events)));
    if let Some(h) = &s.hostname {
        rows.push(("host", format!("{h} {}", s.kernel_release.as_deref().unwrap_or(""))));
    }
    rows.push(("profile", format!("{} (profiler {})", r.database, s.profiler_version)));
    let _ = write!(page.html, "<dl class=\"head\" id=\"{}-head\">", escape(anchor));
    for (k, v) in rows {
        let _ = write!(page.html, "<dt>{}</dt><dd>{}</dd>", escape(k), escape(&v));
    }
    page.html.push_str("</dl>\n");
    let missing: Vec<Vec<String>> = r
        .capabilities
        .iter()
        .filter(|c| !c.available)
        .map(|c| {
            vec![c.source.clone(), c.metric.clone(), c.reason.clone().unwrap_or_else(|| "no reason recorded".into())]
        })
        .collect();
    if missing.is_empty() {
        page.paragraph("Every metric the samplers tried was available.");
    } else {
        page.table(
            &format!("{anchor}-unavailable"),
            "Not measured, and why",
            &["source", "metric", "reason"],
            &missing,
        );
    }
}
