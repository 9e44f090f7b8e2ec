//! The USDT route of `--step-python`: finding CPython's
//! `python:function__entry` / `function__return` in the interpreter or the
//! `libpython*.so` it maps, and attaching the programs to them.
//!
//! CPython 3.11 has the notes but fires `function__entry` only on its tracing
//! path, which it takes while a `sys.settrace`/`setprofile` function or the
//! `python:line` probe is enabled (cpython#98894); 3.12 to 3.14 have no
//! function probes at all (cpython#104280). For 3.11 the line probe's
//! semaphore is held up too, through a uprobe the kernel owns, so that entries
//! fire: that puts the interpreter in its slower tracing dispatch while
//! attached (`cargo xtask bench` measures it).
//!
//! Resolution takes bytes and paths and does no I/O; [`PythonSteps`] and
//! [`find_in_process`] are the thin I/O layer.
use std::{
    num::NonZeroU32,
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::Array,
    programs::{UProbe, uprobe::UProbeScope},
};
use profiler_common::{USDT_MAX_SPECS, UsdtProbeSpec, maps as map_names, programs};

use super::{
    interpreter::python_version,
    spec::PythonTarget,
    targets::{PythonAttachError, fill_targets, loaded_uprobe},
};
use crate::probes::usdt::{
    self, ArgLocation, UsdtError, UsdtProbe,
    attach::{UsdtLink, attach_usdt, open_uprobe},
};

pub const PROVIDER: &str = "python";
pub const ENTRY: &str = "function__entry";
pub const RETURN: &str = "function__return";
pub const LINE: &str = "line";
/// Probes of the same file whose code runs only while their own semaphore
/// is set, so that a uprobe placed on one never fires: the carrier of the
/// line semaphore. Earlier is less likely to be wanted by another tracer.
const CARRIERS: [&str; 5] = ["audit", "import__find__load__start", "import__find__load__done", "gc__start", "gc__done"];

/// CPython's entry and return probes, found in one file.
#[derive(Clone, Debug)]
pub struct PythonProbes {
    /// The file as the target sees it (the executable or a libpython).
    pub path: PathBuf,
    /// `(major, minor)` from the file's `Py_Version` (3.11+); None before.
    pub version: Option<(u8, u8)>,
    /// Every `function__entry` site (usually one).
    pub entry: Vec<UsdtProbe>,
    /// Every `function__return` site.
    pub ret: Vec<UsdtProbe>,
    /// What makes entries fire on CPython 3.11; None where they fire anyway.
    pub tracing_switch: Option<TracingSwitch>,
}

/// The `python:line` semaphore, and the probe site that carries it: a
/// uprobe on `carrier`'s site with the line semaphore as its reference
/// counter raises that semaphore without ever trapping, as long as nobody
/// sets `carrier`'s own semaphore. When the file has no such site the carrier
/// is the line probe itself, which then traps on every new line.
#[derive(Clone, Debug)]
pub struct TracingSwitch {
    pub line_semaphore_file_offset: u64,
    pub carrier: UsdtProbe,
}

/// Whether this CPython fires `function__entry` only on its tracing path:
/// 3.11 (the probe moved into the tracing dispatch when calls were inlined
/// into the eval loop; restored at frame start in 3.15).
fn entry_needs_tracing(version: Option<(u8, u8)>) -> bool {
    version == Some((3, 11))
}

fn tracing_switch(notes: &[UsdtProbe]) -> Option<TracingSwitch> {
    let line = usdt::find(notes, PROVIDER, LINE).next()?;
    let line_semaphore_file_offset = line.semaphore_file_offset?;
    let carrier = CARRIERS
        .iter()
        .filter_map(|name| usdt::find(notes, PROVIDER, name).next())
        .find(|p| p.semaphore_file_offset.is_some_and(|s| s != line_semaphore_file_offset))
        .unwrap_or(line);
    Some(TracingSwitch { line_semaphore_file_offset, carrier: carrier.clone() })
}

#[derive(Debug, thiserror::Error)]
pub enum PythonProbeError {
    #[error(
        "no USDT probe python:function__entry in {searched}: this CPython was built without --with-dtrace \
         (or is 3.12 to 3.14, which dropped the function probes). Run the training under an interpreter built \
         with --with-dtrace (e.g. Debian 12's /usr/bin/python3.11, or a 3.10 or 3.15+ build; check with \
         `readelf -n PYTHON | grep function__entry`), or mark steps in native code with --step-symbol"
    )]
    NoProbes { searched: String },
    #[error(
        "{path}: CPython 3.11 fires python:function__entry only while python:line is enabled, and this file \
         has no line probe with a semaphore"
    )]
    NoTracingSwitch { path: PathBuf },
    #[error("{path}: python:function__entry without python:function__return")]
    NoReturn { path: PathBuf },
    #[error("{path}: {probe} at {address:#x}: arguments '{spec}': {reason}")]
    Args { path: PathBuf, probe: String, address: u64, spec: String, reason: String },
    #[error("{path}: {source}")]
    Notes { path: PathBuf, source: UsdtError },
    #[error("{path}: {count} probe sites, more than the {max} the eBPF side has slots for")]
    TooManySites { path: PathBuf, count: usize, max: u32 },
}

/// The first of `candidates` (target-visible paths) with CPython's probes;
/// `open` maps a path to the file's bytes (None: unreadable, skipped).
pub fn resolve<B: AsRef<[u8]>>(
    candidates: &[PathBuf],
    mut open: impl FnMut(&Path) -> Option<B>,
) -> Result<PythonProbes, PythonProbeError> {
    for path in candidates {
        let Some(bytes) = open(path) else { continue };
        // Not ELF (a script?) or unreadable: not where the probes are.
        let Ok(file) = object::File::parse(bytes.as_ref()) else { continue };
        let notes = match usdt::notes(&file) {
            Ok(n) => n,
            Err(UsdtError::Parse(_) | UsdtError::NotElf) => continue,
            Err(source) => return Err(PythonProbeError::Notes { path: path.clone(), source }),
        };
        let entry: Vec<UsdtProbe> = usdt::find(&notes, PROVIDER, ENTRY).cloned().collect();
        if entry.is_empty() {
            continue;
        }
        let ret: Vec<UsdtProbe> = usdt::find(&notes, PROVIDER, RETURN).cloned().collect();
        if ret.is_empty() {
            return Err(PythonProbeError::NoReturn { path: path.clone() });
        }
        for p in entry.iter().chain(&ret) {
            check_args(path, p)?;
        }
        let count = entry.len() + ret.len();
        if count > USDT_MAX_SPECS as usize {
            return Err(PythonProbeError::TooManySites { path: path.clone(), count, max: USDT_MAX_SPECS });
        }
        let version = python_version(&file);
        let tracing_switch = if entry_needs_tracing(version) {
            Some(tracing_switch(&notes).ok_or_else(|| PythonProbeError::NoTracingSwitch { path: path.clone() })?)
        } else {
            None
        };
        return Ok(PythonProbes { path: path.clone(), version, entry, ret, tracing_switch });
    }
    let searched = match candidates {
        [] => "the target".to_owned(),
        [one] => one.display().to_string(),
        many => many.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" or "),
    };
    Err(PythonProbeError::NoProbes { searched })
}

/// The probes pass (filename, funcname, lineno): the first two must be
/// pointer-sized, and decodable into the eBPF side's layout, which is returned.
fn check_args(path: &Path, p: &UsdtProbe) -> Result<UsdtProbeSpec, PythonProbeError> {
    let err = |reason: String| PythonProbeError::Args {
        path: path.to_owned(),
        probe: p.to_string(),
        address: p.address,
        spec: p.arguments.clone(),
        reason,
    };
    let args = p.args.as_ref().map_err(|e| err(e.to_string()))?;
    if args.len() < 2 {
        return Err(err(format!("{} arguments, expected (filename, funcname, lineno)", args.len())));
    }
    if let Some(a) = args[..2].iter().find(|a| a.size != 8 || matches!(a.location, ArgLocation::Constant(_))) {
        return Err(err(format!("'{}' is not a pointer", a.text)));
    }
    p.bpf_spec().map_err(|e| err(e.to_string()))
}

/// Finds CPython's probes for process `pid` from its executable and maps
/// (the session does the same with the maps it has already read).
#[cfg(test)]
pub fn find_in_process(pid: u32) -> Result<PythonProbes, PythonProbeError> {
    let proc = procfs::process::Process::new(pid as i32);
    let exe = proc.as_ref().ok().and_then(|p| p.exe().ok()).unwrap_or_else(|| PathBuf::from("the target's executable"));
    let mapped = proc.as_ref().ok().and_then(|p| p.maps().ok()).map(|m| crate::probes::maps::mapped_files(&m));
    let list = super::interpreter::candidates(&exe, mapped.as_deref().unwrap_or_default());
    resolve(&list, |p| crate::probes::open_in_target(pid, p))
}

/// The Python step probes attached to one process. Dropping it detaches
/// them and releases the semaphores.
#[derive(Debug)]
pub struct PythonSteps {
    // Field order is drop order: entries stop first, so that steps open at
    // detach still see their returns.
    tracing_switch: Option<OwnedFd>,
    links: Vec<UsdtLink>,
}

impl PythonSteps {
    /// Fills `PY_TARGETS` and `USDT_ARGS` of `ebpf`, loads `python_entry` /
    /// `python_return` if they are not yet, and attaches them to every
    /// entry/return site of `probes` in process `pid`, or in every process
    /// that maps the file for a job (`scope`; the programs keep only the
    /// traced ones), whose semaphores the kernel raises in each.
    ///
    /// Targets that name a file go first in the kernel's list, which stops at
    /// the first match: `helper.py:train_step` wins over a bare `train_step`.
    pub fn attach(
        ebpf: &mut Ebpf,
        pid: NonZeroU32,
        scope: UProbeScope,
        probes: &PythonProbes,
        targets: &[PythonTarget],
    ) -> Result<Self, PythonAttachError> {
        let only = match scope {
            UProbeScope::AllProcesses => None,
            _ => Some(pid.get()),
        };
        fill_targets(ebpf, targets)?;
        // One USDT_ARGS slot per probe site, entries then returns; the slot
        // travels as the cookie.
        {
            let map = ebpf.map_mut(map_names::USDT_ARGS).ok_or(PythonAttachError::Missing(map_names::USDT_ARGS))?;
            let mut array: Array<_, UsdtProbeSpec> =
                Array::try_from(map).map_err(|source| PythonAttachError::Map { name: map_names::USDT_ARGS, source })?;
            for (slot, p) in probes.entry.iter().chain(&probes.ret).enumerate() {
                array
                    .set(
                        slot as u32,
                        check_args(&probes.path, p).map_err(|e| PythonAttachError::Probe(e.to_string()))?,
                        0,
                    )
                    .map_err(|source| PythonAttachError::Map { name: map_names::USDT_ARGS, source })?;
            }
        }
        for name in [programs::PYTHON_ENTRY, programs::PYTHON_RETURN] {
            loaded_uprobe(ebpf, name)?;
        }
        let (entry, ret) = (program_fd(ebpf, programs::PYTHON_ENTRY)?, program_fd(ebpf, programs::PYTHON_RETURN)?);
        let sites = probes.entry.iter().map(|p| (entry, p)).chain(probes.ret.iter().map(|p| (ret, p)));
        let path = crate::probes::in_target_root(pid.get(), &probes.path);
        let mut links = Vec::with_capacity(probes.entry.len() + probes.ret.len());
        for (slot, (program, p)) in sites.enumerate() {
            let link = attach_usdt(program, &path, p.file_offset, p.semaphore_file_offset, only, slot as u64)
                .map_err(|source| PythonAttachError::Attach { probe: p.to_string(), source })?;
            links.push(link);
        }
        // Last, so that no entry fires before its return probe is in place.
        let tracing_switch = match &probes.tracing_switch {
            Some(t) => Some(
                open_uprobe(&path, t.carrier.file_offset, Some(t.line_semaphore_file_offset), only)
                    .map_err(|source| PythonAttachError::Attach { probe: format!("{PROVIDER}:{LINE}"), source })?,
            ),
            None => None,
        };
        Ok(Self { tracing_switch, links })
    }

    /// Whether the interpreter is held in its tracing dispatch (CPython 3.11).
    pub fn tracing_switched(&self) -> bool {
        self.tracing_switch.is_some()
    }

    /// How many probe sites are attached.
    pub fn sites(&self) -> usize {
        self.links.len()
    }

    /// Detaches (the same as dropping).
    pub fn detach(self) {
        let Self { tracing_switch, links } = self;
        drop(tracing_switch);
        drop(links);
    }
}

/// The descriptor of `ebpf`'s loaded uprobe program `name`.
fn program_fd<'e>(ebpf: &'e Ebpf, name: &'static str) -> Result<BorrowedFd<'e>, PythonAttachError> {
    let prog: &UProbe = ebpf
        .program(name)
        .ok_or(PythonAttachError::Missing(name))?
        .try_into()
        .map_err(|source| PythonAttachError::Program { name, source })?;
    Ok(prog.fd().map_err(|source| PythonAttachError::Program { name, source })?.as_fd())
}

#[cfg(test)]
mod root_tests;
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interpreter_without_probes_says_what_to_do() {
        // This test binary has no USDT notes: it stands in for a pyenv build.
        let exe = std::env::current_exe().expect("current exe");
        let bytes = std::fs::read(&exe).expect("read exe");
        let lib = PathBuf::from("/nonexistent/libpython3.11.so.1.0");
        let err = resolve(&[exe.clone(), lib.clone()], |p| (p == exe).then(|| bytes.clone())).expect_err("no probes");
        let text = err.to_string();
        assert!(text.contains("--with-dtrace"), "{text}");
        assert!(text.contains("--step-symbol"), "{text}");
        assert!(text.contains("/usr/bin/python3"), "{text}");
        assert!(text.contains("libpython3.11.so.1.0"), "{text}");
    }

    #[test]
    fn finds_debians_python_probes_when_present() {
        let path = PathBuf::from("/usr/bin/python3.11");
        let Ok(bytes) = std::fs::read(&path) else {
            crate::skip_test(format!("{} not installed", path.display()));
            return;
        };
        let found = resolve(std::slice::from_ref(&path), |_| Some(&bytes[..])).expect("Debian's python3.11 has USDT");
        assert_eq!(found.path, path);
        assert!(!found.entry.is_empty() && !found.ret.is_empty());
        for p in found.entry.iter().chain(&found.ret) {
            // Ground truth: a probe site is a `nop`, and the semaphore is in `.probes`.
            assert_eq!(bytes[p.file_offset as usize], 0x90, "{p} at {:#x}", p.file_offset);
            assert!(p.semaphore_file_offset.is_some(), "{p} has a semaphore");
        }
        // The file name says which CPython it is; Py_Version must agree.
        assert_eq!(found.version, Some((3, 11)));
        let switch = found.tracing_switch.expect("3.11 needs the line switch");
        assert_eq!(switch.carrier.name, "audit");
        assert_eq!(bytes[switch.carrier.file_offset as usize], 0x90);
    }

    fn probe(name: &str, semaphore: Option<u64>) -> UsdtProbe {
        UsdtProbe {
            provider: PROVIDER.into(),
            name: name.into(),
            address: 0x1000,
            note_base: 0,
            semaphore: semaphore.map(|s| s + 0x1000),
            file_offset: 0x10,
            semaphore_file_offset: semaphore,
            arguments: String::new(),
            args: Ok(vec![]),
        }
    }

    #[test]
    fn the_line_switch_rides_on_a_probe_that_never_runs() {
        let line = probe(LINE, Some(0x80));
        let notes = [probe("gc__done", Some(0x82)), line.clone(), probe("audit", Some(0x84))];
        let t = tracing_switch(&notes).expect("switch");
        assert_eq!((t.line_semaphore_file_offset, t.carrier.name.as_str()), (0x80, "audit"));
        // A carrier must have a semaphore of its own, or its code may run.
        let notes = [probe("audit", None), probe("gc__start", Some(0x80)), line.clone(), probe("gc__done", Some(0x86))];
        assert_eq!(tracing_switch(&notes).expect("switch").carrier.name, "gc__done");
        // No other site: the line probe carries its own semaphore (and traps per line).
        assert_eq!(tracing_switch(std::slice::from_ref(&line)).expect("switch").carrier.name, LINE);
        assert!(tracing_switch(&[probe("audit", Some(0x84))]).is_none());
        assert!(tracing_switch(&[probe(LINE, None)]).is_none());
    }

    #[test]
    fn only_3_11_needs_the_switch() {
        assert!(entry_needs_tracing(Some((3, 11))));
        assert!(!entry_needs_tracing(None));
        assert!(!entry_needs_tracing(Some((3, 15))));
    }
}
