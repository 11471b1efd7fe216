\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.1'" to load this file. \quit

-- idempotency 1.0 -> 1.1 upgrade script.
--
-- The rule: every object added to sql/ext/ for 1.1 (or changed there since
-- 1.0) goes into this script too, in the same commit, so that
-- ALTER EXTENSION idempotency UPDATE gives exactly the objects of a fresh
-- 1.1 install, with claims, settings, partitions and guards intact.
--   * new objects: the same CREATE statements as in sql/ext/ (internals
--     qualified with idempotency., public idem_* functions unqualified:
--     the update runs with search_path set to the extension's schema, as
--     CREATE EXTENSION does);
--   * changed functions: CREATE OR REPLACE, or DROP and CREATE when the
--     signature or return type changes;
--   * new columns of existing tables: ALTER TABLE ... ADD COLUMN, which can
--     only append, so add them at the end of the CREATE TABLE in sql/ext/;
--   * new configuration tables: pg_extension_config_dump() here as well;
--   * GRANT/REVOKE and COMMENT ON as in sql/ext/.
-- Fragments of sql/ext/ that are new in 1.1 as a whole (the outbox,
-- sql/ext/40_outbox.sql, and the partitions view, sql/ext/60_partitions.sql)
-- are not copied here: the Makefile appends them when it builds the
-- installed script (NEW_IN_VERSION).
-- Existing claim partitions are ordinary tables, not extension members: if
-- their shape changes, alter them here as well.
-- test/tap/040_upgrade.pl installs 1.0 with claims, settings, sealed
-- partitions and guards, updates it, checks that all of it still works, and
-- compares every member object (and the partitions' shape) with a fresh
-- install; a failing run prints what differs.
--

---- claims store: seals record their claims, the cache trigger is internal,
---- filters and the cache can be inspected, payloads get a digest --------

-- partition registry: what a seal records (appended, as in 00_schema.sql)
ALTER TABLE idempotency.partition_registry
    ADD COLUMN nkeys bigint,                        -- claims in it when sealed
    ADD COLUMN max_claimed_at timestamptz;          -- its newest claim when sealed

-- partition registry: a partition closed to claims (sealed by the next
-- round), or sealed while transactions had claims in it in progress
ALTER TABLE idempotency.partition_registry
    ADD COLUMN closed boolean NOT NULL DEFAULT false,
    ADD COLUMN held_by xid8[];
UPDATE idempotency.partition_registry SET closed = true WHERE sealed;

-- Partitions sealed by 1.0 recorded neither: count them now, so that they
-- are kept for the retention after their newest claim, as 1.1 seals do.
DO $$
DECLARE
    p regclass;
BEGIN
    FOR p IN SELECT relid FROM idempotency.partition_registry WHERE sealed LOOP
        EXECUTE format('UPDATE idempotency.partition_registry r'
                       '   SET nkeys = c.n, max_claimed_at = c.newest'
                       '  FROM (SELECT count(*) AS n, max(claimed_at) AS newest FROM %s) c'
                       ' WHERE r.relid = %L::regclass', p, p::oid);
    END LOOP;
END
$$;

-- the invalidation trigger function under its new name
CREATE FUNCTION idempotency.partition_cache_invalidate() RETURNS trigger
    AS 'MODULE_PATHNAME', 'idem_partition_cache_invalidate' LANGUAGE C;
REVOKE ALL ON FUNCTION idempotency.partition_cache_invalidate() FROM PUBLIC;

DROP TRIGGER registry_changed ON idempotency.partition_registry;
CREATE TRIGGER registry_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.partition_registry
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.partition_registry ENABLE ALWAYS TRIGGER registry_changed;

DROP TRIGGER settings_changed ON idempotency.settings;
CREATE TRIGGER settings_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.settings
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.settings ENABLE ALWAYS TRIGGER settings_changed;

DROP FUNCTION idempotency.registry_changed();

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

-- claims: SHA-256 payload digests (recurses into the existing partitions)
ALTER TABLE idempotency.claims ADD COLUMN digest bytea;
REVOKE ALL ON FUNCTION idempotency.claims_read_only() FROM PUBLIC;

-- settings: the defaults live in the library only
ALTER TABLE idempotency.settings
    ALTER COLUMN retention DROP DEFAULT,
    ALTER COLUMN partition_interval DROP DEFAULT,
    ALTER COLUMN premake DROP DEFAULT;

CREATE FUNCTION idempotency.current_settings(
        OUT retention interval, OUT partition_interval interval, OUT premake integer)
    RETURNS record
    AS 'MODULE_PATHNAME', 'idem_current_settings' LANGUAGE C STABLE;
COMMENT ON FUNCTION idempotency.current_settings() IS
    'retention, partition_interval and premake in force (the defaults when none were configured)';

-- the partitions view gains columns in the middle: drop it; sql/ext/
-- 60_partitions.sql, appended by the Makefile, creates the 1.1 one
DROP VIEW idempotency.partitions;
