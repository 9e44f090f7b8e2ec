//! Python step functions through CPython's USDT probes: `--step-python`
//! specs, finding `python:function__entry` / `function__return` in the
//! interpreter or the `libpython*.so` it maps, and attaching the kernel-side
//! name filter (`PY_TARGETS`) and programs to them.
//!
//! CPython 3.11 has the notes but fires `function__entry` only on its tracing
//! path, which it takes while a `sys.settrace`/`setprofile` function or the
//! `python:line` probe is enabled (cpython#98894); 3.12 to 3.14 have no
//! function probes at all (cpython#104280). For 3.11 the line probe's
//! semaphore is held up too, through a uprobe the kernel owns, so that entries
//! fire: that puts the interpreter in its slower tracing dispatch while
//! attached (measured in `python_call_overhead`).
//!
//! Parsing and resolution take bytes and paths and do no I/O; [`PythonSteps`]
//! and [`find_in_process`] are the thin I/O layer.
use std::{
    fmt,
    num::NonZeroU32,
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::{Array, MapError},
    programs::{ProgramError, UProbe, uprobe::UProbeScope},
};
use object::{Object, ObjectSection, ObjectSymbol};
use profiler_common::{
    PY_MAX_TARGETS, PY_NAME_CAP, PyTarget, USDT_MAX_SPECS, UsdtProbeSpec, maps as map_names, programs,
};

use super::{
    ArgLocation, UsdtError, UsdtProbe,
    attach::{AttachError, UsdtLink, attach_usdt, open_uprobe},
};
use crate::probes::maps::MappedFile;

pub const PROVIDER: &str = "python";
pub const ENTRY: &str = "function__entry";
pub const RETURN: &str = "function__return";
pub const LINE: &str = "line";
/// Probes of the same file whose code runs only while their own semaphore
/// is set, so that a uprobe placed on one never fires: the carrier of the
/// line semaphore. Earlier is less likely to be wanted by another tracer.
const CARRIERS: [&str; 5] = ["audit", "import__find__load__start", "import__find__load__done", "gc__start", "gc__done"];
/// Label of a `--step-python` spec that names none.
pub const DEFAULT_LABEL: &str = "train";

/// `--step-python [LABEL=][FILE_SUFFIX:]NAME`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PythonStepSpec {
    /// What the steps are called (`steps.label`), e.g. `train`, `val`.
    pub label: String,
    /// What the code object's file name must end with, at a `/` boundary.
    pub file_suffix: Option<String>,
    /// The function's bare name, as CPython's probes report it (`co_name`).
    pub function: String,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PythonSpecError {
    #[error("--step-python '{0}': no function name")]
    Empty(String),
    #[error("--step-python '{0}': empty label before '='")]
    EmptyLabel(String),
    #[error(
        "--step-python '{spec}': CPython's probes report the bare function name (co_name), not '{name}'; \
         pass '{short}', with FILE_SUFFIX:{short} to tell apart functions of that name"
    )]
    Qualified { spec: String, name: String, short: String },
    #[error("--step-python '{spec}': '{what}' is {len} bytes, the kernel-side filter holds at most {PY_NAME_CAP}")]
    TooLong { spec: String, what: String, len: usize },
    #[error("--step-python '{0}': not a Python identifier")]
    NotIdentifier(String),
}

impl PythonStepSpec {
    pub fn parse(spec: &str) -> Result<Self, PythonSpecError> {
        let (label, rest) = match spec.split_once('=') {
            Some((l, _)) if l.trim().is_empty() => return Err(PythonSpecError::EmptyLabel(spec.to_owned())),
            Some((l, r)) => (l.trim().to_owned(), r),
            None => (DEFAULT_LABEL.to_owned(), spec),
        };
        let (file_suffix, function) = match rest.rsplit_once(':') {
            Some((f, n)) if !f.is_empty() => (Some(f.to_owned()), n),
            Some((_, n)) => (None, n),
            None => (None, rest),
        };
        if function.is_empty() {
            return Err(PythonSpecError::Empty(spec.to_owned()));
        }
        if let Some((_, short)) = function.rsplit_once('.') {
            return Err(PythonSpecError::Qualified {
                spec: spec.to_owned(),
                name: function.to_owned(),
                short: short.to_owned(),
            });
        }
        // Identifiers may be non-ASCII; the probe reports them as UTF-8.
        let first_ok = function.chars().next().is_some_and(|c| c == '_' || c.is_alphabetic());
        if !first_ok || !function.chars().all(|c| c == '_' || c.is_alphanumeric()) {
            // `<module>`, `<lambda>`, `<listcomp>` are code names CPython reports too.
            if !(function.starts_with('<') && function.ends_with('>')) {
                return Err(PythonSpecError::NotIdentifier(spec.to_owned()));
            }
        }
        for (what, len) in [
            (function, function.len()),
            (file_suffix.as_deref().unwrap_or(""), file_suffix.as_ref().map_or(0, String::len)),
        ] {
            if len > PY_NAME_CAP {
                return Err(PythonSpecError::TooLong { spec: spec.to_owned(), what: what.to_owned(), len });
            }
        }
        Ok(Self { label, file_suffix, function: function.to_owned() })
    }

    /// The `PY_TARGETS` entry; `label_id` is what the kernel writes to
    /// `OrderedRecord::probe` when this function enters or returns.
    pub fn target(&self, label_id: u32) -> PyTarget {
        let mut t = PyTarget { label_id, ..Default::default() };
        let name = self.function.as_bytes();
        t.name[..name.len()].copy_from_slice(name);
        t.name_len = name.len() as u32;
        if let Some(s) = &self.file_suffix {
            t.file_suffix[..s.len()].copy_from_slice(s.as_bytes());
            t.suffix_len = s.len() as u32;
        }
        t
    }
}

impl fmt::Display for PythonStepSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}=", self.label)?;
        if let Some(s) = &self.file_suffix {
            write!(f, "{s}:")?;
        }
        f.write_str(&self.function)
    }
}

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

/// The CPython version a file was built as, from its `Py_Version` symbol
/// (`PY_VERSION_HEX`, exported since 3.11). None: older, or not CPython.
pub fn python_version(file: &object::File<'_>) -> Option<(u8, u8)> {
    // Exported, so in `.dynsym`; a stripped interpreter has no `.symtab`.
    let sym = file.dynamic_symbols().chain(file.symbols()).find(|s| s.name() == Ok("Py_Version"))?;
    let section = file.section_by_index(sym.section_index()?).ok()?;
    let bytes = section.data_range(sym.address(), 4).ok()??;
    let hex = if file.is_little_endian() {
        u32::from_le_bytes(bytes.try_into().ok()?)
    } else {
        u32::from_be_bytes(bytes.try_into().ok()?)
    };
    Some(((hex >> 24) as u8, (hex >> 16) as u8))
}

/// Whether this CPython fires `function__entry` only on its tracing path:
/// 3.11 (the probe moved into the tracing dispatch when calls were inlined
/// into the eval loop; restored at frame start in 3.15).
fn entry_needs_tracing(version: Option<(u8, u8)>) -> bool {
    version == Some((3, 11))
}

fn tracing_switch(notes: &[UsdtProbe]) -> Option<TracingSwitch> {
    let line = super::find(notes, PROVIDER, LINE).next()?;
    let line_semaphore_file_offset = line.semaphore_file_offset?;
    let carrier = CARRIERS
        .iter()
        .filter_map(|name| super::find(notes, PROVIDER, name).next())
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

/// Where CPython's probes may be: the executable, then every mapped
/// `libpython*` (a `--enable-shared` build keeps the interpreter there) or
/// `python*` (the program when the executable is the dynamic loader run by
/// hand, `ld-linux-x86-64.so.2 --library-path DIR python3.13`).
pub fn candidates(exe: &Path, mapped: &[MappedFile]) -> Vec<PathBuf> {
    let mut out = vec![exe.to_owned()];
    for m in mapped {
        let name = m.path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if (name.starts_with("libpython") || name.starts_with("python")) && !out.contains(&m.path) {
            out.push(m.path.clone());
        }
    }
    out
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
        let notes = match super::notes(&file) {
            Ok(n) => n,
            Err(UsdtError::Parse(_) | UsdtError::NotElf) => continue,
            Err(source) => return Err(PythonProbeError::Notes { path: path.clone(), source }),
        };
        let entry: Vec<UsdtProbe> = super::find(&notes, PROVIDER, ENTRY).cloned().collect();
        if entry.is_empty() {
            continue;
        }
        let ret: Vec<UsdtProbe> = super::find(&notes, PROVIDER, RETURN).cloned().collect();
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
    let list = candidates(&exe, mapped.as_deref().unwrap_or_default());
    resolve(&list, |p| crate::probes::open_in_target(pid, p))
}

/// A Python step function to attach, and the id its records carry.
#[derive(Clone, Debug)]
pub struct PythonTarget {
    pub spec: PythonStepSpec,
    /// Written to `OrderedRecord::probe`; the caller maps it back to `spec.label`.
    pub label_id: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum PythonAttachError {
    #[error("{count} --step-python functions; the kernel-side filter holds at most {max}")]
    TooManyTargets { count: usize, max: u32 },
    #[error("--step-python {0} is given twice")]
    Duplicate(String),
    #[error("eBPF object has no {0}; rebuild with `cargo xtask build`")]
    Missing(&'static str),
    #[error("map {name}: {source}")]
    Map { name: &'static str, source: MapError },
    #[error("eBPF program {name}: {source}")]
    Program { name: &'static str, source: ProgramError },
    #[error("{probe}: {source}")]
    Attach { probe: String, source: AttachError },
    /// A site whose arguments the programs cannot read: only possible when
    /// `probes` did not come from [`resolve`], which checks the same.
    #[error(transparent)]
    Probe(#[from] PythonProbeError),
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
                    .set(slot as u32, check_args(&probes.path, p)?, 0)
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

/// Fills `PY_TARGETS` of `ebpf`, shared by the USDT probes and the frame hook.
///
/// Targets that name a file go first in the kernel's list, which stops at
/// the first match: `helper.py:train_step` wins over a bare `train_step`.
pub(crate) fn fill_targets(ebpf: &mut Ebpf, targets: &[PythonTarget]) -> Result<(), PythonAttachError> {
    if targets.len() > PY_MAX_TARGETS as usize {
        return Err(PythonAttachError::TooManyTargets { count: targets.len(), max: PY_MAX_TARGETS });
    }
    let mut ordered: Vec<&PythonTarget> = targets.iter().collect();
    ordered.sort_by_key(|t| t.spec.file_suffix.is_none());
    for (i, t) in ordered.iter().enumerate() {
        let same = |o: &&PythonTarget| o.spec.function == t.spec.function && o.spec.file_suffix == t.spec.file_suffix;
        if ordered[..i].iter().any(same) {
            return Err(PythonAttachError::Duplicate(t.spec.to_string()));
        }
    }
    let map = ebpf.map_mut(map_names::PY_TARGETS).ok_or(PythonAttachError::Missing(map_names::PY_TARGETS))?;
    let mut array: Array<_, PyTarget> =
        Array::try_from(map).map_err(|source| PythonAttachError::Map { name: map_names::PY_TARGETS, source })?;
    for i in 0..PY_MAX_TARGETS {
        let value = ordered.get(i as usize).map_or_else(PyTarget::default, |t| t.spec.target(t.label_id));
        array.set(i, value, 0).map_err(|source| PythonAttachError::Map { name: map_names::PY_TARGETS, source })?;
    }
    Ok(())
}

/// The uprobe program `name` of `ebpf`, loaded (once) into the kernel.
pub(crate) fn loaded_uprobe<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut UProbe, PythonAttachError> {
    let prog: &mut UProbe = ebpf
        .program_mut(name)
        .ok_or(PythonAttachError::Missing(name))?
        .try_into()
        .map_err(|source| PythonAttachError::Program { name, source })?;
    if prog.fd().is_err() {
        prog.load().map_err(|source| PythonAttachError::Program { name, source })?;
    }
    Ok(prog)
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

impl crate::probes::Probes {
    /// [`PythonSteps::attach`] with the loaded object and target of these
    /// probes. The returned handle must be dropped before [`Self::detach`]:
    /// step probes go first.
    pub fn attach_python(
        &mut self,
        probes: &PythonProbes,
        targets: &[PythonTarget],
    ) -> Result<PythonSteps, PythonAttachError> {
        PythonSteps::attach(&mut self.ebpf, self.pid, self.scope, probes, targets)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(label: &str, suffix: Option<&str>, function: &str) -> PythonStepSpec {
        PythonStepSpec { label: label.into(), file_suffix: suffix.map(Into::into), function: function.into() }
    }

    #[test]
    fn parses_label_file_suffix_and_name() {
        assert_eq!(PythonStepSpec::parse("train_step"), Ok(spec("train", None, "train_step")));
        assert_eq!(PythonStepSpec::parse("val=validate"), Ok(spec("val", None, "validate")));
        assert_eq!(PythonStepSpec::parse("train.py:train_step"), Ok(spec("train", Some("train.py"), "train_step")));
        assert_eq!(
            PythonStepSpec::parse("inner=lib/helper.py:train_step"),
            Ok(spec("inner", Some("lib/helper.py"), "train_step"))
        );
        assert_eq!(PythonStepSpec::parse(":f"), Ok(spec("train", None, "f")));
        assert_eq!(PythonStepSpec::parse("<lambda>"), Ok(spec("train", None, "<lambda>")));
        assert_eq!(PythonStepSpec::parse("étape"), Ok(spec("train", None, "étape")));
    }

    #[test]
    fn rejects_what_the_probe_cannot_match_with_a_way_out() {
        assert_eq!(PythonStepSpec::parse(""), Err(PythonSpecError::Empty("".into())));
        assert_eq!(PythonStepSpec::parse("x.py:"), Err(PythonSpecError::Empty("x.py:".into())));
        assert_eq!(PythonStepSpec::parse("=f"), Err(PythonSpecError::EmptyLabel("=f".into())));
        let e = PythonStepSpec::parse("Trainer.train_step").expect_err("qualified");
        assert!(e.to_string().contains("pass 'train_step'"), "{e}");
        assert!(matches!(PythonStepSpec::parse("train-step"), Err(PythonSpecError::NotIdentifier(_))));
        let long = "f".repeat(PY_NAME_CAP + 1);
        assert!(matches!(PythonStepSpec::parse(&long), Err(PythonSpecError::TooLong { len: 65, .. })));
        assert!(PythonStepSpec::parse(&"f".repeat(PY_NAME_CAP)).is_ok());
    }

    #[test]
    fn targets_are_zero_padded_for_the_word_compare() {
        let t = spec("val", Some("eval.py"), "validate").target(7);
        assert_eq!(&t.name[..8], b"validate");
        assert!(t.name[8..].iter().all(|&b| b == 0));
        assert_eq!((t.name_len, t.suffix_len, t.label_id), (8, 7, 7));
        assert_eq!(&t.file_suffix[..7], b"eval.py");
        assert!(t.file_suffix[7..].iter().all(|&b| b == 0));
    }

    #[test]
    fn candidates_are_the_executable_then_libpython() {
        let f = |p: &str| MappedFile { dev: (8, 1), inode: 1, path: p.into() };
        let mapped = [f("/usr/bin/python3.11"), f("/usr/lib/libpython3.11.so.1.0"), f("/usr/lib/libc.so.6")];
        assert_eq!(
            candidates(Path::new("/usr/bin/python3.11"), &mapped),
            vec![PathBuf::from("/usr/bin/python3.11"), PathBuf::from("/usr/lib/libpython3.11.so.1.0")]
        );
    }

    #[test]
    fn candidates_name_the_program_a_loader_run_by_hand_maps() {
        let f = |p: &str| MappedFile { dev: (8, 1), inode: 1, path: p.into() };
        let ld = "/opt/trixie/lib/ld-linux-x86-64.so.2";
        let mapped = [f("/opt/trixie/usr/bin/python3.13"), f("/opt/trixie/lib/libc.so.6"), f(ld)];
        assert_eq!(
            candidates(Path::new(ld), &mapped),
            vec![PathBuf::from(ld), PathBuf::from("/opt/trixie/usr/bin/python3.13")]
        );
    }

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
