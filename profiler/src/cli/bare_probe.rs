//! Hidden benchmark helper: the cost floor, an empty eBPF program on one
//! function of one process, with none of the profiler's work.
use std::{num::NonZeroU32, path::PathBuf, process::ExitCode};

use anyhow::Context;
use clap::Args;
use tokio::signal::unix::{SignalKind, signal};

use crate::probes::{Probes, elf, map_file};

#[derive(Args, Debug)]
pub struct BareProbeArgs {
    pub pid: u32,
    pub library: PathBuf,
    pub symbol: String,
    /// Where the launch probes would go (see `probes::placement`) instead of the entry.
    #[arg(long)]
    pub placed: bool,
}

pub async fn main(args: BareProbeArgs) -> anyhow::Result<ExitCode> {
    let pid = NonZeroU32::new(args.pid).context("PID 0")?;
    let data = map_file(&args.library).with_context(|| format!("read {}", args.library.display()))?;
    let sym = elf::function_symbols(&data)?
        .into_iter()
        .find(|s| s.name == args.symbol)
        .with_context(|| format!("{} not in {}", args.symbol, args.library.display()))?;
    // Placed exactly where the profiler would place its launch probe.
    let (mut probes, _ring) = Probes::load(pid, false, args.placed)?;
    let offset = probes.probe_point(&data, &sym).offset;
    probes.attach_bare(&args.library, sym.file_offset + offset)?;
    println!("attached at +{offset:#x}");
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
    Ok(ExitCode::SUCCESS)
}
