//! An alias of `_PyEval_EvalFrameDefault` for the frame hook to write: a PLT
//! entry in a library the target maps that jumps to it (PyTorch's
//! `libtorch_python.so` calls it through one).
//!
//! Why: CPython 3.11+ store NULL when asked to set `_PyEval_EvalFrameDefault`
//! itself (`_PyInterpreterState_SetEvalFrameFunc`), and dynamo
//! (`torch.compile`) asks exactly that after every compiled call, putting back
//! the value it found before installing its shim. With the function's own
//! address in the field, the field is NULL again after each compiled call and
//! the next Python-to-Python call is inlined, unseen, before any watcher can
//! write it again (0 of 100 back-to-back steps counted). With the PLT entry's
//! address, what dynamo puts back is a different pointer, stored as it is: the
//! field never becomes NULL, and a call through it reaches
//! `_PyEval_EvalFrameDefault` with the same arguments and return address (the
//! entry is a `jmp [GOT]`), where the probes see it.
//!
//! The entry is restored to NULL on detach like the default would be; a
//! profiler killed with SIGKILL leaves it in the field, which stays valid as
//! long as the library is mapped (CPython never unloads extension modules).
//!
//! (A uprobe that rewrites the stored register would do the same without an
//! alias, but needs a kernel that lets uprobe programs write their registers,
//! 6.17+ without lockdown; this machine's 6.18 refuses every such write.)
use std::path::{Path, PathBuf};

use iced_x86::{Code, Decoder, DecoderOptions};
use object::{Object, ObjectSection, ObjectSymbol, ObjectSymbolTable, RelocationFlags, RelocationTarget, elf};

use crate::probes::{self, python::interpreter::EVAL_FRAME_DEFAULT};

/// A PLT entry for `_PyEval_EvalFrameDefault` in the target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Alias {
    /// Its address in the target: what the hook writes.
    pub address: u64,
    /// The library it is in (as the target maps it), and its file offset there.
    pub path: PathBuf,
    pub file_offset: u64,
}

impl std::fmt::Display for Alias {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the PLT entry of {EVAL_FRAME_DEFAULT} in {} (file offset {:#x})",
            self.path.display(),
            self.file_offset
        )
    }
}

/// Finds an alias among the Python-related libraries process `pid` maps
/// (names with `python` in them: `libtorch_python.so`, extension modules),
/// checked against the target's memory: its GOT slot holds `default`, or
/// still points into the library (bound lazily on the first call).
pub fn find(pid: u32, default: u64) -> Option<Alias> {
    let maps = procfs::process::Process::new(pid as i32).and_then(|p| p.maps()).ok()?;
    let mut seen: Vec<&Path> = Vec::new();
    for m in maps.iter() {
        let procfs::process::MMapPath::Path(path) = &m.pathname else { continue };
        let named = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.contains("python"));
        if !named || seen.contains(&path.as_path()) {
            continue;
        }
        seen.push(path);
        if let Some(alias) = alias_in(pid, path, &maps, default) {
            return Some(alias);
        }
    }
    None
}

/// The alias in one mapped library, if it has a checked one.
fn alias_in(pid: u32, path: &Path, maps: &procfs::process::MemoryMaps, default: u64) -> Option<Alias> {
    let data = probes::open_in_target(pid, path)?;
    let file = object::File::parse(&*data).ok()?;
    let (stub, got) = plt_entry(&file, EVAL_FRAME_DEFAULT)?;
    let lowest = probes::elf::load_segments(&file).iter().map(|s| s.address).min()?;
    let bias = probes::maps::load_bias(maps, path, lowest)?;
    let slot = probes::read_target_u64(pid, bias.wrapping_add(got)).ok()?;
    let mapped = |a: u64| {
        maps.iter().any(|m| {
            matches!(&m.pathname, procfs::process::MMapPath::Path(p) if p == path)
                && (m.address.0..m.address.1).contains(&a)
        })
    };
    if slot != default && !mapped(slot) {
        return None;
    }
    let file_offset = probes::elf::load_segments(&file).iter().find_map(|s| s.file_offset(stub))?;
    Some(Alias { address: bias.wrapping_add(stub), path: path.to_owned(), file_offset })
}

/// `(entry, GOT slot)` link-time addresses of the PLT entry that jumps to
/// `symbol` through its `R_X86_64_JUMP_SLOT` GOT slot: the entry starts at
/// its `endbr64` where it has one (`.plt.sec`), else at its `jmp [rip+disp]` (`.plt`).
pub fn plt_entry(file: &object::File<'_>, symbol: &str) -> Option<(u64, u64)> {
    let symbols = file.dynamic_symbol_table()?;
    let got = file.dynamic_relocations()?.find_map(|(offset, r)| {
        let RelocationTarget::Symbol(index) = r.target() else { return None };
        let jump_slot = matches!(r.flags(), RelocationFlags::Elf { r_type } if r_type == elf::R_X86_64_JUMP_SLOT);
        (jump_slot && symbols.symbol_by_index(index).ok()?.name() == Ok(symbol)).then_some(offset)
    })?;
    for name in [".plt.sec", ".plt"] {
        let Some(section) = file.section_by_name(name) else { continue };
        let Ok(code) = section.data() else { continue };
        let mut previous = None;
        for insn in Decoder::with_ip(64, code, section.address(), DecoderOptions::NONE) {
            if insn.is_jmp_near_indirect() && insn.is_ip_rel_memory_operand() && insn.ip_rel_memory_address() == got {
                let start = previous
                    .filter(|p: &iced_x86::Instruction| p.code() == Code::Endbr64)
                    .map_or(insn.ip(), |p| p.ip());
                return Some((start, got));
            }
            previous = Some(insn);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// PyTorch's `libtorch_python.so` calls `_PyEval_EvalFrameDefault`
    /// through its PLT (`objdump -d -j .plt`: `jmp *0x…(%rip)` to the
    /// JUMP_SLOT that `readelf -r` lists); CPython's own libpython takes its
    /// address through the GOT only and has no such entry.
    #[test]
    fn finds_the_plt_entry_of_eval_frame_default() {
        // The environment `cargo xtask test` made (PROFILER_TORCH_PYTHONS:
        // `name=venv/bin/python;…`), else root's cache, as for a plain `cargo test`.
        let venv = std::env::var("PROFILER_TORCH_PYTHONS")
            .ok()
            .and_then(|all| {
                let python = all.split(';').find_map(|p| p.strip_prefix("python3.12="))?.to_owned();
                Some(std::path::Path::new(&python).parent()?.parent()?.to_path_buf())
            })
            .unwrap_or_else(|| "/var/cache/profiler/venvs/python3.12-torch2.15.0".into());
        let torch = venv.join("lib/python3.12/site-packages/torch/lib/libtorch_python.so");
        let Ok(data) = std::fs::read(&torch) else {
            crate::skip_test(format!("{} not installed", torch.display()));
            return;
        };
        let file = object::File::parse(&*data).expect("ELF");
        let (stub, got) = plt_entry(&file, EVAL_FRAME_DEFAULT).expect("a PLT entry");
        let plt = file.section_by_name(".plt").expect(".plt");
        assert!((plt.address()..plt.address() + plt.size()).contains(&stub), "{stub:#x} in .plt");
        assert_eq!((stub - plt.address()) % 16, 0, "an entry's start");
        let got_plt = file.section_by_name(".got.plt").expect(".got.plt");
        assert!((got_plt.address()..got_plt.address() + got_plt.size()).contains(&got));
        let libpython = "/root/.pyenv/versions/3.12.1/lib/libpython3.12.so.1.0";
        match std::fs::read(libpython) {
            Ok(data) => assert_eq!(plt_entry(&object::File::parse(&*data).expect("ELF"), EVAL_FRAME_DEFAULT), None),
            Err(_) => crate::skip_test(format!("{libpython} not installed: its lack of a PLT entry unchecked")),
        }
    }
}
