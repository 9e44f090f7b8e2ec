
-- Why a step is slow. Where the step's thread's time went, from the
-- scheduler's sched_switch/sched_wakeup tracepoints (NULL with --no-sched),
-- in ns: `cpu_ns` on a CPU, `runnable_ns` runnable but waiting for one
-- (woken or preempted), `sleep_ns` in an interruptible wait, `blocked_ns` in
-- an uninterruptible one (disk I/O, page faults). The four add up to the
-- step's duration (see docs/measurement.md for the bound). `other_cpu_ns`:
-- CPU time of the process's other threads during the step (autograd, pin
-- memory, runtime threads), from their finished runs.
ALTER TABLE steps ADD COLUMN cpu_ns INTEGER;
ALTER TABLE steps ADD COLUMN runnable_ns INTEGER;
ALTER TABLE steps ADD COLUMN sleep_ns INTEGER;
ALTER TABLE steps ADD COLUMN blocked_ns INTEGER;
ALTER TABLE steps ADD COLUMN other_cpu_ns INTEGER;
-- Host↔device copies and memsets the step's thread made (driver and runtime
-- entry points, each call counted once): bytes by direction, calls of every
-- kind (memsets and copies of unknown direction included), and host time in
-- them. NULL when no CUDA library was probed.
ALTER TABLE steps ADD COLUMN h2d_bytes INTEGER;
ALTER TABLE steps ADD COLUMN d2h_bytes INTEGER;
ALTER TABLE steps ADD COLUMN d2d_bytes INTEGER;
ALTER TABLE steps ADD COLUMN copy_calls INTEGER;
ALTER TABLE steps ADD COLUMN copy_ns INTEGER;
-- The step's verdict: data, input-copy, gpu, communication, cpu-starved,
-- blocked, host-cpu or mixed (the rule: docs/measurement.md); NULL when the
-- evidence it needs was not collected.
ALTER TABLE steps ADD COLUMN bound TEXT;
-- Times the process's threads left a CPU while traced, and of those the
-- times they were preempted (still runnable). NULL with --no-sched.
-- `sched_mismatches`: switches that did not fit a thread's state as the
-- programs kept it (each loses that thread's interval since its last change;
-- 0 expected).
ALTER TABLE sessions ADD COLUMN context_switches INTEGER;
ALTER TABLE sessions ADD COLUMN preemptions INTEGER;
ALTER TABLE sessions ADD COLUMN sched_mismatches INTEGER;

-- One row per copy or memset call (--launches all). `api`: the entry point
-- (cuMemcpyHtoDAsync_v2, cudaMemcpyAsync, ...); `direction`: h2d, d2h, d2d,
-- h2h, memset, or unknown (unified addressing: cuMemcpy, cudaMemcpyDefault);
-- `bytes`: bytes written; `result`: the CUresult/cudaError_t returned;
-- start_ns/end_ns: host time in the call; `step`: the step its thread was in.
CREATE TABLE copies (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    tid        INTEGER NOT NULL,
    api        TEXT    NOT NULL,
    direction  TEXT    NOT NULL,
    bytes      INTEGER NOT NULL,
    result     INTEGER NOT NULL,
    start_ns   INTEGER NOT NULL,
    end_ns     INTEGER NOT NULL,
    label      TEXT,
    step       INTEGER
);
CREATE INDEX copies_by_step ON copies(session_id, label, step);
