-- Per step: the data and compute types (cuBLAS's names) of the GEMMs that did
-- most of the step's FLOPs, so that a step's FLOPs can be set against the
-- GPU's peak for that precision even with `--launches count`, which keeps no
-- `gemms` rows. NULL when the step issued no GEMM.
ALTER TABLE steps ADD COLUMN gemm_data_type TEXT;
ALTER TABLE steps ADD COLUMN gemm_compute_type TEXT;
