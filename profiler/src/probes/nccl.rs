//! Where NCCL's entry points live in `libnccl.so.2`, and attaching the
//! collective programs there. Each exported call (`ncclAllReduce`, …, the
//! group calls) gets an entry probe, which keeps its arguments, and a return
//! probe, which writes the record: a few calls per step, not a hot path, so
//! the probes sit at the entry, where the stack arguments are at `rsp + 8`
//! (see the eBPF side's `nccl` module).
use std::path::Path;

use profiler_common::{CollectiveOp, nccl_programs};

use super::{PlacedProbe, ProbeError, ProbeSite, Probes, elf};

/// Whether `path` is NCCL's library (`libnccl.so`, `libnccl.so.2`, `libnccl.so.2.30.3`).
pub fn is_libnccl(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n == "libnccl.so" || n.starts_with("libnccl.so."))
}

/// The file offset of each probed entry point `data` exports; an op the
/// library does not export is left out.
pub fn resolve(data: &[u8]) -> Result<Vec<(CollectiveOp, u64)>, elf::ElfError> {
    let symbols = elf::function_symbols(data)?;
    Ok(CollectiveOp::ALL
        .into_iter()
        .filter_map(|op| symbols.iter().find(|s| s.name == op.symbol()).map(|s| (op, s.file_offset)))
        .collect())
}

/// Why each probe is where it is (the `probes` rows' reason).
pub const PLACEMENT: &str = "entry (arguments, stack ones at rsp+8) and return (host time in the call)";

impl Probes {
    /// Attaches the collective programs to one `libnccl.so.2` (all or
    /// nothing); returns where each went.
    pub fn attach_nccl(
        &mut self,
        path: &Path,
        entries: &[(CollectiveOp, u64)],
    ) -> Result<Vec<PlacedProbe>, ProbeError> {
        let before = self.links.len();
        let (mut placed, mut sites) = (Vec::new(), Vec::new());
        for &(op, file_offset) in entries {
            // The return probe first: a call caught between the two has no
            // entry kept, and its return writes nothing.
            sites.push(ProbeSite::new(nccl_programs::EXIT, file_offset, op as u64));
            sites.push(ProbeSite::new(nccl_programs::ENTER, file_offset, op as u64));
            placed.push(PlacedProbe { symbol: op.symbol(), offset: 0, reason: PLACEMENT.into() });
        }
        if let Err(e) = self.attach_sites(path, &sites) {
            self.links.truncate(before);
            return Err(e);
        }
        Ok(placed)
    }
}

/// The programs to load.
pub fn programs() -> [&'static str; 2] {
    [nccl_programs::ENTER, nccl_programs::EXIT]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_the_library_by_file_name() {
        assert!(is_libnccl(Path::new("/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2")));
        assert!(is_libnccl(Path::new("libnccl.so.2.30.3")));
        assert!(is_libnccl(Path::new("/usr/lib/libnccl.so")));
        assert!(!is_libnccl(Path::new("/x/libnccl_static.a")));
        assert!(!is_libnccl(Path::new("/x/libnccl-net.so")));
    }

    #[test]
    fn a_file_that_is_not_elf_says_so() {
        assert!(resolve(b"not an elf").is_err());
    }
}
