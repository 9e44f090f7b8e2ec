//! The `--otlp` pusher: the OpenTelemetry SDK's periodic reader (a thread of its own) exports
//! every interval over OTLP/HTTP protobuf. A collector that is down costs one warning; the reader
//! keeps trying at each interval, quietly, and the session never waits on it.
use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use anyhow::Context;
use opentelemetry::{
    KeyValue,
    metrics::{Meter, MeterProvider as _},
};
use opentelemetry_otlp::{MetricExporter, Protocol, WithExportConfig};
use opentelemetry_sdk::{
    Resource,
    error::OTelSdkResult,
    metrics::{PeriodicReader, SdkMeterProvider, Temporality, data::ResourceMetrics, exporter::PushMetricExporter},
};

use super::SeriesLabels;

/// The longest one push may take (also the longest the last push delays the exit).
const PUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// `--otlp URL`: an http:// URL; with no path, the OTLP/HTTP metrics path `/v1/metrics`.
pub(super) fn parse_url(s: &str) -> Result<String, String> {
    let uri: hyper::Uri = s.parse().map_err(|e| format!("'{s}' is not a URL ({e}); e.g. http://collector:4318"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(format!("'{s}': this build pushes over plain http:// only; use a local collector"));
        }
        _ => return Err(format!("'{s}' needs http:// and a host, e.g. http://collector:4318")),
    }
    if uri.host().is_none() {
        return Err(format!("'{s}' names no host, e.g. http://collector:4318"));
    }
    Ok(match uri.path() {
        "" | "/" => format!("{}/v1/metrics", s.trim_end_matches('/')),
        _ => s.to_owned(),
    })
}

pub(super) struct Pusher {
    provider: SdkMeterProvider,
    meter: Meter,
}

impl Pusher {
    /// The resource says where the figures come from: `service.name` is the
    /// job (Prometheus's OTLP receiver makes it the `job` label), `host.name`,
    /// and the rank when known.
    pub fn start(url: &str, every: Duration, agent: &SeriesLabels) -> anyhow::Result<Self> {
        let exporter = MetricExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(url)
            .with_timeout(PUSH_TIMEOUT)
            .build()
            .with_context(|| format!("cannot set up the OTLP exporter for {url}"))?;
        let exporter = WarnOnce { inner: exporter, url: url.to_owned(), failing: AtomicBool::new(false) };
        let reader = PeriodicReader::builder(exporter).with_interval(every).build();
        let mut attributes = vec![
            KeyValue::new("service.name", agent.job.clone()),
            KeyValue::new("service.instance.id", agent.host.clone()),
            KeyValue::new("host.name", agent.host.clone()),
        ];
        attributes.extend(agent.rank.map(|r| KeyValue::new("rank", i64::from(r))));
        let resource = Resource::builder_empty().with_attributes(attributes).build();
        let provider = SdkMeterProvider::builder().with_resource(resource).with_reader(reader).build();
        let meter = provider.meter("profiler");
        Ok(Self { provider, meter })
    }

    pub fn meter(&self) -> &Meter {
        &self.meter
    }

    /// Pushes the last figures and stops the reader's thread. The blocking
    /// HTTP client must not be dropped on the runtime's thread.
    pub async fn shutdown(self) {
        let provider = self.provider;
        let done = tokio::task::spawn_blocking(move || {
            // A failed last push was already warned about (or is the first, and warned now).
            let _ = provider.shutdown();
            drop(provider);
        });
        let _ = done.await;
    }
}

/// The OTLP exporter, saying once that pushes fail and once that they work again.
struct WarnOnce {
    inner: MetricExporter,
    url: String,
    failing: AtomicBool,
}

impl std::fmt::Debug for WarnOnce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WarnOnce").field("url", &self.url).finish()
    }
}

impl PushMetricExporter for WarnOnce {
    async fn export(&self, metrics: &ResourceMetrics) -> OTelSdkResult {
        let r = self.inner.export(metrics).await;
        match &r {
            Err(e) if !self.failing.swap(true, Ordering::Relaxed) => {
                eprintln!(
                    "profiler: warning: OTLP push to {} failed ({e}); the profile is unaffected, pushes go on quietly",
                    self.url
                );
            }
            Ok(()) if self.failing.swap(false, Ordering::Relaxed) => {
                eprintln!("profiler: OTLP push to {} works again", self.url);
            }
            _ => {}
        }
        r
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn temporality(&self) -> Temporality {
        // Prometheus's OTLP receiver takes cumulative sums only.
        Temporality::Cumulative
    }
}
