-- Calls of `jax.jit` functions (jaxlib's jit fast path, `PjitFunction::Call`):
-- `name` the function's Python name (NULL: it could not be read);
-- `function` the `PjitFunction`'s address in the target (one per jitted
-- function); `start_ns` / `end_ns` the call's entry and return: the host
-- dispatch, not the device work (NULL end: its return was not seen);
-- `depth` the jitted calls it ran inside (a call made while tracing
-- another); `step` the step its thread was in when it began (a call that
-- begins a JAX step is in that step).
CREATE TABLE jit_calls (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    tid        INTEGER NOT NULL,
    name       TEXT,
    function   INTEGER NOT NULL,
    start_ns   INTEGER NOT NULL,
    end_ns     INTEGER,
    depth      INTEGER NOT NULL,
    label      TEXT,
    step       INTEGER
);
CREATE INDEX jit_calls_by_step ON jit_calls(session_id, label, step);
-- JAX steps: ns the host spent dispatching the call that began the step
-- (its `jit_calls` row's end − start). NULL for steps from other sources.
ALTER TABLE steps ADD COLUMN dispatch_ns INTEGER;
