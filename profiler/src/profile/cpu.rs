//! CPU samples, read: a session's stacks and frames, its samples counted by
//! (step, stack), folded stacks (`export --format collapsed`) and each
//! function's self and total share of the samples (`report`).
use std::collections::{BTreeMap, HashMap, HashSet};

use super::ProfileDb;

/// A frame as stored (`frames`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub kind: String,
    pub module: Option<String>,
    pub function: String,
}

impl Frame {
    /// The frame's name in folded stacks: kernel frames carry flamegraph's
    /// `_[k]` suffix; `;` (the separator) and line breaks become spaces.
    fn folded_name(&self) -> String {
        let name: String =
            self.function.chars().map(|c| if c == ';' || c == '\n' || c == '\r' { ' ' } else { c }).collect();
        if self.kind == "kernel" { format!("{name}_[k]") } else { name }
    }
}

/// A session's stacks: stack id → frame ids, leaf first; frame id → frame.
#[derive(Debug, Default)]
pub struct Stacks {
    pub stacks: HashMap<i64, Vec<i64>>,
    pub frames: HashMap<i64, Frame>,
}

/// Samples of one stack, in one step (label and step None: between steps).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackCount {
    pub label: Option<String>,
    pub step: Option<i64>,
    pub stack_id: i64,
    pub samples: u64,
}

/// The session's stacks; None for a profile without CPU samples' tables.
pub fn stacks(db: &ProfileDb, session: i64) -> anyhow::Result<Option<Stacks>> {
    if !db.has_table("stacks") || !db.has_table("frames") {
        return Ok(None);
    }
    let mut out = Stacks::default();
    let mut q = db.conn.prepare("SELECT frame_id, kind, module, function FROM frames WHERE session_id = ?1")?;
    let mut rows = q.query([session])?;
    while let Some(r) = rows.next()? {
        out.frames.insert(r.get(0)?, Frame { kind: r.get(1)?, module: r.get(2)?, function: r.get(3)? });
    }
    let mut q =
        db.conn.prepare("SELECT stack_id, frame_id FROM stacks WHERE session_id = ?1 ORDER BY stack_id, depth")?;
    let mut rows = q.query([session])?;
    while let Some(r) = rows.next()? {
        out.stacks.entry(r.get(0)?).or_default().push(r.get(1)?);
    }
    Ok(Some(out))
}

/// The session's samples counted by (label, step, stack).
pub fn stack_counts(db: &ProfileDb, session: i64) -> anyhow::Result<Vec<StackCount>> {
    if !db.has_table("cpu_samples") {
        return Ok(Vec::new());
    }
    let mut q = db.conn.prepare(
        "SELECT label, step, stack_id, count(*) FROM cpu_samples WHERE session_id = ?1 GROUP BY label, step, stack_id",
    )?;
    let rows = q.query_map([session], |r| {
        Ok(StackCount { label: r.get(0)?, step: r.get(1)?, stack_id: r.get(2)?, samples: r.get::<_, i64>(3)? as u64 })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// Folded stacks, Brendan Gregg's format: `root;…;leaf count`, one line per
/// distinct stack, heaviest first (ties by name).
pub fn folded(stacks: &Stacks, counts: &[StackCount]) -> Vec<(String, u64)> {
    let mut by_stack: HashMap<i64, u64> = HashMap::new();
    for c in counts {
        *by_stack.entry(c.stack_id).or_default() += c.samples;
    }
    // Different stack ids can fold to one line (frames of one name in two modules).
    let mut lines: BTreeMap<String, u64> = BTreeMap::new();
    for (id, n) in by_stack {
        let names: Vec<String> = stacks
            .stacks
            .get(&id)
            .map(|frames| frames.iter().rev().filter_map(|f| stacks.frames.get(f)).map(Frame::folded_name).collect())
            .unwrap_or_default();
        let line = if names.is_empty() { "[unknown]".to_string() } else { names.join(";") };
        *lines.entry(line).or_default() += n;
    }
    let mut out: Vec<(String, u64)> = lines.into_iter().collect();
    out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    out
}

/// One function's samples: as the leaf (self) and anywhere in the stack (total, once per sample).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FunctionSamples {
    pub frame: Frame,
    pub self_samples: u64,
    pub total_samples: u64,
}

/// Each function's self and total samples over `counts`, and the samples in all.
pub fn function_samples<'a>(
    stacks: &Stacks,
    counts: impl IntoIterator<Item = &'a StackCount>,
) -> (u64, Vec<FunctionSamples>) {
    let mut all = 0;
    let mut by_frame: HashMap<i64, (u64, u64)> = HashMap::new();
    for c in counts {
        all += c.samples;
        let Some(frames) = stacks.stacks.get(&c.stack_id) else { continue };
        if let Some(leaf) = frames.first() {
            by_frame.entry(*leaf).or_default().0 += c.samples;
        }
        // A recursive function counts once per sample.
        let distinct: HashSet<i64> = frames.iter().copied().collect();
        for f in distinct {
            by_frame.entry(f).or_default().1 += c.samples;
        }
    }
    let out = by_frame
        .into_iter()
        .filter_map(|(id, (self_samples, total_samples))| {
            Some(FunctionSamples { frame: stacks.frames.get(&id)?.clone(), self_samples, total_samples })
        })
        .collect();
    (all, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: &str, function: &str) -> Frame {
        Frame { kind: kind.into(), module: None, function: function.into() }
    }

    /// main → step → {heavy ×7, light ×3}, one light sample in the kernel, and a recursive stack.
    fn sample() -> (Stacks, Vec<StackCount>) {
        let frames = [
            (0, frame("native", "main")),
            (1, frame("native", "step")),
            (2, frame("native", "heavy")),
            (3, frame("native", "light")),
            (4, frame("kernel", "do_syscall_64")),
        ];
        let stacks = Stacks {
            stacks: HashMap::from([
                (10, vec![2, 1, 0]),
                (11, vec![3, 1, 0]),
                (12, vec![4, 3, 1, 0]),
                (13, vec![2, 2, 1, 0]),
            ]),
            frames: frames.into_iter().collect(),
        };
        let c = |stack_id, samples| StackCount { label: Some("train".into()), step: Some(0), stack_id, samples };
        (stacks, vec![c(10, 6), c(11, 2), c(12, 1), c(13, 1)])
    }

    #[test]
    fn folds_root_first_with_kernel_frames_marked() {
        let (stacks, counts) = sample();
        assert_eq!(
            folded(&stacks, &counts),
            vec![
                ("main;step;heavy".to_string(), 6),
                ("main;step;light".to_string(), 2),
                ("main;step;heavy;heavy".to_string(), 1),
                ("main;step;light;do_syscall_64_[k]".to_string(), 1),
            ]
        );
    }

    #[test]
    fn self_is_the_leaf_and_total_counts_a_sample_once() {
        let (stacks, counts) = sample();
        let (all, mut f) = function_samples(&stacks, &counts);
        f.sort_by(|a, b| a.frame.function.cmp(&b.frame.function));
        let got: Vec<(&str, u64, u64)> =
            f.iter().map(|f| (f.frame.function.as_str(), f.self_samples, f.total_samples)).collect();
        assert_eq!(all, 10);
        assert_eq!(
            got,
            vec![("do_syscall_64", 1, 1), ("heavy", 7, 7), ("light", 2, 3), ("main", 0, 10), ("step", 0, 10)]
        );
    }
}
