//! GPU telemetry through NVML: a sampler per session that reads every
//! selected GPU on each tick, and the per-step figures (exact energy split at
//! step boundaries, GPUStatsMonitor's values at step start and end).
//!
//! One NVML handle per session. A reading a GPU does not have is stored as
//! NULL with the reason recorded once in `capabilities`. The running-process
//! list (milliseconds, under the driver lock) is read every few seconds, never
//! on every tick.
use std::{
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
use rusqlite::{Connection, params, types::Value};

use super::{CapabilityLog, Sampler, load_columns, step_spans};
use crate::{
    correlate::{CounterSeries, GaugeSeries, interval_energy},
    store::{FinishHook, Insert, RowSender, StoreMsg},
};

/// Tables this sampler owns (a migration; see `store::MIGRATIONS`).
pub const SCHEMA: &str = r#"
CREATE TABLE gpus (
    session_id              INTEGER NOT NULL REFERENCES sessions(id),
    gpu                     INTEGER NOT NULL,
    nvml_index              INTEGER NOT NULL,
    uuid                    TEXT    NOT NULL,
    name                    TEXT,
    memory_total_mib        REAL,
    power_limit_w           REAL,
    driver_version          TEXT,
    power_source            TEXT,
    energy_update_period_ms REAL,
    used_by_target          INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, gpu)
);
CREATE TABLE gpu_samples (
    session_id             INTEGER NOT NULL,
    gpu                    INTEGER NOT NULL,
    ts_ns                  INTEGER NOT NULL,
    utilization_gpu_pct    REAL,
    utilization_memory_pct REAL,
    memory_used_mib        REAL,
    memory_free_mib        REAL,
    memory_total_mib       REAL,
    power_w                REAL,
    memory_power_w         REAL,
    energy_j               REAL,
    temperature_gpu_c      REAL,
    temperature_memory_c   REAL,
    fan_speed_pct          REAL,
    sm_clock_mhz           REAL,
    memory_clock_mhz       REAL,
    clock_throttle_reasons INTEGER
);
CREATE TABLE step_gpu (
    session_id                   INTEGER NOT NULL,
    label                        TEXT    NOT NULL,
    step                         INTEGER NOT NULL,
    gpu                          INTEGER NOT NULL,
    energy_j                     REAL,
    energy_error_j               REAL,
    avg_power_w                  REAL,
    below_resolution             INTEGER,
    utilization_gpu_start_pct    REAL,
    utilization_gpu_end_pct      REAL,
    memory_used_start_mib        REAL,
    memory_used_end_mib          REAL,
    memory_free_start_mib        REAL,
    memory_free_end_mib          REAL,
    utilization_memory_start_pct REAL,
    utilization_memory_end_pct   REAL,
    fan_speed_end_pct            REAL,
    temperature_gpu_end_c        REAL,
    temperature_memory_end_c     REAL,
    PRIMARY KEY (session_id, label, step, gpu)
);
CREATE VIEW gpu_stats_monitor AS
    SELECT session_id, label, step, 'GPU_' || gpu || '/utilization.gpu - percent' AS metric, utilization_gpu_start_pct AS value, 'batch_start' AS phase FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/memory.used - MB', memory_used_start_mib, 'batch_start' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/memory.free - MB', memory_free_start_mib, 'batch_start' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/utilization.memory - percent', utilization_memory_start_pct, 'batch_start' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/utilization.gpu - percent', utilization_gpu_end_pct, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/memory.used - MB', memory_used_end_mib, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/memory.free - MB', memory_free_end_mib, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/utilization.memory - percent', utilization_memory_end_pct, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/fan.speed - percent', fan_speed_end_pct, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/temperature.gpu - °C', temperature_gpu_end_c, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/temperature.memory - °C', temperature_memory_end_c, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'batch_time/intra_step (ms)', duration_ns / 1e6, 'batch_end' FROM steps WHERE end_ns IS NOT NULL
    UNION ALL SELECT session_id, label, step, 'batch_time/inter_step (ms)', inter_step_ns / 1e6, 'batch_start' FROM steps WHERE inter_step_ns IS NOT NULL;
"#;

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
    /// `--gpus`: NVML indices or UUIDs (prefixes allowed).
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

/// A GPU chosen for sampling: its index as the target's CUDA sees it, and NVML's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelectedGpu {
    pub logical: u32,
    pub nvml_index: u32,
}

/// Which GPUs to sample, and their logical numbers. `override_list` (`--gpus`)
/// wins; otherwise the target's `CUDA_VISIBLE_DEVICES` (indices or UUIDs,
/// in the order CUDA numbers them); otherwise all GPUs. `uuids[i]` is the UUID
/// of NVML device i. Entries CUDA would stop at (an invalid one ends the list,
/// as in CUDA) end the list here too.
pub fn select_gpus(
    override_list: Option<&[String]>,
    cuda_visible_devices: Option<&str>,
    uuids: &[String],
) -> Result<Vec<SelectedGpu>, String> {
    let find = |entry: &str| -> Option<u32> {
        let e = entry.trim();
        if let Ok(i) = e.parse::<u32>() {
            return ((i as usize) < uuids.len()).then_some(i);
        }
        let matches: Vec<usize> = uuids
            .iter()
            .enumerate()
            .filter(|(_, u)| u.starts_with(e) || u.strip_prefix("GPU-").is_some_and(|s| s.starts_with(e)))
            .map(|(i, _)| i)
            .collect();
        (matches.len() == 1).then(|| matches[0] as u32)
    };
    if let Some(list) = override_list {
        let mut out = Vec::new();
        for (logical, entry) in list.iter().enumerate() {
            let nvml_index = find(entry).ok_or_else(|| {
                format!(
                    "--gpus: '{entry}' is not a GPU index or UUID here ({} GPUs: {})",
                    uuids.len(),
                    uuids.join(", ")
                )
            })?;
            out.push(SelectedGpu { logical: logical as u32, nvml_index });
        }
        return Ok(out);
    }
    match cuda_visible_devices {
        Some(cvd) => {
            let mut out: Vec<SelectedGpu> = Vec::new();
            for entry in cvd.split(',').filter(|e| !e.trim().is_empty()) {
                let Some(nvml_index) = find(entry) else { break };
                if out.iter().any(|g| g.nvml_index == nvml_index) {
                    break;
                }
                out.push(SelectedGpu { logical: out.len() as u32, nvml_index });
            }
            Ok(out)
        }
        None => Ok((0..uuids.len() as u32).map(|i| SelectedGpu { logical: i, nvml_index: i }).collect()),
    }
}

struct GpuState {
    sel: SelectedGpu,
    first_energy_mj: Option<u64>,
    instant_power: bool,
}

/// Samples the selected GPUs.
/// The latest (logical GPU, utilization %, power W) of each GPU, for the live status line.
pub type GpuLive = std::sync::Arc<std::sync::Mutex<Vec<(u32, Option<f64>, Option<f64>)>>>;

pub struct GpuSampler {
    live: GpuLive,
    nvml: Nvml,
    gpus: Vec<GpuState>,
    /// Set by [`GpuSampler::start`]; rows go nowhere before.
    out: Option<(RowSender, CapabilityLog)>,
    info_rows: Vec<Vec<Value>>,
    power_sources: Vec<(u32, bool)>,
    pid: u32,
    interval: Duration,
    ticks: u64,
    rows: Vec<Vec<Value>>,
}

fn opt_f64(r: Result<f64, String>, caps: &mut CapabilityLog, metric: &str) -> Value {
    let r = r.map_err(|e| format!("NVML: {e}"));
    caps.note(metric, &r);
    r.map_or(Value::Null, Value::Real)
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
    /// Initialises NVML and picks the GPUs; nothing is written until [`Self::start`].
    pub fn open(cfg: &GpuConfig, pid: u32, target_cvd: Option<&str>) -> Result<Self, GpuError> {
        let nvml = init_nvml(cfg.nvml_lib.as_deref())?;
        let count = nvml.device_count().map_err(|e| GpuError::Unavailable(format!("NVML device count: {e}")))?;
        let mut uuids = Vec::new();
        for i in 0..count {
            let uuid = nvml
                .device_by_index(i)
                .and_then(|d| d.uuid())
                .map_err(|e| GpuError::Unavailable(format!("NVML device {i}: {e}")))?;
            uuids.push(uuid);
        }
        let selected = select_gpus(cfg.gpus.as_deref(), target_cvd, &uuids).map_err(GpuError::Selection)?;
        let driver = nvml.sys_driver_version().ok();
        let mut gpus = Vec::new();
        let mut power_sources = Vec::new();
        let mut info_rows = Vec::new();
        for sel in selected {
            let dev = nvml.device_by_index(sel.nvml_index).map_err(|e| GpuError::Unavailable(e.to_string()))?;
            let instant =
                field_u32(dev.field_values_for(&[FieldId(FI_DEV_POWER_INSTANT)]).ok().as_ref().and_then(|v| v.first()))
                    .is_ok();
            power_sources.push((sel.logical, instant));
            info_rows.push(vec![
                Value::Integer(sel.logical.into()),
                Value::Integer(sel.nvml_index.into()),
                Value::Text(uuids[sel.nvml_index as usize].clone()),
                dev.name().map(Value::Text).unwrap_or(Value::Null),
                dev.memory_info().map(|m| Value::Real(m.total as f64 / 1048576.0)).unwrap_or(Value::Null),
                dev.power_management_limit().map(|mw| Value::Real(f64::from(mw) / 1000.0)).unwrap_or(Value::Null),
                driver.clone().map(Value::Text).unwrap_or(Value::Null),
                Value::Text(if instant { "instant" } else { "average" }.into()),
            ]);
            gpus.push(GpuState { sel, first_energy_mj: None, instant_power: instant });
        }
        Ok(Self {
            nvml,
            gpus,
            out: None,
            live: GpuLive::default(),
            info_rows,
            power_sources,
            pid,
            interval: cfg.interval,
            ticks: 0,
            rows: Vec::new(),
        })
    }

    /// Records the GPUs in `gpus` and starts sending rows to the store.
    pub fn start(&mut self, sender: RowSender) {
        let mut caps = CapabilityLog::new(sender.clone(), "nvml");
        for &(logical, instant) in &self.power_sources {
            let how = if instant { "instant power (field 186)" } else { "power usage (1 s average)" };
            caps.record(&format!("GPU_{logical}/power_source"), true, Some(how.into()));
        }
        sender.send(StoreMsg::Insert(Insert {
            sql: "INSERT INTO gpus(session_id, gpu, nvml_index, uuid, name, memory_total_mib, power_limit_w,
                                   driver_version, power_source) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            rows: std::mem::take(&mut self.info_rows),
        }));
        self.out = Some((sender, caps));
    }

    /// Logical ids of the sampled GPUs.
    /// A handle on the latest readings (see [`GpuLive`]).
    pub fn live(&self) -> GpuLive {
        self.live.clone()
    }

    pub fn logical_gpus(&self) -> Vec<u32> {
        self.gpus.iter().map(|g| g.sel.logical).collect()
    }

    fn sample(dev: &Device<'_>, g: &mut GpuState, caps: &mut CapabilityLog, now_ns: u64) -> Vec<Value> {
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
        let row = vec![
            Value::Integer(l.into()),
            Value::Integer(now_ns as i64),
            opt_f64(util.as_ref().map(|u| f64::from(u.gpu)).map_err(|e| e.to_string()), caps, &m("utilization.gpu")),
            opt_f64(
                util.as_ref().map(|u| f64::from(u.memory)).map_err(|e| e.to_string()),
                caps,
                &m("utilization.memory"),
            ),
            opt_f64(
                mem.as_ref().map(|v| v.used as f64 / 1048576.0).map_err(|e| e.to_string()),
                caps,
                &m("memory.used"),
            ),
            opt_f64(
                mem.as_ref().map(|v| v.free as f64 / 1048576.0).map_err(|e| e.to_string()),
                caps,
                &m("memory.free"),
            ),
            opt_f64(
                mem.as_ref().map(|v| v.total as f64 / 1048576.0).map_err(|e| e.to_string()),
                caps,
                &m("memory.total"),
            ),
            opt_f64(power, caps, &m("power")),
            {
                // NVML has no memory-subsystem power reading for discrete GPUs.
                caps.record(&m("memory_power"), false, Some("NVML reports no memory power for this GPU".into()));
                Value::Null
            },
            opt_f64(energy, caps, &m("energy")),
            opt_f64(
                dev.temperature(TemperatureSensor::Gpu).map(f64::from).map_err(|e| e.to_string()),
                caps,
                &m("temperature.gpu"),
            ),
            opt_f64(field_u32(fields.as_ref().and_then(|f| f.get(1))), caps, &m("temperature.memory")),
            opt_f64(fan, caps, &m("fan.speed")),
            opt_f64(dev.clock_info(Clock::SM).map(f64::from).map_err(|e| e.to_string()), caps, &m("clocks.sm")),
            opt_f64(dev.clock_info(Clock::Memory).map(f64::from).map_err(|e| e.to_string()), caps, &m("clocks.memory")),
            match dev.current_throttle_reasons() {
                Ok(r) => Value::Integer(r.bits() as i64),
                Err(e) => {
                    caps.record(&m("clocks_throttle_reasons"), false, Some(format!("NVML: {e}")));
                    Value::Null
                }
            },
        ];
        row
    }

    fn scan_processes(&mut self) {
        let mut used = Vec::new();
        for g in &self.gpus {
            let Ok(dev) = self.nvml.device_by_index(g.sel.nvml_index) else { continue };
            if let Ok(procs) = dev.running_compute_processes()
                && procs.iter().any(|p| p.pid == self.pid)
            {
                used.push(vec![Value::Integer(g.sel.logical.into())]);
            }
        }
        if let (false, Some((sender, _))) = (used.is_empty(), &self.out) {
            sender.send(StoreMsg::Insert(Insert {
                sql: "UPDATE gpus SET used_by_target = 1 WHERE session_id = ?1 AND gpu = ?2",
                rows: used,
            }));
        }
    }
}

const SAMPLE_SQL: &str = "INSERT INTO gpu_samples(session_id, gpu, ts_ns, utilization_gpu_pct, utilization_memory_pct,
    memory_used_mib, memory_free_mib, memory_total_mib, power_w, memory_power_w, energy_j, temperature_gpu_c,
    temperature_memory_c, fan_speed_pct, sm_clock_mhz, memory_clock_mhz, clock_throttle_reasons)
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17)";

impl Sampler for GpuSampler {
    fn tick(&mut self, now_ns: u64) {
        let Some((_, caps)) = self.out.as_mut() else { return };
        let mut live = Vec::with_capacity(self.gpus.len());
        for g in self.gpus.iter_mut() {
            match self.nvml.device_by_index(g.sel.nvml_index) {
                Ok(dev) => {
                    let row = Self::sample(&dev, g, caps, now_ns);
                    let real = |v: &Value| if let Value::Real(x) = v { Some(*x) } else { None };
                    live.push((g.sel.logical, real(&row[2]), real(&row[7])));
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

    fn finish(&mut self) -> Option<FinishHook> {
        self.flush();
        let gpus = self.logical_gpus();
        let max_gap_ns = 2 * self.interval.as_nanos() as u64 + 1;
        Some(Box::new(move |conn: &Connection, session: i64| step_gpu(conn, session, &gpus, max_gap_ns)))
    }
}

impl GpuSampler {
    fn flush(&mut self) {
        if let (false, Some((sender, _))) = (self.rows.is_empty(), &self.out) {
            sender.send(StoreMsg::Insert(Insert { sql: SAMPLE_SQL, rows: std::mem::take(&mut self.rows) }));
        }
    }
}

/// Per-step, per-GPU figures from `gpu_samples` and `steps` (the finish
/// hook). A step that never ended gets its start-side values; its energy and
/// end-side values are NULL.
fn step_gpu(conn: &Connection, session: i64, gpus: &[u32], max_gap_ns: u64) -> rusqlite::Result<()> {
    let steps = step_spans(conn, session)?;
    let mut insert = conn.prepare(
        "INSERT INTO step_gpu(session_id, label, step, gpu, energy_j, energy_error_j, avg_power_w, below_resolution,
             utilization_gpu_start_pct, utilization_gpu_end_pct, memory_used_start_mib, memory_used_end_mib,
             memory_free_start_mib, memory_free_end_mib, utilization_memory_start_pct, utilization_memory_end_pct,
             fan_speed_end_pct, temperature_gpu_end_c, temperature_memory_end_c)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19)",
    )?;
    let mut samples = conn.prepare(
        "SELECT ts_ns, energy_j, utilization_gpu_pct, memory_used_mib, memory_free_mib, utilization_memory_pct,
                fan_speed_pct, temperature_gpu_c, temperature_memory_c
         FROM gpu_samples WHERE session_id = ?1 AND gpu = ?2 ORDER BY ts_ns",
    )?;
    for &gpu in gpus {
        let columns = load_columns(&mut samples, params![session, gpu])?.columns;
        let [energy, util, used, free, umem, fan, temp, tmem]: [Vec<(u64, f64)>; 8] =
            columns.try_into().expect("the query selects eight value columns");
        let energy = CounterSeries::from_samples(&energy, ENERGY_RESOLUTION_J);
        let [util, used, free, umem, fan, temp, tmem] =
            [util, used, free, umem, fan, temp, tmem].map(|points| GaugeSeries { points });
        for s in &steps {
            let start = s.start_ns;
            let e = s.end_ns.and_then(|end| interval_energy(&energy, start, end));
            let at_end = |g: &GaugeSeries| s.end_ns.and_then(|end| g.at(end, max_gap_ns));
            insert.execute(params![
                session,
                s.label,
                s.step,
                gpu,
                e.map(|e| e.energy),
                e.map(|e| e.error),
                e.map(|e| e.avg_power),
                e.map(|e| e.below_resolution),
                util.at(start, max_gap_ns),
                at_end(&util),
                used.at(start, max_gap_ns),
                at_end(&used),
                free.at(start, max_gap_ns),
                at_end(&free),
                umem.at(start, max_gap_ns),
                at_end(&umem),
                at_end(&fan),
                at_end(&temp),
                at_end(&tmem),
            ])?;
        }
        if !energy.is_empty() {
            conn.execute(
                "UPDATE gpus SET energy_update_period_ms = ?3 WHERE session_id = ?1 AND gpu = ?2",
                params![session, gpu, energy.update_period_ns as f64 / 1e6],
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::samplers::testing::{end, open_store, step_row};

    const MS: u64 = 1_000_000;

    fn uuids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("GPU-5ca1ab1e-0000-4000-8000-{i:012}")).collect()
    }

    fn sel(pairs: &[(u32, u32)]) -> Vec<SelectedGpu> {
        pairs.iter().map(|&(logical, nvml_index)| SelectedGpu { logical, nvml_index }).collect()
    }

    #[test]
    fn all_gpus_without_cuda_visible_devices() {
        assert_eq!(select_gpus(None, None, &uuids(3)), Ok(sel(&[(0, 0), (1, 1), (2, 2)])));
    }

    #[test]
    fn cuda_visible_devices_maps_logical_to_physical() {
        assert_eq!(select_gpus(None, Some("2,0"), &uuids(4)), Ok(sel(&[(0, 2), (1, 0)])));
        let u = uuids(4);
        let by_uuid = format!("{},GPU-5ca1ab1e-0000-4000-8000-000000000001", u[3]);
        assert_eq!(select_gpus(None, Some(&by_uuid), &u), Ok(sel(&[(0, 3), (1, 1)])));
        // CUDA stops at the first invalid entry, and at a repeated one.
        assert_eq!(select_gpus(None, Some("1,7,0"), &uuids(4)), Ok(sel(&[(0, 1)])));
        assert_eq!(select_gpus(None, Some("1,1,0"), &uuids(4)), Ok(sel(&[(0, 1)])));
        assert_eq!(select_gpus(None, Some(""), &uuids(2)), Ok(vec![]));
        assert_eq!(select_gpus(None, Some("-1"), &uuids(2)), Ok(vec![]));
    }

    #[test]
    fn override_wins_and_rejects_unknown() {
        let o = vec!["1".to_string()];
        assert_eq!(select_gpus(Some(&o), Some("0"), &uuids(2)), Ok(sel(&[(0, 1)])));
        let bad = vec!["9".to_string()];
        assert!(select_gpus(Some(&bad), None, &uuids(2)).is_err());
        // An ambiguous UUID prefix is not a match.
        let amb = vec!["GPU-5ca1ab1e".to_string()];
        assert!(select_gpus(Some(&amb), None, &uuids(2)).is_err());
    }

    #[test]
    fn a_step_that_never_ended_keeps_its_start_values() {
        let db = tempfile::tempdir().expect("tempdir");
        let path = db.path().join("p.db");
        let (store, id) = open_store(&path);
        let writer = store.spawn_writer(id);
        // GPU 0 every 10 ms for 100 ms: 50 W, utilization 10 k %, memory 1000 + k MiB used,
        // fan 30 %, GPU 60 °C, no memory temperature.
        let rows: Vec<Vec<Value>> = (0..=10i64)
            .map(|k| {
                let r = |v: f64| Value::Real(v);
                vec![
                    Value::Integer(0),
                    Value::Integer(k * 10 * MS as i64),
                    r(10.0 * k as f64),
                    r(5.0),
                    r(1000.0 + k as f64),
                    r(3000.0 - k as f64),
                    r(4000.0),
                    r(50.0),
                    Value::Null,
                    r(0.5 * k as f64),
                    r(60.0),
                    Value::Null,
                    r(30.0),
                    r(1500.0),
                    r(5000.0),
                    Value::Integer(0),
                ]
            })
            .collect();
        writer.send(StoreMsg::Insert(Insert { sql: SAMPLE_SQL, rows }));
        let step = |n: u64, start: u64, end: Option<u64>| step_row(n, start * MS, end.map(|e| e * MS));
        writer.send(StoreMsg::Steps(vec![step(0, 20, Some(60)), step(1, 70, None)]));
        let hook: FinishHook = Box::new(|conn, session| step_gpu(conn, session, &[0], 20 * MS + 1));
        let stats = writer.finish(end(), vec![hook]).expect("finish");
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
