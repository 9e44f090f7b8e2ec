//! NCCL calls (`libnccl.so.2`): an entry probe keeps each call's arguments
//! per thread, the return probe writes one `CollectiveRecord` with the host
//! time spent in the call. A handful of calls per step, so each can afford
//! a uretprobe and a map update.
//!
//! x86-64 System V: the first six integer arguments in rdi, rsi, rdx, rcx,
//! r8, r9, the rest on the stack above the return address (`rsp + 8` at the
//! entry, where the probe sits). `ncclAllReduce`/`ncclReduceScatter`
//! (sendbuff, recvbuff, count, datatype, op, comm, stream) and
//! `ncclBroadcast` (…, root, comm, stream) have their stream there;
//! `ncclReduce` (…, op, root, comm, stream) its comm and stream.
//!
//! The records go to the ordered ring with the thread's sequence, like the
//! sync records: a collective belongs to the step its thread is in.
use aya_ebpf::{
    helpers::bpf_ktime_get_ns,
    macros::{map, uprobe, uretprobe},
    maps::HashMap,
    programs::{ProbeContext, RetProbeContext},
};
use profiler_common::{CollectiveOp, CollectiveRecord, NO_PEER, RecordKind};

use crate::{
    LOST_ORDERED, ORDERED_EVENTS, bump, cookie, entry_sp, map_failed, ordered_state, stack_words, submit_flags,
    target_tid,
};

/// A call's arguments, per thread, until it returns. NCCL's entry points do
/// not call one another through their exported addresses, so one per thread
/// is enough.
#[map]
static NCCL_PENDING: HashMap<u32, CollectiveRecord> = HashMap::with_max_entries(4096, 0);

/// A thread exits: its pending call (a return never seen) goes with it.
#[inline(always)]
pub(crate) fn forget_thread(tid: u32) {
    let _ = NCCL_PENDING.remove(tid);
}

/// Entry of an NCCL call (cookie: its `CollectiveOp` id).
#[uprobe]
pub fn nccl_enter(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let op = cookie(&ctx) as u32;
    let r = crate::int_args(&ctx);
    let on_stack = op == CollectiveOp::AllReduce as u32
        || op == CollectiveOp::ReduceScatter as u32
        || op == CollectiveOp::Broadcast as u32
        || op == CollectiveOp::Reduce as u32;
    let s = if on_stack { stack_words::<2>(entry_sp(&ctx, 0) + 8).unwrap_or([0; 2]) } else { [0; 2] };
    let (count, datatype, peer, comm, stream) =
        if op == CollectiveOp::AllReduce as u32 || op == CollectiveOp::ReduceScatter as u32 {
            (r[2], r[3] as u32, NO_PEER, r[5], s[0])
        } else if op == CollectiveOp::AllGather as u32 {
            (r[2], r[3] as u32, NO_PEER, r[4], r[5])
        } else if op == CollectiveOp::Broadcast as u32 {
            (r[2], r[3] as u32, r[4] as i32, r[5], s[0])
        } else if op == CollectiveOp::Reduce as u32 {
            (r[2], r[3] as u32, r[5] as i32, s[0], s[1])
        } else if op == CollectiveOp::Send as u32 || op == CollectiveOp::Recv as u32 {
            (r[1], r[2] as u32, r[3] as i32, r[4], r[5])
        } else {
            (0, u32::MAX, NO_PEER, 0, 0)
        };
    let rec = CollectiveRecord {
        header: crate::header(RecordKind::Collective, tid),
        seq: 0,
        depth: 0,
        // SAFETY: a helper without preconditions.
        start_ns: unsafe { bpf_ktime_get_ns() },
        count,
        comm,
        stream,
        thread_launches: 0,
        op,
        datatype,
        peer,
        result: 0,
    };
    if NCCL_PENDING.insert(tid, rec, 0).is_err() {
        map_failed();
    }
    0
}

/// Return of an NCCL call: the record, with the time in the call.
#[uretprobe]
pub fn nccl_exit(ctx: RetProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    // SAFETY: the value is copied out before the entry is removed.
    let Some(mut rec) = (unsafe { NCCL_PENDING.get(tid) }).copied() else { return 0 };
    let _ = NCCL_PENDING.remove(tid);
    rec.result = ctx.ret::<u64>() as u32;
    let o = ordered_state(tid, RecordKind::Collective);
    (rec.seq, rec.depth, rec.thread_launches, rec.header.ts_ns) = (o.seq, o.depth, o.launches, o.ts_ns);
    match ORDERED_EVENTS.reserve::<CollectiveRecord>(0) {
        Some(mut entry) => {
            entry.write(rec);
            entry.submit(submit_flags());
        }
        None => bump(&LOST_ORDERED),
    }
    0
}
