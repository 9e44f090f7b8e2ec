//! `profiler`: attach to a running training process and record every CUDA
//! launch and every training step into SQLite.
mod cli;
mod clock;
mod correlate;
mod events;
mod privileges;
mod probes;
mod samplers;
mod session;
mod steps;
mod store;

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
