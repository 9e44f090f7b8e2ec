//! The session's side of PyTorch's `record_function` regions (#12): which
//! step sources the regions make, probing `libtorch_cpu.so` when the target
//! maps it (now or after a lazy `import torch`), and turning region events
//! into `regions` rows, step boundaries and per-step phases.
use std::{
    collections::HashSet,
    path::{Path, PathBuf},
};

use rusqlite::types::Value;

use super::{Consumer, SessionConfig};
use crate::{
    clock,
    events::{Event, RegionEvent, StepEvent},
    probes::{self, Probes, maps, torch},
    regions::{Boundary, OPTIMIZER_STEP, Region, RegionSteps, RegionTracker},
    steps::DepthChange,
    store::{Insert, LibraryRow, StoreMsg},
};

/// The step a thread was in when a region began.
type StepTag = Option<(&'static str, u64)>;

/// The label of steps made from the optimizer's markers.
const OPTIMIZER_LABEL: &str = "train";

/// Adds the region step sources to the step tracker's labels (their probe
/// ids follow the named sources'), and says where steps will come from.
pub(super) fn step_sources(cfg: &SessionConfig, mut labels: Vec<&'static str>) -> (Vec<&'static str>, RegionSteps) {
    let named = !(cfg.steps.is_empty() && cfg.python_steps.is_empty() && cfg.step_regions.is_empty());
    let mut sources = RegionSteps::default();
    if cfg.step_mode.optimizer_steps(named) {
        sources.optimizer = Some(labels.len() as u32);
        labels.push(OPTIMIZER_LABEL);
    }
    for spec in &cfg.step_regions {
        sources.prefixes.push((labels.len() as u32, spec.prefix.clone()));
        labels.push(Box::leak(spec.label.clone().into_boxed_str()));
    }
    if cfg.step_mode == crate::regions::StepMode::None && !named {
        say!(cfg.quiet, "no steps will be recorded (--steps none); PyTorch regions still are");
    }
    (labels, sources)
}

/// `sessions.step_symbol`: the named sources, then the region ones.
pub(super) fn step_source_text(cfg: &SessionConfig, named: Option<String>, sources: &RegionSteps) -> Option<String> {
    let mut parts: Vec<String> = named.into_iter().collect();
    if sources.optimizer.is_some() {
        parts.push(format!("torch:{OPTIMIZER_STEP}"));
    }
    parts.extend(cfg.step_regions.iter().map(|s| format!("region:{s}")));
    (!parts.is_empty()).then(|| parts.join(" "))
}

/// Finds `libtorch_cpu.so` in the target's maps and probes it, once per file.
#[derive(Default)]
pub(super) struct TorchWatch {
    seen: HashSet<PathBuf>,
    /// Whether steps come from the optimizer's markers (what to say when none is mapped).
    optimizer_steps: bool,
    /// `--steps torch` rather than `auto`.
    forced: bool,
    looked: bool,
}

impl TorchWatch {
    pub(super) fn new(optimizer_steps: bool, forced: bool) -> Self {
        Self { optimizer_steps, forced, ..Default::default() }
    }

    pub(super) fn scan(
        &mut self,
        pid: u32,
        probes: &mut Probes,
        target_maps: &procfs::process::MemoryMaps,
        rows: &mut Vec<LibraryRow>,
        quiet: bool,
        how: &str,
    ) {
        let files: Vec<maps::MappedFile> =
            maps::mapped_files(target_maps).into_iter().filter(|f| torch::is_libtorch_cpu(&f.path)).collect();
        if files.is_empty() && !self.looked && self.optimizer_steps {
            if self.forced {
                say!(quiet, "PID {pid} has not loaded PyTorch (libtorch_cpu.so) yet: waiting for it (--steps torch)");
            } else {
                say!(
                    quiet,
                    "PID {pid} has not loaded PyTorch yet: steps will come from its optimizer markers if it does; \
                     otherwise no steps will be recorded (name them with --step-symbol, --step-python or --step-region)"
                );
            }
        }
        self.looked = true;
        for f in files {
            if self.seen.insert(f.path.clone()) {
                rows.extend(self.probe(pid, probes, &f.path, quiet, how));
            }
        }
    }

    fn probe(&self, pid: u32, probes: &mut Probes, path: &Path, quiet: bool, how: &str) -> Option<LibraryRow> {
        let t0 = std::time::Instant::now();
        let resolved = probes::open_in_target(pid, path)
            .ok_or_else(|| "cannot read it".to_string())
            .and_then(|data| torch::resolve(&data));
        let row = |probes: u32, text: String| LibraryRow {
            path: path.display().to_string(),
            placed: Vec::new(),
            kind: "torch".into(),
            attached_ns: clock::monotonic_ns(),
            probes,
            how: text,
        };
        let syms = match resolved {
            Ok(s) => s,
            Err(e) => {
                eprintln!("profiler: warning: PyTorch regions not recorded: {}: {e}", path.display());
                return Some(row(0, format!("not probed ({how}): {e}")));
            }
        };
        let visible = probes::in_target_root(pid, path);
        match probes.attach_torch(&visible, &syms) {
            Ok(n) => {
                let exit = match syms.exit {
                    Some(o) => format!("record_function_exit_new at {o:#x}"),
                    None => {
                        eprintln!(
                            "profiler: warning: {} has no record_function_exit_new symbol (stripped build): \
                             regions are recorded with no end, and no steps come from them",
                            path.display()
                        );
                        "no record_function_exit_new symbol: enters only".into()
                    }
                };
                if self.optimizer_steps {
                    say!(quiet, "steps from PyTorch's optimizer markers in {} (label train)", path.display());
                }
                log::info!("resolved and probed {} in {:?}", path.display(), t0.elapsed());
                Some(row(n, format!("record_function_enter_new at {:#x}, {exit} ({how})", syms.enter)))
            }
            Err(e) => {
                eprintln!("profiler: warning: could not probe {}: {e}", path.display());
                Some(row(0, format!("not probed ({how}): {e}")))
            }
        }
    }
}

/// Regions in flight and rows not yet sent (a field of the consumer).
pub(super) struct RegionState {
    tracker: RegionTracker<StepTag>,
    rows: Vec<Region<StepTag>>,
    phases: Vec<Vec<Value>>,
    labels: Vec<&'static str>,
}

impl Default for RegionState {
    fn default() -> Self {
        Self::new(RegionSteps::default(), Vec::new())
    }
}

impl RegionState {
    pub(super) fn new(sources: RegionSteps, labels: Vec<&'static str>) -> Self {
        Self { tracker: RegionTracker::new(sources), rows: Vec::new(), phases: Vec::new(), labels }
    }
}

const INSERT_REGION: &str = "INSERT INTO regions(session_id, tid, name, truncated, start_ns, end_ns, label, step)
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)";
const SET_PHASES: &str =
    "UPDATE steps SET data_wait_ns = ?4, optimizer_ns = ?5 WHERE session_id = ?1 AND label = ?2 AND step = ?3";

fn int(v: u64) -> Value {
    Value::Integer(i64::try_from(v).unwrap_or(i64::MAX))
}

impl Consumer {
    pub(super) fn region_event(&mut self, event: RegionEvent, begin: bool) {
        self.sequence(&event.as_step_event(), DepthChange::None);
        let mut boundaries = Vec::new();
        if begin {
            let tag = self.tracker.current_step(event.tid);
            let dropped = self.torch.tracker.begin(&event, tag, &mut boundaries);
            self.torch.rows.extend(dropped);
        } else {
            let ended = self.torch.tracker.end(&event, &mut boundaries);
            self.torch.rows.extend(ended);
        }
        for b in boundaries {
            self.boundary(event.tid, b);
        }
    }

    /// A step boundary from regions goes through the step tracker like a step function's entry or return.
    fn boundary(&mut self, tid: u32, b: Boundary) {
        let step_event =
            |probe, ts_ns, thread_launches| StepEvent { ts_ns, tid, probe, thread_launches, seq: 0, depth: 0 };
        match b {
            Boundary::Enter { probe, ts_ns, thread_launches } => {
                self.take(Ok(Event::StepEnter(step_event(probe, ts_ns, thread_launches))));
            }
            Boundary::Exit { probe, ts_ns, thread_launches, phases } => {
                let before = self.steps.len();
                self.take(Ok(Event::StepExit(step_event(probe, ts_ns, thread_launches))));
                let label = self.torch.labels.get(probe as usize).copied();
                if let (Some(p), Some(s), true) = (phases, self.steps.last(), self.steps.len() > before)
                    && Some(s.label.as_str()) == label
                {
                    let row = vec![Value::Text(s.label.clone()), int(s.step), int(p.data_wait_ns), int(p.optimizer_ns)];
                    self.torch.phases.push(row);
                }
            }
        }
    }

    /// A thread exited: its open regions are stored with no end.
    pub(super) fn regions_thread_exited(&mut self, tid: u32) {
        let open = self.torch.tracker.thread_exited(tid);
        self.torch.rows.extend(open);
    }

    /// The session is over: regions still open are stored with no end.
    pub(super) fn finish_regions(&mut self) {
        let open = self.torch.tracker.open_regions();
        self.torch.rows.extend(open);
        if self.torch.tracker.unmatched_ends > 0 {
            log::info!("{} record_function ends had no begin seen", self.torch.tracker.unmatched_ends);
        }
    }

    /// Sends the region rows and the steps' phases (after the steps they update).
    pub(super) fn flush_regions(&mut self) {
        if !self.torch.rows.is_empty() {
            let rows = std::mem::take(&mut self.torch.rows)
                .into_iter()
                .map(|r| {
                    vec![
                        Value::Integer(r.tid.into()),
                        Value::Text(r.name),
                        Value::Integer(r.truncated.into()),
                        int(r.start_ns),
                        r.end_ns.map_or(Value::Null, int),
                        r.tag.map_or(Value::Null, |(l, _)| Value::Text(l.to_owned())),
                        r.tag.map_or(Value::Null, |(_, s)| int(s)),
                    ]
                })
                .collect();
            self.writer.send(StoreMsg::Insert(Insert { sql: INSERT_REGION, rows }));
        }
        if !self.torch.phases.is_empty() {
            let rows = std::mem::take(&mut self.torch.phases);
            self.writer.send(StoreMsg::Insert(Insert { sql: SET_PHASES, rows }));
        }
    }
}
