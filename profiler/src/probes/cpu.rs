//! The CPU sampler (`--cpu-sample HZ`): the `cpu_sample` perf_event program
//! on every online CPU's `cpu-clock`, every 1/HZ s of that CPU's time, so a
//! traced thread is sampled HZ times per second it runs, on any CPU, its
//! children's and workers' threads too (the program's filter is the traced
//! set, `TRACED`, which the fork hook grows). Its stacks map and counters.
//!
//! A CPU that comes online after the start is not sampled.
use std::{os::fd::OwnedFd, path::PathBuf, sync::Arc};

use aya::{
    maps::{HashMap, MapData, PerCpuArray, StackTraceMap},
    programs::{
        PerfEvent,
        perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent},
    },
    util::online_cpus,
};
use profiler_common::{PyStackLayout, maps as map_names, programs};

use super::{ProbeError, Probes, take_map};

/// The most `--cpu-sample` rate: above it the sampler costs the traced
/// threads more than the percent or so a profile may.
pub const MAX_HZ: u32 = 10_000;

/// The kernel's stacks of the samples, by `bpf_get_stackid` id. Read while
/// tracing: an id, once given, keeps its stack for the session.
pub struct CpuStackMap(StackTraceMap<MapData>);

impl CpuStackMap {
    /// The stack's instruction pointers, leaf first; None if the map has no such id.
    pub fn ips(&self, id: u32) -> Option<Vec<u64>> {
        self.0.get(&id, 0).ok().map(|t| t.frames().iter().map(|f| f.ip).collect())
    }
}

/// The sampler's kernel-side counters, summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuSampleCounts {
    /// Samples of traced threads taken (kept or lost).
    pub taken: u64,
    /// Of those, samples the launch ring had no room for.
    pub lost: u64,
    /// Stacks `bpf_get_stackid` did not keep (their samples keep the leaf).
    pub stack_failures: u64,
}

/// The attached sampler: its rate, stacks and counters.
pub struct CpuSampler {
    pub hz: u32,
    pub stacks: Arc<CpuStackMap>,
    counters: [PerCpuArray<MapData, u64>; 3],
    /// The program's kernel id, to read its run statistics by.
    program_id: Option<u32>,
    /// Held while the kernel counts the programs' run time
    /// (`BPF_ENABLE_STATS`; it stops when the last holder closes it).
    stats: Result<OwnedFd, String>,
}

/// What the sampling program cost in the kernel: its runs on every CPU (one
/// per sampling tick, whichever thread the tick found) and their total time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SamplerKernelCost {
    pub runs: u64,
    pub ns: u64,
}

impl CpuSampler {
    pub fn counts(&self) -> CpuSampleCounts {
        let sum = |m: &PerCpuArray<MapData, u64>| m.get(&0, 0).map(|v| v.iter().sum::<u64>()).unwrap_or(0);
        let [taken, lost, failures] = &self.counters;
        CpuSampleCounts { taken: sum(taken), lost: sum(lost), stack_failures: sum(failures) }
    }

    /// The program's runs and run time so far, as the kernel counts them;
    /// Err: why it does not (a kernel before 5.8 has no `BPF_ENABLE_STATS`).
    pub fn kernel_cost(&self) -> Result<SamplerKernelCost, String> {
        self.stats.as_ref().map_err(Clone::clone)?;
        let id = self.program_id.ok_or("the program's id could not be read")?;
        let info = aya::programs::loaded_programs()
            .filter_map(Result::ok)
            .find(|p| p.id() == id)
            .ok_or("the program is not among the kernel's loaded programs")?;
        Ok(SamplerKernelCost { runs: info.run_count(), ns: info.run_time().as_nanos() as u64 })
    }
}

impl Probes {
    /// Loads the sampling program and opens a `cpu-clock` event at `hz` on
    /// every online CPU, the program on each. The events go with the probes
    /// (`detach`); `STOPPED` silences them first, like every program.
    pub fn attach_cpu_sampler(&mut self, hz: u32) -> Result<CpuSampler, ProbeError> {
        let name = programs::CPU_SAMPLE;
        let cpus = online_cpus().map_err(|(path, source)| ProbeError::Read { path: PathBuf::from(path), source })?;
        let prog: &mut PerfEvent = self
            .ebpf
            .program_mut(name)
            .ok_or(ProbeError::Missing(name))?
            .try_into()
            .map_err(|source| ProbeError::Program { name, source })?;
        prog.load().map_err(|source| ProbeError::Program { name, source })?;
        let program_id = prog.info().ok().map(|i| i.id());
        let stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).map_err(|e| format!("BPF_ENABLE_STATS: {e}"));
        // A period in ns of CPU time, not a frequency the kernel adapts: the
        // samples of a thread are then exactly proportional to its time on a CPU.
        let period_ns = 1_000_000_000 / u64::from(hz.clamp(1, MAX_HZ));
        for cpu in cpus {
            prog.attach(
                PerfEventConfig::Software(SoftwareEvent::CpuClock),
                PerfEventScope::AllProcessesOneCpu { cpu },
                SamplePolicy::Period(period_ns),
                false,
            )
            .map_err(|source| ProbeError::Program { name, source })?;
        }
        let stacks = take_map(&mut self.ebpf, map_names::CPU_STACKS)?;
        let stacks = StackTraceMap::try_from(stacks)
            .map_err(|source| ProbeError::Map { name: map_names::CPU_STACKS, source })?;
        let mut counter = |name: &'static str| {
            PerCpuArray::try_from(take_map(&mut self.ebpf, name)?).map_err(|source| ProbeError::Map { name, source })
        };
        let counters = [
            counter(map_names::CPU_SAMPLES)?,
            counter(map_names::LOST_CPU_SAMPLES)?,
            counter(map_names::CPU_STACK_FAILURES)?,
        ];
        self.sampling = true;
        Ok(CpuSampler { hz, stacks: Arc::new(CpuStackMap(stacks)), counters, program_id, stats })
    }

    /// Whether CPython processes are to be described to the sampler.
    pub fn samples_python(&self) -> bool {
        self.sampling
    }

    /// Whether `describe_python` can take `layout` now without waiting for
    /// the kernel's types (see there); if not, they are being read.
    pub fn python_layout_ready(&self, layout: &PyStackLayout) -> bool {
        layout.by_native_id != 0 || super::job::task_fsbase_ready()
    }

    /// From now on, the samples of process `tgid` carry its Python frames,
    /// found as `layout` says (`task_fsbase` is filled in here where it is
    /// needed: CPython 3.10, from the kernel's BTF, ≈0.3 s once). The kernel
    /// forgets it when the process execs or exits.
    pub fn describe_python(&mut self, tgid: u32, layout: PyStackLayout) -> Result<(), ProbeError> {
        let name = map_names::PY_PROCS;
        let layout = match layout.by_native_id {
            0 => PyStackLayout { task_fsbase: super::job::task_fsbase_offset()?, ..layout },
            _ => layout,
        };
        let map = self.ebpf.map_mut(name).ok_or(ProbeError::Missing(name))?;
        let mut procs: HashMap<_, u32, PyStackLayout> =
            HashMap::try_from(map).map_err(|source| ProbeError::Map { name, source })?;
        procs.insert(tgid, layout, 0).map_err(|source| ProbeError::Map { name, source })
    }
}
