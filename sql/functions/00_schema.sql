-- idempotency: schema, settings and the partition registry.
--
-- Public functions (idem_*) are created in the extension's schema; tables,
-- views and internals live in schema "idempotency".

\echo Use "CREATE EXTENSION idempotency" to load this file. \quit

CREATE SCHEMA idempotency;
COMMENT ON SCHEMA idempotency IS 'tables, views and internals of the idempotency extension';

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
-- through a relcache invalidation that the trigger below sends on any change).
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
    CHECK (lower < upper)
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.partition_registry', '');

-- Tells every backend to drop its cached partition set.  Internal: not
-- executable by PUBLIC (triggers fire regardless), and it refuses to serve
-- any table outside schema idempotency (it serves the settings and the
-- partition registries of every store).  ENABLE ALWAYS: the caches must hear of changes
-- made with session_replication_role = replica too.
CREATE FUNCTION idempotency.partition_cache_invalidate() RETURNS trigger
    AS 'MODULE_PATHNAME', 'idem_partition_cache_invalidate' LANGUAGE C;
REVOKE ALL ON FUNCTION idempotency.partition_cache_invalidate() FROM PUBLIC;

CREATE TRIGGER registry_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.partition_registry
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.partition_registry ENABLE ALWAYS TRIGGER registry_changed;

CREATE TRIGGER settings_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.settings
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.settings ENABLE ALWAYS TRIGGER settings_changed;

-- The settings in force: the stored row, or the defaults.
CREATE FUNCTION idempotency.current_settings(
        OUT retention interval, OUT partition_interval interval, OUT premake integer)
    RETURNS record
    AS 'MODULE_PATHNAME', 'idem_current_settings' LANGUAGE C STABLE;
COMMENT ON FUNCTION idempotency.current_settings() IS
    'retention, partition_interval and premake in force (the defaults when none were configured)';

-- This backend's view of the registry, and where filters are held.
CREATE FUNCTION idempotency.cached_partitions(
        OUT partition regclass, OUT lower timestamptz, OUT upper timestamptz,
        OUT sealed boolean, OUT keep_until timestamptz, OUT generation bigint)
    RETURNS SETOF record
    AS 'MODULE_PATHNAME', 'idem_cached_partitions' LANGUAGE C VOLATILE;
COMMENT ON FUNCTION idempotency.cached_partitions() IS
    'the partitions as this backend''s cache lists them (diagnosis)';

CREATE FUNCTION idempotency.filter_status(
        OUT mode text, OUT memory_bytes bigint, OUT used_bytes bigint,
        OUT filters integer, OUT refused bigint)
    RETURNS record
    AS 'MODULE_PATHNAME', 'idem_filter_status' LANGUAGE C VOLATILE;
COMMENT ON FUNCTION idempotency.filter_status() IS
    'where Bloom filters of sealed partitions are held (shared or local), how full, how many loads found no room';
