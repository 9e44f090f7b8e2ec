//! Samplers: each on its own thread and timer, sending typed rows to the store
//! over the writer's channel. A sampler never blocks the event path, and a
//! value it cannot read is stored as NULL with the reason recorded once in
//! `capabilities`.
pub mod gpm;
pub mod gpu;
pub mod rapl;
pub mod system;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::store::{AtFinish, Capability, RowSender, StoreMsg};

/// A sampler's periodic work on its own thread. `tick` runs once at start,
/// then every `interval` (on an absolute schedule; missed ticks are skipped,
/// not bunched), and once more when stopped, so that its series covers the
/// whole session.
pub struct SamplerThread {
    stop: Arc<AtomicBool>,
    join: JoinHandle<Option<AtFinish>>,
}

impl SamplerThread {
    /// `tick(now_ns)` samples; `finish()` runs on the sampler thread after the
    /// last tick and may say which per-step figures the store derives at the end.
    pub fn spawn<S: Sampler + Send + 'static>(name: &str, interval: Duration, mut sampler: S) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let join = std::thread::Builder::new().name(format!("sampler-{name}")).spawn(move || {
            let start = Instant::now();
            let mut n: u32 = 0;
            loop {
                sampler.tick(crate::clock::monotonic_ns());
                if flag.load(Ordering::Acquire) {
                    break;
                }
                n += 1;
                let mut next = start + interval * n;
                let now = Instant::now();
                if next < now {
                    // Behind (the machine was busy): skip to the next slot.
                    n = ((now - start).as_nanos() / interval.as_nanos().max(1)) as u32 + 1;
                    next = start + interval * n;
                }
                while !flag.load(Ordering::Acquire) {
                    let now = Instant::now();
                    if now >= next {
                        break;
                    }
                    std::thread::park_timeout(next - now);
                }
            }
            sampler.finish()
        })?;
        Ok(Self { stop, join })
    }

    /// Stops after one last sample; returns what the sampler's [`Sampler::finish`] asks for, or,
    /// when the sampler panicked, one line that says so (its series ends at
    /// the panic; the rest of the session is unaffected).
    pub fn stop(self) -> Result<Option<AtFinish>, String> {
        self.stop.store(true, Ordering::Release);
        self.join.thread().unpark();
        // The thread is named `sampler-NAME` (see `spawn`).
        let name = self.join.thread().name().and_then(|n| n.strip_prefix("sampler-")).unwrap_or("?").to_owned();
        self.join.join().map_err(|payload| {
            format!("the {name} sampler panicked: {}", crate::thread_panic::panic_message(&*payload))
        })
    }
}

/// What a sampler does on its thread.
pub trait Sampler {
    fn tick(&mut self, now_ns: u64);
    /// Called once after the last tick: the per-step figures the store is to
    /// derive from this sampler's series, with what only the sampler knows.
    fn finish(&mut self) -> Option<AtFinish> {
        None
    }
}

/// Records, once per (source, metric), why a value is missing (or that it is there).
pub struct CapabilityLog {
    sender: RowSender,
    source: &'static str,
    seen: std::collections::HashSet<String>,
}

impl CapabilityLog {
    pub fn new(sender: RowSender, source: &'static str) -> Self {
        Self { sender, source, seen: Default::default() }
    }

    pub fn record(&mut self, metric: &str, available: bool, reason: Option<String>) {
        self.record_with(metric, available, || reason);
    }

    /// Records whether `r` holds a value; an error is the reason it does not.
    pub fn note<T, E: std::fmt::Display>(&mut self, metric: &str, r: &Result<T, E>) {
        match r {
            Ok(_) => self.record_with(metric, true, || None),
            Err(e) => self.record_with(metric, false, || Some(e.to_string())),
        }
    }

    fn record_with(&mut self, metric: &str, available: bool, reason: impl FnOnce() -> Option<String>) {
        // Called on every tick for every metric: the seen case must not allocate.
        if self.seen.contains(metric) {
            return;
        }
        self.seen.insert(metric.to_owned());
        self.sender.send(StoreMsg::Capability(Capability {
            source: self.source.to_owned(),
            metric: metric.to_owned(),
            available,
            reason: reason(),
        }));
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! Fixtures shared by the samplers' tests.
    use std::path::Path;

    use rusqlite::Connection;

    use crate::store::{SessionEnd, SessionStart, StepRow, Store};

    const MS: u64 = 1_000_000;

    /// Opens a store (the migrations create every sampler's tables) and begins a session.
    pub(crate) fn open_store(path: &Path) -> (Store, i64) {
        let store = Store::open(path).expect("open store");
        let id = store
            .begin_session(&SessionStart {
                pid: 1,
                command: "trainer".into(),
                exe: None,
                mode: "attach",
                launch_mode: "all",
                step_source: None,
                started_ns: 0,
                unix_offset_ns: 0,
                hostname: None,
                kernel_release: None,
                job: "job-1".into(),
                rank: None,
                local_rank: None,
                world_size: None,
                parent_pid: None,
            })
            .expect("session");
        (store, id)
    }

    pub(crate) fn end() -> SessionEnd {
        SessionEnd {
            ended_ns: 10_000 * MS,
            end_reason: "target-exited".into(),
            lost_events: 0,
            total_launches: 0,
            unmatched_returns: 0,
        }
    }

    /// Step `step` of label `train` on thread 1, from `start_ns` to `end_ns` (None: never ended).
    pub(crate) fn step_row(step: u64, start_ns: u64, end_ns: Option<u64>) -> StepRow {
        StepRow {
            sync_wait_ns: None,
            label: "train".into(),
            step,
            tid: 1,
            start_ns,
            end_ns,
            inter_step_ns: None,
            launches: None,
            phases: None,
            sched: None,
            copies: Default::default(),
        }
    }

    /// (metric, available, reason) recorded by `source`, by metric.
    pub(crate) fn capabilities(conn: &Connection, source: &str) -> Vec<(String, bool, Option<String>)> {
        conn.prepare("SELECT metric, available, reason FROM capabilities WHERE source = ?1 ORDER BY metric")
            .expect("prepare")
            .query_map([source], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .expect("q")
            .collect::<rusqlite::Result<_>>()
            .expect("rows")
    }
}

#[cfg(test)]
mod thread_tests {
    use super::*;

    struct Panicking;

    impl Sampler for Panicking {
        fn tick(&mut self, _now_ns: u64) {
            panic!("no such device");
        }
    }

    struct Quiet;

    impl Sampler for Quiet {
        fn tick(&mut self, _now_ns: u64) {}
    }

    #[test]
    fn a_sampler_panic_is_reported_not_swallowed() {
        let t = SamplerThread::spawn("gpu", Duration::from_millis(1), Panicking).expect("spawn");
        let err = t.stop().expect_err("the panic must surface");
        assert_eq!(err, "the gpu sampler panicked: no such device");
        let t = SamplerThread::spawn("system", Duration::from_millis(1), Quiet).expect("spawn");
        assert!(t.stop().is_ok_and(|work| work.is_none()));
    }
}
