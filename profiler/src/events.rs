//! Decoding of ring-buffer records into typed events, and putting the two
//! rings' events back in each thread's order ([`OrderedQueue`]).
use std::collections::VecDeque;

use zerocopy::FromBytes;

use profiler_common::{
    BLAS_STACK_ARGS, BlasCall, BlasRecord, CollectiveOp, CollectiveRecord, JitRecord, KernelNameRecord, LaunchApi,
    LaunchRecord, OffCpuRecord, OrderedRecord, ProcessRecord, REGION_NAME_CAP, RecordHeader, RecordKind, RegionRecord,
    SchedTimes, copies::CopyRecord,
};

/// What the kernel had counted for a thread when a probe fired on it: its
/// launches, and where its time had gone (zero without scheduler tracing).
/// A step's figures are the differences between its end's and its start's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadCounters {
    pub launches: u64,
    pub sched: SchedTimes,
}

impl ThreadCounters {
    /// Only a launch count (records that carry no scheduler snapshot).
    pub fn launches(launches: u64) -> Self {
        Self { launches, sched: SchedTimes::default() }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchEvent {
    pub ts_ns: u64,
    pub tid: u32,
    /// The thread's process: which session the record belongs to.
    pub tgid: u32,
    pub api: LaunchApi,
    pub function: u64,
    pub stream: u64,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
}

/// A record of the ordered ring: a step or sync entry or return, or a thread's exit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OrderedEvent {
    pub ts_ns: u64,
    pub tid: u32,
    /// The thread's process: which session the record belongs to.
    pub tgid: u32,
    pub probe: u32,
    /// The thread's counters when the probe fired.
    pub counters: ThreadCounters,
    /// The thread's ordered records so far (0: none kept; see `OrderedRecord::seq`).
    pub seq: u32,
    /// Step functions the thread is inside after this record.
    pub depth: u32,
}

impl OrderedEvent {
    /// The sequence-check fields of an ordered record that is no step or
    /// sync probe's (a region, an NCCL call): `probe` is `u32::MAX`.
    pub fn of_record(ts_ns: u64, (tid, tgid): (u32, u32), counters: ThreadCounters, seq: u32, depth: u32) -> Self {
        Self { ts_ns, tid, tgid, probe: u32::MAX, counters, seq, depth }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Launch(LaunchEvent),
    StepEnter(OrderedEvent),
    StepExit(OrderedEvent),
    /// Entry of a synchronisation call (`probe`: its `SyncApi` id).
    SyncEnter(OrderedEvent),
    SyncExit(OrderedEvent),
    /// A thread of the target exited.
    ThreadExit(OrderedEvent),
    KernelName(KernelNameEvent),
    /// The dynamic loader changed the target's libraries.
    LoaderChange {
        ts_ns: u64,
        tgid: u32,
    },
    /// A traced process forked, exec'ed or exited.
    Process(ProcessEvent),
    /// A PyTorch `record_function` region began.
    RegionEnter(RegionEvent),
    /// A region ended (`name` empty).
    RegionExit(RegionEvent),
    /// An NCCL call returned.
    Collective(CollectiveEvent),
    /// A cuBLAS/cuBLASLt call (boxed: launches, far more frequent, keep the enum small).
    Blas(Box<BlasEvent>),
    /// A host↔device copy or memset returned.
    Copy(CopyEvent),
    /// A call of a `jax.jit` function began (jaxlib's `PjitFunction::Call`).
    JitEnter(JitEvent),
    /// That call returned (`function` 0).
    JitExit(JitEvent),
    /// A traced thread came back to a CPU (`--launches all` with the scheduler programs).
    OffCpu(OffCpuEvent),
    /// A traced thread was on a CPU when the sampling clock fired (`--cpu-sample`).
    CpuSample(CpuSampleEvent),
}

/// One CPU sample (see [`profiler_common::CpuSampleRecord`]): the ids are
/// `bpf_get_stackid`'s, None where the kernel kept no stack (or, for
/// `kernel_stack`, where the sample hit user code: `in_kernel` false).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuSampleEvent {
    pub tid: u32,
    pub tgid: u32,
    pub ts_ns: u64,
    /// 0: none read.
    pub user_ip: u64,
    pub user_stack: Option<u32>,
    pub kernel_stack: Option<u32>,
    pub in_kernel: bool,
    /// A CPython thread's Python frames: code object addresses, innermost
    /// first, with [`profiler_common::PY_FRAME_ENTRY`] marks; empty for
    /// another thread (see [`profiler_common::CpuSamplePythonRecord`]).
    pub python: Vec<u64>,
}

fn cpu_sample(bytes: &[u8], header: RecordHeader) -> Result<Event, DecodeError> {
    let r: profiler_common::CpuSampleRecord = exact(bytes, header.kind)?;
    Ok(Event::CpuSample(sample_event(&r, header, Vec::new())))
}

fn cpu_sample_python(bytes: &[u8], header: RecordHeader) -> Result<Event, DecodeError> {
    let r: profiler_common::CpuSamplePythonRecord = exact(bytes, header.kind)?;
    let depth = (r.depth as usize).min(r.frames.len());
    Ok(Event::CpuSample(sample_event(&r.sample, header, r.frames[..depth].to_vec())))
}

fn sample_event(r: &profiler_common::CpuSampleRecord, header: RecordHeader, python: Vec<u64>) -> CpuSampleEvent {
    let id = |v: i32| u32::try_from(v).ok();
    CpuSampleEvent {
        tid: header.tid,
        tgid: header.tgid,
        ts_ns: header.ts_ns,
        user_ip: r.user_ip,
        user_stack: id(r.user_stack),
        kernel_stack: id(r.kernel_stack),
        in_kernel: r.kernel_stack != profiler_common::NO_STACK,
        python,
    }
}

/// One time a thread was off its CPU (see [`OffCpuRecord`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OffCpuEvent {
    pub tid: u32,
    pub tgid: u32,
    pub left_ns: u64,
    /// None: it was preempted or yielded (runnable all the time).
    pub woken_ns: Option<u64>,
    /// When it ran again.
    pub resumed_ns: u64,
    pub state: OffCpuState,
}

/// Why a thread left its CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffCpuState {
    Runnable,
    Sleeping,
    Blocked,
}

impl OffCpuState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Runnable => "runnable",
            Self::Sleeping => "sleeping",
            Self::Blocked => "blocked",
        }
    }
}

/// Decodes an off-CPU record; one with an unknown state is malformed.
fn off_cpu(bytes: &[u8], header: RecordHeader) -> Result<Event, DecodeError> {
    use profiler_common::off_cpu_state as s;
    let r: OffCpuRecord = exact(bytes, header.kind)?;
    let state = match r.state {
        s::RUNNABLE => OffCpuState::Runnable,
        s::SLEEPING => OffCpuState::Sleeping,
        s::BLOCKED => OffCpuState::Blocked,
        _ => return Err(DecodeError::Kind(header.kind)),
    };
    Ok(Event::OffCpu(OffCpuEvent {
        tid: header.tid,
        tgid: header.tgid,
        left_ns: r.left_ns,
        woken_ns: (r.woken_ns != 0).then_some(r.woken_ns),
        resumed_ns: header.ts_ns,
        state,
    }))
}

/// One copy or memset call (see [`CopyRecord`]), its direction classified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyEvent {
    /// The return's time.
    pub ts_ns: u64,
    pub start_ns: u64,
    pub tid: u32,
    pub tgid: u32,
    pub seq: u32,
    pub depth: u32,
    /// The probed entry point.
    pub entry: &'static profiler_common::copies::CopyEntry,
    pub bytes: u64,
    pub direction: profiler_common::copies::CopyDirection,
    /// The call's return value (0: success).
    pub result: u32,
}

impl CopyEvent {
    /// The fields the step tracker's sequence check reads.
    pub fn as_ordered_event(&self) -> OrderedEvent {
        OrderedEvent::of_record(self.ts_ns, (self.tid, self.tgid), ThreadCounters::default(), self.seq, self.depth)
    }
}

/// Decodes a copy record; one naming no known entry point is malformed.
fn copy(bytes: &[u8], header: RecordHeader) -> Result<Event, DecodeError> {
    let r: CopyRecord = exact(bytes, header.kind)?;
    let entry = profiler_common::copies::COPY_ENTRIES.get(r.entry as usize).ok_or(DecodeError::Kind(header.kind))?;
    Ok(Event::Copy(CopyEvent {
        ts_ns: header.ts_ns,
        start_ns: r.start_ns,
        tid: header.tid,
        tgid: header.tgid,
        seq: r.seq,
        depth: r.depth,
        entry,
        bytes: r.bytes,
        direction: entry.direction(r.kind),
        result: r.result,
    }))
}

/// An ordered record of jaxlib's jit fast path (see [`JitRecord`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JitEvent {
    pub ts_ns: u64,
    pub tid: u32,
    pub tgid: u32,
    /// The `PjitFunction*` (0 at a return).
    pub function: u64,
    /// The Python object called (0 at a return).
    pub callable: u64,
    /// The thread's counters when the probe fired.
    pub counters: ThreadCounters,
    /// As [`OrderedEvent::seq`] / [`OrderedEvent::depth`].
    pub seq: u32,
    pub depth: u32,
}

impl JitEvent {
    /// The fields the step tracker's sequence check reads.
    pub fn as_ordered_event(&self) -> OrderedEvent {
        OrderedEvent::of_record(self.ts_ns, (self.tid, self.tgid), self.counters, self.seq, self.depth)
    }
}

/// Decodes a jit record.
fn jit(bytes: &[u8], header: RecordHeader) -> Result<Event, DecodeError> {
    let r: JitRecord = exact(bytes, header.kind)?;
    let e = JitEvent {
        ts_ns: header.ts_ns,
        tid: header.tid,
        tgid: header.tgid,
        function: r.function,
        callable: r.callable,
        counters: ThreadCounters { launches: r.thread_launches, sched: r.sched },
        seq: r.seq,
        depth: r.depth,
    };
    Ok(if header.kind == RecordKind::JitEnter as u32 { Event::JitEnter(e) } else { Event::JitExit(e) })
}

/// A cuBLAS/cuBLASLt call with its raw arguments (see [`BlasRecord`]),
/// decoded by the consumer (`consumer::blas`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlasEvent {
    pub ts_ns: u64,
    pub tid: u32,
    pub tgid: u32,
    pub call: BlasCall,
    pub status: u32,
    pub args: [u64; 6],
    pub stack: [u64; BLAS_STACK_ARGS],
    pub value: u64,
}

impl BlasEvent {
    /// The C argument at `index` (0-based): a register or a stack slot; 0 past those kept.
    pub fn arg(&self, index: usize) -> u64 {
        match index.checked_sub(self.args.len()) {
            None => self.args[index],
            Some(i) => self.stack.get(i).copied().unwrap_or(0),
        }
    }
}

/// Decodes a BLAS record.
fn blas(bytes: &[u8], header: RecordHeader) -> Result<Event, DecodeError> {
    let r: BlasRecord = exact(bytes, header.kind)?;
    let call = BlasCall::from_u32(r.call).ok_or(DecodeError::BlasCall(r.call))?;
    Ok(Event::Blas(Box::new(BlasEvent {
        ts_ns: header.ts_ns,
        tid: header.tid,
        tgid: header.tgid,
        call,
        status: r.status,
        args: r.args,
        stack: r.stack,
        value: r.value,
    })))
}

/// One NCCL call (see `profiler_common::CollectiveRecord`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollectiveEvent {
    /// The return's time (the record's place in its thread's order).
    pub ts_ns: u64,
    pub tid: u32,
    pub tgid: u32,
    pub op: CollectiveOp,
    pub start_ns: u64,
    pub count: u64,
    /// `ncclDataType_t` as passed (u32::MAX for the group calls).
    pub datatype: u32,
    /// Peer of send/recv, root of broadcast/reduce.
    pub peer: Option<i32>,
    pub comm: u64,
    pub stream: u64,
    pub thread_launches: u64,
    pub seq: u32,
    pub depth: u32,
}

impl CollectiveEvent {
    /// The fields the step tracker's sequence check reads.
    pub fn as_ordered_event(&self) -> OrderedEvent {
        let counters = ThreadCounters::launches(self.thread_launches);
        OrderedEvent::of_record(self.ts_ns, (self.tid, self.tgid), counters, self.seq, self.depth)
    }
}

/// Decodes a collective record.
fn collective(bytes: &[u8], header: RecordHeader) -> Result<Event, DecodeError> {
    let r: CollectiveRecord = exact(bytes, header.kind)?;
    let op = CollectiveOp::from_u32(r.op).ok_or(DecodeError::Api(r.op))?;
    Ok(Event::Collective(CollectiveEvent {
        ts_ns: header.ts_ns,
        tid: header.tid,
        tgid: header.tgid,
        op,
        start_ns: r.start_ns,
        count: r.count,
        datatype: r.datatype,
        peer: (r.peer != profiler_common::NO_PEER).then_some(r.peer),
        comm: r.comm,
        stream: r.stream,
        thread_launches: r.thread_launches,
        seq: r.seq,
        depth: r.depth,
    }))
}

/// What happened to a traced process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessChange {
    /// Forked from `parent` (a traced process), and traced from then on.
    Forked { parent: u32 },
    /// Exec'ed a new program.
    Exec,
    /// Its main thread exited.
    Exited,
}

/// A [`profiler_common::ProcessRecord`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessEvent {
    pub ts_ns: u64,
    pub pid: u32,
    pub change: ProcessChange,
}

/// An ordered record of a `record_function` region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionEvent {
    pub ts_ns: u64,
    pub tid: u32,
    /// The thread's process: which session the record belongs to.
    pub tgid: u32,
    /// The region's `PythonRecordFunction*`: pairs an end with its begin.
    pub key: u64,
    pub counters: ThreadCounters,
    /// As [`OrderedEvent::seq`] / [`OrderedEvent::depth`].
    pub seq: u32,
    pub depth: u32,
    /// Empty for an end.
    pub name: String,
    /// `name` is the start of a longer name.
    pub truncated: bool,
}

impl RegionEvent {
    /// The fields the step tracker's sequence check reads.
    pub fn as_ordered_event(&self) -> OrderedEvent {
        OrderedEvent::of_record(self.ts_ns, (self.tid, self.tgid), self.counters, self.seq, self.depth)
    }
}

/// Decodes a region record.
fn region(bytes: &[u8], header: RecordHeader) -> Result<Event, DecodeError> {
    let r: RegionRecord = exact(bytes, header.kind)?;
    let kept = (r.name_len as usize).min(REGION_NAME_CAP);
    let e = RegionEvent {
        ts_ns: header.ts_ns,
        tid: header.tid,
        tgid: header.tgid,
        key: r.key,
        counters: ThreadCounters { launches: r.thread_launches, sched: r.sched },
        seq: r.seq,
        depth: r.depth,
        name: String::from_utf8_lossy(&r.name[..kept]).into_owned(),
        truncated: r.name_len as usize > REGION_NAME_CAP,
    };
    Ok(if header.kind == RecordKind::RegionEnter as u32 { Event::RegionEnter(e) } else { Event::RegionExit(e) })
}

/// A handle the driver returned for a kernel, and its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelNameEvent {
    pub ts_ns: u64,
    /// The process that named the kernel.
    pub tgid: u32,
    /// A `profiler_common::name_call` constant.
    pub which: u32,
    pub handle: u64,
    /// For `cuKernelGetFunction`: the kernel the function belongs to.
    pub kernel: u64,
    /// Empty for `cuKernelGetFunction`.
    pub name: String,
}

impl Event {
    pub fn ts_ns(&self) -> u64 {
        match self {
            Self::Launch(l) => l.ts_ns,
            Self::StepEnter(s) | Self::StepExit(s) | Self::SyncEnter(s) | Self::SyncExit(s) | Self::ThreadExit(s) => {
                s.ts_ns
            }
            Self::KernelName(k) => k.ts_ns,
            Self::LoaderChange { ts_ns, .. } => *ts_ns,
            Self::RegionEnter(r) | Self::RegionExit(r) => r.ts_ns,
            Self::JitEnter(j) | Self::JitExit(j) => j.ts_ns,
            Self::Blas(b) => b.ts_ns,
            Self::Collective(c) => c.ts_ns,
            Self::Copy(c) => c.ts_ns,
            Self::OffCpu(o) => o.resumed_ns,
            Self::CpuSample(c) => c.ts_ns,
            Self::Process(p) => p.ts_ns,
        }
    }

    /// The process the event belongs to (for a process event, the one it is about).
    pub fn tgid(&self) -> u32 {
        match self {
            Self::Launch(l) => l.tgid,
            Self::StepEnter(s) | Self::StepExit(s) | Self::SyncEnter(s) | Self::SyncExit(s) | Self::ThreadExit(s) => {
                s.tgid
            }
            Self::KernelName(k) => k.tgid,
            Self::LoaderChange { tgid, .. } => *tgid,
            Self::RegionEnter(r) | Self::RegionExit(r) => r.tgid,
            Self::JitEnter(j) | Self::JitExit(j) => j.tgid,
            Self::Blas(b) => b.tgid,
            Self::Collective(c) => c.tgid,
            Self::Copy(c) => c.tgid,
            Self::OffCpu(o) => o.tgid,
            Self::CpuSample(c) => c.tgid,
            Self::Process(p) => p.pid,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("record of {0} bytes is shorter than its header")]
    Short(usize),
    #[error("record of kind {kind} has {len} bytes, expected {expected}")]
    Length { kind: u32, len: usize, expected: usize },
    #[error("unknown record kind {0}")]
    Kind(u32),
    #[error("unknown launch entry point id {0}")]
    Api(u32),
    #[error("unknown BLAS call id {0}")]
    BlasCall(u32),
}

/// The record of type `T` that is exactly `bytes`, copied out (the ring
/// buffer aligns records to 8 bytes, not to `T`).
fn exact<T: FromBytes>(bytes: &[u8], kind: u32) -> Result<T, DecodeError> {
    T::read_from_bytes(bytes).map_err(|_| DecodeError::Length {
        kind,
        len: bytes.len(),
        expected: std::mem::size_of::<T>(),
    })
}

/// The records in one ring-buffer record: itself, or the launch records of a
/// run a thread staged and wrote together (see `profiler_common::LaunchStage`).
pub fn records(bytes: &[u8]) -> std::slice::Chunks<'_, u8> {
    const LAUNCH: usize = std::mem::size_of::<LaunchRecord>();
    let run = bytes.len() > LAUNCH
        && bytes.len().is_multiple_of(LAUNCH)
        && RecordHeader::read_from_prefix(bytes).is_ok_and(|(h, _)| h.kind == RecordKind::Launch as u32);
    bytes.chunks(if run { LAUNCH } else { bytes.len().max(1) })
}

/// The event of a launch record.
pub fn launch(r: &LaunchRecord) -> Result<Event, DecodeError> {
    let api = LaunchApi::from_u32(r.api).ok_or(DecodeError::Api(r.api))?;
    Ok(Event::Launch(LaunchEvent {
        ts_ns: r.header.ts_ns,
        tid: r.header.tid,
        tgid: r.header.tgid,
        api,
        function: r.function,
        stream: r.stream,
        grid: r.grid,
        block: r.block,
        shared_mem_bytes: r.shared_mem_bytes,
    }))
}

/// Decodes one record.
pub fn decode(bytes: &[u8]) -> Result<Event, DecodeError> {
    let (header, _) = RecordHeader::read_from_prefix(bytes).map_err(|_| DecodeError::Short(bytes.len()))?;
    match RecordKind::from_u32(header.kind) {
        Some(RecordKind::Launch) => launch(&exact::<LaunchRecord>(bytes, header.kind)?),
        Some(
            kind @ (RecordKind::StepEnter
            | RecordKind::StepExit
            | RecordKind::SyncEnter
            | RecordKind::SyncExit
            | RecordKind::ThreadExit),
        ) => {
            let r: OrderedRecord = exact(bytes, header.kind)?;
            let e = OrderedEvent {
                ts_ns: header.ts_ns,
                tid: header.tid,
                tgid: header.tgid,
                probe: r.probe,
                counters: ThreadCounters { launches: r.thread_launches, sched: r.sched },
                seq: r.seq,
                depth: r.depth,
            };
            Ok(match kind {
                RecordKind::StepEnter => Event::StepEnter(e),
                RecordKind::StepExit => Event::StepExit(e),
                RecordKind::SyncEnter => Event::SyncEnter(e),
                RecordKind::SyncExit => Event::SyncExit(e),
                _ => Event::ThreadExit(e),
            })
        }
        Some(RecordKind::KernelName) => {
            let r: KernelNameRecord = exact(bytes, header.kind)?;
            let len = r.name.iter().position(|b| *b == 0).unwrap_or(r.name.len());
            Ok(Event::KernelName(KernelNameEvent {
                ts_ns: header.ts_ns,
                tgid: header.tgid,
                which: r.which,
                handle: r.handle,
                kernel: r.kernel,
                name: String::from_utf8_lossy(&r.name[..len]).into_owned(),
            }))
        }
        Some(RecordKind::LoaderChange) => {
            exact::<RecordHeader>(bytes, header.kind)?;
            Ok(Event::LoaderChange { ts_ns: header.ts_ns, tgid: header.tgid })
        }
        Some(RecordKind::RegionEnter | RecordKind::RegionExit) => region(bytes, header),
        Some(RecordKind::JitEnter | RecordKind::JitExit) => jit(bytes, header),
        Some(RecordKind::Blas) => blas(bytes, header),
        Some(RecordKind::Collective) => collective(bytes, header),
        Some(RecordKind::Copy) => copy(bytes, header),
        Some(RecordKind::OffCpu) => off_cpu(bytes, header),
        Some(RecordKind::CpuSample) => cpu_sample(bytes, header),
        Some(RecordKind::CpuSamplePython) => cpu_sample_python(bytes, header),
        Some(kind @ (RecordKind::ProcessFork | RecordKind::ProcessExec | RecordKind::ProcessExit)) => {
            let r: ProcessRecord = exact(bytes, header.kind)?;
            let change = match kind {
                RecordKind::ProcessFork => ProcessChange::Forked { parent: r.parent },
                RecordKind::ProcessExec => ProcessChange::Exec,
                _ => ProcessChange::Exited,
            };
            Ok(Event::Process(ProcessEvent { ts_ns: header.ts_ns, pid: r.pid, change }))
        }
        None => Err(DecodeError::Kind(header.kind)),
    }
}

/// Holds the ordered ring's events until they can be handed on in their
/// thread's order with its launches, which come on the other ring.
///
/// The kernel side writes a thread's launches (staged or not) to the launch
/// ring before it reserves that thread's next ordered record. So, with the
/// launch ring read first and the ordered ring after it, every ordered record
/// that precedes a launch just read is in by then; an ordered record just read
/// may still have launches before it that are not. An ordered event is therefore held
/// until either a later launch of its thread comes (it goes just before it),
/// or a whole drain of the launch ring has passed since it was read
/// ([`OrderedQueue::end_drain`]), which has brought every launch before it. A
/// launch record reserved and not yet committed for a whole drain tick would
/// still come late; after the probes are detached nothing is in flight, and
/// [`OrderedQueue::release_all`] is exact.
#[derive(Default)]
pub struct OrderedQueue {
    /// Held ordered events per thread, oldest first, with the drain they were read in.
    held: Vec<(u32, VecDeque<(u64, Event)>)>,
    /// The earliest timestamp held: launches before it release nothing.
    earliest_ns: u64,
    drain: u64,
}

impl OrderedQueue {
    /// Holds an ordered-ring event (any other event is handed on at once).
    pub fn push(&mut self, event: Event, out: &mut Vec<Event>) {
        let tid = match &event {
            Event::StepEnter(e)
            | Event::StepExit(e)
            | Event::SyncEnter(e)
            | Event::SyncExit(e)
            | Event::ThreadExit(e) => e.tid,
            Event::RegionEnter(r) | Event::RegionExit(r) => r.tid,
            Event::Collective(c) => c.tid,
            Event::Copy(c) => c.tid,
            Event::JitEnter(j) | Event::JitExit(j) => j.tid,
            _ => return out.push(event),
        };
        if self.held.is_empty() {
            self.earliest_ns = event.ts_ns();
        } else {
            self.earliest_ns = self.earliest_ns.min(event.ts_ns());
        }
        let entry = (self.drain, event);
        match self.held.iter_mut().find(|(t, _)| *t == tid) {
            Some((_, q)) => q.push_back(entry),
            None => self.held.push((tid, VecDeque::from([entry]))),
        }
    }

    /// Hands on, in order, the held events of thread `tid` that precede its
    /// launch at `ts_ns`.
    #[inline]
    pub fn before_launch(&mut self, tid: u32, ts_ns: u64, out: &mut Vec<Event>) {
        if self.held.is_empty() || ts_ns < self.earliest_ns {
            return;
        }
        let Some(i) = self.held.iter().position(|(t, _)| *t == tid) else { return };
        let q = &mut self.held[i].1;
        let before = q.len();
        while q.front().is_some_and(|(_, e)| e.ts_ns() < ts_ns) {
            out.extend(q.pop_front().map(|(_, e)| e));
        }
        if q.len() != before {
            self.forget_empty();
        }
    }

    /// The end of a drain of both rings: hands on the events read in earlier
    /// drains (the launches before them have all been read by now).
    pub fn end_drain(&mut self, out: &mut Vec<Event>) {
        let drain = self.drain;
        self.release(out, |d| d < drain);
        self.drain += 1;
    }

    /// Hands on everything held (the probes are gone; nothing is in flight).
    pub fn release_all(&mut self, out: &mut Vec<Event>) {
        self.release(out, |_| true);
    }

    fn release(&mut self, out: &mut Vec<Event>, due: impl Fn(u64) -> bool) {
        let start = out.len();
        for (_, q) in &mut self.held {
            while q.front().is_some_and(|(d, _)| due(*d)) {
                out.extend(q.pop_front().map(|(_, e)| e));
            }
        }
        // Threads' events interleaved in time, as the ring had them.
        out[start..].sort_by_key(Event::ts_ns);
        self.forget_empty();
    }

    fn forget_empty(&mut self) {
        self.held.retain(|(_, q)| !q.is_empty());
        self.earliest_ns = self.held.iter().filter_map(|(_, q)| q.front()).map(|(_, e)| e.ts_ns()).min().unwrap_or(0);
    }
}

#[cfg(test)]
mod tests {
    use zerocopy::{Immutable, IntoBytes};

    use super::*;

    fn bytes_of<T: IntoBytes + Immutable>(v: &T) -> Vec<u8> {
        v.as_bytes().to_vec()
    }

    #[test]
    fn decodes_process_records_and_every_records_process() {
        let header = |kind: RecordKind| RecordHeader { kind: kind as u32, tid: 11, ts_ns: 9, tgid: 10, _pad: 0 };
        let fork = ProcessRecord { header: header(RecordKind::ProcessFork), pid: 12, parent: 10 };
        let e = decode(&bytes_of(&fork)).expect("decodes");
        assert_eq!(e, Event::Process(ProcessEvent { ts_ns: 9, pid: 12, change: ProcessChange::Forked { parent: 10 } }));
        // A process event belongs to the process it is about, not the one that wrote it.
        assert_eq!(e.tgid(), 12);
        let exit = ProcessRecord { header: header(RecordKind::ProcessExit), pid: 10, parent: 0 };
        assert!(matches!(
            decode(&bytes_of(&exit)),
            Ok(Event::Process(ProcessEvent { change: ProcessChange::Exited, .. }))
        ));
        let exec = ProcessRecord { header: header(RecordKind::ProcessExec), pid: 10, parent: 0 };
        assert!(matches!(
            decode(&bytes_of(&exec)),
            Ok(Event::Process(ProcessEvent { change: ProcessChange::Exec, .. }))
        ));
        let loader = header(RecordKind::LoaderChange);
        assert_eq!(decode(&bytes_of(&loader)).expect("decodes").tgid(), 10);
        let ordered = OrderedRecord {
            header: header(RecordKind::StepEnter),
            probe: 0,
            seq: 1,
            thread_launches: 0,
            depth: 1,
            _pad: 0,
            sched: SchedTimes::default(),
        };
        assert_eq!(decode(&bytes_of(&ordered)).expect("decodes").tgid(), 10);
    }

    #[test]
    fn decodes_launch() {
        let r = LaunchRecord {
            header: RecordHeader { kind: RecordKind::Launch as u32, tid: 7, ts_ns: 123, tgid: 0, _pad: 0 },
            api: LaunchApi::CuLaunchKernelEx as u32,
            shared_mem_bytes: 4096,
            function: 0xdead,
            stream: 0xbeef,
            grid: [1, 2, 3],
            block: [4, 5, 6],
        };
        let e = decode(&bytes_of(&r)).expect("decodes");
        assert_eq!(
            e,
            Event::Launch(LaunchEvent {
                ts_ns: 123,
                tid: 7,
                tgid: 0,
                api: LaunchApi::CuLaunchKernelEx,
                function: 0xdead,
                stream: 0xbeef,
                grid: [1, 2, 3],
                block: [4, 5, 6],
                shared_mem_bytes: 4096
            })
        );
    }

    #[test]
    fn decodes_cpu_samples_in_user_and_kernel_mode() {
        let header = RecordHeader { kind: RecordKind::CpuSample as u32, tid: 5, ts_ns: 900, tgid: 4, _pad: 0 };
        let user = profiler_common::CpuSampleRecord {
            header,
            user_ip: 0x401000,
            user_stack: 7,
            kernel_stack: profiler_common::NO_STACK,
        };
        let e = CpuSampleEvent {
            tid: 5,
            tgid: 4,
            ts_ns: 900,
            user_ip: 0x401000,
            user_stack: Some(7),
            kernel_stack: None,
            in_kernel: false,
            python: Vec::new(),
        };
        assert_eq!(decode(&bytes_of(&user)), Ok(Event::CpuSample(e.clone())));
        // -EEXIST for the user stack (its bucket held another), a kernel stack kept.
        let kernel = profiler_common::CpuSampleRecord { user_stack: -17, kernel_stack: 3, ..user };
        assert_eq!(
            decode(&bytes_of(&kernel)),
            Ok(Event::CpuSample(CpuSampleEvent {
                user_stack: None,
                kernel_stack: Some(3),
                in_kernel: true,
                ..e.clone()
            }))
        );
        // A CPython thread's sample: its frames, as many as the record says.
        let mut frames = [0u64; profiler_common::PY_STACK_DEPTH];
        frames[..3].copy_from_slice(&[0x7000, 0x7100 | profiler_common::PY_FRAME_ENTRY, 0x7200]);
        let python = profiler_common::CpuSamplePythonRecord {
            sample: profiler_common::CpuSampleRecord {
                header: RecordHeader { kind: RecordKind::CpuSamplePython as u32, ..header },
                ..user
            },
            depth: 3,
            truncated: 0,
            frames,
        };
        assert_eq!(
            decode(&bytes_of(&python)),
            Ok(Event::CpuSample(CpuSampleEvent { python: vec![0x7000, 0x7101, 0x7200], ..e }))
        );
    }

    #[test]
    fn decodes_off_cpu_records() {
        let header = RecordHeader { kind: RecordKind::OffCpu as u32, tid: 5, ts_ns: 900, tgid: 4, _pad: 0 };
        let slept = OffCpuRecord {
            header,
            left_ns: 100,
            woken_ns: 700,
            state: profiler_common::off_cpu_state::SLEEPING,
            _pad: 0,
        };
        let e = OffCpuEvent {
            tid: 5,
            tgid: 4,
            left_ns: 100,
            woken_ns: Some(700),
            resumed_ns: 900,
            state: OffCpuState::Sleeping,
        };
        assert_eq!(decode(&bytes_of(&slept)), Ok(Event::OffCpu(e)));
        let preempted = OffCpuRecord { woken_ns: 0, state: profiler_common::off_cpu_state::RUNNABLE, ..slept };
        assert_eq!(
            decode(&bytes_of(&preempted)),
            Ok(Event::OffCpu(OffCpuEvent { woken_ns: None, state: OffCpuState::Runnable, ..e }))
        );
        assert_eq!(records(&bytes_of(&slept)).count(), 1, "not taken for a run of launches");
        let odd = OffCpuRecord { state: 9, ..slept };
        assert_eq!(decode(&bytes_of(&odd)), Err(DecodeError::Kind(RecordKind::OffCpu as u32)));
    }

    #[test]
    fn decodes_loader_change() {
        let h = RecordHeader { kind: RecordKind::LoaderChange as u32, tid: 3, ts_ns: 77, tgid: 0, _pad: 0 };
        assert_eq!(decode(&bytes_of(&h)), Ok(Event::LoaderChange { ts_ns: 77, tgid: 0 }));
        let mut long = bytes_of(&h);
        long.extend([0u8; 8]);
        assert_eq!(decode(&long), Err(DecodeError::Length { kind: 7, len: 32, expected: 24 }));
    }

    #[test]
    fn decodes_step_records_at_odd_alignment() {
        let r = OrderedRecord {
            header: RecordHeader { kind: RecordKind::StepExit as u32, tid: 9, ts_ns: 55, tgid: 0, _pad: 0 },
            probe: 2,
            seq: 7,
            thread_launches: 1000,
            depth: 3,
            _pad: 0,
            sched: SchedTimes { cpu_ns: 1, runnable_ns: 2, sleep_ns: 3, blocked_ns: 4, process_cpu_ns: 5 },
        };
        let mut buf = vec![0u8];
        buf.extend(bytes_of(&r));
        let e = decode(&buf[1..]).expect("decodes");
        assert_eq!(
            e,
            Event::StepExit(OrderedEvent {
                ts_ns: 55,
                tid: 9,
                tgid: 0,
                probe: 2,
                counters: ThreadCounters {
                    launches: 1000,
                    sched: SchedTimes { cpu_ns: 1, runnable_ns: 2, sleep_ns: 3, blocked_ns: 4, process_cpu_ns: 5 }
                },
                seq: 7,
                depth: 3
            })
        );
        let exit = OrderedRecord { header: RecordHeader { kind: RecordKind::ThreadExit as u32, ..r.header }, ..r };
        assert!(matches!(decode(&bytes_of(&exit)), Ok(Event::ThreadExit(OrderedEvent { seq: 7, tid: 9, .. }))));
    }

    #[test]
    fn decodes_region_records_and_says_when_a_name_was_cut() {
        let mut r = RegionRecord {
            header: RecordHeader { kind: RecordKind::RegionEnter as u32, tid: 4, ts_ns: 9, tgid: 0, _pad: 0 },
            seq: 3,
            depth: 0,
            key: 0xabc,
            thread_launches: 12,
            name_len: 5,
            _pad: 0,
            sched: SchedTimes::default(),
            name: [0; REGION_NAME_CAP],
        };
        r.name[..5].copy_from_slice(b"fwd#1");
        let Ok(Event::RegionEnter(e)) = decode(&bytes_of(&r)) else { panic!("a region enter") };
        assert_eq!((e.name.as_str(), e.truncated, e.key, e.seq, e.counters.launches), ("fwd#1", false, 0xabc, 3, 12));
        r.name = [b'x'; REGION_NAME_CAP];
        r.name_len = 300;
        r.header.kind = RecordKind::RegionExit as u32;
        let Ok(Event::RegionExit(e)) = decode(&bytes_of(&r)) else { panic!("a region exit") };
        assert_eq!((e.name.len(), e.truncated), (REGION_NAME_CAP, true));
        let mut q = OrderedQueue::default();
        let mut out = Vec::new();
        q.push(Event::RegionExit(e), &mut out);
        assert!(out.is_empty(), "held like the other ordered records");
    }

    #[test]
    fn rejects_bad_records() {
        assert_eq!(decode(&[0u8; 4]), Err(DecodeError::Short(4)));
        let mut h = bytes_of(&RecordHeader { kind: 99, tid: 1, ts_ns: 1, tgid: 0, _pad: 0 });
        assert_eq!(decode(&h), Err(DecodeError::Kind(99)));
        h = bytes_of(&RecordHeader { kind: RecordKind::Launch as u32, tid: 1, ts_ns: 1, tgid: 0, _pad: 0 });
        assert_eq!(decode(&h), Err(DecodeError::Length { kind: 1, len: 24, expected: 72 }));
        let mut r = LaunchRecord {
            header: RecordHeader { kind: RecordKind::Launch as u32, tid: 7, ts_ns: 123, tgid: 0, _pad: 0 },
            api: 55,
            shared_mem_bytes: 0,
            function: 0,
            stream: 0,
            grid: [0; 3],
            block: [0; 3],
        };
        assert_eq!(decode(&bytes_of(&r)), Err(DecodeError::Api(55)));
        r.api = LaunchApi::CudaGraphLaunchPtsz as u32;
        assert!(decode(&bytes_of(&r)).is_ok());
        // A launch record with trailing bytes is not a launch record.
        let mut long = bytes_of(&r);
        long.extend([0u8; 8]);
        assert_eq!(decode(&long), Err(DecodeError::Length { kind: 1, len: 80, expected: 72 }));
    }

    #[test]
    fn a_staged_run_splits_into_its_launches_and_nothing_else_does() {
        let launch = |i: u32| LaunchRecord {
            header: RecordHeader { kind: RecordKind::Launch as u32, tid: 7, ts_ns: u64::from(i), tgid: 0, _pad: 0 },
            api: LaunchApi::CuLaunchKernel as u32,
            shared_mem_bytes: 0,
            function: u64::from(i),
            stream: 0,
            grid: [i, 1, 1],
            block: [1; 3],
        };
        let run: Vec<u8> = (0..16).flat_map(|i| bytes_of(&launch(i))).collect();
        let events: Vec<Event> = records(&run).map(|r| decode(r).expect("decodes")).collect();
        assert_eq!(events.len(), 16);
        assert!(events.iter().enumerate().all(|(i, e)| e.ts_ns() == i as u64));
        // One record of another kind, or a single launch, is one record.
        let step = bytes_of(&OrderedRecord {
            header: RecordHeader { kind: RecordKind::StepEnter as u32, tid: 7, ts_ns: 1, tgid: 0, _pad: 0 },
            probe: 0,
            seq: 1,
            thread_launches: 0,
            depth: 1,
            _pad: 0,
            sched: SchedTimes::default(),
        });
        assert_eq!(records(&step).count(), 1);
        assert_eq!(records(&run[..64]).count(), 1);
        // A run that is not a whole number of launches is left whole, to fail decoding.
        assert_eq!(records(&run[..100]).map(|r| r.len()).collect::<Vec<_>>(), vec![100]);
        assert!(records(&[]).next().is_none());
    }

    #[test]
    fn step_events_go_before_the_launches_that_follow_them() {
        let step = |kind: fn(OrderedEvent) -> Event, tid, ts| {
            kind(OrderedEvent {
                ts_ns: ts,
                tid,
                tgid: 0,
                probe: 0,
                counters: ThreadCounters::default(),
                seq: 0,
                depth: 0,
            })
        };
        let launch = |tid, ts| LaunchEvent {
            ts_ns: ts,
            tid,
            tgid: 0,
            api: LaunchApi::CuLaunchKernel,
            function: 0,
            stream: 0,
            grid: [0; 3],
            block: [0; 3],
            shared_mem_bytes: 0,
        };
        let mut q = OrderedQueue::default();
        let mut out = Vec::new();
        q.push(step(Event::StepEnter, 1, 10), &mut out);
        q.push(step(Event::StepExit, 1, 30), &mut out);
        q.push(step(Event::StepEnter, 2, 15), &mut out);
        q.push(Event::LoaderChange { ts_ns: 5, tgid: 0 }, &mut out);
        assert_eq!(out, vec![Event::LoaderChange { ts_ns: 5, tgid: 0 }], "only ordered-ring events are held");
        out.clear();
        // Thread 1's launch at 20 follows its entry at 10, precedes its exit at 30.
        let l = launch(1, 20);
        q.before_launch(l.tid, l.ts_ns, &mut out);
        assert_eq!(out.iter().map(Event::ts_ns).collect::<Vec<_>>(), vec![10]);
        out.clear();
        // Another thread's launch releases nothing of thread 1's.
        q.before_launch(3, 40, &mut out);
        assert!(out.is_empty());
        // Read in this drain: held past its end; the next drain's end hands them on, in time order.
        q.end_drain(&mut out);
        assert!(out.is_empty());
        q.end_drain(&mut out);
        assert_eq!(out.iter().map(Event::ts_ns).collect::<Vec<_>>(), vec![15, 30]);
        out.clear();
        q.push(step(Event::SyncEnter, 4, 50), &mut out);
        q.release_all(&mut out);
        assert_eq!(out.len(), 1);
        q.before_launch(4, 60, &mut out);
        assert_eq!(out.len(), 1, "nothing left");
    }
}
