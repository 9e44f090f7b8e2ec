//! Which mapped files are cuBLAS (`libcublas.so*`) and cuBLASLt
//! (`libcublasLt.so*`), and attaching the BLAS programs to their GEMM entry
//! points and cuBLASLt's descriptor calls (see `profiler-ebpf`'s `blas`).
use std::{os::unix::fs::MetadataExt, path::Path};

use profiler_common::{BLAS_TEXTS, BlasCall, blas_programs};

use super::{PlacedProbe, ProbeError, ProbePoint, ProbeSite, Probes, elf, map_file};

/// A BLAS library, by file name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlasLibrary {
    /// `libcublas.so*`: the classic API (`cublasGemmEx`, `cublasSgemm_v2`, …).
    Cublas,
    /// `libcublasLt.so*`: `cublasLtMatmul` and its descriptors.
    CublasLt,
}

impl BlasLibrary {
    /// The `probed_files.kind` of its rows.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cublas => "cublas",
            Self::CublasLt => "cublasLt",
        }
    }

    /// The calls it exports.
    pub fn calls(self) -> impl Iterator<Item = BlasCall> {
        BlasCall::ALL.into_iter().filter(move |c| c.is_lt() == (self == Self::CublasLt))
    }
}

/// Classifies a file by its name: `libcublas.so`, `libcublas.so.13`,
/// `libcublas.so.12.4.5.8`; `libcublasLt.so.13`. `libcublas_static.a` and
/// the like are neither.
pub fn classify(path: &Path) -> Option<BlasLibrary> {
    let name = path.file_name()?.to_str()?;
    let is = |base: &str| name == base || name.strip_prefix(base).is_some_and(|rest| rest.starts_with('.'));
    if is("libcublasLt.so") {
        Some(BlasLibrary::CublasLt)
    } else if is("libcublas.so") {
        Some(BlasLibrary::Cublas)
    } else {
        None
    }
}

/// The programs to load.
pub fn programs() -> [&'static str; 3] {
    [blas_programs::CALL, blas_programs::CREATE, blas_programs::CREATE_RETURN]
}

impl Probes {
    /// Probes the BLAS calls `path` exports (all or nothing); returns where
    /// each probe went, or None when this file (by device and inode) was
    /// already probed. Its code ranges go to [`Self::add_blas_text`] first.
    pub fn attach_blas_library(
        &mut self,
        library: BlasLibrary,
        path: &Path,
    ) -> Result<Option<Vec<PlacedProbe>>, ProbeError> {
        let meta = std::fs::metadata(path).map_err(|source| ProbeError::Read { path: path.to_owned(), source })?;
        let file = (meta.dev(), meta.ino());
        if !self.probed.insert(file) {
            return Ok(None);
        }
        let links_before = self.links.len();
        let placed = self.probe_blas(library, path);
        if placed.is_err() {
            self.links.truncate(links_before);
            self.probed.remove(&file);
        }
        placed.map(Some)
    }

    fn probe_blas(&mut self, library: BlasLibrary, path: &Path) -> Result<Vec<PlacedProbe>, ProbeError> {
        // Mapped, not read: cuBLASLt is half a gigabyte; only the symbol
        // tables and the entry blocks are touched.
        let data = map_file(path).map_err(|source| ProbeError::Read { path: path.to_owned(), source })?;
        let symbols =
            elf::function_symbols(&data).map_err(|source| ProbeError::Elf { path: path.to_owned(), source })?;
        let (mut placed, mut sites) = (Vec::new(), Vec::new());
        for call in library.calls() {
            let Some(sym) = symbols.iter().find(|s| s.name == call.symbol()) else { continue };
            let ProbePoint { offset, stack_adjust, reason } = self.probe_point(&data, sym);
            let cookie = call as u64 | (stack_adjust << 32);
            if call.creates() {
                // The return first: an entry is never left waiting for a return unprobed.
                sites.push(ProbeSite::new(blas_programs::CREATE_RETURN, sym.file_offset, call as u64));
                sites.push(ProbeSite::new(blas_programs::CREATE, sym.file_offset + offset, cookie));
                let reason = format!("{reason}; and its return (reads the handle)");
                placed.push(PlacedProbe { symbol: call.symbol(), offset, reason });
            } else {
                sites.push(ProbeSite::new(blas_programs::CALL, sym.file_offset + offset, cookie));
                placed.push(PlacedProbe { symbol: call.symbol(), offset, reason });
            }
        }
        self.attach_sites(path, &sites)?;
        Ok(placed)
    }

    /// Adds a BLAS library's code ranges (`[start, end)` in process `tgid`)
    /// to its `BLAS_TEXT` entry: a probed call returning there was made by
    /// that library (cuBLAS calling cuBLASLt), and is not counted again.
    pub fn add_blas_text(&mut self, tgid: u32, text: &[(u64, u64)]) -> Result<(), ProbeError> {
        for (start, end) in self.add_code_ranges(blas_programs::TEXT_MAP, tgid, text)? {
            log::warn!(
                "more than {BLAS_TEXTS} BLAS code mappings in process {tgid}: GEMMs cuBLAS makes through cuBLASLt \
                 from {start:#x}-{end:#x} may count twice"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_the_libraries_by_file_name() {
        let wheel = "/venv/lib/python3.11/site-packages/nvidia/cu13/lib";
        assert_eq!(classify(Path::new(&format!("{wheel}/libcublas.so.13"))), Some(BlasLibrary::Cublas));
        assert_eq!(classify(Path::new(&format!("{wheel}/libcublasLt.so.13"))), Some(BlasLibrary::CublasLt));
        assert_eq!(classify(Path::new("libcublas.so")), Some(BlasLibrary::Cublas));
        assert_eq!(classify(Path::new("libcublasLt.so.12.4.5.8")), Some(BlasLibrary::CublasLt));
        for other in ["libcublas_static.a", "libcublasLt_static.a", "libcublasXt.so.12", "libcublas.so_old"] {
            assert_eq!(classify(Path::new(other)), None, "{other}");
        }
    }

    #[test]
    fn each_library_probes_its_own_calls() {
        let lt: Vec<BlasCall> = BlasLibrary::CublasLt.calls().collect();
        assert!(lt.iter().all(|c| c.symbol().starts_with("cublasLt")));
        assert_eq!(lt.len(), 7);
        let classic: Vec<BlasCall> = BlasLibrary::Cublas.calls().collect();
        assert!(classic.iter().all(|c| !c.symbol().starts_with("cublasLt")));
        assert_eq!(classic.len(), 14);
    }
}
