-- pgTAP: the public API of the inbox (SPEC.md section 4b): names,
-- signatures with their argument names and defaults, return types, that no
-- function is SECURITY DEFINER, and the outcomes and bad input of
-- idem_inbox_extend (fenced like idem_outbox_extend).  Runs in one
-- transaction that rolls back; time moves (always forward) with the
-- test-only setting idempotency.debug_clock_offset.
\ir include/begin.sql

SELECT plan(35);

-- the extension's clock runs $1 seconds further ahead
CREATE FUNCTION pg_temp.advance(int) RETURNS void LANGUAGE sql AS $$
    SELECT set_config('idempotency.debug_clock_offset',
                      ((SELECT setting::int FROM pg_settings
                         WHERE name = 'idempotency.debug_clock_offset') + $1)::text, true);
$$;
-- what claim call "call" handed out
CREATE TEMP TABLE got (call text, id uuid, message_id text, attempts int, lease_token uuid);
CREATE FUNCTION pg_temp.claim(call text, lease interval) RETURNS int LANGUAGE sql AS $$
    WITH c AS (SELECT * FROM idem_inbox_claim(100, lease, ARRAY['tap'])),
         i AS (INSERT INTO got SELECT call, id, message_id, attempts, lease_token FROM c RETURNING 1)
    SELECT count(*)::int FROM i
$$;
CREATE FUNCTION pg_temp.tok(call text) RETURNS uuid LANGUAGE sql AS $$
    SELECT lease_token FROM got WHERE got.call = tok.call LIMIT 1
$$;

-- objects
SELECT has_table('idempotency', 'inbox_messages', 'table idempotency.inbox_messages exists');
SELECT has_view('idempotency', 'inbox_dead', 'view idempotency.inbox_dead exists');
SELECT has_type('idem_inbox_message', 'type idem_inbox_message exists');

-- signatures (argument names and defaults as SPEC 4b writes them)
SELECT is(pg_get_function_arguments('idem_inbox_receive(text, text, jsonb, jsonb)'::regprocedure),
          'source text, message_id text, payload jsonb, headers jsonb DEFAULT ''{}''::jsonb',
          'idem_inbox_receive arguments');
SELECT function_returns('idem_inbox_receive', ARRAY['text', 'text', 'jsonb', 'jsonb'], 'boolean',
                        'idem_inbox_receive returns boolean');
SELECT is(pg_get_function_arguments('idem_inbox_claim(integer, interval, text[])'::regprocedure),
          'batch integer DEFAULT 100, lease interval DEFAULT ''00:00:30''::interval, sources text[] DEFAULT NULL::text[]',
          'idem_inbox_claim arguments');
SELECT function_returns('idem_inbox_claim', ARRAY['integer', 'interval', 'text[]'], 'setof idem_inbox_message',
                        'idem_inbox_claim returns setof idem_inbox_message');
SELECT is(pg_get_function_arguments('idem_inbox_done(uuid[], uuid)'::regprocedure),
          'ids uuid[], lease_token uuid DEFAULT NULL::uuid', 'idem_inbox_done arguments');
SELECT function_returns('idem_inbox_done', ARRAY['uuid[]', 'uuid'], 'integer', 'idem_inbox_done returns integer');
SELECT is(pg_get_function_arguments('idem_inbox_fail(uuid, text, interval, uuid)'::regprocedure),
          'id uuid, error text, retry_after interval DEFAULT NULL::interval, lease_token uuid DEFAULT NULL::uuid',
          'idem_inbox_fail arguments');
SELECT function_returns('idem_inbox_fail', ARRAY['uuid', 'text', 'interval', 'uuid'], 'void', 'idem_inbox_fail returns void');
SELECT is(pg_get_function_arguments('idem_inbox_extend(uuid, interval)'::regprocedure),
          'lease_token uuid, lease interval', 'idem_inbox_extend arguments');
SELECT function_returns('idem_inbox_extend', ARRAY['uuid', 'interval'], 'integer', 'idem_inbox_extend returns integer');
SELECT is(pg_get_function_arguments('idem_inbox_replay(text, timestamp with time zone, timestamp with time zone)'::regprocedure),
          'source text, since timestamp with time zone, until timestamp with time zone DEFAULT now()',
          'idem_inbox_replay arguments');
SELECT function_returns('idem_inbox_replay', ARRAY['text', 'timestamp with time zone', 'timestamp with time zone'],
                        'integer', 'idem_inbox_replay returns integer');
SELECT is((SELECT count(*)::int FROM pg_proc WHERE proname LIKE 'idem\_inbox\_%' AND prosecdef), 0,
          'no inbox function is SECURITY DEFINER');
SELECT is((SELECT count(*)::int FROM pg_proc WHERE proname LIKE 'idem\_inbox\_%' AND provolatile <> 'v'), 0,
          'every inbox function is VOLATILE');
SELECT is((SELECT count(*)::int FROM pg_proc WHERE proname LIKE 'idem\_inbox\_%' AND proisstrict), 0,
          'no inbox function is STRICT (NULL arguments raise 22004)');

-- extend: outcomes
SELECT is((SELECT count(*)::int FROM generate_series(1, 3) g
            WHERE idem_inbox_receive('tap', 'm-' || g, '{}')), 3, 'three messages received');
SELECT is(pg_temp.claim('a', '10 seconds'), 3, 'a worker leases them for 10 seconds');
SELECT is(idem_inbox_extend(pg_temp.tok('a'), '5 minutes'), 3, 'extend returns how many messages the lease covers');
SELECT pg_temp.advance(60) \g /dev/null
SELECT is(pg_temp.claim('b', '10 seconds'), 0, 'past the lease the claim gave, the extended lease still holds');
SELECT is(idem_inbox_done(ARRAY(SELECT id FROM got WHERE call = 'a' AND message_id = 'm-1'), pg_temp.tok('a')), 1,
          '... and its token settles');
SELECT is(idem_inbox_extend(pg_temp.tok('a'), '5 minutes'), 2, 'a done message leaves the lease: it covers 2');
SELECT is(idem_inbox_extend(gen_random_uuid(), '1 minute'), 0, 'an unknown token covers nothing');
SELECT pg_temp.advance(301) \g /dev/null
SELECT is(idem_inbox_extend(pg_temp.tok('a'), '5 minutes'), 0, 'an expired lease covers nothing');
SELECT is(pg_temp.claim('c', '1 minute'), 2, '... and its messages are claimable again');
SELECT is(idem_inbox_extend(pg_temp.tok('a'), '5 minutes'), 0, 'the old token extends nothing of the new lease');
SELECT is(idem_inbox_extend(pg_temp.tok('c'), '5 minutes'), 2, 'the new one does');

-- extend: bad input
SELECT throws_ok($$SELECT idem_inbox_extend(NULL, '1 minute')$$, '22004', NULL, 'NULL token: 22004');
SELECT throws_ok(format($$SELECT idem_inbox_extend(%L, NULL)$$, pg_temp.tok('c')), '22004', NULL, 'NULL lease: 22004');
SELECT throws_ok(format($$SELECT idem_inbox_extend(%L, '0 seconds')$$, pg_temp.tok('c')), '22023', NULL, 'a lease of 0: 22023');
SELECT throws_ok(format($$SELECT idem_inbox_extend(%L, '-1 second')$$, pg_temp.tok('c')), '22023', NULL, 'a negative lease: 22023');
SELECT throws_ok(format($$SELECT idem_inbox_extend(%L, '300000 years')$$, pg_temp.tok('c')), '22023', NULL, 'an absurd lease: 22023');
SELECT throws_ok($$SELECT idem_inbox_extend('not a token', '1 minute')$$, '22P02', NULL, 'not a uuid: 22P02');

SELECT * FROM finish();
ROLLBACK;
