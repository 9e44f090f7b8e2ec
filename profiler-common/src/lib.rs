//! Records that cross the BPF ring buffer, and the ids both sides agree on.
//!
//! Every record is `#[repr(C)]`, `Copy`, has no implicit padding (flags are
//! `u32`, never `bool`) and starts with a [`RecordHeader`], whose `kind` tells
//! the decoder which layout follows. Sizes are asserted at compile time so that
//! a change on one side cannot silently desynchronise the other.
#![no_std]

// Host-side decoding reads records from the ring's bytes without `unsafe`;
// the eBPF build, which has no use for it, does not pull the crate in.
#[cfg(feature = "user")]
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

pub mod copies;

/// What a ring-buffer record is. Stored as `u32` in [`RecordHeader::kind`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    /// A [`LaunchRecord`].
    Launch = 1,
    /// An [`OrderedRecord`] written at the step function's entry.
    StepEnter = 2,
    /// An [`OrderedRecord`] written at the step function's return.
    StepExit = 3,
    /// An [`OrderedRecord`] at the entry of a synchronisation call (`probe`: a [`SyncApi`]).
    SyncEnter = 4,
    /// An [`OrderedRecord`] at the return of a synchronisation call.
    SyncExit = 5,
    /// A [`KernelNameRecord`].
    KernelName = 6,
    /// A bare [`RecordHeader`]: the dynamic loader changed the target's
    /// libraries (`_dl_debug_state`, on every `dlopen` and `dlclose`).
    LoaderChange = 7,
    /// An [`OrderedRecord`] written when a thread of the target exits (`probe` 0):
    /// its kernel-side state is released, and the tid may come back as
    /// another thread, whose sequence starts again at 1.
    ThreadExit = 8,
    /// A [`RegionRecord`]: a PyTorch `record_function` region began .
    RegionEnter = 9,
    /// A [`RegionRecord`] with no name: a `record_function` region ended .
    RegionExit = 10,
    /// A [`CollectiveRecord`]: an NCCL call returned (written at its return).
    Collective = 11,
    /// A [`BlasRecord`]: a cuBLAS/cuBLASLt call (a GEMM, or a cuBLASLt descriptor's life).
    Blas = 12,
    /// A [`copies::CopyRecord`]: a host↔device copy or memset returned.
    Copy = 13,
    /// An [`OffCpuRecord`]: a traced thread is back on a CPU after a time off
    /// it (written only with per-call rows, in the launch ring).
    OffCpu = 14,
    /// A [`CpuSampleRecord`]: a traced thread was on a CPU when the sampling
    /// clock fired (`--cpu-sample HZ`; in the launch ring).
    CpuSample = 15,
    /// A [`CpuSamplePythonRecord`]: a CPU sample of a thread of a CPython
    /// process the agent described (`maps::PY_PROCS`), with its Python frames.
    CpuSamplePython = 16,
    /// A [`ProcessRecord`]: a traced process forked a process (`pid`, its
    /// `parent`), now traced too (`--children`).
    ProcessFork = 20,
    /// A [`ProcessRecord`]: a traced process (`pid`) exec'ed a new program.
    ProcessExec = 21,
    /// A [`ProcessRecord`]: a traced process (`pid`) exited (its main thread did).
    ProcessExit = 22,
    /// A [`JitRecord`]: a call of a `jax.jit` function began (jaxlib's `PjitFunction::Call`).
    JitEnter = 40,
    /// A [`JitRecord`]: that call returned (its dispatch is done, not its device work).
    JitExit = 41,
}

impl RecordKind {
    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            1 => Some(Self::Launch),
            2 => Some(Self::StepEnter),
            3 => Some(Self::StepExit),
            4 => Some(Self::SyncEnter),
            5 => Some(Self::SyncExit),
            6 => Some(Self::KernelName),
            7 => Some(Self::LoaderChange),
            8 => Some(Self::ThreadExit),
            9 => Some(Self::RegionEnter),
            10 => Some(Self::RegionExit),
            11 => Some(Self::Collective),
            12 => Some(Self::Blas),
            13 => Some(Self::Copy),
            14 => Some(Self::OffCpu),
            15 => Some(Self::CpuSample),
            16 => Some(Self::CpuSamplePython),
            20 => Some(Self::ProcessFork),
            21 => Some(Self::ProcessExec),
            22 => Some(Self::ProcessExit),
            40 => Some(Self::JitEnter),
            41 => Some(Self::JitExit),
            _ => None,
        }
    }
}

/// The CUDA entry points that are probed. The discriminant is stored in
/// [`LaunchRecord::api`] and in the `apis` table of the database.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchApi {
    CuLaunchKernel = 1,
    CuLaunchKernelPtsz = 2,
    CuLaunchKernelEx = 3,
    CuLaunchKernelExPtsz = 4,
    CuLaunchCooperativeKernel = 5,
    CuLaunchCooperativeKernelPtsz = 6,
    CuGraphLaunch = 7,
    CuGraphLaunchPtsz = 8,
    CudaLaunchKernel = 101,
    CudaLaunchKernelPtsz = 102,
    CudaLaunchKernelExC = 103,
    CudaLaunchKernelExCPtsz = 104,
    CudaLaunchCooperativeKernel = 105,
    CudaLaunchCooperativeKernelPtsz = 106,
    CudaGraphLaunch = 107,
    CudaGraphLaunchPtsz = 108,
}

/// Which library exports an entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiLayer {
    /// `libcuda.so.1`, the driver API.
    Driver,
    /// `libcudart.so.*`, the runtime API.
    Runtime,
}

impl ApiLayer {
    /// [`LaunchApi`] and [`SyncApi`] ids from here on are runtime calls.
    pub const RUNTIME_ID_BASE: u32 = 100;

    /// The layer of a [`LaunchApi`] or [`SyncApi`] id.
    pub const fn of(id: u32) -> Self {
        if id < Self::RUNTIME_ID_BASE { Self::Driver } else { Self::Runtime }
    }

    /// `driver` or `runtime`, as stored.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Driver => "driver",
            Self::Runtime => "runtime",
        }
    }
}

impl LaunchApi {
    pub const ALL: [LaunchApi; 16] = [
        Self::CuLaunchKernel,
        Self::CuLaunchKernelPtsz,
        Self::CuLaunchKernelEx,
        Self::CuLaunchKernelExPtsz,
        Self::CuLaunchCooperativeKernel,
        Self::CuLaunchCooperativeKernelPtsz,
        Self::CuGraphLaunch,
        Self::CuGraphLaunchPtsz,
        Self::CudaLaunchKernel,
        Self::CudaLaunchKernelPtsz,
        Self::CudaLaunchKernelExC,
        Self::CudaLaunchKernelExCPtsz,
        Self::CudaLaunchCooperativeKernel,
        Self::CudaLaunchCooperativeKernelPtsz,
        Self::CudaGraphLaunch,
        Self::CudaGraphLaunchPtsz,
    ];

    pub fn from_u32(v: u32) -> Option<Self> {
        Self::ALL.iter().copied().find(|a| *a as u32 == v)
    }

    /// The exported symbol name.
    pub fn symbol(self) -> &'static str {
        match self {
            Self::CuLaunchKernel => "cuLaunchKernel",
            Self::CuLaunchKernelPtsz => "cuLaunchKernel_ptsz",
            Self::CuLaunchKernelEx => "cuLaunchKernelEx",
            Self::CuLaunchKernelExPtsz => "cuLaunchKernelEx_ptsz",
            Self::CuLaunchCooperativeKernel => "cuLaunchCooperativeKernel",
            Self::CuLaunchCooperativeKernelPtsz => "cuLaunchCooperativeKernel_ptsz",
            Self::CuGraphLaunch => "cuGraphLaunch",
            Self::CuGraphLaunchPtsz => "cuGraphLaunch_ptsz",
            Self::CudaLaunchKernel => "cudaLaunchKernel",
            Self::CudaLaunchKernelPtsz => "cudaLaunchKernel_ptsz",
            Self::CudaLaunchKernelExC => "cudaLaunchKernelExC",
            Self::CudaLaunchKernelExCPtsz => "cudaLaunchKernelExC_ptsz",
            Self::CudaLaunchCooperativeKernel => "cudaLaunchCooperativeKernel",
            Self::CudaLaunchCooperativeKernelPtsz => "cudaLaunchCooperativeKernel_ptsz",
            Self::CudaGraphLaunch => "cudaGraphLaunch",
            Self::CudaGraphLaunchPtsz => "cudaGraphLaunch_ptsz",
        }
    }

    /// The eBPF program for this entry point when the function pushed
    /// `stack_adjust` bytes before the probe point. Each entry point has a
    /// program of its own, named after it, with its id built in (reading the id
    /// from the attach cookie would cost every launch a helper call). Only an
    /// entry point that takes arguments on the stack, probed after pushes, goes
    /// to its argument shape's shared program, which reads the id and the
    /// pushed bytes from the cookie. Every runtime entry point reads the stack
    /// (its return address: see `profiler-ebpf`'s `in_runtime_launch`).
    pub fn program(self, stack_adjust: u64) -> &'static str {
        if stack_adjust == 0 {
            return self.symbol();
        }
        match self {
            Self::CuLaunchKernel
            | Self::CuLaunchKernelPtsz
            | Self::CuLaunchCooperativeKernel
            | Self::CuLaunchCooperativeKernelPtsz => programs::LAUNCH_DRIVER_PUSHED,
            Self::CudaLaunchKernel
            | Self::CudaLaunchKernelPtsz
            | Self::CudaLaunchCooperativeKernel
            | Self::CudaLaunchCooperativeKernelPtsz => programs::LAUNCH_RUNTIME_PUSHED[0],
            Self::CudaLaunchKernelExC | Self::CudaLaunchKernelExCPtsz => programs::LAUNCH_RUNTIME_PUSHED[1],
            Self::CudaGraphLaunch | Self::CudaGraphLaunchPtsz => programs::LAUNCH_RUNTIME_PUSHED[2],
            // Every argument is in a register.
            _ => self.symbol(),
        }
    }

    /// Every launch program, each once.
    pub fn programs() -> impl Iterator<Item = &'static str> {
        Self::ALL
            .into_iter()
            .map(Self::symbol)
            .chain([programs::LAUNCH_DRIVER_PUSHED])
            .chain(programs::LAUNCH_RUNTIME_PUSHED)
    }

    pub fn layer(self) -> ApiLayer {
        ApiLayer::of(self as u32)
    }
}

/// Calls in which the host waits for the GPU. Runtime calls reach the
/// driver's: each is counted once, as the runtime call.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncApi {
    CuStreamSynchronize = 1,
    CuStreamSynchronizePtsz = 2,
    CuCtxSynchronize = 3,
    CuEventSynchronize = 4,
    CudaDeviceSynchronize = 101,
    CudaStreamSynchronize = 102,
    CudaStreamSynchronizePtsz = 103,
    CudaEventSynchronize = 104,
}

impl SyncApi {
    pub const ALL: [SyncApi; 8] = [
        Self::CuStreamSynchronize,
        Self::CuStreamSynchronizePtsz,
        Self::CuCtxSynchronize,
        Self::CuEventSynchronize,
        Self::CudaDeviceSynchronize,
        Self::CudaStreamSynchronize,
        Self::CudaStreamSynchronizePtsz,
        Self::CudaEventSynchronize,
    ];

    pub fn from_u32(v: u32) -> Option<Self> {
        Self::ALL.iter().copied().find(|a| *a as u32 == v)
    }

    pub fn symbol(self) -> &'static str {
        match self {
            Self::CuStreamSynchronize => "cuStreamSynchronize",
            Self::CuStreamSynchronizePtsz => "cuStreamSynchronize_ptsz",
            Self::CuCtxSynchronize => "cuCtxSynchronize",
            Self::CuEventSynchronize => "cuEventSynchronize",
            Self::CudaDeviceSynchronize => "cudaDeviceSynchronize",
            Self::CudaStreamSynchronize => "cudaStreamSynchronize",
            Self::CudaStreamSynchronizePtsz => "cudaStreamSynchronize_ptsz",
            Self::CudaEventSynchronize => "cudaEventSynchronize",
        }
    }

    pub fn layer(self) -> ApiLayer {
        ApiLayer::of(self as u32)
    }
}

/// First field of every record.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct RecordHeader {
    /// A [`RecordKind`] as `u32`.
    pub kind: u32,
    /// Kernel thread id (`pid` in kernel terms) of the thread that fired.
    pub tid: u32,
    /// `bpf_ktime_get_ns()`: CLOCK_MONOTONIC nanoseconds.
    pub ts_ns: u64,
    /// The process (tgid) of the thread that fired: the agent keeps one
    /// session per traced process and routes each record by it.
    pub tgid: u32,
    pub _pad: u32,
}

/// A process traced, or about to be, as the kernel saw it: the header's
/// `tid`/`tgid` are the thread that forked, exec'ed or exited.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct ProcessRecord {
    pub header: RecordHeader,
    /// The process (tgid) the record is about: the new child for
    /// `ProcessFork`, else the header's own tgid.
    pub pid: u32,
    /// The traced process it was forked from (`ProcessFork`), else 0.
    pub parent: u32,
}

/// One kernel or graph launch.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct LaunchRecord {
    pub header: RecordHeader,
    /// A [`LaunchApi`] as `u32`.
    pub api: u32,
    /// Dynamic shared memory in bytes (0 for graph launches).
    pub shared_mem_bytes: u32,
    /// `CUfunction` (driver), the host stub address (runtime), or the graph-exec
    /// handle (graph launches).
    pub function: u64,
    /// `CUstream` / `cudaStream_t` (0 is the legacy default stream).
    pub stream: u64,
    pub grid: [u32; 3],
    pub block: [u32; 3],
}

/// Launch records a thread has staged but not yet written to the ring
/// buffer: the kernel side writes them [`STAGE_LEN`] at a time as one ring
/// record (a run of [`LaunchRecord`]s), and before any step or sync record of
/// the same thread, so that each thread's records stay in order. What is
/// still staged when tracing stops is read from the map by the agent.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LaunchStage {
    /// The thread that holds this stage (0: none yet).
    pub tid: u32,
    /// How many of `records` are staged.
    pub len: u32,
    pub records: [LaunchRecord; STAGE_LEN],
}

/// Launch records per stage: a ring reservation and commit per 16 launches
/// instead of per launch.
pub const STAGE_LEN: usize = 16;
/// Stages (threads that stage their launches; the others write each record
/// directly). A power of two: a thread's stage is `tid & (STAGES - 1)`.
pub const STAGES: u32 = 256;

/// How many executable mappings of runtime libraries, per process, the
/// driver probes can tell their calls from (one per `libcudart` loaded,
/// normally one or two).
pub const RUNTIME_TEXTS: u32 = CODE_RANGES as u32;

/// Executable mappings one process's entry of a code-range map holds.
pub const CODE_RANGES: usize = 8;

/// One traced process's `[start, end)` code ranges of a kind of library (the
/// value of `RUNTIME_TEXT` and `BLAS_TEXT`, keyed by tgid): each process maps
/// a library at its own addresses. `end` 0 past the last.
pub type CodeRanges = [[u64; 2]; CODE_RANGES];

/// Entry or return of a step function or a synchronisation call, or a
/// thread's exit: the records each thread numbers in order (`seq`), on the
/// ordered ring, which launches cannot crowd out (see `maps::ORDERED_EVENTS`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct OrderedRecord {
    pub header: RecordHeader,
    /// Which step probe fired (index into the agent's list of step sources),
    /// or the [`SyncApi`] id.
    pub probe: u32,
    /// This thread's ordered records so far, this one included: 1, 2, …
    /// (never 0 once it wraps). A gap says records of the thread were lost.
    /// 0: the kernel side had no room to keep the thread's state (a map
    /// update failed, and was counted), so there is no sequence.
    pub seq: u32,
    /// Launches this thread had made when the probe fired (counted in the kernel,
    /// so a step's launch count is exact even if launch records are dropped).
    pub thread_launches: u64,
    /// Step functions (all step sources together) the thread is inside after
    /// this record: entries less returns. After a gap it tells the agent where
    /// the thread is.
    pub depth: u32,
    pub _pad: u32,
    /// Where the thread's time had gone when the probe fired.
    pub sched: SchedTimes,
}

/// Where a thread's time has gone since the scheduler programs first saw it
/// (`sched_switch` / `sched_wakeup`), read when a probe fires on the thread:
/// the thread is then on a CPU, and its run in progress is counted. All 0
/// without scheduler tracing (`--no-sched`). A step's figures are the
/// differences between its end's and its start's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct SchedTimes {
    /// On a CPU.
    pub cpu_ns: u64,
    /// Runnable but not running: woken, or preempted, until it ran again.
    pub runnable_ns: u64,
    /// Off the CPU in an interruptible wait (a sleep, a futex, a poll).
    pub sleep_ns: u64,
    /// Off the CPU in an uninterruptible wait (disk I/O, page faults, some locks).
    pub blocked_ns: u64,
    /// CPU time of the thread's whole process: its threads' finished runs, and
    /// this thread's run in progress (others' runs in progress are not in it).
    pub process_cpu_ns: u64,
}

/// Why a thread left its CPU ([`OffCpuRecord::state`]; `sched_switch`'s
/// `prev_state` and preemption flag).
pub mod off_cpu_state {
    /// Preempted or yielding: runnable all the time it was off.
    pub const RUNNABLE: u32 = 2;
    /// An interruptible wait (a sleep, a futex, a poll), then runnable from its wakeup.
    pub const SLEEPING: u32 = 3;
    /// An uninterruptible wait (disk I/O, page faults, some locks), then runnable from its wakeup.
    pub const BLOCKED: u32 = 4;
}

/// One time a traced thread was off its CPU: it left at `left_ns` (in
/// `state`), was woken at `woken_ns` (0: never waited, it was preempted or it
/// yielded) and ran again at the header's `ts_ns`. The header's `tid` and
/// `tgid` are the thread's (the record is written on the CPU it comes back
/// to, by the scheduler, not by the thread). Its time on a CPU is the gap
/// between one record's `ts_ns` and the next one's `left_ns`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct OffCpuRecord {
    pub header: RecordHeader,
    pub left_ns: u64,
    pub woken_ns: u64,
    /// An [`off_cpu_state`] constant.
    pub state: u32,
    pub _pad: u32,
}

/// Per-process scheduler totals (`map_names::PROCESS_SCHED`, by tgid): the
/// agent reads them for the session's context switches.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessSched {
    /// Finished runs of the process's threads, ns.
    pub cpu_ns: u64,
    /// Times one of its threads left a CPU.
    pub switches: u64,
    /// Of those, times it was preempted (left runnable).
    pub preemptions: u64,
    /// Switches that did not fit a thread's state as the programs kept it
    /// (each loses that thread's interval since its last change).
    pub mismatches: u64,
}

/// A debug record of the scheduler programs' mismatches
/// (`maps::SCHED_MISMATCHES`, one per [`mismatch_site`]): how many there were
/// at the site, and the last one's thread, the state the programs had for it,
/// since when, its last switch-out, the moment and the CPU. The agent writes
/// them to its debug log at the end of a session.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedMismatch {
    pub count: u64,
    pub tid: u32,
    /// The thread's state as the programs kept it: 0 unseen, 1 running, else an [`off_cpu_state`].
    pub found: u32,
    pub since_ns: u64,
    pub left_ns: u64,
    pub at_ns: u64,
    pub cpu: u32,
    pub _pad: u32,
}

/// One scheduler event of the machine, any task's, in the debug history
/// (`maps::SCHED_HISTORY`, `PROFILER_SCHED_HISTORY`): a switch from `prev`
/// to `next` (`prev_state` the tracepoint's, `preempt` 1 when preempted) or
/// a wakeup of `next` (`kind` 1; `prev` the waker).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedHistoryEntry {
    pub at_ns: u64,
    pub prev: u32,
    pub next: u32,
    pub cpu: u32,
    pub kind: u32,
    pub prev_state: u32,
    pub preempt: u32,
}

/// Where a scheduler mismatch was seen (the index in `maps::SCHED_MISMATCHES`).
pub mod mismatch_site {
    /// A switch-out of a thread the programs did not have running.
    pub const SWITCH_OUT: u32 = 0;
    /// A switch-in of a thread they had running.
    pub const SWITCH_IN: u32 = 1;
    /// A probe on a thread (so on a CPU) they had off its CPU.
    pub const PROBE: u32 = 2;
    pub const COUNT: u32 = 3;
    pub const NAMES: [&str; COUNT as usize] =
        ["switch-out of a thread not running", "switch-in of a thread running", "probe on a thread off its CPU"];
}

/// One CPU sample of a traced thread (the header's `tid`, `tgid` and time):
/// where its user code was (`user_ip`, the leaf, always) and the ids of its
/// stacks in `maps::CPU_STACKS` (`bpf_get_stackid`; negative: the kernel's
/// error, `-EEXIST` when the stack's bucket holds another stack, `-EFAULT`
/// when no frame could be read). `kernel_stack` is [`NO_STACK`] when the
/// sample hit user code.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct CpuSampleRecord {
    pub header: RecordHeader,
    /// The user-mode instruction pointer (the interrupted one, or the one the
    /// thread entered the kernel from); 0 where none could be read.
    pub user_ip: u64,
    pub user_stack: i32,
    pub kernel_stack: i32,
}

/// [`CpuSampleRecord::kernel_stack`] of a sample taken in user mode.
pub const NO_STACK: i32 = i32::MIN;

/// Python frames kept per sample (the innermost ones).
pub const PY_STACK_DEPTH: usize = 64;

/// A CPU sample of a CPython thread: the native sample and the frames of its
/// thread state's chain then, innermost first, a slot each: a code object's
/// address, whose bit 0 ([`PY_FRAME_ENTRY`]) marks the outermost frame of
/// one call of the interpreter's loop (`_PyEval_EvalFrameDefault`);
/// [`PY_FRAME_SHIM`], a frame of the C stack below such a call (3.12+); or
/// 0, a frame that is no Python code. User space puts each run of frames of
/// one call where its loop's native frame is on the native stack.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct CpuSamplePythonRecord {
    pub sample: CpuSampleRecord,
    /// Slots of `frames` written; 0 when the thread has no thread state
    /// (not a Python thread, or none yet) or none could be read.
    pub depth: u32,
    /// 1 when the chain had more than [`PY_STACK_DEPTH`] frames (the outer ones are cut).
    pub truncated: u32,
    pub frames: [u64; PY_STACK_DEPTH],
}

/// See [`CpuSamplePythonRecord`].
pub const PY_FRAME_ENTRY: u64 = 1;
/// See [`CpuSamplePythonRecord`].
pub const PY_FRAME_SHIM: u64 = 2;

/// A field CPython's version does not have.
pub const PY_NO_FIELD: u32 = u32::MAX;

/// How a CPython version marks the first frame of one call of its loop ([`PyStackLayout::boundary`]).
pub mod py_boundary {
    /// 3.10: every frame is a call of its own.
    pub const EVERY_FRAME: u32 = 0;
    /// 3.11: the frame's `is_entry` byte.
    pub const IS_ENTRY: u32 = 1;
    /// 3.12+: a shim frame owned by the C stack (`owner` 3) below it; owners
    /// 3 and up (C stack, interpreter) are not Python code and are skipped.
    pub const CSTACK_OWNER: u32 = 2;
}

/// Where the CPU sampler finds a CPython process's Python frames: the value
/// of `maps::PY_PROCS` for its tgid, filled by the agent from the CPython
/// build it maps. The thread's state is the one in the main interpreter's
/// list whose `native_thread_id` is the thread's id (3.11+), or whose
/// `thread_id` (`pthread_self()`) is the thread's `fsbase` (3.10).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct PyStackLayout {
    /// Address, in the process, of `_PyRuntime.interpreters.head`.
    pub interpreters_head: u64,
    /// Applied to a frame's code pointer (3.14 tags it in the low bits).
    pub code_mask: u64,
    /// `offsetof(struct task_struct, thread.fsbase)` in the running kernel,
    /// where `by_native_id` is 0.
    pub task_fsbase: u32,
    /// `PyInterpreterState.threads.head` (`tstate_head` in 3.10).
    pub threads_head: u32,
    pub tstate_next: u32,
    /// `native_thread_id` where `by_native_id` is 1, else `thread_id`.
    pub tstate_thread_id: u32,
    /// 1: a thread state is known by its `native_thread_id` (the thread's id).
    pub by_native_id: u32,
    /// `&tstate->frame` (3.10), `&tstate->cframe` (3.11, 3.12) or `&tstate->current_frame` (3.13+).
    pub tstate_frame: u32,
    /// `&cframe->current_frame` (3.11, 3.12), else [`PY_NO_FIELD`].
    pub cframe_frame: u32,
    /// `f_back` (3.10) or `previous`.
    pub frame_previous: u32,
    /// `f_code` or `f_executable`.
    pub frame_code: u32,
    /// `is_entry` (3.11) or `owner` (3.12+), by `boundary`; unused on 3.10.
    pub frame_marker: u32,
    /// A [`py_boundary`] value.
    pub boundary: u32,
    pub _pad: u32,
}

/// Frames kept per stack in `maps::CPU_STACKS` (the kernel's `PERF_MAX_STACK_DEPTH`).
pub const CPU_STACK_DEPTH: usize = 127;

/// Entries of `maps::CPU_STACKS` (each `CPU_STACK_DEPTH` frames, ~1 KiB):
/// 16 MiB. A stack's bucket is its hash's: with k distinct stacks kept, a new
/// one finds its bucket taken with odds k/16384 (an id keeps its stack for the
/// session, see `profiler-ebpf/src/cpu.rs`); that sample keeps its leaf only,
/// and is counted (`maps::CPU_STACK_FAILURES`).
pub const CPU_STACKS: u32 = 16384;

/// Bytes of a kernel name kept (longer names are cut; C++ kernel names
/// rarely exceed this, templates can).
pub const KERNEL_NAME_CAP: usize = 256;

/// Which call produced a [`KernelNameRecord`] (its `which` field).
pub mod name_call {
    /// `cuModuleGetFunction(CUfunction *out, CUmodule, const char *name)`.
    pub const MODULE_GET_FUNCTION: u32 = 1;
    /// `cuLibraryGetKernel(CUkernel *out, CUlibrary, const char *name)`.
    pub const LIBRARY_GET_KERNEL: u32 = 2;
    /// `cuKernelGetFunction(CUfunction *out, CUkernel kernel)`: no name, an alias.
    pub const KERNEL_GET_FUNCTION: u32 = 3;
}

/// A handle the driver returned, with the kernel name it was asked for.
#[repr(C)]
#[derive(Clone, Copy)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct KernelNameRecord {
    pub header: RecordHeader,
    /// A [`name_call`] constant.
    pub which: u32,
    pub _pad: u32,
    /// The returned `CUfunction` or `CUkernel`.
    pub handle: u64,
    /// For `KERNEL_GET_FUNCTION`: the `CUkernel` the function belongs to.
    pub kernel: u64,
    /// NUL-terminated (unless cut at the cap).
    pub name: [u8; KERNEL_NAME_CAP],
}

// The decoder reads these sizes; keep them in step with the eBPF side.
const _: () = assert!(core::mem::size_of::<RecordHeader>() == 24);
const _: () = assert!(core::mem::size_of::<LaunchRecord>() == 72);
const _: () = assert!(core::mem::size_of::<OrderedRecord>() == 88);
const _: () = assert!(core::mem::size_of::<SchedTimes>() == 40);
const _: () = assert!(core::mem::size_of::<ProcessRecord>() == 32);
const _: () = assert!(core::mem::size_of::<KernelNameRecord>() == 48 + KERNEL_NAME_CAP);

/// What a [`UsdtArgSpec`] reads. Stored as `u32` in [`UsdtArgSpec::kind`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UsdtArgKind {
    /// No argument in this slot.
    None = 0,
    /// `N@$CONST`: the value is [`UsdtArgSpec::displacement`].
    Constant = 1,
    /// `N@%reg`: the value is the register (`pt_regs` at [`UsdtArgSpec::reg_offset`])
    /// plus [`UsdtArgSpec::displacement`] (0, except for a resolved `$symbol`:
    /// `%rip` plus the symbol's distance from the probe).
    Register = 2,
    /// `N@DISP(%base,%index,scale)`: the value is read from user memory at
    /// `base + index * scale + displacement` (either register may be absent).
    Memory = 3,
}

/// [`UsdtArgSpec::reg_offset`] / [`UsdtArgSpec::index_offset`] when there is no register.
pub const USDT_NO_REG: u32 = u32::MAX;
/// Arguments kept per USDT probe (CPython's probes have at most 3; libbpf keeps 12).
pub const USDT_MAX_ARGS: usize = 6;
/// Entries of the `USDT_ARGS` map: one per attached USDT probe site, indexed by
/// the attach cookie.
pub const USDT_MAX_SPECS: u32 = 16;

/// Where one USDT argument lives at the probe site, decoded by user space from
/// the note's argument string (e.g. `-4@%eax`, `8@-16(%rbp)`, `4@$5`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsdtArgSpec {
    /// A [`UsdtArgKind`] as `u32`.
    pub kind: u32,
    /// Width of the value in bytes: 1, 2, 4 or 8.
    pub size: u32,
    /// 1 when the value is sign-extended from `size` bytes, 0 when zero-extended.
    pub signed: u32,
    /// Byte offset in the x86-64 `struct pt_regs` of the register (or the base
    /// register), or [`USDT_NO_REG`]. The high-byte registers (`%ah`…) point one
    /// byte into their full register.
    pub reg_offset: u32,
    /// Byte offset in `pt_regs` of the index register, or [`USDT_NO_REG`].
    pub index_offset: u32,
    /// Multiplier of the index register: 1, 2, 4 or 8.
    pub scale: u32,
    /// The constant, or the memory operand's displacement.
    pub displacement: i64,
}

/// The decoded arguments of one USDT probe site: a value of the `USDT_ARGS` map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsdtProbeSpec {
    pub args: [UsdtArgSpec; USDT_MAX_ARGS],
    /// How many of `args` are set.
    pub arg_count: u32,
    pub _pad: u32,
}

/// Bytes of a function name or file suffix in a [`PyTarget`].
pub const PY_NAME_CAP: usize = 64;
/// Entries of the `PY_TARGETS` map.
pub const PY_MAX_TARGETS: u32 = 8;

/// A Python function whose calls are steps: a value of the `PY_TARGETS` map.
/// The kernel compares the names eight bytes at a time, so the struct is
/// 8-aligned and the unused tail of each name must be zero.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyTarget {
    /// The function's `co_name`, zero-padded; `name_len == 0` marks an unused slot.
    pub name: [u8; PY_NAME_CAP],
    /// What the code object's file name must end with (at a `/` boundary), zero-padded.
    pub file_suffix: [u8; PY_NAME_CAP],
    pub name_len: u32,
    /// 0: any file.
    pub suffix_len: u32,
    /// Written to [`OrderedRecord::probe`] when this target matches.
    pub label_id: u32,
    pub _pad: u32,
}

impl Default for PyTarget {
    fn default() -> Self {
        Self { name: [0; PY_NAME_CAP], file_suffix: [0; PY_NAME_CAP], name_len: 0, suffix_len: 0, label_id: 0, _pad: 0 }
    }
}

/// Where the PEP 523 frame hook's programs find a Python call's name: the
/// value of the `FRAME_LAYOUT` map, filled from the target's CPython version.
/// `_PyEval_EvalFrameDefault(tstate, frame, throwflag)`: `frame` (%rsi) →
/// code object (`frame + code`, masked with `code_mask`) → `co_name` /
/// `co_filename` str objects, whose compact ASCII characters start
/// `ascii_data` bytes in.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrameLayout {
    /// `&frame->f_code` (3.10–3.12) or `&frame->f_executable` (3.13+).
    pub code: u32,
    /// `&code->co_flags` (an int).
    pub co_flags: u32,
    pub co_name: u32,
    pub co_filename: u32,
    /// `sizeof(PyASCIIObject)`: 48 up to 3.11, 40 from 3.12.
    pub ascii_data: u32,
    /// `co_flags` bits whose code is skipped: generators and coroutines,
    /// whose every resume enters the function again.
    pub skip_flags: u32,
    /// Applied to the code pointer: 3.14 tags `f_executable` (a `_PyStackRef`) in its low bits.
    pub code_mask: u64,
}

/// A step function's call open on a thread, keyed by the stack pointer at its
/// entry (the `FRAME_STEPS` map): the return probe finds it at `sp - 8`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrameStep {
    pub tid: u32,
    pub label_id: u32,
}

/// Entries of the `FRAME_STEPS` map: step calls open at once, all threads.
pub const FRAME_STEPS_MAX: u32 = 4096;

// The eBPF side reads these layouts; keep them in step with user space.
const _: () = assert!(core::mem::size_of::<UsdtArgSpec>() == 32);
const _: () = assert!(core::mem::size_of::<LaunchStage>() == 8 + 72 * STAGE_LEN);
const _: () = assert!(STAGES.is_power_of_two());
const _: () = assert!(core::mem::size_of::<UsdtProbeSpec>() == 32 * USDT_MAX_ARGS + 8);
const _: () = assert!(core::mem::size_of::<PyTarget>() == 2 * PY_NAME_CAP + 16);
const _: () = assert!(core::mem::size_of::<FrameLayout>() == 32);
const _: () = assert!(core::mem::size_of::<FrameStep>() == 8);
// Shorter than a launch record: `profiler::events::records` tells a staged run of launches by its length.
const _: () = assert!(core::mem::size_of::<OffCpuRecord>() == 48);
const _: () = assert!(core::mem::size_of::<CpuSampleRecord>() == 40);
const _: () = assert!(core::mem::size_of::<CpuSamplePythonRecord>() == 48 + 8 * PY_STACK_DEPTH);
const _: () = assert!(core::mem::size_of::<PyStackLayout>() == 64);

/// Names of the read-only globals the agent sets at load time.
pub mod globals {
    /// Non-zero: processes forked by traced ones are traced too (`--children`).
    pub const FOLLOW_CHILDREN: &str = "FOLLOW_CHILDREN";
    /// `u32`s: byte offsets of `pid` and `tgid` in the kernel's `struct task_struct`.
    pub const TASK_PID_OFFSET: &str = "TASK_PID_OFFSET";
    pub const TASK_TGID_OFFSET: &str = "TASK_TGID_OFFSET";
    /// `u32`: 1 to write a [`super::LaunchRecord`] per launch, 0 to only count.
    pub const EMIT_LAUNCHES: &str = "EMIT_LAUNCHES";
    /// `u32`: the length of the `THREAD_SLOTS` map less one (a power of two less one).
    pub const THREAD_SLOT_MASK: &str = "THREAD_SLOT_MASK";
    /// `u32`: 1 when the scheduler programs are attached (snapshots are then taken).
    pub const SCHED_ENABLED: &str = "SCHED_ENABLED";
    /// `u32`: 1 to write an [`super::OffCpuRecord`] each time a traced thread
    /// comes back to a CPU (per-call rows with the scheduler programs).
    pub const SCHED_SLICES: &str = "SCHED_SLICES";
    /// `u32`: byte offset of `flags` in `struct task_struct` (`PF_EXITING`).
    pub const TASK_FLAGS_OFFSET: &str = "TASK_FLAGS_OFFSET";
    /// `u32`: entries per CPU of `maps::SCHED_HISTORY` (a power of two; 0:
    /// off, as by default), for `PROFILER_SCHED_HISTORY`.
    pub const SCHED_HISTORY_PER_CPU: &str = "SCHED_HISTORY_PER_CPU";
}

/// Bytes of the launch ring (`maps::EVENTS`), unless the agent sets another size.
pub const EVENTS_BYTES: u32 = 32 * 1024 * 1024;
/// Bytes of the ordered ring (`maps::ORDERED_EVENTS`), unless the agent sets another size.
/// 8 MiB: ≈200 000 records, seconds of a thread-churning target's steps, syncs
/// and exits while the agent is held up behind a slow disk (2 MiB overflowed
/// once in a test of 66 400 short-lived threads on the 2-core VM).
pub const ORDERED_EVENTS_BYTES: u32 = 8 * 1024 * 1024;

/// Names of the maps the agent reads.
pub mod maps {
    /// `RingBuf` carrying launch and kernel-name records.
    pub const EVENTS: &str = "EVENTS";
    /// tgid -> the traced process it was forked from (0 for one named by the user).
    pub const TRACED: &str = "TRACED";
    /// `Array<u32>` of one: set to 1 when the session stops; every program then returns at once.
    pub const STOPPED: &str = "STOPPED";
    /// `RingBuf` carrying [`super::OrderedRecord`]s (steps, syncs, thread exits)
    /// and loader changes: small, and never crowded out by launches.
    pub const ORDERED_EVENTS: &str = "ORDERED_EVENTS";
    /// `RingBuf` of [`super::JitFirstCall`]s, each submitted with a wakeup
    /// (when it is full, a name is read when its call comes up in order).
    pub const JIT_NEW: &str = "JIT_NEW";
    /// `PerCpuArray<u64>[1]`: reservations in `EVENTS` that failed.
    pub const LOST: &str = "LOST";
    /// `PerCpuArray<u64>[1]`: reservations in `ORDERED_EVENTS` that failed.
    pub const LOST_ORDERED: &str = "LOST_ORDERED";
    /// `PerCpuArray<u64>[1]`: of the `LOST` reservations, [`super::OffCpuRecord`]s.
    pub const LOST_OFF_CPU: &str = "LOST_OFF_CPU";
    /// `HashMap<u32, ProcessSched>`: scheduler totals per traced tgid; the agent removes an exited one's.
    pub const PROCESS_SCHED: &str = "PROCESS_SCHED";
    /// `Array<SchedMismatch>[mismatch_site::COUNT]`: the scheduler programs' mismatches by site, for the debug log.
    pub const SCHED_MISMATCHES: &str = "SCHED_MISMATCHES";
    /// `Array<SchedHistoryEntry>[CPUs × SCHED_HISTORY_PER_CPU]`: each CPU's
    /// last scheduler events, written until the first mismatch (debug only).
    pub const SCHED_HISTORY: &str = "SCHED_HISTORY";
    /// `Array<u64>[2]`: the first mismatch's time, ns (0: none yet: the
    /// history stops there), and its tid (low 32 bits) and site (high).
    pub const SCHED_HISTORY_FROZEN: &str = "SCHED_HISTORY_FROZEN";
    /// `PerCpuArray<u64>[1]`: map updates that failed (a map full): each one
    /// costs a thread its launch counter or a mark (see the README's *Loss*).
    pub const MAP_FAILURES: &str = "MAP_FAILURES";
    /// `HashMap<u32, u32>`: slot index -> the tid that claimed it; sized to `THREAD_SLOTS`.
    pub const SLOT_CLAIMS: &str = "SLOT_CLAIMS";
    /// `HashMap<u32, ThreadSlot>`: the state of threads whose slot another holds.
    pub const THREAD_FALLBACK: &str = "THREAD_FALLBACK";
    /// `PerCpuArray<u64>[1]`: launches seen (counted once), kept or not.
    pub const LAUNCHES: &str = "LAUNCHES";
    /// `Array<ThreadSlot>`: per-thread launch counters, sized at load.
    pub const THREAD_SLOTS: &str = "THREAD_SLOTS";
    /// `Array<LaunchStage>[STAGES]`: launch records staged per thread.
    pub const LAUNCH_STAGES: &str = "LAUNCH_STAGES";
    /// `Array<u32>[1]`: 1 once a runtime library is probed.
    pub const RUNTIME_PROBED: &str = "RUNTIME_PROBED";
    /// `StackTrace[CPU_STACKS]`: the CPU samples' user and kernel stacks, by `bpf_get_stackid` id.
    pub const CPU_STACKS: &str = "CPU_STACKS";
    /// `PerCpuArray<u64>[1]`: CPU samples of traced threads taken (kept or lost).
    pub const CPU_SAMPLES: &str = "CPU_SAMPLES";
    /// `HashMap<tgid, PyStackLayout>`: the CPython processes whose samples carry Python frames.
    pub const PY_PROCS: &str = "PY_PROCS";
    /// `PerCpuArray<u64>[1]`: CPU samples the launch ring had no room for.
    pub const LOST_CPU_SAMPLES: &str = "LOST_CPU_SAMPLES";
    /// `PerCpuArray<u64>[1]`: stacks `bpf_get_stackid` did not keep (their samples keep the leaf).
    pub const CPU_STACK_FAILURES: &str = "CPU_STACK_FAILURES";
    /// `HashMap<tgid, CodeRanges>`: per process, `[start, end)` of the probed
    /// runtime libraries' executable mappings.
    pub const RUNTIME_TEXT: &str = "RUNTIME_TEXT";
    /// `Array<UsdtProbeSpec>[USDT_MAX_SPECS]`: argument specs of the attached
    /// USDT probe sites, indexed by the attach cookie.
    pub const USDT_ARGS: &str = "USDT_ARGS";
    /// `Array<PyTarget>[PY_MAX_TARGETS]`: the Python step functions.
    pub const PY_TARGETS: &str = "PY_TARGETS";
    /// `Array<FrameLayout>[1]`: where the frame hook's programs read a call's name.
    pub const FRAME_LAYOUT: &str = "FRAME_LAYOUT";
    /// `LruHashMap<u64, FrameStep>[FRAME_STEPS_MAX]`: open step calls by entry stack pointer.
    pub const FRAME_STEPS: &str = "FRAME_STEPS";
}

/// Names of the programs that are not per launch layout.
pub mod programs {
    /// The driver's stack-argument launches and the runtime's launches (by
    /// argument shape: classic, ex, graph) probed after `push`es (cookie: the
    /// `LaunchApi` id | pushed bytes << 32). Every other launch probe runs the
    /// program named after its entry point.
    pub const LAUNCH_DRIVER_PUSHED: &str = "launch_driver_classic";
    pub const LAUNCH_RUNTIME_PUSHED: [&str; 3] =
        ["launch_runtime_classic", "launch_runtime_ex", "launch_runtime_graph"];
    pub const STEP_ENTER: &str = "step_enter";
    pub const STEP_EXIT: &str = "step_exit";
    /// An empty uprobe: the benchmark's floor.
    pub const BARE: &str = "bare_probe";
    /// The dynamic loader's `_dl_debug_state`: a `LoaderChange` record.
    pub const LOADER: &str = "loader_change";
    /// Entry/return of synchronisation calls (cookie: the `SyncApi` id).
    pub const SYNC_ENTER: &str = "sync_enter";
    pub const SYNC_EXIT: &str = "sync_exit";
    /// Entry/return of the calls that name kernels (cookie: a `name_call` constant).
    pub const NAME_ENTER: &str = "name_enter";
    pub const NAME_EXIT: &str = "name_exit";
    /// USDT `python:function__entry` (cookie: the `USDT_ARGS` slot).
    pub const PYTHON_ENTRY: &str = "python_entry";
    /// USDT `python:function__return` (cookie: the `USDT_ARGS` slot).
    pub const PYTHON_RETURN: &str = "python_return";
    /// Entry of `_PyEval_EvalFrameDefault` under the PEP 523 frame hook
    /// (uprobe; reads frame → code → name against `PY_TARGETS`).
    pub const FRAME_ENTER: &str = "frame_enter";
    /// Return of `_PyEval_EvalFrameDefault` (uretprobe; closes a step opened at the same stack depth).
    pub const FRAME_EXIT: &str = "frame_exit";
    /// Raw tracepoint `sched_process_exit` (no tracefs needed): releases an
    /// exiting target thread's kernel-side state.
    pub const THREAD_EXIT: &str = "thread_exit";
    /// The tracepoint it is attached to.
    pub const THREAD_EXIT_TRACEPOINT: &str = "sched_process_exit";
    /// Raw tracepoint `sched_switch`: a CPU goes from one task to another
    /// (where a traced thread's time goes; skipped with `--no-sched`).
    pub const SCHED_SWITCH: &str = "sched_switch";
    pub const SCHED_SWITCH_TRACEPOINT: &str = "sched_switch";
    /// Raw tracepoints `sched_wakeup` and `sched_wakeup_new`: a task becomes runnable.
    pub const SCHED_WAKEUP: &str = "sched_wakeup";
    pub const SCHED_WAKEUP_TRACEPOINTS: [&str; 2] = ["sched_wakeup", "sched_wakeup_new"];
    /// perf_event program on each CPU's `cpu-clock`: one CPU sample of a traced thread.
    pub const CPU_SAMPLE: &str = "cpu_sample";
    /// Raw tracepoint `sched_process_fork`: a traced process's new child process.
    pub const PROCESS_FORK: &str = "process_fork";
    pub const PROCESS_FORK_TRACEPOINT: &str = "sched_process_fork";
    /// Raw tracepoint `sched_process_exec`: a traced process exec'ed.
    pub const PROCESS_EXEC: &str = "process_exec";
    pub const PROCESS_EXEC_TRACEPOINT: &str = "sched_process_exec";
}

#[cfg(feature = "user")]
mod user {
    // SAFETY: plain-old-data: `#[repr(C)]`, no padding, every bit pattern valid.
    unsafe impl aya::Pod for super::LaunchRecord {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::OrderedRecord {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ProcessRecord {}
    // SAFETY: as above (two u32 then 8-byte-aligned records).
    unsafe impl aya::Pod for super::LaunchStage {}
    // SAFETY: as above (USDT_ARGS values).
    unsafe impl aya::Pod for super::UsdtProbeSpec {}
    // SAFETY: as above (PY_TARGETS values; the trailing u32 makes the size a multiple of 8).
    unsafe impl aya::Pod for super::PyTarget {}
    // SAFETY: as above (FRAME_LAYOUT's value: six u32 then a u64).
    unsafe impl aya::Pod for super::FrameLayout {}
    // SAFETY: as above (two u32).
    unsafe impl aya::Pod for super::FrameStep {}
    // SAFETY: as above (four u64; PROCESS_SCHED values).
    unsafe impl aya::Pod for super::ProcessSched {}
    // SAFETY: as above (u64, two u32, three u64, two u32: no padding).
    unsafe impl aya::Pod for super::SchedMismatch {}
    // SAFETY: as above (a u64 then six u32: no padding).
    unsafe impl aya::Pod for super::SchedHistoryEntry {}
    // SAFETY: as above (two u64 then twelve u32; PY_PROCS values).
    unsafe impl aya::Pod for super::PyStackLayout {}
}

/// Bytes of a `record_function` name kept in a [`RegionRecord`]. PyTorch's own
/// markers (`enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__`,
/// `Optimizer.step#AdamW.step`) are under 64; a longer name is cut here and
/// says so ([`RegionRecord::name_len`] holds the full length).
pub const REGION_NAME_CAP: usize = 128;

/// The begin (`RegionEnter`) or end (`RegionExit`) of a PyTorch
/// `record_function` region, on the ordered ring with the thread's sequence.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct RegionRecord {
    pub header: RecordHeader,
    /// This thread's ordered records so far, as [`OrderedRecord::seq`].
    pub seq: u32,
    /// Step functions the thread is inside, as [`OrderedRecord::depth`] (regions do not change it).
    pub depth: u32,
    /// The region's `PythonRecordFunction*`: what pairs an end with its begin.
    pub key: u64,
    /// Launches this thread had made when the probe fired.
    pub thread_launches: u64,
    /// The name's full length in bytes (0 for an end); more than
    /// [`REGION_NAME_CAP`]: `name` holds its first `REGION_NAME_CAP` bytes.
    pub name_len: u32,
    pub _pad: u32,
    /// As [`OrderedRecord::sched`].
    pub sched: SchedTimes,
    /// The name's first `min(name_len, REGION_NAME_CAP)` bytes; zero after.
    pub name: [u8; REGION_NAME_CAP],
}

const _: () = assert!(core::mem::size_of::<RegionRecord>() == 96 + REGION_NAME_CAP);
const _: () = assert!(REGION_NAME_CAP.is_power_of_two());

/// Names of the region programs .
pub mod torch_programs {
    /// Uprobe on `torch::autograd::profiler::record_function_enter_new`: reads the name.
    pub const ENTER: &str = "torch_region_enter";
    /// Uretprobe on the same function: reads the key it returned, writes the `RegionEnter`.
    pub const ENTER_RETURN: &str = "torch_region_enter_return";
    /// Uprobe on `record_function_exit_new`: writes the `RegionExit`. Its
    /// attach cookie says where the key is: 0 at the function's entry (the
    /// first word `rdi` points at); [`EXIT_KEY_IN_RDI`] with a displacement
    /// `d` in the low 32 bits at a point after the function has loaded that
    /// word into `rdi` and added `d` to it (key = `rdi` − `d`).
    pub const EXIT: &str = "torch_region_exit";
    /// The exit cookie's flag: the key is `rdi` minus the cookie's low 32 bits.
    pub const EXIT_KEY_IN_RDI: u64 = 1 << 32;
    /// The enter cookie for a build with the pre-C++11 libstdc++ ABI (PyPI's
    /// wheels before 2.7): `std::string` is one pointer to the characters,
    /// with the length 24 bytes before them (its copy-on-write header:
    /// length, capacity, reference count). Cookie 0: the C++11 `std::string`
    /// (characters pointer at +0, length at +8).
    pub const ENTER_COW_STRING: u64 = 1;
}

/// The NCCL entry points that are probed (`libnccl.so.2`): the attach cookie
/// of the collective programs, and [`CollectiveRecord::op`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollectiveOp {
    AllReduce = 1,
    ReduceScatter = 2,
    AllGather = 3,
    Broadcast = 4,
    Reduce = 5,
    Send = 6,
    Recv = 7,
    GroupStart = 8,
    GroupEnd = 9,
}

impl CollectiveOp {
    pub const ALL: [CollectiveOp; 9] = [
        Self::AllReduce,
        Self::ReduceScatter,
        Self::AllGather,
        Self::Broadcast,
        Self::Reduce,
        Self::Send,
        Self::Recv,
        Self::GroupStart,
        Self::GroupEnd,
    ];

    pub fn from_u32(v: u32) -> Option<Self> {
        Self::ALL.iter().copied().find(|o| *o as u32 == v)
    }

    /// The exported symbol name.
    pub fn symbol(self) -> &'static str {
        match self {
            Self::AllReduce => "ncclAllReduce",
            Self::ReduceScatter => "ncclReduceScatter",
            Self::AllGather => "ncclAllGather",
            Self::Broadcast => "ncclBroadcast",
            Self::Reduce => "ncclReduce",
            Self::Send => "ncclSend",
            Self::Recv => "ncclRecv",
            Self::GroupStart => "ncclGroupStart",
            Self::GroupEnd => "ncclGroupEnd",
        }
    }

    /// The name stored in `collectives.op`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AllReduce => "all_reduce",
            Self::ReduceScatter => "reduce_scatter",
            Self::AllGather => "all_gather",
            Self::Broadcast => "broadcast",
            Self::Reduce => "reduce",
            Self::Send => "send",
            Self::Recv => "recv",
            Self::GroupStart => "group_start",
            Self::GroupEnd => "group_end",
        }
    }
}

/// [`CollectiveRecord::peer`] when the call has no peer or root.
pub const NO_PEER: i32 = -1;

/// One NCCL call, written at its return to the ordered ring with the thread's
/// sequence (so that it lands in the step its thread was in). The entry
/// keeps the arguments per thread; `header.ts_ns` is the return's time.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct CollectiveRecord {
    pub header: RecordHeader,
    /// As [`OrderedRecord::seq`] / [`OrderedRecord::depth`].
    pub seq: u32,
    pub depth: u32,
    /// `bpf_ktime_get_ns()` at the entry.
    pub start_ns: u64,
    /// Elements (`count`, `recvcount`, `sendcount`); 0 for the group calls.
    pub count: u64,
    /// `ncclComm_t` (0 for the group calls).
    pub comm: u64,
    /// `cudaStream_t` (0 for the group calls).
    pub stream: u64,
    /// Launches this thread had made at the return.
    pub thread_launches: u64,
    /// A [`CollectiveOp`] as `u32`.
    pub op: u32,
    /// `ncclDataType_t` as passed (u32::MAX for the group calls).
    pub datatype: u32,
    /// The peer of send/recv, the root of broadcast/reduce, else [`NO_PEER`].
    pub peer: i32,
    /// The `ncclResult_t` returned (0: ncclSuccess).
    pub result: u32,
}

const _: () = assert!(core::mem::size_of::<CollectiveRecord>() == 88);

/// Names of the collective programs.
pub mod nccl_programs {
    /// Uprobe at an NCCL entry point (cookie: its `CollectiveOp` id): keeps the arguments.
    pub const ENTER: &str = "nccl_enter";
    /// Uretprobe on the same: writes the `CollectiveRecord`.
    pub const EXIT: &str = "nccl_exit";
}

/// The cuBLAS and cuBLASLt calls that are probed: the GEMMs and the calls
/// that give cuBLASLt's opaque descriptors their shapes. The id is the
/// attach cookie's low 32 bits and [`BlasRecord::call`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlasCall {
    GemmEx = 1,
    GemmEx64 = 2,
    Sgemm = 3,
    Sgemm64 = 4,
    Dgemm = 5,
    Dgemm64 = 6,
    Hgemm = 7,
    Hgemm64 = 8,
    SgemmEx = 9,
    SgemmEx64 = 10,
    GemmBatchedEx = 11,
    GemmBatchedEx64 = 12,
    GemmStridedBatchedEx = 13,
    GemmStridedBatchedEx64 = 14,
    LtMatmul = 101,
    LtMatrixLayoutCreate = 102,
    LtMatrixLayoutSetAttribute = 103,
    LtMatrixLayoutDestroy = 104,
    LtMatmulDescCreate = 105,
    LtMatmulDescSetAttribute = 106,
    LtMatmulDescDestroy = 107,
}

impl BlasCall {
    pub const ALL: [BlasCall; 21] = [
        Self::GemmEx,
        Self::GemmEx64,
        Self::Sgemm,
        Self::Sgemm64,
        Self::Dgemm,
        Self::Dgemm64,
        Self::Hgemm,
        Self::Hgemm64,
        Self::SgemmEx,
        Self::SgemmEx64,
        Self::GemmBatchedEx,
        Self::GemmBatchedEx64,
        Self::GemmStridedBatchedEx,
        Self::GemmStridedBatchedEx64,
        Self::LtMatmul,
        Self::LtMatrixLayoutCreate,
        Self::LtMatrixLayoutSetAttribute,
        Self::LtMatrixLayoutDestroy,
        Self::LtMatmulDescCreate,
        Self::LtMatmulDescSetAttribute,
        Self::LtMatmulDescDestroy,
    ];

    /// cuBLASLt's ids start here (`libcublasLt.so`); the ones below are `libcublas.so`'s.
    pub const LT_ID_BASE: u32 = 100;

    pub fn from_u32(v: u32) -> Option<Self> {
        Self::ALL.iter().copied().find(|c| *c as u32 == v)
    }

    /// The exported symbol name.
    pub fn symbol(self) -> &'static str {
        match self {
            Self::GemmEx => "cublasGemmEx",
            Self::GemmEx64 => "cublasGemmEx_64",
            Self::Sgemm => "cublasSgemm_v2",
            Self::Sgemm64 => "cublasSgemm_v2_64",
            Self::Dgemm => "cublasDgemm_v2",
            Self::Dgemm64 => "cublasDgemm_v2_64",
            Self::Hgemm => "cublasHgemm",
            Self::Hgemm64 => "cublasHgemm_64",
            Self::SgemmEx => "cublasSgemmEx",
            Self::SgemmEx64 => "cublasSgemmEx_64",
            Self::GemmBatchedEx => "cublasGemmBatchedEx",
            Self::GemmBatchedEx64 => "cublasGemmBatchedEx_64",
            Self::GemmStridedBatchedEx => "cublasGemmStridedBatchedEx",
            Self::GemmStridedBatchedEx64 => "cublasGemmStridedBatchedEx_64",
            Self::LtMatmul => "cublasLtMatmul",
            Self::LtMatrixLayoutCreate => "cublasLtMatrixLayoutCreate",
            Self::LtMatrixLayoutSetAttribute => "cublasLtMatrixLayoutSetAttribute",
            Self::LtMatrixLayoutDestroy => "cublasLtMatrixLayoutDestroy",
            Self::LtMatmulDescCreate => "cublasLtMatmulDescCreate",
            Self::LtMatmulDescSetAttribute => "cublasLtMatmulDescSetAttribute",
            Self::LtMatmulDescDestroy => "cublasLtMatmulDescDestroy",
        }
    }

    /// Whether `libcublasLt.so` exports it (else `libcublas.so`).
    pub const fn is_lt(self) -> bool {
        self as u32 > Self::LT_ID_BASE
    }

    /// A create call, which returns its handle through the out-pointer in its
    /// first argument: probed at its return too ([`blas_programs::CREATE_RETURN`]).
    pub const fn creates(self) -> bool {
        matches!(self, Self::LtMatrixLayoutCreate | Self::LtMatmulDescCreate)
    }

    /// A set-attribute call: the record's `value` holds the buffer's first
    /// `min(size, 8)` bytes.
    pub const fn sets_attribute(self) -> bool {
        matches!(self, Self::LtMatrixLayoutSetAttribute | Self::LtMatmulDescSetAttribute)
    }
}

/// Stack arguments a [`BlasRecord`] keeps: up to the 22nd argument
/// (`cublasGemmStridedBatchedEx`'s `computeType`), the most any probed call needs.
pub const BLAS_STACK_ARGS: usize = 16;

/// How many executable mappings of the BLAS libraries, per process, the
/// probes can tell their own internal calls from (see `maps::BLAS_TEXT`).
pub const BLAS_TEXTS: u32 = CODE_RANGES as u32;

/// One call into cuBLAS or cuBLASLt, arguments copied raw: the agent decodes
/// them by [`BlasCall`] (the kernel side does not interpret them). A call made
/// from inside a probed BLAS library (cuBLAS calling cuBLASLt) is not written.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct BlasRecord {
    pub header: RecordHeader,
    /// A [`BlasCall`] as `u32`.
    pub call: u32,
    /// A create's return value (`cublasStatus_t`, 0: success); 0 for the others.
    pub status: u32,
    /// The six register arguments (rdi, rsi, rdx, rcx, r8, r9), raw: a 32-bit
    /// argument's upper half is whatever the caller left there.
    pub args: [u64; 6],
    /// The return address at the function's entry.
    pub ret: u64,
    /// The stack arguments, the 7th onwards, each in its 8-byte slot (zero
    /// where the stack could not be read).
    pub stack: [u64; BLAS_STACK_ARGS],
    /// A create: the handle written through the out-pointer (0 on failure).
    /// A set-attribute: the buffer's first `min(size, 8)` bytes, zero-extended.
    pub value: u64,
}

// The decoder reads this size; `ret` and `stack` are read in one copy, so they stay adjacent.
const _: () = assert!(core::mem::size_of::<BlasRecord>() == 24 + 8 + 48 + 8 + 8 * BLAS_STACK_ARGS + 8);
const _: () = assert!(core::mem::offset_of!(BlasRecord, stack) == core::mem::offset_of!(BlasRecord, ret) + 8);

/// Names of the BLAS programs and maps.
pub mod blas_programs {
    /// Entry of every probed call but the creates (cookie: the `BlasCall` id |
    /// bytes pushed before the probe point << 32): writes a `BlasRecord`.
    pub const CALL: &str = "blas_call";
    /// Entry of a create (cookie as `CALL`): keeps the arguments per thread.
    pub const CREATE: &str = "blas_create";
    /// Return of a create (cookie: the `BlasCall` id): reads the handle, writes the record.
    pub const CREATE_RETURN: &str = "blas_create_return";
    /// `HashMap<tgid, [[u64; 2]; BLAS_TEXTS]>`: per process, `[start, end)`
    /// of the probed BLAS libraries' executable mappings; `end` 0 past the last.
    pub const TEXT_MAP: &str = "BLAS_TEXT";
}

/// The entry (`JitEnter`) or return (`JitExit`) of jaxlib's jit fast path,
/// `jax::(anonymous namespace)::PjitFunction::Call`, on the ordered ring with
/// the thread's sequence. The agent reads the function's name from the
/// target's memory through `function` (see `profiler::probes::jax`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct JitRecord {
    pub header: RecordHeader,
    /// This thread's ordered records so far, as [`OrderedRecord::seq`].
    pub seq: u32,
    /// Step functions the thread is inside, as [`OrderedRecord::depth`] (jit calls do not change it).
    pub depth: u32,
    /// The `PjitFunction*` (`this`: `rsi`, since the `absl::StatusOr` result
    /// goes through a hidden pointer in `rdi`); 0 at the return.
    pub function: u64,
    /// The Python object called (`rdx`: the `PjitFunctionObject*` that holds
    /// the `PjitFunction`); 0 at the return.
    pub callable: u64,
    /// Launches this thread had made when the probe fired.
    pub thread_launches: u64,
    /// As [`OrderedRecord::sched`].
    pub sched: SchedTimes,
}

const _: () = assert!(core::mem::size_of::<JitRecord>() == 96);

/// A jitted function's first call in a process (`maps::JIT_NEW`): the agent
/// reads the function's name at once, on a thread of its own, while the
/// target surely holds the function (a call of it is under way), not when the
/// call's [`JitRecord`] comes up in order, which under load can be after the
/// target let the function go (its exit clears a function's `__name__`).
/// Also the key of `JIT_SEEN`, the functions already announced.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(FromBytes, IntoBytes, KnownLayout, Immutable))]
pub struct JitFirstCall {
    pub tgid: u32,
    pub _pad: u32,
    /// The `PjitFunction*`, as [`JitRecord::function`].
    pub function: u64,
}

const _: () = assert!(core::mem::size_of::<JitFirstCall>() == 16);

/// Names of the jit programs.
pub mod jax_programs {
    /// Uprobe on `PjitFunction::Call`: writes the `JitEnter`.
    pub const ENTER: &str = "jax_jit_enter";
    /// Uretprobe on the same function: writes the `JitExit`.
    pub const EXIT: &str = "jax_jit_exit";
}
