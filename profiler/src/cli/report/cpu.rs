//! The report's CPU-profile section (`--cpu-sample`): per step label, the
//! functions with the largest share of the on-CPU samples taken in its
//! measured steps, by self (the sampled instruction is theirs) and by total
//! (they are anywhere on the stack); what differs in its slowest steps (p90
//! and up) from its typical ones; and what the sampler lost.
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
    /// The sampling program's runs on every CPU and their time in the kernel
    /// (ns); null where the kernel did not count them.
    pub kernel_runs: Option<i64>,
    pub kernel_ns: Option<i64>,
    pub labels: Vec<LabelCpu>,
}

#[derive(Debug, Serialize)]
pub struct LabelCpu {
    pub label: String,
    /// Samples in the label's measured steps (after --skip).
    pub samples: u64,
    pub by_self: Vec<FunctionShare>,
    pub by_total: Vec<FunctionShare>,
    /// Its slowest steps against the others; null with fewer than 10 measured steps.
    pub slow_steps: Option<SlowSteps>,
}

/// A label's steps of duration p90 and up, against the rest: the functions
/// whose total share of the on-CPU samples differs significantly
/// (`profile::cpu::share_changes`: ≥ 2 points and |z| ≥ 3).
#[derive(Debug, Serialize)]
pub struct SlowSteps {
    /// The p90 step duration, ns: steps this long or longer are the slow ones.
    pub threshold_ns: i64,
    pub slow_steps: u64,
    pub typical_steps: u64,
    pub slow_samples: u64,
    pub typical_samples: u64,
    /// False when either side has fewer than 30 samples: nothing can be told.
    pub enough_samples: bool,
    pub changes: Vec<ShareChangeRow>,
}

#[derive(Debug, Serialize)]
pub struct ShareChangeRow {
    pub function: String,
    pub module: Option<String>,
    pub kind: String,
    pub line: Option<i64>,
    /// Total share in the typical steps (`a`), in the slow ones or the new run (`b`).
    pub share_a: f64,
    pub share_b: f64,
    pub samples_a: u64,
    pub samples_b: u64,
    pub z: f64,
}

impl From<cpu::ShareChange> for ShareChangeRow {
    fn from(c: cpu::ShareChange) -> Self {
        Self {
            function: c.frame.function,
            module: c.frame.module,
            kind: c.frame.kind,
            line: c.frame.line,
            share_a: c.share_a,
            share_b: c.share_b,
            samples_a: c.samples_a,
            samples_b: c.samples_b,
            z: c.z,
        }
    }
}

/// Changes listed per label in the table (JSON has them all).
const TOP_CHANGES: usize = 5;
/// Measured steps a label needs before its slowest tenth is told apart.
const MIN_STEPS: usize = 10;

/// The slow steps of one label against its others.
fn slow_steps(
    stacks: &cpu::Stacks,
    label: &str,
    counts: &[&cpu::StackCount],
    measured: &HashMap<(String, i64), i64>,
) -> Option<SlowSteps> {
    let mut durations: Vec<i64> = measured.iter().filter(|((l, _), _)| l == label).map(|(_, d)| *d).collect();
    if durations.len() < MIN_STEPS {
        return None;
    }
    durations.sort_unstable();
    let threshold_ns = durations[(durations.len() * 9).div_ceil(10).clamp(1, durations.len()) - 1];
    let is_slow = |c: &&&cpu::StackCount| {
        c.step.and_then(|s| measured.get(&(label.to_owned(), s))).is_some_and(|d| *d >= threshold_ns)
    };
    let (slow, typical): (Vec<&cpu::StackCount>, Vec<&cpu::StackCount>) = counts.iter().partition(is_slow);
    let slow_steps = durations.iter().filter(|d| **d >= threshold_ns).count() as u64;
    let (typical_samples, slow_samples, changes) = cpu::share_changes(stacks, typical, stacks, slow);
    Some(SlowSteps {
        threshold_ns,
        slow_steps,
        typical_steps: durations.len() as u64 - slow_steps,
        slow_samples,
        typical_samples,
        enough_samples: slow_samples >= cpu::MIN_SAMPLES && typical_samples >= cpu::MIN_SAMPLES,
        changes: changes.into_iter().map(ShareChangeRow::from).collect(),
    })
}

#[derive(Clone, Debug, Serialize)]
pub struct FunctionShare {
    /// How the table names it (`function (module)`, `function (file.py:line)`).
    pub name: String,
    pub function: String,
    /// The file it is in (native), `[kernel]`-like for kernel frames; null if unknown.
    pub module: Option<String>,
    /// `native`, `kernel` or `python`.
    pub kind: String,
    /// A Python frame's first line.
    pub line: Option<i64>,
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
    let columns = db.columns("sessions");
    if !columns.iter().any(|c| c == "cpu_sample_hz") {
        return Ok(None);
    }
    let (sample_hz, samples_taken, lost_samples, stack_failures): (Option<i64>, Option<i64>, Option<i64>, Option<i64>) =
        db.conn.query_row(
            "SELECT cpu_sample_hz, cpu_samples_taken, lost_cpu_samples, cpu_stack_failures FROM sessions WHERE id = ?1",
            [session],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )?;
    let (kernel_runs, kernel_ns): (Option<i64>, Option<i64>) = if columns.iter().any(|c| c == "cpu_sample_kernel_ns") {
        db.conn.query_row(
            "SELECT cpu_sample_runs, cpu_sample_kernel_ns FROM sessions WHERE id = ?1",
            [session],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?
    } else {
        (None, None)
    };
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
            let slow = slow_steps(&stacks, label, &counts, measured);
            let (samples, functions) = cpu::function_samples(&stacks, counts);
            let share = |n: u64| if samples == 0 { 0.0 } else { n as f64 / samples as f64 };
            let mut all: Vec<FunctionShare> = functions
                .into_iter()
                .map(|f| FunctionShare {
                    name: f.frame.display(),
                    function: f.frame.function,
                    module: f.frame.module,
                    kind: f.frame.kind,
                    line: f.frame.line,
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
            LabelCpu { label: label.to_owned(), samples, by_self, by_total, slow_steps: slow }
        })
        .collect();
    labels.sort_by(|a, b| a.label.cmp(&b.label));
    Ok(Some(CpuReport { sample_hz, samples_taken, lost_samples, stack_failures, kernel_runs, kernel_ns, labels }))
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
    if let (Some(runs), Some(ns)) = (cpu.kernel_runs.filter(|r| *r > 0), cpu.kernel_ns) {
        let line = format!(
            "  the sampler in the kernel: {runs} runs on all CPUs, {:.1} µs each, {:.1} ms in all",
            ns as f64 / runs as f64 / 1e3,
            ns as f64 / 1e6
        );
        let _ = writeln!(o, "{}", cut(&line, width));
    }
    if cpu.labels.is_empty() {
        let _ = writeln!(o, "  none in the measured steps");
    }
    for l in &cpu.labels {
        let _ = writeln!(o, "  {}: {} samples in its measured steps; share of them", l.label, l.samples);
        for (title, list) in [("by self", &l.by_self), ("by total", &l.by_total)] {
            let _ = writeln!(o, "    {:>6} {:>6}  {title}", "self", "total");
            for f in list.iter() {
                let line = format!("    {:>5.1}% {:>5.1}%  {}", f.self_share * 100.0, f.total_share * 100.0, f.name);
                let _ = writeln!(o, "{}", cut(&line, width));
            }
        }
        if let Some(slow) = &l.slow_steps {
            render_slow(o, slow, width);
        }
    }
}

fn render_slow(o: &mut String, s: &SlowSteps, width: usize) {
    let head = format!(
        "    slow steps (≥ p90, {:.3} ms): {} steps, {} samples; the others: {}, {}",
        s.threshold_ns as f64 / 1e6,
        s.slow_steps,
        s.slow_samples,
        s.typical_steps,
        s.typical_samples
    );
    let _ = writeln!(o, "{}", cut(&head, width));
    if !s.enough_samples {
        let _ = writeln!(o, "      too few samples to tell them apart (30 a side; --cpu-sample HZ takes more)");
        return;
    }
    if s.changes.is_empty() {
        let _ = writeln!(o, "      no function's share differs significantly (≥ 2 points, |z| ≥ 3)");
        return;
    }
    let _ = writeln!(o, "    {:>7} {:>7}  total share: typical → slow", "typical", "slow");
    for c in s.changes.iter().take(TOP_CHANGES) {
        let frame = crate::profile::cpu::Frame {
            kind: c.kind.clone(),
            module: c.module.clone(),
            function: c.function.clone(),
            line: c.line,
        };
        let line = format!("    {:>6.1}% {:>6.1}%  {}", c.share_a * 100.0, c.share_b * 100.0, frame.display());
        let _ = writeln!(o, "{}", cut(&line, width));
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
