//! Debian's newer CPythons as test fixtures, never installed: trixie's
//! python3.13 and sid's python3.14 (built with probes for audit/gc/import
//! but not function__entry, and with `endbr64`: the frame hook's case on a
//! distribution build). Each is fetched with `apt-get download` against a
//! private apt state (the host's sources and pins untouched), unpacked with
//! `dpkg -x` together with its suite's glibc, and run through that glibc's
//! loader: `root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
//! --library-path … root/usr/bin/python3.X`. Cached under
//! /var/cache/profiler so that a machine fetches them once.
use std::path::Path;

use anyhow::{Result, bail};

use crate::say;

/// `(suite, version)`: the interpreters fetched.
pub const PYTHONS: [(&str, &str); 2] = [("trixie", "3.13"), ("sid", "3.14")];

/// Fetches and unpacks each suite's interpreter unless already there, and
/// links `fixtures/debian-python` to the cache. A suite that cannot be
/// fetched (no network, a package gone) is said and left out: the tests
/// then skip it visibly.
pub fn fetch(fixtures: &Path) -> Result<()> {
    let cache = crate::debian_debs::cache_dir("debian-python");
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
    crate::debian_debs::link(&fixtures.join("debian-python"), &cache)
}

fn fetch_suite(dir: &Path, suite: &str, version: &str) -> Result<()> {
    let packages = [
        format!("python{version}-minimal"),
        format!("libpython{version}-minimal"),
        format!("libpython{version}-stdlib"),
        "libc6".into(),
        "libexpat1".into(),
        "zlib1g".into(),
    ];
    let root = crate::debian_debs::fetch_and_unpack(dir, &crate::debian_debs::Source::main(suite), &packages)?;
    if !root.join(format!("usr/bin/python{version}")).exists() {
        bail!("python{version}-minimal left no usr/bin/python{version}");
    }
    Ok(())
}
