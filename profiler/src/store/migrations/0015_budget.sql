-- The profile's size budget (`--max-size`, the disk headroom floor) and
-- `--launches auto`, per session. CLOCK_MONOTONIC ns like every `_ns` column;
-- NULL: it never happened (or the session is older than this schema).
-- When `--launches auto` stopped storing `launches` and `gemms` rows (the
-- launch rate would have spent the budget within the session's expected length).
ALTER TABLE sessions ADD COLUMN launch_rows_stopped_ns INTEGER;
-- When the budget stopped storing per-call rows (launches, gemms, syncs,
-- regions, collectives); steps, counts, samples and energy went on.
ALTER TABLE sessions ADD COLUMN per_call_rows_stopped_ns INTEGER;
-- When the budget stopped storing every row: the session ended there.
ALTER TABLE sessions ADD COLUMN all_rows_stopped_ns INTEGER;
-- Why it stopped (the limit reached and the sizes then), one line.
ALTER TABLE sessions ADD COLUMN budget_reason TEXT;
-- Per-call rows of this session not stored because of the two above.
ALTER TABLE sessions ADD COLUMN per_call_rows_dropped INTEGER;
-- The settings the session ran with: `--max-size` and the headroom floor, bytes.
ALTER TABLE sessions ADD COLUMN max_size_bytes INTEGER;
ALTER TABLE sessions ADD COLUMN headroom_floor_bytes INTEGER;
