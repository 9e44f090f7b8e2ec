//! The live status line: steps, launch rate, GPU and losses, rewritten in place on stderr once a
//! second while tracing.
use std::time::Instant;

use crate::{probes::KernelCounters, samplers::gpu::GpuLive};

/// The width assumed when stderr's terminal does not say.
const DEFAULT_WIDTH: usize = 100;

/// The live status line: rewritten in place on stderr once a second.
pub(super) struct StatusLine {
    pub enabled: bool,
    gpu: Option<GpuLive>,
    started: Instant,
    /// (when, completed steps, launches) at the last update.
    last: Option<(Instant, u64, u64)>,
    shown: bool,
}

impl StatusLine {
    pub fn new(enabled: bool, gpu: Option<GpuLive>) -> Self {
        Self { enabled, gpu, started: Instant::now(), last: None, shown: false }
    }

    /// Shows `steps` completed so far, the last one's duration, the job's
    /// processes (`ranks`, when it has several) and the kernel side's counters.
    pub fn show(&mut self, steps: u64, last_step_ns: Option<u64>, kc: KernelCounters, ranks: Option<String>) {
        let mut line = self.line(steps, last_step_ns, kc);
        if let Some(r) = ranks
            && let Some(at) = line.find(" | launches")
        {
            line.insert_str(at, &format!(" | {r}"));
        }
        let width = terminal_size::terminal_size_of(std::io::stderr()).map_or(DEFAULT_WIDTH, |(w, _)| usize::from(w.0));
        let line: String = line.chars().take(width.saturating_sub(1)).collect();
        eprint!("\r\x1b[2K{line}");
        self.shown = true;
    }

    fn line(&mut self, steps: u64, last_step_ns: Option<u64>, kc: KernelCounters) -> String {
        let now = Instant::now();
        let (steps_per_s, launches_per_s) = match self.last {
            Some((t, s, l)) => {
                let dt = (now - t).as_secs_f64().max(1e-3);
                ((steps - s) as f64 / dt, kc.launches.saturating_sub(l) as f64 / dt)
            }
            None => (0.0, 0.0),
        };
        self.last = Some((now, steps, kc.launches));
        let mut line = format!(
            "[{:>6.1} s] steps {steps} ({steps_per_s:.1}/s, last {}) | launches {launches_per_s:.0}/s",
            self.started.elapsed().as_secs_f64(),
            last_step_ns.map_or("–".to_string(), |ns| format!("{:.1} ms", ns as f64 / 1e6)),
        );
        if let Some(gpu) = self.gpu.as_ref().and_then(|g| g.lock().ok().map(|v| v.clone())) {
            for (l, util, power) in gpu {
                let f = |v: Option<f64>, unit: &str| v.map_or("–".to_string(), |v| format!("{v:.0}{unit}"));
                line.push_str(&format!(" | GPU{l} {} {}", f(util, "%"), f(power, " W")));
            }
        }
        line.push_str(&format!(" | lost {}", kc.lost));
        line
    }

    pub fn clear(&mut self) {
        if self.shown {
            eprint!("\r\x1b[2K");
            self.shown = false;
        }
    }
}
