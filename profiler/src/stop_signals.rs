//! The signals that stop a session (SIGINT, SIGTERM), with where each came
//! from, and the exit status a `run` command's end turns into.
//!
//! A terminal's Ctrl-C is sent by the kernel to the whole foreground process
//! group, so a `run` command still in the profiler's group has it already;
//! passing it on would deliver it twice (a second SIGINT makes PyTorch and
//! most launchers abort their own clean shutdown). A signal someone sent to
//! the profiler alone (`kill -INT`, a job scheduler) is passed on once.
use std::{os::unix::process::ExitStatusExt, process::ExitStatus};

use rustix::process::{Pid, Signal};
use signal_hook::{
    consts::{SIGINT, SIGTERM},
    iterator::{SignalsInfo, exfiltrator::WithOrigin},
    low_level::siginfo::Cause,
};
use tokio::sync::mpsc;

/// A stop signal as it arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StopSignal {
    pub signal: i32,
    /// The kernel generated it (a terminal's Ctrl-C to its foreground
    /// process group), rather than a process sending it to the profiler.
    pub from_terminal: bool,
}

impl StopSignal {
    /// The `end_reason` stored with the session.
    pub fn end_reason(self) -> &'static str {
        if self.signal == SIGTERM { "sigterm" } else { "sigint" }
    }

    /// `SIGINT` or `SIGTERM`, for the user's lines.
    pub fn name(self) -> &'static str {
        if self.signal == SIGTERM { "SIGTERM" } else { "SIGINT" }
    }

    /// Whether a `run` command in process group `child_pgid` needs this
    /// signal passed on: not when the terminal sent it to the profiler's own
    /// group (`own_pgid`) and the command is still in that group.
    pub fn needs_forwarding(self, own_pgid: i32, child_pgid: Option<i32>) -> bool {
        !(self.from_terminal && child_pgid == Some(own_pgid))
    }
}

/// The stop signals that arrived, in order.
pub type Stops = mpsc::UnboundedReceiver<StopSignal>;

/// Stop signals from now on. A thread of its own reads them with their
/// origin (tokio's signal streams do not keep it) and hands them over.
pub fn listen() -> std::io::Result<Stops> {
    let mut signals = SignalsInfo::<WithOrigin>::new([SIGINT, SIGTERM])?;
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::Builder::new().name("stop-signals".into()).spawn(move || {
        for origin in signals.forever() {
            let stop = StopSignal { signal: origin.signal, from_terminal: origin.cause == Cause::Kernel };
            if tx.send(stop).is_err() {
                break;
            }
        }
    })?;
    Ok(rx)
}

/// Sends `signal`, one of the stop signals, to process `pid`; a vanished
/// process is not an error.
pub fn forward(pid: u32, signal: i32) {
    let signal = match signal {
        SIGINT => Signal::INT,
        SIGTERM => Signal::TERM,
        _ => return,
    };
    if let Some(pid) = Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

/// The process group of `pid`, if it still exists.
pub fn process_group(pid: u32) -> Option<i32> {
    let pid = Pid::from_raw(pid as i32)?;
    rustix::process::getpgid(Some(pid)).ok().map(Pid::as_raw_pid)
}

/// The profiler's own process group.
pub fn own_process_group() -> i32 {
    rustix::process::getpgrp().as_raw_pid()
}

/// The status a shell would report for a command that ended with `status`:
/// its exit code, or 128 + the signal that killed it.
pub fn shell_status(status: ExitStatus) -> i32 {
    status.code().or_else(|| status.signal().map(|s| 128 + s)).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_terminal_signal_is_not_passed_to_a_command_in_our_group() {
        let tty = StopSignal { signal: SIGINT, from_terminal: true };
        let kill = StopSignal { signal: SIGINT, from_terminal: false };
        assert!(!tty.needs_forwarding(100, Some(100)));
        // The command left our group (setsid, setpgid): the terminal's signal missed it.
        assert!(tty.needs_forwarding(100, Some(200)));
        assert!(kill.needs_forwarding(100, Some(100)));
        assert!(kill.needs_forwarding(100, None));
        assert_eq!(StopSignal { signal: SIGTERM, from_terminal: false }.end_reason(), "sigterm");
        assert_eq!(tty.end_reason(), "sigint");
    }

    #[test]
    fn shell_status_is_the_code_or_128_plus_the_signal() {
        assert_eq!(shell_status(ExitStatus::from_raw(0)), 0);
        assert_eq!(shell_status(ExitStatus::from_raw(3 << 8)), 3);
        // Killed by SIGKILL (9) / SIGINT (2), as wait(2) encodes it.
        assert_eq!(shell_status(ExitStatus::from_raw(9)), 137);
        assert_eq!(shell_status(ExitStatus::from_raw(2)), 130);
    }

    #[test]
    fn a_signal_sent_with_kill_is_seen_as_sent_not_from_the_terminal() {
        let mut rx = listen().expect("signal thread");
        // SAFETY: raise(3) sends SIGTERM to this process (SI_TKILL): the
        // handler just installed catches it.
        unsafe { libc::raise(SIGTERM) };
        let got = rx.blocking_recv().expect("a signal");
        assert_eq!(got, StopSignal { signal: SIGTERM, from_terminal: false });
    }
}
