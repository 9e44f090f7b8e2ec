//! What a session is asked to do: its settings, validated by the CLI layer, and its target.
use std::{os::fd::OwnedFd, path::PathBuf, time::Duration};

use crate::{
    probes::{python::spec::PythonStepSpec, step_symbol::StepSymbolSpec},
    regions::{RegionStepSpec, StepMode},
    samplers::gpu::GpuConfig,
};

/// Whether every launch gets a row, or only per-step counts are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LaunchMode {
    /// One row per launch in `launches` (about 60 bytes each on disk).
    All,
    /// Only `steps.launches` and the session total; no `launches` rows.
    Count,
    /// Rows while the launch rate is modest; counts only from when it would
    /// spend the size budget within the session's expected length
    /// (`--duration`, else a day), recorded in `sessions.launch_rows_stopped_ns`.
    Auto,
}

impl LaunchMode {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Self::All => "all",
            Self::Count => "count",
            Self::Auto => "auto",
        }
    }

    /// Whether launch (and GEMM) rows are stored, at least at first.
    pub fn keeps_rows(self) -> bool {
        self != Self::Count
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
    /// Whether the PEP 523 frame hook may write into the target (off with `--no-target-writes`).
    pub target_writes: bool,
    pub launch_mode: LaunchMode,
    /// The scheduler programs (off with `--no-sched`).
    pub sched: bool,
    /// `--cpu-sample HZ`: CPU samples of the traced threads; None with `--no-cpu-samples`.
    pub cpu_sample_hz: Option<u32>,
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
    /// `--steps`: where steps come from when none is named.
    pub step_mode: StepMode,
    /// `--step-region`s; their probe ids follow the PyTorch optimizer's (if any).
    pub step_regions: Vec<RegionStepSpec>,
    /// `--prometheus`, `--otlp`: live metrics while tracing.
    pub live: crate::metrics::LiveConfig,
    /// `--job`: the job id of every session (see `job::job_name`).
    pub job: Option<String>,
    /// Trace the processes the targets start (`attach --children`; `run` unless `--no-children`).
    pub follow_children: bool,
    /// `--step-jit`s; their probe ids follow every other source's.
    pub step_jits: Vec<crate::jax_steps::JitStepSpec>,
    /// `--max-size`: the profile's size budget, bytes.
    pub max_size: u64,
    /// `--min-free`: the free space the profile leaves on its filesystem.
    pub min_free: crate::store::budget::MinFree,
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
    /// `attach`: the PIDs named, the first one first.
    Attach(Vec<u32>),
    Run(Box<LaunchedChild>),
}
