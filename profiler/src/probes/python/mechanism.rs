//! `--step-python` on any CPython 3.10–3.14: which mechanism a target gets
//! (its USDT probes where the build has them, else the PEP 523 frame hook),
//! and attaching/detaching the frame hook's programs and write.
use std::{
    collections::HashMap,
    num::NonZeroU32,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use aya::{
    Ebpf,
    maps::Array,
    programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLink, UProbeScope},
};
use profiler_common::{FrameLayout, maps as map_names, programs};

use super::{
    cpython::{self, CPythonBuild},
    frame_hook::{self, FieldState, FrameHookWrite, HookError},
    usdt::python::{
        PythonAttachError, PythonProbeError, PythonProbes, PythonSteps, PythonTarget, fill_targets, loaded_uprobe,
    },
};

/// How the step functions of one target are seen.
#[derive(Clone, Debug)]
pub enum PythonMechanism {
    /// CPython's `python:function__entry/return` (no write into the target).
    Usdt(PythonProbes),
    /// The PEP 523 frame hook on the CPython in `path`.
    FrameHook { path: PathBuf, build: CPythonBuild },
}

#[derive(Debug, thiserror::Error)]
pub enum PythonResolveError {
    #[error(
        "{path}: CPython {major}.{minor} has no USDT function probes; the frame hook would write one pointer \
         into the target (PyInterpreterState.eval_frame), which --no-target-writes forbids. Drop \
         --no-target-writes, or mark steps in native code with --step-symbol"
    )]
    WritesRefused { path: PathBuf, major: u8, minor: u8 },
    #[error(
        "{usdt}; nor can the PEP 523 frame hook be used: {hook}. Run the training under CPython 3.10–3.14, \
         or mark steps in native code with --step-symbol"
    )]
    Neither { usdt: Box<PythonProbeError>, hook: String, none_is_cpython: bool },
}

impl PythonResolveError {
    /// No candidate is a CPython at all (not ELF, or no interpreter's
    /// symbols): a wrapper, not an interpreter the profiler cannot use.
    pub fn none_is_cpython(&self) -> bool {
        matches!(self, Self::Neither { none_is_cpython: true, .. })
    }
}

/// The mechanism for `candidates` (target-visible paths: the executable,
/// then the mapped `libpython*`s); `open` maps a path to its bytes.
pub fn resolve<B: AsRef<[u8]>>(
    candidates: &[PathBuf],
    mut open: impl FnMut(&Path) -> Option<B>,
    allow_writes: bool,
) -> Result<PythonMechanism, PythonResolveError> {
    let usdt = match super::usdt::python::resolve(candidates, &mut open) {
        Ok(p) => return Ok(PythonMechanism::Usdt(p)),
        Err(e) => e,
    };
    let mut reasons = Vec::new();
    let mut none_is_cpython = true;
    for path in candidates {
        let Some(bytes) = open(path) else { continue };
        let inspected = cpython::inspect(bytes.as_ref());
        none_is_cpython &= matches!(inspected, Err(cpython::CPythonError::NotElf | cpython::CPythonError::Missing(_)));
        match inspected {
            Ok(build) if build.needs_write() && !allow_writes => {
                let (major, minor) = build.version;
                return Err(PythonResolveError::WritesRefused { path: path.clone(), major, minor });
            }
            Ok(build) => return Ok(PythonMechanism::FrameHook { path: path.clone(), build }),
            Err(e) => reasons.push(format!("{}: {e}", path.display())),
        }
    }
    Err(PythonResolveError::Neither { usdt: Box::new(usdt), hook: reasons.join("; "), none_is_cpython })
}

/// The `libpython*` an executable needs (DT_NEEDED), found through its
/// RUNPATH/RPATH (`$ORIGIN` expanded), `ld_library_path` and the usual
/// directories: in `run` mode the command has not loaded it yet, and a
/// `--enable-shared` build (pyenv's) keeps the interpreter there.
pub fn needed_libpython(exe: &Path, ld_library_path: Option<&str>) -> Vec<PathBuf> {
    let Ok(data) = super::map_file(exe) else { return Vec::new() };
    let Some((needed, search)) = dynamic_strings(&data) else { return Vec::new() };
    let origin = exe.parent().map(|d| d.display().to_string()).unwrap_or_default();
    let dirs: Vec<String> = search
        .iter()
        .flat_map(|s| s.split(':'))
        .map(|d| d.replace("$ORIGIN", &origin).replace("${ORIGIN}", &origin))
        .chain(ld_library_path.into_iter().flat_map(|p| p.split(':')).map(str::to_owned))
        .chain(
            ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/local/lib", "/lib", "/usr/lib"]
                .map(String::from),
        )
        .filter(|d| !d.is_empty())
        .collect();
    needed
        .iter()
        .filter(|n| n.starts_with("libpython"))
        .filter_map(|n| dirs.iter().map(|d| Path::new(d).join(n)).find(|p| p.exists()))
        .collect()
}

/// `(DT_NEEDED names, DT_RUNPATH and DT_RPATH values)` of an ELF file.
fn dynamic_strings(data: &[u8]) -> Option<(Vec<String>, Vec<String>)> {
    use object::{
        elf,
        read::elf::{Dyn, ElfFile64, FileHeader, SectionHeader},
    };
    let file = ElfFile64::<object::Endianness>::parse(data).ok()?;
    let endian = file.endian();
    let sections = file.elf_header().sections(endian, data).ok()?;
    let (_, header) = sections.iter().enumerate().find(|(_, s)| s.sh_type(endian) == elf::SHT_DYNAMIC)?;
    let (entries, link) = header.dynamic(endian, data).ok()??;
    let strings = sections.strings(endian, data, link).ok()?;
    let (mut needed, mut search) = (Vec::new(), Vec::new());
    for d in entries {
        let text = || d.string(endian, strings).ok().map(|b| String::from_utf8_lossy(b).into_owned());
        match d.d_tag(endian) {
            elf::DT_NEEDED => needed.extend(text()),
            elf::DT_RUNPATH | elf::DT_RPATH => search.extend(text()),
            _ => {}
        }
    }
    Some((needed, search))
}

/// What `--step-python` would use for process `pid` and why, for `doctor`:
/// None when no candidate is a CPython at all.
pub fn mechanism_for(pid: u32, candidates: &[PathBuf]) -> Option<Result<String, String>> {
    let open = |p: &Path| super::open_in_target(pid, p);
    let is_cpython = |p: &PathBuf| {
        open(p).is_some_and(|b| {
            !matches!(cpython::inspect(&b), Err(cpython::CPythonError::NotElf | cpython::CPythonError::Missing(_)))
        })
    };
    if !candidates.iter().any(is_cpython) {
        return None;
    }
    Some(resolve(candidates, open, true).map(|m| m.describe()).map_err(|e| e.to_string()))
}

impl PythonMechanism {
    /// One line for `doctor` and the session's output: what it is and what it costs.
    pub fn describe(&self) -> String {
        match self {
            Self::Usdt(p) => {
                let v = p.version.map(|(a, b)| format!("CPython {a}.{b}, ")).unwrap_or_default();
                format!("USDT python:function__entry/return ({v}{}): no write into the target", p.path.display())
            }
            Self::FrameHook { path, build } if build.needs_write() => format!(
                "PEP 523 frame hook (CPython {}.{}, {}, no USDT probes): writes one pointer into the target \
                 (eval_frame) and costs each Python call about 2 µs while attached; detach restores it",
                build.version.0,
                build.version.1,
                path.display()
            ),
            Self::FrameHook { path, .. } => format!(
                "probes on _PyEval_EvalFrameDefault (CPython 3.10, {}, no USDT probes): no write; each Python \
                 call costs about 2 µs while attached",
                path.display()
            ),
        }
    }
}

/// The Python step probes attached to one process, either mechanism.
#[derive(Debug)]
pub enum PythonStepProbes {
    Usdt(PythonSteps),
    FrameHook(FrameHookSteps),
}

impl PythonStepProbes {
    /// Detaches (and, for the frame hook, restores `eval_frame` first).
    pub fn detach(self) {
        match self {
            Self::Usdt(s) => s.detach(),
            Self::FrameHook(s) => s.detach(),
        }
    }
}

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
        let visible = super::in_target_root(pid.get(), path);
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
            let data = super::map_file(&visible)
                .map_err(|source| FrameHookAttachError::Read { path: visible.clone(), source })?;
            let locator = frame_hook::Locator::new(pid.get(), path, &data, build)?;
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
    template: frame_hook::Locator,
    /// The CPython file (device, inode): what a process must run to get the write.
    file: Option<(u64, u64)>,
    writes: Arc<Mutex<HashMap<u32, FrameHookWrite>>>,
}

impl FrameHookMembers {
    fn new(template: frame_hook::Locator, path: &Path) -> Self {
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
        let visible = super::in_target_root(pid, &target);
        if needed_libpython(&visible, ld_path.as_deref()).iter().any(|p| same(&super::in_target_root(pid, p))) {
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

impl super::Probes {
    /// [`FrameHookSteps::attach`] with the loaded object and target of these probes.
    pub fn attach_frame_hook(
        &mut self,
        path: &Path,
        build: &CPythonBuild,
        targets: &[PythonTarget],
    ) -> Result<FrameHookSteps, FrameHookAttachError> {
        FrameHookSteps::attach(&mut self.ebpf, self.pid, self.scope, path, build, targets)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// pyenv builds `--enable-shared`: the executable names its libpython
    /// (DT_NEEDED) and where it is (RUNPATH); a file without one names none.
    #[test]
    fn needed_libpython_follows_runpath() {
        let exe = Path::new("/root/.pyenv/versions/3.12.1/bin/python3.12");
        if !exe.exists() {
            crate::skip_test("no pyenv 3.12.1");
            return;
        }
        assert_eq!(
            needed_libpython(exe, None),
            vec![PathBuf::from("/root/.pyenv/versions/3.12.1/lib/libpython3.12.so.1.0")]
        );
        let me = std::env::current_exe().expect("exe");
        assert!(needed_libpython(&me, Some("/nonexistent")).is_empty());
    }
}
