//! The only SQLite writer: schema and migrations, the session row, and a
//! writer thread that takes typed rows over a bounded channel and writes them
//! in batched transactions.
//!
//! Bounded: when SQLite falls behind, the event path blocks on `send`, the
//! ring buffer fills, and the kernel counts what it cannot reserve — loss is
//! pushed to the one place where it is counted, never dropped silently here.
use std::{
    path::{Path, PathBuf},
    sync::mpsc::{Receiver, SyncSender, sync_channel},
    thread::JoinHandle,
};

use profiler_common::{ApiLayer, LaunchApi};
use rusqlite::{Connection, DatabaseName, ErrorCode, params, params_from_iter, types::Value};

/// Schema changes in order; `PRAGMA user_version` is how many are applied.
/// Append, never edit: a database written by an older profiler gets the rest.
const MIGRATIONS: &[&str] =
    &[CORE_SCHEMA, crate::samplers::gpu::SCHEMA, crate::samplers::rapl::SCHEMA, crate::samplers::system::SCHEMA];

/// Version of the schema, kept in `PRAGMA user_version`.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

const CORE_SCHEMA: &str = r#"
CREATE TABLE sessions (
    id                INTEGER PRIMARY KEY,
    pid               INTEGER NOT NULL,
    command           TEXT    NOT NULL,
    exe               TEXT,
    mode              TEXT    NOT NULL,
    launch_mode       TEXT    NOT NULL,
    step_symbol       TEXT,
    started_ns        INTEGER NOT NULL,
    ended_ns          INTEGER,
    end_reason        TEXT,
    lost_events       INTEGER,
    total_launches    INTEGER,
    stored_launches   INTEGER,
    unmatched_returns INTEGER,
    unix_offset_ns    INTEGER NOT NULL,
    hostname          TEXT,
    kernel_release    TEXT,
    profiler_version  TEXT    NOT NULL
);
CREATE TABLE libraries (
    session_id  INTEGER NOT NULL REFERENCES sessions(id),
    path        TEXT    NOT NULL,
    kind        TEXT    NOT NULL,
    attached_ns INTEGER NOT NULL,
    probes      INTEGER NOT NULL,
    how         TEXT    NOT NULL
);
CREATE TABLE probes (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    library    TEXT    NOT NULL,
    symbol     TEXT    NOT NULL,
    offset     INTEGER NOT NULL,
    reason     TEXT    NOT NULL
);
CREATE TABLE apis (
    id    INTEGER PRIMARY KEY,
    name  TEXT NOT NULL UNIQUE,
    layer TEXT NOT NULL
);
CREATE TABLE steps (
    session_id    INTEGER NOT NULL REFERENCES sessions(id),
    label         TEXT    NOT NULL DEFAULT 'train',
    step          INTEGER NOT NULL,
    tid           INTEGER NOT NULL,
    start_ns      INTEGER NOT NULL,
    end_ns        INTEGER,
    duration_ns   INTEGER,
    inter_step_ns INTEGER,
    launches      INTEGER,
    sync_wait_ns  INTEGER,
    PRIMARY KEY (session_id, label, step)
);
CREATE TABLE kernels (
    session_id     INTEGER NOT NULL REFERENCES sessions(id),
    function       INTEGER NOT NULL,
    name           TEXT    NOT NULL,
    demangled_name TEXT,
    source         TEXT    NOT NULL,
    UNIQUE (session_id, function)
);
CREATE TABLE syncs (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    tid        INTEGER NOT NULL,
    api        TEXT    NOT NULL,
    start_ns   INTEGER NOT NULL,
    end_ns     INTEGER NOT NULL,
    label      TEXT,
    step       INTEGER
);
CREATE TABLE launches (
    session_id       INTEGER NOT NULL,
    ts_ns            INTEGER NOT NULL,
    tid              INTEGER NOT NULL,
    api              INTEGER NOT NULL,
    function         INTEGER NOT NULL,
    grid_x           INTEGER NOT NULL,
    grid_y           INTEGER NOT NULL,
    grid_z           INTEGER NOT NULL,
    block_x          INTEGER NOT NULL,
    block_y          INTEGER NOT NULL,
    block_z          INTEGER NOT NULL,
    shared_mem_bytes INTEGER NOT NULL,
    stream           INTEGER NOT NULL,
    label            TEXT,
    step             INTEGER
);
CREATE TABLE capabilities (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    source     TEXT    NOT NULL,
    metric     TEXT    NOT NULL,
    available  INTEGER NOT NULL,
    reason     TEXT,
    UNIQUE (session_id, source, metric)
);
CREATE VIEW launches_named AS
    SELECT l.*, a.name AS api_name, a.layer AS api_layer
    FROM launches l JOIN apis a ON a.id = l.api;
"#;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The file exists but is not a SQLite database.
    #[error("{path} is not a SQLite database ({source}); pass a new file with -o")]
    NotADatabase { path: PathBuf, source: rusqlite::Error },
    /// SQLite could not open or create the file.
    #[error("cannot open {path} for writing ({source}); choose a writable path with -o")]
    Open { path: PathBuf, source: rusqlite::Error },
    /// The file is a SQLite database that this profiler did not write.
    #[error(
        "{path} is a SQLite database of something else (it has tables but no profiler schema); pass a new file with -o"
    )]
    Foreign { path: PathBuf },
    /// Written by a newer profiler.
    #[error(
        "{path} has schema version {found}, newer than this profiler's {SCHEMA_VERSION}; upgrade profiler or pass a new file with -o"
    )]
    TooNew { path: PathBuf, found: i64 },
    #[error("database error: {0}")]
    Sql(#[from] rusqlite::Error),
}

/// A database opened and checked for writing.
pub struct Store {
    conn: Connection,
    path: PathBuf,
}

/// What the session row holds at the start.
pub struct SessionStart {
    pub pid: u32,
    pub command: String,
    pub exe: Option<String>,
    pub mode: &'static str,
    pub launch_mode: &'static str,
    pub step_symbol: Option<String>,
    pub started_ns: u64,
    pub unix_offset_ns: i64,
    pub hostname: Option<String>,
    pub kernel_release: Option<String>,
}

/// What the session row gets at the end.
#[derive(Clone, Debug)]
pub struct SessionEnd {
    pub ended_ns: u64,
    pub end_reason: String,
    pub lost_events: u64,
    pub total_launches: u64,
    pub unmatched_returns: u64,
}

#[derive(Clone, Copy, Debug)]
pub struct LaunchRow {
    pub ts_ns: u64,
    pub tid: u32,
    pub api: LaunchApi,
    pub function: u64,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    pub stream: u64,
    /// The step the launching thread was in: (label, step).
    pub step: Option<(&'static str, u64)>,
}

/// A launch handle (or runtime host stub) and its kernel's name.
#[derive(Clone, Debug)]
pub struct KernelRow {
    pub function: u64,
    pub name: String,
    pub demangled_name: Option<String>,
    /// `cuModuleGetFunction`, `cuLibraryGetKernel`, `cuKernelGetFunction`, or `symbol` (runtime host stub).
    pub source: &'static str,
}

/// One host synchronisation call.
#[derive(Clone, Debug)]
pub struct SyncRow {
    pub tid: u32,
    pub api: &'static str,
    pub start_ns: u64,
    pub end_ns: u64,
    /// The step the thread was in when the call began.
    pub step: Option<(&'static str, u64)>,
}

#[derive(Clone, Debug)]
pub struct StepRow {
    pub sync_wait_ns: Option<u64>,
    pub label: String,
    pub step: u64,
    pub tid: u32,
    pub start_ns: u64,
    pub end_ns: Option<u64>,
    pub inter_step_ns: Option<u64>,
    pub launches: Option<u64>,
}

#[derive(Clone, Debug)]
pub struct LibraryRow {
    pub path: String,
    /// (symbol, offset from its start, why there) of each probe.
    pub placed: Vec<(String, u64, String)>,
    pub kind: String,
    pub attached_ns: u64,
    pub probes: u32,
    pub how: String,
}

/// Rows for a table a sampler owns: `sql` takes the session id as `?1` and
/// each row's values as `?2`, `?3`, ….
pub struct Insert {
    pub sql: &'static str,
    pub rows: Vec<Vec<Value>>,
}

/// Work done in the session's last transaction, after every row is in: the
/// per-step figures computed from samples and steps.
pub type FinishHook = Box<dyn FnOnce(&Connection, i64) -> rusqlite::Result<()> + Send>;

/// A metric's availability, recorded once per session.
#[derive(Clone, Debug)]
pub struct Capability {
    pub source: String,
    pub metric: String,
    pub available: bool,
    pub reason: Option<String>,
}

pub enum StoreMsg {
    Insert(Insert),
    Capability(Capability),
    Launches(Vec<LaunchRow>),
    Steps(Vec<StepRow>),
    Syncs(Vec<SyncRow>),
    Kernels(Vec<KernelRow>),
    Library(LibraryRow),
    Finish(SessionEnd, Vec<FinishHook>),
}

/// What the writer did, for the end-of-session summary.
#[derive(Clone, Debug, Default)]
pub struct WriterStats {
    pub launches: u64,
    pub steps: u64,
    pub transactions: u64,
    /// Rows that could not be written, and the first error.
    pub failed_rows: u64,
    pub first_error: Option<String>,
}

fn i(v: u64) -> i64 {
    // Handles and addresses are below 2^63 on every ABI we probe; wrapping
    // keeps the bits if one ever is not.
    v as i64
}

impl Store {
    /// Opens (or creates) `path`, checks it is ours, creates or migrates the schema.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let conn = Connection::open(path).map_err(|source| StoreError::Open { path: path.to_owned(), source })?;
        let classify = |source: rusqlite::Error| match source.sqlite_error_code() {
            Some(ErrorCode::NotADatabase) => StoreError::NotADatabase { path: path.to_owned(), source },
            Some(ErrorCode::CannotOpen | ErrorCode::ReadOnly | ErrorCode::PermissionDenied) => {
                StoreError::Open { path: path.to_owned(), source }
            }
            _ => StoreError::Sql(source),
        };
        conn.pragma_update(None, "journal_mode", "WAL").map_err(classify)?;
        if conn.is_readonly(DatabaseName::Main).unwrap_or(true) {
            return Err(StoreError::Open {
                path: path.to_owned(),
                source: rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_READONLY),
                    Some("read-only".into()),
                ),
            });
        }
        conn.pragma_update(None, "synchronous", "NORMAL").map_err(classify)?;
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0)).map_err(classify)?;
        if version > SCHEMA_VERSION {
            return Err(StoreError::TooNew { path: path.to_owned(), found: version });
        }
        if version == 0 {
            let tables: i64 =
                conn.query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0)).map_err(classify)?;
            if tables > 0 {
                return Err(StoreError::Foreign { path: path.to_owned() });
            }
        }
        if version < SCHEMA_VERSION {
            let tx = conn.unchecked_transaction().map_err(classify)?;
            for (v, migration) in MIGRATIONS.iter().enumerate().skip(version as usize) {
                tx.execute_batch(migration).map_err(classify)?;
                if v == 0 {
                    for api in LaunchApi::ALL {
                        let layer = match api.layer() {
                            ApiLayer::Driver => "driver",
                            ApiLayer::Runtime => "runtime",
                        };
                        tx.execute(
                            "INSERT INTO apis(id, name, layer) VALUES (?1, ?2, ?3)",
                            params![api as u32, api.symbol(), layer],
                        )
                        .map_err(classify)?;
                    }
                }
            }
            tx.pragma_update(None, "user_version", SCHEMA_VERSION).map_err(classify)?;
            tx.commit().map_err(classify)?;
        }
        Ok(Self { conn, path: path.to_owned() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Inserts the session row (ended_ns NULL until the end, so a crash leaves
    /// a visible, unfinished session) and returns its id.
    pub fn begin_session(&self, s: &SessionStart) -> Result<i64, StoreError> {
        self.conn.execute(
            "INSERT INTO sessions(pid, command, exe, mode, launch_mode, step_symbol, started_ns, unix_offset_ns,
                                  hostname, kernel_release, profiler_version)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
            params![
                s.pid,
                s.command,
                s.exe,
                s.mode,
                s.launch_mode,
                s.step_symbol,
                i(s.started_ns),
                s.unix_offset_ns,
                s.hostname,
                s.kernel_release,
                env!("CARGO_PKG_VERSION")
            ],
        )?;
        Ok(self.conn.last_insert_rowid())
    }

    /// Moves the connection to a writer thread.
    pub fn spawn_writer(self, session_id: i64) -> StoreWriter {
        let (tx, rx) = sync_channel::<StoreMsg>(256);
        let join = std::thread::Builder::new()
            .name("profiler-store".into())
            .spawn(move || write_loop(self.conn, session_id, rx))
            .expect("spawning a thread only fails when the system is out of resources");
        StoreWriter { tx, join }
    }
}

/// Handle to the writer thread.
pub struct StoreWriter {
    tx: SyncSender<StoreMsg>,
    join: JoinHandle<Result<WriterStats, StoreError>>,
}

impl StoreWriter {
    /// Sends rows; blocks while the writer is behind (see module docs).
    pub fn send(&self, msg: StoreMsg) {
        // The writer only goes away after Finish; a send after that is a bug
        // worth a log line, not a panic that would lose the session.
        if self.tx.send(msg).is_err() {
            log::error!("store writer is gone; rows not written");
        }
    }

    /// A sender for sampler threads.
    pub fn sender(&self) -> RowSender {
        RowSender(self.tx.clone())
    }

    /// Finishes the session: runs `hooks` in the last transaction, records
    /// the end, and waits for everything to be on disk.
    pub fn finish(self, end: SessionEnd, hooks: Vec<FinishHook>) -> Result<WriterStats, StoreError> {
        self.send(StoreMsg::Finish(end, hooks));
        drop(self.tx);
        self.join
            .join()
            .unwrap_or_else(|_| Ok(WriterStats { first_error: Some("writer panicked".into()), ..Default::default() }))
    }
}

/// A clonable handle for threads that produce rows (samplers).
#[derive(Clone)]
pub struct RowSender(SyncSender<StoreMsg>);

impl RowSender {
    pub fn send(&self, msg: StoreMsg) {
        if self.0.send(msg).is_err() {
            log::error!("store writer is gone; rows not written");
        }
    }
}

fn write_batch(
    conn: &mut Connection,
    session_id: i64,
    msgs: &[StoreMsg],
    stats: &mut WriterStats,
) -> rusqlite::Result<()> {
    let tx = conn.transaction()?;
    {
        let mut launch = tx.prepare_cached(
            "INSERT INTO launches(session_id, ts_ns, tid, api, function, grid_x, grid_y, grid_z,
                                  block_x, block_y, block_z, shared_mem_bytes, stream, label, step)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
        )?;
        let mut step = tx.prepare_cached(
            "INSERT OR REPLACE INTO steps(session_id, label, step, tid, start_ns, end_ns, duration_ns, inter_step_ns, launches,
                                          sync_wait_ns)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
        )?;
        for msg in msgs.iter() {
            match msg {
                StoreMsg::Insert(ins) => {
                    let mut stmt = tx.prepare_cached(ins.sql)?;
                    for row in &ins.rows {
                        stmt.execute(params_from_iter(std::iter::once(&Value::Integer(session_id)).chain(row.iter())))?;
                    }
                }
                StoreMsg::Kernels(rows) => {
                    let mut stmt = tx.prepare_cached(
                        "INSERT OR IGNORE INTO kernels(session_id, function, name, demangled_name, source)
                         VALUES (?1, ?2, ?3, ?4, ?5)",
                    )?;
                    for r in rows {
                        stmt.execute(params![session_id, i(r.function), r.name, r.demangled_name, r.source])?;
                    }
                }
                StoreMsg::Syncs(rows) => {
                    let mut stmt = tx.prepare_cached(
                        "INSERT INTO syncs(session_id, tid, api, start_ns, end_ns, label, step) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                    )?;
                    for r in rows {
                        stmt.execute(params![
                            session_id,
                            r.tid,
                            r.api,
                            i(r.start_ns),
                            i(r.end_ns),
                            r.step.map(|s| s.0),
                            r.step.map(|s| i(s.1))
                        ])?;
                    }
                }
                StoreMsg::Capability(c) => {
                    tx.execute(
                        "INSERT OR IGNORE INTO capabilities(session_id, source, metric, available, reason)
                         VALUES (?1, ?2, ?3, ?4, ?5)",
                        params![session_id, c.source, c.metric, c.available, c.reason],
                    )?;
                }
                StoreMsg::Launches(rows) => {
                    for r in rows {
                        launch.execute(params![
                            session_id,
                            i(r.ts_ns),
                            r.tid,
                            r.api as u32,
                            i(r.function),
                            r.grid[0],
                            r.grid[1],
                            r.grid[2],
                            r.block[0],
                            r.block[1],
                            r.block[2],
                            r.shared_mem_bytes,
                            i(r.stream),
                            r.step.map(|s| s.0),
                            r.step.map(|s| i(s.1))
                        ])?;
                    }
                    stats.launches += rows.len() as u64;
                }
                StoreMsg::Steps(rows) => {
                    for r in rows {
                        step.execute(params![
                            session_id,
                            r.label,
                            i(r.step),
                            r.tid,
                            i(r.start_ns),
                            r.end_ns.map(i),
                            r.end_ns.map(|e| i(e.saturating_sub(r.start_ns))),
                            r.inter_step_ns.map(i),
                            r.launches.map(i),
                            r.sync_wait_ns.map(i)
                        ])?;
                    }
                    stats.steps += rows.len() as u64;
                }
                StoreMsg::Library(l) => {
                    tx.execute(
                        "INSERT INTO libraries(session_id, path, kind, attached_ns, probes, how) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                        params![session_id, l.path, l.kind, i(l.attached_ns), l.probes, l.how],
                    )?;
                    for (symbol, offset, reason) in &l.placed {
                        tx.execute(
                            "INSERT INTO probes(session_id, library, symbol, offset, reason) VALUES (?1, ?2, ?3, ?4, ?5)",
                            params![session_id, l.path, symbol, i(*offset), reason],
                        )?;
                    }
                }
                StoreMsg::Finish(..) => {}
            }
        }
    }
    tx.commit()?;
    stats.transactions += 1;
    Ok(())
}

fn rows_in(msgs: &[StoreMsg]) -> u64 {
    msgs.iter()
        .map(|m| match m {
            StoreMsg::Launches(r) => r.len() as u64,
            StoreMsg::Steps(r) => r.len() as u64,
            StoreMsg::Syncs(r) => r.len() as u64,
            StoreMsg::Kernels(r) => r.len() as u64,
            StoreMsg::Insert(ins) => ins.rows.len() as u64,
            StoreMsg::Library(_) | StoreMsg::Capability(_) => 1,
            StoreMsg::Finish(..) => 0,
        })
        .sum()
}

fn write_loop(mut conn: Connection, session_id: i64, rx: Receiver<StoreMsg>) -> Result<WriterStats, StoreError> {
    let mut stats = WriterStats::default();
    let mut end: Option<(SessionEnd, Vec<FinishHook>)> = None;
    let mut batch: Vec<StoreMsg> = Vec::new();
    while end.is_none() {
        let Ok(first) = rx.recv() else { break };
        batch.push(first);
        // Everything already queued goes into the same transaction.
        while batch.len() < 1024 {
            match rx.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => break,
            }
        }
        if let Some(pos) = batch.iter().position(|m| matches!(m, StoreMsg::Finish(..)))
            && let StoreMsg::Finish(e, hooks) = batch.remove(pos)
        {
            end = Some((e, hooks));
        }
        if let Err(e) = write_batch(&mut conn, session_id, &batch, &mut stats) {
            stats.failed_rows += rows_in(&batch);
            stats.first_error.get_or_insert_with(|| e.to_string());
        }
        batch.clear();
    }
    let (end, hooks) = end.unwrap_or_else(|| {
        let end = SessionEnd {
            ended_ns: crate::clock::monotonic_ns(),
            end_reason: "error: event path stopped without finishing the session".into(),
            lost_events: 0,
            total_launches: 0,
            unmatched_returns: 0,
        };
        (end, Vec::new())
    });
    let mut tx = conn.transaction()?;
    for hook in hooks {
        // A failed hook loses its derived figures (rolled back), not the session.
        let sp = tx.savepoint()?;
        match hook(&sp, session_id) {
            Ok(()) => sp.commit()?,
            Err(e) => {
                stats.first_error.get_or_insert_with(|| format!("computing per-step figures: {e}"));
            }
        }
    }
    tx.execute(
        "UPDATE sessions SET ended_ns = ?2, end_reason = ?3, lost_events = ?4, total_launches = ?5,
                             stored_launches = ?6, unmatched_returns = ?7 WHERE id = ?1",
        params![
            session_id,
            i(end.ended_ns),
            end.end_reason,
            i(end.lost_events),
            i(end.total_launches),
            i(stats.launches),
            i(end.unmatched_returns)
        ],
    )?;
    tx.commit()?;
    // Built once at the end: an index maintained during capture would slow every insert.
    conn.execute_batch(
        "CREATE INDEX IF NOT EXISTS launches_by_step ON launches(session_id, label, step);
         PRAGMA wal_checkpoint(TRUNCATE);",
    )?;
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_db() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("p.db");
        (dir, p)
    }

    fn start() -> SessionStart {
        SessionStart {
            pid: 42,
            command: "trainer --steps 2".into(),
            exe: Some("/bin/trainer".into()),
            mode: "attach",
            launch_mode: "all",
            step_symbol: Some("train_step".into()),
            started_ns: 1000,
            unix_offset_ns: 5,
            hostname: None,
            kernel_release: None,
        }
    }

    #[test]
    fn writes_a_session_and_keeps_old_ones() {
        let (_d, p) = temp_db();
        for round in 0..2 {
            let store = Store::open(&p).expect("open");
            let id = store.begin_session(&start()).expect("session");
            assert_eq!(id, round + 1);
            let w = store.spawn_writer(id);
            w.send(StoreMsg::Steps(vec![StepRow {
                sync_wait_ns: None,
                label: "train".into(),
                step: 0,
                tid: 7,
                start_ns: 100,
                end_ns: Some(250),
                inter_step_ns: None,
                launches: Some(1),
            }]));
            w.send(StoreMsg::Launches(vec![LaunchRow {
                ts_ns: 200,
                tid: 7,
                api: LaunchApi::CuLaunchKernel,
                function: 0x1234,
                grid: [1, 2, 3],
                block: [4, 5, 6],
                shared_mem_bytes: 0,
                stream: 0,
                step: Some(("train", 0)),
            }]));
            let stats = w
                .finish(
                    SessionEnd {
                        ended_ns: 2000,
                        end_reason: "target-exited".into(),
                        lost_events: 0,
                        total_launches: 1,
                        unmatched_returns: 0,
                    },
                    Vec::new(),
                )
                .expect("finish");
            assert_eq!((stats.launches, stats.steps, stats.failed_rows), (1, 1, 0));
        }
        let conn = Connection::open(&p).expect("reopen");
        let n: i64 = conn
            .query_row("SELECT count(*) FROM sessions WHERE end_reason = 'target-exited'", [], |r| r.get(0))
            .expect("q");
        assert_eq!(n, 2);
        let (dur, name): (i64, String) = conn
            .query_row(
                "SELECT s.duration_ns, l.api_name FROM steps s JOIN launches_named l USING (session_id, label, step) WHERE session_id = 2",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .expect("q");
        assert_eq!((dur, name.as_str()), (150, "cuLaunchKernel"));
        let v: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0)).expect("q");
        assert_eq!(v, SCHEMA_VERSION);
    }

    #[test]
    fn rejects_corrupt_foreign_and_newer_files() {
        let (_d, p) = temp_db();
        std::fs::write(&p, vec![0x42u8; 8192]).expect("write");
        assert!(matches!(Store::open(&p), Err(StoreError::NotADatabase { .. })));

        std::fs::remove_file(&p).expect("rm");
        let c = Connection::open(&p).expect("create");
        c.execute_batch("CREATE TABLE other(x)").expect("create");
        drop(c);
        assert!(matches!(Store::open(&p), Err(StoreError::Foreign { .. })));

        std::fs::remove_file(&p).expect("rm");
        let c = Connection::open(&p).expect("create");
        c.pragma_update(None, "user_version", 99).expect("set");
        drop(c);
        assert!(matches!(Store::open(&p), Err(StoreError::TooNew { found: 99, .. })));
    }

    #[test]
    fn unopenable_path_is_an_open_error() {
        let (d, _) = temp_db();
        let file = d.path().join("plain-file");
        std::fs::write(&file, b"x").expect("write");
        let err = Store::open(&file.join("x.db")).err().expect("must fail");
        assert!(matches!(err, StoreError::Open { .. }), "{err}");
        assert!(err.to_string().contains("-o"));
    }
}
