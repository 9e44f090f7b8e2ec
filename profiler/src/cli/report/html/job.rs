//! The job part of a page (`--job J`): the job's processes, each rank's step
//! time side by side, the spread across ranks per step and the slowest rank
//! per step, from the `job_steps` and `job_step_ranks` views.

use super::{
    data::{JobMember, JobStep, job_labels, job_rank_steps, job_steps},
    downsample::{BUCKETS, min_max},
    page::Page,
    plots::{Figure, Frame, LineChart, Stroke, line_chart},
    steps::{legend_of, line},
};
use crate::profile::ProfileDb;

/// How a member is named on the page.
fn who(m: &JobMember) -> String {
    match m.rank {
        Some(r) => format!("rank {r} (session {})", m.session),
        None => format!("session {} (no rank)", m.session),
    }
}

/// The job's part of the page; `skip` leading step numbers of each label
/// are warm-up: shaded in the plots, left out of the slowest-rank counts.
pub fn section(
    page: &mut Page,
    db: &ProfileDb,
    job: &str,
    members: &[JobMember],
    label: Option<&str>,
    skip: u64,
) -> anyhow::Result<()> {
    page.heading(2, "job", &format!("Job {job}: {} processes", members.len()));
    let rows: Vec<Vec<String>> = members
        .iter()
        .map(|m| vec![m.rank.map_or("–".into(), |r| r.to_string()), m.session.to_string(), m.pid.to_string()])
        .collect();
    page.table("job-members", "Processes of the job", &["rank", "session", "pid"], &rows);
    let labels = job_labels(db, job)?;
    let labels: Vec<&String> = labels.iter().filter(|l| label.is_none_or(|want| want == l.as_str())).collect();
    if labels.is_empty() {
        page.paragraph("No completed steps in this job.");
    }
    for l in labels {
        let anchor = format!("job-{}", super::anchor(l));
        page.heading(3, &anchor, &format!("Steps labelled {l} across the ranks"));
        let steps = job_steps(db, job, l)?;
        // Step numbers start where the job's first step of this label does (0 or 1 by source).
        let warm = steps.first().filter(|_| skip > 0).map(|s| WarmUp { first: s.step, skip });
        per_rank(page, db, job, l, members, &anchor, warm)?;
        // The slowest-rank counts are the text report's (`report --job --skip`).
        let counts = super::super::job::build(db, job, Some(l), skip)?;
        spread_and_slowest(page, &steps, &counts, l, members, &anchor, warm)?;
    }
    Ok(())
}

/// The warm-up step numbers (`--skip`): the first `skip` from `first`.
#[derive(Clone, Copy)]
struct WarmUp {
    first: i64,
    skip: u64,
}

impl WarmUp {
    /// The x interval shaded, by step number.
    fn interval(&self) -> (f64, f64) {
        (self.first as f64 - 0.5, self.first as f64 + self.skip as f64 - 0.5)
    }
}

/// Each rank's step time per step number, one line per rank.
fn per_rank(
    page: &mut Page,
    db: &ProfileDb,
    job: &str,
    label: &str,
    members: &[JobMember],
    anchor: &str,
    warm: Option<WarmUp>,
) -> anyhow::Result<()> {
    let per_session = job_rank_steps(db, job, label)?;
    let lines: Vec<_> = members
        .iter()
        .filter_map(|m| per_session.get(&m.session).map(|pts| (m, pts)))
        .enumerate()
        .map(|(i, (m, pts))| line(i, &who(m), min_max(pts, BUCKETS)))
        .collect();
    let id = format!("{anchor}-rank-step-time");
    let title = format!("Step time per rank ({label})");
    let desc = format!("{} ranks' step times by step number, one line each.", lines.len());
    let frame = Frame { id: &id, title: &title, desc, x_label: "step number", y_label: "step time (ms)" };
    let chart = LineChart { lines, warmup: warm.map(|w| w.interval()), ..Default::default() };
    if let Some(svg) = line_chart(&frame, &chart)? {
        page.figure(&Figure { id, title, svg, legend: legend_of(&chart.lines), note: None });
    }
    Ok(())
}

/// Spread (slowest − fastest) per step, the slowest rank per step, and how
/// often each rank was the slowest.
fn spread_and_slowest(
    page: &mut Page,
    steps: &[JobStep],
    counts: &super::super::job::JobReport,
    label: &str,
    members: &[JobMember],
    anchor: &str,
    warm: Option<WarmUp>,
) -> anyhow::Result<()> {
    let shared: Vec<_> = steps.iter().filter(|s| s.ranks > 1).collect();
    let warmup = warm.map(|w| w.interval());
    let spread: Vec<(f64, f64)> = shared.iter().map(|s| (s.step as f64, s.max_ms - s.min_ms)).collect();
    let id = format!("{anchor}-spread");
    let title = format!("Step-time spread across ranks ({label})");
    let desc =
        format!("Slowest minus fastest rank's step time for {} step numbers run by two or more ranks.", spread.len());
    let frame = Frame { id: &id, title: &title, desc, x_label: "step number", y_label: "spread (ms)" };
    let chart = LineChart {
        lines: vec![line(0, "slowest − fastest", min_max(&spread, BUCKETS))],
        warmup,
        ..Default::default()
    };
    match line_chart(&frame, &chart)? {
        Some(svg) => page.figure(&Figure { id, title, svg, legend: Vec::new(), note: None }),
        None => page.missing(&id, &title, "no step number was run by two or more ranks"),
    }
    // The slowest rank as a dot per step; a session without a rank by its id.
    let slowest: Vec<(f64, f64)> =
        shared.iter().map(|s| (s.step as f64, s.slowest_rank.unwrap_or(s.slowest_session) as f64)).collect();
    let id = format!("{anchor}-slowest");
    let title = format!("Slowest rank per step ({label})");
    let desc = format!("One dot per step number at the rank that took longest, {} steps.", slowest.len());
    let frame = Frame { id: &id, title: &title, desc, x_label: "step number", y_label: "slowest rank" };
    let mut dots = line(0, "slowest rank", min_max(&slowest, BUCKETS));
    dots.stroke = Stroke::Points;
    if let Some(svg) =
        line_chart(&frame, &LineChart { lines: vec![dots], whole_y: true, warmup, ..Default::default() })?
    {
        page.figure(&Figure { id, title, svg, legend: Vec::new(), note: None });
    }
    let rows: Vec<Vec<String>> = members
        .iter()
        .map(|m| {
            let n = counts.ranks.iter().find(|r| r.session == m.session).map_or(0, |r| r.slowest_steps);
            let compared = counts.compared_steps;
            let share = if compared == 0 { 0.0 } else { 100.0 * n as f64 / compared as f64 };
            vec![who(m), n.to_string(), format!("{share:.1}%")]
        })
        .collect();
    let caption = match warm {
        Some(w) => {
            format!("How often each rank was the slowest (the first {} step numbers, warm-up, left out)", w.skip)
        }
        None => "How often each rank was the slowest".to_string(),
    };
    page.table(&format!("{anchor}-slowest-count"), &caption, &["rank", "steps", "share"], &rows);
    Ok(())
}
