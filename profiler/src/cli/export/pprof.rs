//! `export --format pprof`: the session's CPU samples as a gzip'd
//! `profile.proto` (github.com/google/pprof, proto/profile.proto), which `go
//! tool pprof`, speedscope and Grafana Pyroscope read: two sample types,
//! `samples/count` and `cpu/nanoseconds` (a sample is 1/HZ s of CPU), one
//! location per distinct frame (one line: its function; a Python frame's
//! file and first line), and each sample's step label and number as labels.
//! The messages are written here with prost, the fields numbered as the
//! schema numbers them.
use std::{collections::HashMap, io::Write};

use anyhow::bail;
use prost::Message;

use crate::profile::{ProfileDb, cpu};

#[derive(Clone, PartialEq, Message)]
pub struct Profile {
    #[prost(message, repeated, tag = "1")]
    pub sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    pub sample: Vec<Sample>,
    #[prost(message, repeated, tag = "4")]
    pub location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    pub function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    pub string_table: Vec<String>,
    #[prost(message, optional, tag = "11")]
    pub period_type: Option<ValueType>,
    #[prost(int64, tag = "12")]
    pub period: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct ValueType {
    #[prost(int64, tag = "1")]
    pub r#type: i64,
    #[prost(int64, tag = "2")]
    pub unit: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct Sample {
    /// Leaf first.
    #[prost(uint64, repeated, tag = "1")]
    pub location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    pub value: Vec<i64>,
    #[prost(message, repeated, tag = "3")]
    pub label: Vec<Label>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Label {
    #[prost(int64, tag = "1")]
    pub key: i64,
    #[prost(int64, tag = "2")]
    pub str: i64,
    #[prost(int64, tag = "3")]
    pub num: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct Location {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(message, repeated, tag = "4")]
    pub line: Vec<Line>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Line {
    #[prost(uint64, tag = "1")]
    pub function_id: u64,
    #[prost(int64, tag = "2")]
    pub line: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct Function {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(int64, tag = "2")]
    pub name: i64,
    #[prost(int64, tag = "3")]
    pub system_name: i64,
    #[prost(int64, tag = "4")]
    pub filename: i64,
    #[prost(int64, tag = "5")]
    pub start_line: i64,
}

/// The string table: index 0 is "", as the format requires.
#[derive(Default)]
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    fn id(&mut self, s: &str) -> i64 {
        if self.table.is_empty() {
            self.table.push(String::new());
            self.index.insert(String::new(), 0);
        }
        if let Some(&i) = self.index.get(s) {
            return i;
        }
        let i = self.table.len() as i64;
        self.table.push(s.to_owned());
        self.index.insert(s.to_owned(), i);
        i
    }
}

/// The profile of `counts` over `stacks`, a sample `period_ns` of CPU each.
pub fn profile(stacks: &cpu::Stacks, counts: &[cpu::StackCount], period_ns: i64) -> Profile {
    let mut s = Strings::default();
    let sample_type = vec![
        ValueType { r#type: s.id("samples"), unit: s.id("count") },
        ValueType { r#type: s.id("cpu"), unit: s.id("nanoseconds") },
    ];
    let period_type = Some(ValueType { r#type: s.id("cpu"), unit: s.id("nanoseconds") });
    let (label_key, step_key) = (s.id("label"), s.id("step"));
    // Frame ids are dense per session: a location and a function each, id + 1 (0 is not an id).
    let mut frame_ids: Vec<&i64> = stacks.frames.keys().collect();
    frame_ids.sort_unstable();
    let mut function = Vec::new();
    let mut location = Vec::new();
    for &id in frame_ids {
        let f = &stacks.frames[&id];
        let pid = id as u64 + 1;
        let name = match f.kind.as_str() {
            "kernel" => format!("{} [k]", f.function),
            _ => f.function.clone(),
        };
        let name = s.id(&name);
        let filename = s.id(f.module.as_deref().unwrap_or(""));
        let line = f.line.unwrap_or(0);
        function.push(Function { id: pid, name, system_name: name, filename, start_line: line });
        location.push(Location { id: pid, line: vec![Line { function_id: pid, line }] });
    }
    let sample = counts
        .iter()
        .map(|c| {
            let location_id = stacks.stacks.get(&c.stack_id).map(|f| f.iter().map(|&id| id as u64 + 1).collect());
            let mut label = Vec::new();
            if let Some(l) = &c.label {
                label.push(Label { key: label_key, str: s.id(l), num: 0 });
            }
            if let Some(step) = c.step {
                label.push(Label { key: step_key, str: 0, num: step });
            }
            let n = c.samples as i64;
            Sample { location_id: location_id.unwrap_or_default(), value: vec![n, n * period_ns], label }
        })
        .collect();
    Profile { sample_type, sample, location, function, string_table: s.table, period_type, period: period_ns }
}

/// Writes the gzip'd profile of `session`'s samples (or those in steps
/// labelled `label`); returns (stacks, samples).
pub(super) fn write_pprof(
    db: &ProfileDb,
    session: i64,
    label: Option<&str>,
    w: &mut impl Write,
) -> anyhow::Result<(u64, u64)> {
    let Some(stacks) = cpu::stacks(db, session)? else {
        bail!("{} has no CPU samples (written by a profiler before --cpu-sample)", db.path.display())
    };
    let mut counts = cpu::stack_counts(db, session)?;
    if let Some(l) = label {
        counts.retain(|c| c.label.as_deref() == Some(l));
    }
    let hz: Option<i64> =
        db.conn.query_row("SELECT cpu_sample_hz FROM sessions WHERE id = ?1", [session], |r| r.get(0))?;
    let period_ns = 1_000_000_000 / hz.filter(|h| *h > 0).unwrap_or(99);
    let p = profile(&stacks, &counts, period_ns);
    let samples = counts.iter().map(|c| c.samples).sum();
    let mut gz = flate2::write::GzEncoder::new(w, flate2::Compression::default());
    gz.write_all(&p.encode_to_vec())?;
    gz.finish()?;
    Ok((p.sample.len() as u64, samples))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::cpu::Frame;

    #[test]
    fn samples_name_their_frames_through_the_tables_and_decode_back() {
        let frame = |kind: &str, f: &str, line| Frame {
            kind: kind.into(),
            module: Some("m.py".into()),
            function: f.into(),
            line,
        };
        let stacks = cpu::Stacks {
            stacks: HashMap::from([(5, vec![1, 0])]),
            frames: HashMap::from([(0, frame("python", "step", Some(3))), (1, frame("kernel", "do_sys", None))]),
        };
        let counts = [cpu::StackCount { label: Some("train".into()), step: Some(7), stack_id: 5, samples: 4 }];
        let p = Profile::decode(&*profile(&stacks, &counts, 10_101_010).encode_to_vec()).expect("decodes");
        let s = |i: i64| p.string_table[i as usize].as_str();
        assert_eq!(s(0), "");
        assert_eq!(p.sample.len(), 1);
        assert_eq!(p.sample[0].value, vec![4, 4 * 10_101_010]);
        let names: Vec<&str> = p.sample[0]
            .location_id
            .iter()
            .map(|id| {
                let loc = p.location.iter().find(|l| l.id == *id).expect("location");
                s(p.function.iter().find(|f| f.id == loc.line[0].function_id).expect("function").name)
            })
            .collect();
        assert_eq!(names, vec!["do_sys [k]", "step"]);
        let labels: Vec<(&str, &str, i64)> = p.sample[0].label.iter().map(|l| (s(l.key), s(l.str), l.num)).collect();
        assert_eq!(labels, vec![("label", "train", 0), ("step", "", 7)]);
        assert_eq!(p.function.iter().find(|f| s(f.name) == "step").map(|f| f.start_line), Some(3));
    }
}
