//! The live metrics without a network: what a scrape would read after known rows.
use std::sync::Arc;

use prometheus_client::{encoding::text::encode, registry::Registry};

use super::*;
use crate::{
    correlate::mfu::Precision,
    probes::KernelCounters,
    samplers::testing::step_row,
    store::{GpuSampleRow, RaplSampleRow},
};

fn labels(rank: Option<u32>) -> SeriesLabels {
    SeriesLabels { job: "trainer".into(), host: "node1".into(), rank }
}

fn families() -> (Arc<Families>, Registry) {
    let mut registry = Registry::default();
    (Arc::new(Families::new(&mut registry, None)), registry)
}

fn scrape(registry: &Registry) -> String {
    let mut text = String::new();
    encode(&mut text, registry).expect("encode");
    text
}

/// The value of the exposition line that starts with `series` (name and labels as written).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[test]
fn ended_steps_are_counted_and_open_ones_are_not() {
    let (f, registry) = families();
    let mut m = SessionMetrics::new(f, &labels(None), &["train", "eval"]);
    let mut a = step_row(0, 1_000_000_000, Some(1_250_000_000));
    a.sync_wait_ns = Some(50_000_000);
    let b = step_row(1, 1_300_000_000, Some(1_400_000_000));
    let open = step_row(2, 1_500_000_000, None);
    m.steps_ended(&[a, b, open], &|_, _| None);
    let text = scrape(&registry);
    let train = r#"{job="trainer",host="node1",label="train"}"#;
    assert_eq!(value(&text, &format!("profiler_steps_total{train}")), Some(2.0), "{text}");
    assert_eq!(value(&text, &format!("profiler_last_step_duration_seconds{train}")), Some(0.1));
    assert_eq!(value(&text, &format!("profiler_step_duration_seconds_count{train}")), Some(2.0));
    assert_eq!(value(&text, &format!("profiler_step_sync_wait_seconds_total{train}")), Some(0.05));
    assert_eq!(value(&text, &format!("profiler_last_step_sync_wait_ratio{train}")), Some(0.2));
    // A label with no step yet is there, at 0.
    let eval = r#"{job="trainer",host="node1",label="eval"}"#;
    assert_eq!(value(&text, &format!("profiler_steps_total{eval}")), Some(0.0));
}

#[test]
fn kernel_counters_are_published_as_increments() {
    let (f, registry) = families();
    let mut m = SessionMetrics::new(f, &labels(Some(3)), &[]);
    let kc = |launches, lost| KernelCounters { lost, lost_step_records: 0, lost_off_cpu: 0, map_failures: 0, launches };
    m.kernel_counters(&kc(100, 0));
    m.kernel_counters(&kc(250, 2));
    m.kernel_counters(&kc(250, 2));
    let text = scrape(&registry);
    let process = r#"{job="trainer",host="node1",rank="3"}"#;
    assert_eq!(value(&text, &format!("profiler_launches_total{process}")), Some(250.0), "{text}");
    assert_eq!(value(&text, &format!("profiler_lost_events_total{process}")), Some(2.0));
}

#[test]
fn two_sessions_in_one_agent_keep_their_own_series() {
    let (f, registry) = families();
    let mut r0 = SessionMetrics::new(f.clone(), &labels(Some(0)), &["train"]);
    let mut r1 = SessionMetrics::new(f, &labels(Some(1)), &["train"]);
    r0.steps_ended(&[step_row(0, 0, Some(10))], &|_, _| None);
    r1.steps_ended(&[step_row(0, 0, Some(10)), step_row(1, 20, Some(30))], &|_, _| None);
    let text = scrape(&registry);
    let series = |rank| format!(r#"profiler_steps_total{{job="trainer",host="node1",rank="{rank}",label="train"}}"#);
    assert_eq!(value(&text, &series(0)), Some(1.0), "{text}");
    assert_eq!(value(&text, &series(1)), Some(2.0));
}

#[test]
fn gpu_and_rapl_samples_become_gauges_and_energy_totals() {
    let (f, registry) = families();
    let mut m = MachineMetrics::new(f, labels(Some(5)));
    for (ts_ns, energy_j) in [(0, 0.0), (1_000_000_000, 150.0)] {
        m.gpu_sample(&GpuSampleRow {
            gpu: 1,
            ts_ns,
            utilization_gpu_pct: Some(40.0),
            memory_used_mib: Some(2.0),
            power_w: Some(150.0),
            energy_j: Some(energy_j),
            temperature_gpu_c: None,
            ..Default::default()
        });
        m.rapl_sample(&[RaplSampleRow { ts_ns, domain: "package", energy_j: energy_j / 3.0 }]);
    }
    let text = scrape(&registry);
    // The machine's series carry no rank.
    let gpu = r#"{job="trainer",host="node1",gpu="1"}"#;
    assert_eq!(value(&text, &format!("profiler_gpu_utilization_ratio{gpu}")), Some(0.4), "{text}");
    assert_eq!(value(&text, &format!("profiler_gpu_memory_used_bytes{gpu}")), Some(2.0 * 1024.0 * 1024.0));
    assert_eq!(value(&text, &format!("profiler_gpu_power_watts{gpu}")), Some(150.0));
    assert_eq!(value(&text, &format!("profiler_gpu_energy_joules_total{gpu}")), Some(150.0));
    assert!(value(&text, &format!("profiler_gpu_temperature_celsius{gpu}")).is_none(), "never read, never shown");
    let package = r#"{job="trainer",host="node1",domain="package"}"#;
    assert_eq!(value(&text, &format!("profiler_cpu_energy_joules_total{package}")), Some(50.0));
    assert_eq!(value(&text, &format!("profiler_cpu_power_watts{package}")), Some(50.0));
}

#[test]
fn otlp_urls_get_the_metrics_path_and_bad_ones_say_what_to_write() {
    assert_eq!(otlp::parse_url("http://c:4318").as_deref(), Ok("http://c:4318/v1/metrics"));
    assert_eq!(otlp::parse_url("http://c:4318/").as_deref(), Ok("http://c:4318/v1/metrics"));
    assert_eq!(
        otlp::parse_url("http://c:9090/api/v1/otlp/v1/metrics").as_deref(),
        Ok("http://c:9090/api/v1/otlp/v1/metrics")
    );
    for bad in ["c:4318", "https://c:4318", "not a url", "grpc://c:4317"] {
        let e = otlp::parse_url(bad).expect_err(bad);
        assert!(e.contains(bad) && e.contains("http://"), "{e}");
    }
    assert!(parse_interval("0").is_err() && parse_interval("50ms").is_err() && parse_interval("1e9").is_err());
    assert_eq!(parse_interval("1.5"), Ok(std::time::Duration::from_millis(1500)));
    assert_eq!(parse_interval("2s"), Ok(std::time::Duration::from_secs(2)));
}

#[test]
fn the_flags_become_the_config_and_bad_values_are_refused() {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        live: LiveArgs,
    }
    let parse = |args: &[&str]| Flags::try_parse_from([&["profiler"], args].concat()).map(|f| LiveConfig::from(f.live));
    let none = parse(&[]).expect("no flags");
    assert!(none.prometheus.is_none() && none.otlp.is_none(), "nothing is exported unless asked");
    let both =
        parse(&["--prometheus", "127.0.0.1:9464", "--otlp", "http://c:4318", "--otlp-interval", "2s"]).expect("ok");
    assert_eq!(both.prometheus, Some("127.0.0.1:9464".parse().expect("addr")));
    assert_eq!(both.otlp, Some(("http://c:4318/v1/metrics".into(), std::time::Duration::from_secs(2))));
    assert_eq!(
        parse(&["--otlp", "http://c:4318"]).expect("ok").otlp.map(|o| o.1),
        Some(std::time::Duration::from_secs(10))
    );
    for bad in [&["--prometheus", "localhost"][..], &["--prometheus", "1.2.3.4:99999"], &["--otlp", "c:4318"]] {
        let e = parse(bad).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains(bad[1]) && e.contains("e.g."), "{bad:?}: {e}");
    }
}

#[test]
fn gemm_flops_are_counted_and_the_last_steps_rate_follows_its_flops() {
    let (f, registry) = families();
    let mut m = SessionMetrics::new(f, &labels(Some(0)), &["train"]);
    let absent = scrape(&registry);
    assert!(!absent.contains("profiler_gemm_flops_total{"), "no GEMM yet, no series: {absent}");
    m.gemm(2 * 64 * 64 * 64);
    m.gemm(2 * 128 * 128 * 128);
    // Step 0: 1e9 FLOPs in 0.5 s; step 1 (1e9 FLOPs in 0.25 s) ends last.
    let flops = |_: &str, _: u64| Some(FlopsAt { flops: 1_000_000_000, precision: Some(Precision::Bf16) });
    m.steps_ended(&[step_row(0, 0, Some(500_000_000)), step_row(1, 600_000_000, Some(850_000_000))], &flops);
    let text = scrape(&registry);
    let process = r#"{job="trainer",host="node1",rank="0"}"#;
    let total = (2 * 64 * 64 * 64 + 2 * 128 * 128 * 128) as f64;
    assert_eq!(value(&text, &format!("profiler_gemm_flops_total{process}")), Some(total), "{text}");
    let train = r#"{job="trainer",host="node1",rank="0",label="train"}"#;
    assert_eq!(value(&text, &format!("profiler_last_step_gemm_flops_per_second{train}")), Some(4e9));
    assert!(!text.contains("profiler_last_step_mfu_ratio{"), "no GPU peak known, no MFU: {text}");
}

/// The last step's MFU: its FLOPs over its GPUs' peak at its precision × its
/// time; after a step whose precision or GPUs have no known peak, NaN (unknown,
/// which Prometheus keeps and graphs as a gap), not the stale figure.
#[test]
fn the_last_steps_mfu_is_its_flops_over_the_peak_at_its_precision() {
    let (f, registry) = families();
    // Two GPUs of 1 PFLOP/s at BF16, 60 TFLOP/s at FP32; no FP8 figure.
    let peak = |p| match p {
        Precision::Bf16 => Some(2e15),
        Precision::Fp32 => Some(1.2e14),
        _ => None,
    };
    let mut m = SessionMetrics::new(f, &labels(Some(1)), &["train"]).with_peak(Box::new(peak));
    let train = r#"{job="trainer",host="node1",rank="1",label="train"}"#;
    let mfu = |m: &mut SessionMetrics, start: u64, end: u64, flops: u64, precision| {
        let at = move |_: &str, _: u64| Some(FlopsAt { flops, precision });
        m.steps_ended(&[step_row(0, start, Some(end))], &at);
        value(&scrape(&registry), &format!("profiler_last_step_mfu_ratio{train}"))
    };
    // 5e14 FLOPs in 0.5 s at BF16: half of 2 PFLOP/s.
    assert_eq!(mfu(&mut m, 0, 500_000_000, 500_000_000_000_000, Some(Precision::Bf16)), Some(0.5));
    // 3e13 FLOPs in 1 s at FP32: a quarter.
    assert_eq!(mfu(&mut m, 1_000_000_000, 2_000_000_000, 30_000_000_000_000, Some(Precision::Fp32)), Some(0.25));
    // No peak for FP8, nor for unknown types: not the previous step's figure.
    assert!(mfu(&mut m, 2_000_000_000, 3_000_000_000, 1, Some(Precision::Fp8)).is_some_and(f64::is_nan));
    assert_eq!(mfu(&mut m, 3_000_000_000, 4_000_000_000, 4e13 as u64, Some(Precision::Fp32)), Some(1.0 / 3.0));
    assert!(mfu(&mut m, 4_000_000_000, 5_000_000_000, 1, None).is_some_and(f64::is_nan));
}
