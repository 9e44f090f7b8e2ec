//! Debian packages as test fixtures, never installed: `apt-get download`
//! against a private apt state (the host's sources, pins, lists and dpkg
//! status untouched) and `dpkg -x` into a folder of the caller's. The genuine
//! NVIDIA libraries (Debian 12's non-free), trixie's and sid's Pythons and
//! Prometheus all come this way.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Result;

use crate::run;

/// Where unpacked fixtures live: `/var/cache/profiler/NAME`, so that a
/// machine fetches them once, or under target/ where that cannot be made.
pub fn cache_dir(name: &str) -> PathBuf {
    let shared = Path::new("/var/cache/profiler").join(name);
    if std::fs::create_dir_all(&shared).is_ok() && writable(&shared) {
        shared
    } else {
        crate::fixtures_dir().join(format!("{name}-cache"))
    }
}

/// Whether this process may write in `dir` (a cache root made another user's stays theirs).
fn writable(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else { return false };
    // SAFETY: `path` is a NUL-terminated string that outlives the call.
    unsafe { libc::access(path.as_ptr(), libc::W_OK) == 0 }
}

/// A Debian suite and its components, as a sources line names them.
pub struct Source<'a> {
    pub suite: &'a str,
    pub components: &'a [&'a str],
}

impl Source<'_> {
    pub const fn main(suite: &str) -> Source<'_> {
        Source { suite, components: &["main"] }
    }
}

/// Downloads `packages` from Debian's `source` into `dir/apt` and unpacks
/// them all into `dir/root`; returns that root. The one way this project
/// fetches a .deb: whatever the host's distribution, nothing under /etc/apt
/// or /var/lib/apt is read or written.
pub fn fetch_and_unpack(dir: &Path, source: &Source, packages: &[String]) -> Result<PathBuf> {
    let keyring = debian_keyring()?;
    let sources = format!(
        "deb [signed-by={}] http://deb.debian.org/debian {} {}\n",
        keyring.display(),
        source.suite,
        source.components.join(" ")
    );
    let apt = dir.join("apt");
    std::fs::create_dir_all(&apt)?;
    std::fs::write(apt.join("sources.list"), sources)?;
    download_and_unpack(dir, &apt.join("sources.list"), Path::new("/dev/null"), packages)
}

/// `apt-get update` and `download` with lists, cache and status under
/// `dir/apt`, the sources named, then `dpkg -x` of each .deb into `dir/root`.
fn download_and_unpack(dir: &Path, source_list: &Path, source_parts: &Path, packages: &[String]) -> Result<PathBuf> {
    let apt = dir.join("apt");
    for d in ["lists/partial", "cache/archives/partial", "debs"] {
        std::fs::create_dir_all(apt.join(d))?;
    }
    std::fs::write(apt.join("status"), "")?;
    let opt = |k: &str, v: &Path| ["-o".to_string(), format!("{k}={}", v.display())];
    let mut opts: Vec<String> = Vec::new();
    for (k, v) in [
        ("Dir::Etc::SourceList", source_list.to_owned()),
        ("Dir::Etc::SourceParts", source_parts.to_owned()),
        ("Dir::Etc::Preferences", "/dev/null".into()),
        ("Dir::Etc::PreferencesParts", "/dev/null".into()),
        ("Dir::State::Lists", apt.join("lists")),
        ("Dir::State::status", apt.join("status")),
        ("Dir::Cache", apt.join("cache")),
    ] {
        opts.extend(opt(k, &v));
    }
    run(Command::new("apt-get").args(&opts).args(["-q", "update"]))?;
    let debs = apt.join("debs");
    run(Command::new("apt-get").current_dir(&debs).args(&opts).args(["-q", "download"]).args(packages))?;
    let root = dir.join("root");
    std::fs::create_dir_all(&root)?;
    for deb in std::fs::read_dir(&debs)? {
        let deb = deb?.path();
        if deb.extension().is_some_and(|e| e == "deb") {
            run(Command::new("dpkg").arg("-x").arg(&deb).arg(&root))?;
        }
    }
    Ok(root)
}

const DEBIAN_KEYRING: &str = "usr/share/keyrings/debian-archive-keyring.gpg";

/// Debian's archive key: the host's own on Debian; on Ubuntu (which does not
/// ship it by default) Ubuntu's `debian-archive-keyring` package, downloaded
/// from the host's own sources (so verified by Ubuntu's key) into the cache
/// and unpacked there, not installed.
fn debian_keyring() -> Result<PathBuf> {
    let host = Path::new("/").join(DEBIAN_KEYRING);
    if host.exists() {
        return Ok(host);
    }
    let dir = cache_dir("debian-keyring");
    let unpacked = dir.join("root").join(DEBIAN_KEYRING);
    if unpacked.exists() {
        return Ok(unpacked);
    }
    let on_ubuntu = crate::toolchain::host_release()?.is_ok_and(|r| r.origin == "Ubuntu");
    if !on_ubuntu {
        anyhow::bail!(
            "{} is missing, and Debian test fixtures are fetched with Debian's archive key: install the host's \
             debian-archive-keyring package",
            host.display()
        );
    }
    crate::say(
        "downloading Ubuntu's debian-archive-keyring (to verify Debian's archive for test fixtures; not installed)",
    );
    let root = download_and_unpack(
        &dir,
        Path::new("/etc/apt/sources.list"),
        Path::new("/etc/apt/sources.list.d"),
        &["debian-archive-keyring".to_string()],
    )?;
    let key = root.join(DEBIAN_KEYRING);
    anyhow::ensure!(key.exists(), "Ubuntu's debian-archive-keyring left no {DEBIAN_KEYRING}");
    Ok(key)
}

/// Points `link` at `target` (a fixture's cache), replacing what was there.
pub fn link(link: &Path, target: &Path) -> Result<()> {
    use anyhow::Context;
    if std::fs::read_link(link).ok().as_deref() != Some(target) {
        let _ = std::fs::remove_file(link);
        std::os::unix::fs::symlink(target, link).with_context(|| format!("linking {}", link.display()))?;
    }
    Ok(())
}
