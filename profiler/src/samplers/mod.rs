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

    /// Stops after one last sample; returns the sampler's finish hook.
    pub fn stop(self) -> Option<FinishHook> {
        self.stop.store(true, Ordering::Release);
        self.join.thread().unpark();
        self.join.join().ok().flatten()
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
        // Called on every tick for every metric: the seen case must not allocate.
        if self.seen.contains(metric) {
            return;
        }
        if self.seen.insert(metric.to_owned()) {
            self.sender.send(StoreMsg::Capability(Capability {
                source: self.source.to_owned(),
                metric: metric.to_owned(),
                available,
                reason,
            }));
        }
    }
}
