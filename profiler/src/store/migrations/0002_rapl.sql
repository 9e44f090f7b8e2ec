
-- One row per RAPL domain kind per sample. energy_j: joules since the
-- session's first sample, wrap-corrected and summed over sockets. domain is
-- 'package', 'dram', 'psys', 'core' or 'uncore'; kinds overlap (psys ⊇
-- package ⊇ core, uncore), so never add rows of different domains.
CREATE TABLE rapl_samples (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    ts_ns      INTEGER NOT NULL,
    domain     TEXT    NOT NULL,
    energy_j   REAL    NOT NULL
);
-- Per step (label, step as in steps), RAPL counters interpolated at the step's start and end (steps
-- that share boundaries sum exactly to the counter's delta). cpu = package
-- domain, dram = DRAM domain. Energies and error bounds in J, powers in W
-- (energy / step duration). below_resolution = 1: the step is shorter than
-- the interval at which the counter was seen to change, so its figure is an
-- interpolated share. NULL where not measurable; note says why when the
-- reason is the step's own (never ended, outside the sampled range); a
-- missing domain or missing RAPL is recorded in capabilities (source 'rapl').
CREATE TABLE step_energy (
    session_id          INTEGER NOT NULL REFERENCES sessions(id),
    label               TEXT    NOT NULL,
    step                INTEGER NOT NULL,
    cpu_energy_j        REAL,
    dram_energy_j       REAL,
    cpu_power_w         REAL,
    dram_power_w        REAL,
    cpu_energy_error_j  REAL,
    dram_energy_error_j REAL,
    below_resolution    INTEGER,
    note                TEXT,
    PRIMARY KEY (session_id, label, step)
);
