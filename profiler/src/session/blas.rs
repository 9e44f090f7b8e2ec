//! Probing cuBLAS and cuBLASLt when the target maps them (at attach, or after
//! a lazy `dlopen`, as PyTorch does on its first GEMM), once per file.
use std::{collections::HashSet, path::PathBuf};

use crate::{
    probes::{self, Probes, blas, maps},
    store::ProbedFileRow,
};

/// Probes the BLAS libraries among `target_maps` not seen yet; a `libraries`
/// row for each (0 probes and why, when attaching failed).
pub(super) fn scan(
    pid: u32,
    probes: &mut Probes,
    target_maps: &procfs::process::MemoryMaps,
    seen: &mut HashSet<PathBuf>,
    rows: &mut Vec<ProbedFileRow>,
    quiet: bool,
    how: &str,
) {
    let mut new = Vec::new();
    for file in maps::mapped_files(target_maps) {
        let Some(library) = blas::classify(&file.path) else { continue };
        let text = maps::executable_ranges(target_maps, &file);
        // Mid-dlopen (the loader reports before it maps the code): the probes
        // need the code ranges to tell cuBLAS's own calls to cuBLASLt, so
        // the next look, which the loader's next report brings, takes it.
        if text.is_empty() || !seen.insert(file.path.clone()) {
            continue;
        }
        new.push((library, file, text));
    }
    // Every new library's code first: cuBLAS's calls into a cuBLASLt probed
    // before it would otherwise count twice until its own code was added.
    for (_, file, text) in &new {
        if let Err(e) = probes.add_blas_text(pid, text) {
            log::warn!("{}: GEMMs it makes through cuBLASLt may count twice: {e}", file.path.display());
        }
    }
    for (library, file, _) in new {
        let visible = probes::in_target_root(pid, &file.path);
        match probes.attach_blas_library(library, &visible) {
            Ok(None) => {}
            Ok(Some(placed)) => {
                say!(quiet, "probing {} for GEMMs ({} probes)", file.path.display(), placed.len());
                let probes = placed.len() as u32;
                let placed = placed.into_iter().map(|p| (p.symbol.to_string(), p.offset, p.reason)).collect();
                rows.push(ProbedFileRow {
                    placed,
                    ..ProbedFileRow::now(&file.path, library.as_str(), probes, how.into())
                });
            }
            Err(e) => {
                eprintln!("profiler: warning: GEMMs of {} not counted: could not probe it: {e}", file.path.display());
                rows.push(ProbedFileRow::now(&file.path, library.as_str(), 0, format!("not probed ({how}): {e}")));
            }
        }
    }
}
