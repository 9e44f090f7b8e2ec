//! Host↔device copies and memsets (`cuMemcpy*`, `cuMemset*`, `cudaMemcpy*`,
//! `cudaMemset*`): the entry probe reads the call's size and direction from
//! its arguments as the attach cookie describes them (`CopyForm`), and keeps
//! them per thread; the return probe writes one `CopyRecord` with the host
//! time in the call. A few calls per step, so each can afford a uretprobe.
//!
//! A runtime copy reaches the driver's exported entry point, as launches do:
//! only the outermost probed call on a thread counts. An entry whose stack
//! pointer is at or below the pending call's is nested in it (at: a tail
//! call, which jumps to the driver with the runtime's frame) and ignored; one
//! above it means the pending call's return was never seen (it is replaced).
//! A return above the pending entry's stack pointer is the outermost call's
//! (after a tail call both return probes fire there: the first writes it).
use aya_ebpf::{
    helpers::{bpf_ktime_get_ns, bpf_probe_read_user},
    macros::{map, uprobe, uretprobe},
    maps::HashMap,
    programs::{ProbeContext, RetProbeContext},
};
use profiler_common::{
    RecordKind,
    copies::{ARG_NONE, ARG_STACK0, CopyForm, CopyLayout, CopyRecord, NO_KIND, layout_offsets as at},
};

use crate::{
    LOST_ORDERED, ORDERED_EVENTS, bump, cookie, entry_sp, map_failed, ordered_state, submit_flags, target_tid,
};

/// A call in progress: its record, and its entry's stack pointer.
#[repr(C)]
#[derive(Clone, Copy)]
struct PendingCopy {
    sp: u64,
    record: CopyRecord,
}

#[map]
static COPY_PENDING: HashMap<u32, PendingCopy> = HashMap::with_max_entries(4096, 0);

/// A thread exits: its pending call (a return never seen) goes with it.
#[inline(always)]
pub(crate) fn forget_thread(tid: u32) {
    let _ = COPY_PENDING.remove(tid);
}

#[inline(always)]
fn user_u64(at: u64) -> u64 {
    // SAFETY: bpf_probe_read_user tolerates any address.
    unsafe { bpf_probe_read_user(at as *const u64) }.unwrap_or(0)
}

#[inline(always)]
fn user_u32(at: u64) -> u32 {
    // SAFETY: as above.
    unsafe { bpf_probe_read_user(at as *const u32) }.unwrap_or(0)
}

/// Argument `n` of the call (a register, or the first stack word), 0 for none.
#[inline(always)]
fn arg(r: &[u64; 6], stack0: u64, n: u8) -> u64 {
    if n == ARG_STACK0 {
        stack0
    } else if (n as usize) < r.len() {
        r[n as usize]
    } else {
        0
    }
}

/// Bytes and kind of a call whose first argument is a descriptor struct.
#[inline(always)]
fn described(layout: CopyLayout, desc: u64) -> (u64, u32) {
    match layout {
        CopyLayout::Driver2D => {
            let bytes = user_u64(desc + at::DRIVER_2D_WIDTH).wrapping_mul(user_u64(desc + at::DRIVER_2D_WIDTH + 8));
            let kind = user_u32(desc + at::DRIVER_2D_SRC_TYPE) | user_u32(desc + at::DRIVER_2D_DST_TYPE) << 8;
            (bytes, kind)
        }
        CopyLayout::Driver3D => {
            let w = at::DRIVER_3D_WIDTH;
            let bytes = user_u64(desc + w).wrapping_mul(user_u64(desc + w + 8)).wrapping_mul(user_u64(desc + w + 16));
            let kind = user_u32(desc + at::DRIVER_3D_SRC_TYPE) | user_u32(desc + at::DRIVER_3D_DST_TYPE) << 8;
            (bytes, kind)
        }
        CopyLayout::Runtime3D => {
            let e = at::RUNTIME_3D_EXTENT;
            let bytes = user_u64(desc + e).wrapping_mul(user_u64(desc + e + 8)).wrapping_mul(user_u64(desc + e + 16));
            (bytes, user_u32(desc + at::RUNTIME_3D_KIND))
        }
        CopyLayout::None => (0, NO_KIND),
    }
}

/// Entry of a copy or memset (cookie: its `CopyForm`).
#[uprobe]
pub fn copy_enter(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let sp = entry_sp(&ctx, 0);
    // SAFETY: a lookup whose value is read at once.
    if let Some(p) = unsafe { COPY_PENDING.get(tid) }
        && sp <= p.sp
    {
        return 0; // nested in a probed call (a runtime copy reaching the driver)
    }
    let (entry, form) = CopyForm::of_cookie(cookie(&ctx));
    let r = crate::int_args(&ctx);
    let stack0 = if form.kind == ARG_STACK0 { user_u64(sp + 8) } else { 0 };
    let (bytes, kind) = if form.layout == CopyLayout::None {
        let count = arg(&r, stack0, form.count) << (form.elem_shift & 7);
        let rows = if form.height == ARG_NONE { 1 } else { arg(&r, stack0, form.height) };
        let kind = if form.kind == ARG_NONE { NO_KIND } else { arg(&r, stack0, form.kind) as u32 };
        (count.wrapping_mul(rows), kind)
    } else {
        described(form.layout, r[0])
    };
    let record = CopyRecord {
        header: crate::header(RecordKind::Copy, tid),
        seq: 0,
        depth: 0,
        // SAFETY: a helper without preconditions.
        start_ns: unsafe { bpf_ktime_get_ns() },
        bytes,
        entry: u32::from(entry),
        kind,
        result: 0,
        _pad: 0,
    };
    if COPY_PENDING.insert(tid, PendingCopy { sp, record }, 0).is_err() {
        map_failed();
    }
    0
}

/// Return of a copy or memset: the outermost call's record, with its host time.
#[uretprobe]
pub fn copy_exit(ctx: RetProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    // SAFETY: the value is copied out before the entry is removed.
    let Some(pending) = (unsafe { COPY_PENDING.get(tid) }).copied() else { return 0 };
    // At the return the stack pointer is past the return address: above the
    // entry's for the call itself, below it for a call nested inside.
    // SAFETY: `regs` is the kernel-provided pt_regs of this probe.
    let sp = unsafe { core::ptr::read_volatile(&(*ctx.regs).rsp) };
    if sp <= pending.sp {
        return 0;
    }
    let _ = COPY_PENDING.remove(tid);
    let mut rec = pending.record;
    rec.result = ctx.ret::<u64>() as u32;
    let o = ordered_state(tid, RecordKind::Copy);
    (rec.seq, rec.depth, rec.header.ts_ns) = (o.seq, o.depth, o.ts_ns);
    match ORDERED_EVENTS.reserve::<CopyRecord>(0) {
        Some(mut entry) => {
            entry.write(rec);
            entry.submit(submit_flags());
        }
        None => bump(&LOST_ORDERED),
    }
    0
}
