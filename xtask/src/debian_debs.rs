//! Debian packages as test fixtures, never installed: `apt-get download`
//! against a private apt state (the host's sources, pins and dpkg status
//! untouched) and `dpkg -x` into a folder of the caller's.
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
    if std::fs::create_dir_all(&shared).is_ok() { shared } else { crate::fixtures_dir().join(format!("{name}-cache")) }
}

/// Downloads `packages` from Debian's `suite` (component `main`) into
/// `dir/apt` and unpacks them all into `dir/root`; returns that root.
pub fn fetch_and_unpack(dir: &Path, suite: &str, packages: &[String]) -> Result<PathBuf> {
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

/// Points `link` at `target` (a fixture's cache), replacing what was there.
pub fn link(link: &Path, target: &Path) -> Result<()> {
    use anyhow::Context;
    if std::fs::read_link(link).ok().as_deref() != Some(target) {
        let _ = std::fs::remove_file(link);
        std::os::unix::fs::symlink(target, link).with_context(|| format!("linking {}", link.display()))?;
    }
    Ok(())
}
