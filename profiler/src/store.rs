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

use profiler_common::LaunchApi;
use rusqlite::{Connection, DatabaseName, ErrorCode, params, params_from_iter, types::Value};

/// Schema changes in order; `PRAGMA user_version` is how many are applied.
/// Append, never edit (the test `migrations_are_append_only` pins each SQL
/// one): a database written by an older profiler gets the rest.
/// (Migrations 0–3 were edited in place anyway; migration 4 repairs that, see
/// [`reconcile_first_four`]. Editing 0–3 again would reach fresh files only.)
const MIGRATIONS: &[Migration] = &[
    Migration::Sql(CORE_SCHEMA),
    Migration::Sql(crate::samplers::gpu::SCHEMA),
    Migration::Sql(crate::samplers::rapl::SCHEMA),
    Migration::Sql(crate::samplers::system::SCHEMA),
    Migration::Code(reconcile_first_four),
    Migration::Sql(crate::steps::LOSS_SCHEMA),
    Migration::Sql(KERNELS_OVER_TIME),
    Migration::Sql(crate::regions::SCHEMA), // #12 hook
];

/// Migration 6: a driver handle can name one kernel, then (its module
/// unloaded, the address reused) another. `kernels` keeps each handle's first
/// name; each later, different one is a `kernel_renames` row with the time it
/// was learned. A launch's kernel is its handle's latest rename at or before
/// it, else its `kernels` name. (A table of its own, not a column: `kernels`
/// keeps the shape the repair of migration 4 reconciles.)
const KERNELS_OVER_TIME: &str = r#"
CREATE TABLE kernel_renames (
    session_id     INTEGER NOT NULL REFERENCES sessions(id),
    function       INTEGER NOT NULL,
    named_ns       INTEGER NOT NULL,
    name           TEXT    NOT NULL,
    demangled_name TEXT,
    source         TEXT    NOT NULL,
    UNIQUE (session_id, function, named_ns)
);
"#;

/// One schema change.
enum Migration {
    /// Statements run as one batch.
    Sql(&'static str),
    /// Changes that depend on what the file already has.
    Code(fn(&Connection) -> rusqlite::Result<()>),
}

impl Migration {
    fn apply(&self, conn: &Connection) -> rusqlite::Result<()> {
        match self {
            Migration::Sql(sql) => conn.execute_batch(sql),
            Migration::Code(f) => f(conn),
        }
    }
}

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
    /// The session lock (see [`written_by_a_live_profiler`]) could not be taken.
    #[error("cannot lock {path} for this session ({source})")]
    Lock { path: PathBuf, source: std::io::Error },
    #[error("database error: {0}")]
    Sql(#[from] rusqlite::Error),
}

/// A database opened and checked for writing.
pub struct Store {
    conn: Connection,
    path: PathBuf,
    /// This open created the file (so under `sudo` it is the user's).
    created: bool,
    /// A shared `flock` on the file for as long as this profiler may write
    /// it: what tells `report` a session is still running (see
    /// [`written_by_a_live_profiler`]). SQLite's own locks cannot: readers hold them too.
    session_lock: std::fs::File,
}

/// The SQLite file next to the profile at `path` with `suffix` (`-wal`, `-shm`).
pub fn side_file(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// Whether a profiler that may still write the profile at `path` is alive:
/// one holds a shared `flock` on it from open to the end of its session, and
/// the kernel drops it when that process dies. Checked with an exclusive
/// non-blocking lock, let go at once.
pub fn written_by_a_live_profiler(path: &Path) -> bool {
    use rustix::fs::{FlockOperation, flock};
    let Ok(file) = std::fs::File::open(path) else { return false };
    flock(&file, FlockOperation::NonBlockingLockExclusive).is_err()
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
    /// When the handle got this name (0: for the whole session).
    pub named_ns: u64,
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
        let created = !path.exists();
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
        let tx = conn.unchecked_transaction().map_err(classify)?;
        for migration in MIGRATIONS.iter().skip(version as usize) {
            migration.apply(&tx).map_err(classify)?;
        }
        fill_apis(&tx).map_err(classify)?;
        if version < SCHEMA_VERSION {
            tx.pragma_update(None, "user_version", SCHEMA_VERSION).map_err(classify)?;
        }
        tx.commit().map_err(classify)?;
        // Now, not at the end: a profiler that is killed leaves the user's file.
        if created {
            crate::ownership::give_to_invoking_user(path);
        }
        // A second descriptor, never closed before the connection: closing one
        // would drop this process's SQLite (fcntl) locks on the file.
        let session_lock =
            std::fs::File::open(path).map_err(|e| StoreError::Lock { path: path.to_owned(), source: e })?;
        rustix::fs::flock(&session_lock, rustix::fs::FlockOperation::LockShared)
            .map_err(|e| StoreError::Lock { path: path.to_owned(), source: e.into() })?;
        Ok(Self { conn, path: path.to_owned(), created, session_lock })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this open created the file.
    pub fn created(&self) -> bool {
        self.created
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
            .spawn(move || {
                let stats = write_loop(self.conn, session_id, rx);
                // After the connection has closed (see `session_lock`).
                drop(self.session_lock);
                stats
            })
            .expect("spawning a thread only fails when the system is out of resources");
        StoreWriter { tx, join }
    }
}

/// Adds the `apis` rows this build's [`LaunchApi`] has and the file lacks.
///
/// On every open rather than in a migration: `launches_named` joins on `apis`,
/// so a launch whose API has no row would drop out of it, and a variant added
/// later would otherwise need a migration of its own that is easy to forget.
/// Reads 16 rows and writes nothing when the file has them all; existing rows
/// are never changed.
fn fill_apis(conn: &Connection) -> rusqlite::Result<()> {
    let have = conn
        .prepare("SELECT id FROM apis")?
        .query_map([], |r| r.get::<_, u32>(0))?
        .collect::<rusqlite::Result<std::collections::HashSet<u32>>>()?;
    for api in LaunchApi::ALL.into_iter().filter(|a| !have.contains(&(*a as u32))) {
        conn.execute(
            "INSERT INTO apis(id, name, layer) VALUES (?1, ?2, ?3)",
            params![api as u32, api.symbol(), api.layer().as_str()],
        )?;
    }
    Ok(())
}

/// Migration 4: brings a file to the schema migrations 0–3 create today.
///
/// Those four were edited in place after files had been written with them, so
/// a file's `user_version` says which migrations ran but not which text:
///
/// * 0 (core): `capabilities` (5f33ae8); `probes`, `steps.label` with the
///   primary key `(session_id, label, step)` instead of `(session_id, step)`,
///   `launches.label` (aa0a811); `steps.sync_wait_ns`, `syncs` (55e0eb6);
///   `kernels` (9936331).
/// * 1 (GPU): empty until f72751d; then `step_gpu.label` with the primary key
///   `(session_id, label, step, gpu)` and `gpu_stats_monitor` by label (6bc0469).
/// * 3 (system): `system_metrics` with the GPU metrics (6bc0469).
///
/// A file created fresh already has the result, and nothing is written.
fn reconcile_first_four(conn: &Connection) -> rusqlite::Result<()> {
    reconcile(conn, &MIGRATIONS[..4])
}

/// A column as `pragma_table_info` gives it: name, type, not null, default, place in the primary key.
type Column = (String, String, bool, Option<String>, i64);

fn columns(conn: &Connection, table: &str) -> rusqlite::Result<Vec<Column>> {
    conn.prepare(r#"SELECT name, type, "notnull", dflt_value, pk FROM pragma_table_info(?1) ORDER BY cid"#)?
        .query_map([table], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))?
        .collect()
}

/// The table's primary-key and UNIQUE constraints: (origin, columns), sorted.
fn keys(conn: &Connection, table: &str) -> rusqlite::Result<Vec<(String, Vec<String>)>> {
    let indexes = conn
        .prepare("SELECT name, origin FROM pragma_index_list(?1) WHERE origin IN ('pk', 'u')")?
        .query_map([table], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let mut keys = Vec::new();
    for (index, origin) in indexes {
        let cols = conn
            .prepare("SELECT name FROM pragma_index_info(?1) ORDER BY seqno")?
            .query_map([&index], |r| r.get::<_, String>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        keys.push((origin, cols));
    }
    keys.sort();
    Ok(keys)
}

fn schema_sql(conn: &Connection, kind: &str, name: &str) -> rusqlite::Result<Option<String>> {
    use rusqlite::OptionalExtension;
    conn.query_row("SELECT sql FROM sqlite_master WHERE type = ?1 AND name = ?2", [kind, name], |r| r.get(0)).optional()
}

/// `name` as an SQL identifier.
pub(crate) fn quoted(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn schema_error(msg: String) -> rusqlite::Error {
    rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ERROR), Some(msg))
}

/// What a table needs to match the target.
enum TablePlan {
    Keep,
    Create,
    /// Columns the target has after all of the file's, each one `ADD COLUMN` can add.
    Add(Vec<Column>),
    /// Anything else (a column in the middle, another primary key): a new
    /// table, the rows copied, the old one dropped.
    Rebuild,
}

/// Makes `conn`'s tables, indexes and views those that `migrations` create on
/// an empty database, keeping every row. Tables the target lacks are left.
fn reconcile(conn: &Connection, migrations: &[Migration]) -> rusqlite::Result<()> {
    let target = Connection::open_in_memory()?;
    for m in migrations {
        m.apply(&target)?;
    }
    let objects = target
        .prepare("SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL ORDER BY rowid")?
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, String>(2)?)))?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let of = |kind: &'static str| objects.iter().filter(move |o| o.0 == kind).map(|o| (o.1.as_str(), o.2.as_str()));

    let mut plans = Vec::new();
    for (table, sql) in of("table") {
        let have = columns(conn, table)?;
        let want = columns(&target, table)?;
        let same_keys = have.is_empty() || keys(conn, table)? == keys(&target, table)?;
        let plan = if have.is_empty() {
            TablePlan::Create
        } else if have.starts_with(&want) && same_keys {
            // Columns past the target's were added by later migrations
            // (e.g. `steps::LOSS_SCHEMA`): this repair leaves them be.
            TablePlan::Keep
        } else if same_keys
            && want.starts_with(&have)
            && want[have.len()..].iter().all(|(_, _, notnull, dflt, pk)| *pk == 0 && (!notnull || dflt.is_some()))
        {
            TablePlan::Add(want[have.len()..].to_vec())
        } else {
            TablePlan::Rebuild
        };
        plans.push((table, sql, plan, have, want));
    }
    let mut views_differ = false;
    for (view, sql) in of("view") {
        views_differ |= schema_sql(conn, "view", view)?.as_deref() != Some(sql);
    }
    // Views are derived: when anything differs drop ours, change the tables,
    // create them again (a view naming a dropped table or a missing column
    // makes RENAME and ADD COLUMN fail). A file made by the current
    // migrations, or already reconciled, is left as it is.
    if views_differ || plans.iter().any(|p| !matches!(p.2, TablePlan::Keep)) {
        for (view, _) in of("view") {
            conn.execute_batch(&format!("DROP VIEW IF EXISTS {}", quoted(view)))?;
        }
    }
    // Deferred so that a table rebuilt under a referenced one checks at commit.
    conn.execute_batch("PRAGMA defer_foreign_keys = ON")?;
    for (table, sql, plan, have, want) in &plans {
        match plan {
            TablePlan::Keep => {}
            TablePlan::Create => conn.execute_batch(sql)?,
            TablePlan::Add(cols) => {
                for (name, ty, notnull, dflt, _) in cols {
                    let mut def = format!("ALTER TABLE {} ADD COLUMN {} {ty}", quoted(table), quoted(name));
                    if *notnull {
                        def.push_str(" NOT NULL");
                    }
                    if let Some(d) = dflt {
                        def.push_str(&format!(" DEFAULT {d}"));
                    }
                    conn.execute_batch(&def)?;
                }
            }
            TablePlan::Rebuild => rebuild(conn, table, sql, have, want)?,
        }
    }
    for (index, sql) in of("index") {
        match schema_sql(conn, "index", index)? {
            Some(s) if s == sql => {}
            Some(_) => conn.execute_batch(&format!("DROP INDEX {}; {sql}", quoted(index)))?,
            None => conn.execute_batch(sql)?,
        }
    }
    for (view, sql) in of("view") {
        if schema_sql(conn, "view", view)?.is_none() {
            conn.execute_batch(sql)?;
        }
    }
    Ok(())
}

/// Replaces `table` with one made by `sql` (its target CREATE TABLE), copying
/// the columns both have. A `label` the old table lacks is the one label steps
/// had before labels: `train`, on rows that have a step.
fn rebuild(conn: &Connection, table: &str, sql: &str, have: &[Column], want: &[Column]) -> rusqlite::Result<()> {
    let new = format!("{table}__reconciled");
    let rest = sql
        .strip_prefix("CREATE TABLE")
        .map(str::trim_start)
        .and_then(|s| s.strip_prefix(quoted(table).as_str()).or_else(|| s.strip_prefix(table)))
        .ok_or_else(|| schema_error(format!("cannot rename the CREATE TABLE of {table}: {sql}")))?;
    conn.execute_batch(&format!("CREATE TABLE {}{rest}", quoted(&new)))?;
    let had = |c: &str| have.iter().any(|h| h.0 == c);
    let (mut into, mut from) = (Vec::new(), Vec::new());
    for (name, ..) in want {
        if had(name) {
            into.push(quoted(name));
            from.push(quoted(name));
        } else if name == "label" && had("step") {
            into.push(quoted(name));
            from.push("CASE WHEN \"step\" IS NOT NULL THEN 'train' END".to_owned());
        }
    }
    conn.execute_batch(&format!(
        "INSERT INTO {new_q} ({}) SELECT {} FROM {old_q};
         DROP TABLE {old_q};
         ALTER TABLE {new_q} RENAME TO {old_q};",
        into.join(", "),
        from.join(", "),
        new_q = quoted(&new),
        old_q = quoted(table),
    ))
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
        self.join.join().unwrap_or_else(|payload| {
            let message = crate::panic_message(&*payload);
            Ok(WriterStats {
                first_error: Some(format!("the database writer panicked: {message}")),
                ..Default::default()
            })
        })
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
    // Counted once the transaction commits: a batch rolled back stored nothing.
    let (mut launches, mut steps) = (0, 0);
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
                    // A handle's first name, else a rename (see KERNELS_OVER_TIME):
                    // the consumer sends a handle's name again only when it changed.
                    let mut first = tx.prepare_cached(
                        "INSERT OR IGNORE INTO kernels(session_id, function, name, demangled_name, source)
                         VALUES (?1, ?2, ?3, ?4, ?5)",
                    )?;
                    let mut rename = tx.prepare_cached(
                        "INSERT OR IGNORE INTO kernel_renames(session_id, function, named_ns, name, demangled_name, source)
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                    )?;
                    for r in rows {
                        let params = params![session_id, i(r.function), r.name, r.demangled_name, r.source];
                        if first.execute(params)? == 0 {
                            rename.execute(params![
                                session_id,
                                i(r.function),
                                i(r.named_ns),
                                r.name,
                                r.demangled_name,
                                r.source
                            ])?;
                        }
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
                    launches += rows.len() as u64;
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
                    steps += rows.len() as u64;
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
    stats.launches += launches;
    stats.steps += steps;
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

    /// Migrations are appended, never edited (the upgrade fixtures below are
    /// built from today's first migrations, and files written by older
    /// profilers only get the migrations they lack): each SQL migration's text
    /// is pinned. A new migration appends its hash; the message gives it.
    #[test]
    fn migrations_are_append_only() {
        const FROZEN: [u64; 6] = [
            0x8aee_e93b_06de_c1a5,
            0xcbca_4468_d4a3_de19,
            0xb9bd_525d_e831_4c63,
            0x1668_b8b2_e3c9_65cd,
            0xa148_fd34_7523_097c,
            0x6309_9958_b308_0ccd,
        ];
        let fnv1a = |s: &str| {
            s.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
        };
        let hashes: Vec<u64> = MIGRATIONS
            .iter()
            .filter_map(|m| match m {
                Migration::Sql(sql) => Some(fnv1a(sql)),
                Migration::Code(_) => None,
            })
            .collect();
        assert_eq!(
            hashes[..FROZEN.len()],
            FROZEN,
            "an SQL migration was edited in place: append a new migration instead (hashes now: {hashes:#x?})"
        );
    }

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

    /// A batch whose transaction is rolled back stored nothing: it is counted
    /// as failed, not as stored, and `stored_launches` says what is there.
    #[test]
    fn a_rolled_back_batch_is_not_counted_as_stored() {
        let (_d, p) = temp_db();
        let store = Store::open(&p).expect("open");
        let id = store.begin_session(&start()).expect("session");
        // tid 666's rows make the insert fail, as a full disk would.
        store
            .conn
            .execute_batch(
                "CREATE TRIGGER fail BEFORE INSERT ON launches WHEN NEW.tid = 666 BEGIN SELECT RAISE(ABORT, 'boom'); END;",
            )
            .expect("trigger");
        let launch = |tid| LaunchRow {
            ts_ns: 200,
            tid,
            api: LaunchApi::CuLaunchKernel,
            function: 1,
            grid: [1, 1, 1],
            block: [1, 1, 1],
            shared_mem_bytes: 0,
            stream: 0,
            step: None,
        };
        let w = store.spawn_writer(id);
        w.send(StoreMsg::Launches(vec![launch(7), launch(7)]));
        // Let the first batch commit on its own before the failing one.
        std::thread::sleep(std::time::Duration::from_millis(100));
        w.send(StoreMsg::Launches(vec![launch(8), launch(666), launch(8)]));
        let end = SessionEnd {
            ended_ns: 2000,
            end_reason: "x".into(),
            lost_events: 0,
            total_launches: 5,
            unmatched_returns: 0,
        };
        let stats = w.finish(end, Vec::new()).expect("finish");
        assert_eq!((stats.launches, stats.failed_rows), (2, 3), "{stats:?}");
        assert!(stats.first_error.as_deref().is_some_and(|e| e.contains("boom")), "{stats:?}");
        let conn = Connection::open(&p).expect("reopen");
        let (rows, stored): (i64, i64) = conn
            .query_row(
                "SELECT (SELECT count(*) FROM launches), stored_launches FROM sessions WHERE id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .expect("q");
        assert_eq!((rows, stored), (2, 2));
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

    /// Migration 0 as 489e641–24f72b4 wrote it (then the only one: user_version 1).
    const CORE_489E641: &str = r#"
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
CREATE TABLE apis (
    id    INTEGER PRIMARY KEY,
    name  TEXT NOT NULL UNIQUE,
    layer TEXT NOT NULL
);
CREATE TABLE steps (
    session_id    INTEGER NOT NULL REFERENCES sessions(id),
    step          INTEGER NOT NULL,
    tid           INTEGER NOT NULL,
    start_ns      INTEGER NOT NULL,
    end_ns        INTEGER,
    duration_ns   INTEGER,
    inter_step_ns INTEGER,
    launches      INTEGER,
    PRIMARY KEY (session_id, step)
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
    step             INTEGER
);
CREATE VIEW launches_named AS
    SELECT l.*, a.name AS api_name, a.layer AS api_layer
    FROM launches l JOIN apis a ON a.id = l.api;
"#;

    /// What 5f33ae8 added to migration 0 (migration 1, GPU, was empty there).
    const CAPABILITIES_5F33AE8: &str = r#"
CREATE TABLE capabilities (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    source     TEXT    NOT NULL,
    metric     TEXT    NOT NULL,
    available  INTEGER NOT NULL,
    reason     TEXT,
    UNIQUE (session_id, source, metric)
);
"#;

    /// Migration 1's `step_gpu` and view as f72751d–6bc0469^ wrote them (no label).
    const STEP_GPU_F72751D: &str = r#"
CREATE TABLE step_gpu (
    session_id                   INTEGER NOT NULL,
    step                         INTEGER NOT NULL,
    gpu                          INTEGER NOT NULL,
    energy_j                     REAL,
    energy_error_j               REAL,
    avg_power_w                  REAL,
    below_resolution             INTEGER,
    utilization_gpu_start_pct    REAL,
    utilization_gpu_end_pct      REAL,
    memory_used_start_mib        REAL,
    memory_used_end_mib          REAL,
    memory_free_start_mib        REAL,
    memory_free_end_mib          REAL,
    utilization_memory_start_pct REAL,
    utilization_memory_end_pct   REAL,
    fan_speed_end_pct            REAL,
    temperature_gpu_end_c        REAL,
    temperature_memory_end_c     REAL,
    PRIMARY KEY (session_id, step, gpu)
);
CREATE VIEW gpu_stats_monitor AS
    SELECT session_id, step, 'GPU_' || gpu || '/utilization.gpu - percent' AS metric, utilization_gpu_start_pct AS value, 'batch_start' AS phase FROM step_gpu
    UNION ALL SELECT session_id, step, 'GPU_' || gpu || '/memory.used - MB', memory_used_start_mib, 'batch_start' FROM step_gpu
    UNION ALL SELECT session_id, step, 'GPU_' || gpu || '/memory.free - MB', memory_free_start_mib, 'batch_start' FROM step_gpu
    UNION ALL SELECT session_id, step, 'GPU_' || gpu || '/utilization.memory - percent', utilization_memory_start_pct, 'batch_start' FROM step_gpu
    UNION ALL SELECT session_id, step, 'GPU_' || gpu || '/utilization.gpu - percent', utilization_gpu_end_pct, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, step, 'GPU_' || gpu || '/memory.used - MB', memory_used_end_mib, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, step, 'GPU_' || gpu || '/memory.free - MB', memory_free_end_mib, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, step, 'GPU_' || gpu || '/utilization.memory - percent', utilization_memory_end_pct, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, step, 'GPU_' || gpu || '/fan.speed - percent', fan_speed_end_pct, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, step, 'GPU_' || gpu || '/temperature.gpu - °C', temperature_gpu_end_c, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, step, 'GPU_' || gpu || '/temperature.memory - °C', temperature_memory_end_c, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, step, 'batch_time/intra_step (ms)', duration_ns / 1e6, 'batch_end' FROM steps WHERE end_ns IS NOT NULL
    UNION ALL SELECT session_id, step, 'batch_time/inter_step (ms)', inter_step_ns / 1e6, 'batch_start' FROM steps WHERE inter_step_ns IS NOT NULL;
"#;

    fn sql_of(m: &Migration) -> &'static str {
        match m {
            Migration::Sql(sql) => sql,
            Migration::Code(_) => panic!("not SQL"),
        }
    }

    /// Migration 1 as f72751d wrote it: today's with the old `step_gpu` and view.
    fn gpu_f72751d(c: &Connection) {
        c.execute_batch(sql_of(&MIGRATIONS[1])).expect("gpu");
        c.execute_batch("DROP VIEW gpu_stats_monitor; DROP TABLE step_gpu;").expect("drop");
        c.execute_batch(STEP_GPU_F72751D).expect("old step_gpu");
    }

    /// Migration 0 as aa0a811–55e0eb6^ wrote it: today's without `syncs`,
    /// `kernels` and `steps.sync_wait_ns`.
    fn core_aa0a811(c: &Connection) {
        core_55e0eb6(c);
        c.execute_batch("DROP TABLE syncs; ALTER TABLE steps DROP COLUMN sync_wait_ns;").expect("older");
    }

    /// Migration 0 as 55e0eb6–9936331^ wrote it: today's without `kernels`.
    fn core_55e0eb6(c: &Connection) {
        c.execute_batch(sql_of(&MIGRATIONS[0])).expect("core");
        c.execute_batch("DROP TABLE kernels").expect("drop");
    }

    /// A file a historical profiler could have left: what, user_version, schema.
    type Shape = (&'static str, i64, fn(&Connection));

    fn historical_shapes() -> Vec<Shape> {
        vec![
            ("489e641 (v1)", 1, |c| c.execute_batch(CORE_489E641).expect("core")),
            ("5f33ae8 (v2, GPU migration empty)", 2, |c| {
                c.execute_batch(CORE_489E641).expect("core");
                c.execute_batch(CAPABILITIES_5F33AE8).expect("capabilities");
            }),
            ("f72751d (v2)", 2, |c| {
                c.execute_batch(CORE_489E641).expect("core");
                c.execute_batch(CAPABILITIES_5F33AE8).expect("capabilities");
                gpu_f72751d(c);
            }),
            ("aa0a811 (v4, unlabelled step_gpu)", 4, |c| {
                core_aa0a811(c);
                gpu_f72751d(c);
                c.execute_batch(sql_of(&MIGRATIONS[2])).expect("rapl");
                c.execute_batch(sql_of(&MIGRATIONS[3])).expect("system");
            }),
            ("6bc0469 (v4, the shape of demo.db)", 4, |c| {
                core_aa0a811(c);
                for m in &MIGRATIONS[1..4] {
                    c.execute_batch(sql_of(m)).expect("samplers");
                }
            }),
            ("55e0eb6 (v4, no kernels)", 4, |c| {
                core_55e0eb6(c);
                for m in &MIGRATIONS[1..4] {
                    c.execute_batch(sql_of(m)).expect("samplers");
                }
            }),
        ]
    }

    /// Writes an old file: its schema, the `apis` rows but the last (standing
    /// for a variant added later), and a session with one step, launch, and
    /// GPU step row in the columns every version has.
    fn write_old_file(path: &Path, version: i64, schema: fn(&Connection)) {
        let c = Connection::open(path).expect("create");
        schema(&c);
        for api in &LaunchApi::ALL[..LaunchApi::ALL.len() - 1] {
            let layer = api.layer().as_str();
            c.execute(
                "INSERT INTO apis(id, name, layer) VALUES (?1, ?2, ?3)",
                params![*api as u32, api.symbol(), layer],
            )
            .expect("apis");
        }
        c.execute_batch(
            "INSERT INTO sessions(id, pid, command, mode, launch_mode, started_ns, ended_ns, end_reason, unix_offset_ns,
                                  profiler_version)
                 VALUES (1, 9, 'old', 'run', 'all', 10, 90, 'target-exited', 0, '0.0.1');
             INSERT INTO steps(session_id, step, tid, start_ns, end_ns, duration_ns) VALUES (1, 0, 9, 20, 50, 30);
             INSERT INTO launches(session_id, ts_ns, tid, api, function, grid_x, grid_y, grid_z, block_x, block_y,
                                  block_z, shared_mem_bytes, stream, step)
                 VALUES (1, 30, 9, 1, 77, 1, 1, 1, 1, 1, 1, 0, 0, 0);",
        )
        .expect("old rows");
        let labelled = |table| columns(&c, table).expect("columns").iter().any(|col| col.0 == "label");
        if labelled("launches") {
            // As a profiler with labels wrote them.
            c.execute_batch("UPDATE launches SET label = 'train'").expect("label");
        }
        let gpu = match (columns(&c, "step_gpu").expect("columns").is_empty(), labelled("step_gpu")) {
            (true, _) => "",
            (false, false) => "INSERT INTO step_gpu(session_id, step, gpu, energy_j) VALUES (1, 0, 0, 5.0)",
            (false, true) => {
                "INSERT INTO step_gpu(session_id, label, step, gpu, energy_j) VALUES (1, 'train', 0, 0, 5.0)"
            }
        };
        c.execute_batch(gpu).expect("gpu");
        c.pragma_update(None, "user_version", version).expect("version");
    }

    /// Writes a session through the normal API with everything the old files
    /// could not hold: two labels at the same step, sync waits, syncs, kernels,
    /// labelled launches and GPU step rows.
    fn write_new_session(path: &Path) -> i64 {
        let store = Store::open(path).expect("open");
        let id = store.begin_session(&start()).expect("session");
        let w = store.spawn_writer(id);
        let step = |label: &str, sync_wait_ns| StepRow {
            sync_wait_ns,
            label: label.into(),
            step: 0,
            tid: 7,
            start_ns: 100,
            end_ns: Some(250),
            inter_step_ns: None,
            launches: Some(1),
        };
        w.send(StoreMsg::Steps(vec![step("train", Some(40)), step("eval", None)]));
        w.send(StoreMsg::Syncs(vec![SyncRow {
            tid: 7,
            api: "cuCtxSynchronize",
            start_ns: 200,
            end_ns: 240,
            step: Some(("train", 0)),
        }]));
        w.send(StoreMsg::Kernels(vec![KernelRow {
            function: 0x1234,
            named_ns: 0,
            name: "_Z4axpyPf".into(),
            demangled_name: Some("axpy(float*)".into()),
            source: "cuModuleGetFunction",
        }]));
        w.send(StoreMsg::Launches(vec![LaunchRow {
            ts_ns: 200,
            tid: 7,
            api: LaunchApi::CudaGraphLaunchPtsz,
            function: 0x1234,
            grid: [1, 1, 1],
            block: [32, 1, 1],
            shared_mem_bytes: 0,
            stream: 0,
            step: Some(("train", 0)),
        }]));
        w.send(StoreMsg::Insert(Insert {
            sql: "INSERT INTO step_gpu(session_id, label, step, gpu, energy_j) VALUES (?1, ?2, ?3, ?4, ?5)",
            rows: vec![
                vec![Value::Text("train".into()), Value::Integer(0), Value::Integer(0), Value::Real(1.5)],
                vec![Value::Text("eval".into()), Value::Integer(0), Value::Integer(0), Value::Real(0.5)],
            ],
        }));
        w.send(StoreMsg::Capability(Capability {
            source: "nvml".into(),
            metric: "energy".into(),
            available: true,
            reason: None,
        }));
        let end = SessionEnd {
            ended_ns: 2000,
            end_reason: "target-exited".into(),
            lost_events: 0,
            total_launches: 1,
            unmatched_returns: 0,
        };
        let stats = w.finish(end, Vec::new()).expect("finish");
        assert_eq!((stats.failed_rows, stats.first_error), (0, None));
        id
    }

    /// Per table: columns, keys and foreign keys; per view and index: its SQL.
    fn schema_of(conn: &Connection) -> Vec<String> {
        let objects = conn
            .prepare("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' ORDER BY type, name")
            .expect("q")
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, Option<String>>(2)?)))
            .expect("q")
            .collect::<rusqlite::Result<Vec<_>>>()
            .expect("q");
        objects
            .into_iter()
            .map(|(kind, name, sql)| {
                if kind == "table" {
                    let fks = conn
                        .prepare(r#"SELECT "from", "table", "to" FROM pragma_foreign_key_list(?1) ORDER BY id, seq"#)
                        .expect("q")
                        .query_map([&name], |r| {
                            Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, String>(2)?))
                        })
                        .expect("q")
                        .collect::<rusqlite::Result<Vec<_>>>()
                        .expect("q");
                    let cols = columns(conn, &name).expect("columns");
                    let keys = keys(conn, &name).expect("keys");
                    format!("table {name} {cols:?} {keys:?} {fks:?}")
                } else {
                    format!("{kind} {name} {sql:?}")
                }
            })
            .collect()
    }

    fn count(conn: &Connection, sql: &str) -> i64 {
        conn.query_row(sql, [], |r| r.get(0)).unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    #[test]
    fn upgrades_every_historical_shape_to_the_fresh_schema() {
        let (_fresh_dir, fresh) = temp_db();
        assert_eq!(write_new_session(&fresh), 1);
        let fresh_schema = schema_of(&Connection::open(&fresh).expect("open"));

        for (what, version, schema) in historical_shapes() {
            let (_d, p) = temp_db();
            write_old_file(&p, version, schema);
            assert_eq!(write_new_session(&p), 2, "{what}");
            let c = Connection::open(&p).expect("reopen");
            let v: i64 = c.pragma_query_value(None, "user_version", |r| r.get(0)).expect("q");
            assert_eq!(v, SCHEMA_VERSION, "{what}");
            assert_eq!(schema_of(&c), fresh_schema, "{what}");

            // The new session, all of it.
            assert_eq!(count(&c, "SELECT count(*) FROM steps WHERE session_id = 2"), 2, "{what}");
            assert_eq!(
                count(&c, "SELECT sync_wait_ns FROM steps WHERE session_id = 2 AND label = 'train' AND step = 0"),
                40,
                "{what}"
            );
            assert_eq!(
                count(&c, "SELECT count(*) FROM syncs WHERE session_id = 2 AND label = 'train' AND end_ns = 240"),
                1,
                "{what}"
            );
            assert_eq!(count(&c, "SELECT count(*) FROM kernels WHERE session_id = 2 AND function = 4660"), 1, "{what}");
            assert_eq!(count(&c, "SELECT count(*) FROM step_gpu WHERE session_id = 2"), 2, "{what}");
            assert_eq!(count(&c, "SELECT count(*) FROM capabilities WHERE session_id = 2"), 1, "{what}");
            // The API the old file had no row for is named, so the launch is in the view.
            assert_eq!(
                count(
                    &c,
                    "SELECT count(*) FROM launches_named JOIN steps USING (session_id, label, step)
                     WHERE session_id = 2 AND api_name = 'cudaGraphLaunch_ptsz'"
                ),
                1,
                "{what}"
            );
            assert_eq!(count(&c, "SELECT count(*) FROM apis"), LaunchApi::ALL.len() as i64, "{what}");
            assert_eq!(count(&c, "SELECT count(*) FROM gpu_stats_monitor WHERE session_id = 2"), 2 * 11 + 2, "{what}");

            // The old session kept, with the label steps had before labels.
            assert_eq!(count(&c, "SELECT count(*) FROM sessions WHERE id = 1 AND command = 'old'"), 1, "{what}");
            assert_eq!(
                count(
                    &c,
                    "SELECT count(*) FROM launches_named JOIN steps USING (session_id, label, step)
                     WHERE session_id = 1 AND label = 'train' AND duration_ns = 30 AND api_name = 'cuLaunchKernel'"
                ),
                1,
                "{what}"
            );
            let old_gpu_rows = count(&c, "SELECT count(*) FROM step_gpu WHERE session_id = 1 AND label = 'train'");
            assert_eq!(old_gpu_rows, i64::from(!what.starts_with("5f33ae8") && !what.starts_with("489e641")), "{what}");

            // Running the repair again changes nothing.
            let before: i64 = c.pragma_query_value(None, "schema_version", |r| r.get(0)).expect("q");
            reconcile_first_four(&c).expect("again");
            let after: i64 = c.pragma_query_value(None, "schema_version", |r| r.get(0)).expect("q");
            assert_eq!(before, after, "{what}");
        }
    }

    #[test]
    fn the_repair_is_a_no_op_on_a_file_made_by_the_current_migrations() {
        let c = Connection::open_in_memory().expect("open");
        for m in &MIGRATIONS[..4] {
            m.apply(&c).expect("migration");
        }
        let objects = |c: &Connection| {
            c.prepare("SELECT type, name, sql FROM sqlite_master ORDER BY rowid")
                .expect("q")
                .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, Option<String>>(2)?)))
                .expect("q")
                .collect::<rusqlite::Result<Vec<_>>>()
                .expect("q")
        };
        let (before, version) = (objects(&c), c.pragma_query_value(None, "schema_version", |r| r.get::<_, i64>(0)));
        reconcile_first_four(&c).expect("repair");
        assert_eq!(objects(&c), before);
        assert_eq!(c.pragma_query_value(None, "schema_version", |r| r.get::<_, i64>(0)), version);
    }

    #[test]
    fn opening_a_current_file_again_writes_nothing() {
        let (_d, p) = temp_db();
        drop(Store::open(&p).expect("create"));
        // `data_version` moves when another connection commits a change.
        let c = Connection::open(&p).expect("open");
        let version = |c: &Connection| c.pragma_query_value(None, "data_version", |r| r.get::<_, i64>(0)).expect("q");
        let before = version(&c);
        drop(Store::open(&p).expect("reopen"));
        assert_eq!(version(&c), before, "opening an up-to-date file wrote to it");
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
