//! `profiler report --html`: one self-contained HTML page of plots for a
//! session or a whole job, readable offline (inline SVG drawn by plotters,
//! inline CSS, no script, nothing fetched). The figures come from the same
//! queries as the text report (`build::build`, `profile::steps::load_steps`); this
//! module adds the per-step and over-time series and the job views.
mod data;
mod downsample;
mod flame;
mod job;
mod page;
mod plots;
mod steps;
mod timeline;

use std::process::ExitCode;

use anyhow::Context;

use self::{page::Page, steps::LabelSteps};
use super::{ReportArgs, build::build};
use crate::profile::{ProfileDb, jobs::resolve_job, steps::load_steps};

/// GEMM shapes listed under "top GEMM shapes by FLOPs".
const TOP_GEMMS: usize = 10;

pub fn main(args: &ReportArgs) -> anyhow::Result<ExitCode> {
    let db = ProfileDb::open(&args.db)?;
    let html = render(&db, args)?;
    std::fs::write(&args.output, &html).with_context(|| format!("writing {}", args.output.display()))?;
    eprintln!("wrote {} ({:.1} KiB); open it in a browser", args.output.display(), html.len() as f64 / 1024.0);
    Ok(ExitCode::SUCCESS)
}

/// The page for the session or job `args` names.
fn render(db: &ProfileDb, args: &ReportArgs) -> anyhow::Result<String> {
    let label = args.label.as_deref();
    if let Some(requested) = &args.job {
        let j = &resolve_job(db, requested)?;
        let members = data::job_members(db, j)?;
        if let Some(l) = label {
            let labels = data::job_labels(db, j)?;
            if !labels.iter().any(|have| have == l) {
                let have = if labels.is_empty() { "none".to_string() } else { labels.join(", ") };
                anyhow::bail!("job {j} has no steps labelled '{l}' (labels: {have})");
            }
        }
        let mut page = Page::new(&format!("profiler report: job {j}"));
        job::section(&mut page, db, j, &members, label, args.skip)?;
        for m in &members {
            session(&mut page, db, m.session, label, args.skip, true)
                .with_context(|| format!("reading session {} of {}", m.session, db.path.display()))?;
        }
        return Ok(page.finish());
    }
    let id = db.session(args.session)?;
    let mut page = Page::new(&format!("profiler report: session {id}"));
    session(&mut page, db, id, label, args.skip, false)
        .with_context(|| format!("reading session {id} of {}", db.path.display()))?;
    Ok(page.finish())
}

/// An HTML id made of `s`'s letters and digits.
fn anchor(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect()
}

/// One session: its header, each label's step figures, its timelines, its kernels.
fn session(
    page: &mut Page,
    db: &ProfileDb,
    id: i64,
    label: Option<&str>,
    skip: u64,
    in_job: bool,
) -> anyhow::Result<()> {
    // In a job, a process without the label asked for (the launcher) is shown without steps, not an error.
    let absent = match label {
        Some(l) if in_job => !data::has_label(db, id, l)?,
        _ => false,
    };
    let mut report = build(db, id, label.filter(|_| !absent), skip)?;
    if absent {
        report.labels.clear();
    }
    let anchor = format!("s{id}");
    // The command can be long: it is in the header below.
    page.heading(2, &anchor, &format!("Session {id}: pid {}", report.session.pid));
    page::header(page, &report, &anchor);
    let (job, processes) = data::job_of(db, id)?;
    if let (Some(job), false, true) = (&job, in_job, processes > 1) {
        page.paragraph(&format!(
            "This process is one of {processes} in job {job}: `profiler report --html --job {job}` shows them side by side."
        ));
    }
    let steps = load_steps(db, id)?;
    let energy = data::step_energy(db, id)?;
    let flops = data::step_flops(db, id)?;
    let gpu_names: Vec<(i64, String)> = report
        .labels
        .first()
        .and_then(|l| l.gpus.as_ref())
        .map(|g| g.iter().filter_map(|g| g.name.clone().map(|n| (g.gpu, n))).collect())
        .unwrap_or_default();
    if absent {
        let why = format!("no steps labelled {} in this process", label.unwrap_or_default());
        page.missing(&format!("{anchor}-steps"), "Steps", &why);
    } else if report.labels.is_empty() {
        page.missing(&format!("{anchor}-steps"), "Steps", "no steps were recorded (was a step source named?)");
    }
    for l in &report.labels {
        let label_anchor = format!("{anchor}-{}", self::anchor(&l.label));
        page.heading(3, &label_anchor, &format!("Steps labelled {}", l.label));
        page.paragraph(&format!(
            "{} steps, {} completed, {} warm-up (--skip), {} measured.",
            l.steps, l.completed, l.skipped, l.measured
        ));
        let rows = steps.iter().filter(|s| s.label == l.label).collect();
        let s = LabelSteps {
            anchor: label_anchor,
            figures: l,
            rows,
            caps: &report.capabilities,
            gpu_names: gpu_names.clone(),
        };
        s.step_time(page)?;
        s.phases(page)?;
        s.energy(page, &energy)?;
        s.launches_and_waits(page, &flops)?;
    }
    cpu_flames(page, db, id, &anchor, &report, &steps)?;
    page.heading(3, &format!("{anchor}-time"), "Over time");
    let started_ns: i64 = db.conn.query_row("SELECT started_ns FROM sessions WHERE id = ?1", [id], |r| r.get(0))?;
    let shown: Vec<_> = steps.into_iter().filter(|s| label.is_none_or(|l| s.label == l)).collect();
    let bands = timeline::step_bands(&shown, started_ns);
    timeline::gpus(page, &anchor, &data::gpu_series(db, id, started_ns)?, &bands, &report.capabilities)?;
    timeline::rapl(page, &anchor, data::rapl_power(db, id, started_ns)?, &bands, &report.capabilities)?;
    page.heading(3, &format!("{anchor}-kernels"), "Kernels");
    let gemms = data::top_gemms(db, id, TOP_GEMMS)?;
    timeline::kernels(page, &anchor, report.top_kernels.as_deref(), &gemms)?;
    Ok(())
}

/// Per label, flame graphs of its measured steps' CPU samples and of its slow steps'.
fn cpu_flames(
    page: &mut Page,
    db: &ProfileDb,
    id: i64,
    anchor: &str,
    report: &super::build::Report,
    steps: &[crate::profile::steps::StepRow],
) -> anyhow::Result<()> {
    let Some(cpu) = &report.cpu else { return Ok(()) };
    if cpu.labels.is_empty() {
        return Ok(());
    }
    let Some(stacks) = crate::profile::cpu::stacks(db, id)? else { return Ok(()) };
    let counts = crate::profile::cpu::stack_counts(db, id)?;
    page.heading(3, &format!("{anchor}-cpu"), "Where the steps' CPU time went");
    page.paragraph(&format!(
        "CPU samples at {} Hz of the traced threads, in each label's measured steps: a frame's width is its share of \
         the samples, its callees stand on it; blue frames are Python, orange native, red the kernel's. Hover a \
         frame for its samples.",
        cpu.sample_hz.unwrap_or_default()
    ));
    for l in &cpu.labels {
        let duration: std::collections::HashMap<i64, i64> =
            steps.iter().filter(|s| s.label == l.label).filter_map(|s| s.duration_ns.map(|d| (s.step, d))).collect();
        // The measured steps are the text report's (after --skip): those its counts hold.
        let measured = |c: &&crate::profile::cpu::StackCount| {
            c.label.as_deref() == Some(l.label.as_str()) && c.step.is_some_and(|s| s >= report_skip(report))
        };
        let all: Vec<&crate::profile::cpu::StackCount> = counts.iter().filter(measured).collect();
        let id_of = |s: &str| format!("{anchor}-cpu-{}-{s}", self::anchor(&l.label));
        if let Some(svg) = flame::svg(&stacks, &all, &id_of("all"), &format!("CPU flame graph of {}", l.label)) {
            page.figure_raw(&id_of("all"), &format!("{}: all measured steps ({} samples)", l.label, l.samples), &svg);
        }
        if let Some(slow) = &l.slow_steps {
            let is_slow = |c: &&&crate::profile::cpu::StackCount| {
                c.step.and_then(|s| duration.get(&s)).is_some_and(|d| *d >= slow.threshold_ns)
            };
            let slow_counts: Vec<&crate::profile::cpu::StackCount> = all.iter().filter(is_slow).copied().collect();
            let caption = format!(
                "{}: the slow steps (≥ p90, {:.3} ms; {} steps, {} samples)",
                l.label,
                slow.threshold_ns as f64 / 1e6,
                slow.slow_steps,
                slow.slow_samples
            );
            if let Some(svg) = flame::svg(&stacks, &slow_counts, &id_of("slow"), &caption) {
                page.figure_raw(&id_of("slow"), &caption, &svg);
            }
        }
    }
    Ok(())
}

/// The first step number the report measures (`--skip`).
fn report_skip(report: &super::build::Report) -> i64 {
    report.skip as i64
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use rusqlite::Connection;

    use super::*;

    /// A session with `n` steps of 10 ms (every 12 ms) from 1 ms on, 2 ms of
    /// data wait and 3 ms of optimizer in each, GPU 0 and
    /// CPU energy per step, 2 GPU samples per step, RAPL package readings, two
    /// GEMM shapes; no DRAM readings (the capability says why).
    fn synthetic(path: &Path, n: i64) -> i64 {
        let store = crate::store::Store::open(path).expect("a profile");
        let id = store.begin_session(&crate::store::testing::start()).expect("session");
        drop(store);
        let conn = Connection::open(path).expect("open");
        conn.execute_batch(&format!(
            "WITH RECURSIVE i(k) AS (SELECT 0 UNION ALL SELECT k + 1 FROM i WHERE k + 1 < {n})
             INSERT INTO steps(session_id, label, step, tid, start_ns, end_ns, duration_ns, inter_step_ns, launches,
                               sync_wait_ns, flops, data_wait_ns, optimizer_ns)
                 SELECT {id}, 'train', k, 7, 1000000 + k * 12000000, 11000000 + k * 12000000, 10000000,
                        CASE WHEN k > 0 THEN 2000000 END, 20 + k % 3, 1000000, 3000000000, 2000000, 3000000 FROM i;
             INSERT INTO step_gpu(session_id, label, step, gpu, energy_j, energy_error_j)
                 SELECT {id}, label, step, 0, 3.0, 0.1 FROM steps WHERE session_id = {id};
             INSERT INTO step_energy(session_id, label, step, cpu_energy_j, cpu_energy_error_j)
                 SELECT {id}, label, step, 1.0, 0.05 FROM steps WHERE session_id = {id};
             INSERT INTO gpus(session_id, gpu, nvml_index, uuid, name) VALUES ({id}, 0, 0, 'GPU-x', 'Test GPU');
             WITH RECURSIVE i(k) AS (SELECT 0 UNION ALL SELECT k + 1 FROM i WHERE k + 1 < 2 * {n})
             INSERT INTO gpu_samples(session_id, gpu, ts_ns, utilization_gpu_pct, memory_used_mib, power_w,
                                     temperature_gpu_c)
                 SELECT {id}, 0, 1000 + k * 6000000, 50 + k % 50, 1000, 300, 60 FROM i;
             WITH RECURSIVE i(k) AS (SELECT 0 UNION ALL SELECT k + 1 FROM i WHERE k + 1 < {n})
             INSERT INTO rapl_samples(session_id, ts_ns, domain, energy_j)
                 SELECT {id}, 1000 + k * 12000000, 'package', k * 1.2 FROM i;
             INSERT INTO capabilities VALUES ({id}, 'rapl', 'ram_energy', 0, 'no DRAM domain on this CPU'),
                                             ({id}, 'rapl', 'ram_power', 0, 'no DRAM domain on this CPU');
             INSERT INTO gemms(session_id, tid, ts_ns, op, m, n, k, batch, flops, label, step)
                 VALUES ({id}, 7, 2000000, 'cublasGemmEx', 1024, 1024, 1024, 1, 2147483648, 'train', 0),
                        ({id}, 7, 3000000, 'cublasLtMatmul', 64, 64, 64, 1, 524288, 'train', 0);"
        ))
        .expect("rows");
        id
    }

    fn args(db: &Path, extra: &[&str]) -> ReportArgs {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            report: ReportArgs,
        }
        let mut argv = vec!["report".to_owned(), db.display().to_string(), "--html".into()];
        argv.extend(extra.iter().map(|s| s.to_string()));
        Cli::try_parse_from(argv).expect("parses").report
    }

    /// The points of `figure`'s polylines, by count.
    fn polylines(html: &str, figure: &str) -> Vec<usize> {
        let start = html.find(&format!("<figure id=\"{figure}\"")).unwrap_or_else(|| panic!("no figure {figure}"));
        let body = &html[start..start + html[start..].find("</figure>").expect("figure ends")];
        body.split("<polyline")
            .skip(1)
            .map(|p| {
                p.split("points=\"")
                    .nth(1)
                    .map_or(0, |s| s.split('"').next().map_or(0, |p| p.split_whitespace().count()))
            })
            .collect()
    }

    #[test]
    fn every_section_of_a_session_is_drawn_or_said_missing() {
        let (_dir, path) = crate::store::testing::temp_db();
        let id = synthetic(&path, 50);
        let db = ProfileDb::open(&path).expect("a profile");
        let html = render(&db, &args(&path, &["--skip", "3"])).expect("renders");
        let s = format!("s{id}-train");
        assert!(polylines(&html, &format!("{s}-step-time")).contains(&50));
        assert!(polylines(&html, &format!("{s}-launches")).contains(&50));
        assert!(polylines(&html, &format!("s{id}-gpu-util")).contains(&100));
        assert!(polylines(&html, &format!("s{id}-rapl-power")).contains(&49));
        // Data wait, optimizer and the rest of each step stacked, and the warm-up shaded.
        let phases = &html[html.find(&format!("<figure id=\"{s}-phases\"")).expect("phases")..];
        assert_eq!(phases[..phases.find("</figure>").expect("end")].matches("<rect").count(), 3 * 50 + 1);
        for present in ["-energy", "-flops", "-sync-wait"] {
            assert!(html.contains(&format!("<figure id=\"{s}{present}\"")), "{present}");
        }
        assert!(html.contains(&format!("id=\"s{id}-top-gemms\"")));
        assert!(html.contains("DRAM energy per step: not measured.</strong> no DRAM domain on this CPU"));
        // Nothing to fetch, and nothing may be fetched.
        assert!(!html.contains(" src=") && !html.contains(" href="));
        assert!(html.contains("content=\"default-src 'none'; style-src 'unsafe-inline'\""));
        assert_eq!(html.matches("<figure").count(), html.matches("<title id=").count(), "each plot has a title");
    }

    /// Two sessions made one job: each rank's line, the spread and the
    /// slowest rank per step, then each session's own section.
    #[test]
    fn a_job_page_has_its_ranks() {
        let (_dir, path) = crate::store::testing::temp_db();
        let a = synthetic(&path, 30);
        let b = synthetic(&path, 20);
        // A process of the job with no steps (a launcher).
        let c = synthetic(&path, 3);
        let conn = Connection::open(&path).expect("open");
        conn.execute_batch(&format!(
            "UPDATE sessions SET job = 'j', rank = id - {a};
             UPDATE steps SET duration_ns = duration_ns + 1000000 WHERE session_id = {b} AND step % 2 = 0;
             DELETE FROM gemms WHERE session_id = {c}; DELETE FROM steps WHERE session_id = {c};"
        ))
        .expect("a job");
        let db = ProfileDb::open(&path).expect("a profile");
        let html = render(&db, &args(&path, &["--job", "j"])).expect("renders");
        let ranks = polylines(&html, "job-train-rank-step-time");
        assert!(ranks.contains(&30), "{ranks:?}");
        assert!(polylines(&html, "job-train-spread").contains(&20), "steps both ranks ran");
        let slowest = &html[html.find("<figure id=\"job-train-slowest\"").expect("slowest")..];
        assert_eq!(slowest[..slowest.find("</figure>").expect("end")].matches("<circle").count(), 20);
        assert!(html.contains(&format!("id=\"s{a}\"")) && html.contains(&format!("id=\"s{b}\"")));
        // `--skip 4`: the first four step numbers shaded, and the slowest-rank counts those of the
        // text report, over the measured steps.
        let skipped = render(&db, &args(&path, &["--job", "j", "--skip", "4"])).expect("renders");
        let table = &skipped[skipped.find("<table id=\"job-train-slowest-count\"").expect("the counts")..];
        let table = &table[..table.find("</table>").expect("end")];
        assert!(table.contains("the first 4 step numbers, warm-up, left out"), "{table}");
        let text = super::super::job::build(&db, "j", Some("train"), 4).expect("the text job report");
        assert_eq!(text.compared_steps, 16);
        for r in &text.ranks {
            let share = 100.0 * r.slowest_steps as f64 / text.compared_steps as f64;
            let row = format!("<td class=\"n\">{}</td><td class=\"n\">{share:.1}%</td>", r.slowest_steps);
            assert!(table.contains(&row), "rank {:?}: {row} not in {table}", r.rank);
        }
        for figure in ["job-train-rank-step-time", "job-train-spread", "job-train-slowest"] {
            let f = &skipped[skipped.find(&format!("<figure id=\"{figure}\"")).expect("figure")..];
            assert!(f[..f.find("</figure>").expect("end")].contains("warm-up (--skip)"), "{figure} marks the warm-up");
        }
        // `--label`: the process without such steps is shown without them; a label no process has is an error.
        let labelled = render(&db, &args(&path, &["--job", "j", "--label", "train"])).expect("renders");
        assert!(labelled.contains(&format!("id=\"s{c}-steps\"")) && labelled.contains("no steps labelled train"));
        let e = render(&db, &args(&path, &["--job", "j", "--label", "eval"])).expect_err("no such label").to_string();
        assert!(e.contains("no steps labelled 'eval' (labels: train)"), "{e}");
        let e = render(&db, &args(&path, &["--job", "k"])).expect_err("no such job").to_string();
        assert!(e.contains("no job k") && e.contains(": j"), "{e}");
    }

    #[test]
    fn html_flags() {
        use clap::Parser;
        let p = Path::new("p.db");
        let a = args(p, &["-o", "x.html", "--job", "j", "--skip", "2"]);
        assert_eq!((a.output.to_str(), a.job.as_deref(), a.skip), (Some("x.html"), Some("j"), 2));
        assert_eq!(args(p, &[]).output, Path::new("report.html"));
        let parse = |argv: &[&str]| crate::cli::Cli::try_parse_from(argv).map(|_| ());
        assert!(parse(&["profiler", "report", "--html", "--job", "j", "--session", "1"]).is_err());
        assert!(parse(&["profiler", "report", "-o", "x.html"]).is_err(), "-o needs --html");
        assert!(parse(&["profiler", "report", "--job", "j"]).is_ok(), "--job alone: the text job report");
        assert!(parse(&["profiler", "report", "--html", "--format", "json"]).is_err());
    }
}
