//! Python step functions: CPython's USDT probes `python:function__entry` and
//! `python:function__return` (arguments: file name, function name, line),
//! filtered in the kernel by function name (and file suffix) against the
//! `PY_TARGETS` map, so that only the step functions' calls reach user space.
//!
//! With the USDT semaphore set, CPython fires these probes on every Python
//! call, so the no-match path is the hot one: one map lookup for the argument
//! specs, an 8-byte read of the function name's start compared with each
//! target's, and only on a possible match the whole name. The file name is
//! only read once a function name matched a target that names a file.
//!
//! The programs are attached by user space through the uprobe PMU (perf
//! event + BPF link with a cookie), not by aya: CPython's probes need the
//! kernel to raise their semaphores (`ref_ctr_offset`), which aya 0.14 cannot
//! ask for. Any provider whose probe passes (file name, function name) as its
//! first two arguments can be served the same way.
//!
//! Where the arguments live is not hard-wired (CPython 3.11 on Debian passes
//! them in %rbp and %r12, another build may not): user space decodes the
//! note's argument string into `USDT_ARGS`, indexed by the attach cookie.

use aya_ebpf::{
    EbpfContext,
    helpers::{bpf_probe_read_kernel, bpf_probe_read_user, generated::bpf_probe_read_user_str},
    macros::{map, uprobe},
    maps::{Array, PerCpuArray},
    programs::ProbeContext,
};
use profiler_common::{
    PY_MAX_TARGETS, PY_NAME_CAP, PyTarget, RecordKind, USDT_MAX_SPECS, USDT_NO_REG, UsdtArgKind, UsdtArgSpec,
    UsdtProbeSpec,
};

use crate::{cookie, emit_ordered, target_tid};

/// Argument specs of each attached USDT probe site, indexed by the attach cookie.
#[map]
static USDT_ARGS: Array<UsdtProbeSpec> = Array::with_max_entries(USDT_MAX_SPECS, 0);

/// The Python functions whose calls are steps (`name_len == 0`: unused slot).
#[map]
static PY_TARGETS: Array<PyTarget> = Array::with_max_entries(PY_MAX_TARGETS, 0);

/// Room for a code object's file name: PATH_MAX bytes do not fit the 512-byte
/// BPF stack, so it lives in a per-CPU map value (programs do not migrate).
const FILE_CAP: usize = 4096;

#[repr(C)]
struct FileName {
    bytes: [u8; FILE_CAP],
}

#[map]
static PY_FILE_NAME: PerCpuArray<FileName> = PerCpuArray::with_max_entries(1, 0);

/// The function name as read: eight bytes more than a target can hold, so
/// that a longer name reads longer than any target and can never match a
/// target it merely starts with.
const NAME_BUF: usize = PY_NAME_CAP + 8;

#[repr(C, align(8))]
struct NameBuf {
    bytes: [u8; NAME_BUF],
}

/// Size of the x86-64 `struct pt_regs`.
const PT_REGS_SIZE: u32 = 168;

/// Reads the 8 bytes of `pt_regs` at `offset`. The verifier rejects context
/// accesses at offsets it cannot prove constant, and this offset comes from a
/// map, so the context is read through bpf_probe_read_kernel instead (it is
/// kernel memory: the traced task's saved registers).
#[inline(always)]
fn read_reg(ctx: &ProbeContext, offset: u32) -> Option<u64> {
    if offset > PT_REGS_SIZE - 8 {
        return None;
    }
    let p = (ctx.as_ptr() as *const u8).wrapping_add(offset as usize) as *const u64;
    // SAFETY: bpf_probe_read_kernel tolerates any address; this one is inside pt_regs.
    unsafe { bpf_probe_read_kernel(p) }.ok()
}

/// Reads exactly `size` bytes of user memory: a wider read could fault at the
/// end of a mapping where the narrow one would not.
#[inline(always)]
fn read_user_sized(addr: u64, size: u32) -> Option<u64> {
    // SAFETY: bpf_probe_read_user tolerates any address.
    unsafe {
        match size {
            1 => bpf_probe_read_user(addr as *const u8).ok().map(u64::from),
            2 => bpf_probe_read_user(addr as *const u16).ok().map(u64::from),
            4 => bpf_probe_read_user(addr as *const u32).ok().map(u64::from),
            _ => bpf_probe_read_user(addr as *const u64).ok(),
        }
    }
}

/// The value of one USDT argument, sign- or zero-extended from its size.
#[inline(always)]
fn usdt_arg(ctx: &ProbeContext, spec: &UsdtArgSpec) -> Option<u64> {
    let raw = if spec.kind == UsdtArgKind::Constant as u32 {
        spec.displacement as u64
    } else if spec.kind == UsdtArgKind::Register as u32 {
        // The displacement is 0 for a plain register; a resolved `$symbol`
        // is %rip plus the symbol's distance from the probe.
        read_reg(ctx, spec.reg_offset)?.wrapping_add(spec.displacement as u64)
    } else if spec.kind == UsdtArgKind::Memory as u32 {
        let mut addr = spec.displacement as u64;
        if spec.reg_offset != USDT_NO_REG {
            addr = addr.wrapping_add(read_reg(ctx, spec.reg_offset)?);
        }
        if spec.index_offset != USDT_NO_REG {
            addr = addr.wrapping_add(read_reg(ctx, spec.index_offset)?.wrapping_mul(u64::from(spec.scale)));
        }
        read_user_sized(addr, spec.size)?
    } else {
        return None;
    };
    let shift = match spec.size {
        1 => 56,
        2 => 48,
        4 => 32,
        _ => 0,
    };
    Some(if spec.signed != 0 { (((raw << shift) as i64) >> shift) as u64 } else { (raw << shift) >> shift })
}

/// Whether the first `PY_NAME_CAP` bytes of two zero-padded names are equal,
/// compared as eight aligned u64 words (64 byte compares would cost the
/// verifier and the hot path eight times as many instructions).
#[inline(always)]
fn same_name(read: &NameBuf, target: &[u8; PY_NAME_CAP]) -> bool {
    let a = read.bytes.as_ptr() as *const u64;
    let b = target.as_ptr() as *const u64;
    let mut i = 0;
    while i < PY_NAME_CAP / 8 {
        // SAFETY: both are 8-aligned (NameBuf and PyTarget are align(8), names
        // at offset 0 / 64) and at least PY_NAME_CAP bytes long.
        if unsafe { a.add(i).read() != b.add(i).read() } {
            return false;
        }
        i += 1;
    }
    true
}

/// Whether some target's name begins like the eight bytes `head` (as read
/// from the name, little-endian): a name shorter than eight bytes must be
/// followed by its NUL, which the zero padding of the target supplies.
#[inline(always)]
fn any_target_starts_with(head: u64) -> bool {
    let mut i = 0;
    while i < PY_MAX_TARGETS {
        let Some(t) = PY_TARGETS.get(i) else { return false };
        i += 1;
        if t.name_len == 0 {
            continue;
        }
        // SAFETY: PyTarget is align(8) and `name` is its first field.
        let first = unsafe { (t.name.as_ptr() as *const u64).read() };
        let mask = if t.name_len >= 7 { u64::MAX } else { (1u64 << ((t.name_len + 1) * 8)) - 1 };
        if (head ^ first) & mask == 0 {
            return true;
        }
    }
    false
}

/// Whether the file name (`len` bytes, no NUL) ends with the target's suffix
/// at a path boundary: `train.py` matches `/src/train.py` and `train.py`, not
/// `/src/pretrain.py`.
#[inline(always)]
fn file_matches(file: &FileName, len: usize, target: &PyTarget) -> bool {
    let suffix_len = target.suffix_len as usize;
    if suffix_len > PY_NAME_CAP || suffix_len > len {
        return false;
    }
    let start = len - suffix_len;
    // An iterator, not `file_suffix[i]`: LLVM rotates an indexed loop so that
    // a bounds-check panic survives, and the verifier rejects the program for
    // the panic path alone ("last insn is not an exit or jmp").
    for (i, &c) in target.file_suffix.iter().enumerate() {
        if i >= suffix_len {
            break;
        }
        // The mask keeps the index provably in bounds; start + i < len <= FILE_CAP.
        if file.bytes[(start + i) & (FILE_CAP - 1)] != c {
            return false;
        }
    }
    start == 0 || target.file_suffix[0] == b'/' || file.bytes[(start - 1) & (FILE_CAP - 1)] == b'/'
}

/// Reads the NUL-terminated file name at `ptr` into the per-CPU buffer;
/// returns its length without the NUL. A name that fills the buffer was
/// truncated and cannot be compared at its end.
#[inline(always)]
fn read_file_name(ptr: u64) -> Option<(&'static FileName, usize)> {
    let buf = PY_FILE_NAME.get_ptr_mut(0)?;
    // SAFETY: the helper writes at most FILE_CAP bytes into the per-CPU value.
    let n = unsafe { bpf_probe_read_user_str((*buf).bytes.as_mut_ptr().cast(), FILE_CAP as u32, ptr as *const _) };
    if n <= 0 || n as usize >= FILE_CAP {
        return None;
    }
    // SAFETY: per-CPU value, valid for the program's run.
    Some((unsafe { &*buf }, n as usize - 1))
}

/// The label of the first `PY_TARGETS` entry that the function named at
/// `name_ptr` (a NUL-terminated UTF-8 string in the target) matches;
/// `file_ptr` gives the file name's address, asked for only when a target
/// that names a file matched by name. Shared by the USDT probes and the
/// frame hook, which differ only in where they find the two strings.
#[inline(always)]
pub(crate) fn matching_label(name_ptr: u64, file_ptr: impl FnOnce() -> Option<u64>) -> Option<u32> {
    // Most calls are not steps: their first eight bytes already rule out
    // every target, for the cost of a fixed-size read. The read fails when
    // a short name ends just before an unmapped page; the full read decides then.
    // SAFETY: bpf_probe_read_user tolerates any address.
    if let Ok(head) = unsafe { bpf_probe_read_user(name_ptr as *const u64) }
        && !any_target_starts_with(head)
    {
        return None;
    }
    let mut name = NameBuf { bytes: [0; NAME_BUF] };
    // SAFETY: the helper writes at most NAME_BUF bytes, NUL included; the
    // rest of the buffer stays zero, as the word compare needs.
    let n = unsafe { bpf_probe_read_user_str(name.bytes.as_mut_ptr().cast(), NAME_BUF as u32, name_ptr as *const _) };
    if n <= 1 {
        return None;
    }
    let name_len = (n - 1) as u32;
    let mut file_ptr = Some(file_ptr);
    let mut file: Option<(&FileName, usize)> = None;
    let mut i = 0;
    while i < PY_MAX_TARGETS {
        let target = PY_TARGETS.get(i)?;
        i += 1;
        if target.name_len == 0 || target.name_len != name_len || !same_name(&name, &target.name) {
            continue;
        }
        if target.suffix_len != 0 {
            if let Some(f) = file_ptr.take() {
                file = f().and_then(read_file_name);
            }
            match file {
                Some((f, len)) if file_matches(f, len, target) => {}
                _ => continue,
            }
        }
        return Some(target.label_id);
    }
    None
}

#[inline(always)]
fn python_step(ctx: &ProbeContext, kind: RecordKind) {
    let Some(tid) = target_tid() else { return };
    let slot = cookie(ctx) as u32;
    let Some(spec) = USDT_ARGS.get(slot) else { return };
    let Some(name_ptr) = usdt_arg(ctx, &spec.args[1]) else { return };
    if let Some(label) = matching_label(name_ptr, || usdt_arg(ctx, &spec.args[0])) {
        emit_ordered(tid, kind, label);
    }
}

/// `python:function__entry(const char *filename, const char *funcname, int lineno)`.
#[uprobe]
pub fn python_entry(ctx: ProbeContext) -> u32 {
    python_step(&ctx, RecordKind::StepEnter);
    0
}

/// `python:function__return(const char *filename, const char *funcname, int lineno)`.
/// Fires where the frame is left, generators' yields included, so entries and
/// returns pair up on each thread.
#[uprobe]
pub fn python_return(ctx: ProbeContext) -> u32 {
    python_step(&ctx, RecordKind::StepExit);
    0
}
