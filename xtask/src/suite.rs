//! `cargo xtask test`: the test phases (unit tests, the profiler's root unit
//! tests, the root integration tests), what their output leaves to say at
//! the end, and `cargo xtask fuzz-corpus`, the one ignored test run only
//! when asked.
use std::{ffi::OsString, path::PathBuf, process::Command, time::Duration};

use anyhow::{Context, Result, bail};

use crate::{cargo, fixtures_dir, jax_env, root, say, torch_env};

/// The module name every root-only test of the profiler crate sits in: the
/// filter of the root unit-test run.
const ROOT_TESTS: &str = "root_tests";

/// Ignored tests of the profiler crate that run only when asked, each by its own command.
const ASKED_ONLY: [(&str, &str); 1] = [("fuzz_tests::regenerate_corpus", "cargo xtask fuzz-corpus")];

/// Runs the test phases (the fixtures are built) and prints the tally last.
/// `bin`: the profiler the tests run; `dist`: the dist binary and its
/// old-glibc fixtures, or why there are none.
pub fn test(args: &[String], bin: PathBuf, dist: std::result::Result<(PathBuf, PathBuf), String>) -> Result<()> {
    let mut tally = Tally::default();
    let result = test_phases(args, bin, dist, &mut tally);
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
    /// Each run's name, wall time and CPU time (its own and its children's,
    /// user and system), in the order run: where the suite's time goes, and
    /// how much of the machine each run kept busy.
    times: Vec<(String, Duration, Duration)>,
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

    /// A run's output is read from its start: no section state carried over from the last.
    fn new_output(&mut self) {
        self.in_failures = false;
        self.in_panic = false;
    }

    /// The totals come last, pass or fail.
    fn print(&self) {
        let wall: Duration = self.times.iter().map(|(_, t, _)| *t).sum();
        let cpu: Duration = self.times.iter().map(|(_, _, c)| *c).sum();
        say(format!(
            "time: {:.0} s in {} test runs, {:.0} s of CPU; each, longest first (wall, CPU):",
            wall.as_secs_f64(),
            self.times.len(),
            cpu.as_secs_f64()
        ));
        let mut longest: Vec<_> = self.times.iter().collect();
        longest.sort_by_key(|(_, t, _)| std::cmp::Reverse(*t));
        for (name, t, c) in longest {
            say(format!("  {:>6.1} s {:>6.1} s  {name}", t.as_secs_f64(), c.as_secs_f64()));
        }
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
    bin: PathBuf,
    dist: std::result::Result<(PathBuf, PathBuf), String>,
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
    let fx = fixtures_dir();
    let mut vars = vec![
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
            vars.push(("PROFILER_DIST_BIN", dist_bin.into_os_string()));
            vars.push(("PROFILER_DIST_FIXTURES", dist_fixtures.into_os_string()));
        }
        Err(why) => vars.push(("PROFILER_DIST_UNAVAILABLE", why.into())),
    }
    vars.extend(install_test_env()?);
    let env = borrowed(&vars);
    // Every test of the workspace is built by one cargo run (each dependency
    // once): the integration binary first, then each of its modules in
    // BESIDE_THE_UNIT_TESTS runs while the rest builds and the unit tests run.
    say("building the tests (the whole workspace in one build; the integration tests first)");
    let integration_exes: Vec<PathBuf> = crate::root::workspace_test_executables(&["--test", "integration"])?
        .into_iter()
        .filter_map(|(package, exe)| (package == "tests").then_some(exe))
        .collect();
    let mut runs = Vec::new();
    for exe in &integration_exes {
        if args.is_empty() {
            for (module, tests) in modules(exe)? {
                runs.push((module, exe.clone(), [vec!["--exact".to_owned()], tests].concat()));
            }
        } else {
            // A filter given here goes to one run of the whole binary.
            runs.push((run_name_of(exe), exe.clone(), args.to_vec()));
        }
    }
    let integration = |exe: &std::path::Path, selection: &[String]| -> Result<Command> {
        let mut c = crate::root::command(exe, &env, "loading eBPF programs")?;
        c.current_dir(crate::root::package_dir("tests")).args(["--test-threads=1", "--show-output"]).args(selection);
        Ok(c)
    };
    let mut beside = Vec::new();
    for (name, exe, selection) in runs.extract_if(.., |(m, _, _)| BESIDE_THE_UNIT_TESTS.contains(&m.as_str())) {
        say(format!("root integration tests of `{name}`, beside the unit tests (their output when both end)"));
        beside.push((name, Beside::start(integration(&exe, &selection)?)?));
    }
    let unit = unit_tests(&env, &integration_exes, tally);
    // Every module runs, a failed one or not: one CI run shows every failure.
    let mut failed = Vec::new();
    for (name, run) in beside {
        if let Err(e) = run.finish(&name, tally) {
            say(format!("{name}: {e:#}"));
            failed.push(name);
        }
    }
    unit?;
    say("root integration tests: the real profiler against fixtures with known ground truth");
    // Each module in a process of its own, one test at a time.
    for (name, exe, selection) in runs {
        if let Err(e) = run_tests_named(&mut integration(&exe, &selection)?, &name, tally) {
            say(format!("{name}: {e:#}"));
            failed.push(name);
        }
    }
    if !failed.is_empty() {
        bail!("integration tests failed in {}", failed.join(", "));
    }
    Ok(())
}

/// The unit tests of the host crates (as the user), then the profiler
/// crate's root-only ones, from the workspace's one build of its tests.
fn unit_tests(env: &[(&str, &std::ffi::OsStr)], integration: &[PathBuf], tally: &mut Tally) -> Result<()> {
    let built = crate::root::workspace_test_executables(&[])?;
    say("unit tests (host crates, release, no root needed)");
    let mut profiler = Vec::new();
    // Every one but the integration binaries (the tests' library too).
    for (package, exe) in built.iter().filter(|(_, exe)| !integration.contains(exe)) {
        // As `cargo test` runs them: in the package's directory.
        let mut c = Command::new(exe);
        c.envs(env.iter().copied()).current_dir(crate::root::package_dir(package));
        run_tests_named(&mut c, &format!("{package} (unit)"), tally)?;
        if package == "profiler" {
            profiler.push(exe);
        }
    }
    // Doc tests, in the same build's libraries.
    run_tests_named(
        cargo().current_dir(root()).envs(env.iter().copied()).args(["test", "--release", "--workspace", "--doc"]),
        "doc tests",
        tally,
    )?;
    // Built as the user, run as root: only the runs that load eBPF programs need it.
    say(format!("root unit tests (profiler crate, ignored tests in `{ROOT_TESTS}` modules: they load eBPF programs)"));
    for exe in profiler {
        warn_unrun_ignored(exe)?;
        let mut c = crate::root::command(exe, env, "loading eBPF programs")?;
        c.current_dir(crate::root::package_dir("profiler")).args(["--ignored", "--test-threads=1", ROOT_TESTS]);
        run_tests_named(&mut c, "profiler (root unit)", tally)?;
    }
    Ok(())
}

/// Integration-test modules run while the unit tests build and run (a
/// compile keeping both cores busy): those whose checks a busy machine
/// cannot fail. `install` waits on the network (apt, crates.io) and on
/// unpacking Debian roots; its trainer's steps are matched within 50 ms
/// plus the time the scheduler kept them off a CPU, its counts exactly.
const BESIDE_THE_UNIT_TESTS: [&str; 1] = ["install"];

/// A test run started in the background, its output kept until it is
/// shown, whole, by [`Beside::finish`] (not interleaved with another's).
struct Beside {
    started: std::time::Instant,
    child: std::process::Child,
    output: std::thread::JoinHandle<std::io::Result<Vec<u8>>>,
}

impl Beside {
    fn start(mut cmd: Command) -> Result<Beside> {
        let mut child =
            cmd.stdout(std::process::Stdio::piped()).spawn().with_context(|| format!("cannot start {cmd:?}"))?;
        let mut pipe = child.stdout.take().context("stdout is piped")?;
        let output = std::thread::spawn(move || {
            let mut out = Vec::new();
            std::io::Read::read_to_end(&mut pipe, &mut out).map(|_| out)
        });
        Ok(Beside { started: std::time::Instant::now(), child, output })
    }

    /// Waits for it, shows its output and counts its run in `tally`.
    fn finish(self, name: &str, tally: &mut Tally) -> Result<()> {
        let (status, cpu) = wait_with_cpu(&self.child)?;
        tally.times.push((format!("{name} (beside the unit tests)"), self.started.elapsed(), cpu));
        let out = self.output.join().map_err(|_| anyhow::anyhow!("the output reader panicked"))??;
        say(format!("root integration tests of `{name}`, run beside the unit tests:"));
        std::io::Write::write_all(&mut std::io::stdout(), &out)?;
        tally.new_output();
        for line in String::from_utf8_lossy(&out).lines() {
            tally.line(line);
        }
        if !status.success() {
            bail!("failed: {status}");
        }
        Ok(())
    }
}

/// `vars` as `Command::envs` and [`crate::root::command`] take them.
fn borrowed<'a>(vars: &'a [(&'static str, OsString)]) -> Vec<(&'static str, &'a std::ffi::OsStr)> {
    vars.iter().map(|(k, v)| (*k, v.as_os_str())).collect()
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

/// Runs a test command, passing its stdout through as it comes, collects
/// what [`Tally`] keeps of it, and times it under `name`.
fn run_tests_named(cmd: &mut Command, name: &str, tally: &mut Tally) -> Result<()> {
    let started = std::time::Instant::now();
    let mut child =
        cmd.stdout(std::process::Stdio::piped()).spawn().with_context(|| format!("cannot start {cmd:?}"))?;
    tally.new_output();
    let passed = pass_through(&mut child, tally);
    if passed.is_err() {
        // Not left running beside the next binary.
        let _ = child.kill();
    }
    let (status, cpu) = wait_with_cpu(&child)?;
    tally.times.push((name.to_owned(), started.elapsed(), cpu));
    passed?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// The tests of a test binary by module (its first path segment), in the
/// order listed; a test at the top level is a module of its own.
fn modules(exe: &std::path::Path) -> Result<Vec<(String, Vec<String>)>> {
    let out = Command::new(exe).args(["--list", "--format", "terse"]).output()?;
    if !out.status.success() {
        bail!("{} --list failed: {}", exe.display(), String::from_utf8_lossy(&out.stderr));
    }
    let mut modules: Vec<(String, Vec<String>)> = Vec::new();
    for test in String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.strip_suffix(": test")) {
        let module = test.split_once("::").map_or(test, |(m, _)| m);
        match modules.iter_mut().find(|(m, _)| m == module) {
            Some((_, tests)) => tests.push(test.to_owned()),
            None => modules.push((module.to_owned(), vec![test.to_owned()])),
        }
    }
    Ok(modules)
}

/// A test binary's name without cargo's hash.
fn run_name_of(exe: &std::path::Path) -> String {
    let name = exe.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    match name.rsplit_once('-') {
        Some((stem, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => stem.to_owned(),
        _ => name,
    }
}

/// Waits for `child` as `Child::wait` does, and returns its CPU time too:
/// user and system, its own and that of the descendants it waited for.
fn wait_with_cpu(child: &std::process::Child) -> Result<(std::process::ExitStatus, Duration)> {
    use std::os::unix::process::ExitStatusExt;
    let (mut status, pid) = (0, child.id() as libc::pid_t);
    // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: `pid` is this process's unreaped child (no `Child::wait`
        // has run); `status` and `usage` are writable locals.
        if unsafe { libc::wait4(pid, &mut status, 0, &mut usage) } == pid {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e).context("waiting for a test run");
        }
    }
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    Ok((std::process::ExitStatus::from_raw(status), time(usage.ru_utime) + time(usage.ru_stime)))
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
