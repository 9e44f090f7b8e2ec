//! Function symbols of an ELF file, with the file offsets a uprobe needs.
//!
//! No I/O here: callers hand in the file's bytes, so tests run on fixtures.
use object::{Object, ObjectSegment, ObjectSymbol, SegmentFlags, SymbolKind, elf::PF_X};

/// A defined function symbol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FunctionSymbol {
    /// The symbol as stored (mangled, without any `@VERSION` suffix).
    pub name: String,
    /// Virtual address in the ELF file's own address space.
    pub address: u64,
    /// Offset in the file: what the uprobe PMU takes.
    pub file_offset: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ElfError {
    /// The bytes are not an ELF object `object` can read.
    #[error("not a readable ELF file: {0}")]
    Parse(#[from] object::Error),
}

/// A loadable (`PT_LOAD`) segment: where the loader maps which part of the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadSegment {
    /// `p_vaddr`.
    pub address: u64,
    /// `p_memsz`: the file's bytes and the zero-filled tail after them.
    pub mem_size: u64,
    /// `p_offset`.
    pub file_offset: u64,
    /// `p_flags` (`PF_X`, `PF_W`, `PF_R`).
    pub flags: u32,
}

impl LoadSegment {
    pub fn executable(&self) -> bool {
        self.flags & PF_X != 0
    }

    /// `address - p_vaddr + p_offset` when the segment's memory image holds
    /// `address`. The zero-filled tail (past `p_filesz`) counts: a variable
    /// there still resolves through the file's mapping of its partial page.
    /// None, not an overflow, for a header whose offset and size pass 2^64.
    pub fn file_offset(&self, address: u64) -> Option<u64> {
        let delta = address.checked_sub(self.address).filter(|&d| d < self.mem_size)?;
        self.file_offset.checked_add(delta)
    }
}

/// The loadable segments of a parsed file, in program-header order.
pub fn load_segments<'data>(file: &impl Object<'data>) -> Vec<LoadSegment> {
    file.segments()
        .map(|s| LoadSegment {
            address: s.address(),
            mem_size: s.size(),
            file_offset: s.file_range().0,
            flags: match s.flags() {
                SegmentFlags::Elf { p_flags } => p_flags,
                _ => 0,
            },
        })
        .collect()
}

/// The program interpreter (`PT_INTERP`) of a 64-bit ELF executable: the
/// dynamic loader it runs under; None for a static executable.
pub fn interpreter(data: &[u8]) -> Result<Option<std::path::PathBuf>, ElfError> {
    use object::read::elf::{ElfFile64, ProgramHeader};
    use std::os::unix::ffi::OsStrExt;
    let file = ElfFile64::<object::Endianness>::parse(data)?;
    let endian = file.endian();
    for ph in file.elf_program_headers() {
        if let Some(path) = ph.interpreter(endian, data)? {
            return Ok(Some(std::ffi::OsStr::from_bytes(path).into()));
        }
    }
    Ok(None)
}

/// Every defined function symbol of `data` (`.symtab` and `.dynsym`), with its
/// file offset. Symbols outside any loadable segment are skipped.
pub fn function_symbols(data: &[u8]) -> Result<Vec<FunctionSymbol>, ElfError> {
    let file = object::File::parse(data)?;
    let segments = load_segments(&file);
    let mut out: Vec<FunctionSymbol> = Vec::new();
    for sym in file.symbols().chain(file.dynamic_symbols()) {
        if sym.kind() != SymbolKind::Text || sym.is_undefined() || sym.address() == 0 {
            continue;
        }
        let Ok(name) = sym.name() else { continue };
        let name = name.split('@').next().unwrap_or(name);
        let address = sym.address();
        let Some(file_offset) = segments.iter().find_map(|s| s.file_offset(address)) else { continue };
        out.push(FunctionSymbol { name: name.to_owned(), address, file_offset });
    }
    out.sort_by(|a, b| (a.name.as_str(), a.address).cmp(&(b.name.as_str(), b.address)));
    out.dedup_by(|a, b| a.name == b.name && a.address == b.address);
    Ok(out)
}

/// A human-readable name: C++ and Rust symbols demangled without parameters
/// or hash, anything else as is.
pub fn demangled(name: &str) -> String {
    // Rust first: legacy Rust symbols are also valid Itanium C++ names, and the
    // C++ demangler would keep the hash.
    if let Some(d) = rust_demangled(name) {
        return d;
    }
    if is_itanium(name)
        && let Ok(sym) = cpp_demangle::Symbol::new(name)
        && let Ok(s) = sym.demangle(&cpp_demangle::DemangleOptions::new().no_params().no_return_type())
    {
        return s;
    }
    name.to_owned()
}

/// The full demangled form (with parameters) of a C++ or Rust symbol, or None
/// when it is not mangled.
pub fn demangled_full(name: &str) -> Option<String> {
    if let Some(d) = rust_demangled(name) {
        return Some(d);
    }
    if !is_itanium(name) {
        return None;
    }
    cpp_demangle::Symbol::new(name).ok()?.demangle(&cpp_demangle::DemangleOptions::default()).ok()
}

/// A Rust symbol's name without its hash. On ELF every Rust symbol starts with
/// `_` (`_ZN…E` legacy, `_R…` v0); rustc-demangle also takes v0 names without
/// it (`R…`, other platforms' spelling), which would rename C symbols such as
/// `RNvCs1234_5myapp10train_step` (found by `fuzz_tests`).
fn rust_demangled(name: &str) -> Option<String> {
    if !name.starts_with('_') {
        return None;
    }
    rustc_demangle::try_demangle(name).ok().map(|d| format!("{d:#}"))
}

/// Whether `name` can be an Itanium C++ symbol (`_Z…`, `_GLOBAL__…`). `cpp_demangle` also
/// accepts bare type encodings, which would turn C symbols such as `f` or `DF32x` into
/// `float` and `_Float32x` (found by `fuzz_tests`).
fn is_itanium(name: &str) -> bool {
    name.starts_with('_')
}

/// Whether `sym` is what a user means by `query`: the exact symbol, or a
/// demangled name equal to it or ending in `::query`.
pub fn matches(sym: &str, query: &str) -> bool {
    if sym == query {
        return true;
    }
    let d = demangled(sym);
    d == query || d.strip_suffix(query).is_some_and(|rest| rest.ends_with("::"))
}

/// Up to `limit` names close to `query` (by edit distance on the demangled
/// name, or containing it), best first.
pub fn near_matches<'a>(query: &str, names: impl Iterator<Item = &'a str>, limit: usize) -> Vec<String> {
    let mut scored: Vec<(f64, String)> = names
        .map(|n| {
            let d = demangled(n);
            let short = d.rsplit("::").next().unwrap_or(&d).to_owned();
            let mut score = strsim::jaro_winkler(query, &short).max(strsim::jaro_winkler(query, &d));
            if short.contains(query) || query.contains(short.as_str()) {
                score = score.max(0.9);
            }
            (score, d)
        })
        .filter(|(s, _)| *s >= 0.8)
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    scored.dedup_by(|a, b| a.1 == b.1);
    scored.into_iter().take(limit).map(|(_, n)| n).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_test_binary_symbols_with_consistent_offsets() {
        let exe = std::env::current_exe().expect("current exe");
        let data = std::fs::read(exe).expect("read exe");
        let syms = function_symbols(&data).expect("parse");
        let main = syms.iter().find(|s| s.name == "main").expect("main is defined");
        // The bytes at the computed file offset are the bytes the loader maps
        // at the symbol's address: check via the section that holds it.
        let file = object::File::parse(&*data).expect("parse");
        let section = file
            .sections()
            .find(|s| {
                use object::ObjectSection;
                main.address >= s.address() && main.address < s.address() + s.size()
            })
            .expect("a section holds main");
        use object::ObjectSection;
        let (sec_off, _) = section.file_range().expect("in file");
        assert_eq!(main.file_offset, main.address - section.address() + sec_off);
    }

    #[test]
    fn interpreter_of_a_dynamic_executable_and_of_a_library() {
        // This test binary is dynamically linked; its loader exports the hook.
        let exe = std::fs::read(std::env::current_exe().expect("current exe")).expect("read exe");
        let interp = interpreter(&exe).expect("parse").expect("a dynamic executable has PT_INTERP");
        assert!(interp.is_absolute(), "{}", interp.display());
        let loader = std::fs::read(&interp).expect("read the loader");
        assert_eq!(interpreter(&loader).expect("parse"), None, "the loader itself has no interpreter");
        let syms = function_symbols(&loader).expect("parse the loader");
        let hook = crate::probes::loader::LOADER_HOOK;
        assert!(syms.iter().any(|s| s.name == hook), "{} exports {hook}", interp.display());
    }

    #[test]
    fn segment_file_offsets_cover_the_memory_image_only() {
        let s = LoadSegment { address: 0x60_3000, mem_size: 0x800, file_offset: 0x2000, flags: 6 };
        assert!(!s.executable());
        assert_eq!(s.file_offset(0x60_3000), Some(0x2000));
        assert_eq!(s.file_offset(0x60_37ff), Some(0x27ff));
        assert_eq!(s.file_offset(0x60_3800), None);
        assert_eq!(s.file_offset(0x60_2fff), None);
        assert_eq!(s.file_offset(u64::MAX), None);
        // A crafted header: p_offset + (address - p_vaddr) past 2^64 (an overflow panic in debug builds).
        let s = LoadSegment { address: 0, mem_size: u64::MAX, file_offset: u64::MAX - 7, flags: 5 };
        assert_eq!(s.file_offset(7), Some(u64::MAX));
        assert_eq!(s.file_offset(8), None);
        let exe = std::env::current_exe().expect("current exe");
        let data = std::fs::read(exe).expect("read exe");
        let segments = load_segments(&object::File::parse(&*data).expect("parse"));
        assert!(segments.iter().any(LoadSegment::executable), "{segments:?}");
        assert!(segments.iter().any(|s| !s.executable()), "{segments:?}");
    }

    #[test]
    fn demangles_cpp_and_rust() {
        assert_eq!(demangled("_Z10train_stepi"), "train_step");
        assert_eq!(demangled("_ZN7Trainer4stepEv"), "Trainer::step");
        assert_eq!(demangled("_ZN5myapp10train_step17h0123456789abcdefE"), "myapp::train_step");
        assert_eq!(demangled("train_step"), "train_step");
    }

    #[test]
    fn full_demangling_keeps_parameters() {
        assert_eq!(demangled_full("_Z6matmulPfS_S_i").as_deref(), Some("matmul(float*, float*, float*, int)"));
        assert_eq!(demangled_full("plain_c_name"), None);
        // C names that happen to be C++ type encodings stay as they are.
        for c_name in ["f", "i", "Ss", "DF32x"] {
            assert_eq!(demangled(c_name), c_name);
            assert_eq!(demangled_full(c_name), None, "{c_name}");
        }
    }

    #[test]
    fn matches_exact_and_demangled_names() {
        assert!(matches("train_step", "train_step"));
        assert!(matches("_Z10train_stepi", "train_step"));
        assert!(matches("_ZN7Trainer4stepEv", "step"));
        assert!(matches("_ZN7Trainer4stepEv", "Trainer::step"));
        assert!(!matches("_Z11xtrain_stepi", "train_step"));
        assert!(!matches("train_steps", "train_step"));
    }

    #[test]
    fn near_matches_rank_typos_first_and_drop_unrelated() {
        let names = ["train_step", "validate", "train_epoch", "main", "_Z10train_stepi"];
        let got = near_matches("trian_step", names.iter().copied(), 3);
        assert_eq!(got.first().map(String::as_str), Some("train_step"));
        assert!(!got.iter().any(|n| n == "main"));
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(function_symbols(b"not an elf").is_err());
    }
}
