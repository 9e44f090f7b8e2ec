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
use std::{
    fs::File,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::Duration,
};

use super::cpython::CPythonBuild;

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
    #[error("stopping thread {tid} of process {pid} around the write (ptrace): {source}")]
    Ptrace { pid: u32, tid: i32, source: std::io::Error },
}

/// Where the field is in the target, and what goes there.
#[derive(Clone, Copy, Debug)]
pub struct HookSite {
    pub pid: u32,
    /// `&interp->eval_frame` in the target.
    pub field: u64,
    /// `&_PyEval_EvalFrameDefault` in the target.
    pub value: u64,
}

/// The load bias of `path` in `pid`: its first mapping (file offset 0) less
/// the lowest segment's page.
fn load_bias(pid: u32, path: &Path, data: &[u8]) -> Result<u64, HookError> {
    let not_mapped = || HookError::NotMapped { path: path.to_owned(), pid };
    let file = object::File::parse(data).map_err(|_| not_mapped())?;
    let lowest = super::elf::load_segments(&file).iter().map(|s| s.address).min().ok_or_else(not_mapped)?;
    let maps = procfs::process::Process::new(pid as i32).and_then(|p| p.maps()).map_err(|_| not_mapped())?;
    let start = maps
        .iter()
        .find(|m| m.offset == 0 && matches!(&m.pathname, procfs::process::MMapPath::Path(p) if p == path))
        .map(|m| m.address.0)
        .ok_or_else(not_mapped)?;
    Ok(start.wrapping_sub(lowest & !0xfff))
}

fn read_u64(mem: &File, pid: u32, address: u64) -> Result<u64, HookError> {
    let mut b = [0u8; 8];
    mem.read_exact_at(&mut b, address).map_err(|source| HookError::Memory { pid, address, source })?;
    Ok(u64::from_le_bytes(b))
}

fn open_mem(pid: u32, write: bool) -> Result<File, HookError> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .open(format!("/proc/{pid}/mem"))
        .map_err(|source| HookError::Memory { pid, address: 0, source })
}

/// Finds the `eval_frame` field of `pid`'s interpreter (the newest one:
/// `interpreters.head`, the main one unless subinterpreters were made).
/// `path` is the CPython file as the target maps it; `data` its bytes.
pub fn locate(pid: u32, path: &Path, data: &[u8], build: &CPythonBuild) -> Result<HookSite, HookError> {
    let bias = load_bias(pid, path, data)?;
    let mem = open_mem(pid, false)?;
    let interp = read_u64(&mem, pid, bias + build.runtime_address + build.interpreters_head)?;
    if interp == 0 {
        return Err(HookError::NoInterpreter { pid });
    }
    Ok(HookSite { pid, field: interp + build.eval_frame, value: bias + build.eval_default_address })
}

/// What the field held when looked at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldState {
    /// NULL: calls are inlined; written now.
    Written,
    /// Already `_PyEval_EvalFrameDefault` (an earlier profiler killed before it could restore it).
    AlreadyOurs,
    /// Another PEP 523 hook (a debugger, dynamo mid-call): left alone.
    Other(u64),
}

/// Writes `site.value` into the field if it is NULL, with the target's threads stopped.
pub fn write_if_null(site: &HookSite) -> Result<FieldState, HookError> {
    swap_if(site, 0, site.value).map(|old| match old {
        0 => FieldState::Written,
        v if v == site.value => FieldState::AlreadyOurs,
        v => FieldState::Other(v),
    })
}

/// Writes `new` if the field holds `expect`; returns what it held.
fn swap_if(site: &HookSite, expect: u64, new: u64) -> Result<u64, HookError> {
    let mem = open_mem(site.pid, true)?;
    // Cheap look first: most checks find nothing to do and stop nobody.
    if read_u64(&mem, site.pid, site.field)? != expect {
        return read_u64(&mem, site.pid, site.field);
    }
    let _stopped = StoppedThreads::stop(site.pid)?;
    let old = read_u64(&mem, site.pid, site.field)?;
    if old == expect {
        mem.write_all_at(&new.to_le_bytes(), site.field).map_err(|source| HookError::Memory {
            pid: site.pid,
            address: site.field,
            source,
        })?;
    }
    Ok(old)
}

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
    let mut status = 0;
    // SAFETY: waits for that one thread; `status` is a valid out-pointer.
    if unsafe { libc::waitpid(tid, &mut status, libc::__WALL) } != tid {
        return Err(err(std::io::Error::last_os_error()));
    }
    if !libc::WIFSTOPPED(status) {
        return Ok(None); // it exited
    }
    let signal = libc::WSTOPSIG(status);
    // An interrupt stop reports SIGTRAP with PTRACE_EVENT_STOP; anything else is a signal on its way in.
    let event_stop = (status >> 16) == libc::PTRACE_EVENT_STOP;
    Ok(Some(if event_stop { 0 } else { signal }))
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
    site: HookSite,
    stop: Arc<AtomicBool>,
    reapplied: Arc<AtomicU32>,
    watcher: Option<std::thread::JoinHandle<()>>,
    /// Whether this session wrote the value (and so takes it back).
    wrote: bool,
}

impl FrameHookWrite {
    /// Writes the hook (if the field is NULL) and starts watching it.
    pub fn apply(site: HookSite) -> Result<(Self, FieldState), HookError> {
        let state = write_if_null(&site)?;
        let stop = Arc::new(AtomicBool::new(false));
        let reapplied = Arc::new(AtomicU32::new(0));
        let (s, r) = (stop.clone(), reapplied.clone());
        let watcher = std::thread::Builder::new()
            .name("frame-hook".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    std::thread::sleep(RECHECK);
                    if !s.load(Ordering::Relaxed) && matches!(write_if_null(&site), Ok(FieldState::Written)) {
                        r.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
            .ok();
        let wrote = state == FieldState::Written;
        Ok((Self { site, stop, reapplied, watcher, wrote }, state))
    }

    /// How often the field was found NULL again and re-written.
    pub fn reapplied(&self) -> u32 {
        self.reapplied.load(Ordering::Relaxed)
    }

    /// Stops watching and puts NULL back if the field still holds our value
    /// (and this session wrote it, or re-wrote it).
    pub fn restore(mut self) -> Result<bool, HookError> {
        self.finish()
    }

    fn finish(&mut self) -> Result<bool, HookError> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
        if !self.wrote && self.reapplied() == 0 {
            return Ok(false);
        }
        self.wrote = false;
        self.reapplied.store(0, Ordering::Relaxed);
        match swap_if(&self.site, self.site.value, 0) {
            Ok(old) => Ok(old == self.site.value),
            // The target is gone: nothing left to restore.
            Err(HookError::Memory { source, .. } | HookError::Ptrace { source, .. })
                if !Path::new(&format!("/proc/{}", self.site.pid)).exists()
                    || source.raw_os_error() == Some(libc::ESRCH) =>
            {
                Ok(false)
            }
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
