//! Merging profiles: the sessions of several profiles (one per node of a job,
//! say) copied with every row of every table into one new file at the current
//! schema, session ids renumbered.
//!
//! Tables are found in the schema, not listed here, so a table a later
//! migration adds is carried without a change to this file: a table with a
//! `session_id` column is per session, one without (`apis`) is shared and its
//! rows must agree between inputs. Views and indexes come with the schema.
//! Each input is attached read-only and copied inside SQLite (`INSERT …
//! SELECT`), an older one through its copy migrated in memory.
//! Times are not shifted: each session keeps its own monotonic clock and its
//! `unix_offset_ns`, which is what puts sessions of different nodes on one
//! Unix time axis for readers that need one.
use std::path::{Path, PathBuf};

use rusqlite::{Connection, OptionalExtension, types::Value};

use super::schema::{migrate, quoted};

/// How a table's rows are carried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TableKind {
    /// `sessions`: every row gets a new id.
    Sessions,
    /// A `session_id` column: rows follow their session to its new id.
    PerSession,
    /// No session (`apis`): rows are kept once; inputs must agree on them.
    Shared,
}

/// A table of the schema and how merge carries it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Table {
    pub name: String,
    pub columns: Vec<String>,
    pub kind: TableKind,
}

#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// Two inputs hold different rows under one key of a shared table.
    #[error(
        "{input} disagrees with an earlier input on a row of {table} ({row}); profiles of profilers that number {table} differently cannot be merged"
    )]
    Conflict { input: PathBuf, table: String, row: String },
    /// The schema has a table whose rows merge does not know how to renumber.
    #[error("merge cannot carry table {table}: {why}")]
    Schema { table: String, why: String },
    #[error("cannot read {input} ({source})")]
    Read { input: PathBuf, source: rusqlite::Error },
    /// Copying an input's rows failed: reading it (a damaged page) or writing.
    #[error("cannot copy {input} into the merged profile ({source})")]
    Copy { input: PathBuf, source: rusqlite::Error },
    #[error("cannot write beside the merged profile ({0})")]
    Io(#[from] std::io::Error),
    #[error("cannot write the merged profile ({0})")]
    Write(#[from] rusqlite::Error),
}

/// What a merge copied, and what it could not.
#[derive(Debug, Default)]
pub struct MergeSummary {
    pub sessions: u64,
    /// Rows of every table but `sessions`, shared rows already there not counted.
    pub rows: u64,
    /// (input, table, rows) whose session_id names no session of that input.
    pub orphans: Vec<(PathBuf, String, u64)>,
    /// (input, table) of tables no migration creates (added by hand): not copied.
    pub foreign_tables: Vec<(PathBuf, String)>,
}

/// One profile to merge, opened at the current schema by
/// [`super::open_for_reading`].
pub struct MergeInput<'a> {
    pub path: &'a Path,
    pub conn: &'a Connection,
}

/// Creates the schema in the empty database at `output` and copies every
/// session of `inputs`, in order, into it, one transaction per input (after
/// an error the caller discards the file). `job`, when given, becomes the job
/// of every merged session.
///
/// Each input is attached to the output's connection read-only and copied
/// table by table with `INSERT … SELECT`, inside SQLite.
pub fn merge_into(output: &Path, inputs: &[MergeInput], job: Option<&str>) -> Result<MergeSummary, MergeError> {
    let out = Connection::open(output)?;
    migrate(&out, 0)?;
    let tables = tables_of(&out)?;
    out.execute_batch("CREATE TEMP TABLE merge_ids (old INTEGER PRIMARY KEY, new INTEGER NOT NULL)")?;
    let mut summary = MergeSummary::default();
    for input in inputs {
        let theirs =
            table_names(input.conn).map_err(|source| MergeError::Read { input: input.path.to_owned(), source })?;
        for name in theirs.iter().filter(|n| !tables.iter().any(|t| &t.name == *n)) {
            summary.foreign_tables.push((input.path.to_owned(), name.clone()));
        }
        let copy = attach(&out, input, output)?;
        copy_input(&out, input, &tables, job, &mut summary).map_err(|e| match e {
            MergeError::Write(source) => MergeError::Copy { input: input.path.to_owned(), source },
            e => e,
        })?;
        out.execute_batch("DETACH DATABASE input")?;
        drop(copy);
        carry_indexes(&out, input)?;
    }
    Ok(summary)
}

/// Attaches `input` to `out` as the read-only schema `input`: its file when
/// it is read from its file, else (an older profile migrated in memory) a
/// copy in a temporary file beside `output`, deleted when the value returned drops.
fn attach(out: &Connection, input: &MergeInput, output: &Path) -> Result<Option<tempfile::TempPath>, MergeError> {
    let read = |source| MergeError::Read { input: input.path.to_owned(), source };
    let (path, copy) = match input.conn.path().filter(|p| !p.is_empty()) {
        Some(file) => (PathBuf::from(file), None),
        None => {
            let dir = output.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
            let temp = tempfile::Builder::new().prefix(".merge-input-").tempfile_in(dir)?.into_temp_path();
            input.conn.backup(rusqlite::DatabaseName::Main, &temp, None).map_err(read)?;
            (temp.to_path_buf(), Some(temp))
        }
    };
    out.execute("ATTACH DATABASE ?1 AS input", [read_only_uri(&path)]).map_err(read)?;
    Ok(copy)
}

/// `path` as an SQLite URI that opens it read-only (bytes other than
/// letters, digits and `/._-~` percent-encoded).
fn read_only_uri(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut uri = String::from("file:");
    for &b in path.as_os_str().as_bytes() {
        if b.is_ascii_alphanumeric() || b"/._-~".contains(&b) {
            uri.push(char::from(b));
        } else {
            uri.push_str(&format!("%{b:02X}"));
        }
    }
    uri.push_str("?mode=ro");
    uri
}

/// Copies the attached input: its sessions, then every other table.
fn copy_input(
    out: &Connection,
    input: &MergeInput,
    tables: &[Table],
    job: Option<&str>,
    summary: &mut MergeSummary,
) -> Result<(), MergeError> {
    let tx = out.unchecked_transaction()?;
    tx.execute("DELETE FROM temp.merge_ids", [])?;
    summary.sessions += copy_sessions(&tx, &tables[0], job)?;
    for table in &tables[1..] {
        let cols = columns_in_both(&tx, table)?;
        let (rows, orphans) = match table.kind {
            TableKind::PerSession => copy_per_session(&tx, input, table, &cols)?,
            _ => (copy_shared(&tx, input, table, &cols)?, 0),
        };
        summary.rows += rows;
        if orphans > 0 {
            summary.orphans.push((input.path.to_owned(), table.name.clone(), orphans));
        }
    }
    tx.commit()?;
    Ok(())
}

/// Creates the indexes an input has and the output lacks: those the store
/// builds at a session's end rather than in a migration (`launches_by_step`),
/// after the rows, as the store does.
fn carry_indexes(out: &Connection, input: &MergeInput) -> Result<(), MergeError> {
    let read = |source| MergeError::Read { input: input.path.to_owned(), source };
    let indexes: Vec<(String, String, String)> = input
        .conn
        .prepare("SELECT name, tbl_name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")
        .and_then(|mut q| q.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?.collect())
        .map_err(read)?;
    for (name, table, sql) in indexes {
        // Not on a table that was not carried (one added by hand).
        let wanted: bool = out.query_row(
            "SELECT NOT EXISTS (SELECT 1 FROM sqlite_master WHERE name = ?1)
                AND EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?2)",
            [&name, &table],
            |r| r.get(0),
        )?;
        if wanted {
            out.execute_batch(&sql)?;
        }
    }
    Ok(())
}

/// Tables of `conn`, `sessions` first, then in the order they were created.
fn table_names(conn: &Connection) -> rusqlite::Result<Vec<String>> {
    conn.prepare(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'
         ORDER BY name <> 'sessions', rowid",
    )?
    .query_map([], |r| r.get(0))?
    .collect()
}

/// The tables of the schema in `conn` and how each is carried; refuses one
/// whose rows refer to sessions other than through `session_id`, or a
/// per-session table with its own row ids (other rows could refer to them,
/// and merge would have to renumber those too).
pub(crate) fn tables_of(conn: &Connection) -> Result<Vec<Table>, MergeError> {
    let mut tables = Vec::new();
    for name in table_names(conn)? {
        let info: Vec<(String, String, i64)> = conn
            .prepare("SELECT name, type, pk FROM pragma_table_info(?1) ORDER BY cid")?
            .query_map([&name], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
            .collect::<rusqlite::Result<_>>()?;
        let refs: Vec<(String, String)> = conn
            .prepare(r#"SELECT "from", "table" FROM pragma_foreign_key_list(?1)"#)?
            .query_map([&name], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<rusqlite::Result<_>>()?;
        let refuse = |why: &str| Err(MergeError::Schema { table: name.clone(), why: why.into() });
        let columns: Vec<String> = info.iter().map(|c| c.0.clone()).collect();
        let own_ids = info.iter().filter(|c| c.2 > 0).count() == 1
            && info.iter().any(|c| c.2 == 1 && c.1.eq_ignore_ascii_case("INTEGER"));
        let kind = if name == "sessions" {
            TableKind::Sessions
        } else if columns.iter().any(|c| c == "session_id") {
            if own_ids {
                return refuse("it has rows ids of its own (INTEGER PRIMARY KEY) that would collide between inputs");
            }
            TableKind::PerSession
        } else {
            TableKind::Shared
        };
        if refs.iter().any(|(from, to)| to == "sessions" && from != "session_id") {
            return refuse("a column other than session_id refers to sessions");
        }
        tables.push(Table { name, columns, kind });
    }
    if tables.first().map(|t| t.kind) != Some(TableKind::Sessions) {
        return Err(MergeError::Schema { table: "sessions".into(), why: "the schema has no sessions table".into() });
    }
    Ok(tables)
}

/// `cols` quoted, each prefixed with `prefix`, comma-separated.
fn list(cols: &[String], prefix: &str) -> String {
    cols.iter().map(|c| format!("{prefix}{}", quoted(c))).collect::<Vec<_>>().join(", ")
}

/// The columns of `table` the attached input has too (all of them: inputs
/// are at the current schema; a column one lacked would get its default).
fn columns_in_both(out: &Connection, table: &Table) -> rusqlite::Result<Vec<String>> {
    let theirs: Vec<String> = out
        .prepare("SELECT name FROM pragma_table_info(?1, 'input')")?
        .query_map([&table.name], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    Ok(table.columns.iter().filter(|c| theirs.contains(c)).cloned().collect())
}

/// Copies the input's sessions in id order, each under a new id, and
/// records old id → new id in `temp.merge_ids`; returns how many. The job a
/// migration gave an older file's session (`session-<id>`, one job per
/// session) follows the new id, so that two such sessions of different
/// inputs do not become one job.
fn copy_sessions(out: &Connection, sessions: &Table, job: Option<&str>) -> Result<u64, MergeError> {
    let mut cols = columns_in_both(out, sessions)?;
    cols.retain(|c| c != "id");
    let old_ids: Vec<i64> = out
        .prepare("SELECT id FROM input.sessions ORDER BY id")?
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    let has_job = cols.iter().any(|c| c == "job");
    let mut copy = out.prepare(&format!(
        "INSERT INTO main.sessions ({}) SELECT {} FROM input.sessions WHERE id = ?1",
        list(&cols, ""),
        list(&cols, "")
    ))?;
    for &old in &old_ids {
        copy.execute([old])?;
        let new = out.last_insert_rowid();
        out.execute("INSERT INTO temp.merge_ids (old, new) VALUES (?1, ?2)", [old, new])?;
        match job {
            Some(name) if has_job => {
                out.execute("UPDATE main.sessions SET job = ?1 WHERE id = ?2", rusqlite::params![name, new])?
            }
            None if has_job => out.execute(
                "UPDATE main.sessions SET job = 'session-' || id WHERE id = ?1 AND job = 'session-' || ?2",
                [new, old],
            )?,
            _ => 0,
        };
    }
    Ok(old_ids.len() as u64)
}

/// Copies every row of a per-session table, in the input's order, its
/// session_id renumbered; returns (rows copied, rows of no session of this
/// input, not copied).
fn copy_per_session(
    out: &Connection,
    input: &MergeInput,
    table: &Table,
    cols: &[String],
) -> Result<(u64, u64), MergeError> {
    if !cols.iter().any(|c| c == "session_id") {
        let why = format!("{} has no session_id in it", input.path.display());
        return Err(MergeError::Schema { table: table.name.clone(), why });
    }
    let from: Vec<String> =
        cols.iter().map(|c| if c == "session_id" { "m.new".to_owned() } else { format!("x.{}", quoted(c)) }).collect();
    let t = quoted(&table.name);
    // CROSS JOIN: the input's table is the outer loop, so rows keep their order.
    let copied = out.execute(
        &format!(
            "INSERT INTO main.{t} ({}) SELECT {} FROM input.{t} x CROSS JOIN temp.merge_ids m ON m.old = x.session_id",
            list(cols, ""),
            from.join(", ")
        ),
        [],
    )?;
    let orphans: i64 = out.query_row(
        &format!("SELECT count(*) FROM input.{t} x WHERE NOT EXISTS (SELECT 1 FROM temp.merge_ids m WHERE m.old = x.session_id)"),
        [],
        |r| r.get(0),
    )?;
    Ok((copied as u64, orphans as u64))
}

/// Copies the rows of a shared table the output lacks; a row of the input
/// that is not in the output afterwards collided with a different one (another
/// name for the same API id): a [`MergeError::Conflict`]. Returns the rows added.
fn copy_shared(out: &Connection, input: &MergeInput, table: &Table, cols: &[String]) -> Result<u64, MergeError> {
    let (t, l) = (quoted(&table.name), list(cols, ""));
    let added = out.execute(&format!("INSERT OR IGNORE INTO main.{t} ({l}) SELECT {l} FROM input.{t}"), [])?;
    let differing = out
        .query_row(&format!("SELECT {l} FROM input.{t} EXCEPT SELECT {l} FROM main.{t} LIMIT 1"), [], |r| {
            (0..cols.len()).map(|i| r.get::<_, Value>(i)).collect::<rusqlite::Result<Vec<_>>>()
        })
        .optional()?;
    if let Some(row) = differing {
        let shown: Vec<String> = cols.iter().zip(&row).map(|(c, v)| format!("{c} = {v:?}")).collect();
        return Err(MergeError::Conflict {
            input: input.path.to_owned(),
            table: table.name.clone(),
            row: shown.join(", "),
        });
    }
    Ok(added as u64)
}

#[cfg(test)]
pub(crate) mod testing {
    //! Profiles of synthetic nodes, for the merge tests and those of readers of merged files.
    use std::path::{Path, PathBuf};

    use rusqlite::{Connection, params, params_from_iter, types::Value};

    use super::{TableKind, list, tables_of};
    use crate::store::{
        AtFinish, Capability, GpuSampleRow, KernelRow, LaunchRow, RaplSampleRow, RegionRow, SessionEnd, StepRow, Store,
        StoreMsg, SyncRow, SystemSampleRow, quoted,
        testing::{launch, start, step},
    };

    /// One node's session of job `job`: three steps whose durations depend
    /// on `slow_ns`, and a row in every other table (through the writer where
    /// it has a message, else `fill_empty_tables`). Returns its id.
    pub(crate) fn node_session(
        path: &Path,
        host: &str,
        unix_offset_ns: i64,
        job: &str,
        rank: i64,
        slow_ns: u64,
    ) -> i64 {
        let store = Store::open(path).expect("open");
        let s = crate::store::SessionStart { hostname: Some(host.into()), unix_offset_ns, ..start() };
        let id = store.begin_session(&s).expect("session");
        let w = store.spawn_writer(id);
        let steps = (0..3u64)
            .map(|k| StepRow {
                step: k,
                start_ns: 100 + 1000 * k,
                end_ns: Some(600 + 1000 * k + slow_ns * k),
                ..step()
            })
            .collect();
        w.send(StoreMsg::Steps(steps));
        w.send(StoreMsg::Launches(vec![launch(), LaunchRow { step: Some(("train", 1)), ts_ns: 1200, ..launch() }]));
        let sync = SyncRow { tid: 7, api: "cuCtxSynchronize", start_ns: 300, end_ns: 400, step: Some(("train", 0)) };
        w.send(StoreMsg::Syncs(vec![sync]));
        let region = RegionRow {
            tid: 7,
            name: "Optimizer.step".into(),
            truncated: false,
            start_ns: 400,
            end_ns: Some(500),
            step: Some(("train", 0)),
        };
        w.send(StoreMsg::Regions(vec![region]));
        let kernel = KernelRow { function: 1, named_ns: 0, name: "_Z1kv".into(), demangled_name: None, source: "x" };
        w.send(StoreMsg::Kernels(vec![kernel]));
        let sample = |k: u64| GpuSampleRow { gpu: 0, ts_ns: 250 * k, energy_j: Some(k as f64), ..Default::default() };
        w.send(StoreMsg::GpuSamples((0..14).map(sample).collect()));
        let rapl = |k: u64| RaplSampleRow { ts_ns: 250 * k, domain: "package-0", energy_j: 2.0 * k as f64 };
        w.send(StoreMsg::RaplSamples((0..14).map(rapl).collect()));
        let sys = |k: u64| SystemSampleRow { ts_ns: 250 * k, cpu_usage_pct: Some(10.0), ..Default::default() };
        w.send(StoreMsg::SystemSamples((0..14).map(sys).collect()));
        let cap = Capability { source: "nvml".into(), metric: "energy".into(), available: true, reason: None };
        w.send(StoreMsg::Capability(cap));
        let end = SessionEnd {
            ended_ns: 4000,
            end_reason: "target-exited".into(),
            lost_events: 0,
            total_launches: 2,
            unmatched_returns: 0,
        };
        let at_finish = vec![
            AtFinish::StepGpu { gpus: vec![0], max_gap_ns: 300, energy_resolution_j: 0.001 },
            AtFinish::StepEnergy { package_resolution_j: Some(0.001), dram_resolution_j: None },
            AtFinish::StepSystem,
        ];
        let stats = w.finish(end, at_finish).expect("finish");
        assert_eq!((stats.failed_rows, stats.first_error), (0, None));
        let c = Connection::open(path).expect("open");
        c.execute("UPDATE sessions SET job = ?1, rank = ?2, world_size = 2 WHERE id = ?3", params![job, rank, id])
            .expect("job");
        fill_empty_tables(&c, id);
        id
    }

    /// A row of session `id` in every per-session table that has none yet
    /// (collectives, gemms, … and whatever a later migration adds), each
    /// column a value of its declared type.
    pub(crate) fn fill_empty_tables(c: &Connection, id: i64) {
        for t in tables_of(c).expect("tables").iter().filter(|t| t.kind == TableKind::PerSession) {
            let q = format!("SELECT count(*) FROM {} WHERE session_id = ?1", quoted(&t.name));
            if c.query_row(&q, [id], |r| r.get::<_, i64>(0)).expect("count") > 0 {
                continue;
            }
            let types: Vec<String> = c
                .prepare("SELECT type FROM pragma_table_info(?1) ORDER BY cid")
                .expect("q")
                .query_map([&t.name], |r| r.get(0))
                .expect("q")
                .collect::<rusqlite::Result<_>>()
                .expect("q");
            let values: Vec<Value> = t
                .columns
                .iter()
                .zip(&types)
                .map(|(col, ty)| match ty.to_ascii_uppercase() {
                    _ if col == "session_id" => Value::Integer(id),
                    ty if ty.contains("INT") => Value::Integer(id * 10 + 3),
                    ty if ty.contains("REAL") => Value::Real(1.5),
                    _ => Value::Text(format!("{}-{id}", t.name)),
                })
                .collect();
            let marks = vec!["?"; values.len()].join(", ");
            let sql = format!("INSERT INTO {} ({}) VALUES ({marks})", quoted(&t.name), list(&t.columns, ""));
            c.execute(&sql, params_from_iter(&values)).expect(&t.name);
        }
    }

    /// Two nodes, A with two sessions (an earlier job, then rank 0 of `j`)
    /// and B with one (rank 1 of `j`), each on its own clock.
    pub(crate) fn two_nodes(dir: &Path) -> (PathBuf, PathBuf) {
        let (a, b) = (dir.join("a.db"), dir.join("b.db"));
        node_session(&a, "node-a", 1_700_000_000_000_000_000, "earlier", 0, 0);
        node_session(&a, "node-a", 1_700_000_000_000_000_000, "j", 0, 50);
        node_session(&b, "node-b", 1_700_000_123_456_789_000, "j", 1, 80);
        (a, b)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::{testing::two_nodes, *};
    use crate::store::{Store, history, open_for_reading, testing::temp_db};

    /// Every row of every table, as text, by table; `session_id` (and
    /// `sessions.id`) through `map`.
    fn rows_by_table(c: &Connection, map: &dyn Fn(i64) -> i64) -> BTreeMap<String, Vec<String>> {
        let mut all = BTreeMap::new();
        for t in tables_of(c).expect("tables") {
            let list: Vec<String> = t.columns.iter().map(|c| quoted(c)).collect();
            let key = if t.kind == TableKind::Sessions { "id" } else { "session_id" };
            let mut q = c.prepare(&format!("SELECT {} FROM {}", list.join(", "), quoted(&t.name))).expect("q");
            let mut rows = q.query([]).expect("q");
            let mut texts = Vec::new();
            while let Some(r) = rows.next().expect("row") {
                let row: Vec<String> = (0..t.columns.len())
                    .map(|i| match (t.columns[i] == key, r.get::<_, Value>(i).expect("value")) {
                        (true, Value::Integer(id)) => format!("{:?}", Value::Integer(map(id))),
                        (_, v) => format!("{v:?}"),
                    })
                    .collect();
                texts.push(row.join(" | "));
            }
            all.insert(t.name, texts);
        }
        all
    }

    fn merge_files(out: &Path, files: &[&Path], job: Option<&str>) -> Result<MergeSummary, MergeError> {
        let conns: Vec<Connection> = files.iter().map(|p| open_for_reading(p).expect("input")).collect();
        let inputs: Vec<MergeInput> = files.iter().zip(&conns).map(|(path, conn)| MergeInput { path, conn }).collect();
        merge_into(out, &inputs, job)
    }

    #[test]
    fn every_row_of_every_input_is_in_the_merged_file_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b) = two_nodes(dir.path());
        let out = dir.path().join("job.db");
        Connection::open(&b)
            .expect("open")
            .execute_batch("CREATE TABLE notes (text TEXT); CREATE INDEX notes_by_text ON notes(text);")
            .expect("a table of someone else's");
        let summary = merge_files(&out, &[&a, &b], None).expect("merge");
        assert_eq!(summary.sessions, 3);
        assert!(summary.orphans.is_empty(), "{summary:?}");
        assert_eq!(summary.foreign_tables, [(b.clone(), "notes".to_owned())], "named, not merged");

        let merged = rows_by_table(&Connection::open(&out).expect("open"), &|id| id);
        let from_a = rows_by_table(&Connection::open(&a).expect("open"), &|id| id);
        let from_b = rows_by_table(&Connection::open(&b).expect("open"), &|id| id + 2);
        assert_eq!(merged.keys().collect::<Vec<_>>(), from_a.keys().collect::<Vec<_>>());
        for (table, rows) in &merged {
            let mut want: Vec<String> = from_a[table].iter().chain(&from_b[table]).cloned().collect();
            if table == "apis" {
                // Shared: once, not once per input.
                want = from_a[table].clone();
            } else {
                assert!(!from_a[table].is_empty() && !from_b[table].is_empty(), "{table}: a test node has no rows");
            }
            let mut have = rows.clone();
            want.sort();
            have.sort();
            assert_eq!(have, want, "{table}");
        }
        let copied = merged.iter().filter(|(t, _)| !["sessions", "apis"].contains(&t.as_str()));
        assert_eq!(summary.rows, copied.map(|(_, r)| r.len() as u64).sum::<u64>(), "apis rows are there already");

        // Views and indexes: the schema's, all of them.
        let objects = |p: &Path| -> Vec<(String, String)> {
            Connection::open(p)
                .expect("open")
                .prepare("SELECT type, name FROM sqlite_master ORDER BY type, name")
                .expect("q")
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                .expect("q")
                .collect::<rusqlite::Result<_>>()
                .expect("q")
        };
        assert_eq!(objects(&out), objects(&a));
    }

    /// job_steps on the merged file says what the two nodes' steps say: per
    /// step, both ranks, the slower one and the spread; sessions keep their
    /// hosts and their Unix start times.
    #[test]
    fn the_job_views_of_the_merged_file_compare_the_nodes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b) = two_nodes(dir.path());
        let out = dir.path().join("job.db");
        merge_files(&out, &[&a, &b], None).expect("merge");
        let durations = |p: &Path, session: i64| -> Vec<i64> {
            Connection::open(p)
                .expect("open")
                .prepare("SELECT duration_ns FROM steps WHERE session_id = ?1 AND label = 'train' ORDER BY step")
                .expect("q")
                .query_map([session], |r| r.get(0))
                .expect("q")
                .collect::<rusqlite::Result<_>>()
                .expect("q")
        };
        let (rank0, rank1) = (durations(&a, 2), durations(&b, 1));
        assert_eq!(rank0.len(), 3);
        let c = Connection::open(&out).expect("open");
        let job_steps: Vec<(i64, i64, i64, i64, i64, i64)> = c
            .prepare(
                "SELECT step, ranks, slowest_rank, max_ns, min_ns, spread_ns FROM job_steps
                 WHERE job = 'j' AND label = 'train' ORDER BY step",
            )
            .expect("q")
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?)))
            .expect("q")
            .collect::<rusqlite::Result<_>>()
            .expect("q");
        let want: Vec<_> = (0..3)
            .map(|k| {
                let (d0, d1) = (rank0[k], rank1[k]);
                (k as i64, 2, if d1 > d0 { 1 } else { 0 }, d0.max(d1), d0.min(d1), (d0 - d1).abs())
            })
            .collect();
        assert_eq!(job_steps, want);
        assert!(want.iter().any(|s| s.5 > 0), "the nodes differ somewhere");

        let unix_start = |c: &Connection, id: i64| -> (String, i64) {
            c.query_row("SELECT hostname, started_ns + unix_offset_ns FROM sessions WHERE id = ?1", [id], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .expect("session")
        };
        assert_eq!(unix_start(&c, 3), unix_start(&Connection::open(&b).expect("open"), 1));
        assert_eq!(unix_start(&c, 2), unix_start(&Connection::open(&a).expect("open"), 2));
        let earlier: i64 =
            c.query_row("SELECT count(*) FROM job_steps WHERE job = 'earlier'", [], |r| r.get(0)).expect("q");
        assert_eq!(earlier, 3, "the earlier job stays apart");
    }

    #[test]
    fn job_names_one_job_for_every_merged_session() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b) = two_nodes(dir.path());
        let out = dir.path().join("job.db");
        // As a file written without foreign-key checks could hold.
        let orphan = "PRAGMA foreign_keys = OFF;
                      INSERT INTO steps(session_id, label, step, tid, start_ns) VALUES (99, 'train', 0, 1, 5)";
        Connection::open(&b).expect("open").execute_batch(orphan).expect("a step of no session");
        let summary = merge_files(&out, &[&a, &b], Some("run-7")).expect("merge");
        assert_eq!(summary.orphans, [(b.clone(), "steps".to_owned(), 1)], "counted, not merged");
        let c = Connection::open(&out).expect("open");
        let jobs: Vec<String> = c
            .prepare("SELECT job FROM sessions")
            .expect("q")
            .query_map([], |r| r.get(0))
            .expect("q")
            .collect::<rusqlite::Result<_>>()
            .expect("q");
        assert_eq!(jobs, ["run-7"; 3]);
    }

    /// Files from older profilers are migrated in memory and merged; the
    /// job their migration gave each session (`session-<id>`) follows the
    /// session's new id, so sessions of two old files stay apart.
    #[test]
    fn old_profiles_merge_at_the_current_schema() {
        for (what, version, schema) in history::historical_shapes() {
            let dir = tempfile::tempdir().expect("tempdir");
            let (old1, old2) = (dir.path().join("old1.db"), dir.path().join("old2.db"));
            history::write_old_file(&old1, version, schema);
            history::write_old_file(&old2, version, schema);
            let bytes = std::fs::read(&old1).expect("read");
            let out = dir.path().join("job.db");
            let summary = merge_files(&out, &[&old1, &old2], None).expect(what);
            assert_eq!(summary.sessions, 2, "{what}");
            let c = Connection::open(&out).expect("open");
            let per_session: Vec<(i64, String, i64, i64)> = c
                .prepare(
                    "SELECT s.id, s.job, (SELECT count(*) FROM steps WHERE session_id = s.id AND label = 'train'),
                            (SELECT count(*) FROM launches_named WHERE session_id = s.id AND api_name = 'cuLaunchKernel')
                     FROM sessions s ORDER BY s.id",
                )
                .expect("q")
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
                .expect("q")
                .collect::<rusqlite::Result<_>>()
                .expect(what);
            assert_eq!(per_session, [(1, "session-1".into(), 1, 1), (2, "session-2".into(), 1, 1)], "{what}");
            assert_eq!(std::fs::read(&old1).expect("read"), bytes, "{what}: an input was written");
        }
    }

    /// Inputs are attached by URI: a path with the characters URIs give a
    /// meaning to (and one that is not ASCII) still names the file.
    #[test]
    fn inputs_under_odd_paths_merge() {
        let dir = tempfile::tempdir().expect("tempdir");
        let odd = dir.path().join("a ?#%20&=é dir");
        std::fs::create_dir(&odd).expect("odd dir");
        let (a, b) = two_nodes(&odd);
        let (old, current) = (odd.join("old?.db"), odd.join("current#.db"));
        let (_, version, schema) = history::historical_shapes()[0];
        history::write_old_file(&old, version, schema);
        std::fs::rename(&a, &current).expect("rename");
        let summary = merge_files(&odd.join("job.db"), &[&current, &b, &old], None).expect("merge");
        assert_eq!(summary.sessions, 4);
        let uri = read_only_uri(&odd);
        assert!(uri.starts_with("file:/") && uri.ends_with("/a%20%3F%23%2520%26%3D%C3%A9%20dir?mode=ro"), "{uri}");
    }

    #[test]
    fn inputs_that_name_one_api_differently_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b) = two_nodes(dir.path());
        Connection::open(&b)
            .expect("open")
            .execute("UPDATE apis SET name = 'renamed' WHERE id = 1", [])
            .expect("rename");
        let err = merge_files(&dir.path().join("job.db"), &[&a, &b], None).expect_err("conflict");
        assert!(matches!(&err, MergeError::Conflict { table, .. } if table == "apis"), "{err}");
        assert!(err.to_string().contains("renamed"), "{err}");
    }

    /// Every table of the schema is found and classified, a table added
    /// later included; tables whose ids merge cannot renumber are refused.
    #[test]
    fn tables_are_found_in_the_schema() {
        let (_d, p) = temp_db();
        drop(Store::open(&p).expect("create"));
        let c = Connection::open(&p).expect("open");
        let tables = tables_of(&c).expect("tables");
        let kind = |name: &str| tables.iter().find(|t| t.name == name).map(|t| t.kind);
        assert_eq!(tables[0].name, "sessions");
        assert_eq!(kind("apis"), Some(TableKind::Shared));
        for t in ["steps", "launches", "gpu_samples", "step_gpu", "regions", "collectives", "gemms", "kernel_renames"] {
            assert_eq!(kind(t), Some(TableKind::PerSession), "{t}");
        }
        let count: usize = c
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'",
                [],
                |r| r.get(0),
            )
            .expect("q");
        assert_eq!(tables.len(), count, "every table, once");
        assert!(tables.iter().all(|t| !t.columns.is_empty()));

        c.execute_batch("CREATE TABLE widgets (session_id INTEGER NOT NULL REFERENCES sessions(id), size REAL)")
            .expect("later table");
        let widgets = tables_of(&c).expect("tables").into_iter().find(|t| t.name == "widgets").expect("found");
        assert_eq!((widgets.kind, widgets.columns), (TableKind::PerSession, vec!["session_id".into(), "size".into()]));

        for bad in [
            "CREATE TABLE own_ids (id INTEGER PRIMARY KEY, session_id INTEGER)",
            "CREATE TABLE by_owner (owner INTEGER REFERENCES sessions(id))",
        ] {
            let c = Connection::open(&p).expect("open");
            c.execute_batch(&format!("BEGIN; {bad};")).expect("create");
            assert!(matches!(tables_of(&c), Err(MergeError::Schema { .. })), "{bad}");
            c.execute_batch("ROLLBACK").expect("rollback");
        }
    }
}
