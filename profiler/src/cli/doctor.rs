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

use crate::{
    privileges,
    probes::{
        maps::{cuda_libraries, mapped_files},
        python::{
            interpreter::candidates,
            usdt::{self as python, PythonProbeError, PythonProbes},
        },
    },
    samplers::{
        gpu,
        rapl::{self, Domain, RaplError},
    },
};

/// Uprobe attach cookies (`bpf_get_attach_cookie` for kprobe-type programs)
/// arrived in 5.15; the launch probes depend on them.
const MIN_KERNEL: (u8, u8) = (5, 15);
const BTF_VMLINUX: &str = "/sys/kernel/btf/vmlinux";

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Also check this process: its CUDA libraries, and whether it is CPython with USDT probes.
    pid: Option<i32>,
    /// Check NVML from this file instead of the system's libnvidia-ml.so.1.
    #[arg(long, value_name = "PATH")]
    nvml_lib: Option<PathBuf>,
    /// Check RAPL in this powercap tree only, as `attach --powercap-root` reads it
    /// (default: the perf `power` PMU, else /sys/class/powercap).
    #[arg(long, value_name = "PATH")]
    powercap_root: Option<PathBuf>,
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

fn machine_checks(args: &DoctorArgs) -> Vec<Check> {
    let mut checks = vec![kernel_check(), btf_check()];
    let (privileges, privileged, cap_fix) = privileges_check();
    checks.push(privileges);
    checks.extend(bpf_checks(privileged, &cap_fix));
    checks.push(nvml_check(args.nvml_lib.as_deref()));
    // What the sampler would read: a named tree alone, else the PMU, else powercap.
    checks.push(rapl_check(rapl::open(args.powercap_root.as_deref())));
    checks
}

/// Whether this process may trace, as `attach` and `run` decide it
/// (privileges::check): the check, the verdict, and how to get them.
fn privileges_check() -> (Check, bool, String) {
    let status = privileges::own_status();
    let caps = status.as_ref().map(|s| s.capeff).map_err(Clone::clone);
    let cap_eff = caps.as_ref().copied().unwrap_or(0);
    let privileged = privileges::can_trace(cap_eff);
    let exe = std::env::current_exe().map_or_else(|_| "profiler".to_string(), |p| p.display().to_string());
    let cap_fix =
        format!("run it as root (sudo), or grant it the capabilities: sudo setcap cap_bpf,cap_perfmon+ep {exe}");
    let held = privileges::held(cap_eff);
    let who = match status.as_ref().map(|s| s.euid) {
        Ok(0) => "root".to_string(),
        Ok(u) => format!("uid {u}"),
        Err(_) => "unknown user".to_string(),
    };
    let held_text = match &caps {
        Err(e) => format!("capabilities unknown: {e}"),
        Ok(_) if held.is_empty() => "none of CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN".into(),
        Ok(_) => held.join(", "),
    };
    let check = if privileged {
        Check::pass("privileges", format!("{held_text} (as {who})"))
    } else {
        Check::fail("privileges", format!("{held_text} (as {who}); needs CAP_BPF and CAP_PERFMON"), cap_fix.clone())
    };
    (check, privileged, cap_fix)
}

/// The BPF checks load a trivial program and create maps: they prove the
/// syscall works for this process, not just that the kernel has the feature.
/// (The uprobe PMU check, which needs no BPF, sits among them.)
fn bpf_checks(privileged: bool, cap_fix: &str) -> Vec<Check> {
    let mut checks = Vec::new();
    let bpf_fix = |e: &str| {
        if privileged {
            format!(
                "the kernel refused ({e}): check lockdown (/sys/kernel/security/lockdown) and seccomp/container limits on bpf()"
            )
        } else {
            cap_fix.to_owned()
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
        checks.push(attach_mode_check());
    }
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

/// How the uprobes will be attached: uprobe-multi links, or one perf-event
/// link per probe, which attaches and detaches far slower under load.
fn attach_mode_check() -> Check {
    use crate::probes::{AttachMode, attach_mode, multi};
    match attach_mode() {
        AttachMode::Multi => Check::pass(
            "uprobe attach",
            "uprobe-multi links: one link per program and library, attached and detached at once",
        ),
        AttachMode::PerProbe if multi::kernel_has_multi() => {
            Check::info("uprobe attach", format!("one perf-event link per probe ({}=0 is set)", multi::MULTI_ENV))
        }
        AttachMode::PerProbe => Check::warn(
            "uprobe attach",
            "this kernel has no uprobe-multi links: one perf-event link per probe (attach takes seconds right \
             after another session's detach)",
            "use Linux 6.6 or later for uprobe-multi links",
        ),
    }
}

/// The uprobe PMU's type, read by the code that attaches the USDT probes.
fn uprobe_pmu_check() -> Check {
    match crate::probes::usdt::attach::uprobe_pmu_type() {
        Ok(ty) => Check::pass("uprobe PMU", format!("perf event type {ty}")),
        Err(e) => Check::fail(
            "uprobe PMU",
            e.to_string(),
            "use a kernel built with CONFIG_UPROBE_EVENTS=y (and sysfs mounted at /sys)",
        ),
    }
}

/// NVML, initialised as the GPU sampler does.
fn nvml_check(lib: Option<&Path>) -> Check {
    let nvml = match gpu::init_nvml(lib) {
        Ok(n) => n,
        Err(e) => {
            return Check::warn(
                "NVML",
                format!("{e}; GPU figures will be absent"),
                "install the NVIDIA driver and load its kernel module (nvidia-smi should list the GPUs), \
                 or pass --nvml-lib PATH",
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

/// The verdict on RAPL opened as the CPU/DRAM energy sampler opens it
/// (`rapl::open`: the named powercap tree alone, else the perf power PMU,
/// else powercap).
fn rapl_check(opened: Result<rapl::RaplReader, RaplError>) -> Check {
    let reader = match opened {
        Ok(r) => r,
        Err(e) => {
            let fix = match &e {
                RaplError::Absent { .. } => {
                    "on bare metal, load the RAPL drivers (modprobe rapl: the perf power PMU; \
                     modprobe intel_rapl_msr: powercap, AMD too); VMs usually have no RAPL"
                }
                RaplError::NotPermitted { .. } => {
                    "run the profiler as root (powercap's energy_uj is root-only; the perf power PMU needs CAP_PERFMON)"
                }
                RaplError::Unusable { .. } => "check the file named above (cat it); until then CPU/DRAM energy is NULL",
            };
            return Check::warn("RAPL", e.to_string(), fix);
        }
    };
    let domains: Vec<&str> = reader.domains().into_iter().map(Domain::as_str).collect();
    let mut detail = format!("{}: {}", reader.source(), domains.join(", "));
    let missing = reader.missing();
    if !missing.is_empty() {
        let reasons: Vec<&str> = missing.iter().map(|(_, why)| why.as_str()).collect();
        let _ = write!(detail, "; {}", reasons.join("; "));
    }
    if missing.iter().any(|(d, _)| *d == Domain::Package) {
        Check::warn(
            "RAPL",
            detail,
            "CPU energy will be NULL: check which domains the powercap zones' name files \
             (or the power PMU's events) list",
        )
    } else {
        Check::pass("RAPL", detail)
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
        let list: Vec<String> = libs.iter().map(|(k, f)| format!("{} {}", k.as_str(), f.path.display())).collect();
        checks.push(Check::pass("CUDA libraries", list.join(", ")));
    }
    // As python::find_in_process does when the executable cannot be read.
    let exe_or = exe.clone().unwrap_or_else(|| PathBuf::from("the target's executable"));
    let candidates = candidates(&exe_or, &mapped_files(&maps));
    checks.push(python_check(pid, &exe_or, &candidates));
    checks.push(step_source_check(pid as u32, &mapped_files(&maps)));
    // Which way `--step-python` would see this process's functions, and why.
    if exe.is_some() {
        match crate::probes::python::mechanism::mechanism_for(pid as u32, &candidates) {
            Some(Ok(line)) => checks.push(Check::info("--step-python", line)),
            Some(Err(e)) => checks.push(Check::info("--step-python", format!("unavailable: {e}"))),
            None => {}
        }
    }
    (header, checks)
}

/// Which step source `--steps auto` (no step flags) would use for this
/// process, and why: PyTorch's optimizer markers where it maps
/// `libtorch_cpu.so`, a jitted training step where it maps jaxlib's
/// `libjax_common.so` (both where it maps both: each makes its own steps).
fn step_source_check(pid: u32, files: &[crate::probes::maps::MappedFile]) -> Check {
    use crate::probes::{jax, torch};
    let mut why = Vec::new();
    if let Some(f) = files.iter().find(|f| torch::is_libtorch_cpu(&f.path)) {
        why.push(format!(
            "PyTorch's optimizer markers (Optimizer.step, DataLoader __next__): it maps {}",
            f.path.display()
        ));
    }
    if let Some(f) = files.iter().find(|f| jax::is_libjax_common(&f.path)) {
        let resolved = crate::probes::open_in_target(pid, &f.path)
            .ok_or_else(|| "cannot read it".to_string())
            .and_then(|data| jax::resolve(&data));
        match resolved {
            Ok(at) => why.push(format!(
                "a jitted training step (a name with 'train', else 'step', else the most-called at a steady \
                 period; see docs/steps.md): it maps {} (PjitFunction::Call at {at:#x})",
                f.path.display()
            )),
            Err(e) => {
                let fix = "name the steps another way (--step-python, --step-symbol), or report the jaxlib version";
                return Check::warn("--steps auto", format!("JAX's jit calls cannot be probed: {e}"), fix);
            }
        }
    }
    if why.is_empty() {
        return Check::info(
            "--steps auto",
            "no step source yet (neither PyTorch nor JAX is loaded; both are picked up when loaded later): \
             name one with --step-python, --step-symbol, --step-region or --step-jit",
        );
    }
    Check::pass("--steps auto", why.join("; and "))
}

/// Whether the process is CPython and where its USDT probes are, found as
/// `attach --python-step` finds them: the executable, then each mapped
/// `libpython*`, each read through the process's root.
fn python_check(pid: i32, exe: &Path, candidates: &[PathBuf]) -> Check {
    let file_name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let is_python =
        file_name(exe).starts_with("python") || candidates.iter().any(|p| file_name(p).starts_with("libpython"));
    let mut unreadable = Vec::new();
    let found = python::resolve(candidates, |p| {
        let bytes = crate::probes::open_in_target(pid as u32, p);
        if bytes.is_none() {
            unreadable.push(p.to_path_buf());
        }
        bytes
    });
    python_verdict(found, is_python, &unreadable)
}

/// The CPython check from what [`python::resolve`] answered. `is_python`:
/// the executable is named python* or the process maps a libpython.
/// `unreadable`: candidates that could not be read (and so were skipped).
fn python_verdict(found: Result<PythonProbes, PythonProbeError>, is_python: bool, unreadable: &[PathBuf]) -> Check {
    match found {
        Ok(py) => {
            let version = py.version.map_or_else(String::new, |(major, minor)| format!(" (CPython {major}.{minor})"));
            let mut detail = format!(
                "{}{version}: {} function__entry and {} function__return site{}",
                py.path.display(),
                py.entry.len(),
                py.ret.len(),
                if py.ret.len() == 1 { "" } else { "s" },
            );
            if let Some(switch) = &py.tracing_switch {
                let _ = write!(
                    detail,
                    "; entries fire only while tracing: switched on through the python:line semaphore \
                     (file offset {:#x}) by a uprobe on {}",
                    switch.line_semaphore_file_offset, switch.carrier,
                );
            }
            Check::pass("CPython", detail)
        }
        Err(PythonProbeError::NoProbes { .. }) if !is_python => {
            Check::info("CPython", "no (not a Python interpreter; use --step-symbol)")
        }
        Err(e) => {
            let no_probes = matches!(e, PythonProbeError::NoProbes { .. });
            let mut detail = e.to_string();
            if no_probes && !unreadable.is_empty() {
                let list: Vec<String> = unreadable.iter().map(|p| p.display().to_string()).collect();
                let _ = write!(detail, " (could not read {}, so not searched)", list.join(", "));
            }
            // NoProbes says what to do itself; the others are limits of the profiler's.
            let fix = match (no_probes, unreadable.is_empty()) {
                (true, true) => None,
                (true, false) => Some("run as root to read the interpreter's files".to_owned()),
                (false, _) => Some("mark steps in native code with --step-symbol instead".to_owned()),
            };
            Check { status: Status::Warn, name: "CPython", detail, fix }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A powercap zone as open_powercap reads it: name, max range, counter.
    fn write_zone(root: &Path, id: &str, name: &str, energy: Option<&str>) {
        let dir = root.join(id);
        std::fs::create_dir_all(&dir).expect("zone");
        std::fs::write(dir.join("name"), format!("{name}\n")).expect("name");
        std::fs::write(dir.join("max_energy_range_uj"), "262143328850\n").expect("max");
        if let Some(e) = energy {
            std::fs::write(dir.join("energy_uj"), e).expect("energy");
        }
    }

    #[test]
    fn powercap_zones_readable_or_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        // No PMU there: powercap decides, as on a machine without the perf driver.
        let no_pmu = dir.path().join("no-power-pmu");
        let root = dir.path().join("powercap");
        write_zone(&root, "intel-rapl:0", "package-0", Some("12345\n"));
        write_zone(&root, "intel-rapl:0:0", "dram", Some("678\n"));
        let c = rapl_check(rapl::open_with(&no_pmu, &root));
        assert_eq!(c.status, Status::Pass, "{c:?}");
        assert!(c.detail.starts_with(&format!("powercap intel-rapl zones under {}", root.display())), "{c:?}");
        assert!(c.detail.ends_with(": package, dram"), "{c:?}");
        assert!(c.fix.is_none(), "{c:?}");

        // A second package whose counter cannot be read: RAPL would fail, so a warning naming the file.
        write_zone(&root, "intel-rapl:1", "package-1", None);
        let c = rapl_check(rapl::open_with(&no_pmu, &root));
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(c.detail.contains("intel-rapl:1/energy_uj"), "{c:?}");
        assert!(c.fix.is_some(), "{c:?}");
        std::fs::write(root.join("intel-rapl:1/energy_uj"), "garbage\n").expect("energy");
        let c = rapl_check(rapl::open_with(&no_pmu, &root));
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(c.detail.contains("intel-rapl:1/energy_uj"), "{c:?}");

        // Package only: still a pass, with why DRAM energy will be NULL.
        let pkg_only = dir.path().join("pkg-only");
        write_zone(&pkg_only, "intel-rapl:0", "package-0", Some("1\n"));
        let c = rapl_check(rapl::open_with(&no_pmu, &pkg_only));
        assert_eq!(c.status, Status::Pass, "{c:?}");
        assert!(c.detail.contains(": package; no RAPL DRAM domain"), "{c:?}");

        // No package domain: CPU energy will be NULL, a warning.
        let psys_only = dir.path().join("psys-only");
        write_zone(&psys_only, "intel-rapl:0", "psys", Some("1\n"));
        let c = rapl_check(rapl::open_with(&no_pmu, &psys_only));
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(c.detail.contains(": psys; no RAPL package domain"), "{c:?}");
        assert!(c.fix.is_some(), "{c:?}");

        // Nothing there at all.
        let c = rapl_check(rapl::open_with(&no_pmu, &dir.path().join("nothing")));
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(c.detail.starts_with("RAPL unavailable: no perf power PMU"), "{c:?}");
        assert!(c.fix.as_deref().is_some_and(|f| f.contains("modprobe")), "{c:?}");
    }

    fn probe(name: &str, file_offset: u64, semaphore_file_offset: Option<u64>) -> crate::probes::usdt::UsdtProbe {
        crate::probes::usdt::UsdtProbe {
            provider: "python".into(),
            name: name.into(),
            address: file_offset,
            note_base: 0,
            semaphore: semaphore_file_offset,
            file_offset,
            semaphore_file_offset,
            arguments: "8@%rbp 8@%r12 -4@%eax".into(),
            args: Ok(Vec::new()),
        }
    }

    #[test]
    fn python_verdicts() {
        let no_probes = || PythonProbeError::NoProbes { searched: "/usr/bin/python3.12".into() };
        // Not Python at all: information, not a warning.
        let c = python_verdict(Err(no_probes()), false, &[]);
        assert_eq!(c.status, Status::Info, "{c:?}");
        assert_eq!(c.detail, "no (not a Python interpreter; use --step-symbol)");
        // Python without probes: a warning whose text is the error's own, which says what to do.
        let c = python_verdict(Err(no_probes()), true, &[]);
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert_eq!(c.detail, no_probes().to_string());
        assert!(c.detail.contains("--with-dtrace") && c.detail.contains("--step-symbol"), "{c:?}");
        // ... and when a candidate could not be read, that is said, with its fix.
        let c = python_verdict(Err(no_probes()), true, &[PathBuf::from("/usr/lib/libpython3.12.so.1.0")]);
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(c.detail.contains("could not read /usr/lib/libpython3.12.so.1.0"), "{c:?}");
        assert!(c.fix.as_deref().is_some_and(|f| f.contains("root")), "{c:?}");
        // Probes that are there but unusable warn even in a non-python-named executable.
        let c = python_verdict(Err(PythonProbeError::NoReturn { path: "/opt/app".into() }), false, &[]);
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert_eq!(c.detail, "/opt/app: python:function__entry without python:function__return");
        assert!(c.fix.is_some(), "{c:?}");

        let py = PythonProbes {
            path: "/usr/bin/python3.10".into(),
            version: None,
            entry: vec![probe("function__entry", 0x1000, Some(0x9000))],
            ret: vec![probe("function__return", 0x2000, Some(0x9002))],
            tracing_switch: None,
        };
        let c = python_verdict(Ok(py.clone()), true, &[]);
        assert_eq!(c.status, Status::Pass, "{c:?}");
        assert_eq!(c.detail, "/usr/bin/python3.10: 1 function__entry and 1 function__return site");
        // 3.11: the tracing switch is named.
        let py311 = PythonProbes {
            path: "/usr/bin/python3.11".into(),
            version: Some((3, 11)),
            tracing_switch: Some(python::TracingSwitch {
                line_semaphore_file_offset: 0x9004,
                carrier: probe("gc__start", 0x3000, Some(0x9006)),
            }),
            ..py
        };
        let c = python_verdict(Ok(py311), false, &[]);
        assert_eq!(c.status, Status::Pass, "{c:?}");
        assert!(c.detail.starts_with("/usr/bin/python3.11 (CPython 3.11): 1 function__entry"), "{c:?}");
        assert!(
            c.detail.contains("python:line semaphore (file offset 0x9004) by a uprobe on python:gc__start"),
            "{c:?}"
        );
    }

    /// This test binary is no Python: the check says so from its own maps.
    #[test]
    fn this_process_is_not_python() {
        let me = procfs::process::Process::myself().expect("self");
        let exe = me.exe().expect("exe");
        let c = python_check(me.pid, &exe, &candidates(&exe, &mapped_files(&me.maps().expect("maps"))));
        assert_eq!(c.status, Status::Info, "{c:?}");
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
