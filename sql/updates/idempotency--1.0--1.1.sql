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

---- locks first, in the claimers' order -----------------------------------

-- This update alters the claims parent (ALTER TABLE ... ADD COLUMN recurses
-- into every partition, oldest first) and the registry, while claimers may
-- run: they read the registry, then lock the partition they insert into,
-- then the others newest first.  Taking the same locks in that order, each
-- with a lock_timeout shorter than deadlock_timeout and the whole set
-- retried when one times out, means no claimer ever deadlocks with the
-- update (claimers only wait for it).  Should the claimers never leave a
-- gap in 60 seconds, the update fails with a message that says so.
DO $$
DECLARE
    tries integer := 0;
    p regclass;
    old_timeout text := pg_catalog.current_setting('lock_timeout');
BEGIN
    PERFORM pg_catalog.set_config('lock_timeout', '100ms', true);
    LOOP
        BEGIN
            LOCK TABLE ONLY idempotency.claims, idempotency.partition_registry,
                       idempotency.settings IN ACCESS EXCLUSIVE MODE;
            FOR p IN SELECT i.inhrelid::regclass
                     FROM pg_catalog.pg_inherits i
                     LEFT JOIN idempotency.partition_registry r ON r.relid = i.inhrelid
                     WHERE i.inhparent = 'idempotency.claims'::regclass
                     ORDER BY (r.lower <= now() AND now() < r.upper) IS TRUE DESC,
                              r.lower DESC NULLS LAST, i.inhrelid DESC
            LOOP
                EXECUTE pg_catalog.format('LOCK TABLE ONLY %s IN ACCESS EXCLUSIVE MODE', p);
            END LOOP;
            EXIT;
        EXCEPTION WHEN lock_not_available THEN
            tries := tries + 1;
            IF tries >= 300 THEN
                RAISE EXCEPTION 'could not lock the claims partitions for the update'
                    USING ERRCODE = 'lock_not_available',
                          DETAIL = 'Claims kept a partition busy for 300 tries over about 60 seconds.',
                          HINT = 'Pause the claimers (or retry when the load is lower), then run ALTER EXTENSION idempotency UPDATE again.';
            END IF;
            PERFORM pg_catalog.pg_sleep(0.1);
        END;
    END LOOP;
    PERFORM pg_catalog.set_config('lock_timeout', old_timeout, true);
END
$$;

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

-- the partitions view gains columns at the end: sql/ext/60_partitions.sql,
-- appended by the Makefile, replaces it in place

---- who owns what, and who may maintain ----------------------------------

-- A 1.1 round runs as the extension's owner and acts only on partitions that
-- owner owns (src/ownership.c).  Under 1.0 the role that ran the rounds
-- created the partitions, and a DBA may have given the tables to a
-- maintenance role: every table of the schema goes back to the extension's
-- owner, and that role keeps maintaining through EXECUTE on the two
-- functions, which PUBLIC no longer has.
DO $$
DECLARE
    ext_owner regrole := (SELECT e.extowner::regrole FROM pg_catalog.pg_extension e
                          WHERE e.extname = 'idempotency');
    claims_owner regrole := (SELECT c.relowner::regrole FROM pg_catalog.pg_class c
                             WHERE c.oid = 'idempotency.claims'::regclass);
    t regclass;
BEGIN
    IF claims_owner <> ext_owner THEN
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION idem_maintain(), idem_configure(interval, interval, integer) TO %s',
                                  claims_owner);
    END IF;
    FOR t IN SELECT c.oid::regclass FROM pg_catalog.pg_class c
             WHERE c.relnamespace = 'idempotency'::regnamespace
               AND c.relkind IN ('r', 'p', 'v') AND c.relowner <> ext_owner
    LOOP
        EXECUTE pg_catalog.format('ALTER TABLE %s OWNER TO %s', t, ext_owner);
    END LOOP;
END
$$;
REVOKE ALL ON FUNCTION idem_configure(interval, interval, integer), idem_maintain() FROM PUBLIC;
