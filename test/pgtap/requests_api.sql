-- pgTAP: the public API of request idempotency (SPEC.md §5): names,
-- signatures with their argument names and defaults, return types, the
-- requests relation, the error codes of §7 for each outcome, and that
-- no function is SECURITY DEFINER.  Runs in one transaction that rolls back.
BEGIN;
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS pgtap;
CREATE EXTENSION IF NOT EXISTS idempotency;

SELECT plan(41);

-- objects
SELECT has_table('idempotency', 'requests', 'table idempotency.requests exists');
SELECT has_table('idempotency', 'request_partitions', 'table idempotency.request_partitions exists');
SELECT columns_are('idempotency', 'requests',
    ARRAY['scope', 'key', 'digest', 'status', 'attempt', 'lease_until', 'recovery_point', 'state',
          'response', 'response_status', 'created_at', 'updated_at', 'bucket'],
    'idempotency.requests has its columns');
SELECT ok((SELECT count(*) > 0 FROM idempotency.request_partitions), 'CREATE EXTENSION made request partitions');

-- signatures (argument names and defaults as SPEC §5 writes them)
SELECT is(pg_get_function_arguments('idem_request_begin(text, text, jsonb, interval, interval)'::regprocedure),
          'key text, scope text DEFAULT ''default''::text, payload jsonb DEFAULT NULL::jsonb, lease interval DEFAULT ''00:01:00''::interval, wait interval DEFAULT ''00:00:00''::interval',
          'idem_request_begin arguments');
SELECT is(pg_get_function_result('idem_request_begin(text, text, jsonb, interval, interval)'::regprocedure),
          'TABLE(status text, response jsonb, response_status integer, attempt integer, recovery_point text, state jsonb)',
          'idem_request_begin returns its table');
SELECT is(pg_get_function_arguments('idem_request_checkpoint(text, text, integer, text, jsonb)'::regprocedure),
          'key text, scope text, attempt integer, recovery_point text, state jsonb DEFAULT NULL::jsonb',
          'idem_request_checkpoint arguments');
SELECT is(pg_get_function_arguments('idem_request_fence(text, text, integer)'::regprocedure),
          'key text, scope text, attempt integer', 'idem_request_fence arguments');
SELECT is(pg_get_function_arguments('idem_request_extend(text, text, integer, interval)'::regprocedure),
          'key text, scope text, attempt integer, lease interval', 'idem_request_extend arguments');
SELECT is(pg_get_function_arguments('idem_request_complete(text, text, jsonb, integer, integer)'::regprocedure),
          'key text, scope text DEFAULT ''default''::text, response jsonb DEFAULT NULL::jsonb, attempt integer DEFAULT NULL::integer, response_status integer DEFAULT NULL::integer',
          'idem_request_complete arguments');
SELECT is(pg_get_function_arguments('idem_request_abandon(text, text, integer)'::regprocedure),
          'key text, scope text DEFAULT ''default''::text, attempt integer DEFAULT NULL::integer',
          'idem_request_abandon arguments');
SELECT function_returns('idem_request_checkpoint', ARRAY['text', 'text', 'integer', 'text', 'jsonb'], 'void', 'checkpoint returns void');
SELECT function_returns('idem_request_fence', ARRAY['text', 'text', 'integer'], 'void', 'fence returns void');
SELECT function_returns('idem_request_extend', ARRAY['text', 'text', 'integer', 'interval'], 'void', 'extend returns void');
SELECT function_returns('idem_request_complete', ARRAY['text', 'text', 'jsonb', 'integer', 'integer'], 'void', 'complete returns void');
SELECT function_returns('idem_request_abandon', ARRAY['text', 'text', 'integer'], 'void', 'abandon returns void');
SELECT is((SELECT count(*)::int FROM pg_proc WHERE proname LIKE 'idem\_request\_%' AND prosecdef), 0,
          'no request function is SECURITY DEFINER');
SELECT is((SELECT count(*)::int FROM pg_proc WHERE proname LIKE 'idem\_request\_%' AND provolatile <> 'v'), 0,
          'every request function is VOLATILE');

-- outcomes
SELECT is((SELECT status || '/' || attempt FROM idem_request_begin('t-1', 'tap', '{"a": 1}')), 'started/1',
          'a new key starts as attempt 1');
SELECT throws_ok($$SELECT * FROM idem_request_begin('t-1', 'tap', '{"a": 1}')$$, 'IK002', NULL,
                 'a live lease: IK002');
SELECT throws_ok($$SELECT * FROM idem_request_begin('t-1', 'tap', '{"a": 2}')$$, 'IK001', NULL,
                 'another payload: IK001');
SELECT lives_ok($$SELECT idem_request_checkpoint('t-1', 'tap', 1, 'step-1', '{"x": 1}')$$, 'the holder checkpoints');
SELECT lives_ok($$SELECT idem_request_extend('t-1', 'tap', 1, '5 minutes')$$, 'the holder extends its lease');
SELECT lives_ok($$SELECT idem_request_fence('t-1', 'tap', 1)$$, 'the holder fences');
SELECT throws_ok($$SELECT idem_request_fence('t-1', 'tap', 2)$$, 'IK003', NULL, 'another attempt: IK003');
SELECT lives_ok($$SELECT idem_request_complete('t-1', 'tap', '{"ok": true}', 1, 201)$$, 'the holder completes');
SELECT results_eq($$SELECT status, response, response_status, attempt, recovery_point, state
                      FROM idem_request_begin('t-1', 'tap', '{"a": 1}')$$,
                  $$VALUES ('completed'::text, '{"ok": true}'::jsonb, 201, 1, 'step-1'::text, '{"x": 1}'::jsonb)$$,
                  'a completed request replays its response');
SELECT throws_ok($$SELECT idem_request_complete('t-1', 'tap', '{}', 1)$$, 'IK003', NULL, 'completing twice: IK003');
SELECT lives_ok($$SELECT idem_request_abandon('t-1', 'tap')$$, 'abandon forgets the outcome');
SELECT is((SELECT status || '/' || attempt FROM idem_request_begin('t-1', 'tap', '{"a": 3}')), 'started/2',
          'after abandon: started afresh, with a new payload, as the next attempt');
SELECT throws_ok($$SELECT idem_request_checkpoint('t-1', 'tap', 1, 'late')$$, 'IK003', NULL,
                 'the abandoned attempt is fenced off');
-- a request and its claim leave together: once the claim is gone (released
-- here, or past its retention) the key is new, and begin starts it afresh in
-- the row it still has, as the next attempt
SELECT lives_ok($$SELECT idem_request_complete('t-1', 'tap', '{"n": 2}', 2)$$, 'attempt 2 completes');
SELECT ok(idem_release('t-1', 'request:tap'), 'the claim of the request is released');
SELECT results_eq($$SELECT status, response, attempt, recovery_point,
                           (SELECT count(*)::int FROM idempotency.requests WHERE key = 't-1')
                      FROM idem_request_begin('t-1', 'tap', '{"a": 4}')$$,
                  $$VALUES ('started'::text, NULL::jsonb, 3, NULL::text, 1)$$,
                  'a new claim starts the key afresh in its one row, as attempt 3');

-- bad input
SELECT throws_ok($$SELECT * FROM idem_request_begin(NULL)$$, '22004', NULL, 'NULL key: 22004');
SELECT throws_ok($$SELECT * FROM idem_request_begin('')$$, '22023', NULL, 'empty key: 22023');
SELECT throws_ok($$SELECT * FROM idem_request_begin('k', repeat('s', 56))$$, '22001', NULL, 'a scope over 55 bytes: 22001');
SELECT throws_ok($$SELECT * FROM idem_request_begin('k', lease => '0')$$, '22023', NULL, 'a lease of 0: 22023');
SELECT throws_ok($$SELECT idem_request_fence('t-1', 'tap', NULL)$$, '22004', NULL, 'NULL attempt: 22004');
SELECT throws_ok($$SELECT idem_request_complete('t-1', 'tap', NULL, 2, 700)$$, '22023', NULL,
                 'a response_status that is no HTTP status: 22023');
SELECT throws_ok($$SELECT idem_request_checkpoint('never', 'tap', 1, 'x')$$, 'IK003', NULL,
                 'a key never begun: IK003');

SELECT * FROM finish();
ROLLBACK;
