//! Installing what a fresh Debian 12 machine lacks for the eBPF build and the
//! genuine-driver test. Each step checks first and says what it does.
use std::{
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use crate::{cargo, run, say};

const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
const BPF_LINKER_VERSION: &str = "0.13.0";

fn output(cmd: &mut Command) -> Option<String> {
    let o = cmd.stderr(Stdio::null()).output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).into_owned())
}

fn apt_candidate(package: &str) -> Option<String> {
    let out = output(Command::new("apt-cache").args(["policy", package]))?;
    let cand = out.lines().find_map(|l| l.trim().strip_prefix("Candidate:"))?.trim().to_owned();
    (cand != "(none)").then_some(cand)
}

fn write_if_absent(path: &str, contents: &str) -> Result<bool> {
    if Path::new(path).exists() {
        return Ok(false);
    }
    crate::root::write_file(path, contents)?;
    Ok(true)
}

fn apt_update() -> Result<()> {
    run(crate::root::command("apt-get", &[], "apt-get update")?.args(["update", "-qq"]))
}

/// Debian 12 had no LLVM 22 (its security suite has one now); Debian 13
/// (trixie) does. Where no configured suite has it, trixie is added at a low
/// pin priority, so nothing else on the machine moves to trixie except what
/// llvm-22-dev needs.
fn ensure_llvm22() -> Result<()> {
    if Path::new(LLVM_PREFIX).join("bin/llvm-config").exists() {
        return Ok(());
    }
    let mut args = vec!["install", "-y", "-q"];
    match apt_candidate("llvm-22-dev") {
        Some(version) => say(format!("installing llvm-22-dev {version} (needed to build bpf-linker)")),
        None => {
            say("adding Debian trixie (pinned low) to apt sources for llvm-22-dev");
            write_if_absent(
                "/etc/apt/sources.list.d/profiler-trixie.sources",
                "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\n\
                 Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n",
            )?;
            write_if_absent(
                "/etc/apt/preferences.d/profiler-trixie",
                "Package: *\nPin: release n=trixie\nPin-Priority: 100\n",
            )?;
            apt_update()?;
            say("installing llvm-22-dev from Debian trixie (needed to build bpf-linker)");
            args.extend(["-t", "trixie"]);
        }
    }
    args.push("llvm-22-dev");
    let noninteractive = [("DEBIAN_FRONTEND", std::ffi::OsStr::new("noninteractive"))];
    run(crate::root::command("apt-get", &noninteractive, "apt-get install")?.args(args))
}

/// rust-src for nightly, and bpf-linker built against LLVM 22.
pub fn ensure_ebpf_toolchain() -> Result<()> {
    let installed = output(Command::new("rustup").args(["component", "list", "--toolchain", "nightly", "--installed"]))
        .context("rustup has no nightly toolchain: install one with `rustup toolchain install nightly`")?;
    if !installed.lines().any(|l| l.starts_with("rust-src")) {
        say("installing rust-src for nightly (the eBPF target builds core from source)");
        run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))?;
    }
    let linker_ok = output(Command::new("bpf-linker").arg("--version")).is_some_and(|v| v.contains(BPF_LINKER_VERSION));
    if !linker_ok {
        ensure_llvm22()?;
        say(format!("installing bpf-linker {BPF_LINKER_VERSION} against LLVM 22 (a few minutes)"));
        run(cargo()
            .args([
                "install",
                "bpf-linker",
                "--version",
                BPF_LINKER_VERSION,
                "--no-default-features",
                "--features",
                "llvm-22",
            ])
            .env("LLVM_PREFIX", LLVM_PREFIX))?;
    }
    Ok(())
}

/// Debian's non-free component, where the genuine driver library lives.
pub fn ensure_nonfree() -> Result<()> {
    if apt_candidate("libcuda1").is_some() {
        return Ok(());
    }
    say("adding Debian bookworm non-free to apt sources (for the genuine libcuda1 test fixture)");
    write_if_absent(
        "/etc/apt/sources.list.d/profiler-nonfree.sources",
        "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: non-free\n\
         Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n",
    )?;
    apt_update()?;
    if apt_candidate("libcuda1").is_none() {
        bail!("libcuda1 is still not available from apt after adding non-free");
    }
    Ok(())
}

/// Unpacks Debian's libcuda1 and libnvidia-ml1 (NVIDIA 535) into `dir`: the
/// libraries end up as `dir/lib/libcuda.so.1` and `dir/lib/libnvidia-ml.so.1`.
pub fn fetch_genuine_nvidia(dir: &Path) -> Result<()> {
    for (package, prefix, name) in
        [("libcuda1", "libcuda.so.5", "libcuda.so.1"), ("libnvidia-ml1", "libnvidia-ml.so.5", "libnvidia-ml.so.1")]
    {
        let lib = dir.join("lib").join(name);
        if lib.exists() {
            continue;
        }
        ensure_nonfree()?;
        let dl = dir.join("download").join(package);
        std::fs::create_dir_all(&dl)?;
        say(format!("downloading Debian's {package} (genuine NVIDIA 535 library, a test fixture)"));
        run(Command::new("apt-get").current_dir(&dl).args(["download", "-q", package]))?;
        let deb = std::fs::read_dir(&dl)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|e| e == "deb"))
            .context("apt-get download left no .deb")?;
        let unpacked = dir.join("root").join(package);
        // dpkg -x creates only the last path component.
        std::fs::create_dir_all(&unpacked)?;
        run(Command::new("dpkg").arg("-x").arg(&deb).arg(&unpacked))?;
        let found = walk(&unpacked)
            .into_iter()
            .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(prefix)))
            .with_context(|| format!("no {prefix}* in {package}"))?;
        std::fs::create_dir_all(dir.join("lib"))?;
        std::fs::copy(&found, &lib)?;
    }
    Ok(())
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() && !p.is_symlink() {
                out.extend(walk(&p));
            } else if p.is_file() && !p.is_symlink() {
                out.push(p);
            }
        }
    }
    out
}
