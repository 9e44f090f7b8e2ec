//! Harness for the root integration tests: starts the C fixtures, attaches the
//! real `profiler` binary, and reads back both the trainer's ground truth and
//! the database. Run through `cargo xtask test`, which builds the fixtures and
//! sets `PROFILER_BIN` and `PROFILER_FIXTURES`.
use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

pub fn profiler_bin() -> PathBuf {
    adopt_orphans();
    PathBuf::from(
        std::env::var_os("PROFILER_BIN").expect("PROFILER_BIN is not set: run these tests with `cargo xtask test`"),
    )
}

pub fn fixtures() -> PathBuf {
    PathBuf::from(
        std::env::var_os("PROFILER_FIXTURES")
            .expect("PROFILER_FIXTURES is not set: run these tests with `cargo xtask test`"),
    )
}

/// A fresh directory for one test's files.
pub fn workdir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("profiler-it-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create workdir");
    d
}

/// The one way a test says it did not check something on this host: a line
/// `SKIPPED: <test>: <reason>`, which `cargo xtask test` counts and totals.
/// Call it where a precondition is not met (then return), or for the part of a
/// test that cannot run here. It goes straight to stdout, past the harness's
/// capture, so that it shows in every run, with or without `--show-output`.
pub fn skip(reason: impl std::fmt::Display) {
    use std::io::Write;
    // The harness names each test's thread after the test.
    let test = std::thread::current().name().unwrap_or("?").to_owned();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "SKIPPED: {test}: {reason}");
    let _ = out.flush();
}

/// The NVIDIA kernel driver, if this host has it loaded: the first line of
/// /proc/driver/nvidia/version, or the module in /sys/module. (Not
/// /dev/nvidiactl: the genuine libcuda creates that node when root calls
/// cuInit, driver or not.)
pub fn nvidia_driver() -> Option<String> {
    if let Ok(v) = std::fs::read_to_string("/proc/driver/nvidia/version") {
        return Some(v.lines().next().unwrap_or("/proc/driver/nvidia/version").trim().to_owned());
    }
    Path::new("/sys/module/nvidia").exists().then(|| "the nvidia kernel module".to_owned())
}

/// Where this host has RAPL, if anywhere: the perf `power` PMU, or powercap
/// `intel-rapl*` zones (AMD's too) under /sys/class/powercap.
pub fn host_rapl() -> Option<String> {
    let pmu = Path::new("/sys/bus/event_source/devices/power");
    let mut found = Vec::new();
    if pmu.exists() {
        found.push(format!("the perf power PMU at {}", pmu.display()));
    }
    let zones: Vec<String> = std::fs::read_dir("/sys/class/powercap")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("intel-rapl"))
        .collect();
    if !zones.is_empty() {
        found.push(format!("powercap zones {}", zones.join(", ")));
    }
    (!found.is_empty()).then(|| found.join(" and "))
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TruthStep {
    /// `train` unless the truth line names another label (the Python trainer's do).
    pub label: String,
    pub tid: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    pub launches: u64,
}

/// A stream synchronisation as the trainer timed it around the call: the
/// profiler's entry and return probes fire between `start_ns` and `end_ns`.
#[derive(Debug, Clone)]
pub struct TruthSync {
    pub tid: u32,
    /// The thread's step number (from 0).
    pub step: i64,
    pub start_ns: u64,
    pub end_ns: u64,
}

#[derive(Debug, Default)]
pub struct Truth {
    pub steps: Vec<TruthStep>,
    pub syncs: Vec<TruthSync>,
    pub total: u64,
    pub apis: BTreeMap<String, u64>,
}

impl Truth {
    pub fn read(path: &Path) -> Truth {
        let file = TruthFile::read(path);
        let mut t = Truth::default();
        for f in file.records("step") {
            t.steps.push(TruthStep {
                label: f.get(4).map_or("train", |l| *l).to_string(),
                tid: file.num(&f, 0),
                start_ns: file.num(&f, 1),
                end_ns: file.num(&f, 2),
                launches: file.num(&f, 3),
            });
        }
        if let Some(f) = file.records("total").last() {
            t.total = file.num(&f, 0);
        }
        for f in file.records("api") {
            t.apis.insert(f[0].to_string(), file.num(&f, 1));
        }
        for f in file.records("sync") {
            t.syncs.push(TruthSync {
                tid: file.num(&f, 0),
                step: file.num(&f, 1),
                start_ns: file.num(&f, 2),
                end_ns: file.num(&f, 3),
            });
        }
        t.steps.sort_by_key(|s| (s.tid, s.start_ns));
        t
    }

    /// Launches per second over the steps' span.
    pub fn launch_rate(&self) -> f64 {
        let first = self.steps.iter().map(|s| s.start_ns).min().unwrap_or(0);
        let last = self.steps.iter().map(|s| s.end_ns).max().unwrap_or(0);
        self.total as f64 / ((last - first) as f64 / 1e9)
    }
}

/// A ground-truth file a fixture wrote: one record per line, its words split
/// on whitespace, the first word naming the record (`step`, `total`, `api`,
/// `cuInit`, …).
pub struct TruthFile {
    path: PathBuf,
    pub text: String,
}

impl TruthFile {
    pub fn read(path: &Path) -> TruthFile {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read truth {}: {e}", path.display()));
        TruthFile { path: path.to_owned(), text }
    }

    /// The words after the name of every `kind` record, in file order.
    pub fn records<'a>(&'a self, kind: &'a str) -> impl Iterator<Item = Vec<&'a str>> + 'a {
        self.text.lines().filter_map(move |line| {
            let mut words = line.split_whitespace();
            (words.next() == Some(kind)).then(|| words.collect())
        })
    }

    /// Word `i` of a record as a number; a panic that names the file and the record otherwise.
    pub fn num<T: std::str::FromStr>(&self, record: &[&str], i: usize) -> T {
        record.get(i).and_then(|w| w.parse().ok()).unwrap_or_else(|| {
            panic!("{}: no number at word {} of record {record:?}\n{}", self.path.display(), i + 1, self.text)
        })
    }
}

/// Nearest-rank percentile (the report's definition): the smallest of `values`
/// with at least `p` % of them at or below it. None when empty.
pub fn percentile<T: Copy + PartialOrd>(values: &[T], p: f64) -> Option<T> {
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let rank = ((p / 100.0 * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len().max(1));
    sorted.get(rank - 1).copied()
}

/// Asserts that every line of `table` fits an 80-column terminal, a wide
/// glyph counting two columns.
pub fn assert_fits_80_columns(table: &str) {
    for line in table.lines() {
        assert!(unicode_width::UnicodeWidthStr::width(line) <= 80, "wider than 80 columns: {line:?}\n{table}");
    }
}

/// Sends `sig` (a `libc::SIG*` number) to process `pid`, a child of this test.
pub fn send_signal(pid: u32, sig: i32) {
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("a process id");
    let sig = rustix::process::Signal::from_named_raw(sig).expect("a named signal");
    rustix::process::kill_process(pid, sig).expect("signal a child");
}

/// The synthetic trainer, held before it loads CUDA until [`Trainer::go`].
pub struct Trainer {
    pub child: Child,
    pub truth: PathBuf,
    go: PathBuf,
    /// The trainer holds after loading its libraries until this exists.
    probed: PathBuf,
}

impl Trainer {
    /// Starts `trainer ARGS --truth … --wait-file … --probed-file …` with the
    /// stand-in libraries on LD_LIBRARY_PATH.
    pub fn spawn(dir: &Path, args: &[&str]) -> Trainer {
        Self::spawn_with(dir, args, Some(fixtures()))
    }

    pub fn spawn_with(dir: &Path, args: &[&str], ld_library_path: Option<PathBuf>) -> Trainer {
        let truth = dir.join("truth.txt");
        let (go, probed) = (dir.join("go"), dir.join("probed"));
        let mut c = Command::new(fixtures().join("trainer"));
        c.args(args).arg("--truth").arg(&truth).arg("--wait-file").arg(&go).arg("--probed-file").arg(&probed);
        match ld_library_path {
            Some(p) => c.env("LD_LIBRARY_PATH", p),
            None => c.env_remove("LD_LIBRARY_PATH"),
        };
        let child = c.spawn().expect("start trainer");
        Trainer { child, truth, go, probed }
    }

    /// Starts the trainer at `trainer` inside `root` through chroot(8) (which
    /// execs it: its PID is the trainer's), with `lib_dir` (a path inside the
    /// root) as LD_LIBRARY_PATH; its files live in the root's /tmp.
    pub fn spawn_in_root(root: &Path, trainer: &str, lib_dir: &str, args: &[&str]) -> Trainer {
        let mut c = Command::new("chroot");
        c.arg(root).arg(trainer).args(args);
        c.args(["--truth", "/tmp/truth.txt", "--wait-file", "/tmp/go", "--probed-file", "/tmp/probed"]);
        let child = c.env("LD_LIBRARY_PATH", lib_dir).spawn().expect("start chroot trainer");
        let tmp = root.join("tmp");
        Trainer { child, truth: tmp.join("truth.txt"), go: tmp.join("go"), probed: tmp.join("probed") }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `sig` (a `libc::SIG*` number).
    pub fn signal(&self, sig: i32) {
        send_signal(self.pid(), sig);
    }

    pub fn go(&self) {
        std::fs::write(&self.probed, b"").expect("write probed file");
        std::fs::write(&self.go, b"").expect("write go file");
    }

    /// Lets it load its libraries, and run once `agent` has said it probes
    /// each of `libraries` (a path's end, as `probing PATH (N probes)` names
    /// it): a library the trainer loads late is probed before its first
    /// launch however slow the machine, not by a sleep's grace.
    pub fn go_once_probed(&self, agent: &Agent, libraries: &[&str]) {
        std::fs::write(&self.go, b"").expect("write go file");
        for lib in libraries {
            agent.wait_for(&format!("{lib} ("), Duration::from_secs(60));
        }
        std::fs::write(&self.probed, b"").expect("write probed file");
    }

    pub fn wait(&mut self) -> ExitStatus {
        self.child.wait().expect("wait trainer")
    }

    pub fn truth(&self) -> Truth {
        Truth::read(&self.truth)
    }
}

impl Drop for Trainer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running `profiler` with its stderr collected.
pub struct Agent {
    pub child: Child,
    stderr: Arc<Mutex<Vec<String>>>,
    /// Set by the reader thread at the pipe's end.
    stderr_ended: Arc<std::sync::atomic::AtomicBool>,
}

impl Agent {
    /// Starts `profiler ARGS` and, when `ready` is set, waits until it says it is tracing.
    pub fn start(args: &[String], ready: bool) -> Agent {
        Self::start_with_env(args, &[], ready)
    }

    /// As [`Agent::start`], with extra environment variables for the profiler.
    pub fn start_with_env(args: &[String], env: &[(&str, &str)], ready: bool) -> Agent {
        let mut command = Command::new(profiler_bin());
        command.args(args).envs(env.iter().copied());
        Self::spawn(command, ready)
    }

    /// Starts `command`, a profiler however it is reached (through chroot(8),
    /// say), as [`Agent::start`] does.
    pub fn spawn(command: Command, ready: bool) -> Agent {
        // After a run that did not go through `finish` (a raw `Command`).
        wait_for_probe_removal();
        let agent = Self::launch(command);
        if ready {
            // The session's own line, which comes after every named process's (theirs say "tracing PID" too).
            agent.wait_for("(Ctrl-C to stop)", Duration::from_secs(30));
        }
        agent
    }

    /// Starts `command` with its stderr collected; waits for nothing.
    fn launch(mut command: Command) -> Agent {
        let mut child = command.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("start profiler");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let stderr_ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (sink, ended) = (stderr.clone(), stderr_ended.clone());
        let pipe = child.stderr.take().expect("stderr piped");
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                sink.lock().expect("lock").push(line);
            }
            ended.store(true, std::sync::atomic::Ordering::Release);
        });
        Agent { child, stderr, stderr_ended }
    }

    /// Starts `profiler ARGS` at once: no wait for an earlier session's
    /// probes to come off, none for this one's tracing line.
    pub fn start_now(args: &[String], env: &[(&str, &str)]) -> Agent {
        let mut command = Command::new(profiler_bin());
        command.args(args).envs(env.iter().copied());
        Self::launch(command)
    }

    pub fn attach(pid: u32, db: &Path, extra: &[&str]) -> Agent {
        Self::attach_with_env(pid, db, extra, &[])
    }

    /// As [`Agent::attach`], with extra environment variables for the profiler.
    pub fn attach_with_env(pid: u32, db: &Path, extra: &[&str], env: &[(&str, &str)]) -> Agent {
        let mut args = vec!["attach".to_string(), pid.to_string(), "-o".into(), db.display().to_string()];
        args.extend(extra.iter().map(|s| s.to_string()));
        Self::start_with_env(&args, env, true)
    }

    pub fn wait_for(&self, needle: &str, timeout: Duration) {
        let t0 = Instant::now();
        while t0.elapsed() < timeout {
            if self.stderr.lock().expect("lock").iter().any(|l| l.contains(needle)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("profiler never printed '{needle}'; stderr so far:\n{}", self.stderr());
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().expect("lock").join("\n")
    }

    pub fn signal(&self, sig: i32) {
        send_signal(self.child.id(), sig);
    }

    /// Waits for exit, and for the kernel to finish removing its probes;
    /// returns the status and everything it printed.
    pub fn finish(self) -> (ExitStatus, String) {
        let r = self.finish_now();
        wait_for_probe_removal();
        r
    }

    /// As [`Agent::finish`], without waiting for the probes to come off.
    pub fn finish_now(mut self) -> (ExitStatus, String) {
        let status = self.child.wait().expect("wait profiler");
        // Every line read: the pipe ends once no process holds it (a target
        // `run` started, or a rank, may hold it longer: 5 s at most then).
        let t0 = Instant::now();
        while !self.stderr_ended.load(std::sync::atomic::Ordering::Acquire) && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(2));
        }
        (status, self.stderr())
    }
}

/// Makes this test process a child subreaper (once): an orphan of a
/// profiler it started, such as the process a finished session leaves
/// removing its probes, becomes this process's child rather than init's, so
/// [`wait_for_probe_removal`] can tell its own from another test's.
fn adopt_orphans() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: prctl on this process with plain integer arguments.
        let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) };
        assert_eq!(r, 0, "PR_SET_CHILD_SUBREAPER: {}", std::io::Error::last_os_error());
    });
}

/// The name (`comm`) of the process a finished session leaves removing its
/// probes (the profiler's `probes::RELEASER_NAME`).
const RELEASER: &str = "profiler-detach";

/// Waits (up to 60 s, else fails) until no probe remover this test started
/// is alive, and reaps those that have exited. The profiler hands the
/// removal of its probes (slow under a kernel-wide lock on older kernels,
/// one RCU grace period per link) to an orphaned process of its own, named
/// [`RELEASER`], and exits; a test that attached again at once would find its
/// own attaches queued behind it, and late-loaded libraries probed too late.
/// The orphans come to this process ([`adopt_orphans`]): another test
/// binary's, running alongside, are not waited for.
pub fn wait_for_probe_removal() {
    let t0 = Instant::now();
    loop {
        let busy = probe_removers();
        if busy.is_empty() {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "probe removers {busy:?} still running after 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The probe removers ([`RELEASER`]) this test started that are still
/// running; those that have exited are reaped.
pub fn probe_removers() -> Vec<u32> {
    adopt_orphans();
    let me = std::process::id().to_string();
    let mut running = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        // "PID (comm) STATE PPID …": a remover adopted by this process.
        let Some(rest) = stat.strip_prefix(&format!("{pid} ({RELEASER}) ")) else { continue };
        let mut fields = rest.split_whitespace();
        if fields.nth(1) != Some(me.as_str()) {
            continue;
        }
        if rest.starts_with('Z') {
            // SAFETY: reaping an exited child of this process that no
            // `Child` handle owns (it was adopted, not spawned).
            unsafe { libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), libc::WNOHANG) };
        } else {
            running.push(pid);
        }
    }
    running
}

/// Runs `profiler ARGS` to completion; returns (exit code, stderr).
pub fn profiler_output(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(profiler_bin()).args(args).output().expect("run profiler");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Asserts a failed run printed exactly one line containing `error`; returns it.
pub fn the_error_line(code: Option<i32>, stderr: &str) -> &str {
    assert_ne!(code, Some(0), "must fail: {stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "exactly one error line: {stderr}");
    errors[0]
}

/// Asserts a failed run printed exactly one error line, and that it says `needle`.
pub fn one_error_line(code: Option<i32>, stderr: &str, needle: &str) {
    let line = the_error_line(code, stderr);
    assert!(line.contains(needle), "'{needle}' not in: {stderr}");
}

#[derive(Clone, Debug)]
pub struct DbStep {
    pub step: i64,
    pub label: String,
    pub tid: u32,
    pub start_ns: u64,
    pub end_ns: Option<u64>,
    pub inter_step_ns: Option<i64>,
    pub launches: Option<u64>,
    /// ns the step's thread could not run (runnable or in an uninterruptible
    /// wait), from the scheduler's tracepoints; None with `--no-sched`.
    pub waited_ns: Option<u64>,
}

#[derive(Debug)]
pub struct Session {
    pub id: i64,
    pub pid: u32,
    pub end_reason: Option<String>,
    pub lost_events: Option<i64>,
    pub total_launches: Option<i64>,
    pub started_ns: i64,
    pub ended_ns: Option<i64>,
}

pub fn open(db: &Path) -> rusqlite::Connection {
    rusqlite::Connection::open(db).expect("open db")
}

/// The session of the last profiler run's first target (its job's first session).
pub fn last_session(db: &Path) -> Session {
    open(db)
        .query_row(
            // The last run's first target: `run` follows the command's children, whose sessions come after.
            "SELECT id, pid, end_reason, lost_events, total_launches, started_ns, ended_ns FROM sessions
             WHERE id = (SELECT min(id) FROM sessions WHERE job = (SELECT job FROM sessions ORDER BY id DESC LIMIT 1))",
            [],
            |r| {
                Ok(Session {
                    id: r.get(0)?,
                    pid: r.get(1)?,
                    end_reason: r.get(2)?,
                    lost_events: r.get(3)?,
                    total_launches: r.get(4)?,
                    started_ns: r.get(5)?,
                    ended_ns: r.get(6)?,
                })
            },
        )
        .expect("a session row")
}

pub fn steps(db: &Path, session: i64) -> Vec<DbStep> {
    let conn = open(db);
    let mut q = conn
        .prepare(
            "SELECT step, tid, start_ns, end_ns, inter_step_ns, launches, label, runnable_ns + blocked_ns
             FROM steps WHERE session_id = ?1 ORDER BY tid, start_ns",
        )
        .expect("prepare");
    q.query_map([session], |r| {
        Ok(DbStep {
            step: r.get(0)?,
            tid: r.get(1)?,
            start_ns: r.get::<_, i64>(2)? as u64,
            end_ns: r.get::<_, Option<i64>>(3)?.map(|v| v as u64),
            inter_step_ns: r.get(4)?,
            launches: r.get::<_, Option<i64>>(5)?.map(|v| v as u64),
            label: r.get(6)?,
            waited_ns: r.get::<_, Option<i64>>(7)?.map(|v| v as u64),
        })
    })
    .expect("query")
    .collect::<Result<Vec<_>, _>>()
    .expect("rows")
}

pub fn count(db: &Path, sql: &str, session: i64) -> i64 {
    open(db).query_row(sql, [session], |r| r.get(0)).unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Per-entry-point launch counts of a session.
pub fn api_counts(db: &Path, session: i64) -> BTreeMap<String, u64> {
    let conn = open(db);
    let mut q = conn
        .prepare("SELECT api_name, count(*) FROM launches_named WHERE session_id = ?1 GROUP BY api_name")
        .expect("prepare");
    q.query_map([session], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)? as u64)))
        .expect("query")
        .collect::<Result<BTreeMap<_, _>, _>>()
        .expect("rows")
}

/// The PyTorch environments `cargo xtask` made (`PROFILER_TORCH_PYTHONS`:
/// `name=python;…`, e.g. `python3.12=/var/cache/profiler/venvs/…/bin/python`);
/// empty where none could be made.
pub fn torch_pythons() -> Vec<(String, PathBuf)> {
    std::env::var("PROFILER_TORCH_PYTHONS")
        .unwrap_or_default()
        .split(';')
        .filter_map(|p| p.split_once('=').map(|(n, p)| (n.to_owned(), PathBuf::from(p))))
        .collect()
}

/// The PyTorch environment `name`'s python (e.g. `python3.11`), or None,
/// said as a visible skip.
pub fn torch_python(name: &str) -> Option<PathBuf> {
    let p = torch_pythons().into_iter().find(|(n, _)| n == name).map(|(_, p)| p);
    if p.is_none() {
        skip(format!("no PyTorch environment for {name} (see `cargo xtask torch-env`)"));
    }
    p
}

/// The JAX environments `cargo xtask` made (`PROFILER_JAX_PYTHONS`:
/// `version=python;…`, newest first); a visible skip where none could be made.
pub fn jax_pythons() -> Vec<(String, PathBuf)> {
    let found: Vec<(String, PathBuf)> = std::env::var("PROFILER_JAX_PYTHONS")
        .unwrap_or_default()
        .split(';')
        .filter_map(|p| p.split_once('=').map(|(n, p)| (n.to_owned(), PathBuf::from(p))))
        .collect();
    if found.is_empty() {
        skip("no JAX environment (see `cargo xtask jax-env`)");
    }
    found
}

/// The `site-packages` directories of the virtual environment at `venv`.
/// The genuine CUDA runtime from the PyTorch wheels (`libcudart.so.13` or
/// `.12`), or None, said as a visible skip.
pub fn genuine_cudart() -> Option<PathBuf> {
    for (_, python) in torch_pythons() {
        let Some(venv) = python.parent().and_then(Path::parent) else { continue };
        for packages in site_packages(venv) {
            for rel in ["nvidia/cu13/lib/libcudart.so.13", "nvidia/cuda_runtime/lib/libcudart.so.12"] {
                if packages.join(rel).exists() {
                    return Some(packages.join(rel));
                }
            }
        }
    }
    skip("no PyTorch environment with the CUDA runtime's libcudart (see `cargo xtask torch-env`)");
    None
}

pub fn site_packages(venv: &Path) -> Vec<PathBuf> {
    let lib = std::fs::read_dir(venv.join("lib")).into_iter().flatten().flatten();
    lib.map(|e| e.path().join("site-packages")).filter(|p| p.is_dir()).collect()
}

/// How far a step's probe boundaries may lie from the trainer's own clock
/// reads: the probe fires before the first and after the last, normally within
/// microseconds (the tests print the p99: 10–13 µs at the start, 2–3 µs at the
/// end on an idle machine). [`assert_steps_match`] adds the time the step's
/// thread could not run, as the scheduler recorded it: a 2-core CI machine
/// under load may hold the thread off its CPU between the probe and the clock
/// read for longer than this bound (22 ms was seen beside a checkpoint writer).
pub const STEP_TOLERANCE_NS: i64 = 20_000_000;

/// Boundary errors in ns between matched steps: (start: truth − db, end: db − truth).
pub struct BoundaryErrors {
    pub start: Vec<i64>,
    pub end: Vec<i64>,
}

impl BoundaryErrors {
    pub fn p99(v: &[i64]) -> i64 {
        percentile(v, 99.0).unwrap_or(0)
    }
}

/// Asserts `db` steps equal `truth` steps one for one, in order (same thread,
/// same label, same launches, boundaries within `tolerance_ns`, the probe's
/// entry before the trainer's own first stamp and its return after the last
/// one). Because each truth step must lie inside its database step, and one
/// thread's steps do not overlap, a pairing shifted by one step fails whatever
/// `tolerance_ns` is: truth k+1 starts after database step k ends.
pub fn assert_steps_match(truth: &[TruthStep], db: &[DbStep], tolerance_ns: i64) -> BoundaryErrors {
    assert_eq!(db.len(), truth.len(), "step count: database {} vs ground truth {}", db.len(), truth.len());
    let mut errs = BoundaryErrors { start: Vec::new(), end: Vec::new() };
    for (t, d) in truth.iter().zip(db) {
        assert_eq!(d.tid, t.tid, "thread of step {d:?} vs {t:?}");
        assert_eq!(d.label, t.label, "label of step {d:?} vs {t:?}");
        assert_eq!(d.launches, Some(t.launches), "launches of step {} (tid {})", d.step, d.tid);
        let end = d.end_ns.expect("completed step has an end");
        let ds = t.start_ns as i64 - d.start_ns as i64;
        let de = end as i64 - t.end_ns as i64;
        // The thread may have been held off its CPU between the probe and the
        // trainer's clock read: that time lies inside the step.
        let bound = tolerance_ns + d.waited_ns.unwrap_or(0) as i64;
        let waited = d.waited_ns.map_or("no scheduler record".into(), |w| format!("{w} ns off-CPU in the step"));
        assert!(
            (0..bound).contains(&ds),
            "step {} start: probe {} vs truth {} ({ds} ns; {waited})",
            d.step,
            d.start_ns,
            t.start_ns
        );
        assert!((0..bound).contains(&de), "step {} end: probe {end} vs truth {} ({de} ns; {waited})", d.step, t.end_ns);
        errs.start.push(ds);
        errs.end.push(de);
    }
    errs
}

/// Raises `/proc/sys/kernel/pid_max` for a test and puts the old value back
/// when dropped (root only). Thread ids above 65 536 exist only where
/// `pid_max` allows them, as it does on current distributions (4 194 304).
pub struct PidMax {
    old: String,
}

impl PidMax {
    const PATH: &'static str = "/proc/sys/kernel/pid_max";

    pub fn raise(to: u32) -> PidMax {
        let old = std::fs::read_to_string(Self::PATH).expect("read pid_max");
        std::fs::write(Self::PATH, to.to_string()).expect("raise pid_max (needs root)");
        PidMax { old }
    }

    /// Makes the next process or thread the kernel creates get id `last + 1`
    /// or a little above (other processes may take a few in between).
    pub fn next_pid_after(&self, last: u32) {
        std::fs::write("/proc/sys/kernel/ns_last_pid", last.to_string()).expect("write ns_last_pid (needs root)");
    }
}

impl Drop for PidMax {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::PATH, self.old.trim());
    }
}

/// What the session stored about loss beyond `lost_events`: step-ring
/// records lost and failed kernel map updates.
pub fn session_losses(db: &Path, session: i64) -> (Option<i64>, Option<i64>) {
    open(db)
        .query_row("SELECT lost_step_records, map_failures FROM sessions WHERE id = ?1", [session], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .expect("session losses")
}

/// The session's steps as [`steps`] gives them, each with `steps.incomplete`.
pub fn steps_with_marks(db: &Path, session: i64) -> Vec<(DbStep, Option<i64>)> {
    let marks: BTreeMap<(String, i64), Option<i64>> = {
        let conn = open(db);
        let mut q = conn.prepare("SELECT label, step, incomplete FROM steps WHERE session_id = ?1").expect("prepare");
        q.query_map([session], |r| Ok(((r.get(0)?, r.get(1)?), r.get(2)?)))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows")
    };
    steps(db, session).into_iter().map(|s| (s.clone(), marks[&(s.label.clone(), s.step)])).collect()
}

/// Launch rows of the session that lie outside the step they are assigned
/// to, or on another thread, or have no step: with every launch of the
/// trainer made inside a step, 0 when each launch was put in its own step.
pub fn launches_outside_their_step(db: &Path, session: i64) -> i64 {
    count(
        db,
        "SELECT count(*) FROM launches l LEFT JOIN steps s USING (session_id, label, step)
         WHERE l.session_id = ?1 AND (s.step IS NULL OR l.tid != s.tid OR l.ts_ns < s.start_ns
                                      OR (s.end_ns IS NOT NULL AND l.ts_ns > s.end_ns))",
        session,
    )
}

/// The stand-in `libnvidia-ml.so.1` of the fixtures (two GPUs with known readings).
pub fn stand_in_nvml() -> String {
    fixtures().join("libnvidia-ml.so.1").display().to_string()
}

/// Profiles the trainer (run to completion) into `db` with the stand-in NVML.
pub fn profile_into(dir: &Path, db: &Path, trainer_args: &[&str], extra: &[&str]) -> Truth {
    // Each trainer gets its own go file and truth file: a go file left by an
    // earlier run would let it start before the profiler is attached.
    let own = dir.join(format!("trainer-{}", std::fs::read_dir(dir).expect("workdir").count()));
    std::fs::create_dir(&own).expect("trainer dir");
    let mut trainer = Trainer::spawn(&own, trainer_args);
    let mut args = vec!["--step-symbol", "train_step", "--nvml-lib"];
    let nvml = stand_in_nvml();
    args.push(&nvml);
    // No RAPL on any host, unless the caller names a powercap tree.
    let no_rapl = no_rapl_root(dir);
    if !extra.contains(&"--powercap-root") {
        args.extend(["--powercap-root", &no_rapl]);
    }
    args.extend_from_slice(extra);
    let agent = Agent::attach(trainer.pid(), db, &args);
    trainer.go();
    assert!(trainer.wait().success(), "trainer failed");
    let (status, stderr) = agent.finish();
    assert!(status.success(), "profiler failed: {stderr}");
    trainer.truth()
}

/// An empty powercap root in `dir`: `--powercap-root` at it means no RAPL, on any host.
pub fn no_rapl_root(dir: &Path) -> String {
    let root = dir.join("no-rapl");
    std::fs::create_dir_all(&root).expect("empty powercap root");
    root.display().to_string()
}

/// A port nothing listens on (bound, then let go).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// `GET path` on 127.0.0.1:port; the body of a 200 reply, else None.
pub fn http_get(port: u16, path: &str) -> Option<String> {
    http_get_query(port, path, &[])
}

/// `GET path?query` (each pair URL-encoded) on 127.0.0.1:port; the body of a 200 reply, else None.
pub fn http_get_query(port: u16, path: &str, query: &[(&str, &str)]) -> Option<String> {
    let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(10)).build().ok()?;
    let reply = client.get(format!("http://127.0.0.1:{port}{path}")).query(query).send().ok()?;
    (reply.status() == reqwest::StatusCode::OK).then(|| reply.text().ok()).flatten()
}

/// The value of the first sample of `metric` (Prometheus text format) that
/// carries every one of `labels` (it may carry others).
pub fn exposed(text: &str, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).ok()?;
    let sample = scrape
        .samples
        .into_iter()
        .find(|s| s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))?;
    match sample.value {
        prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Untyped(v) => Some(v),
        _ => None,
    }
}

/// CLOCK_MONOTONIC now, in ns: the clock the profiler and the fixtures stamp with.
pub fn monotonic_ns() -> i64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}
