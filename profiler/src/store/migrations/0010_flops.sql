
-- GEMMs seen by uprobes on cuBLAS/cuBLASLt, one row per call (`--launches
-- count` keeps only the per-step sums). `op`: the entry point (cublasGemmEx,
-- cublasLtMatmul, ...); m, n, k, batch from its arguments or descriptors;
-- `flops` = 2*m*n*k*batch; `data_type`, `compute_type`: cuBLAS's names.
CREATE TABLE gemms (
    session_id   INTEGER NOT NULL REFERENCES sessions(id),
    tid          INTEGER NOT NULL,
    ts_ns        INTEGER NOT NULL,
    op           TEXT    NOT NULL,
    m            INTEGER NOT NULL,
    n            INTEGER NOT NULL,
    k            INTEGER NOT NULL,
    batch        INTEGER NOT NULL,
    flops        INTEGER NOT NULL,
    data_type    TEXT,
    compute_type TEXT,
    label        TEXT,
    step         INTEGER
);
CREATE INDEX gemms_by_step ON gemms(session_id, label, step);
-- Per step: GEMM FLOPs issued and GEMM calls (NULL when no BLAS library was
-- probed in the process): a lower bound of the step's FLOPs (attention,
-- Triton, CUTLASS and convolution kernels are not counted).
ALTER TABLE steps ADD COLUMN flops INTEGER;
ALTER TABLE steps ADD COLUMN gemm_calls INTEGER;
-- NVML GPM (Hopper and newer), percent over the sample interval; NULL where
-- the GPU has no GPM (see capabilities).
ALTER TABLE gpu_samples ADD COLUMN tensor_util_pct REAL;
ALTER TABLE gpu_samples ADD COLUMN hmma_util_pct REAL;
ALTER TABLE gpu_samples ADD COLUMN dfma_util_pct REAL;
ALTER TABLE gpu_samples ADD COLUMN sm_util_pct REAL;
ALTER TABLE gpu_samples ADD COLUMN sm_occupancy_pct REAL;
ALTER TABLE gpu_samples ADD COLUMN dram_bw_util_pct REAL;
-- Per step and GPU: GPM readings time-weighted over the step; `mfu_pct`: the
-- step's GEMM FLOPs on this GPU / (peak dense FLOP/s x step time);
-- `mfu_gpm_pct`: an estimate from tensor activity x SM clock / max SM clock.
ALTER TABLE step_gpu ADD COLUMN tensor_util_pct REAL;
ALTER TABLE step_gpu ADD COLUMN hmma_util_pct REAL;
ALTER TABLE step_gpu ADD COLUMN dfma_util_pct REAL;
ALTER TABLE step_gpu ADD COLUMN sm_util_pct REAL;
ALTER TABLE step_gpu ADD COLUMN sm_occupancy_pct REAL;
ALTER TABLE step_gpu ADD COLUMN dram_bw_util_pct REAL;
ALTER TABLE step_gpu ADD COLUMN flops INTEGER;
ALTER TABLE step_gpu ADD COLUMN mfu_pct REAL;
ALTER TABLE step_gpu ADD COLUMN mfu_gpm_pct REAL;
