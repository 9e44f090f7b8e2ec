//! Build, test, benchmark and demo tasks: `cargo xtask <task>`.
//!
//! Installs what a fresh machine lacks (rust-src for nightly, bpf-linker
//! linked against nightly's own LLVM, gcc from the host release's archive)
//! and says what it is doing; nothing else on the host changes.
mod bench;
mod debian_debs;
mod debian_prometheus;
mod debian_python;
mod dist;
mod distro;
mod gpu;
mod jax_env;
mod root;
mod soak;
mod suite;
mod toolchain;
mod torch_env;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what is missing: gcc (the host release's own), rust-src (nightly), bpf-linker; nothing else.
    Setup,
    /// Build the eBPF object (installs the toolchain first if needed).
    BuildEbpf,
    /// Build everything: the eBPF object, then the profiler binary that embeds it.
    Build,
    /// Build the C test fixtures; fetch the genuine NVIDIA driver library and Debian's python3.13/3.14.
    Fixtures,
    /// Run the tests: unit tests, the profiler's root unit tests, then the root integration tests.
    Test {
        /// Passed to the integration-test binary (e.g. a test name filter).
        args: Vec<String>,
    },
    /// Rewrite profiler/tests/corpus/ (the fuzz tests' seeds) from this machine's python3.11, libc and libstdc++.
    FuzzCorpus,
    /// rustfmt check, and clippy with warnings denied for the host crates and the eBPF crate.
    Lint,
    /// Print the overhead and throughput tables (`attach`, `torch`, `sched`, `frame-hook`, `flops` or `jobs`: only that table).
    Bench {
        /// `attach`: only attach and detach times, per-probe links against uprobe-multi links, with the
        /// genuine driver and runtime; `torch`: only the PyTorch steps table; `sched`: only the scheduler and copy programs' cost
        /// per context switch and per copy call; `frame-hook`: only the PEP 523 frame hook's
        /// (ns per Python call, step boundary error); `flops`: only the cost per traced GEMM call;
        /// `jobs`: only the 8-rank job (attach time, agent CPU, events/s, lost).
        only: Option<String>,
    },
    /// Leave the profiler running on a churning job (the stand-in driver with the genuine one's entry
    /// shape) with a small --max-size; a table row a minute.
    Soak {
        /// How long (seconds, or 90s, 5m, 1h).
        #[arg(default_value = "20m", value_parser = soak::parse_duration)]
        duration: std::time::Duration,
    },
    /// Make the PyTorch environments the tests use (cached; downloads only what is missing).
    TorchEnv,
    /// Build everything and profile the bundled synthetic trainer into demo.db.
    Demo,
    /// Build target/dist/profiler-x86_64-linux-gnu: one binary, eBPF object inside, glibc 2.31 or newer.
    Dist,
    /// Make the JAX environments the tests use (cached; downloads only what is missing).
    JaxEnv,
    /// Build target/gpu-bundle/: the profiler, the GPU check and its PyTorch loop, for a GPU machine.
    GpuBundle,
    /// Build the GPU bundle and run its check here (exit 3 inside, "nothing to check", is success).
    GpuCheck {
        /// Rehearse every comparison against the stand-in libcuda/libnvidia-ml (no GPU needed; root for eBPF).
        #[arg(long)]
        standin: bool,
        /// Passed to the check (e.g. `-- --steps 40`).
        #[arg(last = true)]
        args: Vec<String>,
    },
}

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_owned()
}

pub fn fixtures_dir() -> PathBuf {
    root().join("target/fixtures")
}

pub fn profiler_bin() -> PathBuf {
    root().join("target/release/profiler")
}

pub fn say(msg: impl AsRef<str>) {
    eprintln!("xtask: {}", msg.as_ref());
}

/// Runs a command, failing with its command line if it fails.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("cannot start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// A cargo invocation free of the variables the outer `cargo xtask` set.
pub fn cargo() -> Command {
    let mut c = Command::new("cargo");
    for v in [
        "RUSTUP_TOOLCHAIN",
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO",
    ] {
        c.env_remove(v);
    }
    c
}

pub(crate) fn build_ebpf() -> Result<()> {
    toolchain::ensure_ebpf_toolchain()?;
    say("building the eBPF object (nightly, bpfel-unknown-none, build-std=core)");
    run(cargo().current_dir(root().join("profiler-ebpf")).args(["+nightly", "build", "--release"]))
}

fn build() -> Result<()> {
    build_ebpf()?;
    build_profiler()
}

/// The profiler binary for this host, once the eBPF object it embeds is built.
fn build_profiler() -> Result<()> {
    say("building the profiler (release)");
    run(cargo().current_dir(root()).args(["build", "--release", "-p", "profiler"]))
}

/// Everything the tests and the bench use: the C fixtures, the genuine NVIDIA
/// driver library, Debian's Pythons and Prometheus.
fn fixtures() -> Result<()> {
    c_fixtures()?;
    let dir = fixtures_dir();
    toolchain::fetch_genuine_nvidia(&dir.join("nvidia"))?;
    debian_python::fetch(&dir)?;
    debian_prometheus::fetch(&dir)
}

/// The C fixtures (stand-in libraries and trainers), all the demo needs.
fn c_fixtures() -> Result<()> {
    let dir = fixtures_dir();
    std::fs::create_dir_all(&dir)?;
    let src = root().join("tests/fixtures");
    let gcc = |args: &[&str]| -> Result<()> { run(Command::new("gcc").current_dir(&src).args(args)) };
    let out = |name: &str| dir.join(name).to_string_lossy().into_owned();
    say(format!("building C fixtures into {}", dir.display()));
    let common = ["-O2", "-g", "-Wall", "-Werror"];
    let so = |soname: &str, file: &str, extra: &[&str]| -> Result<()> {
        let mut a: Vec<String> = common.iter().map(|s| s.to_string()).collect();
        a.extend(["-shared", "-fPIC", "-fvisibility=hidden"].map(String::from));
        a.push(format!("-Wl,-soname,{soname}"));
        a.extend(["-o".to_string(), out(soname), file.to_string()]);
        a.extend(extra.iter().map(|s| s.to_string()));
        gcc(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    so("libcuda.so.1", "fake_cuda.c", &[])?;
    so("libcudart.so.12", "fake_cudart.c", &["-ldl"])?;
    so("libnvidia-ml.so.1", "fake_nvml.c", &[])?;
    so("libnccl.so.2", "fake_nccl.c", &[])?;
    // A stand-in driver whose entry points have the genuine library's shapes
    // (RIP-relative compare, conditional jump, indirect jump; push prologues):
    // probe placement moves its probes.
    std::fs::create_dir_all(dir.join("shaped"))?;
    gcc(&["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", &out("shaped/libcuda.so.1"), "shaped_cuda.S"])?;
    // The stand-in driver with every copy and memset entry point too (the copy tests').
    std::fs::create_dir_all(dir.join("copies"))?;
    let mut copies: Vec<&str> = common.to_vec();
    copies.extend(["-shared", "-fPIC", "-fvisibility=hidden", "-Wl,-soname,libcuda.so.1", "-o"]);
    let copies_out = out("copies/libcuda.so.1");
    copies.extend([copies_out.as_str(), "fake_cuda.c", "fake_cuda_copies.c"]);
    gcc(&copies)?;
    // A stand-in driver whose second launch entry point the kernel refuses to probe.
    std::fs::create_dir_all(dir.join("halfway"))?;
    gcc(&["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", &out("halfway/libcuda.so.1"), "halfway_cuda.S"])?;
    gcc(&[&common[..], &["-rdynamic", "-o", &out("trainer"), "trainer.c", "-ldl", "-lpthread"]].concat())?;
    gcc(&[&common[..], &["-o", &out("genuine_launch"), "genuine_launch.c", "-ldl"]].concat())?;
    gcc(&[&common[..], &["-rdynamic", "-o", &out("sched_trainer"), "sched_trainer.c", "-ldl"]].concat())?;
    gcc(&[&common[..], &["-o", &out("bench_loop"), "bench_loop.c", "-ldl", "-lpthread"]].concat())?;
    // Frame pointers: the CPU sampler's stacks of it reach `main` (tests/tests/integration/cpu.rs).
    gcc(&[&common[..], &["-fno-omit-frame-pointer", "-rdynamic", "-o", &out("cpu_trainer"), "cpu_trainer.c"]].concat())?;
    // And without: the sampler's stacks stop at the leaf, and it says so.
    gcc(&[&common[..], &["-fomit-frame-pointer", "-rdynamic", "-o", &out("cpu_trainer_nofp"), "cpu_trainer.c"]]
        .concat())?;
    gcc(&[&common[..], &["-rdynamic", "-o", &out("nccl_trainer"), "nccl_trainer.c", "-ldl"]].concat())?;
    // cuBLAS and cuBLASLt stand-ins (cuBLAS calls cuBLASLt, found next to it) and their trainer.
    so("libcublasLt.so.13", "fake_cublasLt.c", &[])?;
    let lt_dir = format!("-L{}", dir.display());
    so("libcublas.so.13", "fake_cublas.c", &[&lt_dir, "-l:libcublasLt.so.13", "-Wl,-rpath,$ORIGIN"])?;
    gcc(&[&common[..], &["-rdynamic", "-o", &out("gemm_trainer"), "gemm_trainer.c", "-ldl"]].concat())?;
    gcc(&[&common[..], &["-o", &out("launcher"), "launcher.c"]].concat())?;
    // A copy of the stand-in driver in a directory nobody's search path names:
    // found only by watching the target's maps.
    std::fs::create_dir_all(dir.join("hidden"))?;
    std::fs::copy(dir.join("libcuda.so.1"), dir.join("hidden/libcuda.so.1"))?;
    Ok(())
}

fn lint() -> Result<()> {
    say("rustfmt --check and clippy -D warnings (host crates, then the eBPF crate)");
    run(cargo().current_dir(root()).args(["fmt", "--all", "--check"]))?;
    run(cargo().current_dir(root()).args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
    let ebpf = root().join("profiler-ebpf");
    run(cargo().current_dir(&ebpf).args(["+nightly", "fmt", "--check"]))?;
    run(cargo().current_dir(&ebpf).args(["+nightly", "clippy", "--release", "--", "-D", "warnings"]))
}

fn demo() -> Result<()> {
    build()?;
    c_fixtures()?;
    let db = root().join("demo.db");
    let _ = std::fs::remove_file(&db);
    let fx = fixtures_dir();
    say("profiling the synthetic trainer: 2 threads × 50 steps × 200 launches, all 16 entry points");
    // Under sudo the profiler hands demo.db to the user (SUDO_UID).
    run(root::command(
        profiler_bin(),
        &[("LD_LIBRARY_PATH", fx.as_os_str())],
        "the profiler (it loads eBPF programs)",
    )?
    .args(["run", "-o"])
    .arg(&db)
    .args(["--step-symbol", "train_step", "--"])
    .arg(fx.join("trainer"))
    .args(["--threads", "2", "--steps", "50", "--launches", "200", "--api", "all", "--step-sleep-us", "2000"])
    .args(["--gap-us", "500", "--after-dlopen-ms", "300"]))?;
    let conn = rusqlite::Connection::open(&db)?;
    println!("\nsteps (first 5):");
    println!("{:>5} {:>8} {:>12} {:>14} {:>9}", "step", "tid", "duration_ms", "inter_step_ms", "launches");
    let mut q =
        conn.prepare("SELECT step, tid, duration_ns, inter_step_ns, launches FROM steps ORDER BY step LIMIT 5")?;
    let mut rows = q.query([])?;
    while let Some(r) = rows.next()? {
        let inter: Option<i64> = r.get(3)?;
        println!(
            "{:>5} {:>8} {:>12.3} {:>14} {:>9}",
            r.get::<_, i64>(0)?,
            r.get::<_, i64>(1)?,
            r.get::<_, i64>(2)? as f64 / 1e6,
            inter.map_or("NULL".into(), |v| format!("{:.3}", v as f64 / 1e6)),
            r.get::<_, i64>(4)?
        );
    }
    let (n, mean, launches): (i64, f64, i64) = conn.query_row(
        "SELECT count(*), avg(duration_ns) / 1e6, sum(launches) FROM steps WHERE end_ns IS NOT NULL",
        [],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )?;
    println!("\n{n} steps, mean {mean:.3} ms, {launches} launches in steps");
    println!("\nlaunches by entry point:");
    let mut q = conn.prepare("SELECT api_name, api_layer, count(*) FROM launches_named GROUP BY api ORDER BY api")?;
    let mut rows = q.query([])?;
    while let Some(r) = rows.next()? {
        println!("  {:<34} {:<8} {:>6}", r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?);
    }
    println!("\nquery it: sqlite3 {} 'SELECT * FROM steps LIMIT 10'", db.display());
    Ok(())
}

/// The error, with its causes, is the last thing printed: no backtrace of
/// xtask itself (RUST_BACKTRACE=1 would give one) after a test run's totals.
fn main() -> std::process::ExitCode {
    match run_task(Cli::parse().task) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run_task(task: Task) -> Result<()> {
    match task {
        Task::Setup => toolchain::setup(),
        Task::Dist => dist::dist().map(drop),
        Task::BuildEbpf => build_ebpf(),
        Task::Build => build(),
        Task::Fixtures => fixtures(),
        Task::Test { args } => {
            // The tests run the dist binary, the one file a training node
            // gets: one release build of the profiler serves both. Where it
            // cannot be built here (no PyPI, no python3 venv), the host build
            // stands in, and the install tests say SKIPPED and why.
            let dist = dist::dist().and_then(|bin| Ok((bin, dist::old_glibc_fixtures()?)));
            let bin = match &dist {
                Ok((bin, _)) => bin.clone(),
                Err(e) => {
                    say(format!("no dist binary: {e:#}; the tests run the host build"));
                    build_profiler()?;
                    profiler_bin()
                }
            };
            fixtures()?;
            suite::test(&args, bin, dist.map_err(|e| format!("{e:#}")))
        }
        Task::FuzzCorpus => suite::fuzz_corpus(),
        Task::Bench { only } => {
            build()?;
            fixtures()?;
            bench::main(only.as_deref())
        }
        Task::Soak { duration } => {
            build()?;
            fixtures()?;
            soak::main(duration)
        }
        Task::Demo => demo(),
        Task::TorchEnv => {
            let ready = torch_env::ensure_all();
            for (name, python) in &ready {
                say(format!("torch-env: {name}: {}", python.display()));
            }
            Ok(())
        }
        Task::JaxEnv => {
            for (version, python) in jax_env::ensure_all() {
                say(format!("jax-env: JAX {version}: {}", python.display()));
            }
            Ok(())
        }
        Task::GpuBundle => gpu::bundle().map(drop),
        Task::GpuCheck { standin, args } => gpu::check(standin, &args),
        Task::Lint => {
            toolchain::ensure_ebpf_toolchain()?;
            lint()
        }
    }
}
