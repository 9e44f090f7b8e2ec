//! CPU samples of the traced threads (`--cpu-sample HZ`): a perf_event
//! program on each CPU's `cpu-clock` software event, which fires every
//! 1/HZ s of that CPU's time whatever runs on it. A traced thread on the CPU
//! then gets a `CpuSampleRecord`: its user leaf, its user stack (frame
//! pointers, `bpf_get_stackid`) and, in the kernel, its kernel stack; every
//! other task costs the traced check and nothing more.
//!
//! Stacks go to `CPU_STACKS` without `BPF_F_REUSE_STACKID`: an id, once
//! given, keeps its stack, so user space may read it whenever it sees the
//! id. A stack whose bucket holds another one gets `-EEXIST`; its sample
//! keeps the leaf, and the miss is counted (`CPU_STACK_FAILURES`).
use aya_ebpf::{
    bindings::BPF_F_USER_STACK,
    helpers::{bpf_get_current_pid_tgid, bpf_get_stack},
    macros::{map, perf_event},
    maps::{PerCpuArray, StackTrace},
    programs::{PerfEventContext, tracing::StackIdContext},
};
use profiler_common::{CPU_STACKS as CPU_STACK_ENTRIES, CpuSampleRecord, NO_STACK, RecordKind};

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
