//! Interpreter detection for `--step-python`: which files of a target may
//! hold its CPython (the executable, the `libpython*` it maps or needs), the
//! version a file was built as, and what the PEP 523 frame hook needs to know
//! about one CPython build, read from its ELF file alone (no I/O there): the
//! version, where
//! `_PyEval_EvalFrameDefault` is and where to probe it, how to reach
//! `PyInterpreterState.eval_frame` from `_PyRuntime`, and where a frame's
//! code object keeps its name ([`FrameLayout`]).
//!
//! 3.13+ describe themselves: `_PyRuntime` starts with `_Py_DebugOffsets`
//! (cookie `xdebugpy`). 3.10–3.12 have per-version tables, checked against
//! the debug info of pyenv's 3.10.13, 3.11.7, 3.12.1 (`gdb -batch -ex 'p/x
//! &((_PyRuntimeState*)0)->interpreters.head'` and the like). The
//! `eval_frame` offset moves between patch releases (0x2130 in 3.14.0, 0x2148
//! in 3.14.10), so it is decoded from `_PyInterpreterState_GetEvalFrameFunc`
//! (`mov rax, [rdi+disp]`) on every version.
use std::{
    fmt,
    path::{Path, PathBuf},
};

use iced_x86::{Code, Decoder, DecoderOptions, Register};
use object::{Object, ObjectSection, ObjectSymbol};
use profiler_common::{FrameLayout, PY_NO_FIELD, PyStackLayout, py_boundary};

use crate::probes::maps::MappedFile;

pub const EVAL_FRAME_DEFAULT: &str = "_PyEval_EvalFrameDefault";
const GET_EVAL_FRAME_FUNC: &str = "_PyInterpreterState_GetEvalFrameFunc";
const RUNTIME: &str = "_PyRuntime";
const DEBUG_COOKIE: &[u8; 8] = b"xdebugpy";
/// `CO_GENERATOR | CO_COROUTINE | CO_ITERABLE_COROUTINE | CO_ASYNC_GENERATOR`.
const GENERATOR_FLAGS: u32 = 0x20 | 0x80 | 0x100 | 0x200;
const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];

/// Where the frame hook's pieces are in one CPython file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CPythonBuild {
    /// `(major, minor)`.
    pub version: (u8, u8),
    /// File offset of `_PyEval_EvalFrameDefault`.
    pub eval_default_file_offset: u64,
    /// Its link-time address: the value written into `eval_frame`, once relocated.
    pub eval_default_address: u64,
    /// Bytes from the function's start to its entry and return probes: 4
    /// past an `endbr64`, which the kernel would single-step (several µs a
    /// hit instead of ≈1).
    pub entry_skip: u64,
    /// Link-time address of `_PyRuntime`.
    pub runtime_address: u64,
    /// `offsetof(_PyRuntimeState, interpreters.head)`.
    pub interpreters_head: u64,
    /// `offsetof(PyInterpreterState, eval_frame)`.
    pub eval_frame: u64,
    pub layout: FrameLayout,
    /// Where the CPU sampler finds a thread's Python frames and names their code.
    pub stack: PyStackOffsets,
    /// Where the layout came from: `_Py_DebugOffsets` or a table.
    pub source: &'static str,
}

/// What the CPU sampler needs of a CPython build: the kernel side's walk
/// (a [`PyStackLayout`] whose `interpreters_head` is relative to
/// `_PyRuntime` and whose `task_fsbase` is unset) and where a code object
/// keeps what names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyStackOffsets {
    pub walk: PyStackLayout,
    /// `co_qualname` (3.11+) or `co_name` (3.10).
    pub co_qualname: u32,
    pub co_filename: u32,
    /// `co_firstlineno` (an int).
    pub co_firstlineno: u32,
    /// `sizeof(PyASCIIObject)`: where an ASCII str's characters start.
    pub ascii_data: u32,
    /// `sizeof(PyCompactUnicodeObject)`: where another compact str's start.
    pub compact_data: u32,
}

impl CPythonBuild {
    /// 3.10 calls every Python function through `eval_frame`, whose default
    /// is `_PyEval_EvalFrameDefault`: nothing to write. 3.11+ inline
    /// Python-to-Python calls while it is NULL.
    pub fn needs_write(&self) -> bool {
        self.version >= (3, 11)
    }
}

impl fmt::Display for CPythonBuild {
    /// The `how` text of the probed-files row: mechanism, version, offsets.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor) = self.version;
        let l = &self.layout;
        write!(
            f,
            "PEP 523 frame hook (CPython {major}.{minor}): {EVAL_FRAME_DEFAULT} at file offset {:#x} (+{}), {}; \
             _PyRuntime+{:#x} interpreters.head, interp+{:#x} eval_frame; frame+{:#x} code (mask {:#x}), \
             code+{:#x} co_flags, +{:#x} co_name, +{:#x} co_filename, str+{} ASCII data ({})",
            self.eval_default_file_offset,
            self.entry_skip,
            if self.needs_write() { "eval_frame written" } else { "no write (3.10 calls through eval_frame)" },
            self.interpreters_head,
            self.eval_frame,
            l.code,
            l.code_mask,
            l.co_flags,
            l.co_name,
            l.co_filename,
            l.ascii_data,
            self.source,
        )
    }
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum CPythonError {
    #[error("not an ELF file")]
    NotElf,
    #[error("no exported {0}: not a CPython interpreter (or a stripped one)")]
    Missing(&'static str),
    #[error("CPython {0}.{1}: the frame hook knows 3.10 to 3.14")]
    Unsupported(u8, u8),
    #[error("{GET_EVAL_FRAME_FUNC} does not start with `mov rax, [rdi+disp]`: cannot find eval_frame")]
    EvalFrameOffset,
    #[error("_PyRuntime does not start with _Py_DebugOffsets (cookie xdebugpy)")]
    DebugOffsets,
}

/// Reads the frame hook's facts from a CPython executable or libpython.
pub fn inspect(data: &[u8]) -> Result<CPythonBuild, CPythonError> {
    let file = object::File::parse(data).map_err(|_| CPythonError::NotElf)?;
    let symbol = |name: &'static str| {
        file.dynamic_symbols()
            .chain(file.symbols())
            .find(|s| s.name() == Ok(name) && s.section_index().is_some())
            .ok_or(CPythonError::Missing(name))
    };
    let eval = symbol(EVAL_FRAME_DEFAULT)?;
    let getter = symbol(GET_EVAL_FRAME_FUNC)?;
    let runtime = symbol(RUNTIME)?;
    let version = match python_version(&file) {
        Some(v) => v,
        // Py_Version is exported from 3.11; PyAIter_Check is new in 3.10.
        None if symbol("PyAIter_Check").is_ok() => (3, 10),
        None => return Err(CPythonError::Unsupported(3, 9)),
    };
    let eval_bytes = bytes_at(&file, eval.address(), 4).ok_or(CPythonError::Missing(EVAL_FRAME_DEFAULT))?;
    let getter_bytes = bytes_at(&file, getter.address(), 16).ok_or(CPythonError::Missing(GET_EVAL_FRAME_FUNC))?;
    let eval_frame = eval_frame_offset(getter_bytes, getter.address()).ok_or(CPythonError::EvalFrameOffset)?;
    let (interpreters_head, layout, stack, source) = match version {
        (3, 13..=14) => {
            let head = bytes_at(&file, runtime.address(), DEBUG_OFFSETS_LEN).ok_or(CPythonError::DebugOffsets)?;
            let (interpreters_head, layout) = from_debug_offsets(head, version)?;
            let stack = stack_from_debug_offsets(head, version)?;
            (interpreters_head, layout, stack, "_Py_DebugOffsets")
        }
        (3, 10..=12) => {
            let (head, layout) = table(version).ok_or(CPythonError::Unsupported(version.0, version.1))?;
            let stack = stack_table(version).ok_or(CPythonError::Unsupported(version.0, version.1))?;
            (head, layout, stack, "per-version table")
        }
        (major, minor) => return Err(CPythonError::Unsupported(major, minor)),
    };
    let eval_default_file_offset =
        file_offset(&file, eval.address()).ok_or(CPythonError::Missing(EVAL_FRAME_DEFAULT))?;
    Ok(CPythonBuild {
        version,
        eval_default_file_offset,
        eval_default_address: eval.address(),
        entry_skip: if eval_bytes == ENDBR64 { 4 } else { 0 },
        runtime_address: runtime.address(),
        interpreters_head,
        eval_frame,
        layout,
        stack,
        source,
    })
}

/// `len` bytes of the file's contents at link-time address `address`.
fn bytes_at<'d>(file: &object::File<'d>, address: u64, len: u64) -> Option<&'d [u8]> {
    file.sections()
        .find(|s| s.address() <= address && address + len <= s.address() + s.size())
        .and_then(|s| s.data_range(address, len).ok().flatten())
}

fn file_offset(file: &object::File<'_>, address: u64) -> Option<u64> {
    crate::probes::elf::load_segments(file).iter().find_map(|s| s.file_offset(address))
}

/// `offsetof(PyInterpreterState, eval_frame)` from the machine code of
/// `_PyInterpreterState_GetEvalFrameFunc(interp)`: after an optional
/// `endbr64`, `mov rax, [rdi+disp]`.
pub fn eval_frame_offset(code: &[u8], address: u64) -> Option<u64> {
    let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
    let mut insn = decoder.decode();
    if insn.code() == Code::Endbr64 {
        insn = decoder.decode();
    }
    let load = insn.code() == Code::Mov_r64_rm64
        && insn.op0_register() == Register::RAX
        && insn.memory_base() == Register::RDI
        && insn.memory_index() == Register::None;
    load.then(|| insn.memory_displacement64())
}

/// Bytes of `_Py_DebugOffsets` read: through `unicode_object` in 3.14's layout.
const DEBUG_OFFSETS_LEN: u64 = 648;

/// `interpreters.head` and the frame layout from `_Py_DebugOffsets`.
///
/// 3.13's layout is checked against 3.13.0's debug info (`ptype/o
/// _Py_DebugOffsets`). 3.14 adds fields inside the nested structs, which
/// moves every struct after `runtime_state`: there only `interpreters_head`
/// (in `runtime_state`, at the same place) is read, and the rest comes from
/// 3.14's headers (`f_executable` a `_PyStackRef` tagged in its low bits; the
/// code and str layouts as 3.13's). Checked on Debian's 3.14.10: exact step
/// counts in the python_any tests.
fn from_debug_offsets(b: &[u8], version: (u8, u8)) -> Result<(u64, FrameLayout), CPythonError> {
    if b.get(..8) != Some(DEBUG_COOKIE) {
        return Err(CPythonError::DebugOffsets);
    }
    let at = |o: usize| b.get(o..o + 8).and_then(|s| s.try_into().ok()).map(u64::from_le_bytes);
    let field = |o: usize| at(o).and_then(|v| u32::try_from(v).ok()).ok_or(CPythonError::DebugOffsets);
    // cookie, version, free_threaded, then runtime_state { size, finalizing, interpreters_head }.
    if at(16) != Some(0) {
        // A free-threaded build: other object layouts, and no GIL to lean on.
        return Err(CPythonError::Unsupported(version.0, version.1));
    }
    let head = at(40).ok_or(CPythonError::DebugOffsets)?;
    let layout = if version == (3, 13) {
        FrameLayout {
            code: field(240)?,        // interpreter_frame.executable
            co_flags: 0x30,           // not described; 0x30 in 3.11–3.14
            co_name: field(288)?,     // code_object.name
            co_filename: field(280)?, // code_object.filename
            ascii_data: field(560)?,  // unicode_object.asciiobject_size
            skip_flags: GENERATOR_FLAGS,
            code_mask: u64::MAX,
        }
    } else {
        FrameLayout {
            code: 0,
            co_flags: 0x30,
            co_name: 0x78,
            co_filename: 0x70,
            ascii_data: 40,
            skip_flags: GENERATOR_FLAGS,
            code_mask: !7,
        }
    };
    Ok((head, layout))
}

/// Where, in `_Py_DebugOffsets`, the CPU sampler's offsets are: 3.13's
/// layout (checked against 3.13.0's debug info), and 3.14's, which adds
/// fields to the interpreter state, frame and code structs and a set struct
/// (checked field by field on Debian's 3.14.10, whose sizes come first in
/// each struct, then offsets below them).
struct DebugFields {
    threads_head: usize,
    tstate_next: usize,
    current_frame: usize,
    native_thread_id: usize,
    previous: usize,
    executable: usize,
    owner: usize,
    filename: usize,
    qualname: usize,
    firstlineno: usize,
    ascii_size: usize,
}

const DEBUG_FIELDS_3_13: DebugFields = DebugFields {
    threads_head: 72,
    tstate_next: 168,
    current_frame: 184,
    native_thread_id: 200,
    previous: 232,
    executable: 240,
    owner: 264,
    filename: 280,
    qualname: 296,
    firstlineno: 312,
    ascii_size: 560,
};

const DEBUG_FIELDS_3_14: DebugFields = DebugFields {
    threads_head: 72,
    tstate_next: 192,
    current_frame: 208,
    native_thread_id: 224,
    previous: 256,
    executable: 264,
    owner: 288,
    filename: 320,
    qualname: 336,
    firstlineno: 352,
    ascii_size: 640,
};

/// The CPU sampler's offsets of a 3.13 or 3.14 build, from its `_Py_DebugOffsets`.
fn stack_from_debug_offsets(b: &[u8], version: (u8, u8)) -> Result<PyStackOffsets, CPythonError> {
    let f = if version == (3, 13) { &DEBUG_FIELDS_3_13 } else { &DEBUG_FIELDS_3_14 };
    let field = |o: usize| {
        b.get(o..o + 8)
            .and_then(|s| s.try_into().ok())
            .map(u64::from_le_bytes)
            .and_then(|v| u32::try_from(v).ok())
            .ok_or(CPythonError::DebugOffsets)
    };
    let ascii_data = field(f.ascii_size)?;
    Ok(PyStackOffsets {
        walk: PyStackLayout {
            interpreters_head: 0,
            code_mask: if version >= (3, 14) { !7 } else { u64::MAX },
            task_fsbase: 0,
            threads_head: field(f.threads_head)?,
            tstate_next: field(f.tstate_next)?,
            tstate_thread_id: field(f.native_thread_id)?,
            by_native_id: 1,
            tstate_frame: field(f.current_frame)?,
            cframe_frame: PY_NO_FIELD,
            frame_previous: field(f.previous)?,
            frame_code: field(f.executable)?,
            frame_marker: field(f.owner)?,
            boundary: py_boundary::CSTACK_OWNER,
            _pad: 0,
        },
        co_qualname: field(f.qualname)?,
        co_filename: field(f.filename)?,
        co_firstlineno: field(f.firstlineno)?,
        ascii_data,
        // PyCompactUnicodeObject adds utf8_length and utf8 (3.12+).
        compact_data: ascii_data + 16,
    })
}

/// The CPU sampler's offsets of 3.10–3.12 (x86-64, GIL builds), checked
/// against the debug info of pyenv's 3.10.13, 3.11.7 and 3.12.1 (`gdb -batch
/// -ex 'p/x &((PyThreadState*)0)->thread_id'` and the like).
fn stack_table(version: (u8, u8)) -> Option<PyStackOffsets> {
    #[allow(clippy::too_many_arguments)]
    // `thread_id`: `native_thread_id` from 3.11, else `thread_id` (`pthread_self()`).
    let walk = |threads_head, next, thread_id, frame, cframe_frame, previous, code, marker, boundary| PyStackLayout {
        interpreters_head: 0,
        code_mask: u64::MAX,
        task_fsbase: 0,
        threads_head,
        tstate_next: next,
        tstate_thread_id: thread_id,
        by_native_id: u32::from(boundary != py_boundary::EVERY_FRAME),
        tstate_frame: frame,
        cframe_frame,
        frame_previous: previous,
        frame_code: code,
        frame_marker: marker,
        boundary,
        _pad: 0,
    };
    let offsets = |walk, co_qualname, co_filename, co_firstlineno, ascii_data, compact_data| PyStackOffsets {
        walk,
        co_qualname,
        co_filename,
        co_firstlineno,
        ascii_data,
        compact_data,
    };
    match version {
        // interp->tstate_head; tstate->thread_id; tstate->frame, a
        // PyFrameObject (f_back, f_code); no co_qualname.
        (3, 10) => Some(offsets(
            walk(0x8, 0x8, 0xb0, 0x18, PY_NO_FIELD, 0x18, 0x20, 0, py_boundary::EVERY_FRAME),
            0x70,
            0x68,
            0x28,
            0x30,
            0x48,
        )),
        // tstate->cframe->current_frame, a _PyInterpreterFrame (previous, f_code, is_entry).
        (3, 11) => Some(offsets(
            walk(0x10, 0x8, 0xa0, 0x38, 0x8, 0x30, 0x20, 0x44, py_boundary::IS_ENTRY),
            0x80,
            0x70,
            0x48,
            0x30,
            0x48,
        )),
        // The same, reordered; an entry frame is a shim owned by the C stack.
        (3, 12) => Some(offsets(
            walk(0x48, 0x8, 0x90, 0x38, 0x0, 0x8, 0x0, 0x46, py_boundary::CSTACK_OWNER),
            0x80,
            0x70,
            0x44,
            0x28,
            0x38,
        )),
        _ => None,
    }
}

/// `(interpreters.head, layout)` of 3.10–3.12 (x86-64, GIL builds).
fn table(version: (u8, u8)) -> Option<(u64, FrameLayout)> {
    let layout = |code, co_flags, co_name, co_filename, ascii_data| FrameLayout {
        code,
        co_flags,
        co_name,
        co_filename,
        ascii_data,
        skip_flags: GENERATOR_FLAGS,
        code_mask: u64::MAX,
    };
    match version {
        // PyFrameObject.f_code; PyCodeObject before the 3.11 reshuffle; PyASCIIObject with wstr.
        (3, 10) => Some((0x20, layout(0x20, 0x24, 0x70, 0x68, 48))),
        // _PyInterpreterFrame.f_code after f_func, f_globals, f_builtins, f_locals.
        (3, 11) => Some((0x28, layout(0x20, 0x30, 0x78, 0x70, 48))),
        // _PyInterpreterFrame.f_code first; PyASCIIObject without wstr.
        (3, 12) => Some((0x28, layout(0, 0x30, 0x78, 0x70, 40))),
        _ => None,
    }
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

/// The `libpython*` an executable needs (DT_NEEDED), found through its
/// RUNPATH/RPATH (`$ORIGIN` expanded), `ld_library_path` and the usual
/// directories: in `run` mode the command has not loaded it yet, and a
/// `--enable-shared` build (pyenv's) keeps the interpreter there.
pub fn needed_libpython(exe: &Path, ld_library_path: Option<&str>) -> Vec<PathBuf> {
    let Ok(data) = crate::probes::map_file(exe) else { return Vec::new() };
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

#[cfg(test)]
mod tests;
