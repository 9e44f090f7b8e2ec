//! Debian's newer CPythons as test fixtures, never installed: trixie's
//! python3.13 and sid's python3.14 (built with probes for audit/gc/import
//! but not function__entry, and with `endbr64`: the frame hook's case on a
//! distribution build). Each is fetched with `apt-get download` against a
//! private apt state (the host's sources and pins untouched), unpacked with
//! `dpkg -x` together with its suite's glibc, and run through that glibc's
//! loader: `root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
//! --library-path … root/usr/bin/python3.X`. Cached under
//! /var/cache/profiler so that a machine fetches them once.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{run, say};

/// `(suite, version)`: the interpreters fetched.
pub const PYTHONS: [(&str, &str); 2] = [("trixie", "3.13"), ("sid", "3.14")];

const CACHE: &str = "/var/cache/profiler/debian-python";

/// Where the unpacked suites live: `/var/cache/profiler/debian-python`, or
/// under target/ where that cannot be made.
fn cache_dir() -> PathBuf {
    let shared = PathBuf::from(CACHE);
    if std::fs::create_dir_all(&shared).is_ok() { shared } else { crate::fixtures_dir().join("debian-python-cache") }
}

/// Fetches and unpacks each suite's interpreter unless already there, and
/// links `fixtures/debian-python` to the cache. A suite that cannot be
/// fetched (no network, a package gone) is said and left out: the tests
/// then skip it visibly.
pub fn fetch(fixtures: &Path) -> Result<()> {
    let cache = cache_dir();
    for (suite, version) in PYTHONS {
        let dir = cache.join(suite);
        if dir.join(format!("root/usr/bin/python{version}")).exists() {
            continue;
        }
        say(format!("fetching Debian {suite}'s python{version} and glibc (a test fixture, not installed)"));
        if let Err(e) = fetch_suite(&dir, suite, version) {
            say(format!("Debian {suite}'s python{version} is not available: {e:#}"));
            let _ = std::fs::remove_dir_all(dir.join("root"));
        }
    }
    let link = fixtures.join("debian-python");
    if std::fs::read_link(&link).ok().as_deref() != Some(cache.as_path()) {
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&cache, &link).with_context(|| format!("linking {}", link.display()))?;
    }
    Ok(())
}

fn fetch_suite(dir: &Path, suite: &str, version: &str) -> Result<()> {
    let apt = dir.join("apt");
    for d in ["lists/partial", "cache/archives/partial", "debs"] {
        std::fs::create_dir_all(apt.join(d))?;
    }
    std::fs::write(
        apt.join("sources.list"),
        format!(
            "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian {suite} main\n"
        ),
    )?;
    std::fs::write(apt.join("status"), "")?;
    let opt = |k: &str, v: &Path| ["-o".to_string(), format!("{k}={}", v.display())];
    let mut opts: Vec<String> = Vec::new();
    for (k, v) in [
        ("Dir::Etc::SourceList", apt.join("sources.list")),
        ("Dir::Etc::SourceParts", "/dev/null".into()),
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
    let packages = [
        format!("python{version}-minimal"),
        format!("libpython{version}-minimal"),
        format!("libpython{version}-stdlib"),
        "libc6".into(),
        "libexpat1".into(),
        "zlib1g".into(),
    ];
    run(Command::new("apt-get").current_dir(&debs).args(&opts).args(["-q", "download"]).args(&packages))?;
    let root = dir.join("root");
    std::fs::create_dir_all(&root)?;
    for deb in std::fs::read_dir(&debs)? {
        let deb = deb?.path();
        if deb.extension().is_some_and(|e| e == "deb") {
            run(Command::new("dpkg").arg("-x").arg(&deb).arg(&root))?;
        }
    }
    if !root.join(format!("usr/bin/python{version}")).exists() {
        bail!("python{version}-minimal left no usr/bin/python{version}");
    }
    Ok(())
}
