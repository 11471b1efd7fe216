-- Who may maintain, as whom a round acts, and what it refuses to touch.
-- A round runs as the extension's owner (here the bootstrap superuser that
-- runs the tests) whoever starts it; starting one needs the unlimited
-- operator capability, which both functions check (EXECUTE is PUBLIC's).
CREATE EXTENSION idempotency;

\getenv abs_srcdir PG_ABS_SRCDIR
\set try_sql :abs_srcdir '/include/try.sql'
\i :try_sql

CREATE ROLE idem_maint_role;
CREATE ROLE idem_other_role;
CREATE ROLE idem_partition_owner;

-- 1. no grant: no round, no configuration
SET ROLE idem_maint_role;
SELECT pg_temp.try($$SELECT count(*) FROM idem_maintain()$$);
SELECT pg_temp.try($$SELECT idem_configure(premake => 5)$$);
RESET ROLE;

-- 2. an operator limited to some scopes may not maintain either
SELECT idem_grant('idem_maint_role', 'operator', scopes => ARRAY['maint:*']);
SET ROLE idem_maint_role;
SELECT pg_temp.try($$SELECT count(*) FROM idem_maintain()$$);
RESET ROLE;

-- 3. the operator capability alone (no USAGE on schema idempotency, no
-- table rights) is enough: the round makes the partitions of every store,
-- as the owner
SELECT idem_grant('idem_maint_role', 'operator');
SET ROLE idem_maint_role;
SELECT pg_temp.try($$SELECT idem_configure(premake => 6)$$);
SELECT split_part(object, '_', 1) AS store, action, count(*)
  FROM idem_maintain() GROUP BY 1, 2 ORDER BY 1, 2;
RESET ROLE;
SELECT p.store, count(*) AS partitions,
       count(*) FILTER (WHERE c.relowner = (SELECT extowner FROM pg_extension
                                            WHERE extname = 'idempotency')) AS owned_by_extension_owner
  FROM idempotency.partitions p JOIN pg_class c ON c.oid = p.partition
 GROUP BY p.store ORDER BY p.store;
SELECT premake FROM idempotency.current_settings();

-- 4. an index on an expression of a partition is refused by claimers before
-- its expression is built (building it would run the function, as the claimer)
CREATE TABLE pg_temp.ran (n int);
CREATE FUNCTION pg_temp.note() RETURNS text LANGUAGE plpgsql VOLATILE AS
$$ BEGIN INSERT INTO pg_temp.ran VALUES (1); RETURN ''; END $$;
CREATE FUNCTION pg_temp.quiet() RETURNS text LANGUAGE plpgsql IMMUTABLE AS
$$ BEGIN RETURN pg_temp.note(); END $$;
SELECT relid AS current_part FROM idempotency.partition_registry
 WHERE lower <= now() AND now() < upper AND NOT sealed \gset
CREATE INDEX trap_index ON :current_part ((scope || pg_temp.quiet()));
TRUNCATE pg_temp.ran;
SELECT regexp_replace(pg_temp.try($$SELECT idem_claim('trap', 'maint-security')$$),
                      'claims_[0-9_a-f]+', 'claims_*');
SELECT count(*) AS function_ran FROM pg_temp.ran;
DROP INDEX idempotency.trap_index;

-- 5. a damaged Bloom filter is repaired by setting it to NULL: the next
-- round rebuilds it
SELECT idem_claim('filter-' || g, 'maint-security') FROM generate_series(1, 50) g \g /dev/null
SET idempotency.debug_clock_offset = '2d';
SELECT count(*) > 0 AS sealed_some FROM idem_maintain() WHERE action = 'seal';
SELECT relid AS filtered_part FROM idempotency.partition_registry
 WHERE sealed AND nkeys = 50 \gset
UPDATE idempotency.partition_registry SET bloom = NULL WHERE relid = :'filtered_part'::regclass;
SELECT action FROM idem_maintain() WHERE object = :'filtered_part'::regclass::text;
SELECT has_bloom_filter, claims FROM idempotency.partitions WHERE partition = :'filtered_part'::regclass;
SELECT count(*) AS claimed_again
  FROM (SELECT idem_claim('filter-' || g, 'maint-security') AS c FROM generate_series(1, 50) g) x
 WHERE c;

SELECT action FROM idem_maintain() WHERE object = :'filtered_part'::regclass::text;
RESET idempotency.debug_clock_offset;

-- 6. a partition that is not ours is reported and left alone: handed to
-- another role, it is neither sealed nor dropped, and nothing of it is read
SELECT relid AS future_part FROM idempotency.partition_registry
 WHERE lower > now() + interval '1 day' ORDER BY lower LIMIT 1 \gset
ALTER TABLE :future_part OWNER TO idem_partition_owner;
SET idempotency.debug_clock_offset = '3d';
SELECT regexp_replace(action, '"?idem_partition_owner"?', 'R') AS action
  FROM idem_maintain() WHERE object = :'future_part'::regclass::text;
RESET idempotency.debug_clock_offset;
SELECT sealed FROM idempotency.partition_registry WHERE relid = :'future_part'::regclass;
ALTER TABLE :future_part OWNER TO CURRENT_USER;

-- ... and so is one of ours with an index on an expression (its expression
-- would run when the partition is planned or its index entry built)
CREATE FUNCTION pg_temp.noisy(t text) RETURNS text LANGUAGE sql IMMUTABLE AS $$ SELECT t $$;
CREATE INDEX expression_index ON :future_part ((pg_temp.noisy(key)));
SET idempotency.debug_clock_offset = '3d';
SELECT action FROM idem_maintain() WHERE object = :'future_part'::regclass::text;
RESET idempotency.debug_clock_offset;
DROP INDEX idempotency.expression_index;

-- a store partition likewise (drop is what a round does to an old one)
SELECT relid AS outbox_part FROM idempotency.outbox_partitions ORDER BY lower LIMIT 1 \gset
ALTER TABLE :outbox_part OWNER TO idem_partition_owner;
SET idempotency.debug_clock_offset = '30d';
SELECT regexp_replace(action, '"?idem_partition_owner"?', 'R') AS action
  FROM idem_maintain() WHERE object = :'outbox_part'::regclass::text;
RESET idempotency.debug_clock_offset;
SELECT count(*) AS still_there FROM idempotency.outbox_partitions WHERE relid = :'outbox_part'::regclass;
ALTER TABLE :outbox_part OWNER TO CURRENT_USER;

-- 7. a table of the extension handed to another role: no round acts as the
-- owner on a table whose triggers another role controls
ALTER TABLE idempotency.partition_registry OWNER TO idem_other_role;
SELECT regexp_replace(pg_temp.try($$SELECT count(*) FROM idem_maintain()$$),
                      '"?idem_other_role"?', 'R');
ALTER TABLE idempotency.partition_registry OWNER TO CURRENT_USER;

-- 8. a maintenance role's own settings cannot make its round drop more: with
-- outbox_keep_undelivered off in its session, an undelivered event still
-- pins its partition (a superuser's, or the owner's, setting is honoured)
SELECT relid AS pinned_part FROM idempotency.outbox_partitions
 WHERE lower <= now() AND now() < upper \gset
SELECT seq FROM idem_outbox_emit('maint-security', 'a-1', 'created', '{}');
SET idempotency.debug_clock_offset = '30d';
SET ROLE idem_maint_role;
SET idempotency.outbox_keep_undelivered = off;
SELECT action FROM idem_maintain() WHERE object = :'pinned_part';
RESET ROLE;
SELECT count(*) AS kept FROM idempotency.outbox_partitions WHERE relid = :'pinned_part'::regclass;
SELECT action FROM idem_maintain() WHERE object = :'pinned_part';
RESET idempotency.debug_clock_offset;
RESET idempotency.outbox_keep_undelivered;

SELECT idem_revoke('idem_maint_role') AS revoked;
SET client_min_messages = warning;
DROP EXTENSION idempotency CASCADE;
RESET client_min_messages;
DROP ROLE idem_maint_role, idem_other_role, idem_partition_owner;
