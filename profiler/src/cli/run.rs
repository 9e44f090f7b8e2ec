//! `profiler run [options] -- CMD ARGS…`: start a command held before `exec`,
//! attach, then let it go, so that nothing it does escapes the probes.
use std::{
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    process::ExitCode,
};

use anyhow::Context;
use clap::Args;

use super::TraceArgs;
use crate::{
    privileges,
    session::{self, LaunchedChild, Target},
};

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub trace: TraceArgs,
    /// The command to run, after `--`.
    #[arg(required = true, last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: valid out-array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: two fresh fds from the kernel.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

pub async fn main(args: RunArgs) -> anyhow::Result<ExitCode> {
    privileges::check().map_err(anyhow::Error::msg)?;
    let program = &args.command[0];
    let exe = which::which(program).with_context(|| format!("command '{program}' not found in PATH"))?;
    let exe = std::fs::canonicalize(&exe).unwrap_or(exe);
    let (gate_read, gate_write) = pipe().context("pipe")?;
    let (read_fd, write_fd) = (gate_read.as_raw_fd(), gate_write.as_raw_fd());
    let mut cmd = tokio::process::Command::new(&exe);
    cmd.arg0(program).args(&args.command[1..]);
    // SAFETY: only async-signal-safe calls (close, read, _exit) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::close(write_fd);
            let mut b = 0u8;
            // Wait for the profiler to attach; EOF means it gave up.
            if libc::read(read_fd, (&mut b as *mut u8).cast(), 1) != 1 {
                libc::_exit(127);
            }
            Ok(())
        });
    }
    let child = cmd.spawn().with_context(|| format!("cannot start {}", exe.display()))?;
    drop(gate_read);
    let launched = LaunchedChild { child, release: gate_write, exe, command: args.command.join(" ") };
    let summary = session::profile(args.trace.into_config(), Target::Run(launched)).await?;
    Ok(match summary.exit_code {
        Some(0) | None => ExitCode::SUCCESS,
        Some(c) => ExitCode::from(u8::try_from(c).unwrap_or(1)),
    })
}
