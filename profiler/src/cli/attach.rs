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
    session::profile(args.trace.into_config(), Target::Attach(args.pid)).await?;
    Ok(ExitCode::SUCCESS)
}
