//! The read side of a profile: a file opened without writing it (migrated in
//! memory when an older profiler wrote it, refused when it is not a profile or
//! a newer one), its tables and columns, and the queries that `report`,
//! `export` and `merge` share: sessions and jobs, steps, kernel names, and
//! series derived from stored samples (RAPL power). `store` is the writer.
//!
//! What an old file could not hold (labels, sync wait, kernel names, CPU/DRAM
//! energy came later) reads as NULL, and is shown as absent, never as zero.
pub mod cpu;
pub mod jobs;
pub mod kernels;
mod schema;
pub mod series;
pub mod sessions;
pub mod steps;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use anyhow::{Context, anyhow, bail};
use rusqlite::Connection;

/// A profile opened for reading at the current schema (see
/// [`crate::store::open_for_reading`]), with its tables and views and their
/// columns (for `export --format csv`, which names a table).
pub struct ProfileDb {
    pub conn: Connection,
    pub path: PathBuf,
    /// Table or view → its columns, in order; read once at open.
    tables: BTreeMap<String, Vec<String>>,
    /// Whether a live profiler may still write the profile (checked before
    /// this process opened it): see [`crate::store::written_by_a_live_profiler`].
    pub written_by_a_live_profiler: bool,
}

impl ProfileDb {
    /// Opens `path` without writing it; a missing file, a file that is not
    /// SQLite, a database without the profiler's schema and one from a newer
    /// profiler each get one clear error.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        if !path.exists() {
            bail!("{} does not exist; pass the file written by `profiler attach/run -o FILE`", path.display());
        }
        // Looked at before this process opens the profile: closing the file
        // used to look would drop every fcntl lock this process holds on it,
        // its own connection's included.
        let written_by_a_live_profiler = crate::store::written_by_a_live_profiler(path);
        // A report must never create, migrate or lock a profile that a
        // running profiler may still be writing: an old one is migrated in memory.
        let conn = crate::store::open_for_reading(path).map_err(|e| {
            use crate::store::StoreError;
            let p = path.display();
            match e {
                StoreError::NotADatabase { .. } => {
                    anyhow!("{p} is not a SQLite database; pass a profile written by `profiler attach/run -o`")
                }
                StoreError::Foreign { .. } => {
                    anyhow!("{p} is a SQLite database but not a profile (it has no profiler schema)")
                }
                StoreError::TooNew { found, .. } => anyhow!(
                    "{p} has schema version {found}, newer than this profiler's {}; upgrade profiler to read it",
                    crate::store::SCHEMA_VERSION
                ),
                e => anyhow!("cannot read {p} ({e})"),
            }
        })?;
        let tables = schema::read_schema(&conn).map_err(|e| anyhow!("cannot read {} ({e})", path.display()))?;
        Ok(Self { conn, path: path.to_owned(), tables, written_by_a_live_profiler })
    }

    pub fn has_table(&self, name: &str) -> bool {
        self.tables.contains_key(name)
    }

    /// Tables and views, sorted.
    pub fn tables(&self) -> impl Iterator<Item = &str> {
        self.tables.keys().map(String::as_str)
    }

    /// Column names of a table or view (none if it does not exist).
    pub fn columns(&self, table: &str) -> &[String] {
        self.tables.get(table).map_or(&[], Vec::as_slice)
    }

    /// The session asked for, or the latest.
    pub fn session(&self, requested: Option<i64>) -> anyhow::Result<i64> {
        let ids: Vec<i64> = self
            .conn
            .prepare("SELECT id FROM sessions ORDER BY id")
            .and_then(|mut q| q.query_map([], |r| r.get(0))?.collect())
            .with_context(|| format!("reading the sessions of {}", self.path.display()))?;
        if ids.is_empty() {
            bail!("{} has no sessions yet", self.path.display());
        }
        match requested {
            None => {
                self.newest_jobs_busiest().with_context(|| format!("reading the sessions of {}", self.path.display()))
            }
            Some(n) if ids.contains(&n) => Ok(n),
            Some(n) => bail!("{} has no session {n}; its sessions are {}", self.path.display(), id_list(&ids)),
        }
    }
}

impl ProfileDb {
    /// The session a report shows when none is named: of the newest job's
    /// processes (a `run` follows children: a launcher, its helpers, its
    /// ranks), the one with the most steps; the first of them (the target
    /// named) among equals.
    fn newest_jobs_busiest(&self) -> rusqlite::Result<i64> {
        self.conn.query_row(
            "SELECT s.id FROM sessions s
             WHERE s.job IS (SELECT job FROM sessions ORDER BY id DESC LIMIT 1)
             ORDER BY (SELECT count(*) FROM steps t WHERE t.session_id = s.id) DESC, s.id
             LIMIT 1",
            [],
            |r| r.get(0),
        )
    }
}

/// "1, 2, 3" or "1–40 (40 sessions)".
fn id_list(ids: &[i64]) -> String {
    match ids {
        [] => String::new(),
        [a] => a.to_string(),
        _ if ids.len() <= 5 => ids.iter().map(i64::to_string).collect::<Vec<_>>().join(", "),
        [first, .., last] => format!("{first}–{last} ({} sessions)", ids.len()),
    }
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::*;

    #[test]
    fn session_lists() {
        assert_eq!(id_list(&[1, 2, 3]), "1, 2, 3");
        assert_eq!(id_list(&(1..=40).collect::<Vec<_>>()), "1–40 (40 sessions)");
    }

    /// The columns are read once at open; a view that no longer compiles
    /// (its table changed under it) leaves the rest readable.
    #[test]
    fn schema_is_read_at_open_despite_a_broken_view() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.db");
        drop(crate::store::Store::open(&path).expect("a profile"));
        Connection::open(&path)
            .expect("open")
            .execute_batch(
                "CREATE TABLE gone (x INTEGER);
                 CREATE VIEW broken AS SELECT x FROM gone;
                 DROP TABLE gone;",
            )
            .expect("schema");
        let db = ProfileDb::open(&path).expect("a profile");
        assert_eq!(&db.columns("steps")[..3], ["session_id", "label", "step"]);
        assert!(db.has_table("broken") && db.columns("broken").is_empty());
        assert!(db.columns("missing").is_empty() && !db.has_table("missing"));
    }

    #[test]
    fn not_a_profile_is_one_clear_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("missing.db");
        let e = ProfileDb::open(&missing).err().expect("missing file fails").to_string();
        assert!(e.contains("does not exist"), "{e}");
        let text = dir.path().join("text.db");
        std::fs::write(&text, "this is not a database, just some text that is long enough to have a header")
            .expect("write");
        let e = ProfileDb::open(&text).err().expect("text fails").to_string();
        assert!(e.contains("not a SQLite database"), "{e}");
        let other = dir.path().join("other.db");
        Connection::open(&other).expect("create").execute_batch("CREATE TABLE t (x)").expect("table");
        let e = ProfileDb::open(&other).err().expect("foreign fails").to_string();
        assert!(e.contains("not a profile"), "{e}");
    }
}
