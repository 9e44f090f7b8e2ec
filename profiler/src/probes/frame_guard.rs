//! The frame hook's guard in user space: finding CPython's one store into
//! `PyInterpreterState.eval_frame` (in `_PyInterpreterState_SetEvalFrameFunc`),
//! attaching the `frame_guard` program there, arming it for the target's
//! interpreter once that is found, disarming it before the hook is taken back.
//!
//! Why the store and not the call: dynamo (`torch.compile`) asks for
//! `_PyEval_EvalFrameDefault` in two states of the field. After a compiled
//! call the field holds dynamo's own shim and dynamo puts back what it found
//! (our value), which 3.11+ turn into NULL; skipping the call there would leave
//! the shim installed for good. Changing the stored register from NULL to our
//! value covers both that and a plain reset, and every build read here has the
//! one `mov [interp+eval_frame], reg` (pyenv 3.11–3.13, Debian 3.13/3.14).
use iced_x86::{Code, Decoder, DecoderOptions, Instruction, InstructionInfoFactory, OpAccess, Register};
use object::{Object, ObjectSymbol};
use profiler_common::{FrameGuard, maps as map_names, pt_regs_slot};

use aya::maps::{Array, MapData};

use super::frame_hook::HookSite;

const SET_EVAL_FRAME_FUNC: &str = "_PyInterpreterState_SetEvalFrameFunc";

/// The store into `eval_frame` in one CPython file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreSite {
    /// File offset of the store instruction (the probe goes there).
    pub file_offset: u64,
    /// Offset of the store from the function's start.
    pub within: u64,
    /// `(base, value)` register names, as `pt_regs` calls them.
    pub base: &'static str,
    pub value: &'static str,
}

impl std::fmt::Display for StoreSite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{SET_EVAL_FRAME_FUNC}+{:#x} (file offset {:#x}: store of {} into [{}+eval_frame])",
            self.within, self.file_offset, self.value, self.base
        )
    }
}

/// Finds the store of a register into `[reg + eval_frame]` in
/// `_PyInterpreterState_SetEvalFrameFunc` of the CPython file `data`; an
/// error says why there is none to guard (then the watcher alone keeps the hook).
pub fn find_store(data: &[u8], eval_frame: u64) -> Result<StoreSite, String> {
    let file = object::File::parse(data).map_err(|_| "not an ELF file".to_string())?;
    let function = file
        .dynamic_symbols()
        .chain(file.symbols())
        .find(|s| s.name() == Ok(SET_EVAL_FRAME_FUNC) && s.section_index().is_some() && s.size() > 0)
        .ok_or_else(|| format!("no exported {SET_EVAL_FRAME_FUNC} with a size"))?;
    let (address, size) = (function.address(), function.size());
    let code =
        super::cpython::bytes_at(&file, address, size).ok_or_else(|| format!("{SET_EVAL_FRAME_FUNC}: no bytes"))?;
    let mut info = InstructionInfoFactory::new();
    // Any write into the field counts (a `mov qword [..], 0` could not be guarded); reads (`cmp`) do not.
    let writes_field = |i: &Instruction, info: &mut InstructionInfoFactory| {
        info.info(i).used_memory().iter().any(|m| {
            m.displacement() == eval_frame
                && m.index() == Register::None
                && matches!(
                    m.access(),
                    OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
                )
        })
    };
    let stores: Vec<Instruction> = Decoder::with_ip(64, code, address, DecoderOptions::NONE)
        .into_iter()
        .filter(|i| writes_field(i, &mut info))
        .collect();
    let [store] = stores.as_slice() else {
        return Err(format!("{SET_EVAL_FRAME_FUNC}: {} stores into eval_frame, not one", stores.len()));
    };
    if store.code() != Code::Mov_rm64_r64 {
        return Err(format!("{SET_EVAL_FRAME_FUNC}: its store into eval_frame is not `mov [reg+disp], reg`"));
    }
    let name = |r: Register| register_name(r).ok_or_else(|| format!("{SET_EVAL_FRAME_FUNC}: register {r:?}"));
    let file_offset = super::cpython::file_offset(&file, store.ip())
        .ok_or_else(|| format!("{SET_EVAL_FRAME_FUNC}: the store is outside the loadable segments"))?;
    Ok(StoreSite {
        file_offset,
        within: store.ip() - address,
        base: name(store.memory_base())?,
        value: name(store.op1_register())?,
    })
}

/// The `pt_regs` name of a 64-bit general register (not rsp: never a store's source here).
fn register_name(r: Register) -> Option<&'static str> {
    Some(match r {
        Register::RAX => "rax",
        Register::RBX => "rbx",
        Register::RCX => "rcx",
        Register::RDX => "rdx",
        Register::RSI => "rsi",
        Register::RDI => "rdi",
        Register::RBP => "rbp",
        Register::R8 => "r8",
        Register::R9 => "r9",
        Register::R10 => "r10",
        Register::R11 => "r11",
        Register::R12 => "r12",
        Register::R13 => "r13",
        Register::R14 => "r14",
        Register::R15 => "r15",
        _ => return None,
    })
}

/// The guard's maps, taken out of the loaded object once its program is attached.
pub struct Guard {
    config: Array<MapData, FrameGuard>,
    hits: Array<MapData, u64>,
    store: StoreSite,
    /// `offsetof(PyInterpreterState, eval_frame)`: the interpreter is the field less it.
    eval_frame: u64,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard").field("store", &self.store).finish_non_exhaustive()
    }
}

impl Guard {
    /// Takes the `FRAME_GUARD` maps out of `ebpf` (its `frame_guard` program attached already).
    pub fn take(ebpf: &mut aya::Ebpf, store: StoreSite, eval_frame: u64) -> Result<Self, String> {
        let mut take = |name: &'static str| ebpf.take_map(name).ok_or_else(|| format!("no map {name}"));
        let (config, hits) = (take(map_names::FRAME_GUARD)?, take(map_names::FRAME_GUARD_HITS)?);
        Ok(Self {
            config: Array::try_from(config).map_err(|e| e.to_string())?,
            hits: Array::try_from(hits).map_err(|e| e.to_string())?,
            store,
            eval_frame,
        })
    }

    /// Arms the guard for the interpreter whose field is `site`.
    pub fn arm(&mut self, site: &HookSite) -> Result<(), String> {
        self.set(site, 1)
    }

    /// Disarms it: from here on a NULL stored stays NULL.
    pub fn disarm(&mut self, site: &HookSite) -> Result<(), String> {
        self.set(site, 0)
    }

    fn set(&mut self, site: &HookSite, armed: u32) -> Result<(), String> {
        let slot = |n: &str| pt_regs_slot(n).ok_or_else(|| format!("register {n}"));
        let value = FrameGuard {
            interp: site.field - self.eval_frame,
            value: site.value,
            base_slot: slot(self.store.base)?,
            value_slot: slot(self.store.value)?,
            armed,
            _pad: 0,
        };
        self.config.set(0, value, 0).map_err(|e| e.to_string())
    }

    /// Stores of NULL turned into the hook so far.
    pub fn hits(&self) -> u64 {
        self.hits.get(&0, 0).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every CPython 3.11+ on this host has the one store, into the
    /// `eval_frame` offset the frame hook decodes, with its registers as
    /// `gdb -batch -ex 'disassemble _PyInterpreterState_SetEvalFrameFunc'` shows them.
    #[test]
    fn finds_the_one_store_into_eval_frame() {
        let cases = [
            ("/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0", 0xd, "rdi", "rsi"),
            ("/root/.pyenv/versions/3.12.1/lib/libpython3.12.so.1.0", 0xd, "rdi", "rsi"),
            ("/root/.pyenv/versions/3.13.0/lib/libpython3.13.so.1.0", 0x3c, "rbp", "rbx"),
        ];
        for (path, within, base, value) in cases {
            let Ok(data) = std::fs::read(path) else {
                crate::skip_test(format!("{path} not installed"));
                continue;
            };
            let build = crate::probes::cpython::inspect(&data).expect("a CPython");
            let store = find_store(&data, build.eval_frame).expect("the store");
            assert_eq!((store.within, store.base, store.value), (within, base, value), "{path}");
        }
    }
}
