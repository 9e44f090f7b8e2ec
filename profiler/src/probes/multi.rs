//! Uprobe-multi links (`BPF_TRACE_UPROBE_MULTI`, Linux ≥ 6.6): one `bpf(2)`
//! link puts one program on many offsets of one file, and takes them all off
//! again after a single grace period.
//!
//! Why: a uprobe attached through a perf event is removed under the kernel's
//! `event_mutex` with three grace periods waited out inside it (≈90 ms each
//! probe), and every other uprobe attach on the machine waits for that lock:
//! a session started while the last one's 240 probes are still coming off
//! spent 3–5 s attaching. A multi link neither takes that lock nor waits per
//! probe.
//!
//! aya 0.14 has no wrapper for it, and a program a multi link runs must be
//! loaded with `expected_attach_type = BPF_TRACE_UPROBE_MULTI`, which aya's
//! `UProbe::load` never sets. So the programs that go on multi links are
//! loaded here, from the same object: `aya-obj` (aya's own loader core)
//! parses it and points its map references at the maps aya created, and
//! `BPF_PROG_LOAD` runs with that attach type. Each program is loaded the
//! first time a link needs it.
use std::{
    collections::HashMap,
    ffi::CString,
    io,
    os::{
        fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::ffi::OsStrExt,
    },
    path::Path,
    sync::OnceLock,
};

use aya::{
    Ebpf,
    maps::{Map, MapData},
};
use aya_obj::{Object, ProgramSection, generated::bpf_insn};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_KPROBE: u32 = 2;
const BPF_TRACE_UPROBE_MULTI: u32 = 48;
const BPF_F_UPROBE_MULTI_RETURN: u32 = 1;

/// Environment variable: `0` keeps every uprobe on a perf-event link of its
/// own, as on kernels without multi links (the bench compares the two).
pub const MULTI_ENV: &str = "PROFILER_UPROBE_MULTI";

/// The head of `union bpf_attr` for `BPF_PROG_LOAD`, up to
/// `expected_attach_type` (the kernel zero-fills a shorter attribute).
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// `union bpf_attr` for `BPF_LINK_CREATE` with its `uprobe_multi` member.
#[repr(C)]
#[derive(Default)]
struct UprobeMultiAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    link_flags: u32,
    path: u64,
    offsets: u64,
    ref_ctr_offsets: u64,
    cookies: u64,
    cnt: u32,
    flags: u32,
    pid: u32,
    _pad: u32,
}
const _: () = assert!(size_of::<ProgLoadAttr>() == 72 && size_of::<UprobeMultiAttr>() == 64);

fn sys_bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<OwnedFd> {
    // SAFETY: `attr` is a `#[repr(C)]` prefix of `union bpf_attr` for `cmd`,
    // valid for its size; the pointers in it outlive the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(attr), size_of::<T>() as u32) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a successful BPF_PROG_LOAD / BPF_LINK_CREATE returns a new fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Loads `insns` as a kprobe-type program for multi links; with a verifier
/// log in the error when the kernel refuses it.
fn load_program(name: &str, insns: &[bpf_insn], license: &CString) -> io::Result<OwnedFd> {
    let mut attr = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_KPROBE,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        expected_attach_type: BPF_TRACE_UPROBE_MULTI,
        ..Default::default()
    };
    // The kernel takes [A-Za-z0-9_.] names of at most 15 bytes.
    for (dst, b) in
        attr.prog_name.iter_mut().zip(name.bytes().filter(|b| b.is_ascii_alphanumeric() || *b == b'_')).take(15)
    {
        *dst = b;
    }
    match sys_bpf(BPF_PROG_LOAD, &mut attr) {
        Ok(fd) => Ok(fd),
        Err(first) => {
            let mut log = vec![0u8; 1 << 20];
            attr.log_level = 1;
            attr.log_size = log.len() as u32;
            attr.log_buf = log.as_mut_ptr() as u64;
            match sys_bpf(BPF_PROG_LOAD, &mut attr) {
                Ok(fd) => Ok(fd),
                Err(_) => {
                    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
                    let text = String::from_utf8_lossy(&log[..end]);
                    let tail: Vec<&str> = text.lines().rev().take(8).collect();
                    let tail: Vec<&str> = tail.into_iter().rev().collect();
                    Err(io::Error::new(first.kind(), format!("{first}; verifier: {}", tail.join(" | "))))
                }
            }
        }
    }
}

/// Whether this kernel makes uprobe-multi links (found once): a trivial
/// program loaded for them, linked to `/`, which such a kernel refuses with
/// `EBADF` (not a regular file) after accepting everything else; an older
/// one refuses the attach type itself.
pub fn kernel_has_multi() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        // r0 = 0; exit
        let Ok(insns) = aya_obj::copy_instructions(&[0xb7, 0, 0, 0, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0]) else {
            return false;
        };
        let Ok(prog) = load_program("multi_probe", &insns, &CString::from(c"GPL")) else { return false };
        let (path, offset) = (c"/", 0u64);
        let mut attr = UprobeMultiAttr {
            prog_fd: prog.as_raw_fd() as u32,
            attach_type: BPF_TRACE_UPROBE_MULTI,
            path: path.as_ptr() as u64,
            offsets: (&raw const offset) as u64,
            cnt: 1,
            ..Default::default()
        };
        matches!(sys_bpf(BPF_LINK_CREATE, &mut attr), Err(e) if e.raw_os_error() == Some(libc::EBADF))
    })
}

/// The low-level map behind one of aya's typed maps.
fn map_data(map: &Map) -> &MapData {
    match map {
        Map::Array(d)
        | Map::ArrayOfMaps(d)
        | Map::BloomFilter(d)
        | Map::CgroupArray(d)
        | Map::CgroupStorage(d)
        | Map::CgrpStorage(d)
        | Map::CpuMap(d)
        | Map::DevMap(d)
        | Map::DevMapHash(d)
        | Map::HashMap(d)
        | Map::HashOfMaps(d)
        | Map::InodeStorage(d)
        | Map::LpmTrie(d)
        | Map::LruHashMap(d)
        | Map::PerCpuArray(d)
        | Map::PerCpuCgroupStorage(d)
        | Map::PerCpuHashMap(d)
        | Map::PerCpuLruHashMap(d)
        | Map::PerfEventArray(d)
        | Map::ProgramArray(d)
        | Map::Queue(d)
        | Map::ReusePortSockArray(d)
        | Map::RingBuf(d)
        | Map::SockHash(d)
        | Map::SockMap(d)
        | Map::SkStorage(d)
        | Map::Stack(d)
        | Map::StackTraceMap(d)
        | Map::Unsupported(d)
        | Map::XskMap(d) => d,
    }
}

/// The uprobe programs of the object, ready to load for multi links.
pub struct MultiPrograms {
    /// Per program: its instructions (maps and calls relocated) and whether
    /// it is a return probe.
    code: HashMap<String, (Vec<bpf_insn>, bool)>,
    license: CString,
    loaded: HashMap<&'static str, OwnedFd>,
}

impl MultiPrograms {
    /// Relocates the object's uprobe programs against the maps `ebpf` (the
    /// same object, loaded by aya) created: they share every map with the
    /// programs aya loads. Call before any map is taken out of `ebpf`.
    pub fn prepare(ebpf: &Ebpf, object: &[u8]) -> Result<Self, String> {
        let mut obj = Object::parse(object).map_err(|e| format!("parsing the eBPF object: {e}"))?;
        if obj.has_btf_relocations() {
            return Err("the object has CO-RE relocations, which only aya applies".into());
        }
        let fds: HashMap<&str, RawFd> =
            ebpf.maps().map(|(name, map)| (name, map_data(map).fd().as_fd().as_raw_fd())).collect();
        let maps = obj.maps.clone();
        let mut refs = Vec::new();
        for (name, map) in &maps {
            let fd = *fds.get(name.as_str()).ok_or_else(|| format!("map {name} was not created"))?;
            refs.push((name.as_str(), fd, map));
        }
        let text_sections = obj.functions.keys().map(|(section, _)| *section).collect();
        obj.relocate_maps(refs.into_iter(), &text_sections).map_err(|e| format!("relocating maps: {e}"))?;
        obj.relocate_calls(&text_sections).map_err(|e| format!("relocating calls: {e}"))?;
        let mut code = HashMap::new();
        for (name, program) in &obj.programs {
            let ret = match program.section {
                ProgramSection::UProbe { sleepable: false } => false,
                ProgramSection::URetProbe { sleepable: false } => true,
                _ => continue,
            };
            let function = obj.functions.get(&program.function_key()).ok_or_else(|| format!("no code for {name}"))?;
            code.insert(name.clone(), (function.instructions.clone(), ret));
        }
        Ok(Self { code, license: obj.license.clone(), loaded: HashMap::new() })
    }

    /// Puts `program` on `offsets` of `path` (file offsets), each with its
    /// cookie, in process `pid`'s address space only, or in every process
    /// mapping the file with `pid` None. Dropping the returned link takes
    /// them all off.
    pub fn link(
        &mut self,
        program: &'static str,
        path: &Path,
        offsets: &[u64],
        cookies: &[u64],
        pid: Option<u32>,
    ) -> io::Result<OwnedFd> {
        let (insns, ret) = self
            .code
            .get(program)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no uprobe program {program}")))?;
        let ret = *ret;
        let prog = match self.loaded.get(program) {
            Some(fd) => fd,
            None => {
                let fd = load_program(program, insns, &self.license)?;
                self.loaded.entry(program).or_insert(fd)
            }
        };
        let path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))?;
        let mut attr = UprobeMultiAttr {
            prog_fd: prog.as_raw_fd() as u32,
            attach_type: BPF_TRACE_UPROBE_MULTI,
            path: path.as_ptr() as u64,
            offsets: offsets.as_ptr() as u64,
            cookies: cookies.as_ptr() as u64,
            cnt: offsets.len().min(cookies.len()) as u32,
            flags: if ret { BPF_F_UPROBE_MULTI_RETURN } else { 0 },
            pid: pid.unwrap_or(0),
            ..Default::default()
        };
        sys_bpf(BPF_LINK_CREATE, &mut attr)
    }
}
