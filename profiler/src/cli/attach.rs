//! `profiler attach PID [PID…] [--children]`.
use std::process::ExitCode;

use clap::Args;

use super::TraceArgs;
use crate::session::{self, Target};

#[derive(Args, Debug)]
pub struct AttachArgs {
    /// Process ids of the training processes (e.g. every rank of a job): one
    /// session each, in one profile. A PID that does not exist is named and skipped.
    #[arg(required = true, num_args = 1.., value_name = "PID")]
    pub pids: Vec<u32>,
    /// Also trace the processes they start from now on, and theirs (e.g.
    /// `attach $(pgrep -f torchrun) --children` follows the ranks, restarted ones too).
    #[arg(long)]
    pub children: bool,
    #[command(flatten)]
    pub trace: TraceArgs,
}

pub async fn main(args: AttachArgs) -> anyhow::Result<ExitCode> {
    let mut cfg = args.trace.into_config();
    cfg.follow_children = args.children;
    let summary = session::profile(cfg, Target::Attach(args.pids)).await?;
    summary.report_failure();
    Ok(summary.exit_code())
}
