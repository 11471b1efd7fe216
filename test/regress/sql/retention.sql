-- Retention: configuration, maintenance actions, the retention window,
-- and claims while maintenance lags.
CREATE EXTENSION idempotency;

\getenv abs_srcdir PG_ABS_SRCDIR
\set try_sql :abs_srcdir '/include/try.sql'
\i :try_sql

-- CREATE EXTENSION made the current partition and premake (4) more
SELECT count(*) AS partitions,
       count(*) FILTER (WHERE state = 'current') AS current,
       count(*) FILTER (WHERE state = 'future') AS future
  FROM idempotency.partitions WHERE store = 'claims';
-- defaults apply while idempotency.settings has no row
SELECT count(*) AS settings_rows FROM idempotency.settings;
-- partitions are not extension members (pg_dump must dump them as data)
SELECT count(*) AS member_partitions
  FROM pg_depend d JOIN idempotency.partition_registry r ON d.objid = r.relid
 WHERE d.deptype = 'e';
-- a second round right away has nothing to do
SELECT * FROM idem_maintain();

-- validation: nothing changes on bad input
SELECT pg_temp.try($$SELECT idem_configure(partition_interval => '500 milliseconds')$$);
SELECT pg_temp.try($$SELECT idem_configure(partition_interval => '1.5 seconds')$$);
SELECT pg_temp.try($$SELECT idem_configure(partition_interval => '0 seconds')$$);
SELECT pg_temp.try($$SELECT idem_configure(partition_interval => '-1 day')$$);
SELECT pg_temp.try($$SELECT idem_configure(retention => '1 hour', partition_interval => '2 hours')$$);
SELECT pg_temp.try($$SELECT idem_configure(retention => '12 hours')$$);
SELECT pg_temp.try($$SELECT idem_configure(premake => 0)$$);
SELECT pg_temp.try($$SELECT idem_configure(premake => 1001)$$);
SELECT pg_temp.try($$SELECT idem_configure(retention => 'soon')$$);
SELECT pg_temp.try($$SELECT idem_configure(retention => '1000000 years', partition_interval => '100000 years')$$);
SELECT pg_temp.try($$SELECT idem_configure(retention => '1000 years')$$);
SELECT count(*) AS settings_rows FROM idempotency.settings;
\set VERBOSITY default
SELECT idem_configure(retention => '1 hour', partition_interval => '2 hours');
\set VERBOSITY terse

-- NULL keeps the current value
SELECT idem_configure(retention => '2 days');
SELECT retention, partition_interval, premake FROM idempotency.settings;
SELECT idem_configure(premake => 6);
SELECT retention, partition_interval, premake FROM idempotency.settings;
SELECT idem_configure();
SELECT retention, partition_interval, premake FROM idempotency.settings;

-- a more-premake configuration created the missing partitions at once
SELECT count(*) FILTER (WHERE state = 'future') AS future FROM idempotency.partitions
 WHERE store = 'claims';
-- the ranges of partitions that take claims are contiguous
SELECT count(*) AS gaps FROM (
    SELECT upper, lead(lower) OVER (ORDER BY lower) AS next_lower
      FROM idempotency.partition_registry WHERE NOT sealed) r
 WHERE next_lower IS NOT NULL AND next_lower <> upper;

-- Short intervals: a claim is found for the whole retention window and gone
-- once retention + partition_interval have passed and maintenance ran.
SELECT idem_configure(retention => '3 seconds', partition_interval => '1 second', premake => 3);
-- (past the end of the day partition that the new interval cut short)
SELECT pg_sleep(2.1);
SELECT idem_claim('short-lived', 'retention');
CREATE TEMP TABLE t0 AS SELECT idem_claimed('short-lived', 'retention') AS claimed_at;
DO $$
DECLARE
    t0 timestamptz := (SELECT claimed_at FROM t0);
    checks int := 0;
BEGIN
    -- while within retention, maintenance keeps it and a redelivery is a duplicate
    WHILE clock_timestamp() < t0 + interval '2.8 seconds' LOOP
        PERFORM idem_maintain();
        IF idem_claim('short-lived', 'retention') THEN
            RAISE EXCEPTION 'claim lost % after it was made', clock_timestamp() - t0;
        END IF;
        checks := checks + 1;
        PERFORM pg_sleep(0.2);
    END LOOP;
    RAISE NOTICE 'found in every one of at least 5 checks: %', checks >= 5;
END $$;
-- the function above ran in one transaction (one now()): check again anew
SELECT idem_claim('short-lived', 'retention') AS claimed_again_too_early;
SELECT pg_sleep_until((SELECT claimed_at FROM t0) + interval '4.5 seconds');
SELECT count(*) > 0 AS dropped_some FROM idem_maintain() WHERE action = 'drop';
-- every partition that could hold it is gone (by the clock of the round
-- above, not of this statement, which may have crossed a boundary since)
SELECT count(*) AS left_behind FROM idempotency.partition_registry
 WHERE upper <= (SELECT claimed_at FROM t0) + interval '1 second';
SELECT idem_claimed('short-lived', 'retention') IS NULL AS gone;
SELECT idem_claim('short-lived', 'retention') AS claimable_again;

-- Maintenance lagging far beyond premake: claims still work and still find
-- duplicates (they go into the newest partition); the next round extends
-- that partition rather than leaving a gap.
SELECT idem_configure(retention => '10 seconds', partition_interval => '1 second', premake => 1);
SELECT pg_sleep(5.5);
SELECT count(*) AS covering FROM idempotency.partition_registry
 WHERE lower <= clock_timestamp() AND clock_timestamp() < upper;
SELECT idem_claim('during-lag'), idem_claim('during-lag');
SELECT * FROM idem_claim_many(ARRAY['lag-a', 'during-lag', 'lag-b']);
SELECT count(*) AS extended FROM idem_maintain() WHERE action = 'extend';
SELECT count(*) AS covering FROM idempotency.partition_registry
 WHERE lower <= clock_timestamp() AND clock_timestamp() < upper;
SELECT idem_claim('during-lag'), idem_claim('lag-a');
SELECT count(*) AS gaps FROM (
    SELECT upper, lead(lower) OVER (ORDER BY lower) AS next_lower
      FROM idempotency.partition_registry WHERE NOT sealed) r
 WHERE next_lower IS NOT NULL AND next_lower <> upper;
SELECT count(*) AS doubled FROM (
    SELECT scope, key FROM idempotency.claims GROUP BY 1, 2 HAVING count(*) > 1) d;

-- a partition dropped by hand: claims report it, maintenance forgets it
SELECT idem_configure(retention => '1 hour', partition_interval => '1 hour', premake => 2);
SELECT idem_claim('before-drop');
DO $$
BEGIN
    EXECUTE format('DROP TABLE %s', (SELECT relid FROM idempotency.partition_registry
                                     WHERE lower <= now() AND now() < upper));
END $$;
SELECT pg_temp.try($$SELECT idem_claim('after-drop')$$);
SELECT action FROM idem_maintain() ORDER BY 1;
SELECT idem_claim('after-drop'), idem_claim('after-drop');
SELECT count(*) AS doubled FROM (
    SELECT scope, key FROM idempotency.claims GROUP BY 1, 2 HAVING count(*) > 1) d;

-- sealing: a partition whose range has passed is sealed with a Bloom
-- filter, and every claim in it is still found (no false negatives)
SELECT idem_configure(retention => '30 days', partition_interval => '1 day', premake => 1);
CREATE TABLE idempotency.claims_past () INHERITS (idempotency.claims);
CREATE UNIQUE INDEX ON idempotency.claims_past (scope, key);
ALTER TABLE idempotency.claims DISABLE TRIGGER claims_read_only;
INSERT INTO idempotency.claims_past
SELECT CASE WHEN g % 3 = 0 THEN 'other' ELSE 'default' END, 'past-' || g,
       now() - interval '10 days', NULL
  FROM generate_series(1, 5000) g;
ALTER TABLE idempotency.claims ENABLE TRIGGER claims_read_only;
INSERT INTO idempotency.partition_registry (relid, lower, upper)
VALUES ('idempotency.claims_past', now() - interval '11 days', now() - interval '9 days');
SELECT action FROM idem_maintain() WHERE object = 'idempotency.claims_past';
SELECT state, has_bloom_filter FROM idempotency.partitions
 WHERE partition = 'idempotency.claims_past'::regclass;
SELECT count(*) AS claimed_again FROM idem_claim_many(ARRAY(
    SELECT 'past-' || g FROM generate_series(1, 5000) g WHERE g % 3 <> 0));
SELECT count(*) AS claimed_again FROM idem_claim_many(ARRAY(
    SELECT 'past-' || g FROM generate_series(1, 5000) g WHERE g % 3 = 0), 'other');
SELECT count(*) AS new_keys FROM idem_claim_many(ARRAY(
    SELECT 'past-' || g FROM generate_series(5001, 5100) g));
SELECT count(*) AS in_other_scope FROM idem_claim_many(ARRAY['past-1', 'past-2'], 'other');

-- a prepared transaction with a claim in a partition whose range has passed
-- keeps RowExclusiveLock on it: the round closes the partition, the next
-- one seals it with that claim in its filter, held by the prepared
-- transaction (which has no backend); claims go on meanwhile, and once it
-- commits, the next round counts it in idempotency.consumers' history and
-- marks the partition sealed
SELECT idem_configure(retention => '3 days', partition_interval => '1 hour', premake => 1);
CREATE TEMP TABLE held_part AS
SELECT relid::text AS name FROM idempotency.partition_registry
 WHERE NOT closed AND lower <= now() AND now() < upper;
BEGIN;
SELECT idem_claim('prepared-1', 'held');
PREPARE TRANSACTION 'idem_held';
SET idempotency.debug_clock_offset = '2h';
CREATE TEMP VIEW held_state AS
SELECT p.state, p.claims, p.has_bloom_filter,
       p.held_by_xids::xid[] = ARRAY(SELECT transaction FROM pg_prepared_xacts
                                      WHERE gid = 'idem_held') AS by_prepared,
       p.held_by_pids AS pids
  FROM idempotency.partitions p WHERE p.partition::text = (SELECT name FROM held_part);
SELECT action FROM idem_maintain() WHERE object = (SELECT name FROM held_part);
SELECT * FROM held_state;
SELECT action FROM idem_maintain() WHERE object = (SELECT name FROM held_part);
SELECT * FROM held_state;
SELECT idem_claim('prepared-2', 'held') AS other_key, idem_claimed('prepared-1', 'held') AS uncommitted;
SELECT claims FROM idempotency.consumers WHERE scope = 'held';
-- a held partition is not dropped, not even once expired for claimers
SET idempotency.debug_clock_offset = '4d';
SELECT count(*) AS drop_tried FROM idem_maintain()
 WHERE object = (SELECT name FROM held_part) AND action LIKE '%drop%';
SET idempotency.debug_clock_offset = '2h';
COMMIT PREPARED 'idem_held';
SELECT action FROM idem_maintain() WHERE object = (SELECT name FROM held_part);
SELECT state, claims, has_bloom_filter, pids FROM held_state;
SELECT claims FROM idempotency.consumers WHERE scope = 'held';
SELECT idem_claim('prepared-1', 'held') AS claimed_again;
RESET idempotency.debug_clock_offset;

-- maintenance SQL cannot be hijacked through search_path: an operator put
-- ahead of pg_catalog is not used
CREATE SCHEMA evil;
CREATE FUNCTION evil.ts_le(timestamptz, timestamptz) RETURNS boolean
    LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'hijacked'; END $$;
CREATE OPERATOR evil.<= (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = evil.ts_le);
SET search_path = evil, pg_catalog, public;
SELECT count(*) >= 0 AS ran FROM idem_maintain();
SELECT idem_configure(premake => 2);
RESET search_path;
DROP SCHEMA evil CASCADE;

SET client_min_messages = warning;
DROP EXTENSION idempotency CASCADE;
