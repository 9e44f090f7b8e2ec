
CREATE TABLE kernel_renames (
    session_id     INTEGER NOT NULL REFERENCES sessions(id),
    function       INTEGER NOT NULL,
    named_ns       INTEGER NOT NULL,
    name           TEXT    NOT NULL,
    demangled_name TEXT,
    source         TEXT    NOT NULL,
    UNIQUE (session_id, function, named_ns)
);
