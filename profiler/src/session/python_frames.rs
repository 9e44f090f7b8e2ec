//! Python frames in CPU samples: which CPython a process runs, described to
//! the kernel's sampler once its runtime is mapped (`PY_PROCS`); the code
//! objects the sampler reports, named once each from the process's memory;
//! and the Python frames put in the native stack where the interpreter's
//! loop runs them.
use std::{
    collections::HashSet,
    fs::File,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use procfs::process::MemoryMaps;
use profiler_common::{PY_FRAME_ENTRY, PY_FRAME_SHIM};

use crate::probes::{
    self, Probes,
    python::interpreter::{self, CPythonBuild, CPythonError, PyStackOffsets},
};

/// The longest name or file name read: longer ones are cut.
const MAX_STR: usize = 4096;

/// A process's CPython, as the CPU sampler's user side reads it.
pub struct PyCodeReader {
    mem: File,
    offsets: PyStackOffsets,
}

/// A code object's names: what a Python frame is called.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PyCode {
    /// `co_qualname` (`Class.method`; `co_name` on 3.10).
    pub function: String,
    pub file: String,
    pub first_line: u32,
}

impl PyCodeReader {
    /// The code object at `code` in the process, None where it cannot be read
    /// (the process gone, or not a code object any more).
    pub fn code(&self, code: u64) -> Option<PyCode> {
        let o = &self.offsets;
        let name = self.str_at(self.u64_at(code + u64::from(o.co_qualname))?)?;
        let file = self.str_at(self.u64_at(code + u64::from(o.co_filename))?)?;
        let mut line = [0u8; 4];
        self.mem.read_exact_at(&mut line, code + u64::from(o.co_firstlineno)).ok()?;
        let first_line = u32::try_from(i32::from_le_bytes(line)).ok()?;
        Some(PyCode { function: name, file, first_line })
    }

    fn u64_at(&self, at: u64) -> Option<u64> {
        probes::read_u64_at(&self.mem, at).ok()
    }

    /// A `str` object's text: compact ASCII, or compact UCS-1/2/4. The state
    /// bit field (all GIL builds 3.10–3.14) is `interned:2, kind:3,
    /// compact:1, ascii:1`, after the object header, length and hash.
    fn str_at(&self, s: u64) -> Option<String> {
        let mut head = [0u8; 0x24];
        self.mem.read_exact_at(&mut head, s).ok()?;
        let len = usize::try_from(i64::from_le_bytes(head[0x10..0x18].try_into().ok()?)).ok()?.min(MAX_STR);
        let state = u32::from_le_bytes(head[0x20..0x24].try_into().ok()?);
        let (kind, compact, ascii) = ((state >> 2) & 7, state >> 5 & 1 == 1, state >> 6 & 1 == 1);
        if !compact {
            return None;
        }
        let data = s + u64::from(if ascii { self.offsets.ascii_data } else { self.offsets.compact_data });
        let width = if ascii { 1 } else { kind as usize };
        if !matches!(width, 1 | 2 | 4) {
            return None;
        }
        let mut bytes = vec![0u8; len * width];
        self.mem.read_exact_at(&mut bytes, data).ok()?;
        let chars = bytes.chunks_exact(width).map(|c| {
            let mut v = [0u8; 4];
            v[..width].copy_from_slice(c);
            char::from_u32(u32::from_le_bytes(v)).unwrap_or(char::REPLACEMENT_CHARACTER)
        });
        Some(chars.collect())
    }
}

/// The code objects of a sample's Python frames, innermost first, in runs
/// of one call of the interpreter's loop each: a run ends at a frame the
/// kernel marked as a call's outermost, or before a C-stack shim.
pub fn runs(frames: &[u64]) -> Vec<Vec<u64>> {
    let mut out = Vec::new();
    let mut run = Vec::new();
    for &f in frames {
        if f == PY_FRAME_SHIM {
            if !run.is_empty() {
                out.push(std::mem::take(&mut run));
            }
            continue;
        }
        if f & !PY_FRAME_ENTRY == 0 {
            continue;
        }
        run.push(f & !PY_FRAME_ENTRY);
        if f & PY_FRAME_ENTRY != 0 {
            out.push(std::mem::take(&mut run));
        }
    }
    if !run.is_empty() {
        out.push(run);
    }
    out
}

/// One stack from a native one (leaf first) and the Python runs (innermost
/// first): each native frame of the interpreter's loop gives its place to
/// the next run. Runs left over (the native walk stopped early: code without
/// frame pointers) go at the root end, where their callers are; a loop frame
/// left over stays as it is.
pub fn merge<T: Copy>(native: &[T], is_loop: impl Fn(T) -> bool, runs: &[Vec<T>]) -> Vec<T> {
    let mut runs = runs.iter();
    let mut out = Vec::with_capacity(native.len() + runs.len() * 4);
    for &f in native {
        match (is_loop(f), runs.as_slice().is_empty()) {
            (true, false) => out.extend(runs.next().into_iter().flatten().copied()),
            _ => out.push(f),
        }
    }
    out.extend(runs.flatten().copied());
    out
}

/// Whether a native function is the interpreter's loop (`.cold` parts too).
pub fn is_eval_loop(function: &str) -> bool {
    function.strip_prefix(interpreter::EVAL_FRAME_DEFAULT).is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

/// How long a process's maps are looked at for its CPython at every drain
/// (see `LibraryWatcher::look_for_python`); later, at the watcher's looks.
const EAGER_LOOK: Duration = Duration::from_secs(5);

/// Per process: finds its CPython and describes it to the sampler, once.
pub struct PythonStackWatch {
    done: bool,
    since: Instant,
    /// Files found not to be CPython (not looked at again).
    not_python: HashSet<PathBuf>,
    /// The CPython file found, its facts read once: (path, build, page of its lowest segment).
    found: Option<(PathBuf, CPythonBuild, u64)>,
}

impl Default for PythonStackWatch {
    fn default() -> Self {
        Self { done: false, since: Instant::now(), not_python: HashSet::new(), found: None }
    }
}

impl PythonStackWatch {
    /// Whether its CPython is still to be found, in the process's first seconds.
    pub fn looking(&self) -> bool {
        !self.done && self.since.elapsed() < EAGER_LOOK
    }

    /// Looks at `maps` for the process's CPython. Once its runtime's data is
    /// mapped, describes it to the sampler and returns the reader of its
    /// code objects. A CPython it cannot read says so in one line (native
    /// frames only) and is not looked at again.
    pub fn scan(&mut self, pid: u32, probes: &mut Probes, maps: &MemoryMaps) -> Option<PyCodeReader> {
        if self.done || !probes.samples_python() {
            return None;
        }
        if self.found.is_none() {
            match self.find(pid, maps) {
                Ok(found) => self.found = found,
                Err(why) => {
                    self.done = true;
                    eprintln!("profiler: PID {pid}: {why}: its CPU samples have native frames only");
                    return None;
                }
            }
        }
        let (path, build, lowest_page) = self.found.as_ref()?;
        match describe(pid, path, build, *lowest_page, probes, maps) {
            Ok(Some(reader)) => {
                self.done = true;
                log::info!(
                    "PID {pid}: CPython {}.{} ({}): CPU samples carry Python frames",
                    build.version.0,
                    build.version.1,
                    path.display()
                );
                Some(reader)
            }
            // Not mapped in full yet (the loader at work), or the kernel's
            // types still being read: the next look.
            Ok(None) => None,
            Err(why) => {
                self.done = true;
                eprintln!("profiler: PID {pid}: no Python frames in its CPU samples: {why}");
                None
            }
        }
    }

    /// The CPython file among those the process maps, if one is; an error
    /// names a CPython this profiler cannot read (its version, or a build
    /// it does not know).
    fn find(&mut self, pid: u32, maps: &MemoryMaps) -> Result<Option<(PathBuf, CPythonBuild, u64)>, String> {
        let Ok(exe) = std::fs::read_link(format!("/proc/{pid}/exe")) else { return Ok(None) };
        let mapped = probes::maps::mapped_files(maps);
        for path in interpreter::candidates(&exe, &mapped) {
            if self.not_python.contains(&path) || !mapped.iter().any(|m| m.path == path) {
                continue;
            }
            let Ok(data) = probes::map_file(&probes::in_target_root(pid, &path)) else { continue };
            // A `python3.12` without the interpreter in it (pyenv's
            // `--enable-shared` launcher) is no CPython: its libpython is.
            let build = match interpreter::inspect(&data) {
                Ok(b) => b,
                Err(CPythonError::NotElf | CPythonError::Missing(_)) => {
                    self.not_python.insert(path);
                    continue;
                }
                Err(CPythonError::Unsupported(major, minor)) => {
                    return Err(format!(
                        "{}: CPython {major}.{minor}: Python frames are read on CPython 3.10 to 3.14",
                        path.display()
                    ));
                }
                Err(e) => return Err(format!("{}: {e}", path.display())),
            };
            let lowest = object::File::parse(&*data)
                .ok()
                .and_then(|f| probes::elf::load_segments(&f).iter().map(|s| s.address).min());
            let Some(lowest) = lowest else {
                self.not_python.insert(path);
                continue;
            };
            return Ok(Some((path, build, lowest & !0xfff)));
        }
        Ok(None)
    }
}

/// Describes the process's CPython to the sampler once its runtime's data is
/// mapped (None: not yet).
fn describe(
    pid: u32,
    path: &Path,
    build: &CPythonBuild,
    lowest_page: u64,
    probes: &mut Probes,
    maps: &MemoryMaps,
) -> Result<Option<PyCodeReader>, String> {
    let Some(bias) = probes::maps::load_bias(maps, path, lowest_page) else { return Ok(None) };
    let head = bias + build.runtime_address + build.interpreters_head;
    if !probes::maps::is_writable(maps, head) || !probes.python_layout_ready(&build.stack.walk) {
        return Ok(None);
    }
    let mem = File::open(format!("/proc/{pid}/mem")).map_err(|e| e.to_string())?;
    let walk = profiler_common::PyStackLayout { interpreters_head: head, ..build.stack.walk };
    probes.describe_python(pid, walk).map_err(|e| e.to_string())?;
    Ok(Some(PyCodeReader { mem, offsets: build.stack }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_end_at_each_marked_frame_or_shim_and_the_rest_is_the_last() {
        let frames = [0x10, 0x20 | PY_FRAME_ENTRY, 0x30 | PY_FRAME_ENTRY, 0x40, 0x50];
        assert_eq!(runs(&frames), vec![vec![0x10, 0x20], vec![0x30], vec![0x40, 0x50]]);
        // 3.12+: shims between the calls, an interpreter frame (0) at the base.
        let frames = [0x10, 0x20, PY_FRAME_SHIM, 0x30, PY_FRAME_SHIM, 0];
        assert_eq!(runs(&frames), vec![vec![0x10, 0x20], vec![0x30]]);
        assert!(runs(&[]).is_empty());
    }

    #[test]
    fn each_loop_frame_takes_the_next_run_and_what_is_left_goes_to_the_root() {
        // Native, leaf first: 1 leaf, 9 the loop, 2 a C caller, 9 the loop, 3 main.
        let loop_frame = |f: u32| f == 9;
        let runs = vec![vec![100, 101], vec![200]];
        assert_eq!(merge(&[1, 9, 2, 9, 3], loop_frame, &runs), vec![1, 100, 101, 2, 200, 3]);
        // A walk that stopped at the leaf: the runs follow it, outermost last.
        assert_eq!(merge(&[1], loop_frame, &runs), vec![1, 100, 101, 200]);
        // More loop frames than runs (a thread between frames): the extra stays.
        assert_eq!(merge(&[9, 9, 9], loop_frame, &runs), vec![100, 101, 200, 9]);
        // No Python frames: the native stack as it is.
        assert_eq!(merge(&[1, 9, 3], loop_frame, &[]), vec![1, 9, 3]);
    }

    #[test]
    fn the_loop_is_known_by_its_name_and_its_cold_part() {
        assert!(is_eval_loop("_PyEval_EvalFrameDefault"));
        assert!(is_eval_loop("_PyEval_EvalFrameDefault.cold"));
        assert!(!is_eval_loop("_PyEval_EvalFrameDefaultX"));
        assert!(!is_eval_loop("PyEval_EvalCode"));
    }
}
