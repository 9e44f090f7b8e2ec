//! The frame hook's guard: an entry probe on the one instruction of
//! `_PyInterpreterState_SetEvalFrameFunc` that stores into
//! `PyInterpreterState.eval_frame`. CPython 3.11+ turn a request for
//! `_PyEval_EvalFrameDefault` into NULL there, which lets Python-to-Python
//! calls be inlined again (unseen); `torch.compile` (dynamo) makes that request
//! after every compiled call. While armed, the probe changes the register
//! being stored from NULL to `&_PyEval_EvalFrameDefault`, which CPython
//! treats exactly as its default: the field keeps the hook with no window.
//!
//! Writing a uprobe's registers needs Linux 6.17+ ("bpf: Allow uprobe program
//! to change context registers"); older kernels refuse to load this program
//! and user space falls back to re-writing the field when it finds it NULL.
//! Stores of any other value (dynamo's own shim) pass untouched.

use aya_ebpf::{
    bindings::pt_regs,
    macros::{map, uprobe},
    maps::Array,
    programs::ProbeContext,
};
use profiler_common::FrameGuard;

use crate::target_tid;

/// What is guarded, and whether the guard is armed (one entry, set by user space).
#[map]
static FRAME_GUARD: Array<FrameGuard> = Array::with_max_entries(1, 0);

/// Stores of NULL turned into the hook.
#[map]
static FRAME_GUARD_HITS: Array<u64> = Array::with_max_entries(1, 0);

/// The general registers in `pt_regs` order, read at constant context
/// offsets: the verifier refuses a context pointer moved by a variable (or
/// by a branch-chosen constant the compiler folds into one load).
#[inline(always)]
fn general(regs: &pt_regs) -> [u64; 15] {
    [
        regs.r15, regs.r14, regs.r13, regs.r12, regs.rbp, regs.rbx, regs.r11, regs.r10, regs.r9, regs.r8, regs.rax,
        regs.rcx, regs.rdx, regs.rsi, regs.rdi,
    ]
}

/// Writes every general register back, `value` into `slot` and each other
/// one unchanged: straight-line stores at constant offsets, for the reason above.
#[inline(always)]
fn put(regs: &mut pt_regs, old: &[u64; 15], slot: u32, value: u64) {
    macro_rules! put {
        ($field:ident, $i:literal) => {
            // SAFETY: a field of the saved registers; volatile keeps each store at its own offset.
            unsafe { core::ptr::write_volatile(&mut regs.$field, if slot == $i { value } else { old[$i] }) };
        };
    }
    put!(r15, 0);
    put!(r14, 1);
    put!(r13, 2);
    put!(r12, 3);
    put!(rbp, 4);
    put!(rbx, 5);
    put!(r11, 6);
    put!(r10, 7);
    put!(r9, 8);
    put!(r8, 9);
    put!(rax, 10);
    put!(rcx, 11);
    put!(rdx, 12);
    put!(rsi, 13);
    put!(rdi, 14);
}

/// At `mov [base+eval_frame], value`: NULL into the guarded interpreter
/// becomes the hook. The kernel then executes the store with the changed register.
#[uprobe]
pub fn frame_guard(ctx: ProbeContext) -> u32 {
    if target_tid().is_none() {
        return 0;
    }
    let Some(guard) = FRAME_GUARD.get(0).copied() else { return 0 };
    if guard.armed == 0 {
        return 0;
    }
    // SAFETY: `ctx.regs` is the probed task's saved user registers, writable
    // from a uprobe program (Linux 6.17+).
    let regs = unsafe { &mut *ctx.regs };
    let old = general(regs);
    let (base, value) = (guard.base_slot as usize, guard.value_slot as usize);
    if base >= old.len() || value >= old.len() || old[base] != guard.interp || old[value] != 0 {
        return 0;
    }
    put(regs, &old, guard.value_slot, guard.value);
    if let Some(hits) = FRAME_GUARD_HITS.get_ptr_mut(0) {
        // SAFETY: an array slot; concurrent stores are serialised by CPython
        // (the GIL, or the stop-the-world around the store on 3.13+).
        unsafe { *hits += 1 };
    }
    0
}
