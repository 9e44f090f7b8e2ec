//! The report's CPU-profile section (`--cpu-sample`): per step label, the
//! functions with the largest share of the on-CPU samples taken in its
//! measured steps, by self (the sampled instruction is theirs) and by total
//! (they are anywhere on the stack), and what the sampler lost.
use std::{collections::HashMap, fmt::Write as _};

use serde::Serialize;

use crate::profile::{ProfileDb, cpu};

/// Functions listed per label and ordering in the table (JSON has as many).
const TOP_FUNCTIONS: usize = 8;

#[derive(Debug, Serialize)]
pub struct CpuReport {
    /// `--cpu-sample` rate; null when the sampler was off.
    pub sample_hz: Option<i64>,
    /// Samples of traced threads the kernel took, and of those lost (ring full).
    pub samples_taken: Option<i64>,
    pub lost_samples: Option<i64>,
    /// Samples whose stack the kernel's map did not keep: their leaf only.
    pub stack_failures: Option<i64>,
    pub labels: Vec<LabelCpu>,
}

#[derive(Debug, Serialize)]
pub struct LabelCpu {
    pub label: String,
    /// Samples in the label's measured steps (after --skip).
    pub samples: u64,
    pub by_self: Vec<FunctionShare>,
    pub by_total: Vec<FunctionShare>,
}

#[derive(Clone, Debug, Serialize)]
pub struct FunctionShare {
    pub function: String,
    /// The file it is in (native), `[kernel]`-like for kernel frames; null if unknown.
    pub module: Option<String>,
    /// `native` or `kernel`.
    pub kind: String,
    pub self_share: f64,
    pub total_share: f64,
    pub self_samples: u64,
    pub total_samples: u64,
}

/// The section, over the samples of each label's measured steps (`measured`:
/// (label, step) → duration); None when the session has no sampler columns
/// and no samples.
pub(super) fn build(
    db: &ProfileDb,
    session: i64,
    measured: &HashMap<(String, i64), i64>,
) -> anyhow::Result<Option<CpuReport>> {
    if !db.columns("sessions").iter().any(|c| c == "cpu_sample_hz") {
        return Ok(None);
    }
    let (sample_hz, samples_taken, lost_samples, stack_failures): (Option<i64>, Option<i64>, Option<i64>, Option<i64>) =
        db.conn.query_row(
            "SELECT cpu_sample_hz, cpu_samples_taken, lost_cpu_samples, cpu_stack_failures FROM sessions WHERE id = ?1",
            [session],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )?;
    let counts = cpu::stack_counts(db, session)?;
    if sample_hz.is_none() && counts.is_empty() {
        return Ok(None);
    }
    let stacks = cpu::stacks(db, session)?.unwrap_or_default();
    let mut by_label: HashMap<&str, Vec<&cpu::StackCount>> = HashMap::new();
    for c in &counts {
        if let (Some(l), Some(s)) = (c.label.as_deref(), c.step)
            && measured.contains_key(&(l.to_owned(), s))
        {
            by_label.entry(l).or_default().push(c);
        }
    }
    let mut labels: Vec<LabelCpu> = by_label
        .into_iter()
        .map(|(label, counts)| {
            let (samples, functions) = cpu::function_samples(&stacks, counts);
            let share = |n: u64| if samples == 0 { 0.0 } else { n as f64 / samples as f64 };
            let mut all: Vec<FunctionShare> = functions
                .into_iter()
                .map(|f| FunctionShare {
                    function: f.frame.function,
                    module: f.frame.module,
                    kind: f.frame.kind,
                    self_share: share(f.self_samples),
                    total_share: share(f.total_samples),
                    self_samples: f.self_samples,
                    total_samples: f.total_samples,
                })
                .collect();
            let top = |all: &mut Vec<FunctionShare>, key: fn(&FunctionShare) -> u64| {
                all.sort_by(|a, b| key(b).cmp(&key(a)).then_with(|| a.function.cmp(&b.function)));
                all.iter().filter(|f| key(f) > 0).take(TOP_FUNCTIONS).cloned().collect::<Vec<_>>()
            };
            let by_self = top(&mut all, |f| f.self_samples);
            let by_total = top(&mut all, |f| f.total_samples);
            LabelCpu { label: label.to_owned(), samples, by_self, by_total }
        })
        .collect();
    labels.sort_by(|a, b| a.label.cmp(&b.label));
    Ok(Some(CpuReport { sample_hz, samples_taken, lost_samples, stack_failures, labels }))
}

/// The section as text, `width` columns at most.
pub(super) fn render(o: &mut String, cpu: Option<&CpuReport>, width: usize) {
    let Some(cpu) = cpu else { return };
    let Some(hz) = cpu.sample_hz else {
        let _ = writeln!(o, "\nCPU samples: off (--no-cpu-samples)");
        return;
    };
    let mut head = format!("\nCPU samples at {hz} Hz");
    if let Some(taken) = cpu.samples_taken {
        let _ = write!(head, ": {taken} taken, {} lost", cpu.lost_samples.unwrap_or(0));
    }
    if let Some(n) = cpu.stack_failures.filter(|n| *n > 0) {
        let _ = write!(head, ", {n} with the leaf only");
    }
    let _ = writeln!(o, "{head}");
    if cpu.labels.is_empty() {
        let _ = writeln!(o, "  none in the measured steps");
    }
    for l in &cpu.labels {
        let _ = writeln!(o, "  {}: {} samples in its measured steps; share of them", l.label, l.samples);
        for (title, list) in [("by self", &l.by_self), ("by total", &l.by_total)] {
            let _ = writeln!(o, "    {:>6} {:>6}  {title}", "self", "total");
            for f in list.iter() {
                let name = match &f.module {
                    Some(m) => format!("{} ({m})", f.function),
                    None => f.function.clone(),
                };
                let line = format!("    {:>5.1}% {:>5.1}%  {name}", f.self_share * 100.0, f.total_share * 100.0);
                let _ = writeln!(o, "{}", cut(&line, width));
            }
        }
    }
}

/// `s` cut to `width` characters, with an ellipsis if cut.
fn cut(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        return s.to_owned();
    }
    let mut out: String = s.chars().take(width.saturating_sub(1)).collect();
    out.push('…');
    out
}
