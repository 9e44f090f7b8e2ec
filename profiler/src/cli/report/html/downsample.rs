//! Downsampling for the HTML report's plots: a long session (a million steps,
//! ten hours of samples) becomes a bounded number of points that still show
//! every spike and dip.

/// Points kept per plot at most is twice this: a line is drawn over about
/// 1000 pixels, so two points (min and max) per pixel column lose nothing
/// the eye could see.
pub const BUCKETS: usize = 1000;

/// `points` (in x order) reduced to at most `2 * buckets`: each bucket of
/// consecutive points keeps its minimum and maximum y, in x order, so a spike
/// or a dip survives however many points share its bucket. Fewer points than
/// that are returned as they are.
pub fn min_max(points: &[(f64, f64)], buckets: usize) -> Vec<(f64, f64)> {
    if points.len() <= 2 * buckets || buckets == 0 {
        return points.to_vec();
    }
    let mut out = Vec::with_capacity(2 * buckets);
    for chunk in chunks(points, buckets) {
        let lo = chunk.iter().min_by(|a, b| a.1.total_cmp(&b.1));
        let hi = chunk.iter().max_by(|a, b| a.1.total_cmp(&b.1));
        if let (Some(&lo), Some(&hi)) = (lo, hi) {
            let (first, second) = if lo.0 <= hi.0 { (lo, hi) } else { (hi, lo) };
            out.push(first);
            if second.0 != first.0 {
                out.push(second);
            }
        }
    }
    out
}

/// `points` split into at most `buckets` runs of consecutive points of
/// (nearly) equal size.
pub fn chunks<T>(points: &[T], buckets: usize) -> impl Iterator<Item = &[T]> {
    let size = points.len().div_ceil(buckets.max(1)).max(1);
    points.chunks(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every bucket's min and max survive, in x order; the count is bounded.
    #[test]
    fn keeps_min_and_max_per_bucket() {
        let n: u64 = 1_000_003;
        let points: Vec<(f64, f64)> =
            (0..n).map(|i| (i as f64, ((i * 7919) % 1013) as f64 + if i == 500_000 { 1e6 } else { 0.0 })).collect();
        let kept = min_max(&points, 100);
        assert!(kept.len() <= 200, "{} points", kept.len());
        assert!(kept.windows(2).all(|w| w[0].0 < w[1].0), "x order");
        // The one spike survives, and so do the global min and max.
        assert!(kept.contains(&points[500_000]));
        for chunk in chunks(&points, 100) {
            let lo = chunk.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
            let hi = chunk.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
            let (x0, x1) = (chunk[0].0, chunk[chunk.len() - 1].0);
            let inside: Vec<f64> = kept.iter().filter(|p| p.0 >= x0 && p.0 <= x1).map(|p| p.1).collect();
            assert!(inside.contains(&lo) && inside.contains(&hi), "bucket {x0}..{x1}");
        }
    }

    #[test]
    fn short_series_are_kept_whole() {
        let points = vec![(0.0, 1.0), (1.0, 3.0), (2.0, 2.0)];
        assert_eq!(min_max(&points, 2), points);
        assert!(min_max(&[], 10).is_empty());
        assert_eq!(chunks(&[0; 1000], 400).count(), 334);
        assert_eq!(chunks(&[0; 50], 400).count(), 50);
    }
}
