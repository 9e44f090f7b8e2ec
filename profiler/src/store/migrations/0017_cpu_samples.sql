-- CPU samples of the traced threads (`--cpu-sample HZ`, default 99; off with
-- --no-cpu-samples): each time the sampling clock (every 1/HZ s of a CPU's
-- time) found one on a CPU, in user code (`mode` 'user') or in the kernel
-- ('kernel'), with the step its thread was in then (`label`, `step`; NULL
-- between steps). Per-call rows: the size budget stops them with the others.
CREATE TABLE cpu_samples (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    tid        INTEGER NOT NULL,
    time_ns    INTEGER NOT NULL,
    stack_id   INTEGER NOT NULL,
    mode       TEXT    NOT NULL,
    label      TEXT,
    step       INTEGER
);
-- The samples' stacks, deduplicated per session: one row per frame, `depth` 0
-- the leaf (the sampled instruction), then its callers; kernel frames first
-- for a sample taken in the kernel.
CREATE TABLE stacks (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    stack_id   INTEGER NOT NULL,
    depth      INTEGER NOT NULL,
    frame_id   INTEGER NOT NULL,
    PRIMARY KEY (session_id, stack_id, depth)
);
-- A function a stack passes through, per session: `kind` 'native' (the
-- target's code, `module` the file it is in), 'kernel', or 'python' (a
-- CPython frame: `module` its code's file name, `line` the line the code
-- begins at); `function` the symbol (demangled), the Python function's
-- qualified name, or the address in hex where there is none.
CREATE TABLE frames (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    frame_id   INTEGER NOT NULL,
    kind       TEXT    NOT NULL,
    module     TEXT,
    function   TEXT    NOT NULL,
    line       INTEGER,
    PRIMARY KEY (session_id, frame_id)
);
-- The sampler: its rate (NULL: off), the samples of traced threads it took,
-- those the launch ring had no room for (not stored), and the stacks the
-- kernel's stack map did not keep (those samples have their leaf only). NULL
-- for a job's later processes (the kernel's counters are the job's).
ALTER TABLE sessions ADD COLUMN cpu_sample_hz INTEGER;
ALTER TABLE sessions ADD COLUMN cpu_samples_taken INTEGER;
ALTER TABLE sessions ADD COLUMN lost_cpu_samples INTEGER;
ALTER TABLE sessions ADD COLUMN cpu_stack_failures INTEGER;
