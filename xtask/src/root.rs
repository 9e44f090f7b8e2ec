//! The few steps that need root (loading eBPF programs, apt), and only those:
//! everything else, builds included, runs as the user who ran `cargo xtask`,
//! so that `target/` and `~/.cargo` stay theirs. Run as root, as CI does,
//! nothing changes; run as a user, those steps go through `sudo`, which asks
//! for a password once. (`sudo cargo xtask …` often cannot find rustup's
//! cargo: sudo's `secure_path` replaces the user's PATH.)
use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// `program` with `env`, as root: as it is when xtask already runs as root,
/// else through `sudo env K=V… program` (sudo resets the environment, so what
/// the step needs is passed by name). `why` says what needs root.
pub fn command(program: impl AsRef<OsStr>, env: &[(&str, &OsStr)], why: &str) -> Result<Command> {
    if is_root() {
        let mut c = Command::new(program);
        c.envs(env.iter().copied());
        return Ok(c);
    }
    if which::which("sudo").is_err() {
        bail!(
            "{why} needs root, and there is no sudo here: run this as root, with rustup's cargo on root's PATH \
             (e.g. `su -c 'PATH=\"$PATH\" cargo xtask …'`)"
        );
    }
    crate::say(format!("{why} needs root: asking sudo"));
    let mut c = Command::new("sudo");
    c.arg("env");
    for (k, v) in env {
        let mut kv = std::ffi::OsString::from(format!("{k}="));
        kv.push(v);
        c.arg(kv);
    }
    c.arg(program);
    Ok(c)
}

/// The test executables of the whole workspace (release), built in one
/// cargo run so that each dependency is built once, with the features all
/// the tests use (a run per package would unify them per package and build
/// many twice); `extra`: more `cargo test` arguments (e.g. `--test NAME` for
/// one target first). Each comes with its package's directory, relative to
/// the workspace root (`profiler`, `tests`, …).
pub fn workspace_test_executables(extra: &[&str]) -> Result<Vec<(String, PathBuf)>> {
    let out = crate::cargo()
        .current_dir(crate::root())
        .args(["test", "--release", "--workspace", "--no-run", "--message-format=json"])
        .args(extra)
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the workspace's tests failed");
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let is_test = msg["reason"] == "compiler-artifact" && msg["profile"]["test"] == true;
        let (Some(exe), Some(manifest)) = (msg["executable"].as_str(), msg["manifest_path"].as_str()) else {
            continue;
        };
        let package = Path::new(manifest).parent().and_then(|d| d.strip_prefix(crate::root()).ok());
        if let (true, Some(package)) = (is_test, package) {
            exes.push((package.to_string_lossy().into_owned(), PathBuf::from(exe)));
        }
    }
    if exes.is_empty() {
        bail!("cargo built no test executable");
    }
    Ok(exes)
}

/// The directory cargo runs a package's tests in: the package's own.
pub fn package_dir(package_path: &str) -> PathBuf {
    crate::root().join(Path::new(package_path))
}
