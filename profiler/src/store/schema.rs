//! The profile's schema: the migrations in order (`migrations/NNNN_*.sql`,
//! append-only), the repair that reconciles files written while the first four
//! were still being edited, and the one function that brings a database to
//! [`SCHEMA_VERSION`] or refuses it — for the writer and for readers alike.
//!
//! The runner is our own, not `rusqlite_migration`: migration 4 is a repair
//! that compares the file with what migrations 0–3 create on an empty database
//! and rebuilds tables to match, which that crate's `M::up`/hook model would
//! still leave hand-written here; its `user_version` bookkeeping is the rest,
//! and is ten lines.
use std::path::Path;

use profiler_common::LaunchApi;
use rusqlite::{Connection, ErrorCode, params};

use super::StoreError;

/// Schema changes in order; `PRAGMA user_version` is how many are applied.
/// Append, never edit (the test `migrations_are_append_only` pins each SQL
/// one): a database written by an older profiler gets the rest.
/// (Migrations 0–3 were edited in place anyway; migration 4 repairs that, see
/// [`reconcile_first_four`]. Editing 0–3 again would reach fresh files only.)
pub(super) const MIGRATIONS: &[Migration] = &[
    Migration::Sql(include_str!("migrations/0000_core.sql")),
    Migration::Sql(include_str!("migrations/0001_gpu.sql")),
    Migration::Sql(include_str!("migrations/0002_rapl.sql")),
    // Its view reads `step_energy`: after the RAPL migration.
    Migration::Sql(include_str!("migrations/0003_system.sql")),
    Migration::Code(reconcile_first_four),
    Migration::Sql(include_str!("migrations/0005_losses.sql")),
    Migration::Sql(include_str!("migrations/0006_kernel_renames.sql")),
    Migration::Sql(include_str!("migrations/0007_probed_files_and_step_source.sql")),
    Migration::Sql(include_str!("migrations/0008_regions.sql")),
    Migration::Sql(include_str!("migrations/0009_jobs_and_collectives.sql")),
    Migration::Sql(include_str!("migrations/0010_flops.sql")),
    Migration::Sql(include_str!("migrations/0011_gpm_and_flops_metric.sql")),
    Migration::Sql(include_str!("migrations/0012_gemm_types.sql")),
    Migration::Sql(include_str!("migrations/0013_sched_and_copies.sql")),
    Migration::Sql(include_str!("migrations/0014_jax.sql")),
    Migration::Sql(include_str!("migrations/0015_budget.sql")),
    Migration::Sql(include_str!("migrations/0016_off_cpu.sql")),
    Migration::Sql(include_str!("migrations/0017_cpu_samples.sql")),
    Migration::Sql(include_str!("migrations/0018_sampler_cost.sql")),
];

/// One schema change.
pub(super) enum Migration {
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

/// Turns a SQLite error about the file at `path` into the error a user can act on.
pub(super) fn classify(path: &Path) -> impl Fn(rusqlite::Error) -> StoreError + '_ {
    move |source: rusqlite::Error| match source.sqlite_error_code() {
        Some(ErrorCode::NotADatabase) => StoreError::NotADatabase { path: path.to_owned(), source },
        Some(ErrorCode::CannotOpen | ErrorCode::ReadOnly | ErrorCode::PermissionDenied) => {
            StoreError::Open { path: path.to_owned(), source }
        }
        _ => StoreError::Sql(source),
    }
}

/// The schema version of the database `conn` opened at `path`, if this
/// profiler can bring it to [`SCHEMA_VERSION`]: a file from a newer profiler,
/// or a SQLite database with tables but no version, is refused. Reads only.
pub(super) fn version_of(conn: &Connection, path: &Path) -> Result<i64, StoreError> {
    let classify = classify(path);
    let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0)).map_err(&classify)?;
    if version > SCHEMA_VERSION {
        return Err(StoreError::TooNew { path: path.to_owned(), found: version });
    }
    if version == 0 {
        let tables: i64 = conn.query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0)).map_err(&classify)?;
        if tables > 0 {
            return Err(StoreError::Foreign { path: path.to_owned() });
        }
    }
    Ok(version)
}

/// Brings `conn`, at schema version `from` (see [`version_of`]), to
/// [`SCHEMA_VERSION`] in one transaction, and adds the `apis` rows it lacks.
/// A current file is only read.
pub(super) fn migrate(conn: &Connection, from: i64) -> rusqlite::Result<()> {
    let tx = conn.unchecked_transaction()?;
    for migration in MIGRATIONS.iter().skip(from as usize) {
        migration.apply(&tx)?;
    }
    fill_apis(&tx)?;
    if from < SCHEMA_VERSION {
        tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
    }
    tx.commit()
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
pub fn quoted(name: &str) -> String {
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

#[cfg(test)]
pub(crate) mod history {
    //! Files historical profilers could have left, for the upgrade tests.
    use std::path::Path;

    use profiler_common::LaunchApi;
    use rusqlite::{Connection, params};

    use super::{MIGRATIONS, Migration, columns};

    /// Migration 0 as 489e641–24f72b4 wrote it (then the only one: user_version 1).
    pub(crate) const CORE_489E641: &str = r#"
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
    pub(crate) type Shape = (&'static str, i64, fn(&Connection));

    pub(crate) fn historical_shapes() -> Vec<Shape> {
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
    pub(crate) fn write_old_file(path: &Path, version: i64, schema: fn(&Connection)) {
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
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use profiler_common::LaunchApi;
    use rusqlite::Connection;

    use super::{history::*, *};
    use crate::store::{
        AtFinish, Capability, GpuSampleRow, KernelRow, LaunchRow, SessionEnd, StepRow, Store, StoreMsg, SyncRow,
        testing::{start, temp_db},
    };

    /// Migrations are appended, never edited (the upgrade fixtures below are
    /// built from today's first migrations, and files written by older
    /// profilers only get the migrations they lack): each SQL migration's text
    /// is pinned. A new migration appends its hash; the message gives it.
    #[test]
    fn migrations_are_append_only() {
        const FROZEN: [u64; 12] = [
            0x8aee_e93b_06de_c1a5,
            0xcbca_4468_d4a3_de19,
            0xb9bd_525d_e831_4c63,
            0x1668_b8b2_e3c9_65cd,
            0xa148_fd34_7523_097c,
            0x6309_9958_b308_0ccd,
            0x7113_d04a_b79f_8fe0,
            0x5267_9fa5_8ae7_98c3,
            0xd953_e5bf_732f_00f4,
            0x74cf_cec0_05ce_14f7,
            0xd65c_a388_7388_b798,
            0x5711_0307_e7a1_4918,
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

    /// Writes a session through the normal API with everything the old files
    /// could not hold: two labels at the same step, sync waits, syncs, kernels,
    /// labelled launches and GPU step rows.
    fn write_new_session(path: &Path) -> i64 {
        let store = Store::open(path).expect("open");
        let id = store.begin_session(&start()).expect("session");
        let w = store.spawn_writer(id);
        let step =
            |label: &str, sync_wait_ns| StepRow { sync_wait_ns, label: label.into(), ..crate::store::testing::step() };
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
            api: LaunchApi::CudaGraphLaunchPtsz,
            function: 0x1234,
            block: [32, 1, 1],
            step: Some(("train", 0)),
            ..crate::store::testing::launch()
        }]));
        // GPU 0 drawing 10 W, read every 50 ms around the steps: a step_gpu row for each.
        let sample =
            |k: u64| GpuSampleRow { gpu: 0, ts_ns: 50 * k, energy_j: Some(0.5 * k as f64), ..Default::default() };
        w.send(StoreMsg::GpuSamples((0..8).map(sample).collect()));
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
        let gpu = AtFinish::StepGpu { gpus: vec![0], max_gap_ns: 101, energy_resolution_j: 0.001 };
        let stats = w.finish(end, vec![gpu]).expect("finish");
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
        }
    }

    /// The repair, run again on a file it has repaired, changes nothing.
    #[test]
    fn the_repair_is_idempotent_on_every_historical_shape() {
        for (what, version, schema) in historical_shapes() {
            let (_d, p) = temp_db();
            write_old_file(&p, version, schema);
            let c = Connection::open(&p).expect("reopen");
            for m in &MIGRATIONS[version as usize..5] {
                m.apply(&c).expect("migration");
            }
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
}
