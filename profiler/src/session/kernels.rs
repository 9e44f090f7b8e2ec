//! Kernel names: driver handles named by `cuModuleGetFunction` and its kin as they happen, runtime
//! host stubs named from the target's symbols at the end; both become `kernels` rows.
use std::collections::{HashMap, HashSet};

use profiler_common::name_call;

use super::symbolizer::StubSymbolizer;
use crate::{events::KernelNameEvent, probes, store::KernelRow};

/// What names each launched kernel, and the `kernels` rows not yet stored.
#[derive(Default)]
pub(super) struct KernelNames {
    /// Kernel names by driver handle (`CUfunction` or `CUkernel`).
    names: HashMap<u64, String>,
    /// Host-stub addresses of runtime launches, named at the end.
    stubs_seen: HashSet<u64>,
    stubs: StubSymbolizer,
    /// Rows not yet handed to the store.
    rows: Vec<KernelRow>,
}

impl KernelNames {
    /// A runtime launch's host stub, named at the end (see `name_runtime_stubs`).
    pub fn runtime_launch(&mut self, function: u64) {
        self.stubs_seen.insert(function);
    }

    /// The watcher's last look at the target's maps, kept in case it exits
    /// before its runtime launches are named.
    pub fn remember_maps(&mut self, maps: procfs::process::MemoryMaps) {
        self.stubs.remember(maps);
    }

    pub fn named(&mut self, k: KernelNameEvent) {
        let (name, source) = match k.which {
            name_call::MODULE_GET_FUNCTION => (k.name, "cuModuleGetFunction"),
            name_call::LIBRARY_GET_KERNEL => (k.name, "cuLibraryGetKernel"),
            name_call::KERNEL_GET_FUNCTION => match self.names.get(&k.kernel) {
                Some(n) => (n.clone(), "cuKernelGetFunction"),
                None => return,
            },
            _ => return,
        };
        if name.is_empty() {
            return;
        }
        // A handle named again with another name was reused (its module
        // unloaded, the address given to a new kernel): launches from now on
        // are that kernel's, so the new name gets a row of its own.
        if self.names.get(&k.handle) != Some(&name) {
            self.names.insert(k.handle, name.clone());
            let demangled_name = probes::elf::demangled_full(&name);
            self.rows.push(KernelRow { function: k.handle, named_ns: k.ts_ns, name, demangled_name, source });
        }
    }

    /// A runtime launch names its kernel by the host stub's address, whose
    /// ELF symbol is the kernel's mangled name. Done once, at the end: the
    /// first look into a library's symbols (libtorch_cuda.so has hundreds of
    /// thousands) would otherwise stall the ring-buffer drain.
    pub fn name_runtime_stubs(&mut self, pid: u32) {
        if self.stubs_seen.is_empty() {
            return;
        }
        let mut stubs: Vec<u64> = self.stubs_seen.iter().copied().collect();
        stubs.sort_unstable();
        self.stubs.load_maps(pid);
        for address in stubs {
            if let Some(name) = self.stubs.name(pid, address) {
                let demangled_name = probes::elf::demangled_full(&name);
                // A host stub's symbol names it for the whole session.
                self.rows.push(KernelRow { function: address, named_ns: 0, name, demangled_name, source: "symbol" });
            }
        }
    }

    /// The rows named since the last call.
    pub fn take_rows(&mut self) -> Vec<KernelRow> {
        std::mem::take(&mut self.rows)
    }
}
