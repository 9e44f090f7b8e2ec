//! Where a traced thread's time goes, from the scheduler's own tracepoints:
//! `sched_switch` (a thread leaves a CPU — preempted, or in an interruptible
//! or uninterruptible wait — and another takes it) and `sched_wakeup` /
//! `sched_wakeup_new` (a waiting thread becomes runnable). Each traced thread
//! keeps its state and four running totals (on a CPU, runnable, sleeping,
//! blocked) in its `ThreadSlot`; the ordered records carry a snapshot, so a
//! step's figures are exact differences, like its launch count.
//!
//! These fire on every context switch of the machine: the first thing each
//! does is the traced check (an array lookup for a thread holding a slot, else
//! one `TRACED` hash lookup). Raw tracepoints: no tracefs needed.
//!
//! All events of one task are serialised by its runqueue's lock (a switch
//! runs under its CPU's, a wakeup under the task's), so plain stores suffice
//! for a thread's state; the process totals, written from every CPU, are
//! atomic adds.
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns, bpf_probe_read_kernel},
    macros::{map, raw_tracepoint},
    maps::{Array, HashMap, PerCpuArray},
    programs::RawTracePointContext,
};
use profiler_common::{
    OffCpuRecord, ProcessSched, RecordHeader, RecordKind, SchedHistoryEntry, SchedMismatch, SchedTimes, mismatch_site,
    off_cpu_state::{BLOCKED, RUNNABLE, SLEEPING},
};

use crate::{
    BPF_NOEXIST, EVENTS, LOST, LOST_OFF_CPU, TASK_PID_OFFSET, TASK_TGID_OFFSET, ThreadSlot, bump, map_failed, stopped,
    submit_flags, thread_state, traced,
};

/// What a thread is doing since `ThreadSched::since_ns` (the off-CPU ones
/// are `off_cpu_state`'s).
const UNSEEN: u32 = 0;
const RUNNING: u32 = 1;

/// `task_struct::__state` bits (include/linux/sched.h).
const TASK_UNINTERRUPTIBLE: u32 = 0x2;
const TASK_NOLOAD: u32 = 0x400;

/// Set by the agent: 0 with `--no-sched`, when the tracepoints are not
/// attached and the snapshots stay zero.
#[unsafe(no_mangle)]
static SCHED_ENABLED: u32 = 0;
/// Set by the agent: 1 to write an `OffCpuRecord` each time a traced thread
/// comes back to a CPU (per-call rows: `--launches all`).
#[unsafe(no_mangle)]
static SCHED_SLICES: u32 = 0;
/// Set by the agent: entries per CPU of `SCHED_HISTORY` (a power of two), 0 off.
#[unsafe(no_mangle)]
static SCHED_HISTORY_PER_CPU: u32 = 0;
/// Byte offset of `flags` in `struct task_struct` (from the kernel's BTF).
#[unsafe(no_mangle)]
static TASK_FLAGS_OFFSET: u32 = 0;
/// `task_struct::flags`: the task is exiting (set before `sched_process_exit`).
const PF_EXITING: u32 = 0x4;

/// A thread's scheduler state, in its `ThreadSlot` (zeroed with it at exit).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ThreadSched {
    state: u32,
    _pad: u32,
    since_ns: u64,
    cpu_ns: u64,
    runnable_ns: u64,
    sleep_ns: u64,
    blocked_ns: u64,
    /// Its last time off a CPU, for its `OffCpuRecord`: when it left (0: not
    /// seen leaving), why (`off_cpu_state`), and when it was woken (0: not yet).
    left_ns: u64,
    woken_ns: u64,
    left_state: u32,
    _pad2: u32,
}

/// A switch the programs cannot square with the thread's state (a switch-in
/// of a thread already running, a switch-out of one not running, a probe on
/// a thread they have off its CPU): the interval since its state last changed
/// is lost, or its off-CPU record is, and counted here; and the site's debug
/// record (`SCHED_MISMATCHES`) keeps the last one's thread and state.
#[inline(always)]
fn mismatch(tgid: u32, site: u32, tid: u32, s: &ThreadSched, t: u64) {
    if let Some(p) = process_totals(tgid) {
        // SAFETY: a valid map value field.
        unsafe { atomic_add(&raw mut (*p).mismatches, 1) };
    }
    if let Some(d) = SCHED_MISMATCHES.get_ptr_mut(site) {
        // SAFETY: a valid map value; the fields after the count are the last
        // writer's (two CPUs at once may mix theirs: a debug record).
        unsafe {
            atomic_add(&raw mut (*d).count, 1);
            (*d).tid = tid;
            (*d).found = s.state;
            (*d).since_ns = s.since_ns;
            (*d).left_ns = s.left_ns;
            (*d).at_ns = t;
            (*d).cpu = bpf_get_smp_processor_id();
        }
    }
    if history_on()
        && let (Some(f), Some(who)) = (SCHED_HISTORY_FROZEN.get_ptr_mut(0), SCHED_HISTORY_FROZEN.get_ptr_mut(1))
    {
        // SAFETY: valid map values.
        unsafe {
            if *f == 0 {
                *f = t;
                *who = u64::from(tid) | u64::from(site) << 32;
            }
        }
    }
}

/// Each CPU's last scheduler events, any task's (`PROFILER_SCHED_HISTORY`,
/// debug only): sized by the agent, 1 entry when off.
#[map]
static SCHED_HISTORY: Array<SchedHistoryEntry> = Array::with_max_entries(1, 0);
/// Each CPU's next index into its part of `SCHED_HISTORY` (the programs
/// that write it run with interrupts off, one at a time on a CPU).
#[map]
static SCHED_HISTORY_AT: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);
/// When the first mismatch was seen (0: not yet; the history stops then),
/// and its thread (low 32 bits) and site (high).
#[map]
static SCHED_HISTORY_FROZEN: Array<u64> = Array::with_max_entries(2, 0);

#[inline(always)]
fn history_on() -> bool {
    // SAFETY: a plain read of a global the loader patched.
    unsafe { core::ptr::read_volatile(&SCHED_HISTORY_PER_CPU) != 0 }
}

/// Adds an event to this CPU's history, unless it is frozen (the callers
/// have checked [`history_on`]).
#[inline(always)]
fn remember(kind: u32, prev: u32, next: u32, prev_state: u32, preempt: u32, t: u64) {
    // SAFETY: a plain read of a global the loader patched.
    let per_cpu = unsafe { core::ptr::read_volatile(&SCHED_HISTORY_PER_CPU) }.max(1);
    if SCHED_HISTORY_FROZEN.get(0).is_some_and(|f| *f != 0) {
        return;
    }
    let Some(at) = SCHED_HISTORY_AT.get_ptr_mut(0) else { return };
    // SAFETY: a helper without preconditions; a valid per-CPU map value.
    let (cpu, i) = unsafe { (bpf_get_smp_processor_id(), *at) };
    // SAFETY: as above.
    unsafe { *at = i.wrapping_add(1) };
    let index = cpu.wrapping_mul(per_cpu).wrapping_add(i & (per_cpu - 1));
    if let Some(e) = SCHED_HISTORY.get_ptr_mut(index) {
        // SAFETY: a valid map value.
        unsafe { *e = SchedHistoryEntry { at_ns: t, prev, next, cpu, kind, prev_state, preempt } };
    }
}

/// The mismatches by site (`mismatch_site`), for the agent's debug log.
#[map]
static SCHED_MISMATCHES: Array<SchedMismatch> = Array::with_max_entries(mismatch_site::COUNT, 0);

/// Scheduler totals of each traced process, by tgid (`ProcessSched`). The
/// agent reads an exited process's and removes it.
#[map]
static PROCESS_SCHED: HashMap<u32, ProcessSched> = HashMap::with_max_entries(4096, 0);

#[inline(always)]
fn enabled() -> bool {
    // SAFETY: a plain read of a global the loader patched.
    unsafe { core::ptr::read_volatile(&SCHED_ENABLED) != 0 }
}

#[inline(always)]
fn now() -> u64 {
    // SAFETY: a helper without preconditions.
    unsafe { bpf_ktime_get_ns() }
}

/// The process's totals, created on first use.
#[inline(always)]
fn process_totals(tgid: u32) -> Option<*mut ProcessSched> {
    if let Some(p) = PROCESS_SCHED.get_ptr_mut(tgid) {
        return Some(p);
    }
    let zero = ProcessSched { cpu_ns: 0, switches: 0, preemptions: 0, mismatches: 0 };
    // Another CPU may have created it meanwhile: then the insert fails, harmlessly.
    let _ = PROCESS_SCHED.insert(tgid, zero, BPF_NOEXIST);
    let p = PROCESS_SCHED.get_ptr_mut(tgid);
    if p.is_none() {
        map_failed();
    }
    p
}

/// An atomic add whose result is unused: BPF's `lock xadd`, which every
/// kernel that runs these programs has (the target has no `AtomicU64::fetch_add`).
#[inline(always)]
fn atomic_add(at: *mut u64, n: u64) {
    // SAFETY: an aligned u64 in map memory, only ever accessed atomically or read.
    unsafe { core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(at, n) };
}

/// The tid and tgid of a `task_struct`, at the offsets the agent took from BTF.
#[inline(always)]
fn task_ids(task: *const u8) -> Option<(u32, u32)> {
    // SAFETY: plain reads of globals the loader patched.
    let (pid_at, tgid_at) =
        unsafe { (core::ptr::read_volatile(&TASK_PID_OFFSET), core::ptr::read_volatile(&TASK_TGID_OFFSET)) };
    // SAFETY: bpf_probe_read_kernel tolerates any address.
    unsafe {
        let tid = bpf_probe_read_kernel(task.wrapping_add(pid_at as usize).cast::<u32>()).ok()?;
        let tgid = bpf_probe_read_kernel(task.wrapping_add(tgid_at as usize).cast::<u32>()).ok()?;
        Some((tid, tgid))
    }
}

/// Whether `task` is exiting: from then on the programs keep a thread's state
/// if it has one but give none to a thread without (its exit, which releases
/// the state, may already have run: a state made after it would never go).
#[inline(always)]
fn exiting(task: *const u8) -> bool {
    // SAFETY: a plain read of a global the loader patched.
    let at = unsafe { core::ptr::read_volatile(&TASK_FLAGS_OFFSET) };
    // SAFETY: bpf_probe_read_kernel tolerates any address.
    unsafe { bpf_probe_read_kernel(task.wrapping_add(at as usize).cast::<u32>()) }.is_ok_and(|f| f & PF_EXITING != 0)
}

/// Ends the thread's current off-CPU or runnable interval at `now`, adding it to its total.
#[inline(always)]
fn close_interval(s: &mut ThreadSched, now: u64) {
    let took = now.saturating_sub(s.since_ns);
    // Branch-free, each total at its fixed offset: a `match` compiles to a
    // pointer computed from the state, which the verifier rejects as an
    // unbounded access into the map value.
    s.runnable_ns += took * u64::from(s.state == RUNNABLE);
    s.sleep_ns += took * u64::from(s.state == SLEEPING);
    s.blocked_ns += took * u64::from(s.state == BLOCKED);
}

/// The state a thread leaving a CPU is in: preempted or yielding (still
/// runnable), an uninterruptible wait that counts as load (blocked), or
/// another wait (sleeping; `TASK_IDLE` waits are uninterruptible but idle).
#[inline(always)]
fn leaving_state(preempt: bool, prev_state: u32) -> u32 {
    if preempt || prev_state == 0 {
        RUNNABLE
    } else if prev_state & TASK_UNINTERRUPTIBLE != 0 && prev_state & TASK_NOLOAD == 0 {
        BLOCKED
    } else {
        SLEEPING
    }
}

#[inline(always)]
fn sched_of(slot: *mut ThreadSlot) -> &'static mut ThreadSched {
    // SAFETY: a valid map value; see the module comment for who writes it.
    unsafe { &mut (*slot).sched }
}

/// A CPU switches from `prev` (the running task) to `next`. The fourth
/// argument, `prev_state`, is there since Linux 5.18.
#[raw_tracepoint(tracepoint = "sched_switch")]
pub fn sched_switch(ctx: RawTracePointContext) -> i32 {
    if stopped() {
        return 0;
    }
    let t = now();
    let pid_tgid = bpf_get_current_pid_tgid();
    let (prev_tid, prev_tgid) = (pid_tgid as u32, (pid_tgid >> 32) as u32);
    let (preempt, prev_state): (u64, u64) = (ctx.arg(0), ctx.arg(3));
    let next: *const u8 = ctx.arg(2);
    if history_on() {
        let next_tid = task_ids(next).map_or(u32::MAX, |(tid, _)| tid);
        remember(0, prev_tid, next_tid, prev_state as u32, (preempt & 0xff) as u32, t);
    }
    if prev_tid != 0 && traced(prev_tid, prev_tgid) {
        let leaving = leaving_state(preempt & 0xff != 0, prev_state as u32);
        let prev: *const u8 = ctx.arg(1);
        if let Some(slot) = thread_state(prev_tid, !exiting(prev)) {
            let s = sched_of(slot);
            if s.state != RUNNING && s.state != UNSEEN {
                mismatch(prev_tgid, mismatch_site::SWITCH_OUT, prev_tid, s, t);
            }
            let ran = if s.state == RUNNING { t.saturating_sub(s.since_ns) } else { 0 };
            s.cpu_ns += ran;
            s.state = leaving;
            s.since_ns = t;
            (s.left_ns, s.left_state, s.woken_ns) = (t, leaving, 0);
            if let Some(p) = process_totals(prev_tgid) {
                // SAFETY: valid map value fields.
                unsafe {
                    atomic_add(&raw mut (*p).cpu_ns, ran);
                    atomic_add(&raw mut (*p).switches, 1);
                    if leaving == RUNNABLE {
                        atomic_add(&raw mut (*p).preemptions, 1);
                    }
                }
            }
        }
    }
    let Some((next_tid, next_tgid)) = task_ids(next) else { return 0 };
    if next_tid != 0
        && traced(next_tid, next_tgid)
        && let Some(slot) = thread_state(next_tid, !exiting(next))
    {
        let s = sched_of(slot);
        if s.state == RUNNING {
            mismatch(next_tgid, mismatch_site::SWITCH_IN, next_tid, s, t);
        }
        close_interval(s, t);
        s.state = RUNNING;
        s.since_ns = t;
        if s.left_ns != 0 && slices() {
            write_off_cpu(s, next_tid, next_tgid, t);
        }
        s.left_ns = 0;
    }
    0
}

#[inline(always)]
fn slices() -> bool {
    // SAFETY: a plain read of a global the loader patched.
    unsafe { core::ptr::read_volatile(&SCHED_SLICES) != 0 }
}

/// The thread's time off its CPU that ends now, at `t`: counted lost when the ring has no room.
#[inline(always)]
fn write_off_cpu(s: &ThreadSched, tid: u32, tgid: u32, t: u64) {
    match EVENTS.reserve::<OffCpuRecord>(0) {
        Some(mut entry) => {
            entry.write(OffCpuRecord {
                header: RecordHeader { kind: RecordKind::OffCpu as u32, tid, ts_ns: t, tgid, _pad: 0 },
                left_ns: s.left_ns,
                woken_ns: s.woken_ns,
                state: s.left_state,
                _pad: 0,
            });
            entry.submit(submit_flags());
        }
        None => {
            bump(&LOST);
            bump(&LOST_OFF_CPU);
        }
    }
}

/// A waiting task (`p`, the first argument) becomes runnable, in the waker's
/// context; `sched_wakeup_new` for a new task's first wake-up. A wakeup of a
/// task still on its CPU (it had not yet switched out) changes nothing.
#[raw_tracepoint(tracepoint = "sched_wakeup")]
pub fn sched_wakeup(ctx: RawTracePointContext) -> i32 {
    if stopped() {
        return 0;
    }
    let task: *const u8 = ctx.arg(0);
    let Some((tid, tgid)) = task_ids(task) else { return 0 };
    if history_on() {
        remember(1, bpf_get_current_pid_tgid() as u32, tid, 0, 0, now());
    }
    if tid == 0 || !traced(tid, tgid) {
        return 0;
    }
    let Some(slot) = thread_state(tid, !exiting(task)) else { return 0 };
    let s = sched_of(slot);
    if s.state == SLEEPING || s.state == BLOCKED || s.state == UNSEEN {
        let t = now();
        close_interval(s, t);
        s.state = RUNNABLE;
        s.since_ns = t;
        s.woken_ns = t;
    }
    0
}

/// The thread's snapshot, from a probe on the thread itself (so it is on a
/// CPU: its run in progress counts), and the moment it is of, which the
/// record is stamped with. A thread the scheduler programs have not seen yet
/// starts here, running.
///
/// Uprobe programs are preemptible: a switch between reading the totals and
/// the clock would mix two moments (a preempted probe would lose the whole
/// time it waited). So the clock is read after the totals, and all is read
/// again if the run's start moved meanwhile.
#[inline(always)]
pub(crate) fn snapshot(slot: *mut ThreadSlot, tgid: u32) -> (SchedTimes, u64) {
    if !enabled() {
        return (SchedTimes { cpu_ns: 0, runnable_ns: 0, sleep_ns: 0, blocked_ns: 0, process_cpu_ns: 0 }, now());
    }
    let s = sched_of(slot);
    if s.state != RUNNING {
        // Unseen, or off a CPU for the programs though it runs: a switch-in
        // they did not see (rare, on a loaded machine), whose off-CPU record
        // is missing, so counted. It runs from now on.
        let t = now();
        if s.state != UNSEEN {
            // SAFETY: a valid map value's field.
            let tid = unsafe { (*slot).tid };
            mismatch(tgid, mismatch_site::PROBE, tid, s, t);
        }
        close_interval(s, t);
        s.state = RUNNING;
        s.since_ns = t;
        s.left_ns = 0;
    }
    let mut taken = (SchedTimes { cpu_ns: 0, runnable_ns: 0, sleep_ns: 0, blocked_ns: 0, process_cpu_ns: 0 }, 0);
    for _ in 0..3 {
        // SAFETY: reads of the thread's own state, which the scheduler programs may change meanwhile.
        let since = unsafe { core::ptr::read_volatile(&s.since_ns) };
        let (cpu, runnable, sleep, blocked) = unsafe {
            (
                core::ptr::read_volatile(&s.cpu_ns),
                core::ptr::read_volatile(&s.runnable_ns),
                core::ptr::read_volatile(&s.sleep_ns),
                core::ptr::read_volatile(&s.blocked_ns),
            )
        };
        // SAFETY: a lookup whose value is copied at once.
        let process = unsafe { PROCESS_SCHED.get(tgid) }.map_or(0, |p| p.cpu_ns);
        let t = now();
        let running = t.saturating_sub(since);
        taken = (
            SchedTimes {
                cpu_ns: cpu + running,
                runnable_ns: runnable,
                sleep_ns: sleep,
                blocked_ns: blocked,
                process_cpu_ns: process + running,
            },
            t,
        );
        // SAFETY: as above.
        if unsafe { core::ptr::read_volatile(&s.since_ns) } == since {
            break;
        }
    }
    taken
}
