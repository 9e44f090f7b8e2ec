//! `profiler merge A.db B.db … -o job.db`: the checks around a merge (no
//! input twice, never into an input, never over a file without --force) and
//! the new file made whole or not at all; the copy is `store::merge_into`.
use std::{
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::{Context, bail};
use clap::Args;

use crate::profile::ProfileDb;
use crate::store::{MergeInput, MergeSummary, merge_into, profile_files, side_file, written_by_a_live_profiler};

#[derive(Args, Debug)]
pub struct MergeArgs {
    /// Profiles to merge (one per node, say), in the order their sessions are numbered.
    #[arg(required = true, value_name = "PROFILE")]
    inputs: Vec<PathBuf>,
    /// The merged profile to create.
    #[arg(short, long, value_name = "PATH")]
    output: PathBuf,
    /// Replace OUTPUT if it exists (never an input, never a profile a running profiler writes).
    #[arg(long)]
    force: bool,
    /// Put every merged session in job NAME (for nodes profiled under different job ids).
    #[arg(long, value_name = "NAME")]
    job: Option<String>,
}

pub async fn main(args: MergeArgs) -> anyhow::Result<ExitCode> {
    let (summary, profiles) = merge(&args)?;
    for (input, table, rows) in &summary.orphans {
        eprintln!("profiler: warning: {rows} rows of {table} in {} belong to no session; not merged", input.display());
    }
    for (input, table) in &summary.foreign_tables {
        eprintln!("profiler: warning: table {table} of {} is not the profiler's; not merged", input.display());
    }
    eprintln!(
        "profiler: merged {} sessions ({} rows) from {profiles} profiles into {}",
        summary.sessions,
        summary.rows,
        args.output.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// Checks the paths, reads the inputs, writes the output; returns what was
/// merged and from how many profiles.
fn merge(args: &MergeArgs) -> anyhow::Result<(MergeSummary, usize)> {
    check_paths(args)?;
    let dbs = args.inputs.iter().map(|p| ProfileDb::open(p)).collect::<anyhow::Result<Vec<_>>>()?;
    for db in dbs.iter().filter(|db| db.written_by_a_live_profiler) {
        eprintln!(
            "profiler: warning: a running profiler is still writing {}; its sessions are merged as they are now",
            db.path.display()
        );
    }
    let inputs: Vec<MergeInput> = dbs.iter().map(|db| MergeInput { path: &db.path, conn: &db.conn }).collect();

    // Built under a temporary name beside the output and renamed over it
    // when complete: a failed merge leaves nothing, a replaced file is
    // replaced whole.
    let out = &args.output;
    let dir = out.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let temp = tempfile::Builder::new()
        .prefix(&format!(".{name}.merging-"))
        // A profile's mode, not a temporary file's 0600 (the umask applies).
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .tempfile_in(dir)
        .with_context(|| format!("cannot create a file in {}; choose a writable -o", dir.display()))?
        .into_temp_path();
    // Its message holds SQLite's reason once; the chain would repeat it.
    let summary = merge_into(&temp, &inputs, args.job.as_deref()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let persisted = if args.force {
        // A -wal left by the replaced profile would be applied to the new one.
        for side in [side_file(out, "-wal"), side_file(out, "-shm")] {
            match std::fs::remove_file(&side) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(e).with_context(|| format!("cannot remove {} of the profile replaced", side.display()));
                }
                _ => {}
            }
        }
        temp.persist(out)
    } else {
        temp.persist_noclobber(out)
    };
    persisted.map_err(|e| e.error).with_context(|| format!("cannot create {}", out.display()))?;
    crate::ownership::give_to_invoking_user(&profile_files(out));
    Ok((summary, inputs.len()))
}

/// Refuses a missing input, one named twice (by any path to the same file),
/// an output that is one of the inputs, and an existing output without
/// --force or that a running profiler writes.
fn check_paths(args: &MergeArgs) -> anyhow::Result<()> {
    let mut seen: Vec<(&Path, (u64, u64))> = Vec::new();
    for input in &args.inputs {
        let meta = match std::fs::metadata(input) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bail!("{} does not exist; pass profiles written by `profiler attach/run -o FILE`", input.display())
            }
            r => r.with_context(|| format!("cannot read {}", input.display()))?,
        };
        let id = (meta.dev(), meta.ino());
        if let Some((first, _)) = seen.iter().find(|(_, s)| *s == id) {
            bail!("{} and {} are the same file; name each profile once", first.display(), input.display());
        }
        seen.push((input, id));
    }
    let out = &args.output;
    let Ok(meta) = std::fs::metadata(out) else { return Ok(()) };
    if let Some((input, _)) = seen.iter().find(|(_, s)| *s == (meta.dev(), meta.ino())) {
        bail!("-o {} is the input {}; merge into a new file", out.display(), input.display());
    }
    if !args.force {
        bail!("{} exists; pass --force to replace it, or another -o", out.display());
    }
    if written_by_a_live_profiler(out) {
        bail!("a running profiler is writing {}; choose another -o", out.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::{
        cli::{Cli, Command},
        store::{
            LaunchRow, SessionEnd, Store, StoreMsg,
            testing::{launch, start},
        },
    };

    fn args(argv: &[&Path]) -> MergeArgs {
        let mut all = vec![Path::new("profiler"), Path::new("merge")];
        all.extend(argv);
        let Command::Merge(a) = Cli::try_parse_from(all).expect("parses").command else { panic!("merge expected") };
        a
    }

    /// A profile with one session of `launches` launches.
    fn profile(path: &Path, launches: u64) {
        let store = Store::open(path).expect("open");
        let id = store.begin_session(&start()).expect("session");
        let w = store.spawn_writer(id);
        w.send(StoreMsg::Launches((0..launches).map(|k| LaunchRow { ts_ns: k, ..launch() }).collect()));
        let end =
            SessionEnd { ended_ns: 9, end_reason: "x".into(), lost_events: 0, total_launches: 0, unmatched_returns: 0 };
        w.finish(end, Vec::new()).expect("finish");
    }

    /// The files in `dir` but the side files reading a profile leaves.
    fn files_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| !n.ends_with("-wal") && !n.ends_with("-shm"))
            .collect();
        names.sort();
        names
    }

    fn refused(a: &MergeArgs, needle: &str) {
        let err = format!("{:#}", merge(a).expect_err("refused"));
        assert!(err.contains(needle) && !err.contains('\n'), "{err}");
    }

    #[test]
    fn never_merges_a_file_into_itself_or_twice() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b) = (dir.path().join("a.db"), dir.path().join("b.db"));
        profile(&a, 1);
        profile(&b, 1);
        let (link, hard) = (dir.path().join("link.db"), dir.path().join("hard.db"));
        std::os::unix::fs::symlink(&a, &link).expect("symlink");
        std::fs::hard_link(&a, &hard).expect("hard link");
        let before = std::fs::read(&a).expect("read");
        for out in [&a, &link, &hard] {
            refused(&args(&[&a, &b, Path::new("-o"), out]), "is the input");
            refused(&args(&[&b, &a, Path::new("-o"), out, Path::new("--force")]), "is the input");
        }
        refused(&args(&[&a, &link, Path::new("-o"), &dir.path().join("job.db")]), "are the same file");
        assert_eq!(std::fs::read(&a).expect("read"), before);
        assert_eq!(files_in(dir.path()), ["a.db", "b.db", "hard.db", "link.db"]);
    }

    /// An existing output is refused without --force; with it, replaced
    /// whole, a -wal it left included (SQLite would apply it to the new file).
    #[test]
    fn replaces_an_existing_output_only_when_forced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b, out) = (dir.path().join("a.db"), dir.path().join("b.db"), dir.path().join("job.db"));
        profile(&a, 3);
        profile(&b, 5);
        std::fs::write(&out, b"old").expect("old output");
        refused(&args(&[&a, &b, Path::new("-o"), &out]), "pass --force");
        assert_eq!(std::fs::read(&out).expect("read"), b"old");
        std::fs::write(side_file(&out, "-wal"), vec![0x42u8; 4096]).expect("stale wal");
        let (summary, profiles) = merge(&args(&[&a, &b, Path::new("-o"), &out, Path::new("--force")])).expect("merge");
        assert_eq!((summary.sessions, profiles), (2, 2));
        assert!(!side_file(&out, "-wal").exists(), "the replaced profile's -wal is gone");
        let c = rusqlite::Connection::open(&out).expect("open");
        let launches: Vec<i64> = c
            .prepare("SELECT count(*) FROM launches GROUP BY session_id ORDER BY session_id")
            .expect("q")
            .query_map([], |r| r.get(0))
            .expect("q")
            .collect::<rusqlite::Result<_>>()
            .expect("q");
        assert_eq!(launches, [3, 5]);
        assert_eq!(files_in(dir.path()), ["a.db", "b.db", "job.db"]);

        // Not even with --force over a profile a profiler is writing.
        let live = dir.path().join("live.db");
        let writing = Store::open(&live).expect("a profiler's store");
        refused(&args(&[&a, &b, Path::new("-o"), &live, Path::new("--force")]), "a running profiler is writing");
        drop(writing);
        // As a file created here with the umask applied, less write for others.
        let mode =
            |p: &Path| std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(p).expect("stat").permissions());
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"").expect("plain file");
        assert_eq!(mode(&out) & 0o777, mode(&plain) & 0o644, "not a temporary file's 0600");
        std::fs::remove_file(&plain).expect("rm");
    }

    /// A missing, corrupt or damaged input: one line naming it, and nothing
    /// written (no output, no temporary file).
    #[test]
    fn a_bad_input_is_refused_and_nothing_is_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, bad, out) = (dir.path().join("a.db"), dir.path().join("bad.db"), dir.path().join("job.db"));
        profile(&a, 1);
        refused(&args(&[&a, &bad, Path::new("-o"), &out]), "bad.db does not exist");
        std::fs::write(&bad, vec![0x42u8; 8192]).expect("write");
        refused(&args(&[&a, &bad, Path::new("-o"), &out]), "bad.db is not a SQLite database");
        // A real profile whose second half is overwritten: its header and
        // schema read, its rows do not.
        std::fs::remove_file(&bad).expect("rm");
        profile(&bad, 20_000);
        let mut bytes = std::fs::read(&bad).expect("read");
        let half = bytes.len() / 2;
        bytes[half..].fill(0x42);
        std::fs::write(&bad, bytes).expect("damage");
        refused(&args(&[&a, &bad, Path::new("-o"), &out]), "bad.db");
        assert_eq!(files_in(dir.path()), ["a.db", "bad.db"]);
    }
}
