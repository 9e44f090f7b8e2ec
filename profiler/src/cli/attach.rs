//! `profiler attach PID`.
use std::process::ExitCode;

use clap::Args;

use super::TraceArgs;
use crate::session::{self, Target};

#[derive(Args, Debug)]
pub struct AttachArgs {
    /// Process id of the training process.
    pub pid: u32,
    #[command(flatten)]
    pub trace: TraceArgs,
}

pub async fn main(args: AttachArgs) -> anyhow::Result<ExitCode> {
    let summary = session::profile(args.trace.into_config(), Target::Attach(args.pid)).await?;
    summary.report_failure();
    Ok(summary.exit_code())
}
