//! Attaching a loaded eBPF program to one USDT probe site of one process: a
//! uprobe perf event on the uprobe PMU, with the probe's semaphore handed to
//! the kernel as the uprobe's reference counter, and a BPF perf-event link
//! that carries the attach cookie.
//!
//! aya 0.14 can attach uprobes but cannot pass a reference-counter offset, so
//! this module opens the perf event itself. The kernel increments the
//! semaphore in the target when it installs the breakpoint there and
//! decrements it when the last user of the uprobe goes away: dropping a
//! [`UsdtLink`] closes its descriptors, which unregisters the uprobe and
//! releases the semaphore, with nothing written into the target by us.
use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
};

use perf_event_open_sys::bindings::{PERF_FLAG_FD_CLOEXEC, perf_event_attr};

/// Where the uprobe PMU publishes its dynamic perf event type.
const UPROBE_PMU_TYPE: &str = "/sys/bus/event_source/devices/uprobe/type";
/// `PERF_UPROBE_REF_CTR_OFFSET_SHIFT`: the reference counter's file offset
/// goes in the upper 32 bits of `config` (format `ref_ctr_offset: config:32-63`).
const REF_CTR_OFFSET_SHIFT: u32 = 32;
/// `BPF_LINK_CREATE` (enum bpf_cmd), kernel >= 5.7.
const BPF_LINK_CREATE: libc::c_int = 28;
/// `BPF_PERF_EVENT` (enum bpf_attach_type): a link to a perf event; with a
/// cookie since kernel 5.15.
const BPF_PERF_EVENT: u32 = 41;

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The uprobe PMU is missing (a kernel without CONFIG_UPROBE_EVENTS) or unreadable.
    #[error("cannot read the uprobe PMU type from {UPROBE_PMU_TYPE}: {0} (kernel built without uprobe events?)")]
    PmuType(#[source] io::Error),
    #[error("path {0} contains a NUL byte")]
    PathNul(PathBuf),
    /// The kernel refused the uprobe perf event.
    #[error("opening a uprobe on {path} at offset {offset:#x} for {}: {source}{hint}", pid.map_or("every process".into(), |p| format!("PID {p}")))]
    PerfEventOpen { path: PathBuf, offset: u64, pid: Option<u32>, hint: &'static str, source: io::Error },
    /// The kernel refused to link the program to the perf event.
    #[error("linking the eBPF program to the uprobe on {path} at offset {offset:#x}: {source}")]
    Link { path: PathBuf, offset: u64, source: io::Error },
}

/// One program attached to one USDT probe site of one process. Dropping it
/// detaches: the link goes first, then the perf event, whose release
/// unregisters the uprobe and decrements the semaphore.
#[derive(Debug)]
pub struct UsdtLink {
    // Field order is drop order. Held for their Drop: closing detaches.
    #[expect(dead_code, reason = "held for its Drop, which detaches")]
    link: OwnedFd,
    #[expect(dead_code, reason = "held for its Drop, which unregisters the uprobe")]
    perf_event: OwnedFd,
}

/// The uprobe PMU's perf event type.
pub fn uprobe_pmu_type() -> Result<u32, AttachError> {
    // Read once per process: it cannot change while the kernel runs, and it is
    // needed for every probe site.
    static TYPE: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    if let Some(t) = TYPE.get() {
        return Ok(*t);
    }
    let text = std::fs::read_to_string(UPROBE_PMU_TYPE).map_err(AttachError::PmuType)?;
    let t = text.trim().parse().map_err(|e| AttachError::PmuType(io::Error::new(io::ErrorKind::InvalidData, e)))?;
    Ok(*TYPE.get_or_init(|| t))
}

/// Attaches `program` (a loaded kprobe/uprobe-type program) to the probe at
/// `file_offset` of `path`, in process `pid` only (all its threads: the kernel
/// filters uprobe perf events on the address space). `ref_ctr_offset` is the
/// semaphore's file offset; `cookie` is what the program reads with
/// bpf_get_attach_cookie.
///
/// `path` is the file as this process sees it (e.g. under /proc/PID/root);
/// the kernel identifies the probe by inode, so any path to the file works.
pub fn attach_usdt(
    program: BorrowedFd<'_>,
    path: &Path,
    file_offset: u64,
    ref_ctr_offset: Option<u64>,
    pid: Option<u32>,
    cookie: u64,
) -> Result<UsdtLink, AttachError> {
    let perf_event = open_uprobe(path, file_offset, ref_ctr_offset, pid)?;
    let link = link_perf_event(program, perf_event.as_fd(), cookie).map_err(|source| AttachError::Link {
        path: path.to_owned(),
        offset: file_offset,
        source,
    })?;
    Ok(UsdtLink { link, perf_event })
}

/// A uprobe perf event at `file_offset` of `path` in process `pid` (None:
/// in every process that maps the file, as a job's file-wide probes are), with
/// `ref_ctr_offset` as its reference counter, and no program: while the
/// descriptor is open the kernel keeps the breakpoint installed and the
/// counter raised. [`attach_usdt`] links a program to one; alone, it holds
/// a semaphore up (the breakpoint only costs a trap if that code runs).
pub fn open_uprobe(
    path: &Path,
    file_offset: u64,
    ref_ctr_offset: Option<u64>,
    pid: Option<u32>,
) -> Result<OwnedFd, AttachError> {
    let pmu = uprobe_pmu_type()?;
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| AttachError::PathNul(path.to_owned()))?;
    // SAFETY: perf_event_attr is plain data; all-zero is its documented default.
    let mut attr: perf_event_attr = unsafe { std::mem::zeroed() };
    attr.type_ = pmu;
    attr.size = std::mem::size_of::<perf_event_attr>() as u32;
    attr.config = ref_ctr_offset.unwrap_or(0) << REF_CTR_OFFSET_SHIFT;
    attr.__bindgen_anon_3.config1 = c_path.as_ptr() as u64;
    attr.__bindgen_anon_4.config2 = file_offset;
    // SAFETY: attr is initialised and c_path outlives the call (the kernel
    // copies the path while opening).
    let fd = unsafe {
        // Every process: pid -1 needs a CPU, and a uprobe's program runs on every CPU whichever is named.
        let (pid, cpu) = pid.map_or((-1, 0), |p| (p as libc::pid_t, -1));
        perf_event_open_sys::perf_event_open(&mut attr, pid, cpu, -1, PERF_FLAG_FD_CLOEXEC.into())
    };
    if fd < 0 {
        let source = io::Error::last_os_error();
        let hint = match source.raw_os_error() {
            Some(libc::EINVAL) if ref_ctr_offset.is_some() => {
                " (EINVAL: another uprobe already sits at this offset with a different reference-counter \
                 offset, or the offset is not an instruction of that file)"
            }
            Some(libc::EPERM | libc::EACCES) => " (needs root, or CAP_PERFMON and CAP_SYS_PTRACE over the target)",
            Some(libc::ESRCH) => " (no such process)",
            Some(libc::ENOENT) => " (no such file)",
            _ => "",
        };
        return Err(AttachError::PerfEventOpen { path: path.to_owned(), offset: file_offset, pid, hint, source });
    }
    // SAFETY: perf_event_open returned a fresh descriptor that we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `union bpf_attr` as BPF_LINK_CREATE reads it for a perf-event link
/// (uapi/linux/bpf.h: prog_fd, target_fd, attach_type, flags, then the
/// `perf_event.bpf_cookie` member of the next union). The kernel zero-fills
/// the part of the union it is not given, so this prefix is enough.
#[repr(C)]
struct LinkCreatePerfEvent {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    bpf_cookie: u64,
}

/// A BPF link from `program` to the perf event, with `cookie`. A link (rather
/// than PERF_EVENT_IOC_SET_BPF) is what carries the cookie that lets one
/// program serve several probe sites; the event is already enabled, having
/// been opened without `disabled`.
fn link_perf_event(program: BorrowedFd<'_>, perf_event: BorrowedFd<'_>, cookie: u64) -> io::Result<OwnedFd> {
    let attr = LinkCreatePerfEvent {
        prog_fd: program.as_raw_fd() as u32,
        target_fd: perf_event.as_raw_fd() as u32,
        attach_type: BPF_PERF_EVENT,
        flags: 0,
        bpf_cookie: cookie,
    };
    // SAFETY: attr is a valid prefix of union bpf_attr for BPF_LINK_CREATE and
    // lives across the call; the size tells the kernel how much to read.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_CREATE,
            &attr as *const LinkCreatePerfEvent,
            std::mem::size_of::<LinkCreatePerfEvent>() as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: BPF_LINK_CREATE returned a fresh descriptor that we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_attr_matches_the_kernel_layout() {
        // bpf_cookie is the first member of the third union, at offset 16.
        assert_eq!(std::mem::offset_of!(LinkCreatePerfEvent, bpf_cookie), 16);
        assert_eq!(std::mem::size_of::<LinkCreatePerfEvent>(), 24);
    }
}
