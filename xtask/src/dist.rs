//! `cargo xtask dist`: the one file a training node needs,
//! `target/dist/profiler-x86_64-linux-gnu` (eBPF object inside, glibc 2.31 or
//! newer: Debian 11, Ubuntu 20.04 and later), and its `.sha256`. Not static:
//! NVML is `dlopen`ed (nvml-wrapper uses libloading), which a static musl
//! binary cannot do, so it is linked against glibc 2.31's symbols with
//! cargo-zigbuild and zig, both from PyPI into a virtual environment under the
//! cache (nothing installed system-wide), and in its own target folder so that
//! the normal build is not invalidated.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{cargo, gpu, root, run, say};

/// The oldest glibc the dist binary loads on (Debian 11: 2.31, Ubuntu 20.04: 2.31).
pub const GLIBC: &str = "2.31";
const TARGET: &str = "x86_64-unknown-linux-gnu";
/// PyPI's `ziglang` (zig itself) and `cargo-zigbuild` (a prebuilt binary), pinned.
const PYPI: [&str; 2] = ["ziglang==0.15.2", "cargo-zigbuild==0.24.0"];

pub fn dist_bin() -> PathBuf {
    root().join("target/dist/profiler-x86_64-linux-gnu")
}

/// A Python 3 with its venv module: Debian's, else the first on PATH.
fn python() -> PathBuf {
    let debian = Path::new("/usr/bin/python3");
    if debian.exists() { debian.to_owned() } else { PathBuf::from("python3") }
}

/// The venv's bin folder, with `cargo-zigbuild` and `python -m ziglang`.
fn zig_tools() -> Result<PathBuf> {
    let venv = crate::debian_debs::cache_dir("zig").join(PYPI.join("-").replace("==", "-"));
    let bin = venv.join("bin");
    if bin.join("cargo-zigbuild").exists() && bin.join("python").exists() {
        return Ok(bin);
    }
    say(format!("installing {} from PyPI into {} (nothing system-wide)", PYPI.join(" and "), venv.display()));
    let _ = std::fs::remove_dir_all(&venv);
    run(Command::new(python()).args(["-m", "venv"]).arg(&venv)).context(
        "making the venv for zig failed: it needs python3 with its venv module (Debian/Ubuntu: python3-venv)",
    )?;
    run(Command::new(bin.join("python")).args(["-m", "pip", "install", "-q"]).args(PYPI))?;
    Ok(bin)
}

/// Builds the dist binary and checks it: eBPF object inside, only glibc's
/// own libraries needed, no symbol version newer than [`GLIBC`].
pub fn dist() -> Result<PathBuf> {
    crate::build_ebpf()?;
    let ebpf = root().join("profiler-ebpf/target/bpfel-unknown-none/release/profiler-ebpf");
    let object = std::fs::read(&ebpf).with_context(|| format!("reading the eBPF object {}", ebpf.display()))?;
    let tools = zig_tools()?;
    let path = std::env::join_paths(
        std::iter::once(tools.clone()).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
    )?;
    let target_dir = root().join("target/dist-build");
    say(format!("building the profiler for {TARGET} with glibc {GLIBC} (cargo-zigbuild, in {})", target_dir.display()));
    run(cargo()
        .current_dir(root())
        .env("PATH", path)
        .env("PROFILER_EBPF_OBJECT", &ebpf)
        // No line tables: they are stripped below anyway, and cost the build time.
        .env("CARGO_PROFILE_RELEASE_DEBUG", "0")
        .args(["zigbuild", "--release", "-p", "profiler", "--target", &format!("{TARGET}.{GLIBC}"), "--target-dir"])
        .arg(&target_dir))?;
    let built = target_dir.join(TARGET).join("release/profiler");

    let out = dist_bin();
    std::fs::create_dir_all(out.parent().context("dist has a folder")?)?;
    // The release profile keeps line tables (for the bench's profiles); a node does not need them.
    run(Command::new("objcopy").arg("--strip-debug").arg(&built).arg(&out))
        .context("objcopy (binutils, which comes with gcc) strips the debug info")?;
    let mut elf = std::fs::read(&out)?;
    if !contains(&elf, &object) {
        bail!("{} does not hold the eBPF object {} byte for byte", out.display(), ebpf.display());
    }
    let needs = gpu::weaken_optional_glibc_versions(&mut elf).context("reading the profiler's symbol versions")?;
    std::fs::write(&out, &elf)?;
    let floor = gpu::glibc_floor(&needs).unwrap_or_else(|| "none".into());
    if version_key(&floor) > version_key(GLIBC) {
        let newer: Vec<&str> = needs
            .iter()
            .filter(|n| !n.weak && n.name.strip_prefix("GLIBC_").is_some_and(|v| version_key(v) > version_key(GLIBC)))
            .map(|n| n.name.as_str())
            .collect();
        bail!("{} needs glibc {floor} ({}), newer than {GLIBC}", out.display(), newer.join(", "));
    }
    let libs = gpu::dynamic_needs(&out)?;
    let foreign: Vec<&String> = libs.iter().filter(|n| !gpu::SYSTEM_LIBS.iter().any(|s| n.starts_with(s))).collect();
    if !foreign.is_empty() {
        bail!("{} needs libraries a bare training node may lack: {foreign:?}", out.display());
    }
    let sum = Command::new("sha256sum")
        .current_dir(out.parent().context("dist has a folder")?)
        .arg(out.file_name().context("dist binary has a name")?)
        .output()
        .context("cannot run sha256sum")?;
    if !sum.status.success() {
        bail!("sha256sum failed");
    }
    let sha_file = out.with_extension("sha256");
    std::fs::write(&sha_file, &sum.stdout)?;
    println!(
        "\n{}  {}\n  needs {} (glibc {floor} or newer); eBPF object inside ({} KiB)\n  sha256 in {}",
        out.display(),
        gpu::human(elf.len() as u64),
        libs.join(", "),
        object.len() / 1024,
        sha_file.display()
    );
    println!("on a training node: copy that one file, then `sudo ./profiler-x86_64-linux-gnu doctor`");
    Ok(out)
}

/// The synthetic trainer and the stand-in libcuda built against glibc
/// [`GLIBC`] (zig's C compiler), into `target/dist/fixtures/`: the install
/// tests run them beside the dist binary in a Debian 11 root, whose glibc
/// is older than the host's (which `cargo xtask fixtures` builds against).
pub fn old_glibc_fixtures() -> Result<PathBuf> {
    let tools = zig_tools()?;
    let dir = root().join("target/dist/fixtures");
    std::fs::create_dir_all(&dir)?;
    let src = root().join("tests/fixtures");
    let zig_cc = |args: &[&str]| -> Result<()> {
        run(Command::new(tools.join("python"))
            .current_dir(&src)
            .args(["-m", "ziglang", "cc", "-target", &format!("x86_64-linux-gnu.{GLIBC}"), "-O2", "-g", "-Wall"])
            .args(args))
    };
    say(format!("building the trainer and the stand-in libcuda for glibc {GLIBC} into {}", dir.display()));
    let lib = dir.join("libcuda.so.1").display().to_string();
    zig_cc(&["-shared", "-fPIC", "-fvisibility=hidden", "-Wl,-soname,libcuda.so.1", "-o", &lib, "fake_cuda.c"])?;
    let trainer = dir.join("trainer").display().to_string();
    zig_cc(&["-rdynamic", "-o", &trainer, "trainer.c", "-ldl", "-lpthread"])?;
    Ok(dir)
}

/// `2.31` → (2, 31, 0); anything unparsable sorts first.
fn version_key(v: &str) -> (u32, u32, u32) {
    let mut p = v.split('.').map(|x| x.parse::<u32>().unwrap_or(0));
    (p.next().unwrap_or(0), p.next().unwrap_or(0), p.next().unwrap_or(0))
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    let Some(first) = needle.first() else { return true };
    haystack
        .iter()
        .enumerate()
        .filter(|(_, b)| *b == first)
        .any(|(i, _)| haystack.get(i..i + needle.len()) == Some(needle))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_versions_compare_by_number() {
        assert!(version_key("2.34") > version_key(GLIBC));
        assert!(version_key("2.4") < version_key(GLIBC));
        assert!(version_key("2.31") == version_key("2.31.0"));
        assert!(version_key("none") < version_key(GLIBC));
    }

    #[test]
    fn finds_the_object_inside() {
        assert!(contains(b"xx\x7fELFab\x7fELFabc!", b"\x7fELFabc"));
        assert!(!contains(b"xx\x7fELFab", b"\x7fELFabc"));
    }
}
