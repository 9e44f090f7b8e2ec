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

/// Hands `path`, which this run created, and the SQLite side files next to
/// it (`-wal`, `-shm`), to the user who ran `sudo`, where they are root's: a
/// file someone else owns is left alone, and so is any file that was there
/// before (callers pass only what they created). Does nothing outside `sudo`.
/// A failure is a warning: the profile is still there, owned by root.
pub fn give_to_invoking_user(path: &Path) {
    let Some((uid, gid)) = invoking_user() else { return };
    let (wal, shm) = (crate::store::side_file(path, "-wal"), crate::store::side_file(path, "-shm"));
    for p in [path, wal.as_path(), shm.as_path()] {
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
