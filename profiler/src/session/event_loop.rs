//! The event loop while tracing: drains the rings on a tick, looks for new libraries, updates the
//! status line, and ends on a stop signal, the `--duration`, or the target's exit.
use std::{os::fd::OwnedFd, time::Duration};

use anyhow::{Context, bail};
use tokio::{
    io::unix::AsyncFd,
    time::{Instant, Interval, MissedTickBehavior},
};

use super::{config::SessionConfig, job::Job, status::StatusLine};
use crate::{
    probes::{self, Probes},
    stop_signals,
};

/// How often the maps are polled when the loader's hook is probed.
const LOADER_SAFETY_NET: Duration = Duration::from_secs(2);

/// Traces until told to stop; returns the session's `end_reason` and, when
/// the `run` command exited, its status. The first target's exit ends it
/// once the job's other processes have ended too.
pub(super) async fn run(
    cfg: &SessionConfig,
    child: &mut Option<(tokio::process::Child, OwnedFd)>,
    probes: &mut Probes,
    rings: &mut probes::Rings,
    job: &mut Job,
    stops: &mut stop_signals::Stops,
    status: &mut StatusLine,
) -> anyhow::Result<(String, Option<i32>)> {
    let pid = job.first_pid();
    let deadline = cfg.duration.map(|d| Instant::now() + d);
    // None: the first target exited while the probes went in (the job's
    // other processes, if any, go on).
    let exit_fd = target_exit(pid)?;
    let mut ticks = Ticks::new(cfg, job.watcher.loader_hooked);
    // Set when the first target has exited: (its `run` status).
    let mut first_exited: Option<Option<i32>> = None;
    if exit_fd.is_none() {
        let code = match child.as_mut() {
            Some((c, _)) => Some(stop_signals::shell_status(c.wait().await.context("waiting for the command")?)),
            None => None,
        };
        first_exited = Some(code);
    }
    if let Some((_, release)) = child.as_ref() {
        release_command(release)?;
    }
    // `run`: the command gets the signal that stops us, once.
    let forward_to_child = child.is_some();
    let own_pgid = stop_signals::own_process_group();
    loop {
        tokio::select! {
            _ = ticks.flush.tick() => {
                job.tick(rings, probes);
                if let Some(code) = first_exited && job.live_members() == 0 {
                    return Ok(("target-exited".into(), code));
                }
                if job.budget_spent() {
                    return Ok(("budget".into(), None));
                }
            }
            _ = ticks.status.tick(), if status.enabled || job.first.live.is_some() => {
                let kc = probes.counters();
                // The kernel's counters are the job's: on the first process's series.
                if let Some(live) = &mut job.first.live {
                    live.kernel_counters(&kc);
                }
                if status.enabled {
                    let ranks = job.ranks_status();
                    status.show(job.completed_steps(), job.first.last_step_ns, kc, ranks);
                }
            }
            _ = ticks.maps.tick() => job.scan_maps(probes),
            Some(stop) = stops.recv() => {
                if forward_to_child && stop.needs_forwarding(own_pgid, stop_signals::process_group(pid)) {
                    stop_signals::forward(pid, stop.signal);
                }
                return Ok((stop.end_reason().into(), None));
            }
            _ = sleep_until(deadline) => return Ok(("duration".into(), None)),
            r = first_target_exit(exit_fd.as_ref()), if first_exited.is_none() => {
                r?;
                let code = match child.as_mut() {
                    Some((c, _)) => Some(stop_signals::shell_status(c.wait().await.context("waiting for the command")?)),
                    None => None,
                };
                if job.live_members() == 0 {
                    return Ok(("target-exited".into(), code));
                }
                first_exited = Some(code);
            }
        }
    }
}

/// The loop's timers.
struct Ticks {
    /// Drains the rings.
    flush: Interval,
    /// Looks at the target's maps for new libraries.
    maps: Interval,
    /// Rewrites the status line.
    status: Interval,
}

impl Ticks {
    fn new(cfg: &SessionConfig, loader_hooked: bool) -> Self {
        // The probes submit without waking us (see profiler-ebpf): this tick
        // drains the ring buffer, and bounds the latency of everything else.
        let mut flush = tokio::time::interval(Duration::from_millis(20));
        flush.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // With the loader's hook probed, the maps are read when it fires and
        // polled only as a safety net (reading them costs the agent ≈1 ms per
        // thousand mappings, and a PyTorch process has thousands).
        let poll = if loader_hooked { cfg.maps_interval.max(LOADER_SAFETY_NET) } else { cfg.maps_interval };
        // The maps were read just now, by `attach_all`.
        let mut maps = tokio::time::interval_at(Instant::now() + poll, poll);
        maps.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut status = tokio::time::interval(Duration::from_secs(1));
        status.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Self { flush, maps, status }
    }
}

/// Becomes readable when the target exits; None when it already has.
fn target_exit(pid: u32) -> anyhow::Result<Option<AsyncFd<OwnedFd>>> {
    let pid = rustix::process::Pid::from_raw(pid as i32).context("pidfd_open on the target: not a PID")?;
    let pidfd = match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) {
        Err(rustix::io::Errno::SRCH) => return Ok(None),
        r => r.context("pidfd_open on the target")?,
    };
    // SAFETY: an OwnedFd keeps its fd open and unchanged for its lifetime.
    let exit_fd = unsafe { AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE) }
        .map_err(|e| e.into_parts().1)?;
    Ok(Some(exit_fd))
}

/// The first target's exit (see `target_exit`).
async fn first_target_exit(exit_fd: Option<&AsyncFd<OwnedFd>>) -> anyhow::Result<()> {
    match exit_fd {
        Some(fd) => fd.readable().await.map(drop).map_err(Into::into),
        None => std::future::pending().await,
    }
}

/// Lets the `run` command, held at its exec gate, go on.
fn release_command(release: &OwnedFd) -> anyhow::Result<()> {
    match rustix::io::write(release, b"g") {
        Ok(1) => Ok(()),
        Ok(_) => bail!("could not start the command: the exec gate took no byte"),
        Err(e) => bail!("could not start the command: {e}"),
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
