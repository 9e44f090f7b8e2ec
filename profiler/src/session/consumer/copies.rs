//! The consumer's side of copies and memsets: each call counts toward the
//! step its thread is in (bytes by direction, calls, host time: exact under
//! any `--launches`), and under `--launches all` becomes a `copies` row.
use super::Consumer;
use crate::{
    events::CopyEvent,
    steps::DepthChange,
    store::{CopyRow, StoreMsg},
};

/// The state the consumer keeps for copies.
#[derive(Default)]
pub(super) struct CopyState {
    /// `--launches all`: a row per call.
    pub keep_rows: bool,
    pub rows: Vec<CopyRow>,
}

impl Consumer {
    /// `--launches all`: a `copies` row per call; otherwise only the per-step sums.
    pub(in crate::session) fn keep_copy_rows(&mut self, keep: bool) {
        self.copies.keep_rows = keep;
    }

    /// Whether the scheduler programs are attached (steps then get their scheduler columns).
    pub(in crate::session) fn trace_sched(&mut self, on: bool) {
        self.tracker.sched = on;
    }

    /// A copy or memset returned.
    pub(super) fn copy(&mut self, c: &CopyEvent) {
        self.sequence(&c.as_ordered_event(), DepthChange::None);
        self.tracker.add_copy(c);
        if self.copies.keep_rows {
            let step = self.tracker.current_step(c.tid);
            self.copies.rows.push(CopyRow {
                tid: c.tid,
                api: c.entry.symbol,
                direction: c.direction.as_str(),
                bytes: c.bytes,
                result: c.result,
                start_ns: c.start_ns,
                end_ns: c.ts_ns,
                step,
            });
        }
    }

    /// Sends the copy rows.
    pub(super) fn flush_copies(&mut self) {
        if !self.copies.rows.is_empty() {
            self.writer.send(StoreMsg::Copies(std::mem::take(&mut self.copies.rows)));
        }
    }
}
