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

/// How long a library whose probes failed waits before it is tried again.
const RETRY_FAILED: Duration = Duration::from_secs(10);

/// Finds CUDA libraries in the target's maps and probes the new ones.
pub(super) struct LibraryWatcher {
    pid: u32,
    /// Target-visible paths already handled.
    pub seen: HashSet<PathBuf>,
    /// Whether the dynamic loader's hook is probed (see `attach::attach_all`).
    pub loader_hooked: bool,
    /// Paths whose probes failed (reported once, see `not_probed`), and when they were last tried.
    failed: HashMap<PathBuf, Instant>,
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
        // what attached (≈90 ms a probe), on the loop that drains the rings:
        // not at every look.
        let due: Vec<PathBuf> =
            self.failed.iter().filter(|(_, at)| at.elapsed() >= RETRY_FAILED).map(|(p, _)| p.clone()).collect();
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
                // Nothing of it stays probed (all or nothing); a look after
                // RETRY_FAILED tries again (see the top of this function).
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
        if self.failed.insert(path.to_owned(), Instant::now()).is_some() {
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
        log::warn!("could not probe {} (tried again at each look for new libraries): {why}", path.display());
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
