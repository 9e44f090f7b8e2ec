//! One profiling session, as the stages a record passes through: setup, attach, the event loop
//! (consumer, library watcher, status line), and teardown.
//!
//! Data flows one way: ring buffer → decode → step tracking → batches → the
//! store's writer thread. Nothing here touches SQLite directly.

/// A line for the user on stderr, unless `--quiet`.
macro_rules! say {
    ($quiet:expr, $($arg:tt)*) => {
        if !$quiet { eprintln!("profiler: {}", format!($($arg)*)); }
    };
}

mod attach;
mod blas;
mod config;
mod consumer;
mod cpu_stacks;
mod drain;
mod event_loop;
mod jax;
mod job;
mod kernels;
mod loss;
mod nccl;
mod python_frames;
mod setup;
mod status;
mod symbolizer;
mod teardown;
mod torch;
mod watcher;

pub use config::{LaunchMode, LaunchedChild, SessionConfig, Target};
use consumer::Consumer;
use job::{Job, JobContext};
use setup::TargetProcess;
use status::StatusLine;
pub use teardown::Summary;
use watcher::LibraryWatcher;

use anyhow::Context;

use crate::{
    probes::{JobOptions, Probes, python::mechanism::PythonStepProbes},
    stop_signals,
    store::Store,
};

/// Runs a whole session. Errors before the session row exists are the user's
/// one-line errors; after that, everything collected is flushed whatever happens.
pub async fn profile(cfg: SessionConfig, target: Target) -> anyhow::Result<Summary> {
    // First of all: a Ctrl-C from here on stops the session, while the
    // probes go in too, rather than killing the profiler mid-attach.
    let mut stops = stop_signals::listen().context("cannot catch SIGINT/SIGTERM")?;
    let mut target = TargetProcess::open(target)?;
    let host = setup::read_trimmed("/proc/sys/kernel/hostname");
    let job_name = job::name_for(&cfg, target.var("TORCHELASTIC_RUN_ID"), host.as_deref(), target.pid);
    let first_rank = job::ranks(&|k| target.var(k)).0;
    // The first target's labels; every other process's come from its own session row.
    let labels = crate::metrics::SeriesLabels::of_process(&job_name, first_rank);
    let live = crate::metrics::Live::start(&cfg.live, &labels).await?;
    let store = Store::open(&cfg.output)?;
    // The step functions and NVML before anything is attached: a typo costs nothing.
    let steps = setup::resolve_steps(&cfg, &target)?;
    let gpu = setup::open_gpu(&cfg, &target)?;
    stopped_before_attach(&mut stops)?;
    let mut others: Vec<(u32, Option<u32>)> =
        job::existing(&target.others, target.pid).into_iter().map(|p| (p, None)).collect();
    let scan_children = cfg.follow_children && target.mode == "attach";
    let roots: Vec<u32> = std::iter::once(target.pid).chain(others.iter().map(|o| o.0)).collect();
    // The roots' descendants not in `known`, each with its parent.
    let new_children = |known: &[(u32, Option<u32>)]| -> Vec<(u32, Option<u32>)> {
        job::descendants(&roots)
            .into_iter()
            .filter(|(p, _)| !known.iter().any(|o| o.0 == *p))
            .map(|(p, parent)| (p, Some(parent)))
            .collect()
    };
    if scan_children {
        let children = new_children(&others);
        others.extend(children);
    }
    let pids: Vec<_> =
        std::iter::once(target.nz_pid).chain(others.iter().filter_map(|&(p, _)| p.try_into().ok())).collect();
    let emit = cfg.launch_mode.keeps_rows();
    let options = JobOptions {
        follow_children: cfg.follow_children,
        emit_launches: emit,
        place_probes: cfg.place_probes,
        sched: cfg.sched,
    };
    let (mut probes, mut rings) = Probes::load_job(&pids, options)?;
    // Stopped and joined when the session returns, after its last drain.
    let jit_names = crate::probes::jax::SharedJitNames::default();
    let _jit_reader = rings.jit_new.take().and_then(|ring| {
        crate::probes::jax::NameReader::spawn(ring, jit_names.clone())
            .inspect_err(|e| log::warn!("jitted functions' names are read in order only: {e}"))
            .ok()
    });
    if scan_children {
        // A child forked after the scan and before the fork hook went in is
        // in neither: the fork hook is in now, so a second scan finds the rest.
        let late = new_children(&others);
        let late_pids: Vec<std::num::NonZeroU32> = late.iter().filter_map(|&(p, _)| p.try_into().ok()).collect();
        probes.trace_more(&late_pids)?;
        others.extend(late);
    }
    stopped_before_attach(&mut stops)?;
    let cpu_sampler = cfg.cpu_sample_hz.and_then(|hz| {
        probes
            .attach_cpu_sampler(hz)
            .inspect_err(|e| eprintln!("profiler: warning: no CPU samples (--no-cpu-samples to not ask): {e}"))
            .ok()
    });
    let (session, writer) = setup::begin_session(&cfg, &target, store, &steps.regions, job_name)?;
    let sampled = gpu.as_ref().map(|g| g.logical_gpus()).unwrap_or_default();
    let gpu_peaks = std::sync::Arc::new(gpu.as_ref().map(|g| g.peaks()).unwrap_or_default());
    let (samplers, gpu_live) = setup::start_samplers(&cfg, target.pid, gpu, &writer, live.machine(&labels))?;
    let (gpu_live, nvml_processes) = gpu_live.unzip();

    // From here on, whatever happens, the session is finished and flushed.
    let mut consumer = Consumer::new(writer.sender(), steps.labels.clone(), steps.regions.clone(), target.pid);
    consumer.use_jit_steps(steps.jax.clone(), jit_names.clone(), cfg.quiet);
    consumer.keep_gemm_rows(cfg.launch_mode.keeps_rows());
    consumer.keep_copy_rows(cfg.launch_mode.keeps_rows());
    consumer.trace_sched(cfg.sched);
    let stack_namer = cpu_sampler.as_ref().map(|s| cpu_stacks::StackNamer::new(s.stacks.clone()));
    if let Some(namer) = &stack_namer {
        consumer.sample_cpu(namer.clone());
    }
    let watcher = LibraryWatcher::new(target.pid, torch::TorchWatch::new(&cfg, &steps.regions));
    let ctx = JobContext {
        cfg: cfg.clone(),
        template: session.start.clone(),
        sender: writer.sender(),
        labels: steps.labels.clone(),
        regions: steps.regions.clone(),
        jax: steps.jax.clone(),
        jit_names,
        gpus: sampled,
        nvml_processes,
        gpu_peaks,
        sampler_cvd: target.var("CUDA_VISIBLE_DEVICES"),
        live: live.sessions(),
        cpu_sampler,
        stack_namer,
    };
    // The first target's MFU is over the GPUs NVML lists it on, else all (as in `step_gpu`).
    consumer.live = ctx.live_for(&session.start, None, None);
    let mut job = Job::new(ctx, target.pid, consumer, watcher);
    let mut python = None;
    let outcome = match attach::attach_all(&cfg, &target, &mut probes, &mut job.watcher, &steps) {
        Ok((libraries, py)) => {
            if let Some(PythonStepProbes::FrameHook(hook)) = &py {
                job.frame_hook = hook.members();
            }
            python = py;
            job.first.store_libraries(libraries);
            job.watcher.hand_over(&mut job.first);
            let (id, pid, output) = (session.id, target.pid, session.output.display());
            let named = job.add_named(&others, &mut probes);
            let how = match (named, cfg.follow_children) {
                (0, false) => String::new(),
                (_, true) => format!(" and its children (job {})", job.name()),
                (n, false) => format!(" and {n} more (job {})", job.name()),
            };
            if let Ok(stop) = stops.try_recv() {
                // Stopped while the probes went in: they come off again, and
                // what they saw meanwhile is stored. A `run` command has not
                // started; it gets the signal at its gate, as it would have.
                let signal = stop.name();
                say!(cfg.quiet, "session {id}: {signal} while the probes went in on PID {pid}: detaching");
                if target.child.is_some()
                    && stop.needs_forwarding(stop_signals::own_process_group(), stop_signals::process_group(pid))
                {
                    stop_signals::forward(pid, stop.signal);
                }
                Ok((stop.end_reason().into(), None))
            } else {
                say!(cfg.quiet, "session {id}: tracing PID {pid}{how} into {output} (Ctrl-C to stop)");
                job.read_kallsyms();
                let mut status = StatusLine::new(cfg.status_line, gpu_live);
                let child = &mut target.child;
                let r = event_loop::run(&cfg, child, &mut probes, &mut rings, &mut job, &mut stops, &mut status).await;
                status.clear();
                r
            }
        }
        // The target ended while its probes went in: not an error. What the
        // probes in place saw is in the rings, and teardown takes it.
        Err(e) if !crate::probes::is_alive(target.pid) => {
            log::info!("attach stopped by the target's exit: {e:#}");
            let pid = target.pid;
            say!(cfg.quiet, "PID {pid} exited while the probes were going in; the session ends with what they saw");
            Ok(("target-exited".into(), None))
        }
        Err(e) => Err(e),
    };
    let traced = teardown::Traced { probes, rings, python, job, samplers, writer };
    let summary = teardown::finish(&cfg, &session, target.child.take(), traced, outcome, &mut stops).await;
    live.shutdown().await;
    summary
}

/// Fails with the user's one-line error when a stop signal came before
/// anything was attached (nothing is recorded yet: no session row, or one
/// with no probes behind it).
fn stopped_before_attach(stops: &mut stop_signals::Stops) -> anyhow::Result<()> {
    match stops.try_recv() {
        Ok(stop) => anyhow::bail!("stopped by {} before attaching: nothing was recorded", stop.name()),
        Err(_) => Ok(()),
    }
}
