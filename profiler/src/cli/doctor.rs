//! `profiler doctor [PID]`: what will and will not work on this machine (and
//! for this process) before tracing starts, each failure with its fix.
//!
//! Checks that attaching needs (kernel, BTF, privileges, the BPF syscall, the
//! uprobe PMU, ring buffers, attach cookies; for a PID, reading its maps)
//! decide the exit code. NVML and RAPL only decide whether GPU and CPU/DRAM
//! figures will be recorded, so their absence is a warning.
use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::ExitCode,
};

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported, is_program_supported},
};
use clap::Args;
use nvml_wrapper::{Nvml, error::NvmlError};
use object::{
    Endianness, Object, ObjectSection,
    read::elf::{ElfFile64, SectionHeader},
};

use crate::{
    privileges,
    probes::maps::{LibraryKind, cuda_libraries},
};

/// Uprobe attach cookies (`bpf_get_attach_cookie` for kprobe-type programs)
/// arrived in 5.15; the launch probes depend on them.
const MIN_KERNEL: (u8, u8) = (5, 15);
const BTF_VMLINUX: &str = "/sys/kernel/btf/vmlinux";
const UPROBE_PMU_TYPE: &str = "/sys/bus/event_source/devices/uprobe/type";
const PERF_POWER_PMU: &str = "/sys/bus/event_source/devices/power";
/// Capability bits (linux/capability.h).
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Also check this process: its CUDA libraries, and whether it is CPython with USDT probes.
    pid: Option<i32>,
    /// Check NVML from this file instead of the system's libnvidia-ml.so.1.
    #[arg(long, value_name = "PATH")]
    nvml_lib: Option<PathBuf>,
    /// Where powercap zones are.
    #[arg(long, value_name = "PATH", default_value = "/sys/class/powercap")]
    powercap_root: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Pass,
    /// Attaching would fail.
    Fail,
    /// Attaching works; some figures will be absent.
    Warn,
    /// For information.
    Info,
}

#[derive(Debug)]
pub struct Check {
    pub status: Status,
    pub name: &'static str,
    pub detail: String,
    pub fix: Option<String>,
}

impl Check {
    fn pass(name: &'static str, detail: impl Into<String>) -> Self {
        Self { status: Status::Pass, name, detail: detail.into(), fix: None }
    }
    fn fail(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Self { status: Status::Fail, name, detail: detail.into(), fix: Some(fix.into()) }
    }
    fn warn(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Self { status: Status::Warn, name, detail: detail.into(), fix: Some(fix.into()) }
    }
    fn info(name: &'static str, detail: impl Into<String>) -> Self {
        Self { status: Status::Info, name, detail: detail.into(), fix: None }
    }
}

pub async fn main(args: DoctorArgs) -> anyhow::Result<ExitCode> {
    let mut checks = machine_checks(&args);
    let mut pid_header = None;
    if let Some(pid) = args.pid {
        let (header, c) = process_checks(pid);
        pid_header = Some((checks.len(), header));
        checks.extend(c);
    }
    print!("{}", render(&checks, pid_header.as_ref().map(|(i, h)| (*i, h.as_str()))));
    let failed = checks.iter().filter(|c| c.status == Status::Fail).count();
    let warned = checks.iter().filter(|c| c.status == Status::Warn).count();
    if failed > 0 {
        println!("\nattach would fail: {failed} problem{} above", if failed == 1 { "" } else { "s" });
        Ok(ExitCode::FAILURE)
    } else {
        if warned > 0 {
            println!("\nattach would work; some figures will be absent (warnings above)");
        } else {
            println!("\nattach would work");
        }
        Ok(ExitCode::SUCCESS)
    }
}

fn render(checks: &[Check], pid_header: Option<(usize, &str)>) -> String {
    let mut o = String::new();
    for (i, c) in checks.iter().enumerate() {
        if let Some((_, header)) = pid_header.filter(|(at, _)| *at == i) {
            let _ = writeln!(o, "{header}");
        }
        let mark = match c.status {
            Status::Pass => "✓",
            Status::Fail => "✗",
            Status::Warn => "!",
            Status::Info => "·",
        };
        let _ = writeln!(o, "{mark} {:<15} {}", c.name, c.detail);
        if let Some(fix) = &c.fix {
            let _ = writeln!(o, "  {:<15} fix: {fix}", "");
        }
    }
    o
}

/// Effective capabilities and uid of this process, from /proc/self/status.
fn own_credentials() -> (u64, Option<u32>) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
    let cap_eff = field("CapEff:").and_then(|v| u64::from_str_radix(v, 16).ok()).unwrap_or(0);
    // "Uid: real effective saved fs"
    let euid = field("Uid:").and_then(|v| v.split_whitespace().nth(1)).and_then(|v| v.parse().ok());
    (cap_eff, euid)
}

fn machine_checks(args: &DoctorArgs) -> Vec<Check> {
    let mut checks = vec![kernel_check(), btf_check()];
    let (cap_eff, euid) = own_credentials();
    let privileged = privileges::can_trace(cap_eff);
    let exe = std::env::current_exe().map_or_else(|_| "profiler".to_string(), |p| p.display().to_string());
    let cap_fix =
        format!("run it as root (sudo), or grant it the capabilities: sudo setcap cap_bpf,cap_perfmon+ep {exe}");
    let has = |c: u32| cap_eff & (1u64 << c) != 0;
    let held: Vec<&str> = [(CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN")]
        .iter()
        .filter(|(c, _)| has(*c))
        .map(|(_, n)| *n)
        .collect();
    let who = match euid {
        Some(0) => "root".to_string(),
        Some(u) => format!("uid {u}"),
        None => "unknown user".to_string(),
    };
    let held_text =
        if held.is_empty() { "none of CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN".into() } else { held.join(", ") };
    checks.push(if privileged {
        Check::pass("privileges", format!("{held_text} (as {who})"))
    } else {
        Check::fail("privileges", format!("{held_text} (as {who}); needs CAP_BPF and CAP_PERFMON"), cap_fix.clone())
    });

    // The BPF checks load a trivial program and create maps: they prove the
    // syscall works for this process, not just that the kernel has the feature.
    let bpf_fix = |e: &str| {
        if privileged {
            format!(
                "the kernel refused ({e}): check lockdown (/sys/kernel/security/lockdown) and seccomp/container limits on bpf()"
            )
        } else {
            cap_fix.clone()
        }
    };
    let bpf_ok = match is_program_supported(ProgramType::KProbe) {
        Ok(true) => {
            checks.push(Check::pass("BPF syscall", "a test uprobe-type program loads"));
            true
        }
        Ok(false) => {
            checks.push(Check::fail(
                "BPF syscall",
                "this kernel does not load kprobe/uprobe programs",
                "use a kernel built with CONFIG_BPF_SYSCALL, CONFIG_BPF_EVENTS and CONFIG_UPROBE_EVENTS",
            ));
            false
        }
        Err(e) => {
            let e = e.to_string();
            checks.push(Check::fail("BPF syscall", format!("cannot load a test program: {e}"), bpf_fix(&e)));
            false
        }
    };
    let needs_bpf = "not checked: the BPF syscall does not work for this process";
    if bpf_ok {
        checks.push(match is_helper_supported(ProgramType::KProbe, BpfHelper::BPF_FUNC_get_attach_cookie) {
            Ok(true) => Check::pass("attach cookies", "bpf_get_attach_cookie works in uprobe programs"),
            Ok(false) => Check::fail(
                "attach cookies",
                "bpf_get_attach_cookie is not available to uprobe programs",
                "use Linux 5.15 or later",
            ),
            Err(e) => Check::fail("attach cookies", format!("probe failed: {e}"), bpf_fix(&e.to_string())),
        });
    } else {
        checks.push(Check::fail("attach cookies", needs_bpf, "fix the BPF syscall first (above)"));
    }
    checks.push(uprobe_pmu_check());
    if bpf_ok {
        checks.push(match is_map_supported(MapType::RingBuf) {
            Ok(true) => Check::pass("ring buffer", "a BPF ring buffer map can be created"),
            Ok(false) => {
                Check::fail("ring buffer", "this kernel has no BPF ring buffer maps", "use Linux 5.8 or later")
            }
            Err(e) => Check::fail("ring buffer", format!("cannot create one: {e}"), bpf_fix(&e.to_string())),
        });
    } else {
        checks.push(Check::fail("ring buffer", needs_bpf, "fix the BPF syscall first (above)"));
    }
    checks.push(nvml_check(args.nvml_lib.as_deref()));
    checks.push(perf_power_check());
    checks.push(powercap_check(&args.powercap_root));
    checks
}

fn kernel_check() -> Check {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_owned();
    let need = format!("{}.{}", MIN_KERNEL.0, MIN_KERNEL.1);
    match procfs::sys::kernel::Version::from_str(&release) {
        Ok(v) if (v.major, v.minor) >= MIN_KERNEL => {
            Check::pass("kernel", format!("{release} (≥ {need}: uprobe attach cookies)"))
        }
        Ok(_) => Check::fail(
            "kernel",
            format!("{release} is older than {need} (no uprobe attach cookies)"),
            format!("boot Linux {need} or later"),
        ),
        Err(e) => Check::fail(
            "kernel",
            format!("cannot tell the version of '{release}': {e}"),
            format!("use Linux {need} or later"),
        ),
    }
}

fn btf_check() -> Check {
    match std::fs::metadata(BTF_VMLINUX) {
        Ok(m) => Check::pass("BTF", format!("{BTF_VMLINUX} ({} KiB)", m.len() / 1024)),
        Err(e) => Check::fail(
            "BTF",
            format!("{BTF_VMLINUX}: {e}"),
            "boot a kernel built with CONFIG_DEBUG_INFO_BTF=y (distribution kernels since 2021 are)",
        ),
    }
}

fn uprobe_pmu_check() -> Check {
    match std::fs::read_to_string(UPROBE_PMU_TYPE) {
        Ok(t) => match t.trim().parse::<u32>() {
            Ok(ty) => Check::pass("uprobe PMU", format!("perf event type {ty} ({UPROBE_PMU_TYPE})")),
            Err(_) => Check::fail(
                "uprobe PMU",
                format!("{UPROBE_PMU_TYPE} holds '{}', not a type number", t.trim()),
                "use a kernel built with CONFIG_UPROBE_EVENTS=y",
            ),
        },
        Err(e) => Check::fail(
            "uprobe PMU",
            format!("{UPROBE_PMU_TYPE}: {e}"),
            "use a kernel built with CONFIG_UPROBE_EVENTS=y (and sysfs mounted at /sys)",
        ),
    }
}

fn nvml_check(lib: Option<&Path>) -> Check {
    let path = lib.map_or_else(|| PathBuf::from("libnvidia-ml.so.1"), Path::to_path_buf);
    let nvml = match Nvml::builder().lib_path(path.as_os_str()).init() {
        Ok(n) => n,
        Err(NvmlError::LibloadingError(e)) => {
            return Check::warn(
                "NVML",
                format!("cannot load {} ({e}); GPU figures will be absent", path.display()),
                "install the NVIDIA driver (it ships libnvidia-ml.so.1), or pass --nvml-lib PATH",
            );
        }
        Err(e) => {
            return Check::warn(
                "NVML",
                format!("{} loads but does not initialise: {e}; GPU figures will be absent", path.display()),
                "load the NVIDIA kernel driver (nvidia-smi should list the GPUs), matching the library's version",
            );
        }
    };
    let driver = nvml.sys_driver_version().map_or_else(|_| String::new(), |v| format!(", driver {v}"));
    match nvml.device_count() {
        Ok(0) => Check::warn(
            "NVML",
            format!("initialises{driver} but sees no GPUs"),
            "check that the GPUs are visible (nvidia-smi)",
        ),
        Ok(n) => {
            let names: Vec<String> = (0..n)
                .map(|i| nvml.device_by_index(i).and_then(|d| d.name()).unwrap_or_else(|e| format!("? ({e})")))
                .collect();
            Check::pass("NVML", format!("{n} GPU{}{driver}: {}", if n == 1 { "" } else { "s" }, names.join(", ")))
        }
        Err(e) => Check::warn("NVML", format!("initialises{driver} but cannot count GPUs: {e}"), "check nvidia-smi"),
    }
}

fn perf_power_check() -> Check {
    let dir = Path::new(PERF_POWER_PMU);
    if !dir.join("type").exists() {
        return Check::warn(
            "RAPL perf PMU",
            format!("no {PERF_POWER_PMU}; CPU/DRAM energy comes from powercap, if readable"),
            "on bare-metal Intel/AMD hosts, load the RAPL perf driver (modprobe rapl); VMs have none",
        );
    }
    let mut events: Vec<String> = std::fs::read_dir(dir.join("events"))
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("energy-") && !n.contains('.'))
                .collect()
        })
        .unwrap_or_default();
    events.sort();
    if events.is_empty() {
        Check::warn("RAPL perf PMU", format!("{PERF_POWER_PMU} lists no energy events"), "use powercap (below)")
    } else {
        Check::pass("RAPL perf PMU", events.join(", "))
    }
}

/// Powercap RAPL zones under `root` (`intel-rapl:0`, `intel-rapl:0:0`, …;
/// AMD's are named the same) and whether their energy counters can be read.
fn powercap_check(root: &Path) -> Check {
    let Ok(dir) = std::fs::read_dir(root) else {
        return Check::warn(
            "RAPL powercap",
            format!("{} does not exist; CPU/DRAM energy will be absent unless the perf PMU works", root.display()),
            "on bare metal, load intel_rapl_common/intel_rapl_msr (AMD: rapl); VMs usually have no RAPL",
        );
    };
    let mut zones: Vec<(String, String, Result<u64, String>)> = Vec::new();
    for entry in dir.filter_map(Result::ok) {
        let id = entry.file_name().to_string_lossy().into_owned();
        if !id.starts_with("intel-rapl:") {
            continue;
        }
        let path = entry.path();
        let name = std::fs::read_to_string(path.join("name")).map_or_else(|_| id.clone(), |n| n.trim().to_owned());
        let energy = std::fs::read_to_string(path.join("energy_uj"))
            .map_err(|e| e.to_string())
            .and_then(|v| v.trim().parse::<u64>().map_err(|e| format!("'{}': {e}", v.trim())));
        zones.push((id, name, energy));
    }
    zones.sort();
    if zones.is_empty() {
        return Check::warn(
            "RAPL powercap",
            format!("no RAPL zones under {}; CPU/DRAM energy will be absent unless the perf PMU works", root.display()),
            "on bare metal, load intel_rapl_common/intel_rapl_msr (AMD: rapl); VMs usually have no RAPL",
        );
    }
    let names: Vec<String> = zones.iter().map(|(id, name, _)| format!("{name} ({id})")).collect();
    let unreadable: Vec<String> =
        zones.iter().filter_map(|(id, _, e)| e.as_ref().err().map(|e| format!("{id}: {e}"))).collect();
    if unreadable.is_empty() {
        Check::pass("RAPL powercap", format!("energy readable: {}", names.join(", ")))
    } else {
        Check::warn(
            "RAPL powercap",
            format!("{} of {} zones unreadable ({})", unreadable.len(), zones.len(), unreadable.join("; ")),
            "energy_uj is readable by root only: run the profiler as root",
        )
    }
}

/// Checks of one process; the header names it.
fn process_checks(pid: i32) -> (String, Vec<Check>) {
    let mut checks = Vec::new();
    let proc = match procfs::process::Process::new(pid) {
        Ok(p) => p,
        Err(e) => {
            checks.push(Check::fail("process", format!("no process {pid}: {e}"), "check the PID (pgrep -af python)"));
            return (format!("PID {pid}"), checks);
        }
    };
    let exe = proc.exe().ok();
    let header = match &exe {
        Some(p) => format!("PID {pid} ({})", p.display()),
        None => format!("PID {pid}"),
    };
    let maps = match proc.maps() {
        Ok(m) => m,
        Err(e) => {
            checks.push(Check::fail(
                "process maps",
                format!("cannot read /proc/{pid}/maps: {e}"),
                "run as root, or as the process's user with CAP_BPF and CAP_PERFMON",
            ));
            return (header, checks);
        }
    };
    let libs = cuda_libraries(&maps);
    if libs.is_empty() {
        checks.push(Check::info(
            "CUDA libraries",
            "none mapped yet; the profiler probes libcuda.so.1 where the process would load it, and waits",
        ));
    } else {
        let list: Vec<String> = libs
            .iter()
            .map(|(k, f)| {
                let kind = match k {
                    LibraryKind::Driver => "driver",
                    LibraryKind::Runtime => "runtime",
                };
                format!("{kind} {}", f.path.display())
            })
            .collect();
        checks.push(Check::pass("CUDA libraries", list.join(", ")));
    }
    checks.push(python_check(pid, exe.as_deref(), &maps));
    (header, checks)
}

/// Whether the process is CPython and where its USDT probes are: in a mapped
/// `libpython*.so` when the interpreter links one, else in the executable.
fn python_check(pid: i32, exe: Option<&Path>, maps: &procfs::process::MemoryMaps) -> Check {
    let file_name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let libpython = crate::probes::maps::mapped_files(maps)
        .into_iter()
        .map(|f| f.path)
        .find(|p| file_name(p).starts_with("libpython") && file_name(p).contains(".so"));
    let exe_is_python = exe.is_some_and(|p| file_name(p).starts_with("python"));
    let interpreter = match (libpython, exe) {
        (Some(lib), _) => lib,
        (None, Some(e)) if exe_is_python => e.to_path_buf(),
        _ => return Check::info("CPython", "no (not a Python interpreter; use --step-symbol)"),
    };
    // The path as the process sees it, through its root (another mount namespace in a container).
    let in_root =
        PathBuf::from(format!("/proc/{pid}/root")).join(interpreter.strip_prefix("/").unwrap_or(&interpreter));
    let data = match std::fs::read(&in_root).or_else(|_| std::fs::read(&interpreter)) {
        Ok(d) => d,
        Err(e) => {
            return Check::warn(
                "CPython",
                format!("{}: cannot read it ({e})", interpreter.display()),
                "run as root to inspect the interpreter",
            );
        }
    };
    match usdt_probes(&data) {
        Ok(probes) if probes.iter().any(|p| p == "python:function__entry") => Check::pass(
            "CPython",
            format!("{} has {} USDT probes, function__entry among them", interpreter.display(), probes.len()),
        ),
        Ok(probes) if !probes.is_empty() => Check::warn(
            "CPython",
            format!("{} has {} USDT probes but no python:function__entry", interpreter.display(), probes.len()),
            "use an interpreter built --with-dtrace (e.g. Debian's/Ubuntu's /usr/bin/python3), or --step-symbol",
        ),
        Ok(_) => Check::warn(
            "CPython",
            format!("{} has no USDT probes (.note.stapsdt)", interpreter.display()),
            "use an interpreter built --with-dtrace (e.g. Debian's/Ubuntu's /usr/bin/python3), or --step-symbol",
        ),
        Err(e) => Check::warn(
            "CPython",
            format!("{}: not a 64-bit ELF file we can read ({e})", interpreter.display()),
            "use --step-symbol",
        ),
    }
}

/// `provider:name` of every SystemTap SDT note (type 3, owner "stapsdt") in
/// the `.note.stapsdt` section of a 64-bit ELF file.
pub fn usdt_probes(data: &[u8]) -> object::Result<Vec<String>> {
    let file = ElfFile64::<Endianness>::parse(data)?;
    let mut out = Vec::new();
    for section in file.sections() {
        if section.name() != Ok(".note.stapsdt") {
            continue;
        }
        let Some(mut notes) = section.elf_section_header().notes(file.endian(), file.data())? else {
            continue;
        };
        while let Some(note) = notes.next()? {
            if note.name() != b"stapsdt" || note.n_type(file.endian()) != 3 {
                continue;
            }
            // desc: pc, base, semaphore (8 bytes each), then "provider\0name\0args\0".
            let mut strings = note.desc().get(24..).unwrap_or_default().split(|&b| b == 0);
            if let (Some(provider), Some(name)) = (strings.next(), strings.next()) {
                out.push(format!("{}:{}", String::from_utf8_lossy(provider), String::from_utf8_lossy(name)));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn powercap_zones_readable_or_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let z = dir.path().join("intel-rapl:0");
        std::fs::create_dir_all(&z).expect("zone");
        std::fs::write(z.join("name"), "package-0\n").expect("name");
        std::fs::write(z.join("energy_uj"), "12345\n").expect("energy");
        let c = powercap_check(dir.path());
        assert_eq!(c.status, Status::Pass, "{c:?}");
        assert!(c.detail.contains("package-0 (intel-rapl:0)"), "{c:?}");
        let z1 = dir.path().join("intel-rapl:1");
        std::fs::create_dir_all(&z1).expect("zone");
        std::fs::write(z1.join("name"), "package-1\n").expect("name");
        let c = powercap_check(dir.path());
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(c.detail.contains("1 of 2 zones unreadable"), "{c:?}");
        let c = powercap_check(&dir.path().join("nothing"));
        assert_eq!(c.status, Status::Warn);
        assert!(c.fix.is_some());
    }

    #[test]
    fn usdt_probes_of_a_non_elf_file_is_an_error() {
        assert!(usdt_probes(b"not an elf").is_err());
    }

    /// This test binary has no SDT notes; libc's, where the system has them, would.
    #[test]
    fn usdt_probes_of_a_plain_executable_are_none() {
        let exe = std::fs::read(std::env::current_exe().expect("exe")).expect("read");
        assert_eq!(usdt_probes(&exe).expect("an ELF file"), Vec::<String>::new());
    }

    #[test]
    fn render_marks_and_fixes() {
        let out = render(
            &[Check::pass("kernel", "6.1"), Check::fail("privileges", "none", "sudo"), Check::info("CPython", "no")],
            Some((2, "PID 1")),
        );
        assert_eq!(
            out,
            "✓ kernel          6.1\n✗ privileges      none\n                  fix: sudo\nPID 1\n· CPython         no\n"
        );
    }
}
