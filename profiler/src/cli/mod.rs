//! Command-line interface: one file per subcommand; this file holds the
//! options they share and turns them into the engine's own config.
mod attach;
mod bare_probe;
mod compare;
mod doctor;
mod export;
mod merge;
mod output;
mod report;
mod run;

use std::{io::IsTerminal, path::PathBuf, process::ExitCode, time::Duration};

use clap::{Args, Parser, Subcommand};

pub use run::{EXEC_GATE, exec_gate};

use crate::{
    probes::{python::spec::PythonStepSpec, step_symbol::StepSymbolSpec},
    samplers::gpu::GpuConfig,
    session::{LaunchMode, SessionConfig},
};

#[derive(Parser, Debug)]
#[command(name = "profiler", version, about = "Where do my training steps' time go? eBPF CUDA launch and step tracer.")]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Attach to a running process and trace it until Ctrl-C, --duration, or its exit.
    Attach(attach::AttachArgs),
    /// Start a command and trace it from its first instruction.
    Run(run::RunArgs),
    /// Summarise a session: step time, inter-step time, launches, energy per step, top kernels
    /// (--html: a page of plots for a session or a job).
    Report(report::ReportArgs),
    /// Export a session as a Perfetto/Chrome trace (--format perfetto) or a table as CSV (--format csv --table T).
    Export(export::ExportArgs),
    /// Merge profiles (one per node) into one new file: sessions renumbered, every row kept.
    Merge(merge::MergeArgs),
    /// Compare two runs per label, with each change's 95 % interval; --fail-if gates CI on them.
    Compare(compare::CompareArgs),
    /// Check what will and will not work on this machine (and for PID) before tracing.
    Doctor(doctor::DoctorArgs),
    /// Benchmark helper: attach an empty uprobe to LIBRARY:SYMBOL in PID until SIGINT/SIGTERM.
    #[command(hide = true)]
    BareProbe(bare_probe::BareProbeArgs),
}

/// Options shared by `attach` and `run`.
#[derive(Args, Debug, Clone)]
pub struct TraceArgs {
    /// SQLite file to write; an existing profile gets a new session.
    #[arg(short, long, default_value = "profile.db")]
    output: PathBuf,
    /// A step function: SYMBOL (searched in the executable, then in its mapped
    /// libraries; C++/Rust names may be given demangled) or FILE:SYMBOL, with an
    /// optional LABEL= (letters, digits, `_.-`; default `train`; `=NAME` takes
    /// all after the `=` as the name, for one that holds a `=`). Repeatable.
    #[arg(long, value_name = "[LABEL=][FILE:]SYMBOL", value_parser = StepSymbolSpec::parse)]
    step_symbol: Vec<StepSymbolSpec>,
    /// A Python step function by name, optionally in a file ending in
    /// FILE_SUFFIX, with an optional LABEL= as for --step-symbol. Repeatable.
    /// CPython 3.10–3.14: its USDT probes where the build has them, else the
    /// PEP 523 frame hook (one pointer written into the target, restored on detach).
    #[arg(long, value_name = "[LABEL=][FILE_SUFFIX:]NAME", value_parser = parse_python_step)]
    step_python: Vec<PythonStepSpec>,
    /// Where steps come from: `auto` (the named step sources if any, else
    /// PyTorch's optimizer markers once libtorch is loaded, and a JAX
    /// program's jitted training step, picked by name or period), `torch`, or `none`.
    #[arg(long, value_enum, default_value_t = crate::regions::StepMode::Auto)]
    steps: crate::regions::StepMode,
    /// A PyTorch `record_function` region whose name starts with
    /// NAME_PREFIX is a step (e.g. `ProfilerStep#`, or a user's
    /// `record_function("train_step")`), with an optional LABEL= as for
    /// --step-symbol. Repeatable.
    #[arg(long, value_name = "[LABEL=]NAME_PREFIX", value_parser = crate::regions::RegionStepSpec::parse)]
    step_region: Vec<crate::regions::RegionStepSpec>,
    /// A `jax.jit` function whose Python name is NAME makes steps: each one
    /// runs from the start of a call to the start of the next step
    /// function's call on its thread (see docs/steps.md), with an optional
    /// LABEL= as for --step-symbol. Repeatable.
    #[arg(long, value_name = "[LABEL=]NAME", value_parser = crate::jax_steps::JitStepSpec::parse)]
    step_jit: Vec<crate::jax_steps::JitStepSpec>,
    /// Never write into the target: refuse the frame hook that --step-python
    /// needs on a CPython without USDT probes.
    #[arg(long)]
    no_target_writes: bool,
    /// Keep a row per launch and per GEMM (`all`), only per-step counts and
    /// FLOPs (`count`), or rows until their rate would spend --max-size within
    /// the session's expected length (`auto`: --duration, else a day).
    #[arg(long, value_enum, default_value_t = LaunchMode::All)]
    launches: LaunchMode,
    /// Do not trace the scheduler (each step's on-CPU, runnable, sleeping
    /// and blocked time, and its verdict's CPU evidence): its programs run on
    /// every context switch of the machine (see docs/measurement.md for the cost).
    #[arg(long)]
    no_sched: bool,
    /// Sample the traced threads' stacks this many times per second of their
    /// time on a CPU (native frames through frame pointers, the leaf always;
    /// kernel frames in the kernel), each sample in the step its thread was in.
    #[arg(long, value_name = "HZ", default_value_t = 99, value_parser = clap::value_parser!(u32).range(1..=i64::from(crate::probes::cpu::MAX_HZ)))]
    cpu_sample: u32,
    /// Take no CPU samples.
    #[arg(long)]
    no_cpu_samples: bool,
    /// The profile's size budget (database and -wal; e.g. 500M, 4G): per-call
    /// rows (launches, GEMMs, syncs, regions, collectives, copies, jitted calls,
    /// off-CPU times) stop at 7/8 of it, steps, counts and samples go on; at all of it the session ends.
    // 4G: about 45 million launch rows (15 minutes at 50 000 launches/s, a
    // day at 500/s), well under 1 % of a training node's scratch disk.
    #[arg(long, value_name = "SIZE", default_value = "4G", value_parser = crate::store::budget::parse_size)]
    max_size: u64,
    /// Free space the profile leaves on its filesystem: a share (`10%`), a
    /// size (`20G`), or the smaller of both (`10%,5G`); below it per-call rows
    /// stop; below half of it for 2 s, every row stops and the session ends.
    // 10 %, at most 5G: room for the checkpoint a job writes beside the one it
    // replaces on a small disk, and a floor that does not stop a profile on a
    // big disk that is merely 90 % full (the profile itself is --max-size at most).
    #[arg(long, value_name = "PCT%,SIZE", default_value = "10%,5G", value_parser = crate::store::budget::MinFree::parse)]
    min_free: crate::store::budget::MinFree,
    /// Stop tracing after this many seconds, or this long (`90s`, `2m`, `1h 30m`).
    #[arg(long, value_name = "TIME", value_parser = parse_duration)]
    duration: Option<Duration>,
    /// How often to read the target's maps for newly loaded CUDA libraries, in
    /// ms, when its dynamic loader cannot be probed (with it probed, the maps
    /// are read after each dlopen, and polled every 2 s at most).
    #[arg(long, value_name = "MS", default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    maps_interval: u64,
    /// Print only errors and warnings.
    #[arg(short, long)]
    quiet: bool,
    /// GPU sampling period, in ms.
    #[arg(long, value_name = "MS", default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    gpu_interval: u64,
    /// Load NVML from this file instead of the system's libnvidia-ml.so.1.
    #[arg(long, value_name = "PATH")]
    nvml_lib: Option<PathBuf>,
    /// GPUs to sample (NVML indices, or GPU-/MIG- UUIDs, comma-separated),
    /// instead of those the target's CUDA_VISIBLE_DEVICES names (numbered in
    /// its CUDA_DEVICE_ORDER), or all.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    gpus: Option<Vec<String>>,
    /// Do not sample GPUs.
    #[arg(long, conflicts_with = "require_gpu")]
    no_gpu: bool,
    /// Fail if NVML cannot be used, instead of storing NULLs.
    #[arg(long)]
    require_gpu: bool,
    /// Put every launch probe on its function's first instruction, instead of
    /// the first one the kernel emulates (see the `probes` table).
    #[arg(long)]
    probe_at_entry: bool,
    /// Read RAPL from this powercap tree only (default: the perf `power` PMU,
    /// else /sys/class/powercap).
    #[arg(long, value_name = "PATH")]
    powercap_root: Option<PathBuf>,
    /// System (CPU, RAM, disk) sampling period, in ms.
    #[arg(long, value_name = "MS", default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    system_interval: u64,
    /// Report disk usage of the filesystem holding PATH (default: the target's working directory).
    #[arg(long, value_name = "PATH")]
    disk: Option<PathBuf>,
    #[command(flatten)]
    live: crate::metrics::LiveArgs,
    /// The job id every session of this profile gets (default: the first
    /// target's TORCHELASTIC_RUN_ID, else HOST-UNIXTIME-PID).
    #[arg(long, value_name = "NAME")]
    job: Option<String>,
}

fn parse_python_step(s: &str) -> Result<PythonStepSpec, String> {
    PythonStepSpec::parse(s).map_err(|e| e.to_string())
}

/// The longest `--duration`: a year. Longer is a typo, and far enough past
/// any clock's end that the deadline arithmetic would overflow.
const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// `--duration`: a number of seconds (fractions allowed), or a duration with
/// units as humantime reads them (`90s`, `2m`, `1h 30m`, `500ms`).
fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = match s.parse::<f64>() {
        Ok(v) if !v.is_finite() || v < 0.0 => return Err(format!("'{s}' is not a non-negative number of seconds")),
        // Checked before the conversion, which panics past u64 seconds.
        Ok(v) if v > MAX_DURATION.as_secs_f64() => None,
        Ok(v) => Some(Duration::from_secs_f64(v)),
        Err(_) => Some(humantime::parse_duration(s).map_err(|e| {
            format!("'{s}' is neither a number of seconds nor a duration such as 90s, 2m or 1h 30m ({e})")
        })?),
    };
    d.filter(|d| *d <= MAX_DURATION).ok_or_else(|| {
        format!("'{s}' is more than a year ({} s); leave --duration out to trace until Ctrl-C", MAX_DURATION.as_secs())
    })
}

impl TraceArgs {
    fn into_config(self) -> SessionConfig {
        SessionConfig {
            output: self.output,
            steps: self.step_symbol,
            python_steps: self.step_python,
            target_writes: !self.no_target_writes,
            launch_mode: self.launches,
            sched: !self.no_sched,
            cpu_sample_hz: (!self.no_cpu_samples).then_some(self.cpu_sample),
            duration: self.duration,
            maps_interval: Duration::from_millis(self.maps_interval),
            quiet: self.quiet,
            gpu: (!self.no_gpu).then(|| GpuConfig {
                nvml_lib: self.nvml_lib,
                interval: Duration::from_millis(self.gpu_interval),
                gpus: self.gpus,
            }),
            require_gpu: self.require_gpu,
            place_probes: !self.probe_at_entry,
            powercap_root: self.powercap_root,
            system_interval: Duration::from_millis(self.system_interval),
            disk: self.disk,
            status_line: !self.quiet && std::io::stderr().is_terminal(),
            step_mode: self.steps,
            step_regions: self.step_region,
            live: self.live.into(),
            job: self.job,
            follow_children: false,
            step_jits: self.step_jit,
            max_size: self.max_size,
            min_free: self.min_free,
        }
    }
}

pub async fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Attach(a) => attach::main(a).await,
        Command::Run(a) => run::main(a).await,
        Command::Report(a) => report::main(a).await,
        Command::Export(a) => export::main(a).await,
        Command::Merge(a) => merge::main(a).await,
        Command::Compare(a) => compare::main(a).await,
        Command::Doctor(a) => doctor::main(a).await,
        Command::BareProbe(a) => bare_probe::main(a).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_attach_flags() {
        let cli = Cli::try_parse_from([
            "profiler",
            "attach",
            "42",
            "-o",
            "x.db",
            "--step-symbol",
            "lib.so:step",
            "--launches",
            "count",
            "--duration",
            "1.5",
        ])
        .expect("parses");
        let Command::Attach(a) = cli.command else { panic!("attach expected") };
        assert_eq!(a.pids, vec![42]);
        assert!(!a.children);
        let c = a.trace.into_config();
        assert_eq!(c.output, PathBuf::from("x.db"));
        assert_eq!(c.launch_mode, LaunchMode::Count);
        assert_eq!(c.duration, Some(Duration::from_millis(1500)));
        assert_eq!(
            c.steps,
            vec![StepSymbolSpec { label: "train".into(), file: Some("lib.so".into()), symbol: "step".into() }]
        );
    }

    #[test]
    fn rejects_bad_values() {
        assert!(Cli::try_parse_from(["profiler", "attach", "notapid"]).is_err());
        assert!(Cli::try_parse_from(["profiler", "attach", "1", "--duration", "-1"]).is_err());
        for bad in ["1e20", "inf", "NaN", "31536001", "366days", "1y", "1 fortnight", "5 x", ""] {
            let e = Cli::try_parse_from(["profiler", "attach", "1", "--duration", bad]).expect_err(bad);
            assert!(e.to_string().contains(&format!("'{bad}'")), "{e}");
        }
        for (good, secs) in [("31536000", 31_536_000.0), ("0", 0.0), ("0.25", 0.25), ("90s", 90.0), ("2m", 120.0)] {
            let duration = |a: TraceArgs| a.duration;
            let cli = Cli::try_parse_from(["profiler", "attach", "1", "--duration", good]).expect(good);
            let Command::Attach(a) = cli.command else { panic!("attach expected") };
            assert_eq!(duration(a.trace), Some(Duration::from_secs_f64(secs)), "{good}");
        }
        assert!(Cli::try_parse_from(["profiler", "attach", "1", "--duration", "1h 30m"]).is_ok());
        assert!(Cli::try_parse_from(["profiler", "attach", "1", "--gpu-interval", "0"]).is_err());
        assert!(Cli::try_parse_from(["profiler", "attach", "1", "--maps-interval", "99999999999999999999"]).is_err());
        assert!(Cli::try_parse_from(["profiler", "attach", "1", "--launches", "some"]).is_err());
        assert!(Cli::try_parse_from(["profiler", "run"]).is_err());
    }

    #[test]
    fn attach_takes_several_pids_and_children() {
        let cli =
            Cli::try_parse_from(["profiler", "attach", "7", "8", "9", "--children", "--job", "j1"]).expect("parses");
        let Command::Attach(a) = cli.command else { panic!("attach expected") };
        assert_eq!(a.pids, vec![7, 8, 9]);
        assert!(a.children);
        assert_eq!(a.trace.into_config().job.as_deref(), Some("j1"));
        assert!(Cli::try_parse_from(["profiler", "attach"]).is_err());
        let cli = Cli::try_parse_from(["profiler", "run", "--no-children", "--", "t"]).expect("parses");
        let Command::Run(r) = cli.command else { panic!("run expected") };
        assert!(r.no_children);
    }

    #[test]
    fn run_takes_the_command_after_dashes() {
        let cli = Cli::try_parse_from(["profiler", "run", "--launches", "count", "--", "trainer", "--steps", "3"])
            .expect("parses");
        let Command::Run(r) = cli.command else { panic!("run expected") };
        assert_eq!(r.command, vec!["trainer", "--steps", "3"]);
    }

    /// The step flags as `attach` parses them.
    fn step_flags(args: &[&str]) -> Result<TraceArgs, clap::Error> {
        let cli = Cli::try_parse_from(["profiler", "attach", "1"].iter().chain(args))?;
        let Command::Attach(a) = cli.command else { panic!("attach expected") };
        Ok(a.trace)
    }

    #[test]
    fn step_symbol_takes_the_label_prefix() {
        let one = |v: &str| step_flags(&["--step-symbol", v]).map(|t| t.step_symbol[0].clone());
        let spec =
            |label: &str, symbol: &str| StepSymbolSpec { label: label.into(), file: None, symbol: symbol.into() };
        assert_eq!(one("eval=validate").expect("LABEL=NAME"), spec("eval", "validate"));
        assert_eq!(one("=operator=").expect("=NAME"), spec("train", "operator="));
        assert_eq!(one("train_step").expect("NAME"), spec("train", "train_step"));
        for bad in ["", "eval=", "a b=f", "Vec::operator="] {
            let e = one(bad).expect_err(bad).to_string();
            assert!(e.contains("LABEL=NAME"), "{bad}: {e}");
        }
    }

    #[test]
    fn step_python_takes_the_label_prefix() {
        let one = |v: &str| step_flags(&["--step-python", v]).map(|t| t.step_python[0].clone());
        let spec = |label: &str, function: &str| PythonStepSpec {
            label: label.into(),
            file_suffix: None,
            function: function.into(),
        };
        assert_eq!(one("validate=validate").expect("LABEL=NAME"), spec("validate", "validate"));
        assert_eq!(one("=train_step").expect("=NAME"), spec("train", "train_step"));
        assert_eq!(one("train_step").expect("NAME"), spec("train", "train_step"));
        for bad in ["", "val=", "a b=f"] {
            let e = one(bad).expect_err(bad).to_string();
            assert!(e.contains("LABEL=NAME"), "{bad}: {e}");
        }
    }

    #[test]
    fn step_region_takes_the_label_prefix() {
        use crate::regions::RegionStepSpec;
        let one = |v: &str| step_flags(&["--step-region", v]).map(|t| t.step_region[0].clone());
        let spec = |label: &str, prefix: &str| RegionStepSpec { label: label.into(), prefix: prefix.into() };
        assert_eq!(one("user=train_step").expect("LABEL=NAME"), spec("user", "train_step"));
        assert_eq!(one("=ProfilerStep#").expect("=NAME"), spec("train", "ProfilerStep#"));
        assert_eq!(one("ProfilerStep#").expect("NAME"), spec("train", "ProfilerStep#"));
        for bad in ["", "eval=", "Step#1=x"] {
            let e = one(bad).expect_err(bad).to_string();
            assert!(e.contains("LABEL=NAME"), "{bad}: {e}");
        }
    }

    #[test]
    fn step_jit_takes_the_label_prefix() {
        use crate::jax_steps::JitStepSpec;
        let one = |v: &str| step_flags(&["--step-jit", v]).map(|t| t.step_jit[0].clone());
        let spec = |label: &str, name: &str| JitStepSpec { label: label.into(), name: name.into() };
        assert_eq!(one("eval=eval_step").expect("LABEL=NAME"), spec("eval", "eval_step"));
        assert_eq!(one("train_step").expect("NAME"), spec("train", "train_step"));
        for bad in ["", "eval=", "a b=x"] {
            let e = one(bad).expect_err(bad).to_string();
            assert!(e.contains("LABEL=NAME") && e.contains("--step-jit"), "{bad}: {e}");
        }
    }
}
