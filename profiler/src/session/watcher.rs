//! The library watcher: finds CUDA libraries in the target's maps (at attach, after a dlopen, and
//! on a timer) and probes the new ones, retrying those whose probes failed; and the `libraries` rows.
use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use super::{
    consumer::Consumer,
    jax::JaxWatch,
    nccl::NcclWatch,
    python_frames::{PyCodeReader, PythonStackWatch},
    torch::TorchWatch,
};
use crate::{
    probes::{
        self, Probes,
        maps::{self, LibraryKind},
    },
    store::ProbedFileRow,
};

/// How long a library whose probes failed waits before it is tried again:
/// 1 s after the first failure, twice as long after each next one, and
/// [`RETRY_FAILED_MAX`] at most (a failure that lasts costs a few tries; a
/// passing one, such as the runtime's first attach that failed with ENOENT
/// (issue 35), loses seconds of launches, not ten).
const RETRY_FAILED_FIRST: Duration = Duration::from_secs(1);
const RETRY_FAILED_MAX: Duration = Duration::from_secs(10);

/// A library whose probes failed: when it was last tried, and how many times.
struct Failed {
    at: Instant,
    tries: u32,
}

impl Failed {
    fn due(&self) -> bool {
        let wait = RETRY_FAILED_FIRST.saturating_mul(1 << self.tries.saturating_sub(1).min(4));
        self.at.elapsed() >= wait.min(RETRY_FAILED_MAX)
    }
}

/// Finds CUDA libraries in the target's maps and probes the new ones.
pub(super) struct LibraryWatcher {
    pid: u32,
    /// Target-visible paths already handled.
    pub seen: HashSet<PathBuf>,
    /// Whether the dynamic loader's hook is probed (see `attach::attach_all`).
    pub loader_hooked: bool,
    /// Paths whose probes failed (reported once, see `not_probed`), and when they were last tried.
    failed: HashMap<PathBuf, Failed>,
    /// PyTorch's `libtorch_cpu.so`, probed for its `record_function` regions.
    torch: TorchWatch,
    /// NCCL's `libnccl.so.2`, probed for its collectives.
    nccl: NcclWatch,
    /// jaxlib's `libjax_common.so`, probed for its jitted calls.
    jax: JaxWatch,
    /// The process's CPython, described to the CPU sampler.
    python: PythonStackWatch,
    /// Its code objects' reader, for the consumer (see `hand_over`).
    python_reader: Option<PyCodeReader>,
}

impl LibraryWatcher {
    pub fn new(pid: u32, torch: TorchWatch) -> Self {
        Self {
            pid,
            seen: HashSet::new(),
            loader_hooked: false,
            failed: HashMap::new(),
            torch,
            nccl: NcclWatch::default(),
            jax: JaxWatch::default(),
            python: PythonStackWatch::default(),
            python_reader: None,
        }
    }

    /// In a process's first seconds, at each drain: its CPython, as soon as
    /// its runtime is mapped (its libpython comes with the program, not by a
    /// `dlopen` the loader's hook would report).
    pub fn look_for_python(&mut self, probes: &mut Probes, consumer: &mut Consumer) {
        if !self.python.looking() || !probes.samples_python() {
            return;
        }
        let Ok(maps) = procfs::process::Process::new(self.pid as i32).and_then(|p| p.maps()) else { return };
        if let Some(reader) = self.python.scan(self.pid, probes, &maps) {
            self.python_reader = Some(reader);
        }
        self.hand_over(consumer);
    }

    /// Gives the consumer what the last looks found for it to keep.
    pub fn hand_over(&mut self, consumer: &mut Consumer) {
        if let Some(reader) = self.python_reader.take() {
            consumer.read_python(reader);
        }
    }

    /// Probes new CUDA libraries (their rows say `how` they were found), and
    /// leaves the maps with the consumer, to name runtime launches.
    pub fn scan(&mut self, probes: &mut Probes, consumer: &mut Consumer, quiet: bool, how: &str) {
        let mut rows = Vec::new();
        if let Some(maps) = self.scan_into(probes, &mut rows, quiet, how) {
            consumer.kernels.remember_maps(maps);
        }
        self.hand_over(consumer);
        if let Some(at) = rows.iter().filter(|r| r.kind == "driver" && r.probes > 0).map(|r| r.attached_ns).max() {
            consumer.driver_probed(at);
        }
        consumer.store_libraries(rows);
    }

    /// Probes new CUDA libraries; returns the maps it read.
    pub fn scan_into(
        &mut self,
        probes: &mut Probes,
        rows: &mut Vec<ProbedFileRow>,
        quiet: bool,
        how: &str,
    ) -> Option<procfs::process::MemoryMaps> {
        let maps = procfs::process::Process::new(self.pid as i32).and_then(|p| p.maps()).ok()?;
        // Each try of a failing library maps and parses it and takes back
        // what attached, on the loop that drains the rings: not at every
        // look, and less often the longer it fails (see `Failed::due`).
        let due: Vec<PathBuf> = self.failed.iter().filter(|(_, f)| f.due()).map(|(p, _)| p.clone()).collect();
        for path in due {
            self.seen.remove(&path);
        }
        for (kind, file) in maps::cuda_libraries(&maps) {
            let text = maps::executable_ranges(&maps, &file);
            if kind == LibraryKind::Runtime && text.is_empty() {
                // Mid-dlopen (the loader reports before it maps the code): the
                // driver probes need the runtime's code ranges, so wait for the
                // next look, which the loader's next report brings.
                continue;
            }
            if !self.seen.insert(file.path.clone()) {
                continue;
            }
            let visible = probes::in_target_root(self.pid, &file.path);
            super::attach::pause_for_tests(super::attach::TEST_LIBRARY_PAUSE_ENV, self.pid, "a library's probes");
            match probes.attach_cuda_library(kind, &visible, &text, self.pid) {
                Ok(None) => {}
                Ok(Some(placed)) => {
                    self.failed.remove(&file.path);
                    if placed.is_empty() {
                        log::warn!("{} exports no launch entry point", file.path.display());
                    } else {
                        say!(quiet, "probing {} ({} probes)", file.path.display(), placed.len());
                    }
                    rows.push(library_row(&file.path, kind, placed, how));
                }
                // Nothing of it stays probed (all or nothing); a later look
                // tries again (`Failed::due`, at the top of this function).
                Err(e) => rows.extend(self.not_probed(&file.path, kind, how, &e)),
            }
        }
        self.torch.scan(self.pid, probes, &maps, rows, quiet, how);
        self.nccl.scan(self.pid, probes, &maps, rows, quiet, how);
        self.jax.scan(self.pid, probes, &maps, rows, quiet, how);
        super::blas::scan(self.pid, probes, &maps, &mut self.seen, rows, quiet, how);
        if let Some(reader) = self.python.scan(self.pid, probes, &maps) {
            self.python_reader = Some(reader);
        }
        Some(maps)
    }

    /// A library whose probes could not all attach: a warning and a
    /// `libraries` row (0 probes, and why), the first time only, since every
    /// later look tries it again.
    pub fn not_probed(
        &mut self,
        path: &Path,
        kind: LibraryKind,
        how: &str,
        e: &probes::ProbeError,
    ) -> Option<ProbedFileRow> {
        let tries = self.failed.get(path).map_or(0, |f| f.tries) + 1;
        if self.failed.insert(path.to_owned(), Failed { at: Instant::now(), tries }).is_some() {
            log::debug!("probing {} failed again (try {tries}): {e}", path.display());
            return None;
        }
        // The OS error sits at the end of the chain (aya's says only which syscall failed).
        let mut why = e.to_string();
        let mut source = std::error::Error::source(e);
        while let Some(s) = source {
            let s_text = s.to_string();
            if !why.ends_with(&s_text) {
                why = format!("{why}: {s_text}");
            }
            source = s.source();
        }
        // The path the kernel looks up is the target's (`/proc/PID/root/…`),
        // which is gone with the target: a target that exits while its
        // probes wait in the kernel (behind another session's removal: seen
        // with one link per probe, sessions back to back, issue 35) leaves
        // ENOENT. That is the session's end, not a library to look into.
        if !probes::is_alive(self.pid) {
            log::info!("PID {} exited before {} was probed ({why})", self.pid, path.display());
            let row = format!("not probed ({how}): the target exited first ({why})");
            return Some(ProbedFileRow::now(path, kind.as_str(), 0, row));
        }
        // ENOENT from perf_event_open or a link's creation is the kernel's
        // lookup of the path: say whether the file is there now, which
        // tells a path that is wrong from one that was not there yet.
        if why.contains("os error 2)") {
            let visible = probes::in_target_root(self.pid, path);
            let there = if visible.exists() { "is there now" } else { "is not there now either" };
            why = format!("{why} ({} {there})", visible.display());
        }
        log::warn!("could not probe {} (tried again 1, 2, 4, 8 s later, then every 10 s): {why}", path.display());
        Some(ProbedFileRow::now(path, kind.as_str(), 0, format!("not probed ({how}): {why}")))
    }
}

/// A `libraries` row for a CUDA library's launch probes (with their `probes` rows).
pub(super) fn library_row(
    path: &Path,
    kind: LibraryKind,
    placed: Vec<probes::PlacedProbe>,
    how: &str,
) -> ProbedFileRow {
    ProbedFileRow {
        placed: placed.iter().map(|p| (p.symbol.to_string(), p.offset, p.reason.clone())).collect(),
        ..ProbedFileRow::now(path, kind.as_str(), placed.len() as u32, how.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(tries: u32, ago: Duration) -> Failed {
        Failed { at: Instant::now().checked_sub(ago).expect("the machine has been up longer"), tries }
    }

    #[test]
    fn a_failed_library_is_tried_again_after_1_2_4_8_then_10_seconds() {
        for (tries, wait) in [(1, 1), (2, 2), (3, 4), (4, 8), (5, 10), (9, 10), (u32::MAX, 10)] {
            let wait = Duration::from_secs(wait);
            assert!(!failed(tries, wait - Duration::from_millis(50)).due(), "try {tries} before {wait:?}");
            assert!(failed(tries, wait).due(), "try {tries} at {wait:?}");
        }
    }
}
