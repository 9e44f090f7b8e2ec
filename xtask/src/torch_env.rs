//! A real PyTorch for the tests and the benchmark: the pinned wheels
//! from PyPI, downloaded once into a cache, and one virtual environment per
//! Python on the machine image (Debian's 3.11, pyenv's 3.12 and 3.13), kept
//! in the cache too, so a repeated run (or a fresh clone on the same machine)
//! fetches and installs nothing.
//!
//! CPU use only: the CUDA wheel runs on CPU, but `import torch` preloads
//! cuBLAS, cuDNN, NCCL, … from the `nvidia-*` wheels and fails without them
//! (checked with 2.15.0), so they are installed; `triton`, `cuda-bindings`
//! and `jinja2` are not needed to import torch and train, and are left out
//! (`--no-deps` with an explicit list), which also spares downloading their
//! per-Python wheels.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};

use crate::{run, say};

pub const TORCH_VERSION: &str = "2.15.0";

/// What `import torch` and a training loop need, besides torch itself.
const PACKAGES: &[&str] = &[
    "numpy",
    "filelock",
    "typing_extensions",
    "sympy",
    "mpmath",
    "networkx",
    "fsspec",
    "nvidia-cublas",
    "nvidia-cudnn-cu13",
    "nvidia-cuda-nvrtc",
    "nvidia-cuda-runtime",
    "nvidia-cuda-cupti",
    "nvidia-cufft",
    "nvidia-nvjitlink",
    "nvidia-cusparse",
    "nvidia-cusparselt-cu13",
    "nvidia-cusolver",
    "nvidia-nccl-cu13",
    "nvidia-nvshmem-cu13",
    "nvidia-cufile",
    "nvidia-nvtx",
];

/// The Pythons to provide, where the machine has them: (name, interpreter).
pub const PYTHONS: &[(&str, &str)] = &[
    ("python3.11", "/usr/bin/python3.11"),
    ("python3.12", "/root/.pyenv/versions/3.12.1/bin/python3.12"),
    ("python3.13", "/root/.pyenv/versions/3.13.0/bin/python3.13"),
];

/// The cache: `PROFILER_TORCH_CACHE`, else /var/cache/profiler where it can
/// be written (root), else `target/torch-cache`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PROFILER_TORCH_CACHE") {
        return d.into();
    }
    let system = Path::new("/var/cache/profiler");
    if std::fs::create_dir_all(system).is_ok() && access_w(system) {
        return system.to_owned();
    }
    crate::root().join("target/torch-cache")
}

fn access_w(p: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: a NUL-terminated path; access has no other preconditions.
    unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
}

/// Makes every environment whose interpreter exists; returns the ready ones
/// (name, its Python). A Python that cannot get one is reported, not fatal:
/// the tests that need it skip, saying why.
pub fn ensure_all() -> Vec<(String, PathBuf)> {
    let mut ready = Vec::new();
    for (name, python) in PYTHONS {
        if !Path::new(python).exists() {
            say(format!("torch-env: {python} is not on this machine: no {name} environment"));
            continue;
        }
        match ensure(name, Path::new(python)) {
            Ok(p) => ready.push((name.to_string(), p)),
            Err(e) => say(format!("torch-env: no PyTorch for {name}: {e:#}")),
        }
    }
    ready
}

fn ensure(name: &str, python: &Path) -> Result<PathBuf> {
    let cache = cache_dir();
    let venv = cache.join(format!("venvs/{name}-torch{TORCH_VERSION}"));
    let marker = venv.join(".profiler-ready");
    if marker.exists() && venv.join("bin/python").exists() {
        // Environments made before the scripts' `#!` lines were mended (the
        // environment works without: everything here runs `python -m`).
        if let Err(e) = mend_scripts(&venv) {
            say(format!("torch-env: {}'s scripts (torchrun, pip) not mended: {e:#}", venv.display()));
        }
        return Ok(venv.join("bin/python"));
    }
    let wheels = cache.join("wheels");
    std::fs::create_dir_all(&wheels).with_context(|| format!("creating {}", wheels.display()))?;
    let partial = venv.with_extension("partial");
    let _ = std::fs::remove_dir_all(&partial);
    let _ = std::fs::remove_dir_all(&venv);
    // The environment first: its pip (from ensurepip) downloads what is
    // missing, so a machine whose interpreter has no pip of its own (Debian
    // without python3-pip) works too.
    run(Command::new(python).args(["-m", "venv"]).arg(&partial))?;
    fill_wheels(&partial.join("bin/python"), &wheels)?;
    say(format!("torch-env: creating {} (offline, from {})", venv.display(), wheels.display()));
    let pip = |c: &mut Command| {
        c.args(["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links"]).arg(&wheels);
        c.arg(format!("torch=={TORCH_VERSION}")).args(PACKAGES);
    };
    let mut c = Command::new(partial.join("bin/python"));
    pip(&mut c);
    run(&mut c)?;
    run(Command::new(partial.join("bin/python")).args(["-c", "import torch"]))?;
    std::fs::write(partial.join(".profiler-ready"), TORCH_VERSION)?;
    // The environment's `bin/python` finds its packages through pyvenv.cfg
    // next to it, so the renamed tree works; its scripts (`torchrun`, `pip`)
    // name the interpreter by its path on their `#!` line: mended.
    std::fs::rename(&partial, &venv)?;
    mend_scripts(&venv)?;
    Ok(venv.join("bin/python"))
}

/// py-spy, the peer the CPU-sample tests compare with.
pub const PY_SPY_VERSION: &str = "0.4.1";

/// py-spy from PyPI, in an environment of its own (its wheel is a static
/// binary), downloaded once into the wheel cache. Returns the `py-spy` program.
pub fn ensure_py_spy() -> Result<PathBuf> {
    let cache = cache_dir();
    let venv = cache.join(format!("venvs/py-spy{PY_SPY_VERSION}"));
    let program = venv.join("bin/py-spy");
    if venv.join(".profiler-ready").exists() && program.exists() {
        return Ok(program);
    }
    let python =
        PYTHONS.iter().map(|(_, p)| Path::new(*p)).find(|p| p.exists()).context("no Python to install py-spy with")?;
    let wheels = cache.join("wheels");
    std::fs::create_dir_all(&wheels).with_context(|| format!("creating {}", wheels.display()))?;
    let partial = venv.with_extension("partial");
    let _ = std::fs::remove_dir_all(&partial);
    let _ = std::fs::remove_dir_all(&venv);
    run(Command::new(python).args(["-m", "venv"]).arg(&partial))?;
    let spec = format!("py-spy=={PY_SPY_VERSION}");
    let have = std::fs::read_dir(&wheels)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().starts_with(&format!("py_spy-{PY_SPY_VERSION}-")));
    let pip = partial.join("bin/python");
    if !have {
        say(format!("py-spy: downloading {spec} into {} (once)", wheels.display()));
        run(Command::new(&pip).args(["-m", "pip", "download", "-q", "--no-deps", "-d"]).arg(&wheels).arg(&spec))?;
    }
    run(Command::new(&pip)
        .args(["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links"])
        .arg(&wheels)
        .arg(&spec))?;
    std::fs::write(partial.join(".profiler-ready"), PY_SPY_VERSION)?;
    std::fs::rename(&partial, &venv)?;
    Ok(program)
}

/// pprof-format (npm), a reader of pprof profiles nobody here wrote, that
/// the pprof export's test decodes `profiler export --format pprof` with.
pub const PPROF_FORMAT_VERSION: &str = "2.3.2";

/// pprof-format from the npm registry, installed once into the cache with
/// the machine's `npm` (none installed system-wide). Returns the package's
/// directory, for node's `require`.
pub fn ensure_pprof_format() -> Result<PathBuf> {
    let dir = cache_dir().join(format!("npm/pprof-format-{PPROF_FORMAT_VERSION}"));
    let package = dir.join("node_modules/pprof-format");
    if dir.join(".profiler-ready").exists() && package.exists() {
        return Ok(package);
    }
    let partial = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&partial);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;
    say(format!("pprof-format: npm install pprof-format@{PPROF_FORMAT_VERSION} into {} (once)", dir.display()));
    run(Command::new("npm")
        .args(["install", "--no-audit", "--no-fund", "--silent", "--no-save"])
        .arg(format!("pprof-format@{PPROF_FORMAT_VERSION}"))
        .current_dir(&partial))?;
    std::fs::write(partial.join(".profiler-ready"), PPROF_FORMAT_VERSION)?;
    std::fs::rename(&partial, &dir)?;
    Ok(package)
}

/// Points the `#!` line of each script in `venv`'s `bin/` that names an
/// interpreter no longer there (where the environment was built, before its
/// rename) at `venv`'s own of the same name, so that `torchrun` and the other
/// entry points run.
fn mend_scripts(venv: &Path) -> Result<()> {
    let bin = venv.join("bin");
    for entry in std::fs::read_dir(&bin)? {
        let path = entry?.path();
        if path.is_symlink() || !path.is_file() {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&path) else { continue }; // a binary
        let Some((first, rest)) = text.strip_prefix("#!").and_then(|t| t.split_once('\n')) else { continue };
        let interpreter = Path::new(first.trim());
        let Some(name) = interpreter.file_name() else { continue };
        if interpreter.exists() || !bin.join(name).exists() {
            continue;
        }
        let mended = format!("#!{}\n{rest}", bin.join(name).display());
        std::fs::write(&path, mended).with_context(|| format!("mending {}", path.display()))?;
    }
    Ok(())
}

/// Downloads, once, what `python` needs: its own torch and numpy wheels,
/// and (the first time) the pure-Python and NVIDIA wheels all share.
fn fill_wheels(python: &Path, wheels: &Path) -> Result<()> {
    let out = Command::new(python)
        .args(["-c", "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')"])
        .output()
        .context("asking the Python its tag")?;
    let tag = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let have = |prefix: &str, tag: &str| {
        std::fs::read_dir(wheels).into_iter().flatten().flatten().any(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with(prefix) && n.contains(tag) && n.ends_with(".whl")
        })
    };
    let download = |args: &[&str]| {
        say(format!("torch-env: downloading {} into {} (once)", args.join(" "), wheels.display()));
        run(Command::new(python).args(["-m", "pip", "download", "-q", "-d"]).arg(wheels).args(args))
    };
    let torch = format!("torch=={TORCH_VERSION}");
    if !have(&format!("torch-{TORCH_VERSION}-"), &format!("{tag}-")) || !have("numpy-", &format!("{tag}-")) {
        download(&["--no-deps", &torch, "numpy"])?;
    }
    if !have("nvidia_cuda_runtime-", "") || !have("sympy-", "") {
        // With its dependencies, so that their versions are the ones torch pins.
        download(&[&torch])?;
    }
    Ok(())
}
