//! `profiler run [options] -- CMD ARGS…`: start a command held before `exec`,
//! attach, then let it go, so that nothing it does escapes the probes.
use std::{
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    process::ExitCode,
};

use anyhow::Context;
use clap::Args;

use super::TraceArgs;
use crate::{
    command_path::{find_program, program_run_by},
    privileges,
    session::{self, LaunchedChild, Target},
};

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub trace: TraceArgs,
    /// Trace the command's process alone, not the processes it starts (by
    /// default its children are traced too, e.g. torchrun's ranks).
    #[arg(long)]
    pub no_children: bool,
    /// The command to run, after `--`.
    #[arg(required = true, last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// Name of the hidden subcommand the child runs first (see [`exec_gate`]).
pub const EXEC_GATE: &str = "__exec-gate";

/// The child's side: wait on `fd` until the profiler has attached, then become
/// the command. std's `spawn` waits for `exec`, so the wait cannot sit between
/// fork and exec; it sits in this first program instead, under the same PID.
pub fn exec_gate(args: &[String]) -> ExitCode {
    use std::os::unix::process::CommandExt;
    let (Some(fd), Some(program)) = (args.first().and_then(|f| f.parse::<i32>().ok()), args.get(1)) else {
        eprintln!("profiler: error: {EXEC_GATE} FD PROGRAM ARG0 [ARGS...]");
        return ExitCode::FAILURE;
    };
    // SAFETY: the profiler passed this fd down for the gate alone; nothing
    // else in this process uses it, and it is closed when `gate` drops.
    let gate = unsafe { OwnedFd::from_raw_fd(fd) };
    let n = rustix::io::read(&gate, &mut [0u8; 1]);
    drop(gate);
    if !matches!(n, Ok(1)) {
        // The profiler went away before attaching: do not run unprofiled.
        return ExitCode::from(127);
    }
    let err = std::process::Command::new(program)
        .arg0(args.get(2).map_or(program.as_str(), String::as_str))
        .args(args.iter().skip(3))
        .exec();
    eprintln!("profiler: error: cannot run {program}: {err}");
    ExitCode::from(127)
}

pub async fn main(args: RunArgs) -> anyhow::Result<ExitCode> {
    privileges::check().map_err(anyhow::Error::msg)?;
    let program = &args.command[0];
    let exe = find_program(program).with_context(|| format!("command '{program}' not found in PATH"))?;
    let (gate_read, gate_write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).context("pipe")?;
    let read_fd = gate_read.as_raw_fd();
    let me = std::env::current_exe().context("cannot find the profiler's own executable")?;
    let mut cmd = tokio::process::Command::new(me);
    cmd.arg(EXEC_GATE).arg(read_fd.to_string()).arg(&exe).arg(program).args(&args.command[1..]);
    // SAFETY: between fork and exec, `read_fd` is still open (the parent
    // holds `gate_read` until `spawn` returns), and fcntl is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            // Let the gate's read end survive exec; the write end stays CLOEXEC.
            let read_end = BorrowedFd::borrow_raw(read_fd);
            rustix::io::fcntl_setfd(read_end, rustix::io::FdFlags::empty())?;
            Ok(())
        });
    }
    let child = cmd.spawn().with_context(|| format!("cannot start {}", exe.display()))?;
    drop(gate_read);
    // A script (`torchrun`, `./train.py`) runs in its interpreter: that is the
    // program probed (its loader, its CPython), though the script is what is run.
    // A version manager's shim (pyenv's `python3`) execs the program it picks.
    let exe = program_run_by(&exe);
    let launched = LaunchedChild { child, release: gate_write, exe, command: args.command.join(" ") };
    let mut cfg = args.trace.into_config();
    cfg.follow_children = !args.no_children;
    let summary = session::profile(cfg, Target::Run(Box::new(launched))).await?;
    summary.report_failure();
    Ok(summary.exit_code())
}
