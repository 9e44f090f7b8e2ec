//! JAX's jit fast path in jaxlib's `libjax_common.so`: finding
//! `jax::(anonymous namespace)::PjitFunction::Call`, attaching the jit
//! programs there, and reading a jitted function's name from the target.
//!
//! The function is local (in `.symtab` only; PyPI's jaxlib keeps it: 690 154
//! symbols in 0.12.0.1) and is found by its mangled name, the same in every
//! release tried (0.6.2, June 2025, and 0.12.0.1; see docs/steps.md).
//!
//! The name: a `PjitFunction` begins with `std::string function_name_` in
//! both releases, but its place is not taken on trust. For each process the
//! reader looks at the first jitted call it sees: every `std::string`-shaped
//! field of the `PjitFunction` (pointer, length, printable bytes there) is a
//! candidate, and the one whose text equals the `__name__` of the Python
//! function the object wraps (its `fun_` field, a `PyObject*` whose type
//! Python names `function`) is the name's offset, from then on read for
//! every new function. A call whose wrapped object is no plain function (a
//! `functools.partial`) proves nothing; the next one is tried.
//!
//! When: a function's first call in a process is announced on `JIT_NEW`, and
//! [`NameReader`] reads its name at once, while the call is under way. The
//! call's record comes up in order later (the rings are drained every 20 ms,
//! later under load), and by then a short program may have let the function
//! go: a freed Python function's `__name__` is the empty string (seen: 30
//! calls of a 0.1 s loop all unnamed, read after the loop had returned).
use std::{
    collections::HashMap,
    os::{fd::OwnedFd, unix::fs::FileExt},
    path::Path,
    sync::{Arc, Mutex, PoisonError},
    thread::JoinHandle,
};

use aya::maps::{MapData, RingBuf};
use object::{Object, ObjectSymbol, SymbolKind};
use profiler_common::{JitFirstCall, jax_programs};
use zerocopy::FromBytes;

use super::{ProbeError, ProbeSite, Probes, elf};

/// `jax::(anonymous namespace)::PjitFunction::Call(nanobind::handle, _object* const*, unsigned long, _object*)`.
pub const CALL_SYMBOL: &str = "_ZN3jax12_GLOBAL__N_112PjitFunction4CallEN8nanobind6handleEPKP7_objectmS5_";
/// Its demangled name, for the `probes` rows.
const CALL: &str = "jax::(anonymous namespace)::PjitFunction::Call";

/// Whether `path` is jaxlib's common library (`libjax_common.so`, any suffix).
pub fn is_libjax_common(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libjax_common.so"))
}

/// The file offset of `PjitFunction::Call` in one `libjax_common.so`.
pub fn resolve(data: &[u8]) -> Result<u64, String> {
    let file = object::File::parse(data).map_err(|e| format!("not a readable ELF file: {e}"))?;
    let segments = elf::load_segments(&file);
    let sym = file
        .symbols()
        .find(|s| s.kind() == SymbolKind::Text && !s.is_undefined() && s.name() == Ok(CALL_SYMBOL))
        .ok_or_else(|| format!("no {CALL} symbol (a stripped jaxlib, or one whose jit fast path is another)"))?;
    segments
        .iter()
        .find_map(|s| s.file_offset(sym.address()))
        .ok_or_else(|| format!("{CALL} at {:#x} lies in no loaded segment", sym.address()))
}

impl Probes {
    /// Attaches the jit programs to one `libjax_common.so` (both or
    /// neither): the return first, so that a target running through the
    /// attach loses at most a call's begin (a return with no begin is
    /// dropped), never leaves one open. Returns the `probes` rows.
    pub fn attach_jax(&mut self, path: &Path, call: u64) -> Result<Vec<(String, u64, String)>, ProbeError> {
        let before = self.links.len();
        let points = [
            (jax_programs::EXIT, "return: the call is dispatched"),
            (jax_programs::ENTER, "entry: reads this (rsi) and the object called (rdx)"),
        ];
        let sites = points.map(|(program, _)| ProbeSite::new(program, call, 0));
        if let Err(e) = self.attach_sites(path, &sites) {
            self.links.truncate(before);
            return Err(e);
        }
        Ok(points.iter().map(|(_, why)| (CALL.to_string(), 0, why.to_string())).collect())
    }
}

/// The programs to load.
pub fn programs() -> [&'static str; 2] {
    [jax_programs::ENTER, jax_programs::EXIT]
}

/// Reads a process's memory: `len` bytes at an address, or None.
pub trait Memory {
    fn read(&self, address: u64, len: usize) -> Option<Vec<u8>>;

    fn word(&self, address: u64) -> Option<u64> {
        self.read(address, 8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
    }

    /// A NUL-terminated string of at most `cap` bytes.
    fn c_string(&self, address: u64, cap: usize) -> Option<String> {
        let b = self.read(address, cap).or_else(|| self.read(address, 16))?;
        let end = b.iter().position(|&c| c == 0)?;
        String::from_utf8(b[..end].to_vec()).ok()
    }
}

/// `/proc/PID/mem`.
pub struct ProcMem(std::fs::File);

impl ProcMem {
    pub fn open(pid: u32) -> Option<Self> {
        std::fs::File::open(format!("/proc/{pid}/mem")).ok().map(Self)
    }
}

impl Memory for ProcMem {
    fn read(&self, address: u64, len: usize) -> Option<Vec<u8>> {
        let mut b = vec![0; len];
        self.0.read_exact_at(&mut b, address).ok()?;
        Some(b)
    }
}

/// How far into a `PjitFunction` the reader looks for its fields.
const SCAN_BYTES: u64 = 256;
/// The longest name read.
const NAME_CAP: u64 = 1024;

/// A `std::string` (libstdc++, C++11 ABI) at `address`: its text, if its
/// pointer and length look like one and the bytes are printable.
fn std_string(mem: &impl Memory, address: u64) -> Option<String> {
    let (data, len) = (mem.word(address)?, mem.word(address + 8)?);
    if len == 0 || len > NAME_CAP || data < 4096 {
        return None;
    }
    let text = String::from_utf8(mem.read(data, len as usize)?).ok()?;
    text.chars().all(|c| !c.is_control()).then_some(text)
}

/// The type name Python gives the object at `object` (`Py_TYPE(o)->tp_name`:
/// `ob_type` at +8, `tp_name` at +24, in every CPython since 3.0).
fn type_name(mem: &impl Memory, object: u64) -> Option<String> {
    let ty = mem.word(object + 8)?;
    mem.c_string(mem.word(ty + 24)?, 64)
}

/// The text of a Python `str` holding ASCII (compact: its characters follow
/// the 40-byte header from 3.12 on, 48 before, NUL-terminated).
fn py_ascii(mem: &impl Memory, s: u64) -> Option<String> {
    if type_name(mem, s)? != "str" {
        return None;
    }
    let len = mem.word(s + 16)?;
    if len == 0 || len > NAME_CAP {
        return None;
    }
    [40u64, 48].iter().find_map(|&at| {
        let b = mem.read(s + at, len as usize + 1)?;
        (b[len as usize] == 0 && b[..len as usize].iter().all(|c| c.is_ascii_graphic()))
            .then(|| String::from_utf8_lossy(&b[..len as usize]).into_owned())
    })
}

/// `__name__` of a Python function object (`func_name`: +32 from 3.10 on,
/// after `func_globals` and `func_builtins`; +40 is `func_qualname`).
fn function_name(mem: &impl Memory, function: u64) -> Option<String> {
    (type_name(mem, function)? == "function").then_some(())?;
    py_ascii(mem, mem.word(function + 32)?)
}

/// Finds where a `PjitFunction` at `this` keeps its name: the offset of the
/// `std::string` whose text is the `__name__` of a Python function one of its
/// later fields points at. None: nothing here proves an offset.
pub fn calibrate(mem: &impl Memory, this: u64) -> Option<u64> {
    let strings: Vec<(u64, String)> =
        (0..SCAN_BYTES).step_by(8).filter_map(|off| std_string(mem, this + off).map(|s| (off, s))).collect();
    for field in (0..SCAN_BYTES).step_by(8) {
        let Some(p) = mem.word(this + field).filter(|&p| p >= 4096) else { continue };
        let Some(name) = function_name(mem, p) else { continue };
        if let Some((off, _)) = strings.iter().find(|(off, s)| *off < field && *s == name) {
            return Some(*off);
        }
    }
    None
}

/// A jitted function's name, by its `PjitFunction*`, per process.
#[derive(Default)]
pub struct JitNames {
    /// The name's offset in a `PjitFunction`, once a call proved it.
    offset: Option<u64>,
    /// Calls looked at without proving it (the reader stops after many).
    tries: u32,
    names: HashMap<u64, Option<String>>,
}

/// Calls looked at for the name's offset before the reader gives up.
const MAX_TRIES: u32 = 64;

impl JitNames {
    /// The name of the function at `this` (read once per function; a
    /// function freed and another made at the same address keeps the first
    /// one's name, which jitted functions, made once and kept, do not do).
    pub fn name(&mut self, mem: Option<&impl Memory>, this: u64) -> Option<String> {
        if let Some(n) = self.names.get(&this) {
            return n.clone();
        }
        let mem = mem?;
        if self.offset.is_none() && self.tries < MAX_TRIES {
            self.tries += 1;
            self.offset = calibrate(mem, this);
            match self.offset {
                Some(o) => log::info!("jit function names at +{o:#x} of a PjitFunction (checked against __name__)"),
                None if self.tries == MAX_TRIES => {
                    log::warn!("no jit function's name could be checked against Python's: names are not read")
                }
                None => return None, // not kept: a later look may prove the offset
            }
        }
        let name = self.offset.and_then(|o| std_string(mem, this + o));
        self.names.insert(this, name.clone());
        name
    }

    #[cfg(test)]
    fn offset(&self) -> Option<u64> {
        self.offset
    }
}

/// The jitted functions' names in every process of a session: read early by
/// the [`NameReader`], and looked up by each process's consumer when a call
/// comes up in order (which reads the name itself if the reader has not).
#[derive(Clone, Default)]
pub struct SharedJitNames(Arc<Mutex<HashMap<u32, ProcessNames>>>);

#[derive(Default)]
struct ProcessNames {
    /// `/proc/PID/mem`, opened at the process's first call.
    mem: Option<ProcMem>,
    names: JitNames,
}

impl SharedJitNames {
    /// The name of the function at `function` in process `pid` (see [`JitNames::name`]).
    pub fn name(&self, pid: u32, function: u64) -> Option<String> {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let p = all.entry(pid).or_default();
        if p.mem.is_none() {
            p.mem = ProcMem::open(pid);
        }
        p.names.name(p.mem.as_ref(), function)
    }
}

/// A thread that reads a jitted function's name as soon as the kernel
/// announces its first call (`JIT_NEW`, submitted with a wakeup). Dropping
/// it stops the thread and waits for it.
pub struct NameReader {
    /// Closed to stop the thread (its read end then polls as hung up).
    stop: Option<OwnedFd>,
    thread: Option<JoinHandle<()>>,
}

impl NameReader {
    pub fn spawn(mut ring: RingBuf<MapData>, names: SharedJitNames) -> std::io::Result<Self> {
        use rustix::event::{PollFd, PollFlags, poll};
        let (stopped, stop) = rustix::pipe::pipe()?;
        let thread = std::thread::Builder::new().name("jit-names".into()).spawn(move || {
            loop {
                while let Some(item) = ring.next() {
                    if let Ok((first, _)) = JitFirstCall::read_from_prefix(&item) {
                        names.name(first.tgid, first.function);
                    }
                }
                let mut fds = [PollFd::new(&ring, PollFlags::IN), PollFd::new(&stopped, PollFlags::IN)];
                match poll(&mut fds, None) {
                    Ok(_) if !fds[1].revents().is_empty() => return,
                    Ok(_) | Err(rustix::io::Errno::INTR) => {}
                    Err(e) => {
                        log::warn!(
                            "jitted functions' names are read in order only from now on: polling their ring: {e}"
                        );
                        return;
                    }
                }
            }
        })?;
        Ok(Self { stop: Some(stop), thread: Some(thread) })
    }
}

impl Drop for NameReader {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_the_library_by_file_name() {
        assert!(is_libjax_common(Path::new("/v/lib/python3.12/site-packages/jaxlib/libjax_common.so")));
        assert!(!is_libjax_common(Path::new("/v/jaxlib/_jax.so")));
    }

    #[test]
    fn the_symbol_demangles_to_the_fast_path() {
        let full = elf::demangled_full(CALL_SYMBOL).expect("demangles");
        assert!(full.starts_with(CALL), "{full}");
        assert!(full.contains("nanobind::handle"), "{full}");
    }

    /// A fake address space: (address, bytes) blocks.
    struct Fake(Vec<(u64, Vec<u8>)>);

    impl Memory for Fake {
        fn read(&self, address: u64, len: usize) -> Option<Vec<u8>> {
            self.0.iter().find_map(|(at, b)| {
                let start = address.checked_sub(*at)? as usize;
                b.get(start..start + len).map(<[u8]>::to_vec)
            })
        }
    }

    fn words(ws: &[u64]) -> Vec<u8> {
        ws.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// A process with a `PjitFunction` at 0x10000 whose name string sits at
    /// `name_at` and whose `fun_` points at a Python function named `py_name`.
    fn process(name_at: u64, jit_name: &str, py_name: &str) -> Fake {
        let (this, text, func, pystr, ty_fn, ty_str) =
            (0x10000u64, 0x20000u64, 0x30000u64, 0x40000u64, 0x50000u64, 0x60000u64);
        let mut fields = vec![0u64; 32];
        fields[(name_at / 8) as usize] = text;
        fields[(name_at / 8) as usize + 1] = jit_name.len() as u64;
        fields[(name_at / 8) as usize + 4] = func; // fun_, after the string
        fields[31] = 7; // not a pointer
        let mut s = vec![0u8; 48];
        s[8..16].copy_from_slice(&ty_str.to_le_bytes());
        s[16..24].copy_from_slice(&(py_name.len() as u64).to_le_bytes());
        s.extend(py_name.as_bytes());
        s.push(0);
        let mut f = words(&[1, ty_fn, 0, 0, pystr, 0]);
        f.resize(64, 0);
        Fake(vec![
            (this, words(&fields)),
            (text, jit_name.as_bytes().to_vec()),
            (func, f),
            (pystr - 8, [vec![0; 8], s].concat()),
            (ty_fn, words(&[0, 0, 0, 0x70000])),
            (ty_str, words(&[0, 0, 0, 0x70010])),
            (0x70000, b"function\0\0\0\0\0\0\0\0str\0\0\0\0\0\0\0\0\0\0\0\0\0".to_vec()),
        ])
    }

    #[test]
    fn the_name_is_the_string_python_agrees_with() {
        for at in [0, 8, 40] {
            let p = process(at, "train_step", "train_step");
            assert_eq!(calibrate(&p, 0x10000), Some(at), "name at +{at}");
            let mut names = JitNames::default();
            assert_eq!(names.name(Some(&p), 0x10000).as_deref(), Some("train_step"));
            assert_eq!(names.offset(), Some(at));
        }
    }

    #[test]
    fn a_string_python_does_not_confirm_proves_nothing() {
        let p = process(0, "train_step", "other");
        assert_eq!(calibrate(&p, 0x10000), None);
        let mut names = JitNames::default();
        assert_eq!(names.name(Some(&p), 0x10000), None);
        assert_eq!(names.offset(), None);
    }
}
