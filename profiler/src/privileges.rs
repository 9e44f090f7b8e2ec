//! Whether this process may load BPF programs and attach uprobes.

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// Decides from the effective capability set (`CapEff` of /proc/self/status).
pub fn can_trace(cap_eff: u64) -> bool {
    let has = |c: u32| cap_eff & (1u64 << c) != 0;
    (has(CAP_BPF) && has(CAP_PERFMON)) || has(CAP_SYS_ADMIN)
}

/// Checks this process; `Err` carries the message for the user.
pub fn check() -> Result<(), String> {
    let status =
        std::fs::read_to_string("/proc/self/status").map_err(|e| format!("cannot read /proc/self/status: {e}"))?;
    let cap_eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    if can_trace(cap_eff) {
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
}
