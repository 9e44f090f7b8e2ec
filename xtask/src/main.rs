//! Build, test, benchmark and demo tasks: `cargo xtask <task>`.
//!
//! Installs what a fresh machine lacks (rust-src for nightly, Debian's
//! llvm-22-dev, bpf-linker built against it) and says what it is doing.
mod bench;
mod bench_flops;
mod bench_frame_hook;
mod bench_jobs;
mod bench_python;
mod bench_torch;
mod debian_debs;
mod debian_prometheus;
mod debian_python;
mod gpu;
mod root;
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
    /// Install what is missing: rust-src (nightly), llvm-22-dev, bpf-linker, Debian non-free access.
    Setup,
    /// Build the eBPF object (installs the toolchain first if needed).
    BuildEbpf,
    /// Build everything: the eBPF object, then the profiler binary that embeds it.
    Build,
    /// Build the C test fixtures; fetch the genuine NVIDIA driver library and Debian's python3.13/3.14.
    Fixtures,
    /// Run all tests: unit tests, then the root integration tests.
    Test {
        /// Passed to the integration-test binary (e.g. a test name filter).
        args: Vec<String>,
    },
    /// rustfmt check, and clippy with warnings denied for the host crates and the eBPF crate.
    Lint,
    /// Print the overhead and throughput tables (`torch`, `frame-hook`, `flops` or `jobs`: only that table).
    Bench {
        /// `torch`: only the PyTorch steps table; `frame-hook`: only the PEP 523 frame hook's
        /// (ns per Python call, step boundary error); `flops`: only the cost per traced GEMM call;
        /// `jobs`: only the 8-rank job (attach time, agent CPU, events/s, lost).
        only: Option<String>,
    },
    /// Make the PyTorch environments the tests use (cached; downloads only what is missing).
    TorchEnv,
    /// Build everything and profile the bundled synthetic trainer into demo.db.
    Demo,
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

fn build_ebpf() -> Result<()> {
    toolchain::ensure_ebpf_toolchain()?;
    say("building the eBPF object (nightly, bpfel-unknown-none, build-std=core)");
    run(cargo().current_dir(root().join("profiler-ebpf")).args(["+nightly", "build", "--release"]))
}

fn build() -> Result<()> {
    build_ebpf()?;
    say("building the profiler (release)");
    run(cargo().current_dir(root()).args(["build", "--release", "-p", "profiler"]))
}

fn fixtures() -> Result<()> {
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
    // A stand-in driver whose second launch entry point the kernel refuses to probe.
    std::fs::create_dir_all(dir.join("halfway"))?;
    gcc(&["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", &out("halfway/libcuda.so.1"), "halfway_cuda.S"])?;
    gcc(&[&common[..], &["-rdynamic", "-o", &out("trainer"), "trainer.c", "-ldl", "-lpthread"]].concat())?;
    gcc(&[&common[..], &["-o", &out("genuine_launch"), "genuine_launch.c", "-ldl"]].concat())?;
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
    toolchain::fetch_genuine_nvidia(&dir.join("nvidia"))?;
    debian_python::fetch(&dir)?;
    debian_prometheus::fetch(&dir)
}

fn test(args: &[String]) -> Result<()> {
    build()?;
    fixtures()?;
    let mut tally = Tally::default();
    let result = test_phases(args, &mut tally);
    tally.print();
    result
}

/// What the test runs printed that matters after the last line: the checks
/// skipped on this host (`integration_tests::skip`) and, for a failed test,
/// where it panicked and its message, which a long backtrace
/// (`RUST_BACKTRACE=1`) would otherwise push out of a log's tail.
#[derive(Default)]
struct Tally {
    skipped: Vec<String>,
    panics: Vec<String>,
    /// Lines of the panic message being read (it ends at a backtrace or a blank line).
    in_panic: bool,
    /// In libtest's `failures:` section (a passing test's output, which
    /// `--show-output` prints before it, may hold a panic it caught).
    in_failures: bool,
}

impl Tally {
    fn line(&mut self, text: &str) {
        if let Some(at) = text.find("SKIPPED: ") {
            self.skipped.push(text[at..].trim_end().to_owned());
        }
        if text == "failures:" {
            self.in_failures = true;
        } else if text.starts_with("test result: ") {
            self.in_failures = false;
        }
        if self.in_failures && text.starts_with("thread '") && text.contains(" panicked at ") {
            self.in_panic = true;
            self.panics.push(text.trim_end().to_owned());
        } else if self.in_panic {
            let t = text.trim_end();
            if t.is_empty() || t.starts_with("stack backtrace:") || t.starts_with("note: ") || self.panics.len() > 200 {
                self.in_panic = false;
            } else if let Some(last) = self.panics.last_mut()
                && last.len() < 4000
            {
                last.push('\n');
                last.push_str(t);
            }
        }
    }

    /// The totals come last, pass or fail.
    fn print(&self) {
        if self.skipped.is_empty() {
            say("skipped: none");
        } else {
            say(format!("skipped: {} (not checked on this host):", self.skipped.len()));
            for line in &self.skipped {
                say(format!("  {line}"));
            }
        }
        if !self.panics.is_empty() {
            say(format!("failed: {} panic(s), as they began:", self.panics.len()));
            for p in &self.panics {
                say(format!("  {p}"));
            }
        }
    }
}

fn test_phases(args: &[String], tally: &mut Tally) -> Result<()> {
    // Release, like the root runs below: the profiler's test binary built here
    // is the one the `--ignored` run reuses, so nothing is compiled twice.
    // A failed test's message, not a backtrace of the test harness, is what a
    // log's tail should end with: backtraces stay off unless asked for here.
    let backtrace = std::env::var_os("PROFILER_TEST_BACKTRACE").unwrap_or_else(|| "0".into());
    say("unit tests (host crates, release, no root needed)");
    run_tests(
        cargo().current_dir(root()).env("RUST_BACKTRACE", &backtrace).args([
            "test",
            "--release",
            "--workspace",
            "--exclude",
            "integration-tests",
        ]),
        tally,
    )?;
    // Built as the user, run as root: only the runs that load eBPF programs need it.
    say("root unit tests of the USDT attach path (profiler crate, --ignored: they load eBPF programs)");
    for exe in root::test_executables("profiler")? {
        let mut c = root::command(&exe, &[("RUST_BACKTRACE", &backtrace)], "loading eBPF programs")?;
        c.current_dir(root::package_dir("profiler")).args(["--ignored", "--test-threads=1"]);
        run_tests(&mut c, tally)?;
    }
    say("root integration tests: the real profiler against fixtures with known ground truth");
    let (bin, fx) = (profiler_bin(), fixtures_dir());
    // The real PyTorch environments, as `name=python;…` for tests/tests/torch.rs.
    let pythons = torch_env::ensure_all().iter().map(|(n, p)| format!("{n}={}", p.display())).collect::<Vec<_>>();
    let pythons = std::ffi::OsString::from(pythons.join(";"));
    let env = [
        ("PROFILER_BIN", bin.as_os_str()),
        ("PROFILER_FIXTURES", fx.as_os_str()),
        ("PROFILER_TORCH_PYTHONS", pythons.as_os_str()),
        ("RUST_BACKTRACE", backtrace.as_os_str()),
    ];
    // Every binary runs, a failed one or not: one CI run shows every failure.
    let mut failed = Vec::new();
    for exe in root::test_executables("integration-tests")? {
        let mut c = root::command(&exe, &env, "loading eBPF programs")?;
        c.current_dir(root::package_dir("tests")).args(["--test-threads=1", "--show-output"]).args(args);
        if let Err(e) = run_tests(&mut c, tally) {
            say(format!("{e:#}"));
            failed.push(exe.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned()));
        }
    }
    if !failed.is_empty() {
        bail!("integration tests failed in {}", failed.join(", "));
    }
    Ok(())
}

/// Runs a `cargo test` command, passing its stdout through as it comes, and
/// collects what [`Tally`] keeps of it.
fn run_tests(cmd: &mut Command, tally: &mut Tally) -> Result<()> {
    let mut child =
        cmd.stdout(std::process::Stdio::piped()).spawn().with_context(|| format!("cannot start {cmd:?}"))?;
    // Each binary's output is read from its start: no section state carried over from the last.
    tally.in_failures = false;
    tally.in_panic = false;
    let passed = pass_through(&mut child, tally);
    if passed.is_err() {
        // Not left running beside the next binary.
        let _ = child.kill();
    }
    let status = child.wait()?;
    passed?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// Copies a test binary's stdout through, line by line into `tally`.
fn pass_through(child: &mut std::process::Child, tally: &mut Tally) -> Result<()> {
    use std::io::{Read, Write};
    let mut pipe = child.stdout.take().context("stdout is piped")?;
    let mut out = std::io::stdout();
    let (mut buf, mut line) = ([0u8; 8192], Vec::new());
    loop {
        let n = match pipe.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).context("reading the tests' output"),
        };
        // Partial lines too ("test x ... " before the test runs).
        out.write_all(&buf[..n])?;
        out.flush()?;
        for &b in &buf[..n] {
            if b != b'\n' {
                line.push(b);
                continue;
            }
            tally.line(&String::from_utf8_lossy(&line));
            line.clear();
        }
    }
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
    fixtures()?;
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
        Task::Setup => {
            toolchain::ensure_ebpf_toolchain()?;
            toolchain::ensure_nonfree()
        }
        Task::BuildEbpf => build_ebpf(),
        Task::Build => build(),
        Task::Fixtures => fixtures(),
        Task::Test { args } => test(&args),
        Task::Bench { only } => {
            build()?;
            fixtures()?;
            bench::main(only.as_deref())
        }
        Task::Demo => demo(),
        Task::TorchEnv => {
            let ready = torch_env::ensure_all();
            for (name, python) in &ready {
                say(format!("torch-env: {name}: {}", python.display()));
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
