
-- Multi-process jobs: one session per traced process; `job` is the same for
-- every process of one profiler run (`--job NAME`, else the target's
-- TORCHELASTIC_RUN_ID, else a generated id), so that profiles of several
-- nodes of one job, merged, group together. `rank`, `local_rank`,
-- `world_size`: the process's RANK, LOCAL_RANK, WORLD_SIZE (NULL when absent).
-- `parent_pid`: the traced process it was forked from (NULL for one named on
-- the command line). Older files: one job per session.
ALTER TABLE sessions ADD COLUMN job TEXT;
ALTER TABLE sessions ADD COLUMN rank INTEGER;
ALTER TABLE sessions ADD COLUMN local_rank INTEGER;
ALTER TABLE sessions ADD COLUMN world_size INTEGER;
ALTER TABLE sessions ADD COLUMN parent_pid INTEGER;
UPDATE sessions SET job = 'session-' || id WHERE job IS NULL;

-- NCCL calls seen by uprobes on libnccl.so.2, one row per call. `op`:
-- all_reduce, reduce_scatter, all_gather, broadcast, reduce, send, recv,
-- group_start, group_end. `count`: elements; `datatype`: NCCL's name (int8,
-- float16, bfloat16, float32, ...); `bytes`: count x element size (NULL when
-- the datatype is unknown; for reduce_scatter, the per-rank output count as
-- NCCL defines it). `peer`: the peer rank of send/recv, the root of
-- broadcast/reduce, else NULL. `comm`, `stream`: the ncclComm_t and
-- cudaStream_t handles. start_ns/end_ns: host time in the call (GPU-side
-- time would need CUPTI). `step`: the step its thread was in.
CREATE TABLE collectives (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    tid        INTEGER NOT NULL,
    op         TEXT    NOT NULL,
    count      INTEGER,
    datatype   TEXT,
    bytes      INTEGER,
    peer       INTEGER,
    comm       INTEGER,
    stream     INTEGER,
    start_ns   INTEGER NOT NULL,
    end_ns     INTEGER,
    label      TEXT,
    step       INTEGER
);
CREATE INDEX collectives_by_step ON collectives(session_id, label, step);
-- Per step: bytes its collectives moved and host ns spent in them (NULL when
-- no NCCL library was probed in the process).
ALTER TABLE steps ADD COLUMN collective_bytes INTEGER;
ALTER TABLE steps ADD COLUMN collective_ns INTEGER;

-- One row per (job, label, step, session): a rank's step beside the others
-- of the same number. `behind_ns`: its duration minus the fastest rank's;
-- `wait_ns`: sync wait + collective host time; `wait_pct`: of its duration.
CREATE VIEW job_step_ranks AS
    SELECT s.job, st.label, st.step, st.session_id, s.rank, s.pid, st.duration_ns,
           st.duration_ns - min(st.duration_ns) OVER w AS behind_ns,
           coalesce(st.sync_wait_ns, 0) + coalesce(st.collective_ns, 0) AS wait_ns,
           100.0 * (coalesce(st.sync_wait_ns, 0) + coalesce(st.collective_ns, 0)) / st.duration_ns AS wait_pct,
           row_number() OVER (w ORDER BY st.duration_ns DESC, s.rank, st.session_id) AS slowness
    FROM steps st JOIN sessions s ON s.id = st.session_id
    WHERE st.duration_ns IS NOT NULL AND st.duration_ns > 0
    WINDOW w AS (PARTITION BY s.job, st.label, st.step);

-- One row per (job, label, step): the slowest and fastest rank and the
-- spread (max - min duration) across the ranks that ran that step.
CREATE VIEW job_steps AS
    SELECT job, label, step, count(*) AS ranks,
           max(CASE WHEN slowness = 1 THEN rank END) AS slowest_rank,
           max(CASE WHEN slowness = 1 THEN session_id END) AS slowest_session,
           max(CASE WHEN slowness = count_in_step THEN rank END) AS fastest_rank,
           max(CASE WHEN slowness = count_in_step THEN session_id END) AS fastest_session,
           max(duration_ns) AS max_ns, min(duration_ns) AS min_ns,
           max(duration_ns) - min(duration_ns) AS spread_ns,
           avg(wait_pct) AS mean_wait_pct
    FROM (SELECT r.*, count(*) OVER (PARTITION BY job, label, step) AS count_in_step FROM job_step_ranks r)
    GROUP BY job, label, step;
