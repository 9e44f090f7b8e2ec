//! A session's CPU-sample stacks: the kernel's stack ids turned into the
//! session's deduplicated `frames` and `stacks`, symbolised as they first
//! come (the process, its libraries, may be gone at the end) with blazesym:
//! the target's ELF symbols through its own maps, the kernel's kallsyms. A
//! CPython thread's Python frames (code objects, named once each) take the
//! places of the interpreter's loop in its native stack.
use std::{
    collections::{HashMap, HashSet},
    rc::Rc,
    sync::Arc,
};

use blazesym::{
    Pid,
    symbolize::{
        Input, Reason, Symbolized, Symbolizer,
        source::{Elf, Kernel, Process, Source},
    },
};

use super::python_frames::{self, PyCodeReader};
use crate::{
    events::CpuSampleEvent,
    probes::cpu::CpuStackMap,
    store::{FrameRow, StackRow},
};

/// Frame kinds (`frames.kind`).
const NATIVE: &str = "native";
const KERNEL: &str = "kernel";
const PYTHON: &str = "python";

/// What every session of a job names its samples' stacks with: the kernel's
/// stack map, and one symbolizer, so that kallsyms and each library (every
/// rank maps the same libtorch) are parsed once for the job, not once per
/// process on the event loop while new ranks wait to be looked at.
#[derive(Clone)]
pub(super) struct StackNamer {
    map: Arc<CpuStackMap>,
    symbolizer: Rc<Symbolizer>,
}

impl StackNamer {
    pub fn new(map: Arc<CpuStackMap>) -> Self {
        Self { map, symbolizer: Rc::new(Symbolizer::new()) }
    }

    /// Reads kallsyms now: once the probes are in and before the event loop
    /// runs (not during attach, which it would lengthen by as much). Its
    /// first parse takes ≈70 ms on the 2-core VM, and on the loop that held
    /// a drain long enough for a small ring to overflow.
    pub fn read_kallsyms(&self) {
        let t0 = std::time::Instant::now();
        let any_kernel_address: &[u64] = &[0xffff_ffff_8100_0000];
        let kernel = Source::Kernel(Kernel::default());
        if let Err(e) = self.symbolizer.symbolize(&kernel, Input::AbsAddr(any_kernel_address)) {
            log::debug!("reading kallsyms ahead: {e}");
        }
        log::debug!("kallsyms read ahead in {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
    }
}

pub(super) struct CpuStacks {
    map: Arc<CpuStackMap>,
    pid: u32,
    symbolizer: Rc<Symbolizer>,
    /// Kernel stack id -> the frame ids of its user (by this process) or kernel stack.
    user: HashMap<u32, Vec<u32>>,
    kernel: HashMap<u32, Vec<u32>>,
    /// Symbolised user leaves of samples without a user stack.
    leaves: HashMap<u64, u32>,
    frame_ids: HashMap<FrameKey, u32>,
    stack_ids: HashMap<Vec<u32>, u32>,
    new_frames: Vec<FrameRow>,
    new_stacks: Vec<StackRow>,
    /// Samples with a user stack, and of those the ones whose stack ends
    /// within [`SHALLOW`] frames (see [`CpuStacks::no_frame_pointers`]).
    user_samples: u64,
    shallow_samples: u64,
    /// The process's CPython, when it runs one the sampler reads.
    python: Option<PyCodeReader>,
    /// Code object address -> its frame id (None: it could not be read).
    code_frames: HashMap<u64, Option<u32>>,
    /// The native frames of the interpreter's loop.
    loop_frames: HashSet<u32>,
    /// The process's executable mappings as last read.
    maps: Vec<ExecMap>,
    /// Every address named so far, by kind: a new stack is mostly addresses
    /// named before (the interpreter's loop, libtorch's dispatch), and only
    /// the others are read and named, with the maps read only then. The user
    /// ones are forgotten when the process's libraries change.
    named: HashMap<(&'static str, u64), Named>,
    /// The maps are to be read again before the next naming.
    maps_stale: bool,
    /// When the maps were last read.
    maps_read_at: Option<std::time::Instant>,
    /// Whether the process's root is the agent's (None: not looked at yet):
    /// its files are then named by their own paths, which every process of a
    /// job shares (the symbolizer parses each file once), else through
    /// `/proc/PID/root` (a container's).
    same_root: Option<bool>,
}

/// Whether `pid`'s root directory is the agent's.
fn same_root(pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (theirs, ours) = (std::fs::metadata(format!("/proc/{pid}/root")), std::fs::metadata("/"));
    theirs.is_ok_and(|t| ours.is_ok_and(|o| (t.dev(), t.ino()) == (o.dev(), o.ino())))
}

/// An executable mapping: its addresses, and the file (None: anonymous,
/// the vDSO) and offset they come from.
struct ExecMap {
    range: std::ops::Range<u64>,
    offset: u64,
    path: Option<std::path::PathBuf>,
}

/// `pid`'s executable mappings; None once it has exited.
fn exec_maps(pid: u32) -> Option<Vec<ExecMap>> {
    use procfs::process::{MMPermissions, MMapPath};
    let maps = procfs::process::Process::new(pid as i32).and_then(|p| p.maps()).ok()?;
    let exec = maps
        .iter()
        .filter(|m| m.perms.contains(MMPermissions::EXECUTE))
        .map(|m| ExecMap {
            range: m.address.0..m.address.1,
            offset: m.offset,
            // A path that is gone by the time it is needed fails there, once, in `by_files`.
            path: match &m.pathname {
                MMapPath::Path(p) => Some(p.clone()),
                _ => None,
            },
        })
        .collect();
    Some(exec)
}

/// A frame's (kind, module, function, line).
type FrameKey = (&'static str, Option<String>, String, Option<u32>);
/// A frame, and whether its address was in no mapping of the process.
type Named = (FrameKey, bool);

/// How often addresses in none of the maps as last read make them be read
/// again (a new mapping may hold them).
const REREAD_MAPS: std::time::Duration = std::time::Duration::from_secs(1);

/// A user stack this deep or less: a leaf and one caller at most.
const SHALLOW: usize = 2;

impl CpuStacks {
    pub fn new(namer: StackNamer, pid: u32) -> Self {
        Self {
            map: namer.map,
            pid,
            symbolizer: namer.symbolizer,
            user: HashMap::new(),
            kernel: HashMap::new(),
            leaves: HashMap::new(),
            frame_ids: HashMap::new(),
            stack_ids: HashMap::new(),
            new_frames: Vec::new(),
            new_stacks: Vec::new(),
            user_samples: 0,
            shallow_samples: 0,
            python: None,
            code_frames: HashMap::new(),
            loop_frames: HashSet::new(),
            maps: Vec::new(),
            named: HashMap::new(),
            maps_stale: true,
            maps_read_at: None,
            same_root: None,
        }
    }

    /// The process mapped or unmapped code (a `dlopen`, a `dlclose`, an
    /// `exec`): an address named before may now be another function's.
    pub fn forget_user_addresses(&mut self) {
        self.named.retain(|(kind, _), _| *kind == KERNEL);
        self.maps_stale = true;
    }

    /// The process's Python frames are read with `reader` from now on.
    pub fn read_python(&mut self, reader: PyCodeReader) {
        self.python = Some(reader);
        self.code_frames.clear();
    }

    /// The session's stack id of each sample, in order, naming what is new.
    pub fn stack_ids(&mut self, samples: &[&CpuSampleEvent]) -> Vec<u32> {
        self.name_new(samples);
        samples
            .iter()
            .map(|s| {
                let mut frames = Vec::new();
                if let Some(k) = s.kernel_stack.and_then(|id| self.kernel.get(&id)) {
                    frames.extend_from_slice(k);
                }
                let mut user = Vec::new();
                match s.user_stack.and_then(|id| self.user.get(&id)) {
                    Some(u) => {
                        self.user_samples += 1;
                        self.shallow_samples += u64::from(u.len() <= SHALLOW);
                        user.extend_from_slice(u);
                    }
                    None => user.extend(self.leaves.get(&s.user_ip).copied()),
                }
                if s.python.is_empty() {
                    frames.extend(user);
                } else {
                    let runs = self.python_runs(&s.python);
                    frames.extend(python_frames::merge(&user, |f| self.loop_frames.contains(&f), &runs));
                }
                self.stack_id(frames)
            })
            .collect()
    }

    /// A sample's Python frames as frame ids, in runs (see `python_frames::runs`);
    /// a code object that cannot be read is left out.
    fn python_runs(&mut self, python: &[u64]) -> Vec<Vec<u32>> {
        python_frames::runs(python)
            .into_iter()
            .map(|run| run.into_iter().filter_map(|code| self.code_frame(code)).collect())
            .collect()
    }

    fn code_frame(&mut self, code: u64) -> Option<u32> {
        if let Some(&known) = self.code_frames.get(&code) {
            return known;
        }
        let named = self.python.as_ref().and_then(|r| r.code(code));
        let id = named.map(|c| self.frame_id((PYTHON, Some(c.file), c.function, Some(c.first_line))));
        self.code_frames.insert(code, id);
        id
    }

    /// The share of the samples' user stacks that end within two frames,
    /// when it is most of them (90 % of 50 samples or more): the walk, which
    /// follows frame pointers, stopped at once, as it does in code built
    /// without them (`-fomit-frame-pointer`, most distributions' default).
    pub fn no_frame_pointers(&self) -> Option<f64> {
        let share = self.shallow_samples as f64 / self.user_samples.max(1) as f64;
        (self.user_samples >= 50 && share >= 0.9).then_some(share)
    }

    /// The frames and stacks first seen since the last call.
    pub fn take_new(&mut self) -> (Vec<FrameRow>, Vec<StackRow>) {
        (std::mem::take(&mut self.new_frames), std::mem::take(&mut self.new_stacks))
    }

    /// Reads and names the stacks (and leaves) these samples bring that are not known yet.
    fn name_new(&mut self, samples: &[&CpuSampleEvent]) {
        let mut user_ids: Vec<u32> = samples.iter().filter_map(|s| s.user_stack).collect();
        user_ids.sort_unstable();
        user_ids.dedup();
        user_ids.retain(|id| !self.user.contains_key(id));
        let mut kernel_ids: Vec<u32> = samples.iter().filter_map(|s| s.kernel_stack).collect();
        kernel_ids.sort_unstable();
        kernel_ids.dedup();
        kernel_ids.retain(|id| !self.kernel.contains_key(id));
        let mut leaves: Vec<u64> = samples
            .iter()
            .filter(|s| s.user_stack.is_none() && s.user_ip != 0 && !self.leaves.contains_key(&s.user_ip))
            .map(|s| s.user_ip)
            .collect();
        leaves.sort_unstable();
        leaves.dedup();
        let user: Vec<(u32, Vec<u64>)> =
            user_ids.into_iter().map(|id| (id, self.map.ips(id).unwrap_or_default())).collect();
        let kernel: Vec<(u32, Vec<u64>)> =
            kernel_ids.into_iter().map(|id| (id, self.map.ips(id).unwrap_or_default())).collect();
        // Return addresses point past their call: the call is at the byte before.
        let lookup = |ips: &[u64]| -> Vec<u64> {
            ips.iter().enumerate().map(|(n, &ip)| if n == 0 { ip } else { ip.saturating_sub(1) }).collect()
        };
        let user_addrs: Vec<u64> = user.iter().flat_map(|(_, ips)| lookup(ips)).chain(leaves.iter().copied()).collect();
        let kernel_addrs: Vec<u64> = kernel.iter().flat_map(|(_, ips)| lookup(ips)).collect();
        let user_names = self.names(NATIVE, &user_addrs);
        let kernel_names = self.names(KERNEL, &kernel_addrs);
        let mut user_names = user_names.into_iter();
        for (id, ips) in user {
            let names: Vec<Named> = user_names.by_ref().take(ips.len()).collect();
            // A caller in no mapping of the process: the frame-pointer walk
            // went astray (code without frame pointers); it and what follows go.
            let kept = names.iter().skip(1).position(|n| n.1).map_or(names.len(), |p| p + 1);
            let frames = names.into_iter().take(kept).map(|n| self.frame_id(n.0)).collect();
            self.user.insert(id, frames);
        }
        for ip in leaves {
            if let Some(n) = user_names.next() {
                let id = self.frame_id(n.0);
                self.leaves.insert(ip, id);
            }
        }
        let mut kernel_names = kernel_names.into_iter();
        for (id, ips) in kernel {
            let frames = kernel_names.by_ref().take(ips.len()).map(|n| self.frame_id(n.0)).collect();
            self.kernel.insert(id, frames);
        }
    }

    /// Each address's frame, a hex address where no symbol covers it, and
    /// whether the address is in none of the process's executable mappings
    /// (a return address there is no return address: the walk went astray).
    /// A user address is named through the process while it lives, and
    /// through the mappings last seen (file and offset) once it has exited:
    /// its last samples are named after it, at the end of the session.
    fn names(&mut self, kind: &'static str, addrs: &[u64]) -> Vec<Named> {
        let mut new: Vec<u64> = addrs.iter().copied().filter(|&a| !self.named.contains_key(&(kind, a))).collect();
        new.sort_unstable();
        new.dedup();
        let named = if new.is_empty() { Vec::new() } else { self.name_addresses(kind, &new) };
        // An address in none of the maps (a frame-pointer walk gone astray,
        // mostly) is named for these samples but not kept: a later read of
        // the maps may hold it.
        let mut passing = HashMap::new();
        for (a, n) in new.into_iter().zip(named) {
            if kind == KERNEL || self.maps.iter().any(|m| m.range.contains(&a)) {
                self.named.insert((kind, a), n);
            } else {
                passing.insert(a, n);
            }
        }
        addrs.iter().map(|a| self.named.get(&(kind, *a)).unwrap_or_else(|| &passing[a]).clone()).collect()
    }

    /// [`Self::names`] for addresses not named before, each once.
    fn name_addresses(&mut self, kind: &'static str, addrs: &[u64]) -> Vec<Named> {
        let t0 = std::time::Instant::now();
        let mut alive = true;
        // The maps are read again only when they may have changed: after a
        // change to the loaded code, or for an address they do not hold (a
        // new anonymous mapping). Reading them costs 1–2 ms in a PyTorch
        // process, and almost every naming brings some new address (a leaf).
        let in_maps = |maps: &[ExecMap], a: &u64| maps.iter().any(|m| m.range.contains(a));
        let outside = !addrs.iter().all(|a| in_maps(&self.maps, a));
        let due = self.maps_read_at.is_none_or(|at| at.elapsed() >= REREAD_MAPS);
        if kind != KERNEL && (self.maps_stale || (outside && due)) {
            match exec_maps(self.pid) {
                Some(maps) => self.maps = maps,
                None => alive = false,
            }
            self.maps_stale = false;
            self.maps_read_at = Some(std::time::Instant::now());
        }
        let symbolize = |src: &Source, input: Input<&[u64]>| {
            self.symbolizer.symbolize(src, input).map_err(|e| {
                log::debug!("symbolizing {} addresses of PID {}: {e}", addrs.len(), self.pid);
            })
        };
        let found: Vec<Symbolized> = match kind {
            KERNEL => symbolize(&Source::Kernel(Kernel::default()), Input::AbsAddr(addrs)).unwrap_or_default(),
            _ => {
                let pid = self.pid;
                let rooted = alive && !*self.same_root.get_or_insert_with(|| same_root(pid));
                let mut found = self.by_files(addrs, rooted);
                // Code in no file (the vDSO, a JIT's): through the process
                // while it lives, which knows the vDSO's symbols.
                let fileless: Vec<usize> = (0..addrs.len())
                    .filter(|&n| {
                        matches!(found[n], Symbolized::Unknown(_))
                            && self.maps.iter().any(|m| m.path.is_none() && m.range.contains(&addrs[n]))
                    })
                    .collect();
                if alive && !fileless.is_empty() {
                    let these: Vec<u64> = fileless.iter().map(|&n| addrs[n]).collect();
                    let process = Source::Process(Process::new(Pid::from(self.pid)));
                    if let Ok(syms) = symbolize(&process, Input::AbsAddr(&these)) {
                        fileless.into_iter().zip(syms).for_each(|(n, sym)| found[n] = sym);
                    }
                }
                found
            }
        };
        // Without any mapping known (the process gone before its first
        // naming), blazesym's own verdict (no mapping at all) stands.
        let known = kind != KERNEL && !self.maps.is_empty();
        let astray = |addr: u64, unmapped: bool| {
            kind != KERNEL && if known { !self.maps.iter().any(|m| m.range.contains(&addr)) } else { unmapped }
        };
        let named = addrs
            .iter()
            .enumerate()
            .map(|(n, &addr)| match found.get(n) {
                Some(Symbolized::Sym(sym)) => {
                    let module = match kind {
                        KERNEL => sym.module.as_ref().map(|m| m.to_string_lossy().into_owned()),
                        _ => sym.module.as_ref().map(|m| {
                            let path = std::path::Path::new(&**m);
                            path.file_name().unwrap_or(path.as_os_str()).to_string_lossy().into_owned()
                        }),
                    };
                    ((kind, module, sym.name.to_string(), None), astray(addr, false))
                }
                Some(Symbolized::Unknown(Reason::Unmapped)) => {
                    ((kind, None, format!("{addr:#x}"), None), astray(addr, true))
                }
                _ => ((kind, None, format!("{addr:#x}"), None), astray(addr, false)),
            })
            .collect::<Vec<_>>();
        log::debug!(
            "named {} {kind} addresses of PID {}{} in {:.1} ms",
            addrs.len(),
            self.pid,
            if alive || kind == KERNEL { "" } else { " (exited: by its files)" },
            t0.elapsed().as_secs_f64() * 1e3
        );
        named
    }

    /// `addrs` named in the files the process has mapped there (its
    /// mappings as last read), one symbolize call per file: with `rooted`
    /// through its root (a container's files, while it lives), else, or if
    /// that fails (it has exited since), by the same path from here.
    fn by_files(&self, addrs: &[u64], rooted: bool) -> Vec<Symbolized<'_>> {
        let mut found: Vec<Symbolized> = vec![Symbolized::Unknown(Reason::Unmapped); addrs.len()];
        let mut by_file: HashMap<&std::path::Path, (Vec<usize>, Vec<u64>)> = HashMap::new();
        for (n, &addr) in addrs.iter().enumerate() {
            if let Some(m) = self.maps.iter().find(|m| m.range.contains(&addr))
                && let Some(path) = &m.path
            {
                let (at, offsets) = by_file.entry(path).or_default();
                at.push(n);
                offsets.push(addr - m.range.start + m.offset);
            }
        }
        for (path, (at, offsets)) in by_file {
            let rooted = rooted.then(|| crate::probes::in_target_root(self.pid, path));
            // The process may have exited since its maps were read.
            for file in rooted.iter().map(|p| p.as_path()).chain([path]) {
                let src = Source::Elf(Elf::new(file));
                match self.symbolizer.symbolize(&src, Input::FileOffset(&offsets)) {
                    Ok(syms) => {
                        at.iter().zip(syms).for_each(|(&n, sym)| found[n] = sym);
                        break;
                    }
                    Err(e) => log::debug!("symbolizing {} offsets in {}: {e}", offsets.len(), file.display()),
                }
            }
        }
        found
    }

    fn frame_id(&mut self, key: FrameKey) -> u32 {
        if let Some(&id) = self.frame_ids.get(&key) {
            return id;
        }
        let id = self.frame_ids.len() as u32;
        if key.0 == NATIVE && python_frames::is_eval_loop(&key.2) {
            self.loop_frames.insert(id);
        }
        self.new_frames.push(FrameRow {
            frame_id: id,
            kind: key.0,
            module: key.1.clone(),
            function: key.2.clone(),
            line: key.3,
        });
        self.frame_ids.insert(key, id);
        id
    }

    fn stack_id(&mut self, frames: Vec<u32>) -> u32 {
        if let Some(&id) = self.stack_ids.get(&frames) {
            return id;
        }
        let id = self.stack_ids.len() as u32;
        self.new_stacks.push(StackRow { stack_id: id, frames: frames.clone() });
        self.stack_ids.insert(frames, id);
        id
    }
}
