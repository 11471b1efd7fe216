-- idempotency: the schema's comment, the cache trigger of the settings and
-- the partition registry, and the functions that show what is in force
-- (the tables are in sql/tables/00_schema.sql).

COMMENT ON SCHEMA idempotency IS 'tables, views and internals of the idempotency extension';

-- Tells every backend to drop its cached partition set.  Internal: not
-- executable by PUBLIC (triggers fire regardless), and it refuses to serve
-- any table outside schema idempotency (it serves the settings and the
-- partition registries of every store).  ENABLE ALWAYS: the caches must hear of changes
-- made with session_replication_role = replica too.  (CREATE OR REPLACE
-- TRIGGER sets a trigger back to ENABLE, so each ALTER TABLE follows its
-- trigger.)
CREATE OR REPLACE FUNCTION idempotency.partition_cache_invalidate() RETURNS trigger
    AS 'MODULE_PATHNAME', 'idem_partition_cache_invalidate' LANGUAGE C;
REVOKE ALL ON FUNCTION idempotency.partition_cache_invalidate() FROM PUBLIC;

CREATE OR REPLACE TRIGGER registry_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.partition_registry
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.partition_registry ENABLE ALWAYS TRIGGER registry_changed;

CREATE OR REPLACE TRIGGER settings_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.settings
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.settings ENABLE ALWAYS TRIGGER settings_changed;

-- The settings in force: the stored row, or the defaults.
CREATE OR REPLACE FUNCTION idempotency.current_settings(
        OUT retention interval, OUT partition_interval interval, OUT premake integer)
    RETURNS record
    AS 'MODULE_PATHNAME', 'idem_current_settings' LANGUAGE C STABLE;
COMMENT ON FUNCTION idempotency.current_settings() IS
    'retention, partition_interval and premake in force (the defaults when none were configured)';

-- This backend's view of the registry, and where filters are held.
CREATE OR REPLACE FUNCTION idempotency.cached_partitions(
        OUT partition regclass, OUT lower timestamptz, OUT upper timestamptz,
        OUT sealed boolean, OUT keep_until timestamptz, OUT generation bigint)
    RETURNS SETOF record
    AS 'MODULE_PATHNAME', 'idem_cached_partitions' LANGUAGE C VOLATILE;
COMMENT ON FUNCTION idempotency.cached_partitions() IS
    'the partitions as this backend''s cache lists them (diagnosis)';

CREATE OR REPLACE FUNCTION idempotency.filter_status(
        OUT mode text, OUT memory_bytes bigint, OUT used_bytes bigint,
        OUT filters integer, OUT refused bigint)
    RETURNS record
    AS 'MODULE_PATHNAME', 'idem_filter_status' LANGUAGE C VOLATILE;
COMMENT ON FUNCTION idempotency.filter_status() IS
    'where Bloom filters of sealed partitions are held (shared or local), how full, how many loads found no room';
