//! The profile's size budget, kept by the writer: `--max-size` and the disk
//! headroom floor (`--min-free`) stop per-call rows first and every row last,
//! and `--launches auto` stops launch rows when their rate would spend the
//! budget within the session's expected length. Every message passes one gate
//! ([`Budget::admit`]); what a message is for the budget is [`RowKind::of`].
//!
//! Per-call rows (launches, GEMMs, syncs, regions, collectives, copies, jitted
//! calls, off-CPU times) grow with the target's call rate, the rest (steps, samples, kernel names) with time: once a
//! limit is near, new per-call rows are dropped and those written are kept. Keeping the
//! newest would mean deleting old rows, which frees pages inside the file but not
//! on the disk, and rewrites the indexes while the job runs; the first hours of a
//! run (warm-up, the first epochs) are what per-call rows are read for.
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU8, Ordering},
    },
    time::{Duration, Instant},
};

use super::StoreMsg;

/// `--launches auto` without `--duration`: the session is assumed to last a day.
pub const AUTO_EXPECTED: Duration = Duration::from_secs(24 * 3600);

/// Bytes on disk per row, by table, measured on this schema (`cargo xtask soak`
/// prints the real figure): what a message is estimated to add until the file is
/// measured again, after its batch.
const LAUNCH_ROW_BYTES: u64 = 64;
/// `launches_by_step`, built at the end, per launch row: reserved while rows are stored.
const LAUNCH_INDEX_BYTES: u64 = 24;
/// How often `--launches auto` looks at the launch rate.
const AUTO_WINDOW: Duration = Duration::from_secs(5);
/// Free space below half the floor stops every row only when it stays there this long:
/// a checkpoint written beside the old one dips the free space for a moment.
const HARD_FLOOR_HOLD: Duration = Duration::from_secs(2);

/// The free space the profile leaves on its filesystem: a share of it, a
/// size, or the smaller of both.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MinFree {
    pub share: Option<f64>,
    pub bytes: Option<u64>,
}

impl MinFree {
    /// `--min-free`: `10%`, a size (`2G`), or both (`10%,5G`: the smaller).
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut m = MinFree { share: None, bytes: None };
        for part in s.split(',') {
            if let Some(p) = part.trim().strip_suffix('%') {
                match p.trim().parse::<f64>() {
                    Ok(v) if (0.0..100.0).contains(&v) && m.share.is_none() => m.share = Some(v / 100.0),
                    _ => return Err(format!("'{s}': give one share between 0% and 100% (e.g. 10%), a size, or both")),
                }
            } else if m.bytes.is_none() {
                m.bytes = Some(parse_size(part)?);
            } else {
                return Err(format!("'{s}': give one size (e.g. 5G), a share, or both (10%,5G)"));
            }
        }
        Ok(m)
    }

    /// The floor in bytes on a filesystem of `fs_bytes`.
    pub fn floor(self, fs_bytes: u64) -> u64 {
        let share = self.share.map(|f| (fs_bytes as f64 * f) as u64);
        share.unwrap_or(u64::MAX).min(self.bytes.unwrap_or(u64::MAX)).min(fs_bytes)
    }
}

/// A size: bytes, or with a binary unit (`64M`, `4G`, `512KiB`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().trim_end_matches("ib").trim_end_matches('b') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => return Err(format!("'{s}' is not a size: use bytes or K, M, G, T (e.g. 4G, 64M)")),
    };
    match num.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v * ((1u64 << shift) as f64) < u64::MAX as f64 => {
            Ok((v * (1u64 << shift) as f64) as u64)
        }
        _ => Err(format!("'{s}' is not a positive size (e.g. 4G, 64M)")),
    }
}

/// What the writer keeps to.
#[derive(Clone, Debug)]
pub struct BudgetConfig {
    /// The profile (database, `-wal`, the index built at the end), bytes.
    pub max_size: u64,
    pub min_free: MinFree,
    /// `--launches auto`: the session's expected length (`--duration`, else [`AUTO_EXPECTED`]).
    pub auto_launches: Option<Duration>,
}

impl BudgetConfig {
    /// No limit: for tests that write a profile of known size.
    #[cfg(test)]
    pub fn unlimited() -> Self {
        Self { max_size: u64::MAX, min_free: MinFree { share: None, bytes: Some(0) }, auto_launches: None }
    }

    /// Per-call rows stop here; the last eighth of `max_size` is for steps and
    /// samples (of 4 GiB, 512 MiB: hours of steps and of 8 GPUs' samples).
    fn per_call_limit(&self) -> u64 {
        self.max_size - self.max_size / 8
    }
}

/// A per-call row kind: the rows the budget stops first. A new per-call table
/// is one variant here and one arm in [`RowKind::of`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PerCall {
    Launches,
    Gemms,
    Syncs,
    Regions,
    Collectives,
    Copies,
    JitCalls,
    OffCpu,
    CpuSamples,
}

impl PerCall {
    /// Estimated bytes on disk per row.
    fn row_bytes(self) -> u64 {
        match self {
            // Its index, built at the end, is reserved apart (`Budget::size_now`).
            Self::Launches => LAUNCH_ROW_BYTES,
            Self::Gemms => 96,
            Self::Syncs => 56,
            Self::Regions | Self::Collectives | Self::Copies | Self::JitCalls => 80,
            Self::OffCpu => 56,
            // Five integers and a short text, without an index.
            Self::CpuSamples => 48,
        }
    }

    /// Stopped by `--launches auto` too (the rows `--launches count` never keeps).
    fn per_launch(self) -> bool {
        matches!(self, Self::Launches | Self::Gemms)
    }
}

/// What a message is to the budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowKind {
    /// `rows` per-call rows.
    PerCall(PerCall, u64),
    /// Rows that grow with time (steps, samples, names): `bytes` estimated.
    Timed(u64),
    /// Session rows, capabilities, the end: always written.
    Control,
}

impl RowKind {
    pub fn of(msg: &StoreMsg) -> Self {
        let n = |len: usize| len as u64;
        match msg {
            StoreMsg::Launches(r) => Self::PerCall(PerCall::Launches, n(r.len())),
            StoreMsg::Gemms(r) => Self::PerCall(PerCall::Gemms, n(r.len())),
            StoreMsg::Syncs(r) => Self::PerCall(PerCall::Syncs, n(r.len())),
            StoreMsg::Regions(r) => Self::PerCall(PerCall::Regions, n(r.len())),
            StoreMsg::Collectives(r) => Self::PerCall(PerCall::Collectives, n(r.len())),
            StoreMsg::Copies(r) => Self::PerCall(PerCall::Copies, n(r.len())),
            StoreMsg::JitCalls(r) => Self::PerCall(PerCall::JitCalls, n(r.len())),
            StoreMsg::OffCpu(r) => Self::PerCall(PerCall::OffCpu, n(r.len())),
            StoreMsg::CpuSamples(r) => Self::PerCall(PerCall::CpuSamples, n(r.len())),
            StoreMsg::CpuStacks(f, s) => Self::Timed(
                f.iter().map(|f| 48 + n(f.function.len())).sum::<u64>()
                    + s.iter().map(|s| 24 * n(s.frames.len())).sum::<u64>(),
            ),
            StoreMsg::Steps(r) => Self::Timed(n(r.len()) * 128),
            StoreMsg::StepGemms(r) | StoreMsg::StepGemmsSoFar(r) => Self::Timed(n(r.len()) * 64),
            StoreMsg::Kernels(r) => Self::Timed(r.iter().map(|k| 64 + 2 * n(k.name.len())).sum()),
            StoreMsg::Gpus(r) => Self::Timed(n(r.len()) * 256),
            StoreMsg::GpuSamples(r) => Self::Timed(n(r.len()) * 192),
            StoreMsg::RaplSamples(r) => Self::Timed(n(r.len()) * 48),
            StoreMsg::SystemSamples(r) => Self::Timed(n(r.len()) * 96),
            StoreMsg::ProbedFile(f) => Self::Timed(256 + 96 * n(f.placed.len())),
            StoreMsg::GpusUsedByTarget(_) | StoreMsg::Capability(_) | StoreMsg::Process(_) => Self::Control,
            StoreMsg::Finish(..) | StoreMsg::EndProcess(..) => Self::Control,
            StoreMsg::ForProcess(_, inner) => Self::of(inner),
        }
    }

    /// Estimated bytes on disk.
    pub fn bytes(self) -> u64 {
        match self {
            Self::PerCall(k, rows) => k.row_bytes() * rows,
            Self::Timed(b) => b,
            Self::Control => 0,
        }
    }
}

/// How far the budget has stopped rows; shared with the session, which ends
/// when every row has stopped ([`BudgetState::all_stopped`]).
#[derive(Debug, Default)]
pub struct BudgetState(AtomicU8);

const LAUNCH_ROWS_STOPPED: u8 = 1;
const PER_CALL_STOPPED: u8 = 2;
const ALL_STOPPED: u8 = 4;

impl BudgetState {
    fn set(&self, bit: u8) {
        self.0.fetch_or(bit, Ordering::Relaxed);
    }

    fn has(&self, bit: u8) -> bool {
        self.0.load(Ordering::Relaxed) & bit != 0
    }

    /// Nothing more can be stored: the session should end.
    pub fn all_stopped(&self) -> bool {
        self.has(ALL_STOPPED)
    }
}

/// A change the session records: its `sessions` column and capability.
#[derive(Clone, Debug, PartialEq)]
pub struct BudgetEvent {
    pub at_ns: u64,
    pub what: Stopped,
    /// One line: the limit reached and the sizes then.
    pub reason: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stopped {
    /// `--launches auto`: launch and GEMM rows.
    Launches,
    PerCall,
    Everything,
}

impl Stopped {
    pub fn column(self) -> &'static str {
        match self {
            Self::Launches => "launch_rows_stopped_ns",
            Self::PerCall => "per_call_rows_stopped_ns",
            Self::Everything => "all_rows_stopped_ns",
        }
    }

    /// The `capabilities` metric (source `store`).
    pub fn metric(self) -> &'static str {
        match self {
            Self::Launches => "launch_rows",
            Self::PerCall => "per_call_rows",
            Self::Everything => "all_rows",
        }
    }
}

/// The profile's size and its filesystem's free space, as last measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Measured {
    /// The database file, bytes.
    pub db: u64,
    /// The `-wal` alone: its pages may all become new pages of the database
    /// at the next checkpoint, so they count against the free space twice.
    pub wal: u64,
    /// Free to unprivileged users (`f_bavail`: what the job can write; root's
    /// reserved blocks are not the job's).
    pub free: u64,
    pub fs_size: u64,
}

/// Measures the profile at `path` (None when its filesystem cannot be read).
pub fn measure(path: &Path) -> Option<Measured> {
    let len = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let wal = len(&super::side_file(path, "-wal"));
    let db = len(path);
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let vfs = rustix::fs::statvfs(dir).ok()?;
    Some(Measured { db, wal, free: vfs.f_bavail * vfs.f_frsize, fs_size: vfs.f_blocks * vfs.f_frsize })
}

/// `--launches auto`'s rate window.
struct AutoLaunches {
    expected: Duration,
    window_start: Instant,
    rows: u64,
}

/// The writer's gate (see the module docs).
pub struct Budget {
    cfg: BudgetConfig,
    path: PathBuf,
    started: Instant,
    state: Arc<BudgetState>,
    last: Measured,
    /// Estimated bytes admitted since `last`.
    pending: u64,
    /// Launch rows admitted: their index is built at the end.
    launch_rows: u64,
    auto: Option<AutoLaunches>,
    /// Since when free space has been below half the floor.
    below_hard_floor: Option<Instant>,
    /// Per-call rows dropped, by process (None: the first session).
    pub dropped: BTreeMap<Option<u32>, u64>,
    /// Every change so far (recorded again at the end, in case its batch failed).
    pub events: Vec<BudgetEvent>,
    /// Changes not yet written.
    pub fresh: Vec<BudgetEvent>,
}

impl Budget {
    pub fn new(cfg: BudgetConfig, path: &Path, state: Arc<BudgetState>) -> Self {
        let now = Instant::now();
        let auto = cfg.auto_launches.map(|expected| AutoLaunches { expected, window_start: now, rows: 0 });
        let mut b = Self {
            cfg,
            path: path.to_owned(),
            started: now,
            state,
            last: Measured::default(),
            pending: 0,
            launch_rows: 0,
            auto,
            below_hard_floor: None,
            dropped: BTreeMap::new(),
            events: Vec::new(),
            fresh: Vec::new(),
        };
        b.remeasure();
        b
    }

    pub fn config(&self) -> &BudgetConfig {
        &self.cfg
    }

    /// The headroom floor on the profile's filesystem, bytes.
    pub fn floor(&self) -> u64 {
        self.cfg.min_free.floor(self.last.fs_size)
    }

    /// The `-wal` file is checkpointed and truncated past this size: a small
    /// part of the budget, and of the floor (see [`Measured::wal`]).
    pub fn wal_limit(&self) -> u64 {
        let floor = match self.floor() {
            0 => u64::MAX,
            f => f / 4,
        };
        (self.cfg.max_size / 16).min(floor).clamp(1 << 20, 64 << 20)
    }

    /// Free space as the job will see it once the `-wal` is checkpointed and
    /// the launch index built (its pages pass through the `-wal` first: twice).
    fn free_now(&self) -> u64 {
        let index = 2 * self.launch_rows * LAUNCH_INDEX_BYTES;
        self.last.free.saturating_sub(self.last.wal + self.pending + index)
    }

    /// Measures the file and the filesystem again (after each batch).
    pub fn remeasure(&mut self) {
        if let Some(m) = measure(&self.path) {
            self.last = m;
            self.pending = 0;
        }
        if self.cfg.max_size == u64::MAX {
            return;
        }
        let floor = self.floor();
        if self.free_now() < floor / 2 {
            let since = *self.below_hard_floor.get_or_insert_with(Instant::now);
            if since.elapsed() >= HARD_FLOOR_HOLD && !self.state.has(ALL_STOPPED) {
                let why = format!("the disk's free space stayed under {} (half the floor)", mib(floor / 2));
                self.stop(Stopped::Everything, why);
            }
        } else {
            self.below_hard_floor = None;
        }
    }

    /// A batch failed for want of space: nothing more is stored.
    pub fn disk_full(&mut self, error: &str) {
        if !self.state.has(ALL_STOPPED) {
            self.stop(Stopped::Everything, format!("a write failed ({error})"));
        }
    }

    /// Whether `msg` is written; a message dropped is counted.
    pub fn admit(&mut self, msg: &StoreMsg) -> bool {
        let kind = RowKind::of(msg);
        let keep = match kind {
            RowKind::Control => true,
            RowKind::PerCall(k, rows) => self.admit_per_call(k, rows, kind.bytes()),
            RowKind::Timed(bytes) => self.admit_timed(bytes),
        };
        if keep {
            self.pending += kind.bytes();
        } else if let RowKind::PerCall(_, rows) = kind {
            let pid = match msg {
                StoreMsg::ForProcess(pid, _) => Some(*pid),
                _ => None,
            };
            *self.dropped.entry(pid).or_default() += rows;
        }
        keep
    }

    fn admit_per_call(&mut self, kind: PerCall, rows: u64, bytes: u64) -> bool {
        if self.state.has(PER_CALL_STOPPED | ALL_STOPPED) {
            return false;
        }
        if kind.per_launch() && self.state.has(LAUNCH_ROWS_STOPPED) {
            return false;
        }
        let index = if kind == PerCall::Launches { rows * LAUNCH_INDEX_BYTES } else { 0 };
        let size = self.size_now() + bytes + index;
        let free = self.free_now().saturating_sub(bytes + 2 * index);
        let (floor, limit) = (self.floor(), self.cfg.per_call_limit());
        if size > limit || free < floor {
            let why = if size > limit {
                format!("the profile reached {} of --max-size {}", mib(size), mib(self.cfg.max_size))
            } else {
                format!(
                    "the disk had {} free of {}, under the --min-free floor {}",
                    mib(free),
                    mib(self.last.fs_size),
                    mib(floor)
                )
            };
            self.stop(Stopped::PerCall, why);
            return false;
        }
        if kind == PerCall::Launches {
            let keep = self.auto_launches(rows);
            self.launch_rows += if keep { rows } else { 0 };
            return keep;
        }
        true
    }

    fn admit_timed(&mut self, bytes: u64) -> bool {
        if self.state.has(ALL_STOPPED) {
            return false;
        }
        let size = self.size_now() + bytes;
        if size > self.cfg.max_size {
            let why = format!("the profile reached --max-size {}", mib(self.cfg.max_size));
            self.stop(Stopped::Everything, why);
            return false;
        }
        true
    }

    /// The profile's size now: the database as measured, what was admitted
    /// since, the launch index still to be built, and room for the `-wal` at
    /// its largest (its limit and a batch: a constant, where its measured
    /// size would come and go with each checkpoint).
    fn size_now(&self) -> u64 {
        let wal = self.wal_limit() + self.wal_limit() / 4;
        self.last.db + self.pending + self.launch_rows * LAUNCH_INDEX_BYTES + wal
    }

    /// `--launches auto`: counts `rows`; at the end of each window, stops launch
    /// rows if their rate would fill what is left of the budget before the
    /// session's expected end. Returns whether these rows are kept.
    fn auto_launches(&mut self, rows: u64) -> bool {
        let Some(a) = self.auto.as_mut() else { return true };
        a.rows += rows;
        let window = a.window_start.elapsed();
        if window < AUTO_WINDOW {
            return true;
        }
        let rate = a.rows as f64 / window.as_secs_f64();
        let remaining = a.expected.saturating_sub(self.started.elapsed()).max(AUTO_WINDOW);
        (a.window_start, a.rows) = (Instant::now(), 0);
        let row = PerCall::Launches.row_bytes() + LAUNCH_INDEX_BYTES;
        let projected = rate * row as f64 * remaining.as_secs_f64();
        let room =
            self.cfg.per_call_limit().saturating_sub(self.size_now()).min(self.free_now().saturating_sub(self.floor()));
        if projected <= room as f64 {
            return true;
        }
        let why = format!(
            "{rate:.0} launches/s would write {} in the {:.0} s expected to remain, more than the {} left",
            mib(projected as u64),
            remaining.as_secs_f64(),
            mib(room)
        );
        self.stop(Stopped::Launches, why);
        false
    }

    fn stop(&mut self, what: Stopped, reason: String) {
        self.state.set(match what {
            Stopped::Launches => LAUNCH_ROWS_STOPPED,
            Stopped::PerCall => PER_CALL_STOPPED,
            Stopped::Everything => ALL_STOPPED,
        });
        let at_ns = crate::clock::monotonic_ns();
        let line = match what {
            Stopped::Launches => "--launches auto: launch and GEMM rows stop here, per-step counts go on",
            Stopped::PerCall => {
                "per-call rows (launches, GEMMs, syncs, regions, collectives, copies, jitted calls, off-CPU times) stop here; steps, counts, samples and energy go on"
            }
            Stopped::Everything => "no more rows are stored; the session ends with what was committed",
        };
        eprintln!("profiler: warning: {reason}: {line}");
        let e = BudgetEvent { at_ns, what, reason };
        self.events.push(e.clone());
        self.fresh.push(e);
    }
}

/// Records `events` on every session of the writer's job (`first` and the
/// sessions made after it): the `sessions` columns, once each, and a
/// `capabilities` row (source `store`); and the settings the job ran with.
pub(super) fn record(
    tx: &rusqlite::Connection,
    first: i64,
    cfg: &BudgetConfig,
    floor: u64,
    events: &[BudgetEvent],
) -> rusqlite::Result<()> {
    if events.is_empty() {
        return Ok(());
    }
    const JOB: &str = "id >= ?1 AND job IS (SELECT job FROM sessions WHERE id = ?1)";
    tx.execute(
        &format!("UPDATE sessions SET max_size_bytes = ?2, headroom_floor_bytes = ?3 WHERE {JOB}"),
        rusqlite::params![first, (cfg.max_size != u64::MAX).then_some(cfg.max_size as i64), floor as i64],
    )?;
    for e in events {
        let col = e.what.column();
        tx.execute(
            &format!(
                "UPDATE sessions SET {col} = max(started_ns, ?2),
                                     budget_reason = coalesce(budget_reason || '; ', '') || ?3
                 WHERE {JOB} AND {col} IS NULL"
            ),
            rusqlite::params![first, e.at_ns as i64, e.reason],
        )?;
        tx.execute(
            &format!(
                "INSERT OR IGNORE INTO capabilities(session_id, source, metric, available, reason)
                 SELECT id, 'store', ?2, 0, ?3 FROM sessions WHERE {JOB}"
            ),
            rusqlite::params![first, e.what.metric(), format!("stopped: {}", e.reason)],
        )?;
    }
    Ok(())
}

/// At the end: every change again (for the sessions made since, and in case
/// its batch failed) and the rows each session lost to them.
pub(super) fn record_at_finish(conn: &mut rusqlite::Connection, first: i64, budget: &Budget) -> rusqlite::Result<()> {
    if budget.events.is_empty() {
        return Ok(());
    }
    let tx = conn.transaction()?;
    record(&tx, first, &budget.cfg, budget.floor(), &budget.events)?;
    for (pid, n) in &budget.dropped {
        let id = match pid {
            Some(pid) => super::job::session_of(&tx, first, *pid)?,
            None => first,
        };
        tx.execute(
            "UPDATE sessions SET per_call_rows_dropped = coalesce(per_call_rows_dropped, 0) + ?2 WHERE id = ?1",
            rusqlite::params![id, *n as i64],
        )?;
    }
    tx.commit()
}

/// Checkpoints the `-wal` back into the database and truncates it once it is
/// past the budget's limit (SQLite's own checkpoints reuse the file, never
/// shrink it). A reader in the way makes it partial; the next batch tries again.
pub(super) fn keep_wal_small(conn: &rusqlite::Connection, budget: &Budget) {
    let wal = std::fs::metadata(super::side_file(&budget.path, "-wal")).map(|m| m.len()).unwrap_or(0);
    if wal > budget.wal_limit()
        && let Err(e) = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
    {
        log::debug!("wal checkpoint: {e}");
    }
}

/// Bytes as MiB, one decimal, for the warning lines.
fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing;

    const NO_FLOOR: MinFree = MinFree { share: None, bytes: Some(0) };

    fn launches(n: usize) -> StoreMsg {
        StoreMsg::Launches(vec![testing::launch(); n])
    }

    fn budget(dir: &Path, cfg: BudgetConfig) -> Budget {
        let p = dir.join("p.db");
        std::fs::write(&p, vec![0u8; 4096]).expect("write");
        Budget::new(cfg, &p, Arc::default())
    }

    #[test]
    fn sizes_and_floors_parse() {
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("4G"), Ok(4 << 30));
        assert_eq!(parse_size("512KiB"), Ok(512 << 10));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        for bad in ["", "0", "-1M", "4X", "G", "1e30T"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        let both = MinFree::parse("10%,5G").expect("both");
        assert_eq!(both, MinFree { share: Some(0.10), bytes: Some(5 << 30) });
        assert_eq!(MinFree::parse("2G"), Ok(MinFree { share: None, bytes: Some(2 << 30) }));
        for bad in ["100%", "x%", "1%,2%", "1G,2G", ""] {
            assert!(MinFree::parse(bad).is_err(), "{bad}");
        }
        // The smaller of the two: 10 % of a small disk, 5 GiB of a big one.
        assert_eq!(both.floor(64 << 20), (64 << 20) / 10);
        assert_eq!(both.floor(1 << 40), 5 << 30);
    }

    /// Every kind of message has its place: per-call tables by kind, through
    /// `ForProcess` too.
    #[test]
    fn messages_are_classified_once() {
        assert_eq!(RowKind::of(&launches(3)), RowKind::PerCall(PerCall::Launches, 3));
        let inner = StoreMsg::ForProcess(9, Box::new(StoreMsg::Syncs(Vec::new())));
        assert_eq!(RowKind::of(&inner), RowKind::PerCall(PerCall::Syncs, 0));
        assert_eq!(RowKind::of(&StoreMsg::Steps(vec![testing::step()])), RowKind::Timed(128));
    }

    /// Per-call rows stop at 7/8 of --max-size, steps go on until all of it;
    /// each stop is one event and every dropped row is counted by process.
    #[test]
    fn per_call_rows_stop_first_and_everything_last() {
        let d = tempfile::tempdir().expect("tempdir");
        let cfg = BudgetConfig { max_size: 16 << 20, min_free: NO_FLOOR, auto_launches: None };
        let mut b = budget(d.path(), cfg);
        // 88 bytes per row, 1.25 MiB kept for the -wal: 140 000 rows fit in 14 MiB, 160 000 do not.
        assert!(b.admit(&launches(140_000)));
        assert!(!b.admit(&launches(20_000)));
        assert!(!b.admit(&StoreMsg::ForProcess(5, Box::new(launches(7)))));
        assert_eq!(b.events.len(), 1);
        assert_eq!(b.events[0].what, Stopped::PerCall);
        assert!(b.events[0].reason.contains("--max-size"), "{:?}", b.events);
        assert_eq!(b.dropped, BTreeMap::from([(None, 20_000), (Some(5), 7)]));
        // Steps fill the last eighth, then nothing is stored.
        let steps = StoreMsg::Steps(vec![testing::step(); 100]);
        assert!(b.admit(&steps));
        while b.admit(&steps) {}
        assert!(b.state.all_stopped());
        assert_eq!(b.events.iter().map(|e| e.what).collect::<Vec<_>>(), [Stopped::PerCall, Stopped::Everything]);
        assert!(b.admit(&StoreMsg::Capability(crate::store::Capability {
            source: "x".into(),
            metric: "y".into(),
            available: false,
            reason: None
        })));
    }

    /// The floor applies to the filesystem's free space, whatever --max-size allows.
    #[test]
    fn the_headroom_floor_stops_per_call_rows() {
        let d = tempfile::tempdir().expect("tempdir");
        let m = measure(&d.path().join("p.db")).expect("statvfs");
        let cfg = BudgetConfig {
            max_size: u64::MAX / 2,
            min_free: MinFree { share: None, bytes: Some(m.free) },
            auto_launches: None,
        };
        let mut b = budget(d.path(), cfg);
        assert!(!b.admit(&launches(1)));
        assert!(b.events[0].reason.contains("--min-free"), "{:?}", b.events);
        assert!(b.admit(&StoreMsg::Steps(vec![testing::step()])), "steps go on under the floor");
    }

    /// `--launches auto` switches when the projected launch rows exceed what is
    /// left, and keeps other per-call rows.
    #[test]
    fn auto_switches_on_a_rate_that_would_spend_the_budget() {
        let d = tempfile::tempdir().expect("tempdir");
        let expected = Some(Duration::from_secs(3600));
        let cfg = BudgetConfig { max_size: 64 << 20, min_free: NO_FLOOR, auto_launches: expected };
        let mut b = budget(d.path(), cfg);
        assert!(b.admit(&launches(1000)), "within the first window");
        // As if the window had lasted 5 s: 2000 rows, 400/s, 88 B × 400/s × 3600 s ≈ 120 MiB > the 60 MiB left.
        b.auto.as_mut().expect("auto").window_start -= AUTO_WINDOW;
        assert!(!b.admit(&launches(1000)));
        assert_eq!(b.events[0].what, Stopped::Launches, "{:?}", b.events);
        assert!(b.events[0].reason.contains("launches/s"), "{:?}", b.events);
        assert!(!b.admit(&StoreMsg::Gemms(Vec::new())));
        assert!(b.admit(&StoreMsg::Syncs(Vec::new())), "syncs are not launch rows");
    }

    #[test]
    fn auto_keeps_launch_rows_at_a_modest_rate() {
        let d = tempfile::tempdir().expect("tempdir");
        let expected = Some(Duration::from_secs(60));
        let cfg = BudgetConfig { max_size: 64 << 20, min_free: NO_FLOOR, auto_launches: expected };
        let mut b = budget(d.path(), cfg);
        b.auto.as_mut().expect("auto").window_start -= AUTO_WINDOW;
        assert!(b.admit(&launches(1000)), "≈200/s for a minute is ≈1 MiB");
        assert!(b.events.is_empty());
    }
}
