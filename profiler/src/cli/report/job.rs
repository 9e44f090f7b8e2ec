//! `profiler report --job [JOB]`: the ranks of one job side by side. Steps of
//! the same label and number across the job's sessions form a job step (the
//! `job_steps` / `job_step_ranks` views): per step the slowest and fastest
//! rank and the spread (max − min step time); per rank its share of step time
//! spent waiting (host sync waits + NCCL calls' host time); and the ranks
//! that were slowest most often. A session without a rank (a process with no
//! `RANK` in its environment) is named by its pid.
use std::{fmt::Write as _, io::Write, process::ExitCode};

use anyhow::Context;
use serde::Serialize;

use super::{super::output::print, ReportArgs};
use crate::profile::{
    ProfileDb,
    jobs::{job_sessions, resolve_job},
};

/// `report --job [JOB]` (none: the latest session's job).
pub(super) fn main(args: &ReportArgs) -> anyhow::Result<ExitCode> {
    let db = ProfileDb::open(&args.db)?;
    let job = resolve_job(&db, args.job.as_deref().unwrap_or_default())?;
    let report = build(&db, &job, args.label.as_deref(), args.skip)
        .with_context(|| format!("reading job {job} of {}", db.path.display()))?;
    print(&report, args.format, render_table, write_csv)
}

/// Steps listed in the table (the largest spreads); JSON and CSV have them all.
const TABLE_STEPS: usize = 10;

/// One process of the job.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct JobRank {
    pub session: i64,
    pub rank: Option<i64>,
    pub pid: i64,
    /// `rank N`, or `pid P` when the process had no rank.
    pub name: String,
    /// Steps it ran that ended.
    pub steps: i64,
    pub mean_step_ms: Option<f64>,
    /// Σ (sync wait + collective host time) / Σ step time, over its steps.
    pub wait_share: Option<f64>,
    /// Job steps (run by two or more ranks) where it was the slowest.
    pub slowest_steps: i64,
}

/// One job step: the same label and step number across the ranks.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct JobStep {
    pub label: String,
    pub step: i64,
    pub ranks: i64,
    pub slowest: String,
    pub fastest: String,
    pub max_ms: f64,
    pub min_ms: f64,
    pub spread_ms: f64,
    /// Mean over its ranks of each one's wait share of that step, %.
    pub mean_wait_pct: Option<f64>,
}

/// `report --job --format json` prints this.
#[derive(Debug, Serialize)]
pub struct JobReport {
    pub job: String,
    pub ranks: Vec<JobRank>,
    pub steps: Vec<JobStep>,
    /// The rank(s) slowest in the most job steps (ties: all of them), and in how many.
    pub slowest_most_often: Vec<String>,
    pub slowest_most_often_steps: i64,
    /// Job steps run by two or more ranks.
    pub compared_steps: i64,
}

/// The name of a process in the job: its rank, else its pid.
fn rank_name(rank: Option<i64>, pid: i64) -> String {
    rank.map_or_else(|| format!("pid {pid}"), |r| format!("rank {r}"))
}

/// The report of `job`: only steps labelled `label` when given, and without
/// the first `skip` step numbers of each label.
pub fn build(db: &ProfileDb, job: &str, label: Option<&str>, skip: u64) -> anyhow::Result<JobReport> {
    let sessions = job_sessions(db, job)?;
    let name_of = |session: Option<i64>| {
        sessions.iter().find(|s| Some(s.0) == session).map_or_else(|| "?".to_string(), |s| rank_name(s.1, s.2))
    };
    // The job steps kept: the label filter, and the skipped leading numbers.
    let kept = "job = ?1 AND (?2 IS NULL OR label = ?2)
                AND step >= (SELECT min(step) FROM job_step_ranks m WHERE m.job = ?1 AND m.label = v.label) + ?3";
    let ms = |ns: i64| ns as f64 / 1e6;
    let mut steps = Vec::new();
    {
        let mut q = db.conn.prepare(&format!(
            "SELECT label, step, ranks, slowest_session, fastest_session, max_ns, min_ns, spread_ns, mean_wait_pct
             FROM job_steps v WHERE {kept} ORDER BY label, step"
        ))?;
        let mut rows = q.query(rusqlite::params![job, label, skip as i64])?;
        while let Some(r) = rows.next()? {
            steps.push(JobStep {
                label: r.get(0)?,
                step: r.get(1)?,
                ranks: r.get(2)?,
                slowest: name_of(r.get(3)?),
                fastest: name_of(r.get(4)?),
                max_ms: ms(r.get(5)?),
                min_ms: ms(r.get(6)?),
                spread_ms: ms(r.get(7)?),
                mean_wait_pct: r.get(8)?,
            });
        }
    }
    let mut ranks = Vec::new();
    for &(session, rank, pid) in &sessions {
        let (n, mean_ns, wait, total): (i64, Option<f64>, Option<i64>, Option<i64>) = db.conn.query_row(
            &format!(
                "SELECT count(*), avg(duration_ns), sum(wait_ns), sum(duration_ns) FROM job_step_ranks v
                 WHERE {kept} AND session_id = ?4"
            ),
            rusqlite::params![job, label, skip as i64, session],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )?;
        let name = rank_name(rank, pid);
        let slowest_steps = steps.iter().filter(|s| s.ranks > 1 && s.slowest == name).count() as i64;
        ranks.push(JobRank {
            session,
            rank,
            pid,
            steps: n,
            mean_step_ms: mean_ns.map(|v| v / 1e6),
            wait_share: wait.zip(total).filter(|(_, t)| *t > 0).map(|(w, t)| w as f64 / t as f64),
            slowest_steps,
            name,
        });
    }
    let most = ranks.iter().map(|r| r.slowest_steps).max().unwrap_or(0);
    let slowest_most_often = if most == 0 {
        Vec::new()
    } else {
        ranks.iter().filter(|r| r.slowest_steps == most).map(|r| r.name.clone()).collect()
    };
    let compared_steps = steps.iter().filter(|s| s.ranks > 1).count() as i64;
    Ok(JobReport {
        job: job.to_owned(),
        ranks,
        steps,
        slowest_most_often,
        slowest_most_often_steps: most,
        compared_steps,
    })
}

fn opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "–".to_string(), |v| format!("{v:.decimals$}"))
}

/// The table, in 80 columns: the ranks, who was slowest most often, and the
/// job steps with the largest spread.
pub fn render_table(r: &JobReport) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "job {}: {} processes, {} job steps ({} run by 2+ ranks)",
        r.job,
        r.ranks.len(),
        r.steps.len(),
        r.compared_steps
    );
    let _ = writeln!(o, "\nranks (wait: host sync waits + NCCL calls' host time, of step time)");
    let _ = writeln!(
        o,
        "  {:<14} {:>8} {:>6} {:>14} {:>8} {:>14}",
        "rank", "pid", "steps", "mean step ms", "wait %", "slowest steps"
    );
    for k in &r.ranks {
        let _ = writeln!(
            o,
            "  {:<14} {:>8} {:>6} {:>14} {:>8} {:>14}",
            k.name,
            k.pid,
            k.steps,
            opt(k.mean_step_ms, 3),
            opt(k.wait_share.map(|s| s * 100.0), 1),
            k.slowest_steps
        );
    }
    if r.slowest_most_often.is_empty() {
        let _ = writeln!(o, "\nno step was run by two or more ranks: nothing to compare");
        return o;
    }
    let _ = writeln!(
        o,
        "\nslowest most often: {} ({} of {} job steps)",
        r.slowest_most_often.join(", "),
        r.slowest_most_often_steps,
        r.compared_steps
    );
    let mut widest: Vec<&JobStep> = r.steps.iter().filter(|s| s.ranks > 1).collect();
    widest.sort_by(|a, b| b.spread_ms.total_cmp(&a.spread_ms).then(a.step.cmp(&b.step)));
    let _ = writeln!(o, "\nlargest spreads (max − min step time across ranks)");
    let _ = writeln!(
        o,
        "  {:<12} {:>6} {:>10} {:>10} {:>10} {:>12} {:>12}",
        "label", "step", "spread ms", "max ms", "min ms", "slowest", "fastest"
    );
    for s in widest.iter().take(TABLE_STEPS) {
        let _ = writeln!(
            o,
            "  {:<12} {:>6} {:>10.3} {:>10.3} {:>10.3} {:>12} {:>12}",
            s.label.chars().take(12).collect::<String>(),
            s.step,
            s.spread_ms,
            s.max_ms,
            s.min_ms,
            s.slowest,
            s.fastest
        );
    }
    if widest.len() > TABLE_STEPS {
        let _ = writeln!(o, "  … {} more (--format json or csv lists every step)", widest.len() - TABLE_STEPS);
    }
    o
}

/// Every job step as CSV.
pub fn write_csv(r: &JobReport, out: &mut impl Write) -> anyhow::Result<()> {
    let mut w = csv::Writer::from_writer(out);
    w.write_record([
        "job",
        "label",
        "step",
        "ranks",
        "slowest",
        "fastest",
        "max_ms",
        "min_ms",
        "spread_ms",
        "mean_wait_pct",
    ])?;
    for s in &r.steps {
        w.serialize((
            &r.job,
            &s.label,
            s.step,
            s.ranks,
            &s.slowest,
            &s.fastest,
            s.max_ms,
            s.min_ms,
            s.spread_ms,
            s.mean_wait_pct,
        ))?;
    }
    w.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use unicode_width::UnicodeWidthStr;

    use super::*;
    use crate::profile::jobs::testing::*;

    #[test]
    fn each_step_names_its_slowest_and_fastest_rank_and_the_spread() {
        let (_dir, db, ids) = open();
        let r = build(&db, "j1", None, 0).expect("report");
        let got: Vec<(i64, &str, &str, f64, f64, f64)> = r
            .steps
            .iter()
            .map(|s| (s.step, s.slowest.as_str(), s.fastest.as_str(), s.max_ms, s.min_ms, s.spread_ms))
            .collect();
        assert_eq!(
            got,
            [
                (0, "rank 1", "rank 0", 14.0, 10.0, 4.0),
                (1, "pid 303", "rank 0", 13.0, 10.0, 3.0),
                (2, "pid 303", "rank 1", 11.0, 9.0, 2.0),
                (3, "rank 1", "pid 303", 15.0, 8.0, 7.0),
            ]
        );
        assert!(r.steps.iter().all(|s| s.ranks == 3));
        // Rank 0 waits 1 ms (sync) + 2 ms (all-reduce) of its 10 ms steps; the others never.
        let ranks: Vec<(i64, &str, i64, Option<f64>, i64)> =
            r.ranks.iter().map(|k| (k.session, k.name.as_str(), k.steps, k.wait_share, k.slowest_steps)).collect();
        assert_eq!(
            ranks,
            [
                (ids[0], "rank 0", 4, Some(0.3), 0),
                (ids[1], "rank 1", 4, Some(0.0), 2),
                (ids[2], "pid 303", 4, Some(0.0), 2),
            ]
        );
        assert_eq!(r.ranks[1].mean_step_ms, Some(12.5));
        // Step 0's mean wait: rank 0's 30 %, the others' 0.
        assert!((r.steps[0].mean_wait_pct.expect("wait") - 10.0).abs() < 1e-9);
        assert_eq!(
            (r.slowest_most_often.clone(), r.slowest_most_often_steps),
            (vec!["rank 1".into(), "pid 303".into()], 2)
        );
        let table = render_table(&r);
        assert!(table.contains("slowest most often: rank 1, pid 303 (2 of 4 job steps)"), "{table}");
        assert!(table.lines().all(|l| l.width() <= 80), "{table}");
    }

    #[test]
    fn skip_and_label_narrow_the_job_steps() {
        let (_dir, db, _) = open();
        let r = build(&db, "j1", Some("train"), 2).expect("report");
        assert_eq!(r.steps.iter().map(|s| s.step).collect::<Vec<_>>(), [2, 3]);
        assert_eq!(
            (r.slowest_most_often.clone(), r.slowest_most_often_steps),
            (vec!["rank 1".into(), "pid 303".into()], 1)
        );
        assert!(build(&db, "j1", Some("eval"), 0).expect("report").steps.is_empty());
        // The one-process job compares nothing.
        let old = build(&db, "j0", None, 0).expect("report");
        assert_eq!((old.compared_steps, old.slowest_most_often.len()), (0, 0));
        assert!(render_table(&old).contains("nothing to compare"));
    }

    #[test]
    fn per_step_collective_figures_are_summed_and_null_without_nccl() {
        let (_dir, db, ids) = open();
        let figures = |id: i64| -> Vec<(Option<i64>, Option<i64>)> {
            db.conn
                .prepare("SELECT collective_bytes, collective_ns FROM steps WHERE session_id = ?1 ORDER BY step")
                .expect("prepare")
                .query_map([id], |r| Ok((r.get(0)?, r.get(1)?)))
                .expect("query")
                .collect::<rusqlite::Result<_>>()
                .expect("rows")
        };
        assert_eq!(figures(ids[0]), vec![(Some(4000), Some(2 * MS as i64)); 4]);
        assert_eq!(figures(ids[1]), vec![(None, None); 4]);
    }
}
