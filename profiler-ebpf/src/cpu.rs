//! CPU samples of the traced threads (`--cpu-sample HZ`): a perf_event
//! program on each CPU's `cpu-clock` software event, which fires every
//! 1/HZ s of that CPU's time whatever runs on it. A traced thread on the CPU
//! then gets a `CpuSampleRecord`: its user leaf, its user stack (frame
//! pointers, `bpf_get_stackid`) and, in the kernel, its kernel stack; every
//! other task costs the traced check and nothing more.
//!
//! A thread of a CPython process the agent described (`PY_PROCS`) gets a
//! `CpuSamplePythonRecord` instead: the same, and the code objects of its
//! Python frames, walked from its thread state (found by `pthread_self()` in
//! the main interpreter's list, then cached per thread). User space names
//! each code object once (its qualified name, file and first line) and puts
//! the Python frames in the native stack where the interpreter's loop is.
//!
//! Stacks go to `CPU_STACKS` without `BPF_F_REUSE_STACKID`: an id, once
//! given, keeps its stack, so user space may read it whenever it sees the
//! id. A stack whose bucket holds another one gets `-EEXIST`; its sample
//! keeps the leaf, and the miss is counted (`CPU_STACK_FAILURES`).
use aya_ebpf::{
    bindings::BPF_F_USER_STACK,
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_current_task, bpf_get_stack, bpf_probe_read_kernel, bpf_probe_read_user,
    },
    macros::{map, perf_event},
    maps::{HashMap, LruHashMap, PerCpuArray, StackTrace},
    programs::{PerfEventContext, tracing::StackIdContext},
};
use profiler_common::{
    CPU_STACKS as CPU_STACK_ENTRIES, CpuSamplePythonRecord, CpuSampleRecord, NO_STACK, PY_FRAME_ENTRY, PY_FRAME_SHIM,
    PY_NO_FIELD, PY_STACK_DEPTH, PyStackLayout, RecordKind, py_boundary,
};

use crate::{EVENTS, bump, header, stopped, traced};

/// The samples' stacks, by id (see the module comment).
#[map]
static CPU_STACKS: StackTrace = StackTrace::with_max_entries(CPU_STACK_ENTRIES, 0);

/// Samples of traced threads taken, per CPU.
#[map]
static CPU_SAMPLES: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Samples the launch ring had no room for, per CPU. Not in `LOST`: they
/// cost a profile a sample, not a launch row, and are stored apart.
#[map]
static LOST_CPU_SAMPLES: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Stacks `bpf_get_stackid` did not keep (bucket taken, nothing readable), per CPU.
#[map]
static CPU_STACK_FAILURES: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// The CPython processes whose samples carry Python frames, by tgid (the agent's).
#[map]
static PY_PROCS: HashMap<u32, PyStackLayout> = HashMap::with_max_entries(1024, 0);

/// A thread's Python thread state, as last found (checked again at each use).
#[map]
static PY_THREADS: LruHashMap<u32, u64> = LruHashMap::with_max_entries(8192, 0);

/// Thread states looked at before a thread is taken for one without any.
const PY_MAX_THREADS: u32 = 64;

/// x86-64: the privilege level of the interrupted code is `cs`'s low two bits.
const USER_MODE: u64 = 3;

#[perf_event]
pub fn cpu_sample(ctx: PerfEventContext) -> u32 {
    if stopped() {
        return 0;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let (tid, tgid) = (pid_tgid as u32, (pid_tgid >> 32) as u32);
    if tid == 0 || !traced(tid, tgid) {
        return 0;
    }
    bump(&CPU_SAMPLES);
    // SAFETY: the context of a perf_event program is a `bpf_perf_event_data`
    // whose registers the verifier lets it read directly.
    let (cs, ip) = unsafe { ((*ctx.ctx).regs.cs, (*ctx.ctx).regs.rip) };
    let in_user = cs & 3 == USER_MODE;
    let kernel_stack = if in_user { NO_STACK } else { stack_id(&ctx, 0) };
    let user_stack = stack_id(&ctx, u64::from(BPF_F_USER_STACK));
    let user_ip = if in_user { ip } else { user_leaf(&ctx) };
    // SAFETY: a copy out of the map value.
    if let Some(layout) = unsafe { PY_PROCS.get(tgid) }.copied() {
        let Some(mut entry) = EVENTS.reserve::<CpuSamplePythonRecord>(0) else {
            bump(&LOST_CPU_SAMPLES);
            return 0;
        };
        let record = entry.as_mut_ptr();
        // SAFETY: the reserved entry is ours, and large enough for the record.
        unsafe {
            (*record).sample =
                CpuSampleRecord { header: header(RecordKind::CpuSamplePython, tid), user_ip, user_stack, kernel_stack };
            (*record).depth = 0;
            (*record).truncated = 0;
            python_frames(&layout, tid, record);
        }
        entry.submit(crate::submit_flags());
        return 0;
    }
    match EVENTS.reserve::<CpuSampleRecord>(0) {
        Some(mut entry) => {
            entry.write(CpuSampleRecord {
                header: header(RecordKind::CpuSample, tid),
                user_ip,
                user_stack,
                kernel_stack,
            });
            entry.submit(crate::submit_flags());
        }
        None => bump(&LOST_CPU_SAMPLES),
    }
    0
}

/// A process's image is gone (exit, exec): its Python layout goes with it.
#[inline(always)]
pub fn forget_process(tgid: u32) {
    let _ = PY_PROCS.remove(tgid);
}

/// Reads a `T` of the sampled process at `addr`.
#[inline(always)]
fn read<T>(addr: u64) -> Option<T> {
    // SAFETY: bpf_probe_read_user tolerates any address.
    unsafe { bpf_probe_read_user(addr as *const T) }.ok()
}

/// The thread state of thread `tid`, known by `id`: its id, or its `fsbase`
/// (its `pthread_self()`), as the layout says.
#[inline(always)]
fn thread_state(layout: &PyStackLayout, tid: u32, id: u64) -> Option<u64> {
    let id_at = u64::from(layout.tstate_thread_id);
    // SAFETY: a copy out of the map value.
    if let Some(&known) = unsafe { PY_THREADS.get(tid) }
        && read::<u64>(known.wrapping_add(id_at)) == Some(id)
    {
        return Some(known);
    }
    let interp = read::<u64>(layout.interpreters_head)?;
    let mut tstate = read::<u64>(interp.wrapping_add(u64::from(layout.threads_head)))?;
    for _ in 0..PY_MAX_THREADS {
        if tstate == 0 {
            return None;
        }
        if read::<u64>(tstate.wrapping_add(id_at))? == id {
            let _ = PY_THREADS.insert(tid, tstate, 0);
            return Some(tstate);
        }
        tstate = read::<u64>(tstate.wrapping_add(u64::from(layout.tstate_next)))?;
    }
    None
}

/// Writes the thread's Python frames into `record` (innermost first), one
/// slot per frame of its chain: the slot index is the loop's own, which
/// keeps the verifier's work linear in the depth.
///
/// # Safety
/// `record` points at a reserved ring entry.
#[inline(always)]
unsafe fn python_frames(layout: &PyStackLayout, tid: u32, record: *mut CpuSamplePythonRecord) {
    let id = if layout.by_native_id != 0 {
        u64::from(tid)
    } else {
        // SAFETY: the current task is a kernel pointer the helper reads safely.
        let task = unsafe { bpf_get_current_task() };
        match unsafe { bpf_probe_read_kernel((task + u64::from(layout.task_fsbase)) as *const u64) } {
            Ok(fsbase) => fsbase,
            Err(_) => return,
        }
    };
    let Some(tstate) = thread_state(layout, tid, id) else { return };
    let Some(mut frame) = read::<u64>(tstate.wrapping_add(u64::from(layout.tstate_frame))) else { return };
    if layout.cframe_frame != PY_NO_FIELD {
        let Some(f) = read::<u64>(frame.wrapping_add(u64::from(layout.cframe_frame))) else { return };
        frame = f;
    }
    let mut depth = 0u32;
    for slot in 0..PY_STACK_DEPTH {
        if frame == 0 {
            break;
        }
        let marker = match layout.boundary {
            py_boundary::EVERY_FRAME => 1,
            _ => read::<u8>(frame.wrapping_add(u64::from(layout.frame_marker))).unwrap_or(0),
        };
        let value = if layout.boundary == py_boundary::CSTACK_OWNER && marker >= 3 {
            // Not Python code: a shim of the C stack (the frame above it
            // began a call of the loop), or the interpreter's own base frame.
            if marker == 3 { PY_FRAME_SHIM } else { 0 }
        } else {
            let Some(code) = read::<u64>(frame.wrapping_add(u64::from(layout.frame_code))) else { break };
            let entry = layout.boundary != py_boundary::CSTACK_OWNER && marker != 0;
            (code & layout.code_mask & !7) | (u64::from(entry) * PY_FRAME_ENTRY)
        };
        // SAFETY: `slot` < PY_STACK_DEPTH, the array's length.
        unsafe { (*record).frames[slot] = value };
        depth = slot as u32 + 1;
        let Some(previous) = read::<u64>(frame.wrapping_add(u64::from(layout.frame_previous))) else { break };
        frame = previous;
    }
    // SAFETY: the caller's entry.
    unsafe {
        (*record).depth = depth;
        (*record).truncated = u32::from(depth as usize == PY_STACK_DEPTH && frame != 0);
    }
}

/// The id of the current user (`BPF_F_USER_STACK`) or kernel stack, or the
/// kernel's negative error, counted.
#[inline(always)]
fn stack_id(ctx: &PerfEventContext, flags: u64) -> i32 {
    match ctx.get_stackid(&CPU_STACKS, flags) {
        Ok(id) => id as i32,
        Err(e) => {
            bump(&CPU_STACK_FAILURES);
            e
        }
    }
}

/// The user-mode instruction pointer of a thread sampled in the kernel: the
/// first frame of its user stack (one frame: the registers it entered the
/// kernel with), 0 when there is none.
#[inline(always)]
fn user_leaf(ctx: &PerfEventContext) -> u64 {
    let mut leaf = [0u64; 1];
    // SAFETY: the helper writes at most the 8 bytes it is given.
    let n = unsafe { bpf_get_stack(ctx.ctx.cast(), leaf.as_mut_ptr().cast(), 8, u64::from(BPF_F_USER_STACK)) };
    if n >= 8 { leaf[0] } else { 0 }
}
