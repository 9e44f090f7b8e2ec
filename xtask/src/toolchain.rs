//! Installing what a fresh machine lacks for the eBPF build, and nothing
//! else: rust-src for nightly, bpf-linker linked against the nightly
//! toolchain's own LLVM (so no system LLVM, on any distribution), and gcc
//! from the host release's own archive where it is missing. No foreign
//! release's sources, no pins, no package changed that setup does not name.
//! Each step checks first and says what it does.
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use crate::{
    cargo,
    distro::{self, Release},
    run, say,
};

const BPF_LINKER_VERSION: &str = "0.13.0";
/// The LLVM major bpf-linker 0.13's `llvm-22` feature binds to.
const LLVM_MAJOR: &str = "22";
/// What the C fixtures and the Rust linker driver need (`cc` is gcc on Debian and Ubuntu).
const C_PACKAGES: [&str; 2] = ["gcc", "libc6-dev"];

fn output(cmd: &mut Command) -> Option<String> {
    let o = cmd.stderr(Stdio::null()).output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).into_owned())
}

/// The host's release, if it is one this setup knows.
pub fn host_release() -> Result<std::result::Result<Release, String>> {
    let text = std::fs::read_to_string("/etc/os-release")
        .or_else(|_| std::fs::read_to_string("/usr/lib/os-release"))
        .context("cannot read /etc/os-release")?;
    let os = distro::parse_os_release(&text);
    Ok(distro::known_release(&os).ok_or_else(|| distro::unknown_release_advice(&os)))
}

/// Everything setup does: gcc, then the eBPF toolchain.
pub fn setup() -> Result<()> {
    ensure_c_compiler()?;
    ensure_ebpf_toolchain()?;
    warn_old_setup_files();
    say("setup: nothing else to do");
    Ok(())
}

/// An earlier setup added Debian trixie (pinned low) and bookworm non-free to
/// apt's sources. They are no longer used; they are the machine owner's to
/// remove (setup writes nothing under /etc/apt).
fn warn_old_setup_files() {
    for f in [
        "/etc/apt/sources.list.d/profiler-trixie.sources",
        "/etc/apt/preferences.d/profiler-trixie",
        "/etc/apt/sources.list.d/profiler-nonfree.sources",
    ] {
        if Path::new(f).exists() {
            say(format!("{f} was written by an older `cargo xtask setup` and is no longer needed: remove it"));
        }
    }
}

/// gcc on PATH, or installed from the host release's own archive: `apt-get
/// update`, then an `apt-get install` whose simulated plan adds only new
/// packages from that release (named before installing) and changes none.
pub fn ensure_c_compiler() -> Result<()> {
    if which::which("gcc").is_ok() {
        return Ok(());
    }
    let release = match host_release()? {
        Ok(r) if r.builds => r,
        Ok(r) => bail!(
            "{} is too old to build on (its glibc and kernel): build with `cargo xtask dist` on Debian 12/13 or Ubuntu 22.04/24.04 and copy the binary here",
            r.name()
        ),
        Err(advice) => bail!("no gcc here, and {advice}"),
    };
    let origin = release.name();
    say(format!("installing {} from {origin}'s own archive (apt-get update first)", C_PACKAGES.join(" and ")));
    run(crate::root::command("apt-get", &[], "apt-get update")?.args(["update", "-q"]))?;
    let mut simulate = Command::new("apt-get");
    simulate.args(["install", "-s", "--no-install-recommends"]).args(C_PACKAGES);
    let plan = output(&mut simulate).context("apt-get install -s failed")?;
    let added = distro::check_plan(&distro::parse_apt_simulation(&plan), &release)
        .map_err(|why| anyhow::anyhow!("not installing gcc: {why}; install gcc yourself"))?;
    say(format!("apt-get install --no-install-recommends {}: adds {}", C_PACKAGES.join(" "), added.join(" ")));
    let noninteractive = [("DEBIAN_FRONTEND", std::ffi::OsStr::new("noninteractive"))];
    run(crate::root::command("apt-get", &noninteractive, "apt-get install")?
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(C_PACKAGES))
}

/// The nightly toolchain's libLLVM (`libLLVM.so.22.1-rust-1.97.0-nightly`),
/// which rustup builds for an old glibc and which needs only libc, libz and
/// libgcc_s.
fn nightly_libllvm() -> Result<PathBuf> {
    let sysroot = output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))
        .context("`rustc +nightly` does not run: install nightly with `rustup toolchain install nightly`")?;
    let lib = Path::new(sysroot.trim()).join("lib");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&lib)
        .with_context(|| format!("cannot list {}", lib.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("libLLVM.so.")))
        .collect();
    found.sort();
    let Some(path) = found.pop() else {
        bail!("no libLLVM.so.* in {}: nightly ships one; reinstall it", lib.display())
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if name.strip_prefix("libLLVM.so.").and_then(|v| v.split('.').next()) != Some(LLVM_MAJOR) {
        bail!("nightly's LLVM is {name}, and bpf-linker {BPF_LINKER_VERSION} is built here for LLVM {LLVM_MAJOR}");
    }
    Ok(path)
}

/// rust-src for nightly, and bpf-linker of the right version that runs (one
/// built against a nightly since removed no longer finds its libLLVM).
pub fn ensure_ebpf_toolchain() -> Result<()> {
    let installed = output(Command::new("rustup").args(["component", "list", "--toolchain", "nightly", "--installed"]))
        .context("rustup has no nightly toolchain: install one with `rustup toolchain install nightly`")?;
    if !installed.lines().any(|l| l.starts_with("rust-src")) {
        say("installing rust-src for nightly (the eBPF target builds core from source)");
        run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))?;
    }
    let want = format!("bpf-linker {BPF_LINKER_VERSION}");
    match Command::new("bpf-linker").arg("--version").output() {
        Ok(o) if o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == want => return Ok(()),
        Ok(o) if o.status.success() => {
            say(format!("bpf-linker is {}, not {BPF_LINKER_VERSION}", String::from_utf8_lossy(&o.stdout).trim()))
        }
        Ok(o) => say(format!("bpf-linker does not run ({}): rebuilding it", String::from_utf8_lossy(&o.stderr).trim())),
        Err(_) => {}
    }
    let llvm = nightly_libllvm()?;
    let dir = llvm.parent().context("libLLVM has a directory")?;
    say(format!(
        "installing bpf-linker {BPF_LINKER_VERSION} linked against nightly's {} (about a minute)",
        llvm.display()
    ));
    // `no-llvm-linking`: llvm-sys links no LLVM of its own; the library is
    // named on the link line, and the rpath finds it where rustup keeps it.
    let rustflags = format!("-C link-arg={} -C link-arg=-Wl,-rpath,{}", llvm.display(), dir.display());
    // From `/`: no rust-toolchain.toml picks the compiler (the workspace's
    // root may not exist where setup runs, as in the install test's root).
    // The build stays in the cache: a later install (another nightly, a
    // failed link) rebuilds only what changed.
    let build_dir = crate::debian_debs::cache_dir("bpf-linker-build");
    run(cargo().current_dir("/").env("RUSTFLAGS", rustflags).arg("install").arg("--target-dir").arg(&build_dir).args(
        [
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--no-default-features",
            "--features",
            "llvm-22,no-llvm-linking",
            "--locked",
            "--force",
        ],
    ))?;
    let version = output(Command::new("bpf-linker").arg("--version"))
        .context("the bpf-linker just installed does not run (is ~/.cargo/bin on PATH?)")?;
    if version.trim() != want {
        bail!("the bpf-linker on PATH says {:?}, not {want}: another one comes first on PATH", version.trim());
    }
    Ok(())
}

/// Unpacks Debian 12's non-free libcuda1 and libnvidia-ml1 (NVIDIA 535) into
/// `dir`: `dir/lib/libcuda.so.1` and `dir/lib/libnvidia-ml.so.1`. A test
/// fixture, never installed: fetched against a private apt state, so nothing
/// under /etc/apt changes. Bookworm's on every host, Ubuntu's too: the
/// placement tests are written against that build of the library.
pub fn fetch_genuine_nvidia(dir: &Path) -> Result<()> {
    let wanted =
        [("libcuda1", "libcuda.so.5", "libcuda.so.1"), ("libnvidia-ml1", "libnvidia-ml.so.5", "libnvidia-ml.so.1")];
    if wanted.iter().all(|(_, _, name)| dir.join("lib").join(name).exists()) {
        return Ok(());
    }
    say("downloading Debian 12's non-free libcuda1 and libnvidia-ml1 (genuine NVIDIA 535 libraries, a test fixture)");
    let source = crate::debian_debs::Source { suite: "bookworm", components: &["non-free"] };
    let packages = wanted.iter().map(|(p, _, _)| p.to_string()).collect::<Vec<_>>();
    let unpacked = crate::debian_debs::fetch_and_unpack(&dir.join("apt-fetch"), &source, &packages)?;
    std::fs::create_dir_all(dir.join("lib"))?;
    for (package, prefix, name) in wanted {
        let found = walk(&unpacked)
            .into_iter()
            .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(prefix)))
            .with_context(|| format!("no {prefix}* in {package}"))?;
        std::fs::copy(&found, dir.join("lib").join(name))?;
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
