//! The session's side of NCCL before the event path: probing `libnccl.so.2`
//! when the target maps it (at attach, or after a late `dlopen`, through
//! the library watcher). The records are the consumer's (`consumer::collectives`).
use std::{collections::HashSet, path::PathBuf};

use crate::{
    probes::{self, Probes, maps, nccl},
    store::{NCCL_KIND as KIND, ProbedFileRow},
};

/// Finds `libnccl.so*` in the target's maps and probes it, once per file.
#[derive(Default)]
pub(super) struct NcclWatch {
    seen: HashSet<PathBuf>,
}

impl NcclWatch {
    pub(super) fn scan(
        &mut self,
        pid: u32,
        probes: &mut Probes,
        target_maps: &procfs::process::MemoryMaps,
        rows: &mut Vec<ProbedFileRow>,
        quiet: bool,
        how: &str,
    ) {
        for f in maps::mapped_files(target_maps).into_iter().filter(|f| nccl::is_libnccl(&f.path)) {
            // A job's other process maps the same file: its file-wide probes serve both.
            if self.seen.insert(f.path.clone()) && probes.first_look(&probes::in_target_root(pid, &f.path)) {
                rows.push(probe(pid, probes, &f.path, quiet, how));
            }
        }
    }
}

/// Probes one NCCL library: a `probed_files` row with its `probes` rows, or
/// one with 0 probes saying why not.
fn probe(pid: u32, probes: &mut Probes, path: &std::path::Path, quiet: bool, how: &str) -> ProbedFileRow {
    let resolved = probes::open_in_target(pid, path)
        .ok_or_else(|| "cannot read it".to_string())
        .and_then(|data| nccl::resolve(&data).map_err(|e| e.to_string()));
    let not_probed = |why: String| {
        eprintln!("profiler: warning: NCCL collectives not recorded: {}: {why}", path.display());
        ProbedFileRow::now(path, KIND, 0, format!("not probed ({how}): {why}"))
    };
    let entries = match resolved {
        Ok(e) if e.is_empty() => return not_probed("exports none of the NCCL entry points".into()),
        Ok(e) => e,
        Err(e) => return not_probed(e),
    };
    match probes.attach_nccl(&probes::in_target_root(pid, path), &entries) {
        Ok(placed) => {
            say!(quiet, "probing {} ({} NCCL entry points)", path.display(), placed.len());
            ProbedFileRow {
                placed: placed.iter().map(|p| (p.symbol.to_string(), p.offset, p.reason.clone())).collect(),
                ..ProbedFileRow::now(path, KIND, placed.len() as u32, how.into())
            }
        }
        Err(e) => not_probed(e.to_string()),
    }
}
