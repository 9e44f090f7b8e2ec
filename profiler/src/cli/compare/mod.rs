//! `profiler compare A B`: two runs side by side, per label, with each
//! metric's change, its 95 % interval and a verdict; `--fail-if` gates CI on
//! them. Exit status: 0, 1 when a `--fail-if` condition failed, 2 for bad
//! input (one line saying what to do).
mod html;
mod load;
mod render;

use std::{path::PathBuf, process::ExitCode};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use serde::Serialize;

use self::load::{Side, SideInfo, SideSpec};
use super::output::ReportFormat;
use crate::compare::{
    LabelComparison, compare_label,
    gate::{self, Condition},
};

/// Version of the JSON shape ([`Comparison`]); bumped only when a field
/// changes meaning or goes away.
const COMPARE_VERSION: u32 = 1;

#[derive(Args, Debug)]
pub struct CompareArgs {
    /// The baseline: FILE, FILE:SESSION, FILE:job (its newest job) or FILE:job=NAME.
    a: String,
    /// The run compared with it, in the same forms.
    b: String,
    /// Only this label (default: every label both runs have).
    #[arg(long, value_name = "L")]
    label: Option<String>,
    /// Leave out the first K steps of each label on both sides (warm-up).
    #[arg(long, value_name = "K", default_value_t = 0)]
    skip: u64,
    /// A plain FILE side means its newest job: per step, the slowest rank's step.
    #[arg(long)]
    job: bool,
    /// Exit 1 when METRIC's change is significant and past THRESHOLD, e.g.
    /// 'step_p50 > +5%', 'energy_per_step > +3%', 'data_wait_p50 > +2ms'. Repeatable.
    #[arg(long = "fail-if", value_name = "METRIC OP THRESHOLD", value_parser = gate::parse)]
    fail_if: Vec<Condition>,
    /// Changes within ±PCT % of A count as run-to-run noise, not as a change:
    /// one run per side cannot measure how much a second run would move.
    #[arg(long, value_name = "PCT", default_value_t = 5.0)]
    noise: f64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = CompareFormat::Table)]
    format: CompareFormat,
    /// Write one self-contained HTML page (opens offline) to FILE as well.
    #[arg(long, value_name = "FILE")]
    html: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CompareFormat {
    Table,
    Json,
}

/// The comparison; `--format json` prints exactly this. Figures are in each
/// metric's unit (`unit`), `*_pct` relative to A.
#[derive(Debug, Serialize)]
pub struct Comparison {
    pub compare_version: u32,
    pub a: SideInfo,
    pub b: SideInfo,
    pub skip: u64,
    /// `--noise`: changes within ± this % of A read as no significant change.
    pub noise_pct: f64,
    pub labels: Vec<LabelComparison>,
    /// Labels only one side has.
    pub only_in_a: Vec<String>,
    pub only_in_b: Vec<String>,
    /// Metadata that differs: (name, A's, B's); "" where a side has none.
    pub differences: Vec<(String, String, String)>,
    /// Each `--fail-if` with its outcome.
    pub gates: Vec<GateOutcome>,
    /// Per label both sides sampled (`--cpu-sample`), the functions whose
    /// share of the on-CPU samples in its steps changed significantly (not gated).
    pub cpu: Vec<CpuComparison>,
}

#[derive(Debug, Serialize)]
pub struct CpuComparison {
    pub label: String,
    pub samples_a: u64,
    pub samples_b: u64,
    /// False when a side has fewer than 30 samples: nothing can be told.
    pub enough_samples: bool,
    /// Largest change first; `share_a` is A's, `share_b` B's.
    pub changes: Vec<super::report::cpu::ShareChangeRow>,
}

#[derive(Debug, Serialize)]
pub struct GateOutcome {
    pub condition: String,
    pub label: String,
    pub failed: bool,
    /// The change as the condition reads it, e.g. "+7.9 % (95 % CI +6.1 … +9.8)".
    pub change: String,
}

pub async fn main(args: CompareArgs) -> anyhow::Result<ExitCode> {
    let comparison = match build(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("profiler: error: {e:#}");
            return Ok(ExitCode::from(2));
        }
    };
    if let Some(path) = &args.html {
        std::fs::write(path, html::page(&comparison)).with_context(|| format!("writing {}", path.display()))?;
    }
    let format = match args.format {
        CompareFormat::Table => ReportFormat::Table,
        CompareFormat::Json => ReportFormat::Json,
    };
    // No CSV form: the closure is never called.
    super::output::print(&comparison, format, render::table, |_, _| Ok(()))?;
    let failed: Vec<&GateOutcome> = comparison.gates.iter().filter(|g| g.failed).collect();
    for g in &failed {
        eprintln!("profiler: fail-if: {} ({}): {}", g.condition, g.label, g.change);
    }
    Ok(if failed.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// Reads both sides and compares every label they share.
fn build(args: &CompareArgs) -> anyhow::Result<Comparison> {
    if !(0.0..100.0).contains(&args.noise) {
        bail!("--noise {} is not a share of A; give a percentage from 0 to 100, e.g. --noise 5", args.noise);
    }
    let a = Side::open(&SideSpec::parse(&args.a, args.job))?;
    let b = Side::open(&SideSpec::parse(&args.b, args.job))?;
    let (la, lb) = (a.labels()?, b.labels()?);
    let labels: Vec<String> = match &args.label {
        Some(l) => {
            for (side, labels, name) in [(&a, &la, "A"), (&b, &lb, "B")] {
                if !labels.contains(l) {
                    bail!(
                        "{name} ({}) has no steps labelled '{l}'; its labels are: {}; pass one with --label",
                        side.info.database,
                        list(labels)
                    );
                }
            }
            vec![l.clone()]
        }
        None => la.iter().filter(|l| lb.contains(l)).cloned().collect(),
    };
    if labels.is_empty() {
        bail!("A's labels ({}) and B's ({}) have none in common; compare one with --label", list(&la), list(&lb));
    }
    let mut compared = Vec::new();
    for label in &labels {
        let (sa, sb) = (a.steps(label, args.skip)?, b.steps(label, args.skip)?);
        for (side, steps, name) in [(&a, &sa, "A"), (&b, &sb, "B")] {
            if steps.steps.is_empty() {
                bail!(
                    "{name} ({}) has no completed '{label}' step after --skip {}; lower --skip or pick another label",
                    side.info.database,
                    args.skip
                );
            }
        }
        compared.push(compare_label(label, sa, sb, args.noise));
    }
    let gates = gate_outcomes(&args.fail_if, &compared)?;
    let cpu = cpu_changes(&a, &b, &labels, args.skip)?;
    Ok(Comparison {
        cpu,
        compare_version: COMPARE_VERSION,
        differences: differences(&a.info, &b.info),
        only_in_a: la.iter().filter(|l| !lb.contains(l)).cloned().collect(),
        only_in_b: lb.iter().filter(|l| !la.contains(l)).cloned().collect(),
        a: a.info,
        b: b.info,
        skip: args.skip,
        noise_pct: args.noise,
        labels: compared,
        gates,
    })
}

/// Each label's CPU-share changes from A to B, over the samples in its steps
/// after `skip` (of the compared session; a job side's first rank).
fn cpu_changes(a: &Side, b: &Side, labels: &[String], skip: u64) -> anyhow::Result<Vec<CpuComparison>> {
    use crate::profile::cpu;
    let read = |side: &Side| -> anyhow::Result<Option<(cpu::Stacks, Vec<cpu::StackCount>)>> {
        let Some(stacks) = cpu::stacks(&side.db, side.info.session)? else { return Ok(None) };
        Ok(Some((stacks, cpu::stack_counts(&side.db, side.info.session)?)))
    };
    let (Some((stacks_a, counts_a)), Some((stacks_b, counts_b))) = (read(a)?, read(b)?) else { return Ok(Vec::new()) };
    let of = |counts: &'_ [cpu::StackCount], label: &str| -> Vec<cpu::StackCount> {
        let kept = |c: &&cpu::StackCount| c.label.as_deref() == Some(label) && c.step.is_some_and(|s| s >= skip as i64);
        counts.iter().filter(kept).cloned().collect()
    };
    let mut out = Vec::new();
    for label in labels {
        let (ca, cb) = (of(&counts_a, label), of(&counts_b, label));
        if ca.is_empty() && cb.is_empty() {
            continue;
        }
        let (samples_a, samples_b, mut changes) = cpu::share_changes(&stacks_a, &ca, &stacks_b, &cb);
        // A frame named by its address only is not the same function in two runs (ASLR).
        changes.retain(|c| !(c.frame.module.is_none() && c.frame.function.starts_with("0x")));
        out.push(CpuComparison {
            label: label.clone(),
            samples_a,
            samples_b,
            enough_samples: samples_a >= cpu::MIN_SAMPLES && samples_b >= cpu::MIN_SAMPLES,
            changes: changes.into_iter().map(Into::into).collect(),
        });
    }
    Ok(out)
}

fn list(labels: &[String]) -> String {
    if labels.is_empty() { "none".into() } else { labels.join(", ") }
}

/// Each condition on each compared label; a metric a side lacks is bad input.
fn gate_outcomes(conditions: &[Condition], labels: &[LabelComparison]) -> anyhow::Result<Vec<GateOutcome>> {
    let mut out = Vec::new();
    for c in conditions {
        for l in labels {
            let Some(m) = l.metrics.iter().find(|m| m.metric == c.metric.name) else { continue };
            let Some(diff) = m.change else {
                bail!(
                    "--fail-if '{c}': {} is {} for label '{}'; gate on a metric both runs have",
                    m.metric,
                    m.verdict,
                    l.label
                );
            };
            out.push(GateOutcome {
                condition: c.text.clone(),
                label: l.label.clone(),
                failed: c.fails(diff, m.change_pct, m.significant),
                change: render::change_text(m),
            });
        }
    }
    Ok(out)
}

/// Metadata whose value differs between the sides.
fn differences(a: &SideInfo, b: &SideInfo) -> Vec<(String, String, String)> {
    let get = |side: &SideInfo, k: &str| side.metadata.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let mut keys: Vec<&String> = a.metadata.iter().chain(&b.metadata).map(|(k, _)| k).collect();
    keys.dedup();
    let mut seen = std::collections::BTreeSet::new();
    keys.into_iter()
        .filter(|k| seen.insert(k.as_str()))
        .filter_map(|k| {
            let (va, vb) = (get(a, k), get(b, k));
            (va != vb).then(|| (k.clone(), va.unwrap_or_default(), vb.unwrap_or_default()))
        })
        .collect()
}
