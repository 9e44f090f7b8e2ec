//! The kernel side's set of traced processes (`TRACED`) and the hooks that grow it and report on
//! it: a traced process's new child process (`sched_process_fork`, reading the child's pid and
//! tgid at their `struct task_struct` offsets from the kernel's BTF) and its `exec`.
use std::num::NonZeroU32;

use aya::{Ebpf, maps::HashMap, programs::RawTracePoint};
use profiler_common::{maps as map_names, programs};

use super::ProbeError;

/// Puts `pids` in `TRACED`, before any probe is attached.
pub(super) fn trace(ebpf: &mut Ebpf, pids: &[NonZeroU32]) -> Result<(), ProbeError> {
    let name = map_names::TRACED;
    let map = ebpf.map_mut(name).ok_or(ProbeError::Missing(name))?;
    let mut traced: HashMap<_, u32, u32> = HashMap::try_from(map).map_err(|source| ProbeError::Map { name, source })?;
    for pid in pids {
        traced.insert(pid.get(), 0, 0).map_err(|source| ProbeError::Map { name, source })?;
    }
    Ok(())
}

/// The `exec` hook, and with `follow_children` the fork hook. Raw
/// tracepoints: they need neither tracefs nor kprobes (which a kernel may
/// lack: this VM's has no kprobe PMU).
pub(super) fn attach_process_hooks(ebpf: &mut Ebpf, follow_children: bool) -> Result<(), ProbeError> {
    let mut hooks = vec![(programs::PROCESS_EXEC, programs::PROCESS_EXEC_TRACEPOINT)];
    if follow_children {
        hooks.push((programs::PROCESS_FORK, programs::PROCESS_FORK_TRACEPOINT));
    }
    for (name, tracepoint) in hooks {
        let prog: &mut RawTracePoint = ebpf
            .program_mut(name)
            .ok_or(ProbeError::Missing(name))?
            .try_into()
            .map_err(|source| ProbeError::Program { name, source })?;
        prog.load().map_err(|source| ProbeError::Program { name, source })?;
        prog.attach(tracepoint).map_err(|source| ProbeError::Program { name, source })?;
    }
    Ok(())
}

/// Where the kernel's BTF is.
const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

/// Byte offsets in the running kernel's `struct task_struct`, from its BTF.
#[derive(Clone, Copy, Debug)]
struct TaskOffsets {
    pid: u32,
    tgid: u32,
    flags: u32,
    /// `thread.fsbase` (x86-64), None where the kernel's types have none.
    fsbase: Option<u32>,
}

/// The kernel's types are read once per run (≈0.3 s): at load when the
/// fork hook or the scheduler programs need them, else when a CPython 3.10
/// is first found (see `task_fsbase_ready`).
static TASK_OFFSETS: std::sync::OnceLock<Result<TaskOffsets, String>> = std::sync::OnceLock::new();

fn read_task_offsets() -> Result<TaskOffsets, String> {
    TASK_OFFSETS
        .get_or_init(|| {
            let btf = btf_rs::Btf::from_file(VMLINUX_BTF).map_err(|e| e.to_string())?;
            let member_of = |s: &btf_rs::Struct, field: &str| {
                s.members
                    .iter()
                    .find(|m| btf.resolve_name(*m).is_ok_and(|n| n == field))
                    .filter(|m| m.bitfield_size().unwrap_or(0) == 0 && m.bit_offset() % 8 == 0)
                    .cloned()
                    .ok_or_else(|| format!("struct task_struct has no byte-aligned {field}"))
            };
            let task = btf
                .resolve_types_by_name("task_struct")
                .map_err(|e| e.to_string())?
                .into_iter()
                .find_map(|t| match t {
                    btf_rs::Type::Struct(s) => Some(s),
                    _ => None,
                })
                .ok_or("no struct task_struct")?;
            let offset = |field: &str| member_of(&task, field).map(|m| m.bit_offset() / 8);
            let fsbase = member_of(&task, "thread").ok().and_then(|thread| {
                let btf_rs::Type::Struct(t) = btf.resolve_chained_type(&thread).ok()? else { return None };
                Some(thread.bit_offset() / 8 + member_of(&t, "fsbase").ok()?.bit_offset() / 8)
            });
            Ok(TaskOffsets { pid: offset("pid")?, tgid: offset("tgid")?, flags: offset("flags")?, fsbase })
        })
        .clone()
}

/// Byte offsets of `pid` and `tgid` in the running kernel's `struct
/// task_struct`, from its BTF (the fork hook reads the child's there), and of
/// `flags` (the scheduler programs read `PF_EXITING` there).
pub(super) fn task_offsets() -> Result<(u32, u32, u32), ProbeError> {
    let t = read_task_offsets().map_err(|e| ProbeError::KernelTypes(format!("{VMLINUX_BTF}: {e}")))?;
    Ok((t.pid, t.tgid, t.flags))
}

/// Whether [`task_fsbase_offset`] answers at once; if not, the kernel's
/// types are read now on another thread (once), so that a caller on the
/// event loop need not wait.
pub(super) fn task_fsbase_ready() -> bool {
    static STARTED: std::sync::Once = std::sync::Once::new();
    if TASK_OFFSETS.get().is_some() {
        return true;
    }
    STARTED.call_once(|| {
        std::thread::spawn(|| read_task_offsets().is_ok());
    });
    false
}

/// `offsetof(struct task_struct, thread.fsbase)` in the running kernel (x86-64):
/// where the CPU sampler finds a thread's `pthread_self()` (CPython 3.10).
pub(super) fn task_fsbase_offset() -> Result<u32, ProbeError> {
    let why = |e: String| ProbeError::KernelTypes(format!("{VMLINUX_BTF}: {e}"));
    read_task_offsets().map_err(why)?.fsbase.ok_or_else(|| why("no task_struct.thread.fsbase".into()))
}

/// Tests that load the eBPF programs: run as root by `cargo xtask test`.
#[cfg(test)]
mod root_tests {
    use std::{
        io::Write,
        process::{Command, Stdio},
        time::{Duration, Instant},
    };

    use profiler_common::{CodeRanges, blas_programs, maps as map_names};

    use crate::probes::{JobOptions, Probes};

    /// Whether process `tgid` has an entry in the code-range map `name`.
    fn has_ranges(probes: &mut Probes, name: &'static str, tgid: u32) -> bool {
        let map = probes.ebpf.map_mut(name).expect("the map");
        let ranges: aya::maps::HashMap<_, u32, CodeRanges> = aya::maps::HashMap::try_from(map).expect("a hash map");
        ranges.get(&tgid, 0).is_ok()
    }

    /// Waits (up to 5 s) for both of `tgid`'s code-range entries to go.
    fn ranges_gone(probes: &mut Probes, tgid: u32) -> bool {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(5) {
            if !has_ranges(probes, map_names::RUNTIME_TEXT, tgid) && !has_ranges(probes, blas_programs::TEXT_MAP, tgid)
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// A traced process's library code ranges (registered by the agent) go
    /// in the kernel when it execs (a new image) and when it exits (its
    /// tgid may come back as another process), so that neither a stale range
    /// nor a full map misjudges a later one.
    #[test]
    #[ignore = "needs root and the eBPF object"]
    fn a_processs_code_ranges_go_when_it_execs_and_when_it_exits() {
        /// Killed and collected however the test ends.
        struct Reaped(std::process::Child);
        impl Drop for Reaped {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let mut child = Reaped(
            Command::new("sh").args(["-c", "read line; exec sleep 30"]).stdin(Stdio::piped()).spawn().expect("sh"),
        );
        let pid = child.0.id();
        let nz = std::num::NonZeroU32::new(pid).expect("a pid");
        let (mut probes, _rings) = Probes::load_job(
            &[nz],
            JobOptions { follow_children: true, emit_launches: false, place_probes: false, sched: false },
        )
        .expect("load the programs");
        let register = |probes: &mut Probes| {
            for name in [map_names::RUNTIME_TEXT, blas_programs::TEXT_MAP] {
                assert!(probes.add_code_ranges(name, pid, &[(0x1000, 0x2000)]).expect("registered").is_empty());
                assert!(has_ranges(probes, name, pid), "{name} holds the process's ranges");
            }
        };
        register(&mut probes);
        child.0.stdin.take().expect("stdin").write_all(b"go\n").expect("write");
        assert!(ranges_gone(&mut probes, pid), "the ranges are still there after the exec");
        register(&mut probes);
        child.0.kill().expect("kill");
        child.0.wait().expect("wait");
        assert!(ranges_gone(&mut probes, pid), "the ranges are still there after the exit");
    }
}

#[cfg(test)]
mod tests {
    /// This kernel's BTF (every kernel this profiler supports has it: see
    /// `doctor`) gives `pid` and `tgid`, adjacent `pid_t`s in `task_struct`.
    #[test]
    fn task_struct_pid_and_tgid_offsets_come_from_the_kernels_btf() {
        let (pid, tgid, _) = super::task_offsets().expect("offsets from /sys/kernel/btf/vmlinux");
        assert_eq!(tgid, pid + 4, "pid_t pid; pid_t tgid;");
        assert!(pid > 0);
    }
}
