//! Host↔device copies and memsets in the CUDA driver and runtime: an entry
//! probe (which reads size and direction as the cookie's form says) and a
//! return probe (the record, with the host time in the call) on each entry
//! point of `profiler_common::copies::COPY_ENTRIES` a library exports. A few
//! calls per step: at the entry, where stack arguments are at `rsp + 8`.
use profiler_common::{
    ApiLayer,
    copies::{COPY_ENTRIES, copy_programs},
};

use super::{PlacedProbe, ProbeSite, Probes, elf::FunctionSymbol};

/// Why each probe is where it is (the `probes` rows' reason).
const PLACEMENT: &str = "copy entry (size and direction from the arguments) and return (host time)";

impl Probes {
    /// The copy programs' probes on the entry points of `layer` that
    /// `symbols` has, appended to `sites`; returns where each went.
    pub(super) fn copy_sites(
        symbols: &[FunctionSymbol],
        layer: ApiLayer,
        sites: &mut Vec<ProbeSite>,
    ) -> Vec<PlacedProbe> {
        let mut placed = Vec::new();
        let runtime = layer == ApiLayer::Runtime;
        for (index, entry) in COPY_ENTRIES.iter().enumerate().filter(|(_, e)| e.runtime == runtime) {
            let Some(sym) = symbols.iter().find(|s| s.name == entry.symbol) else { continue };
            let cookie = entry.form.cookie(index as u16);
            // The return probe first: a call caught between the two has no
            // entry kept, and its return writes nothing.
            sites.push(ProbeSite::new(copy_programs::EXIT, sym.file_offset, cookie));
            sites.push(ProbeSite::new(copy_programs::ENTER, sym.file_offset, cookie));
            placed.push(PlacedProbe { symbol: entry.symbol, offset: 0, reason: PLACEMENT.into() });
        }
        placed
    }
}

/// The programs to load.
pub fn programs() -> [&'static str; 2] {
    [copy_programs::ENTER, copy_programs::EXIT]
}
