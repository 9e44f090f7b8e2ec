//! One profiling session: checks, attach, the event loop, and the flush.
//!
//! Data flows one way: ring buffer → decode → step tracking → batches → the
//! store's writer thread. Nothing here touches SQLite directly.
use std::{
    collections::HashSet,
    num::NonZeroU32,
    os::fd::{FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, bail};
use profiler_common::{SyncApi, name_call};
use tokio::io::unix::AsyncFd;

use crate::{
    clock,
    events::{self, Event},
    privileges,
    probes::{
        self, Probes,
        maps::{self, LibraryKind},
        step_symbol::{self, StepSymbolSpec},
        usdt::{self, python::PythonStepSpec},
    },
    samplers::{
        self, SamplerThread,
        gpu::{GpuConfig, GpuSampler},
    },
    steps::StepTracker,
    stop_signals,
    store::{
        Capability, FinishHook, KernelRow, LaunchRow, LibraryRow, SessionEnd, SessionStart, StepRow, Store, StoreMsg,
        StoreWriter, SyncRow,
    },
};

/// Whether every launch gets a row, or only per-step counts are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LaunchMode {
    /// One row per launch in `launches` (about 60 bytes each on disk).
    All,
    /// Only `steps.launches` and the session total; no `launches` rows.
    Count,
}

impl LaunchMode {
    fn as_str(self) -> &'static str {
        match self {
            Self::All => "all",
            Self::Count => "count",
        }
    }
}

/// Everything a session needs, validated by the CLI layer.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    pub output: PathBuf,
    /// `--step-symbol`s, in order: the index is the probe id the kernel reports.
    pub steps: Vec<StepSymbolSpec>,
    /// `--step-python`s; their probe ids follow the symbols'.
    pub python_steps: Vec<PythonStepSpec>,
    pub launch_mode: LaunchMode,
    pub duration: Option<Duration>,
    pub maps_interval: Duration,
    pub quiet: bool,
    /// NVML sampling; None with `--no-gpu`.
    pub gpu: Option<GpuConfig>,
    /// `--require-gpu`: no NVML is an error, not NULLs.
    pub require_gpu: bool,
    /// Move launch probes to instructions the kernel emulates (off with `--probe-at-entry`).
    pub place_probes: bool,
    /// `--powercap-root`: a powercap tree to read instead of the system's RAPL.
    pub powercap_root: Option<PathBuf>,
    pub system_interval: Duration,
    /// `--disk`: the filesystem to report (default: the target's cwd).
    pub disk: Option<PathBuf>,
    /// A live status line on stderr (a terminal, and not `--quiet`).
    pub status_line: bool,
    /// `--steps` and `--step-region`s (#12 hook).
    pub step_mode: crate::regions::StepMode,
    pub step_regions: Vec<crate::regions::RegionStepSpec>,
}

/// A process started by `profiler run`, held before `exec` until the probes are in.
pub struct LaunchedChild {
    pub child: tokio::process::Child,
    /// Writing a byte here lets the child `exec`.
    pub release: OwnedFd,
    /// The program it will exec (its step symbol is searched here).
    pub exe: PathBuf,
    pub command: String,
}

pub enum Target {
    Attach(u32),
    Run(Box<LaunchedChild>),
}

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

macro_rules! say {
    ($quiet:expr, $($arg:tt)*) => {
        if !$quiet { eprintln!("profiler: {}", format!($($arg)*)); }
    };
}

mod torch; // #12 hook

/// Waits, up to 2 s, for an exec in progress in `process` to finish. Between
/// the switch to the new image and the end of its loading, /proc already
/// shows the new executable but an empty command line and environment
/// (`env_end` 0): attaching then would miss the target's `LD_LIBRARY_PATH`,
/// and so the driver library it is about to load. A test that starts a
/// process and attaches at once hits this window on a loaded machine.
fn wait_for_exec(process: &procfs::process::Process, pid: u32) {
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    loop {
        match process.stat() {
            Ok(st) if st.env_end == Some(0) => {}
            _ => return,
        }
        if std::time::Instant::now() >= deadline {
            log::warn!("PID {pid} still looks mid-exec (no environment yet): attaching anyway");
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscall; on success the returned fd is ours.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd returned by the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn ldconfig_cache() -> String {
    ["/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"]
        .iter()
        .find_map(|p| std::process::Command::new(p).arg("-p").output().ok())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// Runs a whole session. Errors before the session row exists are the user's
/// one-line errors; after that, everything collected is flushed whatever happens.
pub async fn profile(cfg: SessionConfig, target: Target) -> anyhow::Result<Summary> {
    // For `attach`, the target's process (its maps) and environment, read once.
    let mut attached: Option<(
        procfs::process::Process,
        std::collections::HashMap<std::ffi::OsString, std::ffi::OsString>,
    )> = None;
    let (pid, mut child, exe, command, mode) = match target {
        Target::Attach(pid) => {
            let process = procfs::process::Process::new(pid as i32)
                .map_err(|_| anyhow::anyhow!("no process with PID {pid}: check the PID (ps -p {pid})"))?;
            if process.stat().is_ok_and(|st| st.state == 'Z' || st.state == 'X') {
                bail!("process {pid} has already exited");
            }
            privileges::check().map_err(anyhow::Error::msg)?;
            wait_for_exec(&process, pid);
            let exe =
                process.exe().with_context(|| format!("cannot read /proc/{pid}/exe (has the process exited?)"))?;
            let command = process.cmdline().map(|args| args.join(" ")).unwrap_or_default();
            let env = process.environ().unwrap_or_default();
            attached = Some((process, env));
            (pid, None, exe, command, "attach")
        }
        Target::Run(c) => {
            let c = *c;
            let pid = c.child.id().context("the command exited before it could be profiled")?;
            (pid, Some((c.child, c.release)), c.exe, c.command, "run")
        }
    };
    let nz_pid = NonZeroU32::new(pid).context("PID 0 cannot be profiled")?;
    let target_var = |key: &str| match &attached {
        Some((_, env)) => env.get(std::ffi::OsStr::new(key)).map(|v| v.to_string_lossy().into_owned()),
        None => std::env::var(key).ok(),
    };

    let store = Store::open(&cfg.output)?;

    // The step functions, before anything is attached: a typo costs nothing.
    // Both kinds are searched in the executable and the files it maps (in
    // `run`, the target is still the exec gate: only what it will exec).
    let mapped = match &attached {
        Some((process, _)) if !(cfg.steps.is_empty() && cfg.python_steps.is_empty()) => {
            maps::mapped_files(&process.maps().with_context(|| format!("cannot read /proc/{pid}/maps"))?)
        }
        _ => Vec::new(),
    };
    let open_in_target = |p: &Path| probes::open_in_target(pid, p);
    let mut resolved_steps = Vec::new();
    if !cfg.steps.is_empty() {
        let mut candidates = vec![exe.clone()];
        candidates.extend(mapped.iter().map(|f| f.path.clone()).filter(|p| *p != exe));
        for spec in &cfg.steps {
            resolved_steps.push(step_symbol::resolve(spec, &candidates, open_in_target)?);
        }
    }
    // CPython's USDT probes: no probes is an error that says what to do.
    let python = if cfg.python_steps.is_empty() {
        None
    } else {
        Some(usdt::python::resolve(&usdt::python::candidates(&exe, &mapped), open_in_target)?)
    };
    // Labels live as long as the session's rows refer to them: one small leak per session.
    let labels: Vec<&'static str> = cfg
        .steps
        .iter()
        .map(|s| s.label.as_str())
        .chain(cfg.python_steps.iter().map(|s| s.label.as_str()))
        .map(|l| &*Box::leak(l.to_owned().into_boxed_str()))
        .collect();
    let (labels, region_steps) = torch::step_sources(&cfg, labels); // #12 hook

    // NVML before anything is attached: with --require-gpu its absence is an error.
    let gpu = match &cfg.gpu {
        None => Err("disabled with --no-gpu".to_string()),
        Some(g) => GpuSampler::open(g, pid, &target_var).map_err(|e| e.to_string()),
    };
    if let Err(e) = &gpu
        && cfg.gpu.is_some()
    {
        if cfg.require_gpu {
            bail!("{e} (--require-gpu)");
        }
        eprintln!("profiler: {e}; GPU metrics will be NULL (--no-gpu skips NVML, --require-gpu makes this an error)");
    }

    let (mut probes, mut rings) = Probes::load(nz_pid, cfg.launch_mode == LaunchMode::All, cfg.place_probes)?;

    let started_ns = clock::monotonic_ns();
    let session_id = store.begin_session(&SessionStart {
        pid,
        command,
        exe: Some(exe.display().to_string()),
        mode,
        launch_mode: cfg.launch_mode.as_str(),
        // #12 hook: the region sources are appended.
        step_symbol: torch::step_source_text(
            &cfg,
            (!cfg.steps.is_empty() || !cfg.python_steps.is_empty()).then(|| {
                cfg.steps
                    .iter()
                    .map(|s| s.to_string())
                    .chain(cfg.python_steps.iter().map(|s| format!("python:{s}")))
                    .collect::<Vec<_>>()
                    .join(" ")
            }),
            &region_steps,
        ),
        started_ns,
        unix_offset_ns: clock::unix_offset_ns(),
        hostname: std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|s| s.trim().to_owned()),
        kernel_release: std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|s| s.trim().to_owned()),
    })?;
    let (output, created) = (store.path().to_owned(), store.created());
    let writer = store.spawn_writer(session_id);

    // Samplers start before the step probes, so their series cover every step.
    let mut samplers: Vec<SamplerThread> = Vec::new();
    let mut gpu_live = None;
    match gpu {
        Ok(mut g) => {
            gpu_live = Some(g.live());
            g.start(writer.sender());
            let interval = cfg.gpu.as_ref().map_or(Duration::from_millis(100), |c| c.interval);
            samplers.push(SamplerThread::spawn("gpu", interval, g)?);
        }
        Err(reason) => writer.send(StoreMsg::Capability(Capability {
            source: "nvml".into(),
            metric: "*".into(),
            available: false,
            reason: Some(reason),
        })),
    }
    let rapl = samplers::rapl::open(cfg.powercap_root.as_deref());
    if let Err(e) = &rapl {
        say!(cfg.quiet, "{e}");
    }
    samplers.push(SamplerThread::spawn(
        "rapl",
        samplers::rapl::DEFAULT_INTERVAL,
        samplers::rapl::RaplSampler::new(rapl, writer.sender()),
    )?);
    samplers.push(SamplerThread::spawn(
        "system",
        cfg.system_interval,
        samplers::system::SystemSampler::new(pid, cfg.disk.clone(), writer.sender()),
    )?);

    // From here on, whatever happens, the session is finished and flushed.
    let mut consumer = Consumer::new(writer, labels.clone(), pid);
    consumer.torch = torch::RegionState::new(region_steps.clone(), labels); // #12 hook
    let mut watcher = LibraryWatcher {
        pid,
        seen: HashSet::new(),
        loader_hooked: false,
        failed: Default::default(),
        // #12 hook
        torch: torch::TorchWatch::new(
            region_steps.optimizer.is_some(),
            cfg.step_mode == crate::regions::StepMode::Torch,
        ),
    };
    let probed =
        attach_all(&cfg, pid, mode, &exe, &mut probes, &mut watcher, &resolved_steps, python.as_ref(), &target_var);
    let mut python_steps = None;
    let outcome = match probed {
        Ok((libraries, py)) => {
            python_steps = py;
            for l in libraries {
                consumer.writer.send(StoreMsg::Library(l));
            }
            say!(cfg.quiet, "session {session_id}: tracing PID {pid} into {} (Ctrl-C to stop)", output.display());
            let mut status = StatusLine::new(cfg.status_line, gpu_live);
            let r = run_loop(&cfg, pid, &mut child, &mut probes, &mut rings, &mut consumer, &mut watcher, &mut status)
                .await;
            status.clear();
            r
        }
        Err(e) => Err(e),
    };
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
    let kc = probes.counters();
    // Records from before the stop are still queued; those written while the
    // probes are being detached (neither instantaneous nor ordered between
    // probes) are not part of the session.
    consumer.cutoff_ns = Some(ended_ns);
    // Python's probes close alongside the rest (each close waits for the kernel).
    let staged = std::thread::scope(|scope| {
        if let Some(py) = python_steps {
            scope.spawn(move || py.detach());
        }
        probes.detach()
    });
    consumer.drain(&mut rings);
    consumer.release_held_steps();
    consumer.take_staged(&staged.records());
    // A sampler that panicked loses its series, not the session; it fails the run.
    let mut problems = Vec::new();
    let mut hooks = Vec::new();
    for sampler in samplers {
        match sampler.stop() {
            Ok(hook) => hooks.extend(hook),
            Err(e) => problems.push(e),
        }
    }
    let marked_steps = consumer.incomplete_steps.len() as u64;
    let steps_without_start = consumer.tracker.steps_without_start;
    hooks.push(consumer.loss_hook(kc));
    let (report, written) = consumer.finish(
        SessionEnd {
            ended_ns,
            end_reason: end_reason.clone(),
            lost_events: kc.lost,
            total_launches: kc.launches,
            unmatched_returns: 0,
        },
        hooks,
    )?;
    let secs = (ended_ns - started_ns) as f64 / 1e9;
    say!(cfg.quiet, "session {session_id} ended ({end_reason}) after {secs:.1} s: {} → {}", report, output.display());
    for warning in crate::steps::loss_warnings(&kc, marked_steps, steps_without_start) {
        eprintln!("profiler: warning: {warning}");
    }
    if end_reason.starts_with("error") {
        bail!("the session ended with an error; what was collected is in {}", output.display());
    }
    problems.extend(written);
    // The side files SQLite made since the open, under `sudo`.
    if created {
        crate::ownership::give_to_invoking_user(&output);
    }
    let failure = (!problems.is_empty())
        .then(|| format!("{}; what was committed is in {}", problems.join("; "), output.display()));

    // `run`: the command outlives the profiling window; wait for it and pass on its status.
    let exit_code = match (exit_code, child) {
        (Some(c), _) => Some(c),
        (None, Some((mut c, _))) => {
            say!(cfg.quiet, "waiting for the command to exit (profiling has stopped)");
            Some(stop_signals::shell_status(c.wait().await.context("waiting for the command")?))
        }
        (None, None) => None,
    };
    Ok(Summary { exit_code, failure })
}

/// Probes the CUDA libraries the target maps or will load, then the step
/// functions, native and Python. Returns the `libraries` rows and the Python
/// probes' handle (dropped before the rest detach).
#[expect(clippy::too_many_arguments, reason = "what the session resolved before attaching, borrowed separately")]
fn attach_all(
    cfg: &SessionConfig,
    pid: u32,
    mode: &str,
    exe: &Path,
    probes: &mut Probes,
    watcher: &mut LibraryWatcher,
    steps: &[step_symbol::ResolvedStep],
    python: Option<&usdt::python::PythonProbes>,
    target_var: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<(Vec<LibraryRow>, Option<usdt::python::PythonSteps>)> {
    let mut libraries: Vec<LibraryRow> = Vec::new();
    if mode == "attach" {
        watcher.scan_into(probes, &mut libraries, cfg.quiet, "maps");
    }
    // The loader's hook: libraries loaded from now on are looked for as soon
    // as it fires. In `run` the target has not exec'ed yet: the probe is on
    // the file, and the kernel puts it in whatever maps it later.
    match probes::loader_of(pid, exe) {
        Some(loader) => match probes.attach_loader(&probes::in_target_root(pid, &loader)) {
            Ok(Some(offset)) => {
                libraries.push(probe_row(
                    &loader,
                    "loader",
                    1,
                    format!("{} at file offset {offset:#x}", probes::LOADER_HOOK),
                ));
                watcher.loader_hooked = true;
            }
            Ok(None) => log::warn!(
                "{} exports no {}: new CUDA libraries are found by polling the maps",
                loader.display(),
                probes::LOADER_HOOK
            ),
            Err(e) => log::warn!("could not probe the dynamic loader {}: {e}", loader.display()),
        },
        None => log::info!("{} has no dynamic loader: new CUDA libraries are found by polling the maps", exe.display()),
    }
    // Probe the driver library where the target would find it, before it loads
    // it: PyTorch initialises CUDA lazily, and the first launches follow at once.
    for cand in maps::driver_candidates(target_var("LD_LIBRARY_PATH").as_deref(), &ldconfig_cache()) {
        let visible = probes::in_target_root(pid, &cand);
        if !visible.is_file() {
            continue;
        }
        match probes.attach_cuda_library(LibraryKind::Driver, &visible, &[]) {
            Ok(None) => {}
            Ok(Some(placed)) if placed.is_empty() => {}
            Ok(Some(placed)) => {
                watcher.seen.insert(cand.clone());
                libraries.push(library_row(&cand, LibraryKind::Driver, placed, "predicted"));
            }
            Err(e) => libraries.extend(watcher.not_probed(&cand, LibraryKind::Driver, "predicted", &e)),
        }
    }
    // The step probes go in last, so that every step they see has the launch
    // probes of the libraries known now in place for its whole span.
    for (probe_id, step) in steps.iter().enumerate() {
        let visible = if step.path.is_relative() { step.path.clone() } else { probes::in_target_root(pid, &step.path) };
        let visible = if visible.exists() { visible } else { step.path.clone() };
        probes.attach_step(&visible, step.file_offset, probe_id as u32)?;
        let how = format!("symbol {} at file offset {:#x}", step.symbol, step.file_offset);
        libraries.push(probe_row(&step.path, "step", 2, how));
        say!(cfg.quiet, "step function {} in {}", step.symbol, step.path.display());
    }
    let python_steps = match python {
        Some(py) => {
            let targets: Vec<usdt::python::PythonTarget> = cfg
                .python_steps
                .iter()
                .enumerate()
                .map(|(i, spec)| usdt::python::PythonTarget { spec: spec.clone(), label_id: (steps.len() + i) as u32 })
                .collect();
            let handle = probes.attach_python(py, &targets)?;
            let mut how = match py.version {
                Some((major, minor)) => format!("USDT python:function__entry/return (CPython {major}.{minor})"),
                None => "USDT python:function__entry/return".to_string(),
            };
            if handle.tracing_switched() {
                how.push_str(" + line semaphore (CPython 3.11)");
                say!(
                    cfg.quiet,
                    "CPython 3.11 fires function__entry only on its tracing path: Python calls now cost about 2 µs more each while attached"
                );
            }
            libraries.push(probe_row(&py.path, "step", handle.sites() as u32, how));
            Some(handle)
        }
        None => None,
    };
    if !libraries.iter().any(|l| l.kind == "driver" || l.kind == "runtime") {
        say!(
            cfg.quiet,
            "PID {pid} has no CUDA library mapped yet; launches will appear once it loads libcuda or libcudart"
        );
    }
    Ok((libraries, python_steps))
}

#[expect(clippy::too_many_arguments, reason = "the session's parts, borrowed separately so each can be finished after")]
async fn run_loop(
    cfg: &SessionConfig,
    pid: u32,
    child: &mut Option<(tokio::process::Child, OwnedFd)>,
    probes: &mut Probes,
    rings: &mut probes::Rings,
    consumer: &mut Consumer,
    watcher: &mut LibraryWatcher,
    status: &mut StatusLine,
) -> anyhow::Result<(String, Option<i32>)> {
    let mut stop_signals = stop_signals::listen().context("cannot catch SIGINT/SIGTERM")?;
    let deadline = cfg.duration.map(|d| tokio::time::Instant::now() + d);
    let pidfd = pidfd_open(pid).context("pidfd_open on the target")?;
    // SAFETY: an OwnedFd keeps its fd open and unchanged for its lifetime.
    let exit_fd = unsafe { AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE) }
        .map_err(|e| e.into_parts().1)?;
    // The probes submit without waking us (see profiler-ebpf): this tick
    // drains the ring buffer, and bounds the latency of everything else.
    let mut flush = tokio::time::interval(Duration::from_millis(20));
    flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // With the loader's hook probed, the maps are read when it fires and
    // polled only as a safety net (reading them costs the agent ≈1 ms per
    // thousand mappings, and a PyTorch process has thousands).
    let poll = if watcher.loader_hooked { cfg.maps_interval.max(LOADER_SAFETY_NET) } else { cfg.maps_interval };
    // The maps were read just now, by `attach_all`.
    let mut maps_tick = tokio::time::interval_at(tokio::time::Instant::now() + poll, poll);
    maps_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut status_tick = tokio::time::interval(Duration::from_secs(1));
    status_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    if let Some((_, release)) = child.as_ref() {
        // SAFETY: writing one byte from a valid buffer to an fd we own.
        let n = unsafe { libc::write(std::os::fd::AsRawFd::as_raw_fd(release), b"g".as_ptr().cast(), 1) };
        if n != 1 {
            bail!("could not start the command: {}", std::io::Error::last_os_error());
        }
    }
    let sleep_until = |d: Option<tokio::time::Instant>| async move {
        match d {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    // `run`: the command gets the signal that stops us, once.
    let forward_to_child = child.is_some();
    let own_pgid = stop_signals::own_process_group();
    loop {
        tokio::select! {
            _ = flush.tick() => {
                consumer.drain(rings);
                if std::mem::take(&mut consumer.loader_changed) {
                    watcher.scan(probes, consumer, cfg.quiet, "dlopen");
                }
                consumer.flush();
            }
            _ = status_tick.tick(), if status.enabled => {
                status.show(consumer, probes.counters());
            }
            _ = maps_tick.tick() => watcher.scan(probes, consumer, cfg.quiet, "maps"),
            Some(stop) = stop_signals.recv() => {
                if forward_to_child && stop.needs_forwarding(own_pgid, stop_signals::process_group(pid)) {
                    stop_signals::forward(pid, stop.signal);
                }
                return Ok((stop.end_reason().into(), None));
            }
            _ = sleep_until(deadline) => return Ok(("duration".into(), None)),
            r = exit_fd.readable() => {
                let _ = r?;
                let code = match child.as_mut() {
                    Some((c, _)) => Some(stop_signals::shell_status(c.wait().await.context("waiting for the command")?)),
                    None => None,
                };
                return Ok(("target-exited".into(), code));
            }
        }
    }
}

fn library_row(path: &Path, kind: LibraryKind, placed: Vec<probes::PlacedProbe>, how: &str) -> LibraryRow {
    LibraryRow {
        placed: placed.iter().map(|p| (p.symbol.to_string(), p.offset, p.reason.clone())).collect(),
        ..probe_row(path, kind.as_str(), placed.len() as u32, how.into())
    }
}

/// A `libraries` row for probes that are not launch probes (no `probes` rows).
fn probe_row(path: &Path, kind: &str, probes: u32, how: String) -> LibraryRow {
    LibraryRow {
        path: path.display().to_string(),
        kind: kind.into(),
        attached_ns: clock::monotonic_ns(),
        probes,
        how,
        placed: Vec::new(),
    }
}

/// Finds CUDA libraries in the target's maps and probes the new ones.
struct LibraryWatcher {
    pid: u32,
    /// Target-visible paths already handled.
    seen: HashSet<PathBuf>,
    /// Whether the dynamic loader's hook is probed (see `attach_all`).
    loader_hooked: bool,
    /// Paths whose probes failed (reported once, see `not_probed`), and when they were last tried.
    failed: std::collections::HashMap<PathBuf, std::time::Instant>,
    /// PyTorch's library (#12 hook).
    torch: torch::TorchWatch,
}

/// How long a library whose probes failed waits before it is tried again.
const RETRY_FAILED: Duration = Duration::from_secs(10);

/// How often the maps are polled when the loader's hook is probed.
const LOADER_SAFETY_NET: Duration = Duration::from_secs(2);

impl LibraryWatcher {
    /// Probes new CUDA libraries (their rows say `how` they were found), and
    /// leaves the maps with the stub symbolizer.
    fn scan(&mut self, probes: &mut Probes, consumer: &mut Consumer, quiet: bool, how: &str) {
        let mut rows = Vec::new();
        if let Some(maps) = self.scan_into(probes, &mut rows, quiet, how) {
            consumer.stubs.remember(maps);
        }
        for r in rows {
            consumer.writer.send(StoreMsg::Library(r));
        }
    }

    /// Probes new CUDA libraries; returns the maps it read.
    fn scan_into(
        &mut self,
        probes: &mut Probes,
        rows: &mut Vec<LibraryRow>,
        quiet: bool,
        how: &str,
    ) -> Option<procfs::process::MemoryMaps> {
        let maps = procfs::process::Process::new(self.pid as i32).and_then(|p| p.maps()).ok()?;
        // Each try of a failing library maps and parses it and takes back
        // what attached (≈90 ms a probe), on the loop that drains the rings:
        // not at every look.
        let due: Vec<PathBuf> =
            self.failed.iter().filter(|(_, at)| at.elapsed() >= RETRY_FAILED).map(|(p, _)| p.clone()).collect();
        for path in due {
            self.seen.remove(&path);
        }
        for (kind, file) in maps::cuda_libraries(&maps) {
            let text = maps::executable_ranges(&maps, &file);
            if kind == LibraryKind::Runtime && text.is_empty() {
                // Mid-dlopen (the loader reports before it maps the code): the
                // driver probes need the runtime's code ranges, so wait for the
                // next look, which the loader's next report brings.
                continue;
            }
            if !self.seen.insert(file.path.clone()) {
                continue;
            }
            let visible = probes::in_target_root(self.pid, &file.path);
            match probes.attach_cuda_library(kind, &visible, &text) {
                Ok(None) => {}
                Ok(Some(placed)) => {
                    self.failed.remove(&file.path);
                    if placed.is_empty() {
                        log::warn!("{} exports no launch entry point", file.path.display());
                    } else {
                        say!(quiet, "probing {} ({} probes)", file.path.display(), placed.len());
                    }
                    rows.push(library_row(&file.path, kind, placed, how));
                }
                // Nothing of it stays probed (all or nothing); a look after
                // RETRY_FAILED tries again (see the top of this function).
                Err(e) => rows.extend(self.not_probed(&file.path, kind, how, &e)),
            }
        }
        self.torch.scan(self.pid, probes, &maps, rows, quiet, how); // #12 hook
        Some(maps)
    }

    /// A library whose probes could not all attach: a warning and a
    /// `libraries` row (0 probes, and why), the first time only, since every
    /// later look tries it again.
    fn not_probed(&mut self, path: &Path, kind: LibraryKind, how: &str, e: &probes::ProbeError) -> Option<LibraryRow> {
        if self.failed.insert(path.to_owned(), std::time::Instant::now()).is_some() {
            return None;
        }
        // The OS error sits at the end of the chain (aya's says only which syscall failed).
        let mut why = e.to_string();
        let mut source = std::error::Error::source(e);
        while let Some(s) = source {
            let s_text = s.to_string();
            if !why.ends_with(&s_text) {
                why = format!("{why}: {s_text}");
            }
            source = s.source();
        }
        log::warn!("could not probe {} (tried again at each look for new libraries): {why}", path.display());
        Some(probe_row(path, kind.as_str(), 0, format!("not probed ({how}): {why}")))
    }
}

/// Finds the ELF symbol at an address of the target (runtime host stubs).
#[derive(Default)]
struct StubSymbolizer {
    /// (start, end, file offset, path) of the target's file mappings.
    maps: Vec<(u64, u64, u64, PathBuf)>,
    /// The watcher's last look at the maps, for a target that has exited.
    last_seen: Option<procfs::process::MemoryMaps>,
    /// Function symbols by file offset, per file.
    files: std::collections::HashMap<PathBuf, std::collections::HashMap<u64, String>>,
}

impl StubSymbolizer {
    /// The target's maps as last seen (kept, not parsed, in case it exits
    /// before its runtime launches are named).
    fn remember(&mut self, maps: procfs::process::MemoryMaps) {
        self.last_seen = Some(maps);
    }

    /// Reads the target's file mappings, once, before naming: its maps now,
    /// or, if it has exited, the watcher's last look (see `remember`).
    fn load_maps(&mut self, pid: u32) {
        let current = procfs::process::Process::new(pid as i32).and_then(|p| p.maps()).ok();
        if let Some(maps) = current.or_else(|| self.last_seen.take()) {
            self.maps = maps
                .0
                .into_iter()
                .filter_map(|m| match m.pathname {
                    procfs::process::MMapPath::Path(p) => Some((m.address.0, m.address.1, m.offset, p)),
                    _ => None,
                })
                .collect();
        }
    }

    /// The function symbol at `address` of the target (after `load_maps`).
    fn name(&mut self, pid: u32, address: u64) -> Option<String> {
        let (start, offset, path) =
            self.maps.iter().find(|m| address >= m.0 && address < m.1).map(|m| (m.0, m.2, m.3.clone()))?;
        let symbols = self.files.entry(path.clone()).or_insert_with(|| {
            // Mapped, not read: the file may be a gigabyte (libtorch_cuda.so);
            // only its symbol tables are touched.
            probes::open_in_target(pid, &path)
                .and_then(|data| probes::elf::function_symbols(&data).ok())
                .map(|syms| syms.into_iter().map(|s| (s.file_offset, s.name)).collect())
                .unwrap_or_default()
        });
        symbols.get(&(address - start + offset)).cloned()
    }
}

/// A synchronisation call in progress: (SyncApi id, start ns, the step its thread was in).
type OpenSync = (u32, u64, Option<(&'static str, u64)>);

/// The live status line: rewritten in place on stderr once a second.
struct StatusLine {
    enabled: bool,
    gpu: Option<crate::samplers::gpu::GpuLive>,
    started: std::time::Instant,
    last: Option<(std::time::Instant, u64, u64)>,
    shown: bool,
}

impl StatusLine {
    fn new(enabled: bool, gpu: Option<crate::samplers::gpu::GpuLive>) -> Self {
        Self { enabled, gpu, started: std::time::Instant::now(), last: None, shown: false }
    }

    fn show(&mut self, consumer: &Consumer, kc: probes::KernelCounters) {
        let now = std::time::Instant::now();
        let steps = consumer.completed_steps;
        let (steps_per_s, launches_per_s) = match self.last {
            Some((t, s, l)) => {
                let dt = (now - t).as_secs_f64().max(1e-3);
                ((steps - s) as f64 / dt, kc.launches.saturating_sub(l) as f64 / dt)
            }
            None => (0.0, 0.0),
        };
        self.last = Some((now, steps, kc.launches));
        let mut line = format!(
            "[{:>6.1} s] steps {steps} ({steps_per_s:.1}/s, last {}) | launches {launches_per_s:.0}/s",
            self.started.elapsed().as_secs_f64(),
            consumer.last_step_ns.map_or("–".to_string(), |ns| format!("{:.1} ms", ns as f64 / 1e6)),
        );
        if let Some(gpu) = self.gpu.as_ref().and_then(|g| g.lock().ok().map(|v| v.clone())) {
            for (l, util, power) in gpu {
                let f = |v: Option<f64>, unit: &str| v.map_or("–".to_string(), |v| format!("{v:.0}{unit}"));
                line.push_str(&format!(" | GPU{l} {} {}", f(util, "%"), f(power, " W")));
            }
        }
        line.push_str(&format!(" | lost {}", kc.lost));
        let width = terminal_width().unwrap_or(100);
        let line: String = line.chars().take(width.saturating_sub(1)).collect();
        eprint!("\r\x1b[2K{line}");
        self.shown = true;
    }

    fn clear(&mut self) {
        if self.shown {
            eprint!("\r\x1b[2K");
            self.shown = false;
        }
    }
}

fn terminal_width() -> Option<usize> {
    // SAFETY: TIOCGWINSZ fills a winsize we own.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: ioctl on stderr with a valid out-pointer.
    let ok = unsafe { libc::ioctl(libc::STDERR_FILENO, libc::TIOCGWINSZ, &mut ws) } == 0;
    (ok && ws.ws_col > 0).then_some(ws.ws_col as usize)
}

/// Turns records into rows, in batches.
struct Consumer {
    writer: StoreWriter,
    tracker: StepTracker,
    launches: Vec<LaunchRow>,
    steps: Vec<StepRow>,
    syncs: Vec<SyncRow>,
    /// Target process, for symbolising runtime host stubs.
    pid: u32,
    /// Kernel names by driver handle (`CUfunction` or `CUkernel`).
    names: std::collections::HashMap<u64, String>,
    /// Host-stub addresses of runtime launches, named at the end.
    stubs_seen: HashSet<u64>,
    stubs: StubSymbolizer,
    kernels: Vec<KernelRow>,
    /// Synchronisation calls in progress per thread.
    open_syncs: std::collections::HashMap<u32, Vec<OpenSync>>,
    decode_errors: u64,
    completed_steps: u64,
    step_ns_total: u128,
    last_step_ns: Option<u64>,
    /// Records stamped after this are dropped (see the end of [`profile`]).
    cutoff_ns: Option<u64>,
    /// The dynamic loader changed the target's libraries since the last look.
    loader_changed: bool,
    /// Step-ring events waiting for their place among the launches.
    step_queue: events::StepQueue,
    /// Launch-ring events read and not yet taken; step events handed on.
    chunk: Vec<Result<Event, events::DecodeError>>,
    released: Vec<Event>,
    /// (label, step) of the steps stored as incomplete (see `steps::LOSS_SCHEMA`).
    incomplete_steps: Vec<(&'static str, u64)>,
    /// PyTorch regions (#12 hook).
    torch: torch::RegionState,
}

const BATCH: usize = 16 * 1024;

/// Launch-ring records read before the step ring is read again (see `drain`).
const DRAIN_CHUNK: usize = 1024;

impl Consumer {
    fn new(writer: StoreWriter, labels: Vec<&'static str>, pid: u32) -> Self {
        Self {
            writer,
            tracker: StepTracker::new(labels),
            launches: Vec::with_capacity(BATCH),
            steps: Vec::new(),
            syncs: Vec::new(),
            open_syncs: Default::default(),
            pid,
            names: Default::default(),
            stubs_seen: HashSet::new(),
            stubs: StubSymbolizer::default(),
            kernels: Vec::new(),
            decode_errors: 0,
            completed_steps: 0,
            step_ns_total: 0,
            last_step_ns: None,
            cutoff_ns: None,
            loader_changed: false,
            step_queue: events::StepQueue::default(),
            chunk: Vec::new(),
            released: Vec::new(),
            incomplete_steps: Vec::new(),
            torch: Default::default(), // #12 hook
        }
    }

    /// Drains both rings: the launch ring a chunk at a time, and after each
    /// chunk the step ring, so that every step event before a launch of the
    /// chunk is in when that launch is taken (see `events::StepQueue`).
    fn drain(&mut self, rings: &mut probes::Rings) {
        let mut chunk = std::mem::take(&mut self.chunk);
        let mut steps = std::mem::take(&mut self.released);
        loop {
            let mut read = 0;
            while read < DRAIN_CHUNK {
                let Some(item) = rings.launches.next() else { break };
                read += 1;
                chunk.extend(events::records(&item).map(events::decode));
            }
            while let Some(item) = rings.steps.next() {
                match events::decode(&item) {
                    Ok(e) => self.step_queue.push(e, &mut steps),
                    Err(e) => self.take(Err(e)),
                }
            }
            for event in chunk.drain(..) {
                if let Ok(Event::Launch(l)) = &event {
                    self.step_queue.before_launch(l.tid, l.ts_ns, &mut steps);
                }
                for s in steps.drain(..) {
                    self.take(Ok(s));
                }
                self.take(event);
            }
            if read < DRAIN_CHUNK {
                break;
            }
        }
        self.step_queue.end_drain(&mut steps);
        for s in steps.drain(..) {
            self.take(Ok(s));
        }
        self.chunk = chunk;
        self.released = steps;
    }

    /// Takes the step events still held: the probes are gone and both rings
    /// drained, so nothing can come before them any more.
    fn release_held_steps(&mut self) {
        let mut steps = std::mem::take(&mut self.released);
        self.step_queue.release_all(&mut steps);
        for s in steps.drain(..) {
            self.take(Ok(s));
        }
        self.released = steps;
    }

    /// Checks a step-ring event's place in its thread's sequence; after a gap,
    /// stores the steps that ended unseen and forgets the thread's open syncs.
    fn sequence(&mut self, e: &events::StepEvent, change: crate::steps::DepthChange) {
        let mut ended = Vec::new();
        if self.tracker.sequence(e.tid, e.probe, e.seq, e.depth, change, &mut ended) {
            self.open_syncs.remove(&e.tid);
        }
        for s in ended {
            self.store_open_step(s);
        }
    }

    /// A step with no end: begun and not ended, or ended unseen.
    fn store_open_step(&mut self, s: crate::steps::OpenStep) {
        if s.incomplete {
            self.incomplete_steps.push((s.label, s.step));
        }
        self.steps.push(StepRow {
            sync_wait_ns: None,
            label: s.label.to_owned(),
            step: s.step,
            tid: s.tid,
            start_ns: s.start_ns,
            end_ns: None,
            inter_step_ns: s.inter_step_ns,
            launches: None,
        });
    }

    /// Stores, in the session's last transaction, what was lost: the step
    /// ring's share of the lost records, the failed map updates, and which
    /// steps are incomplete.
    fn loss_hook(&mut self, kc: probes::KernelCounters) -> FinishHook {
        let open = self.tracker.open_steps().into_iter().filter(|s| s.incomplete).map(|s| (s.label, s.step));
        let mut incomplete = std::mem::take(&mut self.incomplete_steps);
        incomplete.extend(open);
        Box::new(move |conn, session| crate::steps::store_losses(conn, session, &kc, &incomplete))
    }

    /// Launch records the threads still had staged when tracing stopped:
    /// each thread's come after everything it wrote to the ring buffer.
    fn take_staged(&mut self, staged: &[profiler_common::LaunchRecord]) {
        for r in staged {
            self.take(events::launch(r));
        }
    }

    fn take(&mut self, event: Result<Event, events::DecodeError>) {
        if let (Some(cutoff), Ok(e)) = (self.cutoff_ns, &event)
            && e.ts_ns() > cutoff
        {
            return;
        }
        match event {
            Ok(Event::Launch(l)) => {
                if l.api.layer() == profiler_common::ApiLayer::Runtime {
                    // Named at the end, off the event path (see `name_runtime_stubs`).
                    self.stubs_seen.insert(l.function);
                }
                // Launch records exist only in `--launches all`: in `count`
                // mode the kernel side never writes them.
                self.launches.push(LaunchRow {
                    ts_ns: l.ts_ns,
                    tid: l.tid,
                    api: l.api,
                    function: l.function,
                    grid: l.grid,
                    block: l.block,
                    shared_mem_bytes: l.shared_mem_bytes,
                    stream: l.stream,
                    step: self.tracker.current_step(l.tid),
                });
                if self.launches.len() >= BATCH {
                    self.flush_launches();
                }
            }
            Ok(Event::LoaderChange { .. }) => self.loader_changed = true,
            Ok(Event::StepEnter(e)) => {
                self.sequence(&e, crate::steps::DepthChange::Enter);
                self.tracker.enter(e.tid, e.probe, e.ts_ns, e.thread_launches);
            }
            Ok(Event::StepExit(e)) => {
                self.sequence(&e, crate::steps::DepthChange::Exit);
                if let Some(s) = self.tracker.exit(e.tid, e.probe, e.ts_ns, e.thread_launches) {
                    if s.incomplete {
                        self.incomplete_steps.push((s.label, s.step));
                    }
                    self.completed_steps += 1;
                    self.step_ns_total += u128::from(s.end_ns - s.start_ns);
                    self.last_step_ns = Some(s.end_ns - s.start_ns);
                    self.steps.push(StepRow {
                        sync_wait_ns: Some(s.sync_wait_ns),
                        label: s.label.to_owned(),
                        step: s.step,
                        tid: s.tid,
                        start_ns: s.start_ns,
                        end_ns: Some(s.end_ns),
                        inter_step_ns: s.inter_step_ns,
                        launches: Some(s.launches),
                    });
                }
            }
            Ok(Event::KernelName(k)) => self.kernel_name(k),
            Ok(Event::RegionEnter(r)) => self.region_event(r, true), // #12 hook
            Ok(Event::RegionExit(r)) => self.region_event(r, false), // #12 hook
            Ok(Event::SyncEnter(e)) => {
                self.sequence(&e, crate::steps::DepthChange::None);
                let step = self.tracker.current_step(e.tid);
                self.open_syncs.entry(e.tid).or_default().push((e.probe, e.ts_ns, step));
            }
            Ok(Event::SyncExit(e)) => {
                self.sequence(&e, crate::steps::DepthChange::None);
                let open = self.open_syncs.get_mut(&e.tid).and_then(Vec::pop);
                if let Some((probe, start_ns, step)) = open
                    && let Some(api) = SyncApi::from_u32(probe)
                {
                    let ns = e.ts_ns.saturating_sub(start_ns);
                    self.tracker.add_sync_wait(e.tid, ns);
                    self.syncs.push(SyncRow { tid: e.tid, api: api.symbol(), start_ns, end_ns: e.ts_ns, step });
                }
            }
            Ok(Event::ThreadExit(e)) => {
                self.sequence(&e, crate::steps::DepthChange::None);
                self.open_syncs.remove(&e.tid);
                self.regions_thread_exited(e.tid); // #12 hook
                for s in self.tracker.thread_exited(e.tid) {
                    self.store_open_step(s);
                }
            }
            Err(e) => {
                if self.decode_errors == 0 {
                    log::error!("undecodable record: {e}");
                }
                self.decode_errors += 1;
            }
        }
    }

    fn kernel_name(&mut self, k: crate::events::KernelNameEvent) {
        let (name, source) = match k.which {
            name_call::MODULE_GET_FUNCTION => (k.name, "cuModuleGetFunction"),
            name_call::LIBRARY_GET_KERNEL => (k.name, "cuLibraryGetKernel"),
            name_call::KERNEL_GET_FUNCTION => match self.names.get(&k.kernel) {
                Some(n) => (n.clone(), "cuKernelGetFunction"),
                None => return,
            },
            _ => return,
        };
        if name.is_empty() {
            return;
        }
        // A handle named again with another name was reused (its module
        // unloaded, the address given to a new kernel): launches from now on
        // are that kernel's, so the new name gets a row of its own.
        if self.names.get(&k.handle) != Some(&name) {
            self.names.insert(k.handle, name.clone());
            let demangled_name = probes::elf::demangled_full(&name);
            self.kernels.push(KernelRow { function: k.handle, named_ns: k.ts_ns, name, demangled_name, source });
        }
    }

    /// A runtime launch names its kernel by the host stub's address, whose
    /// ELF symbol is the kernel's mangled name. Done once, at the end: the
    /// first look into a library's symbols (libtorch_cuda.so has hundreds of
    /// thousands) would otherwise stall the ring-buffer drain.
    fn name_runtime_stubs(&mut self) {
        if self.stubs_seen.is_empty() {
            return;
        }
        let mut stubs: Vec<u64> = self.stubs_seen.iter().copied().collect();
        stubs.sort_unstable();
        self.stubs.load_maps(self.pid);
        for address in stubs {
            if let Some(name) = self.stubs.name(self.pid, address) {
                let demangled_name = probes::elf::demangled_full(&name);
                // A host stub's symbol names it for the whole session.
                self.kernels.push(KernelRow { function: address, named_ns: 0, name, demangled_name, source: "symbol" });
            }
        }
    }

    fn flush_launches(&mut self) {
        if !self.launches.is_empty() {
            let batch = std::mem::replace(&mut self.launches, Vec::with_capacity(BATCH));
            self.writer.send(StoreMsg::Launches(batch));
        }
    }

    fn flush(&mut self) {
        self.flush_launches();
        if !self.steps.is_empty() {
            self.writer.send(StoreMsg::Steps(std::mem::take(&mut self.steps)));
        }
        if !self.syncs.is_empty() {
            self.writer.send(StoreMsg::Syncs(std::mem::take(&mut self.syncs)));
        }
        if !self.kernels.is_empty() {
            self.writer.send(StoreMsg::Kernels(std::mem::take(&mut self.kernels)));
        }
        self.flush_regions(); // #12 hook
    }

    /// Stores steps still open (end NULL), finishes the session, and returns a
    /// one-line description of what was stored, and what could not be.
    fn finish(mut self, mut end: SessionEnd, hooks: Vec<FinishHook>) -> anyhow::Result<(String, Vec<String>)> {
        self.name_runtime_stubs();
        for s in self.tracker.open_steps() {
            self.store_open_step(s);
        }
        self.finish_regions(); // #12 hook
        self.flush();
        end.unmatched_returns = self.tracker.unmatched_returns;
        let stats = self.writer.finish(end.clone(), hooks)?;
        let problems: Vec<String> = stats
            .first_error
            .iter()
            .map(|e| match stats.failed_rows {
                0 => e.clone(),
                n => format!("{n} rows could not be written: {e}"),
            })
            .collect();
        if self.decode_errors > 0 {
            eprintln!("profiler: warning: {} records could not be decoded", self.decode_errors);
        }
        let mean = if self.completed_steps > 0 {
            format!(" (mean {:.3} ms)", self.step_ns_total as f64 / self.completed_steps as f64 / 1e6)
        } else {
            String::new()
        };
        let report = format!(
            "{} steps{mean}, {} launches seen, {} launch rows, {} lost events",
            self.completed_steps, end.total_launches, stats.launches, end.lost_events
        );
        Ok((report, problems))
    }
}

#[cfg(test)]
mod summary_tests {
    use super::Summary;

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
