//! The root integration tests, one binary: the real profiler against
//! fixtures with known ground truth, a module per area. `cargo xtask test`
//! runs each module in a process of its own, one test at a time (they load
//! eBPF programs and time what they trace), after building them all at once:
//! one crate and one link, not one per area.

mod attach;
mod attach_time;
mod budget;
mod collectives;
mod compare;
mod cpu;
mod cpu_python;
mod energy;
mod exit;
mod flops;
mod gpm;
mod gpu;
mod html;
mod install;
mod jax;
mod merge;
mod multiprocess;
mod prometheus;
mod python;
mod python_any;
mod report;
mod scale;
mod sched;
mod torch;
