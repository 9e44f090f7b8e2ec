//! `profiler export`: a session as a Chrome trace-event JSON file that
//! ui.perfetto.dev and chrome://tracing open, any table or view of it as CSV,
//! or its CPU samples as folded stacks (`collapsed`) or a pprof profile (`pprof`).
//!
//! Both stream: rows go from an SQLite cursor through a buffered writer one at
//! a time, in the order SQLite stores them (no ORDER BY over launches, which
//! would sort millions of rows), so an export of any size runs in a few MiB.
//! Trace viewers sort events themselves.
use std::{
    collections::{HashMap, HashSet},
    fs::File,
    io::{BufWriter, Write},
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use rusqlite::types::ValueRef;
use serde::{Serialize, Serializer, ser::SerializeMap};

use super::output::reader_went_away;
use crate::profile::{
    ProfileDb,
    jobs::resolve_job,
    kernels::{kernel_display, kernel_names},
    series::rapl_power,
};

mod collapsed;
mod job;
mod pprof;
mod sched;

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// The profile to read.
    db: PathBuf,
    /// `perfetto`: Chrome trace-event JSON; `csv`: one table (--table);
    /// `collapsed`: the CPU samples as folded stacks (`root;…;leaf count`);
    /// `pprof`: the CPU samples as a gzip'd profile.proto.
    #[arg(long, value_enum, default_value_t = ExportFormat::Perfetto)]
    format: ExportFormat,
    /// File to write (default, or `-`: standard output).
    #[arg(short, long, value_name = "PATH")]
    output: Option<PathBuf>,
    /// Session id (default: of the newest job's processes, the one with the most steps).
    #[arg(long, value_name = "N")]
    session: Option<i64>,
    /// Table or view to export with --format csv (rows of the session only,
    /// where it has a session_id column).
    #[arg(long, value_name = "T")]
    table: Option<String>,
    /// Every process of a job (default: the latest session's job) in one
    /// Perfetto trace, each on its own process track named by its rank.
    #[arg(long, value_name = "JOB", num_args = 0..=1, default_missing_value = "", conflicts_with_all = ["session", "table"])]
    job: Option<String>,
    /// With --format collapsed or pprof: only the samples in steps with this label.
    #[arg(long, value_name = "L")]
    label: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ExportFormat {
    Perfetto,
    Csv,
    Collapsed,
    Pprof,
}

pub async fn main(args: ExportArgs) -> anyhow::Result<ExitCode> {
    let db = ProfileDb::open(&args.db)?;
    let session = db.session(args.session)?;
    let job = args.job.as_deref().map(|j| resolve_job(&db, j)).transpose()?;
    let table = match (args.format, &args.table) {
        (ExportFormat::Csv, None) => {
            bail!("--format csv needs --table T (one of: {})", db.tables().collect::<Vec<_>>().join(", "))
        }
        (ExportFormat::Perfetto | ExportFormat::Collapsed | ExportFormat::Pprof, Some(_)) => {
            bail!("--table is for --format csv; the Perfetto, collapsed and pprof exports hold the whole session")
        }
        (_, t) => t.clone(),
    };
    let samples = matches!(args.format, ExportFormat::Collapsed | ExportFormat::Pprof);
    if samples && job.is_some() {
        bail!("--format collapsed and pprof are one session's samples: name it with --session N instead of --job");
    }
    if args.label.is_some() && !samples {
        bail!("--label is for --format collapsed or pprof");
    }
    let to_file = args.output.as_deref().filter(|p| *p != Path::new("-"));
    let sink: Box<dyn Write> = match to_file {
        Some(p) => {
            let created = !p.exists();
            let file = File::create(p).with_context(|| format!("cannot create {}", p.display()))?;
            if created {
                crate::ownership::give_to_invoking_user(&[p]);
            }
            Box::new(file)
        }
        None => Box::new(std::io::stdout().lock()),
    };
    let mut out = BufWriter::with_capacity(1 << 16, sink);
    let hint = match (args.format, &table) {
        (ExportFormat::Perfetto, None) => "; open it in https://ui.perfetto.dev",
        (ExportFormat::Collapsed, _) => "; flamegraph.pl, inferno-flamegraph and speedscope read it",
        (ExportFormat::Pprof, _) => "; go tool pprof, speedscope and Grafana Pyroscope read it",
        _ => "",
    };
    let written = match table {
        None if args.format == ExportFormat::Collapsed => {
            collapsed::write_collapsed(&db, session, args.label.as_deref(), &mut out).and_then(|(lines, samples)| {
                out.flush()?;
                Ok(format!("{lines} stacks of {samples} CPU samples (session {session})"))
            })
        }
        None if args.format == ExportFormat::Pprof => pprof::write_pprof(&db, session, args.label.as_deref(), &mut out)
            .and_then(|(lines, samples)| {
                out.flush()?;
                Ok(format!("{lines} stacks of {samples} CPU samples (session {session}), gzip'd profile.proto"))
            }),
        Some(t) => export_csv(&db, session, &t, &mut out).and_then(|rows| {
            out.flush()?;
            Ok(format!("{rows} rows of {t} (session {session})"))
        }),
        None => {
            let (counts, what) = match &job {
                Some(j) => (job::export_job_perfetto(&db, j, &mut out), format!("job {j}")),
                None => (export_perfetto(&db, session, &mut out), format!("session {session}")),
            };
            counts.and_then(|c| {
                out.flush()?;
                Ok(format!(
                    "{} events ({} steps, {} regions, {} launches, {} syncs, {} NCCL calls, {} scheduler slices, \
                 {} counter values) of {what}",
                    c.total, c.steps, c.regions, c.launches, c.syncs, c.collectives, c.sched, c.counters
                ))
            })
        }
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
    pub regions: u64,
    pub collectives: u64,
    /// Scheduler-state slices.
    pub sched: u64,
}

impl std::ops::AddAssign for EventCounts {
    fn add_assign(&mut self, c: Self) {
        self.total += c.total;
        self.steps += c.steps;
        self.launches += c.launches;
        self.syncs += c.syncs;
        self.counters += c.counters;
        self.regions += c.regions;
        self.collectives += c.collectives;
        self.sched += c.sched;
    }
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

/// Where a session's events go: the target's process, timed in µs since the
/// session started.
#[derive(Clone, Copy)]
struct Timeline {
    pid: i64,
    started_ns: i64,
}

impl Timeline {
    /// A profile's timestamp (ns) as trace time.
    fn us(self, ns: i64) -> f64 {
        (ns - self.started_ns) as f64 / 1e3
    }

    /// Metadata: the name of the process (`tid` = pid) or of a thread.
    fn meta<'a>(self, what: &'a str, tid: i64, name: &'a str) -> Event<'a, NameArgs<'a>> {
        Event {
            name: what,
            ph: "M",
            cat: None,
            ts: 0.0,
            dur: None,
            pid: self.pid,
            tid,
            s: None,
            args: NameArgs { name },
        }
    }

    /// A slice on thread `tid`'s track. One still running at the end has a
    /// beginning and no end: a "B" without its "E", which viewers show as not
    /// ended.
    fn span<'a, A: Serialize>(
        self,
        name: &'a str,
        cat: &'static str,
        tid: i64,
        start_ns: i64,
        end_ns: Option<i64>,
        args: A,
    ) -> Event<'a, A> {
        Event {
            name,
            ph: if end_ns.is_some() { "X" } else { "B" },
            cat: Some(cat),
            ts: self.us(start_ns),
            dur: end_ns.map(|e| (e - start_ns) as f64 / 1e3),
            pid: self.pid,
            tid,
            s: None,
            args,
        }
    }

    /// An instant on thread `tid`'s track.
    fn instant<'a, A: Serialize>(
        self,
        name: &'a str,
        cat: &'static str,
        tid: i64,
        ts_ns: i64,
        args: A,
    ) -> Event<'a, A> {
        Event { name, ph: "i", cat: Some(cat), ts: self.us(ts_ns), dur: None, pid: self.pid, tid, s: Some("t"), args }
    }

    /// Metadata: where track `track` of thread `tid` goes among the
    /// process's tracks (each thread's own, then its others, in tid order).
    fn sort_index(self, track: i64, tid: i64, after: SortAfter) -> Event<'static, SortIndex> {
        Event {
            name: "thread_sort_index",
            ph: "M",
            cat: None,
            ts: 0.0,
            dur: None,
            pid: self.pid,
            tid: track,
            s: None,
            args: SortIndex { sort_index: 4 * tid + after as i64 },
        }
    }

    /// One value of the counter track `name`.
    fn counter<'a>(self, name: &'a str, unit: &'a str, ts_ns: i64, value: f64) -> Event<'a, CounterValue<'a>> {
        Event {
            name,
            ph: "C",
            cat: None,
            ts: self.us(ts_ns),
            dur: None,
            pid: self.pid,
            tid: self.pid,
            s: None,
            args: CounterValue { unit, value },
        }
    }
}

#[derive(Serialize)]
struct NameArgs<'a> {
    name: &'a str,
}

#[derive(Serialize)]
struct SortIndex {
    sort_index: i64,
}

/// A thread's tracks, in the order they are shown.
#[derive(Clone, Copy)]
enum SortAfter {
    /// Its steps, regions, syncs, launches.
    Thread = 0,
    /// Regions crossing its steps' boundaries.
    Crossing = 1,
    /// Its scheduler states.
    Scheduler = 2,
}

#[derive(Serialize)]
struct StepArgs<'a> {
    label: &'a str,
    step: i64,
    launches: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sync_wait_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data_wait_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    optimizer_ms: Option<f64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    unfinished: bool,
}

#[derive(Serialize)]
struct RegionArgs<'a> {
    /// The step its thread was in when it began.
    label: Option<&'a str>,
    step: Option<i64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    truncated: bool,
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
/// slices on their thread's track, launches as instants, syncs and NCCL calls
/// as slices, each thread's scheduler states on a track beside it, and counter
/// tracks for each GPU and for CPU/DRAM power.
/// Timestamps are µs since the session started.
pub fn export_perfetto(db: &ProfileDb, session: i64, out: impl Write) -> anyhow::Result<EventCounts> {
    let s = TracedProcess::read(db, session)?;
    let mut w = TraceWriter::new(out)?;
    let mut counts = write_session(db, &s, Timeline { pid: s.pid, started_ns: s.started_ns }, &mut w)?;
    counts.total = w.events;
    let mut out = w.finish(&OtherData {
        profiler_session: session,
        command: &s.command,
        started_unix_s: (s.started_ns + s.unix_offset_ns) as f64 / 1e9,
        timestamps: "µs since the session started",
    })?;
    out.flush()?;
    Ok(counts)
}

/// What a session's process tracks are named after.
struct TracedProcess {
    session: i64,
    pid: i64,
    command: String,
    exe: Option<String>,
    started_ns: i64,
    unix_offset_ns: i64,
    /// `RANK` of a process of a multi-process job.
    rank: Option<i64>,
    /// Its machine, named on its track when a job spans several (a merged profile).
    host: Option<String>,
}

impl TracedProcess {
    fn read(db: &ProfileDb, session: i64) -> rusqlite::Result<Self> {
        db.conn.query_row(
            "SELECT pid, command, exe, started_ns, unix_offset_ns, rank, hostname FROM sessions WHERE id = ?1",
            [session],
            |r| {
                Ok(Self {
                    session,
                    pid: r.get(0)?,
                    command: r.get(1)?,
                    exe: r.get(2)?,
                    started_ns: r.get(3)?,
                    unix_offset_ns: r.get(4)?,
                    rank: r.get(5)?,
                    host: None,
                })
            },
        )
    }
}

/// One session's events on its process's tracks (named by its rank, when it
/// has one), timed by `t`.
fn write_session<W: Write>(
    db: &ProfileDb,
    s: &TracedProcess,
    t: Timeline,
    w: &mut TraceWriter<W>,
) -> anyhow::Result<EventCounts> {
    let (session, pid) = (s.session, s.pid);
    let mut counts = EventCounts::default();
    // Track names.
    let program = program_name(s.exe.as_deref(), &s.command);
    let mut process = match s.rank {
        Some(rank) => format!("rank {rank}: {program} (pid {pid})"),
        None => format!("{program} (pid {pid})"),
    };
    if let Some(host) = &s.host {
        process = format!("{host} {process}");
    }
    w.event(&t.meta("process_name", pid, &process))?;
    let tid_sql = "SELECT tid FROM steps WHERE session_id = ?1 UNION SELECT tid FROM launches WHERE session_id = ?1
                   UNION SELECT tid FROM syncs WHERE session_id = ?1 UNION SELECT tid FROM regions WHERE session_id = ?1
                   UNION SELECT tid FROM collectives WHERE session_id = ?1";
    {
        let mut q = db.conn.prepare(tid_sql)?;
        let mut rows = q.query([session])?;
        while let Some(r) = rows.next()? {
            let tid: i64 = r.get(0)?;
            let name = if tid == pid { format!("main thread {tid}") } else { format!("thread {tid}") };
            w.event(&t.meta("thread_name", tid, &name))?;
            w.event(&t.sort_index(tid, tid, SortAfter::Thread))?;
        }
    }

    let steps = write_steps(db, session, t, w)?;
    counts.steps = steps.values().map(|v| v.len() as u64).sum();
    counts.regions = write_regions(db, session, t, &steps, w)?;

    // Host sync waits and NCCL calls: inside the step that made them, on the
    // same thread. Each is stored once it returned, so each has an end.
    counts.syncs = write_syncs(db, session, t, w)?;
    counts.collectives = job::write_collectives(db, session, t, w)?;

    counts.launches = write_launches(db, session, t, w)?;
    counts.sched = sched::write_sched_slices(db, session, t, w)?;
    counts.counters = write_counters(db, session, t, w)?;
    Ok(counts)
}

/// The target's program for its track name: the executable's file name, else
/// the command's first word's.
fn program_name(exe: Option<&str>, command: &str) -> String {
    exe.or_else(|| command.split_whitespace().next())
        .and_then(|p| Path::new(p).file_name())
        .map_or_else(|| "target".to_string(), |n| n.to_string_lossy().into_owned())
}

/// Each thread's steps, (start, end) in start order (`i64::MAX`: not ended).
type StepSpans = HashMap<i64, Vec<(i64, i64)>>;

/// Steps as slices. One thread runs one step at a time (a step is the
/// outermost call), so a thread's step slices never overlap.
fn write_steps<W: Write>(
    db: &ProfileDb,
    session: i64,
    t: Timeline,
    w: &mut TraceWriter<W>,
) -> anyhow::Result<StepSpans> {
    let mut q = db.conn.prepare(
        "SELECT label, step, tid, start_ns, end_ns, launches, sync_wait_ns, data_wait_ns, optimizer_ns
         FROM steps WHERE session_id = ?1 ORDER BY tid, start_ns",
    )?;
    let mut rows = q.query([session])?;
    let mut spans = StepSpans::new();
    let ms = |v: Option<i64>| v.map(|n| n as f64 / 1e6);
    while let Some(r) = rows.next()? {
        let label: String = r.get(0)?;
        let step: i64 = r.get(1)?;
        let (tid, start, end): (i64, i64, Option<i64>) = (r.get(2)?, r.get(3)?, r.get(4)?);
        let args = StepArgs {
            label: &label,
            step,
            launches: r.get(5)?,
            sync_wait_ms: ms(r.get(6)?),
            data_wait_ms: ms(r.get(7)?),
            optimizer_ms: ms(r.get(8)?),
            unfinished: end.is_none(),
        };
        w.event(&t.span(&format!("{label} #{step}"), "step", tid, start, end, args))?;
        spans.entry(tid).or_default().push((start, end.unwrap_or(i64::MAX)));
    }
    Ok(spans)
}

/// Added to a thread id for the track of its regions that cross one of its
/// steps' boundaries (above Linux's largest pid, 2^22).
const CROSSING_TRACK: i64 = 1 << 30;

/// PyTorch `record_function` regions as slices on their thread's track,
/// where they nest with each other (a thread's regions open and close in
/// order) and with the thread's steps. A region that crosses a step's start
/// or end (a user region around the forward, backward and optimizer step but
/// not the batch fetch) would break the track's nesting: it goes to a track
/// of its own next to the thread's.
fn write_regions<W: Write>(
    db: &ProfileDb,
    session: i64,
    t: Timeline,
    steps: &StepSpans,
    w: &mut TraceWriter<W>,
) -> anyhow::Result<u64> {
    let mut q = db.conn.prepare(
        "SELECT name, tid, start_ns, end_ns, label, step, truncated FROM regions WHERE session_id = ?1
         ORDER BY tid, start_ns",
    )?;
    let mut rows = q.query([session])?;
    let (mut n, mut crossing_tracks) = (0, HashSet::new());
    while let Some(r) = rows.next()? {
        let name: String = r.get(0)?;
        let (tid, start, end): (i64, i64, Option<i64>) = (r.get(1)?, r.get(2)?, r.get(3)?);
        let on_thread = steps.get(&tid).is_none_or(|s| !crosses_a_step(s, start, end.unwrap_or(i64::MAX)));
        let track = if on_thread { tid } else { tid + CROSSING_TRACK };
        if !on_thread && crossing_tracks.insert(tid) {
            w.event(&t.meta("thread_name", track, &format!("thread {tid}: regions crossing its steps")))?;
            w.event(&t.sort_index(track, tid, SortAfter::Crossing))?;
        }
        let label: Option<String> = r.get(4)?;
        let args =
            RegionArgs { label: label.as_deref(), step: r.get(5)?, truncated: r.get(6)?, unfinished: end.is_none() };
        w.event(&t.span(&name, "region", track, start, end, args))?;
        n += 1;
    }
    Ok(n)
}

/// Whether [start, end] overlaps one of `steps` (sorted, disjoint) without
/// containing it or lying inside it.
fn crosses_a_step(steps: &[(i64, i64)], start: i64, end: i64) -> bool {
    // Only steps that begin before the region ends can overlap it.
    let upto = steps.partition_point(|&(s, _)| s < end);
    steps[..upto].iter().rev().take_while(|&&(_, e)| e > start).any(|&(s, e)| {
        let overlaps = s < end && start < e;
        let nested = (start <= s && e <= end) || (s <= start && end <= e);
        overlaps && !nested
    })
}

/// Host sync waits as slices.
fn write_syncs<W: Write>(db: &ProfileDb, session: i64, t: Timeline, w: &mut TraceWriter<W>) -> anyhow::Result<u64> {
    let mut q = db.conn.prepare("SELECT api, tid, start_ns, end_ns, step FROM syncs WHERE session_id = ?1")?;
    let mut rows = q.query([session])?;
    let mut n = 0;
    while let Some(r) = rows.next()? {
        let api: String = r.get(0)?;
        let args = SyncArgs { step: r.get(4)? };
        w.event(&t.span(&api, "sync", r.get(1)?, r.get(2)?, Some(r.get(3)?), args))?;
        n += 1;
    }
    Ok(n)
}

/// Launch instants, named by kernel where the profile knows the name.
fn write_launches<W: Write>(db: &ProfileDb, session: i64, t: Timeline, w: &mut TraceWriter<W>) -> anyhow::Result<u64> {
    let (names, kernels) = kernel_names(db, session, "l.function", "l.ts_ns")?;
    let sql = format!(
        "SELECT l.ts_ns, l.tid, l.function, a.name, {names}, l.grid_x, l.grid_y, l.grid_z,
                l.block_x, l.block_y, l.block_z, l.shared_mem_bytes, l.stream, l.label, l.step
         FROM launches l LEFT JOIN apis a ON a.id = l.api {kernels} WHERE l.session_id = ?1"
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
        let args = LaunchArgs {
            api: api.as_deref(),
            function: format!("{function:#x}"),
            grid: [r.get(6)?, r.get(7)?, r.get(8)?],
            block: [r.get(9)?, r.get(10)?, r.get(11)?],
            shared_mem_bytes: r.get(12)?,
            stream: format!("{:#x}", r.get::<_, i64>(13)?),
            label: label.as_deref(),
            step: r.get(15)?,
        };
        w.event(&t.instant(&name, "launch", r.get(1)?, r.get(0)?, args))?;
        n += 1;
    }
    Ok(n)
}

/// GPU samples, RAPL power and system usage as counter tracks; a reading
/// the profile does not have is left out, never drawn as zero.
fn write_counters<W: Write>(db: &ProfileDb, session: i64, t: Timeline, w: &mut TraceWriter<W>) -> anyhow::Result<u64> {
    let before = w.events;
    sample_counters(
        db,
        session,
        t,
        w,
        "gpu_samples",
        Some("gpu"),
        &[
            ("utilization_gpu_pct", "utilization", "%"),
            ("power_w", "power", "W"),
            ("memory_used_mib", "memory used", "MiB"),
            ("temperature_gpu_c", "temperature", "°C"),
        ],
    )?;

    // RAPL counters are cumulative joules per domain: the power over each
    // interval is drawn from the interval's start.
    rapl_power(db, session, |p| {
        let name = match p.domain {
            "package" => "CPU package power".to_string(),
            "dram" => "DRAM power".to_string(),
            other => format!("RAPL {other} power"),
        };
        w.event(&t.counter(&name, "W", p.start_ns, p.watts))
    })?;

    sample_counters(
        db,
        session,
        t,
        w,
        "system_samples",
        None,
        &[
            ("cpu_usage_pct", "system CPU", "%"),
            ("process_cpu_pct", "target CPU", "%"),
            ("ram_used_gb", "RAM used", "GB"),
            ("process_rss_gb", "target RSS", "GB"),
        ],
    )?;
    Ok(w.events - before)
}

/// Counter tracks from a table of samples (`ts_ns` and one column per
/// reading): for each (column, track name, unit) of `series`, one value per
/// sample that has it. With `gpu`, the column telling the
/// GPU, tracks are per GPU: "GPU <n> <track name>".
fn sample_counters<W: Write>(
    db: &ProfileDb,
    session: i64,
    t: Timeline,
    w: &mut TraceWriter<W>,
    table: &str,
    gpu: Option<&str>,
    series: &[(&str, &str, &str)],
) -> anyhow::Result<()> {
    let list: Vec<&str> = series.iter().map(|(c, ..)| *c).collect();
    let mut q = db.conn.prepare(&format!(
        "SELECT {}, ts_ns, {} FROM {table} WHERE session_id = ?1",
        gpu.unwrap_or("NULL"),
        list.join(", ")
    ))?;
    let mut rows = q.query([session])?;
    // Track names, per GPU (one entry, for no GPU, otherwise).
    let mut names: Vec<(Option<i64>, Vec<String>)> = Vec::new();
    while let Some(r) = rows.next()? {
        let g: Option<i64> = r.get(0)?;
        let ts: i64 = r.get(1)?;
        let idx = match names.iter().position(|(x, _)| *x == g) {
            Some(i) => i,
            None => {
                let track = |what: &str| g.map_or_else(|| what.to_string(), |g| format!("GPU {g} {what}"));
                names.push((g, series.iter().map(|(_, what, _)| track(what)).collect()));
                names.len() - 1
            }
        };
        for (i, (_, _, unit)) in series.iter().enumerate() {
            if let Some(v) = r.get::<_, Option<f64>>(2 + i)? {
                w.event(&t.counter(&names[idx].1[i], unit, ts, v))?;
            }
        }
    }
    Ok(())
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
    let cols = db.columns(table);
    // The name is one of the file's own tables (checked above); quoting keeps
    // odd names intact.
    let quoted = crate::store::quoted(table);
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
    fn regions_that_cross_a_step_boundary_are_told_apart() {
        let steps = [(10, 20), (30, 40), (50, i64::MAX)];
        // Inside a step, around one, between two, around several: nested.
        for (s, e) in [(12, 18), (10, 20), (5, 25), (21, 29), (0, 45), (55, 60), (45, i64::MAX)] {
            assert!(!crosses_a_step(&steps, s, e), "{s}..{e}");
        }
        // Over a step's start or end.
        for (s, e) in [(5, 15), (15, 25), (35, 45), (25, 35), (45, 55)] {
            assert!(crosses_a_step(&steps, s, e), "{s}..{e}");
        }
    }

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
