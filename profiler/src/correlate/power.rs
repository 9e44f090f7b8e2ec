//! Power from a cumulative energy counter: the mean over the interval between
//! two of its readings. One rule for the live gauges and for the series read
//! back from a profile.

/// The mean power (W) between two readings (ns, J) of a cumulative energy
/// counter; None unless the second is later than the first.
pub fn mean_power_w(earlier: (u64, f64), later: (u64, f64)) -> Option<f64> {
    (later.0 > earlier.0).then(|| (later.1 - earlier.1) / ((later.0 - earlier.0) as f64 / 1e9))
}
