-- Late duplicates: a key claimed, its partition dropped, claimed again is
-- counted, warned about or refused (idempotency.late_duplicate_policy);
-- idem_claimed_before() says so; the summaries expire after
-- idempotency.late_duplicate_window.  The counter is in TAP 047 (it needs
-- the library preloaded).
CREATE EXTENSION idempotency;

\getenv abs_srcdir PG_ABS_SRCDIR
\set try_sql :abs_srcdir '/include/try.sql'
\i :try_sql

-- the defaults: 30 days, counted
SHOW idempotency.late_duplicate_window;
SHOW idempotency.late_duplicate_policy;
SELECT count(*) AS summaries FROM idempotency.late_summaries;

-- Rounds until every partition that held the claims of t is dropped; each
-- round in a transaction of its own.
CREATE TABLE late_t (claimed_at timestamptz);
CREATE PROCEDURE pg_temp.drop_past(t timestamptz) LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1..100 LOOP
        PERFORM idem_maintain();
        COMMIT;
        EXIT WHEN NOT EXISTS (SELECT 1 FROM idempotency.partition_registry WHERE lower <= t);
        PERFORM pg_sleep(0.2);
    END LOOP;
END $$;

SELECT idem_configure(retention => '1 second', partition_interval => '1 second', premake => 2);
SELECT idem_claim('k' || i, 'late') FROM generate_series(1, 6) i;
INSERT INTO late_t SELECT idem_claimed('k1', 'late');
SELECT claimed_at AS t0 FROM late_t \gset
CALL pg_temp.drop_past(:'t0');

-- the claims are gone, their keys are in a summary
SELECT count(*) AS claims_left FROM idempotency.claims WHERE scope = 'late';
SELECT count(*) AS summaries, sum(nkeys) >= 6 AS keys_kept,
       bool_and(expired_from <= expired_to) AS ordered,
       bool_and(expired_to >= (SELECT claimed_at FROM late_t) + interval '1 second') AS expired_after_retention
  FROM idempotency.late_summaries;
SELECT idem_claimed('k1', 'late') AS claimed_now;
SELECT idem_claimed_before('k1', 'late') >= (SELECT claimed_at FROM late_t) + interval '1 second'
       AS claimed_before;
SELECT idem_claimed_before('k1', 'other scope') AS other_scope,
       idem_claimed_before('never-claimed', 'late') AS never;

-- policy 'count' (default): claimed again, silently
SELECT idem_claim('k1', 'late') AS count_policy;

-- policy 'warn': claimed again, with a WARNING that names the scope, key and
-- when the earlier claim expired
SET idempotency.late_duplicate_policy = 'warn';
\set VERBOSITY terse
SELECT idem_claim('k2', 'late') AS warn_policy;
\set VERBOSITY default
DO $$
DECLARE
    d text;
BEGIN
    SET LOCAL client_min_messages = error;
    SET LOCAL idempotency.late_duplicate_policy = 'error';
    PERFORM idem_claim('k3', 'late');
EXCEPTION WHEN SQLSTATE 'IK008' THEN
    GET STACKED DIAGNOSTICS d = PG_EXCEPTION_DETAIL;
    RAISE NOTICE 'detail names scope and key: %, says when it expired: %',
        d LIKE 'Scope "late", key "k3" was probably claimed before; that claim expired between % and %.',
        (regexp_match(d, 'between (.*) and (.*)\.$'))[2]::timestamptz
            >= (SELECT claimed_at FROM late_t) + interval '1 second';
END $$;

-- policy 'error': refused with IK008, nothing claimed
SET idempotency.late_duplicate_policy = 'error';
SELECT pg_temp.try($$SELECT idem_claim('k3', 'late')$$);
SELECT idem_claimed('k3', 'late') AS not_claimed,
       (SELECT count(*) FROM idempotency.claims WHERE key = 'k3') AS rows;
SELECT pg_temp.try($$SELECT count(*) FROM idem_claim_many(ARRAY['fresh-a', 'k4'], 'late')$$);
SELECT count(*) AS batch_left_nothing FROM idempotency.claims WHERE key IN ('fresh-a', 'k4');
-- a refusal caught in a savepoint leaves the transaction going
BEGIN;
SAVEPOINT s;
SELECT pg_temp.try($$SELECT idem_claim('k4', 'late')$$);
ROLLBACK TO s;
SELECT idem_claim('fresh-b', 'late') AS fresh_key_claimed;
COMMIT;
-- a key claimed again (k1, k2) is a plain duplicate, not refused
SELECT idem_claim('k1', 'late') AS k1_duplicate, idem_claim('k2', 'late') AS k2_duplicate;
-- fresh keys are claimed
SELECT count(*) AS fresh_claimed FROM generate_series(1, 200) i WHERE idem_claim('fresh' || i, 'late');
-- the inbox and requests claim through the same protocol: their scopes are
-- their own, so these keys are new there
SELECT idem_claim('k5', 'late2') AS other_scope_claimed;

-- the window: a summary is tested until its last drop is older than the
-- window, then claims pass silently, and maintenance deletes it
SET idempotency.late_duplicate_window = '1h';
SELECT idem_claimed_before('k5', 'late') IS NOT NULL AS within_window;
SELECT pg_sleep_until((SELECT max(last_drop) FROM idempotency.late_summaries) + interval '2 seconds');
SET idempotency.late_duplicate_window = '2s';
SELECT idem_claimed_before('k5', 'late') AS past_window;
SELECT idem_claim('k5', 'late') AS claimed_silently;
SELECT action, object FROM idem_maintain() WHERE action = 'expire';
SELECT count(*) AS summaries_left FROM idempotency.late_summaries;

-- window 0: nothing kept, nothing checked
SET idempotency.late_duplicate_window = 0;
SET idempotency.late_duplicate_policy = 'error';
TRUNCATE late_t;
SELECT idem_claim('off-' || i, 'late') FROM generate_series(1, 3) i;
INSERT INTO late_t SELECT idem_claimed('off-1', 'late');
SELECT claimed_at AS t0 FROM late_t \gset
CALL pg_temp.drop_past(:'t0');
SELECT count(*) AS summaries_when_off FROM idempotency.late_summaries;
SELECT idem_claim('off-1', 'late') AS claimed_when_off;
RESET idempotency.late_duplicate_window;
RESET idempotency.late_duplicate_policy;

-- bad input and settings
SELECT pg_temp.try($$SELECT idem_claimed_before(NULL, 'late')$$);
SELECT pg_temp.try($$SELECT idem_claimed_before('k', NULL)$$);
SELECT pg_temp.try($$SELECT idem_claimed_before('', 'late')$$);
SELECT pg_temp.try($$SELECT idem_claimed_before('k', '')$$);
SELECT pg_temp.try($$SELECT idem_claimed_before(repeat('x', 3000), 'late')$$);
SELECT pg_temp.try($$SELECT idem_claimed_before('k', repeat('s', 64))$$);
SELECT pg_temp.try($$SELECT idem_claimed_before(42, 'late')$$);
SELECT pg_temp.try($$SET idempotency.late_duplicate_policy = 'sometimes'$$);
SELECT pg_temp.try($$SET idempotency.late_duplicate_window = '-1s'$$);
SELECT pg_temp.try($$SET idempotency.late_duplicate_window = 'forever'$$);
-- privileges: a handler of the scope may ask, nobody else; only a superuser
-- sets the window (it decides what maintenance keeps)
CREATE ROLE idem_late_app;
CREATE ROLE idem_late_nobody;
SELECT idem_grant('idem_late_app', 'handler', scopes => ARRAY['late']);
SET ROLE idem_late_nobody;
SELECT pg_temp.try($$SELECT idem_claimed_before('k1', 'late')$$);
SELECT pg_temp.try($$SET idempotency.late_duplicate_window = '1h'$$);
SELECT pg_temp.try($$SELECT count(*) FROM idempotency.late_summaries$$);
RESET ROLE;
SET ROLE idem_late_app;
SELECT pg_temp.try($$SELECT idem_claimed_before('k1', 'late') IS NULL$$);
SELECT pg_temp.try($$SELECT idem_claimed_before('k1', 'other')$$);
SET idempotency.late_duplicate_policy = 'warn';
RESET ROLE;
SELECT idem_revoke('idem_late_app', 'handler');
DROP ROLE idem_late_app;
DROP ROLE idem_late_nobody;

-- no claim was doubled
SELECT count(*) AS doubled FROM (
    SELECT scope, key FROM idempotency.claims GROUP BY 1, 2 HAVING count(*) > 1) d;

DROP TABLE late_t;
SET client_min_messages = warning;
DROP EXTENSION idempotency CASCADE;
