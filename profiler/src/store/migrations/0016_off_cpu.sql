-- Each time a traced thread was off its CPU (per-call rows: --launches all,
-- without --no-sched), from the scheduler's sched_switch/sched_wakeup: it left
-- at `left_ns` because it was preempted or yielded (`state` 'runnable'), or to
-- wait ('sleeping': interruptible; 'blocked': uninterruptible, disk I/O, page
-- faults), was woken at `woken_ns` (NULL for 'runnable') and ran again at
-- `resumed_ns`. Its time on a CPU is the gap between a row's `resumed_ns` and
-- its thread's next row's `left_ns`. The Perfetto export draws these as the
-- thread's scheduler track.
CREATE TABLE off_cpu (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    tid        INTEGER NOT NULL,
    state      TEXT    NOT NULL,
    left_ns    INTEGER NOT NULL,
    woken_ns   INTEGER,
    resumed_ns INTEGER NOT NULL
);
-- Of `sessions.lost_events`, the off-CPU records the launch ring had no room
-- for (each a gap in a thread's scheduler track; the steps' scheduler columns
-- are counted in the kernel and stay exact). NULL for a job's later processes
-- (the kernel's counters are the job's, on its first session).
ALTER TABLE sessions ADD COLUMN lost_off_cpu_records INTEGER;
