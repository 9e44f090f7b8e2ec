//! The comparison as an 80-column table.
use std::fmt::Write;

use unicode_width::UnicodeWidthStr;

use super::Comparison;
use crate::compare::{LabelComparison, MetricChange};

const WIDTH: usize = 80;
/// Metric, A, B, change, 95 % interval, verdict.
const COLUMNS: [usize; 6] = [17, 10, 10, 8, 16, 14];

/// A figure in its unit, with an SI prefix for large counts.
pub fn figure(v: f64, unit: &str) -> String {
    let (v, prefix) = match v.abs() {
        x if x >= 1e12 && unit != "ms" => (v / 1e12, "T"),
        x if x >= 1e9 && unit != "ms" => (v / 1e9, "G"),
        x if x >= 1e6 && unit != "ms" => (v / 1e6, "M"),
        x if x >= 1e4 && unit != "ms" => (v / 1e3, "k"),
        _ => (v, ""),
    };
    let digits = if v.abs() >= 100.0 {
        0
    } else if v.abs() >= 10.0 {
        1
    } else {
        2
    };
    let sep = if unit.is_empty() && prefix.is_empty() { "" } else { " " };
    format!("{v:.digits$}{sep}{prefix}{unit}")
}

/// A percentage in at most 8 columns: one decimal below 100.
fn pct(p: f64) -> String {
    if p.abs() >= 100.0 { format!("{p:+.0}") } else { format!("{p:+.1}") }
}

/// A change: relative to A in %, or in percentage points for shares.
fn delta(m: &MetricChange, diff: f64, relative: Option<f64>) -> String {
    match (m.unit, relative) {
        _ if diff == 0.0 => "0".into(),
        ("%", _) => format!("{diff:+.1}pp"),
        (_, Some(p)) => format!("{}%", pct(p)),
        (unit, None) => figure(diff, unit),
    }
}

fn interval(m: &MetricChange) -> String {
    match (m.ci_low, m.ci_high) {
        (Some(lo), Some(hi)) if m.unit == "%" => format!("{lo:+.1}…{hi:+.1}pp"),
        (Some(_), Some(_)) => match (m.ci_low_pct, m.ci_high_pct) {
            (Some(lo), Some(hi)) => format!("{}…{}%", pct(lo), pct(hi)),
            _ => String::new(),
        },
        _ if m.change.is_some() => "exact".into(),
        _ => String::new(),
    }
}

/// The change as a gate line gives it.
pub fn change_text(m: &MetricChange) -> String {
    let Some(diff) = m.change else { return m.verdict.clone() };
    let ci = interval(m);
    let ci = if ci.is_empty() || ci == "exact" {
        format!("({})", if ci.is_empty() { "no interval" } else { "exact" })
    } else {
        format!("(95 % CI {ci})")
    };
    format!("{} {ci}, {}", delta(m, diff, m.change_pct), m.verdict)
}

/// Cells padded to the columns (text left, figures right).
fn row(o: &mut String, cells: [&str; 6]) {
    let mut line = String::new();
    for (i, (cell, w)) in cells.iter().zip(COLUMNS).enumerate() {
        let cell = fit(cell, w);
        let pad = w.saturating_sub(cell.width());
        if i == 0 || i == 5 {
            line.push_str(&cell);
            line.push_str(&" ".repeat(pad));
        } else {
            line.push_str(&" ".repeat(pad));
            line.push_str(&cell);
        }
        if i < 5 {
            line.push(' ');
        }
    }
    let _ = writeln!(o, "{}", line.trim_end());
}

fn fit(s: &str, width: usize) -> String {
    if s.width() <= width {
        return s.to_owned();
    }
    let mut out: String = String::new();
    for c in s.chars() {
        if out.width() + 2 > width {
            break;
        }
        out.push(c);
    }
    out.push('…');
    out
}

fn verdict_cell(m: &MetricChange) -> &str {
    match m.verdict.as_str() {
        "no significant change" => "no change",
        v => v,
    }
}

fn label_block(o: &mut String, l: &LabelComparison, noise_pct: f64) {
    let _ = writeln!(o, "\n{}: {} steps in A, {} in B", l.label, l.steps_a, l.steps_b);
    row(o, ["metric", "A", "B", "change", "95 % interval", "verdict"]);
    for m in l.metrics.iter().filter(|m| m.verdict != "not in either") {
        let (a, b) = (m.a.map_or("—".into(), |v| figure(v, m.unit)), m.b.map_or("—".into(), |v| figure(v, m.unit)));
        let change = m.change.map_or(String::new(), |d| delta(m, d, m.change_pct));
        row(o, [m.title, &a, &b, &change, &interval(m), verdict_cell(m)]);
    }
    let _ = writeln!(
        o,
        "no change: the 95 % interval does not lie wholly beyond ±{noise} % of A (--noise)",
        noise = noise_pct
    );
    if !l.energy_domains.is_empty() {
        let _ = writeln!(o, "energy/step sums {} (the domains both runs have)", l.energy_domains.join(" + "));
    }
    if let Some(v) = &l.verdicts {
        let mix: Vec<String> = v.iter().map(|s| format!("{} {:.0}→{:.0} %", s.bound, s.a_pct, s.b_pct)).collect();
        wrap(o, "step verdicts: ", &mix.join(", "));
    }
    match &l.kernels {
        None => {
            let _ = writeln!(o, "kernels: not compared (a side is a job, or kept no launch rows: --launches count)");
        }
        Some(k) if k.is_empty() => {
            let _ = writeln!(o, "kernels: the same launches per step in both");
        }
        Some(k) => {
            let _ = writeln!(o, "kernels whose launches per step changed (A → B):");
            for c in k.iter().take(10) {
                let name = fit(&c.kernel, WIDTH - 32);
                let _ = writeln!(o, "  {:>8.1} → {:<8.1} {:<11} {name}", c.a_per_step, c.b_per_step, c.change);
            }
        }
    }
}

fn wrap(o: &mut String, head: &str, text: &str) {
    let mut line = head.to_owned();
    for word in text.split(' ') {
        if line.width() + word.width() + 1 > WIDTH && line.trim() != head.trim() {
            let _ = writeln!(o, "{}", line.trim_end());
            line = "  ".into();
        }
        line.push_str(word);
        line.push(' ');
    }
    let _ = writeln!(o, "{}", line.trim_end());
}

/// The whole table.
/// Functions whose share of the CPU samples changed, per label.
fn cpu_block(o: &mut String, cpu: &[super::CpuComparison]) {
    for l in cpu {
        let head = format!("\nCPU samples of '{}': {} in A, {} in B", l.label, l.samples_a, l.samples_b);
        let _ = writeln!(o, "{head}");
        if !l.enough_samples {
            let _ = writeln!(o, "  too few samples to compare shares (30 a side)");
        } else if l.changes.is_empty() {
            let _ = writeln!(o, "  no function's share changed significantly (≥ 2 points, |z| ≥ 3)");
        } else {
            let _ = writeln!(o, "  {:>7} {:>7}  total share, A → B", "A", "B");
            for c in l.changes.iter().take(8) {
                let frame = crate::profile::cpu::Frame {
                    kind: c.kind.clone(),
                    module: c.module.clone(),
                    function: c.function.clone(),
                    line: c.line,
                };
                let line = format!("  {:>6.1}% {:>6.1}%  {}", c.share_a * 100.0, c.share_b * 100.0, frame.display());
                let _ = writeln!(o, "{}", fit(&line, WIDTH));
            }
        }
    }
}

pub fn table(c: &Comparison) -> String {
    let mut o = String::new();
    for (name, s) in [("A", &c.a), ("B", &c.b)] {
        let what = match &s.job {
            Some(job) => format!("job {job}"),
            None => format!("session {}", s.session),
        };
        let _ = writeln!(o, "{}", fit(&format!("{name}: {} {what}: {}", s.database, s.command), WIDTH));
    }
    for (k, a, b) in &c.differences {
        wrap(&mut o, "differs: ", &format!("{k}: {} → {}", or_none(a), or_none(b)));
    }
    if c.skip > 0 {
        let _ = writeln!(o, "first {} steps of each label left out (--skip)", c.skip);
    }
    for l in &c.labels {
        label_block(&mut o, l, c.noise_pct);
    }
    cpu_block(&mut o, &c.cpu);
    for (side, labels) in [("A", &c.only_in_a), ("B", &c.only_in_b)] {
        if !labels.is_empty() {
            let _ = writeln!(o, "\nonly in {side}: {}", labels.join(", "));
        }
    }
    if !c.gates.is_empty() {
        o.push('\n');
    }
    for g in &c.gates {
        let status = if g.failed { "FAILED" } else { "passed" };
        wrap(&mut o, "", &format!("fail-if {} ({}): {status}: {}", g.condition, g.label, g.change));
    }
    o
}

fn or_none(s: &str) -> &str {
    if s.is_empty() { "(none)" } else { s }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_keep_their_unit_and_a_readable_size() {
        assert_eq!(figure(12.3456, "ms"), "12.3 ms");
        assert_eq!(figure(1234.5, "ms"), "1234 ms");
        assert_eq!(figure(3.0, ""), "3.00");
        assert_eq!(figure(2.5e9, "FLOP"), "2.50 GFLOP");
        assert_eq!(figure(61.5, "J"), "61.5 J");
    }

    #[test]
    fn rows_fit_in_eighty_columns() {
        let mut o = String::new();
        row(
            &mut o,
            [
                "a very long metric name here",
                "123456789012",
                "1",
                "+100.0%",
                "+1000.0…+2000.0%",
                "no significant change",
            ],
        );
        assert!(o.lines().all(|l| l.width() <= WIDTH), "{o}");
    }
}
