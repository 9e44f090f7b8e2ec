
-- One row per system sample. GB are 10^9 bytes. cpu_usage_pct: all CPUs
-- busy, 0-100, over the interval since the previous sample (/proc/stat).
-- process_cpu_pct: the target's CPU time, all its threads, over the same
-- wall interval (/proc/PID/stat utime+stime), so 250 = 2.5 CPUs busy. RAM:
-- MemTotal - MemAvailable (/proc/meminfo). process_rss_gb: the target's
-- resident set. disk: the filesystem holding the target's working directory
-- (or --disk PATH): used = blocks - free; % as df computes it, used /
-- (used + available to unprivileged users). NULL where unreadable (the
-- first sample has no interval for the rates); reasons in capabilities
-- (source 'system').
CREATE TABLE system_samples (
    session_id      INTEGER NOT NULL REFERENCES sessions(id),
    ts_ns           INTEGER NOT NULL,
    cpu_usage_pct   REAL,
    process_cpu_pct REAL,
    ram_used_gb     REAL,
    ram_usage_pct   REAL,
    process_rss_gb  REAL,
    disk_used_gb    REAL,
    disk_usage_pct  REAL
);
-- The system values at each step's end: for the two rates, the sample whose
-- interval contains the end; for the levels, the latest sample at or before
-- it (or the first after it when there is none). A sample counts only within
-- two sampling intervals of the end; otherwise NULL. ts_ns: the level sample used.
CREATE TABLE step_system (
    session_id      INTEGER NOT NULL REFERENCES sessions(id),
    label           TEXT    NOT NULL,
    step            INTEGER NOT NULL,
    ts_ns           INTEGER,
    cpu_usage_pct   REAL,
    process_cpu_pct REAL,
    ram_used_gb     REAL,
    ram_usage_pct   REAL,
    process_rss_gb  REAL,
    disk_used_gb    REAL,
    disk_usage_pct  REAL,
    PRIMARY KEY (session_id, label, step)
);
-- prov4ml's system metrics per step, one row per (label, step, metric), NULL where
-- unavailable. Units: *_pct %, *_gb GB (10^9 bytes), *_power W (average over
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
    UNION ALL SELECT session_id, label, step, 'gpu_temperature_c', temperature_c FROM gpu;
