//! `profiler export`: a session as a Chrome trace-event JSON file that
//! ui.perfetto.dev and chrome://tracing open, or any table or view of it as CSV.
//!
//! Both stream: rows go from an SQLite cursor through a buffered writer one at
//! a time, in the order SQLite stores them (no ORDER BY over launches, which
//! would sort millions of rows), so an export of any size runs in a few MiB.
//! Trace viewers sort events themselves.
use std::{
    fs::File,
    io::{BufWriter, Write},
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use rusqlite::types::ValueRef;
use serde::{Serialize, Serializer, ser::SerializeMap};

use super::report::{ProfileDb, kernel_display, reader_went_away};

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// The profile to read.
    db: PathBuf,
    /// `perfetto`: Chrome trace-event JSON; `csv`: one table (--table).
    #[arg(long, value_enum, default_value_t = ExportFormat::Perfetto)]
    format: ExportFormat,
    /// File to write (default, or `-`: standard output).
    #[arg(short, long, value_name = "PATH")]
    output: Option<PathBuf>,
    /// Session id (default: the latest).
    #[arg(long, value_name = "N")]
    session: Option<i64>,
    /// Table or view to export with --format csv (rows of the session only,
    /// where it has a session_id column).
    #[arg(long, value_name = "T")]
    table: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ExportFormat {
    Perfetto,
    Csv,
}

pub async fn main(args: ExportArgs) -> anyhow::Result<ExitCode> {
    let db = ProfileDb::open(&args.db)?;
    let session = db.session(args.session)?;
    let table = match (args.format, &args.table) {
        (ExportFormat::Csv, None) => {
            bail!("--format csv needs --table T (one of: {})", db.tables().collect::<Vec<_>>().join(", "))
        }
        (ExportFormat::Perfetto, Some(_)) => {
            bail!("--table is for --format csv; the Perfetto export holds the whole session")
        }
        (_, t) => t.clone(),
    };
    let to_file = args.output.as_deref().filter(|p| *p != Path::new("-"));
    let sink: Box<dyn Write> = match to_file {
        Some(p) => Box::new(File::create(p).with_context(|| format!("cannot create {}", p.display()))?),
        None => Box::new(std::io::stdout().lock()),
    };
    let mut out = BufWriter::with_capacity(1 << 16, sink);
    let hint = if table.is_none() { "; open it in https://ui.perfetto.dev" } else { "" };
    let written = match table {
        Some(t) => export_csv(&db, session, &t, &mut out).and_then(|rows| {
            out.flush()?;
            Ok(format!("{rows} rows of {t} (session {session})"))
        }),
        None => export_perfetto(&db, session, &mut out).and_then(|c| {
            out.flush()?;
            Ok(format!(
                "{} events ({} steps, {} launches, {} syncs, {} counter values) of session {session}",
                c.total, c.steps, c.launches, c.syncs, c.counters
            ))
        }),
    };
    match (written, to_file) {
        (Err(e), None) if reader_went_away(&e) => {}
        (Err(e), _) => return Err(e.context("exporting")),
        (Ok(what), Some(p)) => {
            eprintln!("profiler: wrote {what} to {}{hint}", p.display());
        }
        (Ok(_), None) => {}
    }
    Ok(ExitCode::SUCCESS)
}

/// Events written, by kind.
#[derive(Debug, Default)]
pub struct EventCounts {
    pub total: u64,
    pub steps: u64,
    pub launches: u64,
    pub syncs: u64,
    pub counters: u64,
}

/// One trace event. Field names are the trace-event format's.
#[derive(Serialize)]
struct Event<'a, A: Serialize> {
    name: &'a str,
    ph: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    cat: Option<&'static str>,
    ts: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    dur: Option<f64>,
    pid: i64,
    tid: i64,
    /// Scope of an instant event: `t`, the thread's track.
    #[serde(skip_serializing_if = "Option::is_none")]
    s: Option<&'static str>,
    args: A,
}

#[derive(Serialize)]
struct NameArgs<'a> {
    name: &'a str,
}

#[derive(Serialize)]
struct StepArgs<'a> {
    label: &'a str,
    step: i64,
    launches: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sync_wait_ms: Option<f64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    unfinished: bool,
}

#[derive(Serialize)]
struct LaunchArgs<'a> {
    api: Option<&'a str>,
    function: String,
    grid: [i64; 3],
    block: [i64; 3],
    shared_mem_bytes: i64,
    stream: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    label: Option<&'a str>,
    step: Option<i64>,
}

#[derive(Serialize)]
struct SyncArgs {
    step: Option<i64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    unfinished: bool,
}

/// A counter's one series: `{"<unit>": value}`, so the track is named
/// "<counter> <unit>" in Perfetto.
struct CounterValue<'a> {
    unit: &'a str,
    value: f64,
}

impl Serialize for CounterValue<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(1))?;
        m.serialize_entry(self.unit, &self.value)?;
        m.end()
    }
}

/// Writes `{"traceEvents": [` … `]}` one event per line.
struct TraceWriter<W: Write> {
    out: W,
    events: u64,
}

impl<W: Write> TraceWriter<W> {
    fn new(mut out: W) -> std::io::Result<Self> {
        out.write_all(b"{\"traceEvents\":[")?;
        Ok(Self { out, events: 0 })
    }

    fn event(&mut self, e: &impl Serialize) -> anyhow::Result<()> {
        self.out.write_all(if self.events == 0 { b"\n" } else { b",\n" })?;
        serde_json::to_writer(&mut self.out, e)?;
        self.events += 1;
        Ok(())
    }

    fn finish(mut self, other: &impl Serialize) -> anyhow::Result<W> {
        self.out.write_all(b"\n],\"displayTimeUnit\":\"ms\",\"otherData\":")?;
        serde_json::to_writer(&mut self.out, other)?;
        self.out.write_all(b"}\n")?;
        Ok(self.out)
    }
}

/// What chrome://tracing shows under "metadata".
#[derive(Serialize)]
struct OtherData<'a> {
    profiler_session: i64,
    command: &'a str,
    started_unix_s: f64,
    timestamps: &'static str,
}

/// Writes the Perfetto trace of `session`: process and thread names, steps as
/// slices on their thread's track, launches as instants, syncs as slices,
/// and counter tracks for each GPU and for CPU/DRAM power. Timestamps are µs
/// since the session started.
pub fn export_perfetto(db: &ProfileDb, session: i64, out: impl Write) -> anyhow::Result<EventCounts> {
    let (pid, command, exe, started_ns, unix_s): (i64, String, Option<String>, i64, f64) = db.conn.query_row(
        "SELECT pid, command, exe, started_ns, (started_ns + unix_offset_ns) / 1e9 FROM sessions WHERE id = ?1",
        [session],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
    )?;
    let us = |ns: i64| (ns - started_ns) as f64 / 1e3;
    let mut w = TraceWriter::new(out)?;
    let mut counts = EventCounts::default();

    // Track names.
    let program = exe
        .as_deref()
        .or_else(|| command.split_whitespace().next())
        .and_then(|p| Path::new(p).file_name())
        .map_or_else(|| "target".to_string(), |n| n.to_string_lossy().into_owned());
    let process_name = format!("{program} (pid {pid})");
    w.event(&Event {
        name: "process_name",
        ph: "M",
        cat: None,
        ts: 0.0,
        dur: None,
        pid,
        tid: pid,
        s: None,
        args: NameArgs { name: &process_name },
    })?;
    let has_syncs = db.has_table("syncs");
    let mut tid_sql = "SELECT tid FROM steps WHERE session_id = ?1".to_string();
    if db.has_table("launches") {
        tid_sql.push_str(" UNION SELECT tid FROM launches WHERE session_id = ?1");
    }
    if has_syncs {
        tid_sql.push_str(" UNION SELECT tid FROM syncs WHERE session_id = ?1");
    }
    {
        let mut q = db.conn.prepare(&tid_sql)?;
        let mut rows = q.query([session])?;
        while let Some(r) = rows.next()? {
            let tid: i64 = r.get(0)?;
            let name = if tid == pid { format!("main thread {tid}") } else { format!("thread {tid}") };
            w.event(&Event {
                name: "thread_name",
                ph: "M",
                cat: None,
                ts: 0.0,
                dur: None,
                pid,
                tid,
                s: None,
                args: NameArgs { name: &name },
            })?;
        }
    }

    // Steps. One thread runs one step at a time (a step is the outermost
    // call), so a thread's step slices never overlap.
    {
        let label = db.label_expr("steps")?;
        let sync = if db.has_column("steps", "sync_wait_ns")? { "sync_wait_ns" } else { "NULL" };
        let mut q = db.conn.prepare(&format!(
            "SELECT {label}, step, tid, start_ns, end_ns, launches, {sync} FROM steps WHERE session_id = ?1
             ORDER BY tid, start_ns"
        ))?;
        let mut rows = q.query([session])?;
        let mut name = String::new();
        while let Some(r) = rows.next()? {
            let label: String = r.get(0)?;
            let step: i64 = r.get(1)?;
            let end: Option<i64> = r.get(4)?;
            name.clear();
            name.push_str(&label);
            name.push_str(" #");
            name.push_str(&step.to_string());
            let start: i64 = r.get(3)?;
            w.event(&Event {
                name: &name,
                // A step still running at the end has a beginning and no end:
                // a "B" without its "E", which viewers show as not ended.
                ph: if end.is_some() { "X" } else { "B" },
                cat: Some("step"),
                ts: us(start),
                dur: end.map(|e| (e - start) as f64 / 1e3),
                pid,
                tid: r.get(2)?,
                s: None,
                args: StepArgs {
                    label: &label,
                    step,
                    launches: r.get(5)?,
                    sync_wait_ms: r.get::<_, Option<i64>>(6)?.map(|n| n as f64 / 1e6),
                    unfinished: end.is_none(),
                },
            })?;
            counts.steps += 1;
        }
    }

    // Host sync waits: inside the step that waited, on the same thread.
    if has_syncs {
        let api = if db.has_table("apis") {
            "COALESCE((SELECT name FROM apis WHERE id = s.api), CAST(s.api AS TEXT))"
        } else {
            "CAST(s.api AS TEXT)"
        };
        let step = if db.has_column("syncs", "step")? { "s.step" } else { "NULL" };
        let mut q = db.conn.prepare(&format!(
            "SELECT {api}, s.tid, s.start_ns, s.end_ns, {step} FROM syncs s WHERE s.session_id = ?1"
        ))?;
        let mut rows = q.query([session])?;
        while let Some(r) = rows.next()? {
            let name: String = r.get(0)?;
            let start: i64 = r.get(2)?;
            let end: Option<i64> = r.get(3)?;
            w.event(&Event {
                name: &name,
                ph: if end.is_some() { "X" } else { "B" },
                cat: Some("sync"),
                ts: us(start),
                dur: end.map(|e| (e - start) as f64 / 1e3),
                pid,
                tid: r.get(1)?,
                s: None,
                args: SyncArgs { step: r.get(4)?, unfinished: end.is_none() },
            })?;
            counts.syncs += 1;
        }
    }

    if db.has_table("launches") {
        counts.launches = write_launches(db, session, pid, started_ns, &mut w)?;
    }
    counts.counters = write_counters(db, session, pid, started_ns, &mut w)?;

    counts.total = w.events;
    let mut out = w.finish(&OtherData {
        profiler_session: session,
        command: &command,
        started_unix_s: unix_s,
        timestamps: "µs since the session started",
    })?;
    out.flush()?;
    Ok(counts)
}

/// Launch instants, named by kernel where the profile knows the name.
fn write_launches<W: Write>(
    db: &ProfileDb,
    session: i64,
    pid: i64,
    started_ns: i64,
    w: &mut TraceWriter<W>,
) -> anyhow::Result<u64> {
    let api = if db.has_table("apis") { "(SELECT name FROM apis WHERE id = l.api)" } else { "CAST(l.api AS TEXT)" };
    let label = if db.has_column("launches", "label")? { "l.label" } else { "NULL" };
    // One name per handle (a handle could be named twice, e.g. a module
    // loaded again); a join on the raw table would repeat the launch.
    let (kernel_join, kname, kdem) =
        if db.has_table("kernels") && db.has_column("kernels", "function")? && db.has_column("kernels", "name")? {
            let dem = if db.has_column("kernels", "demangled_name")? { "min(demangled_name)" } else { "NULL" };
            let by_session = if db.has_column("kernels", "session_id")? { "WHERE session_id = ?1" } else { "" };
            (
                format!(
                    "LEFT JOIN (SELECT function, min(name) AS name, {dem} AS demangled_name FROM kernels {by_session}
                     GROUP BY function) k ON k.function = l.function"
                ),
                "k.name",
                "k.demangled_name",
            )
        } else {
            (String::new(), "NULL", "NULL")
        };
    let sql = format!(
        "SELECT l.ts_ns, l.tid, l.function, {api}, {kname}, {kdem}, l.grid_x, l.grid_y, l.grid_z,
                l.block_x, l.block_y, l.block_z, l.shared_mem_bytes, l.stream, {label}, l.step
         FROM launches l {kernel_join} WHERE l.session_id = ?1"
    );
    let mut q = db.conn.prepare(&sql)?;
    let mut rows = q.query([session])?;
    let mut n = 0;
    while let Some(r) = rows.next()? {
        let function: i64 = r.get(2)?;
        let api: Option<String> = r.get(3)?;
        let kname: Option<String> = r.get(4)?;
        let kdem: Option<String> = r.get(5)?;
        let label: Option<String> = r.get(14)?;
        let name = kernel_display(kname.as_deref(), kdem.as_deref(), api.as_deref(), function);
        let ts: i64 = r.get(0)?;
        w.event(&Event {
            name: &name,
            ph: "i",
            cat: Some("launch"),
            ts: (ts - started_ns) as f64 / 1e3,
            dur: None,
            pid,
            tid: r.get(1)?,
            s: Some("t"),
            args: LaunchArgs {
                api: api.as_deref(),
                function: format!("{function:#x}"),
                grid: [r.get(6)?, r.get(7)?, r.get(8)?],
                block: [r.get(9)?, r.get(10)?, r.get(11)?],
                shared_mem_bytes: r.get(12)?,
                stream: format!("{:#x}", r.get::<_, i64>(13)?),
                label: label.as_deref(),
                step: r.get(15)?,
            },
        })?;
        n += 1;
    }
    Ok(n)
}

/// GPU samples, RAPL power and system usage as counter tracks; a reading
/// the profile does not have is left out, never drawn as zero.
fn write_counters<W: Write>(
    db: &ProfileDb,
    session: i64,
    pid: i64,
    started_ns: i64,
    w: &mut TraceWriter<W>,
) -> anyhow::Result<u64> {
    let mut n = 0;
    let mut counter = |w: &mut TraceWriter<W>, name: &str, unit: &str, ts_ns: i64, value: f64| -> anyhow::Result<()> {
        n += 1;
        w.event(&Event {
            name,
            ph: "C",
            cat: None,
            ts: (ts_ns - started_ns) as f64 / 1e3,
            dur: None,
            pid,
            tid: pid,
            s: None,
            args: CounterValue { unit, value },
        })
    };

    // (column, counter name after the GPU, unit)
    const GPU: [(&str, &str, &str); 4] = [
        ("utilization_gpu_pct", "utilization", "%"),
        ("power_w", "power", "W"),
        ("memory_used_mib", "memory used", "MiB"),
        ("temperature_gpu_c", "temperature", "°C"),
    ];
    if db.has_table("gpu_samples") {
        let cols = db.columns("gpu_samples")?;
        let present: Vec<&(&str, &str, &str)> = GPU.iter().filter(|(c, ..)| cols.iter().any(|x| x == c)).collect();
        if !present.is_empty() {
            let list: Vec<&str> = present.iter().map(|(c, ..)| *c).collect();
            let mut q = db
                .conn
                .prepare(&format!("SELECT gpu, ts_ns, {} FROM gpu_samples WHERE session_id = ?1", list.join(", ")))?;
            let mut rows = q.query([session])?;
            let mut names: Vec<(i64, Vec<String>)> = Vec::new();
            while let Some(r) = rows.next()? {
                let gpu: i64 = r.get(0)?;
                let ts: i64 = r.get(1)?;
                let idx = match names.iter().position(|(g, _)| *g == gpu) {
                    Some(i) => i,
                    None => {
                        names.push((gpu, present.iter().map(|(_, what, _)| format!("GPU {gpu} {what}")).collect()));
                        names.len() - 1
                    }
                };
                for (i, (_, _, unit)) in present.iter().enumerate() {
                    if let Some(v) = r.get::<_, Option<f64>>(2 + i)? {
                        counter(w, &names[idx].1[i], unit, ts, v)?;
                    }
                }
            }
        }
    }

    // RAPL counters are cumulative joules per domain: the power over each
    // interval is drawn from the interval's start.
    if db.has_table("rapl_samples") {
        let mut q = db
            .conn
            .prepare("SELECT domain, ts_ns, energy_j FROM rapl_samples WHERE session_id = ?1 ORDER BY domain, ts_ns")?;
        let mut rows = q.query([session])?;
        let mut prev: Option<(String, i64, f64)> = None;
        while let Some(r) = rows.next()? {
            let domain: String = r.get(0)?;
            let ts: i64 = r.get(1)?;
            let e: f64 = r.get(2)?;
            if let Some((d, t0, e0)) = &prev
                && *d == domain
                && ts > *t0
            {
                let name = match domain.as_str() {
                    "package" => "CPU package power".to_string(),
                    "dram" => "DRAM power".to_string(),
                    other => format!("RAPL {other} power"),
                };
                counter(w, &name, "W", *t0, (e - e0) / ((ts - t0) as f64 / 1e9))?;
            }
            prev = Some((domain, ts, e));
        }
    }

    const SYSTEM: [(&str, &str, &str); 4] = [
        ("cpu_usage_pct", "system CPU", "%"),
        ("process_cpu_pct", "target CPU", "%"),
        ("ram_used_gb", "RAM used", "GB"),
        ("process_rss_gb", "target RSS", "GB"),
    ];
    if db.has_table("system_samples") {
        let cols = db.columns("system_samples")?;
        let present: Vec<&(&str, &str, &str)> = SYSTEM.iter().filter(|(c, ..)| cols.iter().any(|x| x == c)).collect();
        if !present.is_empty() && cols.iter().any(|c| c == "ts_ns") {
            let list: Vec<&str> = present.iter().map(|(c, ..)| *c).collect();
            let mut q = db
                .conn
                .prepare(&format!("SELECT ts_ns, {} FROM system_samples WHERE session_id = ?1", list.join(", ")))?;
            let mut rows = q.query([session])?;
            while let Some(r) = rows.next()? {
                let ts: i64 = r.get(0)?;
                for (i, (_, name, unit)) in present.iter().enumerate() {
                    if let Some(v) = r.get::<_, Option<f64>>(1 + i)? {
                        counter(w, name, unit, ts, v)?;
                    }
                }
            }
        }
    }
    Ok(n)
}

/// Writes `table` (a table or view) as CSV: a header, then the session's rows
/// (all rows if it has no session column). Returns the number of rows.
pub fn export_csv(db: &ProfileDb, session: i64, table: &str, out: impl Write) -> anyhow::Result<u64> {
    if !db.has_table(table) {
        bail!(
            "{} has no table or view '{table}'; it has: {}",
            db.path.display(),
            db.tables().collect::<Vec<_>>().join(", ")
        );
    }
    let cols = db.columns(table)?;
    // The name is one of the file's own tables (checked above); quoting keeps
    // odd names intact.
    let quoted = format!("\"{}\"", table.replace('"', "\"\""));
    let filter = if table == "sessions" {
        "WHERE id = ?1"
    } else if cols.iter().any(|c| c == "session_id") {
        "WHERE session_id = ?1"
    } else {
        // Not per session (apis): every row. The clause keeps ?1 bound either way.
        "WHERE ?1 IS NOT NULL"
    };
    let mut q = db.conn.prepare(&format!("SELECT * FROM {quoted} {filter}"))?;
    let header: Vec<String> = q.column_names().iter().map(|s| s.to_string()).collect();
    let mut w = csv::Writer::from_writer(out);
    w.write_record(&header)?;
    let mut rows = q.query([session])?;
    let mut fields: Vec<String> = vec![String::new(); header.len()];
    let mut n = 0;
    while let Some(r) = rows.next()? {
        for (i, f) in fields.iter_mut().enumerate() {
            f.clear();
            match r.get_ref(i)? {
                ValueRef::Null => {}
                ValueRef::Integer(v) => f.push_str(&v.to_string()),
                ValueRef::Real(v) => f.push_str(&v.to_string()),
                ValueRef::Text(t) => f.push_str(&String::from_utf8_lossy(t)),
                ValueRef::Blob(b) => {
                    for byte in b {
                        f.push_str(&format!("{byte:02x}"));
                    }
                }
            }
        }
        w.write_record(&fields)?;
        n += 1;
    }
    w.flush()?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_values_name_their_unit() {
        let json = serde_json::to_string(&CounterValue { unit: "W", value: 1.5 }).expect("serialises");
        assert_eq!(json, r#"{"W":1.5}"#);
    }

    #[test]
    fn events_are_one_per_line_inside_trace_events() {
        let mut buf = Vec::new();
        let mut w = TraceWriter::new(&mut buf).expect("writer");
        for i in 0..3 {
            w.event(&Event {
                name: "n",
                ph: "i",
                cat: None,
                ts: f64::from(i),
                dur: None,
                pid: 1,
                tid: 2,
                s: Some("t"),
                args: NameArgs { name: "x" },
            })
            .expect("event");
        }
        w.finish(&OtherData { profiler_session: 1, command: "c", started_unix_s: 0.0, timestamps: "µs" })
            .expect("finish");
        let v: serde_json::Value = serde_json::from_slice(&buf).expect("valid JSON");
        assert_eq!(v["traceEvents"].as_array().map(Vec::len), Some(3));
        assert_eq!(String::from_utf8_lossy(&buf).lines().filter(|l| l.contains("\"ph\":\"i\"")).count(), 3);
    }
}
