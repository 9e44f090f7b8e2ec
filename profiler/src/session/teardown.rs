//! The end of a session: detach, take the last records, stop the samplers, finish the store (the
//! session's last transaction), tell the user, and the profiler's exit status.
use std::os::fd::OwnedFd;

use anyhow::{Context, bail};

use super::{
    config::SessionConfig,
    consumer::{Consumer, ConsumerTotals},
    job::Job,
    setup::BegunSession,
};
use crate::{
    clock,
    probes::{self, KernelCounters, Probes, python::mechanism::PythonStepProbes},
    samplers::SamplerThread,
    stop_signals,
    store::{AtFinish, Losses, SessionEnd, StoreWriter},
};

/// What the user is told at the end.
#[derive(Debug)]
pub struct Summary {
    /// The `run` command's status as a shell reports it (its exit code, or
    /// 128 + the signal that killed it), when it was waited for.
    pub exit_code: Option<i32>,
    /// Why the profile is incomplete (rows that could not be written, a
    /// sampler or the writer that panicked), in one line; None when it is not.
    pub failure: Option<String>,
}

impl Summary {
    /// The profiler's exit status: the `run` command's when it failed, else 1
    /// for an incomplete profile, else the command's (0 for `attach`).
    pub fn exit_code(&self) -> std::process::ExitCode {
        let code = match (self.exit_code, &self.failure) {
            (Some(c), _) if c != 0 => c,
            (_, Some(_)) => 1,
            (c, None) => c.unwrap_or(0),
        };
        std::process::ExitCode::from(u8::try_from(code).unwrap_or(1))
    }

    /// Prints the failure line, if there is one.
    pub fn report_failure(&self) {
        if let Some(f) = &self.failure {
            eprintln!("profiler: error: {f}");
        }
    }
}

/// What tracing leaves to take down.
pub(super) struct Traced {
    pub probes: Probes,
    pub rings: probes::Rings,
    /// Python's probes, when they were attached.
    pub python: Option<PythonStepProbes>,
    /// Every traced process's consumer.
    pub job: Job,
    pub samplers: Vec<SamplerThread>,
    /// The first session's writer (the job's other sessions share it).
    pub writer: StoreWriter,
}

/// Ends the session whatever happened while tracing (`outcome`: the end
/// reason and the `run` command's status, or the error that ended it), and
/// flushes everything collected.
pub(super) async fn finish(
    cfg: &SessionConfig,
    session: &BegunSession,
    child: Option<(tokio::process::Child, OwnedFd)>,
    mut traced: Traced,
    outcome: anyhow::Result<(String, Option<i32>)>,
    stops: &mut stop_signals::Stops,
) -> anyhow::Result<Summary> {
    let (end_reason, exit_code) = match outcome {
        Ok(v) => v,
        Err(e) => {
            eprintln!("profiler: error: {e:#}");
            (format!("error: {e:#}"), None)
        }
    };
    // The session ends when we decide to stop; detaching (which waits for the
    // kernel to retire each uprobe) can take a while and is not part of it.
    let ended_ns = clock::monotonic_ns();
    let kc = traced.probes.counters();
    let first_sched = traced.job.take_all_sched(&mut traced.probes);
    traced.probes.log_sched_mismatches();
    traced.probes.write_sched_history();
    let cpu_sampling = traced.job.cpu_sampling(cfg.quiet);
    let job = detach_and_drain(traced.probes, traced.rings, traced.python, traced.job, ended_ns);
    let late_records = job.late_records;
    // The job's other processes end first: their rows go before the first session's end.
    let consumer = job.into_first(&end_reason, ended_ns);
    let mut consumer = consumer;
    if let Some(live) = &mut consumer.live {
        live.kernel_counters(&kc);
    }
    // A sampler that panicked loses its series, not the session; it fails the run.
    let (mut problems, mut at_finish) = stop_samplers(traced.samplers);
    at_finish.extend(first_sched.map(AtFinish::ContextSwitches));
    at_finish.extend(cpu_sampling.map(AtFinish::CpuSampling));
    let (marked_steps, steps_without_start) = consumer.loss_counts();
    let end = SessionEnd {
        ended_ns,
        end_reason: end_reason.clone(),
        lost_events: kc.lost + late_records,
        total_launches: kc.launches,
        unmatched_returns: 0,
    };
    let (report, written) = finish_store(consumer, traced.writer, kc, end, at_finish)?;
    let secs = (ended_ns - session.started_ns) as f64 / 1e9;
    let (id, output) = (session.id, &session.output);
    say!(cfg.quiet, "session {id} ended ({end_reason}) after {secs:.1} s: {} → {}", report, output.display());
    if late_records > 0 {
        eprintln!(
            "profiler: warning: {late_records} records came after their process's session had ended and were \
             dropped (counted in lost_events): that process's last steps may have no end"
        );
    }
    for warning in super::loss::loss_warnings(&kc, marked_steps, steps_without_start) {
        eprintln!("profiler: warning: {warning}");
    }
    if end_reason.starts_with("error") {
        bail!("the session ended with an error; what was collected is in {}", output.display());
    }
    problems.extend(written);
    // The side files SQLite made since the open, under `sudo`.
    if session.created {
        crate::ownership::give_to_invoking_user(&crate::store::profile_files(output));
    }
    let failure = (!problems.is_empty())
        .then(|| format!("{}; what was committed is in {}", problems.join("; "), output.display()));
    let exit_code = command_status(cfg, exit_code, child, stops).await?;
    Ok(Summary { exit_code, failure })
}

/// Detaches every probe, then takes what the rings and the threads' staging
/// still hold, up to `ended_ns`.
fn detach_and_drain(
    probes: Probes,
    mut rings: probes::Rings,
    python: Option<PythonStepProbes>,
    mut job: Job,
    ended_ns: u64,
) -> Job {
    // Records from before the stop are still queued; those written while the
    // probes are being detached (neither instantaneous nor ordered between
    // probes) are not part of the session.
    job.set_cutoff(ended_ns);
    // Python's probes close alongside the rest (each close waits for the kernel).
    let staged = std::thread::scope(|scope| {
        if let Some(py) = python {
            scope.spawn(move || py.detach());
        }
        probes.detach()
    });
    job.drain_last(&mut rings, &staged.records());
    job
}

/// Stops the samplers: the problems of those that panicked, and what the
/// others hand the store's last transaction (series to derive per-step figures from).
fn stop_samplers(samplers: Vec<SamplerThread>) -> (Vec<String>, Vec<AtFinish>) {
    let mut problems = Vec::new();
    let mut at_finish = Vec::new();
    for sampler in samplers {
        match sampler.stop() {
            Ok(what) => at_finish.extend(what),
            Err(e) => problems.push(e),
        }
    }
    (problems, at_finish)
}

/// Finishes the session in the store, with what was lost (the step ring's
/// share of the lost records, the failed map updates, and which steps are
/// incomplete) in its last transaction. Returns a one-line description of
/// what was stored, and what could not be.
fn finish_store(
    mut consumer: Consumer,
    writer: StoreWriter,
    kc: KernelCounters,
    mut end: SessionEnd,
    mut at_finish: Vec<AtFinish>,
) -> anyhow::Result<(String, Vec<String>)> {
    let incomplete = consumer.take_incomplete_steps();
    at_finish.push(AtFinish::Losses(Losses {
        lost_step_records: kc.lost_step_records,
        lost_off_cpu_records: kc.lost_off_cpu,
        map_failures: kc.map_failures,
        incomplete,
    }));
    let totals = consumer.close();
    end.unmatched_returns = totals.unmatched_returns;
    let stats = writer.finish(end.clone(), at_finish)?;
    let problems: Vec<String> = stats
        .first_error
        .iter()
        .map(|e| match stats.failed_rows {
            0 => e.clone(),
            n => format!("{n} rows could not be written: {e}"),
        })
        .collect();
    if totals.decode_errors > 0 {
        eprintln!("profiler: warning: {} records could not be decoded", totals.decode_errors);
    }
    let report =
        format!("{}, {} launch rows, {} lost events", totals_line(&totals, &end), stats.launches, end.lost_events);
    Ok((report, problems))
}

/// "N steps (mean X ms), M launches seen", with the steps stored with no end
/// after the completed ones: a JAX step ends only at the next call, so a loop
/// of N calls is N − 1 completed steps and one open.
fn totals_line(totals: &ConsumerTotals, end: &SessionEnd) -> String {
    let mean = if totals.completed_steps > 0 {
        format!(" (mean {:.3} ms)", totals.step_ns_total as f64 / totals.completed_steps as f64 / 1e6)
    } else {
        String::new()
    };
    let open = match totals.open_steps {
        0 => String::new(),
        n => format!(" and {n} open (stored with no end)"),
    };
    format!("{} steps{mean}{open}, {} launches seen", totals.completed_steps, end.total_launches)
}

/// `run`: the command outlives the profiling window; waits for it and passes
/// on its status. A stop signal meanwhile goes on to the command (as in the
/// event loop), which gets [`COMMAND_GRACE`] to exit; the profiler then
/// exits as the signal would have it (everything is stored by now), leaving a
/// command that ignores it running.
async fn command_status(
    cfg: &SessionConfig,
    exit_code: Option<i32>,
    child: Option<(tokio::process::Child, OwnedFd)>,
    stops: &mut stop_signals::Stops,
) -> anyhow::Result<Option<i32>> {
    let (mut c, _gate) = match (exit_code, child) {
        (Some(code), _) => return Ok(Some(code)),
        (None, None) => return Ok(None),
        (None, Some(child)) => child,
    };
    say!(cfg.quiet, "waiting for the command to exit (profiling has stopped)");
    let stop = tokio::select! {
        status = c.wait() => return Ok(Some(stop_signals::shell_status(status.context("waiting for the command")?))),
        Some(stop) = stops.recv() => stop,
    };
    if let Some(pid) = c.id()
        && stop.needs_forwarding(stop_signals::own_process_group(), stop_signals::process_group(pid))
    {
        stop_signals::forward(pid, stop.signal);
    }
    match tokio::time::timeout(COMMAND_GRACE, c.wait()).await {
        Ok(status) => Ok(Some(stop_signals::shell_status(status.context("waiting for the command")?))),
        Err(_) => {
            let pid = c.id().map_or_else(String::new, |p| format!(" (PID {p})"));
            eprintln!("profiler: the command{pid} did not exit on {}; not waiting for it", stop.name());
            Ok(Some(128 + stop.signal))
        }
    }
}

/// How long a `run` command that got a stop signal while the profiler waited
/// for it has to exit before the profiler stops waiting (every profiler
/// process ends within a second of SIGTERM).
const COMMAND_GRACE: std::time::Duration = std::time::Duration::from_millis(700);

#[cfg(test)]
mod tests {
    use super::{ConsumerTotals, SessionEnd, Summary, totals_line};

    #[test]
    fn the_summary_counts_open_steps_apart_from_completed_ones() {
        let end = SessionEnd {
            ended_ns: 0,
            end_reason: String::new(),
            lost_events: 0,
            total_launches: 7,
            unmatched_returns: 0,
        };
        let totals = |completed_steps, open_steps| ConsumerTotals {
            completed_steps,
            open_steps,
            step_ns_total: u128::from(completed_steps) * 2_000_000,
            decode_errors: 0,
            unmatched_returns: 0,
        };
        assert_eq!(
            totals_line(&totals(199, 1), &end),
            "199 steps (mean 2.000 ms) and 1 open (stored with no end), 7 launches seen"
        );
        assert_eq!(totals_line(&totals(3, 0), &end), "3 steps (mean 2.000 ms), 7 launches seen");
        assert_eq!(totals_line(&totals(0, 0), &end), "0 steps, 7 launches seen");
    }

    fn code(exit_code: Option<i32>, failure: bool) -> std::process::ExitCode {
        Summary { exit_code, failure: failure.then(|| "3 rows could not be written".into()) }.exit_code()
    }

    #[test]
    fn the_exit_status_is_the_commands_else_1_for_an_incomplete_profile() {
        use std::process::ExitCode;
        assert_eq!(code(None, false), ExitCode::SUCCESS);
        assert_eq!(code(Some(0), false), ExitCode::SUCCESS);
        assert_eq!(code(Some(130), false), ExitCode::from(130));
        assert_eq!(code(Some(7), true), ExitCode::from(7));
        assert_eq!(code(Some(0), true), ExitCode::from(1));
        assert_eq!(code(None, true), ExitCode::from(1));
    }
}
