
CREATE TABLE gpus (
    session_id              INTEGER NOT NULL REFERENCES sessions(id),
    gpu                     INTEGER NOT NULL,
    nvml_index              INTEGER NOT NULL,
    uuid                    TEXT    NOT NULL,
    name                    TEXT,
    memory_total_mib        REAL,
    power_limit_w           REAL,
    driver_version          TEXT,
    power_source            TEXT,
    energy_update_period_ms REAL,
    used_by_target          INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, gpu)
);
CREATE TABLE gpu_samples (
    session_id             INTEGER NOT NULL,
    gpu                    INTEGER NOT NULL,
    ts_ns                  INTEGER NOT NULL,
    utilization_gpu_pct    REAL,
    utilization_memory_pct REAL,
    memory_used_mib        REAL,
    memory_free_mib        REAL,
    memory_total_mib       REAL,
    power_w                REAL,
    memory_power_w         REAL,
    energy_j               REAL,
    temperature_gpu_c      REAL,
    temperature_memory_c   REAL,
    fan_speed_pct          REAL,
    sm_clock_mhz           REAL,
    memory_clock_mhz       REAL,
    clock_throttle_reasons INTEGER
);
CREATE TABLE step_gpu (
    session_id                   INTEGER NOT NULL,
    label                        TEXT    NOT NULL,
    step                         INTEGER NOT NULL,
    gpu                          INTEGER NOT NULL,
    energy_j                     REAL,
    energy_error_j               REAL,
    avg_power_w                  REAL,
    below_resolution             INTEGER,
    utilization_gpu_start_pct    REAL,
    utilization_gpu_end_pct      REAL,
    memory_used_start_mib        REAL,
    memory_used_end_mib          REAL,
    memory_free_start_mib        REAL,
    memory_free_end_mib          REAL,
    utilization_memory_start_pct REAL,
    utilization_memory_end_pct   REAL,
    fan_speed_end_pct            REAL,
    temperature_gpu_end_c        REAL,
    temperature_memory_end_c     REAL,
    PRIMARY KEY (session_id, label, step, gpu)
);
CREATE VIEW gpu_stats_monitor AS
    SELECT session_id, label, step, 'GPU_' || gpu || '/utilization.gpu - percent' AS metric, utilization_gpu_start_pct AS value, 'batch_start' AS phase FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/memory.used - MB', memory_used_start_mib, 'batch_start' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/memory.free - MB', memory_free_start_mib, 'batch_start' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/utilization.memory - percent', utilization_memory_start_pct, 'batch_start' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/utilization.gpu - percent', utilization_gpu_end_pct, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/memory.used - MB', memory_used_end_mib, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/memory.free - MB', memory_free_end_mib, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/utilization.memory - percent', utilization_memory_end_pct, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/fan.speed - percent', fan_speed_end_pct, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/temperature.gpu - °C', temperature_gpu_end_c, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'GPU_' || gpu || '/temperature.memory - °C', temperature_memory_end_c, 'batch_end' FROM step_gpu
    UNION ALL SELECT session_id, label, step, 'batch_time/intra_step (ms)', duration_ns / 1e6, 'batch_end' FROM steps WHERE end_ns IS NOT NULL
    UNION ALL SELECT session_id, label, step, 'batch_time/inter_step (ms)', inter_step_ns / 1e6, 'batch_start' FROM steps WHERE inter_step_ns IS NOT NULL;
