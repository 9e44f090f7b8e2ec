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

use super::{ProbeError, Probes, elf};

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
}

/// Finds the functions in the library's bytes. Only names that mention
/// `record_function_e` are demangled: libtorch_cpu has hundreds of thousands
/// of symbols, and this runs while the target trains.
pub fn resolve(data: &[u8]) -> Result<TorchSymbols, String> {
    let file = object::File::parse(data).map_err(|e| format!("not a readable ELF file: {e}"))?;
    let segments = elf::load_segments(&file);
    let (mut enter, mut exit) = (None, None);
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
        // The `std::string` overload: older builds also had one taking a tensor.
        let takes_string = name.contains("basic_string");
        if base == ENTER && takes_string && enter.is_none() {
            enter = Some(offset);
        } else if base == EXIT && name.contains("PythonRecordFunction") && exit.is_none() {
            exit = Some(offset);
        }
    }
    let enter = enter.ok_or_else(|| format!("no {ENTER}(std::string const&, …) symbol"))?;
    Ok(TorchSymbols { enter, exit })
}

impl Probes {
    /// Attaches the region programs to one `libtorch_cpu.so` (all or nothing).
    pub fn attach_torch(&mut self, path: &Path, syms: &TorchSymbols) -> Result<u32, ProbeError> {
        let before = self.links.len();
        // Ends first, then the enter's return, then the enter: while a target
        // runs through the attach, a region can only lose its begin (an end
        // with no begin pairs with nothing), never its end (a region open
        // forever would keep its thread inside a DataLoader `__next__` or an
        // optimizer step, and no step would start or end again).
        let mut points: Vec<(&str, u64)> = syms.exit.map(|o| (torch_programs::EXIT, o)).into_iter().collect();
        points.extend([(torch_programs::ENTER_RETURN, syms.enter), (torch_programs::ENTER, syms.enter)]);
        for (program, offset) in &points {
            if let Err(e) = self.attach(program, path, *offset, 0) {
                self.links.truncate(before);
                return Err(e);
            }
        }
        Ok(points.len() as u32)
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
    }

    #[test]
    fn a_file_that_is_not_elf_says_so() {
        assert!(resolve(b"not an elf").is_err());
    }
}
