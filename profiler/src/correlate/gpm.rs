//! Per-step NVML GPM figures: each GPM reading is a mean over the interval
//! between two GPM samples, and a step gets the readings' mean weighted by
//! how much of each interval falls in the step; its mean SM clock likewise
//! from the clock samples, each held until the next.
use super::GaugeSeries;

/// One GPM reading: its mean over (`start_ns`, `end_ns`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reading {
    pub start_ns: u64,
    pub end_ns: u64,
    pub value: f64,
}

/// The readings' mean over [start, end], each weighted by its overlap with it;
/// None unless the readings cover all of it. A zero-length interval gets the
/// reading whose interval holds it. `readings` in time order.
pub fn interval_mean(readings: &[Reading], start: u64, end: u64) -> Option<f64> {
    if end < start {
        return None;
    }
    if end == start {
        return readings.iter().find(|r| r.start_ns < start && start <= r.end_ns).map(|r| r.value);
    }
    let (mut weighted, mut covered) = (0.0, 0u64);
    // The first reading that ends after `start`: earlier ones cannot overlap.
    let first = readings.partition_point(|r| r.end_ns <= start);
    for r in readings[first..].iter().take_while(|r| r.start_ns < end) {
        let overlap = r.end_ns.min(end).saturating_sub(r.start_ns.max(start));
        weighted += r.value * overlap as f64;
        covered += overlap;
    }
    (covered >= end - start).then(|| weighted / covered as f64)
}

/// A gauge's time-weighted mean over [start, end], each reading held until
/// the next; the reading before `start` (or the first after it within
/// `max_gap_ns`) opens it. None when the gauge has no reading near `start` or `end`.
pub fn held_mean(gauge: &GaugeSeries, start: u64, end: u64, max_gap_ns: u64) -> Option<f64> {
    let mut value = gauge.at(start, max_gap_ns)?;
    gauge.at(end, max_gap_ns)?;
    if end <= start {
        return Some(value);
    }
    let (mut weighted, mut t) = (0.0, start);
    let from = gauge.points.partition_point(|&(pt, _)| pt <= start);
    for &(pt, v) in gauge.points[from..].iter().take_while(|&&(pt, _)| pt < end) {
        weighted += value * (pt - t) as f64;
        (t, value) = (pt, v);
    }
    weighted += value * (end - t) as f64;
    Some(weighted / (end - start) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(start_ns: u64, end_ns: u64, value: f64) -> Reading {
        Reading { start_ns, end_ns, value }
    }

    #[test]
    fn a_step_gets_its_share_of_each_interval() {
        // 40 % over (0, 100], 80 % over (100, 200], 10 % over (200, 350].
        let rs = [r(0, 100, 40.0), r(100, 200, 80.0), r(200, 350, 10.0)];
        // Inside one interval: that interval's reading.
        assert_eq!(interval_mean(&rs, 10, 60), Some(40.0));
        // 50 ns at 40 %, 100 at 80 %, 50 at 10 %: (2000 + 8000 + 500) / 200.
        assert_eq!(interval_mean(&rs, 50, 250), Some(52.5));
        assert_eq!(interval_mean(&rs, 0, 350), Some((4000.0 + 8000.0 + 1500.0) / 350.0));
        // An instant on a boundary belongs to the interval it closes.
        assert_eq!(interval_mean(&rs, 100, 100), Some(40.0));
        assert_eq!(interval_mean(&rs, 0, 0), None);
    }

    #[test]
    fn a_step_not_covered_has_no_figure() {
        let rs = [r(100, 200, 40.0), r(300, 400, 80.0)];
        assert_eq!(interval_mean(&rs, 50, 150), None, "starts before the first GPM sample");
        assert_eq!(interval_mean(&rs, 150, 450), None, "ends after the last");
        assert_eq!(interval_mean(&rs, 150, 350), None, "spans a gap (a lost interval)");
        assert_eq!(interval_mean(&rs, 300, 250), None);
        assert_eq!(interval_mean(&[], 1, 2), None);
    }

    #[test]
    fn a_held_gauge_is_weighted_by_time() {
        let g = GaugeSeries { points: vec![(0, 1000.0), (100, 2000.0), (300, 1500.0)] };
        // 50 ns at 1000, 200 at 2000, 50 at 1500.
        assert_eq!(held_mean(&g, 50, 350, 1000), Some((50_000.0 + 400_000.0 + 75_000.0) / 300.0));
        assert_eq!(held_mean(&g, 120, 180, 1000), Some(2000.0));
        assert_eq!(held_mean(&g, 100, 100, 1000), Some(2000.0));
        assert_eq!(held_mean(&g, 500, 2000, 1000), None, "no reading near the end");
    }
}
