//! Files the profiler writes under `sudo` belong to the user who ran `sudo`,
//! so that they can query, move and delete their profile without it.
use std::{os::unix::fs::MetadataExt, path::Path};

/// The uid and gid `sudo` recorded for the user who invoked it, when this
/// process runs as root under `sudo`.
fn invoking_user() -> Option<(u32, u32)> {
    if !rustix::process::geteuid().is_root() {
        return None;
    }
    let id = |var: &str| std::env::var(var).ok()?.parse::<u32>().ok();
    let (uid, gid) = (id("SUDO_UID")?, id("SUDO_GID")?);
    (uid != 0).then_some((uid, gid))
}

/// Hands `files`, which this run created, to the user who ran `sudo`, where
/// they are root's: a file someone else owns is left alone, and so is any file
/// that was there before (callers pass only what they created; a profile's
/// callers pass its SQLite side files too, see `store::profile_files`). Does
/// nothing outside `sudo`. A failure is a warning: the file is still there,
/// owned by root.
pub fn give_to_invoking_user<P: AsRef<Path>>(files: &[P]) {
    let Some((uid, gid)) = invoking_user() else { return };
    for p in files.iter().map(AsRef::as_ref) {
        match std::fs::symlink_metadata(p) {
            Ok(m) if m.is_file() && m.uid() == 0 => {
                if let Err(e) = std::os::unix::fs::lchown(p, Some(uid), Some(gid)) {
                    log::warn!("cannot hand {} to uid {uid} (SUDO_UID): {e}", p.display());
                }
            }
            _ => {}
        }
    }
}
