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

/// The test executables `cargo test --no-run` builds for `package` (release),
/// built as the user, to be run as root by [`command`].
pub fn test_executables(package: &str) -> Result<Vec<PathBuf>> {
    let out = crate::cargo()
        .current_dir(crate::root())
        .args(["test", "--release", "-p", package, "--no-run", "--message-format=json"])
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the tests of {package} failed");
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let is_test = msg["reason"] == "compiler-artifact" && msg["profile"]["test"] == true;
        if let (true, Some(exe)) = (is_test, msg["executable"].as_str()) {
            exes.push(PathBuf::from(exe));
        }
    }
    if exes.is_empty() {
        bail!("cargo built no test executable for {package}");
    }
    Ok(exes)
}

/// The directory cargo runs a package's tests in: the package's own.
pub fn package_dir(package_path: &str) -> PathBuf {
    crate::root().join(Path::new(package_path))
}
