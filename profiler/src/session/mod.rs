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
mod event_loop;
mod kernels;
mod nccl;
mod setup;
mod status;
mod symbolizer;
mod teardown;
mod torch;
mod watcher;

pub use config::{LaunchMode, LaunchedChild, SessionConfig, Target};
use consumer::Consumer;
use setup::TargetProcess;
use status::StatusLine;
pub use teardown::Summary;
use watcher::LibraryWatcher;

use crate::{probes::Probes, store::Store};

/// Runs a whole session. Errors before the session row exists are the user's
/// one-line errors; after that, everything collected is flushed whatever happens.
pub async fn profile(cfg: SessionConfig, target: Target) -> anyhow::Result<Summary> {
    let mut target = TargetProcess::open(target)?;
    // The one place a session's job, host and rank are decided, for its live series.
    let labels = crate::metrics::SeriesLabels::placeholder(&target.exe);
    let live = crate::metrics::Live::start(&cfg.live, &labels).await?;
    let store = Store::open(&cfg.output)?;
    // The step functions and NVML before anything is attached: a typo costs nothing.
    let steps = setup::resolve_steps(&cfg, &target)?;
    let gpu = setup::open_gpu(&cfg, &target)?;
    let (mut probes, mut rings) = Probes::load(target.nz_pid, cfg.launch_mode == LaunchMode::All, cfg.place_probes)?;
    let (session, writer) = setup::begin_session(&cfg, &target, store, &steps.regions)?;
    let (samplers, gpu_live) = setup::start_samplers(&cfg, target.pid, gpu, &writer, live.machine(&labels))?;

    // From here on, whatever happens, the session is finished and flushed.
    let mut consumer = Consumer::new(writer, steps.labels.clone(), steps.regions.clone(), target.pid);
    consumer.live = live.session(&labels, &steps.labels);
    consumer.keep_gemm_rows(cfg.launch_mode == LaunchMode::All);
    let mut watcher = LibraryWatcher::new(target.pid, torch::TorchWatch::new(&cfg, &steps.regions));
    let mut python = None;
    let outcome = match attach::attach_all(&cfg, &target, &mut probes, &mut watcher, &steps) {
        Ok((libraries, py)) => {
            python = py;
            consumer.store_libraries(libraries);
            let (id, pid, output) = (session.id, target.pid, session.output.display());
            say!(cfg.quiet, "session {id}: tracing PID {pid} into {output} (Ctrl-C to stop)");
            let mut status = StatusLine::new(cfg.status_line, gpu_live);
            let (child, consumer, watcher) = (&mut target.child, &mut consumer, &mut watcher);
            let r = event_loop::run(&cfg, pid, child, &mut probes, &mut rings, consumer, watcher, &mut status).await;
            status.clear();
            r
        }
        Err(e) => Err(e),
    };
    let traced = teardown::Traced { probes, rings, python, consumer, samplers };
    let summary = teardown::finish(&cfg, &session, target.child.take(), traced, outcome).await;
    live.shutdown().await;
    summary
}
