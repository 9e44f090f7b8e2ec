//! Host↔device copies and memsets in the CUDA driver and runtime: an entry
//! probe (which reads size and direction as the cookie's form says) and a
//! return probe (the record, with the host time in the call) on each entry
//! point of `profiler_common::copies::COPY_ENTRIES` a library exports. A few
//! calls per step: at the entry, where stack arguments are at `rsp + 8`.
use std::path::Path;

use profiler_common::{
    ApiLayer,
    copies::{COPY_ENTRIES, copy_programs},
};

use super::{PlacedProbe, ProbeError, Probes, elf::FunctionSymbol};

/// Why each probe is where it is (the `probes` rows' reason).
const PLACEMENT: &str = "copy entry (size and direction from the arguments) and return (host time)";

impl Probes {
    /// Attaches the copy programs to the entry points of `layer` that `symbols` (of `path`) has.
    pub(super) fn attach_copies(
        &mut self,
        path: &Path,
        symbols: &[FunctionSymbol],
        layer: ApiLayer,
    ) -> Result<Vec<PlacedProbe>, ProbeError> {
        let mut placed = Vec::new();
        let runtime = layer == ApiLayer::Runtime;
        for (index, entry) in COPY_ENTRIES.iter().enumerate().filter(|(_, e)| e.runtime == runtime) {
            let Some(sym) = symbols.iter().find(|s| s.name == entry.symbol) else { continue };
            let cookie = entry.form.cookie(index as u16);
            // The return probe first: a call caught between the two has no
            // entry kept, and its return writes nothing.
            self.attach(copy_programs::EXIT, path, sym.file_offset, cookie)?;
            self.attach(copy_programs::ENTER, path, sym.file_offset, cookie)?;
            placed.push(PlacedProbe { symbol: entry.symbol, offset: 0, reason: PLACEMENT.into() });
        }
        Ok(placed)
    }
}

/// The programs to load.
pub fn programs() -> [&'static str; 2] {
    [copy_programs::ENTER, copy_programs::EXIT]
}
