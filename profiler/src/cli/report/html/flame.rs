//! Flame graphs of the CPU samples (`--cpu-sample`): per step label, one of
//! its measured steps and one of its slow steps (p90 and up, as the text
//! report splits them). Inline SVG, no script: a frame's width is its share
//! of the samples, its callees stand on it, each frame's `<title>` says its
//! samples; frames are coloured by kind (Python, native, kernel). Frames
//! narrower than a pixel and frames deeper than [`MAX_DEPTH`] are left out,
//! which bounds the page whatever the profile.
use std::{collections::BTreeMap, fmt::Write as _};

use crate::profile::cpu::{StackCount, Stacks};

const WIDTH: f64 = 1200.0;
const ROW: f64 = 16.0;
/// Below this width (px) a frame, and what stands on it, is not drawn.
const MIN_WIDTH: f64 = 1.0;
const MAX_DEPTH: usize = 64;
/// Pixels per character of the labels (11 px sans-serif, about).
const CHAR_PX: f64 = 6.5;

#[derive(Default)]
struct Node {
    samples: u64,
    kind: String,
    children: BTreeMap<String, Node>,
}

/// The tree of `counts`' stacks, root first; None when there are no samples.
fn tree(stacks: &Stacks, counts: &[&StackCount]) -> Option<Node> {
    let mut root = Node { kind: "root".into(), ..Node::default() };
    for c in counts {
        root.samples += c.samples;
        let Some(frames) = stacks.stacks.get(&c.stack_id) else { continue };
        let mut node = &mut root;
        for f in frames.iter().rev().filter_map(|f| stacks.frames.get(f)) {
            node = node.children.entry(f.display()).or_insert_with(|| Node { kind: f.kind.clone(), ..Node::default() });
            node.samples += c.samples;
        }
    }
    (root.samples > 0).then_some(root)
}

fn depth(n: &Node, scale: f64, d: usize) -> usize {
    if d >= MAX_DEPTH {
        return d;
    }
    n.children
        .values()
        .filter(|c| c.samples as f64 * scale >= MIN_WIDTH)
        .map(|c| depth(c, scale, d + 1))
        .max()
        .unwrap_or(d)
}

fn colour(kind: &str) -> &'static str {
    match kind {
        "python" => "#7fa7e6",
        "kernel" => "#e88a7a",
        "root" => "#cfcfcf",
        _ => "#f0b65a",
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// The SVG of `counts`' flame graph: `id` names its `<title>` and `<desc>`
/// (`title` its accessible name; the description says the functions with the
/// most self time, what the picture shows at a glance); None without samples.
pub fn svg(stacks: &Stacks, counts: &[&StackCount], id: &str, title: &str) -> Option<String> {
    let root = tree(stacks, counts)?;
    let scale = WIDTH / root.samples as f64;
    let rows = depth(&root, scale, 0) + 1;
    let height = rows as f64 * ROW;
    let id = escape(id);
    let mut o = String::new();
    let _ = write!(
        o,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {WIDTH} {height}\" width=\"100%\" role=\"img\" \
         aria-labelledby=\"{id}-title {id}-desc\" font-family=\"sans-serif\" font-size=\"11\">\
         <title id=\"{id}-title\">{}</title><desc id=\"{id}-desc\">{}</desc>",
        escape(title),
        escape(&description(&root))
    );
    let all = root.samples;
    draw(&mut o, "all", &root, 0.0, 0, rows, scale, all);
    o.push_str("</svg>");
    Some(o)
}

/// "N samples; most self time: f (s %), …": the three functions whose own
/// frames (not their callees') hold the most samples.
fn description(root: &Node) -> String {
    fn self_samples<'a>(name: &'a str, n: &'a Node, out: &mut BTreeMap<&'a str, u64>) {
        let below: u64 = n.children.values().map(|c| c.samples).sum();
        *out.entry(name).or_default() += n.samples - below;
        for (child_name, child) in &n.children {
            self_samples(child_name, child, out);
        }
    }
    let mut own = BTreeMap::new();
    for (name, child) in &root.children {
        self_samples(name, child, &mut own);
    }
    let mut top: Vec<(&str, u64)> = own.into_iter().filter(|(_, s)| *s > 0).collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let named: Vec<String> =
        top.iter().take(3).map(|(f, s)| format!("{f} ({:.1} %)", *s as f64 / root.samples as f64 * 100.0)).collect();
    if named.is_empty() {
        format!("{} samples, none with a stack", root.samples)
    } else {
        format!("{} samples; most self time: {}", root.samples, named.join(", "))
    }
}

#[allow(clippy::too_many_arguments)]
fn draw(o: &mut String, name: &str, n: &Node, x: f64, d: usize, rows: usize, scale: f64, all: u64) {
    let w = n.samples as f64 * scale;
    if w < MIN_WIDTH || d >= rows {
        return;
    }
    // Root at the bottom, callees above their callers.
    let y = (rows - 1 - d) as f64 * ROW;
    let share = n.samples as f64 / all as f64 * 100.0;
    let _ = write!(
        o,
        "<g><title>{} ({} samples, {share:.1} %)</title><rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{:.1}\" \
         fill=\"{}\" stroke=\"#fff\" stroke-width=\"0.5\"/>",
        escape(name),
        n.samples,
        w,
        ROW,
        colour(&n.kind)
    );
    let fits = ((w - 4.0) / CHAR_PX).floor() as usize;
    if fits >= 3 {
        let label: String = if name.chars().count() > fits {
            name.chars().take(fits - 1).chain(std::iter::once('…')).collect()
        } else {
            name.to_owned()
        };
        let _ = write!(o, "<text x=\"{:.1}\" y=\"{:.1}\">{}</text>", x + 2.0, y + ROW - 4.0, escape(&label));
    }
    o.push_str("</g>");
    let mut cx = x;
    for (child_name, child) in &n.children {
        draw(o, child_name, child, cx, d + 1, rows, scale, all);
        cx += child.samples as f64 * scale;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::profile::cpu::Frame;

    fn frame(kind: &str, function: &str) -> Frame {
        Frame { kind: kind.into(), module: None, function: function.into(), line: None }
    }

    #[test]
    fn widths_are_shares_and_callees_stand_on_callers() {
        let stacks = Stacks {
            stacks: HashMap::from([(1, vec![2, 1, 0]), (2, vec![3, 1, 0])]),
            frames: HashMap::from([
                (0, frame("python", "<module>")),
                (1, frame("python", "step")),
                (2, frame("native", "heavy")),
                (3, frame("kernel", "light<&>")),
            ]),
        };
        let c = |stack_id, samples| StackCount { label: None, step: None, stack_id, samples };
        let counts = [c(1, 3), c(2, 1)];
        let refs: Vec<&StackCount> = counts.iter().collect();
        let svg = svg(&stacks, &refs, "f", "t").expect("an SVG");
        // heavy: 3 of 4 samples, 900 px; light: 300 px at x 900, its name escaped.
        assert!(
            svg.contains("<title>heavy (3 samples, 75.0 %)</title><rect x=\"0.0\" y=\"0.0\" width=\"900.0\""),
            "{svg}"
        );
        assert!(svg.contains("<title>light&lt;&amp;&gt; (1 samples, 25.0 %)</title><rect x=\"900.0\""), "{svg}");
        // Four rows: all, <module>, step, the leaves; the root at the bottom.
        assert!(svg.contains("viewBox=\"0 0 1200 64\""), "{svg}");
        assert!(svg.contains("<title>all (4 samples, 100.0 %)</title><rect x=\"0.0\" y=\"48.0\""), "{svg}");
        assert!(
            svg.contains("aria-labelledby=\"f-title f-desc\"") && svg.contains("<title id=\"f-title\">t</title>"),
            "{svg}"
        );
        assert!(
            svg.contains(
                "<desc id=\"f-desc\">4 samples; most self time: heavy (75.0 %), light&lt;&amp;&gt; (25.0 %)</desc>"
            ),
            "{svg}"
        );
        assert!(super::svg(&stacks, &[], "f", "t").is_none());
    }
}
