//! The writer thread: takes typed rows over a bounded channel and writes them
//! in batched transactions; at the end, the session's last transaction (see
//! [`super::finish`]).
//!
//! Bounded: when SQLite falls behind, the event path blocks on `send`, the
//! ring buffer fills, and the kernel counts what it cannot reserve — loss is
//! pushed to the one place where it is counted, never dropped silently here.
use std::{
    sync::{
        Arc,
        mpsc::{Receiver, SyncSender},
    },
    thread::JoinHandle,
};

use rusqlite::{Connection, Transaction, params};

use super::{
    StoreError, StoreMsg, WriterStats,
    budget::{Budget, BudgetState, RowKind},
    i,
    rows::{
        AtFinish, GpuRow, GpuSampleRow, KernelRow, LaunchRow, ProbedFileRow, RegionRow, SessionEnd, StepRow, SyncRow,
        SystemSampleRow,
    },
};

/// Handle to the writer thread.
pub struct StoreWriter {
    pub(super) tx: SyncSender<StoreMsg>,
    pub(super) join: JoinHandle<Result<WriterStats, StoreError>>,
    pub(super) budget: Arc<BudgetState>,
}

impl StoreWriter {
    /// Sends rows; blocks while the writer is behind (see module docs).
    pub fn send(&self, msg: StoreMsg) {
        // The writer only goes away after Finish; a send after that is a bug
        // worth a log line, not a panic that would lose the session.
        if self.tx.send(msg).is_err() {
            log::error!("store writer is gone; rows not written");
        }
    }

    /// A sender for sampler threads and the consumer.
    pub fn sender(&self) -> RowSender {
        RowSender { tx: self.tx.clone(), process: None, budget: self.budget.clone() }
    }

    /// Finishes the session: derives `at_finish` in the last transaction,
    /// records the end, and waits for everything to be on disk.
    pub fn finish(self, end: SessionEnd, at_finish: Vec<AtFinish>) -> Result<WriterStats, StoreError> {
        self.send(StoreMsg::Finish(end, at_finish));
        drop(self.tx);
        self.join.join().unwrap_or_else(|payload| {
            let message = crate::thread_panic::panic_message(&*payload);
            Ok(WriterStats {
                first_error: Some(format!("the database writer panicked: {message}")),
                ..Default::default()
            })
        })
    }
}

/// A clonable handle for what produces rows (samplers, consumers): for the
/// first session, or for a job's other process ([`RowSender::for_process`]).
#[derive(Clone)]
pub struct RowSender {
    tx: SyncSender<StoreMsg>,
    process: Option<u32>,
    budget: Arc<BudgetState>,
}

impl RowSender {
    pub fn send(&self, msg: StoreMsg) {
        let msg = match self.process {
            Some(pid) => StoreMsg::ForProcess(pid, Box::new(msg)),
            None => msg,
        };
        if self.tx.send(msg).is_err() {
            log::error!("store writer is gone; rows not written");
        }
    }

    /// A sender whose rows go to the session of the job's process `pid`.
    pub fn for_process(&self, pid: u32) -> RowSender {
        RowSender { tx: self.tx.clone(), process: Some(pid), budget: self.budget.clone() }
    }

    /// The size budget has stopped every row: the session should end.
    pub fn budget_spent(&self) -> bool {
        self.budget.all_stopped()
    }
}

fn write_batch(
    conn: &mut Connection,
    session_id: i64,
    msgs: &[StoreMsg],
    budget: &mut Budget,
    stats: &mut WriterStats,
) -> rusqlite::Result<()> {
    let tx = conn.transaction()?;
    for msg in msgs {
        write_msg(&tx, session_id, msg)?;
    }
    // What the budget stopped, with the rows it was decided on.
    super::budget::record(&tx, session_id, budget.config(), budget.floor(), &budget.fresh)?;
    tx.commit()?;
    budget.fresh.clear();
    // Counted once the transaction commits: a batch rolled back stored nothing.
    stats.transactions += 1;
    for msg in msgs {
        let msg = match msg {
            StoreMsg::ForProcess(_, inner) => inner,
            m => m,
        };
        match msg {
            StoreMsg::Launches(rows) => stats.launches += rows.len() as u64,
            StoreMsg::Steps(rows) => stats.steps += rows.len() as u64,
            _ => {}
        }
    }
    Ok(())
}

pub(super) fn write_msg(tx: &Transaction<'_>, session_id: i64, msg: &StoreMsg) -> rusqlite::Result<()> {
    match msg {
        StoreMsg::Process(start) => super::job::upsert_process(tx, session_id, start),
        StoreMsg::ForProcess(pid, inner) => write_msg(tx, super::job::session_of(tx, session_id, *pid)?, inner),
        StoreMsg::Kernels(rows) => write_kernels(tx, session_id, rows),
        StoreMsg::Syncs(rows) => write_syncs(tx, session_id, rows),
        StoreMsg::Regions(rows) => write_regions(tx, session_id, rows),
        StoreMsg::Collectives(rows) => super::collectives::write_collectives(tx, session_id, rows),
        StoreMsg::Copies(rows) => super::copies::write_copies(tx, session_id, rows),
        StoreMsg::JitCalls(rows) => super::jax::write_jit_calls(tx, session_id, rows),
        StoreMsg::OffCpu(rows) => super::off_cpu::write_off_cpu(tx, session_id, rows),
        StoreMsg::CpuSamples(rows) => super::cpu_samples::write_samples(tx, session_id, rows),
        StoreMsg::CpuStacks(frames, stacks) => super::cpu_samples::write_stacks(tx, session_id, frames, stacks),
        StoreMsg::Capability(c) => tx
            .execute(
                "INSERT OR IGNORE INTO capabilities(session_id, source, metric, available, reason)
                 VALUES (?1, ?2, ?3, ?4, ?5)",
                params![session_id, c.source, c.metric, c.available, c.reason],
            )
            .map(drop),
        StoreMsg::Launches(rows) => write_launches(tx, session_id, rows),
        StoreMsg::Steps(rows) => write_steps(tx, session_id, rows),
        StoreMsg::ProbedFile(f) => write_probed_file(tx, session_id, f),
        StoreMsg::Gpus(rows) => write_gpus(tx, session_id, rows),
        StoreMsg::GpusUsedByTarget(gpus) => {
            let mut stmt =
                tx.prepare_cached("UPDATE gpus SET used_by_target = 1 WHERE session_id = ?1 AND gpu = ?2")?;
            gpus.iter().try_for_each(|g| stmt.execute(params![session_id, g]).map(drop))
        }
        StoreMsg::GpuSamples(rows) => write_gpu_samples(tx, session_id, rows),
        StoreMsg::RaplSamples(rows) => {
            let mut stmt = tx.prepare_cached(
                "INSERT INTO rapl_samples(session_id, ts_ns, domain, energy_j) VALUES (?1, ?2, ?3, ?4)",
            )?;
            rows.iter().try_for_each(|r| stmt.execute(params![session_id, i(r.ts_ns), r.domain, r.energy_j]).map(drop))
        }
        StoreMsg::SystemSamples(rows) => write_system_samples(tx, session_id, rows),
        StoreMsg::Gemms(rows) => super::gemms::write_gemms(tx, session_id, rows),
        StoreMsg::StepGemms(sums) => super::gemms::write_step_gemms(tx, session_id, sums),
        StoreMsg::StepGemmsSoFar(sums) => super::gemms::write_step_sums(tx, session_id, sums),
        StoreMsg::Finish(..) | StoreMsg::EndProcess(..) => Ok(()),
    }
}

fn write_kernels(tx: &Transaction<'_>, session_id: i64, rows: &[KernelRow]) -> rusqlite::Result<()> {
    // A handle's first name, else a rename (see migration 6, `kernel_renames`):
    // the consumer sends a handle's name again only when it changed.
    let mut first = tx.prepare_cached(
        "INSERT OR IGNORE INTO kernels(session_id, function, name, demangled_name, source)
         VALUES (?1, ?2, ?3, ?4, ?5)",
    )?;
    let mut rename = tx.prepare_cached(
        "INSERT OR IGNORE INTO kernel_renames(session_id, function, named_ns, name, demangled_name, source)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?;
    for r in rows {
        let params = params![session_id, i(r.function), r.name, r.demangled_name, r.source];
        if first.execute(params)? == 0 {
            rename.execute(params![session_id, i(r.function), i(r.named_ns), r.name, r.demangled_name, r.source])?;
        }
    }
    Ok(())
}

fn write_syncs(tx: &Transaction<'_>, session_id: i64, rows: &[SyncRow]) -> rusqlite::Result<()> {
    let mut stmt = tx.prepare_cached(
        "INSERT INTO syncs(session_id, tid, api, start_ns, end_ns, label, step) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?;
    for r in rows {
        let (label, step) = (r.step.map(|s| s.0), r.step.map(|s| i(s.1)));
        stmt.execute(params![session_id, r.tid, r.api, i(r.start_ns), i(r.end_ns), label, step])?;
    }
    Ok(())
}

fn write_launches(tx: &Transaction<'_>, session_id: i64, rows: &[LaunchRow]) -> rusqlite::Result<()> {
    let mut launch = tx.prepare_cached(
        "INSERT INTO launches(session_id, ts_ns, tid, api, function, grid_x, grid_y, grid_z,
                              block_x, block_y, block_z, shared_mem_bytes, stream, label, step)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
    )?;
    for r in rows {
        launch.execute(params![
            session_id,
            i(r.ts_ns),
            r.tid,
            r.api as u32,
            i(r.function),
            r.grid[0],
            r.grid[1],
            r.grid[2],
            r.block[0],
            r.block[1],
            r.block[2],
            r.shared_mem_bytes,
            i(r.stream),
            r.step.map(|s| s.0),
            r.step.map(|s| i(s.1))
        ])?;
    }
    Ok(())
}

fn write_steps(tx: &Transaction<'_>, session_id: i64, rows: &[StepRow]) -> rusqlite::Result<()> {
    let mut step = tx.prepare_cached(
        "INSERT OR REPLACE INTO steps(session_id, label, step, tid, start_ns, end_ns, duration_ns, inter_step_ns, launches,
                                      sync_wait_ns, data_wait_ns, optimizer_ns,
                                      cpu_ns, runnable_ns, sleep_ns, blocked_ns, other_cpu_ns,
                                      h2d_bytes, d2h_bytes, d2d_bytes, copy_calls, copy_ns)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22)",
    )?;
    for r in rows {
        let sched = r.sched.map(|s| [s.cpu_ns, s.runnable_ns, s.sleep_ns, s.blocked_ns, s.other_cpu_ns].map(i));
        let c = &r.copies;
        step.execute(params![
            session_id,
            r.label,
            i(r.step),
            r.tid,
            i(r.start_ns),
            r.end_ns.map(i),
            r.end_ns.map(|e| i(e.saturating_sub(r.start_ns))),
            r.inter_step_ns.map(i),
            r.launches.map(i),
            r.sync_wait_ns.map(i),
            r.phases.map(|p| i(p.data_wait_ns)),
            r.phases.map(|p| i(p.optimizer_ns)),
            sched.map(|s| s[0]),
            sched.map(|s| s[1]),
            sched.map(|s| s[2]),
            sched.map(|s| s[3]),
            sched.map(|s| s[4]),
            i(c.h2d_bytes),
            i(c.d2h_bytes),
            i(c.d2d_bytes),
            i(c.calls),
            i(c.ns)
        ])?;
    }
    Ok(())
}

fn write_regions(tx: &Transaction<'_>, session_id: i64, rows: &[RegionRow]) -> rusqlite::Result<()> {
    let mut stmt = tx.prepare_cached(
        "INSERT INTO regions(session_id, tid, name, truncated, start_ns, end_ns, label, step)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?;
    for r in rows {
        let (label, step) = (r.step.map(|s| s.0), r.step.map(|s| i(s.1)));
        stmt.execute(params![session_id, r.tid, r.name, r.truncated, i(r.start_ns), r.end_ns.map(i), label, step])?;
    }
    Ok(())
}

fn write_probed_file(tx: &Transaction<'_>, session_id: i64, f: &ProbedFileRow) -> rusqlite::Result<()> {
    tx.execute(
        "INSERT INTO probed_files(session_id, path, kind, attached_ns, probes, how) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![session_id, f.path, f.kind, i(f.attached_ns), f.probes, f.how],
    )?;
    for (symbol, offset, reason) in &f.placed {
        tx.execute(
            "INSERT INTO probes(session_id, library, symbol, offset, reason) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![session_id, f.path, symbol, i(*offset), reason],
        )?;
    }
    Ok(())
}

fn write_gpus(tx: &Transaction<'_>, session_id: i64, rows: &[GpuRow]) -> rusqlite::Result<()> {
    let mut stmt = tx.prepare_cached(
        "INSERT INTO gpus(session_id, gpu, nvml_index, uuid, name, memory_total_mib, power_limit_w,
                          driver_version, power_source, max_sm_clock_mhz)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
    )?;
    for g in rows {
        stmt.execute(params![
            session_id,
            g.gpu,
            g.nvml_index,
            g.uuid,
            g.name,
            g.memory_total_mib,
            g.power_limit_w,
            g.driver_version,
            g.power_source,
            g.max_sm_clock_mhz
        ])?;
    }
    Ok(())
}

fn write_gpu_samples(tx: &Transaction<'_>, session_id: i64, rows: &[GpuSampleRow]) -> rusqlite::Result<()> {
    let mut stmt = tx.prepare_cached(
        "INSERT INTO gpu_samples(session_id, gpu, ts_ns, utilization_gpu_pct, utilization_memory_pct,
             memory_used_mib, memory_free_mib, memory_total_mib, power_w, memory_power_w, energy_j, temperature_gpu_c,
             temperature_memory_c, fan_speed_pct, sm_clock_mhz, memory_clock_mhz, clock_throttle_reasons,
             gpm_start_ns, tensor_util_pct, hmma_util_pct, dfma_util_pct, sm_util_pct, sm_occupancy_pct,
             dram_bw_util_pct)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17,
                 ?18, ?19, ?20, ?21, ?22, ?23, ?24)",
    )?;
    for r in rows {
        stmt.execute(params![
            session_id,
            r.gpu,
            i(r.ts_ns),
            r.utilization_gpu_pct,
            r.utilization_memory_pct,
            r.memory_used_mib,
            r.memory_free_mib,
            r.memory_total_mib,
            r.power_w,
            r.memory_power_w,
            r.energy_j,
            r.temperature_gpu_c,
            r.temperature_memory_c,
            r.fan_speed_pct,
            r.sm_clock_mhz,
            r.memory_clock_mhz,
            r.clock_throttle_reasons,
            r.gpm.map(|g| i(g.start_ns)),
            r.gpm.and_then(|g| g.tensor_util_pct),
            r.gpm.and_then(|g| g.hmma_util_pct),
            r.gpm.and_then(|g| g.dfma_util_pct),
            r.gpm.and_then(|g| g.sm_util_pct),
            r.gpm.and_then(|g| g.sm_occupancy_pct),
            r.gpm.and_then(|g| g.dram_bw_util_pct)
        ])?;
    }
    Ok(())
}

fn write_system_samples(tx: &Transaction<'_>, session_id: i64, rows: &[SystemSampleRow]) -> rusqlite::Result<()> {
    let mut stmt = tx.prepare_cached(
        "INSERT INTO system_samples(session_id, ts_ns, cpu_usage_pct, process_cpu_pct, ram_used_gb, ram_usage_pct,
                                    process_rss_gb, disk_used_gb, disk_usage_pct)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
    )?;
    for r in rows {
        stmt.execute(params![
            session_id,
            i(r.ts_ns),
            r.cpu_usage_pct,
            r.process_cpu_pct,
            r.ram_used_gb,
            r.ram_usage_pct,
            r.process_rss_gb,
            r.disk_used_gb,
            r.disk_usage_pct
        ])?;
    }
    Ok(())
}

fn rows_in(msgs: &[StoreMsg]) -> u64 {
    msgs.iter()
        .map(|m| match m {
            StoreMsg::Launches(r) => r.len() as u64,
            StoreMsg::Steps(r) => r.len() as u64,
            StoreMsg::Syncs(r) => r.len() as u64,
            StoreMsg::Regions(r) => r.len() as u64,
            StoreMsg::Collectives(r) => r.len() as u64,
            StoreMsg::Copies(r) => r.len() as u64,
            StoreMsg::JitCalls(r) => r.len() as u64,
            StoreMsg::OffCpu(r) => r.len() as u64,
            StoreMsg::CpuSamples(r) => r.len() as u64,
            StoreMsg::CpuStacks(f, s) => (f.len() + s.iter().map(|s| s.frames.len()).sum::<usize>()) as u64,
            StoreMsg::Kernels(r) => r.len() as u64,
            StoreMsg::Gpus(r) => r.len() as u64,
            StoreMsg::GpusUsedByTarget(r) => r.len() as u64,
            StoreMsg::GpuSamples(r) => r.len() as u64,
            StoreMsg::RaplSamples(r) => r.len() as u64,
            StoreMsg::SystemSamples(r) => r.len() as u64,
            StoreMsg::Gemms(r) => r.len() as u64,
            StoreMsg::StepGemms(r) | StoreMsg::StepGemmsSoFar(r) => r.len() as u64,
            StoreMsg::ProbedFile(_) | StoreMsg::Capability(_) | StoreMsg::Process(_) => 1,
            StoreMsg::ForProcess(_, inner) => rows_in(std::slice::from_ref(inner)),
            StoreMsg::Finish(..) | StoreMsg::EndProcess(..) => 0,
        })
        .sum()
}

/// The writer thread's body: batches until Finish (or until every sender is
/// gone), then the session's last transaction.
pub(super) fn write_loop(
    mut conn: Connection,
    session_id: i64,
    rx: Receiver<StoreMsg>,
    mut budget: Budget,
) -> Result<WriterStats, StoreError> {
    let mut stats = WriterStats::default();
    let mut end: Option<(SessionEnd, Vec<AtFinish>)> = None;
    // The job's other processes that ended: derived at the end (see `job`).
    let mut ended = Vec::new();
    let mut batch: Vec<StoreMsg> = Vec::new();
    // A transaction's pages are all in the `-wal` until it commits: batches
    // stay well under the size it is truncated back to.
    let batch_bytes = budget.wal_limit() / 4;
    while end.is_none() {
        let Ok(first) = rx.recv() else { break };
        let mut bytes = RowKind::of(&first).bytes();
        batch.push(first);
        // Everything already queued goes into the same transaction.
        while batch.len() < 1024 && bytes < batch_bytes {
            match rx.try_recv() {
                Ok(m) => {
                    bytes += RowKind::of(&m).bytes();
                    batch.push(m);
                }
                Err(_) => break,
            }
        }
        if let Some(pos) = batch.iter().position(|m| matches!(m, StoreMsg::Finish(..)))
            && let StoreMsg::Finish(e, work) = batch.remove(pos)
        {
            end = Some((e, work));
        }
        super::job::take_ended(&mut batch, &mut ended);
        batch.retain(|m| budget.admit(m));
        if let Err(e) = write_batch(&mut conn, session_id, &batch, &mut budget, &mut stats) {
            stats.failed_rows += rows_in(&batch);
            if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull) {
                budget.disk_full(&e.to_string());
            } else {
                stats.first_error.get_or_insert_with(|| e.to_string());
            }
        }
        batch.clear();
        super::budget::keep_wal_small(&conn, &budget);
        budget.remeasure();
    }
    let (end, work) = end.unwrap_or_else(|| {
        let end = SessionEnd {
            ended_ns: crate::clock::monotonic_ns(),
            end_reason: "error: event path stopped without finishing the session".into(),
            lost_events: 0,
            total_launches: 0,
            unmatched_returns: 0,
        };
        (end, Vec::new())
    });
    if let Err(e) = super::budget::record_at_finish(&mut conn, session_id, &budget) {
        stats.first_error.get_or_insert_with(|| format!("recording the size budget: {e}"));
    }
    super::job::finish_processes(&mut conn, session_id, &end, &work, ended, &mut stats);
    super::finish::finish_session(&mut conn, session_id, &end, &work, &mut stats)?;
    Ok(stats)
}
