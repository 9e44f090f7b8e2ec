//! The CUDA launch family: probes on the driver's and runtime's launch entry
//! points, host synchronisation calls and (driver) kernel-naming calls of one
//! library, and the runtime's code ranges the driver probes tell its calls by.
use std::{os::unix::fs::MetadataExt, path::Path};

use aya::maps::{Array, MapData};
use profiler_common::{ApiLayer, LaunchApi, RUNTIME_TEXTS, SyncApi, maps as map_names, name_call, programs};

use super::{PlacedProbe, ProbeError, ProbePoint, ProbeSite, Probes, elf, map_file, maps::LibraryKind};

impl Probes {
    /// Probes the launch entry points, host synchronisation calls and (for
    /// the driver) kernel-naming calls `path` exports; returns where each probe
    /// went (empty when the file exports none), or None when this file (by
    /// device and inode) was already probed, under whatever name. On an error
    /// none of its probes stay attached.
    ///
    /// `text`: where a runtime library's code is mapped in the target, so that
    /// the driver probes can tell the runtime's calls to the driver.
    pub fn attach_cuda_library(
        &mut self,
        kind: LibraryKind,
        path: &Path,
        text: &[(u64, u64)],
        tgid: u32,
    ) -> Result<Option<Vec<PlacedProbe>>, ProbeError> {
        let meta = std::fs::metadata(path).map_err(|source| ProbeError::Read { path: path.to_owned(), source })?;
        let file = (meta.dev(), meta.ino());
        if !self.probed.insert(file) {
            // Probed for another process of the job (file-wide): this one's
            // runtime code is at its own addresses.
            if kind == LibraryKind::Runtime {
                self.add_runtime_text(tgid, text)?;
            }
            return Ok(None);
        }
        // All or nothing: a library probed half way would count some of its
        // launches and miss the others for the rest of the session. On any
        // failure the probes attached so far come off (dropping a link
        // detaches it), and the file is left for the next look to try again.
        let links_before = self.links.len();
        let placed = self.probe_library(kind, path, text, tgid);
        if placed.is_err() {
            self.links.truncate(links_before);
            self.probed.remove(&file);
        }
        placed.map(Some)
    }

    /// The probes of [`Self::attach_cuda_library`], all of them or an error.
    fn probe_library(
        &mut self,
        kind: LibraryKind,
        path: &Path,
        text: &[(u64, u64)],
        tgid: u32,
    ) -> Result<Vec<PlacedProbe>, ProbeError> {
        // Mapped, not read: only the symbol tables and the entry blocks are touched.
        let data = map_file(path).map_err(|source| ProbeError::Read { path: path.to_owned(), source })?;
        let symbols =
            elf::function_symbols(&data).map_err(|source| ProbeError::Elf { path: path.to_owned(), source })?;
        let layer = match kind {
            LibraryKind::Driver => ApiLayer::Driver,
            LibraryKind::Runtime => ApiLayer::Runtime,
        };
        if layer == ApiLayer::Runtime && symbols.iter().any(|s| s.name.starts_with("cuda")) {
            // Before the runtime probes exist: from now on the driver probes
            // look for a runtime launch in progress on their thread.
            self.add_runtime_text(tgid, text)?;
            let map =
                self.ebpf.map_mut(map_names::RUNTIME_PROBED).ok_or(ProbeError::Missing(map_names::RUNTIME_PROBED))?;
            let mut flag: Array<&mut MapData, u32> =
                Array::try_from(map).map_err(|source| ProbeError::Map { name: map_names::RUNTIME_PROBED, source })?;
            flag.set(0, 1, 0).map_err(|source| ProbeError::Map { name: map_names::RUNTIME_PROBED, source })?;
        }
        let (mut placed, mut sites) = (Vec::new(), Vec::new());
        for api in LaunchApi::ALL.into_iter().filter(|a| a.layer() == layer) {
            let Some(sym) = symbols.iter().find(|s| s.name == api.symbol()) else {
                continue;
            };
            let ProbePoint { offset, stack_adjust, reason } = self.probe_point(&data, sym);
            // The program reads the stack `stack_adjust` bytes further up when
            // pushes ran before the probe; the shared program that does takes
            // it from the cookie.
            let cookie = api as u64 | (stack_adjust << 32);
            sites.push(ProbeSite::new(api.program(stack_adjust), sym.file_offset + offset, cookie));
            placed.push(PlacedProbe { symbol: api.symbol(), offset, reason });
        }
        // Host synchronisation calls: not hot, so at their entry; the return
        // probe first, so that a runtime call's mark on its thread (which
        // keeps the driver call it makes from counting twice) is always cleared.
        for api in SyncApi::ALL.into_iter().filter(|a| a.layer() == layer) {
            let Some(sym) = symbols.iter().find(|s| s.name == api.symbol()) else {
                continue;
            };
            sites.push(ProbeSite::new(programs::SYNC_EXIT, sym.file_offset, api as u64));
            sites.push(ProbeSite::new(programs::SYNC_ENTER, sym.file_offset, api as u64));
            placed.push(PlacedProbe { symbol: api.symbol(), offset: 0, reason: "sync entry and return".into() });
        }
        // The calls that name kernels (driver only; rare: entry and return).
        if layer == ApiLayer::Driver {
            for (symbol, which) in [
                ("cuModuleGetFunction", name_call::MODULE_GET_FUNCTION),
                ("cuLibraryGetKernel", name_call::LIBRARY_GET_KERNEL),
                ("cuKernelGetFunction", name_call::KERNEL_GET_FUNCTION),
            ] {
                let Some(sym) = symbols.iter().find(|s| s.name == symbol) else { continue };
                sites.push(ProbeSite::new(programs::NAME_EXIT, sym.file_offset, which.into()));
                sites.push(ProbeSite::new(programs::NAME_ENTER, sym.file_offset, which.into()));
                placed.push(PlacedProbe { symbol, offset: 0, reason: "kernel name entry and return".into() });
            }
        }
        self.attach_sites(path, &sites)?;
        // The copies last: the most probes (98 entry points in a driver), and
        // the launch and sync probes are what steps are counted by.
        let mut copies = Vec::new();
        placed.extend(Self::copy_sites(&symbols, layer, &mut copies));
        self.attach_sites(path, &copies)?;
        Ok(placed)
    }

    /// Adds a runtime library's code ranges in process `tgid` to `RUNTIME_TEXT`.
    fn add_runtime_text(&mut self, tgid: u32, text: &[(u64, u64)]) -> Result<(), ProbeError> {
        for (start, end) in self.add_code_ranges(map_names::RUNTIME_TEXT, tgid, text)? {
            log::warn!(
                "more than {RUNTIME_TEXTS} runtime code mappings in process {tgid}: driver launches made by the \
                 runtime from {start:#x}-{end:#x} count as driver launches too"
            );
        }
        Ok(())
    }
}
