//! The PEP 523 frame hook in a running CPython: finding its interpreter's
//! `eval_frame` field, writing `&_PyEval_EvalFrameDefault` there while it is
//! NULL (so that 3.11+ leave their interpreter loop for every Python call),
//! keeping it written while attached, and putting NULL back on detach if the
//! field still holds our value.
//!
//! The write is one aligned pointer, but `/proc/PID/mem` copies it with the
//! kernel's `memcpy`, which promises no single 8-byte store: the target's
//! threads are stopped around it (PTRACE_SEIZE + PTRACE_INTERRUPT, invisible
//! to the target's parent, unlike SIGSTOP), so no thread can read a torn
//! pointer. A profiler killed while they are stopped lets them go (the
//! kernel detaches a dead tracer's tracees); one killed later leaves
//! `_PyEval_EvalFrameDefault` in the field, which is CPython's own default:
//! calls then cost what a PEP 523 hook costs, nothing breaks.
//!
//! Where the target maps a PLT entry of `_PyEval_EvalFrameDefault`
//! ([`super::alias`]: PyTorch's), that entry's address is written
//! instead, so that `torch.compile` cannot reset the field to NULL.
use std::{
    fs::File,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::{
        Arc, OnceLock,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::Duration,
};

use super::alias::Alias;
use crate::probes::{self, python::interpreter::CPythonBuild};

/// How often the field is checked: `torch.compile` (dynamo) puts back the
/// value it found when it set its own, which may be NULL.
const RECHECK: Duration = Duration::from_millis(50);

#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error("{path} is not mapped by process {pid}")]
    NotMapped { path: PathBuf, pid: u32 },
    #[error("process {pid}'s memory at {address:#x}: {source}")]
    Memory { pid: u32, address: u64, source: std::io::Error },
    #[error("process {pid}: _PyRuntime.interpreters.head is NULL (the interpreter is not initialised yet)")]
    NoInterpreter { pid: u32 },
    #[error("process {pid}: CPython's data is not mapped yet (the loader is still loading it)")]
    NotLoaded { pid: u32 },
    #[error("stopping thread {tid} of process {pid} around the write (ptrace): {source}")]
    Ptrace { pid: u32, tid: i32, source: std::io::Error },
}

impl HookError {
    /// Whether the process is gone (or going): its memory or threads no longer there.
    fn target_gone(&self) -> bool {
        match self {
            Self::Memory { source, .. } | Self::Ptrace { source, .. } => {
                source.kind() == std::io::ErrorKind::UnexpectedEof
                    || matches!(source.raw_os_error(), Some(libc::ESRCH | libc::ENOENT))
            }
            Self::NotMapped { .. } | Self::NoInterpreter { .. } | Self::NotLoaded { .. } => false,
        }
    }
}

/// Where the field is in the target, and what goes there.
#[derive(Clone, Debug)]
pub struct HookSite {
    pub pid: u32,
    /// The target's memory as it was when the field was found: after an
    /// exec (or once the process is gone) reads and writes through it fail
    /// (end of file), so nothing is ever written into a later image.
    mem: Arc<File>,
    /// `&interp->eval_frame` in the target.
    pub field: u64,
    /// `&_PyEval_EvalFrameDefault` in the target.
    pub value: u64,
}

/// What finds the field in a running target: the file's facts, read once.
#[derive(Clone, Debug)]
pub struct Locator {
    pid: u32,
    /// The CPython file as the target maps it.
    path: PathBuf,
    /// Page of its lowest loadable segment's link-time address.
    lowest_page: u64,
    runtime_head: u64,
    eval_frame: u64,
    eval_default_address: u64,
}

impl Locator {
    /// `path` is the CPython file as the target maps it; `data` its bytes.
    pub fn new(pid: u32, path: &Path, data: &[u8], build: &CPythonBuild) -> Result<Self, HookError> {
        let not_mapped = || HookError::NotMapped { path: path.to_owned(), pid };
        let file = object::File::parse(data).map_err(|_| not_mapped())?;
        let lowest = probes::elf::load_segments(&file).iter().map(|s| s.address).min().ok_or_else(not_mapped)?;
        Ok(Self {
            pid,
            path: path.to_owned(),
            lowest_page: lowest & !0xfff,
            runtime_head: build.runtime_address + build.interpreters_head,
            eval_frame: build.eval_frame,
            eval_default_address: build.eval_default_address,
        })
    }

    /// The same CPython file in another process of the job.
    pub fn for_pid(&self, pid: u32) -> Self {
        Self { pid, ..self.clone() }
    }

    /// Finds the `eval_frame` field of the target's interpreter (the newest
    /// one: `interpreters.head`, the main one unless subinterpreters were made).
    pub fn locate(&self) -> Result<HookSite, HookError> {
        let pid = self.pid;
        let not_mapped = || HookError::NotMapped { path: self.path.clone(), pid };
        let maps = procfs::process::Process::new(pid as i32).and_then(|p| p.maps()).map_err(|_| not_mapped())?;
        let bias = probes::maps::load_bias(&maps, &self.path, self.lowest_page).ok_or_else(not_mapped)?;
        // While the loader maps the library (`run` mode, just after exec), `_PyRuntime`'s address
        // first holds other bytes of the file: seen as a head of 0xffffffff.
        let head = bias + self.runtime_head;
        if !probes::maps::is_writable(&maps, head) {
            return Err(HookError::NotLoaded { pid });
        }
        let mem = open_mem(pid, true)?;
        let interp = read_u64(&mem, pid, head)?;
        if interp == 0 {
            return Err(HookError::NoInterpreter { pid });
        }
        let (field, value) = (interp + self.eval_frame, bias + self.eval_default_address);
        let site = HookSite { pid, mem: Arc::new(mem), field, value };
        // The field must be there to read: a site is kept for the session once found.
        read_u64(&site.mem, pid, site.field).map_err(|_| HookError::NotLoaded { pid })?;
        Ok(site)
    }
}

fn read_u64(mem: &File, pid: u32, address: u64) -> Result<u64, HookError> {
    probes::read_u64_at(mem, address).map_err(|source| HookError::Memory { pid, address, source })
}

fn open_mem(pid: u32, write: bool) -> Result<File, HookError> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .open(format!("/proc/{pid}/mem"))
        .map_err(|source| HookError::Memory { pid, address: 0, source })
}

/// What the field held when looked at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldState {
    /// NULL: calls are inlined; written now.
    Written,
    /// Already `_PyEval_EvalFrameDefault` or the value being written (an
    /// earlier profiler killed before it could restore it).
    AlreadyOurs,
    /// Another PEP 523 hook (a debugger, dynamo mid-call): left alone.
    Other(u64),
}

/// Writes `value` (`site.value` or an alias of it) into the field if it is
/// NULL, with the target's threads stopped.
pub fn write_if_null(site: &HookSite, value: u64) -> Result<FieldState, HookError> {
    swap_if(site, &[0], value).map(|old| match old {
        0 => FieldState::Written,
        v if v == site.value || v == value => FieldState::AlreadyOurs,
        v => FieldState::Other(v),
    })
}

/// Writes `new` if the field holds one of `expect`; returns what it held.
fn swap_if(site: &HookSite, expect: &[u64], new: u64) -> Result<u64, HookError> {
    let mem = &site.mem;
    // Cheap look first: most checks find nothing to do and stop nobody.
    let held = read_u64(mem, site.pid, site.field)?;
    if !expect.contains(&held) {
        return Ok(held);
    }
    // One stop at a time in this process: a process's watcher that an exec
    // replaced may still hold its threads when the new one comes, and a
    // second tracer's PTRACE_SEIZE fails (EPERM) while they are held.
    let _one = STOPS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let _stopped = StoppedThreads::stop(site.pid)?;
    let old = read_u64(mem, site.pid, site.field)?;
    if expect.contains(&old) {
        mem.write_all_at(&new.to_le_bytes(), site.field).map_err(|source| HookError::Memory {
            pid: site.pid,
            address: site.field,
            source,
        })?;
    }
    Ok(old)
}

/// Held around every [`StoppedThreads`] (see [`swap_if`]).
static STOPS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Every thread of a process held in a ptrace stop; dropping resumes them.
struct StoppedThreads {
    /// `(tid, signal to deliver on resume)`: a stop may have caught a signal on its way in.
    threads: Vec<(i32, i32)>,
}

impl StoppedThreads {
    fn stop(pid: u32) -> Result<Self, HookError> {
        let mut held = Self { threads: Vec::new() };
        // Threads made while the first ones were being stopped show up in a second listing;
        // a stopped thread makes none, so the listing settles.
        loop {
            let tids: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/task"))
                .map_err(|source| HookError::Ptrace { pid, tid: pid as i32, source })?
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .filter(|t| !held.threads.iter().any(|(h, _)| h == t))
                .collect();
            if tids.is_empty() {
                return Ok(held);
            }
            for tid in tids {
                if let Some(signal) = seize_and_stop(pid, tid)? {
                    held.threads.push((tid, signal));
                }
            }
        }
    }
}

/// Seizes and stops `tid`; None when it exited meanwhile. Returns the signal
/// its stop intercepted (0: none), to be delivered when it is let go.
fn seize_and_stop(pid: u32, tid: i32) -> Result<Option<i32>, HookError> {
    let err = |source| HookError::Ptrace { pid, tid, source };
    // SAFETY: ptrace requests on a thread id; no memory is passed.
    if unsafe { libc::ptrace(libc::PTRACE_SEIZE, tid, 0, 0) } != 0 {
        let e = std::io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ESRCH) { Ok(None) } else { Err(err(e)) };
    }
    // SAFETY: as above.
    unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0) };
    let stopped = wait_stopped(pid, tid);
    if !matches!(stopped, Ok(Some(_))) {
        // SAFETY: lets go of a tracee of ours that is not held (no-op if it is gone).
        unsafe { libc::ptrace(libc::PTRACE_DETACH, tid, 0, 0) };
    }
    stopped.map_err(err)
}

/// How long a thread may take to reach its ptrace stop.
const STOP_TIMEOUT: Duration = Duration::from_secs(2);

/// Waits for `tid` (seized, interrupted) to be in its ptrace stop; None when
/// it exited instead.
///
/// The stop is seen with `PTRACE_GETSIGINFO` (it succeeds only on a stopped
/// tracee) rather than by waiting for it: in `run` mode the target is this
/// process's child, so any thread here may collect its notifications (a
/// reaper's `waitpid(pid, WNOHANG)` would take the stop and leave a blocking
/// wait here hanging), and the leader's exit is the session's to collect. So
/// stop notifications are consumed without blocking (`WSTOPPED` only), and an
/// exit is collected only for a thread other than the leader of a process that
/// is not this one's child (collecting it lets its parent see it go).
fn wait_stopped(pid: u32, tid: i32) -> std::io::Result<Option<i32>> {
    let started = std::time::Instant::now();
    loop {
        // SAFETY: `info` is a valid out-pointer for the tracee's siginfo.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::ptrace(libc::PTRACE_GETSIGINFO, tid, 0, &mut info as *mut libc::siginfo_t) } == 0 {
            collect(tid, libc::WSTOPPED);
            // An interrupt stop is a SIGTRAP with PTRACE_EVENT_STOP in si_code; anything else is a
            // signal on its way in.
            let event_stop = info.si_signo == libc::SIGTRAP && (info.si_code >> 8) == libc::PTRACE_EVENT_STOP;
            return Ok(Some(if event_stop { 0 } else { info.si_signo }));
        }
        if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
            collect(tid, libc::WSTOPPED);
            return Ok(Some(0)); // a group-stop (SIGSTOP): stopped, and nothing to deliver
        }
        if thread_exited(pid, tid) {
            if tid != pid as i32 || parent_of(pid) != Some(std::process::id()) {
                collect(tid, libc::WEXITED);
            }
            return Ok(None);
        }
        if started.elapsed() > STOP_TIMEOUT {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the thread did not stop"));
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Collects a pending notification of `tid` of the kinds in `which`, if any, without blocking.
fn collect(tid: i32, which: i32) {
    // SAFETY: `info` is a valid out-pointer; WNOHANG never blocks.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::waitid(libc::P_PID, tid as libc::id_t, &mut info, which | libc::WNOHANG | libc::__WALL) };
}

/// Whether `tid` is gone or a zombie (`/proc/PID/task/TID/stat` state Z or X).
fn thread_exited(pid: u32, tid: i32) -> bool {
    let stat = procfs::process::Process::new(pid as i32).and_then(|p| p.task_from_tid(tid)).and_then(|t| t.stat());
    stat.map_or(true, |st| probes::has_exited(&st))
}

fn parent_of(pid: u32) -> Option<u32> {
    procfs::process::Process::new(pid as i32).and_then(|p| p.stat()).ok().map(|s| s.ppid as u32)
}

impl Drop for StoppedThreads {
    fn drop(&mut self) {
        for &(tid, signal) in &self.threads {
            // SAFETY: detaching a tracee of ours; `signal` is delivered as it would have been.
            unsafe { libc::ptrace(libc::PTRACE_DETACH, tid, 0, signal as libc::c_long) };
        }
    }
}

/// The hook while attached: re-applied when something puts NULL back,
/// restored on drop.
#[derive(Debug)]
pub struct FrameHookWrite {
    shared: Arc<Watched>,
    watcher: Option<std::thread::JoinHandle<()>>,
}

/// What the session and the watcher thread share.
#[derive(Debug, Default)]
struct Watched {
    /// Where the field is, once found.
    site: OnceLock<HookSite>,
    stop: AtomicBool,
    /// Whether this session wrote the value (and so takes it back).
    wrote: AtomicBool,
    /// Writes after the first one.
    reapplied: AtomicU32,
    /// What is written instead of `_PyEval_EvalFrameDefault`, once found.
    alias: OnceLock<Alias>,
    /// A job's other process: our value found there (inherited from the
    /// process it was forked from, or written by an earlier look) is this
    /// session's to take back too.
    claim: bool,
    /// The watcher has looked at the field once (written it, found it
    /// otherwise, failed to), or has found the process is not this CPython
    /// or gone: what [`FrameHookWrite::first_look_done`] reports.
    looked: AtomicBool,
}

impl Watched {
    /// What goes into the field: the alias where there is one.
    fn value(&self, site: &HookSite) -> u64 {
        self.alias.get().map_or(site.value, |a| a.address)
    }

    /// Writes the hook if the field is NULL, counting the write.
    fn write(&self, site: &HookSite) -> Result<FieldState, HookError> {
        let state = write_if_null(site, self.value(site))?;
        if state == FieldState::Written && self.wrote.swap(true, Ordering::Relaxed) {
            self.reapplied.fetch_add(1, Ordering::Relaxed);
        }
        if state == FieldState::AlreadyOurs && self.claim {
            self.wrote.store(true, Ordering::Relaxed);
        }
        Ok(state)
    }

    /// Looks for an alias (see [`super::alias`]) and, once found, puts it
    /// in place of `_PyEval_EvalFrameDefault` if the field holds that.
    fn look_for_alias(&self, site: &HookSite) {
        if self.alias.get().is_some() {
            return;
        }
        let Some(alias) = super::alias::find(site.pid, site.value) else { return };
        let address = self.alias.get_or_init(|| alias).address;
        if swap_if(site, &[site.value], address).is_ok_and(|old| old == site.value) {
            self.wrote.store(true, Ordering::Relaxed);
        }
    }

    /// Finds the field (`run` mode: once the command has become CPython and
    /// made its interpreter, polled every millisecond so that the write
    /// comes before the script's first lines), then keeps it written.
    fn watch(&self, locator: &Locator) {
        let started = std::time::Instant::now();
        let mut last_reset = None;
        let mut alias_looked: Option<std::time::Instant> = None;
        let mut failed = false;
        // Writes that failed in a row: the first ones are retried every millisecond.
        let mut failures = 0u32;
        let mut last_state = None;
        while !self.stop.load(Ordering::Relaxed) {
            let site = match self.site.get() {
                Some(site) => site.clone(),
                None => match locator.locate() {
                    Ok(site) => {
                        log::info!(
                            "process {}: eval_frame at {:#x}, {} ms after the watch began",
                            site.pid,
                            site.field,
                            started.elapsed().as_millis()
                        );
                        self.site.get_or_init(|| site).clone()
                    }
                    Err(_) if !probes::is_alive(locator.pid) => return,
                    Err(e) => {
                        let fast = started.elapsed() < FAST_LOCATE;
                        if !fast && !failed {
                            failed = true;
                            log::warn!(
                                "process {}: no CPython interpreter found in {} s ({e}); the frame hook is written \
                                 once there is one",
                                locator.pid,
                                FAST_LOCATE.as_secs()
                            );
                        }
                        std::thread::sleep(if fast { Duration::from_millis(1) } else { RECHECK });
                        continue;
                    }
                },
            };
            let written = if self.stop.load(Ordering::Relaxed) { Ok(None) } else { self.write(&site).map(Some) };
            match &written {
                Ok(Some(FieldState::Written)) => log::info!(
                    "eval_frame of process {} found NULL and written, {} ms after the watch began",
                    site.pid,
                    started.elapsed().as_millis()
                ),
                Ok(Some(state)) if last_state != Some(*state) => {
                    log::info!("eval_frame of process {} holds {state:?}: left as it is", site.pid);
                }
                Ok(_) => {}
                // Gone: nothing more to watch (its restore finds nothing to do).
                Err(e) if e.target_gone() || !probes::is_alive(site.pid) => return,
                // Said once: retried at every check.
                Err(e) if !failed => {
                    failed = true;
                    log::warn!("cannot write the frame hook (calls may go unseen until it is written): {e}");
                }
                Err(_) => {}
            }
            self.looked.store(true, Ordering::Release);
            failures = if written.is_err() { failures.saturating_add(1) } else { 0 };
            if let Ok(Some(state)) = written {
                last_state = Some(state);
            }
            if matches!(written, Ok(Some(FieldState::Written))) {
                last_reset = Some(std::time::Instant::now());
                // Reset by something (dynamo, which loads with PyTorch): an alias may exist now.
                // Looked for at most once a second: it reads the maps and opens libraries.
                if alias_looked.is_none_or(|t| t.elapsed() > ALIAS_RELOOK) {
                    alias_looked = Some(std::time::Instant::now());
                    self.look_for_alias(&site);
                }
            }
            // Something that resets the field once (dynamo: after every compiled call) does it again:
            // look every millisecond for a while, so that fewer calls are inlined unseen meanwhile.
            let busy =
                last_reset.is_some_and(|t| t.elapsed() < FAST_AFTER_RESET) || (1..=FAST_RETRIES).contains(&failures);
            std::thread::sleep(if busy { Duration::from_millis(1) } else { RECHECK });
        }
    }
}

/// How often an alias is looked for at most, while the field keeps being reset.
const ALIAS_RELOOK: Duration = Duration::from_secs(1);

/// How long the field is looked at every millisecond after it was found reset.
const FAST_AFTER_RESET: Duration = Duration::from_secs(2);

/// How many failed writes in a row are retried a millisecond apart (a
/// passing cause, such as another look holding the threads) before [`RECHECK`].
const FAST_RETRIES: u32 = 200;

/// How long a target not yet running CPython is looked at every millisecond.
const FAST_LOCATE: Duration = Duration::from_secs(10);

impl FrameHookWrite {
    /// Writes the hook (if the field is NULL) and starts watching it. A
    /// target that is not CPython yet (`run` mode, before the exec) or has
    /// no interpreter yet gets the write as soon as it has one: None then.
    pub fn apply(locator: Locator) -> Result<(Self, Option<FieldState>), HookError> {
        let shared = Arc::new(Watched::default());
        let state = match locator.locate() {
            Ok(site) => {
                let _ = shared.site.set(site.clone());
                // `attach` to a PyTorch process: its alias is there before the first write.
                shared.look_for_alias(&site);
                Some(shared.write(&site)?)
            }
            Err(HookError::NotMapped { .. } | HookError::NoInterpreter { .. } | HookError::NotLoaded { .. }) => None,
            Err(e) => return Err(e),
        };
        let s = shared.clone();
        let watcher = std::thread::Builder::new().name("frame-hook".into()).spawn(move || s.watch(&locator)).ok();
        Ok((Self { shared, watcher }, state))
    }

    /// Another process of the job (just adopted, or just exec'ed): nothing
    /// is done here, on the caller's thread; the watcher finds the field once
    /// the interpreter exists, writes it, keeps it written, and at the end our
    /// value is taken back wherever it is found (see `Watched::claim`).
    /// The thread first asks `runs_cpython` (reads of the process's files)
    /// and ends at once if the process runs another program.
    pub fn watch_member(locator: Locator, runs_cpython: impl FnOnce() -> bool + Send + 'static) -> Self {
        let shared = Arc::new(Watched { claim: true, ..Watched::default() });
        let s = shared.clone();
        let watch = move || {
            if runs_cpython() {
                s.watch(&locator);
            }
            // Not this CPython, or its watch ended (gone, stopped): nothing more to wait for.
            s.looked.store(true, Ordering::Release);
        };
        let watcher = std::thread::Builder::new().name("frame-hook".into()).spawn(watch).ok();
        Self { shared, watcher }
    }

    /// Whether the watcher has had its first look at the field (see
    /// `Watched::looked`): a job's process named at attach is traced once it has.
    pub fn first_look_done(&self) -> bool {
        self.shared.looked.load(Ordering::Acquire) || self.watcher.as_ref().is_none_or(|w| w.is_finished())
    }

    /// How often the field was found NULL again and re-written.
    pub fn reapplied(&self) -> u32 {
        self.shared.reapplied.load(Ordering::Relaxed)
    }

    /// The alias written instead of `_PyEval_EvalFrameDefault`, if one was found.
    pub fn alias(&self) -> Option<&Alias> {
        self.shared.alias.get()
    }

    /// Stops watching and puts NULL back if the field still holds our value
    /// (and this session wrote it).
    pub fn restore(mut self) -> Result<bool, HookError> {
        self.finish()
    }

    /// Stops watching without restoring and without waiting for the watcher,
    /// which ends at its next look: the process has exec'ed or exited, and
    /// the image written into is gone.
    pub fn abandon(mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.wrote.store(false, Ordering::Relaxed);
        drop(self.watcher.take());
    }

    fn finish(&mut self) -> Result<bool, HookError> {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
        let Some(site) = self.shared.site.get() else { return Ok(false) };
        if !self.shared.wrote.swap(false, Ordering::Relaxed) {
            return Ok(false);
        }
        let ours = [site.value, self.shared.value(site)];
        match swap_if(site, &ours, 0) {
            Ok(old) => Ok(ours.contains(&old)),
            // The target is gone, or is another program now: nothing left to restore.
            Err(e) if e.target_gone() || !probes::is_alive(site.pid) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

impl Drop for FrameHookWrite {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            log::warn!("frame hook not restored: {e}");
        }
    }
}
