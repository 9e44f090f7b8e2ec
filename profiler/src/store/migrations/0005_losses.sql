
ALTER TABLE sessions ADD COLUMN lost_step_records INTEGER;
ALTER TABLE sessions ADD COLUMN map_failures INTEGER;
ALTER TABLE steps ADD COLUMN incomplete INTEGER;
