-- The claims store at its edges: each block is one finding of the
-- adversarial review (lagging rounds, a role that stops maintenance, REINDEX
-- CONCURRENTLY, extra indexes, payload collisions, damaged filters, internal
-- functions, session_replication_role).  Time is moved with the test-only
-- setting idempotency.debug_clock_offset, always forward.
CREATE EXTENSION idempotency;

\getenv abs_srcdir PG_ABS_SRCDIR
\set try_sql :abs_srcdir '/include/try.sql'
\i :try_sql

SELECT idem_configure(retention => '1 day', partition_interval => '1 hour', premake => 2);
-- the (backend-local) filters of this test are named in warnings: hide them
SET client_min_messages = error;

-- 1. One partition that cannot be dropped (an application role put a view
-- on it) costs one reported row, not the round: the rest still happens.
CREATE ROLE regress_idem_app;
CREATE SCHEMA regress_app AUTHORIZATION regress_idem_app;
GRANT USAGE ON SCHEMA idempotency TO regress_idem_app;
SELECT idem_claim('pinned', 'edges');
SELECT tableoid::regclass AS pinned_part FROM idempotency.claims WHERE key = 'pinned' \gset
SET idempotency.debug_clock_offset = '3h';
SELECT count(*) > 0 AS sealed_some FROM idem_maintain() WHERE action = 'seal';
SET ROLE regress_idem_app;
CREATE VIEW regress_app.pin AS SELECT key FROM :pinned_part;
RESET ROLE;
SET idempotency.debug_clock_offset = '30h';
CREATE TEMP TABLE round1 AS SELECT * FROM idem_maintain();
SELECT regexp_replace(action, 'claims_\w+', 'claims_*', 'g') AS skipped
  FROM round1 WHERE action LIKE 'skip%';
SELECT count(*) FILTER (WHERE action IN ('create', 'extend')) > 0 AS made_partitions,
       count(*) FILTER (WHERE action = 'drop') > 0 AS dropped_others
  FROM round1;
SELECT count(*) AS pinned_still_registered
  FROM idempotency.partition_registry WHERE relid = :'pinned_part'::regclass;
DROP VIEW regress_app.pin;
SELECT count(*) AS dropped_after FROM idem_maintain()
 WHERE action = 'drop' AND object = :'pinned_part';
-- the internal schema is not needed to claim: the handler capability is
REVOKE USAGE ON SCHEMA idempotency FROM regress_idem_app;
SELECT idem_grant('regress_idem_app', 'handler');
SET ROLE regress_idem_app;
SELECT idem_claim('app-no-schema', 'edges'), idem_claim('app-no-schema', 'edges');
SELECT idem_claimed('app-no-schema', 'edges') IS NOT NULL AS found;
RESET ROLE;

-- 2. Claims made while maintenance lags lie past their partition's upper
-- bound; retention counts from the newest claim the seal found there.
SET idempotency.debug_clock_offset = '36h';
SELECT idem_claim('late-claim', 'edges');
SELECT tableoid::regclass AS late_part FROM idempotency.claims WHERE key = 'late-claim' \gset
SET idempotency.debug_clock_offset = '34h';
SELECT count(*) AS extended FROM idem_maintain() WHERE action = 'extend';
SELECT upper < (SELECT claimed_at FROM idempotency.claims WHERE key = 'late-claim') AS claim_past_upper
  FROM idempotency.partition_registry WHERE relid = :'late_part'::regclass;
SET idempotency.debug_clock_offset = '38h';
SELECT count(*) AS sealed FROM idem_maintain() WHERE action = 'seal' AND object = :'late_part';
SELECT nkeys, max_claimed_at = (SELECT claimed_at FROM idempotency.claims WHERE key = 'late-claim') AS newest_recorded
  FROM idempotency.partition_registry WHERE relid = :'late_part'::regclass;
-- 23.5 hours after the claim (a day after the upper bound): still kept
SET idempotency.debug_clock_offset = '3570min';
SELECT count(*) AS dropped_early FROM idem_maintain() WHERE object = :'late_part';
SELECT idem_claim('late-claim', 'edges') AS claimable_early,
       idem_claimed('late-claim', 'edges') IS NOT NULL AS found;
-- past its retention it goes
SET idempotency.debug_clock_offset = '61h';
SELECT count(*) AS dropped FROM idem_maintain() WHERE action = 'drop' AND object = :'late_part';
SELECT idem_claim('late-claim', 'edges') AS claimable_after;

-- 3. Damaged Bloom filters are never trusted: the partition is probed.
SET idempotency.debug_clock_offset = '62h';
SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'filtered-' || g FROM generate_series(1, 200) g), 'edges');
SELECT tableoid::regclass AS filtered_part FROM idempotency.claims WHERE key = 'filtered-1' \gset
SET idempotency.debug_clock_offset = '65h';
SELECT count(*) AS sealed FROM idem_maintain() WHERE action = 'seal' AND object = :'filtered_part';
SELECT has_bloom_filter, claims FROM idempotency.partitions WHERE partition = :'filtered_part'::regclass;
SELECT count(*) AS claimed_again FROM idem_claim_many(ARRAY(SELECT 'filtered-' || g FROM generate_series(1, 200) g), 'edges');
SELECT filters > 0 AS filter_loaded, mode FROM idempotency.filter_status();
-- bits flipped (the CRC no longer matches), then cut short, then not even a header
UPDATE idempotency.partition_registry SET bloom = overlay(bloom PLACING '\xffffffff'::bytea FROM 40)
 WHERE relid = :'filtered_part'::regclass;
SELECT count(*) AS claimed_again FROM idem_claim_many(ARRAY(SELECT 'filtered-' || g FROM generate_series(1, 200) g), 'edges');
UPDATE idempotency.partition_registry SET bloom = substring(bloom FROM 1 FOR 100)
 WHERE relid = :'filtered_part'::regclass;
SELECT idem_claim('filtered-7', 'edges') AS f7, idem_claim('filtered-new-1', 'edges') AS new1;
UPDATE idempotency.partition_registry SET bloom = '\x00'
 WHERE relid = :'filtered_part'::regclass;
SELECT idem_claim('filtered-8', 'edges') AS f8, idem_claim('filtered-new-2', 'edges') AS new2;

-- 4. REINDEX CONCURRENTLY replaces the (scope, key) index: claims go on.
-- (day-wide partitions from here, so the current one stays current)
SELECT idem_configure(retention => '2 days', partition_interval => '1 day');
SELECT idem_claim('ri-1', 'edges');
SELECT tableoid::regclass AS cur FROM idempotency.claims WHERE key = 'ri-1' \gset
REINDEX TABLE CONCURRENTLY :cur;
SELECT idem_claim('ri-1', 'edges') AS ri1, idem_claim('ri-2', 'edges') AS ri2;
REINDEX TABLE CONCURRENTLY :cur;
SELECT idem_claim('ri-2', 'edges') AS ri2, idem_claim('ri-3', 'edges') AS ri3;

-- 5. Extra indexes: plain ones are maintained; the (scope, key) index is
-- found wherever it is in the list; expression indexes are refused.
CREATE INDEX claims_edges_at ON :cur (claimed_at);
SELECT idem_claim('ix-1', 'edges');
SET enable_seqscan = off;
SET enable_bitmapscan = off;
SELECT count(*) AS via_index FROM :cur WHERE claimed_at IS NOT NULL \gset
CREATE FUNCTION pg_temp.plan_uses(q text, idx text) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE l text;
BEGIN
    FOR l IN EXECUTE 'EXPLAIN (COSTS OFF) ' || q LOOP
        IF l LIKE '%' || idx || '%' THEN RETURN true; END IF;
    END LOOP;
    RETURN false;
END $$;
SELECT pg_temp.plan_uses(format('SELECT count(*) FROM %s WHERE claimed_at IS NOT NULL', :'cur'),
                         'claims_edges_at') AS counted_via_index;
RESET enable_seqscan;
RESET enable_bitmapscan;
SELECT count(*) = :via_index AS index_has_every_claim FROM ONLY :cur;
SELECT indexrelid::regclass AS unique_index FROM pg_index
 WHERE indrelid = :'cur'::regclass AND indisunique \gset
DROP INDEX :unique_index;
CREATE UNIQUE INDEX claims_edges_unique ON :cur (scope, key);
SELECT idem_claim('ix-1', 'edges') AS ix1, idem_claim('ix-2', 'edges') AS ix2;
CREATE INDEX claims_edges_expr ON :cur (lower(key));
SELECT regexp_replace(pg_temp.try($$SELECT idem_claim('ix-3', 'edges')$$), 'claims_\w+', 'claims_*');
DROP INDEX idempotency.claims_edges_expr;
SELECT idem_claim('ix-3', 'edges') AS ix3;

-- 6. Payloads are compared by a digest of the canonical jsonb: values the
-- old 64-bit hash confused are told apart; equal jsonb stays equal.
SELECT idem_claim('pay-1', 'edges', jsonb_build_object('qty', (SELECT jsonb_agg(1) FROM generate_series(1, 64))));
SELECT pg_temp.try($$SELECT idem_claim('pay-1', 'edges', jsonb_build_object('qty', (SELECT jsonb_agg(7) FROM generate_series(1, 64))))$$);
SELECT idem_claim('pay-1', 'edges', jsonb_build_object('qty', (SELECT jsonb_agg(1) FROM generate_series(1, 64)))) AS same_payload;
SELECT idem_claim('pay-2', 'edges', '[100, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 100]');
SELECT pg_temp.try($$SELECT idem_claim('pay-2', 'edges', '[999, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 999]')$$);
SELECT idem_claim('pay-3', 'edges', '{"a": 1.0, "b": [true, null, "x"]}');
SELECT idem_claim('pay-3', 'edges', '{ "b": [true, null, "x"], "a": 1.00 }') AS reordered_equal;
SELECT pg_temp.try($$SELECT idem_claim('pay-3', 'edges', '{"a": 1, "b": [true, null, "y"]}')$$);
SELECT pg_temp.try($$SELECT idem_claim('pay-3', 'edges', '{"a": 1, "b": [true, "null", "x"]}')$$);
SELECT pg_temp.try($$SELECT idem_claim('pay-3', 'edges', '"{\"a\": 1}"')$$);
SELECT length(digest) AS digest_bytes, fingerprint IS NULL AS no_old_hash
  FROM idempotency.claims WHERE key = 'pay-3';
-- a claim stored by version 1.0 (64-bit fingerprint, no digest) still compares
INSERT INTO :cur (scope, key, claimed_at, fingerprint)
VALUES ('edges', 'legacy', now(), jsonb_hash_extended('{"a": 1}', 2153723919735591701));
SELECT idem_claim('legacy', 'edges', '{"a": 1}') AS legacy_same;
SELECT pg_temp.try($$SELECT idem_claim('legacy', 'edges', '{"a": 2}')$$);

-- 7. Internal functions: not executable by application roles, and the
-- cache trigger serves no table but the registry and the settings.
GRANT USAGE ON SCHEMA idempotency TO regress_idem_app;
SET ROLE regress_idem_app;
CREATE TABLE regress_app.t (x int);
SELECT pg_temp.try($$CREATE TRIGGER flush AFTER INSERT ON regress_app.t
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate()$$);
SELECT pg_temp.try($$CREATE TRIGGER ro BEFORE INSERT ON regress_app.t
    FOR EACH ROW EXECUTE FUNCTION idempotency.claims_read_only()$$);
RESET ROLE;
REVOKE USAGE ON SCHEMA idempotency FROM regress_idem_app;
CREATE TRIGGER flush AFTER INSERT ON regress_app.t
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
SELECT pg_temp.try($$INSERT INTO regress_app.t VALUES (1)$$);
SELECT p.proname, has_function_privilege('regress_idem_app', p.oid, 'EXECUTE') AS app_can_execute
  FROM pg_proc p WHERE p.pronamespace = 'idempotency'::regnamespace
   AND p.proname IN ('partition_cache_invalidate', 'claims_read_only') ORDER BY 1;

-- 8. Registry changes made with session_replication_role = replica still
-- reach the partition caches.
SET session_replication_role = replica;
SELECT idem_configure(premake => 4);
SELECT (SELECT count(*) FROM idempotency.cached_partitions()) =
       (SELECT count(*) FROM idempotency.partition_registry) AS cache_current;
RESET session_replication_role;

-- 9. A shape with more live partitions than a claim can consult is refused,
-- with an interval that works.
\set VERBOSITY default
SELECT idem_configure(retention => '1 day', partition_interval => '1 minute');
\set VERBOSITY terse
SELECT idem_configure(retention => '1 day', partition_interval => '15 minutes', premake => 2);

-- 10. Raising the retention brings back a claim that had expired and was
-- made again; releasing the key forgets both, so it can be claimed again.
SET idempotency.debug_clock_offset = '65h';
SELECT idem_configure(retention => '2 seconds', partition_interval => '1 second', premake => 3);
SELECT idem_claim('rel', 'edges') AS first;
SET idempotency.debug_clock_offset = 234005;
SELECT count(*) > 0 AS sealed FROM idem_maintain() WHERE action = 'seal';
SELECT idem_claim('rel', 'edges') AS after_expiry;
SELECT idem_configure(retention => '60 seconds');
SELECT count(*) AS rows_of_rel FROM idempotency.claims WHERE key = 'rel';
BEGIN;
SELECT idem_release('rel', 'edges') AS released;
SELECT idem_claim('rel', 'edges') AS reprocess;
COMMIT;
SELECT count(*) AS rows_of_rel FROM idempotency.claims WHERE key = 'rel';

-- 11. Releasing also forgets a claim that has expired but is not dropped
-- yet: a retention raised after the release would bring it back (found by
-- the adversarial stress: claims answered false after a committed release).
-- rel2 is claimed again after its claim expired, rel3 only once: a key whose
-- only row has expired had no claim to release (false), and its row goes
-- all the same.
SET idempotency.debug_clock_offset = 234100;
SELECT idem_configure(retention => '2 seconds');
SELECT idem_claim('rel2', 'edges') AS first2, idem_claim('rel3', 'edges') AS first3;
SET idempotency.debug_clock_offset = 234105;
SELECT count(*) > 0 AS sealed FROM idem_maintain() WHERE action = 'seal';
SELECT idem_claim('rel2', 'edges') AS after_expiry;
SELECT idem_release('rel2', 'edges') AS released2, idem_release('rel3', 'edges') AS released3;
SELECT count(*) AS rows_left FROM idempotency.claims WHERE key IN ('rel2', 'rel3');
SELECT idem_configure(retention => '60 seconds');
SELECT idem_claimed('rel2', 'edges') IS NULL AS forgotten2, idem_claimed('rel3', 'edges') IS NULL AS forgotten3;
SELECT idem_claim('rel2', 'edges') AS reprocess2, idem_claim('rel3', 'edges') AS reprocess3;

-- nothing doubled on the way
SELECT count(*) AS doubled FROM (
    SELECT scope, key FROM idempotency.claims GROUP BY 1, 2 HAVING count(*) > 1) d;

RESET idempotency.debug_clock_offset;
DROP SCHEMA regress_app CASCADE;
SELECT idem_revoke('regress_idem_app');
DROP ROLE regress_idem_app;
DROP EXTENSION idempotency CASCADE;
