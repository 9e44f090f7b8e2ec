-- What the CPU sampler cost in the kernel, as the kernel counts it
-- (`BPF_ENABLE_STATS`, held by the agent while it samples): the sampling
-- program's runs (one per sampling tick on each CPU, whichever thread the
-- tick found, so more than `cpu_samples_taken`) and their total time, ns.
-- The interrupt that runs the program is not in it. NULL: not sampled, or
-- the kernel would not count (the reason is in `capabilities`, source
-- 'cpu_sampler', metric 'kernel_cost').
ALTER TABLE sessions ADD COLUMN cpu_sample_runs INTEGER;
ALTER TABLE sessions ADD COLUMN cpu_sample_kernel_ns INTEGER;
