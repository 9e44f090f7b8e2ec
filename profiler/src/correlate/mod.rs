//! Assigning sampled counters and gauges to steps: energy counters are
//! interpolated at step boundaries (so the steps' energies add up exactly to
//! the counter's delta over them), with an error bound; gauges are read at the
//! step's start and end.
//!
//! Pure arithmetic on in-memory series: no I/O, unit-tested without root.
//! The store reads the series at a session's end and writes what
//! [`per_step`] derives from them.
pub mod gpm;
pub mod mfu;
pub mod per_step;
pub mod power;
pub mod step_mfu;

/// A cumulative counter (energy in J, wrap-corrected, non-decreasing) as the
/// sampler saw it.
#[derive(Clone, Debug, Default)]
pub struct CounterSeries {
    /// (time, value) at the first sample that saw each new value: the
    /// counter's update instants, each seen at most one sampling interval late.
    points: Vec<(u64, f64)>,
    /// Median interval between the counter's updates, ns.
    pub update_period_ns: u64,
    /// Median sampling interval, ns.
    pub sample_period_ns: u64,
    /// Smallest step of the counter (its resolution), in the value's unit.
    pub resolution: f64,
}

/// The median of `v` (0 when empty).
pub(crate) fn median(mut v: Vec<u64>) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    v[v.len() / 2]
}

impl CounterSeries {
    /// Builds the series from raw samples in time order. Repeated values are
    /// dropped (a counter that has not updated says nothing new; keeping the
    /// repeats would turn linear interpolation into a staircase), except the
    /// last sample, which closes the covered range.
    pub fn from_samples(raw: &[(u64, f64)], resolution: f64) -> Self {
        let mut points: Vec<(u64, f64)> = Vec::new();
        for &(t, v) in raw {
            if points.last().is_none_or(|&(_, last)| v != last) {
                points.push((t, v));
            }
        }
        let update_period_ns = median(points.windows(2).map(|w| w[1].0 - w[0].0).collect());
        if let (Some(&last_raw), Some(&(lt, _))) = (raw.last(), points.last())
            && last_raw.0 > lt
        {
            // The counter stood still until the last sample: close the range
            // there, at the value it kept.
            points.push(last_raw);
        }
        let sample_period_ns = median(raw.windows(2).map(|w| w[1].0 - w[0].0).collect());
        Self { points, update_period_ns, sample_period_ns, resolution }
    }

    pub fn is_empty(&self) -> bool {
        self.points.len() < 2
    }

    /// First and last covered instants.
    pub fn range(&self) -> Option<(u64, u64)> {
        Some((self.points.first()?.0, self.points.last()?.0))
    }

    fn segment(&self, t: u64) -> Option<usize> {
        let (a, b) = self.range()?;
        if t < a || t > b || self.points.len() < 2 {
            return None;
        }
        // Index i such that points[i].0 <= t <= points[i + 1].0.
        let i = self.points.partition_point(|&(pt, _)| pt <= t);
        Some(i.saturating_sub(1).min(self.points.len() - 2))
    }

    fn slope(&self, i: usize) -> f64 {
        let (t0, v0) = self.points[i];
        let (t1, v1) = self.points[i + 1];
        if t1 == t0 { 0.0 } else { (v1 - v0) / ((t1 - t0) as f64 / 1e9) }
    }

    /// The counter at `t`, linearly interpolated; None outside the covered range.
    pub fn at(&self, t: u64) -> Option<f64> {
        let i = self.segment(t)?;
        let (t0, v0) = self.points[i];
        let (t1, v1) = self.points[i + 1];
        if t1 == t0 {
            return Some(v1);
        }
        Some(v0 + (v1 - v0) * ((t - t0) as f64 / (t1 - t0) as f64))
    }

    /// The two parts of [`Self::at`]'s error at `t`: the local power (the
    /// points are the true curve seen up to one sampling interval late, or
    /// one update period if sampling is slower), and the shape error (a power
    /// change across the segment costs at most ΔP·T_seg/4) plus resolution.
    fn error_parts(&self, t: u64) -> Option<(f64, f64)> {
        let i = self.segment(t)?;
        let p = self.slope(i);
        let neighbours: Vec<f64> = [i.checked_sub(1), (i + 2 < self.points.len()).then_some(i + 1)]
            .into_iter()
            .flatten()
            .map(|j| self.slope(j))
            .collect();
        let p_max = neighbours.iter().copied().fold(p, f64::max);
        let dp = neighbours.iter().map(|q| (q - p).abs()).fold(0.0, f64::max);
        let seg_s = (self.points[i + 1].0 - self.points[i].0) as f64 / 1e9;
        Some((p_max, dp * seg_s / 4.0 + self.resolution))
    }

    /// How late a point may be seen: min(T_s, T_u), in seconds.
    fn lag_s(&self) -> f64 {
        self.sample_period_ns.min(self.update_period_ns.max(1)) as f64 / 1e9
    }
}

/// Energy assigned to one interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IntervalEnergy {
    pub energy: f64,
    pub error: f64,
    pub avg_power: f64,
    /// Shorter than the counter's update period: the figure is an
    /// interpolation, not a measurement of this interval alone.
    pub below_resolution: bool,
}

/// Energy over [start, end] from the interpolated counter; None when the
/// interval is not inside the covered range.
pub fn interval_energy(series: &CounterSeries, start: u64, end: u64) -> Option<IntervalEnergy> {
    if end < start {
        return None;
    }
    let e0 = series.at(start)?;
    let e1 = series.at(end)?;
    // Both boundaries are read through points seen late by λ0, λ1 ∈ [0, lag]:
    // the difference is off by P·(λ0 − λ1), at most P·lag once, not twice.
    let (p0, shape0) = series.error_parts(start)?;
    let (p1, shape1) = series.error_parts(end)?;
    let error = p0.max(p1) * series.lag_s() + shape0 + shape1;
    let energy = (e1 - e0).max(0.0);
    let secs = (end - start) as f64 / 1e9;
    Some(IntervalEnergy {
        energy,
        error,
        avg_power: if secs > 0.0 { energy / secs } else { 0.0 },
        below_resolution: end - start < series.update_period_ns,
    })
}

/// A gauge (utilization, temperature, …) sampled over time.
#[derive(Clone, Debug, Default)]
pub struct GaugeSeries {
    pub points: Vec<(u64, f64)>,
}

impl GaugeSeries {
    /// The latest reading at or before `t`; if there is none, the first
    /// reading after `t` when it is within `max_gap_ns`. None otherwise.
    pub fn at(&self, t: u64, max_gap_ns: u64) -> Option<f64> {
        let i = self.points.partition_point(|&(pt, _)| pt <= t);
        if i > 0 {
            let (pt, v) = self.points[i - 1];
            if t - pt <= max_gap_ns {
                return Some(v);
            }
        }
        self.points.get(i).filter(|(pt, _)| pt - t <= max_gap_ns).map(|&(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// A GPU drawing `power(t)` W whose counter (mJ resolution) updates every
    /// `update` ns, polled every `poll` ns starting at `phase`.
    fn staircase(
        power: impl Fn(f64) -> f64,
        update: u64,
        poll: u64,
        phase: u64,
        until: u64,
    ) -> (Vec<(u64, f64)>, impl Fn(u64) -> f64) {
        // True energy by fine integration (1 µs).
        let energy = move |t: u64| -> f64 {
            let dt = 1_000u64;
            let mut e = 0.0;
            let mut s = 0u64;
            while s < t {
                e += power(s as f64 / 1e9) * (dt as f64 / 1e9);
                s += dt;
            }
            e
        };
        let mut raw = Vec::new();
        let mut t = phase;
        while t <= until {
            let last_update = t / update * update;
            let v = (energy(last_update) * 1000.0).floor() / 1000.0;
            raw.push((t, v));
            t += poll;
        }
        (raw, energy)
    }

    #[test]
    fn constant_power_steps_are_within_the_bound_and_sum_exactly() {
        let (raw, truth) = staircase(|_| 250.0, 20 * MS, 7 * MS, 3 * MS, 2_000 * MS);
        let s = CounterSeries::from_samples(&raw, 0.001);
        assert!((s.update_period_ns as i64 - (20 * MS) as i64).abs() <= (7 * MS) as i64, "{}", s.update_period_ns);
        // Back-to-back steps of 50 ms from 100 ms to 1900 ms.
        let bounds: Vec<u64> = (0..=36).map(|k| 100 * MS + k * 50 * MS).collect();
        let mut sum = 0.0;
        for w in bounds.windows(2) {
            let e = interval_energy(&s, w[0], w[1]).expect("inside");
            let real = truth(w[1]) - truth(w[0]);
            assert!((e.energy - real).abs() <= e.error, "step {:?}: {} vs {} (bound {})", w, e.energy, real, e.error);
            assert!(!e.below_resolution);
            sum += e.energy;
        }
        let whole = s.at(*bounds.last().expect("b")).expect("in") - s.at(bounds[0]).expect("in");
        assert!((sum - whole).abs() < 1e-9, "steps sum to the counter delta: {sum} vs {whole}");
    }

    #[test]
    fn changing_power_stays_within_the_bound() {
        let (raw, truth) = staircase(|t| 100.0 + 200.0 * (t * 3.0).sin().abs(), 50 * MS, 100 * MS, 0, 3_000 * MS);
        let s = CounterSeries::from_samples(&raw, 0.001);
        for k in 0..25u64 {
            let (a, b) = (300 * MS + k * 97 * MS, 300 * MS + k * 97 * MS + 120 * MS);
            let e = interval_energy(&s, a, b).expect("inside");
            let real = truth(b) - truth(a);
            assert!((e.energy - real).abs() <= e.error, "[{a}, {b}]: {} vs {real} (bound {})", e.energy, e.error);
        }
    }

    #[test]
    fn short_steps_are_flagged_not_zero() {
        let (raw, _) = staircase(|_| 300.0, 100 * MS, 10 * MS, 0, 1_000 * MS);
        let s = CounterSeries::from_samples(&raw, 0.001);
        let e = interval_energy(&s, 405 * MS, 407 * MS).expect("inside");
        assert!(e.below_resolution);
        assert!(e.energy > 0.0, "an interpolated share, never 0 J");
    }

    #[test]
    fn outside_the_sampled_range_is_none() {
        let s = CounterSeries::from_samples(&[(10, 1.0), (20, 2.0), (30, 3.0)], 0.001);
        assert!(interval_energy(&s, 5, 25).is_none());
        assert!(interval_energy(&s, 15, 35).is_none());
        assert_eq!(s.at(25), Some(2.5));
        assert!(CounterSeries::from_samples(&[(10, 1.0)], 0.001).is_empty());
    }

    #[test]
    fn repeated_values_do_not_make_a_staircase() {
        let s = CounterSeries::from_samples(&[(0, 0.0), (10, 0.0), (20, 2.0), (30, 2.0), (40, 4.0), (50, 4.0)], 0.0);
        // Change points at 0, 20, 40, and the closing sample at 50.
        assert_eq!(s.at(10), Some(1.0));
        assert_eq!(s.at(30), Some(3.0));
        assert_eq!(s.at(50), Some(4.0));
        assert_eq!(s.update_period_ns, 20);
    }

    #[test]
    fn gauge_reads_latest_or_near_next() {
        let g = GaugeSeries { points: vec![(100, 1.0), (200, 2.0)] };
        assert_eq!(g.at(150, 1000), Some(1.0));
        assert_eq!(g.at(250, 1000), Some(2.0));
        assert_eq!(g.at(50, 60), Some(1.0));
        assert_eq!(g.at(50, 10), None);
        assert_eq!(g.at(5000, 1000), None);
    }
}
