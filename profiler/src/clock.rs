//! The one clock: CLOCK_MONOTONIC nanoseconds, as `bpf_ktime_get_ns()` reads it.

use rustix::time::{ClockId, clock_gettime};

fn read(clock: ClockId) -> i128 {
    let ts = clock_gettime(clock);
    ts.tv_sec as i128 * 1_000_000_000 + ts.tv_nsec as i128
}

/// CLOCK_MONOTONIC now, in ns.
pub fn monotonic_ns() -> u64 {
    read(ClockId::Monotonic) as u64
}

/// Unix time minus CLOCK_MONOTONIC, in ns: add it to any `*_ns` column to get
/// Unix nanoseconds. Read as the tightest of a few bracketing samples.
pub fn unix_offset_ns() -> i64 {
    let mut best: Option<(i128, i128)> = None;
    for _ in 0..5 {
        let a = read(ClockId::Monotonic);
        let r = read(ClockId::Realtime);
        let b = read(ClockId::Monotonic);
        let width = b - a;
        let off = r - (a + b) / 2;
        if best.is_none_or(|(w, _)| width < w) {
            best = Some((width, off));
        }
    }
    best.map(|(_, o)| o as i64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn offset_maps_monotonic_to_wall_clock() {
        let off = super::unix_offset_ns();
        let wall =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_nanos() as i64;
        let mapped = super::monotonic_ns() as i64 + off;
        assert!((wall - mapped).abs() < 50_000_000, "wall {wall} vs mapped {mapped}");
    }
}
