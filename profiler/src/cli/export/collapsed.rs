//! `export --format collapsed`: the session's CPU samples as folded stacks
//! (`root;…;leaf count` per line), which flamegraph.pl, inferno, speedscope
//! and Grafana Pyroscope read.
use std::io::Write;

use anyhow::bail;

use crate::profile::{ProfileDb, cpu};

/// Writes the folded stacks of every sample of `session` (in steps or not,
/// or only those in steps labelled `label`); returns (lines, samples).
pub(super) fn write_collapsed(
    db: &ProfileDb,
    session: i64,
    label: Option<&str>,
    w: &mut impl Write,
) -> anyhow::Result<(u64, u64)> {
    let Some(stacks) = cpu::stacks(db, session)? else {
        bail!("{} has no CPU samples (written by a profiler before --cpu-sample)", db.path.display())
    };
    let mut counts = cpu::stack_counts(db, session)?;
    if let Some(l) = label {
        counts.retain(|c| c.label.as_deref() == Some(l));
    }
    let lines = cpu::folded(&stacks, &counts);
    let samples = lines.iter().map(|l| l.1).sum();
    for (stack, n) in &lines {
        writeln!(w, "{stack} {n}")?;
    }
    Ok((lines.len() as u64, samples))
}
