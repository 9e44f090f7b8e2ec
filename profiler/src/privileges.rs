//! Whether this process may load BPF programs and attach uprobes.

/// Capability bits (linux/capability.h).
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// The capabilities that matter for tracing, in the order they are reported.
const TRACING_CAPS: [(u32, &str); 3] =
    [(CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN")];

fn has(cap_eff: u64, cap: u32) -> bool {
    cap_eff & (1u64 << cap) != 0
}

/// Decides from the effective capability set (`CapEff` of /proc/self/status).
pub fn can_trace(cap_eff: u64) -> bool {
    (has(cap_eff, CAP_BPF) && has(cap_eff, CAP_PERFMON)) || has(cap_eff, CAP_SYS_ADMIN)
}

/// Names of the tracing capabilities (CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN)
/// that `cap_eff` holds, in that order.
pub fn held(cap_eff: u64) -> Vec<&'static str> {
    TRACING_CAPS.iter().filter(|(c, _)| has(cap_eff, *c)).map(|(_, n)| *n).collect()
}

/// This process's /proc/self/status.
pub fn own_status() -> Result<procfs::process::Status, String> {
    procfs::process::Process::myself()
        .and_then(|p| p.status())
        .map_err(|e| format!("cannot read /proc/self/status: {e}"))
}

/// This process's effective capability set (`CapEff`).
pub fn effective_caps() -> Result<u64, String> {
    own_status().map(|s| s.capeff)
}

/// Checks this process; `Err` carries the message for the user.
pub fn check() -> Result<(), String> {
    if can_trace(effective_caps()?) {
        Ok(())
    } else {
        Err("profiler needs root (or CAP_BPF and CAP_PERFMON) to load eBPF probes: run it with sudo".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_sets() {
        assert!(!can_trace(0));
        assert!(can_trace(0x1ff_ffff_ffff));
        assert!(can_trace((1 << 38) | (1 << 39)));
        assert!(!can_trace(1 << 39));
        assert!(can_trace(1 << 21));
    }

    #[test]
    fn held_names_the_tracing_capabilities() {
        assert_eq!(held(0), Vec::<&str>::new());
        assert_eq!(held(0x1ff_ffff_ffff), ["CAP_BPF", "CAP_PERFMON", "CAP_SYS_ADMIN"]);
        assert_eq!(held((1 << 38) | (1 << 39)), ["CAP_BPF", "CAP_PERFMON"]);
        assert_eq!(held(1 << 21), ["CAP_SYS_ADMIN"]);
        // Other bits (CAP_NET_ADMIN = 12, CAP_SYS_PTRACE = 19) are not named.
        assert_eq!(held((1 << 12) | (1 << 19) | (1 << 38)), ["CAP_PERFMON"]);
    }

    #[test]
    fn this_process_has_a_capability_set() {
        let caps = effective_caps().expect("/proc/self/status has CapEff");
        assert_eq!(check().is_ok(), can_trace(caps));
    }
}
