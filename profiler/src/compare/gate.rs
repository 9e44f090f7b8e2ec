//! `--fail-if 'METRIC OP THRESHOLD'`: a regression gate for CI.
//!
//! A condition fails when the metric's change is significant (its 95 %
//! interval excludes no change) and its estimate is past the threshold.
//! `%` is always a change relative to A; anything else is a change in the
//! metric's own unit (`ms` for times, with `ns`/`us`/`s` converted; `J`, `W`,
//! `pp` for shares in percentage points, or a plain number).
use std::fmt;

use super::{Metric, Unit};

/// `>` fails on an increase past the threshold, `<` on a decrease past it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Above,
    Below,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Threshold {
    /// Relative to A, %.
    Percent(f64),
    /// In the metric's unit.
    Absolute(f64),
}

/// One parsed `--fail-if`.
#[derive(Clone, Debug, PartialEq)]
pub struct Condition {
    pub text: String,
    pub metric: &'static Metric,
    pub direction: Direction,
    pub threshold: Threshold,
}

impl fmt::Display for Condition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

const HOW: &str = "write METRIC > +5% or METRIC < -2ms, e.g. --fail-if 'step_p50 > +5%'";

/// Parses one `--fail-if` (a clap value parser).
pub fn parse(text: &str) -> Result<Condition, String> {
    let at = text.find(['>', '<']).ok_or_else(|| format!("'{text}' has no > or <: {HOW}"))?;
    let (name, rest) = (text[..at].trim(), &text[at..]);
    let direction = if rest.starts_with('>') { Direction::Above } else { Direction::Below };
    let value = rest[1..].trim();
    let metric = super::metric(name).ok_or_else(|| {
        let names: Vec<&str> = super::METRICS.iter().map(|m| m.name).collect();
        format!("'{name}' is not a metric compare knows; give --fail-if one of: {}", names.join(", "))
    })?;
    let threshold = threshold(value, metric.unit).map_err(|why| format!("'{text}': {why}; {HOW}"))?;
    Ok(Condition { text: text.trim().to_owned(), metric, direction, threshold })
}

fn threshold(value: &str, unit: Unit) -> Result<Threshold, String> {
    if value.is_empty() {
        return Err("no threshold after the comparison".into());
    }
    if let Some(pct) = value.strip_suffix('%') {
        return number(pct).map(Threshold::Percent);
    }
    let split = value.find(|c: char| c.is_ascii_alphabetic() || c == 'µ').unwrap_or(value.len());
    let (num, suffix) = (number(&value[..split])?, &value[split..]);
    let scale = match (unit, suffix) {
        (_, "") => 1.0,
        (Unit::Ms, "ns") => 1e-6,
        (Unit::Ms, "us" | "µs") => 1e-3,
        (Unit::Ms, "ms") | (Unit::Joule, "J") | (Unit::Watt, "W") | (Unit::Points, "pp") => 1.0,
        (Unit::Ms, "s") => 1e3,
        (Unit::Joule, "mJ") => 1e-3,
        (Unit::Joule, "kJ") => 1e3,
        _ => return Err(format!("'{suffix}' is not a unit of this metric (its unit is {})", unit.symbol())),
    };
    Ok(Threshold::Absolute(num * scale))
}

fn number(s: &str) -> Result<f64, String> {
    s.trim().parse::<f64>().ok().filter(|v| v.is_finite()).ok_or_else(|| format!("'{s}' is not a number"))
}

impl Condition {
    /// Whether a change (B − A, with `relative_pct` = its % of A) trips the condition.
    pub fn fails(&self, diff: f64, relative_pct: Option<f64>, significant: bool) -> bool {
        let (change, limit) = match self.threshold {
            Threshold::Percent(p) => match relative_pct {
                Some(r) => (r, p),
                // A was 0: any increase is past any relative threshold.
                None => (diff.signum() * f64::INFINITY, p),
            },
            Threshold::Absolute(v) => (diff, v),
        };
        significant
            && match self.direction {
                Direction::Above => change > limit,
                Direction::Below => change < limit,
            }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_parse_in_each_unit() {
        let c = parse("step_p50 > +5%").expect("parses");
        assert_eq!((c.metric.name, c.direction, c.threshold), ("step_p50", Direction::Above, Threshold::Percent(5.0)));
        let c = parse("data_wait_p50>+2ms").expect("parses");
        assert_eq!(c.threshold, Threshold::Absolute(2.0));
        assert_eq!(parse("step_p99 > 1.5s").expect("parses").threshold, Threshold::Absolute(1500.0));
        assert_eq!(parse("step_mean > 250us").expect("parses").threshold, Threshold::Absolute(0.25));
        assert_eq!(parse("energy_per_step > +3%").expect("parses").threshold, Threshold::Percent(3.0));
        let c = parse("mfu_pct < -2pp").expect("parses");
        assert_eq!((c.direction, c.threshold), (Direction::Below, Threshold::Absolute(-2.0)));
        assert_eq!(parse("launches_per_step > 0").expect("parses").threshold, Threshold::Absolute(0.0));
    }

    #[test]
    fn bad_conditions_say_what_to_write() {
        for (bad, says) in [
            ("step_p50 +5%", "has no > or <"),
            ("step_p5 > +5%", "not a metric compare knows"),
            ("step_p50 >", "no threshold"),
            ("step_p50 > fast", "not a number"),
            ("step_p50 > +5J", "not a unit of this metric"),
            ("gpu_energy_per_step > 2ms", "not a unit of this metric"),
        ] {
            let e = parse(bad).expect_err(bad);
            assert!(e.contains(says) && e.contains("--fail-if"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_condition_fails_only_when_significant_and_past_its_threshold() {
        let c = parse("step_p50 > +5%").expect("parses");
        assert!(c.fails(6.0, Some(6.0), true));
        assert!(!c.fails(6.0, Some(6.0), false), "not significant");
        assert!(!c.fails(4.0, Some(4.0), true), "within the threshold");
        assert!(!c.fails(-9.0, Some(-9.0), true), "faster");
        let c = parse("mfu_pct < -2pp").expect("parses");
        assert!(c.fails(-3.0, Some(-10.0), true) && !c.fails(-1.0, Some(-3.0), true));
        let c = parse("launches_per_step > 0").expect("parses");
        assert!(c.fails(1.0, None, true) && !c.fails(0.0, Some(0.0), false));
    }
}
