//! The only SQLite writer and owner of every table: the schema and its
//! migrations ([`schema`]), the rows the rest of the profiler sends
//! ([`rows`]), the batched writer thread ([`writer`]) and the session's last
//! transaction, where per-step figures are derived ([`finish`]); and the one
//! way readers open a profile ([`open_for_reading`]); profiles merged into
//! one new file ([`merge_into`]).
pub mod budget;
mod collectives;
mod copies;
mod cpu_samples;
mod finish;
mod gemms;
mod jax;
mod job;
mod merge;
mod off_cpu;
pub mod rows;
mod schema;
mod step_flops;
mod writer;

use std::{
    path::{Path, PathBuf},
    sync::mpsc::sync_channel,
};

use rusqlite::{Connection, DatabaseName, OpenFlags, backup::Backup};

use self::schema::{classify, migrate, version_of};
pub use self::{
    collectives::NCCL_KIND,
    gemms::{GemmRow, StepGemms},
    merge::{MergeInput, MergeSummary, merge_into},
    rows::{
        AtFinish, Capability, CollectiveRow, CopyRow, CpuSampleRow, CpuSampling, FrameRow, GpmReadings, GpuRow,
        GpuSampleRow, JitCallRow, KernelRow, LaunchRow, Losses, OffCpuRow, ProbedFileRow, RaplSampleRow, RegionRow,
        SessionEnd, SessionStart, StackRow, StepRow, SyncRow, SystemSampleRow,
    },
    schema::{SCHEMA_VERSION, quoted},
    writer::{RowSender, StoreWriter},
};

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

/// The profile at `path` and the SQLite side files next to it (`-wal`, `-shm`).
pub fn profile_files(path: &Path) -> [PathBuf; 3] {
    [path.to_owned(), side_file(path, "-wal"), side_file(path, "-shm")]
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

/// Opens the profile at `path` for reading at [`SCHEMA_VERSION`], never
/// writing the file (a running profiler may be writing it): a current file is
/// opened read-only; an older one is copied into memory and migrated there; a
/// newer, foreign or corrupt one is refused. An empty SQLite file is
/// [`StoreError::Foreign`]: there is nothing to read in it.
pub fn open_for_reading(path: &Path) -> Result<Connection, StoreError> {
    let classify = classify(path);
    let file = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(&classify)?;
    let version = version_of(&file, path)?;
    if version == 0 {
        return Err(StoreError::Foreign { path: path.to_owned() });
    }
    if version == SCHEMA_VERSION {
        return Ok(file);
    }
    let mut memory = Connection::open_in_memory()?;
    {
        // All pages in one step: one read transaction, one consistent copy.
        let backup = Backup::new(&file, &mut memory)?;
        while backup.step(-1).map_err(&classify)? != rusqlite::backup::StepResult::Done {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    drop(file);
    migrate(&memory, version).map_err(&classify)?;
    Ok(memory)
}

impl Store {
    /// Opens (or creates) `path`, checks it is ours, creates or migrates the schema.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let created = !path.exists();
        let conn = Connection::open(path).map_err(|source| StoreError::Open { path: path.to_owned(), source })?;
        let classify = classify(path);
        conn.pragma_update(None, "journal_mode", "WAL").map_err(&classify)?;
        if conn.is_readonly(DatabaseName::Main).unwrap_or(true) {
            return Err(StoreError::Open {
                path: path.to_owned(),
                source: rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_READONLY),
                    Some("read-only".into()),
                ),
            });
        }
        conn.pragma_update(None, "synchronous", "NORMAL").map_err(&classify)?;
        let version = version_of(&conn, path)?;
        migrate(&conn, version).map_err(&classify)?;
        // Now, not at the end: a profiler that is killed leaves the user's file.
        if created {
            crate::ownership::give_to_invoking_user(&profile_files(path));
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
        Ok(job::insert_session(&self.conn, s)?)
    }

    /// Moves the connection to a writer thread, with no size budget.
    #[cfg(test)]
    pub fn spawn_writer(self, session_id: i64) -> StoreWriter {
        self.spawn_writer_with(session_id, budget::BudgetConfig::unlimited())
    }

    /// Moves the connection to a writer thread that keeps to `budget`.
    pub fn spawn_writer_with(self, session_id: i64, budget: budget::BudgetConfig) -> StoreWriter {
        let (tx, rx) = sync_channel::<StoreMsg>(256);
        let state = std::sync::Arc::<budget::BudgetState>::default();
        let gate = budget::Budget::new(budget, &self.path, state.clone());
        if let Err(e) = self.conn.pragma_update(None, "journal_size_limit", gate.wal_limit() as i64) {
            log::warn!("cannot limit the -wal file's size: {e}");
        }
        let join = std::thread::Builder::new()
            .name("profiler-store".into())
            .spawn(move || {
                let stats = writer::write_loop(self.conn, session_id, rx, gate);
                // After the connection has closed (see `session_lock`).
                drop(self.session_lock);
                stats
            })
            .expect("spawning a thread only fails when the system is out of resources");
        StoreWriter { tx, join, budget: state }
    }
}

/// What the writer is sent.
pub enum StoreMsg {
    Capability(Capability),
    Launches(Vec<LaunchRow>),
    Steps(Vec<StepRow>),
    Syncs(Vec<SyncRow>),
    /// PyTorch `record_function` regions.
    Regions(Vec<RegionRow>),
    /// NCCL calls.
    Collectives(Vec<CollectiveRow>),
    /// Copies and memsets (`--launches all`).
    Copies(Vec<CopyRow>),
    /// Calls of `jax.jit` functions.
    JitCalls(Vec<JitCallRow>),
    /// Times traced threads were off their CPU (`--launches all`).
    OffCpu(Vec<OffCpuRow>),
    /// CPU samples (`--cpu-sample`), after the frames and stacks they name.
    CpuSamples(Vec<CpuSampleRow>),
    /// Frames and stacks first seen; never stopped by the budget (small, and
    /// what the samples already stored name).
    CpuStacks(Vec<FrameRow>, Vec<StackRow>),
    Kernels(Vec<KernelRow>),
    ProbedFile(ProbedFileRow),
    /// The sampled GPUs, once at the start.
    Gpus(Vec<GpuRow>),
    /// GPUs (logical numbers) the target was seen using.
    GpusUsedByTarget(Vec<u32>),
    GpuSamples(Vec<GpuSampleRow>),
    RaplSamples(Vec<RaplSampleRow>),
    SystemSamples(Vec<SystemSampleRow>),
    /// GEMM calls on cuBLAS/cuBLASLt (`--launches all` only).
    Gemms(Vec<GemmRow>),
    /// Every step's GEMM sums, once, after the steps (see `gemms::write_step_gemms`).
    StepGemms(Vec<StepGemms>),
    /// The GEMM sums of steps that ended, after their rows (the consumer
    /// keeps no step's sums past its end); `StepGemms` still comes at the end.
    StepGemmsSoFar(Vec<StepGemms>),
    /// The last message: the session's end and what to derive then.
    Finish(SessionEnd, Vec<AtFinish>),
    /// A job's traced process other than the first: its session row, made on
    /// the first message for its pid, updated (command, exe, ranks) on later
    /// ones (after an `exec`). See [`job`].
    Process(Box<SessionStart>),
    /// Rows of that process's session (sent through [`writer::RowSender::for_process`]).
    ForProcess(u32, Box<StoreMsg>),
    /// That process's session ended; its per-step figures are derived at the
    /// job's `Finish`, from the first session's samples.
    EndProcess(u32, SessionEnd, Vec<AtFinish>),
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
    /// Of `launches`, those of a job's other processes' sessions.
    pub member_launches: u64,
}

/// A u64 as SQLite's integer. Handles and addresses are below 2^63 on every
/// ABI we probe; wrapping keeps the bits if one ever is not.
pub(super) fn i(v: u64) -> i64 {
    v as i64
}

#[cfg(test)]
pub(crate) use schema::history;

#[cfg(test)]
pub(crate) mod testing {
    //! Fixtures shared by the store's tests.
    use std::path::PathBuf;

    use super::{LaunchRow, SessionStart, StepRow};

    /// Step 0 of `train` on thread 7, 100–250 ns, one launch.
    pub(crate) fn step() -> StepRow {
        StepRow {
            sync_wait_ns: None,
            label: "train".into(),
            step: 0,
            tid: 7,
            start_ns: 100,
            end_ns: Some(250),
            inter_step_ns: None,
            launches: Some(1),
            phases: None,
            sched: None,
            copies: Default::default(),
        }
    }

    /// A `cuLaunchKernel` of handle 1 at 200 ns by thread 7, in no step;
    /// tests change what they look at with struct-update syntax.
    pub(crate) fn launch() -> LaunchRow {
        LaunchRow {
            ts_ns: 200,
            tid: 7,
            api: profiler_common::LaunchApi::CuLaunchKernel,
            function: 1,
            grid: [1, 1, 1],
            block: [1, 1, 1],
            shared_mem_bytes: 0,
            stream: 0,
            step: None,
        }
    }

    pub(crate) fn temp_db() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("p.db");
        (dir, p)
    }

    pub(crate) fn start() -> SessionStart {
        SessionStart {
            pid: 42,
            command: "trainer --steps 2".into(),
            exe: Some("/bin/trainer".into()),
            mode: "attach",
            launch_mode: "all",
            step_source: Some("train_step".into()),
            started_ns: 1000,
            unix_offset_ns: 5,
            hostname: None,
            kernel_release: None,
            job: "job-1".into(),
            rank: None,
            local_rank: None,
            world_size: None,
            parent_pid: None,
        }
    }
}

#[cfg(test)]
mod tests {

    use super::{history::*, testing::*, *};

    #[test]
    fn writes_a_session_and_keeps_old_ones() {
        let (_d, p) = temp_db();
        for round in 0..2 {
            let store = Store::open(&p).expect("open");
            let id = store.begin_session(&start()).expect("session");
            assert_eq!(id, round + 1);
            let w = store.spawn_writer(id);
            w.send(StoreMsg::Steps(vec![testing::step()]));
            w.send(StoreMsg::Launches(vec![LaunchRow {
                function: 0x1234,
                grid: [1, 2, 3],
                block: [4, 5, 6],
                step: Some(("train", 0)),
                ..testing::launch()
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
        let launch = |tid| LaunchRow { tid, ..testing::launch() };
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

    /// Reading never writes the file: a current one is opened read-only, an
    /// older one is migrated in memory to the fresh schema, old rows kept.
    #[test]
    fn readers_get_the_current_schema_and_the_file_is_untouched() {
        let (_d, fresh) = temp_db();
        drop(Store::open(&fresh).expect("create"));
        let current = open_for_reading(&fresh).expect("current file");
        assert!(current.is_readonly(DatabaseName::Main).expect("q"), "a current file is opened read-only");
        let names = |c: &Connection| -> Vec<(String, String)> {
            c.prepare("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' ORDER BY type, name")
                .expect("q")
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                .expect("q")
                .collect::<rusqlite::Result<_>>()
                .expect("q")
        };
        let want = names(&current);
        for (what, version, schema) in historical_shapes() {
            let (_d, p) = temp_db();
            write_old_file(&p, version, schema);
            let bytes = std::fs::read(&p).expect("read");
            let c = open_for_reading(&p).expect(what);
            assert_eq!(names(&c), want, "{what}");
            let v: i64 = c.pragma_query_value(None, "user_version", |r| r.get(0)).expect("q");
            assert_eq!(v, SCHEMA_VERSION, "{what}");
            let (label, step_source): (String, Option<String>) = c
                .query_row(
                    "SELECT label, step_source FROM steps JOIN sessions s ON s.id = session_id WHERE session_id = 1",
                    [],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .expect(what);
            assert_eq!((label.as_str(), step_source), ("train", None), "{what}");
            drop(c);
            assert_eq!(std::fs::read(&p).expect("read"), bytes, "{what}: the file was written");
        }
    }

    #[test]
    fn readers_refuse_corrupt_foreign_empty_and_newer_files() {
        let (_d, p) = temp_db();
        std::fs::write(&p, vec![0x42u8; 8192]).expect("write");
        assert!(matches!(open_for_reading(&p), Err(StoreError::NotADatabase { .. })));
        std::fs::remove_file(&p).expect("rm");
        Connection::open(&p).expect("create").execute_batch("CREATE TABLE other(x)").expect("create");
        assert!(matches!(open_for_reading(&p), Err(StoreError::Foreign { .. })));
        std::fs::remove_file(&p).expect("rm");
        drop(Connection::open(&p).expect("create"));
        assert!(matches!(open_for_reading(&p), Err(StoreError::Foreign { .. })), "an empty file has no profile");
        Connection::open(&p).expect("open").pragma_update(None, "user_version", 99).expect("set");
        assert!(matches!(open_for_reading(&p), Err(StoreError::TooNew { found: 99, .. })));
    }
}
