//! `cargo xtask bench`: what tracing costs the target, and how much the agent
//! sustains. Prints a table; asserts nothing.
//!
//! The synthetic trainer times its own launch loops (CLOCK_MONOTONIC around
//! each step's launches), so "ns per launch" is the host-side cost of one
//! `cuLaunchKernel` call into the stand-in driver, with or without probes.
//! The genuine-library workload calls each of its 8 launch entry points in a
//! timed loop of its own: "ns per launch" is its `cuLaunchKernel` loop, while
//! the launch count, events/s and the agent's CPU % cover all 8 loops, as the
//! profiler traces all of them.
use std::{
    io::{BufRead, BufReader},
    os::unix::process::ExitStatusExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::{fixtures_dir, profiler_bin, say};

const STEPS: u32 = 200;
const LAUNCHES: u32 = 1000;
const REPEATS: usize = 5;
/// Calls per entry point by `genuine_launch`.
const GENUINE_CALLS: u32 = 50_000;

#[derive(Clone, Copy, PartialEq)]
enum Probe {
    None,
    /// An empty program on `cuLaunchKernel`, at its entry or where the
    /// profiler would place its probe.
    Bare {
        placed: bool,
    },
    Profiler {
        count_only: bool,
        at_entry: bool,
    },
}

/// The profiler as it runs by default, and counting launches only.
const ALL: Probe = Probe::Profiler { count_only: false, at_entry: false };
const COUNT: Probe = Probe::Profiler { count_only: true, at_entry: false };

/// A table row: its name, what probes the target, and what the target runs.
type Scenario = (&'static str, Probe, Workload);

/// What runs the launches.
#[derive(Clone, Copy, PartialEq)]
enum Workload {
    /// The synthetic trainer on a stand-in driver (`lib` under the fixtures:
    /// "" for the plain one, "shaped" for the one with the genuine entry shape),
    /// launching through the driver, or with `runtime` through the stand-in
    /// runtime (`libcudart.so.12`, which calls the driver's entry points).
    Trainer { lib: &'static str, runtime: bool, threads: u32, steps: u32, launches: u32 },
    /// The 8 launch entry points of the genuine NVIDIA 535 library, each
    /// called `GENUINE_CALLS` times in a loop of its own (no GPU: they fail fast).
    Genuine,
}

#[derive(Clone, Default)]
struct Measured {
    ns_per_launch: f64,
    /// The 10th percentile over the run's steps (genuine library: its chunks
    /// of `cuLaunchKernel` calls) of their ns per launch: the cost with the
    /// least interference from the rest of this shared host.
    quiet_ns_per_launch: f64,
    launches: u64,
    events_per_s: f64,
    lost: Option<i64>,
    agent_cpu_pct: Option<f64>,
    agent_rss_mib: Option<f64>,
}

struct Truth {
    /// Host time of the timed launches: the trainer's, or `genuine_launch`'s
    /// `cuLaunchKernel` loop.
    launch_ns: u64,
    /// How many calls `launch_ns` covers.
    launch_calls: u64,
    /// Every launch the target made: the trainer's, or `genuine_launch`'s
    /// calls to all its entry points.
    total: u64,
    steps: u64,
    /// The target's busy span: first step start to last step end for the
    /// trainer, the sum of all entry points' loop times for `genuine_launch`.
    span_ns: u64,
    /// ns per launch of each of the trainer's steps, or of each chunk of
    /// `genuine_launch`'s `cuLaunchKernel` calls.
    per_part: Vec<f64>,
}

fn read_truth(path: &Path) -> Result<Truth> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let mut t = Truth { launch_ns: 0, launch_calls: 0, total: 0, steps: 0, span_ns: 0, per_part: Vec::new() };
    let (mut first, mut last) = (u64::MAX, 0u64);
    // `genuine_launch`: one `api NAME COUNT rc RC ns NS` line per entry point.
    let (mut api_calls, mut api_ns) = (0u64, 0u64);
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["step", _, s, e, n] => {
                let (s, e, n): (u64, u64, u64) = (s.parse()?, e.parse()?, n.parse()?);
                t.steps += 1;
                first = first.min(s);
                last = last.max(e);
                if n > 0 {
                    t.per_part.push(e.saturating_sub(s) as f64 / n as f64);
                }
            }
            ["chunk", "cuLaunchKernel", n, "ns", ns] => {
                let (n, ns): (u64, u64) = (n.parse()?, ns.parse()?);
                t.per_part.push(ns as f64 / n.max(1) as f64);
            }
            ["total", n] => t.total = n.parse()?,
            ["api", name, n, "rc", _, "ns", ns] => {
                let (n, ns): (u64, u64) = (n.parse()?, ns.parse()?);
                api_calls += n;
                api_ns += ns;
                if *name == "cuLaunchKernel" {
                    t.launch_calls = n;
                    t.launch_ns = ns;
                }
            }
            ["launch_ns", n] => t.launch_ns = n.parse()?,
            _ => {}
        }
    }
    if api_calls > 0 {
        t.total = api_calls;
        t.span_ns = api_ns;
    } else {
        t.launch_calls = t.total;
        t.span_ns = last.saturating_sub(first);
    }
    Ok(t)
}

/// Waits for `child` and returns (CPU seconds, peak RSS in KiB).
pub(crate) fn wait_rusage(child: &Child) -> Result<(f64, f64)> {
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: zeroed rusage is a valid out-value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waiting on our own child with valid out-pointers.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    if r != pid {
        bail!("wait4: {}", std::io::Error::last_os_error());
    }
    let exit = std::process::ExitStatus::from_raw(status);
    if !exit.success() {
        bail!("agent exited with {exit}");
    }
    let cpu = ru.ru_utime.tv_sec as f64
        + ru.ru_utime.tv_usec as f64 / 1e6
        + ru.ru_stime.tv_sec as f64
        + ru.ru_stime.tv_usec as f64 / 1e6;
    Ok((cpu, ru.ru_maxrss as f64))
}

/// `profiler attach PID ARGS… -o DB`, returned once it says it is tracing.
pub(crate) fn attach_agent(pid: u32, args: &[&str], db: &Path) -> Result<Child> {
    let mut c = Command::new(crate::profiler_bin())
        .arg("attach")
        .arg(pid.to_string())
        .args(args)
        .arg("-o")
        .arg(db)
        .stderr(Stdio::piped())
        .spawn()
        .context("start the profiler")?;
    wait_for_line(c.stderr.take().context("stderr")?, "tracing PID")?;
    Ok(c)
}

/// Reads lines of `stream` until one contains `needle`; the rest is drained
/// in the background so the agent never blocks on a full pipe.
pub(crate) fn wait_for_line(stream: impl std::io::Read + Send + 'static, needle: &'static str) -> Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut seen = false;
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if !seen && line.contains(needle) {
                seen = true;
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(60)).with_context(|| format!("never printed '{needle}'"))
}

fn measure(probe: Probe, workload: Workload, work: &Path) -> Result<Measured> {
    let truth = work.join("truth.txt");
    let go = work.join("go");
    let db = work.join("bench.db");
    for p in [&truth, &go, &db] {
        let _ = std::fs::remove_file(p);
    }
    let (mut target, lib_dir) = start_target(workload, &truth, &go)?;
    let agent = start_agent(probe, workload, &target.id().to_string(), &lib_dir, &db)?;
    std::fs::write(&go, b"")?;
    let status = target.wait()?;
    if !status.success() {
        bail!("target failed: {status}");
    }
    let mut m = Measured::default();
    let mut t = read_truth(&truth)?;
    m.ns_per_launch = t.launch_ns as f64 / t.launch_calls.max(1) as f64;
    t.per_part.sort_by(f64::total_cmp);
    m.quiet_ns_per_launch = t.per_part.get(t.per_part.len() / 10).copied().unwrap_or(m.ns_per_launch);
    m.launches = t.total;
    if let Some(agent) = agent {
        agent_figures(probe, agent, &t, &db, &mut m)?;
    }
    Ok(m)
}

/// Starts the workload, held until `go` exists, writing its truth to `truth`;
/// returns it and the directory of the `libcuda.so.1` it loads.
fn start_target(workload: Workload, truth: &Path, go: &Path) -> Result<(Child, PathBuf)> {
    let fx = fixtures_dir();
    match workload {
        Workload::Trainer { lib, runtime, threads, steps, launches } => {
            let dir = fx.join(lib);
            let mut c = Command::new(fx.join("trainer"));
            c.args(["--steps", &steps.to_string(), "--launches", &launches.to_string()])
                .args(["--threads", &threads.to_string(), "--truth"])
                .arg(truth)
                .arg("--wait-file")
                .arg(go);
            if runtime {
                // The runtime (in the fixtures' top directory) is found after
                // its dlopen: give the agent time to probe it before the timed
                // launches.
                c.args(["--api", "runtime", "--after-dlopen-ms", "300"])
                    .env("LD_LIBRARY_PATH", format!("{}:{}", dir.display(), fx.display()));
            } else {
                c.env("LD_LIBRARY_PATH", &dir);
            }
            Ok((c.spawn().context("start trainer")?, dir))
        }
        Workload::Genuine => {
            let dir = fx.join("nvidia/lib");
            let child = Command::new(fx.join("genuine_launch"))
                .args(["libcuda.so.1", &GENUINE_CALLS.to_string()])
                .arg(truth)
                .arg(go)
                .env("LD_LIBRARY_PATH", &dir)
                .spawn()
                .context("start genuine_launch")?;
            Ok((child, dir))
        }
    }
}

/// Starts what `probe` says on the target `pid`, and waits until it is attached.
fn start_agent(probe: Probe, workload: Workload, pid: &str, lib_dir: &Path, db: &Path) -> Result<Option<Child>> {
    match probe {
        Probe::None => Ok(None),
        Probe::Bare { placed } => {
            let mut c = Command::new(profiler_bin());
            c.args(["bare-probe", pid]).arg(lib_dir.join("libcuda.so.1")).arg("cuLaunchKernel");
            if placed {
                c.arg("--placed");
            }
            let mut c = c.stdout(Stdio::piped()).spawn()?;
            wait_for_line(c.stdout.take().context("stdout")?, "attached")?;
            Ok(Some(c))
        }
        Probe::Profiler { count_only, at_entry } => {
            let mut c = Command::new(profiler_bin());
            c.args(["attach", pid, "--no-gpu", "-o"]).arg(db).stderr(Stdio::piped());
            if matches!(workload, Workload::Trainer { .. }) {
                c.args(["--step-symbol", "train_step"]);
            }
            if count_only {
                c.args(["--launches", "count"]);
            }
            if at_entry {
                c.arg("--probe-at-entry");
            }
            let mut c = c.spawn()?;
            wait_for_line(c.stderr.take().context("stderr")?, "tracing PID")?;
            Ok(Some(c))
        }
    }
}

/// Stops the agent (the profiler stops by itself when the target exits) and,
/// for the profiler, fills in its figures: loss, events/s, CPU and memory.
fn agent_figures(probe: Probe, agent: Child, t: &Truth, db: &Path, m: &mut Measured) -> Result<()> {
    if matches!(probe, Probe::Bare { .. }) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    }
    let waited = Instant::now();
    let (cpu, rss_kib) = wait_rusage(&agent)?;
    if let Probe::Profiler { .. } = probe {
        let conn = rusqlite::Connection::open(db)?;
        let lost: i64 =
            conn.query_row("SELECT lost_events FROM sessions ORDER BY id DESC LIMIT 1", [], |r| r.get(0))?;
        m.lost = Some(lost);
        let events = t.total + 2 * t.steps;
        let span = if t.span_ns > 0 { t.span_ns } else { t.launch_ns };
        m.events_per_s = events as f64 / (span as f64 / 1e9);
        m.agent_cpu_pct = Some(100.0 * cpu / (span as f64 / 1e9 + waited.elapsed().as_secs_f64()));
        m.agent_rss_mib = Some(rss_kib / 1024.0);
    }
    Ok(())
}

/// The run with the median ns per launch, with the median of the runs' quiet
/// ns per launch.
fn median(mut runs: Vec<Measured>) -> Measured {
    runs.sort_by(|a, b| a.quiet_ns_per_launch.total_cmp(&b.quiet_ns_per_launch));
    let quiet = runs[runs.len() / 2].quiet_ns_per_launch;
    runs.sort_by(|a, b| a.ns_per_launch.total_cmp(&b.ns_per_launch));
    Measured { quiet_ns_per_launch: quiet, ..runs[runs.len() / 2].clone() }
}

/// The tables; `only`: `torch`, `frame-hook`, `flops` or `jobs`, that one alone.
pub fn main(only: Option<&str>) -> Result<()> {
    if !crate::root::is_root() {
        bail!(
            "the benchmark loads eBPF programs throughout and needs root: run it as root, e.g. `sudo env \"PATH=$PATH\" cargo xtask bench` (sudo's secure_path hides rustup's cargo)"
        );
    }
    let work: PathBuf = crate::root().join("target/bench");
    std::fs::create_dir_all(&work)?;
    match only {
        Some("torch") => return crate::bench_torch::torch_table(&work),
        Some("frame-hook") => return crate::bench_frame_hook::frame_hook_table(&work),
        Some("flops") => return crate::bench_flops::flops_table(&work),
        Some("jobs") => return crate::bench_jobs::jobs_table(&work),
        Some(other) => bail!("no bench part '{other}' (parts: torch, frame-hook, flops, jobs)"),
        None => {}
    }
    println!();
    println!("Host cost per launch, median of {REPEATS} runs; kernel {}", kernel());
    for (title, scenarios) in launch_sections() {
        let mut results = Vec::new();
        for (name, probe, workload) in scenarios {
            say(format!("bench: {title}: {name}"));
            let runs = (0..REPEATS).map(|_| measure(probe, workload, &work)).collect::<Result<Vec<_>>>()?;
            results.push((name, probe, median(runs)));
        }
        print_launch_section(title, &results);
    }
    print_launch_notes();
    detach_table(&work)?;
    sampler_table(&work)?;
    maps_table(&work)?;
    crate::bench_python::python_table(&work)?;
    crate::bench_torch::torch_table(&work)?;
    crate::bench_frame_hook::frame_hook_table(&work)?;
    crate::bench_flops::flops_table(&work)?;
    crate::bench_jobs::jobs_table(&work)?;
    fuzz_long()
}

/// The launch-cost tables: a title each, and their rows.
fn launch_sections() -> Vec<(&'static str, Vec<Scenario>)> {
    let plain = |threads| Workload::Trainer { lib: "", runtime: false, threads, steps: STEPS, launches: LAUNCHES };
    let shaped =
        |threads, steps, launches| Workload::Trainer { lib: "shaped", runtime: false, threads, steps, launches };
    let runtime = Workload::Trainer { lib: "shaped", runtime: true, threads: 1, steps: STEPS, launches: LAUNCHES };
    vec![
        (
            "stand-in driver, entry `addq $1, counter(%rip)` (RIP-relative: single-stepped, not movable)",
            vec![
                ("(a) untraced", Probe::None, plain(1)),
                ("(b) bare uprobe at entry", Probe::Bare { placed: false }, plain(1)),
                ("(c) profiler, --launches all", ALL, plain(1)),
                ("(c) profiler, --launches count", COUNT, plain(1)),
                ("(c) profiler, all, 2 threads", ALL, plain(2)),
            ],
        ),
        (
            "stand-in with the genuine entry shape (`cmpl $imm, rip; je; jmp *rip`)",
            vec![
                ("(a) untraced", Probe::None, shaped(1, STEPS, LAUNCHES)),
                ("(b) bare uprobe at entry", Probe::Bare { placed: false }, shaped(1, STEPS, LAUNCHES)),
                ("(b') bare uprobe at chosen offset", Probe::Bare { placed: true }, shaped(1, STEPS, LAUNCHES)),
                (
                    "(c) profiler, --probe-at-entry",
                    Probe::Profiler { count_only: false, at_entry: true },
                    shaped(1, STEPS, LAUNCHES),
                ),
                ("(c) profiler, --launches all", ALL, shaped(1, STEPS, LAUNCHES)),
                ("(c) profiler, --launches count", COUNT, shaped(1, STEPS, LAUNCHES)),
                ("(c) profiler, all, 2 threads", ALL, shaped(2, STEPS, LAUNCHES)),
                ("launch-bound step (10 000), untraced", Probe::None, shaped(1, 20, 10_000)),
                ("launch-bound step (10 000), profiler", ALL, shaped(1, 20, 10_000)),
            ],
        ),
        (
            "stand-in runtime: cudaLaunchKernel (stand-in libcudart.so.12) calling cuLaunchKernel (genuine shape): \
             two probes fire, the driver's skipped",
            vec![
                ("(a) untraced", Probe::None, runtime),
                ("(c) profiler, --launches all", ALL, runtime),
                ("(c) profiler, --launches count", COUNT, runtime),
            ],
        ),
        (
            "genuine NVIDIA 535 libcuda.so.1, no GPU: every call returns an error at once \
             (ns / launch: cuLaunchKernel; launches and events/s: all 8 launch entry points)",
            vec![
                ("(a) untraced", Probe::None, Workload::Genuine),
                ("(b) bare uprobe at entry", Probe::Bare { placed: false }, Workload::Genuine),
                ("(b') bare uprobe at chosen offset", Probe::Bare { placed: true }, Workload::Genuine),
                ("(c) profiler, --launches all", ALL, Workload::Genuine),
                ("(c) profiler, --launches count", COUNT, Workload::Genuine),
            ],
        ),
    ]
}

/// Prints one launch-cost table, and the profiler's ratio to the bare uprobe.
fn print_launch_section(title: &str, results: &[(&str, Probe, Measured)]) {
    let opt = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |v| format!("{v:.prec$}"));
    println!();
    println!("{title}");
    println!(
        "| {:<38} | {:>11} | {:>9} | {:>9} | {:>10} | {:>4} | {:>11} | {:>13} |",
        "scenario", "ns / launch", "quiet ns", "launches", "events/s", "lost", "agent CPU %", "agent RSS MiB"
    );
    println!("|{:-<40}|{:->13}|{:->11}|{:->11}|{:->12}|{:->6}|{:->13}|{:->15}|", "", "", "", "", "", "", "", "");
    for (name, _, m) in results {
        println!(
            "| {:<38} | {:>11.0} | {:>9.0} | {:>9} | {:>10} | {:>4} | {:>11} | {:>13} |",
            name,
            m.ns_per_launch,
            m.quiet_ns_per_launch,
            m.launches,
            if m.events_per_s > 0.0 { format!("{:.0}", m.events_per_s) } else { "-".into() },
            m.lost.map_or("-".into(), |l| l.to_string()),
            opt(m.agent_cpu_pct, 1),
            opt(m.agent_rss_mib, 1),
        );
    }
    let find = |p: Probe| results.iter().find(|r| r.1 == p).map(|r| &r.2);
    let floor = find(Probe::Bare { placed: true }).or(find(Probe::Bare { placed: false }));
    if let (Some(floor), Some(a), Some(c)) = (floor, find(ALL), find(COUNT)) {
        println!(
            "ratio profiler ÷ bare uprobe at the profiler's offset: all {:.2}, count {:.2} (quiet: all {:.2}, count {:.2})",
            a.ns_per_launch / floor.ns_per_launch,
            c.ns_per_launch / floor.ns_per_launch,
            a.quiet_ns_per_launch / floor.quiet_ns_per_launch,
            c.quiet_ns_per_launch / floor.quiet_ns_per_launch,
        );
    }
}

/// What the launch-cost tables' columns mean.
fn print_launch_notes() {
    println!();
    println!("ns / launch: over the whole run (the trainer's steps, or genuine_launch's cuLaunchKernel loop);");
    println!("quiet ns: the 10th percentile of ns per launch over the run's steps (genuine: chunks of 1000 calls),");
    println!("the cost with the least interference from the rest of the host; both the median over runs.");
    println!("events/s: launch records plus step entry/return records over the target's busy span");
    println!("(genuine library: the calls to all 8 entry points over the sum of their loops' times);");
    println!("agent CPU %: the agent's CPU time over that span plus its drain-and-flush time after the target exits.");
}

/// Cases per property in the bench's long fuzzing run (the test suite runs 256).
const FUZZ_CASES: &str = "100000";

/// The parsers' property tests (`profiler/src/fuzz_tests.rs`) with many more
/// cases than the test suite gives them, and how long that took.
fn fuzz_long() -> Result<()> {
    say(format!("bench: fuzzing the parsers, {FUZZ_CASES} cases per property"));
    let t0 = std::time::Instant::now();
    crate::run(
        crate::cargo()
            .current_dir(crate::root())
            .args(["test", "--release", "-p", "profiler", "fuzz_", "--", "--test-threads=2"])
            .env("PROFILER_FUZZ_CASES", FUZZ_CASES),
    )?;
    println!();
    println!(
        "Parser fuzzing: {FUZZ_CASES} cases per property, no panic, every invariant held, in {:.0} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// CPU time of the agent's thread named `name`, from its schedstat (ns).
fn thread_cpu_ns(pid: u32, name: &str) -> Option<u64> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim() == name {
            let stat = std::fs::read_to_string(task.path().join("schedstat")).ok()?;
            return stat.split_whitespace().next()?.parse().ok();
        }
    }
    None
}

/// The GPU sampler thread's CPU time per tick (from its schedstat, part way
/// through a window), and the whole agent's CPU %, on an idle target with the
/// stand-in NVML exposing `gpus` GPUs sampled every `interval_ms`.
fn sampler_cost(work: &Path, gpus: u32, interval_ms: u32) -> Result<(f64, f64)> {
    const WINDOW_S: f64 = 3.0;
    let db = work.join("sampler.db");
    let _ = std::fs::remove_file(&db);
    let mut idle = Command::new("sleep").arg("60").spawn()?;
    let mut c = Command::new(profiler_bin());
    c.args(["attach", &idle.id().to_string(), "-q", "--duration", &WINDOW_S.to_string(), "-o"]).arg(&db);
    c.arg("--nvml-lib").arg(fixtures_dir().join("libnvidia-ml.so.1"));
    c.args(["--gpu-interval", &interval_ms.to_string()]).env("STANDIN_NVML_GPUS", gpus.to_string());
    let t0 = Instant::now();
    let agent = c.spawn()?;
    // The sampler's steady state: from 1 s in (NVML opened, probes attached).
    let ns_per_s = thread_cpu_rate(agent.id(), "sampler-gpu", Duration::from_secs(1), Duration::from_millis(1500))?;
    let (cpu, _) = wait_rusage(&agent)?;
    let wall = t0.elapsed().as_secs_f64();
    let _ = idle.kill();
    let _ = idle.wait();
    Ok((ns_per_s / 1e3 * f64::from(interval_ms) / 1e3, 100.0 * cpu / wall))
}

/// CPU ns per second of `pid`'s thread `name`, over `window` from `after` on.
fn thread_cpu_rate(pid: u32, name: &str, after: Duration, window: Duration) -> Result<f64> {
    std::thread::sleep(after);
    let cpu = || thread_cpu_ns(pid, name).with_context(|| format!("no {name} thread in the agent"));
    let (a, t) = (cpu()?, Instant::now());
    std::thread::sleep(window);
    let b = cpu()?;
    Ok((b - a) as f64 / t.elapsed().as_secs_f64())
}

/// The agent's main (drain) thread's CPU time per second, on an idle target
/// that maps `mappings` separate file pages (a PyTorch process maps thousands
/// of regions): what looking for newly loaded CUDA libraries costs.
fn maps_cost(work: &Path, mappings: u32) -> Result<f64> {
    let file = work.join("mapped.bin");
    let script = format!(
        "import mmap,sys,time\n\
         f=open(sys.argv[1],'w+b'); f.truncate(8192*{mappings}); f.flush()\n\
         keep=[mmap.mmap(f.fileno(),4096,offset=8192*i,prot=mmap.PROT_READ) for i in range({mappings})]\n\
         print('ready',flush=True); time.sleep(60)\n"
    );
    let mut target = Command::new("python3").args(["-c", &script]).arg(&file).stdout(Stdio::piped()).spawn()?;
    wait_for_line(target.stdout.take().context("stdout")?, "ready")?;
    let db = work.join("maps.db");
    let _ = std::fs::remove_file(&db);
    let agent = Command::new(profiler_bin())
        .args(["attach", &target.id().to_string(), "--no-gpu", "-q", "--duration", "6", "-o"])
        .arg(&db)
        .spawn()?;
    let per_s = thread_cpu_rate(agent.id(), "profiler", Duration::from_secs(2), Duration::from_secs(3))? / 1e6;
    wait_rusage(&agent)?;
    let _ = target.kill();
    let _ = target.wait();
    let _ = std::fs::remove_file(&file);
    Ok(per_s)
}

fn maps_table(work: &Path) -> Result<()> {
    say("bench: agent drain thread on idle targets with few and many mappings");
    println!();
    println!("Agent drain thread (also the library watcher) on an idle target, CPU ms per s");
    println!("| {:<24} | {:>9} |", "target mappings", "ms / s");
    println!("|{:-<26}|{:->11}|", "", "");
    for n in [100u32, 4000] {
        println!("| {:<24} | {:>9.1} |", n, maps_cost(work, n)?);
    }
    println!("(the maps are read when the dynamic loader's hook reports a dlopen, and every 2 s as a safety net)");
    Ok(())
}

/// One `attach --duration 2` of a trainer launching through the stand-in
/// driver and runtime, with every launch, sync and naming probe and six step
/// functions (51 uprobes): (uprobes, ms the profiler's detach took by its own clock, ms
/// from the end of the 2 s to the profiler's exit, database written).
fn detach_cost(work: &Path) -> Result<(u32, f64, f64)> {
    const DURATION: Duration = Duration::from_secs(2);
    let fx = fixtures_dir();
    let go = work.join("detach-go");
    let db = work.join("detach.db");
    for p in [&go, &db] {
        let _ = std::fs::remove_file(p);
    }
    let mut target = Command::new(fx.join("trainer"))
        .args(["--forever", "--threads", "2", "--launches", "16", "--api", "all", "--sync-us", "1"])
        .args(["--gap-us", "300", "--after-dlopen-ms", "300", "--wait-file"])
        .arg(&go)
        .env("LD_LIBRARY_PATH", &fx)
        .spawn()
        .context("start trainer")?;
    let mut agent = Command::new(profiler_bin())
        .args(["attach", &target.id().to_string(), "--no-gpu", "--duration", "2", "-o"])
        .arg(&db)
        .args(["--step-symbol", "train_step", "--step-symbol", "s1=_Z12saxpy_kernelifPKfPf"])
        .args(["--step-symbol", "s2=_Z12scale_kernelPfi", "--step-symbol", "m=main"])
        .args(["--step-symbol", "o=open_lib", "--step-symbol", "u=usage"])
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()?;
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = agent.stderr.take().context("stderr")?;
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send((Instant::now(), line));
        }
    });
    let mut tracing_at = None;
    let mut detach = None;
    while let Ok((at, line)) = rx.recv_timeout(Duration::from_secs(60)) {
        if line.contains("tracing PID") {
            tracing_at = Some(at);
            std::fs::write(&go, b"")?;
        }
        // "[INFO ] detached 47 uprobes in 83.2 ms"
        if let Some(rest) = line.split("detached ").nth(1) {
            let f: Vec<&str> = rest.split_whitespace().collect();
            if let [n, "uprobes", "in", ms, ..] = f.as_slice() {
                detach = Some((n.parse::<u32>()?, ms.parse::<f64>()?));
            }
        }
        if line.contains("session") && line.contains("ended") {
            break;
        }
    }
    let status = agent.wait()?;
    let exited = Instant::now();
    let _ = target.kill();
    let _ = target.wait();
    if !status.success() {
        bail!("profiler failed: {status}");
    }
    let tracing_at = tracing_at.context("the profiler never said it was tracing")?;
    let (probes, detach_ms) = detach.context("no detach line (RUST_LOG=info)")?;
    let stop_to_exit = exited.saturating_duration_since(tracing_at + DURATION).as_secs_f64() * 1e3;
    Ok((probes, detach_ms, stop_to_exit))
}

fn detach_table(work: &Path) -> Result<()> {
    say("bench: detaching 51 probes (stand-in driver and runtime, six step functions)");
    let mut runs = (0..3).map(|_| detach_cost(work)).collect::<Result<Vec<_>>>()?;
    runs.sort_by(|a, b| a.1.total_cmp(&b.1));
    let (probes, detach_ms, stop_ms) = runs[runs.len() / 2];
    println!();
    println!("Detach, median of 3 runs of `attach --duration 2`");
    println!("| {:<8} | {:>10} | {:>18} |", "uprobes", "detach ms", "stop → exit ms");
    println!("|{:-<10}|{:->12}|{:->20}|", "", "", "");
    println!("| {probes:<8} | {detach_ms:>10.0} | {stop_ms:>18.0} |");
    println!("(detach: closing every uprobe, by the profiler's clock; stop → exit: from the end of --duration to");
    println!("the profiler's exit, the database complete: detach, the last drain and the last transaction)");
    Ok(())
}

fn sampler_table(work: &Path) -> Result<()> {
    say("bench: GPU sampler cost (stand-in NVML, idle target, 3 s windows)");
    println!();
    println!("GPU sampler (stand-in NVML, idle target): sampler-thread CPU per tick, and the whole agent's CPU %");
    println!("| {:<6} | {:>8} | {:>12} | {:>12} |", "GPUs", "rate", "µs per tick", "agent CPU %");
    println!("|{:-<8}|{:->10}|{:->14}|{:->14}|", "", "", "", "");
    for gpus in [1u32, 8] {
        for (hz, ms) in [(10u32, 100u32), (100, 10)] {
            let (per_tick, agent) = sampler_cost(work, gpus, ms)?;
            println!("| {:<6} | {:>5} Hz | {:>12.1} | {:>12.2} |", gpus, hz, per_tick, agent);
        }
    }
    println!("(µs per tick: the sampler thread's own CPU time; writing its rows happens on the store thread.)");
    Ok(())
}

fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_owned()).unwrap_or_default()
}
