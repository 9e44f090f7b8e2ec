//! A step's verdict — what bound it — as a rule over its stored columns, so
//! that a user can check every verdict with a query (docs/measurement.md
//! writes the rule out). The first of these that holds is the verdict:
//!
//! 1. `data`: the DataLoader wait is at least 30 % of the step's period (its
//!    duration and the gap before it, where the wait for its first batch lies);
//! 2. `communication`: NCCL calls take at least 30 % of the step;
//! 3. `gpu`: synchronisation calls (the host waiting on the GPU) take at least 30 %;
//! 4. `input-copy`: copy calls take at least 30 % and host→device bytes moved;
//! 5. `cpu-starved`: the thread was runnable, waiting for a CPU, at least 20 %;
//! 6. `blocked`: it was in uninterruptible waits (I/O, page faults) at least 20 %;
//! 7. `host-cpu`: it was on a CPU at least 50 % (Python, dispatch, launch overhead);
//! 8. `mixed`: none of these.
//!
//! A rule whose column is NULL does not hold; when the scheduler columns are
//! NULL (`--no-sched`) and none of rules 1–4 holds, there is no verdict.

/// The share of the step's period that makes the DataLoader wait its bound.
pub const DATA_SHARE: f64 = 0.3;
/// The share of the step a wait (NCCL, sync, copies) must take to be its bound.
pub const WAIT_SHARE: f64 = 0.3;
/// The share of the step runnable or blocked time must take.
pub const SCHED_SHARE: f64 = 0.2;
/// The share of the step the thread must be on a CPU for `host-cpu`.
pub const CPU_SHARE: f64 = 0.5;

/// What bound a step (`steps.bound`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Bound {
    Data,
    Communication,
    Gpu,
    InputCopy,
    CpuStarved,
    Blocked,
    HostCpu,
    Mixed,
}

impl Bound {
    pub const ALL: [Bound; 8] = [
        Self::Data,
        Self::Communication,
        Self::Gpu,
        Self::InputCopy,
        Self::CpuStarved,
        Self::Blocked,
        Self::HostCpu,
        Self::Mixed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Data => "data",
            Self::Communication => "communication",
            Self::Gpu => "gpu",
            Self::InputCopy => "input-copy",
            Self::CpuStarved => "cpu-starved",
            Self::Blocked => "blocked",
            Self::HostCpu => "host-cpu",
            Self::Mixed => "mixed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.as_str() == s)
    }
}

/// The stored columns the rule reads (ns; None for NULL).
#[derive(Clone, Copy, Debug, Default)]
pub struct Evidence {
    pub duration_ns: u64,
    pub inter_step_ns: Option<u64>,
    pub data_wait_ns: Option<u64>,
    pub collective_ns: Option<u64>,
    pub sync_wait_ns: Option<u64>,
    pub copy_ns: Option<u64>,
    pub h2d_bytes: Option<u64>,
    pub runnable_ns: Option<u64>,
    pub blocked_ns: Option<u64>,
    pub cpu_ns: Option<u64>,
}

/// The step's verdict (see the module's rule); None without the evidence to decide.
pub fn verdict(e: &Evidence) -> Option<Bound> {
    if e.duration_ns == 0 {
        return None;
    }
    let d = e.duration_ns as f64;
    let share = |v: Option<u64>, of: f64, at_least: f64| v.is_some_and(|v| v as f64 >= at_least * of);
    let period = d + e.inter_step_ns.unwrap_or(0) as f64;
    if share(e.data_wait_ns, period, DATA_SHARE) {
        return Some(Bound::Data);
    }
    if share(e.collective_ns, d, WAIT_SHARE) {
        return Some(Bound::Communication);
    }
    if share(e.sync_wait_ns, d, WAIT_SHARE) {
        return Some(Bound::Gpu);
    }
    if share(e.copy_ns, d, WAIT_SHARE) && e.h2d_bytes.is_some_and(|b| b > 0) {
        return Some(Bound::InputCopy);
    }
    e.cpu_ns?;
    Some(if share(e.runnable_ns, d, SCHED_SHARE) {
        Bound::CpuStarved
    } else if share(e.blocked_ns, d, SCHED_SHARE) {
        Bound::Blocked
    } else if share(e.cpu_ns, d, CPU_SHARE) {
        Bound::HostCpu
    } else {
        Bound::Mixed
    })
}

/// Runs of steps with a verdict other than their label's most common one are
/// named when at least this many steps long (shorter ones are noise).
pub const MIN_RUN: u64 = 5;
/// The most runs a summary names (the longest).
pub const MAX_RUNS: usize = 3;

/// Consecutive steps with the same verdict, other than the label's most common.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    pub first: i64,
    pub last: i64,
    pub bound: Bound,
    pub steps: u64,
}

/// How a label's steps were bound: each verdict's count (most common first)
/// and the longest runs of another verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    pub counts: Vec<(Bound, u64)>,
    /// Steps with a verdict.
    pub judged: u64,
    pub runs: Vec<Run>,
}

/// The summary of `steps` ((step, verdict) in order), None when none has a verdict.
pub fn summarize(steps: &[(i64, Option<Bound>)]) -> Option<Summary> {
    let mut counts: Vec<(Bound, u64)> = Vec::new();
    for b in steps.iter().filter_map(|(_, b)| *b) {
        match counts.iter_mut().find(|(c, _)| *c == b) {
            Some((_, n)) => *n += 1,
            None => counts.push((b, 1)),
        }
    }
    counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let &(dominant, _) = counts.first()?;
    let mut runs: Vec<Run> = Vec::new();
    let mut current: Option<Run> = None;
    for &(step, bound) in steps {
        match (&mut current, bound) {
            (Some(r), Some(b)) if r.bound == b => {
                r.last = step;
                r.steps += 1;
            }
            _ => {
                runs.extend(current.take().filter(|r| r.steps >= MIN_RUN));
                current =
                    bound.filter(|b| *b != dominant).map(|bound| Run { first: step, last: step, bound, steps: 1 });
            }
        }
    }
    runs.extend(current.filter(|r| r.steps >= MIN_RUN));
    runs.sort_by(|a, b| b.steps.cmp(&a.steps).then(a.first.cmp(&b.first)));
    runs.truncate(MAX_RUNS);
    runs.sort_by_key(|r| r.first);
    Some(Summary { judged: counts.iter().map(|(_, n)| n).sum(), counts, runs })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(duration_ns: u64) -> Evidence {
        Evidence { duration_ns, cpu_ns: Some(0), runnable_ns: Some(0), blocked_ns: Some(0), ..Default::default() }
    }

    #[test]
    fn each_rule_gives_its_verdict() {
        let ms = 1_000_000;
        let cases = [
            (Evidence { data_wait_ns: Some(40 * ms), inter_step_ns: Some(40 * ms), ..step(60 * ms) }, Bound::Data),
            (Evidence { collective_ns: Some(30 * ms), ..step(100 * ms) }, Bound::Communication),
            (Evidence { sync_wait_ns: Some(50 * ms), ..step(100 * ms) }, Bound::Gpu),
            (Evidence { copy_ns: Some(40 * ms), h2d_bytes: Some(1 << 20), ..step(100 * ms) }, Bound::InputCopy),
            (Evidence { runnable_ns: Some(45 * ms), cpu_ns: Some(55 * ms), ..step(100 * ms) }, Bound::CpuStarved),
            (Evidence { blocked_ns: Some(20 * ms), ..step(100 * ms) }, Bound::Blocked),
            (Evidence { cpu_ns: Some(90 * ms), ..step(100 * ms) }, Bound::HostCpu),
            (Evidence { cpu_ns: Some(30 * ms), ..step(100 * ms) }, Bound::Mixed),
        ];
        for (e, want) in cases {
            assert_eq!(verdict(&e), Some(want), "{e:?}");
        }
    }

    #[test]
    fn the_first_rule_that_holds_wins() {
        let e = Evidence { sync_wait_ns: Some(40), runnable_ns: Some(50), cpu_ns: Some(50), ..step(100) };
        assert_eq!(verdict(&e), Some(Bound::Gpu));
    }

    #[test]
    fn copies_without_host_to_device_bytes_are_no_input_copy() {
        let e = Evidence { copy_ns: Some(60), h2d_bytes: Some(0), cpu_ns: Some(90), ..step(100) };
        assert_eq!(verdict(&e), Some(Bound::HostCpu));
    }

    #[test]
    fn without_scheduler_columns_only_the_waits_decide() {
        let none = Evidence { duration_ns: 100, sync_wait_ns: Some(10), ..Default::default() };
        assert_eq!(verdict(&none), None);
        let gpu = Evidence { duration_ns: 100, sync_wait_ns: Some(31), ..Default::default() };
        assert_eq!(verdict(&gpu), Some(Bound::Gpu));
        assert_eq!(verdict(&Evidence::default()), None, "a step of no length");
    }

    #[test]
    fn a_summary_names_the_common_verdict_and_the_long_runs_of_others() {
        let mut steps: Vec<(i64, Option<Bound>)> = (0..100).map(|i| (i, Some(Bound::Gpu))).collect();
        for s in &mut steps[40..48] {
            s.1 = Some(Bound::Data);
        }
        steps[60].1 = Some(Bound::Data); // one step: no run
        steps[70].1 = None;
        let s = summarize(&steps).expect("a summary");
        assert_eq!(s.counts, vec![(Bound::Gpu, 90), (Bound::Data, 9)]);
        assert_eq!(s.judged, 99);
        assert_eq!(s.runs, vec![Run { first: 40, last: 47, bound: Bound::Data, steps: 8 }]);
        assert_eq!(summarize(&[(0, None)]), None);
    }

    #[test]
    fn names_round_trip() {
        for b in Bound::ALL {
            assert_eq!(Bound::parse(b.as_str()), Some(b));
        }
    }
}
