//! JAX's jit fast path: an entry and a return probe on jaxlib's
//! `jax::(anonymous namespace)::PjitFunction::Call(nanobind::handle,
//! _object* const*, unsigned long, _object*)` in `libjax_common.so`, which
//! runs once per call of a `jax.jit` function (tracing or not) on the
//! calling thread. A few hits per training step: each can afford a
//! uretprobe.
//!
//! x86-64: the function returns `absl::StatusOr<nb::object>` through a hidden
//! pointer in `rdi`, so `this` (the `PjitFunction`) is in `rsi` and the
//! Python object called (the `PjitFunctionObject` holding it) in `rdx`. The
//! name is not read here: the agent reads it from the target's memory once
//! per function, at an offset it checks against the target's Python objects
//! (jaxlib's layout changes between releases; the kernel side stays fixed).
//!
//! The records go to the ordered ring with the thread's sequence (they make
//! JAX steps, so launches must not crowd them out, and a gap must show).
use aya_ebpf::{
    bindings::BPF_RB_FORCE_WAKEUP,
    helpers::bpf_get_current_pid_tgid,
    macros::{map, uprobe, uretprobe},
    maps::{LruHashMap, RingBuf},
    programs::{ProbeContext, RetProbeContext},
};
use profiler_common::{JitFirstCall, JitRecord, RecordKind};

use crate::{BPF_NOEXIST, LOST_ORDERED, ORDERED_EVENTS, bump, header, ordered_state, submit_flags, target_tid};

/// The (process, function) pairs already sent to `JIT_NEW`. A program makes
/// a few jitted functions and keeps them; one evicted is announced again,
/// which costs the agent a cache lookup.
#[map]
static JIT_SEEN: LruHashMap<JitFirstCall, u8> = LruHashMap::with_max_entries(4096, 0);

/// First calls, for the agent's name reader (a few per process).
#[map]
static JIT_NEW: RingBuf = RingBuf::with_byte_size(64 * 1024, 0);

/// `PjitFunction::Call(this = rsi, callable = rdx, …)`.
#[uprobe]
pub fn jax_jit_enter(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let (Some(function), Some(callable)) = (ctx.arg::<u64>(1), ctx.arg::<u64>(2)) else { return 0 };
    submit(tid, RecordKind::JitEnter, function, callable);
    let first = JitFirstCall { tgid: (bpf_get_current_pid_tgid() >> 32) as u32, _pad: 0, function };
    if JIT_SEEN.insert(first, 0, BPF_NOEXIST).is_ok() {
        // Full: the agent reads the name when the call comes up in order.
        if let Some(mut entry) = JIT_NEW.reserve::<JitFirstCall>(0) {
            entry.write(first);
            entry.submit(BPF_RB_FORCE_WAKEUP as u64);
        }
    }
    0
}

/// The return of `PjitFunction::Call`: the call is dispatched.
#[uretprobe]
pub fn jax_jit_exit(_ctx: RetProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    submit(tid, RecordKind::JitExit, 0, 0);
    0
}

/// Writes the record to the ordered ring with the thread's sequence, depth and launch count.
#[inline(always)]
fn submit(tid: u32, kind: RecordKind, function: u64, callable: u64) {
    let o = ordered_state(tid, kind);
    match ORDERED_EVENTS.reserve::<JitRecord>(0) {
        Some(mut entry) => {
            let mut header = header(kind, tid);
            header.ts_ns = o.ts_ns;
            entry.write(JitRecord {
                header,
                seq: o.seq,
                depth: o.depth,
                function,
                callable,
                thread_launches: o.launches,
                sched: o.sched,
            });
            entry.submit(submit_flags());
        }
        None => bump(&LOST_ORDERED),
    }
}
