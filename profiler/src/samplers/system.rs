//! System and target-process usage (CPU, RAM, disk) sampled from /proc and
//! statvfs into `system_samples` (the store reads them at each step's end into
//! `step_system`, and its `system_metrics` view gives prov4ml's per-step names).
//!
//! /proc is parsed by procfs; what is here is the arithmetic on its numbers
//! (deltas of tick counters, bytes to GB), kept in pure functions so the
//! tests run it on fixture text.
use std::path::PathBuf;

use procfs::{CpuTime, Current, CurrentSI, KernelStats, Meminfo, process::Process};

use super::{CapabilityLog, Sampler};
pub use crate::store::SystemSampleRow as SystemSample;
use crate::store::{AtFinish, RowSender, StoreMsg};

const GB: f64 = 1e9;

/// All CPUs' busy share, %, between two `/proc/stat` totals. Busy is
/// everything but idle and iowait; guest time is already inside user and is
/// not added again. None when no time passed.
pub fn cpu_usage_pct(prev: &CpuTime, cur: &CpuTime) -> Option<f64> {
    let idle = |c: &CpuTime| c.idle + c.iowait.unwrap_or(0);
    let total = |c: &CpuTime| {
        c.user + c.nice + c.system + idle(c) + c.irq.unwrap_or(0) + c.softirq.unwrap_or(0) + c.steal.unwrap_or(0)
    };
    let dt = total(cur).checked_sub(total(prev)).filter(|&d| d > 0)?;
    // iowait is known to step backwards on some kernels (it is sampled per
    // CPU); a negative idle delta would show more than 100% busy.
    let d_idle = idle(cur).saturating_sub(idle(prev)).min(dt);
    Some(100.0 * (dt - d_idle) as f64 / dt as f64)
}

/// The target's CPU share, % of one CPU, from its utime+stime in clock ticks
/// over `wall_ns`. None when no wall time passed or the counter went back
/// (a different process now has the pid).
pub fn process_cpu_pct(prev_ticks: u64, cur_ticks: u64, ticks_per_second: u64, wall_ns: u64) -> Option<f64> {
    if wall_ns == 0 || ticks_per_second == 0 {
        return None;
    }
    let d = cur_ticks.checked_sub(prev_ticks)?;
    Some(100.0 * (d as f64 / ticks_per_second as f64) / (wall_ns as f64 / 1e9))
}

/// RAM used (GB) and used % from /proc/meminfo: MemTotal − MemAvailable.
/// None without MemAvailable (kernels before 3.14): MemFree would count the
/// page cache as used, and a sum of other fields is a guess.
pub fn ram_usage(meminfo: &Meminfo) -> Option<(f64, f64)> {
    let total = meminfo.mem_total;
    let used = total.checked_sub(meminfo.mem_available?)?;
    (total > 0).then(|| (used as f64 / GB, 100.0 * used as f64 / total as f64))
}

/// Filesystem use from statvfs numbers: used GB, and % as df shows it (of
/// the space unprivileged users can have: used + available, without the
/// root reserve).
pub fn disk_usage(blocks: u64, free: u64, available: u64, fragment_size: u64) -> Option<(f64, f64)> {
    let used = blocks.checked_sub(free)?;
    let usable = used + available;
    (usable > 0).then(|| (used as f64 * fragment_size as f64 / GB, 100.0 * used as f64 / usable as f64))
}

/// Samples /proc and statvfs into `system_samples`; at the end, asks the store for `step_system`.
pub struct SystemSampler {
    pid: i32,
    /// Opened once: a handle on /proc/PID keeps reading this process, not a
    /// later one that reuses the pid.
    process: Option<Process>,
    /// `--disk PATH`; otherwise the target's working directory, looked up each time.
    disk_path: Option<PathBuf>,
    sender: RowSender,
    caps: CapabilityLog,
    ticks_per_second: u64,
    page_size: u64,
    prev_cpu: Option<CpuTime>,
    /// (ts_ns, utime+stime ticks) at the previous sample.
    prev_process: Option<(u64, u64)>,
}

impl SystemSampler {
    pub fn new(pid: u32, disk_path: Option<PathBuf>, sender: RowSender) -> Self {
        let pid = pid as i32;
        let mut caps = CapabilityLog::new(sender.clone(), "system");
        let process = match Process::new(pid) {
            Ok(p) => Some(p),
            Err(e) => {
                let why = format!("cannot open /proc/{pid}: {e}");
                caps.record("process_cpu_pct", false, Some(why.clone()));
                caps.record("process_rss_gb", false, Some(why));
                None
            }
        };
        Self {
            pid,
            process,
            disk_path,
            sender,
            caps,
            ticks_per_second: procfs::ticks_per_second(),
            page_size: procfs::page_size(),
            prev_cpu: None,
            prev_process: None,
        }
    }

    /// Reads everything once; `now_ns` is the sample's time and the end of
    /// the rates' interval.
    pub fn sample(&mut self, now_ns: u64) -> SystemSample {
        let mut s = SystemSample { ts_ns: now_ns, ..Default::default() };

        let cpu = KernelStats::current().map(|k| k.total).map_err(|e| format!("/proc/stat: {e}"));
        if let Ok(cur) = &cpu {
            if let Some(prev) = &self.prev_cpu {
                s.cpu_usage_pct = cpu_usage_pct(prev, cur);
                self.caps.record("cpu_usage_pct", true, None);
            }
            self.prev_cpu = Some(cur.clone());
        } else {
            self.caps.note("cpu_usage_pct", &cpu);
        }

        let ram = Meminfo::current()
            .map_err(|e| format!("/proc/meminfo: {e}"))
            .and_then(|m| ram_usage(&m).ok_or_else(|| "/proc/meminfo has no MemAvailable (kernel < 3.14)".to_owned()));
        self.caps.note("ram_usage_pct", &ram);
        if let Ok((gb, pct)) = ram {
            (s.ram_used_gb, s.ram_usage_pct) = (Some(gb), Some(pct));
        }

        if let Some(p) = &self.process {
            let pid = self.pid;
            let stat = p.stat().map_err(|e| format!("/proc/{pid}/stat: {e}"));
            match &stat {
                Ok(st) => {
                    s.process_rss_gb = Some((st.rss * self.page_size) as f64 / GB);
                    let ticks = st.utime + st.stime;
                    if let Some((t0, prev)) = self.prev_process {
                        s.process_cpu_pct =
                            process_cpu_pct(prev, ticks, self.ticks_per_second, now_ns.saturating_sub(t0));
                        self.caps.record("process_cpu_pct", true, None);
                    }
                    self.prev_process = Some((now_ns, ticks));
                }
                // The target exits before the session ends: NULLs from then on.
                Err(_) => self.prev_process = None,
            }
            self.caps.note("process_rss_gb", &stat);
        }

        let path = match (&self.disk_path, &self.process) {
            (Some(p), _) => Ok(p.clone()),
            (None, Some(p)) => p.cwd().map_err(|e| format!("/proc/{}/cwd: {e}", self.pid)),
            (None, None) => Err(format!("/proc/{} could not be opened, and no --disk PATH", self.pid)),
        };
        let disk = path.and_then(|path| {
            let v = rustix::fs::statvfs(&path).map_err(|e| format!("statvfs {}: {e}", path.display()))?;
            disk_usage(v.f_blocks, v.f_bfree, v.f_bavail, v.f_frsize)
                .ok_or_else(|| format!("{}: a filesystem without blocks", path.display()))
        });
        self.caps.note("disk_usage_pct", &disk);
        if let Ok((gb, pct)) = disk {
            (s.disk_used_gb, s.disk_usage_pct) = (Some(gb), Some(pct));
        }
        s
    }
}

impl Sampler for SystemSampler {
    fn tick(&mut self, now_ns: u64) {
        let row = self.sample(now_ns);
        self.sender.send(StoreMsg::SystemSamples(vec![row]));
    }

    fn finish(&mut self) -> Option<AtFinish> {
        Some(AtFinish::StepSystem)
    }
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::*;
    use crate::samplers::testing::{capabilities, end, open_store, step_row};
    use procfs::{ExplicitSystemInfo, FromRead, FromReadSI, process::Stat};

    const MS: u64 = 1_000_000;

    fn si() -> ExplicitSystemInfo {
        ExplicitSystemInfo {
            boot_time_secs: 1_700_000_000,
            ticks_per_second: 100,
            page_size: 4096,
            is_little_endian: true,
        }
    }

    fn kernel_stats(cpu_line: &str) -> KernelStats {
        let text = format!(
            "{cpu_line}\ncpu0 0 0 0 0 0 0 0 0 0 0\nintr 0\nctxt 100\nbtime 1700000000\nprocesses 10\n\
             procs_running 1\nprocs_blocked 0\nsoftirq 0 0 0 0 0 0 0 0 0 0 0\n"
        );
        KernelStats::from_read(text.as_bytes(), &si()).expect("parse /proc/stat fixture")
    }

    #[test]
    fn cpu_usage_from_proc_stat_deltas() {
        //                user nice system idle iowait irq softirq steal guest guest_nice
        let a = kernel_stats("cpu  1000 50 300 8000 100 10 20 5 400 0");
        let b = kernel_stats("cpu  1150 50 350 8160 140 10 30 5 500 0");
        // busy: user 150 + system 50 + softirq 10 = 210 (guest's 100 is inside user);
        // idle: idle 160 + iowait 40 = 200; total 410.
        let pct = cpu_usage_pct(&a.total, &b.total).expect("interval");
        assert!((pct - 100.0 * 210.0 / 410.0).abs() < 1e-9, "{pct}");
        assert_eq!(cpu_usage_pct(&a.total, &a.total), None, "no time passed");
        // iowait stepping back does not push usage past 100 %.
        let c = kernel_stats("cpu  1150 50 350 8160 90 10 30 5 500 0");
        let d = kernel_stats("cpu  1160 50 350 8160 90 10 30 5 500 0");
        assert_eq!(cpu_usage_pct(&c.total, &d.total), Some(100.0));
    }

    #[test]
    fn process_cpu_counts_every_thread_and_can_exceed_100() {
        let stat = |utime: u64, stime: u64| {
            let text = format!(
                "4242 (python3 train) R 1 4242 4242 0 -1 4194560 900 0 0 0 {utime} {stime} 7 3 20 0 12 0 \
                 500 8000000000 262144 18446744073709551615 1 1 0 0 0 0 0 16781312 17642 0 0 0 17 1 0 0 0 0 0 \
                 0 0 0 0 0 0 0 0"
            );
            Stat::from_read(text.as_bytes()).expect("parse /proc/PID/stat fixture")
        };
        let (a, b) = (stat(1000, 200), stat(1240, 210));
        assert_eq!(b.comm, "python3 train");
        // 250 ticks at 100 Hz = 2.5 CPU-seconds in 1 s of wall time; children's cutime/cstime are not counted.
        let pct = process_cpu_pct(a.utime + a.stime, b.utime + b.stime, 100, 1_000 * MS).expect("rate");
        assert!((pct - 250.0).abs() < 1e-9, "{pct}");
        assert_eq!((b.rss * si().page_size) as f64 / GB, 262144.0 * 4096.0 / 1e9);
        assert_eq!(process_cpu_pct(10, 20, 100, 0), None);
        assert_eq!(process_cpu_pct(20, 10, 100, MS), None, "a counter going back is another process");
    }

    #[test]
    fn ram_used_is_total_minus_available() {
        let text = "MemTotal:       16000000 kB\nMemFree:         2000000 kB\nMemAvailable:   12000000 kB\n\
                    Buffers:          100000 kB\nCached:          9000000 kB\nSwapCached:            0 kB\n\
                    Active:          1 kB\nInactive:        1 kB\nSwapTotal:       0 kB\nSwapFree:        0 kB\n\
                    Dirty:           0 kB\nWriteback:       0 kB\nMapped:          0 kB\nSlab:            0 kB\n\
                    CommitLimit:     0 kB\nCommitted_AS:    0 kB\nVmallocTotal:    0 kB\nVmallocUsed:     0 kB\n\
                    VmallocChunk:    0 kB\n";
        let m = Meminfo::from_read(text.as_bytes()).expect("parse /proc/meminfo fixture");
        let (gb, pct) = ram_usage(&m).expect("MemAvailable present");
        assert!((gb - 4_000_000.0 * 1024.0 / 1e9).abs() < 1e-12, "{gb}");
        assert!((pct - 25.0).abs() < 1e-12, "{pct}");
        let old = text.replace("MemAvailable:   12000000 kB\n", "");
        let m = Meminfo::from_read(old.as_bytes()).expect("parse");
        assert_eq!(ram_usage(&m), None, "no MemAvailable: NULL, not MemFree");
    }

    #[test]
    fn disk_usage_matches_df() {
        // df: 1K-blocks 1000, used 600, avail 350 (50 reserved for root) → Use% 64 (rounded up from 63.2).
        let (gb, pct) = disk_usage(250, 100, 87, 4096).expect("blocks");
        assert!((gb - 150.0 * 4096.0 / 1e9).abs() < 1e-15);
        assert!((pct - 100.0 * 150.0 / 237.0).abs() < 1e-12, "{pct}");
        assert_eq!(disk_usage(0, 0, 0, 4096), None);
    }

    /// /proc/meminfo read by hand, as ground truth independent of procfs.
    fn meminfo_kb(field: &str) -> f64 {
        let text = std::fs::read_to_string("/proc/meminfo").expect("meminfo");
        let line = text.lines().find(|l| l.starts_with(&format!("{field}:"))).expect("field");
        line.split_whitespace().nth(1).expect("value").parse().expect("number")
    }

    fn rusage_cpu_ns() -> u64 {
        let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: RUSAGE_SELF with a valid out-pointer.
        let ru = unsafe {
            libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr());
            ru.assume_init()
        };
        let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
        tv(ru.ru_utime) + tv(ru.ru_stime)
    }

    /// Runs `body` with a sender into a real store; returns the database.
    fn with_store(body: impl FnOnce(RowSender)) -> (tempfile::TempDir, Connection) {
        let db = tempfile::tempdir().expect("tempdir");
        let path = db.path().join("p.db");
        let (store, id) = open_store(&path);
        let writer = store.spawn_writer(id);
        body(writer.sender());
        writer.finish(end(), Vec::new()).expect("finish");
        let conn = Connection::open(&path).expect("reopen");
        (db, conn)
    }

    #[test]
    fn live_sample_agrees_with_what_the_test_reads_itself() {
        let (_db, conn) = with_store(live_sample_checks);
        let caps = capabilities(&conn, "system");
        for m in ["cpu_usage_pct", "process_cpu_pct", "ram_usage_pct", "process_rss_gb", "disk_usage_pct"] {
            assert!(caps.iter().any(|(c, ok, _)| c == m && *ok), "{m} recorded as available: {caps:?}");
        }
    }

    fn live_sample_checks(sender: RowSender) {
        let mut s = SystemSampler::new(std::process::id(), None, sender);
        let t0 = crate::clock::monotonic_ns();
        let cpu0 = rusage_cpu_ns();
        let first = s.sample(t0);
        assert_eq!((first.cpu_usage_pct, first.process_cpu_pct), (None, None), "no interval yet");
        // Burn CPU for 400 ms on this thread.
        let mut x = 0u64;
        while crate::clock::monotonic_ns() - t0 < 400 * MS {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let t1 = crate::clock::monotonic_ns();
        let cpu1 = rusage_cpu_ns();
        let second = s.sample(t1);
        let truth = 100.0 * (cpu1 - cpu0) as f64 / (t1 - t0) as f64;
        let got = second.process_cpu_pct.expect("rate");
        // /proc counts in 10 ms ticks: 2 ticks of slack over 400 ms is 5 %.
        assert!((got - truth).abs() <= 6.0, "process CPU {got}% vs getrusage {truth}%");
        let cpu = second.cpu_usage_pct.expect("system rate");
        let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64;
        assert!(cpu >= 100.0 / ncpu * 0.8 && cpu <= 100.0, "system CPU {cpu}% with one of {ncpu} CPUs busy");

        let total = meminfo_kb("MemTotal") * 1024.0;
        let used = total - meminfo_kb("MemAvailable") * 1024.0;
        let ram = second.ram_used_gb.expect("ram");
        // Other processes allocate meanwhile; 0.5 GB is far below a wrong unit or field.
        assert!((ram - used / 1e9).abs() < 0.5, "RAM {ram} GB vs {} GB", used / 1e9);
        assert!((second.ram_usage_pct.expect("pct") - 100.0 * used / total).abs() < 3.0);

        let status = std::fs::read_to_string("/proc/self/status").expect("status");
        let rss_kb: f64 = status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .expect("VmRSS");
        let rss = second.process_rss_gb.expect("rss");
        assert!((rss - rss_kb * 1024.0 / 1e9).abs() < 0.05, "RSS {rss} GB vs VmRSS {} GB", rss_kb * 1024.0 / 1e9);

        let cwd = std::env::current_dir().expect("cwd");
        let v = rustix::fs::statvfs(&cwd).expect("statvfs");
        let used_gb = (v.f_blocks - v.f_bfree) as f64 * v.f_frsize as f64 / 1e9;
        assert!((second.disk_used_gb.expect("disk") - used_gb).abs() < 0.5, "disk used vs statvfs of the cwd");
        let pct = second.disk_usage_pct.expect("disk pct");
        assert!(pct > 0.0 && pct <= 100.0, "{pct}");
    }

    #[test]
    fn a_missing_target_and_disk_are_null_with_reasons() {
        let (_db, conn) = with_store(|sender| {
            // Pids are below 2^22 on Linux; this one cannot exist.
            let mut s = SystemSampler::new(i32::MAX as u32, None, sender);
            let a = s.sample(0);
            // /proc/stat counts 10 ms ticks: let some pass.
            std::thread::sleep(std::time::Duration::from_millis(50));
            let b = s.sample(50 * MS);
            let target = (b.process_cpu_pct, b.process_rss_gb, b.disk_used_gb, b.disk_usage_pct);
            assert_eq!(target, (None, None, None, None));
            assert!(a.ram_used_gb.is_some() && b.cpu_usage_pct.is_some(), "system values do not depend on the target");
        });
        let caps = capabilities(&conn, "system");
        for m in ["process_cpu_pct", "process_rss_gb", "disk_usage_pct"] {
            let found =
                caps.iter().any(|(x, ok, why)| x == m && !ok && why.as_deref().is_some_and(|w| w.contains("/proc/")));
            assert!(found, "{m}: {caps:?}");
        }
        assert!(caps.iter().any(|(x, ok, _)| x == "ram_usage_pct" && *ok), "{caps:?}");
    }

    #[test]
    fn steps_get_the_values_at_their_end_and_the_view_names_them() {
        let db = tempfile::tempdir().expect("tempdir");
        let path = db.path().join("p.db");
        let (store, id) = open_store(&path);
        let writer = store.spawn_writer(id);
        let sample = |k: u64| SystemSample {
            ts_ns: k * 100 * MS,
            cpu_usage_pct: (k > 0).then_some(10.0 * k as f64),
            process_cpu_pct: (k > 0).then_some(150.0 + k as f64),
            ram_used_gb: Some(1.0 + k as f64),
            ram_usage_pct: Some(5.0 + k as f64),
            process_rss_gb: Some(0.5),
            disk_used_gb: if k == 3 { None } else { Some(100.0) },
            disk_usage_pct: Some(40.0),
        };
        writer.send(StoreMsg::SystemSamples((0..=6).map(sample).collect()));
        let step = |n: u64, start: u64, end: Option<u64>| step_row(n, start * MS, end.map(|e| e * MS));
        // Ends: 250 ms (between samples 2 and 3), 300 ms (on sample 3), never, and 2 s (past the last sample).
        writer.send(StoreMsg::Steps(vec![
            step(0, 10, Some(250)),
            step(1, 250, Some(300)),
            step(2, 300, None),
            step(3, 300, Some(2_000)),
        ]));
        let stats = writer.finish(end(), vec![AtFinish::StepSystem]).expect("finish");
        assert_eq!((stats.failed_rows, stats.first_error), (0, None));

        let conn = Connection::open(&path).expect("reopen");
        type Row = (i64, Option<i64>, Option<f64>, Option<f64>, Option<f64>, Option<f64>);
        let got: Vec<Row> = conn
            .prepare(
                "SELECT step, ts_ns, cpu_usage_pct, process_cpu_pct, ram_used_gb, disk_used_gb
                 FROM step_system WHERE session_id = ?1 AND label = 'train' ORDER BY step",
            )
            .expect("prepare")
            .query_map([id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?)))
            .expect("q")
            .collect::<rusqlite::Result<_>>()
            .expect("rows");
        let ms = |m: i64| Some(m * MS as i64);
        assert_eq!(
            got,
            vec![
                // Rates from sample 3 (its interval 200–300 ms holds 250), levels from sample 2.
                (0, ms(200), Some(30.0), Some(153.0), Some(3.0), Some(100.0)),
                // On a sample: both from it; sample 3's NULL disk falls back to sample 2, within the gap.
                (1, ms(300), Some(30.0), Some(153.0), Some(4.0), Some(100.0)),
                (2, None, None, None, None, None),
                // 1.4 s after the last sample (gap 200 ms): nothing describes that moment.
                (3, None, None, None, None, None),
            ]
        );

        let metrics: Vec<(String, Option<f64>)> = conn
            .prepare("SELECT metric, value FROM system_metrics WHERE session_id = ?1 AND step = 0 ORDER BY metric")
            .expect("prepare")
            .query_map([id], |r| Ok((r.get(0)?, r.get(1)?)))
            .expect("q")
            .collect::<rusqlite::Result<_>>()
            .expect("rows");
        let names: Vec<&str> = metrics.iter().map(|(m, _)| m.as_str()).collect();
        assert_eq!(
            names,
            [
                "cpu_energy",
                "cpu_power",
                "cpu_usage_pct",
                "disk_usage_gb",
                "disk_usage_pct",
                "flops",
                "gpu_energy",
                "gpu_memory_power",
                "gpu_memory_usage_gb",
                "gpu_memory_usage_pct",
                "gpu_power",
                "gpu_temperature_c",
                "gpu_usage_pct",
                "ram_energy",
                "ram_power",
                "ram_usage_gb",
                "ram_usage_pct"
            ]
        );
        let value = |name: &str| metrics.iter().find(|(m, _)| m == name).and_then(|(_, v)| *v);
        assert_eq!(
            (value("cpu_usage_pct"), value("ram_usage_gb"), value("disk_usage_pct")),
            (Some(30.0), Some(3.0), Some(40.0))
        );
        assert_eq!(value("cpu_energy"), None, "no step_energy row: NULL, not absent");
        assert_eq!(value("flops"), None, "no BLAS library probed: NULL");
        conn.execute("UPDATE steps SET flops = 123456789 WHERE session_id = ?1 AND step = 0", [id]).expect("flops");
        let flops: Option<f64> = conn
            .query_row(
                "SELECT value FROM system_metrics WHERE session_id = ?1 AND step = 0 AND metric = 'flops'",
                [id],
                |r| r.get(0),
            )
            .expect("flops row");
        assert_eq!(flops, Some(123456789.0), "steps.flops as prov4ml's `flops`");
    }

    #[test]
    fn step_system_ts_is_exact_past_2_pow_53_ns() {
        let db = tempfile::tempdir().expect("tempdir");
        let path = db.path().join("p.db");
        let (store, id) = open_store(&path);
        let writer = store.spawn_writer(id);
        // An odd nanosecond count above 2^53, which an f64 cannot hold.
        let base = (1u64 << 53) + 1;
        let rows = (0..3).map(|k| SystemSample { ts_ns: base + k * 100 * MS, ..Default::default() }).collect();
        writer.send(StoreMsg::SystemSamples(rows));
        writer.send(StoreMsg::Steps(vec![step_row(0, base, Some(base + 150 * MS))]));
        let stats = writer.finish(end(), vec![AtFinish::StepSystem]).expect("finish");
        assert_eq!((stats.failed_rows, stats.first_error), (0, None));
        let conn = Connection::open(&path).expect("reopen");
        let ts: i64 = conn
            .query_row("SELECT ts_ns FROM step_system WHERE session_id = ?1 AND step = 0", [id], |r| r.get(0))
            .expect("row");
        assert_eq!(ts as u64, base + 100 * MS, "the level sample at or before the end, to the nanosecond");
    }
}
