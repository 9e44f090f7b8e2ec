//! Draining the rings: the launch ring a chunk at a time, the ordered ring after each chunk, every
//! thread's records put back in its order (see `events::OrderedQueue`) and handed to a [`Sink`].
use crate::{
    events::{self, Event},
    probes,
};

/// Launch-ring records read before the step ring is read again (see `drain`).
const DRAIN_CHUNK: usize = 1024;

/// Where decoded records go: a process's consumer, or the job that routes
/// each to its process's.
pub(super) trait Sink {
    fn take(&mut self, event: Result<Event, events::DecodeError>);
}

impl Sink for super::consumer::Consumer {
    fn take(&mut self, event: Result<Event, events::DecodeError>) {
        super::consumer::Consumer::take(self, event);
    }
}

/// The rings' reading state between drains.
#[derive(Default)]
pub(super) struct RingDrain {
    /// Step-ring events waiting for their place among the launches.
    step_queue: events::OrderedQueue,
    /// Launch-ring events read and not yet taken; step events handed on.
    chunk: Vec<Result<Event, events::DecodeError>>,
    released: Vec<Event>,
}

impl RingDrain {
    /// Drains both rings: the launch ring a chunk at a time, and after each
    /// chunk the step ring, so that every step event before a launch of the
    /// chunk is in when that launch is taken (see `events::OrderedQueue`).
    pub fn drain(&mut self, rings: &mut probes::Rings, sink: &mut impl Sink) {
        let mut chunk = std::mem::take(&mut self.chunk);
        let mut steps = std::mem::take(&mut self.released);
        loop {
            let mut read = 0;
            while read < DRAIN_CHUNK {
                let Some(item) = rings.launches.next() else { break };
                read += 1;
                chunk.extend(events::records(&item).map(events::decode));
            }
            while let Some(item) = rings.ordered.next() {
                match events::decode(&item) {
                    Ok(e) => self.step_queue.push(e, &mut steps),
                    Err(e) => sink.take(Err(e)),
                }
            }
            for event in chunk.drain(..) {
                match &event {
                    Ok(Event::Launch(l)) => self.step_queue.before_launch(l.tid, l.ts_ns, &mut steps),
                    Ok(Event::Blas(b)) => self.step_queue.before_launch(b.tid, b.ts_ns, &mut steps),
                    Ok(Event::CpuSample(c)) => self.step_queue.before_launch(c.tid, c.ts_ns, &mut steps),
                    _ => {}
                }
                for s in steps.drain(..) {
                    sink.take(Ok(s));
                }
                sink.take(event);
            }
            if read < DRAIN_CHUNK {
                break;
            }
        }
        self.step_queue.end_drain(&mut steps);
        for s in steps.drain(..) {
            sink.take(Ok(s));
        }
        self.chunk = chunk;
        self.released = steps;
    }

    /// Takes the step events still held: the probes are gone and both rings
    /// drained, so nothing can come before them any more.
    pub fn release_held_steps(&mut self, sink: &mut impl Sink) {
        let mut steps = std::mem::take(&mut self.released);
        self.step_queue.release_all(&mut steps);
        for s in steps.drain(..) {
            sink.take(Ok(s));
        }
        self.released = steps;
    }

    /// Launch records the threads still had staged when tracing stopped:
    /// each thread's come after everything it wrote to the ring buffer.
    pub fn take_staged(staged: &[profiler_common::LaunchRecord], sink: &mut impl Sink) {
        for r in staged {
            sink.take(events::launch(r));
        }
    }
}
