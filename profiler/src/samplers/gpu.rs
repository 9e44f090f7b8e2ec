//! GPU telemetry through NVML: a sampler per session that reads every
//! selected GPU on each tick into `gpu_samples`; at the end, the store derives
//! the per-step figures (exact energy split at step boundaries,
//! GPUStatsMonitor's values at step start and end) from them.
//!
//! One NVML handle per session. A reading a GPU does not have is stored as
//! NULL with the reason recorded once in `capabilities`. The running-process
//! list (milliseconds, under the driver lock) is read every few seconds, never
//! on every tick.
use std::{
    collections::{BTreeSet, HashMap},
    path::{Path, PathBuf},
    time::Duration,
};

use nvml_wrapper::{
    Device, Nvml,
    enum_wrappers::device::{Clock, TemperatureSensor},
    enums::device::SampleValue,
    error::NvmlError,
    struct_wrappers::device::FieldValueSample,
    structs::device::FieldId,
};

use super::{CapabilityLog, Sampler, gpm::GpmState};
use crate::store::{AtFinish, GpuRow, GpuSampleRow, RowSender, StoreMsg};

/// NVML field ids (nvml.h).
const FI_DEV_MEMORY_TEMP: u32 = 82;
const FI_DEV_POWER_INSTANT: u32 = 186;
/// The energy counter counts mJ.
const ENERGY_RESOLUTION_J: f64 = 0.001;
const PROCESS_SCAN_EVERY: Duration = Duration::from_secs(2);

#[derive(Clone, Debug)]
pub struct GpuConfig {
    /// `--nvml-lib`; None: the system's libnvidia-ml.so.1.
    pub nvml_lib: Option<PathBuf>,
    pub interval: Duration,
    /// `--gpus`: NVML indices, UUIDs or MIG UUIDs (prefixes allowed).
    pub gpus: Option<Vec<String>>,
}

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// NVML missing or not initialising: the message the user sees.
    #[error("NVIDIA driver not loaded: {0}")]
    Unavailable(String),
    #[error("{0}")]
    Selection(String),
}

/// How CUDA numbers the GPUs it sees (the target's `CUDA_DEVICE_ORDER`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceOrder {
    /// CUDA's default: "fastest first" by an undocumented heuristic (see [`cuda_order`]).
    FastestFirst,
    /// `PCI_BUS_ID`: ascending PCI bus id, the order of NVML and nvidia-smi.
    PciBusId,
}

impl DeviceOrder {
    /// CUDA knows `PCI_BUS_ID` and `FASTEST_FIRST`; unset (or anything else) is the default.
    pub fn from_env(value: Option<&str>) -> Self {
        match value.map(str::trim) {
            Some("PCI_BUS_ID") => Self::PciBusId,
            _ => Self::FastestFirst,
        }
    }
}

/// What NVML says about one GPU (NVML device `i` is `facts[i]`), as far as
/// choosing and numbering GPUs needs it. `None`: NVML could not say.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuFacts {
    pub uuid: String,
    pub name: Option<String>,
    /// PCI (domain, bus, device).
    pub pci: Option<(u32, u32, u32)>,
    /// CUDA cores (`nvmlDeviceGetNumGpuCores`).
    pub cores: Option<u32>,
    pub max_sm_clock_mhz: Option<u32>,
    pub compute_capability: Option<(i32, i32)>,
    pub mig_enabled: bool,
    /// UUIDs (`MIG-…`) of the GPU's MIG devices.
    pub mig_uuids: Vec<String>,
}

/// A GPU chosen for sampling: its index as the target's CUDA sees it, NVML's,
/// and the MIG devices of it that the target was given by UUID (NVML's
/// readings are for the whole GPU, never for one MIG device).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelectedGpu {
    pub logical: u32,
    pub nvml_index: u32,
    pub mig: Vec<String>,
}

/// The sampled GPUs, and what the profiler wants said about how it chose and
/// numbered them: `(metric, available, reason)` rows for `capabilities`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuSelection {
    pub gpus: Vec<SelectedGpu>,
    pub notes: Vec<(String, bool, String)>,
}

/// NVML indices in PCI bus order (NVML's own order where a GPU has no PCI info).
fn pci_order(gpus: &[GpuFacts]) -> Vec<u32> {
    let mut order: Vec<u32> = (0..gpus.len() as u32).collect();
    if gpus.iter().all(|g| g.pci.is_some()) {
        order.sort_by_key(|&i| gpus[i as usize].pci);
    }
    order
}

/// NVML indices in the order CUDA numbers the GPUs, and whether that order is
/// exact (`true`) or an approximation, with a sentence that says which.
///
/// `PCI_BUS_ID` is exact. CUDA's default, FASTEST_FIRST, is "fastest to
/// slowest using a simple heuristic" (CUDA programming guide) that NVIDIA does
/// not publish. GPUs of one model tie, and CUDA numbers them in PCI bus order:
/// exact again. For mixed models, what users report seeing
/// (ethereum-mining/ethminer#283: one GTX 1080 and three 1080 Ti numbered
/// 1080 Ti, 1080, 1080 Ti, 1080 Ti; xmrig/xmrig-nvidia#69, likewise with 750
/// and 750 Ti) is the fastest GPU moved to the front and the rest left in PCI
/// bus order, not a full sort; that is what this does, with "fastest" as
/// CUDA's samples' `gpuGetMaxGflopsDeviceId` reckons it: cores × clock, then
/// compute capability (NVML: `num_cores` × max SM clock), else compute
/// capability, then max SM clock. The result is marked as an approximation.
pub fn cuda_order(order: DeviceOrder, gpus: &[GpuFacts]) -> (Vec<u32>, bool, String) {
    let pci = pci_order(gpus);
    if order == DeviceOrder::PciBusId {
        return (pci, true, "CUDA_DEVICE_ORDER=PCI_BUS_ID: logical numbers follow PCI bus order".into());
    }
    let first_name = gpus.first().and_then(|g| g.name.as_deref());
    if gpus.len() <= 1 || (first_name.is_some() && gpus.iter().all(|g| g.name.as_deref() == first_name)) {
        let what = first_name.map_or_else(|| "one GPU".to_string(), |n| format!("every GPU is {n}"));
        return (pci, true, format!("CUDA_DEVICE_ORDER=FASTEST_FIRST (CUDA's default) and {what}: PCI bus order"));
    }
    let cc = |g: &GpuFacts| {
        g.compute_capability.map_or(0, |(major, minor)| (major.max(0) as u64) << 32 | minor.max(0) as u64)
    };
    let advice = "set CUDA_DEVICE_ORDER=PCI_BUS_ID in the target, or name GPUs by UUID, for an exact mapping";
    let clock = |g: &GpuFacts| g.max_sm_clock_mhz.map_or(0, u64::from);
    let throughput = |g: &GpuFacts| u64::from(g.cores.unwrap_or(0)) * clock(g);
    type Speed<'a> = &'a dyn Fn(&GpuFacts) -> (u64, u64);
    let (basis, speed): (&str, Speed) = if gpus.iter().all(|g| g.cores.is_some() && g.max_sm_clock_mhz.is_some()) {
        ("cores × max SM clock", &|g| (throughput(g), cc(g)))
    } else if gpus.iter().all(|g| g.compute_capability.is_some()) {
        ("compute capability", &|g| (cc(g), clock(g)))
    } else {
        let why = "GPU numbers follow PCI bus order, which may not be CUDA's default order (FASTEST_FIRST) \
                       for GPUs of different models: NVML gives no cores, clocks or compute capability to rank them";
        return (pci, false, format!("{why}; {advice}"));
    };
    let speeds: Vec<(u64, u64)> = pci.iter().map(|&i| speed(&gpus[i as usize])).collect();
    // The first of the fastest in PCI order: `max_by_key` keeps the last of equals.
    let fastest = (0..pci.len()).rev().max_by_key(|&k| speeds[k]).unwrap_or(0);
    let mut out = vec![pci[fastest]];
    out.extend(pci.iter().enumerate().filter(|&(k, _)| k != fastest).map(|(_, &i)| i));
    let name = gpus[pci[fastest] as usize].name.as_deref().unwrap_or("unnamed");
    let why = format!(
        "GPU numbers approximate CUDA's default order (FASTEST_FIRST, undocumented) for GPUs of different models: \
         NVML {} ({name}) first as the fastest by {basis}, the rest in PCI bus order",
        pci[fastest]
    );
    (out, false, format!("{why}; {advice}"))
}

/// A `CUDA_VISIBLE_DEVICES` / `--gpus` entry as it resolves: a GPU, or a MIG
/// device (its parent's NVML index, its full UUID).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Entry {
    Gpu(u32),
    Mig(u32, String),
}

impl Entry {
    fn gpu(&self) -> u32 {
        match self {
            Entry::Gpu(i) | Entry::Mig(i, _) => *i,
        }
    }
}

/// Resolves one entry as CUDA does: an integer is the `numbered[i]` GPU; a
/// `GPU-` or `MIG-` UUID may be shortened to any prefix that names one device;
/// `MIG-GPU-<uuid>/<gi>/<ci>` (CUDA 11's form) names a MIG device of that GPU.
fn resolve(entry: &str, gpus: &[GpuFacts], numbered: &[u32]) -> Option<Entry> {
    let e = entry.trim();
    if e.is_empty() {
        return None;
    }
    if let Ok(i) = e.parse::<u32>() {
        return numbered.get(i as usize).map(|&n| Entry::Gpu(n));
    }
    let unique = |mut hits: Vec<Entry>| (hits.len() == 1).then(|| hits.remove(0));
    if let Some(rest) = e.strip_prefix("MIG-") {
        if let Some((parent, _)) = rest.split_once('/') {
            return gpus.iter().position(|g| g.uuid == parent).map(|i| Entry::Mig(i as u32, e.to_string()));
        }
        let hits = gpus.iter().enumerate().flat_map(|(i, g)| {
            g.mig_uuids.iter().filter(|u| u.starts_with(e)).map(move |u| Entry::Mig(i as u32, u.clone()))
        });
        return unique(hits.collect());
    }
    let hits = gpus
        .iter()
        .enumerate()
        .filter(|(_, g)| g.uuid.starts_with(e) || g.uuid.strip_prefix("GPU-").is_some_and(|s| s.starts_with(e)))
        .map(|(i, _)| Entry::Gpu(i as u32));
    unique(hits.collect())
}

/// Which GPUs to sample, and their logical numbers. `override_list` (`--gpus`:
/// NVML indices, UUIDs, MIG UUIDs; logical numbers are list positions) wins;
/// otherwise the target's `CUDA_VISIBLE_DEVICES`, read as CUDA reads it:
/// integers count in CUDA's order (`order`, see [`cuda_order`]), the first
/// entry that names nothing or repeats one ends the list, and the logical
/// number is the entry's place; otherwise all GPUs, in CUDA's order. A MIG
/// device is sampled as its parent GPU (once, however many of its MIG devices
/// the target sees), and a note says so. An unknown `--gpus` entry, or a
/// `CUDA_VISIBLE_DEVICES` that names no GPU here, is the error.
pub fn select_gpus(
    override_list: Option<&[String]>,
    cuda_visible_devices: Option<&str>,
    order: DeviceOrder,
    gpus: &[GpuFacts],
) -> Result<GpuSelection, String> {
    let (cuda, exact, how) = cuda_order(order, gpus);
    let mut notes = Vec::new();
    let entries = if let Some(list) = override_list {
        notes.push(("gpu_order".to_string(), true, "--gpus: logical numbers are places in the --gpus list".into()));
        override_entries(list, gpus)?
    } else if let Some(cvd) = cuda_visible_devices {
        visible_entries(cvd, gpus, &cuda, (exact, how), &mut notes)?
    } else {
        notes.push(("gpu_order".to_string(), exact, how));
        cuda.iter().enumerate().map(|(logical, &i)| (logical as u32, Entry::Gpu(i))).collect()
    };
    let selected = group_by_gpu(entries);
    notes.extend(mig_notes(&selected, gpus));
    Ok(GpuSelection { gpus: selected, notes })
}

/// One line listing the GPUs NVML sees, for errors.
fn known_gpus(gpus: &[GpuFacts]) -> String {
    let list: Vec<String> = gpus.iter().enumerate().map(|(i, g)| format!("{i} {}", g.uuid)).collect();
    format!("{} GPUs: {}", gpus.len(), list.join(", "))
}

/// `--gpus`: every entry must name a GPU; logical numbers are list places.
fn override_entries(list: &[String], gpus: &[GpuFacts]) -> Result<Vec<(u32, Entry)>, String> {
    let identity: Vec<u32> = (0..gpus.len() as u32).collect();
    let mut out = Vec::new();
    for (logical, entry) in list.iter().enumerate() {
        let hit = resolve(entry, gpus, &identity).ok_or_else(|| {
            format!("--gpus: '{entry}' is not a GPU index, UUID or MIG UUID here ({})", known_gpus(gpus))
        })?;
        out.push((logical as u32, hit));
    }
    Ok(out)
}

/// The target's `CUDA_VISIBLE_DEVICES`, read as CUDA reads it: the first entry
/// that names nothing or repeats one ends the list.
fn visible_entries(
    cvd: &str,
    gpus: &[GpuFacts],
    cuda: &[u32],
    (exact, how): (bool, String),
    notes: &mut Vec<(String, bool, String)>,
) -> Result<Vec<(u32, Entry)>, String> {
    let listed: Vec<&str> = cvd.split(',').map(str::trim).filter(|e| !e.is_empty()).collect();
    let mut out: Vec<(u32, Entry)> = Vec::new();
    for &entry in &listed {
        let hit = resolve(entry, gpus, cuda);
        let repeated = hit.as_ref().is_some_and(|h| out.iter().any(|(_, seen)| seen == h));
        let Some(hit) = hit.filter(|_| !repeated) else {
            let what = if repeated { "repeats an earlier one" } else { "names no GPU" };
            notes.push((
                "gpu_selection".to_string(),
                true,
                format!(
                    "the target's CUDA_VISIBLE_DEVICES='{cvd}': entry '{entry}' {what}, so CUDA ignores it and \
                     every entry after it, and so does the profiler"
                ),
            ));
            break;
        };
        out.push((out.len() as u32, hit));
    }
    if out.is_empty() {
        return Err(format!(
            "the target's CUDA_VISIBLE_DEVICES='{cvd}' names no GPU that NVML sees ({})",
            known_gpus(gpus)
        ));
    }
    if listed[..out.len()].iter().any(|e| e.parse::<u32>().is_ok()) {
        notes.push(("gpu_order".to_string(), exact, how));
    } else {
        let how = "the target's CUDA_VISIBLE_DEVICES names GPUs by UUID: logical numbers are places in that list";
        notes.push(("gpu_order".to_string(), true, how.into()));
    }
    Ok(out)
}

/// One entry per physical GPU (its first logical number), with the MIG
/// devices the target sees on it.
fn group_by_gpu(entries: Vec<(u32, Entry)>) -> Vec<SelectedGpu> {
    let mut selected: Vec<SelectedGpu> = Vec::new();
    for (logical, hit) in entries {
        let nvml_index = hit.gpu();
        let k = match selected.iter().position(|s| s.nvml_index == nvml_index) {
            Some(k) => k,
            None => {
                selected.push(SelectedGpu { logical, nvml_index, mig: Vec::new() });
                selected.len() - 1
            }
        };
        if let Entry::Mig(_, uuid) = hit
            && !selected[k].mig.contains(&uuid)
        {
            selected[k].mig.push(uuid);
        }
    }
    selected
}

/// A note for each selected GPU in MIG mode: its readings are the whole GPU's.
fn mig_notes(selected: &[SelectedGpu], gpus: &[GpuFacts]) -> Vec<(String, bool, String)> {
    let mut notes = Vec::new();
    for s in selected {
        let gpu = &gpus[s.nvml_index as usize];
        if s.mig.is_empty() && !gpu.mig_enabled {
            continue;
        }
        let n = s.nvml_index;
        let reason = if s.mig.is_empty() {
            format!(
                "readings are the whole GPU's (NVML {n} is in MIG mode), shared by all its MIG devices; CUDA numbers \
                 MIG devices, not GPUs: name the target's by its MIG- UUID for an exact mapping"
            )
        } else {
            format!(
                "readings are the whole GPU's (NVML {n}), shared by all its MIG devices, not those of the target's \
                 MIG device {}",
                s.mig.join(", ")
            )
        };
        notes.push((format!("GPU_{}/mig", s.logical), false, reason));
    }
    notes
}

struct GpuState {
    sel: SelectedGpu,
    first_energy_mj: Option<u64>,
    instant_power: bool,
}

/// Samples the selected GPUs.
/// The latest (logical GPU, utilization %, power W) of each GPU, for the live status line.
pub type GpuLive = std::sync::Arc<std::sync::Mutex<Vec<(u32, Option<f64>, Option<f64>)>>>;

/// Every process NVML has listed on a sampled GPU so far (its compute
/// processes, looked at every [`PROCESS_SCAN_EVERY`]): PID → logical GPUs.
/// A job's ranks get their steps' GPU figures from these GPUs when NVML saw them.
pub type GpuProcesses = std::sync::Arc<std::sync::Mutex<HashMap<u32, BTreeSet<u32>>>>;

pub struct GpuSampler {
    live: GpuLive,
    processes: GpuProcesses,
    nvml: Nvml,
    gpus: Vec<GpuState>,
    /// Set by [`GpuSampler::start`]; rows go nowhere before.
    out: Option<(RowSender, CapabilityLog)>,
    info_rows: Vec<GpuRow>,
    power_sources: Vec<(u32, bool)>,
    /// How the GPUs were chosen and numbered ([`GpuSelection::notes`]).
    selection_notes: Vec<(String, bool, String)>,
    pid: u32,
    interval: Duration,
    ticks: u64,
    rows: Vec<GpuSampleRow>,
    /// `--prometheus`/`--otlp`: the live series each sample updates.
    pub live_metrics: Option<crate::metrics::MachineMetrics>,
    /// NVML GPM of each GPU in `gpus`' order.
    gpm: GpmState,
}

fn opt_f64(r: Result<f64, String>, caps: &mut CapabilityLog, metric: &str) -> Option<f64> {
    let r = r.map_err(|e| format!("NVML: {e}"));
    caps.note(metric, &r);
    r.ok()
}

fn field_u32(sample: Option<&Result<FieldValueSample, NvmlError>>) -> Result<f64, String> {
    match sample {
        Some(Ok(s)) => match &s.value {
            Ok(SampleValue::U32(v)) => Ok(f64::from(*v)),
            Ok(SampleValue::U64(v)) => Ok(*v as f64),
            Ok(SampleValue::I64(v)) => Ok(*v as f64),
            Ok(SampleValue::F64(v)) => Ok(*v),
            Err(e) => Err(e.to_string()),
        },
        Some(Err(e)) => Err(e.to_string()),
        None => Err("no value returned".into()),
    }
}

/// What NVML says about `dev` for [`select_gpus`]; a call NVML cannot answer
/// (an older driver, a stand-in library) leaves its field `None`.
fn gpu_facts(dev: &Device<'_>, uuid: String) -> GpuFacts {
    // nvmlDeviceGetMigMode's NVML_DEVICE_MIG_ENABLE.
    let mig_enabled = dev.mig_mode().is_ok_and(|m| m.current == 1);
    // Slots up to the maximum; an empty slot is an error, and skipped.
    let mig_uuids = match mig_enabled {
        true => (0..dev.mig_device_count().unwrap_or(0))
            .filter_map(|k| dev.mig_device_by_index(k).and_then(|m| m.uuid()).ok())
            .collect(),
        false => Vec::new(),
    };
    GpuFacts {
        uuid,
        name: dev.name().ok(),
        pci: dev.pci_info().ok().map(|p| (p.domain, p.bus, p.device)),
        cores: dev.num_cores().ok(),
        max_sm_clock_mhz: dev.max_clock_info(Clock::SM).ok(),
        compute_capability: dev.cuda_compute_capability().ok().map(|c| (c.major, c.minor)),
        mig_enabled,
        mig_uuids,
    }
}

/// A full MIG UUID among `entries` that no GPU listed as its own (NVML would
/// not enumerate its MIG devices) is looked up directly and filed under the
/// parent NVML names for it (`nvmlDeviceGetDeviceHandleFromMigDeviceHandle`).
fn find_mig_parents(nvml: &Nvml, entries: &[&str], facts: &mut [GpuFacts]) {
    for e in entries.iter().map(|e| e.trim()) {
        let listed = facts.iter().any(|g| g.mig_uuids.iter().any(|u| u.starts_with(e)));
        if !e.starts_with("MIG-") || e.contains('/') || listed {
            continue;
        }
        let parent = nvml.device_by_uuid(e).and_then(|m| m.mig_parent_device()).and_then(|p| p.index());
        if let Some(g) = parent.ok().and_then(|p| facts.get_mut(p as usize)) {
            g.mig_enabled = true;
            g.mig_uuids.push(e.to_string());
        }
    }
}

/// Loads NVML from `lib` (None: the system's libnvidia-ml.so.1) and
/// initialises it; the error says which of the two failed.
pub fn init_nvml(lib: Option<&Path>) -> Result<Nvml, GpuError> {
    let lib = lib.unwrap_or(Path::new("libnvidia-ml.so.1"));
    Nvml::builder().lib_path(lib.as_os_str()).init().map_err(|e| match e {
        NvmlError::LibloadingError(e) => {
            GpuError::Unavailable(format!("cannot load NVML ({e}); pass its path with --nvml-lib"))
        }
        e => GpuError::Unavailable(format!("NVML ({}) did not initialise: {e}", lib.display())),
    })
}

impl GpuSampler {
    /// Initialises NVML and picks the GPUs the target sees, reading its
    /// `CUDA_VISIBLE_DEVICES` and `CUDA_DEVICE_ORDER` through `target_var`;
    /// nothing is written until [`Self::start`].
    pub fn open(cfg: &GpuConfig, pid: u32, target_var: &dyn Fn(&str) -> Option<String>) -> Result<Self, GpuError> {
        let nvml = init_nvml(cfg.nvml_lib.as_deref())?;
        let count = nvml.device_count().map_err(|e| GpuError::Unavailable(format!("NVML device count: {e}")))?;
        let mut facts = Vec::new();
        for i in 0..count {
            let dev = nvml.device_by_index(i).map_err(|e| GpuError::Unavailable(format!("NVML device {i}: {e}")))?;
            let uuid = dev.uuid().map_err(|e| GpuError::Unavailable(format!("NVML device {i}: {e}")))?;
            facts.push(gpu_facts(&dev, uuid));
        }
        let cvd = target_var("CUDA_VISIBLE_DEVICES");
        let order = DeviceOrder::from_env(target_var("CUDA_DEVICE_ORDER").as_deref());
        let named: Vec<&str> = match (&cfg.gpus, &cvd) {
            (Some(list), _) => list.iter().map(String::as_str).collect(),
            (None, Some(cvd)) => cvd.split(',').collect(),
            (None, None) => Vec::new(),
        };
        find_mig_parents(&nvml, &named, &mut facts);
        let GpuSelection { gpus: selected, notes: selection_notes } =
            select_gpus(cfg.gpus.as_deref(), cvd.as_deref(), order, &facts).map_err(GpuError::Selection)?;
        let driver = nvml.sys_driver_version().ok();
        let mut gpus = Vec::new();
        let mut power_sources = Vec::new();
        let mut info_rows = Vec::new();
        let mut gpm = GpmState::default();
        for sel in selected {
            let dev = nvml.device_by_index(sel.nvml_index).map_err(|e| GpuError::Unavailable(e.to_string()))?;
            let instant =
                field_u32(dev.field_values_for(&[FieldId(FI_DEV_POWER_INSTANT)]).ok().as_ref().and_then(|v| v.first()))
                    .is_ok();
            power_sources.push((sel.logical, instant));
            info_rows.push(GpuRow {
                gpu: sel.logical,
                nvml_index: sel.nvml_index,
                uuid: facts[sel.nvml_index as usize].uuid.clone(),
                name: facts[sel.nvml_index as usize].name.clone(),
                memory_total_mib: dev.memory_info().ok().map(|m| m.total as f64 / 1048576.0),
                power_limit_w: dev.power_management_limit().ok().map(|mw| f64::from(mw) / 1000.0),
                driver_version: driver.clone(),
                power_source: if instant { "instant" } else { "average" },
                max_sm_clock_mhz: facts[sel.nvml_index as usize].max_sm_clock_mhz.map(f64::from),
            });
            gpm.add(&dev, sel.logical);
            gpus.push(GpuState { sel, first_energy_mj: None, instant_power: instant });
        }
        Ok(Self {
            nvml,
            gpus,
            out: None,
            live: GpuLive::default(),
            processes: GpuProcesses::default(),
            info_rows,
            power_sources,
            selection_notes,
            pid,
            interval: cfg.interval,
            ticks: 0,
            rows: Vec::new(),
            live_metrics: None,
            gpm,
        })
    }

    /// Records the GPUs in `gpus` and starts sending rows to the store.
    pub fn start(&mut self, sender: RowSender) {
        let mut caps = CapabilityLog::new(sender.clone(), "nvml");
        for (metric, available, reason) in std::mem::take(&mut self.selection_notes) {
            caps.record(&metric, available, Some(reason));
        }
        for &(logical, instant) in &self.power_sources {
            let how = if instant { "instant power (field 186)" } else { "power usage (1 s average)" };
            caps.record(&format!("GPU_{logical}/power_source"), true, Some(how.into()));
        }
        sender.send(StoreMsg::Gpus(std::mem::take(&mut self.info_rows)));
        self.out = Some((sender, caps));
    }

    /// Logical ids of the sampled GPUs.
    /// A handle on the latest readings (see [`GpuLive`]).
    pub fn live(&self) -> GpuLive {
        self.live.clone()
    }

    /// A handle on the processes NVML has listed (see [`GpuProcesses`]).
    pub fn processes(&self) -> GpuProcesses {
        self.processes.clone()
    }

    /// The dense peaks of each sampled GPU NVML's name is in the peak table
    /// for (`correlate::mfu::Peaks`), by logical id. Before [`GpuSampler::start`].
    pub fn peaks(&self) -> HashMap<u32, &'static crate::correlate::mfu::Peaks> {
        let named = self.info_rows.iter().filter_map(|r| Some((r.gpu, r.name.as_deref()?)));
        named.filter_map(|(gpu, name)| Some((gpu, crate::correlate::mfu::Peaks::of_gpu(name)?))).collect()
    }

    pub fn logical_gpus(&self) -> Vec<u32> {
        self.gpus.iter().map(|g| g.sel.logical).collect()
    }

    fn sample(dev: &Device<'_>, g: &mut GpuState, caps: &mut CapabilityLog, now_ns: u64) -> GpuSampleRow {
        let l = g.sel.logical;
        let m = |name: &str| format!("GPU_{l}/{name}");
        let util = dev.utilization_rates();
        let mem = dev.memory_info();
        let fields = dev.field_values_for(&[FieldId(FI_DEV_POWER_INSTANT), FieldId(FI_DEV_MEMORY_TEMP)]).ok();
        let power = if g.instant_power {
            field_u32(fields.as_ref().and_then(|f| f.first())).map(|mw| mw / 1000.0)
        } else {
            dev.power_usage().map(|mw| f64::from(mw) / 1000.0).map_err(|e| e.to_string())
        };
        let energy = dev
            .total_energy_consumption()
            .map(|mj| {
                let first = *g.first_energy_mj.get_or_insert(mj);
                mj.saturating_sub(first) as f64 / 1000.0
            })
            .map_err(|e| e.to_string());
        let fan = match dev.num_fans() {
            Ok(0) => Err("the GPU has no fan".to_string()),
            _ => dev.fan_speed(0).map(f64::from).map_err(|e| e.to_string()),
        };
        let mem_mib = |f: fn(&nvml_wrapper::struct_wrappers::device::MemoryInfo) -> u64| {
            mem.as_ref().map(|v| f(v) as f64 / 1048576.0).map_err(|e| e.to_string())
        };
        let rate = |f: fn(&nvml_wrapper::struct_wrappers::device::Utilization) -> u32| {
            util.as_ref().map(|u| f64::from(f(u))).map_err(|e| e.to_string())
        };
        GpuSampleRow {
            gpu: l,
            ts_ns: now_ns,
            utilization_gpu_pct: opt_f64(rate(|u| u.gpu), caps, &m("utilization.gpu")),
            utilization_memory_pct: opt_f64(rate(|u| u.memory), caps, &m("utilization.memory")),
            memory_used_mib: opt_f64(mem_mib(|v| v.used), caps, &m("memory.used")),
            memory_free_mib: opt_f64(mem_mib(|v| v.free), caps, &m("memory.free")),
            memory_total_mib: opt_f64(mem_mib(|v| v.total), caps, &m("memory.total")),
            power_w: opt_f64(power, caps, &m("power")),
            memory_power_w: {
                // NVML has no memory-subsystem power reading for discrete GPUs.
                caps.record(&m("memory_power"), false, Some("NVML reports no memory power for this GPU".into()));
                None
            },
            energy_j: opt_f64(energy, caps, &m("energy")),
            temperature_gpu_c: opt_f64(
                dev.temperature(TemperatureSensor::Gpu).map(f64::from).map_err(|e| e.to_string()),
                caps,
                &m("temperature.gpu"),
            ),
            temperature_memory_c: opt_f64(
                field_u32(fields.as_ref().and_then(|f| f.get(1))),
                caps,
                &m("temperature.memory"),
            ),
            fan_speed_pct: opt_f64(fan, caps, &m("fan.speed")),
            sm_clock_mhz: opt_f64(
                dev.clock_info(Clock::SM).map(f64::from).map_err(|e| e.to_string()),
                caps,
                &m("clocks.sm"),
            ),
            memory_clock_mhz: opt_f64(
                dev.clock_info(Clock::Memory).map(f64::from).map_err(|e| e.to_string()),
                caps,
                &m("clocks.memory"),
            ),
            clock_throttle_reasons: match dev.current_throttle_reasons() {
                Ok(r) => Some(r.bits() as i64),
                Err(e) => {
                    caps.record(&m("clocks_throttle_reasons"), false, Some(format!("NVML: {e}")));
                    None
                }
            },
            gpm: None,
        }
    }

    fn scan_processes(&mut self) {
        let mut used = Vec::new();
        let mut seen: Vec<(u32, u32)> = Vec::new();
        for g in &self.gpus {
            let Ok(dev) = self.nvml.device_by_index(g.sel.nvml_index) else { continue };
            if let Ok(procs) = dev.running_compute_processes() {
                if procs.iter().any(|p| p.pid == self.pid) {
                    used.push(g.sel.logical);
                }
                seen.extend(procs.iter().map(|p| (p.pid, g.sel.logical)));
            }
        }
        if !seen.is_empty()
            && let Ok(mut all) = self.processes.lock()
        {
            for (pid, gpu) in seen {
                all.entry(pid).or_default().insert(gpu);
            }
        }
        if let (false, Some((sender, _))) = (used.is_empty(), &self.out) {
            sender.send(StoreMsg::GpusUsedByTarget(used));
        }
    }
}

impl Sampler for GpuSampler {
    fn tick(&mut self, now_ns: u64) {
        let Some((_, caps)) = self.out.as_mut() else { return };
        let mut live = Vec::with_capacity(self.gpus.len());
        for (k, g) in self.gpus.iter_mut().enumerate() {
            match self.nvml.device_by_index(g.sel.nvml_index) {
                Ok(dev) => {
                    let mut row = Self::sample(&dev, g, caps, now_ns);
                    row.gpm = self.gpm.read(k, &self.nvml, &dev, now_ns, caps);
                    live.push((g.sel.logical, row.utilization_gpu_pct, row.power_w));
                    if let Some(m) = &mut self.live_metrics {
                        m.gpu_sample(&row);
                    }
                    self.rows.push(row);
                }
                Err(e) => caps.record(&format!("GPU_{}/device", g.sel.logical), false, Some(format!("NVML: {e}"))),
            }
        }
        if let Ok(mut shared) = self.live.lock() {
            *shared = live;
        }
        let every = (PROCESS_SCAN_EVERY.as_nanos() / self.interval.as_nanos().max(1)).max(1) as u64;
        if self.ticks.is_multiple_of(every) {
            self.scan_processes();
        }
        self.ticks += 1;
        // Batches of about a second keep the writer's transactions few.
        if self.rows.len() as u128 * self.interval.as_nanos() >= 1_000_000_000 * self.gpus.len().max(1) as u128 {
            self.flush();
        }
    }

    fn finish(&mut self) -> Option<AtFinish> {
        // One more tick once GPM's interval allows, so that GPM covers the session's end.
        if let Some(wait) = self.gpm.wait_to_close_ns(crate::clock::monotonic_ns()) {
            std::thread::sleep(Duration::from_nanos(wait));
            self.tick(crate::clock::monotonic_ns());
        }
        self.flush();
        Some(AtFinish::StepGpu {
            gpus: self.logical_gpus(),
            max_gap_ns: 2 * self.interval.as_nanos() as u64 + 1,
            energy_resolution_j: ENERGY_RESOLUTION_J,
        })
    }
}

impl Drop for GpuSampler {
    fn drop(&mut self) {
        self.gpm.release(&self.nvml);
    }
}

impl GpuSampler {
    fn flush(&mut self) {
        if let (false, Some((sender, _))) = (self.rows.is_empty(), &self.out) {
            sender.send(StoreMsg::GpuSamples(std::mem::take(&mut self.rows)));
        }
    }
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::*;
    use crate::samplers::testing::{end, open_store, step_row};

    const MS: u64 = 1_000_000;

    /// NVML device `i`: an H200 on PCI bus 0x18 + 0x10 i.
    fn h200(i: usize) -> GpuFacts {
        GpuFacts {
            uuid: format!("GPU-5ca1ab1e-0000-4000-8000-{i:012}"),
            name: Some("NVIDIA H200".into()),
            pci: Some((0, 0x18 + 0x10 * i as u32, 0)),
            cores: Some(16896),
            max_sm_clock_mhz: Some(1980),
            compute_capability: Some((9, 0)),
            ..Default::default()
        }
    }

    fn a10(i: usize) -> GpuFacts {
        let name = Some("NVIDIA A10".into());
        GpuFacts { name, cores: Some(9216), max_sm_clock_mhz: Some(1695), compute_capability: Some((8, 6)), ..h200(i) }
    }

    fn h200s(n: usize) -> Vec<GpuFacts> {
        (0..n).map(h200).collect()
    }

    /// GPU 1 with MIG on and two MIG devices.
    fn with_mig(mut gpus: Vec<GpuFacts>) -> Vec<GpuFacts> {
        gpus[1].mig_enabled = true;
        gpus[1].mig_uuids =
            vec!["MIG-aaaa1111-0000-4000-9000-000000000000".into(), "MIG-aaaa2222-0000-4000-9000-000000000000".into()];
        gpus
    }

    /// (logical, NVML index) of each selected GPU.
    fn picked(r: &Result<GpuSelection, String>) -> Vec<(u32, u32)> {
        r.as_ref().expect("a selection").gpus.iter().map(|g| (g.logical, g.nvml_index)).collect()
    }

    fn note(r: &Result<GpuSelection, String>, metric: &str) -> Option<(bool, String)> {
        let notes = &r.as_ref().expect("a selection").notes;
        notes.iter().find(|(m, _, _)| m == metric).map(|(_, available, reason)| (*available, reason.clone()))
    }

    fn cvd(value: &str, gpus: &[GpuFacts]) -> Result<GpuSelection, String> {
        select_gpus(None, Some(value), DeviceOrder::FastestFirst, gpus)
    }

    #[test]
    fn all_gpus_without_cuda_visible_devices() {
        let r = select_gpus(None, None, DeviceOrder::FastestFirst, &h200s(3));
        assert_eq!(picked(&r), [(0, 0), (1, 1), (2, 2)]);
        let (exact, how) = note(&r, "gpu_order").expect("order note");
        assert!(exact && how.contains("every GPU is NVIDIA H200: PCI bus order"), "{how}");
        assert_eq!(note(&r, "GPU_0/mig"), None);
    }

    #[test]
    fn cuda_device_order_is_read_as_cuda_reads_it() {
        assert_eq!(DeviceOrder::from_env(Some("PCI_BUS_ID")), DeviceOrder::PciBusId);
        for v in [None, Some("FASTEST_FIRST"), Some("pci"), Some("")] {
            assert_eq!(DeviceOrder::from_env(v), DeviceOrder::FastestFirst, "{v:?}");
        }
    }

    #[test]
    fn integers_count_in_cuda_order_for_one_model() {
        assert_eq!(picked(&cvd("2,0", &h200s(4))), [(0, 2), (1, 0)]);
        assert_eq!(picked(&cvd(" 3 , 1 ", &h200s(4))), [(0, 3), (1, 1)]);
        // Same model, different clocks (one power-capped): still PCI order.
        let mut gpus = h200s(2);
        gpus[1].max_sm_clock_mhz = Some(1980 + 100);
        let r = cvd("0", &gpus);
        assert_eq!(picked(&r), [(0, 0)]);
        assert!(note(&r, "gpu_order").expect("order").0);
    }

    #[test]
    fn fastest_first_moves_the_fastest_to_the_front_and_says_it_approximates() {
        // PCI order A10, H200, A10, H200: CUDA numbers the first H200 0, the rest keep PCI order.
        let gpus = vec![a10(0), h200(1), a10(2), h200(3)];
        let r = select_gpus(None, None, DeviceOrder::FastestFirst, &gpus);
        assert_eq!(picked(&r), [(0, 1), (1, 0), (2, 2), (3, 3)]);
        let (exact, how) = note(&r, "gpu_order").expect("order note");
        assert!(!exact, "a guess is never silent");
        assert!(how.contains("approximate") && how.contains("NVML 1 (NVIDIA H200)") && how.contains("PCI_BUS_ID"));
        assert_eq!(picked(&cvd("0,1", &gpus)), [(0, 1), (1, 0)]);
        assert!(!note(&cvd("0", &gpus), "gpu_order").expect("order").0);
        // UUIDs do not depend on the order: exact.
        let r = cvd(&gpus[2].uuid, &gpus);
        assert_eq!(picked(&r), [(0, 2)]);
        assert!(note(&r, "gpu_order").expect("order").0);
        // PCI_BUS_ID: NVML's order, exact.
        let r = select_gpus(None, Some("0,1"), DeviceOrder::PciBusId, &gpus);
        assert_eq!(picked(&r), [(0, 0), (1, 1)]);
        let (exact, how) = note(&r, "gpu_order").expect("order note");
        assert!(exact && how.contains("PCI_BUS_ID"), "{how}");
    }

    #[test]
    fn the_order_follows_pci_bus_ids_and_degrades_to_what_nvml_knows() {
        // NVML's index order is not the bus order here.
        let mut gpus = h200s(3);
        gpus[0].pci = Some((0, 0xca, 0));
        assert_eq!(cuda_order(DeviceOrder::PciBusId, &gpus).0, [1, 2, 0]);
        assert_eq!(cuda_order(DeviceOrder::FastestFirst, &gpus).0, [1, 2, 0]);
        // Without PCI info for every GPU, NVML's order.
        gpus[1].pci = None;
        assert_eq!(cuda_order(DeviceOrder::PciBusId, &gpus).0, [0, 1, 2]);
        // No core counts: compute capability decides.
        let mut gpus = vec![a10(0), a10(1), h200(2)];
        gpus.iter_mut().for_each(|g| g.cores = None);
        let (order, exact, how) = cuda_order(DeviceOrder::FastestFirst, &gpus);
        assert_eq!((order, exact), (vec![2, 0, 1], false));
        assert!(how.contains("NVML 2 (NVIDIA H200) first as the fastest by compute capability"), "{how}");
        // Nothing to rank by: PCI order, and it says it may not be CUDA's.
        gpus.iter_mut().for_each(|g| g.compute_capability = None);
        let (order, exact, how) = cuda_order(DeviceOrder::FastestFirst, &gpus);
        assert_eq!((order, exact), (vec![0, 1, 2], false));
        assert!(how.contains("may not be CUDA's"), "{how}");
        // Cores × clock, not compute capability alone: more, older SMs win.
        let mut big = a10(1);
        big.cores = Some(30000);
        let (order, _, _) = cuda_order(DeviceOrder::FastestFirst, &[h200(0), big]);
        assert_eq!(order, [1, 0]);
    }

    #[test]
    fn uuids_and_unique_prefixes_name_gpus() {
        let u = h200s(4);
        let by_uuid = format!("{},GPU-5ca1ab1e-0000-4000-8000-000000000001", u[3].uuid);
        assert_eq!(picked(&cvd(&by_uuid, &u)), [(0, 3), (1, 1)]);
        // A prefix that names one GPU is that GPU, with or without "GPU-".
        let mut u = h200s(2);
        u[1].uuid = "GPU-b0b0cafe-0000-4000-8000-000000000001".into();
        assert_eq!(picked(&cvd("GPU-b0b0,GPU-5ca1", &u)), [(0, 1), (1, 0)]);
        assert_eq!(picked(&cvd("b0b0cafe", &u)), [(0, 1)]);
        // A prefix that names several names none, and ends the list.
        let r = cvd("1,GPU-", &u);
        assert_eq!(picked(&r), [(0, 1)]);
        let (_, why) = note(&r, "gpu_selection").expect("a note on the ignored entries");
        assert!(why.contains("'GPU-' names no GPU"), "{why}");
    }

    #[test]
    fn a_mig_device_is_sampled_as_its_parent_and_says_so() {
        let gpus = with_mig(h200s(3));
        let r = cvd("MIG-aaaa2", &gpus);
        let want = SelectedGpu { logical: 0, nvml_index: 1, mig: vec![gpus[1].mig_uuids[1].clone()] };
        assert_eq!(r.as_ref().map(|s| s.gpus.clone()), Ok(vec![want]));
        let (available, why) = note(&r, "GPU_0/mig").expect("a MIG note");
        assert!(!available);
        assert!(why.contains("MIG-aaaa2222-0000-4000-9000-000000000000") && why.contains("whole GPU"), "{why}");
        // Two MIG devices of one GPU: the GPU is sampled once, as the first one's number.
        let r = cvd("MIG-aaaa1,2,MIG-aaaa2", &gpus);
        assert_eq!(picked(&r), [(0, 1), (1, 2)]);
        assert_eq!(r.as_ref().map(|s| s.gpus[0].mig.len()), Ok(2));
        // CUDA 11's form names the parent by its UUID.
        let legacy = format!("MIG-{}/1/0", gpus[1].uuid);
        assert_eq!(picked(&cvd(&legacy, &gpus)), [(0, 1)]);
        assert!(cvd(&format!("MIG-{}/1/0", "GPU-0000"), &gpus).is_err());
        // An ambiguous MIG prefix, or a MIG UUID nobody has, names nothing.
        assert!(cvd("MIG-aaaa", &gpus).is_err());
        assert!(cvd("MIG-ffff", &gpus).is_err());
        // A GPU in MIG mode chosen by number: its readings are still the whole GPU's.
        let r = select_gpus(None, None, DeviceOrder::FastestFirst, &gpus);
        let (available, why) = note(&r, "GPU_1/mig").expect("a MIG note");
        assert!(!available && why.contains("NVML 1 is in MIG mode") && why.contains("MIG- UUID"), "{why}");
        assert_eq!(note(&r, "GPU_0/mig"), None);
    }

    #[test]
    fn the_first_invalid_entry_ends_the_list() {
        let r = cvd("1,7,0", &h200s(4));
        assert_eq!(picked(&r), [(0, 1)]);
        let (available, why) = note(&r, "gpu_selection").expect("a note");
        assert!(available && why.contains("'7' names no GPU"), "{why}");
        // CUDA's own example: 0,2,-1,1 shows 0 and 2.
        assert_eq!(picked(&cvd("0,2,-1,1", &h200s(3))), [(0, 0), (1, 2)]);
        assert_eq!(note(&cvd("0,2", &h200s(3)), "gpu_selection"), None);
    }

    #[test]
    fn nothing_matched_is_an_error_that_names_the_gpus() {
        for value in ["", " , ", "-1", "7", "GPU-ffff", "MIG-ffff,0"] {
            let e = cvd(value, &h200s(2)).expect_err(value);
            assert!(e.contains(&format!("CUDA_VISIBLE_DEVICES='{value}' names no GPU")), "{e}");
            assert!(e.contains("2 GPUs: 0 GPU-5ca1ab1e-0000-4000-8000-000000000000, 1 GPU-"), "{e}");
        }
    }

    #[test]
    fn a_repeated_entry_ends_the_list() {
        let r = cvd("1,1,0", &h200s(4));
        assert_eq!(picked(&r), [(0, 1)]);
        assert!(note(&r, "gpu_selection").expect("a note").1.contains("'1' repeats an earlier one"));
        let gpus = h200s(2);
        assert_eq!(picked(&cvd(&format!("0,{}", gpus[0].uuid), &gpus)), [(0, 0)]);
        let gpus = with_mig(h200s(2));
        assert_eq!(picked(&cvd("MIG-aaaa1,MIG-aaaa1111,0", &gpus)), [(0, 1)]);
    }

    #[test]
    fn override_wins_takes_nvml_indices_and_rejects_unknown() {
        let gpus = vec![a10(0), h200(1)];
        let o = vec!["0".to_string()];
        let r = select_gpus(Some(&o), Some("1"), DeviceOrder::FastestFirst, &gpus);
        assert_eq!(picked(&r), [(0, 0)], "--gpus numbers are NVML's, whatever CUDA's order");
        assert!(note(&r, "gpu_order").expect("order").1.contains("--gpus"));
        let mig = vec!["1".to_string(), "MIG-aaaa2".to_string()];
        let r = select_gpus(Some(&mig), None, DeviceOrder::FastestFirst, &with_mig(h200s(2)));
        assert_eq!(picked(&r), [(0, 1)]);
        for bad in ["9", "GPU-5ca1ab1e", "MIG-aaaa"] {
            let e = select_gpus(Some(&[bad.to_string()]), None, DeviceOrder::FastestFirst, &with_mig(h200s(2)))
                .expect_err(bad);
            assert!(e.starts_with(&format!("--gpus: '{bad}' is not")), "{e}");
        }
    }

    #[test]
    fn a_step_that_never_ended_keeps_its_start_values() {
        let db = tempfile::tempdir().expect("tempdir");
        let path = db.path().join("p.db");
        let (store, id) = open_store(&path);
        let writer = store.spawn_writer(id);
        // GPU 0 every 10 ms for 100 ms: 50 W, utilization 10 k %, memory 1000 + k MiB used,
        // fan 30 %, GPU 60 °C, no memory temperature.
        let rows: Vec<GpuSampleRow> = (0..=10u64)
            .map(|k| GpuSampleRow {
                gpu: 0,
                ts_ns: k * 10 * MS,
                utilization_gpu_pct: Some(10.0 * k as f64),
                utilization_memory_pct: Some(5.0),
                memory_used_mib: Some(1000.0 + k as f64),
                memory_free_mib: Some(3000.0 - k as f64),
                memory_total_mib: Some(4000.0),
                power_w: Some(50.0),
                memory_power_w: None,
                energy_j: Some(0.5 * k as f64),
                temperature_gpu_c: Some(60.0),
                temperature_memory_c: None,
                fan_speed_pct: Some(30.0),
                sm_clock_mhz: Some(1500.0),
                memory_clock_mhz: Some(5000.0),
                clock_throttle_reasons: Some(0),
                gpm: None,
            })
            .collect();
        writer.send(StoreMsg::GpuSamples(rows));
        let step = |n: u64, start: u64, end: Option<u64>| step_row(n, start * MS, end.map(|e| e * MS));
        writer.send(StoreMsg::Steps(vec![step(0, 20, Some(60)), step(1, 70, None)]));
        let work =
            AtFinish::StepGpu { gpus: vec![0], max_gap_ns: 20 * MS + 1, energy_resolution_j: ENERGY_RESOLUTION_J };
        let stats = writer.finish(end(), vec![work]).expect("finish");
        assert_eq!((stats.failed_rows, stats.first_error), (0, None));

        let conn = Connection::open(&path).expect("reopen");
        type Row = (i64, Option<f64>, Option<f64>, Option<bool>, [Option<f64>; 8], [Option<f64>; 3]);
        let got: Vec<Row> = conn
            .prepare(
                "SELECT step, energy_j, energy_error_j, below_resolution,
                        utilization_gpu_start_pct, utilization_gpu_end_pct, memory_used_start_mib,
                        memory_used_end_mib, memory_free_start_mib, memory_free_end_mib,
                        utilization_memory_start_pct, utilization_memory_end_pct,
                        fan_speed_end_pct, temperature_gpu_end_c, temperature_memory_end_c
                 FROM step_gpu WHERE session_id = ?1 AND label = 'train' AND gpu = 0 ORDER BY step",
            )
            .expect("prepare")
            .query_map([id], |r| {
                let mut gauges = [None; 8];
                for (k, g) in gauges.iter_mut().enumerate() {
                    *g = r.get(4 + k)?;
                }
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, gauges, [r.get(12)?, r.get(13)?, r.get(14)?]))
            })
            .expect("q")
            .collect::<rusqlite::Result<_>>()
            .expect("rows");
        assert_eq!(got.len(), 2, "one row per step, ended or not: {got:?}");

        let (n, energy, error, below, gauges, end_only) = got[0];
        assert_eq!(n, 0);
        let (energy, error) = (energy.expect("energy"), error.expect("error bound"));
        assert!((energy - 2.0).abs() <= error, "40 ms at 50 W: {energy} J (bound {error})");
        assert_eq!(below, Some(false));
        let pairs =
            [Some(20.0), Some(60.0), Some(1002.0), Some(1006.0), Some(2998.0), Some(2994.0), Some(5.0), Some(5.0)];
        assert_eq!(gauges, pairs, "start and end values");
        assert_eq!(end_only, [Some(30.0), Some(60.0), None]);

        // The step that never ended: its start-side values, NULL for all that needs an end.
        let (n, energy, error, below, gauges, end_only) = got[1];
        assert_eq!(n, 1);
        assert_eq!((energy, error, below), (None, None, None));
        assert_eq!(gauges, [Some(70.0), None, Some(1007.0), None, Some(2993.0), None, Some(5.0), None]);
        assert_eq!(end_only, [None, None, None]);
    }
}
