//! `cargo xtask bench`: what tracing costs the target, and how much the agent
//! sustains. Runs the tables in order (or one of them); each prints its
//! table and asserts nothing. The shared pieces (attaching, the clock, the
//! median) are in [`harness`]; each table is a module of its own.
mod agent;
mod attach;
mod cpu;
mod flops;
mod frame_hook;
mod fuzz;
mod harness;
mod jobs;
mod launch;
mod python;
mod sched;
mod torch;

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

/// A table: it runs its workloads in the work directory and prints.
type Table = fn(&Path) -> Result<()>;

/// The tables that run alone by name (`cargo xtask bench NAME`).
const PARTS: [(&str, Table); 7] = [
    ("attach", attach::attach_table),
    ("cpu", cpu::cpu_table),
    ("torch", torch::torch_table),
    ("sched", sched::sched_table),
    ("frame-hook", frame_hook::frame_hook_table),
    ("flops", flops::flops_table),
    ("jobs", jobs::jobs_table),
];

/// The tables; `only`: one of [`PARTS`], that one alone.
pub fn main(only: Option<&str>) -> Result<()> {
    if !crate::root::is_root() {
        bail!(
            "the benchmark loads eBPF programs throughout and needs root: run it as root, e.g. `sudo env \"PATH=$PATH\" cargo xtask bench` (sudo's secure_path hides rustup's cargo)"
        );
    }
    let work: PathBuf = crate::root().join("target/bench");
    std::fs::create_dir_all(&work)?;
    if let Some(only) = only {
        let Some((_, table)) = PARTS.iter().find(|(name, _)| *name == only) else {
            let names: Vec<&str> = PARTS.iter().map(|(name, _)| *name).collect();
            bail!("no bench part '{only}' (parts: {})", names.join(", "));
        };
        return table(&work);
    }
    launch::launch_tables(&work)?;
    agent::detach_table(&work)?;
    agent::sampler_table(&work)?;
    agent::maps_table(&work)?;
    python::python_table(&work)?;
    for (_, table) in PARTS {
        table(&work)?;
    }
    fuzz::fuzz_long()
}
