-- Replay tests of handlers (SPEC section 8): idem_check_replay catches a
-- naive INSERT handler and an unguarded last-write-wins upsert, passes the
-- same handlers behind idem_claim and idem_guard_version, leaves the
-- database as it was, reproduces a run from its seed; bad input;
-- idem_is_replay_safe as a pgTAP line; and puts back what a rollback does
-- not undo (session advisory locks, sequences, prepared statements).  That
-- a replay leaves the counters as they were is in test/tap/080_stats.pl.
CREATE EXTENSION idempotency;

\getenv abs_srcdir PG_ABS_SRCDIR
\set try_sql :abs_srcdir '/include/try.sql'
\i :try_sql

-- the events: 8 payments to 3 accounts, and 6 versioned updates of 2 rows
CREATE TEMP TABLE ev AS
SELECT ARRAY(SELECT jsonb_build_object('id', 'p' || g, 'account', 'a' || (g % 3), 'amount', g)
               FROM generate_series(1, 8) g) AS payments,
       ARRAY(SELECT jsonb_build_object('id', g % 2, 'version', g, 'balance', g * 10)
               FROM generate_series(1, 6) g) AS versions;

-- 1. a naive handler: every delivery inserts; redeliveries double effects
CREATE TABLE ledger (payment text, account text, amount int);
CREATE FUNCTION naive(e jsonb) RETURNS void LANGUAGE sql AS $$
    INSERT INTO ledger VALUES (e->>'id', e->>'account', (e->>'amount')::int)
$$;
SELECT count(*) FILTER (WHERE NOT ok) > 10 AS most_runs_fail
  FROM idem_check_replay('naive(jsonb)', (SELECT payments FROM ev),
                         'SELECT account, sum(amount) FROM ledger GROUP BY account');
-- what a failed run says (runs are reproducible: seed 0 gives these)
SELECT run, deliveries, ok, difference
  FROM idem_check_replay('naive(jsonb)', (SELECT payments FROM ev),
                         'SELECT account, sum(amount) FROM ledger GROUP BY account', runs => 3);
-- the database is as it was
SELECT count(*) AS ledger_rows_left FROM ledger;

-- the same handler behind idem_claim passes every run
CREATE FUNCTION claimed(e jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF idem_claim(e->>'id', 'replay-test') THEN
        INSERT INTO ledger VALUES (e->>'id', e->>'account', (e->>'amount')::int);
    END IF;
END $$;
SELECT count(*) AS runs, count(*) FILTER (WHERE ok) AS ok_runs, sum(deliveries) > 20 * 8 AS redelivered
  FROM idem_check_replay('claimed(jsonb)', (SELECT payments FROM ev),
                         'SELECT account, sum(amount) FROM ledger GROUP BY account');
SELECT count(*) AS claims_left FROM idempotency.claims WHERE scope = 'replay-test';

-- 2. last-write-wins of versioned events: reordering goes backwards ...
CREATE TABLE acct (id int PRIMARY KEY, version bigint NOT NULL, balance int);
CREATE FUNCTION lww(e jsonb) RETURNS void LANGUAGE sql AS $$
    INSERT INTO acct VALUES ((e->>'id')::int, (e->>'version')::int, (e->>'balance')::int)
    ON CONFLICT (id) DO UPDATE SET version = EXCLUDED.version, balance = EXCLUDED.balance
$$;
SELECT count(*) FILTER (WHERE NOT ok) > 0 AS caught
  FROM idem_check_replay('lww(jsonb)', (SELECT versions FROM ev), 'SELECT * FROM acct');
-- ... and passes once the version guard is installed
SELECT idem_guard_version('acct');
SELECT count(*) FILTER (WHERE NOT ok) AS failed_runs
  FROM idem_check_replay('lww(jsonb)', (SELECT versions FROM ev), 'SELECT * FROM acct');
SELECT count(*) AS acct_rows_left FROM acct;

-- 3. the seed reproduces the runs; another seed gives others
SELECT (SELECT array_agg(deliveries ORDER BY run) FROM idem_check_replay('naive(jsonb)', payments,
            'SELECT * FROM ledger', runs => 5, seed => 7))
     = (SELECT array_agg(deliveries ORDER BY run) FROM idem_check_replay('naive(jsonb)', payments,
            'SELECT * FROM ledger', runs => 5, seed => 7)) AS same_seed_same_runs,
       (SELECT array_agg(deliveries ORDER BY run) FROM idem_check_replay('naive(jsonb)', payments,
            'SELECT * FROM ledger', runs => 5, seed => 7))
    <> (SELECT array_agg(deliveries ORDER BY run) FROM idem_check_replay('naive(jsonb)', payments,
            'SELECT * FROM ledger', runs => 5, seed => 8)) AS other_seed_other_runs
  FROM ev;
-- with neither duplicates nor crashes, only the order changes: every run
-- delivers each event once
SELECT bool_and(deliveries = 8) AS once_each, bool_and(ok) AS naive_passes_without_redelivery
  FROM idem_check_replay('naive(jsonb)', (SELECT payments FROM ev),
                         'SELECT account, sum(amount) FROM ledger GROUP BY account',
                         duplicate_rate => 0, crash_rate => 0);

-- 4. a handler that accepts p3 only as the third payment: a run where p3
-- can no longer succeed (it fails 5 times) fails, naming the event and its
-- error
CREATE FUNCTION picky(e jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF e->>'id' = 'p3' AND (SELECT count(*) FROM ledger) <> 2 THEN
        RAISE EXCEPTION 'p3 must come third';
    END IF;
    INSERT INTO ledger VALUES (e->>'id', e->>'account', (e->>'amount')::int);
END $$;
SELECT run, deliveries, ok, difference FROM idem_check_replay('picky(jsonb)', (SELECT payments FROM ev),
       'SELECT * FROM ledger', runs => 4, duplicate_rate => 0, crash_rate => 0, seed => 1)
 ORDER BY run;
-- a handler that fails in the in-order run: an error, with the event
SELECT pg_temp.try($$SELECT count(*) FROM idem_check_replay('picky(jsonb)',
       ARRAY['{"id": "p1"}', '{"id": "p3"}']::jsonb[], 'SELECT 1')$$);
-- a state_query that fails
SELECT pg_temp.try($$SELECT count(*) FROM idem_check_replay('naive(jsonb)',
       ARRAY['{"id": "p1"}']::jsonb[], 'SELECT * FROM no_such_table')$$);

-- 5. bad input
SELECT pg_temp.try($$SELECT count(*) FROM idem_check_replay(NULL, ARRAY['{}']::jsonb[], 'SELECT 1')$$);
SELECT pg_temp.try($$SELECT count(*) FROM idem_check_replay('naive(jsonb)', NULL, 'SELECT 1')$$);
SELECT pg_temp.try($$SELECT count(*) FROM idem_check_replay('naive(jsonb)', '{}', 'SELECT 1')$$);
SELECT pg_temp.try($$SELECT count(*) FROM idem_check_replay('naive(jsonb)', ARRAY[NULL]::jsonb[], 'SELECT 1')$$);
SELECT pg_temp.try($$SELECT count(*) FROM idem_check_replay('naive(jsonb)', ARRAY['{}']::jsonb[], ' ')$$);
SELECT pg_temp.try($$SELECT count(*) FROM idem_check_replay('naive(jsonb)', ARRAY['{}']::jsonb[], 'SELECT 1', runs => 0)$$);
SELECT pg_temp.try($$SELECT count(*) FROM idem_check_replay('naive(jsonb)', ARRAY['{}']::jsonb[], 'SELECT 1', crash_rate => 1)$$);
SELECT pg_temp.try($$SELECT count(*) FROM idem_check_replay('naive(jsonb)', ARRAY['{}']::jsonb[], 'SELECT 1', duplicate_rate => -0.1)$$);
SELECT pg_temp.try($$SELECT count(*) FROM idem_check_replay('length(text)', ARRAY['{}']::jsonb[], 'SELECT 1')$$);
SELECT pg_temp.try($$SELECT count(*) FROM idem_check_replay('no_such(jsonb)', ARRAY['{}']::jsonb[], 'SELECT 1')$$);
SELECT count(*) AS ledger_rows_left FROM ledger;

-- 6. idem_is_replay_safe needs pgTAP; with it, a test line
SELECT pg_temp.try($$SELECT idem_is_replay_safe('claimed(jsonb)', ARRAY['{}']::jsonb[], 'SELECT 1')$$);
CREATE EXTENSION pgtap;
SELECT plan(2);
SELECT idem_is_replay_safe('claimed(jsonb)', (SELECT payments FROM ev),
                           'SELECT account, sum(amount) FROM ledger GROUP BY account');
SELECT regexp_replace(idem_is_replay_safe('naive(jsonb)', (SELECT payments FROM ev),
                      'SELECT account, sum(amount) FROM ledger GROUP BY account', 'naive is replay-safe'),
                      'after [0-9]+ deliveries: .*', 'after N deliveries: ...') AS tap_line;
SELECT * FROM finish();
DROP EXTENSION pgtap;

-- 7. what a rollback does not undo is put back after every run: the
-- session advisory locks the handler took (as often as it took them), the
-- sequences it advanced (each run starts where the call did, so each run
-- hands out the same ids), the statements it prepared; the caller's own
-- lock and statement stay
CREATE SEQUENCE replay_ids;
CREATE SEQUENCE replay_fresh;
SELECT nextval('replay_ids') AS ids_before;
CREATE FUNCTION leaky(e jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_lock(4711), pg_advisory_lock(4711), pg_advisory_lock_shared(1, -2),
            pg_advisory_xact_lock(4712), nextval('replay_fresh');
    IF idem_claim(e->>'id', 'replay-leaky') THEN
        INSERT INTO ledger VALUES (e->>'id', 'x', nextval('replay_ids'));
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_prepared_statements WHERE name = 'replay_leak') THEN
        EXECUTE 'PREPARE replay_leak AS SELECT 1';
    END IF;
END $$;
SELECT pg_advisory_lock(99) IS NOT NULL AS callers_lock;
PREPARE callers_statement AS SELECT 2;
-- (a run delivers fewer than 50 times: its ids stay below 100 only if
-- every run starts from where the call did)
SELECT count(*) AS runs, count(*) FILTER (WHERE ok) AS ok_runs
  FROM idem_check_replay('leaky(jsonb)', (SELECT payments FROM ev),
                         'SELECT count(*) FROM ledger WHERE amount < 100');
SELECT l.objid, l.objsubid, l.mode FROM pg_locks l
 WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() ORDER BY 1;
SELECT last_value, is_called FROM replay_ids;
SELECT last_value, is_called FROM replay_fresh;
SELECT name FROM pg_prepared_statements ORDER BY name;
-- and after a call that fails (in the reference run)
SELECT pg_temp.try($$SELECT count(*) FROM idem_check_replay('leaky(jsonb)',
       ARRAY['{"id": "p1"}', '{"id": null}']::jsonb[], 'SELECT 1')$$);
SELECT count(*) AS advisory_locks FROM pg_locks l
 WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid();
SELECT last_value, is_called FROM replay_fresh;
SELECT name FROM pg_prepared_statements ORDER BY name;
SELECT pg_advisory_unlock(99);
DEALLOCATE callers_statement;

SET client_min_messages = warning;
DROP TABLE ledger, acct;
DROP SEQUENCE replay_ids, replay_fresh;
DROP FUNCTION naive(jsonb), claimed(jsonb), lww(jsonb), picky(jsonb), leaky(jsonb);
DROP EXTENSION idempotency CASCADE;
