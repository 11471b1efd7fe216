\echo Use "ALTER EXTENSION idempotency UPDATE TO '1.1'" to load this file. \quit

-- idempotency 1.0 -> 1.1 update script: the hand-written part.
--
-- The Makefile builds sql/idempotency--1.0--1.1.sql from this file, then
-- the sql/tables/ files wholly new in 1.1 (NEW_TABLES), then every
-- sql/functions/ file as written (CREATE OR REPLACE), then sql/init.sql; see
-- doc/development.md, "The SQL scripts".  So this file holds only what
-- cannot simply be run again (internals qualified with idempotency.,
-- public idem_* functions unqualified: the update runs with search_path
-- set to the extension's schema, as CREATE EXTENSION does):
--   * the locks, taken first;
--   * new columns of existing tables: ALTER TABLE ... ADD COLUMN, which can
--     only append, so add them at the end of the CREATE TABLE in
--     sql/tables/ (and existing claim partitions are ordinary tables, not
--     extension members: if their shape changes, alter them here as well);
--   * data fixes;
--   * DROP of what changes shape or goes: a function whose signature or
--     return type changes, a view whose columns change other than by
--     appending, a trigger whose function is dropped, an object 1.1 no
--     longer has;
--   * pg_extension_config_dump() of a new configuration table in a table
--     file that existed in 1.0.
-- No function, view, trigger, comment or grant is copied here.
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

-- partition registry: retention classes (retention per scope)
ALTER TABLE idempotency.partition_registry
    ADD COLUMN retention interval,
    ADD COLUMN keep_retention interval,
    ADD COLUMN keep_default boolean NOT NULL DEFAULT false;

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

-- the invalidation trigger function has a new name
-- (idempotency.partition_cache_invalidate(), in sql/functions/00_schema.sql,
-- which makes the triggers again)
DROP TRIGGER registry_changed ON idempotency.partition_registry;
DROP TRIGGER settings_changed ON idempotency.settings;
DROP FUNCTION idempotency.registry_changed();

-- claims: SHA-256 payload digests (recurses into the existing partitions)
ALTER TABLE idempotency.claims ADD COLUMN digest bytea;

-- settings: the defaults live in the library only
ALTER TABLE idempotency.settings
    ALTER COLUMN retention DROP DEFAULT,
    ALTER COLUMN partition_interval DROP DEFAULT,
    ALTER COLUMN premake DROP DEFAULT;

-- the partitions view gains columns at the end: sql/functions/60_partitions.sql
-- replaces it in place

---- who owns what, and who may maintain ----------------------------------

-- A 1.1 round runs as the extension's owner and acts only on partitions that
-- owner owns (src/common/ownership.c).  Under 1.0 the role that ran the rounds
-- created the partitions, and a DBA may have given the tables to a
-- maintenance role: every table of the schema goes back to the extension's
-- owner, and that role keeps maintaining through EXECUTE on the two
-- functions, which PUBLIC no longer has (sql/functions/20_retention.sql
-- revokes it).
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
