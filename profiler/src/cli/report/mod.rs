//! `profiler report`: one session's figures per step label (step and inter-step
//! time, launches, sync wait, energy per step) and its top kernels, as a table
//! for an 80-column terminal, JSON for scripts, or CSV (`build`, `render`,
//! `csv`); a job's ranks side by side (`--job`, `job`); one HTML page of plots
//! (`--html`, `html`). The profile is read through [`crate::profile`].
mod build;
pub(super) mod cpu;
mod csv;
mod html;
mod job;
mod render;

use std::{path::PathBuf, process::ExitCode};

use anyhow::Context;
use clap::Args;

use super::output::{ReportFormat, print};
use crate::profile::ProfileDb;

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// The profile to read.
    #[arg(default_value = "profile.db")]
    pub(super) db: PathBuf,
    /// Session id (default: of the newest job's processes, the one with the most steps).
    #[arg(long, value_name = "N")]
    pub(super) session: Option<i64>,
    /// Only steps with this label (default: every label).
    #[arg(long, value_name = "L")]
    pub(super) label: Option<String>,
    /// Leave out the first K steps of each label (warm-up).
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub(super) skip: u64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = ReportFormat::Table)]
    pub(super) format: ReportFormat,
    /// The ranks of a job side by side (default: the latest session's job):
    /// per step the slowest and fastest rank, the spread, each rank's wait share.
    /// With --html: every process of the job, ranks side by side.
    #[arg(long, value_name = "JOB", num_args = 0..=1, default_missing_value = "", conflicts_with = "session")]
    pub(super) job: Option<String>,
    /// Write one self-contained HTML page of plots (opens offline) instead.
    #[arg(long, conflicts_with = "format")]
    pub(super) html: bool,
    /// Where --html writes its page.
    #[arg(short, long, value_name = "FILE", default_value = "report.html", requires = "html")]
    pub(super) output: PathBuf,
}

pub async fn main(args: ReportArgs) -> anyhow::Result<ExitCode> {
    if args.html {
        return html::main(&args);
    }
    if args.job.is_some() {
        return job::main(&args);
    }
    let db = ProfileDb::open(&args.db)?;
    let session = db.session(args.session)?;
    let report = build::build(&db, session, args.label.as_deref(), args.skip)
        .with_context(|| format!("reading session {session} of {}", args.db.display()))?;
    print(&report, args.format, render::render_table, csv::write_csv)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--job` alone means the latest session's job; after the file, so
    /// that the file is not taken for a job's name.
    #[test]
    fn job_takes_an_optional_name() {
        #[derive(clap::Parser)]
        struct Cmd {
            #[command(flatten)]
            a: ReportArgs,
        }
        let parse = |args: &[&str]| <Cmd as clap::Parser>::try_parse_from(args).expect("parses").a;
        let a = parse(&["report", "p.db", "--job"]);
        assert_eq!((a.db, a.job.as_deref()), (PathBuf::from("p.db"), Some("")));
        assert_eq!(parse(&["report", "p.db", "--job", "j1", "--format", "json"]).job.as_deref(), Some("j1"));
        assert_eq!(parse(&["report", "p.db"]).job, None);
    }
}
