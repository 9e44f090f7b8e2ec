//! Python step functions through the PEP 523 frame hook, for CPythons without
//! USDT probes: an entry probe and a return probe on the exported
//! `_PyEval_EvalFrameDefault(tstate, frame, throwflag)`, which every Python
//! call reaches while `PyInterpreterState.eval_frame` is set (user space
//! writes it on 3.11+; 3.10 calls through it anyway).
//!
//! Every Python call runs the entry program, so the no-match path is the hot
//! one: three dependent user reads (frame → code → name) and the same 8-byte
//! name screen as the USDT path ([`crate::python::matching_label`]). The
//! return program runs for every call too (a uretprobe cannot be armed for
//! some calls only): one hash lookup keyed by the stack pointer, which finds
//! the step calls the entry program recorded.

use aya_ebpf::{
    helpers::bpf_probe_read_user,
    macros::{map, uprobe, uretprobe},
    maps::{Array, LruHashMap},
    programs::{ProbeContext, RetProbeContext},
};
use profiler_common::{FRAME_STEPS_MAX, FrameLayout, FrameStep, RecordKind};

use crate::{emit_ordered, python::matching_label, target_tid};

/// The target CPython's offsets (one entry, filled before the probes go in).
#[map]
static FRAME_LAYOUT: Array<FrameLayout> = Array::with_max_entries(1, 0);

/// Step calls open now, by the stack pointer at their entry. LRU: an entry
/// whose return never came (its thread killed mid-call, or the uretprobe
/// dropped past the kernel's nesting limit) ages out instead of filling the map.
#[map]
static FRAME_STEPS: LruHashMap<u64, FrameStep> = LruHashMap::with_max_entries(FRAME_STEPS_MAX, 0);

/// Reads a `T` of the target at `addr`.
#[inline(always)]
fn read<T>(addr: u64) -> Option<T> {
    // SAFETY: bpf_probe_read_user tolerates any address.
    unsafe { bpf_probe_read_user(addr as *const T) }.ok()
}

/// The label of the step function `frame` runs, if it runs one.
#[inline(always)]
fn frame_label(frame: u64) -> Option<u32> {
    let layout = FRAME_LAYOUT.get(0)?;
    let code = read::<u64>(frame.wrapping_add(u64::from(layout.code)))? & layout.code_mask;
    // Each resume of a generator or coroutine enters the function again.
    let flags = read::<u32>(code.wrapping_add(u64::from(layout.co_flags)))?;
    if flags & layout.skip_flags != 0 {
        return None;
    }
    let name = read::<u64>(code.wrapping_add(u64::from(layout.co_name)))?;
    let data = u64::from(layout.ascii_data);
    matching_label(name.wrapping_add(data), || {
        read::<u64>(code.wrapping_add(u64::from(layout.co_filename))).map(|f| f.wrapping_add(data))
    })
}

/// Entry of `_PyEval_EvalFrameDefault`, placed where the stack pointer still
/// points at the return address (the function's first instruction, or the
/// one after its `endbr64`).
#[uprobe]
pub fn frame_enter(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let Some(frame) = ctx.arg::<u64>(1) else { return 0 };
    let Some(label_id) = frame_label(frame) else { return 0 };
    // SAFETY: `ctx.regs` is the probed task's saved registers.
    let sp = unsafe { (*ctx.regs).rsp };
    if FRAME_STEPS.insert(sp, FrameStep { tid, label_id }, 0).is_ok() {
        emit_ordered(tid, RecordKind::StepEnter, label_id);
    }
    0
}

/// Return of `_PyEval_EvalFrameDefault`, normal or by exception: the `ret`
/// popped the return address, so the entry's stack pointer is 8 below.
#[uretprobe]
pub fn frame_exit(ctx: RetProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    // SAFETY: as above.
    let sp = unsafe { (*ctx.regs).rsp }.wrapping_sub(8);
    // SAFETY: a copy out of the map value, which only this thread's calls write.
    let Some(step) = (unsafe { FRAME_STEPS.get(sp) }).copied() else { return 0 };
    if step.tid != tid {
        return 0;
    }
    let _ = FRAME_STEPS.remove(sp);
    emit_ordered(tid, RecordKind::StepExit, step.label_id);
    0
}
