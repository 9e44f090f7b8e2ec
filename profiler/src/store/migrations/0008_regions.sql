
-- PyTorch `record_function` regions. `step`: the step its thread was in
-- when the region began (like `launches`); `end_ns` NULL: its end was not
-- seen. `truncated` 1: `name` is the first bytes of a longer name.
CREATE TABLE regions (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    tid        INTEGER NOT NULL,
    name       TEXT    NOT NULL,
    truncated  INTEGER NOT NULL,
    start_ns   INTEGER NOT NULL,
    end_ns     INTEGER,
    label      TEXT,
    step       INTEGER
);
CREATE INDEX regions_by_step ON regions(session_id, label, step);
-- Steps from PyTorch's optimizer markers: ns the step's thread spent in the
-- DataLoader's `__next__` (since the previous optimizer step) and in the
-- optimizer's step. NULL for steps from other sources.
ALTER TABLE steps ADD COLUMN data_wait_ns INTEGER;
ALTER TABLE steps ADD COLUMN optimizer_ns INTEGER;
