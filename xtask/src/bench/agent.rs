//! `cargo xtask bench`, agent part: what the agent's own threads cost on an
//! idle target (the GPU sampler, the drain thread watching many mappings) and
//! how long detaching takes. Prints tables; asserts nothing.
use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use super::harness::{wait_for_line, wait_rusage};
use crate::{fixtures_dir, profiler_bin, say};

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

pub fn maps_table(work: &Path) -> Result<()> {
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

pub fn detach_table(work: &Path) -> Result<()> {
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

pub fn sampler_table(work: &Path) -> Result<()> {
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
