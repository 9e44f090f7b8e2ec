//! Where PyTorch's `record_function` enter and exit live in `libtorch_cpu.so`
//!, and attaching the region programs there.
//!
//! `torch::autograd::profiler::record_function_enter_new(std::string const&,
//! std::optional<std::string> const&)` is exported; `record_function_exit_new(
//! c10::intrusive_ptr<PythonRecordFunction> const&)` is a local (`static`)
//! function, found in `.symtab` (PyPI's wheels are not stripped). Names are
//! matched on their demangled base name, so the mangled spelling of the
//! argument types (`std::optional` vs `c10::optional`, checked 2.15.0) does
//! not matter. Compiler-split parts (`….cold`) are not the function.
use std::path::Path;

use object::{Object, ObjectSymbol, SymbolKind};
use profiler_common::torch_programs;

use super::{ProbeError, ProbeSite, Probes, elf};

const ENTER: &str = "torch::autograd::profiler::record_function_enter_new";
const EXIT: &str = "torch::autograd::profiler::record_function_exit_new";

/// Whether `path` is PyTorch's CPU library (`libtorch_cpu.so`, any suffix).
pub fn is_libtorch_cpu(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libtorch_cpu.so"))
}

/// File offsets of the two functions in one `libtorch_cpu.so`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TorchSymbols {
    pub enter: u64,
    /// None: this build has no exit symbol (stripped `.symtab`): enters only.
    pub exit: Option<u64>,
    /// Where in the exit its probe can go more cheaply (see [`exit_jump`]).
    pub exit_jump: Option<ExitJump>,
    /// The build uses the pre-C++11 libstdc++ ABI (`std::string` mangled
    /// `Ss`: PyPI's wheels before 2.7), whose strings the enter reads
    /// differently (see `torch_programs::ENTER_COW_STRING`).
    pub cow_string: bool,
}

/// The exit's `jmp` and what the function added to the key before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExitJump {
    /// Bytes from the function's start.
    pub offset: u64,
    /// `rdi` there is the key plus this.
    pub displacement: u8,
}

/// The one body this recognises (PyTorch 2.15.0's wheel, and any build that
/// compiles the exit the same way): `mov (%rdi),%rdi` (the key: the
/// `intrusive_ptr`'s first word), `add $d,%rdi` (imm8, the `RecordFunction`
/// inside the `PythonRecordFunction`), `jmp rel32` to `RecordFunction::end`.
/// A uprobe on the `mov` is single-stepped out of line (two traps, ≈5 µs
/// measured), one on the `jmp` is emulated (one trap, ≈0.6 µs; see
/// `placement`'s table): the probe goes on the `jmp` and reads the key as
/// `rdi − d`. The straight-line body is reached only from its entry, so the
/// probe fires exactly when the function is called. Any other bytes (another
/// compiler, a negative `d`) keep the probe at the entry.
pub fn exit_jump(code: &[u8]) -> Option<ExitJump> {
    const MOV: [u8; 3] = [0x48, 0x8b, 0x3f];
    const ADD: [u8; 3] = [0x48, 0x83, 0xc7];
    const JMP_REL32: u8 = 0xe9;
    match code.get(..8)? {
        [m0, m1, m2, a0, a1, a2, d, JMP_REL32] if [*m0, *m1, *m2] == MOV && [*a0, *a1, *a2] == ADD && *d < 0x80 => {
            Some(ExitJump { offset: 7, displacement: *d })
        }
        _ => None,
    }
}

/// Finds the functions in the library's bytes. Only names that mention
/// `record_function_e` are demangled: libtorch_cpu has hundreds of thousands
/// of symbols, and this runs while the target trains.
pub fn resolve(data: &[u8]) -> Result<TorchSymbols, String> {
    let file = object::File::parse(data).map_err(|e| format!("not a readable ELF file: {e}"))?;
    let segments = elf::load_segments(&file);
    let (mut enter, mut exit, mut cow_string) = (None, None, false);
    for sym in file.dynamic_symbols().chain(file.symbols()) {
        if sym.kind() != SymbolKind::Text || sym.is_undefined() || sym.address() == 0 {
            continue;
        }
        let Ok(name) = sym.name() else { continue };
        if !name.contains("record_function_e") || name.contains('.') {
            continue;
        }
        let Some(offset) = segments.iter().find_map(|s| s.file_offset(sym.address())) else { continue };
        let base = elf::demangled(name);
        // The `std::string` overload (older builds also had one taking a
        // tensor), in either libstdc++ ABI: `…basic_string…` or `Ss`.
        let cow = name.contains("ERKSs");
        let takes_string = name.contains("basic_string") || cow;
        if base == ENTER && takes_string && enter.is_none() {
            enter = Some(offset);
            cow_string = cow;
        } else if base == EXIT && name.contains("PythonRecordFunction") && exit.is_none() {
            exit = Some(offset);
        }
    }
    let enter = enter.ok_or_else(|| format!("no {ENTER}(std::string const&, …) symbol"))?;
    let exit_jump = exit.and_then(|o| data.get(o as usize..)).and_then(exit_jump);
    Ok(TorchSymbols { enter, exit, exit_jump, cow_string })
}

/// One region probe: its program, (symbol, offset from its start, why there)
/// for the `probes` rows, its file offset and its cookie.
type RegionProbe = (&'static str, (String, u64, String), u64, u64);

impl Probes {
    /// Attaches the region programs to one `libtorch_cpu.so` (all or
    /// nothing); returns where each went, as `probes` rows.
    pub fn attach_torch(&mut self, path: &Path, syms: &TorchSymbols) -> Result<Vec<(String, u64, String)>, ProbeError> {
        let before = self.links.len();
        // Ends first, then the enter's return, then the enter: while a target
        // runs through the attach, a region can only lose its begin (an end
        // with no begin pairs with nothing), never its end (a region open
        // forever would keep its thread inside a DataLoader `__next__` or an
        // optimizer step, and no step would start or end again).
        let mut points: Vec<RegionProbe> = syms.exit.map(|o| self.exit_probe(o, syms.exit_jump)).into_iter().collect();
        let enter = |why: &str| (ENTER.to_string(), 0, why.to_string());
        points.extend([
            (torch_programs::ENTER_RETURN, enter("return: reads the key"), syms.enter, 0),
            if syms.cow_string {
                let why = "entry: reads the name (pre-C++11 ABI std::string: length before the characters)";
                (torch_programs::ENTER, enter(why), syms.enter, torch_programs::ENTER_COW_STRING)
            } else {
                (torch_programs::ENTER, enter("entry: reads the name"), syms.enter, 0)
            },
        ]);
        let sites: Vec<ProbeSite> = points
            .iter()
            .map(|&(program, _, file_offset, cookie)| ProbeSite::new(program, file_offset, cookie))
            .collect();
        if let Err(e) = self.attach_sites(path, &sites) {
            self.links.truncate(before);
            return Err(e);
        }
        Ok(points.into_iter().map(|(_, row, _, _)| row).collect())
    }

    /// The exit's probe: on its `jmp` where the body is the one
    /// [`exit_jump`] knows, unless `--probe-at-entry`.
    fn exit_probe(&self, file_offset: u64, jump: Option<ExitJump>) -> RegionProbe {
        let row = |offset, why: String| (EXIT.to_string(), offset, why);
        match jump {
            Some(j) if self.kernel.is_some() => (
                torch_programs::EXIT,
                row(
                    j.offset,
                    format!(
                        "+{:#x}: moved past mov (%rdi),%rdi; add ${:#x},%rdi to a jmp, which the kernel emulates \
                         (key = rdi - {:#x})",
                        j.offset, j.displacement, j.displacement
                    ),
                ),
                file_offset + j.offset,
                torch_programs::EXIT_KEY_IN_RDI | u64::from(j.displacement),
            ),
            Some(_) => (torch_programs::EXIT, row(0, "at the entry (--probe-at-entry)".into()), file_offset, 0),
            None => (
                torch_programs::EXIT,
                row(0, "entry (single-stepped): not the mov/add/jmp body the probe can move past".into()),
                file_offset,
                0,
            ),
        }
    }
}

/// The programs to load.
pub fn programs() -> [&'static str; 3] {
    [torch_programs::ENTER, torch_programs::ENTER_RETURN, torch_programs::EXIT]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_the_library_by_file_name() {
        assert!(is_libtorch_cpu(Path::new("/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so")));
        assert!(is_libtorch_cpu(Path::new("libtorch_cpu.so.2.4")));
        assert!(!is_libtorch_cpu(Path::new("/x/libtorch_cuda.so")));
        assert!(!is_libtorch_cpu(Path::new("/x/libtorch.so")));
    }

    #[test]
    fn the_demangled_names_are_the_ones_pytorch_2_15_uses() {
        // As read from the 2.15.0 wheel's libtorch_cpu.so (nm), exported and local.
        let enter = "_ZN5torch8autograd8profiler25record_function_enter_newERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEERKSt8optionalIS7_E";
        let exit = "_ZN5torch8autograd8profilerL24record_function_exit_newERKN3c1013intrusive_ptrINS1_20PythonRecordFunctionENS2_6detail34intrusive_target_default_null_typeIS4_EEEE";
        assert_eq!(elf::demangled(enter), ENTER);
        assert_eq!(elf::demangled(exit), EXIT);
        // 2.4.0 and 2.6.0 (manylinux1 wheels, pre-C++11 ABI: `std::string` is `Ss`).
        let old = "_ZN5torch8autograd8profiler25record_function_enter_newERKSsRKSt8optionalISsE";
        assert_eq!(elf::demangled(old), ENTER);
    }

    #[test]
    fn the_exit_probe_moves_to_the_jmp_only_on_the_known_body() {
        // PyTorch 2.15.0's record_function_exit_new, as objdump shows it.
        let body = [0x48, 0x8b, 0x3f, 0x48, 0x83, 0xc7, 0x10, 0xe9, 0xe4, 0xf5, 0x17, 0xfb, 0x0f, 0x1f, 0x40, 0x00];
        assert_eq!(exit_jump(&body), Some(ExitJump { offset: 7, displacement: 0x10 }));
        let mut other = body;
        other[6] = 0x18;
        assert_eq!(exit_jump(&other), Some(ExitJump { offset: 7, displacement: 0x18 }));
        // A negative displacement, another register, a call instead of the
        // jmp, or too few bytes: the entry.
        for (at, byte) in [(6, 0xf0), (2, 0x3e), (5, 0xc6), (7, 0xe8)] {
            let mut b = body;
            b[at] = byte;
            assert_eq!(exit_jump(&b), None, "byte {at} = {byte:#x}");
        }
        assert_eq!(exit_jump(&body[..7]), None);
        // A usual prologue.
        assert_eq!(exit_jump(&[0x55, 0x48, 0x89, 0xe5, 0x53, 0x48, 0x83, 0xec, 0x08]), None);
    }

    #[test]
    fn a_file_that_is_not_elf_says_so() {
        assert!(resolve(b"not an elf").is_err());
    }
}
