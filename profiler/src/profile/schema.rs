//! The tables and views of a profile with their columns, read once when it is opened.
use std::collections::BTreeMap;

use rusqlite::{Connection, ErrorCode};

/// Every table and view with its columns, in one query. A view that no
/// longer compiles fails that query; then each is read on its own, and such a
/// view has no columns.
pub(super) fn read_schema(conn: &Connection) -> rusqlite::Result<BTreeMap<String, Vec<String>>> {
    let mut tables: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let all = conn
        .prepare(
            "SELECT m.name, p.name FROM sqlite_master m, pragma_table_info(m.name) p
             WHERE m.type IN ('table', 'view') ORDER BY m.name, p.cid",
        )
        .and_then(|mut q| q.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect::<rusqlite::Result<Vec<_>>>());
    match all {
        Ok(pairs) => {
            for (table, column) in pairs {
                tables.entry(table).or_default().push(column);
            }
        }
        Err(e) if e.sqlite_error_code() == Some(ErrorCode::NotADatabase) => return Err(e),
        Err(_) => {
            let names: Vec<String> = conn
                .prepare("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")?
                .query_map([], |r| r.get(0))?
                .collect::<rusqlite::Result<_>>()?;
            for name in names {
                let columns = conn
                    .prepare("SELECT name FROM pragma_table_info(?1) ORDER BY cid")
                    .and_then(|mut q| q.query_map([&name], |r| r.get(0))?.collect())
                    .unwrap_or_default();
                tables.insert(name, columns);
            }
        }
    }
    Ok(tables)
}
