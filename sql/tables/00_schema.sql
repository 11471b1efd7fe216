-- idempotency: schema, settings and the partition registry (the tables;
-- the cache trigger and the functions over them are in
-- sql/functions/00_schema.sql).
--
-- Public functions (idem_*) are created in the extension's schema; tables,
-- views and internals live in schema "idempotency".

\echo Use "CREATE EXTENSION idempotency" to load this file. \quit

CREATE SCHEMA idempotency;

-- At most one row, written by idem_configure(); no row means every setting
-- has its default (idempotency.current_settings() shows what is in force;
-- the defaults live in the library only).  Kept by pg_dump (configuration
-- table), so settings survive dump and restore.
CREATE TABLE idempotency.settings (
    singleton          boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    retention          interval NOT NULL,
    partition_interval interval NOT NULL,
    premake            integer  NOT NULL
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.settings', '');

-- Every time partition of the claims table, with the time range of the
-- claims it takes.  Read by every claiming backend (cached, and refreshed
-- through a relcache invalidation that its trigger, registry_changed in
-- sql/functions/00_schema.sql, sends on any change).
CREATE TABLE idempotency.partition_registry (
    relid      regclass    PRIMARY KEY,
    lower      timestamptz NOT NULL,
    upper      timestamptz NOT NULL,
    sealed     boolean     NOT NULL DEFAULT false,  -- summarised, and counted in the scope history
    bloom      bytea,                               -- Bloom filter of a sealed (or held) partition's keys
    nkeys      bigint,                              -- claims in it when sealed
    max_claimed_at timestamptz,                     -- its newest claim when sealed
    closed     boolean     NOT NULL DEFAULT false,  -- takes no claims any more (sealed, or next round)
    held_by    xid8[],                              -- sealed while these transactions had claims
                                                    -- in it in progress: sealed is set once they end
    retention  interval,                            -- its retention class (scope_retention);
                                                    -- NULL: idem_configure()'s retention
    keep_retention interval,                        -- kept at least this long after its newest claim:
                                                    -- it holds claims of scopes kept longer than its class
    keep_default boolean NOT NULL DEFAULT false,    -- kept at least idem_configure()'s retention too:
                                                    -- it holds claims of scopes that follow it now
    CHECK (lower < upper)
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.partition_registry', '');
