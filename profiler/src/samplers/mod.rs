//! Samplers: each on its own thread and timer, sending typed rows to the store
//! over the writer's channel. A sampler never blocks the event path, and a
//! value it cannot read is stored as NULL with the reason recorded once in
//! `capabilities`.
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

use rusqlite::{Connection, Params, Statement};

use crate::store::{Capability, FinishHook, RowSender, StoreMsg};

/// A sampler's periodic work on its own thread. `tick` runs once at start,
/// then every `interval` (on an absolute schedule; missed ticks are skipped,
/// not bunched), and once more when stopped, so that its series covers the
/// whole session.
pub struct SamplerThread {
    stop: Arc<AtomicBool>,
    join: JoinHandle<Option<FinishHook>>,
}

impl SamplerThread {
    /// `tick(now_ns)` samples; `finish()` runs on the sampler thread after the
    /// last tick and may return the hook that computes per-step figures.
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

    /// Stops after one last sample; returns the sampler's finish hook, or,
    /// when the sampler panicked, one line that says so (its series ends at
    /// the panic; the rest of the session is unaffected).
    pub fn stop(self) -> Result<Option<FinishHook>, String> {
        self.stop.store(true, Ordering::Release);
        self.join.thread().unpark();
        // The thread is named `sampler-NAME` (see `spawn`).
        let name = self.join.thread().name().and_then(|n| n.strip_prefix("sampler-")).unwrap_or("?").to_owned();
        self.join.join().map_err(|payload| format!("the {name} sampler panicked: {}", crate::panic_message(&*payload)))
    }
}

/// What a sampler does on its thread.
pub trait Sampler {
    fn tick(&mut self, now_ns: u64);
    /// Called once after the last tick.
    fn finish(&mut self) -> Option<FinishHook> {
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

/// One row of `steps`: the interval a sampler's per-step figures describe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StepSpan {
    pub label: String,
    pub step: i64,
    pub start_ns: u64,
    /// None: the step never ended.
    pub end_ns: Option<u64>,
}

/// Every step of the session, ended or not, ordered by (label, step). Each
/// finish hook writes one row per step; a step that never ended gets its
/// start-side values and NULL for whatever needs the end.
pub(crate) fn step_spans(conn: &Connection, session_id: i64) -> rusqlite::Result<Vec<StepSpan>> {
    conn.prepare("SELECT label, step, start_ns, end_ns FROM steps WHERE session_id = ?1 ORDER BY label, step")?
        .query_map([session_id], |r| {
            Ok(StepSpan {
                label: r.get(0)?,
                step: r.get(1)?,
                start_ns: r.get::<_, i64>(2)? as u64,
                end_ns: r.get::<_, Option<i64>>(3)?.map(|e| e as u64),
            })
        })?
        .collect()
}

/// Sample columns as time series: what [`load_columns`] returns.
pub(crate) struct SampleSeries {
    /// Every row's timestamp, in query order.
    pub ts: Vec<u64>,
    /// One series per value column, (ts_ns, value), its NULLs left out.
    pub columns: Vec<Vec<(u64, f64)>>,
}

/// Runs `stmt` (first column ts_ns, then value columns) and splits the rows
/// into one series per value column.
pub(crate) fn load_columns(stmt: &mut Statement<'_>, params: impl Params) -> rusqlite::Result<SampleSeries> {
    let n = stmt.column_count().saturating_sub(1);
    let mut out = SampleSeries { ts: Vec::new(), columns: vec![Vec::new(); n] };
    let mut rows = stmt.query(params)?;
    while let Some(r) = rows.next()? {
        let ts = r.get::<_, i64>(0)? as u64;
        out.ts.push(ts);
        for (k, series) in out.columns.iter_mut().enumerate() {
            if let Some(v) = r.get::<_, Option<f64>>(k + 1)? {
                series.push((ts, v));
            }
        }
    }
    Ok(out)
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
                step_symbol: None,
                started_ns: 0,
                unix_offset_ns: 0,
                hostname: None,
                kernel_release: None,
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
        let err = t.stop().err().expect("the panic must surface");
        assert_eq!(err, "the gpu sampler panicked: no such device");
        let t = SamplerThread::spawn("system", Duration::from_millis(1), Quiet).expect("spawn");
        assert!(t.stop().is_ok_and(|hook| hook.is_none()));
    }
}
