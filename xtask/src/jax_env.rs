//! A real JAX for the tests: `jax[cpu]` from PyPI, two releases apart
//! (0.12, current, and 0.6 from June 2025, to check that the jit probes and
//! the name read survive releases), each downloaded once into the cache that
//! PyTorch's wheels use and installed offline into a virtual environment
//! kept there too, so a repeated run (or a fresh clone on the same machine)
//! fetches and installs nothing.
//!
//! JAX 0.12 needs Python 3.12 or later, so all use pyenv's 3.12 (Debian's
//! 3.11 cannot take 0.12). A third environment is the CUDA build: 0.12 with
//! the CUDA plugin's two wheels (`jax-cuda12-plugin`, `jax-cuda12-pjrt`,
//! 0.2 GB, fetched once like the rest) installed without their NVIDIA
//! dependencies: `import jax` loads the plugin, which finds no CUDA and
//! leaves JAX on the CPU, so the loop runs with the CUDA build's libraries
//! mapped. 1.1 GB on disk, about 40 s to make, once.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};

use crate::{run, say, torch_env};

/// (jax version, with the CUDA plugin, interpreter): the environments to make.
pub const RELEASES: &[(&str, bool, &str)] =
    &[("0.12.0.1", false, PYTHON), ("0.6.2", false, PYTHON), ("0.12.0.1", true, PYTHON)];

const PYTHON: &str = "/root/.pyenv/versions/3.12.1/bin/python3.12";

/// The CUDA plugin wheels downloaded next to the newest release's.
const CUDA_PLUGINS: &[&str] = &["jax-cuda12-plugin", "jax-cuda12-pjrt"];

/// Where the CUDA plugin wheels go (under the cache's `wheels/`).
fn cuda_wheels() -> PathBuf {
    torch_env::cache_dir().join("wheels/jax-cuda")
}

/// Makes every environment whose interpreter exists; returns the ready ones
/// (jax version, `+cuda12` for the CUDA build, and its Python). One that
/// cannot be made is reported, not fatal: the tests that need it skip,
/// saying why.
pub fn ensure_all() -> Vec<(String, PathBuf)> {
    let mut ready = Vec::new();
    for &(version, cuda, python) in RELEASES {
        let key = if cuda { format!("{version}+cuda12") } else { version.to_string() };
        if !Path::new(python).exists() {
            say(format!("jax-env: {python} is not on this machine: no JAX {key} environment"));
            continue;
        }
        match ensure(version, cuda, Path::new(python)) {
            Ok(p) => ready.push((key, p)),
            Err(e) => say(format!("jax-env: no JAX {key}: {e:#}")),
        }
    }
    ready
}

fn ensure(version: &str, cuda: bool, python: &Path) -> Result<PathBuf> {
    let cache = torch_env::cache_dir();
    let name = python.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let venv = cache.join(format!("venvs/{name}-jax{version}{}", if cuda { "-cuda12" } else { "" }));
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
    if cuda {
        ensure_cuda_wheels(&py, version)?;
        let plugins = CUDA_PLUGINS.iter().map(|p| format!("{p}=={version}"));
        let mut c = Command::new(&py);
        c.args(["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links"]).arg(cuda_wheels());
        run(c.args(plugins))?;
    }
    run(Command::new(&py).args(["-c", "import jax; jax.jit(lambda x: x + 1)(1)"]))?;
    std::fs::write(partial.join(".profiler-ready"), version)?;
    // `bin/python` finds its packages through pyvenv.cfg beside it: the
    // renamed tree works (nothing here runs the environment's scripts).
    std::fs::rename(&partial, &venv)?;
    Ok(venv.join("bin/python"))
}

/// Downloads the CUDA plugin wheels of `version` once (not their NVIDIA
/// dependencies, which only a GPU would use).
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
