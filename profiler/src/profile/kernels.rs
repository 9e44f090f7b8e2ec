//! Kernel names: the name a launch's handle had at the time of the launch
//! (a handle may be named again, its address reused for another kernel), how
//! a kernel is shown, and the session's most launched kernels.
use serde::Serialize;

use super::ProfileDb;

/// One of the most launched kernels.
#[derive(Debug, Serialize)]
pub struct TopKernel {
    pub function: i64,
    pub name: Option<String>,
    pub demangled_name: Option<String>,
    pub api: Option<String>,
    pub launches: i64,
    pub share: f64,
}

/// The `limit` most launched kernels of the whole session; None when launch rows were
/// not kept.
pub fn top_kernels(
    db: &ProfileDb,
    session: i64,
    launch_mode: &str,
    limit: usize,
) -> anyhow::Result<Option<Vec<TopKernel>>> {
    if launch_mode == "count" {
        return Ok(None);
    }
    let sql = if handles_renamed(db, session)? {
        // Each launch counts for the kernel its handle named at the time: one
        // rename lookup per launch, only in sessions that renamed a handle.
        let rrow = rename_at("l.function", "l.ts_ns");
        format!(
            "SELECT t.function, t.n, t.total, a.name, {RENAMED_NAMES} FROM (
                 SELECT function, rrow, count(*) AS n, sum(count(*)) OVER () AS total, min(api) AS api FROM (
                     SELECT l.function, l.api, {rrow} AS rrow FROM launches l WHERE l.session_id = ?1
                 ) GROUP BY function, rrow ORDER BY n DESC, function LIMIT {limit}
             ) t LEFT JOIN apis a ON a.id = t.api
               LEFT JOIN kernels k ON k.session_id = ?1 AND k.function = t.function
               LEFT JOIN kernel_renames r ON r.rowid = t.rrow
             ORDER BY t.n DESC, t.function"
        )
    } else {
        let (names, kernels) = kernel_names_given(false, "t.function", "0");
        format!(
            "SELECT t.function, t.n, t.total, a.name, {names} FROM (
                 SELECT function, count(*) AS n, sum(count(*)) OVER () AS total, min(api) AS api
                 FROM launches WHERE session_id = ?1 GROUP BY function ORDER BY n DESC, function LIMIT {limit}
             ) t LEFT JOIN apis a ON a.id = t.api {kernels} ORDER BY t.n DESC, t.function"
        )
    };
    let mut q = db.conn.prepare(&sql)?;
    let rows = q
        .query_map([session], |r| {
            let n: i64 = r.get(1)?;
            let total: i64 = r.get(2)?;
            Ok(TopKernel {
                function: r.get(0)?,
                name: r.get(4)?,
                demangled_name: r.get(5)?,
                api: r.get(3)?,
                launches: n,
                share: n as f64 / total.max(1) as f64,
            })
        })?
        .collect::<rusqlite::Result<_>>()?;
    Ok(Some(rows))
}

/// The names of the kernel handle in `function` (a column) at time `at` (a
/// column), for a query whose `?1` is `session`: the two columns `name, demangled_name`, and the joins that provide
/// them. Each joins at most one row.
pub fn kernel_names(
    db: &ProfileDb,
    session: i64,
    function: &str,
    at: &str,
) -> rusqlite::Result<(&'static str, String)> {
    Ok(kernel_names_given(handles_renamed(db, session)?, function, at))
}

/// [`kernel_names`] for a session whose renames are already known.
fn kernel_names_given(renamed: bool, function: &str, at: &str) -> (&'static str, String) {
    let first = format!("LEFT JOIN kernels k ON k.session_id = ?1 AND k.function = {function}");
    // The rename lookup costs one query per row: only for sessions that need it.
    if !renamed {
        return ("k.name, k.demangled_name", first);
    }
    (RENAMED_NAMES, format!("{first} LEFT JOIN kernel_renames r ON r.rowid = {}", rename_at(function, at)))
}

/// The name columns where `r` is the handle's rename at the time (NULL: none) and `k` its first name.
const RENAMED_NAMES: &str =
    "coalesce(r.name, k.name), CASE WHEN r.rowid IS NULL THEN k.demangled_name ELSE r.demangled_name END";

/// The `kernel_renames` row naming handle `function` at time `at` (SQL
/// expressions; `?1` the session): its latest rename at or before `at`; NULL
/// while the handle still has its first name (see the store's migration 6, `kernel_renames`).
fn rename_at(function: &str, at: &str) -> String {
    format!(
        "(SELECT r2.rowid FROM kernel_renames r2 WHERE r2.session_id = ?1 AND r2.function = {function}
          AND r2.named_ns <= {at} ORDER BY r2.named_ns DESC LIMIT 1)"
    )
}

/// Whether a handle of the session was named again (see [`rename_at`]).
fn handles_renamed(db: &ProfileDb, session: i64) -> rusqlite::Result<bool> {
    db.conn.query_row("SELECT EXISTS (SELECT 1 FROM kernel_renames WHERE session_id = ?1)", [session], |r| r.get(0))
}

/// How a kernel is shown: its (demangled) name, else its handle and entry point.
pub fn kernel_display(name: Option<&str>, demangled: Option<&str>, api: Option<&str>, function: i64) -> String {
    match (demangled, name) {
        (Some(d), _) => d.to_owned(),
        (None, Some(n)) => n.to_owned(),
        (None, None) => match api {
            Some(a) => format!("{a} {function:#x}"),
            None => format!("{function:#x}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_prefer_demangled() {
        assert_eq!(kernel_display(Some("_Z1fv"), Some("f()"), Some("cuLaunchKernel"), 1), "f()");
        assert_eq!(kernel_display(Some("_Z1fv"), None, None, 1), "_Z1fv");
        assert_eq!(kernel_display(None, None, Some("cuLaunchKernel"), 0x100000), "cuLaunchKernel 0x100000");
    }

    /// A handle named twice (its address reused for another kernel): each
    /// launch counts for the kernel the handle named at its time, in the
    /// report's top kernels and in the export's per-launch names.
    #[test]
    fn a_reused_handle_names_each_launch_by_its_time() {
        use crate::store::{KernelRow, LaunchRow, StoreMsg};
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.db");
        let (store, id) = crate::samplers::testing::open_store(&path);
        let w = store.spawn_writer(id);
        let kernel = |named_ns, name: &str| KernelRow {
            function: 0x77,
            named_ns,
            name: name.into(),
            demangled_name: None,
            source: "cuModuleGetFunction",
        };
        w.send(StoreMsg::Kernels(vec![kernel(50, "first"), kernel(200, "second")]));
        let launch = |ts_ns| LaunchRow { ts_ns, tid: 1, function: 0x77, ..crate::store::testing::launch() };
        // One launch under the first name, two under the second; one before
        // any naming counts for the first.
        w.send(StoreMsg::Launches(vec![launch(10), launch(100), launch(250), launch(300)]));
        let end = crate::samplers::testing::end();
        w.finish(end, Vec::new()).expect("finish");
        let db = ProfileDb::open(&path).expect("a profile");
        let top = top_kernels(&db, id, "all", 10).expect("query").expect("launch rows");
        let got: Vec<(Option<&str>, i64)> = top.iter().map(|k| (k.name.as_deref(), k.launches)).collect();
        assert_eq!(got, vec![(Some("first"), 2), (Some("second"), 2)]);
        let (names, join) = kernel_names(&db, id, "l.function", "l.ts_ns").expect("names");
        let per_launch: Vec<String> = db
            .conn
            .prepare(&format!("SELECT {names} FROM launches l {join} WHERE l.session_id = ?1 ORDER BY l.ts_ns"))
            .expect("prepare")
            .query_map([id], |r| r.get::<_, String>(0))
            .expect("query")
            .collect::<rusqlite::Result<_>>()
            .expect("rows");
        assert_eq!(per_launch, ["first", "first", "second", "second"]);
    }
}
