//! Decoding of ring-buffer records into typed events.
use profiler_common::{KernelNameRecord, LaunchApi, LaunchRecord, RecordHeader, RecordKind, StepRecord};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchEvent {
    pub ts_ns: u64,
    pub tid: u32,
    pub api: LaunchApi,
    pub function: u64,
    pub stream: u64,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepEvent {
    pub ts_ns: u64,
    pub tid: u32,
    pub probe: u32,
    /// The thread's launch count when the probe fired.
    pub thread_launches: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Launch(LaunchEvent),
    StepEnter(StepEvent),
    StepExit(StepEvent),
    /// Entry of a synchronisation call (`probe`: its `SyncApi` id).
    SyncEnter(StepEvent),
    SyncExit(StepEvent),
    KernelName(KernelNameEvent),
    /// The dynamic loader changed the target's libraries.
    LoaderChange {
        ts_ns: u64,
    },
}

/// A handle the driver returned for a kernel, and its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelNameEvent {
    pub ts_ns: u64,
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
            Self::StepEnter(s) | Self::StepExit(s) | Self::SyncEnter(s) | Self::SyncExit(s) => s.ts_ns,
            Self::KernelName(k) => k.ts_ns,
            Self::LoaderChange { ts_ns } => *ts_ns,
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
}

fn read<T: Copy>(bytes: &[u8]) -> T {
    debug_assert!(bytes.len() >= std::mem::size_of::<T>());
    // SAFETY: callers check the length; T is a #[repr(C)] plain-old-data record
    // from profiler-common, valid for any bit pattern; read_unaligned copes with
    // the ring buffer's 8-byte (not T-) alignment.
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) }
}

fn exact<T>(bytes: &[u8], kind: u32) -> Result<(), DecodeError> {
    let expected = std::mem::size_of::<T>();
    if bytes.len() != expected {
        return Err(DecodeError::Length { kind, len: bytes.len(), expected });
    }
    Ok(())
}

/// The records in one ring-buffer record: itself, or the launch records of a
/// run a thread staged and wrote together (see `profiler_common::LaunchStage`).
pub fn records(bytes: &[u8]) -> std::slice::Chunks<'_, u8> {
    const LAUNCH: usize = std::mem::size_of::<LaunchRecord>();
    let run = bytes.len() > LAUNCH
        && bytes.len().is_multiple_of(LAUNCH)
        && read::<RecordHeader>(bytes).kind == RecordKind::Launch as u32;
    bytes.chunks(if run { LAUNCH } else { bytes.len().max(1) })
}

/// The event of a launch record.
pub fn launch(r: &LaunchRecord) -> Result<Event, DecodeError> {
    let api = LaunchApi::from_u32(r.api).ok_or(DecodeError::Api(r.api))?;
    Ok(Event::Launch(LaunchEvent {
        ts_ns: r.header.ts_ns,
        tid: r.header.tid,
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
    if bytes.len() < std::mem::size_of::<RecordHeader>() {
        return Err(DecodeError::Short(bytes.len()));
    }
    let header: RecordHeader = read(bytes);
    match RecordKind::from_u32(header.kind) {
        Some(RecordKind::Launch) => {
            exact::<LaunchRecord>(bytes, header.kind)?;
            launch(&read(bytes))
        }
        Some(kind @ (RecordKind::StepEnter | RecordKind::StepExit | RecordKind::SyncEnter | RecordKind::SyncExit)) => {
            exact::<StepRecord>(bytes, header.kind)?;
            let r: StepRecord = read(bytes);
            let e =
                StepEvent { ts_ns: header.ts_ns, tid: header.tid, probe: r.probe, thread_launches: r.thread_launches };
            Ok(match kind {
                RecordKind::StepEnter => Event::StepEnter(e),
                RecordKind::StepExit => Event::StepExit(e),
                RecordKind::SyncEnter => Event::SyncEnter(e),
                _ => Event::SyncExit(e),
            })
        }
        Some(RecordKind::KernelName) => {
            exact::<KernelNameRecord>(bytes, header.kind)?;
            let r: KernelNameRecord = read(bytes);
            let len = r.name.iter().position(|b| *b == 0).unwrap_or(r.name.len());
            Ok(Event::KernelName(KernelNameEvent {
                ts_ns: header.ts_ns,
                which: r.which,
                handle: r.handle,
                kernel: r.kernel,
                name: String::from_utf8_lossy(&r.name[..len]).into_owned(),
            }))
        }
        Some(RecordKind::LoaderChange) => {
            exact::<RecordHeader>(bytes, header.kind)?;
            Ok(Event::LoaderChange { ts_ns: header.ts_ns })
        }
        None => Err(DecodeError::Kind(header.kind)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_of<T>(v: &T) -> Vec<u8> {
        // SAFETY: test-only view of a padding-free #[repr(C)] record.
        unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }.to_vec()
    }

    #[test]
    fn decodes_launch() {
        let r = LaunchRecord {
            header: RecordHeader { kind: RecordKind::Launch as u32, tid: 7, ts_ns: 123 },
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
    fn decodes_loader_change() {
        let h = RecordHeader { kind: RecordKind::LoaderChange as u32, tid: 3, ts_ns: 77 };
        assert_eq!(decode(&bytes_of(&h)), Ok(Event::LoaderChange { ts_ns: 77 }));
        let mut long = bytes_of(&h);
        long.extend([0u8; 8]);
        assert_eq!(decode(&long), Err(DecodeError::Length { kind: 7, len: 24, expected: 16 }));
    }

    #[test]
    fn decodes_step_records_at_odd_alignment() {
        let r = StepRecord {
            header: RecordHeader { kind: RecordKind::StepExit as u32, tid: 9, ts_ns: 55 },
            probe: 2,
            _pad: 0,
            thread_launches: 1000,
        };
        let mut buf = vec![0u8];
        buf.extend(bytes_of(&r));
        let e = decode(&buf[1..]).expect("decodes");
        assert_eq!(e, Event::StepExit(StepEvent { ts_ns: 55, tid: 9, probe: 2, thread_launches: 1000 }));
    }

    #[test]
    fn rejects_bad_records() {
        assert_eq!(decode(&[0u8; 4]), Err(DecodeError::Short(4)));
        let mut h = bytes_of(&RecordHeader { kind: 99, tid: 1, ts_ns: 1 });
        assert_eq!(decode(&h), Err(DecodeError::Kind(99)));
        h = bytes_of(&RecordHeader { kind: RecordKind::Launch as u32, tid: 1, ts_ns: 1 });
        assert_eq!(decode(&h), Err(DecodeError::Length { kind: 1, len: 16, expected: 64 }));
        let mut r = LaunchRecord {
            header: RecordHeader { kind: RecordKind::Launch as u32, tid: 7, ts_ns: 123 },
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
        assert_eq!(decode(&long), Err(DecodeError::Length { kind: 1, len: 72, expected: 64 }));
    }

    #[test]
    fn a_staged_run_splits_into_its_launches_and_nothing_else_does() {
        let launch = |i: u32| LaunchRecord {
            header: RecordHeader { kind: RecordKind::Launch as u32, tid: 7, ts_ns: u64::from(i) },
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
        let step = bytes_of(&StepRecord {
            header: RecordHeader { kind: RecordKind::StepEnter as u32, tid: 7, ts_ns: 1 },
            probe: 0,
            _pad: 0,
            thread_launches: 0,
        });
        assert_eq!(records(&step).count(), 1);
        assert_eq!(records(&run[..64]).count(), 1);
        // A run that is not a whole number of launches is left whole, to fail decoding.
        assert_eq!(records(&run[..100]).map(|r| r.len()).collect::<Vec<_>>(), vec![100]);
        assert!(records(&[]).next().is_none());
    }
}
