//! cuBLAS and cuBLASLt calls: the GEMM entry points and the calls that give
//! cuBLASLt's opaque descriptors their shapes. Each writes a `BlasRecord` to
//! the launch ring with its arguments copied raw (registers, the return
//! address and sixteen stack slots in one read); the agent decodes them, and
//! keeps cuBLASLt's descriptors, by call id.
//!
//! A GEMM is counted once: cuBLAS reaches cuBLASLt through `cublasLtMatmul`
//! (checked in the 13.x wheel: one `call`, never a `jmp`, to its PLT entry;
//! its own exports are bound `-Bsymbolic`, so it never calls them through
//! probes). A call whose return address lies in a probed BLAS library's code
//! was made by that library, for a call already recorded: it is dropped. That
//! costs one comparison per mapping, no return probe (a second trap per call).
//!
//! Creates return their handle through the out-pointer in their first
//! argument: the entry keeps the arguments per thread, the return reads the
//! handle and writes the record. Creates are rare next to the work they
//! describe, so the return probe is affordable.
use aya_ebpf::{
    helpers::{bpf_probe_read_user, generated::bpf_probe_read_user as probe_read_user_raw},
    macros::{map, uprobe, uretprobe},
    maps::{HashMap, PerCpuArray},
    programs::{ProbeContext, RetProbeContext},
};
use profiler_common::{BLAS_STACK_ARGS, BlasCall, BlasRecord, CodeRanges, RecordKind};

use crate::{EVENTS, LOST, bump, cookie, map_failed, submit_flags, target_tid};

/// Per traced process (tgid): `[start, end)` of the probed BLAS libraries'
/// code in it, filled by the agent before it probes them; `end` 0 past the
/// last. Per process: each maps the libraries at its own addresses.
#[map]
static BLAS_TEXT: HashMap<u32, CodeRanges> = HashMap::with_max_entries(4096, 0);

/// A create in progress per thread: its record, all but the handle and the
/// status, until it returns (creates do not nest).
#[map]
static BLAS_PENDING: HashMap<u32, BlasRecord> = HashMap::with_max_entries(4096, 0);

/// A thread exits: a create it never returned from goes with it.
#[inline(always)]
pub(crate) fn forget_thread(tid: u32) {
    let _ = BLAS_PENDING.remove(tid);
}

/// A traced process exits or execs: its BLAS code ranges go with its image.
#[inline(always)]
pub(crate) fn forget_process(tgid: u32) {
    let _ = BLAS_TEXT.remove(tgid);
}

/// Whether `address` lies in a probed BLAS library's code in the calling process.
#[inline(always)]
fn in_blas_text(address: u64) -> bool {
    crate::in_code_ranges(&BLAS_TEXT, address)
}

/// Fills `r` from the call's registers and stack; false when the call was
/// made from inside a BLAS library (nested: not to be counted).
#[inline(always)]
fn fill(ctx: &ProbeContext, tid: u32, r: &mut BlasRecord) -> bool {
    let c = cookie(ctx);
    // SAFETY: `regs` is the kernel-provided pt_regs of this probe.
    let sp = unsafe { (*ctx.regs).rsp } + (c >> 32);
    // The return address and the stack arguments, adjacent in the record
    // (asserted in profiler-common), in one read.
    let dst = (&raw mut r.ret).cast::<core::ffi::c_void>();
    let len = (8 * (1 + BLAS_STACK_ARGS)) as u32;
    // SAFETY: `ret` and `stack` are 8 + 128 contiguous bytes of `r`; the
    // helper tolerates any source address and writes at most `len` bytes.
    if unsafe { probe_read_user_raw(dst, len, sp as *const core::ffi::c_void) } != 0 {
        r.ret = 0;
        r.stack = [0; BLAS_STACK_ARGS];
    }
    if in_blas_text(r.ret) {
        return false;
    }
    r.header = crate::header(RecordKind::Blas, tid);
    r.call = c as u32;
    r.status = 0;
    r.args = [arg(ctx, 0), arg(ctx, 1), arg(ctx, 2), arg(ctx, 3), arg(ctx, 4), arg(ctx, 5)];
    r.value = 0;
    true
}

#[inline(always)]
fn arg(ctx: &ProbeContext, n: usize) -> u64 {
    ctx.arg::<u64>(n).unwrap_or(0)
}

/// `min(size, 8)` bytes at `buf`, zero-extended (a set-attribute's value:
/// 4-byte enums and 8-byte counts).
#[inline(always)]
fn attribute_value(buf: u64, size: u64) -> u64 {
    // SAFETY: bpf_probe_read_user tolerates any address.
    unsafe {
        if size >= 8 {
            bpf_probe_read_user(buf as *const u64).unwrap_or(0)
        } else if size >= 4 {
            bpf_probe_read_user(buf as *const u32).map(u64::from).unwrap_or(0)
        } else {
            0
        }
    }
}

/// Entry of a GEMM, `cublasLtMatmul`, a set-attribute or a destroy.
#[uprobe]
pub fn blas_call(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let Some(mut entry) = EVENTS.reserve::<BlasRecord>(0) else {
        bump(&LOST);
        return 0;
    };
    // SAFETY: the reserved record is ours until submitted or discarded.
    let r = unsafe { &mut *entry.as_mut_ptr() };
    if !fill(&ctx, tid, r) {
        entry.discard(0);
        return 0;
    }
    if r.call == BlasCall::LtMatrixLayoutSetAttribute as u32 || r.call == BlasCall::LtMatmulDescSetAttribute as u32 {
        r.value = attribute_value(r.args[2], r.args[3]);
    }
    entry.submit(submit_flags());
    0
}

/// Entry of `cublasLtMatrixLayoutCreate` / `cublasLtMatmulDescCreate`: the
/// record waits for the handle (see the module's docs).
#[uprobe]
pub fn blas_create(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let Some(scratch) = BLAS_SCRATCH.get_ptr_mut(0) else { return 0 };
    // SAFETY: the per-CPU value, ours for the program's run.
    let r = unsafe { &mut *scratch };
    if fill(&ctx, tid, r) && BLAS_PENDING.insert(tid, r, 0).is_err() {
        map_failed();
    }
    0
}

/// Where a create's record is built: 224 bytes are too many for the BPF stack's share.
#[map]
static BLAS_SCRATCH: PerCpuArray<BlasRecord> = PerCpuArray::with_max_entries(1, 0);

/// Return of a create: the handle it wrote through its first argument.
#[uretprobe]
pub fn blas_create_return(ctx: RetProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let Some(pending) = BLAS_PENDING.get_ptr_mut(tid) else { return 0 };
    let Some(mut entry) = EVENTS.reserve::<BlasRecord>(0) else {
        let _ = BLAS_PENDING.remove(tid);
        bump(&LOST);
        return 0;
    };
    // SAFETY: the reserved record is ours until submitted; the pending one is
    // a valid map value only this thread uses, copied before its removal.
    let r = unsafe { &mut *entry.as_mut_ptr() };
    unsafe { *r = *pending };
    let _ = BLAS_PENDING.remove(tid);
    r.status = ctx.ret::<u64>() as u32;
    r.value = if r.status == 0 {
        // SAFETY: bpf_probe_read_user tolerates any address.
        unsafe { bpf_probe_read_user(r.args[0] as *const u64) }.unwrap_or(0)
    } else {
        0
    };
    entry.submit(submit_flags());
    0
}
