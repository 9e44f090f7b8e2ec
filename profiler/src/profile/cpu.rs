//! CPU samples, read: a session's stacks and frames, its samples counted by
//! (step, stack), folded stacks (`export --format collapsed`) and each
//! function's self and total share of the samples (`report`).
use std::collections::{BTreeMap, HashMap, HashSet};

use super::ProfileDb;

/// A frame as stored (`frames`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Frame {
    pub kind: String,
    pub module: Option<String>,
    pub function: String,
    /// A Python frame's first line.
    pub line: Option<i64>,
}

impl Frame {
    /// How the report names it: `function (module)`, a Python frame by its
    /// file's name and first line (`python_part (loop.py:33)`).
    pub fn display(&self) -> String {
        match (&self.module, self.line) {
            (Some(m), Some(line)) => {
                let file = std::path::Path::new(m).file_name().map_or(m.clone(), |f| f.to_string_lossy().into_owned());
                format!("{} ({file}:{line})", self.function)
            }
            (Some(m), None) => format!("{} ({m})", self.function),
            (None, _) => self.function.clone(),
        }
    }

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
    let line = if db.columns("frames").iter().any(|c| c == "line") { "line" } else { "NULL" };
    let mut q = db
        .conn
        .prepare(&format!("SELECT frame_id, kind, module, function, {line} FROM frames WHERE session_id = ?1"))?;
    let mut rows = q.query([session])?;
    while let Some(r) = rows.next()? {
        let frame = Frame { kind: r.get(1)?, module: r.get(2)?, function: r.get(3)?, line: r.get(4)? };
        out.frames.insert(r.get(0)?, frame);
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

/// A function whose total share differs between two sets of samples.
#[derive(Clone, Debug, PartialEq)]
pub struct ShareChange {
    pub frame: Frame,
    /// Its total share of set `a`'s samples and of `b`'s, and its samples in each.
    pub share_a: f64,
    pub share_b: f64,
    pub samples_a: u64,
    pub samples_b: u64,
    /// The two-proportion z statistic of the difference.
    pub z: f64,
}

/// Samples each set needs before a difference is looked for.
pub const MIN_SAMPLES: u64 = 30;
/// A change is kept when it is this many points or more…
pub const MIN_CHANGE: f64 = 0.02;
/// …and this many standard errors from none (two-proportion z-test; 3: a
/// false one in ~370 functions tested, so a profile's hundreds of functions
/// rarely show one).
pub const MIN_Z: f64 = 3.0;

/// The functions (by kind, module, name, line) whose total share of `b`'s
/// samples differs significantly from their share of `a`'s, largest change
/// first; empty when either set has fewer than [`MIN_SAMPLES`]. Returns the
/// two sets' sample counts too.
pub fn share_changes<'a>(
    stacks_a: &Stacks,
    a: impl IntoIterator<Item = &'a StackCount>,
    stacks_b: &Stacks,
    b: impl IntoIterator<Item = &'a StackCount>,
) -> (u64, u64, Vec<ShareChange>) {
    let (n_a, fa) = function_samples(stacks_a, a);
    let (n_b, fb) = function_samples(stacks_b, b);
    if n_a < MIN_SAMPLES || n_b < MIN_SAMPLES {
        return (n_a, n_b, Vec::new());
    }
    // One function can be several frames (two stack ids): summed by what names it.
    let mut by: HashMap<Frame, (u64, u64)> = HashMap::new();
    for f in fa {
        by.entry(f.frame).or_default().0 += f.total_samples;
    }
    for f in fb {
        by.entry(f.frame).or_default().1 += f.total_samples;
    }
    let mut out: Vec<ShareChange> = by
        .into_iter()
        .filter_map(|(frame, (x, y))| {
            let (pa, pb) = (x as f64 / n_a as f64, y as f64 / n_b as f64);
            let pooled = (x + y) as f64 / (n_a + n_b) as f64;
            let se = (pooled * (1.0 - pooled) * (1.0 / n_a as f64 + 1.0 / n_b as f64)).sqrt();
            let z = if se > 0.0 { (pb - pa) / se } else { 0.0 };
            ((pb - pa).abs() >= MIN_CHANGE && z.abs() >= MIN_Z).then_some(ShareChange {
                frame,
                share_a: pa,
                share_b: pb,
                samples_a: x,
                samples_b: y,
                z,
            })
        })
        .collect();
    out.sort_by(|p, q| {
        (q.share_b - q.share_a)
            .abs()
            .total_cmp(&(p.share_b - p.share_a).abs())
            .then_with(|| p.frame.function.cmp(&q.frame.function))
    });
    (n_a, n_b, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: &str, function: &str) -> Frame {
        Frame { kind: kind.into(), module: None, function: function.into(), line: None }
    }

    #[test]
    fn a_share_that_moved_is_a_change_and_noise_is_not() {
        let (stacks, _) = sample();
        let c = |stack_id, samples| StackCount { label: None, step: None, stack_id, samples };
        // a: heavy 60, light 40; b: heavy 30, light 70 (far apart); c: heavy 58, light 42 (noise).
        let a = [c(10, 60), c(11, 40)];
        let b = [c(10, 30), c(11, 70)];
        let (na, nb, changes) = share_changes(&stacks, &a, &stacks, &b);
        assert_eq!((na, nb), (100, 100));
        let got: Vec<(&str, u64, u64)> =
            changes.iter().map(|c| (c.frame.function.as_str(), c.samples_a, c.samples_b)).collect();
        assert_eq!(got, vec![("heavy", 60, 30), ("light", 40, 70)]);
        assert!(changes[0].z < -3.0 && changes[1].z > 3.0, "{changes:?}");
        let noise = [c(10, 58), c(11, 42)];
        assert!(share_changes(&stacks, &a, &stacks, &noise).2.is_empty());
        // Too few samples to tell.
        let few = [c(10, 1), c(11, 9)];
        assert!(share_changes(&stacks, &a, &stacks, &few).2.is_empty());
    }

    #[test]
    fn python_frames_are_named_by_file_and_line() {
        let f = Frame {
            kind: "python".into(),
            module: Some("/a/b/loop.py".into()),
            function: "step".into(),
            line: Some(33),
        };
        assert_eq!(f.display(), "step (loop.py:33)");
        assert_eq!(Frame { line: None, ..f.clone() }.display(), "step (/a/b/loop.py)");
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
