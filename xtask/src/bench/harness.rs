//! What every benchmark table uses: starting the profiler (or a bare probe)
//! on a target and waiting until it is attached, collecting it with its
//! rusage, the clock the fixtures stamp their steps with, and the median.
use std::{
    io::{BufRead, BufReader},
    os::unix::process::ExitStatusExt,
    path::Path,
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context, Result, bail};

use crate::profiler_bin;

/// CLOCK_MONOTONIC in ns: the clock the fixtures' truth files and the
/// profiler's step rows are in.
pub fn monotonic_ns() -> i64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec * 1_000_000_000 + t.tv_nsec
}

/// The middle value (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Waits for `child` and returns (CPU seconds, peak RSS in KiB).
pub fn wait_rusage(child: &Child) -> Result<(f64, f64)> {
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
pub fn attach_agent(pid: u32, args: &[&str], db: &Path) -> Result<Child> {
    let _ = std::fs::remove_file(db);
    let mut c = Command::new(profiler_bin())
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

/// Waits (up to a minute) until no `profiler` process is left, nor the
/// `profiler-detach` a finished session hands its probes' removal to: it
/// would still be taking them off a window that is meant to be detached.
pub fn wait_until_detached() {
    let t0 = std::time::Instant::now();
    while profiler_running() && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether a `profiler` or `profiler-detach` process is alive.
pub fn profiler_running() -> bool {
    std::fs::read_dir("/proc").into_iter().flatten().flatten().any(|e| {
        std::fs::read_to_string(e.path().join("comm"))
            .is_ok_and(|c| matches!(c.trim_end(), "profiler" | "profiler-detach"))
    })
}

/// `profiler bare-probe PID LIBRARY SYMBOL [--placed]`: an empty program
/// where the profiler would probe, returned once attached. It stays until
/// signalled.
pub fn bare_probe(pid: u32, library: &Path, symbol: &str, placed: bool) -> Result<Child> {
    let mut c = Command::new(profiler_bin());
    c.args(["bare-probe", &pid.to_string()]).arg(library).arg(symbol);
    if placed {
        c.arg("--placed");
    }
    let mut c = c.stdout(Stdio::piped()).spawn().context("start the bare probe")?;
    wait_for_line(c.stdout.take().context("stdout")?, "attached")?;
    Ok(c)
}

/// Reads lines of `stream` until one contains `needle`; the rest is drained
/// in the background so the agent never blocks on a full pipe.
pub fn wait_for_line(stream: impl std::io::Read + Send + 'static, needle: &'static str) -> Result<()> {
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

/// CPU time (user and system, ns) of process `pid` and every process below
/// it, now; processes that end between the reads are left out.
pub fn tree_cpu_ns(pid: u32) -> u64 {
    // SAFETY: sysconf has no preconditions.
    let tick_ns = 1_000_000_000 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let mut total = 0;
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
        // The fields after the command's closing parenthesis: utime is the 12th, stime the 13th.
        let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
        let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        total += (ticks(11) + ticks(12)) * tick_ns;
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else { continue };
        for t in tasks.flatten() {
            let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            todo.extend(children.split_whitespace().filter_map(|c| c.parse::<u32>().ok()));
        }
    }
    total
}
