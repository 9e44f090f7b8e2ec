//! Loading the eBPF object and attaching its programs to the target. What is
//! here is what every probe family shares (loading, the one attach call,
//! counters, detach, reading the target's files and memory); each family's
//! own attach code is in the module named for it: CUDA launches [`cuda`],
//! the dynamic loader's hook [`loader`], native steps [`step_symbol`], Python
//! steps [`python`], PyTorch regions [`torch`], BLAS calls [`blas`], NCCL
//! collectives [`nccl`], the job's processes and children [`job`].
pub mod blas;
pub mod copies;
pub mod cpu;
pub mod cuda;
pub mod elf;
pub mod jax;
mod job;
pub mod loader;
pub mod maps;
pub mod multi;
pub mod nccl;
pub mod placement;
pub mod python;
mod sched;
pub mod step_symbol;
pub mod torch;
pub mod usdt;

use std::{
    collections::HashSet,
    num::NonZeroU32,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, Map, MapData, PerCpuArray, RingBuf},
    programs::{
        RawTracePoint, UProbe,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLink, UProbeScope},
    },
};
use profiler_common::{
    CodeRanges, EVENTS_BYTES, LaunchApi, LaunchRecord, LaunchStage, ORDERED_EVENTS_BYTES, STAGE_LEN, STAGES, globals,
    maps as map_names, programs,
};

/// The eBPF object built by `cargo xtask build-ebpf`, embedded at build time.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/profiler-ebpf.o"));

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("this profiler binary was built without its eBPF object: run `cargo xtask build`")]
    NoObject,
    #[error("loading the eBPF object failed: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("eBPF program {name}: {source}")]
    Program { name: &'static str, source: aya::programs::ProgramError },
    /// A uprobe-multi link (see [`multi`]) the kernel refused.
    #[error("eBPF program {name}: uprobe-multi link on {path}: {source}")]
    MultiLink { name: &'static str, path: PathBuf, source: std::io::Error },
    #[error("eBPF object has no {0}; rebuild with `cargo xtask build`")]
    Missing(&'static str),
    #[error("map {name}: {source}")]
    Map { name: &'static str, source: aya::maps::MapError },
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {source}")]
    Elf { path: PathBuf, source: elf::ElfError },
    /// The kernel's type information, which following children needs.
    #[error(
        "cannot follow child processes: {0} (without --children, or with --no-children, the named processes are traced)"
    )]
    KernelTypes(String),
}

/// One probe to attach: a program, a file offset, the cookie it reads.
#[derive(Clone, Copy, Debug)]
pub struct ProbeSite {
    pub program: &'static str,
    pub offset: u64,
    pub cookie: u64,
}

impl ProbeSite {
    pub fn new(program: &'static str, offset: u64, cookie: u64) -> Self {
        Self { program, offset, cookie }
    }
}

/// How the probes of a session are attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    /// One uprobe-multi link per program and file (Linux ≥ 6.6).
    Multi,
    /// One perf-event link per probe: older kernels, or `PROFILER_UPROBE_MULTI=0`.
    PerProbe,
}

/// One attachment: a perf-event uprobe, or a multi link of many.
enum Link {
    // Held for its drop, which detaches.
    #[expect(dead_code, reason = "held only so that dropping it detaches the probe")]
    Perf(UProbeLink),
    #[expect(dead_code, reason = "held only so that dropping it detaches the probes")]
    Multi(std::os::fd::OwnedFd),
}

/// Where one probe went in a library, and why.
#[derive(Clone, Debug)]
pub struct PlacedProbe {
    pub symbol: &'static str,
    /// Bytes from the symbol's start.
    pub offset: u64,
    pub reason: String,
}

/// Where a probe goes in its function (see [`Probes::probe_point`]).
pub struct ProbePoint {
    /// Bytes from the function's start.
    pub offset: u64,
    /// Bytes the function pushed before that point.
    pub stack_adjust: u64,
    pub reason: String,
}

/// What [`Probes::load_job`] sets up besides the launch, step and sync probes.
#[derive(Clone, Copy, Debug)]
pub struct JobOptions {
    /// Trace the processes the named ones fork from now on (`--children`).
    pub follow_children: bool,
    /// A record per launch (`--launches all`), else counts only.
    pub emit_launches: bool,
    /// Move launch probes to instructions the kernel emulates.
    pub place_probes: bool,
    /// The scheduler programs (off with `--no-sched`).
    pub sched: bool,
}

/// Kernel-side counters, summed over CPUs.
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelCounters {
    /// Records the rings had no room for, both rings together.
    pub lost: u64,
    /// Of those, ordered-ring records (steps, syncs, thread exits, loader
    /// changes); named after the `sessions` column it fills.
    pub lost_step_records: u64,
    /// Of those, off-CPU records (launch ring): `sessions.lost_off_cpu_records`.
    pub lost_off_cpu: u64,
    /// Map updates that failed (see `profiler_common::maps::MAP_FAILURES`).
    pub map_failures: u64,
    /// Launches seen, each counted once, whether a record was kept or not.
    pub launches: u64,
}

/// The two ring buffers, which the caller owns so that they outlive the
/// probes (they are drained once more after the probes are detached).
pub struct Rings {
    /// Launch and kernel-name records.
    pub launches: RingBuf<MapData>,
    /// Step, sync and thread-exit records (the ordered ring,
    /// `profiler_common::maps::ORDERED_EVENTS`), and loader changes.
    pub ordered: RingBuf<MapData>,
    /// Jitted functions' first calls (`maps::JIT_NEW`), for `jax::NameReader`.
    pub jit_new: Option<RingBuf<MapData>>,
}

/// The loaded programs and their attachments to one target process.
pub struct Probes {
    ebpf: Ebpf,
    /// The first target: Python's step probes (USDT, frame hook) are its alone.
    pid: NonZeroU32,
    /// Where the uprobes fire (see [`Probes::load_job`]).
    scope: UProbeScope,
    /// The running kernel, for probe placement; None places every probe at
    /// its function's entry (`--probe-at-entry`).
    kernel: Option<placement::KernelVersion>,
    /// (st_dev, st_ino) of files already probed.
    probed: HashSet<(u64, u64)>,
    counters: [PerCpuArray<MapData, u64>; 5],
    stages: StagedLaunches,
    /// Every uprobe attached, owned here so that `detach` closes them all at
    /// once, each link with the number of probes it holds.
    links: Vec<(Link, usize)>,
    /// The programs for multi links, where the kernel makes them.
    multi: Option<multi::MultiPrograms>,
    /// Whether the CPU sampler is on (`attach_cpu_sampler`): CPython processes are then described to it.
    sampling: bool,
}

/// The launch records threads have staged in the kernel and not yet written
/// to the ring buffer (see [`profiler_common::LaunchStage`]).
pub struct StagedLaunches(Array<MapData, LaunchStage>);

impl StagedLaunches {
    /// Every stage's records, oldest first per thread. Read once the probes
    /// are detached and the ring buffer drained, they follow everything their
    /// thread wrote there.
    pub fn records(&self) -> Vec<LaunchRecord> {
        let mut out = Vec::new();
        for index in 0..STAGES {
            match self.0.get(&index, 0) {
                Ok(stage) => out.extend(stage.records.iter().take((stage.len as usize).min(STAGE_LEN)).copied()),
                Err(e) => log::warn!("reading launch stage {index}: {e}"),
            }
        }
        out
    }
}

/// Stands in for `pid_max` when sizing the per-thread slots (and so the
/// fallback map): with a handful, threads share slots, which exercises the
/// kernel side's fallback entries. For tests.
const THREAD_SLOTS_ENV: &str = "PROFILER_THREAD_SLOTS";

/// Sizes of the launch ring and the ordered ring in bytes (a power of two, at
/// least a page), instead of `EVENTS_BYTES` / `ORDERED_EVENTS_BYTES`: a small
/// ring overflows on purpose. For tests.
const RING_BYTES_ENV: &str = "PROFILER_RING_BYTES";
const ORDERED_RING_BYTES_ENV: &str = "PROFILER_STEP_RING_BYTES";

/// The most per-thread slots the kernel side gets (40 bytes each).
const MAX_THREAD_SLOTS: u32 = 1 << 16;

/// The fewest `THREAD_FALLBACK` entries.
const MIN_THREAD_FALLBACK: u32 = 1024;

/// How many per-thread slots to create: enough that no two tids share one
/// (`pid_max` rounded up to a power of two) where that is at most
/// [`MAX_THREAD_SLOTS`]; otherwise that many. Exits release slots, so only
/// live threads share them.
fn thread_slots(pid_max: Option<u32>) -> u32 {
    pid_max.map_or(MAX_THREAD_SLOTS, |p| p.max(2).next_power_of_two().min(MAX_THREAD_SLOTS))
}

/// Entries of `THREAD_FALLBACK`, for live threads whose slot another live
/// thread holds: with `slots` slots and n live threads about n²/2·slots of
/// them while n is well below `slots`, so a quarter of `slots` holds the
/// overflow of some 30 000 live threads on 65 536 slots.
fn thread_fallback_entries(slots: u32) -> u32 {
    (slots / 4).max(MIN_THREAD_FALLBACK)
}

/// A ring size from the environment (tests), if it is a usable one.
fn ring_bytes(var: &str, default: u32) -> u32 {
    match std::env::var(var).ok().and_then(|s| s.trim().parse::<u32>().ok()) {
        Some(n) if n.is_power_of_two() && n >= 4096 => n,
        Some(n) => {
            log::warn!("{var}={n} is not a power of two of at least 4096: using {default}");
            default
        }
        None => default,
    }
}

fn take_map(ebpf: &mut Ebpf, name: &'static str) -> Result<Map, ProbeError> {
    ebpf.take_map(name).ok_or(ProbeError::Missing(name))
}

impl Probes {
    /// Loads all programs, filtering on `pid`'s tgid, and attaches the
    /// thread-exit hook. Returns the probes and the rings.
    pub fn load(pid: NonZeroU32, emit_launches: bool, place_probes: bool) -> Result<(Self, Rings), ProbeError> {
        Self::load_job(&[pid], JobOptions { follow_children: false, emit_launches, place_probes, sched: false })
    }

    /// Loads all programs, tracing the processes `pids` (the first is the
    /// one Python's step probes go in) and, with `follow_children`, every
    /// process they fork from now on. One process: the uprobes fire in it
    /// alone (the kernel installs them in no other). Several, or children:
    /// they are installed file-wide, in every process that maps a probed
    /// file, and the programs drop what an untraced process does (`TRACED`);
    /// that is what sees a child from its first instruction after `exec`.
    pub fn load_job(pids: &[NonZeroU32], options: JobOptions) -> Result<(Self, Rings), ProbeError> {
        let JobOptions { follow_children, emit_launches, place_probes, sched } = options;
        if EBPF_OBJECT.is_empty() {
            return Err(ProbeError::NoObject);
        }
        let Some(&pid) = pids.first() else { return Err(ProbeError::Missing("a target PID")) };
        let scope =
            if pids.len() == 1 && !follow_children { UProbeScope::OneProcess(pid) } else { UProbeScope::AllProcesses };
        let follow: u32 = follow_children.into();
        let (pid_at, tgid_at, flags_at) = if follow_children || sched { job::task_offsets()? } else { (0, 0, 0) };
        let sched_on: u32 = sched.into();
        let emit: u32 = emit_launches.into();
        // Off-CPU intervals are per-call rows: kept where launches are.
        let slices: u32 = (sched && emit_launches).into();
        // Tests set a handful of slots so that threads share them.
        let slots = thread_slots(
            std::env::var(THREAD_SLOTS_ENV)
                .or_else(|_| std::fs::read_to_string("/proc/sys/kernel/pid_max"))
                .ok()
                .and_then(|s| s.trim().parse().ok()),
        );
        let slot_mask = slots - 1;
        let history = sched::history_per_cpu();
        let history_entries = (history * aya::util::nr_cpus().unwrap_or(1) as u32).max(1);
        let mut ebpf = EbpfLoader::new()
            .override_global(globals::FOLLOW_CHILDREN, &follow, true)
            .override_global(globals::TASK_PID_OFFSET, &pid_at, true)
            .override_global(globals::TASK_TGID_OFFSET, &tgid_at, true)
            .override_global(globals::EMIT_LAUNCHES, &emit, true)
            .override_global(globals::THREAD_SLOT_MASK, &slot_mask, true)
            .override_global(globals::SCHED_ENABLED, &sched_on, true)
            .override_global(globals::SCHED_SLICES, &slices, true)
            .override_global(globals::TASK_FLAGS_OFFSET, &flags_at, true)
            .override_global(globals::SCHED_HISTORY_PER_CPU, &history, true)
            .map_max_entries(map_names::SCHED_HISTORY, history_entries)
            .map_max_entries(map_names::THREAD_SLOTS, slots)
            .map_max_entries(map_names::SLOT_CLAIMS, slots)
            .map_max_entries(map_names::THREAD_FALLBACK, thread_fallback_entries(slots))
            .map_max_entries(map_names::EVENTS, ring_bytes(RING_BYTES_ENV, EVENTS_BYTES))
            .map_max_entries(map_names::ORDERED_EVENTS, ring_bytes(ORDERED_RING_BYTES_ENV, ORDERED_EVENTS_BYTES))
            .load(EBPF_OBJECT)?;
        let multi = match attach_mode() {
            AttachMode::Multi => multi::MultiPrograms::prepare(&ebpf, EBPF_OBJECT)
                .inspect_err(|e| log::warn!("uprobe-multi links unavailable ({e}): one link per probe"))
                .ok(),
            AttachMode::PerProbe => None,
        };
        // Without multi links every uprobe program is loaded now (a verifier
        // error shows before any probe goes in); with them, aya's copy of a
        // program is loaded only if a multi link is refused.
        if multi.is_none() {
            for name in program_names() {
                load_uprobe(&mut ebpf, name)?;
            }
        }
        // Released when a target thread exits: before any probe, so that no
        // thread's state outlives it.
        let name = programs::THREAD_EXIT;
        let exit_hook: &mut RawTracePoint = ebpf
            .program_mut(name)
            .ok_or(ProbeError::Missing(name))?
            .try_into()
            .map_err(|source| ProbeError::Program { name, source })?;
        exit_hook.load().map_err(|source| ProbeError::Program { name, source })?;
        exit_hook.attach(programs::THREAD_EXIT_TRACEPOINT).map_err(|source| ProbeError::Program { name, source })?;
        job::trace(&mut ebpf, pids)?;
        if sched {
            sched::attach(&mut ebpf)?;
        }
        if follow_children || pids.len() > 1 {
            job::attach_process_hooks(&mut ebpf, follow_children)?;
        }
        let mut ring = |name: &'static str| {
            RingBuf::try_from(take_map(&mut ebpf, name)?).map_err(|source| ProbeError::Map { name, source })
        };
        let rings = Rings {
            launches: ring(map_names::EVENTS)?,
            ordered: ring(map_names::ORDERED_EVENTS)?,
            jit_new: Some(ring(map_names::JIT_NEW)?),
        };
        let mut counter = |name: &'static str| {
            PerCpuArray::try_from(take_map(&mut ebpf, name)?).map_err(|source| ProbeError::Map { name, source })
        };
        let counters = [
            counter(map_names::LOST)?,
            counter(map_names::LOST_ORDERED)?,
            counter(map_names::MAP_FAILURES)?,
            counter(map_names::LAUNCHES)?,
            counter(map_names::LOST_OFF_CPU)?,
        ];
        let stages = Array::try_from(take_map(&mut ebpf, map_names::LAUNCH_STAGES)?)
            .map_err(|source| ProbeError::Map { name: map_names::LAUNCH_STAGES, source })?;
        let kernel = if place_probes { placement::running_kernel_version() } else { None };
        let stages = StagedLaunches(stages);
        let probes = Self {
            ebpf,
            pid,
            scope,
            kernel,
            probed: HashSet::new(),
            counters,
            stages,
            links: Vec::new(),
            multi,
            sampling: false,
        };
        Ok((probes, rings))
    }

    /// Traces the processes `pids` too: found after the load.
    pub fn trace_more(&mut self, pids: &[NonZeroU32]) -> Result<(), ProbeError> {
        job::trace(&mut self.ebpf, pids)
    }

    /// How many uprobes are attached.
    pub fn attached(&self) -> usize {
        self.links.iter().map(|(_, n)| n).sum()
    }

    /// How this session's probes are attached.
    pub fn attach_mode(&self) -> AttachMode {
        if self.multi.is_some() { AttachMode::Multi } else { AttachMode::PerProbe }
    }

    /// Attaches `sites` in `path`. With multi links, one link per program,
    /// made in the order the programs first appear in `sites` (so a return
    /// probe listed before its entry probe is in place first); a link the
    /// kernel refuses is retried one probe at a time, which names the probe
    /// it refuses. Without, one probe at a time in the order given. On an
    /// error the links made so far stay: callers that want all or nothing
    /// truncate `links`.
    fn attach_sites(&mut self, path: &Path, sites: &[ProbeSite]) -> Result<(), ProbeError> {
        if self.multi.is_none() {
            return sites.iter().try_for_each(|s| self.attach(s.program, path, s.offset, s.cookie));
        }
        let mut programs: Vec<&'static str> = Vec::new();
        for s in sites {
            if !programs.contains(&s.program) {
                programs.push(s.program);
            }
        }
        let pid = match self.scope {
            UProbeScope::OneProcess(pid) => Some(pid.get()),
            _ => None,
        };
        for program in programs {
            let group: Vec<&ProbeSite> = sites.iter().filter(|s| s.program == program).collect();
            let offsets: Vec<u64> = group.iter().map(|s| s.offset).collect();
            let cookies: Vec<u64> = group.iter().map(|s| s.cookie).collect();
            let Some(multi) = self.multi.as_mut() else { break };
            match multi.link(program, path, &offsets, &cookies, pid) {
                Ok(fd) => {
                    self.links.push((Link::Multi(fd), group.len()));
                }
                // The target is gone: no other way will attach either.
                Err(source) if source.raw_os_error() == Some(libc::ESRCH) => {
                    return Err(ProbeError::MultiLink { name: program, path: path.to_owned(), source });
                }
                Err(e) => {
                    log::info!("{program}: uprobe-multi link on {} refused ({e}); one probe at a time", path.display());
                    for s in group {
                        self.attach(s.program, path, s.offset, s.cookie)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// One probe on its own perf-event link.
    fn attach(&mut self, program: &'static str, path: &Path, offset: u64, cookie: u64) -> Result<(), ProbeError> {
        let prog = load_uprobe(&mut self.ebpf, program)?;
        let point = UProbeAttachPoint { location: UProbeAttachLocation::AbsoluteOffset(offset), cookie: Some(cookie) };
        // OneProcess: the kernel installs the breakpoints only in the target's
        // address space (all its threads), so other processes using the same
        // library pay nothing. A job's are file-wide (see `load_job`).
        let id =
            prog.attach(point, path, self.scope).map_err(|source| ProbeError::Program { name: program, source })?;
        let link = prog.take_link(id).map_err(|source| ProbeError::Program { name: program, source })?;
        self.links.push((Link::Perf(link), 1));
        Ok(())
    }

    /// Whether the probes are file-wide (a job): every process that maps a
    /// probed file takes the breakpoints, the programs keep the traced ones.
    pub fn file_wide(&self) -> bool {
        matches!(self.scope, UProbeScope::AllProcesses)
    }

    /// Whether `path` (by device and inode) is looked at for the first time
    /// by a job whose probes are file-wide, and is marked as looked at: one
    /// attach serves every process of the job that maps it. Always true for
    /// one process's probes.
    pub fn first_look(&mut self, path: &Path) -> bool {
        if matches!(self.scope, UProbeScope::OneProcess(_)) {
            return true;
        }
        match std::fs::metadata(path) {
            Ok(meta) => self.probed.insert((meta.dev(), meta.ino())),
            Err(_) => true,
        }
    }

    /// Where a hot probe on `sym` (in the file `data`) goes: placement's choice,
    /// or the entry under `--probe-at-entry`.
    pub fn probe_point(&self, data: &[u8], sym: &elf::FunctionSymbol) -> ProbePoint {
        let Some(kernel) = self.kernel else {
            return ProbePoint { offset: 0, stack_adjust: 0, reason: "at the entry (--probe-at-entry)".into() };
        };
        let code = data.get(sym.file_offset as usize..).unwrap_or_default();
        let p = placement::choose(&code[..code.len().min(placement::WINDOW)], sym.address, kernel);
        ProbePoint { offset: p.offset, stack_adjust: p.stack_adjust, reason: p.to_string() }
    }

    /// Adds `text` (`[start, end)` in process `tgid`) to the first free
    /// ranges of its entry in the code-range map `name` (see
    /// `profiler_common::CodeRanges`); returns the ranges it had no room for.
    pub(crate) fn add_code_ranges(
        &mut self,
        name: &'static str,
        tgid: u32,
        text: &[(u64, u64)],
    ) -> Result<Vec<(u64, u64)>, ProbeError> {
        let map = self.ebpf.map_mut(name).ok_or(ProbeError::Missing(name))?;
        let mut maps: aya::maps::HashMap<&mut MapData, u32, CodeRanges> =
            aya::maps::HashMap::try_from(map).map_err(|source| ProbeError::Map { name, source })?;
        let mut ranges = maps.get(&tgid, 0).unwrap_or_default();
        let mut free = ranges.iter_mut().filter(|r| r[1] == 0);
        let mut left_out = Vec::new();
        for &(start, end) in text {
            match free.next() {
                Some(slot) => *slot = [start, end],
                None => left_out.push((start, end)),
            }
        }
        maps.insert(tgid, ranges, 0).map_err(|source| ProbeError::Map { name, source })?;
        Ok(left_out)
    }

    /// The benchmark's floor: an empty program on `file_offset` of `path`.
    pub fn attach_bare(&mut self, path: &Path, file_offset: u64) -> Result<(), ProbeError> {
        self.attach_sites(path, &[ProbeSite::new(programs::BARE, file_offset, 0)])
    }

    pub fn counters(&self) -> KernelCounters {
        let sum = |m: &PerCpuArray<MapData, u64>| m.get(&0, 0).map(|v| v.iter().sum::<u64>()).unwrap_or(0);
        let [lost, lost_ordered, map_failures, launches, lost_off_cpu] = &self.counters;
        let lost_step_records = sum(lost_ordered);
        KernelCounters {
            lost: sum(lost) + lost_step_records,
            lost_step_records,
            lost_off_cpu: sum(lost_off_cpu),
            map_failures: sum(map_failures),
            launches: sum(launches),
        }
    }

    /// Stops every program and hands the probes' removal to a process of its
    /// own; returns the launches still staged, which no program changes any
    /// more.
    ///
    /// The kernel takes a uprobe off in ≈90 ms (it waits out a grace period
    /// under a global lock, so closing them from parallel threads is no
    /// faster): ≈4 s for a PyTorch target's 50. The session does not wait for
    /// that. `STOPPED` makes every program return at once (the caller drops
    /// records stamped after its stop time, taken before this); a moment
    /// later nothing writes to the rings or stages, and the last references
    /// to the probes go with a child process (see [`release_elsewhere`]),
    /// which leaves the target's probes, idle, for the kernel to remove.
    pub fn detach(self) -> StagedLaunches {
        let (count, t0) = (self.attached(), std::time::Instant::now());
        let Self { mut ebpf, stages, links, multi, .. } = self;
        let releaser = match stop_programs(&mut ebpf) {
            Ok(()) => {
                // Programs already past the check finish within microseconds.
                std::thread::sleep(std::time::Duration::from_millis(10));
                release_elsewhere()
                    .inspect_err(|e| log::warn!("removing the probes here, which takes a while: {e}"))
                    .ok()
            }
            Err(e) => {
                log::warn!("could not stop the probes ({e}); removing them here, which takes a while");
                None
            }
        };
        // Reference drops when the grandchild holds copies; else the slow closes, here.
        drop(links);
        drop(multi);
        drop(ebpf);
        // Lets the grandchild go: it closes the last references.
        drop(releaser);
        // The benchmark reads this line (`cargo xtask bench`, RUST_LOG=info).
        log::info!("detached {count} uprobes in {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
        stages
    }
}

/// Multi links where the kernel makes them, unless `PROFILER_UPROBE_MULTI=0`.
pub fn attach_mode() -> AttachMode {
    let wanted = std::env::var(multi::MULTI_ENV).map_or(true, |v| v.trim() != "0");
    if wanted && multi::kernel_has_multi() { AttachMode::Multi } else { AttachMode::PerProbe }
}

/// `name`, aya's copy, loaded if it is not yet.
fn load_uprobe<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut UProbe, ProbeError> {
    let prog: &mut UProbe = ebpf
        .program_mut(name)
        .ok_or(ProbeError::Missing(name))?
        .try_into()
        .map_err(|source| ProbeError::Program { name, source })?;
    if prog.fd().is_err() {
        prog.load().map_err(|source| ProbeError::Program { name, source })?;
    }
    Ok(prog)
}

/// Sets `STOPPED`: every program returns at once from now on.
fn stop_programs(ebpf: &mut Ebpf) -> Result<(), ProbeError> {
    let name = map_names::STOPPED;
    let map = ebpf.map_mut(name).ok_or(ProbeError::Missing(name))?;
    let mut stopped: Array<&mut MapData, u32> =
        Array::try_from(map).map_err(|source| ProbeError::Map { name, source })?;
    stopped.set(0, 1, 0).map_err(|source| ProbeError::Map { name, source })
}

/// The releaser's process name (`comm`, at most 15 bytes).
const RELEASER_NAME: &std::ffi::CStr = c"profiler-detach";

/// Leaves a copy of this process's file descriptors, the probes' among them,
/// to an orphaned grandchild that closes them once this process has closed
/// its own: the kernel's slow removal of each probe then runs there, and
/// this process's closes only drop references. The grandchild, named
/// [`RELEASER_NAME`], leaves the terminal's session (a Ctrl-C there is not
/// its), takes the default action of every signal (the stop-signal handlers
/// it inherited would swallow a SIGTERM: none of its threads reads them),
/// waits until the returned pipe end is dropped (or this process dies), and
/// exits; init (or the nearest subreaper) reaps it. A SIGTERM ends it at
/// once: its exit closes the descriptors, and the probes come off as well.
fn release_elsewhere() -> std::io::Result<std::os::fd::OwnedFd> {
    let (read_end, write_end) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    // SAFETY: the child and grandchild only make raw system calls (the
    // grandchild's fork as a plain syscall: glibc's fork runs atfork handlers)
    // and async-signal-safe calls (prctl, setsid, signal, sigprocmask, close,
    // read, _exit). The
    // grandchild also inherits the database's and samplers' descriptors; it
    // only closes them, and holds no lock (fcntl locks are not inherited).
    match unsafe { libc::fork() } {
        -1 => Err(std::io::Error::last_os_error()),
        0 => unsafe {
            if libc::syscall(libc::SYS_fork) == 0 {
                // What `ps` and the tests see it as: not a session.
                libc::prctl(libc::PR_SET_NAME, RELEASER_NAME.as_ptr());
                libc::setsid();
                for signal in 1..32 {
                    if signal != libc::SIGKILL && signal != libc::SIGSTOP {
                        libc::signal(signal, libc::SIG_DFL);
                    }
                }
                let mut none: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut none);
                libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
                libc::close(std::os::fd::AsRawFd::as_raw_fd(&write_end));
                let mut byte = 0u8;
                let fd = std::os::fd::AsRawFd::as_raw_fd(&read_end);
                while libc::read(fd, (&raw mut byte).cast(), 1) < 0 && *libc::__errno_location() == libc::EINTR {}
            }
            libc::_exit(0)
        },
        child => {
            // The intermediate child exits at once.
            // SAFETY: waiting for our own child.
            unsafe { libc::waitpid(child, std::ptr::null_mut(), 0) };
            drop(read_end);
            Ok(write_end)
        }
    }
}

/// The uprobe programs `Probes` loads (the USDT ones are `usdt`'s).
fn program_names() -> impl Iterator<Item = &'static str> {
    [programs::STEP_EXIT, programs::STEP_ENTER]
        .into_iter()
        .chain(LaunchApi::programs())
        .chain([
            programs::SYNC_ENTER,
            programs::SYNC_EXIT,
            programs::NAME_ENTER,
            programs::NAME_EXIT,
            programs::LOADER,
            programs::BARE,
        ])
        .chain(torch::programs())
        .chain(nccl::programs())
        .chain(blas::programs())
        .chain(copies::programs())
        .chain(jax::programs())
}

/// Maps a file read-only (libraries can be a gigabyte; callers touch only
/// their symbol tables and a few code blocks).
pub fn map_file(path: &Path) -> std::io::Result<memmap2::Mmap> {
    let f = std::fs::File::open(path)?;
    // SAFETY: a read-only private mapping of a file we only read; a concurrent
    // truncation could fault, which executable files in use do not see.
    unsafe { memmap2::Mmap::map(&f) }
}

/// A file of the target's, mapped: through the target's root (its mount
/// namespace) when the path is absolute, else or failing that as given.
pub fn open_in_target(pid: u32, path: &Path) -> Option<memmap2::Mmap> {
    let inside = path.is_absolute().then(|| map_file(&in_target_root(pid, path)).ok()).flatten();
    inside.or_else(|| map_file(path).ok())
}

/// Whether the process or thread whose `stat` this is has exited (a zombie
/// waiting to be reaped, or dead).
pub fn has_exited(stat: &procfs::process::Stat) -> bool {
    matches!(stat.state, 'Z' | 'X' | 'x')
}

/// Whether process `pid` exists and has not exited.
pub fn is_alive(pid: u32) -> bool {
    procfs::process::Process::new(pid as i32).and_then(|p| p.stat()).is_ok_and(|st| !has_exited(&st))
}

/// One word of process `pid`'s memory.
pub fn read_target_u64(pid: u32, address: u64) -> std::io::Result<u64> {
    read_u64_at(&std::fs::File::open(format!("/proc/{pid}/mem"))?, address)
}

/// One word at `address` of a process's memory opened as `mem` (`/proc/PID/mem`).
pub fn read_u64_at(mem: &std::fs::File, address: u64) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 8];
    mem.read_exact_at(&mut b, address)?;
    Ok(u64::from_le_bytes(b))
}

/// `path` as seen from inside `pid`'s mount namespace, reachable from ours.
pub fn in_target_root(pid: u32, path: &Path) -> PathBuf {
    let rel = path.strip_prefix("/").unwrap_or(path);
    PathBuf::from(format!("/proc/{pid}/root")).join(rel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_slots_cover_pid_max_up_to_the_cap() {
        assert_eq!(thread_slots(Some(32768)), 32768);
        assert_eq!(thread_slots(Some(40000)), 65536);
        assert_eq!(thread_slots(Some(4_194_304)), MAX_THREAD_SLOTS);
        assert_eq!(thread_slots(Some(0)), 2);
        assert_eq!(thread_slots(None), MAX_THREAD_SLOTS);
    }

    /// The deepest stack offset a BPF program's code touches: stores and loads
    /// through r10, and r10 copied and moved down (`rX = r10; rX += -N`).
    fn bpf_stack_depth(code: &[u8]) -> i64 {
        let mut depth = 0i64;
        let mut frame_copies = [false; 11];
        for insn in code.chunks_exact(8) {
            let (op, dst, src) = (insn[0], usize::from(insn[1] & 0xf), usize::from(insn[1] >> 4));
            let off = i64::from(i16::from_le_bytes([insn[2], insn[3]]));
            let imm = i64::from(i32::from_le_bytes([insn[4], insn[5], insn[6], insn[7]]));
            match op & 0x07 {
                // LDX: r10 as the source; ST/STX: as the destination.
                0x01 if src == 10 => depth = depth.max(-off),
                0x02 | 0x03 if dst == 10 => depth = depth.max(-off),
                _ => {}
            }
            if dst < frame_copies.len() {
                match op {
                    0xbf => frame_copies[dst] = src == 10,                // rX = rY
                    0x07 if frame_copies[dst] => depth = depth.max(-imm), // rX += imm
                    _ if op & 0x07 == 0x04 || op & 0x07 == 0x07 || op & 0x07 == 0x01 => frame_copies[dst] = false,
                    _ => {}
                }
            }
        }
        depth
    }

    /// The driver's hot launch programs keep their stack under 64 bytes: from
    /// 64 on the kernel runs a program on a per-CPU private stack, and the
    /// argument read into a buffer there costs each launch ≈40 ns more
    /// (`profiler-ebpf`'s `stack_words`). A change that keeps one more value
    /// across a helper call can cross the line unnoticed.
    #[test]
    fn hot_launch_programs_stay_off_the_private_stack() {
        use object::{Object, ObjectSection, ObjectSymbol};
        if EBPF_OBJECT.is_empty() {
            return; // built without the eBPF object (see build.rs)
        }
        let obj = object::File::parse(EBPF_OBJECT).expect("eBPF object");
        let uprobe = obj.section_by_name("uprobe").expect("uprobe section");
        let data = uprobe.data().expect("section data");
        for name in ["cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuGraphLaunch", "bare_probe"] {
            let sym = obj.symbols().find(|s| s.name() == Ok(name)).expect("program symbol");
            let (start, len) = ((sym.address() - uprobe.address()) as usize, sym.size() as usize);
            let depth = bpf_stack_depth(&data[start..start + len]);
            // The kernel rounds the depth up to 16 before comparing with 64.
            assert!((depth + 15) / 16 * 16 < 64, "{name} uses {depth} bytes of stack");
        }
        // The measure itself: a program that reads through a 64-byte buffer.
        let mut code = Vec::new();
        code.extend([0xbf, 0xa2, 0, 0, 0, 0, 0, 0]); // r2 = r10
        code.extend([0x07, 0x02, 0, 0, 0xc0, 0xff, 0xff, 0xff]); // r2 += -64
        assert_eq!(bpf_stack_depth(&code), 64);
    }

    /// Every launch probe goes to a program of its own, named after its entry
    /// point, unless it reads the stack after pushes; and every program
    /// so named is a uprobe in the eBPF object (the loader would fail
    /// otherwise, but only at attach time and as root).
    #[test]
    fn launch_programs_exist_and_only_pushed_stack_readers_share_one() {
        use object::{Object, ObjectSection, ObjectSymbol};
        if EBPF_OBJECT.is_empty() {
            return; // built without the eBPF object (see build.rs)
        }
        let obj = object::File::parse(EBPF_OBJECT).expect("eBPF object");
        let uprobes: HashSet<&str> = obj
            .symbols()
            .filter(|s| {
                s.section_index().and_then(|i| obj.section_by_index(i).ok()).is_some_and(|s| s.name() == Ok("uprobe"))
            })
            .filter_map(|s| s.name().ok())
            .collect();
        for name in LaunchApi::programs() {
            assert!(uprobes.contains(name), "no uprobe program {name}");
        }
        for api in LaunchApi::ALL {
            assert_eq!(api.program(0), api.symbol());
        }
        use LaunchApi::*;
        for (api, pushed) in [
            (CuLaunchKernel, programs::LAUNCH_DRIVER_PUSHED),
            (CuLaunchCooperativeKernelPtsz, programs::LAUNCH_DRIVER_PUSHED),
            (CudaLaunchKernel, "launch_runtime_classic"),
            (CudaLaunchCooperativeKernel, "launch_runtime_classic"),
            (CuLaunchKernelEx, "cuLaunchKernelEx"),
            (CuGraphLaunchPtsz, "cuGraphLaunch_ptsz"),
            (CudaLaunchKernelExC, "launch_runtime_ex"),
            (CudaGraphLaunch, "launch_runtime_graph"),
        ] {
            assert_eq!(api.program(16), pushed, "{api:?}");
        }
    }
}
