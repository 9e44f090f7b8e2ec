-- NVML GPM intervals: the GPM columns of a gpu_samples row (migration 10)
-- describe the interval (gpm_start_ns, ts_ns] between two GPM samples (at
-- least 100 ms apart); NULL on rows that close no interval.
ALTER TABLE gpu_samples ADD COLUMN gpm_start_ns INTEGER;
-- The GPU's maximum SM clock (NVML), for step_gpu.mfu_gpm_pct.
ALTER TABLE gpus ADD COLUMN max_sm_clock_mhz REAL;
DROP VIEW system_metrics;
-- prov4ml's system metrics per step (migration 3's view, `flops` added), one
-- row per (label, step, metric), NULL where unavailable. Units: *_pct %, *_gb GB (10^9 bytes), *_power W (average over
-- the step), *_energy J (over the step). cpu_* power/energy are the RAPL
-- package domain, ram_* the RAPL DRAM domain.
CREATE VIEW system_metrics AS
    WITH sys AS (SELECT s.session_id, s.label, s.step, y.cpu_usage_pct, y.ram_usage_pct, y.ram_used_gb,
                        y.disk_used_gb, y.disk_usage_pct
                 FROM steps s LEFT JOIN step_system y
                     ON y.session_id = s.session_id AND y.label = s.label AND y.step = s.step),
         nrg AS (SELECT s.session_id, s.label, s.step, e.cpu_power_w, e.cpu_energy_j, e.dram_power_w, e.dram_energy_j
                 FROM steps s LEFT JOIN step_energy e
                     ON e.session_id = s.session_id AND e.label = s.label AND e.step = s.step),
         -- All sampled GPUs together: usage averaged, power/energy/memory summed, hottest temperature.
         gpu AS (SELECT s.session_id, s.label, s.step,
                        avg(g.utilization_gpu_end_pct) AS usage_pct,
                        sum(g.avg_power_w) AS power_w,
                        sum(g.energy_j) AS energy_j,
                        sum(g.memory_used_end_mib) * 1048576 / 1e9 AS memory_gb,
                        100.0 * sum(g.memory_used_end_mib) / sum(d.memory_total_mib) AS memory_pct,
                        max(g.temperature_gpu_end_c) AS temperature_c
                 FROM steps s LEFT JOIN step_gpu g
                     ON g.session_id = s.session_id AND g.label = s.label AND g.step = s.step
                 LEFT JOIN gpus d ON d.session_id = g.session_id AND d.gpu = g.gpu
                 GROUP BY s.session_id, s.label, s.step)
              SELECT session_id, label, step, 'cpu_usage_pct' AS metric, cpu_usage_pct AS value FROM sys
    UNION ALL SELECT session_id, label, step, 'cpu_power',      cpu_power_w    FROM nrg
    UNION ALL SELECT session_id, label, step, 'cpu_energy',     cpu_energy_j   FROM nrg
    UNION ALL SELECT session_id, label, step, 'ram_usage_pct',  ram_usage_pct  FROM sys
    UNION ALL SELECT session_id, label, step, 'ram_usage_gb',   ram_used_gb    FROM sys
    UNION ALL SELECT session_id, label, step, 'ram_power',      dram_power_w   FROM nrg
    UNION ALL SELECT session_id, label, step, 'ram_energy',     dram_energy_j  FROM nrg
    UNION ALL SELECT session_id, label, step, 'disk_usage_gb',  disk_used_gb   FROM sys
    UNION ALL SELECT session_id, label, step, 'disk_usage_pct', disk_usage_pct FROM sys
    UNION ALL SELECT session_id, label, step, 'gpu_usage_pct', usage_pct FROM gpu
    UNION ALL SELECT session_id, label, step, 'gpu_power', power_w FROM gpu
    UNION ALL SELECT session_id, label, step, 'gpu_energy', energy_j FROM gpu
    UNION ALL SELECT session_id, label, step, 'gpu_memory_usage_gb', memory_gb FROM gpu
    UNION ALL SELECT session_id, label, step, 'gpu_memory_usage_pct', memory_pct FROM gpu
    -- NVML has no memory-subsystem power: NULL (see capabilities).
    UNION ALL SELECT session_id, label, step, 'gpu_memory_power', NULL FROM gpu
    UNION ALL SELECT session_id, label, step, 'gpu_temperature_c', temperature_c FROM gpu
    -- GEMM FLOPs the step issued (steps.flops; a lower bound, NULL when no BLAS library was probed).
    UNION ALL SELECT session_id, label, step, 'flops', flops FROM steps;
