//! Writing a subcommand's result to standard output: a table, JSON or CSV,
//! and a reader that closed the pipe (`| head`) taken as done, not as an error.
use std::{io::Write, process::ExitCode};

use anyhow::Context;
use clap::ValueEnum;
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum ReportFormat {
    Table,
    Json,
    Csv,
}

/// Standard output, buffered, as the reports write it.
pub(super) type Stdout = std::io::BufWriter<std::io::StdoutLock<'static>>;

/// Prints `report` in `format`: `table` renders it, JSON is its
/// serialisation, `csv` writes its rows. A reader that closed the pipe is not an error.
pub(super) fn print<R: Serialize>(
    report: &R,
    format: ReportFormat,
    table: impl FnOnce(&R) -> String,
    csv: impl FnOnce(&R, &mut Stdout) -> anyhow::Result<()>,
) -> anyhow::Result<ExitCode> {
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let written = (|| -> anyhow::Result<()> {
        match format {
            ReportFormat::Table => out.write_all(table(report).as_bytes())?,
            ReportFormat::Json => {
                serde_json::to_writer_pretty(&mut out, report)?;
                out.write_all(b"\n")?;
            }
            ReportFormat::Csv => csv(report, &mut out)?,
        }
        out.flush()?;
        Ok(())
    })();
    match written {
        Err(e) if reader_went_away(&e) => Ok(ExitCode::SUCCESS),
        r => r.context("writing the report").map(|()| ExitCode::SUCCESS),
    }
}

/// Whether writing failed because the reader closed the pipe (`| head`):
/// the reader has what it wanted, so that is not an error to report.
pub(super) fn reader_went_away(e: &anyhow::Error) -> bool {
    let pipe = |k: std::io::ErrorKind| k == std::io::ErrorKind::BrokenPipe;
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().is_some_and(|io| pipe(io.kind()))
            || c.downcast_ref::<serde_json::Error>().and_then(serde_json::Error::io_error_kind).is_some_and(pipe)
            || c.downcast_ref::<csv::Error>()
                .is_some_and(|e| matches!(e.kind(), csv::ErrorKind::Io(io) if pipe(io.kind())))
    })
}
