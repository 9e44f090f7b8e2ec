//! The rows the store writes, as the rest of the profiler hands them over:
//! one struct per table (or per kind of update), no SQL.
use profiler_common::LaunchApi;

use crate::steps::StepPhases;

/// What the session row holds at the start.
#[derive(Clone, Debug)]
pub struct SessionStart {
    pub pid: u32,
    pub command: String,
    pub exe: Option<String>,
    pub mode: &'static str,
    pub launch_mode: &'static str,
    /// Every step source (`--step-symbol`, `--step-python`), space-separated.
    pub step_source: Option<String>,
    pub started_ns: u64,
    pub unix_offset_ns: i64,
    pub hostname: Option<String>,
    pub kernel_release: Option<String>,
    /// The job every process of one profiler run shares (`--job`, else the
    /// first target's TORCHELASTIC_RUN_ID, else generated).
    pub job: String,
    /// The process's RANK, LOCAL_RANK, WORLD_SIZE (None when absent or not a number).
    pub rank: Option<i64>,
    pub local_rank: Option<i64>,
    pub world_size: Option<i64>,
    /// The traced process it was forked from (None for a named target).
    pub parent_pid: Option<u32>,
}

/// What the session row gets at the end.
#[derive(Clone, Debug)]
pub struct SessionEnd {
    pub ended_ns: u64,
    pub end_reason: String,
    pub lost_events: u64,
    pub total_launches: u64,
    pub unmatched_returns: u64,
}

#[derive(Clone, Copy, Debug)]
pub struct LaunchRow {
    pub ts_ns: u64,
    pub tid: u32,
    pub api: LaunchApi,
    pub function: u64,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    pub stream: u64,
    /// The step the launching thread was in: (label, step).
    pub step: Option<(&'static str, u64)>,
}

/// A launch handle (or runtime host stub) and its kernel's name.
#[derive(Clone, Debug)]
pub struct KernelRow {
    pub function: u64,
    /// When the handle got this name (0: for the whole session).
    pub named_ns: u64,
    pub name: String,
    pub demangled_name: Option<String>,
    /// `cuModuleGetFunction`, `cuLibraryGetKernel`, `cuKernelGetFunction`, or `symbol` (runtime host stub).
    pub source: &'static str,
}

/// One host synchronisation call.
#[derive(Clone, Debug)]
pub struct SyncRow {
    pub tid: u32,
    pub api: &'static str,
    pub start_ns: u64,
    pub end_ns: u64,
    /// The step the thread was in when the call began.
    pub step: Option<(&'static str, u64)>,
}

#[derive(Clone, Debug)]
pub struct StepRow {
    pub sync_wait_ns: Option<u64>,
    pub label: String,
    pub step: u64,
    pub tid: u32,
    pub start_ns: u64,
    pub end_ns: Option<u64>,
    pub inter_step_ns: Option<u64>,
    pub launches: Option<u64>,
    /// Where a step from PyTorch's optimizer markers spent its time; None for other sources.
    pub phases: Option<StepPhases>,
    /// Its thread's time by scheduler state; None without scheduler tracing.
    pub sched: Option<crate::steps::StepSched>,
    /// Its thread's copies and memsets.
    pub copies: crate::steps::CopyTotals,
}

/// One copy or memset call (a `copies` row, `--launches all`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyRow {
    pub tid: u32,
    /// The entry point called.
    pub api: &'static str,
    /// `h2d`, `d2h`, `d2d`, `h2h`, `memset` or `unknown`.
    pub direction: &'static str,
    pub bytes: u64,
    pub result: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    /// The step its thread was in: (label, step).
    pub step: Option<(&'static str, u64)>,
}

/// One CPU sample (a `cpu_samples` row).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuSampleRow {
    pub tid: u32,
    pub time_ns: u64,
    /// The session's `stacks.stack_id`.
    pub stack_id: u32,
    pub in_kernel: bool,
    /// The step its thread was in: (label, step).
    pub step: Option<(&'static str, u64)>,
}

/// A frame first seen (a `frames` row).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrameRow {
    pub frame_id: u32,
    /// `native`, `kernel` or `python`.
    pub kind: &'static str,
    pub module: Option<String>,
    pub function: String,
    /// A Python frame's first line.
    pub line: Option<u32>,
}

/// A stack first seen: its frames' ids, leaf first (`stacks` rows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackRow {
    pub stack_id: u32,
    pub frames: Vec<u32>,
}

/// The CPU sampler's rate and kernel-side counts (`sessions.cpu_sample_hz` …).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuSampling {
    pub hz: u32,
    pub counts: crate::probes::cpu::CpuSampleCounts,
    /// Err: why the kernel did not count it.
    pub kernel: Result<crate::probes::cpu::SamplerKernelCost, String>,
}

/// One time a thread was off its CPU (an `off_cpu` row, `--launches all`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffCpuRow {
    pub tid: u32,
    /// `runnable`, `sleeping` or `blocked`.
    pub state: &'static str,
    pub left_ns: u64,
    pub woken_ns: Option<u64>,
    pub resumed_ns: u64,
}

/// One PyTorch `record_function` region (a `regions` row).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionRow {
    pub tid: u32,
    pub name: String,
    /// `name` is the first bytes of a longer name.
    pub truncated: bool,
    pub start_ns: u64,
    /// None: its end was not seen.
    pub end_ns: Option<u64>,
    /// The step its thread was in when it began: (label, step).
    pub step: Option<(&'static str, u64)>,
}

/// One call of a `jax.jit` function (a `jit_calls` row).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JitCallRow {
    pub tid: u32,
    /// None: the name could not be read.
    pub name: Option<String>,
    /// The `PjitFunction*`.
    pub function: u64,
    pub start_ns: u64,
    /// None: its return was not seen.
    pub end_ns: Option<u64>,
    pub depth: u32,
    /// The step its thread was in when it began: (label, step).
    pub step: Option<(&'static str, u64)>,
}

/// One NCCL call (a `collectives` row); None where the call has no such argument.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectiveRow {
    pub tid: u32,
    /// `all_reduce`, `send`, `group_start`, … (`CollectiveOp::as_str`).
    pub op: &'static str,
    pub count: Option<u64>,
    /// NCCL's name of the datatype, or its number when NCCL defines none.
    pub datatype: Option<String>,
    /// count × element size; None when the datatype is unknown.
    pub bytes: Option<u64>,
    pub peer: Option<i32>,
    pub comm: Option<u64>,
    pub stream: Option<u64>,
    /// Host time in the call.
    pub start_ns: u64,
    pub end_ns: u64,
    /// The step its thread was in: (label, step).
    pub step: Option<(&'static str, u64)>,
}

/// A file the profiler probed (a CUDA library, a step function's object,
/// the dynamic loader) and the probes it placed there.
#[derive(Clone, Debug)]
pub struct ProbedFileRow {
    pub path: String,
    /// (symbol, offset from its start, why there) of each probe.
    pub placed: Vec<(String, u64, String)>,
    pub kind: String,
    pub attached_ns: u64,
    pub probes: u32,
    pub how: String,
}

impl ProbedFileRow {
    /// `path`, probed now with `probes` probes (`placed` left empty: not
    /// launch probes, or none placed), of `kind`, `how` it was found.
    pub fn now(path: &std::path::Path, kind: &str, probes: u32, how: String) -> Self {
        Self {
            path: path.display().to_string(),
            kind: kind.into(),
            attached_ns: crate::clock::monotonic_ns(),
            probes,
            how,
            placed: Vec::new(),
        }
    }
}

/// A metric's availability, recorded once per session.
#[derive(Clone, Debug)]
pub struct Capability {
    pub source: String,
    pub metric: String,
    pub available: bool,
    pub reason: Option<String>,
}

/// One GPU chosen for sampling (a `gpus` row).
#[derive(Clone, Debug, PartialEq)]
pub struct GpuRow {
    /// The GPU's number as the target's CUDA sees it.
    pub gpu: u32,
    pub nvml_index: u32,
    pub uuid: String,
    pub name: Option<String>,
    pub memory_total_mib: Option<f64>,
    pub power_limit_w: Option<f64>,
    pub driver_version: Option<String>,
    /// `instant` (field 186) or `average` (1 s power usage).
    pub power_source: &'static str,
    pub max_sm_clock_mhz: Option<f64>,
}

/// One reading of one GPU (a `gpu_samples` row); None where NVML could not say.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuSampleRow {
    pub gpu: u32,
    pub ts_ns: u64,
    pub utilization_gpu_pct: Option<f64>,
    pub utilization_memory_pct: Option<f64>,
    pub memory_used_mib: Option<f64>,
    pub memory_free_mib: Option<f64>,
    pub memory_total_mib: Option<f64>,
    pub power_w: Option<f64>,
    pub memory_power_w: Option<f64>,
    /// Joules since the session's first reading of this GPU.
    pub energy_j: Option<f64>,
    pub temperature_gpu_c: Option<f64>,
    pub temperature_memory_c: Option<f64>,
    pub fan_speed_pct: Option<f64>,
    pub sm_clock_mhz: Option<f64>,
    pub memory_clock_mhz: Option<f64>,
    pub clock_throttle_reasons: Option<i64>,
    /// NVML GPM readings over the interval this row closes; None on rows that close none.
    pub gpm: Option<GpmReadings>,
}

/// NVML GPM metrics (percent) over (`start_ns`, the row's `ts_ns`], each None
/// where the GPU could not say (see `capabilities`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GpmReadings {
    pub start_ns: u64,
    /// ANY_TENSOR_UTIL
    pub tensor_util_pct: Option<f64>,
    /// HMMA_TENSOR_UTIL
    pub hmma_util_pct: Option<f64>,
    /// DFMA_TENSOR_UTIL
    pub dfma_util_pct: Option<f64>,
    /// SM_UTIL
    pub sm_util_pct: Option<f64>,
    /// SM_OCCUPANCY
    pub sm_occupancy_pct: Option<f64>,
    /// DRAM_BW_UTIL
    pub dram_bw_util_pct: Option<f64>,
}

/// One RAPL domain's cumulative energy at one instant (a `rapl_samples` row).
#[derive(Clone, Debug, PartialEq)]
pub struct RaplSampleRow {
    pub ts_ns: u64,
    /// `package`, `dram`, `psys`, `core` or `uncore`.
    pub domain: &'static str,
    pub energy_j: f64,
}

/// One row of `system_samples`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SystemSampleRow {
    pub ts_ns: u64,
    pub cpu_usage_pct: Option<f64>,
    pub process_cpu_pct: Option<f64>,
    pub ram_used_gb: Option<f64>,
    pub ram_usage_pct: Option<f64>,
    pub process_rss_gb: Option<f64>,
    pub disk_used_gb: Option<f64>,
    pub disk_usage_pct: Option<f64>,
}

/// What the session lost, stored at its end: the step ring's share of the
/// lost records, failed map updates, and the steps marked incomplete (every
/// other step of the session is marked complete).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Losses {
    pub lost_step_records: u64,
    /// Off-CPU records lost (the scheduler track's gaps).
    pub lost_off_cpu_records: u64,
    pub map_failures: u64,
    /// (label, step) of each incomplete step.
    pub incomplete: Vec<(&'static str, u64)>,
}

/// Work the store does in the session's last transaction, once every row is
/// in: per-step figures derived (by `correlate`) from the samples and steps it
/// holds, with what only the sampler knew. Each kind is written or, on an
/// error, rolled back on its own.
#[derive(Clone, Debug, PartialEq)]
pub enum AtFinish {
    /// `step_gpu` for each step and GPU, and `gpus.energy_update_period_ms`.
    StepGpu {
        /// Logical numbers of the sampled GPUs.
        gpus: Vec<u32>,
        /// A gauge reading counts for a moment at most this far from it.
        max_gap_ns: u64,
        /// The energy counter's resolution, J.
        energy_resolution_j: f64,
    },
    /// `step_energy` for each step: RAPL package and DRAM energy. Each is the
    /// domain's counter resolution in J when the domain was read, None when not.
    StepEnergy { package_resolution_j: Option<f64>, dram_resolution_j: Option<f64> },
    /// `step_system` for each step: the system values at its end.
    StepSystem,
    /// `sessions.lost_step_records`, `sessions.map_failures`, `steps.incomplete`.
    Losses(Losses),
    /// `sessions.context_switches` and `sessions.preemptions` (scheduler tracing).
    ContextSwitches(profiler_common::ProcessSched),
    /// A job's process other than the first: the logical GPUs (of the first
    /// session's sampled ones) its steps get `step_gpu` rows for, in place of
    /// the first session's list (see `session::job::rank_gpus`).
    RankGpus(Vec<u32>),
    /// `sessions.cpu_sample_hz` and the sampler's counts (`--cpu-sample`).
    CpuSampling(CpuSampling),
}
