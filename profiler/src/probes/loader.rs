//! The dynamic loader's debugger hook: a probe on it makes each `dlopen` and
//! `dlclose` of the target write a `LoaderChange` record, so that libraries
//! loaded later are probed at once.
use std::path::{Path, PathBuf};

use profiler_common::programs;

use super::{ProbeError, ProbeSite, Probes, elf, map_file, open_in_target};

/// The function glibc's and musl's dynamic loaders call before and after each
/// change to the loaded objects, for debuggers (`r_debug.r_brk`).
pub const LOADER_HOOK: &str = "_dl_debug_state";

/// The dynamic loader `exe` (a path in the target's view) runs under, in the
/// target's view; None for a static executable or an unreadable one.
pub fn loader_of(pid: u32, exe: &Path) -> Option<PathBuf> {
    elf::interpreter(&open_in_target(pid, exe)?).ok().flatten()
}

impl Probes {
    /// Probes the dynamic loader at `path` (as the agent sees it) on its
    /// [`LOADER_HOOK`], so that each `dlopen` and `dlclose` of the target
    /// writes a `LoaderChange` record; returns the hook's file offset, or None
    /// when the file does not export it.
    pub fn attach_loader(&mut self, path: &Path) -> Result<Option<u64>, ProbeError> {
        let data = map_file(path).map_err(|source| ProbeError::Read { path: path.to_owned(), source })?;
        let symbols =
            elf::function_symbols(&data).map_err(|source| ProbeError::Elf { path: path.to_owned(), source })?;
        let Some(hook) = symbols.iter().find(|s| s.name == LOADER_HOOK) else {
            return Ok(None);
        };
        // At the entry: it runs a few times per dlopen, never on a hot path.
        self.attach_sites(path, &[ProbeSite::new(programs::LOADER, hook.file_offset, 0)])?;
        Ok(Some(hook.file_offset))
    }
}
