//! The report as a table for an 80-column terminal: comfy-table blocks,
//! wide glyphs counted as two columns, long names cut with an ellipsis.
use std::{collections::BTreeMap, fmt::Write as _};

use comfy_table::{CellAlignment, ColumnConstraint, Row, Table, Width};
use unicode_width::{UnicodeWidthChar, UnicodeWidthStr};

use super::build::{EnergyStat, LabelReport, Percentiles, RegionStat, Report};
use crate::profile::{
    kernels::{TopKernel, kernel_display},
    sessions::{CapabilityRow, SessionState},
};

/// Unavailable metrics listed in the table before "… N more".
const CAPABILITY_LINES: usize = 8;
/// The table's width.
pub(super) const WIDTH: usize = 80;

/// `s` cut to `width` terminal columns (a wide glyph counts two), with an
/// ellipsis if cut.
fn fit(s: &str, width: usize) -> String {
    if s.width() <= width {
        return s.to_owned();
    }
    let mut out = String::new();
    let mut used = 0;
    for c in s.chars() {
        let w = c.width().unwrap_or(0);
        // Room for the ellipsis, one column.
        if used + w + 1 > width {
            break;
        }
        used += w;
        out.push(c);
    }
    out.push('…');
    out
}

const ABSENT: &str = "–";

fn num(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| ABSENT.to_string(), |v| format!("{v:.decimals$}"))
}

fn int(v: Option<i64>) -> String {
    v.map_or_else(|| ABSENT.to_string(), |v| v.to_string())
}

/// One column of a [`block`]: its width in terminal columns (None: as wide as
/// its widest cell), alignment, and blank columns before it.
#[derive(Clone, Copy)]
struct Col(Option<u16>, CellAlignment, u16);

const LEFT: CellAlignment = CellAlignment::Left;

const RIGHT: CellAlignment = CellAlignment::Right;

/// `rows` as a borderless block of `cols`, indented two columns, appended to
/// `o`. comfy-table pads by terminal width (wide glyphs line up), wraps a cell
/// wider than its column at spaces, and shows at most `max_lines` lines of a
/// row, the last cut with an ellipsis.
fn block(o: &mut String, cols: &[Col], rows: Vec<Vec<String>>, max_lines: usize) {
    let mut t = Table::new();
    t.load_style(comfy_table::presets::NOTHING).set_truncation_indicator("…");
    for cells in rows {
        let mut row = Row::from(cells);
        row.max_height(max_lines);
        t.add_row(row);
    }
    for (column, &Col(width, align, gap)) in t.column_iter_mut().zip(cols) {
        column.set_padding((gap, 0)).set_cell_alignment(align);
        if let Some(w) = width {
            column.set_constraint(ColumnConstraint::Absolute(Width::Fixed(w + gap)));
        }
    }
    for line in t.lines() {
        let _ = writeln!(o, "  {}", line.trim_end());
    }
}

/// The table: readable in 80 columns.
pub fn render_table(r: &Report) -> String {
    let mut o = String::new();
    render_session(&mut o, r);
    render_capabilities(&mut o, &r.capabilities);
    if r.labels.is_empty() {
        let _ = writeln!(o, "\nno steps recorded (was --step-symbol given?)");
    }
    for l in &r.labels {
        o.push('\n');
        render_label(&mut o, l);
    }
    o.push('\n');
    render_kernels(&mut o, r.top_kernels.as_deref());
    render_regions(&mut o, &r.top_regions);
    super::cpu::render(&mut o, r.cpu.as_ref(), WIDTH);
    o
}

fn render_regions(o: &mut String, regions: &[RegionStat]) {
    if regions.is_empty() {
        return;
    }
    let _ = writeln!(o, "\ntop PyTorch regions by total time (whole session; open: end not seen)");
    let mut rows = vec![["total ms", "count", "mean ms", "open", "region"].map(str::to_owned).to_vec()];
    for r in regions {
        // Indent 2, figures 10 + 9 + 10 + 7, gap 2.
        let name = fit(&r.name, WIDTH - 40);
        rows.push(vec![
            format!("{:.3}", r.total_ms),
            r.count.to_string(),
            format!("{:.3}", r.mean_ms),
            r.open.to_string(),
            name,
        ]);
    }
    let cols = [
        Col(Some(10), RIGHT, 0),
        Col(Some(7), RIGHT, 2),
        Col(Some(8), RIGHT, 2),
        Col(Some(5), RIGHT, 2),
        Col(None, LEFT, 2),
    ];
    block(o, &cols, rows, 1);
}

/// The key column of the session lines ("target", "traced", …).
const KEY: Col = Col(Some(10), LEFT, 0);

/// Width left for a value after the key column and the indent.
const VALUE_WIDTH: usize = WIDTH - 12;

fn render_session(o: &mut String, r: &Report) {
    let s = &r.session;
    let _ = writeln!(o, "{}", fit(&format!("session {} of {}", s.id, r.database), WIDTH));
    let started = s.started_utc.as_deref().map_or(String::new(), |t| format!("from {t} UTC, "));
    let traced = match (s.state, s.duration_s) {
        (SessionState::Ended, Some(d)) => {
            format!("{}, {started}{d:.3} s, ended: {}", s.mode, s.end_reason.as_deref().unwrap_or(ABSENT))
        }
        (SessionState::Running, _) => format!("{}, {started}still running", s.mode),
        _ => format!("{}, {started}not ended", s.mode),
    };
    let mut rows = vec![("target", format!("pid {}  {}", s.pid, s.command)), ("traced", traced)];
    if let Some(job) = s.job.as_deref().filter(|_| s.job_processes > 1) {
        let rank = s.rank.map_or(String::new(), |r| format!(", this one rank {r}"));
        let line = format!("{job} ({} processes{rank}; see --job)", s.job_processes);
        rows.push(("job", line));
    }
    if s.state == SessionState::Unclean {
        rows.push(("end", "did not end cleanly (the profiler was killed?)".into()));
        rows.push(("", "committed rows are all here; the end and totals are not".into()));
    }
    if let Some(sym) = &s.step_symbol {
        rows.push(("steps by", sym.clone()));
    }
    let launches = format!(
        "{} seen, {} stored ({}), {} lost events",
        int(s.total_launches),
        int(s.stored_launches),
        s.launch_mode,
        int(s.lost_events)
    );
    rows.push(("launches", launches));
    // Not an end-of-run warning (nothing to act on there): here, where a user
    // reading a step's scheduler columns looks.
    if let Some(n) = s.sched_mismatches.filter(|&n| n > 0) {
        rows.push(("scheduler", format!("{n} switches did not fit a thread's state (a loaded machine?):")));
        rows.push(("", format!("up to {n} steps' scheduler columns each miss one interval")));
    }
    // What stopped and when, then why (the whole line is in `sessions.budget_reason`).
    if let Some((what, why)) = s.budget.as_deref().and_then(|b| b.split_once(": ")) {
        rows.push(("budget", what.to_owned()));
        rows.push(("", why.to_owned()));
    }
    let rows = rows.into_iter().map(|(k, v)| vec![k.to_owned(), fit(&v, VALUE_WIDTH)]).collect();
    block(o, &[KEY, Col(None, LEFT, 0)], rows, 1);
}

fn render_capabilities(o: &mut String, caps: &[CapabilityRow]) {
    if caps.is_empty() {
        block(o, &[KEY, Col(None, LEFT, 0)], vec![vec!["sources".into(), format!("{ABSENT} (none recorded)")]], 1);
        return;
    }
    let mut per_source: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    // Metrics missing for one reason share a line (a machine without RAPL
    // loses all of its metrics for the same reason).
    let mut missing: BTreeMap<(&str, &str), Vec<&str>> = BTreeMap::new();
    for c in caps {
        let e = per_source.entry(&c.source).or_default();
        e.1 += 1;
        e.0 += usize::from(c.available);
        if !c.available {
            let why = c.reason.as_deref().unwrap_or("no reason recorded");
            missing.entry((&c.source, why)).or_default().push(&c.metric);
        }
    }
    let sources = per_source.iter().enumerate().map(|(i, (source, (ok, n)))| {
        vec![if i == 0 { "sources" } else { "" }.to_owned(), format!("{source}: {ok} of {n} metrics available")]
    });
    block(o, &[KEY, Col(None, LEFT, 0)], sources.collect(), 1);
    let reasons = missing.iter().take(CAPABILITY_LINES).map(|((source, why), metrics)| {
        let what = if metrics.len() > 3 { format!("{} metrics", metrics.len()) } else { metrics.join(", ") };
        vec![String::new(), "✗".to_owned(), format!("{source} {what}: {why}")]
    });
    // The reason is what the user acts on: up to two lines of it.
    block(o, &[KEY, Col(Some(2), LEFT, 0), Col(Some(VALUE_WIDTH as u16 - 4), LEFT, 0)], reasons.collect(), 2);
    if missing.len() > CAPABILITY_LINES {
        let _ = writeln!(o, "            … {} more (see the capabilities table)", missing.len() - CAPABILITY_LINES);
    }
}

fn render_label(o: &mut String, l: &LabelReport) {
    let rate = l.steps_per_s.map_or(String::new(), |v| format!(", {v:.1} steps/s"));
    let head = format!(
        "{}: {} steps, {} completed, {} skipped, {} measured{rate}",
        l.label, l.steps, l.completed, l.skipped, l.measured
    );
    let _ = writeln!(o, "{}", fit(&head, WIDTH));
    let mut rows = vec![["", "p50", "p90", "p99", "max", "mean"].map(str::to_owned).to_vec()];
    for (name, p, decimals) in [
        ("step time (ms)", &l.step_time_ms, 3),
        ("inter-step (ms)", &l.inter_step_ms, 3),
        ("launches/step", &l.launches_per_step, 0),
        ("data wait (ms)", &l.data_wait_ms, 3),
        ("optimizer (ms)", &l.optimizer_ms, 3),
        ("dispatch (ms)", &l.dispatch_ms, 3),
        ("GEMM TFLOP/s", &l.tflops_per_s, 1),
        ("MFU (%)", &l.mfu_pct, 1),
        ("MFU est. GPM (%)", &l.mfu_gpm_pct, 1),
    ] {
        if p.is_none() && !matches!(name, "step time (ms)" | "inter-step (ms)" | "launches/step") {
            continue; // PyTorch's phases, JAX's dispatch, FLOPs and MFU: only some steps have them
        }
        let cell = |f: fn(&Percentiles) -> f64, decimals| num(p.as_ref().map(f), decimals);
        rows.push(vec![
            name.to_owned(),
            cell(|p| p.p50, decimals),
            cell(|p| p.p90, decimals),
            cell(|p| p.p99, decimals),
            cell(|p| p.max, decimals),
            cell(|p| p.mean, decimals.max(1)),
        ]);
    }
    let figure = Col(Some(12), RIGHT, 0);
    block(o, &[Col(Some(18), LEFT, 0), figure, figure, figure, figure, figure], rows, 1);
    let sync = l
        .sync_wait_share
        .map_or_else(|| format!("{ABSENT:>12}  (not recorded)"), |v| format!("{:>11.1}%  of step time", 100.0 * v));
    let _ = writeln!(o, "  {:<18}{sync}", "sync wait");
    if let Some(e) = &l.epochs {
        let other = e.other_wait_ms.as_ref().map_or(String::new(), |p| format!(" vs {:.3} ms otherwise", p.p50));
        let line = format!(
            "epoch boundaries: {}, first-batch wait p50 {:.3} ms{other}",
            e.boundaries, e.first_batch_wait_ms.p50
        );
        let _ = writeln!(o, "  {}", fit(&line, WIDTH - 2));
    }
    render_bound(o, l);
    render_energy(o, l);
}

/// The label's verdicts: `87.0% gpu (sync wait p50 12.1 ms), 13.0% data`, then
/// the long runs of steps bound otherwise.
fn render_bound(o: &mut String, l: &LabelReport) {
    let Some(b) = &l.bound else {
        let _ = writeln!(o, "  {:<18}{ABSENT:>12}  (no verdicts: see docs/measurement.md)", "bound by");
        return;
    };
    let evidence = |e: &Option<super::build::BoundEvidence>| {
        e.as_ref().map_or(String::new(), |e| format!(" ({} p50 {:.1} ms)", e.name, e.p50_ms))
    };
    let shares: Vec<String> = b
        .verdicts
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let why = if i == 0 { evidence(&v.evidence) } else { String::new() };
            format!("{:.0}% {}{why}", v.pct, v.verdict)
        })
        .collect();
    let _ = writeln!(o, "{}", fit(&format!("  {:<18}{}", "bound by", shares.join(", ")), WIDTH));
    for r in &b.runs {
        let line = format!("  {:<18}steps {}–{} {}{}", "", r.first_step, r.last_step, r.verdict, evidence(&r.evidence));
        let _ = writeln!(o, "{}", fit(&line, WIDTH));
    }
}

fn render_energy(o: &mut String, l: &LabelReport) {
    let row = |name: &str, e: Option<&EnergyStat>| {
        vec![
            fit(name, 31),
            num(e.and_then(|e| e.energy_per_step_j), 3),
            num(e.and_then(|e| e.energy_error_per_step_j), 3),
            num(e.and_then(|e| e.avg_power_w), 1),
            e.map_or_else(|| ABSENT.to_string(), |e| e.steps.to_string()),
        ]
    };
    let mut rows = vec![["energy per step", "J/step", "± J/step", "avg W", "steps"].map(str::to_owned).to_vec()];
    match &l.gpus {
        Some(gpus) if !gpus.is_empty() => rows.extend(gpus.iter().map(|g| {
            let name = g.name.as_ref().map_or_else(|| format!("GPU {}", g.gpu), |n| format!("GPU {} {n}", g.gpu));
            row(&name, Some(&g.energy))
        })),
        _ => rows.push(row("GPU", None)),
    }
    rows.push(row("CPU package", l.cpu.as_ref()));
    rows.push(row("DRAM", l.dram.as_ref()));
    let (j, w) = (Col(Some(12), RIGHT, 0), Col(Some(10), RIGHT, 0));
    block(o, &[Col(Some(32), LEFT, 0), j, j, w, Col(Some(6), RIGHT, 0)], rows, 1);
    let parts =
        if l.energy_components.is_empty() { String::new() } else { format!("  ({})", l.energy_components.join(" + ")) };
    let _ = writeln!(o, "{}", fit(&format!("  {:<32}{:>12}{parts}", "total", num(l.energy_per_step_j, 3)), WIDTH));
    let below = l
        .gpus
        .iter()
        .flatten()
        .map(|g| &g.energy)
        .chain(l.cpu.as_ref())
        .chain(l.dram.as_ref())
        .filter_map(|e| e.below_resolution)
        .max()
        .unwrap_or(0);
    if below > 0 {
        let _ = writeln!(
            o,
            "  {below} of {} steps are shorter than an energy counter's update period:\n  \
             their energy is an interpolated share (see ± J/step)",
            l.measured
        );
    }
}

fn render_kernels(o: &mut String, kernels: Option<&[TopKernel]>) {
    let Some(kernels) = kernels else {
        let _ = writeln!(o, "top kernels: {ABSENT} (launch rows not kept: --launches count)");
        return;
    };
    if kernels.is_empty() {
        let _ = writeln!(o, "top kernels: no launches recorded");
        return;
    }
    let _ = writeln!(o, "top kernels (whole session)");
    let mut rows = vec![["launches", "share", "kernel"].map(str::to_owned).to_vec()];
    for k in kernels {
        let name = kernel_display(k.name.as_deref(), k.demangled_name.as_deref(), k.api.as_deref(), k.function);
        rows.push(vec![k.launches.to_string(), format!("{:.1}%", 100.0 * k.share), fit(&name, WIDTH - 22)]);
    }
    block(o, &[Col(Some(10), RIGHT, 0), Col(Some(6), RIGHT, 2), Col(None, LEFT, 2)], rows, 1);
}

#[cfg(test)]
mod tests {
    use super::{
        super::build::{BoundEvidence, BoundReport, BoundRun, BoundShare, GpuEnergy, REPORT_VERSION},
        *,
    };
    use crate::profile::sessions::SessionInfo;

    /// A report with every section filled: an unclean session, capabilities
    /// with long reasons, two labels, named GPUs, wide glyphs in names.
    fn sample_report() -> Report {
        let stat = |j: f64| EnergyStat {
            steps: 47,
            energy_per_step_j: Some(j),
            energy_error_per_step_j: Some(j / 100.0),
            avg_power_w: Some(j * 10.0),
            below_resolution: Some(3),
        };
        let p = |v: f64| Percentiles { p50: v, p90: v * 1.5, p99: v * 2.0, max: v * 3.0, mean: v * 1.1 };
        let label = |name: &str, gpus: Option<Vec<GpuEnergy>>| LabelReport {
            label: name.into(),
            steps: 50,
            completed: 50,
            skipped: 3,
            measured: 47,
            steps_per_s: Some(9.87),
            step_time_ms: Some(p(101.2345)),
            inter_step_ms: None,
            launches_per_step: Some(p(20.0)),
            sync_wait_share: Some(0.25),
            data_wait_ms: None,
            optimizer_ms: None,
            dispatch_ms: None,
            epochs: None,
            gpus,
            cpu: Some(stat(8.0)),
            dram: None,
            energy_per_step_j: Some(69.6),
            energy_components: vec!["GPU 0".into(), "GPU 1".into(), "CPU".into()],
            tflops_per_s: Some(p(1234.5)),
            mfu_pct: Some(p(45.6)),
            mfu_gpm_pct: Some(p(38.9)),
            bound: Some(BoundReport {
                verdicts: vec![
                    BoundShare {
                        verdict: "gpu",
                        steps: 87,
                        pct: 87.0,
                        evidence: Some(BoundEvidence { name: "sync wait", p50_ms: 12.25 }),
                    },
                    BoundShare { verdict: "data", steps: 13, pct: 13.0, evidence: None },
                ],
                runs: vec![BoundRun {
                    first_step: 1200,
                    last_step: 1260,
                    verdict: "data",
                    evidence: Some(BoundEvidence { name: "data wait", p50_ms: 41.0 }),
                }],
            }),
        };
        let gpu = |gpu: i64, name: &str| GpuEnergy { gpu, name: Some(name.into()), energy: stat(61.5) };
        let cap = |source: &str, metric: &str, reason: Option<&str>| CapabilityRow {
            source: source.into(),
            metric: metric.into(),
            available: reason.is_none(),
            reason: reason.map(str::to_owned),
        };
        let kernel = |name: Option<&str>, launches: i64| TopKernel {
            function: 0x100000 + launches,
            name: name.map(str::to_owned),
            demangled_name: None,
            api: Some("cuLaunchKernel".into()),
            launches,
            share: launches as f64 / 1000.0,
        };
        Report {
            report_version: REPORT_VERSION,
            database: "/tmp/a/rather/long/path/to/the/profile/written/by/the/profiler/run/profile.db".into(),
            skip: 3,
            label_filter: None,
            session: SessionInfo {
                id: 2,
                pid: 4242,
                command: "python train.py --epochs 10 --batch-size 256 --learning-rate 0.001 --data /data/imagenet"
                    .into(),
                exe: None,
                mode: "attach".into(),
                launch_mode: "all".into(),
                step_symbol: Some("python:train.py:train_step".into()),
                budget: None,
                started_utc: Some("2025-06-01 12:00:03".into()),
                started_unix_s: 0.0,
                duration_s: None,
                state: SessionState::Unclean,
                end_reason: None,
                lost_events: Some(0),
                total_launches: Some(1000),
                stored_launches: Some(1000),
                unmatched_returns: Some(0),
                sched_mismatches: Some(2),
                hostname: None,
                kernel_release: None,
                profiler_version: "0.1.0".into(),
                job: Some("job-1".into()),
                rank: None,
                job_processes: 1,
            },
            capabilities: vec![
                cap("nvml", "GPU_0/power", None),
                cap("nvml", "GPU_0/fan.speed", Some("Not Supported: this GPU has no fan (passively cooled board)")),
                cap(
                    "rapl",
                    "package",
                    Some(
                        "no powercap tree at /sys/class/powercap and no perf power PMU: this machine (a VM?) does not expose RAPL to the guest",
                    ),
                ),
                cap(
                    "rapl",
                    "dram",
                    Some(
                        "no powercap tree at /sys/class/powercap and no perf power PMU: this machine (a VM?) does not expose RAPL to the guest",
                    ),
                ),
            ],
            labels: vec![
                label("train", Some(vec![gpu(0, "NVIDIA H200"), gpu(1, "显卡 H200 with a very long marketing name")])),
                label("validate", None),
            ],
            top_kernels: Some(vec![
                kernel(
                    Some(
                        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)",
                    ),
                    500,
                ),
                kernel(Some("核函数_核函数_核函数_核函数_核函数_核函数_核函数_核函数_核函数"), 300),
                kernel(None, 200),
            ]),
            top_regions: Vec::new(),
            cpu: None,
        }
    }

    /// The table fits 80 terminal columns, wide glyphs counted as two.
    #[test]
    fn table_fits_80_columns() {
        let table = render_table(&sample_report());
        println!("{table}");
        assert!(table.contains("2 switches did not fit"), "the scheduler's mismatches are in the session block");
        for line in table.lines() {
            assert!(line.width() <= WIDTH, "wider than {WIDTH}: {line:?}");
        }
    }

    #[test]
    fn fit_cuts_with_an_ellipsis() {
        assert_eq!(fit("abcdef", 6), "abcdef");
        assert_eq!(fit("abcdefg", 6), "abcde…");
        assert_eq!(fit("µµµµ", 3), "µµ…");
    }

    #[test]
    fn fit_counts_terminal_columns() {
        assert_eq!(fit("显卡显卡", 8), "显卡显卡");
        assert_eq!(fit("显卡显卡", 7), "显卡显…");
        assert_eq!(fit("显卡显卡", 6), "显卡…");
    }

    /// A block wraps a cell at spaces within its column and keeps at most
    /// `max_lines` lines of a row, the last one cut with an ellipsis.
    #[test]
    fn blocks_wrap_and_cut_rows() {
        let mut o = String::new();
        let cols = [Col(Some(3), LEFT, 0), Col(Some(6), LEFT, 0)];
        block(&mut o, &cols, vec![vec!["k".into(), "a bb ccc dddd eeee".into()], vec![String::new(), "x".into()]], 2);
        assert_eq!(o, "  k  a bb\n     ccc…\n     x\n");
    }
}
