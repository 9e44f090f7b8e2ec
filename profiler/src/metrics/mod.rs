//! Live metrics while tracing: per-step, launch, loss, GPU and CPU-energy figures kept in atomics
//! that the consumer and the samplers update, served to Prometheus (`--prometheus ADDR`) and pushed
//! over OTLP/HTTP (`--otlp URL`). Nothing here is on the event path: the consumer publishes once
//! per drained batch, the samplers once per sample, and a scrape or push only reads atomics.
mod http;
mod machine;
mod otlp;
mod series;
mod session;
#[cfg(test)]
mod tests;

use std::{net::SocketAddr, sync::Arc, time::Duration};

pub use machine::MachineMetrics;
use prometheus_client::registry::Registry;
use series::{CounterFamily, GaugeFamily, HistogramFamily, Labels, Spec};
pub use session::{FlopsAt, SessionMetrics};

/// The live-metrics flags of `attach` and `run`.
#[derive(clap::Args, Debug, Clone)]
pub struct LiveArgs {
    /// Serve live metrics for Prometheus at http://ADDR/metrics (e.g. 127.0.0.1:9464; none unless asked).
    #[arg(long, value_name = "ADDR", value_parser = parse_listen_addr)]
    prometheus: Option<SocketAddr>,
    /// Push live metrics over OTLP/HTTP (protobuf) to URL (e.g. http://collector:4318/v1/metrics; a
    /// URL with no path gets /v1/metrics).
    #[arg(long, value_name = "URL", value_parser = otlp::parse_url)]
    otlp: Option<String>,
    /// How often to push with --otlp (`10s`, `500ms`, or seconds).
    #[arg(long, value_name = "TIME", default_value = "10s", value_parser = parse_interval)]
    otlp_interval: Duration,
}

fn parse_listen_addr(s: &str) -> Result<SocketAddr, String> {
    s.parse().map_err(|_| format!("'{s}' is not IP:PORT, e.g. 127.0.0.1:9464 (this machine only) or 0.0.0.0:9464"))
}

fn parse_interval(s: &str) -> Result<Duration, String> {
    let d = match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v < 86_400.0 => Duration::from_secs_f64(v),
        Ok(_) => return Err(format!("'{s}' is not a number of seconds between 0 and a day")),
        Err(_) => humantime::parse_duration(s).map_err(|e| format!("'{s}' is not a duration such as 10s ({e})"))?,
    };
    if d < Duration::from_millis(100) {
        return Err(format!("'{s}' is shorter than 100ms; push less often"));
    }
    Ok(d)
}

/// What the session is to export live, validated by the CLI.
#[derive(Clone, Debug, Default)]
pub struct LiveConfig {
    pub prometheus: Option<SocketAddr>,
    /// (metrics endpoint URL, push interval).
    pub otlp: Option<(String, Duration)>,
}

impl From<LiveArgs> for LiveConfig {
    fn from(a: LiveArgs) -> Self {
        Self { prometheus: a.prometheus, otlp: a.otlp.map(|u| (u, a.otlp_interval)) }
    }
}

/// The labels every series of a process carries: `job`, `host` and, when known, `rank`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeriesLabels {
    pub job: String,
    pub host: String,
    pub rank: Option<u32>,
}

impl SeriesLabels {
    /// A process's labels: its job, this machine's name, its `RANK` when set.
    pub fn of_process(job: &str, rank: Option<i64>) -> Self {
        let host = rustix::system::uname().nodename().to_string_lossy().into_owned();
        Self { job: job.to_owned(), host, rank: rank.and_then(|r| u32::try_from(r).ok()) }
    }

    /// `job`, `host`, `rank` (when known), then `extra`.
    fn with(&self, extra: Option<(&'static str, String)>) -> Labels {
        let mut labels = vec![("job", self.job.clone()), ("host", self.host.clone())];
        labels.extend(self.rank.map(|r| ("rank", r.to_string())));
        labels.extend(extra);
        labels
    }

    /// The machine's series carry no rank: one agent samples its GPUs and RAPL once.
    fn machine(&self, extra: (&'static str, String)) -> Labels {
        vec![("job", self.job.clone()), ("host", self.host.clone()), extra]
    }
}

const STEPS: Spec = Spec { name: "profiler_steps", help: "Steps ended", unit: None };
const STEP_DURATION: Spec =
    Spec { name: "profiler_step_duration", help: "Step time (intra-step)", unit: Some(("seconds", "s")) };
const LAST_STEP: Spec =
    Spec { name: "profiler_last_step_duration", help: "The last step's time", unit: Some(("seconds", "s")) };
const STEP_RATE: Spec =
    Spec { name: "profiler_steps_per_second", help: "Steps ended per second, over about a second", unit: None };
const SYNC_WAIT: Spec = Spec {
    name: "profiler_step_sync_wait",
    help: "Time in steps spent waiting on the GPU (synchronisation calls)",
    unit: Some(("seconds", "s")),
};
const SYNC_SHARE: Spec = Spec {
    name: "profiler_last_step_sync_wait",
    help: "The last step's share of time spent waiting on the GPU",
    unit: Some(("ratio", "1")),
};
const STEPS_BOUND: Spec = Spec {
    name: "profiler_steps_bound",
    help: "Steps ended, by verdict (`bound`: data, gpu, host-cpu, cpu-starved, ...; the rule in docs/measurement.md)",
    unit: None,
};
const LAUNCHES: Spec = Spec { name: "profiler_launches", help: "CUDA kernel launches seen", unit: None };
const GEMM_FLOPS: Spec = Spec {
    name: "profiler_gemm_flops",
    help: "Floating-point operations of the GEMMs issued through cuBLAS/cuBLASLt (2·m·n·k·batch)",
    unit: None,
};
const LAST_STEP_FLOPS_RATE: Spec = Spec {
    name: "profiler_last_step_gemm_flops_per_second",
    help: "The last step's GEMM FLOPs over its time (a lower bound: GEMMs through cuBLAS/cuBLASLt only)",
    unit: None,
};
const LAST_STEP_MFU: Spec = Spec {
    name: "profiler_last_step_mfu",
    help: "The last step's GEMM FLOPs over what its GPUs could do in its time at their dense peak for the step's \
           dominant precision (model-FLOPs utilisation; a lower bound: GEMMs through cuBLAS/cuBLASLt only)",
    unit: Some(("ratio", "1")),
};
const LOST: Spec = Spec { name: "profiler_lost_events", help: "Records the ring buffers had no room for", unit: None };
const GPU_UTIL: Spec =
    Spec { name: "profiler_gpu_utilization", help: "GPU busy share (NVML)", unit: Some(("ratio", "1")) };
const GPU_MEMORY: Spec =
    Spec { name: "profiler_gpu_memory_used", help: "GPU memory in use", unit: Some(("bytes", "By")) };
const GPU_POWER: Spec = Spec { name: "profiler_gpu_power", help: "GPU power draw", unit: Some(("watts", "W")) };
const GPU_ENERGY: Spec =
    Spec { name: "profiler_gpu_energy", help: "GPU energy since tracing began", unit: Some(("joules", "J")) };
const GPU_TEMP: Spec =
    Spec { name: "profiler_gpu_temperature", help: "GPU temperature", unit: Some(("celsius", "Cel")) };
const CPU_POWER: Spec =
    Spec { name: "profiler_cpu_power", help: "RAPL power by domain (package, dram, …)", unit: Some(("watts", "W")) };
const CPU_ENERGY: Spec = Spec {
    name: "profiler_cpu_energy",
    help: "RAPL energy by domain since tracing began",
    unit: Some(("joules", "J")),
};

/// Every metric's family, in both exporters.
struct Families {
    steps: CounterFamily,
    step_duration: HistogramFamily,
    last_step: GaugeFamily,
    step_rate: GaugeFamily,
    sync_wait: CounterFamily,
    sync_share: GaugeFamily,
    steps_bound: CounterFamily,
    launches: CounterFamily,
    gemm_flops: CounterFamily,
    last_step_flops_rate: GaugeFamily,
    last_step_mfu: GaugeFamily,
    lost: CounterFamily,
    gpu_util: GaugeFamily,
    gpu_memory: GaugeFamily,
    gpu_power: GaugeFamily,
    gpu_energy: CounterFamily,
    gpu_temp: GaugeFamily,
    cpu_power: GaugeFamily,
    cpu_energy: CounterFamily,
}

impl Families {
    fn new(r: &mut Registry, m: Option<&opentelemetry::metrics::Meter>) -> Self {
        Self {
            steps: CounterFamily::new(&STEPS, r, m),
            step_duration: HistogramFamily::new(&STEP_DURATION, r, m),
            last_step: GaugeFamily::new(&LAST_STEP, r, m),
            step_rate: GaugeFamily::new(&STEP_RATE, r, m),
            sync_wait: CounterFamily::new(&SYNC_WAIT, r, m),
            sync_share: GaugeFamily::new(&SYNC_SHARE, r, m),
            steps_bound: CounterFamily::new(&STEPS_BOUND, r, m),
            launches: CounterFamily::new(&LAUNCHES, r, m),
            gemm_flops: CounterFamily::new(&GEMM_FLOPS, r, m),
            last_step_flops_rate: GaugeFamily::new(&LAST_STEP_FLOPS_RATE, r, m),
            last_step_mfu: GaugeFamily::new(&LAST_STEP_MFU, r, m),
            lost: CounterFamily::new(&LOST, r, m),
            gpu_util: GaugeFamily::new(&GPU_UTIL, r, m),
            gpu_memory: GaugeFamily::new(&GPU_MEMORY, r, m),
            gpu_power: GaugeFamily::new(&GPU_POWER, r, m),
            gpu_energy: CounterFamily::new(&GPU_ENERGY, r, m),
            gpu_temp: GaugeFamily::new(&GPU_TEMP, r, m),
            cpu_power: GaugeFamily::new(&CPU_POWER, r, m),
            cpu_energy: CounterFamily::new(&CPU_ENERGY, r, m),
        }
    }
}

/// Registers a process's series with the agent's families.
#[derive(Clone)]
pub struct LiveSessions(Arc<Families>);

impl LiveSessions {
    /// A session's series, one set per step label.
    pub fn session(&self, labels: &SeriesLabels, step_labels: &[&'static str]) -> SessionMetrics {
        SessionMetrics::new(self.0.clone(), labels, step_labels)
    }
}

/// The agent's live metrics: one per agent, shared by its sessions (each
/// registers its own labelled series) and its samplers. Inert without
/// `--prometheus` and `--otlp`.
pub struct Live {
    families: Option<Arc<Families>>,
    server: Option<tokio::task::JoinHandle<()>>,
    pusher: Option<otlp::Pusher>,
}

impl Live {
    /// Listens on the `--prometheus` address (a port in use is the user's
    /// one-line error) and starts the OTLP pusher, whose resource says `agent`'s
    /// host, job and rank. Needs the tokio runtime.
    pub async fn start(cfg: &LiveConfig, agent: &SeriesLabels) -> anyhow::Result<Self> {
        if cfg.prometheus.is_none() && cfg.otlp.is_none() {
            return Ok(Self { families: None, server: None, pusher: None });
        }
        let pusher = cfg.otlp.as_ref().map(|(url, every)| otlp::Pusher::start(url, *every, agent)).transpose()?;
        let mut registry = Registry::default();
        let families = Arc::new(Families::new(&mut registry, pusher.as_ref().map(otlp::Pusher::meter)));
        let server = match cfg.prometheus {
            Some(addr) => Some(http::serve(addr, Arc::new(registry)).await?),
            None => None,
        };
        Ok(Self { families: Some(families), server, pusher })
    }

    /// What registers each process's series (the job's processes come and
    /// go); None when nothing is exported.
    pub fn sessions(&self) -> Option<LiveSessions> {
        self.families.clone().map(LiveSessions)
    }

    /// The machine's GPU and RAPL series, for the samplers.
    pub fn machine(&self, labels: &SeriesLabels) -> Option<MachineMetrics> {
        self.families.as_ref().map(|f| MachineMetrics::new(f.clone(), labels.clone()))
    }

    /// Stops serving, and pushes one last time (the session's final figures).
    pub async fn shutdown(self) {
        if let Some(server) = self.server {
            server.abort();
        }
        if let Some(pusher) = self.pusher {
            pusher.shutdown().await;
        }
    }
}
