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

use super::report::ProfileDb;
use crate::store::{MergeInput, merge_into, profile_files, side_file, written_by_a_live_profiler};

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
    check_paths(&args)?;
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
        .tempfile_in(dir)
        .with_context(|| format!("cannot create a file in {}; choose a writable -o", dir.display()))?
        .into_temp_path();
    let summary = merge_into(&temp, &inputs, args.job.as_deref())?;
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

    for (input, table, rows) in &summary.orphans {
        eprintln!("profiler: warning: {rows} rows of {table} in {} belong to no session; not merged", input.display());
    }
    for (input, table) in &summary.foreign_tables {
        eprintln!("profiler: warning: table {table} of {} is not the profiler's; not merged", input.display());
    }
    eprintln!(
        "profiler: merged {} sessions ({} rows) from {} profiles into {}",
        summary.sessions,
        summary.rows,
        inputs.len(),
        out.display()
    );
    Ok(ExitCode::SUCCESS)
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
