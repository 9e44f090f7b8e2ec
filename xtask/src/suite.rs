//! `cargo xtask test`: the test phases (unit tests, the profiler's root unit
//! tests, the root integration tests), what their output leaves to say at
//! the end, and `cargo xtask fuzz-corpus`, the one ignored test run only
//! when asked.
use std::{ffi::OsString, path::PathBuf, process::Command};

use anyhow::{Context, Result, bail};

use crate::{cargo, fixtures_dir, jax_env, profiler_bin, root, say, torch_env};

/// The module name every root-only test of the profiler crate sits in: the
/// filter of the root unit-test run.
const ROOT_TESTS: &str = "root_tests";

/// Ignored tests of the profiler crate that run only when asked, each by its own command.
const ASKED_ONLY: [(&str, &str); 1] = [("fuzz_tests::regenerate_corpus", "cargo xtask fuzz-corpus")];

/// Runs the test phases (the fixtures are built) and prints the tally last.
/// `dist`: the dist binary and its old-glibc fixtures, or why there are none.
pub fn test(args: &[String], dist: std::result::Result<(PathBuf, PathBuf), String>) -> Result<()> {
    let mut tally = Tally::default();
    let result = test_phases(args, &dist, &mut tally);
    tally.print();
    result
}

/// Rewrites `profiler/tests/corpus/` from this machine's system files.
pub fn fuzz_corpus() -> Result<()> {
    let (name, _) = ASKED_ONLY[0];
    say(format!("rewriting profiler/tests/corpus/ ({name})"));
    crate::run(
        cargo().current_dir(root()).args(["test", "--release", "-p", "profiler", "--bin", "profiler", "--"]).args([
            "--ignored",
            "--exact",
            name,
        ]),
    )?;
    say("profiler/tests/corpus/ rewritten: `git diff --stat profiler/tests/corpus` shows what changed");
    Ok(())
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

fn test_phases(
    args: &[String],
    dist: &std::result::Result<(PathBuf, PathBuf), String>,
    tally: &mut Tally,
) -> Result<()> {
    // A failed test's message, not a backtrace of the test harness, is what a
    // log's tail should end with: backtraces stay off unless asked for here.
    let backtrace = std::env::var_os("PROFILER_TEST_BACKTRACE").unwrap_or_else(|| "0".into());
    // The real PyTorch environments, as `name=python;…`, made before any
    // test runs: a unit test reads PyTorch's libraries too.
    let pythons = torch_env::ensure_all().iter().map(|(n, p)| format!("{n}={}", p.display())).collect::<Vec<_>>();
    let pythons = OsString::from(pythons.join(";"));
    // The JAX environments, as `version=python;…` (`+cuda12`: with the CUDA plugin).
    let jax = jax_env::ensure_all().iter().map(|(v, p)| format!("{v}={}", p.display())).collect::<Vec<_>>();
    let jax = OsString::from(jax.join(";"));
    // py-spy, the peer the CPU-sample tests compare with (their skip says why when missing).
    let py_spy = torch_env::ensure_py_spy().unwrap_or_else(|e| {
        say(format!("py-spy: not installed: {e:#}"));
        PathBuf::new()
    });
    // pprof-format (npm), the third-party reader the pprof export is checked with.
    let pprof_format = torch_env::ensure_pprof_format().unwrap_or_else(|e| {
        say(format!("pprof-format: not installed: {e:#}"));
        PathBuf::new()
    });
    let (bin, fx) = (profiler_bin(), fixtures_dir());
    let mut env = vec![
        ("PROFILER_PY_SPY", py_spy.into_os_string()),
        ("PROFILER_PPROF_FORMAT", pprof_format.into_os_string()),
        ("PROFILER_BIN", bin.into_os_string()),
        ("PROFILER_FIXTURES", fx.into_os_string()),
        ("PROFILER_TORCH_PYTHONS", pythons),
        ("PROFILER_JAX_PYTHONS", jax),
        ("RUST_BACKTRACE", backtrace),
    ];
    // The install tests: the dist binary, and what setup runs with in their Debian 12 root.
    match dist {
        Ok((dist_bin, dist_fixtures)) => {
            env.push(("PROFILER_DIST_BIN", dist_bin.clone().into_os_string()));
            env.push(("PROFILER_DIST_FIXTURES", dist_fixtures.clone().into_os_string()));
        }
        Err(why) => env.push(("PROFILER_DIST_UNAVAILABLE", why.into())),
    }
    env.extend(install_test_env()?);
    let env: Vec<(&str, &std::ffi::OsStr)> = env.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
    // Release, like the root runs below: the profiler's test binary built here
    // is the one the root run reuses, so nothing is compiled twice.
    say("unit tests (host crates, release, no root needed)");
    run_tests(
        cargo().current_dir(root()).envs(env.iter().copied()).args([
            "test",
            "--release",
            "--workspace",
            "--exclude",
            "integration-tests",
        ]),
        tally,
    )?;
    // Built as the user, run as root: only the runs that load eBPF programs need it.
    say(format!("root unit tests (profiler crate, ignored tests in `{ROOT_TESTS}` modules: they load eBPF programs)"));
    for exe in crate::root::test_executables("profiler")? {
        warn_unrun_ignored(&exe)?;
        let mut c = crate::root::command(&exe, &env, "loading eBPF programs")?;
        c.current_dir(crate::root::package_dir("profiler")).args(["--ignored", "--test-threads=1", ROOT_TESTS]);
        run_tests(&mut c, tally)?;
    }
    say("root integration tests: the real profiler against fixtures with known ground truth");
    // Every binary runs, a failed one or not: one CI run shows every failure.
    let mut failed = Vec::new();
    for exe in crate::root::test_executables("integration-tests")? {
        let mut c = crate::root::command(&exe, &env, "loading eBPF programs")?;
        c.current_dir(crate::root::package_dir("tests")).args(["--test-threads=1", "--show-output"]).args(args);
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

/// The xtask binary itself, rustup's home and cargo's (where rustup's own
/// binary is): the setup test runs `xtask setup` in a Debian 12 root with them.
fn install_test_env() -> Result<Vec<(&'static str, OsString)>> {
    let mut env = vec![("PROFILER_XTASK_BIN", std::env::current_exe().context("xtask's own path")?.into_os_string())];
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
    let rustup_home = std::env::var_os("RUSTUP_HOME").map(PathBuf::from).unwrap_or_else(|| home.join(".rustup"));
    let cargo_home = std::env::var_os("CARGO_HOME").map(PathBuf::from).unwrap_or_else(|| home.join(".cargo"));
    env.push(("PROFILER_RUSTUP_HOME", rustup_home.into_os_string()));
    env.push(("PROFILER_CARGO_HOME", cargo_home.into_os_string()));
    Ok(env)
}

/// Says which ignored tests of `exe` no phase runs: neither in a
/// `root_tests` module nor run by a command of their own (a root test
/// elsewhere would be left out silently).
fn warn_unrun_ignored(exe: &std::path::Path) -> Result<()> {
    let out = Command::new(exe).args(["--list", "--ignored", "--format", "terse"]).output()?;
    let listed = String::from_utf8_lossy(&out.stdout);
    for name in listed.lines().filter_map(|l| l.strip_suffix(": test")) {
        let asked = ASKED_ONLY.iter().any(|(n, _)| *n == name);
        if !asked && !name.split("::").any(|m| m == ROOT_TESTS) {
            say(format!(
                "ignored test {name} is not run by `cargo xtask test`: root-only tests go in a `{ROOT_TESTS}` module"
            ));
        }
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
