//! `profiler`: attach to a running training process and record every CUDA
//! launch and every training step into SQLite.
mod cli;
mod clock;
mod command_path;
mod compare;
mod correlate;
mod events;
#[cfg(test)]
mod fuzz_tests;
mod jax_steps;
mod metrics;
mod ownership;
mod privileges;
mod probes;
mod profile;
mod regions;
mod samplers;
mod session;
mod step_label;
mod steps;
mod stop_signals;
mod store;
mod thread_panic;
mod verdict;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_target(false)
        .format_timestamp(None)
        .init();
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some(cli::EXEC_GATE) {
        return cli::exec_gate(&argv[2..]);
    }
    let args = cli::Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("profiler: error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli::dispatch(args)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("profiler: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The one way a unit test says it did not check something on this host: a
/// line `SKIPPED: <test>: <reason>` straight to stdout, past the harness's
/// capture, which `cargo xtask test` counts and totals (as the integration
/// tests' `skip` does).
#[cfg(test)]
pub(crate) fn skip_test(reason: impl std::fmt::Display) {
    use std::io::Write;
    // The harness names each test's thread after the test.
    let test = std::thread::current().name().unwrap_or("?").to_owned();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "SKIPPED: {test}: {reason}");
    let _ = out.flush();
}
