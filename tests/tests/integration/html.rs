//! `profiler report --html` as a person gets it: pages made from real
//! profiles of the C trainer (stand-in NVML, no RAPL), opened in headless
//! Chromium (Debian's `chromium`), with no console message and no network
//! request; every plot is in the DOM with as many points or bars as the
//! trainer's ground truth and the database say; a screenshot is left in the
//! test's folder. A million-step session's page is measured (its size is a
//! figure; bounded, not timed).
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use integration_tests::*;
use serde_json::Value;

/// Debian's Chromium, if installed.
fn chromium() -> Option<PathBuf> {
    which::which("chromium").or_else(|_| which::which("chromium-browser")).ok()
}

/// Flags for a headless run that reaches nothing but the page: background
/// services off, and every request the browser itself makes sent to a dead
/// local proxy (it tries Google's update and account services regardless).
const QUIET: &[&str] = &[
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--hide-scrollbars",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--no-first-run",
    "--proxy-server=127.0.0.1:9",
    "--proxy-bypass-list=<-loopback>",
];

/// Chromium with [`QUIET`] and its own profile folder, stopped after two minutes.
fn headless(browser: &Path, profile: &Path) -> Command {
    let mut c = Command::new("timeout");
    c.arg("120").arg(browser).args(QUIET).arg(format!("--user-data-dir={}", profile.display()));
    c
}

/// What the browser saw of a page.
struct Loaded {
    dom: String,
    /// Console messages (the page has no script: any is an error).
    console: Vec<String>,
    /// URLs the page itself asked for over the network.
    requests: Vec<String>,
}

fn load(browser: &Path, page: &Path, dir: &Path) -> Loaded {
    let profile = dir.join("chromium-profile");
    let netlog = dir.join("netlog.json");
    let _ = std::fs::remove_dir_all(&profile);
    let out = headless(browser, &profile)
        .args(["--enable-logging=stderr", "--v=0"])
        .arg(format!("--log-net-log={}", netlog.display()))
        .arg("--dump-dom")
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("run chromium");
    assert!(out.status.success(), "chromium failed: {}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let console = stderr.lines().filter(|l| l.contains(":CONSOLE")).map(str::to_owned).collect();
    let log: Value = serde_json::from_slice(&std::fs::read(&netlog).expect("net log")).expect("net log is JSON");
    Loaded { dom: String::from_utf8_lossy(&out.stdout).into_owned(), console, requests: page_requests(&log) }
}

/// The network requests a `file://` page made, from Chromium's NetLog: jobs
/// started for the page's own isolation key (the browser's own requests have
/// another), other than files and inline data.
fn page_requests(log: &Value) -> Vec<String> {
    let start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"].as_i64().expect("event type");
    let events = log["events"].as_array().expect("events");
    events
        .iter()
        .filter(|e| e["type"].as_i64() == Some(start_job))
        .filter(|e| e["params"]["network_isolation_key"].as_str().is_some_and(|k| k.contains("file://")))
        .filter_map(|e| e["params"]["url"].as_str())
        .filter(|u| !u.starts_with("file:") && !u.starts_with("data:"))
        .map(str::to_owned)
        .collect()
}

fn screenshot(browser: &Path, page: &Path, png: &Path) {
    let out = headless(browser, &png.with_extension("profile"))
        .args(["--window-size=1100,6000", &format!("--screenshot={}", png.display())])
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("run chromium");
    assert!(out.status.success() && png.exists(), "no screenshot: {}", String::from_utf8_lossy(&out.stderr));
    println!("screenshot for a person to look at: {}", png.display());
}

/// Loads `page` and checks what every page must be: quiet, offline, each
/// figure an accessible image. Returns the DOM.
fn load_clean(browser: &Path, page: &Path, dir: &Path) -> String {
    let l = load(browser, page, dir);
    assert!(l.console.is_empty(), "console messages: {:#?}", l.console);
    assert!(l.requests.is_empty(), "network requests: {:#?}", l.requests);
    let figures = l.dom.matches("<figure").count();
    assert!(figures > 0, "no figure in the page");
    assert_eq!(l.dom.matches("<svg").count(), figures, "one plot per figure");
    assert_eq!(l.dom.matches("role=\"img\"").count(), figures, "each plot is an image to assistive tech");
    assert_eq!(l.dom.matches("<title id=").count(), figures, "each plot has a title");
    assert_eq!(l.dom.matches("<desc id=").count(), figures, "each plot has a description");
    l.dom
}

/// The markup of figure `id`.
fn figure<'a>(dom: &'a str, id: &str) -> &'a str {
    let start = dom.find(&format!("<figure id=\"{id}\"")).unwrap_or_else(|| panic!("no figure {id}"));
    let len = dom[start..].find("</figure>").expect("figure ends");
    &dom[start..start + len]
}

/// Points of each data line in `fig` (axes and reference lines are thinner),
/// most first.
fn series_points(fig: &str) -> Vec<usize> {
    let mut n: Vec<usize> = fig
        .split("<polyline")
        .skip(1)
        .filter(|p| p.split('>').next().is_some_and(|attrs| attrs.contains("stroke-width=\"2\"")))
        .map(|p| {
            p.split("points=\"").nth(1).and_then(|s| s.split('"').next()).map_or(0, |s| s.split_whitespace().count())
        })
        .collect();
    n.sort_unstable_by(|a, b| b.cmp(a));
    n
}

/// Runs `profiler report DB --html -o PAGE ARGS`; returns the page's path.
fn html(db: &Path, page: &Path, args: &[&str]) -> PathBuf {
    let out = Command::new(profiler_bin())
        .args(["report", &db.display().to_string(), "--html", "-o", &page.display().to_string()])
        .args(args)
        .output()
        .expect("run profiler");
    assert!(out.status.success(), "report --html failed: {}", String::from_utf8_lossy(&out.stderr));
    page.to_owned()
}

fn text(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The checker itself: a page that logs to the console and fetches an image
/// is caught on both counts.
#[test]
fn the_browser_check_catches_console_messages_and_requests() {
    let Some(browser) = chromium() else {
        return skip("Debian's chromium is not installed (.ci/run installs it)");
    };
    let dir = workdir("html-control");
    let page = dir.join("bad.html");
    std::fs::write(
        &page,
        "<!DOCTYPE html><html><body><img src=\"http://127.0.0.1:9/x.png\"><script>console.error('x')</script></body></html>",
    )
    .expect("write");
    let l = load(&browser, &page, &dir);
    assert_eq!(l.requests, ["http://127.0.0.1:9/x.png"]);
    assert!(l.console.iter().any(|c| c.contains("\"x\"")), "{:?}", l.console);
}

#[test]
fn a_session_page_loads_offline_with_every_plot() {
    let dir = workdir("html-session");
    let db = dir.join("p.db");
    let trainer = ["--steps", "20", "--launches", "30", "--step-sleep-us", "3000", "--gap-us", "1000"];
    let truth = profile_into(&dir, &db, &trainer, &["--gpu-interval", "10"]);
    let s = last_session(&db);
    let page = html(&db, &dir.join("session.html"), &["--skip", "3"]);
    let Some(browser) = chromium() else {
        return skip("Debian's chromium is not installed (.ci/run installs it)");
    };
    let dom = load_clean(&browser, &page, &dir);
    let p = format!("s{}", s.id);
    // One point per step the trainer ran; the gap line is drawn dashed.
    assert_eq!(series_points(figure(&dom, &format!("{p}-train-step-time")))[0], truth.steps.len());
    assert_eq!(series_points(figure(&dom, &format!("{p}-train-launches")))[0], truth.steps.len());
    // One bar part per step and GPU with an energy figure, plus the warm-up shade.
    let energy = figure(&dom, &format!("{p}-train-energy"));
    let parts = count(&db, "SELECT count(*) FROM step_gpu WHERE session_id = ?1 AND energy_j IS NOT NULL", s.id);
    assert!(parts >= truth.steps.len() as i64, "{parts} GPU energy figures");
    assert_eq!(energy.matches("<rect").count() as i64, parts + 1);
    // No RAPL here: said so with the recorded reason, never drawn as zeros.
    let why: String = open(&db)
        .query_row("SELECT reason FROM capabilities WHERE session_id = ?1 AND metric = 'cpu_energy'", [s.id], |r| {
            r.get(0)
        })
        .expect("the reason RAPL is missing");
    assert!(dom.contains(&format!("CPU package energy per step: not measured.</strong> {}", text(&why))));
    assert!(!dom.contains(&format!("<figure id=\"{p}-rapl-power\"")));
    // GPU 0's samples, every one (fewer than the downsampling bound).
    let samples = count(
        &db,
        "SELECT count(*) FROM gpu_samples WHERE session_id = ?1 AND gpu = 0 AND utilization_gpu_pct IS NOT NULL",
        s.id,
    );
    assert_eq!(series_points(figure(&dom, &format!("{p}-gpu-util")))[0] as i64, samples);
    let kernels = count(&db, "SELECT min(10, count(DISTINCT function)) FROM launches WHERE session_id = ?1", s.id);
    assert_eq!(figure(&dom, &format!("{p}-top-kernels")).matches("<rect").count() as i64, kernels);
    screenshot(&browser, &page, &dir.join("session.png"));
}

/// Two real runs made one job by setting `sessions.job`/`rank` (as the
/// multi-process agent does), with GEMM rows for one of them.
#[test]
fn a_job_page_shows_ranks_and_flops() {
    let dir = workdir("html-job");
    let db = dir.join("p.db");
    let trainer = ["--steps", "12", "--launches", "5", "--step-sleep-us", "2000"];
    let truth = profile_into(&dir, &db, &trainer, &[]);
    profile_into(&dir, &db, &trainer, &[]);
    let conn = open(&db);
    conn.execute_batch(
        "UPDATE sessions SET job = 'job-a', rank = id - 1, world_size = 2;
         INSERT INTO gemms(session_id, tid, ts_ns, op, m, n, k, batch, flops, label, step)
             SELECT 1, tid, start_ns, 'cublasGemmEx', 64 * (step % 3 + 1), 64, 64, 1, 2 * 64 * (step % 3 + 1) * 64 * 64,
                    label, step FROM steps WHERE session_id = 1;
         UPDATE steps SET flops = (SELECT sum(flops) FROM gemms g WHERE g.session_id = 1 AND g.step = steps.step)
             WHERE session_id = 1;",
    )
    .expect("a job");
    let page = html(&db, &dir.join("job.html"), &["--job", "job-a"]);
    let bad = Command::new(profiler_bin())
        .args(["report", &db.display().to_string(), "--html", "--job", "nope", "-o"])
        .arg(dir.join("nope.html"))
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && err.contains("no job nope;") && err.contains("job-a"), "{err}");
    let Some(browser) = chromium() else {
        return skip("Debian's chromium is not installed (.ci/run installs it)");
    };
    let dom = load_clean(&browser, &page, &dir);
    let n = truth.steps.len();
    assert_eq!(series_points(figure(&dom, "job-train-rank-step-time"))[0], n, "rank 0, one point per step");
    assert_eq!(series_points(figure(&dom, "job-train-spread"))[0], n);
    assert_eq!(figure(&dom, "job-train-slowest").matches("<circle").count(), n, "a dot per step");
    assert_eq!(series_points(figure(&dom, "s1-train-flops"))[0], n);
    assert_eq!(figure(&dom, "s1-top-gemms").matches("<rect").count(), 3, "three GEMM shapes");
    assert!(!dom.contains("id=\"s2-top-gemms\""), "FLOPs only where recorded");
    screenshot(&browser, &page, &dir.join("job.png"));
}

/// A ten-hour session of a million steps and 360 000 GPU samples: the page
/// stays a few MB, every line at most 2000 points. Its size is printed.
#[test]
fn a_million_step_session_stays_a_few_megabytes() {
    const LIMIT_BYTES: u64 = 5_000_000;
    let dir = workdir("html-large");
    let db = dir.join("p.db");
    profile_into(&dir, &db, &["--steps", "3", "--launches", "2", "--step-sleep-us", "20000"], &[]);
    let s = last_session(&db);
    // Steps every 36 ms for 10 h, the step time wandering with a spike every 100 000.
    open(&db)
        .execute_batch(&format!(
            "WITH RECURSIVE i(k) AS (SELECT 0 UNION ALL SELECT k + 1 FROM i WHERE k + 1 < 1000000)
             INSERT INTO steps(session_id, label, step, tid, start_ns, end_ns, duration_ns, inter_step_ns, launches,
                               sync_wait_ns)
                 SELECT {id}, 'long', k, 1, t0 + k * 36000000, t0 + k * 36000000 + d, d, max(36000000 - d, 0), 100 + k % 7, d / 4
                 FROM (SELECT k, 30000000 + (k * 7919) % 1000000 + CASE WHEN k % 100000 = 0 THEN 50000000 ELSE 0 END
                       AS d, (SELECT started_ns FROM sessions WHERE id = {id}) AS t0 FROM i);
             INSERT INTO step_gpu(session_id, label, step, gpu, energy_j, energy_error_j)
                 SELECT {id}, 'long', step, 0, duration_ns / 1e8, 0.01 FROM steps WHERE session_id = {id} AND label = 'long';
             WITH RECURSIVE i(k) AS (SELECT 0 UNION ALL SELECT k + 1 FROM i WHERE k + 1 < 360000)
             INSERT INTO gpu_samples(session_id, gpu, ts_ns, utilization_gpu_pct, memory_used_mib, power_w,
                                     temperature_gpu_c)
                 SELECT {id}, 0, (SELECT started_ns FROM sessions WHERE id = {id}) + k * 100000000, k % 101, 1000 + k % 13, 300 + k % 17, 60 + k % 5 FROM i;",
            id = s.id
        ))
        .expect("a million steps");
    let started = std::time::Instant::now();
    let page = html(&db, &dir.join("large.html"), &["--label", "long"]);
    let took = started.elapsed();
    let size = std::fs::metadata(&page).expect("page").len();
    println!("1M-step, 10 h session: page {:.2} MB, written in {:.1} s", size as f64 / 1e6, took.as_secs_f64());
    assert!(size < LIMIT_BYTES, "page of {size} bytes");
    let html = std::fs::read_to_string(&page).expect("read");
    let longest = series_points(&html)[0];
    assert!((1000..=2000).contains(&longest), "longest line {longest} points");
    // The spikes survive downsampling: the step-time axis reaches 80 ms.
    let ticks: Vec<&str> = figure(&html, &format!("s{}-long-step-time", s.id))
        .split("</text>")
        .filter_map(|t| t.rsplit('>').next().map(str::trim))
        .collect();
    assert!(ticks.contains(&"80"), "the spikes are drawn: the axis reaches 80 ms ({ticks:?})");
    if let Some(browser) = chromium() {
        load_clean(&browser, &page, &dir);
    } else {
        skip("Debian's chromium is not installed: the large page was not opened");
    }
    // 170 MB: not left behind.
    let _ = std::fs::remove_file(&db);
}
