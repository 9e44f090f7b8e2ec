//! The consumer's side of NCCL calls: each record becomes a `collectives`
//! row in the step its thread is in, with NCCL's datatype named and the
//! bytes it moves counted.
use super::Consumer;
use crate::{
    events::CollectiveEvent,
    steps::DepthChange,
    store::{CollectiveRow, StoreMsg},
};

/// NCCL's name and element size of an `ncclDataType_t` (nccl.h, NCCL 2.30:
/// the fp8 types are 10 and 11).
pub(super) fn datatype(value: u32) -> Option<(&'static str, u64)> {
    Some(match value {
        0 => ("int8", 1),
        1 => ("uint8", 1),
        2 => ("int32", 4),
        3 => ("uint32", 4),
        4 => ("int64", 8),
        5 => ("uint64", 8),
        6 => ("float16", 2),
        7 => ("float32", 4),
        8 => ("float64", 8),
        9 => ("bfloat16", 2),
        10 => ("float8e4m3", 1),
        11 => ("float8e5m2", 1),
        _ => return None,
    })
}

/// The row of one call, in `step`. The group calls take no arguments: their
/// count, datatype, comm and stream are NULL.
pub(super) fn row(c: &CollectiveEvent, step: Option<(&'static str, u64)>) -> CollectiveRow {
    let group = matches!(c.op, profiler_common::CollectiveOp::GroupStart | profiler_common::CollectiveOp::GroupEnd);
    let known = datatype(c.datatype);
    CollectiveRow {
        tid: c.tid,
        op: c.op.as_str(),
        count: (!group).then_some(c.count),
        datatype: (!group).then(|| known.map_or_else(|| c.datatype.to_string(), |(name, _)| name.to_owned())),
        bytes: if group { None } else { known.map(|(_, size)| c.count.saturating_mul(size)) },
        peer: c.peer,
        comm: (!group).then_some(c.comm),
        stream: (!group).then_some(c.stream),
        start_ns: c.start_ns,
        end_ns: c.ts_ns,
        step,
    }
}

impl Consumer {
    /// An NCCL call returned: a row in the step its thread is in.
    pub(super) fn collective(&mut self, c: &CollectiveEvent) {
        self.sequence(&c.as_ordered_event(), DepthChange::None);
        let step = self.tracker.current_step(c.tid);
        self.collectives.push(row(c, step));
    }

    /// Sends the collective rows.
    pub(super) fn flush_collectives(&mut self) {
        if !self.collectives.is_empty() {
            self.writer.send(StoreMsg::Collectives(std::mem::take(&mut self.collectives)));
        }
    }
}

#[cfg(test)]
mod tests {
    use profiler_common::CollectiveOp;

    use super::*;

    fn event(op: CollectiveOp, count: u64, datatype: u32) -> CollectiveEvent {
        CollectiveEvent {
            ts_ns: 900,
            tid: 7,
            tgid: 7,
            op,
            start_ns: 100,
            count,
            datatype,
            peer: None,
            comm: 0xc0,
            stream: 0x50,
            thread_launches: 0,
            seq: 1,
            depth: 1,
        }
    }

    #[test]
    fn bytes_are_count_times_the_element_size() {
        let r = row(&event(CollectiveOp::AllReduce, 1000, 9), Some(("train", 3)));
        assert_eq!((r.op, r.datatype.as_deref(), r.bytes), ("all_reduce", Some("bfloat16"), Some(2000)));
        assert_eq!((r.start_ns, r.end_ns, r.step), (100, 900, Some(("train", 3))));
        let fp8 = row(&event(CollectiveOp::AllGather, 64, 11), None);
        assert_eq!((fp8.datatype.as_deref(), fp8.bytes), (Some("float8e5m2"), Some(64)));
    }

    #[test]
    fn an_unknown_datatype_keeps_its_number_and_no_bytes() {
        let r = row(&event(CollectiveOp::Send, 5, 42), None);
        assert_eq!((r.datatype.as_deref(), r.bytes, r.count), (Some("42"), None, Some(5)));
    }

    #[test]
    fn group_calls_have_no_arguments() {
        let r = row(&event(CollectiveOp::GroupStart, 0, u32::MAX), None);
        assert_eq!((r.count, r.datatype, r.bytes, r.comm, r.stream), (None, None, None, None, None));
    }
}
