//! The change between two runs' per-step series, with a confidence interval
//! from a circular block bootstrap.
//!
//! Steps are not independent: a slow phase (a noisy neighbour, a thermal
//! throttle, a data shard that decodes slowly) spans many consecutive steps,
//! so resampling single steps would understate the spread and call noise a
//! change. Resampling blocks of consecutive steps keeps that serial
//! correlation. The block length is chosen per series from its
//! autocorrelation ([`block_length`]); each side is resampled on its own, the
//! statistic taken on both, and the 2.5th and 97.5th percentiles of the
//! differences bound the change at 95 %.
//!
//! A bootstrap rather than a rank test: the statistics compared are quantiles
//! (p50, p90, p99), means and ratios of sums, and a rank test answers a
//! different question (is one distribution shifted) without an interval in the
//! metric's own unit, which the gate's thresholds (`+5%`, `+2ms`) need.
use rand::{Rng, SeedableRng, rngs::SmallRng};

/// Resamples per comparison: enough for stable 2.5/97.5 percentiles.
pub const RESAMPLES: usize = 1000;
/// The same seed every time: a comparison of the same two files reads the same.
const SEED: u64 = 0x5eed_c0de;

/// What is taken of a series.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Statistic {
    /// Nearest-rank quantile, 0 < q ≤ 1 (0.5: the median).
    Quantile(f64),
    Mean,
    /// Σ values / Σ denominators (a share of time: sync wait over step time).
    RatioOfSums,
}

/// One side's per-step values, in step order; `denominators` only for
/// [`Statistic::RatioOfSums`].
#[derive(Clone, Debug, Default)]
pub struct Series {
    pub values: Vec<f64>,
    pub denominators: Vec<f64>,
}

impl Series {
    #[cfg(test)]
    pub fn new(values: Vec<f64>) -> Self {
        Self { values, denominators: Vec::new() }
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }
}

/// The change from A to B of one statistic.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Change {
    pub a: f64,
    pub b: f64,
    /// B − A, and its 95 % interval.
    pub diff: f64,
    pub diff_low: f64,
    pub diff_high: f64,
}

impl Change {
    /// B / A − 1, in %, and its interval (None when A is 0).
    pub fn relative_pct(&self) -> Option<(f64, f64, f64)> {
        (self.a != 0.0).then(|| {
            let r = |d: f64| 100.0 * d / self.a.abs();
            (r(self.diff), r(self.diff_low), r(self.diff_high))
        })
    }

    /// The interval lies wholly outside ±`noise_pct` % of A: it excludes
    /// every change that run-to-run noise could make (0: excludes no change).
    pub fn significant(&self, noise_pct: f64) -> bool {
        let margin = noise_pct / 100.0 * self.a.abs();
        self.diff_low > margin || self.diff_high < -margin
    }
}

/// The statistic of `s` over the steps `idx` (all steps when None).
pub fn statistic(s: &Series, stat: Statistic, idx: Option<&[usize]>, scratch: &mut Vec<f64>) -> f64 {
    let pick = |v: &[f64]| -> Vec<f64> {
        match idx {
            Some(i) => i.iter().map(|&k| v[k]).collect(),
            None => v.to_vec(),
        }
    };
    match stat {
        Statistic::Mean => {
            let n = idx.map_or(s.values.len(), <[usize]>::len) as f64;
            let sum: f64 = match idx {
                Some(i) => i.iter().map(|&k| s.values[k]).sum(),
                None => s.values.iter().sum(),
            };
            sum / n
        }
        Statistic::RatioOfSums => {
            let (num, den): (f64, f64) = match idx {
                Some(i) => (i.iter().map(|&k| s.values[k]).sum(), i.iter().map(|&k| s.denominators[k]).sum()),
                None => (s.values.iter().sum(), s.denominators.iter().sum()),
            };
            if den > 0.0 { num / den } else { 0.0 }
        }
        Statistic::Quantile(q) => {
            *scratch = pick(&s.values);
            quantile_in_place(scratch, q)
        }
    }
}

/// Nearest rank: the smallest value with at least q of the values at or below it.
fn quantile_in_place(v: &mut [f64], q: f64) -> f64 {
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    let (_, x, _) = v.select_nth_unstable_by(rank - 1, f64::total_cmp);
    *x
}

/// The block length for a series of `n` steps: the first lag whose
/// autocorrelation falls inside the noise band ±2/√n, doubled (a block must
/// span the correlated stretch), at least n^(1/3) and at most n/4.
pub fn block_length(values: &[f64]) -> usize {
    let n = values.len();
    if n < 8 {
        return 1;
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    let var: f64 = values.iter().map(|x| (x - mean) * (x - mean)).sum();
    let floor = (n as f64).cbrt().ceil() as usize;
    let cap = (n / 4).max(1);
    if var == 0.0 {
        return floor.min(cap);
    }
    let band = 2.0 / (n as f64).sqrt();
    let max_lag = cap.min(200);
    let mut first_quiet = max_lag;
    for lag in 1..=max_lag {
        let c: f64 = (0..n - lag).map(|i| (values[i] - mean) * (values[i + lag] - mean)).sum();
        if (c / var).abs() < band {
            first_quiet = lag;
            break;
        }
    }
    (2 * first_quiet).max(floor).min(cap)
}

/// Indices of one circular block resample of `n` steps in blocks of `block`.
fn resample(n: usize, block: usize, rng: &mut SmallRng, out: &mut Vec<usize>) {
    out.clear();
    while out.len() < n {
        let start = rng.random_range(0..n);
        for k in 0..block.min(n - out.len()) {
            out.push((start + k) % n);
        }
    }
}

/// The change of `stat` from `a` to `b`, with its 95 % interval. Both series
/// must have at least one step.
pub fn compare(a: &Series, b: &Series, stat: Statistic) -> Change {
    let mut scratch = Vec::new();
    let sa = statistic(a, stat, None, &mut scratch);
    let sb = statistic(b, stat, None, &mut scratch);
    let (ba, bb) = (block_length(&a.values), block_length(&b.values));
    let mut rng = SmallRng::seed_from_u64(SEED);
    let (mut ia, mut ib) = (Vec::with_capacity(a.len()), Vec::with_capacity(b.len()));
    let mut diffs: Vec<f64> = (0..RESAMPLES)
        .map(|_| {
            resample(a.len(), ba, &mut rng, &mut ia);
            resample(b.len(), bb, &mut rng, &mut ib);
            statistic(b, stat, Some(&ib), &mut scratch) - statistic(a, stat, Some(&ia), &mut scratch)
        })
        .collect();
    let low = quantile_in_place(&mut diffs, 0.025);
    let high = quantile_in_place(&mut diffs, 0.975);
    // A percentile interval of a skewed statistic (p99 of few steps) can miss
    // its own estimate; widened to hold it, it never reads tighter than it is.
    Change { a: sa, b: sb, diff: sb - sa, diff_low: low.min(sb - sa), diff_high: high.max(sb - sa) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps around `base` with noise from a fixed generator, in slow phases
    /// (an AR(1) process): serially correlated as real step times are.
    fn correlated(n: usize, base: f64, seed: u64) -> Vec<f64> {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut x = 0.0;
        (0..n)
            .map(|_| {
                x = 0.9 * x + rng.random_range(-1.0..1.0);
                base + x
            })
            .collect()
    }

    #[test]
    fn the_same_process_reads_no_change_and_a_shift_reads_one() {
        let mut false_alarms = 0;
        for seed in 0..20 {
            let a = Series::new(correlated(400, 100.0, seed));
            let b = Series::new(correlated(400, 100.0, seed + 1000));
            if compare(&a, &b, Statistic::Quantile(0.5)).significant(0.0) {
                false_alarms += 1;
            }
        }
        // 5 % expected at 95 %: 1 in 20, allow a few.
        assert!(false_alarms <= 3, "{false_alarms} of 20 identical pairs read as changed");
        let a = Series::new(correlated(400, 100.0, 1));
        let b = Series::new(correlated(400, 110.0, 2));
        let c = compare(&a, &b, Statistic::Quantile(0.5));
        assert!(c.significant(0.0) && c.diff_low > 5.0 && c.diff_high < 15.0, "{c:?}");
        assert!(c.diff_low <= c.diff && c.diff <= c.diff_high);
    }

    #[test]
    fn correlated_steps_get_longer_blocks_and_wider_intervals() {
        let ar = correlated(1000, 0.0, 7);
        let mut rng = SmallRng::seed_from_u64(8);
        let white: Vec<f64> = (0..1000).map(|_| rng.random_range(-1.0..1.0)).collect();
        assert!(block_length(&ar) > block_length(&white), "{} vs {}", block_length(&ar), block_length(&white));
        assert_eq!(block_length(&[1.0; 5]), 1);
        assert!(block_length(&[3.0; 100]) <= 25);
    }

    #[test]
    fn statistics_are_nearest_rank_means_and_ratios() {
        let s = Series { values: vec![4.0, 1.0, 3.0, 2.0], denominators: vec![8.0, 2.0, 6.0, 4.0] };
        let mut scratch = Vec::new();
        assert_eq!(statistic(&s, Statistic::Quantile(0.5), None, &mut scratch), 2.0);
        assert_eq!(statistic(&s, Statistic::Quantile(0.99), None, &mut scratch), 4.0);
        assert_eq!(statistic(&s, Statistic::Mean, None, &mut scratch), 2.5);
        assert_eq!(statistic(&s, Statistic::RatioOfSums, None, &mut scratch), 0.5);
        assert_eq!(statistic(&s, Statistic::Mean, Some(&[0, 0]), &mut scratch), 4.0);
        // Identical constant series: no change, an interval of zero width.
        let c = compare(&Series::new(vec![5.0; 50]), &Series::new(vec![5.0; 50]), Statistic::Mean);
        assert!(!c.significant(0.0) && c.diff == 0.0 && c.diff_low == 0.0 && c.diff_high == 0.0);
        assert_eq!(c.relative_pct(), Some((0.0, 0.0, 0.0)));
    }
}
