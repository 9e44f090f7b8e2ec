//! Debian trixie's Prometheus 2.53, the server the live-metrics test has
//! scrape `--prometheus`, fetched and unpacked as a test fixture, never
//! installed. (Debian builds it, 2.53 and sid's 3.5 alike, with the OTLP
//! receiver disabled: the `--otlp` test decodes pushes itself.) A static Go
//! binary: nothing else from the suite is needed. Linked as `fixtures/prometheus`.
use std::path::Path;

use anyhow::{Result, bail};

use crate::say;

const SUITE: &str = "trixie";

/// Fetches it unless already there; one that cannot be fetched is said and
/// left out, and the tests that need it skip visibly.
pub fn fetch(fixtures: &Path) -> Result<()> {
    let cache = crate::debian_debs::cache_dir("debian-prometheus");
    let dir = cache.join(SUITE);
    if !dir.join("root/usr/bin/prometheus").exists() {
        say(format!("fetching Debian {SUITE}'s prometheus (a test fixture, not installed)"));
        let fetched = crate::debian_debs::fetch_and_unpack(
            &dir,
            &crate::debian_debs::Source::main(SUITE),
            &["prometheus".to_string()],
        )
        .and_then(|root| {
            if !root.join("usr/bin/prometheus").exists() {
                bail!("the prometheus package left no usr/bin/prometheus");
            }
            Ok(())
        });
        if let Err(e) = fetched {
            say(format!("Debian {SUITE}'s prometheus is not available: {e:#}"));
            let _ = std::fs::remove_dir_all(dir.join("root"));
        }
        // The .deb itself is no longer needed.
        let _ = std::fs::remove_dir_all(dir.join("apt/debs"));
        let _ = std::fs::remove_dir_all(dir.join("apt/cache"));
        let _ = std::fs::remove_dir_all(dir.join("apt/lists"));
    }
    crate::debian_debs::link(&fixtures.join("prometheus"), &dir.join("root/usr/bin/prometheus"))
}
