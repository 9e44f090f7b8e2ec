
CREATE TABLE sessions (
    id                INTEGER PRIMARY KEY,
    pid               INTEGER NOT NULL,
    command           TEXT    NOT NULL,
    exe               TEXT,
    mode              TEXT    NOT NULL,
    launch_mode       TEXT    NOT NULL,
    step_symbol       TEXT,
    started_ns        INTEGER NOT NULL,
    ended_ns          INTEGER,
    end_reason        TEXT,
    lost_events       INTEGER,
    total_launches    INTEGER,
    stored_launches   INTEGER,
    unmatched_returns INTEGER,
    unix_offset_ns    INTEGER NOT NULL,
    hostname          TEXT,
    kernel_release    TEXT,
    profiler_version  TEXT    NOT NULL
);
CREATE TABLE libraries (
    session_id  INTEGER NOT NULL REFERENCES sessions(id),
    path        TEXT    NOT NULL,
    kind        TEXT    NOT NULL,
    attached_ns INTEGER NOT NULL,
    probes      INTEGER NOT NULL,
    how         TEXT    NOT NULL
);
CREATE TABLE probes (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    library    TEXT    NOT NULL,
    symbol     TEXT    NOT NULL,
    offset     INTEGER NOT NULL,
    reason     TEXT    NOT NULL
);
CREATE TABLE apis (
    id    INTEGER PRIMARY KEY,
    name  TEXT NOT NULL UNIQUE,
    layer TEXT NOT NULL
);
CREATE TABLE steps (
    session_id    INTEGER NOT NULL REFERENCES sessions(id),
    label         TEXT    NOT NULL DEFAULT 'train',
    step          INTEGER NOT NULL,
    tid           INTEGER NOT NULL,
    start_ns      INTEGER NOT NULL,
    end_ns        INTEGER,
    duration_ns   INTEGER,
    inter_step_ns INTEGER,
    launches      INTEGER,
    sync_wait_ns  INTEGER,
    PRIMARY KEY (session_id, label, step)
);
CREATE TABLE kernels (
    session_id     INTEGER NOT NULL REFERENCES sessions(id),
    function       INTEGER NOT NULL,
    name           TEXT    NOT NULL,
    demangled_name TEXT,
    source         TEXT    NOT NULL,
    UNIQUE (session_id, function)
);
CREATE TABLE syncs (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    tid        INTEGER NOT NULL,
    api        TEXT    NOT NULL,
    start_ns   INTEGER NOT NULL,
    end_ns     INTEGER NOT NULL,
    label      TEXT,
    step       INTEGER
);
CREATE TABLE launches (
    session_id       INTEGER NOT NULL,
    ts_ns            INTEGER NOT NULL,
    tid              INTEGER NOT NULL,
    api              INTEGER NOT NULL,
    function         INTEGER NOT NULL,
    grid_x           INTEGER NOT NULL,
    grid_y           INTEGER NOT NULL,
    grid_z           INTEGER NOT NULL,
    block_x          INTEGER NOT NULL,
    block_y          INTEGER NOT NULL,
    block_z          INTEGER NOT NULL,
    shared_mem_bytes INTEGER NOT NULL,
    stream           INTEGER NOT NULL,
    label            TEXT,
    step             INTEGER
);
CREATE TABLE capabilities (
    session_id INTEGER NOT NULL REFERENCES sessions(id),
    source     TEXT    NOT NULL,
    metric     TEXT    NOT NULL,
    available  INTEGER NOT NULL,
    reason     TEXT,
    UNIQUE (session_id, source, metric)
);
CREATE VIEW launches_named AS
    SELECT l.*, a.name AS api_name, a.layer AS api_layer
    FROM launches l JOIN apis a ON a.id = l.api;
