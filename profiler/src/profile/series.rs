//! Series derived from a session's stored samples: RAPL power from the
//! domains' cumulative energy readings.
use super::ProfileDb;
use crate::correlate::power::mean_power_w;

/// A RAPL domain's mean power between two consecutive readings.
pub struct RaplPower<'a> {
    pub domain: &'a str,
    pub start_ns: i64,
    pub end_ns: i64,
    pub watts: f64,
}

/// Calls `each` with every domain's power over each interval between its
/// consecutive readings, in (domain, time) order. Streams: the readings are
/// never held in memory.
pub fn rapl_power(
    db: &ProfileDb,
    session: i64,
    mut each: impl FnMut(&RaplPower<'_>) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut q = db
        .conn
        .prepare("SELECT domain, ts_ns, energy_j FROM rapl_samples WHERE session_id = ?1 ORDER BY domain, ts_ns")?;
    let mut rows = q.query([session])?;
    let mut last: Option<(String, i64, f64)> = None;
    while let Some(r) = rows.next()? {
        let (domain, ts, j): (String, i64, f64) = (r.get(0)?, r.get(1)?, r.get(2)?);
        // Timestamps are CLOCK_MONOTONIC ns, stored from u64 (as the store reads them back).
        if let Some((d, t0, j0)) = &last
            && *d == domain
            && let Some(watts) = mean_power_w((*t0 as u64, *j0), (ts as u64, j))
        {
            each(&RaplPower { domain: &domain, start_ns: *t0, end_ns: ts, watts })?;
        }
        last = Some((domain, ts, j));
    }
    Ok(())
}
