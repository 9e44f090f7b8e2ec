//! A real JAX for the tests: `jax[cpu]` from PyPI, two releases apart
//! (0.12, current, and 0.6 from June 2025, to check that the jit probes and
//! the name read survive releases), each downloaded once into the cache that
//! PyTorch's wheels use and installed offline into a virtual environment
//! kept there too, so a repeated run (or a fresh clone on the same machine)
//! fetches and installs nothing.
//!
//! JAX 0.12 needs Python 3.12 or later, so both use pyenv's 3.12 (Debian's
//! 3.11 cannot take 0.12). The CUDA plugin's two wheels (`jax-cuda12-plugin`,
//! `jax-cuda12-pjrt`) are downloaded, not installed: the jit fast path the
//! probes go on is jaxlib's, shared by the CPU and CUDA builds, and the
//! plugins' libraries are only read (a test checks that they hold no second
//! copy of it). They are 0.2 GB, fetched once like the rest.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};

use crate::{run, say, torch_env};

/// (jax version, Python name, interpreter): the environments to make.
pub const RELEASES: &[(&str, &str, &str)] = &[
    ("0.12.0.1", "python3.12", "/root/.pyenv/versions/3.12.1/bin/python3.12"),
    ("0.6.2", "python3.12", "/root/.pyenv/versions/3.12.1/bin/python3.12"),
];

/// The CUDA plugin wheels downloaded next to the newest release's.
const CUDA_PLUGINS: &[&str] = &["jax-cuda12-plugin", "jax-cuda12-pjrt"];

/// Where the CUDA plugin wheels go (under the cache's `wheels/`).
pub fn cuda_wheels() -> PathBuf {
    torch_env::cache_dir().join("wheels/jax-cuda")
}

/// Makes every environment whose interpreter exists; returns the ready ones
/// (jax version, its Python). One that cannot be made is reported, not
/// fatal: the tests that need it skip, saying why.
pub fn ensure_all() -> Vec<(String, PathBuf)> {
    let mut ready = Vec::new();
    for (version, name, python) in RELEASES {
        if !Path::new(python).exists() {
            say(format!("jax-env: {python} is not on this machine: no JAX {version} environment"));
            continue;
        }
        match ensure(version, name, Path::new(python)) {
            Ok(p) => ready.push((version.to_string(), p)),
            Err(e) => say(format!("jax-env: no JAX {version} for {name}: {e:#}")),
        }
    }
    if let Some((version, ..)) = RELEASES.first()
        && let Some((_, python)) = ready.iter().find(|(v, _)| v == version)
        && let Err(e) = ensure_cuda_wheels(python, version)
    {
        say(format!("jax-env: the CUDA plugin wheels are not cached: {e:#}"));
    }
    ready
}

fn ensure(version: &str, name: &str, python: &Path) -> Result<PathBuf> {
    let cache = torch_env::cache_dir();
    let venv = cache.join(format!("venvs/{name}-jax{version}"));
    if venv.join(".profiler-ready").exists() && venv.join("bin/python").exists() {
        return Ok(venv.join("bin/python"));
    }
    let wheels = cache.join("wheels");
    std::fs::create_dir_all(&wheels).with_context(|| format!("creating {}", wheels.display()))?;
    let partial = venv.with_extension("partial");
    let _ = std::fs::remove_dir_all(&partial);
    let _ = std::fs::remove_dir_all(&venv);
    run(Command::new(python).args(["-m", "venv"]).arg(&partial))?;
    let py = partial.join("bin/python");
    let jax = format!("jax[cpu]=={version}");
    let have = std::fs::read_dir(&wheels).into_iter().flatten().flatten().any(|e| {
        let n = e.file_name().to_string_lossy().into_owned();
        n.starts_with(&format!("jaxlib-{version}-")) && n.ends_with(".whl")
    });
    if !have {
        say(format!("jax-env: downloading {jax} into {} (once)", wheels.display()));
        run(Command::new(&py).args(["-m", "pip", "download", "-q", "-d"]).arg(&wheels).arg(&jax))?;
    }
    say(format!("jax-env: creating {} (offline, from {})", venv.display(), wheels.display()));
    run(Command::new(&py).args(["-m", "pip", "install", "-q", "--no-index", "--find-links"]).arg(&wheels).arg(&jax))?;
    run(Command::new(&py).args(["-c", "import jax; jax.jit(lambda x: x + 1)(1)"]))?;
    std::fs::write(partial.join(".profiler-ready"), version)?;
    // `bin/python` finds its packages through pyvenv.cfg beside it: the
    // renamed tree works (nothing here runs the environment's scripts).
    std::fs::rename(&partial, &venv)?;
    Ok(venv.join("bin/python"))
}

/// Downloads the CUDA plugin wheels of `version` once (no dependencies: they
/// are read, not installed).
fn ensure_cuda_wheels(python: &Path, version: &str) -> Result<()> {
    let dir = cuda_wheels();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let missing: Vec<String> = CUDA_PLUGINS
        .iter()
        .filter(|p| {
            let prefix = format!("{}-{version}-", p.replace('-', "_"));
            !std::fs::read_dir(&dir).into_iter().flatten().flatten().any(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.starts_with(&prefix) && n.ends_with(".whl")
            })
        })
        .map(|p| format!("{p}=={version}"))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    say(format!("jax-env: downloading {} into {} (once)", missing.join(" "), dir.display()));
    run(Command::new(python).args(["-m", "pip", "download", "-q", "--no-deps", "-d"]).arg(&dir).args(&missing))
}
