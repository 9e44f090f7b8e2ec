//! What program a command runs: the file PATH finds, a script's `#!`
//! interpreter, the program a version manager's shim execs, and the CPython a
//! wrapper's PATH names. `run` probes that program, not the script.

/// `program` as PATH finds it, with its links resolved.
pub fn find_program(program: &str) -> which::Result<std::path::PathBuf> {
    let found = which::which(program)?;
    Ok(std::fs::canonicalize(&found).unwrap_or(found))
}

/// The interpreter a script names on its `#!` line (through `env`, as
/// `#!/usr/bin/env python3` or `#!/usr/bin/env -S python3 -u`, looked up in
/// PATH), canonical; None for anything else.
pub fn script_interpreter(path: &std::path::Path) -> Option<std::path::PathBuf> {
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
pub fn shim_target(path: &std::path::Path) -> Option<std::path::PathBuf> {
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

/// The CPython `python3` (else `python`) names on the PATH `path` (relative
/// entries against `cwd`): what a wrapper script (`bash train.sh`, a batch
/// job's script) most likely starts. A version manager's shim is followed
/// only with `follow_shims` (running its tool: `run`, whose command runs with
/// the profiler's rights anyway; never for a process attached to).
pub fn path_python(
    path: Option<&std::ffi::OsStr>,
    cwd: &std::path::Path,
    follow_shims: bool,
) -> Option<std::path::PathBuf> {
    ["python3", "python"].iter().find_map(|name| {
        let found = which::which_in(name, path, cwd).ok()?;
        let found = std::fs::canonicalize(&found).unwrap_or(found);
        Some(if follow_shims { program_run_by(&found) } else { found })
    })
}

/// The program that runs when `exe` is executed: through version managers'
/// shims and `#!` lines, in any order (a shim that runs a pip console script
/// whose `#!` names a CPython, a script whose `env python3` is a shim), a
/// few levels deep.
pub fn program_run_by(exe: &std::path::Path) -> std::path::PathBuf {
    let mut exe = exe.to_path_buf();
    for _ in 0..4 {
        match shim_target(&exe).or_else(|| script_interpreter(&exe)) {
            Some(next) if next != exe => exe = next,
            _ => break,
        }
    }
    exe
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
        assert_eq!(program_run_by(&shim), sh, "sh itself runs no further program");
        // A script whose `#!` names the shim: followed through both (`./train.py` under pyenv).
        let script = dir.join("train.py");
        std::fs::write(&script, format!("#!{}\nprint()\n", shim.display())).expect("script");
        assert_eq!(program_run_by(&script), sh);
        // Another name: the stand-in answers nothing, so no target.
        let other = shims.join("python9");
        std::fs::copy(&shim, &other).expect("copy");
        assert_eq!(shim_target(&other), None);
        assert_eq!(shim_target(&script), None, "a script that is no shim");
        assert_eq!(shim_target(&sh), None, "an ELF file");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
