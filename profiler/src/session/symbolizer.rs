//! The host-stub symbolizer: the ELF function symbol at an address of the target, which names the
//! kernel of a runtime launch.
use std::{collections::HashMap, path::PathBuf};

use crate::probes;

/// Finds the ELF symbol at an address of the target (runtime host stubs).
#[derive(Default)]
pub(super) struct StubSymbolizer {
    /// (start, end, file offset, path) of the target's file mappings.
    maps: Vec<(u64, u64, u64, PathBuf)>,
    /// The watcher's last look at the maps, for a target that has exited.
    last_seen: Option<procfs::process::MemoryMaps>,
    /// Function symbols by file offset, per file.
    files: HashMap<PathBuf, HashMap<u64, String>>,
}

impl StubSymbolizer {
    /// The target's maps as last seen (kept, not parsed, in case it exits
    /// before its runtime launches are named).
    pub fn remember(&mut self, maps: procfs::process::MemoryMaps) {
        self.last_seen = Some(maps);
    }

    /// Reads the target's file mappings, once, before naming: its maps now,
    /// or, if it has exited, the watcher's last look (see `remember`).
    pub fn load_maps(&mut self, pid: u32) {
        let current = procfs::process::Process::new(pid as i32).and_then(|p| p.maps()).ok();
        if let Some(maps) = current.or_else(|| self.last_seen.take()) {
            self.maps = maps
                .0
                .into_iter()
                .filter_map(|m| match m.pathname {
                    procfs::process::MMapPath::Path(p) => Some((m.address.0, m.address.1, m.offset, p)),
                    _ => None,
                })
                .collect();
        }
    }

    /// The function symbol at `address` of the target (after `load_maps`).
    pub fn name(&mut self, pid: u32, address: u64) -> Option<String> {
        let (start, offset, path) =
            self.maps.iter().find(|m| address >= m.0 && address < m.1).map(|m| (m.0, m.2, m.3.clone()))?;
        let symbols = self.files.entry(path.clone()).or_insert_with(|| {
            // Mapped, not read: the file may be a gigabyte (libtorch_cuda.so);
            // only its symbol tables are touched.
            probes::open_in_target(pid, &path)
                .and_then(|data| probes::elf::function_symbols(&data).ok())
                .map(|syms| syms.into_iter().map(|s| (s.file_offset, s.name)).collect())
                .unwrap_or_default()
        });
        symbols.get(&(address - start + offset)).cloned()
    }
}
