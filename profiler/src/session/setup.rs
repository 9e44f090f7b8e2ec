//! Before anything is attached: the target checked and read, the step functions resolved, NVML opened,
//! the session row begun and the samplers started.
use std::{
    collections::HashMap,
    ffi::{OsStr, OsString},
    num::NonZeroU32,
    os::fd::OwnedFd,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, bail};

use super::config::{SessionConfig, Target};
use crate::{
    clock, privileges,
    probes::{
        self,
        maps::{self, MappedFile},
        python::{
            interpreter,
            mechanism::{self, PythonMechanism},
        },
        step_symbol::{self, ResolvedStep},
    },
    regions::RegionSteps,
    samplers::{
        self, SamplerThread,
        gpu::{GpuLive, GpuProcesses, GpuSampler},
    },
    store::{Capability, SessionStart, Store, StoreMsg, StoreWriter},
};

/// The process being profiled, as read before anything is attached.
pub(super) struct TargetProcess {
    pub pid: u32,
    pub nz_pid: NonZeroU32,
    pub exe: PathBuf,
    pub command: String,
    /// "attach" or "run", as stored with the session.
    pub mode: &'static str,
    /// `attach`: the target's process (its maps) and environment, read once.
    attached: Option<(procfs::process::Process, HashMap<OsString, OsString>)>,
    /// `run`: the command, and the gate it waits on before `exec`.
    pub child: Option<(tokio::process::Child, OwnedFd)>,
    /// `attach`: the further PIDs named (checked later, see `job::existing`).
    pub others: Vec<u32>,
}

impl TargetProcess {
    pub fn open(target: Target) -> anyhow::Result<Self> {
        let target = match target {
            Target::Attach(pids) => Self::attach_first(&pids)?,
            Target::Run(c) => {
                let c = *c;
                let pid = c.child.id().context("the command exited before it could be profiled")?;
                Self::new(pid, c.exe, c.command, "run", None, Some((c.child, c.release)))?
            }
        };
        Ok(target)
    }

    /// The first of `pids` that can be traced; with several, one that does
    /// not exist is named and skipped.
    fn attach_first(pids: &[u32]) -> anyhow::Result<Self> {
        let several = pids.len() > 1;
        for (i, &pid) in pids.iter().enumerate() {
            if several && !crate::probes::is_alive(pid) {
                eprintln!("profiler: no process with PID {pid}: skipped; the others are traced");
                continue;
            }
            let mut t = Self::attach(pid)?;
            t.others = pids[i + 1..].to_vec();
            return Ok(t);
        }
        bail!("none of the PIDs {pids:?} exists: check them (ps -p PID)")
    }

    fn attach(pid: u32) -> anyhow::Result<Self> {
        let process = procfs::process::Process::new(pid as i32)
            .map_err(|_| anyhow::anyhow!("no process with PID {pid}: check the PID (ps -p {pid})"))?;
        if process.stat().is_ok_and(|st| crate::probes::has_exited(&st)) {
            bail!("process {pid} has already exited");
        }
        privileges::check().map_err(anyhow::Error::msg)?;
        wait_for_exec(&process, pid);
        let exe = process.exe().with_context(|| format!("cannot read /proc/{pid}/exe (has the process exited?)"))?;
        let command = process.cmdline().map(|args| args.join(" ")).unwrap_or_default();
        let env = process.environ().unwrap_or_default();
        Self::new(pid, exe, command, "attach", Some((process, env)), None)
    }

    fn new(
        pid: u32,
        exe: PathBuf,
        command: String,
        mode: &'static str,
        attached: Option<(procfs::process::Process, HashMap<OsString, OsString>)>,
        child: Option<(tokio::process::Child, OwnedFd)>,
    ) -> anyhow::Result<Self> {
        let nz_pid = NonZeroU32::new(pid).context("PID 0 cannot be profiled")?;
        Ok(Self { pid, nz_pid, exe, command, mode, attached, child, others: Vec::new() })
    }

    /// A variable of the target's environment: for `run`, the profiler's
    /// own, which the command inherits.
    pub fn var(&self, key: &str) -> Option<String> {
        match &self.attached {
            Some((_, env)) => env.get(OsStr::new(key)).map(|v| v.to_string_lossy().into_owned()),
            None => std::env::var(key).ok(),
        }
    }

    /// The files an attached target maps, read only when a step function is
    /// to be searched in them (in `run`, the target is still the exec gate).
    fn mapped_files(&self, cfg: &SessionConfig) -> anyhow::Result<Vec<MappedFile>> {
        match &self.attached {
            Some((process, _)) if !(cfg.steps.is_empty() && cfg.python_steps.is_empty()) => {
                let pid = self.pid;
                Ok(maps::mapped_files(&process.maps().with_context(|| format!("cannot read /proc/{pid}/maps"))?))
            }
            _ => Ok(Vec::new()),
        }
    }
}

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

/// The step functions, found before anything is attached.
pub(super) struct StepFunctions {
    /// The `--step-symbol`s, in probe-id order.
    pub symbols: Vec<ResolvedStep>,
    /// How the `--step-python`s are seen (USDT or the frame hook), when one is named.
    pub python: Option<PythonMechanism>,
    /// Every step's label, by probe id.
    pub labels: Vec<&'static str>,
    /// The step sources PyTorch's regions make (their probe ids follow the others').
    pub regions: RegionSteps,
    /// The jitted functions that make JAX steps (their probe ids come last).
    pub jax: crate::jax_steps::JitSources,
}

/// Resolves the step functions: a typo costs nothing yet. Both kinds are
/// searched in the executable and the files it maps.
pub(super) fn resolve_steps(cfg: &SessionConfig, target: &TargetProcess) -> anyhow::Result<StepFunctions> {
    let (pid, exe) = (target.pid, &target.exe);
    let mapped = target.mapped_files(cfg)?;
    let open_in_target = |p: &Path| probes::open_in_target(pid, p);
    let mut symbols = Vec::new();
    if !cfg.steps.is_empty() {
        let mut candidates = vec![exe.clone()];
        candidates.extend(mapped.iter().map(|f| f.path.clone()).filter(|p| p != exe));
        for spec in &cfg.steps {
            symbols.push(step_symbol::resolve(spec, &candidates, open_in_target)?);
        }
    }
    // CPython's USDT probes, else the frame hook: neither is an error that says what to do.
    let python = if cfg.python_steps.is_empty() {
        None
    } else {
        let ld_path = target.var("LD_LIBRARY_PATH");
        let candidates_of = |exe: &Path, mapped: &[MappedFile]| {
            let mut candidates = interpreter::candidates(exe, mapped);
            // `run` mode: nothing is mapped yet; the libpython the command will load.
            if mapped.is_empty() {
                candidates.extend(interpreter::needed_libpython(exe, ld_path.as_deref()));
            }
            candidates
        };
        match mechanism::resolve(&candidates_of(exe, &mapped), open_in_target, cfg.target_writes) {
            Ok(found) => Some(found),
            // A wrapper (`bash train.sh`, a batch job's script) followed with its
            // children: the steps are in the CPython it runs or starts.
            Err(e) if cfg.follow_children && e.none_is_cpython() => {
                let found = job_pythons(target).into_iter().find_map(|(python, why)| {
                    let found = mechanism::resolve(&candidates_of(&python, &[]), open_in_target, cfg.target_writes);
                    Some((found.ok()?, python, why))
                });
                let Some((found, python, why)) = found else { return Err(e.into()) };
                say!(
                    cfg.quiet,
                    "{} is not CPython: --step-python looks in the processes of the job that run {} ({why})",
                    exe.display(),
                    python.display()
                );
                Some(found)
            }
            Err(e) => return Err(e.into()),
        }
    };
    // Labels live as long as the session's rows refer to them: one small leak per session.
    let mut labels: Vec<&'static str> = cfg
        .steps
        .iter()
        .map(|s| s.label.as_str())
        .chain(cfg.python_steps.iter().map(|s| s.label.as_str()))
        .map(|l| &*Box::leak(l.to_owned().into_boxed_str()))
        .collect();
    let regions = super::torch::step_sources(cfg, &mut labels);
    let jax = super::jax::step_sources(cfg, &mut labels);
    Ok(StepFunctions { symbols, python, labels, regions, jax })
}

/// The CPythons a job whose first target is none may run, each with why:
/// those its descendants run now (`attach`), then the `python3` its PATH
/// names (through a version manager's shim), which a wrapper most likely starts.
fn job_pythons(target: &TargetProcess) -> Vec<(PathBuf, &'static str)> {
    let mut out: Vec<(PathBuf, &'static str)> = Vec::new();
    let cwd = if target.mode == "attach" {
        for (pid, _) in super::job::descendants(&[target.pid]) {
            if let Ok(exe) = std::fs::read_link(format!("/proc/{pid}/exe"))
                && !out.iter().any(|(p, _)| *p == exe)
            {
                out.push((exe, "a process it started runs it"));
            }
        }
        std::fs::read_link(format!("/proc/{}/cwd", target.pid)).unwrap_or_default()
    } else {
        std::env::current_dir().unwrap_or_default()
    };
    let path = target.var("PATH").map(std::ffi::OsString::from);
    if let Some(python) = crate::command_path::path_python(path.as_deref(), &cwd, target.mode == "run") {
        out.push((python, "python3 on its PATH"));
    }
    out
}

/// NVML, before anything is attached: with `--require-gpu` its absence is an
/// error; otherwise the reason it is missing, stored as a capability.
pub(super) fn open_gpu(cfg: &SessionConfig, target: &TargetProcess) -> anyhow::Result<Result<GpuSampler, String>> {
    let gpu = match &cfg.gpu {
        None => Err("disabled with --no-gpu".to_string()),
        Some(g) => GpuSampler::open(g, target.pid, &|key| target.var(key)).map_err(|e| e.to_string()),
    };
    if let Err(e) = &gpu
        && cfg.gpu.is_some()
    {
        if cfg.require_gpu {
            bail!("{e} (--require-gpu)");
        }
        eprintln!("profiler: {e}; GPU metrics will be NULL (--no-gpu skips NVML, --require-gpu makes this an error)");
    }
    Ok(gpu)
}

/// The session row, once written.
pub(super) struct BegunSession {
    pub id: i64,
    /// Its row as begun: the job's other sessions are made from it.
    pub start: SessionStart,
    pub started_ns: u64,
    pub output: PathBuf,
    /// This run created the file (see `ownership`).
    pub created: bool,
}

/// Writes the session row and hands the store to its writer thread.
pub(super) fn begin_session(
    cfg: &SessionConfig,
    target: &TargetProcess,
    store: Store,
    regions: &RegionSteps,
    job: String,
) -> anyhow::Result<(BegunSession, StoreWriter)> {
    let started_ns = clock::monotonic_ns();
    let (rank, local_rank, world_size) = super::job::ranks(&|k| target.var(k));
    let start = SessionStart {
        pid: target.pid,
        command: target.command.clone(),
        exe: Some(target.exe.display().to_string()),
        mode: target.mode,
        launch_mode: cfg.launch_mode.as_str(),
        step_source: super::jax::step_source_text(cfg, super::torch::step_source_text(cfg, step_specs(cfg), regions)),
        started_ns,
        unix_offset_ns: clock::unix_offset_ns(),
        hostname: read_trimmed("/proc/sys/kernel/hostname"),
        kernel_release: read_trimmed("/proc/sys/kernel/osrelease"),
        job,
        rank,
        local_rank,
        world_size,
        parent_pid: None,
    };
    let id = store.begin_session(&start)?;
    let begun = BegunSession { id, start, started_ns, output: store.path().to_owned(), created: store.created() };
    Ok((begun, store.spawn_writer_with(id, budget_config(cfg))))
}

/// The writer's size budget from `--max-size`, `--min-free`, `--launches auto`.
fn budget_config(cfg: &SessionConfig) -> crate::store::budget::BudgetConfig {
    use crate::store::budget::{AUTO_EXPECTED, BudgetConfig};
    let auto = (cfg.launch_mode == super::LaunchMode::Auto).then(|| cfg.duration.unwrap_or(AUTO_EXPECTED));
    BudgetConfig { max_size: cfg.max_size, min_free: cfg.min_free, auto_launches: auto }
}

/// The step functions as named on the command line, space-separated.
fn step_specs(cfg: &SessionConfig) -> Option<String> {
    (!cfg.steps.is_empty() || !cfg.python_steps.is_empty()).then(|| {
        cfg.steps
            .iter()
            .map(|s| s.to_string())
            .chain(cfg.python_steps.iter().map(|s| format!("python:{s}")))
            .collect::<Vec<_>>()
            .join(" ")
    })
}

pub(super) fn read_trimmed(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_owned())
}

/// What the session reads of the GPU sampler while it runs: the latest
/// readings (status line) and the processes NVML lists (a job's ranks' GPUs).
pub(super) type GpuHandles = (GpuLive, GpuProcesses);

/// Starts the GPU, RAPL and system samplers, before the step probes, so that
/// their series cover every step. Returns them and the GPU's live values
/// for the status line.
pub(super) fn start_samplers(
    cfg: &SessionConfig,
    pid: u32,
    gpu: Result<GpuSampler, String>,
    writer: &StoreWriter,
    live: Option<crate::metrics::MachineMetrics>,
) -> anyhow::Result<(Vec<SamplerThread>, Option<GpuHandles>)> {
    let mut samplers: Vec<SamplerThread> = Vec::new();
    let mut gpu_live = None;
    match gpu {
        Ok(mut g) => {
            gpu_live = Some((g.live(), g.processes()));
            g.live_metrics = live.clone();
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
    let mut rapl = samplers::rapl::RaplSampler::new(rapl, writer.sender());
    rapl.live = live;
    samplers.push(SamplerThread::spawn("rapl", samplers::rapl::DEFAULT_INTERVAL, rapl)?);
    samplers.push(SamplerThread::spawn(
        "system",
        cfg.system_interval,
        samplers::system::SystemSampler::new(pid, cfg.disk.clone(), writer.sender()),
    )?);
    Ok((samplers, gpu_live))
}
