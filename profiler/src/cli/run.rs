//! `profiler run [options] -- CMD ARGS…`: start a command held before `exec`,
//! attach, then let it go, so that nothing it does escapes the probes.
use std::{
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    process::ExitCode,
};

use anyhow::Context;
use clap::Args;

use super::TraceArgs;
use crate::{
    privileges,
    session::{self, LaunchedChild, Target},
};

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub trace: TraceArgs,
    /// Trace the command's process alone, not the processes it starts (by
    /// default its children are traced too, e.g. torchrun's ranks).
    #[arg(long)]
    pub no_children: bool,
    /// The command to run, after `--`.
    #[arg(required = true, last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// Name of the hidden subcommand the child runs first (see [`exec_gate`]).
pub const EXEC_GATE: &str = "__exec-gate";

/// The child's side: wait on `fd` until the profiler has attached, then become
/// the command. std's `spawn` waits for `exec`, so the wait cannot sit between
/// fork and exec; it sits in this first program instead, under the same PID.
pub fn exec_gate(args: &[String]) -> ExitCode {
    use std::os::unix::process::CommandExt;
    let (Some(fd), Some(program)) = (args.first().and_then(|f| f.parse::<i32>().ok()), args.get(1)) else {
        eprintln!("profiler: error: {EXEC_GATE} FD PROGRAM ARG0 [ARGS...]");
        return ExitCode::FAILURE;
    };
    // SAFETY: the profiler passed this fd down for the gate alone; nothing
    // else in this process uses it, and it is closed when `gate` drops.
    let gate = unsafe { OwnedFd::from_raw_fd(fd) };
    let n = rustix::io::read(&gate, &mut [0u8; 1]);
    drop(gate);
    if !matches!(n, Ok(1)) {
        // The profiler went away before attaching: do not run unprofiled.
        return ExitCode::from(127);
    }
    let err = std::process::Command::new(program)
        .arg0(args.get(2).map_or(program.as_str(), String::as_str))
        .args(args.iter().skip(3))
        .exec();
    eprintln!("profiler: error: cannot run {program}: {err}");
    ExitCode::from(127)
}

pub async fn main(args: RunArgs) -> anyhow::Result<ExitCode> {
    privileges::check().map_err(anyhow::Error::msg)?;
    let program = &args.command[0];
    let exe = find_program(program).with_context(|| format!("command '{program}' not found in PATH"))?;
    let (gate_read, gate_write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).context("pipe")?;
    let read_fd = gate_read.as_raw_fd();
    let me = std::env::current_exe().context("cannot find the profiler's own executable")?;
    let mut cmd = tokio::process::Command::new(me);
    cmd.arg(EXEC_GATE).arg(read_fd.to_string()).arg(&exe).arg(program).args(&args.command[1..]);
    // SAFETY: between fork and exec, `read_fd` is still open (the parent
    // holds `gate_read` until `spawn` returns), and fcntl is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            // Let the gate's read end survive exec; the write end stays CLOEXEC.
            let read_end = BorrowedFd::borrow_raw(read_fd);
            rustix::io::fcntl_setfd(read_end, rustix::io::FdFlags::empty())?;
            Ok(())
        });
    }
    let child = cmd.spawn().with_context(|| format!("cannot start {}", exe.display()))?;
    drop(gate_read);
    // A script (`torchrun`, `./train.py`) runs in its interpreter: that is the
    // program probed (its loader, its CPython), though the script is what is run.
    // A version manager's shim (pyenv's `python3`) execs the program it picks.
    let exe = shim_target(&exe).or_else(|| script_interpreter(&exe)).unwrap_or(exe);
    let launched = LaunchedChild { child, release: gate_write, exe, command: args.command.join(" ") };
    let mut cfg = args.trace.into_config();
    cfg.follow_children = !args.no_children;
    let summary = session::profile(cfg, Target::Run(Box::new(launched))).await?;
    summary.report_failure();
    Ok(summary.exit_code())
}

/// `program` as PATH finds it, with its links resolved.
fn find_program(program: &str) -> which::Result<std::path::PathBuf> {
    let found = which::which(program)?;
    Ok(std::fs::canonicalize(&found).unwrap_or(found))
}

/// The interpreter a script names on its `#!` line (through `env`, as
/// `#!/usr/bin/env python3` or `#!/usr/bin/env -S python3 -u`, looked up in
/// PATH), canonical; None for anything else.
fn script_interpreter(path: &std::path::Path) -> Option<std::path::PathBuf> {
    use std::io::{BufRead, Read};
    let mut line = String::new();
    std::io::BufReader::new(std::fs::File::open(path).ok()?.take(4096)).read_line(&mut line).ok()?;
    let mut words = line.strip_prefix("#!")?.split_whitespace();
    let first = words.next()?;
    let program = if std::path::Path::new(first).file_name().is_some_and(|n| n == "env") {
        // `env [-S] [-i] [-u NAME] [-C DIR] [NAME=VALUE]… PROGRAM`: the options that take a value skip it.
        let mut program = None;
        while let Some(w) = words.next() {
            match w {
                "-u" | "--unset" | "-C" | "--chdir" => {
                    words.next();
                }
                w if w.starts_with('-') || w.contains('=') => {}
                w => {
                    program = Some(w);
                    break;
                }
            }
        }
        program?
    } else {
        first
    };
    find_program(program).ok()
}

/// The program a pyenv or asdf shim runs (`exec "…/pyenv" exec "$program"
/// "$@"`), as the tool's own `which` names it for the shim's name, in this
/// directory and environment; None for anything else.
fn shim_target(path: &std::path::Path) -> Option<std::path::PathBuf> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path).ok()?.take(64 * 1024).read_to_string(&mut text).ok()?;
    if !text.starts_with("#!") {
        return None;
    }
    let unquote = |w: &str| w.trim_matches('"').to_owned();
    let tool = text.lines().find_map(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        let tool = std::path::PathBuf::from(unquote(w.get(1)?));
        let known = tool.file_name().is_some_and(|n| n == "pyenv" || n == "asdf");
        (w[0] == "exec" && w.get(2) == Some(&"exec") && known).then_some(tool)
    })?;
    // pyenv's shim exports the root it was made for.
    let root = text.lines().find_map(|l| l.trim().strip_prefix("export PYENV_ROOT=").map(unquote));
    let mut which = std::process::Command::new(&tool);
    which.arg("which").arg(path.file_name()?).stderr(std::process::Stdio::null());
    if let Some(root) = root {
        which.env("PYENV_ROOT", root);
    }
    let out = which.output().ok().filter(|o| o.status.success())?;
    let found = std::path::PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    std::fs::canonicalize(found).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_script_runs_in_the_interpreter_its_first_line_names() {
        let dir = std::env::temp_dir().join(format!("profiler-shebang-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let sh = std::fs::canonicalize(which::which("sh").expect("sh on PATH")).expect("canonical");
        let cases = [
            ("direct", format!("#!{}\necho", sh.display())),
            ("env", "#!/usr/bin/env sh\necho".to_string()),
            ("env-s", "#!/usr/bin/env -S A=1 sh -e\necho".to_string()),
            ("env-u", "#!/usr/bin/env -u HOME -C /tmp sh\necho".to_string()),
        ];
        for (name, text) in cases {
            let p = dir.join(name);
            std::fs::write(&p, text).expect("script");
            assert_eq!(script_interpreter(&p).as_deref(), Some(sh.as_path()), "{name}");
        }
        let plain = dir.join("plain");
        std::fs::write(&plain, "echo").expect("file");
        assert_eq!(script_interpreter(&plain), None);
        assert_eq!(script_interpreter(&sh), None, "an ELF file has no #! line");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A pyenv shim is followed to the program `pyenv which NAME` names (the
    /// shim's exported PYENV_ROOT passed on); a script that is no shim is not.
    #[test]
    fn a_version_managers_shim_is_followed_to_its_program() {
        let dir = std::env::temp_dir().join(format!("profiler-shim-{}", std::process::id()));
        let shims = dir.join("shims");
        std::fs::create_dir_all(&shims).expect("dir");
        let sh = std::fs::canonicalize(which::which("sh").expect("sh on PATH")).expect("canonical");
        // A stand-in pyenv: `which python3` under the right root answers sh's path.
        let pyenv = dir.join("pyenv");
        let answer = format!(
            "#!/bin/sh\n[ \"$1 $2 $PYENV_ROOT\" = \"which python3 {}\" ] && echo {} && exit 0\nexit 1\n",
            dir.display(),
            sh.display()
        );
        std::fs::write(&pyenv, answer).expect("pyenv");
        let shim = shims.join("python3");
        let text = format!(
            "#!/usr/bin/env bash\nset -e\nexport PYENV_ROOT=\"{}\"\nexec \"{}\" exec \"$program\" \"$@\"\n",
            dir.display(),
            pyenv.display()
        );
        std::fs::write(&shim, text).expect("shim");
        for f in [&pyenv, &shim] {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        }
        assert_eq!(shim_target(&shim).as_deref(), Some(sh.as_path()));
        // Another name: the stand-in answers nothing, so no target.
        let other = shims.join("python9");
        std::fs::copy(&shim, &other).expect("copy");
        assert_eq!(shim_target(&other), None);
        let script = dir.join("train.py");
        std::fs::write(&script, "#!/usr/bin/env python3\nexec(open('x').read())\n").expect("script");
        assert_eq!(shim_target(&script), None, "a script that is no shim");
        assert_eq!(shim_target(&sh), None, "an ELF file");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
