-- Claims: every outcome and error of SPEC section 1.
CREATE EXTENSION idempotency;

\getenv abs_srcdir PG_ABS_SRCDIR
\set try_sql :abs_srcdir '/include/try.sql'
\i :try_sql

-- first and second claim
SELECT idem_claim('order-1');
SELECT idem_claim('order-1');
SELECT idem_claimed('order-1') IS NOT NULL AS claimed;
SELECT idem_claimed('order-2') IS NULL AS not_claimed;

-- scopes are independent namespaces
SELECT idem_claim('order-1', 'billing');
SELECT idem_claim('order-1', 'billing');
SELECT idem_claim('order-1', 'shipping');
SELECT scope, key FROM idempotency.claims ORDER BY scope, key;

-- the same transaction twice: the second is a duplicate
BEGIN;
SELECT idem_claim('tx-twice');
SELECT idem_claim('tx-twice');
SELECT idem_claimed('tx-twice') IS NOT NULL AS visible_to_self;
COMMIT;
SELECT idem_claim('tx-twice');

-- rollback: the claim vanishes with the effect
BEGIN;
SELECT idem_claim('rolled-back');
ROLLBACK;
SELECT idem_claimed('rolled-back') IS NULL AS gone;
SELECT idem_claim('rolled-back');

-- rollback to savepoint
BEGIN;
SAVEPOINT s1;
SELECT idem_claim('in-savepoint');
ROLLBACK TO SAVEPOINT s1;
SELECT idem_claim('in-savepoint');
SAVEPOINT s2;
SELECT idem_claim('kept-savepoint');
RELEASE SAVEPOINT s2;
COMMIT;
SELECT idem_claim('in-savepoint'), idem_claim('kept-savepoint');

-- a claim inside a failed subtransaction (plpgsql exception block) is undone
DO $$
BEGIN
    BEGIN
        PERFORM idem_claim('failed-block');
        RAISE EXCEPTION 'handler failed';
    EXCEPTION WHEN others THEN
        NULL;
    END;
END $$;
SELECT idem_claimed('failed-block') IS NULL AS gone;

-- payload fingerprints
SELECT idem_claim('pay-1', 'default', '{"amount": 10, "currency": "EUR"}');
SELECT idem_claim('pay-1', 'default', '{"currency": "EUR", "amount": 10}');   -- reordered keys
SELECT idem_claim('pay-1', 'default', '{ "currency":"EUR",  "amount":10.0 }'); -- same value
SELECT pg_temp.try($$SELECT idem_claim('pay-1', 'default', '{"amount": 11, "currency": "EUR"}')$$);
SELECT idem_claim('pay-1');                       -- no payload: ordinary duplicate
SELECT idem_claim('pay-2');
SELECT idem_claim('pay-2', 'default', '{"a": 1}');  -- stored without payload: duplicate
SELECT idem_claim('pay-3', 'default', 'null'::jsonb);
SELECT pg_temp.try($$SELECT idem_claim('pay-3', 'default', '[]')$$);
-- different payload in the same transaction
BEGIN;
SELECT idem_claim('pay-4', 'default', '[1, 2]');
SELECT pg_temp.try($$SELECT idem_claim('pay-4', 'default', '[2, 1]')$$);
COMMIT;
-- the mismatch error left nothing behind
SELECT count(*) FROM idempotency.claims WHERE key LIKE 'pay-%';
-- message and detail as users see them
\set VERBOSITY default
SELECT idem_claim('pay-1', 'default', '{"amount": 12}');

-- keys: NULL, empty, 1024 bytes, the 2000-byte limit, 100 kB
SELECT pg_temp.try($$SELECT idem_claim(NULL)$$);
SELECT pg_temp.try($$SELECT idem_claim('')$$);
SELECT idem_claim(repeat('k', 1024));
SELECT idem_claim(repeat('k', 1024));
SELECT idem_claim(repeat('é', 1000));           -- 2000 bytes
SELECT pg_temp.try($$SELECT idem_claim(repeat('k', 2001))$$);
SELECT pg_temp.try($$SELECT idem_claim(repeat('k', 100000))$$);
SELECT idem_claim(repeat('k', 100000));
SELECT idem_claim(E'tab\there, newline\nthere, quote '' and "');
SELECT idem_claim(E'tab\there, newline\nthere, quote '' and "');

-- scopes: NULL, empty, 63 bytes, over-long
SELECT pg_temp.try($$SELECT idem_claim('k', NULL)$$);
SELECT pg_temp.try($$SELECT idem_claim('k', '')$$);
SELECT idem_claim('k', repeat('s', 63));
SELECT pg_temp.try($$SELECT idem_claim('k', repeat('s', 64))$$);
SELECT pg_temp.try($$SELECT idem_claimed('k', NULL)$$);
SELECT pg_temp.try($$SELECT idem_release('', 'default')$$);
-- wrong type: no implicit cast from integer[] or json to the arguments
SELECT pg_temp.try($$SELECT idem_claim(ARRAY[1])$$);
SELECT pg_temp.try($$SELECT idem_claim('k', 'default', 'not json')$$);

-- batches: repeats count once, input order, only new keys
SELECT * FROM idem_claim_many(ARRAY['b3', 'b1', 'b2', 'b1', 'b3']);
SELECT * FROM idem_claim_many(ARRAY['b2', 'b4', 'b0', 'b4']);
SELECT * FROM idem_claim_many(ARRAY[]::text[]);
SELECT * FROM idem_claim_many(ARRAY['b1', 'b5'], 'other');
SELECT pg_temp.try($$SELECT * FROM idem_claim_many(ARRAY['b6', NULL])$$);
SELECT pg_temp.try($$SELECT * FROM idem_claim_many(NULL)$$);
SELECT pg_temp.try($$SELECT * FROM idem_claim_many(ARRAY['b7', ''])$$);
SELECT pg_temp.try($$SELECT * FROM idem_claim_many(ARRAY[['b8'], ['b9']])$$);
SELECT pg_temp.try($$SELECT * FROM idem_claim_many(ARRAY['b10'], NULL)$$);
-- a rejected batch claimed nothing
SELECT idem_claimed('b6') IS NULL AND idem_claimed('b7') IS NULL AS nothing_claimed;
-- a batch rolled back
BEGIN;
SELECT * FROM idem_claim_many(ARRAY['b20', 'b21']);
ROLLBACK;
SELECT * FROM idem_claim_many(ARRAY['b21', 'b20']);
-- a large batch
SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'big-' || g FROM generate_series(1, 5000) g));
SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'big-' || g FROM generate_series(4001, 6000) g));

-- release: deliberate reprocessing
SELECT idem_release('order-1');
SELECT idem_release('order-1');
SELECT idem_claimed('order-1') IS NULL AS released;
SELECT idem_claim('order-1');
SELECT idem_release('never-claimed');
SELECT idem_release('order-1', 'billing'), idem_claimed('order-1', 'shipping') IS NOT NULL AS other_scope_kept;
-- claim and release in one transaction, and in one statement
BEGIN;
SELECT idem_claim('short-lived');
SELECT idem_release('short-lived');
SELECT idem_claim('short-lived');
ROLLBACK;
SELECT idem_claim('same-stmt'), idem_release('same-stmt'), idem_claim('same-stmt');

-- REPEATABLE READ: a claim committed after our snapshot is still a duplicate
-- (the concurrent case is in the isolation specs); own claims behave as usual
BEGIN ISOLATION LEVEL REPEATABLE READ;
SELECT idem_claim('rr-1');
SELECT idem_claim('rr-1');
COMMIT;

-- a read-only transaction may look claims up but not make or release them
BEGIN READ ONLY;
SELECT idem_claimed('order-1') IS NOT NULL AS found_read_only;
SELECT pg_temp.try($$SELECT idem_claim('read-only')$$);
SELECT pg_temp.try($$SELECT * FROM idem_claim_many(ARRAY['read-only'])$$);
SELECT pg_temp.try($$SELECT idem_release('order-1')$$);
COMMIT;

-- writing to idempotency.claims directly is refused
SELECT pg_temp.try($$INSERT INTO idempotency.claims VALUES ('default', 'direct', now(), NULL)$$);

-- capabilities: handler claims and looks up, operator releases (table
-- privileges play no part: test/regress/sql/capabilities.sql)
CREATE ROLE idem_app;
CREATE ROLE idem_nobody;
SELECT idem_grant('idem_app', 'handler');
SET ROLE idem_nobody;
SELECT pg_temp.try($$SELECT idem_claim('priv-1')$$);
SELECT pg_temp.try($$SELECT * FROM idem_claim_many(ARRAY['priv-1'])$$);
SELECT pg_temp.try($$SELECT idem_claimed('priv-1')$$);
SELECT pg_temp.try($$SELECT idem_release('order-1')$$);
SELECT pg_temp.try($$SELECT idem_configure(retention => '1 day')$$);
SELECT pg_temp.try($$SELECT * FROM idem_maintain()$$);
RESET ROLE;
SET ROLE idem_app;
SELECT idem_claim('priv-1');
SELECT idem_claim('priv-1');
SELECT idem_claimed('priv-1') IS NOT NULL AS found;
SELECT pg_temp.try($$SELECT idem_release('priv-1')$$);
RESET ROLE;
SELECT idem_grant('idem_app', 'operator');
SET ROLE idem_app;
SELECT idem_release('priv-1');
RESET ROLE;
SELECT idem_revoke('idem_app');
DROP ROLE idem_app;
DROP ROLE idem_nobody;

-- nothing was stored in the parent itself, and every key is unique
SELECT count(*) AS in_parent FROM ONLY idempotency.claims;
SELECT count(*) AS doubled FROM (
    SELECT scope, key FROM idempotency.claims GROUP BY 1, 2 HAVING count(*) > 1) d;

SET client_min_messages = warning;
DROP EXTENSION idempotency CASCADE;
