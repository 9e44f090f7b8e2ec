//! The profiler's eBPF programs, all filtered on a set of traced processes
//! (`TRACED`, grown by the fork hook when following children): entry probes on
//! the CUDA launch entry points, entry/return probes on the host
//! synchronisation calls, the kernel-naming calls and the step function, and
//! (in `python`) CPython's USDT function probes; (in `blas`) cuBLAS/cuBLASLt GEMM calls.
//!
//! The kernel side only filters, timestamps, copies arguments and submits; the
//! one piece of aggregation it does is a per-thread launch counter, which makes
//! each step's launch count exact even when launch records are not kept
//! (`--launches count`) or the ring buffer overflows.
//!
//! Per-thread state (launch counter, runtime frame, step sequence and depth)
//! lives in an array slot indexed by tid, or in a hash map when another live
//! thread holds the slot; `thread_exit` releases both when a target thread
//! exits, so the maps hold live threads only. A map update that fails is
//! counted (`MAP_FAILURES`), never silent.
//!
//! Step, sync and thread-exit records, which each thread numbers in order,
//! go to a ring of their own (`ORDERED_EVENTS`), which launch records cannot fill.
//!
//! Each launch entry point has a program of its own with its `LaunchApi` id
//! built in (`launch_programs`); a probe moved past `push`es uses its argument
//! shape's shared program, which takes the id and the pushed bytes from the
//! attach cookie (kernel >= 5.15). The other programs take theirs from the
//! cookie. Launch programs keep their stack under 64 bytes (see `stack_words`).
#![no_std]
#![no_main]
// `atomic_xadd` for the scheduler programs' per-process totals (see `sched::atomic_add`).
#![feature(core_intrinsics)]
#![expect(internal_features, reason = "core::intrinsics::atomic_xadd: the BPF target has no AtomicU64::fetch_add")]

mod blas;
mod copies;
mod cpu;
mod frame_hook;
mod jax;
mod nccl;
mod python;
mod sched;
mod torch;

use aya_ebpf::{
    EbpfContext,
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_kernel, bpf_probe_read_user,
        bpf_probe_read_user_str_bytes,
        generated::{bpf_get_attach_cookie, bpf_probe_read_user as probe_read_user_raw},
    },
    macros::{map, raw_tracepoint, uprobe, uretprobe},
    maps::{Array, HashMap, PerCpuArray, RingBuf},
    programs::{ProbeContext, RawTracePointContext, RetProbeContext},
};
use profiler_common::{
    ApiLayer, CODE_RANGES, CodeRanges, EVENTS_BYTES, KernelNameRecord, LaunchApi, LaunchRecord, LaunchStage,
    ORDERED_EVENTS_BYTES, OrderedRecord, ProcessRecord, RecordHeader, RecordKind, STAGE_LEN, STAGES, SchedTimes,
    name_call,
};

/// bpf_probe_read_user and bpf_get_attach_cookie are GPL-only helpers.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

/// The globals below are set by the agent before load
/// (`EbpfLoader::override_global`) and read with `read_volatile`, so that the
/// compiler does not fold the initial value in.
#[unsafe(no_mangle)]
static FOLLOW_CHILDREN: u32 = 0;
/// Byte offsets of `pid` and `tgid` in `struct task_struct` (from the kernel's BTF).
#[unsafe(no_mangle)]
static TASK_PID_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TASK_TGID_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static EMIT_LAUNCHES: u32 = 1;
/// `THREAD_SLOTS`' length less one (a power of two less one).
#[unsafe(no_mangle)]
static THREAD_SLOT_MASK: u32 = 0;

/// Launch and kernel-name records. 32 MiB: at 64 bytes a launch this holds
/// ~500 000 launches, several hundred milliseconds of a launch-bound loop,
/// while the agent drains it in batches.
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_BYTES, 0);

/// Step, sync and thread-exit records (`OrderedRecord`) and loader changes: a
/// few per step, so 8 MiB (~200 000 records) is ample between two drains, and
/// launches, which can fill `EVENTS`, never take their room.
#[map]
static ORDERED_EVENTS: RingBuf = RingBuf::with_byte_size(ORDERED_EVENTS_BYTES, 0);

/// Reservations in `EVENTS` that failed (records lost), per CPU.
#[map]
static LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Reservations in `ORDERED_EVENTS` that failed (records lost), per CPU.
#[map]
static LOST_ORDERED: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Of the `LOST` ones, off-CPU records (`sched`), per CPU: they cost the
/// scheduler track a slice, not a launch row.
#[map]
static LOST_OFF_CPU: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Map updates that failed and lost something (a map full, or a bucket
/// lock not taken), per CPU: a thread's state that could not be kept (its
/// launches go uncounted, its runtime launches may count twice, its steps
/// have no sequence), a pending kernel name; and removals at a thread's exit
/// that failed (an entry left behind takes room until the session ends).
#[map]
static MAP_FAILURES: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Launches seen (each counted once), per CPU.
#[map]
static LAUNCHES: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// The last runtime-API launch a thread began: the stack pointer at its entry
/// point (where its return address lies) and that return address; `sp` 0
/// for none (see `in_runtime_launch`).
#[repr(C)]
#[derive(Clone, Copy)]
struct RuntimeFrame {
    sp: u64,
    ret: u64,
}

/// One thread of the target: its launches so far, its last runtime launch,
/// and where its step records stand. All zero but `tid` when claimed.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ThreadSlot {
    tid: u32,
    /// Ordered records written (`OrderedRecord::seq` of the last one).
    seq: u32,
    launches: u64,
    runtime: RuntimeFrame,
    /// Step functions the thread is inside (`OrderedRecord::depth`).
    step_depth: u32,
    /// Non-zero while the thread is inside a runtime-API synchronisation
    /// call (marked by its entry probe, cleared by its return probe): the
    /// runtime reaches the driver's exported sync calls, whose probes must
    /// not count that call twice.
    in_runtime_sync: u32,
    /// Where its time goes (`sched`).
    sched: sched::ThreadSched,
}

/// Per-thread state, indexed by `tid & THREAD_SLOT_MASK`: an array lookup,
/// which the verifier inlines, where a hash lookup costs the traced thread
/// tens of nanoseconds on every launch. A thread claims its slot when it
/// first needs one (through `SLOT_CLAIMS`, whose insert is atomic) and keeps
/// it until it exits (`thread_exit`); a thread whose slot another live thread
/// holds keeps its state in `THREAD_FALLBACK` instead, for its whole life, so
/// that its counter never moves. Only the owning thread writes its state, so
/// plain increments are race free. The agent sizes the array to `pid_max`
/// (up to 65 536 slots); with exits releasing slots, sharing is between live
/// threads only.
#[map]
static THREAD_SLOTS: Array<ThreadSlot> = Array::with_max_entries(65536, 0);

/// Slot index -> the tid that claimed it; sized to `THREAD_SLOTS` by the
/// agent, so an insert fails only when the slot is taken.
#[map]
static SLOT_CLAIMS: HashMap<u32, u32> = HashMap::with_max_entries(65536, 0);

/// The state of threads whose slot another live thread holds, by tid;
/// entries are removed when their thread exits. Sized by the agent.
#[map]
static THREAD_FALLBACK: HashMap<u32, ThreadSlot> = HashMap::with_max_entries(16384, 0);

/// A zeroed `ThreadSlot` to insert into `THREAD_FALLBACK` from map memory,
/// not the launch programs' small stack (see `stack_words`).
#[map]
static NEW_THREAD: PerCpuArray<ThreadSlot> = PerCpuArray::with_max_entries(1, 0);

/// Launch records staged per thread (see `LaunchStage`), indexed by
/// `tid & (STAGES - 1)` and claimed like `THREAD_SLOTS`; a thread whose stage
/// another holds writes each record straight to the ring buffer. Staging
/// spares the traced thread a ring reservation and commit (two helper calls,
/// a lock and an atomic) on 15 launches of 16.
#[map]
static LAUNCH_STAGES: Array<LaunchStage> = Array::with_max_entries(STAGES, 0);

/// Stage index -> the tid that claimed it.
#[map]
static STAGE_CLAIMS: HashMap<u32, u32> = HashMap::with_max_entries(STAGES, 0);

/// Per traced process (tgid): `[start, end)` of the probed runtime
/// libraries' code in it, filled by the agent before the runtime probes exist.
#[map]
static RUNTIME_TEXT: HashMap<u32, CodeRanges> = HashMap::with_max_entries(4096, 0);

/// Whether `address` lies in one of the calling process's ranges in `map`.
#[inline(always)]
pub(crate) fn in_code_ranges(map: &HashMap<u32, CodeRanges>, address: u64) -> bool {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // SAFETY: a read-only lookup; the agent adds ranges before the probes that read them.
    let Some(ranges) = (unsafe { map.get(tgid) }) else { return false };
    let mut i = 0;
    while i < CODE_RANGES {
        let r = ranges[i];
        if r[1] == 0 {
            return false;
        }
        if address >= r[0] && address < r[1] {
            return true;
        }
        i += 1;
    }
    false
}

/// Whether `address` lies in a probed runtime library's code.
#[inline(always)]
fn in_runtime_text(address: u64) -> bool {
    in_code_ranges(&RUNTIME_TEXT, address)
}

pub(crate) const BPF_NOEXIST: u64 = 1;

/// `[0]` is 1 once the agent has probed a runtime library: only then can a
/// driver launch or sync be the runtime's, made on behalf of a runtime call.
#[map]
static RUNTIME_PROBED: Array<u32> = Array::with_max_entries(1, 0);

/// Records never wake the agent: it drains on its own 20 ms timer. A wakeup
/// per record costs the traced thread an irq_work and the agent a context
/// switch per launch, and even a fill-level check per record (a helper call
/// that reads the consumer position the agent keeps writing) measurably costs
/// the traced thread; 20 ms of the fastest launch stream here is ~2 MB of a
/// 32 MiB buffer.
const BPF_RB_NO_WAKEUP: u64 = 1;

#[inline(always)]
fn submit_flags() -> u64 {
    BPF_RB_NO_WAKEUP
}

/// `[0]` is set by the agent when the session stops: from then on every
/// program returns at once, so that the rings and stages it reads no longer
/// change while the kernel takes the probes off, at its own pace (≈90 ms a
/// probe, in a process the agent leaves behind: see `Probes::detach`).
#[map]
static STOPPED: Array<u32> = Array::with_max_entries(1, 0);

/// The traced processes: tgid -> the traced process it was forked from (0
/// for one the user named). The agent fills it before any probe is attached;
/// the fork hook adds children (`FOLLOW_CHILDREN`); a process's exit removes it.
#[map]
static TRACED: HashMap<u32, u32> = HashMap::with_max_entries(4096, 0);

/// Whether the agent has stopped the session. An array lookup the verifier
/// inlines (no helper call).
#[inline(always)]
pub(crate) fn stopped() -> bool {
    STOPPED.get(0).is_some_and(|s| *s != 0)
}

/// The calling thread if its process is traced. A thread holding its
/// `THREAD_SLOTS` slot is one of a traced process (slots are claimed only
/// past this check and released when their thread exits): an array lookup the
/// verifier inlines answers for it, and only other threads (a first record, a
/// fallback thread, and every thread of an untraced process that maps a probed
/// file) pay the `TRACED` hash lookup.
#[inline(always)]
fn target_tid() -> Option<u32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    let held = THREAD_SLOTS.get(slot_index(tid)).is_some_and(|s| s.tid == tid);
    // SAFETY: a lookup whose value is not kept.
    if !held && unsafe { TRACED.get((pid_tgid >> 32) as u32) }.is_none() {
        return None;
    }
    if stopped() {
        return None;
    }
    Some(tid)
}

/// Whether thread `tid` of process `tgid` (not necessarily the calling
/// thread) is traced: it holds its slot, or its process is in `TRACED`.
#[inline(always)]
pub(crate) fn traced(tid: u32, tgid: u32) -> bool {
    // SAFETY: a lookup whose value is not kept.
    THREAD_SLOTS.get(slot_index(tid)).is_some_and(|s| s.tid == tid) || unsafe { TRACED.get(tgid) }.is_some()
}

/// A record header for the calling thread (`tid`), stamped now.
#[inline(always)]
pub(crate) fn header(kind: RecordKind, tid: u32) -> RecordHeader {
    let mut h = RecordHeader { kind: kind as u32, tid, ts_ns: 0, tgid: 0, _pad: 0 };
    write_header(&mut h, kind, tid);
    h
}

/// Writes a header in place (map or ring memory), each helper's result
/// stored as soon as it returns: nothing is kept across a helper call, which
/// would take the launch programs' stack past 64 bytes (see `stack_words`).
#[inline(always)]
fn write_header(h: &mut RecordHeader, kind: RecordKind, tid: u32) {
    h.kind = kind as u32;
    h.tid = tid;
    h._pad = 0;
    h.tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // SAFETY: a helper without preconditions.
    h.ts_ns = unsafe { bpf_ktime_get_ns() };
}

#[inline(always)]
fn add(counter: &PerCpuArray<u64>, n: u64) {
    if let Some(p) = counter.get_ptr_mut(0) {
        // SAFETY: per-CPU slot; BPF programs do not migrate while running.
        unsafe { *p += n };
    }
}

#[inline(always)]
fn bump(counter: &PerCpuArray<u64>) {
    add(counter, 1);
}

/// The attach cookie: for the launch shapes' shared programs, the `LaunchApi`
/// id in the low 32 bits and, in the high 32, how many bytes the function
/// pushed before the probe point (the agent may move a probe past `push`es to
/// an instruction the kernel emulates; see `probes::placement`); for the
/// others, the id of what fired.
#[inline(always)]
pub(crate) fn cookie(ctx: &impl EbpfContext) -> u64 {
    // SAFETY: the helper only reads the attach cookie of the running program.
    unsafe { bpf_get_attach_cookie(ctx.as_ptr()) }
}

/// Counts a failed map update.
#[inline(always)]
pub(crate) fn map_failed() {
    bump(&MAP_FAILURES);
}

/// Claims element `index` of `claims`' array for thread `tid`: the insert is
/// atomic, so one thread wins. A claim that fails loses nothing (the thread
/// keeps its state in `THREAD_FALLBACK`, or writes its launches straight to
/// the ring), so it is not counted as a failure.
#[inline(always)]
fn claim(claims: &HashMap<u32, u32>, index: u32, tid: u32) -> bool {
    claims.insert(index, tid, BPF_NOEXIST).is_ok()
}

/// Element `index` of `array` if thread `tid` holds it, claiming it first
/// (through `claims`) when `claim_it` and nobody has. `T` is `#[repr(C)]` and
/// starts with the holder's tid, written by the claimant (and zeroed, with the
/// rest, by `release` when the holder exits).
#[inline(always)]
fn held<T>(array: &Array<T>, claims: &HashMap<u32, u32>, index: u32, tid: u32, claim_it: bool) -> Option<*mut T> {
    let entry = array.get_ptr_mut(index)?;
    let holder = entry.cast::<u32>();
    // SAFETY: a valid array element, whose first field is the holder's tid.
    let current = unsafe { *holder };
    if current == tid {
        return Some(entry);
    }
    if current == 0 && claim_it && claim(claims, index, tid) {
        // SAFETY: as above; this thread won the claim, so it alone writes here.
        unsafe { *holder = tid };
        return Some(entry);
    }
    None
}

#[inline(always)]
fn slot_index(tid: u32) -> u32 {
    // SAFETY: a plain read of a global the loader patched.
    tid & unsafe { core::ptr::read_volatile(&THREAD_SLOT_MASK) }
}

/// The thread's state: its slot in `THREAD_SLOTS` if it holds it, else its
/// `THREAD_FALLBACK` entry; with `create`, a thread that has neither claims
/// its slot, or failing that gets an entry. A thread never moves between the
/// two while it lives (its counter would jump): only a thread with no entry
/// claims a slot. None: no state (without `create`), or no room (counted).
#[inline(always)]
pub(crate) fn thread_state(tid: u32, create: bool) -> Option<*mut ThreadSlot> {
    let index = slot_index(tid);
    let slot = THREAD_SLOTS.get_ptr_mut(index)?;
    // SAFETY: a valid array element.
    let holder = unsafe { (*slot).tid };
    if holder == tid {
        return Some(slot);
    }
    if let Some(entry) = THREAD_FALLBACK.get_ptr_mut(tid) {
        return Some(entry);
    }
    if !create {
        return None;
    }
    if holder == 0 && claim(&SLOT_CLAIMS, index, tid) {
        // SAFETY: this thread won the claim, so it alone writes here; the
        // rest of the slot was zeroed when its last holder exited.
        unsafe { (*slot).tid = tid };
        return Some(slot);
    }
    let new = NEW_THREAD.get_ptr_mut(0)?;
    // SAFETY: per-CPU scratch, zero but for the tid this writes (programs do not migrate).
    unsafe { (*new).tid = tid };
    // By reference: the value is copied from map memory, not the stack.
    // SAFETY: as above.
    let value: &ThreadSlot = unsafe { &*new };
    if THREAD_FALLBACK.insert(tid, value, BPF_NOEXIST).is_err() {
        map_failed();
        return None;
    }
    THREAD_FALLBACK.get_ptr_mut(tid)
}

/// The thread's stage in `LAUNCH_STAGES`, if it holds it.
#[inline(always)]
fn thread_stage(tid: u32, claim_it: bool) -> Option<*mut LaunchStage> {
    held(&LAUNCH_STAGES, &STAGE_CLAIMS, tid & (STAGES - 1), tid, claim_it)
}

/// Writes the stage's records to the ring buffer as one record and empties
/// it; counts them lost when the ring has no room.
#[inline(always)]
fn flush_stage(stage: &mut LaunchStage) {
    let len = stage.len as usize;
    stage.len = 0;
    if len == 0 || len > STAGE_LEN {
        return;
    }
    // SAFETY: `len` is within the array (checked above).
    let staged = unsafe { stage.records.get_unchecked(..len) };
    if EVENTS.output::<[LaunchRecord]>(staged, submit_flags()).is_err() {
        add(&LOST, len as u64);
    }
}

/// Counts the launch for its thread.
#[inline(always)]
fn count_launch(tid: u32) {
    bump(&LAUNCHES);
    if let Some(state) = thread_state(tid, true) {
        // SAFETY: only this thread writes its own state.
        unsafe { (*state).launches += 1 };
    }
}

/// How a launch program learns which entry point fired and how many bytes
/// the function pushed before the probe point.
#[derive(Clone, Copy)]
enum Site {
    /// A program of the entry point's own: its id is built in, and nothing
    /// was pushed (or the arguments are all in registers).
    Fixed(LaunchApi),
    /// The shared program of an argument shape: both travel in the attach
    /// cookie, the id in the low 32 bits, the pushed bytes in the high 32.
    Cookie,
}

impl Site {
    /// (`LaunchApi` id, pushed bytes). Every helper call costs the traced
    /// thread a kernel function call and return (≈55 ns each on the bench
    /// host, with its return-stack mitigation), which is why each entry point
    /// has a program of its own rather than reading its id from the cookie.
    #[inline(always)]
    fn resolve(self, ctx: &ProbeContext) -> (u32, u64) {
        match self {
            Self::Fixed(api) => (api as u32, 0),
            Self::Cookie => {
                let c = cookie(ctx);
                (c as u32, c >> 32)
            }
        }
    }
}

/// Counts a launch of entry point `api` and, unless only counting, writes its
/// record into the thread's stage (or, without one, a reserved ring record):
/// the header here, the arguments by `fill`. Returns whether `fill` ran.
#[inline(always)]
fn emit_launch(tid: u32, api: u32, fill: impl FnOnce(&mut LaunchRecord)) -> bool {
    count_launch(tid);
    // SAFETY: plain read of a loader-set global.
    if unsafe { core::ptr::read_volatile(&EMIT_LAUNCHES) } == 0 {
        // `--launches count`: the arguments are never read.
        return false;
    }
    if let Some(stage) = thread_stage(tid, true) {
        // SAFETY: a valid array element; only its holder, this thread, writes it.
        let stage = unsafe { &mut *stage };
        let len = stage.len as usize;
        if let Some(record) = stage.records.get_mut(len) {
            write_launch(tid, api, record, fill);
            stage.len = (len + 1) as u32;
            if len + 1 == STAGE_LEN {
                flush_stage(stage);
            }
            return true;
        }
    }
    let Some(mut entry) = EVENTS.reserve::<LaunchRecord>(0) else {
        bump(&LOST);
        return false;
    };
    // SAFETY: the reserved record is ours until submitted.
    write_launch(tid, api, unsafe { &mut *entry.as_mut_ptr() }, fill);
    entry.submit(submit_flags());
    true
}

/// Writes a launch record: the header and `api` here, the rest by `fill`.
#[inline(always)]
fn write_launch(tid: u32, api: u32, record: &mut LaunchRecord, fill: impl FnOnce(&mut LaunchRecord)) {
    write_header(&mut record.header, RecordKind::Launch, tid);
    record.api = api;
    fill(record);
}

/// Whether a driver launch on this thread is the one the runtime makes on
/// behalf of a runtime launch (already counted as that); if so it uses that
/// runtime launch up. `pushed`: bytes the driver entry point pushed before
/// its probe point.
///
/// The runtime launch's entry probe noted where its return address lay. The
/// driver launch is the runtime's when, with that runtime launch not used up
/// and at or above it in the stack, the driver entry point's own return
/// address either lies in a runtime library's code (the runtime called it),
/// or sits in the very slot the runtime launch's did and equals it (the
/// runtime tail-called it). The runtime makes one driver launch per runtime
/// launch, so the first one found uses it up. What remains is a runtime
/// launch the runtime rejected before reaching the driver, followed on the
/// same thread by a driver launch from the same call instruction at the same
/// depth: only a caller that dispatches both APIs through one function
/// pointer could do that.
///
/// A return probe would say exactly when the runtime call ends, but costs
/// every runtime launch a second trap (≈800 ns here); this costs a driver
/// launch one user-memory read, and only when its thread has a runtime launch
/// not yet used up at or above it in the stack.
#[inline(always)]
fn in_runtime_launch(ctx: &ProbeContext, tid: u32, pushed: u64) -> bool {
    // An array lookup (inlined by the verifier) spares the rest on every
    // driver launch of a process that has no probed runtime.
    if RUNTIME_PROBED.get(0).is_none_or(|v| *v == 0) {
        return false;
    }
    let Some(state) = thread_state(tid, false) else { return false };
    // SAFETY: a valid map value.
    let frame: *mut RuntimeFrame = unsafe { &raw mut (*state).runtime };
    let sp = entry_sp(ctx, pushed);
    // SAFETY: a valid map value, written only by this thread.
    let frame_sp = unsafe { (*frame).sp };
    if frame_sp == 0 || sp > frame_sp {
        return false;
    }
    // SAFETY: bpf_probe_read_user tolerates any address.
    let Ok(ret) = (unsafe { bpf_probe_read_user(sp as *const u64) }) else { return false };
    // The frame is read again rather than kept across the helper call: a
    // value kept is a stack slot (see `stack_words`).
    // SAFETY: as above.
    let (frame_sp, frame_ret) =
        unsafe { (core::ptr::read_volatile(&(*frame).sp), core::ptr::read_volatile(&(*frame).ret)) };
    let inside = if sp == frame_sp { ret == frame_ret } else { in_runtime_text(ret) };
    if inside {
        // SAFETY: as above.
        unsafe { (*frame).sp = 0 };
    }
    inside
}

/// Notes the runtime launch whose return address `ret` lies at `sp` as the
/// thread's current one (see `in_runtime_launch`).
#[inline(always)]
fn enter_runtime_launch(tid: u32, sp: u64, ret: u64) {
    if let Some(state) = thread_state(tid, true) {
        // SAFETY: only this thread writes its own state.
        unsafe { (*state).runtime = RuntimeFrame { sp, ret } };
    }
}

/// The six integer argument registers at a function's entry (rdi, rsi, rdx,
/// rcx, r8, r9), each read at a fixed offset before any is chosen: a choice
/// folded into the context offset is rejected by the verifier.
#[inline(always)]
pub(crate) fn int_args(ctx: &ProbeContext) -> [u64; 6] {
    // SAFETY: `regs` is the kernel-provided pt_regs of this probe.
    unsafe {
        let p = ctx.regs;
        [
            core::ptr::read_volatile(&(*p).rdi),
            core::ptr::read_volatile(&(*p).rsi),
            core::ptr::read_volatile(&(*p).rdx),
            core::ptr::read_volatile(&(*p).rcx),
            core::ptr::read_volatile(&(*p).r8),
            core::ptr::read_volatile(&(*p).r9),
        ]
    }
}

/// Where the function's return address lies: the stack pointer at its entry,
/// `pushed` bytes above the probe point's when it pushed that much first.
#[inline(always)]
fn entry_sp(ctx: &ProbeContext, pushed: u64) -> u64 {
    // SAFETY: `regs` is the kernel-provided pt_regs of this probe.
    unsafe { (*ctx.regs).rsp + pushed }
}

/// `N` words of the target's memory at `at`, in one read (8 bytes cost as
/// much as 32) into a buffer on the program's stack. Where the buffer is
/// matters: on the task's kernel stack the kernel's hardened-usercopy check
/// passes at its first test, while in map memory, or on the per-CPU private
/// stack the kernel gives a program whose stack reaches 64 bytes, each read
/// costs ≈40 ns more here (measured). So the launch programs keep their
/// stack under 64 bytes: nothing is kept across a helper call that need not be.
#[inline(always)]
fn stack_words<const N: usize>(at: u64) -> Option<[u64; N]> {
    // SAFETY: bpf_probe_read_user tolerates any address.
    unsafe { bpf_probe_read_user(at as *const [u64; N]) }.ok()
}

/// `N` (at most 5) words of the target's memory at `at`, in one read into the
/// record's own argument bytes, `function` onwards, which the caller then
/// fills in: for reads too large for the stack budget (see `stack_words`).
#[inline(always)]
fn record_words<const N: usize>(r: &mut LaunchRecord, at: u64) -> Option<[u64; N]> {
    const { assert!(N * 8 <= core::mem::size_of::<LaunchRecord>() - core::mem::offset_of!(LaunchRecord, function)) };
    let dst = (&raw mut r.function).cast::<[u64; N]>();
    // SAFETY: `function` starts the record's last 40 bytes (u64, u64, 6 × u32),
    // 8-byte aligned and the caller's to overwrite; the helper tolerates any
    // source address and writes at most the size given.
    let rc = unsafe { probe_read_user_raw(dst.cast(), (N * 8) as u32, at as *const core::ffi::c_void) };
    // SAFETY: as above; the helper filled the words.
    (rc == 0).then(|| unsafe { *dst })
}

#[inline(always)]
fn reg(ctx: &ProbeContext, n: usize) -> u64 {
    ctx.arg::<u64>(n).unwrap_or(0)
}

/// `CUresult cuLaunchKernel(CUfunction f, unsigned gridX, gridY, gridZ,
/// blockX, blockY, blockZ, unsigned sharedMemBytes, CUstream hStream, void
/// **kernelParams, void **extra)` and `cuLaunchCooperativeKernel` (same up to
/// `kernelParams`): six register arguments, then blockZ, sharedMemBytes and
/// hStream on the stack.
#[inline(always)]
fn driver_classic(ctx: &ProbeContext, site: Site) {
    driver_launch(ctx, site, |r, pushed| {
        let [block_z, shared, stream] = stack_words::<3>(entry_sp(ctx, pushed) + 8).unwrap_or([0; 3]);
        r.function = reg(ctx, 0);
        r.grid = [reg(ctx, 1) as u32, reg(ctx, 2) as u32, reg(ctx, 3) as u32];
        r.block = [reg(ctx, 4) as u32, reg(ctx, 5) as u32, block_z as u32];
        r.shared_mem_bytes = shared as u32;
        r.stream = stream;
    });
}

/// A driver launch: counted and recorded, unless it is the one the runtime
/// makes for a runtime launch. `fill` gets the bytes the entry point pushed
/// before the probe point.
#[inline(always)]
fn driver_launch(ctx: &ProbeContext, site: Site, fill: impl FnOnce(&mut LaunchRecord, u64)) {
    let Some(tid) = target_tid() else { return };
    let (api, pushed) = site.resolve(ctx);
    if in_runtime_launch(ctx, tid, pushed) {
        return;
    }
    emit_launch(tid, api, |r| fill(r, pushed));
}

/// Fills a record from a launch-config call (the config pointer first, the
/// function second), zeros where the config cannot be read.
///
/// The launch-config struct of `cuLaunchKernelEx` (`CUlaunchConfig`) and of
/// `cudaLaunchKernelExC` (`cudaLaunchConfig_t`) starts with what is read, five
/// words: grid and block dims (6 × u32), dynamic shared memory (a u32 and
/// padding in the driver's, a size_t in the runtime's: the low 32 bits either
/// way, on little-endian x86-64), and the stream.
#[inline(always)]
fn fill_from_config(ctx: &ProbeContext, r: &mut LaunchRecord) {
    let [g, gb, b, shared, stream] = record_words::<5>(r, reg(ctx, 0)).unwrap_or([0; 5]);
    r.function = reg(ctx, 1);
    r.grid = [g as u32, (g >> 32) as u32, gb as u32];
    r.block = [(gb >> 32) as u32, b as u32, (b >> 32) as u32];
    r.shared_mem_bytes = shared as u32;
    r.stream = stream;
}

/// `CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f,
/// void **kernelParams, void **extra)`.
#[inline(always)]
fn driver_ex(ctx: &ProbeContext, site: Site) {
    driver_launch(ctx, site, |r, _| fill_from_config(ctx, r));
}

/// Fills a graph launch's record: the executable graph and the stream.
#[inline(always)]
fn fill_graph(ctx: &ProbeContext, r: &mut LaunchRecord) {
    r.function = reg(ctx, 0);
    r.stream = reg(ctx, 1);
    r.grid = [0; 3];
    r.block = [0; 3];
    r.shared_mem_bytes = 0;
}

/// `CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)`.
#[inline(always)]
fn driver_graph(ctx: &ProbeContext, site: Site) {
    driver_launch(ctx, site, |r, _| fill_graph(ctx, r));
}

/// `cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3
/// blockDim, void **args, size_t sharedMem, cudaStream_t stream)` and
/// `cudaLaunchCooperativeKernel` (same). A `dim3` (12 bytes) is passed in two
/// registers: x | y << 32, then z.
#[inline(always)]
fn runtime_classic(ctx: &ProbeContext, site: Site) {
    let Some(tid) = target_tid() else { return };
    let (api, pushed) = site.resolve(ctx);
    let sp = entry_sp(ctx, pushed);
    let mut ret = None;
    let recorded = emit_launch(tid, api, |r| {
        // The return address and both stack arguments, in one read.
        let words = stack_words::<3>(sp);
        ret = words.map(|w| w[0]);
        let [_, shared, stream] = words.unwrap_or([0; 3]);
        let (g, gz, b, bz) = (reg(ctx, 1), reg(ctx, 2), reg(ctx, 3), reg(ctx, 4));
        r.function = reg(ctx, 0);
        r.grid = [g as u32, (g >> 32) as u32, gz as u32];
        r.block = [b as u32, (b >> 32) as u32, bz as u32];
        r.shared_mem_bytes = shared as u32;
        r.stream = stream;
    });
    if !recorded {
        // `--launches count`, or no room for the record: the return address alone.
        ret = stack_words::<1>(sp).map(|[r]| r);
    }
    if let Some(ret) = ret {
        enter_runtime_launch(tid, sp, ret);
    }
}

/// `cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const
/// void *func, void **args)`.
#[inline(always)]
fn runtime_ex(ctx: &ProbeContext, site: Site) {
    runtime_register_launch(ctx, site, |r| fill_from_config(ctx, r));
}

/// A launch of a runtime entry point that takes every argument in registers:
/// notes the runtime frame (see `in_runtime_launch`), then counts and records.
#[inline(always)]
fn runtime_register_launch(ctx: &ProbeContext, site: Site, fill: impl FnOnce(&mut LaunchRecord)) {
    let Some(tid) = target_tid() else { return };
    let (api, pushed) = site.resolve(ctx);
    let sp = entry_sp(ctx, pushed);
    if let Some([ret]) = stack_words::<1>(sp) {
        enter_runtime_launch(tid, sp, ret);
    }
    emit_launch(tid, api, fill);
}

/// `cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream)`.
#[inline(always)]
fn runtime_graph(ctx: &ProbeContext, site: Site) {
    runtime_register_launch(ctx, site, |r| fill_graph(ctx, r));
}

/// The launch programs: one per entry point, named after it
/// (`LaunchApi::program`), with its id built in; and, for probes moved past
/// `push`es on entry points that read the stack, one per argument shape, which
/// takes id and pushed bytes from the cookie.
mod launch_programs {
    #![allow(non_snake_case)]

    use super::{LaunchApi::*, Site::*, *};

    macro_rules! launch_programs {
        ($($name:ident => $shape:ident($site:expr);)*) => {$(
            #[uprobe]
            pub fn $name(ctx: ProbeContext) -> u32 {
                $shape(&ctx, $site);
                0
            }
        )*};
    }

    launch_programs! {
        cuLaunchKernel => driver_classic(Fixed(CuLaunchKernel));
        cuLaunchKernel_ptsz => driver_classic(Fixed(CuLaunchKernelPtsz));
        cuLaunchCooperativeKernel => driver_classic(Fixed(CuLaunchCooperativeKernel));
        cuLaunchCooperativeKernel_ptsz => driver_classic(Fixed(CuLaunchCooperativeKernelPtsz));
        cuLaunchKernelEx => driver_ex(Fixed(CuLaunchKernelEx));
        cuLaunchKernelEx_ptsz => driver_ex(Fixed(CuLaunchKernelExPtsz));
        cuGraphLaunch => driver_graph(Fixed(CuGraphLaunch));
        cuGraphLaunch_ptsz => driver_graph(Fixed(CuGraphLaunchPtsz));
        cudaLaunchKernel => runtime_classic(Fixed(CudaLaunchKernel));
        cudaLaunchKernel_ptsz => runtime_classic(Fixed(CudaLaunchKernelPtsz));
        cudaLaunchCooperativeKernel => runtime_classic(Fixed(CudaLaunchCooperativeKernel));
        cudaLaunchCooperativeKernel_ptsz => runtime_classic(Fixed(CudaLaunchCooperativeKernelPtsz));
        cudaLaunchKernelExC => runtime_ex(Fixed(CudaLaunchKernelExC));
        cudaLaunchKernelExC_ptsz => runtime_ex(Fixed(CudaLaunchKernelExCPtsz));
        cudaGraphLaunch => runtime_graph(Fixed(CudaGraphLaunch));
        cudaGraphLaunch_ptsz => runtime_graph(Fixed(CudaGraphLaunchPtsz));
        launch_driver_classic => driver_classic(Cookie);
        launch_runtime_classic => runtime_classic(Cookie);
        launch_runtime_ex => runtime_ex(Cookie);
        launch_runtime_graph => runtime_graph(Cookie);
    }
}

#[inline(always)]
fn in_runtime_sync(tid: u32) -> bool {
    RUNTIME_PROBED.get(0).is_some_and(|v| *v != 0)
        // SAFETY: a valid map value.
        && thread_state(tid, false).is_some_and(|s| unsafe { (*s).in_runtime_sync } != 0)
}

/// Marks or clears the thread as inside a runtime synchronisation call.
#[inline(always)]
fn set_in_runtime_sync(tid: u32, inside: bool) {
    if let Some(state) = thread_state(tid, inside) {
        // SAFETY: only this thread writes its own state.
        unsafe { (*state).in_runtime_sync = inside.into() };
    }
}

/// Entry of a host synchronisation call (`cookie`: its `SyncApi` id). A
/// runtime call marks its thread, so that the driver call it makes is not
/// counted again; the mark is cleared by `sync_exit` (syncs are not hot: a
/// return probe is needed for the wait time anyway).
#[uprobe]
pub fn sync_enter(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let api = cookie(&ctx) as u32;
    if ApiLayer::of(api) == ApiLayer::Runtime {
        set_in_runtime_sync(tid, true);
    } else if in_runtime_sync(tid) {
        return 0;
    }
    emit_ordered(tid, RecordKind::SyncEnter, api);
    0
}

/// Return of a host synchronisation call.
#[uretprobe]
pub fn sync_exit(ctx: RetProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let api = cookie(&ctx) as u32;
    if ApiLayer::of(api) == ApiLayer::Runtime {
        set_in_runtime_sync(tid, false);
    } else if in_runtime_sync(tid) {
        return 0;
    }
    emit_ordered(tid, RecordKind::SyncExit, api);
    0
}

/// A naming call in progress on a thread: where the handle will be written,
/// and the name (or, for `cuKernelGetFunction`, the kernel handle).
#[repr(C)]
#[derive(Clone, Copy)]
struct PendingName {
    which: u32,
    _pad: u32,
    out: u64,
    arg: u64,
}

#[map]
static NAME_PENDING: HashMap<u32, PendingName> = HashMap::with_max_entries(4096, 0);

/// Entry of `cuModuleGetFunction`, `cuLibraryGetKernel`, `cuKernelGetFunction`
/// (rare calls: entry and return probes are affordable here).
#[uprobe]
pub fn name_enter(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let which = cookie(&ctx) as u32;
    // Both registers are read, with volatile loads: choosing first lets LLVM
    // fold the choice into a variable offset on the context pointer, which
    // the verifier rejects ("dereference of modified ctx ptr").
    // SAFETY: `regs` is the kernel-provided pt_regs of this probe.
    let (rsi, rdx) =
        unsafe { (core::ptr::read_volatile(&(*ctx.regs).rsi), core::ptr::read_volatile(&(*ctx.regs).rdx)) };
    let arg = if which == name_call::KERNEL_GET_FUNCTION { rsi } else { rdx };
    if NAME_PENDING.insert(tid, PendingName { which, _pad: 0, out: reg(&ctx, 0), arg }, 0).is_err() {
        map_failed();
    }
    0
}

/// Return of a naming call: on success, the handle it wrote and the name.
#[uretprobe]
pub fn name_exit(ctx: RetProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    // SAFETY: the value is copied out before the entry is removed.
    let Some(pending) = (unsafe { NAME_PENDING.get(tid) }).copied() else { return 0 };
    let _ = NAME_PENDING.remove(tid);
    if ctx.ret::<u64>() as u32 != 0 {
        return 0; // CUDA_SUCCESS is 0: nothing was returned.
    }
    // SAFETY: bpf_probe_read_user tolerates any address.
    let Ok(handle) = (unsafe { bpf_probe_read_user(pending.out as *const u64) }) else { return 0 };
    let Some(mut entry) = EVENTS.reserve::<KernelNameRecord>(0) else {
        bump(&LOST);
        return 0;
    };
    let p = entry.as_mut_ptr();
    // SAFETY: `p` points at the reserved record; every field is written
    // before submit (the name by the helper, or its first byte here).
    unsafe {
        write_header(&mut (*p).header, RecordKind::KernelName, tid);
        (*p).which = pending.which;
        (*p)._pad = 0;
        (*p).handle = handle;
        if pending.which == name_call::KERNEL_GET_FUNCTION {
            (*p).kernel = pending.arg;
            (*p).name[0] = 0;
        } else {
            (*p).kernel = 0;
            if bpf_probe_read_user_str_bytes(pending.arg as *const u8, &mut (*p).name).is_err() {
                (*p).name[0] = 0;
            }
        }
    }
    entry.submit(submit_flags());
    0
}

/// Writes an ordered record for the thread (`kind`: a step or sync entry or
/// return), with its sequence number and step depth.
#[inline(always)]
fn emit_ordered(tid: u32, kind: RecordKind, probe: u32) {
    let o = ordered_state(tid, kind);
    write_ordered_record(tid, kind, probe, &o);
}

/// Where a thread stands at one of its ordered records: the record's
/// sequence number, its step depth after the record, its launch count, where
/// its time has gone, and the moment these are of (the record's stamp).
pub(crate) struct Ordered {
    pub seq: u32,
    pub depth: u32,
    pub launches: u64,
    pub sched: SchedTimes,
    pub ts_ns: u64,
}

/// Before an ordered record of the thread (`kind`): flushes its staged
/// launches, and returns where the thread stands ([`Ordered`]). Split out of
/// `emit_ordered` for the records of the other families, which carry the
/// same sequence.
#[inline(always)]
pub(crate) fn ordered_state(tid: u32, kind: RecordKind) -> Ordered {
    // The thread's staged launches go first: the agent, reading the launch
    // ring before the ordered ring, then has every launch that precedes an ordered
    // record by the time it reads that record (see `profiler::events::OrderedQueue`).
    if let Some(stage) = thread_stage(tid, false) {
        // SAFETY: a valid array element; only its holder, this thread, writes it.
        flush_stage(unsafe { &mut *stage });
    }
    match thread_state(tid, true) {
        Some(state) => {
            let (sched, ts_ns) = sched::snapshot(state, (bpf_get_current_pid_tgid() >> 32) as u32);
            // SAFETY: only this thread writes these fields of its own state.
            let state = unsafe { &mut *state };
            state.seq = next_seq(state.seq);
            if kind == RecordKind::StepEnter {
                state.step_depth += 1;
            } else if kind == RecordKind::StepExit {
                state.step_depth = state.step_depth.saturating_sub(1);
            }
            Ordered { seq: state.seq, depth: state.step_depth, launches: state.launches, sched, ts_ns }
        }
        // SAFETY: a helper without preconditions.
        None => Ordered {
            seq: 0,
            depth: 0,
            launches: 0,
            sched: SchedTimes::default(),
            ts_ns: unsafe { bpf_ktime_get_ns() },
        },
    }
}

/// The sequence number after `seq`: 0 means "none", so it is skipped.
#[inline(always)]
fn next_seq(seq: u32) -> u32 {
    if seq == u32::MAX { 1 } else { seq + 1 }
}

#[inline(always)]
fn write_ordered_record(tid: u32, kind: RecordKind, probe: u32, o: &Ordered) {
    match ORDERED_EVENTS.reserve::<OrderedRecord>(0) {
        Some(mut entry) => {
            let mut header = header(kind, tid);
            header.ts_ns = o.ts_ns;
            entry.write(OrderedRecord {
                header,
                probe,
                seq: o.seq,
                thread_launches: o.launches,
                depth: o.depth,
                _pad: 0,
                sched: o.sched,
            });
            entry.submit(submit_flags());
        }
        None => bump(&LOST_ORDERED),
    }
}

/// Releases element `index` of an array claimed through `claims`, which the
/// exiting thread held and has zeroed: the claim goes last, so a thread that
/// claims the element next finds it zeroed, and none can claim it before.
#[inline(always)]
fn release_claim(claims: &HashMap<u32, u32>, index: u32) {
    if claims.remove(index).is_err() {
        map_failed();
    }
}

/// A thread of the target exits (`sched_process_exit` runs in the exiting
/// task): its staged launches go to the ring, its slot, stage, fallback entry
/// and pending kernel name are released, and, if it had state, a
/// `ThreadExit` record tells the agent it is gone. A raw tracepoint: it needs
/// no tracefs, which is not mounted by default.
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn thread_exit(_ctx: RawTracePointContext) -> i32 {
    let Some(tid) = target_tid() else { return 0 };
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // The main thread's exit is the process's, for the agent: it ends that
    // process's session, and the tgid, which may come back as another
    // process, is no longer traced.
    if tid == tgid && TRACED.remove(tgid).is_ok() {
        forget_code_ranges(tgid);
        emit_process(RecordKind::ProcessExit, tid, tgid, 0);
    }
    if let Some(stage) = thread_stage(tid, false) {
        // SAFETY: a valid array element; only its holder, this thread, writes it.
        let stage = unsafe { &mut *stage };
        flush_stage(stage); // leaves `len` 0; the records past it are never read
        stage.tid = 0;
        release_claim(&STAGE_CLAIMS, tid & (STAGES - 1));
    }
    let _ = NAME_PENDING.remove(tid);
    torch::forget_thread(tid);
    nccl::forget_thread(tid);
    blas::forget_thread(tid);
    copies::forget_thread(tid);
    let index = slot_index(tid);
    let Some(slot) = THREAD_SLOTS.get_ptr_mut(index) else { return 0 };
    // SAFETY: a valid array element.
    let (state, in_slot) = if unsafe { (*slot).tid } == tid {
        (slot, true)
    } else {
        match THREAD_FALLBACK.get_ptr_mut(tid) {
            Some(entry) => (entry, false),
            None => return 0,
        }
    };
    // SAFETY: a valid map value; its thread is exiting, so nothing else writes it.
    let (seq, depth, launches) = unsafe { (next_seq((*state).seq), (*state).step_depth, (*state).launches) };
    // Not on the record: a thread's last figures are of no step.
    // SAFETY: a helper without preconditions.
    let ts_ns = unsafe { bpf_ktime_get_ns() };
    let exit = Ordered { seq, depth, launches, sched: SchedTimes::default(), ts_ns };
    if in_slot {
        // SAFETY: as above.
        unsafe { core::ptr::write_bytes(slot, 0, 1) };
        release_claim(&SLOT_CLAIMS, index);
    } else if THREAD_FALLBACK.remove(tid).is_err() {
        map_failed();
    }
    write_ordered_record(tid, RecordKind::ThreadExit, 0, &exit);
    0
}

/// Writes a [`ProcessRecord`] on the ordered ring (rare: a fork, exec or exit).
#[inline(always)]
fn emit_process(kind: RecordKind, tid: u32, pid: u32, parent: u32) {
    match ORDERED_EVENTS.reserve::<ProcessRecord>(0) {
        Some(mut entry) => {
            entry.write(ProcessRecord { header: header(kind, tid), pid, parent });
            entry.submit(submit_flags());
        }
        None => bump(&LOST_ORDERED),
    }
}

/// A task is being forked (`sched_process_fork(parent, child)`, in the
/// parent, before the child first runs), with `FOLLOW_CHILDREN`: a new
/// process (not a thread) of a traced one is traced from its first
/// instruction, and the agent told. The child's pid and tgid are read at
/// their offsets in `struct task_struct`, which the agent took from the
/// kernel's BTF (`TASK_PID_OFFSET`, `TASK_TGID_OFFSET`): a raw tracepoint,
/// where kprobes and tracefs may be missing.
#[raw_tracepoint(tracepoint = "sched_process_fork")]
pub fn process_fork(ctx: RawTracePointContext) -> i32 {
    // SAFETY: a plain read of a global the loader patched.
    if unsafe { core::ptr::read_volatile(&FOLLOW_CHILDREN) } == 0 || stopped() {
        return 0;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let parent = (pid_tgid >> 32) as u32;
    // SAFETY: a lookup whose value is not kept.
    if unsafe { TRACED.get(parent) }.is_none() {
        return 0;
    }
    let child: *const u8 = ctx.arg(1);
    // SAFETY: plain reads of globals the loader patched.
    let (pid_at, tgid_at) =
        unsafe { (core::ptr::read_volatile(&TASK_PID_OFFSET), core::ptr::read_volatile(&TASK_TGID_OFFSET)) };
    // SAFETY: bpf_probe_read_kernel tolerates any address.
    let (Ok(pid), Ok(tgid)) = (unsafe {
        (
            bpf_probe_read_kernel(child.wrapping_add(pid_at as usize).cast::<u32>()),
            bpf_probe_read_kernel(child.wrapping_add(tgid_at as usize).cast::<u32>()),
        )
    }) else {
        return 0;
    };
    if pid != tgid || pid == 0 {
        return 0; // a thread
    }
    if TRACED.insert(pid, parent, 0).is_err() {
        map_failed();
        return 0;
    }
    emit_process(RecordKind::ProcessFork, pid_tgid as u32, pid, parent);
    0
}

/// A traced process exec'ed (`sched_process_exec` runs in it, after the new
/// program is in place): the agent reads its new command, environment and
/// libraries.
#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn process_exec(_ctx: RawTracePointContext) -> i32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: a lookup whose value is not kept.
    if stopped() || unsafe { TRACED.get(tgid) }.is_none() {
        return 0;
    }
    // The old image's libraries are gone; the agent registers the new one's as it finds them.
    forget_code_ranges(tgid);
    emit_process(RecordKind::ProcessExec, pid_tgid as u32, tgid, 0);
    0
}

/// The code ranges of process `tgid`'s libraries, registered by the agent,
/// go with its image (at exit, or exec): a later process with the same tgid
/// starts with none, and the maps do not fill up over a long job.
#[inline(always)]
fn forget_code_ranges(tgid: u32) {
    let _ = RUNTIME_TEXT.remove(tgid);
    blas::forget_process(tgid);
    cpu::forget_process(tgid);
}

/// Entry of the step function. Nesting is resolved in user space, which sees
/// every entry and return in per-thread order.
#[uprobe]
pub fn step_enter(ctx: ProbeContext) -> u32 {
    if let Some(tid) = target_tid() {
        emit_ordered(tid, RecordKind::StepEnter, cookie(&ctx) as u32);
    }
    0
}

/// Return of the step function. The kernel drops uretprobes nested deeper than
/// 64 frames (MAX_URETPROBE_DEPTH); recursion that deep loses the returns.
#[uretprobe]
pub fn step_exit(ctx: RetProbeContext) -> u32 {
    if let Some(tid) = target_tid() {
        emit_ordered(tid, RecordKind::StepExit, cookie(&ctx) as u32);
    }
    0
}

/// The dynamic loader's `_dl_debug_state`, which it calls before and after
/// each change to the loaded objects (the hook debuggers use): the agent
/// reads the target's maps for new CUDA libraries when it sees the record,
/// rather than polling them.
#[uprobe]
pub fn loader_change(_ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    // On the ordered ring: rare, and not to be crowded out by launches.
    match ORDERED_EVENTS.reserve::<RecordHeader>(0) {
        Some(mut entry) => {
            entry.write(header(RecordKind::LoaderChange, tid));
            entry.submit(submit_flags());
        }
        None => bump(&LOST_ORDERED),
    }
    0
}

/// Does nothing: the benchmark's floor, the cost of a bare uprobe.
#[uprobe]
pub fn bare_probe(_ctx: ProbeContext) -> u32 {
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
