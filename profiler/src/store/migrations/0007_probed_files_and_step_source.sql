ALTER TABLE sessions RENAME COLUMN step_symbol TO step_source;
ALTER TABLE libraries RENAME TO probed_files;
