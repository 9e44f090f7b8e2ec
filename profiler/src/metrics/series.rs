//! One live figure in both exporters at once: a Prometheus family member (an atomic the scrape
//! reads) and, with `--otlp`, the OpenTelemetry instrument its pushes read, with the same labels.
use std::sync::atomic::AtomicU64;

use opentelemetry::{
    KeyValue,
    metrics::{Counter as OtelCounter, Gauge as OtelGauge, Histogram as OtelHistogram, Meter},
};
use prometheus_client::{
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::{Registry, Unit},
};

/// A series' labels, in order: `job`, `host`, `rank` (when known), then `label`, `gpu` or `domain`.
pub type Labels = Vec<(&'static str, String)>;

/// How a metric is named: Prometheus's base name, unit and help, from which both
/// exporters derive theirs (Prometheus's OTLP receiver adds the same unit and `_total` suffixes).
pub struct Spec {
    pub name: &'static str,
    pub help: &'static str,
    /// (Prometheus unit suffix, UCUM unit for OTLP); None for a plain count.
    pub unit: Option<(&'static str, &'static str)>,
}

impl Spec {
    fn register(&self, registry: &mut Registry, metric: impl prometheus_client::registry::Metric) {
        match self.unit {
            Some((prom, _)) => registry.register_with_unit(self.name, self.help, Unit::Other(prom.into()), metric),
            None => registry.register(self.name, self.help, metric),
        }
    }

    fn otel_unit(&self) -> &'static str {
        self.unit.map_or("", |(_, ucum)| ucum)
    }
}

fn attributes(labels: &Labels) -> Vec<KeyValue> {
    labels.iter().map(|(k, v)| KeyValue::new(*k, v.clone())).collect()
}

type F64Counter = Counter<f64, AtomicU64>;
type F64Gauge = Gauge<f64, AtomicU64>;

/// A monotonic total (`_total`).
pub struct CounterFamily {
    prom: Family<Labels, F64Counter>,
    otel: Option<OtelCounter<f64>>,
}

impl CounterFamily {
    pub fn new(spec: &Spec, registry: &mut Registry, meter: Option<&Meter>) -> Self {
        let prom = Family::default();
        spec.register(registry, prom.clone());
        let otel =
            meter.map(|m| m.f64_counter(spec.name).with_unit(spec.otel_unit()).with_description(spec.help).build());
        Self { prom, otel }
    }

    pub fn series(&self, labels: &Labels) -> LiveCounter {
        let prom = self.prom.get_or_create(labels).clone();
        LiveCounter { prom, otel: self.otel.clone().map(|c| (c, attributes(labels))) }
    }
}

pub struct LiveCounter {
    prom: F64Counter,
    otel: Option<(OtelCounter<f64>, Vec<KeyValue>)>,
}

impl LiveCounter {
    pub fn add(&self, v: f64) {
        if v > 0.0 {
            self.prom.inc_by(v);
            if let Some((c, attrs)) = &self.otel {
                c.add(v, attrs);
            }
        }
    }
}

/// A value that goes up and down.
pub struct GaugeFamily {
    prom: Family<Labels, F64Gauge>,
    otel: Option<OtelGauge<f64>>,
}

impl GaugeFamily {
    pub fn new(spec: &Spec, registry: &mut Registry, meter: Option<&Meter>) -> Self {
        let prom = Family::default();
        spec.register(registry, prom.clone());
        let otel =
            meter.map(|m| m.f64_gauge(spec.name).with_unit(spec.otel_unit()).with_description(spec.help).build());
        Self { prom, otel }
    }

    pub fn series(&self, labels: &Labels) -> LiveGauge {
        let prom = self.prom.get_or_create(labels).clone();
        LiveGauge { prom, otel: self.otel.clone().map(|g| (g, attributes(labels))) }
    }
}

pub struct LiveGauge {
    prom: F64Gauge,
    otel: Option<(OtelGauge<f64>, Vec<KeyValue>)>,
}

impl LiveGauge {
    pub fn set(&self, v: f64) {
        self.prom.set(v);
        if let Some((g, attrs)) = &self.otel {
            g.record(v, attrs);
        }
    }
}

/// Bucket bounds of the step-time histogram: 1 ms to about 65 s, doubling.
fn step_buckets() -> Vec<f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 17).collect()
}

type HistogramFamilyOf = Family<Labels, Histogram, fn() -> Histogram>;

/// A distribution (`_bucket`, `_sum`, `_count`).
pub struct HistogramFamily {
    prom: HistogramFamilyOf,
    otel: Option<OtelHistogram<f64>>,
}

impl HistogramFamily {
    pub fn new(spec: &Spec, registry: &mut Registry, meter: Option<&Meter>) -> Self {
        let prom: HistogramFamilyOf = Family::new_with_constructor(|| Histogram::new(step_buckets()));
        spec.register(registry, prom.clone());
        let otel = meter.map(|m| {
            let h = m.f64_histogram(spec.name).with_unit(spec.otel_unit()).with_description(spec.help);
            h.with_boundaries(step_buckets()).build()
        });
        Self { prom, otel }
    }

    pub fn series(&self, labels: &Labels) -> LiveHistogram {
        let prom = self.prom.get_or_create(labels).clone();
        LiveHistogram { prom, otel: self.otel.clone().map(|h| (h, attributes(labels))) }
    }
}

pub struct LiveHistogram {
    prom: Histogram,
    otel: Option<(OtelHistogram<f64>, Vec<KeyValue>)>,
}

impl LiveHistogram {
    pub fn observe(&self, v: f64) {
        self.prom.observe(v);
        if let Some((h, attrs)) = &self.otel {
            h.record(v, attrs);
        }
    }
}
