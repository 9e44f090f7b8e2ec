//! The report as CSV (`--format csv`): one figure per row.
use std::io::Write;

use super::build::{EnergyStat, LabelReport, Percentiles, Report};
use crate::profile::kernels::kernel_display;

/// `--format csv`: one figure per row, `section,label,metric,value,unit`;
/// an absent figure has an empty value.
pub(super) fn write_csv(r: &Report, out: &mut impl Write) -> anyhow::Result<()> {
    let mut w = ::csv::Writer::from_writer(out);
    w.write_record(["section", "label", "metric", "value", "unit"])?;
    let mut row = |section: &str, label: &str, metric: &str, value: Option<String>, unit: &str| {
        w.write_record([section, label, metric, value.as_deref().unwrap_or(""), unit])
    };
    let f = |v: Option<f64>| v.map(|v| v.to_string());
    let i = |v: Option<i64>| v.map(|v| v.to_string());
    let s = &r.session;
    row("session", "", "id", Some(s.id.to_string()), "")?;
    row("session", "", "pid", Some(s.pid.to_string()), "")?;
    row("session", "", "command", Some(s.command.clone()), "")?;
    row("session", "", "mode", Some(s.mode.clone()), "")?;
    row("session", "", "launch_mode", Some(s.launch_mode.clone()), "")?;
    row("session", "", "started_utc", s.started_utc.clone(), "")?;
    row("session", "", "duration", f(s.duration_s), "s")?;
    row("session", "", "state", Some(s.state.as_str().to_owned()), "")?;
    row("session", "", "end_reason", s.end_reason.clone(), "")?;
    row("session", "", "lost_events", i(s.lost_events), "")?;
    row("session", "", "total_launches", i(s.total_launches), "")?;
    row("session", "", "stored_launches", i(s.stored_launches), "")?;
    for c in &r.capabilities {
        row("capability", &c.source, &c.metric, Some(u8::from(c.available).to_string()), "")?;
    }
    for l in &r.labels {
        label_rows(l, &mut row)?;
    }
    for k in r.top_kernels.iter().flatten() {
        let name = kernel_display(k.name.as_deref(), k.demangled_name.as_deref(), k.api.as_deref(), k.function);
        row("kernel", "", &name, Some(k.launches.to_string()), "launches")?;
    }
    for g in &r.top_regions {
        row("region", "", &g.name, Some(g.total_ms.to_string()), "ms")?;
    }
    w.flush()?;
    Ok(())
}

/// One CSV row: section, label, metric, value (None: empty), unit.
type RowWriter<'a> = dyn FnMut(&str, &str, &str, Option<String>, &str) -> ::csv::Result<()> + 'a;

/// A label's rows: its step counts and percentiles, sync wait, and energy per source.
fn label_rows(l: &LabelReport, row: &mut RowWriter<'_>) -> ::csv::Result<()> {
    let f = |v: Option<f64>| v.map(|v| v.to_string());
    let n = |v: u64| Some(v.to_string());
    row("steps", &l.label, "steps", n(l.steps), "")?;
    row("steps", &l.label, "completed", n(l.completed), "")?;
    row("steps", &l.label, "skipped", n(l.skipped), "")?;
    row("steps", &l.label, "measured", n(l.measured), "")?;
    row("steps", &l.label, "steps_per_s", f(l.steps_per_s), "1/s")?;
    for (name, p, unit) in [
        ("step_time", &l.step_time_ms, "ms"),
        ("inter_step", &l.inter_step_ms, "ms"),
        ("launches_per_step", &l.launches_per_step, ""),
        ("data_wait", &l.data_wait_ms, "ms"),
        ("optimizer", &l.optimizer_ms, "ms"),
        ("dispatch", &l.dispatch_ms, "ms"),
    ] {
        for (stat, get) in [
            ("p50", (|p: &Percentiles| p.p50) as fn(&Percentiles) -> f64),
            ("p90", |p| p.p90),
            ("p99", |p| p.p99),
            ("max", |p| p.max),
            ("mean", |p| p.mean),
        ] {
            row("steps", &l.label, &format!("{name}_{stat}"), f(p.as_ref().map(get)), unit)?;
        }
    }
    row("steps", &l.label, "sync_wait_share", f(l.sync_wait_share), "")?;
    let mut energy = |prefix: &str, e: Option<&EnergyStat>| -> ::csv::Result<()> {
        row("energy", &l.label, &format!("{prefix}_energy_per_step"), f(e.and_then(|e| e.energy_per_step_j)), "J")?;
        row(
            "energy",
            &l.label,
            &format!("{prefix}_energy_error_per_step"),
            f(e.and_then(|e| e.energy_error_per_step_j)),
            "J",
        )?;
        row("energy", &l.label, &format!("{prefix}_avg_power"), f(e.and_then(|e| e.avg_power_w)), "W")
    };
    for g in l.gpus.iter().flatten() {
        energy(&format!("gpu{}", g.gpu), Some(&g.energy))?;
    }
    energy("cpu", l.cpu.as_ref())?;
    energy("dram", l.dram.as_ref())?;
    row("energy", &l.label, "total_energy_per_step", f(l.energy_per_step_j), "J")?;
    Ok(())
}
