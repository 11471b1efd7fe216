-- pgTAP: outbox subscriptions (SPEC.md section 4, "Subscriptions"): the
-- functions and views, fan-out of one log to several subscriptions, each
-- with its own progress, leases, attempts, dead letters and dead policy,
-- start 'now' and 'earliest', aggregate types, unsubscribe, every bad
-- input and missing capability.  Runs in one transaction that rolls back;
-- each block uses aggregate types of its own.
\ir include/begin.sql
DO $$ BEGIN PERFORM idempotency.current_settings(); END $$;

SELECT plan(112);

-- every event a claim handed out, tagged with the claim's name
CREATE TEMP TABLE got (call text, id uuid, aggregate_type text, aggregate_id text, seq bigint,
                       attempts int, lease_token uuid);
-- pg_temp.claim(call, subscription, types, batch, lease): claim, remember, return how many
CREATE FUNCTION pg_temp.claim(text, text, text[], int DEFAULT 100, interval DEFAULT '30 seconds')
RETURNS int LANGUAGE sql AS $$
    WITH c AS (
        INSERT INTO pg_temp.got
        SELECT $1, c.id, c.aggregate_type, c.aggregate_id, c.seq, c.attempts, c.lease_token
          FROM idem_outbox_claim($4, $5, $3, $2) c
        RETURNING 1)
    SELECT count(*)::int FROM c
$$;
CREATE FUNCTION pg_temp.tok(text) RETURNS uuid LANGUAGE sql AS $$
    SELECT lease_token FROM pg_temp.got WHERE call = $1 LIMIT 1
$$;
CREATE FUNCTION pg_temp.ids(text) RETURNS uuid[] LANGUAGE sql AS $$
    SELECT coalesce(array_agg(id ORDER BY aggregate_id, seq), '{}') FROM pg_temp.got WHERE call = $1
$$;
CREATE FUNCTION pg_temp.runs(text) RETURNS text LANGUAGE sql AS $$
    SELECT coalesce(string_agg(aggregate_id || ':' || seq, ',' ORDER BY aggregate_id, seq), '')
      FROM pg_temp.got WHERE call = $1
$$;
CREATE FUNCTION pg_temp.ev(text, text, bigint) RETURNS uuid LANGUAGE sql AS $$
    SELECT id FROM idempotency.outbox_events
     WHERE aggregate_type = $1 AND aggregate_id = $2 AND seq = $3
$$;
CREATE FUNCTION pg_temp.emit(text, text, int) RETURNS void LANGUAGE sql AS $$
    SELECT count(*) FROM idem_outbox_emit_many($1, array_fill($2, ARRAY[$3]),
                                               array_fill('x'::text, ARRAY[$3]),
                                               array_fill('{}'::jsonb, ARRAY[$3]));
$$;
-- a subscription's rows of one kind
CREATE FUNCTION pg_temp.rows_of(text, text) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE n bigint;
BEGIN
    EXECUTE format('SELECT count(*) FROM idempotency.%I WHERE subscription = '
                   '(SELECT id FROM idempotency.outbox_subscriptions WHERE name = %L)', $2, $1)
    INTO n;
    RETURN n;
END $$;

CREATE ROLE obs_nobody;
GRANT USAGE ON SCHEMA idempotency TO obs_nobody;

-- 1. objects ------------------------------------------------------------------

SELECT has_function('idem_outbox_subscribe', ARRAY['text', 'text[]', 'text', 'text'],
                    'idem_outbox_subscribe(text, text[], text, text)');
SELECT function_returns('idem_outbox_subscribe', ARRAY['text', 'text[]', 'text', 'text'], 'boolean',
                        'idem_outbox_subscribe returns boolean');
SELECT is(pg_get_function_arguments('idem_outbox_subscribe(text, text[], text, text)'::regprocedure),
          'name text, aggregate_types text[] DEFAULT NULL::text[], start text DEFAULT ''now''::text, dead_policy text DEFAULT NULL::text',
          'idem_outbox_subscribe argument names and defaults');
SELECT has_function('idem_outbox_unsubscribe', ARRAY['text'], 'idem_outbox_unsubscribe(text)');
SELECT function_returns('idem_outbox_unsubscribe', ARRAY['text'], 'boolean', 'idem_outbox_unsubscribe returns boolean');
SELECT has_view('idempotency', 'outbox_subscriptions_status', 'view idempotency.outbox_subscriptions_status exists');
SELECT is(ARRAY(SELECT attname::text FROM pg_attribute
                 WHERE attrelid = 'idempotency.outbox_subscriptions_status'::regclass AND attnum > 0 ORDER BY attnum),
          ARRAY['name', 'aggregate_types', 'start', 'dead_policy', 'created_at', 'state', 'detached_at',
                'detach_reason', 'pending', 'dead', 'oldest_pending_age'],
          'idempotency.outbox_subscriptions_status columns');
SELECT is((SELECT state FROM idempotency.outbox_subscriptions_status WHERE name = 'default'), 'active',
          'the default subscription comes with the extension');
SELECT is(idempotency.outbox_partition_pinned_by('idempotency.settings'), NULL,
          'outbox_partition_pinned_by says nothing of a table that is no outbox partition');
SELECT throws_ok($$SET LOCAL ROLE obs_nobody; SELECT idempotency.outbox_detach_lagging('idempotency.settings', '1 s', now())$$,
                 '42501', NULL, 'outbox_detach_lagging: not for PUBLIC');
SELECT throws_ok($$SET LOCAL ROLE obs_nobody; SELECT idempotency.outbox_partition_pinned_by('idempotency.settings')$$,
                 '42501', NULL, 'outbox_partition_pinned_by: not for PUBLIC');
SELECT is((SELECT setting FROM pg_settings WHERE name = 'idempotency.outbox_max_lag'), '1209600',
          'outbox_max_lag defaults to 14 days');

-- 2. subscribe: outcomes and bad input ----------------------------------------

SELECT is(idem_outbox_subscribe('fan', ARRAY['fo']), true, 'subscribe: made');
SELECT is(idem_outbox_subscribe('fan', ARRAY['fo']), false, 'subscribe again as asked: nothing to do');
SELECT throws_ok($$SELECT idem_outbox_subscribe('fan', ARRAY['fo', 'other'])$$, '42710', NULL,
                 'subscribe again with other types: 42710');
SELECT throws_ok($$SELECT idem_outbox_subscribe('fan', ARRAY['fo'], 'now', 'skip')$$, '42710', NULL,
                 'subscribe again with another dead policy: 42710');
SELECT throws_ok($$SELECT idem_outbox_subscribe(NULL)$$, '22004', NULL, 'NULL name: 22004');
SELECT throws_ok($$SELECT idem_outbox_subscribe('')$$, '22023', NULL, 'empty name: 22023');
SELECT throws_ok($$SELECT idem_outbox_subscribe(repeat('n', 64))$$, '22001', NULL, 'name of 64 bytes: 22001');
SELECT lives_ok($$SELECT idem_outbox_subscribe(repeat('n', 63))$$, 'name of 63 bytes: made');
SELECT throws_ok($$SELECT idem_outbox_subscribe('x1', '{}')$$, '22023', NULL, 'empty aggregate_types: 22023');
SELECT throws_ok($$SELECT idem_outbox_subscribe('x1', ARRAY['a', NULL])$$, '22004', NULL, 'a NULL aggregate type: 22004');
SELECT throws_ok($$SELECT idem_outbox_subscribe('x1', ARRAY['a', ''])$$, '22023', NULL, 'an empty aggregate type: 22023');
SELECT throws_ok($$SELECT idem_outbox_subscribe('x1', ARRAY[repeat('t', 64)])$$, '22001', NULL, 'an aggregate type too long: 22001');
SELECT throws_ok($$SELECT idem_outbox_subscribe('x1', NULL, 'later')$$, '22023', NULL, 'start neither now nor earliest: 22023');
SELECT throws_ok($$SELECT idem_outbox_subscribe('x1', NULL, NULL)$$, '22004', NULL, 'NULL start: 22004');
SELECT throws_ok($$SELECT idem_outbox_subscribe('x1', NULL, 'now', 'retry')$$, '22023', NULL, 'dead_policy neither block nor skip: 22023');
SELECT throws_ok($$SELECT idem_outbox_subscribe('x1', '{{a},{b}}')$$, '22023', NULL, 'a two-dimensional aggregate_types: 22023');
SELECT is((SELECT count(*) FROM idempotency.outbox_subscriptions WHERE name = 'x1'), 0::bigint,
          'the refused subscribes made nothing');
SELECT is((SELECT aggregate_types FROM idempotency.outbox_subscriptions_status WHERE name = 'fan'), ARRAY['fo'],
          'the subscription is listed with its types');

-- 3. fan-out: one log, a position each ----------------------------------------

SELECT pg_temp.emit('fo', 'a1', 3);
SELECT is(pg_temp.claim('d1', 'default', ARRAY['fo']), 3, 'the default subscription gets the events');
SELECT is(pg_temp.claim('f1', 'fan', NULL), 3, 'so does fan (its own types, none named in the call)');
SELECT is(pg_temp.ids('f1'), pg_temp.ids('d1'), '... the same events, not copies');
SELECT is((SELECT count(*) FROM idempotency.outbox_events WHERE aggregate_type = 'fo'), 3::bigint,
          'three event rows in all');
SELECT is(idem_outbox_ack(pg_temp.ids('f1'), pg_temp.tok('d1'), 'fan'), 0,
          'an ack on fan with the default subscription''s lease token marks nothing');
SELECT is(idem_outbox_ack(pg_temp.ids('d1'), pg_temp.tok('d1')), 3, 'the default subscription acks its lease');
SELECT is(pg_temp.claim('f2', 'fan', NULL), 0, 'fan''s lease still holds its run');
SELECT is(idem_outbox_extend(pg_temp.tok('f1'), '1 minute', 'fan'), 3, 'fan extends its lease');
SELECT is(idem_outbox_extend(pg_temp.tok('f1'), '1 minute'), 0, '... which is no lease of the default subscription');
SELECT is(idem_outbox_ack(pg_temp.ids('f1'), pg_temp.tok('f1'), 'fan'), 3, 'fan acks its own');
SELECT pg_temp.emit('fo', 'a1', 1);
SELECT is(pg_temp.claim('f3', 'fan', NULL), 1, 'fan: the next event');
SELECT is(pg_temp.runs('f3'), 'a1:4', '... seq 4');
SELECT is(pg_temp.claim('d2', 'default', ARRAY['fo']), 1, 'default: the same next event');
SELECT is((SELECT pending FROM idempotency.outbox_backlog WHERE subscription = 'fan' AND aggregate_type = 'fo'), 1::bigint,
          'the backlog is per subscription');
SELECT is(pg_temp.claim('f4', 'fan', ARRAY['elsewhere']), 0, 'a call''s types narrow the subscription''s');
SELECT is(idem_outbox_ack(pg_temp.ids('f3'), pg_temp.tok('f3'), 'fan') + idem_outbox_ack(pg_temp.ids('d2'), pg_temp.tok('d2')), 2,
          'both ack');

-- 4. aggregate types: a subscription sees only its own ---------------------------

SELECT pg_temp.emit('fx', 'b1', 2);
SELECT is(pg_temp.claim('f5', 'fan', NULL), 0, 'fan does not see type fx');
SELECT is((SELECT count(*) FROM idempotency.outbox_backlog WHERE subscription = 'fan' AND aggregate_type = 'fx'), 0::bigint,
          '... nor does its backlog count it');
SELECT is(pg_temp.claim('d3', 'default', ARRAY['fx']), 2, 'the default subscription does');
SELECT is(idem_outbox_ack(pg_temp.ids('d3'), pg_temp.tok('d3')), 2, '... and acks');

-- 5. start 'now' and 'earliest' ----------------------------------------------------

SELECT pg_temp.emit('fs', 'c1', 2);
SELECT pg_temp.emit('fs', 'c2', 1);
SELECT is(idem_outbox_subscribe('late', ARRAY['fs'], 'now'), true, 'subscribe late from now');
SELECT is(idem_outbox_subscribe('early', ARRAY['fs'], 'earliest'), true, 'subscribe early from the earliest stored');
SELECT pg_temp.emit('fs', 'c1', 1);
SELECT pg_temp.emit('fs', 'c3', 1);
SELECT is(pg_temp.claim('l1', 'late', NULL), 2, 'now: what was emitted since');
SELECT is(pg_temp.runs('l1'), 'c1:3,c3:1', '... c1 from seq 3, and c3, new');
SELECT is(pg_temp.claim('e1', 'early', NULL), 5, 'earliest: everything stored');
SELECT is(pg_temp.runs('e1'), 'c1:1,c1:2,c1:3,c2:1,c3:1', '... from seq 1');
SELECT is((SELECT start FROM idempotency.outbox_subscriptions_status WHERE name = 'late'), 'now', 'start is listed');

-- 6. attempts, dead letters and dead policy are the subscription's ---------------

SELECT is(idem_outbox_subscribe('sk', ARRAY['fd'], 'now', 'skip'), true, 'a subscription with dead policy skip');
SELECT pg_temp.emit('fd', 'd1', 2);
SET LOCAL idempotency.outbox_max_attempts = 1;
SELECT is(pg_temp.claim('s1', 'sk', NULL, 1), 1, 'sk claims seq 1');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'bad', '0', %L, 'sk')$$, pg_temp.ev('fd', 'd1', 1), pg_temp.tok('s1')),
                'sk nacks it: dead after one attempt');
SELECT is((SELECT string_agg(subscription || ':' || seq, ',') FROM idempotency.outbox_dead WHERE aggregate_type = 'fd'), 'sk:1',
          'the dead letter is sk''s');
SELECT is(pg_temp.claim('s2', 'sk', NULL), 1, 'sk skips it (its own policy)');
SELECT is(pg_temp.runs('s2'), 'd1:2', '... seq 2 flows');
SELECT is(pg_temp.claim('d4', 'default', ARRAY['fd']), 2, 'the default subscription has attempts of its own: both events');
SELECT is((SELECT attempts FROM pg_temp.got WHERE call = 'd4' AND seq = 1), 1, '... first attempt');
SELECT is(idem_outbox_redrive(ARRAY[pg_temp.ev('fd', 'd1', 1)]), 0, 'redrive on the default subscription: not its dead letter');
SELECT is(idem_outbox_redrive(ARRAY[pg_temp.ev('fd', 'd1', 1)], 'sk'), 1, 'redrive on sk');
RESET idempotency.outbox_max_attempts;

-- 7. unknown subscription: 42704 for every relay and operator call ----------------

SELECT throws_ok($$SELECT * FROM idem_outbox_claim(10, '1 minute', NULL, 'nosuch')$$, '42704', NULL, 'claim: 42704');
SELECT throws_ok($$SELECT idem_outbox_ack('{}', NULL, 'nosuch')$$, '42704', NULL, 'ack: 42704');
SELECT throws_ok(format($$SELECT idem_outbox_nack(%L, 'x', NULL, NULL, 'nosuch')$$, pg_temp.ev('fd', 'd1', 1)),
                 '42704', NULL, 'nack: 42704');
SELECT throws_ok($$SELECT idem_outbox_extend(gen_random_uuid(), '1 minute', 'nosuch')$$, '42704', NULL, 'extend: 42704');
SELECT throws_ok($$SELECT idem_outbox_redrive('{}', 'nosuch')$$, '42704', NULL, 'redrive: 42704');
SELECT throws_ok($$SELECT idem_outbox_discard('{}', 'nosuch')$$, '42704', NULL, 'discard: 42704');
SELECT throws_ok($$SELECT * FROM idem_outbox_claim(10, '1 minute', NULL, NULL)$$, '22004', NULL, 'claim, NULL subscription: 22004');

-- 8. unsubscribe ----------------------------------------------------------------------

SELECT is(idem_outbox_unsubscribe('sk'), true, 'unsubscribe: dropped');
SELECT is(pg_temp.rows_of('sk', 'outbox_deliveries') + pg_temp.rows_of('sk', 'outbox_dead_letters')
          + pg_temp.rows_of('sk', 'outbox_cursor'), 0::bigint, '... with its rows');
SELECT is((SELECT count(*) FROM idempotency.outbox_dead_letters x
            WHERE NOT EXISTS (SELECT 1 FROM idempotency.outbox_subscriptions b WHERE b.id = x.subscription)),
          0::bigint, 'no dead letter is left without its subscription');
SELECT is(idem_outbox_unsubscribe('sk'), false, 'unsubscribe again: there is none');
SELECT throws_ok($$SELECT * FROM idem_outbox_claim(10, '1 minute', NULL, 'sk')$$, '42704', NULL, 'its relays'' calls: 42704');
SELECT throws_ok($$SELECT idem_outbox_unsubscribe(NULL)$$, '22004', NULL, 'unsubscribe NULL: 22004');
SELECT is(idem_outbox_subscribe('sk', ARRAY['fd'], 'now'), true, 'the name can be used again');
SELECT is(pg_temp.claim('s3', 'sk', NULL), 0, '... a new subscription, from now');
-- the default subscription too: its calls fail until it is made again, as id 0
-- (a dump leaves id 0 out, since CREATE EXTENSION makes it)
SELECT is(idem_outbox_unsubscribe('default'), true, 'unsubscribe default');
SELECT throws_ok($$SELECT * FROM idem_outbox_claim()$$, '42704', NULL, '... calls without a subscription fail');
SELECT is(idem_outbox_subscribe('default', NULL, 'now'), true, 'subscribe default again');
SELECT is((SELECT id FROM idempotency.outbox_subscriptions WHERE name = 'default'), 0, '... as id 0');
SELECT lives_ok($$SELECT * FROM idem_outbox_claim()$$, '... and the calls work again');

-- 9. capabilities: subscribing is an operator's -------------------------------------

CREATE ROLE obs_relay;
CREATE ROLE obs_ops;
SELECT idem_grant('obs_relay', 'relay');
SELECT idem_grant('obs_ops', 'operator', aggregate_types => ARRAY['fo', 'fs']);
CREATE FUNCTION public.obs_as(role text, sql text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE r text;
BEGIN
    EXECUTE format('SET LOCAL ROLE %I', role);
    EXECUTE sql INTO r;
    RESET ROLE;
    RETURN r;
EXCEPTION WHEN OTHERS THEN
    RESET ROLE;
    RAISE;
END $$;
SELECT throws_ok($$SELECT obs_as('obs_relay', 'SELECT idem_outbox_subscribe(''r1'')')$$, '42501', NULL,
                 'a relay may not subscribe');
SELECT throws_ok($$SELECT obs_as('obs_ops', 'SELECT idem_outbox_subscribe(''o1'')')$$, '42501', NULL,
                 'an operator limited to some types may not subscribe to all');
SELECT throws_ok($$SELECT obs_as('obs_ops', 'SELECT idem_outbox_subscribe(''o1'', ARRAY[''fo'', ''zz''])')$$, '42501', NULL,
                 '... nor to a type outside its limits');
SELECT is(obs_as('obs_ops', 'SELECT idem_outbox_subscribe(''o1'', ARRAY[''fo''])'), 'true',
          '... but to its own types');
SELECT throws_ok($$SELECT obs_as('obs_ops', 'SELECT idem_outbox_unsubscribe(''fan'') AND idem_outbox_unsubscribe(''default'')')$$, '42501', NULL,
                 'it may not unsubscribe one beyond its limits');
SELECT is(obs_as('obs_ops', 'SELECT idem_outbox_unsubscribe(''o1'')'), 'true', '... but its own');
SELECT is(obs_as('obs_relay', 'SELECT count(*) FROM idem_outbox_claim(10, ''1 minute'', NULL, ''fan'')'), '0',
          'a relay claims on a named subscription');
-- a relay limited to its own subscription cannot ack (silence) another's
CREATE ROLE obs_billing;
SELECT idem_grant('obs_billing', 'relay', subscriptions => ARRAY['billing*']);
SELECT idem_outbox_subscribe('billing', ARRAY['fo']);
SELECT pg_temp.emit('fo', 'z1', 1);
SELECT is(obs_as('obs_billing', 'SELECT count(*) FROM idem_outbox_claim(10, ''1 minute'', NULL, ''billing'')'), '1',
          'a relay limited to billing* claims on billing');
SELECT throws_ok($$SELECT obs_as('obs_billing', 'SELECT count(*) FROM idem_outbox_claim(10, ''1 minute'', NULL, ''fan'')')$$,
                 '42501', NULL, '... not on fan');
SELECT throws_ok($$SELECT obs_as('obs_billing', 'SELECT count(*) FROM idem_outbox_claim(10)')$$,
                 '42501', NULL, '... nor on the default subscription');
SELECT throws_ok(format($$SELECT obs_as('obs_billing', format('SELECT idem_outbox_ack(%%L, NULL, ''fan'')', %L::uuid[]))$$,
                        ARRAY[pg_temp.ev('fo', 'z1', 1)]),
                 '42501', NULL, '... nor ack on fan');
SELECT throws_ok($$SELECT obs_as('obs_billing', 'SELECT idem_outbox_extend(gen_random_uuid(), ''1 minute'', ''fan'')')$$,
                 '42501', NULL, '... nor extend on fan');
SELECT is((SELECT subscriptions FROM idempotency.capability_grants WHERE role = 'obs_billing'), ARRAY['billing*'],
          'the limit is listed');
SELECT throws_ok($$SELECT idem_grant('obs_billing', 'monitor', subscriptions => ARRAY['x'])$$, '22023', NULL,
                 'the monitor capability cannot be limited by subscription');
SELECT throws_ok($$SELECT idem_grant('obs_billing', 'relay', subscriptions => ARRAY['bill*ing'])$$, '22023', NULL,
                 'a subscription pattern with * inside: 22023');
SELECT idem_grant('obs_ops', 'operator', aggregate_types => ARRAY['fo', 'fs'], subscriptions => ARRAY['o*']);
SELECT throws_ok($$SELECT obs_as('obs_ops', 'SELECT idem_outbox_subscribe(''p1'', ARRAY[''fo''])')$$, '42501', NULL,
                 'an operator limited to subscriptions o* may not subscribe p1');
SELECT is(obs_as('obs_ops', 'SELECT idem_outbox_subscribe(''o2'', ARRAY[''fo''])'), 'true', '... but o2');
SELECT throws_ok($$SELECT obs_as('obs_ops', 'SELECT idem_outbox_unsubscribe(''billing'')')$$, '42501', NULL,
                 '... and may not unsubscribe billing');
SELECT throws_ok($$SELECT obs_as('obs_ops', 'SELECT idem_outbox_redrive(''{}'', ''billing'')')$$, '42501', NULL,
                 '... nor redrive on it');

-- 10. many aggregates at once: an operator's ack makes their rows under one
-- lock, a relay makes at most 1024 a transaction (the lock table stays
-- free; last, as the count is the whole test transaction's)
SELECT count(*) FROM idem_outbox_emit_many('fb', ARRAY(SELECT 'b' || g FROM generate_series(1, 10000) g),
                                           array_fill('x'::text, ARRAY[10000]),
                                           array_fill('{}'::jsonb, ARRAY[10000])) \gset
SELECT is(idem_outbox_subscribe('bulk', ARRAY['fb'], 'earliest'), true, 'a subscription of 10000 aggregates it has no rows for');
SELECT is(idem_outbox_ack(ARRAY(SELECT id FROM idempotency.outbox_events WHERE aggregate_type = 'fb'), NULL, 'bulk'), 10000,
          'an administrative ack of all their events in one call');
SELECT is(pg_temp.rows_of('bulk', 'outbox_deliveries'), 10000::bigint, '... made their 10000 rows');
SELECT is(idem_outbox_subscribe('bulk2', ARRAY['fb'], 'earliest'), true, 'another');
SELECT ok(pg_temp.claim('k1', 'bulk2', NULL, 10000) BETWEEN 1000 AND 1024,
          'a claim of 10000 new aggregates makes at most 1024 rows in the transaction, and leases them');
SELECT is(pg_temp.claim('k2', 'bulk2', NULL, 10000), 0, '... and no more in the same transaction');

SELECT * FROM finish();
ROLLBACK;
