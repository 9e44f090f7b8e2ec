//! Live metrics, compared with the profile's database: a real Prometheus (Debian trixie's 2.53,
//! fetched by `cargo xtask fixtures`) on loopback scrapes `--prometheus` and is read back through
//! its query API; `--otlp` pushes go to an OTLP/HTTP receiver here that decodes them with the
//! OpenTelemetry protobuf types (Debian builds Prometheus with its OTLP receiver disabled).
use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use integration_tests::*;
use opentelemetry_proto::tonic::{
    collector::metrics::v1::ExportMetricsServiceRequest,
    common::v1::{AnyValue, KeyValue, any_value},
    metrics::v1::{metric::Data, number_data_point},
};
use prost::Message;

/// How long the test waits for something that normally takes well under a second.
const PATIENCE: Duration = Duration::from_secs(60);

/// A Prometheus server in a test's folder, killed when dropped.
struct Prometheus {
    child: Child,
    port: u16,
}

impl Prometheus {
    /// The fixture, or None (said as a skip) where `cargo xtask fixtures` could not fetch it.
    fn binary() -> Option<PathBuf> {
        let bin = fixtures().join("prometheus");
        if bin.exists() {
            return Some(bin);
        }
        skip("no Debian trixie prometheus in the fixtures (cargo xtask fixtures fetches it; needs deb.debian.org)");
        None
    }

    /// Starts it scraping 127.0.0.1:`target` every 200 ms.
    fn start(bin: &Path, dir: &Path, target: u16) -> Prometheus {
        let port = free_port();
        // `honor_labels`: the profiler's own `job` label is the training job's.
        let config = format!(
            "global:\n  scrape_interval: 200ms\n  scrape_timeout: 200ms\nscrape_configs:\n  - job_name: profiler\n    honor_labels: true\n    static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
        );
        let file = dir.join("prometheus.yml");
        std::fs::write(&file, config).expect("write config");
        let child = Command::new(bin)
            .arg(format!("--config.file={}", file.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("prometheus.log")).expect("log file"))
            .spawn()
            .expect("start prometheus");
        let p = Prometheus { child, port };
        p.wait_until("Prometheus ready", || http_get(port, "/-/ready").map(|_| ()));
        p
    }

    /// `query`'s result vector: (labels, value) per series.
    fn query(&self, query: &str) -> Vec<(serde_json::Value, f64)> {
        let Some(body) = http_get_query(self.port, "/api/v1/query", &[("query", query)]) else {
            return Vec::new();
        };
        let v: serde_json::Value = serde_json::from_str(&body).expect("query JSON");
        let result = v["data"]["result"].as_array().cloned().unwrap_or_default();
        result
            .into_iter()
            .map(|r| {
                let value = r["value"][1].as_str().and_then(|s| s.parse().ok()).expect("a sample value");
                (r["metric"].clone(), value)
            })
            .collect()
    }

    /// The one series `query` returns, once it equals `want`; fails with what it has after a minute.
    fn wait_for_value(&self, query: &str, want: f64) -> serde_json::Value {
        let t0 = Instant::now();
        loop {
            let got = self.query(query);
            if let [(labels, v)] = got.as_slice()
                && (v - want).abs() <= 1e-9 * want.abs().max(1.0)
            {
                return labels.clone();
            }
            assert!(t0.elapsed() < PATIENCE, "Prometheus has {got:?} for {query}, not {want}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn wait_until<T>(&self, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        let t0 = Instant::now();
        loop {
            if let Some(v) = f() {
                return v;
            }
            assert!(t0.elapsed() < PATIENCE, "{what}: still not after a minute");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value (the last word) of the first line of the exposition text that starts with `series`.
fn nvml() -> String {
    fixtures().join("libnvidia-ml.so.1").display().to_string()
}

fn hostname(db: &Path, session: i64) -> String {
    open(db).query_row("SELECT hostname FROM sessions WHERE id = ?1", [session], |r| r.get(0)).expect("hostname")
}

fn ended_steps(db: &Path, session: i64) -> f64 {
    count(db, "SELECT COUNT(*) FROM steps WHERE session_id = ?1 AND end_ns IS NOT NULL", session) as f64
}

/// Whether `v` is, within rounding, one of the values `sql` (with the session id) returns.
fn one_of(db: &Path, sql: &str, session: i64, v: f64) -> bool {
    let conn = open(db);
    let mut q = conn.prepare(sql).expect("prepare");
    let values: Vec<f64> = q.query_map([session], |r| r.get(0)).expect("query").map(|r| r.expect("row")).collect();
    values.iter().any(|x| (x - v).abs() <= 1e-6 * x.abs().max(1.0))
}

/// Polls the profiler's endpoint until `metric` of job `trainer` reads the same twice 1.5 s
/// apart (the launch and loss totals are refreshed every second); returns that value.
fn settled(port: u16, metric: &str) -> f64 {
    let t0 = Instant::now();
    let mut last = None;
    loop {
        let now = http_get(port, "/metrics").and_then(|t| exposed(&t, metric, &[("job", "trainer")]));
        if now.is_some() && now == last {
            return now.unwrap_or_default();
        }
        assert!(t0.elapsed() < PATIENCE, "{metric} never settled (last {now:?})");
        last = now;
        std::thread::sleep(Duration::from_millis(1500));
    }
}

#[test]
fn prometheus_scrapes_the_live_step_metrics() {
    let Some(bin) = Prometheus::binary() else { return };
    let dir = workdir("prom_scrape");
    let db = dir.join("p.db");
    let port = free_port();
    let prometheus = Prometheus::start(&bin, &dir, port);
    let trainer =
        Trainer::spawn(&dir, &["--forever", "--launches", "7", "--step-sleep-us", "2000", "--sync-us", "300"]);
    let addr = format!("127.0.0.1:{port}");
    let nvml = nvml();
    let agent = Agent::attach(
        trainer.pid(),
        &db,
        &["--step-symbol", "train_step", "--nvml-lib", &nvml, "--prometheus", &addr, "--job", "trainer"],
    );
    trainer.go();
    // Some steps, then the trainer stops where it is: the figures stop moving.
    prometheus.wait_until("20 steps exposed", || {
        let text = http_get(port, "/metrics")?;
        exposed(&text, "profiler_steps_total", &[("job", "trainer")]).filter(|n| *n >= 20.0)
    });
    trainer.signal(libc::SIGSTOP);
    let steps = settled(port, "profiler_steps_total");
    let launches = settled(port, "profiler_launches_total");
    let step_labels = prometheus.wait_for_value(r#"profiler_steps_total{job="trainer",label="train"}"#, steps);
    prometheus.wait_for_value(r#"profiler_launches_total{job="trainer"}"#, launches);
    prometheus.wait_for_value(r#"profiler_step_duration_seconds_count{job="trainer"}"#, steps);
    let step_seconds = prometheus.query(r#"profiler_step_duration_seconds_sum{job="trainer"}"#);
    let sync_seconds = prometheus.query(r#"profiler_step_sync_wait_seconds_total{job="trainer"}"#);
    let power = prometheus.query(r#"profiler_gpu_power_watts{job="trainer",gpu="0"}"#);
    let energy = prometheus.query(r#"profiler_gpu_energy_joules_total{job="trainer",gpu="0"}"#);
    let lost = prometheus.query(r#"profiler_lost_events_total{job="trainer"}"#);
    agent.signal(libc::SIGINT);
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    drop(trainer);

    let s = last_session(&db);
    assert_eq!(steps, ended_steps(&db, s.id), "steps: Prometheus vs the database");
    assert_eq!(launches, s.total_launches.expect("total launches") as f64, "launches: Prometheus vs the database");
    assert_eq!(lost.first().map(|l| l.1), s.lost_events.map(|l| l as f64), "lost events");
    assert_eq!(step_labels["host"].as_str(), Some(hostname(&db, s.id).as_str()), "{step_labels}");
    // Step time and sync wait, summed over the ended steps.
    let sum = |sql: &str| open(&db).query_row(sql, [s.id], |r| r.get::<_, i64>(0)).expect(sql) as f64 / 1e9;
    let db_step = sum("SELECT SUM(end_ns - start_ns) FROM steps WHERE session_id = ?1 AND end_ns IS NOT NULL");
    let db_sync = sum("SELECT SUM(sync_wait_ns) FROM steps WHERE session_id = ?1 AND end_ns IS NOT NULL");
    assert!(db_sync > 0.0, "the trainer waits {} µs a step", 300);
    for (what, got, want) in [("step time", &step_seconds, db_step), ("sync wait", &sync_seconds, db_sync)] {
        let [(_, got)] = got.as_slice() else { panic!("one {what} series: {got:?}") };
        assert!((got - want).abs() <= 1e-9 * want, "{what}: Prometheus {got} s vs the database {want} s");
    }
    // The GPU figures are samples the database holds too.
    let [(_, power)] = power.as_slice() else { panic!("one GPU 0 power series: {power:?}") };
    let [(_, energy)] = energy.as_slice() else { panic!("one GPU 0 energy series: {energy:?}") };
    assert!(one_of(&db, "SELECT power_w FROM gpu_samples WHERE session_id = ?1 AND gpu = 0", s.id, *power));
    assert!(one_of(&db, "SELECT energy_j FROM gpu_samples WHERE session_id = ?1 AND gpu = 0", s.id, *energy));
}

/// An OTLP/HTTP receiver on loopback: every request's body, decoded, in arrival order.
struct OtlpReceiver {
    port: u16,
    requests: Arc<Mutex<Vec<ExportMetricsServiceRequest>>>,
}

impl OtlpReceiver {
    fn start() -> OtlpReceiver {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let sink = requests.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                if let Some(body) = read_post(&stream) {
                    let request =
                        ExportMetricsServiceRequest::decode(body.as_slice()).expect("an OTLP metrics request");
                    sink.lock().expect("lock").push(request);
                }
                let mut stream = stream;
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            }
        });
        OtlpReceiver { port, requests }
    }

    fn last(&self) -> ExportMetricsServiceRequest {
        self.requests.lock().expect("lock").last().cloned().expect("at least one push")
    }
}

/// The body of one HTTP POST to /v1/metrics (Content-Length framed).
fn read_post(stream: &TcpStream) -> Option<Vec<u8>> {
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    assert!(line.starts_with("POST /v1/metrics "), "unexpected request: {line}");
    let mut length = 0;
    loop {
        line.clear();
        r.read_line(&mut line).ok()?;
        if line.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            length = v.trim().parse().ok()?;
        }
    }
    let mut body = vec![0; length];
    r.read_exact(&mut body).ok()?;
    Some(body)
}

fn text(v: &Option<AnyValue>) -> Option<String> {
    match v.as_ref()?.value.as_ref()? {
        any_value::Value::StringValue(s) => Some(s.clone()),
        any_value::Value::IntValue(i) => Some(i.to_string()),
        _ => None,
    }
}

fn attribute(attrs: &[KeyValue], key: &str) -> Option<String> {
    attrs.iter().find(|a| a.key == key).and_then(|a| text(&a.value))
}

/// (value, unit) of the data point of `metric` whose attributes include `with`: a sum's or
/// gauge's value, a histogram's count.
fn pushed(req: &ExportMetricsServiceRequest, metric: &str, with: (&str, &str)) -> Option<(f64, String)> {
    let m = req
        .resource_metrics
        .iter()
        .flat_map(|r| &r.scope_metrics)
        .flat_map(|s| &s.metrics)
        .find(|m| m.name == metric)?;
    let matches = |attrs: &[KeyValue]| attribute(attrs, with.0).as_deref() == Some(with.1);
    let number = |p: &opentelemetry_proto::tonic::metrics::v1::NumberDataPoint| match p.value? {
        number_data_point::Value::AsDouble(v) => Some(v),
        number_data_point::Value::AsInt(v) => Some(v as f64),
    };
    let value = match m.data.as_ref()? {
        Data::Sum(s) => s.data_points.iter().find(|p| matches(&p.attributes)).and_then(number),
        Data::Gauge(g) => g.data_points.iter().find(|p| matches(&p.attributes)).and_then(number),
        Data::Histogram(h) => h.data_points.iter().find(|p| matches(&p.attributes)).map(|p| p.count as f64),
        _ => None,
    }?;
    Some((value, m.unit.clone()))
}

#[test]
fn otlp_pushes_carry_the_profile_s_figures() {
    let dir = workdir("otlp_push");
    let db = dir.join("p.db");
    let receiver = OtlpReceiver::start();
    let mut trainer = Trainer::spawn(&dir, &["--steps", "40", "--launches", "5", "--step-sleep-us", "20000"]);
    let url = format!("http://127.0.0.1:{}", receiver.port);
    let nvml = nvml();
    let agent = Agent::attach(
        trainer.pid(),
        &db,
        &[
            "--step-symbol",
            "train_step",
            "--nvml-lib",
            &nvml,
            "--otlp",
            &url,
            "--otlp-interval",
            "500ms",
            "--job",
            "trainer",
        ],
    );
    trainer.go();
    assert!(trainer.wait().success());
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    assert!(!stderr.contains("OTLP push"), "pushes to a live receiver never fail: {stderr}");

    // The last push, at the session's end, carries the final figures.
    let truth = trainer.truth();
    let s = last_session(&db);
    let job: String = open(&db).query_row("SELECT job FROM sessions WHERE id = ?1", [s.id], |r| r.get(0)).expect("job");
    assert_eq!(job, "trainer", "the series' job is the session's");
    let steps = truth.steps.len() as f64;
    assert_eq!(ended_steps(&db, s.id), steps);
    let last = receiver.last();
    let resource = last.resource_metrics[0].resource.clone().expect("a resource").attributes;
    assert_eq!(attribute(&resource, "service.name").as_deref(), Some("trainer"), "{resource:?}");
    assert_eq!(attribute(&resource, "host.name"), Some(hostname(&db, s.id)), "{resource:?}");
    let train = ("label", "train");
    assert_eq!(pushed(&last, "profiler_steps", train), Some((steps, String::new())));
    assert_eq!(pushed(&last, "profiler_step_duration", train), Some((steps, "s".into())));
    let launches = s.total_launches.expect("launches") as f64;
    assert_eq!(pushed(&last, "profiler_launches", ("job", "trainer")), Some((launches, String::new())));
    let (energy, unit) = pushed(&last, "profiler_gpu_energy", ("gpu", "0")).expect("GPU 0 energy pushed");
    assert_eq!(unit, "J");
    assert!(one_of(&db, "SELECT energy_j FROM gpu_samples WHERE session_id = ?1 AND gpu = 0", s.id, energy));
}

#[test]
fn a_collector_that_refuses_connections_costs_one_warning_not_the_profile() {
    let dir = workdir("otlp_refused");
    let db = dir.join("p.db");
    let url = format!("http://127.0.0.1:{}", free_port());
    let mut trainer = Trainer::spawn(&dir, &["--steps", "30", "--launches", "3", "--step-sleep-us", "30000"]);
    let agent = Agent::attach(
        trainer.pid(),
        &db,
        &["--step-symbol", "train_step", "--no-gpu", "--otlp", &url, "--otlp-interval", "200ms"],
    );
    trainer.go();
    assert!(trainer.wait().success());
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("OTLP push")).collect();
    assert_eq!(warnings.len(), 1, "one warning for a whole session of failed pushes: {stderr}");
    assert!(warnings[0].contains(&url), "{}", warnings[0]);
    let s = last_session(&db);
    assert_steps_match(&trainer.truth().steps, &steps(&db, s.id), STEP_TOLERANCE_NS);
}

#[test]
fn a_prometheus_address_in_use_is_one_error_line() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let dir = workdir("prom_in_use");
    let db = dir.join("p.db").display().to_string();
    let (code, stderr) = profiler_output(&["run", "-o", &db, "--no-gpu", "--prometheus", &addr, "--", "/bin/true"]);
    one_error_line(code, &stderr, &addr);
}
