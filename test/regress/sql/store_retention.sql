-- Retention per store: idem_configure_store(store, retention), what is in
-- force, and the drops of the outbox's, the inbox's and the requests'
-- partitions by each store's own retention, across changes and a lagging
-- maintenance.  Time moves with idempotency.debug_clock_offset; every
-- outcome checked is certain whatever the time of day the test runs at
-- (a partition's upper bound is at most one partition_interval after the
-- rows it holds).
CREATE EXTENSION idempotency;

\getenv abs_srcdir PG_ABS_SRCDIR
\set try_sql :abs_srcdir '/include/try.sql'
\i :try_sql

SELECT idem_configure(retention => '2 days', partition_interval => '1 day', premake => 1);

-- 1. Defaults: every store follows idem_configure's retention
SELECT * FROM idempotency.current_store_settings();
SELECT count(*) AS rows FROM idempotency.store_settings;

-- 2. Bad input: nothing is stored
SELECT pg_temp.try($$SELECT idem_configure_store(NULL, '3 days')$$);
SELECT pg_temp.try($$SELECT idem_configure_store(NULL, NULL)$$);
SELECT pg_temp.try($$SELECT idem_configure_store('claims', '3 days')$$);
SELECT pg_temp.try($$SELECT idem_configure_store('Outbox', '3 days')$$);
SELECT pg_temp.try($$SELECT idem_configure_store('', '3 days')$$);
SELECT pg_temp.try($$SELECT idem_configure_store('outbox', '-1 day')$$);
SELECT pg_temp.try($$SELECT idem_configure_store('outbox', '0')$$);
SELECT pg_temp.try($$SELECT idem_configure_store('inbox', '23 hours 59 minutes')$$);
SELECT pg_temp.try($$SELECT idem_configure_store('requests', '200 years')$$);
SELECT pg_temp.try($$SELECT idem_configure_store('requests', '1000000 years')$$);
-- at most 400 live partitions: 1 day x 398 + current + premake 1 is the most
SELECT pg_temp.try($$SELECT idem_configure_store('requests', '399 days')$$);
SELECT count(*) AS rows FROM idempotency.store_settings;
-- the hints say what would be accepted
\set VERBOSITY verbose
SELECT idem_configure_store('inbox', '12 hours');
SELECT idem_configure_store('requests', '399 days');
\set VERBOSITY default
-- the bounds themselves are accepted, then removed again; but the requests'
-- dedup claims follow their store, in a retention class of their own beside
-- the default one, and all classes share the claims' bound of 400 live
-- partitions: 398 days is refused on the claims' side (391 is the most, beside the default and the inbox's)
SELECT idem_configure_store('inbox', '1 day');
SELECT idem_configure_store('requests', '398 days');
SELECT idem_configure_store('requests', '391 days');
SELECT * FROM idempotency.current_store_settings();
SELECT idem_configure_store('inbox', NULL);
SELECT idem_configure_store('requests', NULL);
-- removing what is not there is no error
SELECT idem_configure_store('requests', NULL);
SELECT count(*) AS rows FROM idempotency.store_settings;

-- 3. Who may: the unlimited operator capability, as for idem_configure
CREATE ROLE idem_store_ret_role;
SET ROLE idem_store_ret_role;
SELECT pg_temp.try($$SELECT idem_configure_store('outbox', '3 days')$$) AS no_grant;
-- an unknown store is refused before the capability is asked
SELECT pg_temp.try($$SELECT idem_configure_store('nope', '3 days')$$) AS no_grant_bad_store;
RESET ROLE;
SELECT idem_grant('idem_store_ret_role', 'operator', scopes => ARRAY['x']);
SET ROLE idem_store_ret_role;
SELECT pg_temp.try($$SELECT idem_configure_store('outbox', '3 days')$$) AS limited_operator;
RESET ROLE;
SELECT idem_grant('idem_store_ret_role', 'handler');
SELECT idem_grant('idem_store_ret_role', 'operator');
SET ROLE idem_store_ret_role;
SELECT pg_temp.try($$SELECT idem_configure_store('outbox', '3 days')$$) AS operator;
SELECT pg_temp.try($$SELECT idem_configure_store('outbox', NULL)$$) AS operator_removes;
RESET ROLE;
SELECT count(*) AS rows FROM idempotency.store_settings;
SELECT idem_revoke('idem_store_ret_role');
DROP ROLE idem_store_ret_role;

-- 4. Settings and overrides stay consistent: idem_configure refuses a
-- partition_interval, premake or retention that a store's own retention
-- cannot follow, and names the store
SELECT idem_configure_store('outbox', '5 days');
SELECT idem_configure_store('requests', '3 days');
SELECT pg_temp.try($$SELECT idem_configure(retention => '4 days', partition_interval => '4 days')$$);
SELECT pg_temp.try($$SELECT idem_configure(partition_interval => '10 minutes')$$);
SELECT pg_temp.try($$SELECT idem_configure(premake => 399)$$);
\set VERBOSITY verbose
SELECT idem_configure(retention => '4 days', partition_interval => '4 days');
SELECT idem_configure(partition_interval => '10 minutes');
\set VERBOSITY default
SELECT * FROM idempotency.current_settings();
-- idem_configure's retention moves only the stores without their own
SELECT idem_configure(retention => '3 days');
SELECT * FROM idempotency.current_store_settings();
SELECT idem_configure(retention => '2 days');
SELECT * FROM idempotency.current_store_settings();
SELECT store, retention FROM idempotency.store_settings ORDER BY store;
-- the table is a configuration table: pg_dump keeps its rows
SELECT c.relname FROM pg_extension e, unnest(e.extconfig) x JOIN pg_class c ON c.oid = x
 WHERE e.extname = 'idempotency' AND c.relname = 'store_settings';

-- 5. Drops by each store's retention: outbox 5 days, requests 3 days,
-- inbox 2 days (idem_configure's).  pg_temp.put(tag) writes a row of each
-- store and settles it (acked, done, completed), so that nothing pins.
CREATE FUNCTION pg_temp.put(tag text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM idem_outbox_emit('ret', tag, 'e', jsonb_build_object('tag', tag));
    PERFORM idem_inbox_receive('ret', tag, '{}');
    PERFORM idem_request_begin(tag, 'ret');
    PERFORM idem_request_complete(tag, 'ret', '{}', 1, 200);
END
$$;
CREATE FUNCTION pg_temp.settle() RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT * FROM idem_outbox_claim(1000) LOOP
        PERFORM idem_outbox_ack(ARRAY[r.id], r.lease_token);
    END LOOP;
    FOR r IN SELECT * FROM idem_inbox_claim(1000) LOOP
        PERFORM idem_inbox_done(ARRAY[r.id], r.lease_token);
    END LOOP;
END
$$;
-- the rows of each store, by tag
CREATE VIEW pg_temp.present AS
SELECT 'outbox' AS store, string_agg(payload->>'tag', ',' ORDER BY payload->>'tag') AS tags
  FROM idempotency.outbox_events WHERE aggregate_type = 'ret'
UNION ALL
SELECT 'inbox', string_agg(message_id, ',' ORDER BY message_id)
  FROM idempotency.inbox_messages WHERE source = 'ret'
UNION ALL
SELECT 'requests', string_agg(key, ',' ORDER BY key)
  FROM idempotency.requests WHERE scope = 'ret';
-- a round, and the partitions it kept past their retention or could not
-- drop, by store (what it dropped shows in pg_temp.present)
CREATE FUNCTION pg_temp.maintain() RETURNS text LANGUAGE sql AS $$
    WITH m AS (SELECT * FROM idem_maintain())
    SELECT coalesce(string_agg(DISTINCT a.action || ' ' || split_part(a.object, '_', 1), ', '),
                    'nothing kept')
      FROM m a
     WHERE a.action LIKE 'keep%' OR a.action LIKE 'skip%'
$$;

-- day 0: rows a
SELECT pg_temp.maintain();
SELECT pg_temp.put('a');
SELECT pg_temp.settle();
-- day 1.5: rows b; nothing is old enough to go
SET idempotency.debug_clock_offset = 129600;
SELECT pg_temp.maintain();
SELECT pg_temp.put('b');
SELECT pg_temp.settle();
SELECT * FROM pg_temp.present;

-- day 2.4: the inbox's retention goes up to 5 days (a stays: its rows are
-- 2.4 days old, past the 2 days it had), the outbox's down to 1 day (a,
-- at least 1.4 days past its partition's end, goes at once; b, 0.9 days
-- old, stays)
SET idempotency.debug_clock_offset = 207360;
SELECT idem_configure_store('inbox', '5 days');
SELECT * FROM pg_temp.present;
SELECT idem_configure_store('outbox', '1 day');
SELECT * FROM pg_temp.present;
SELECT * FROM idempotency.current_store_settings();

-- maintenance lags from day 2.4 to day 4.2; a request c comes at day 3.9
-- meanwhile (into whichever partition the writers know)
SET idempotency.debug_clock_offset = 336960;
SELECT status FROM idem_request_begin('c', 'ret');
SELECT count(*) AS completed FROM idem_request_complete('c', 'ret', '{}', 1, 200);
-- day 4.2: requests a (4.2 days, at least 1.2 past its partition's end
-- over 3 days) goes; b (2.7 days) and c stay; outbox b (2.7 days) goes;
-- the inbox keeps a and b (5 days)
SET idempotency.debug_clock_offset = 362880;
SELECT pg_temp.maintain();
SELECT * FROM pg_temp.present;
-- a second round has nothing more to drop
SELECT pg_temp.maintain();

-- day 5.6: the inbox follows idem_configure's 2 days again: a and b (at
-- least 3.1 days past the end of their partitions) go at once; so does
-- requests b in the same round (its partition ended at least 3.1 days
-- ago, over 3 days); c (1.7 days) stays
SET idempotency.debug_clock_offset = 483840;
SELECT idem_configure_store('inbox', NULL);
SELECT * FROM pg_temp.present;
SELECT * FROM idempotency.current_store_settings();

-- 6. Pins still hold under a store's own retention: undelivered events
-- (day 5.6) keep their partition past the outbox's 1 day, until acked;
-- the aggregate's seq carries on across the drop
SELECT seq FROM idem_outbox_emit('ret', 'p', 'e', '{"tag": "p"}');
SELECT seq FROM idem_outbox_emit('ret', 'p', 'e', '{"tag": "p"}');
-- day 8: the events' partition ended at least 1.4 days ago, over 1 day;
-- request c's at least 0.1 days past its 3 days
SET idempotency.debug_clock_offset = 691200;
SELECT pg_temp.maintain();
SELECT * FROM pg_temp.present;
SELECT pg_temp.settle();
SELECT pg_temp.maintain();
SELECT * FROM pg_temp.present;
SELECT seq FROM idem_outbox_emit('ret', 'p', 'e', '{"tag": "p"}');

-- 7. A store's retention change in a transaction that is rolled back
-- changes nothing
BEGIN;
SELECT idem_configure_store('outbox', '10 days');
SELECT * FROM idempotency.current_store_settings() WHERE store = 'outbox';
ROLLBACK;
SELECT * FROM idempotency.current_store_settings() WHERE store = 'outbox';
-- in a read-only transaction: refused
BEGIN READ ONLY;
SELECT pg_temp.try($$SELECT idem_configure_store('outbox', '10 days')$$);
ROLLBACK;

RESET idempotency.debug_clock_offset;
SET client_min_messages = warning;
DROP EXTENSION idempotency CASCADE;
