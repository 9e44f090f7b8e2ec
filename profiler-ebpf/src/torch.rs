//! PyTorch `record_function` regions: probes on libtorch_cpu's
//! `torch::autograd::profiler::record_function_enter_new` (and its return)
//! and `record_function_exit_new`, which every `record_function` — the
//! optimizer's step, the DataLoader's `__next__`, a user's region — goes
//! through, on every Python. A few hits per training step, so each can
//! afford a uretprobe and a name copy.
//!
//! x86-64, checked in the 2.15.0 wheel: the enter returns its
//! `intrusive_ptr<PythonRecordFunction>` through a hidden pointer in `rdi`,
//! so the name's `std::string const&` is in `rsi` (characters pointer at +0,
//! length at +8; the short-string case points into the string itself, so
//! one read serves both; builds with the pre-C++11 ABI — PyPI's before 2.7 —
//! keep the length 24 bytes before the characters, said by the cookie). The `PythonRecordFunction*` it stores through the
//! hidden pointer is only there on return: the entry keeps the name and the
//! hidden pointer per thread (`TORCH_PENDING`), the return reads the pointer
//! and writes the record. The exit's `rdi` points at the `intrusive_ptr`,
//! whose first word is that same `PythonRecordFunction*`: the key that pairs
//! an end with its begin in user space.
//!
//! The records go to the ordered ring with the thread's sequence (they make
//! steps, so launches must not crowd them out, and a gap must show).
use aya_ebpf::{
    helpers::{bpf_probe_read_user, bpf_probe_read_user_buf},
    macros::{map, uprobe, uretprobe},
    maps::{HashMap, PerCpuArray},
    programs::{ProbeContext, RetProbeContext},
};
use profiler_common::{REGION_NAME_CAP, RecordKind, RegionRecord, SchedTimes, torch_programs};

use crate::{LOST_ORDERED, ORDERED_EVENTS, bump, cookie, header, map_failed, ordered_state, submit_flags, target_tid};

/// The entry's half of a `RegionEnter`, per thread, until the function
/// returns (`key` holds the hidden return pointer until then). The function
/// does not re-enter itself, so one per thread is enough.
#[map]
static TORCH_PENDING: HashMap<u32, RegionRecord> = HashMap::with_max_entries(4096, 0);

/// Where the entry builds its record: 176 bytes are a third of the BPF stack.
#[map]
static TORCH_SCRATCH: PerCpuArray<RegionRecord> = PerCpuArray::with_max_entries(1, 0);

/// A thread exits: its pending entry (a return never seen) goes with it.
#[inline(always)]
pub(crate) fn forget_thread(tid: u32) {
    let _ = TORCH_PENDING.remove(tid);
}

/// `record_function_enter_new(std::string const& name, std::optional<std::string> const& args)`,
/// returning `intrusive_ptr<PythonRecordFunction>` through `rdi`.
#[uprobe]
pub fn torch_region_enter(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let (Some(ret_slot), Some(name)) = (ctx.arg::<u64>(0), ctx.arg::<u64>(1)) else { return 0 };
    let Some(rec) = TORCH_SCRATCH.get_ptr_mut(0) else { return 0 };
    // SAFETY: the per-CPU value, ours for the program's run.
    let rec = unsafe { &mut *rec };
    rec.header = header(RecordKind::RegionEnter, tid);
    rec.key = ret_slot;
    rec.name = [0; REGION_NAME_CAP];
    // SAFETY: bpf_probe_read_user tolerates any address.
    let data = unsafe { bpf_probe_read_user(name as *const u64) }.unwrap_or(0);
    // The length: next to the pointer (C++11 ABI), or in the copy-on-write
    // header just before the characters (the old ABI; see ENTER_COW_STRING).
    let len_at = if cookie(&ctx) == torch_programs::ENTER_COW_STRING { data.wrapping_sub(24) } else { name + 8 };
    // SAFETY: as above.
    let len = unsafe { bpf_probe_read_user(len_at as *const u64) }.unwrap_or(0);
    rec.name_len = len.min(u64::from(u32::MAX)) as u32;
    let n = (len as usize).min(REGION_NAME_CAP);
    if let Some(dst) = rec.name.get_mut(..n)
        // SAFETY: the helper writes at most `n` bytes into the value.
        && unsafe { bpf_probe_read_user_buf(data as *const u8, dst) }.is_err()
    {
        rec.name_len = 0;
    }
    if TORCH_PENDING.insert(tid, rec, 0).is_err() {
        map_failed();
    }
    0
}

/// The return of `record_function_enter_new`: the key is in place now.
#[uretprobe]
pub fn torch_region_enter_return(_ctx: RetProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let Some(pending) = TORCH_PENDING.get_ptr_mut(tid) else { return 0 };
    // SAFETY: a valid map value; only this thread uses its entry.
    let mut rec = unsafe { *pending };
    let _ = TORCH_PENDING.remove(tid);
    // SAFETY: bpf_probe_read_user tolerates any address.
    rec.key = unsafe { bpf_probe_read_user(rec.key as *const u64) }.unwrap_or(0);
    submit(rec);
    0
}

/// `record_function_exit_new(intrusive_ptr<PythonRecordFunction> const&)`:
/// at its entry (cookie 0) or, where the agent found PyTorch 2.15's body
/// `mov (%rdi),%rdi; add $d,%rdi; jmp RecordFunction::end`, on the `jmp`
/// (cookie `EXIT_KEY_IN_RDI | d`): the kernel emulates a `jmp` but
/// single-steps the `mov`, ≈4 µs more per region.
#[uprobe]
pub fn torch_region_exit(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let Some(rdi) = ctx.arg::<u64>(0) else { return 0 };
    let how = cookie(&ctx);
    let key = if how & torch_programs::EXIT_KEY_IN_RDI != 0 {
        rdi.wrapping_sub(how & u64::from(u32::MAX))
    } else {
        // SAFETY: bpf_probe_read_user tolerates any address.
        unsafe { bpf_probe_read_user(rdi as *const u64) }.unwrap_or(0)
    };
    submit(RegionRecord {
        header: header(RecordKind::RegionExit, tid),
        seq: 0,
        depth: 0,
        key,
        thread_launches: 0,
        name_len: 0,
        _pad: 0,
        sched: SchedTimes { cpu_ns: 0, runnable_ns: 0, sleep_ns: 0, blocked_ns: 0, process_cpu_ns: 0 },
        name: [0; REGION_NAME_CAP],
    });
    0
}

/// Writes the record to the ordered ring with the thread's sequence, depth and launch count.
#[inline(always)]
fn submit(mut rec: RegionRecord) {
    let kind = if rec.header.kind == RecordKind::RegionEnter as u32 {
        RecordKind::RegionEnter
    } else {
        RecordKind::RegionExit
    };
    let o = ordered_state(rec.header.tid, kind);
    (rec.seq, rec.depth, rec.thread_launches, rec.sched, rec.header.ts_ns) =
        (o.seq, o.depth, o.launches, o.sched, o.ts_ns);
    match ORDERED_EVENTS.reserve::<RegionRecord>(0) {
        Some(mut entry) => {
            entry.write(rec);
            entry.submit(submit_flags());
        }
        None => bump(&LOST_ORDERED),
    }
}
