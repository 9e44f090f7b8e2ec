//! Root integration tests of how `profiler` ends: exit statuses, the stop
//! signal a `run` command gets (once), a database that fills up mid-session,
//! input it must refuse, and who owns what it writes under `sudo`.
use std::{
    io::{BufRead, BufReader, Write},
    os::unix::{fs::MetadataExt, process::ExitStatusExt},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use integration_tests::*;

fn run_args(db: &Path, extra: &[&str], command: &[&str]) -> Vec<String> {
    let mut args = vec!["run".to_string(), "-o".into(), db.display().to_string(), "--no-gpu".into()];
    args.extend(extra.iter().map(|s| s.to_string()));
    args.push("--".into());
    args.extend(command.iter().map(|s| s.to_string()));
    args
}

#[test]
fn run_exits_with_the_commands_status() {
    let dir = workdir("exit-code");
    let db = dir.join("p.db");
    let agent = Agent::start(&run_args(&db, &[], &["sh", "-c", "exit 7"]), false);
    let (status, stderr) = agent.finish();
    assert_eq!(status.code(), Some(7), "{stderr}");
    assert_eq!(last_session(&db).end_reason.as_deref(), Some("target-exited"));
}

#[test]
fn run_exits_128_plus_the_signal_that_killed_the_command() {
    let dir = workdir("exit-signal");
    let db = dir.join("p.db");
    // Killed while traced.
    let agent = Agent::start(&run_args(&db, &[], &["sh", "-c", "kill -TERM $$"]), false);
    let (status, stderr) = agent.finish();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{stderr}");
    // Killed after --duration ended the profiling window, while the profiler waits for it.
    let agent = Agent::start(&run_args(&db, &["--duration", "0.2"], &["sh", "-c", "sleep 3; kill -KILL $$"]), false);
    let (status, stderr) = agent.finish();
    assert_eq!(status.code(), Some(128 + libc::SIGKILL), "{stderr}");
    assert_eq!(last_session(&db).end_reason.as_deref(), Some("duration"));
}

/// A command that takes SIGINT itself (blocked, then taken with
/// sigtimedwait, so that the kernel's record of each is kept: who sent it and
/// how), writes one line per SIGINT, and exits 0 only if it got exactly one.
const COUNTS_SIGINTS: &str = r#"
import signal, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
out = open(sys.argv[1], "a", buffering=1)
out.write("ready\n")
got, deadline = 0, time.monotonic() + 30
while time.monotonic() < deadline:
    info = signal.sigtimedwait({signal.SIGINT}, 1.0 if got else 0.2)
    if info is None:
        if got:
            break
        continue
    got += 1
    out.write(f"SIGINT code={info.si_code} pid={info.si_pid}\n")
sys.exit(0 if got == 1 else 3)
"#;

fn sigint_lines(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("SIGINT"))
        .map(String::from)
        .collect()
}

fn wait_for_file_line(path: &Path, needle: &str) {
    let t0 = Instant::now();
    while !std::fs::read_to_string(path).unwrap_or_default().contains(needle) {
        assert!(t0.elapsed() < Duration::from_secs(30), "{} never said '{needle}'", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `kill -INT <profiler>`: the signal reached the profiler alone, which
/// passes it on to the command, once.
#[test]
fn a_sigint_sent_to_the_profiler_reaches_the_command_once() {
    let dir = workdir("sigint-kill");
    let (db, script, log) = (dir.join("p.db"), dir.join("counts.py"), dir.join("signals.txt"));
    std::fs::write(&script, COUNTS_SIGINTS).expect("write script");
    let command = ["python3", script.to_str().expect("utf-8"), log.to_str().expect("utf-8")];
    let agent = Agent::start(&run_args(&db, &[], &command), true);
    wait_for_file_line(&log, "ready");
    agent.signal(libc::SIGINT);
    let profiler_pid = agent.child.id();
    let (status, stderr) = agent.finish();
    let lines = sigint_lines(&log);
    assert_eq!(lines.len(), 1, "{lines:?}\n{stderr}");
    // SI_USER (0), from the profiler.
    assert_eq!(lines[0], format!("SIGINT code=0 pid={profiler_pid}"), "{stderr}");
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert_eq!(last_session(&db).end_reason.as_deref(), Some("sigint"));
}

/// Ctrl-C in a terminal: the kernel sends SIGINT to the whole foreground
/// process group, the command included; the profiler must not add its own.
#[test]
fn ctrl_c_in_a_terminal_reaches_the_command_once() {
    let dir = workdir("sigint-tty");
    let (db, script, log) = (dir.join("p.db"), dir.join("counts.py"), dir.join("signals.txt"));
    std::fs::write(&script, COUNTS_SIGINTS).expect("write script");
    let inner = format!(
        "exec {} run -o {} --no-gpu -- python3 {} {}",
        profiler_bin().display(),
        db.display(),
        script.display(),
        log.display()
    );
    // script(1) gives the profiler a terminal of its own, whose input we type.
    let mut term = Command::new("script")
        .args(["-q", "-e", "-c", &inner, "/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start script(1)");
    let out = term.stdout.take().expect("stdout");
    let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let sink = seen.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            sink.lock().expect("lock").push_str(&(line + "\n"));
        }
    });
    wait_for_file_line(&log, "ready");
    let mut input = term.stdin.take().expect("stdin");
    input.write_all(b"\x03").expect("type Ctrl-C");
    input.flush().expect("flush");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = term.try_wait().expect("wait") {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "the profiler did not stop: {}", seen.lock().expect("lock"));
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(input);
    let printed = seen.lock().expect("lock").clone();
    let lines = sigint_lines(&log);
    assert_eq!(lines.len(), 1, "{lines:?}\n{printed}");
    // SI_KERNEL (0x80): from the terminal, not from the profiler.
    assert!(lines[0].starts_with("SIGINT code=128 "), "{lines:?}");
    assert_eq!(status.code(), Some(0), "{printed}");
    assert_eq!(last_session(&db).end_reason.as_deref(), Some("sigint"));
}

/// Unmounts a test's filesystem, whatever happens.
struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn a_database_that_fills_up_fails_the_run_in_one_line() {
    let dir = workdir("disk-full");
    let mnt = dir.join("small");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let ok = Command::new("mount").args(["-t", "tmpfs", "-o", "size=512k", "tmpfs"]).arg(&mnt).status();
    assert!(ok.is_ok_and(|s| s.success()), "mount a 512 KiB tmpfs (root)");
    let _mount = Mount(mnt.clone());
    let db = mnt.join("p.db");
    // 40 000 launch rows need a few MiB.
    let mut trainer = Trainer::spawn(&dir, &["--steps", "40", "--launches", "1000"]);
    let agent = Agent::attach(trainer.pid(), &db, &["--step-symbol", "train_step", "--no-gpu"]);
    trainer.go();
    assert!(trainer.wait().success());
    let (status, stderr) = agent.finish();
    let code = status.code();
    assert_ne!(code, Some(0), "a profile that could not be written must fail the run: {stderr}");
    assert_eq!(status.signal(), None, "{stderr}");
    one_error_line(code, &stderr, "full");
    // What was committed is readable, session row and all.
    let conn = open(&db);
    let sessions: i64 = conn.query_row("SELECT count(*) FROM sessions", [], |r| r.get(0)).expect("query");
    assert_eq!(sessions, 1);
}

#[test]
fn numeric_options_are_refused_in_one_line_never_a_panic() {
    for (flag, value) in [
        ("--duration", "1e20"),
        ("--duration", "-3"),
        ("--duration", "NaN"),
        ("--gpu-interval", "0"),
        ("--system-interval", "99999999999"),
        ("--maps-interval", "-1"),
    ] {
        let (code, stderr) = profiler_output(&["attach", "1", flag, value]);
        assert_eq!(code, Some(2), "{flag} {value}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        one_error_line(code, &stderr, value);
    }
}

#[test]
fn files_written_under_sudo_belong_to_the_user_who_ran_it() {
    let dir = workdir("sudo-owner");
    let db = dir.join("p.db");
    let env = [("SUDO_UID", "4242"), ("SUDO_GID", "4343")];
    let agent = Agent::start_with_env(&run_args(&db, &[], &["true"]), &env, false);
    let (status, stderr) = agent.finish();
    assert!(status.success(), "{stderr}");
    let m = std::fs::metadata(&db).expect("db");
    assert_eq!((m.uid(), m.gid()), (4242, 4343));
    let trace = dir.join("trace.json");
    let out = Command::new(profiler_bin())
        .args(["export"])
        .arg(&db)
        .arg("-o")
        .arg(&trace)
        .envs(env)
        .output()
        .expect("export");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let m = std::fs::metadata(&trace).expect("trace");
    assert_eq!((m.uid(), m.gid()), (4242, 4343));
    // Without sudo's variables (these tests may themselves run under sudo), root's files stay root's.
    let plain = dir.join("plain.db");
    let out = Command::new(profiler_bin())
        .args(run_args(&plain, &[], &["true"]))
        .env_remove("SUDO_UID")
        .env_remove("SUDO_GID")
        .output()
        .expect("run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    wait_for_probe_removal();
    assert_eq!(std::fs::metadata(&plain).expect("db").uid(), 0);
}

/// A stop signal while the profiler waits for a `run` command that outlived
/// the profiling window goes on to the command; one that ignores it does not
/// keep the profiler: it exits at once (within a second) as 128 + SIGTERM,
/// everything stored. The process it leaves removing the probes ends on
/// SIGTERM too: no handler, nothing blocked, out of the terminal's session.
#[test]
fn sigterm_ends_every_profiler_process() {
    let dir = workdir("sigterm-ends");
    let db = dir.join("p.db");
    let trainer = Trainer::spawn(&dir, &["--steps", "1000000", "--launches", "10", "--step-sleep-us", "1000"]);
    // One link a probe: the remover takes ≈90 ms each, long enough to look at it.
    let agent =
        Agent::attach_with_env(trainer.pid(), &db, &["--step-symbol", "train_step"], &[("PROFILER_UPROBE_MULTI", "0")]);
    trainer.go();
    agent.signal(libc::SIGINT);
    let (status, stderr) = agent.finish_now();
    assert!(status.success(), "{stderr}");
    let removers = probe_removers();
    assert_eq!(removers.len(), 1, "one process removes the session's probes: {stderr}");
    let remover = removers[0];
    let proc_status = std::fs::read_to_string(format!("/proc/{remover}/status")).expect("the remover's status");
    // The standard signals, 1 to 31 (the bits above are glibc's and real-time signals).
    for field in ["SigBlk:", "SigIgn:", "SigCgt:"] {
        let line = proc_status.lines().find(|l| l.starts_with(field)).expect(field);
        let mask = u64::from_str_radix(line[field.len()..].trim(), 16).expect("a hex signal mask");
        assert_eq!(mask & 0x7fff_ffff, 0, "the remover has no signal blocked, ignored or caught: {line}");
    }
    let stat = std::fs::read_to_string(format!("/proc/{remover}/stat")).expect("the remover's stat");
    let session: u32 =
        stat.rsplit(") ").next().and_then(|r| r.split_whitespace().nth(3)).expect("sid").parse().expect("sid");
    assert_eq!(session, remover, "the remover leads a session of its own (a terminal's Ctrl-C is not its)");
    send_signal(remover, libc::SIGTERM);
    wait_for_probe_removal();

    // A command that ignores SIGTERM, still running when the window ends.
    let pid_file = dir.join("command.pid");
    let script = format!("echo $$ > {}; trap '' TERM INT; exec sleep 30", pid_file.display());
    let agent = Agent::start(&run_args(&db, &["--duration", "0.3"], &["sh", "-c", &script]), false);
    agent.wait_for("waiting for the command to exit", Duration::from_secs(30));
    let t0 = Instant::now();
    agent.signal(libc::SIGTERM);
    let (status, stderr) = agent.finish();
    let took = t0.elapsed();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{stderr}");
    assert!(stderr.contains("did not exit on SIGTERM; not waiting for it"), "{stderr}");
    assert!(took < Duration::from_secs(10), "the profiler waited {took:?} for a command that ignores SIGTERM");
    assert_eq!(last_session(&db).end_reason.as_deref(), Some("duration"), "{stderr}");
    // The command runs on, as it chose, adopted by this process: not to be left behind.
    let pid: i32 = std::fs::read_to_string(&pid_file).expect("the command's PID").trim().parse().expect("a PID");
    assert!(std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim_end() == "sleep"));
    send_signal(pid as u32, libc::SIGKILL);
    // SAFETY: reaping an adopted child of this process, which no `Child` owns.
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
}
