//! The frame-hook route of `--step-python`: probes on
//! `_PyEval_EvalFrameDefault` and, on 3.11+, the hook written into each
//! traced process's interpreter ([`write`]), with an alias of the function
//! where one keeps `torch.compile` from undoing it ([`alias`]).
pub mod alias;
pub mod write;

use std::{
    collections::HashMap,
    num::NonZeroU32,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use aya::{
    Ebpf,
    maps::Array,
    programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLink, UProbeScope},
};
use profiler_common::{FrameLayout, maps as map_names, programs};

use self::write::{FieldState, FrameHookWrite, HookError, Locator};
use super::{
    interpreter::{CPythonBuild, needed_libpython},
    spec::PythonTarget,
    targets::{PythonAttachError, fill_targets, loaded_uprobe},
};
use crate::probes::{in_target_root, map_file};

#[derive(Debug, thiserror::Error)]
pub enum FrameHookAttachError {
    #[error(transparent)]
    Targets(#[from] PythonAttachError),
    #[error("{path}: cannot read it again: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Hook(#[from] HookError),
    #[error(
        "--step-python '{0}': the frame hook matches ASCII function names only; name an ASCII function, \
         or run under a CPython with USDT probes"
    )]
    NonAscii(String),
}

/// The frame hook's probes and write in one process. Dropping it restores
/// `eval_frame` and detaches.
#[derive(Debug)]
pub struct FrameHookSteps {
    // Field order is drop order: the writes go back first.
    write: Option<FrameHookWrite>,
    /// The job's other processes that run the same CPython (3.11+).
    members: Option<FrameHookMembers>,
    links: Vec<UProbeLink>,
    /// What the field held when attached (None: not yet CPython, or no
    /// interpreter yet, in `run` mode; written as soon as there is one).
    pub found: Option<FieldState>,
}

impl FrameHookSteps {
    /// Fills `PY_TARGETS` and `FRAME_LAYOUT`, attaches `frame_enter` /
    /// `frame_exit` to `_PyEval_EvalFrameDefault` in `path` (target-visible),
    /// then writes the hook (3.11+): no call leaves the loop before both
    /// probes are there to see it.
    ///
    /// `scope`: the first target alone, or (a job) every process that maps
    /// the file, the programs keeping the traced ones' calls; the job's other
    /// processes get the write through [`FrameHookMembers::add`].
    pub fn attach(
        ebpf: &mut Ebpf,
        pid: NonZeroU32,
        scope: UProbeScope,
        path: &Path,
        build: &CPythonBuild,
        targets: &[PythonTarget],
    ) -> Result<Self, FrameHookAttachError> {
        if let Some(t) = targets.iter().find(|t| !t.spec.function.is_ascii()) {
            return Err(FrameHookAttachError::NonAscii(t.spec.to_string()));
        }
        fill_targets(ebpf, targets)?;
        set_layout(ebpf, build.layout)?;
        let visible = in_target_root(pid.get(), path);
        // Both past any `endbr64`: the return address is still at the stack pointer there, and one
        // breakpoint serves both probes without a single-step (≈7 µs a call on Debian's 3.13/3.14 with
        // the return probe on the `endbr64`, ≈2–3 µs without).
        let at = build.eval_default_file_offset + build.entry_skip;
        let mut links = Vec::with_capacity(2);
        for name in [programs::FRAME_EXIT, programs::FRAME_ENTER] {
            links.push(attach_one(ebpf, name, &visible, at, scope)?);
        }
        let mut steps = Self { write: None, members: None, links, found: None };
        if build.needs_write() {
            let data =
                map_file(&visible).map_err(|source| FrameHookAttachError::Read { path: visible.clone(), source })?;
            let locator = Locator::new(pid.get(), path, &data, build)?;
            if matches!(scope, UProbeScope::AllProcesses) {
                steps.members = Some(FrameHookMembers::new(locator.clone(), &visible));
            }
            let (write, state) = FrameHookWrite::apply(locator)?;
            steps.write = Some(write);
            steps.found = state;
        }
        Ok(steps)
    }

    /// What gives the job's other processes the write (None: one process, or CPython 3.10).
    pub fn members(&self) -> Option<FrameHookMembers> {
        self.members.clone()
    }

    /// How often `eval_frame` was found NULL again (dynamo) and re-written.
    pub fn reapplied(&self) -> u32 {
        self.write.as_ref().map_or(0, FrameHookWrite::reapplied)
    }

    /// The `how` text's tail: the alias written, where one was found at attach.
    pub fn alias_text(&self) -> String {
        match self.write.as_ref().and_then(FrameHookWrite::alias) {
            Some(alias) => format!("; value written: {alias}, which torch.compile cannot reset to NULL"),
            None => String::new(),
        }
    }

    /// Restores `eval_frame` (if it still holds our value), then detaches the probes.
    pub fn detach(mut self) {
        let reapplied = self.reapplied();
        if reapplied > 0 {
            let alias = self.write.as_ref().and_then(FrameHookWrite::alias).map(|a| format!("; from then on {a}"));
            log::info!(
                "eval_frame was found NULL again and re-written {reapplied} times (torch.compile?){}",
                alias.unwrap_or_default()
            );
        }
        if let Some(w) = self.write.take()
            && let Err(e) = w.restore()
        {
            log::warn!("eval_frame not restored: {e}");
        }
        if let Some(m) = self.members.take() {
            m.restore_all();
        }
        drop(std::mem::take(&mut self.links));
    }
}

fn set_layout(ebpf: &mut Ebpf, layout: FrameLayout) -> Result<(), PythonAttachError> {
    let name = map_names::FRAME_LAYOUT;
    let map = ebpf.map_mut(name).ok_or(PythonAttachError::Missing(name))?;
    let mut array: Array<_, FrameLayout> =
        Array::try_from(map).map_err(|source| PythonAttachError::Map { name, source })?;
    array.set(0, layout, 0).map_err(|source| PythonAttachError::Map { name, source })
}

/// The frame hook's write in the job's other processes that run the same
/// CPython file: each gets its own (its own interpreter), watched like the
/// first target's, restored at the end. Shared with the job, which names the
/// processes as it adopts them and as they exec.
#[derive(Clone, Debug)]
pub struct FrameHookMembers {
    /// The first target's locator: the file's facts, for another pid.
    template: Locator,
    /// The CPython file (device, inode): what a process must run to get the write.
    file: Option<(u64, u64)>,
    writes: Arc<Mutex<HashMap<u32, FrameHookWrite>>>,
}

impl FrameHookMembers {
    fn new(template: Locator, path: &Path) -> Self {
        let file = std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()));
        Self { template, file, writes: Arc::default() }
    }

    /// Process `pid` (just adopted, or just exec'ed) gets the write if it
    /// runs the CPython the hook was built for: a watcher thread of its own
    /// looks at its files, then finds and writes the field (nothing here, on
    /// the caller's thread); a write it had before an exec went with its old image.
    pub fn add(&self, pid: u32) {
        let Some(file) = self.file else { return };
        let write = FrameHookWrite::watch_member(self.template.for_pid(pid), move || runs_file(file, pid));
        let old = self.writes.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(pid, write);
        if let Some(old) = old {
            old.abandon();
        }
    }

    /// Waits, up to `timeout`, until every process given the write so far has
    /// had its first look at the field (normally milliseconds: the
    /// interpreter of a process already running is there to be found);
    /// returns those that have not, whose first calls may go unseen.
    pub fn wait_first_looks(&self, timeout: Duration) -> Vec<u32> {
        let t0 = Instant::now();
        loop {
            let pending: Vec<u32> = {
                let writes = self.writes.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                writes.iter().filter(|(_, w)| !w.first_look_done()).map(|(&pid, _)| pid).collect()
            };
            if pending.is_empty() || t0.elapsed() >= timeout {
                return pending;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Process `pid` has exited: its watcher ends, nothing to restore.
    pub fn remove(&self, pid: u32) {
        let old = self.writes.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&pid);
        if let Some(old) = old {
            old.abandon();
        }
    }

    /// Puts NULL back in every process written into that is still there.
    fn restore_all(&self) {
        let writes = std::mem::take(&mut *self.writes.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        for (pid, w) in writes {
            if let Err(e) = w.restore() {
                log::warn!("PID {pid}: eval_frame not restored: {e}");
            }
        }
    }
}

/// Whether process `pid`'s program is the CPython `file` (device, inode), or
/// an executable that loads it (`DT_NEEDED`, through its `LD_LIBRARY_PATH`), or maps it.
fn runs_file(file: (u64, u64), pid: u32) -> bool {
    let same = |p: &Path| std::fs::metadata(p).is_ok_and(|m| (m.dev(), m.ino()) == file);
    let exe = PathBuf::from(format!("/proc/{pid}/exe"));
    if same(&exe) {
        return true;
    }
    let Ok(process) = procfs::process::Process::new(pid as i32) else { return false };
    let ld_path = process
        .environ()
        .ok()
        .and_then(|env| env.get(std::ffi::OsStr::new("LD_LIBRARY_PATH")).map(|v| v.to_string_lossy().into_owned()));
    if let Ok(target) = std::fs::read_link(&exe) {
        let visible = in_target_root(pid, &target);
        if needed_libpython(&visible, ld_path.as_deref()).iter().any(|p| same(&in_target_root(pid, p))) {
            return true;
        }
    }
    process.maps().is_ok_and(|maps| {
        maps.iter()
            .any(|m| m.inode != 0 && m.inode == file.1 && matches!(m.pathname, procfs::process::MMapPath::Path(_)))
    })
}

fn attach_one(
    ebpf: &mut Ebpf,
    name: &'static str,
    path: &Path,
    offset: u64,
    scope: UProbeScope,
) -> Result<UProbeLink, PythonAttachError> {
    let prog = loaded_uprobe(ebpf, name)?;
    let point = UProbeAttachPoint { location: UProbeAttachLocation::AbsoluteOffset(offset), cookie: None };
    let id = prog.attach(point, path, scope).map_err(|source| PythonAttachError::Program { name, source })?;
    prog.take_link(id).map_err(|source| PythonAttachError::Program { name, source })
}
