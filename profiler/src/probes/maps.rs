//! Which CUDA libraries a process has mapped, and where it would find the
//! driver library before it has loaded it.
//!
//! Parsing is procfs's; the functions here take parsed maps or strings and do
//! no I/O, so they are tested on fixtures.
use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use procfs::process::{MMPermissions, MMapPath, MemoryMaps};

/// What a mapped file is to us.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LibraryKind {
    /// `libcuda.so*`: the driver API.
    Driver,
    /// `libcudart.so*`: the runtime API.
    Runtime,
}

impl LibraryKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Driver => "driver",
            Self::Runtime => "runtime",
        }
    }
}

/// Classifies a file by its name: `libcuda.so`, `libcuda.so.1`,
/// `libcuda.so.535.104.05` are the driver; `libcudart.so.12` the runtime.
/// `libcudadebugger.so`, `libcudart_static.a` and the like are neither.
pub fn classify(path: &Path) -> Option<LibraryKind> {
    let name = path.file_name()?.to_str()?;
    if name == "libcuda.so" || name.starts_with("libcuda.so.") {
        Some(LibraryKind::Driver)
    } else if name == "libcudart.so" || name.starts_with("libcudart.so.") {
        Some(LibraryKind::Runtime)
    } else {
        None
    }
}

/// A file mapped into the target, identified by device and inode (several
/// mappings of one file, or two paths of one file, are one library).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct MappedFile {
    pub dev: (i32, i32),
    pub inode: u64,
    /// The path as the target sees it (in its mount namespace).
    pub path: PathBuf,
}

/// The distinct executable-backed files of `maps`, in first-mapped order.
pub fn mapped_files(maps: &MemoryMaps) -> Vec<MappedFile> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for m in maps.0.iter() {
        let MMapPath::Path(path) = &m.pathname else {
            continue;
        };
        if m.inode == 0 || !seen.insert((m.dev, m.inode)) {
            continue;
        }
        out.push(MappedFile { dev: m.dev, inode: m.inode, path: path.clone() });
    }
    out
}

/// Where `file`'s code is mapped: its executable mappings, `[start, end)`.
pub fn executable_ranges(maps: &MemoryMaps, file: &MappedFile) -> Vec<(u64, u64)> {
    maps.0
        .iter()
        .filter(|m| m.dev == file.dev && m.inode == file.inode && m.perms.contains(MMPermissions::EXECUTE))
        .map(|m| m.address)
        .collect()
}

/// The CUDA libraries among `maps`.
pub fn cuda_libraries(maps: &MemoryMaps) -> Vec<(LibraryKind, MappedFile)> {
    mapped_files(maps).into_iter().filter_map(|f| classify(&f.path).map(|k| (k, f))).collect()
}

#[cfg(target_arch = "aarch64")]
const LDCONFIG_ABI: &str = "AArch64";
#[cfg(not(target_arch = "aarch64"))]
const LDCONFIG_ABI: &str = "x86-64";

/// Where `dlopen("libcuda.so.1")` would look, in order: the target's
/// `LD_LIBRARY_PATH`, then the dynamic linker's cache (`ldconfig -p` output),
/// then the usual directories. Probing these files before the target maps
/// them means launches right after a lazy CUDA initialisation are not missed.
pub fn driver_candidates(ld_library_path: Option<&str>, ldconfig_p: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    let mut push = |p: PathBuf| {
        if !out.contains(&p) {
            out.push(p);
        }
    };
    for dir in ld_library_path.unwrap_or("").split(':').filter(|d| !d.is_empty()) {
        push(Path::new(dir).join("libcuda.so.1"));
    }
    for line in ldconfig_p.lines() {
        // "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1"
        let mut parts = line.trim().splitn(2, " => ");
        let (Some(lhs), Some(path)) = (parts.next(), parts.next()) else {
            continue;
        };
        let soname = lhs.split_whitespace().next().unwrap_or("");
        // Only libraries of our own ABI: a 32-bit libcuda cannot be the target's.
        if soname == "libcuda.so.1" && lhs.contains(LDCONFIG_ABI) {
            push(PathBuf::from(path.trim()));
        }
    }
    for dir in ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/cuda/lib64", "/usr/lib/wsl/lib"] {
        push(Path::new(dir).join("libcuda.so.1"));
    }
    out
}

/// What to add to `path`'s link-time addresses for the target's: where its
/// first page is mapped, less the page of its lowest loadable address.
pub fn load_bias(maps: &MemoryMaps, path: &Path, lowest: u64) -> Option<u64> {
    let start = maps.iter().find(|m| m.offset == 0 && matches!(&m.pathname, MMapPath::Path(p) if p == path))?.address.0;
    Some(start.wrapping_sub(lowest & !0xfff))
}

/// Whether `address` lies in a writable mapping: where a library's data is
/// once the loader has mapped it, and not while only its first, read-only
/// mapping of the whole file is there.
pub fn is_writable(maps: &MemoryMaps, address: u64) -> bool {
    maps.iter().any(|m| (m.address.0..m.address.1).contains(&address) && m.perms.contains(MMPermissions::WRITE))
}

#[cfg(test)]
mod tests {
    use procfs::FromRead;

    use super::*;

    const MAPS: &str = "\
55d0c0a00000-55d0c0a01000 r--p 00000000 fe:01 1311 /usr/bin/trainer
55d0c0a01000-55d0c0a02000 r-xp 00001000 fe:01 1311 /usr/bin/trainer
55d0c1b00000-55d0c1b21000 rw-p 00000000 00:00 0 [heap]
7f1a00000000-7f1a00100000 r--p 00000000 fe:01 2001 /usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05
7f1a00100000-7f1a00900000 r-xp 00100000 fe:01 2001 /usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05
7f1a01000000-7f1a01100000 r-xp 00000000 fe:01 3001 /opt/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12
7f1a02000000-7f1a02100000 r-xp 00000000 fe:01 4001 /usr/lib/x86_64-linux-gnu/libcudadebugger.so.1
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
";

    fn maps() -> MemoryMaps {
        MemoryMaps::from_read(MAPS.as_bytes()).expect("fixture parses")
    }

    #[test]
    fn only_addresses_in_writable_mappings_are_writable() {
        let m = maps();
        assert!(is_writable(&m, 0x55d0c1b00000));
        assert!(is_writable(&m, 0x55d0c1b20fff));
        assert!(!is_writable(&m, 0x55d0c1b21000), "one past the heap's end");
        assert!(!is_writable(&m, 0x7f1a00000008), "a read-only mapping of a file");
        assert!(!is_writable(&m, 0x1000), "nothing mapped");
    }

    #[test]
    fn finds_driver_and_runtime_once_each() {
        let libs = cuda_libraries(&maps());
        let kinds: Vec<_> = libs.iter().map(|(k, f)| (*k, f.inode)).collect();
        assert_eq!(kinds, vec![(LibraryKind::Driver, 2001), (LibraryKind::Runtime, 3001)]);
        assert_eq!(libs[0].1.path, PathBuf::from("/usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05"));
    }

    #[test]
    fn mapped_files_dedupes_by_inode_and_skips_anonymous() {
        let files = mapped_files(&maps());
        assert_eq!(files.len(), 4);
        assert_eq!(files[0].path, PathBuf::from("/usr/bin/trainer"));
    }

    #[test]
    fn executable_ranges_are_the_files_code_mappings() {
        let maps = maps();
        let libs = cuda_libraries(&maps);
        assert_eq!(executable_ranges(&maps, &libs[0].1), vec![(0x7f1a_0010_0000, 0x7f1a_0090_0000)]);
        assert_eq!(executable_ranges(&maps, &libs[1].1), vec![(0x7f1a_0100_0000, 0x7f1a_0110_0000)]);
    }

    #[test]
    fn classify_names() {
        assert_eq!(classify(Path::new("/x/libcuda.so")), Some(LibraryKind::Driver));
        assert_eq!(classify(Path::new("/x/libcuda.so.1")), Some(LibraryKind::Driver));
        assert_eq!(classify(Path::new("/x/libcudart.so.12.4.127")), Some(LibraryKind::Runtime));
        assert_eq!(classify(Path::new("/x/libcudadebugger.so.1")), None);
        assert_eq!(classify(Path::new("/x/libcudart_static.a")), None);
    }

    #[test]
    fn driver_candidates_follow_search_order() {
        let ldconfig = "\
3 libs found in cache `/etc/ld.so.cache'
\tlibcudart.so.12 (libc6,x86-64) => /usr/local/cuda/lib64/libcudart.so.12
\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/nvidia/libcuda.so.1
\tlibcuda.so.1 (libc6) => /usr/lib/i386-linux-gnu/libcuda.so.1
";
        let c = driver_candidates(Some("/opt/a::/opt/b"), ldconfig);
        assert_eq!(c[0], PathBuf::from("/opt/a/libcuda.so.1"));
        assert_eq!(c[1], PathBuf::from("/opt/b/libcuda.so.1"));
        assert_eq!(c[2], PathBuf::from("/usr/lib/x86_64-linux-gnu/nvidia/libcuda.so.1"));
        assert!(!c.iter().any(|p| p.starts_with("/usr/lib/i386-linux-gnu")));
        assert_eq!(c[3], PathBuf::from("/usr/lib/x86_64-linux-gnu/libcuda.so.1"));
    }
}
