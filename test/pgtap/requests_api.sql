-- pgTAP: the public API of request idempotency (SPEC.md §5): names,
-- signatures with their argument names and defaults, return types, the
-- requests relation, the error codes of §7 for each outcome, and that
-- no function is SECURITY DEFINER.  Runs in one transaction that rolls back.
\ir include/begin.sql

SELECT plan(95);

-- objects
SELECT has_table('idempotency', 'requests', 'table idempotency.requests exists');
SELECT has_table('idempotency', 'request_partitions', 'table idempotency.request_partitions exists');
SELECT columns_are('idempotency', 'requests',
    ARRAY['scope', 'key', 'digest', 'status', 'attempt', 'lease_until', 'recovery_point', 'state',
          'response', 'response_status', 'response_body', 'response_headers', 'created_at', 'updated_at',
          'bucket'],
    'idempotency.requests has its columns');
SELECT ok((SELECT count(*) > 0 FROM idempotency.request_partitions), 'CREATE EXTENSION made request partitions');

-- signatures (argument names and defaults as SPEC §5 writes them)
SELECT is(pg_get_function_arguments('idem_request_begin(text, text, jsonb, interval, interval, text)'::regprocedure),
          'key text, scope text DEFAULT ''default''::text, payload jsonb DEFAULT NULL::jsonb, lease interval DEFAULT ''00:01:00''::interval, wait interval DEFAULT ''00:00:00''::interval, on_conflict text DEFAULT ''error''::text',
          'idem_request_begin arguments');
SELECT is(pg_get_function_result('idem_request_begin(text, text, jsonb, interval, interval, text)'::regprocedure),
          'TABLE(status text, response jsonb, response_status integer, attempt integer, recovery_point text, state jsonb, retry_after interval, replayed boolean, response_body text, response_headers jsonb)',
          'idem_request_begin returns its table: the six of SPEC §5, then the data columns');
SELECT is(pg_get_function_arguments('idem_request_checkpoint(text, text, integer, text, jsonb)'::regprocedure),
          'key text, scope text, attempt integer, recovery_point text, state jsonb DEFAULT NULL::jsonb',
          'idem_request_checkpoint arguments');
SELECT is(pg_get_function_arguments('idem_request_fence(text, text, integer)'::regprocedure),
          'key text, scope text, attempt integer', 'idem_request_fence arguments');
SELECT is(pg_get_function_arguments('idem_request_extend(text, text, integer, interval)'::regprocedure),
          'key text, scope text, attempt integer, lease interval', 'idem_request_extend arguments');
SELECT is(pg_get_function_arguments('idem_request_complete(text, text, jsonb, integer, integer, text, jsonb)'::regprocedure),
          'key text, scope text DEFAULT ''default''::text, response jsonb DEFAULT NULL::jsonb, attempt integer DEFAULT NULL::integer, response_status integer DEFAULT NULL::integer, response_body text DEFAULT NULL::text, response_headers jsonb DEFAULT NULL::jsonb',
          'idem_request_complete arguments');
SELECT is(pg_get_function_result('idem_request_complete(text, text, jsonb, integer, integer, text, jsonb)'::regprocedure),
          'TABLE(status text, response jsonb, response_status integer, response_body text, response_headers jsonb, replayed boolean)',
          'idem_request_complete returns what it stored');
SELECT is((SELECT count(*)::int FROM pg_proc WHERE proname IN ('idem_request_begin', 'idem_request_complete')), 2,
          'one idem_request_begin and one idem_request_complete (no overload left behind)');
SELECT is(pg_get_function_arguments('idem_request_abandon(text, text, integer)'::regprocedure),
          'key text, scope text DEFAULT ''default''::text, attempt integer DEFAULT NULL::integer',
          'idem_request_abandon arguments');
SELECT function_returns('idem_request_checkpoint', ARRAY['text', 'text', 'integer', 'text', 'jsonb'], 'void', 'checkpoint returns void');
SELECT function_returns('idem_request_fence', ARRAY['text', 'text', 'integer'], 'void', 'fence returns void');
SELECT function_returns('idem_request_extend', ARRAY['text', 'text', 'integer', 'interval'], 'void', 'extend returns void');
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

-- what an HTTP handler needs, as data (SPEC §5, last point)
-- a holder: no retry_after, no replay, no stored response
SELECT results_eq($$SELECT status, attempt, retry_after, replayed, response_body, response_headers
                      FROM idem_request_begin('d-1', 'tap', '{"a": 1}', lease => '30 seconds')$$,
                  $$VALUES ('started'::text, 1, NULL::interval, false, NULL::text, NULL::jsonb)$$,
                  'a new key: started, retry_after NULL, replayed false, no body or headers');
CREATE TEMP TABLE d1_before AS
    SELECT r.ctid::text AS row_ctid, r.updated_at, r.lease_until,
           (SELECT count(*) FROM idempotency.claims WHERE scope = 'request:tap') AS claims
      FROM idempotency.requests r WHERE scope = 'tap' AND key = 'd-1';
CREATE TEMP TABLE d1_conflict AS
    SELECT * FROM idem_request_begin('d-1', 'tap', '{"a": 1}', on_conflict => 'return');
SELECT results_eq($$SELECT status, response, response_status, attempt, recovery_point, state, replayed,
                           response_body, response_headers FROM d1_conflict$$,
                  $$VALUES ('in_progress'::text, NULL::jsonb, NULL::int, NULL::int, NULL::text, NULL::jsonb, false,
                            NULL::text, NULL::jsonb)$$,
                  'on_conflict => return: a live holder is the row in_progress, with no attempt to act for');
SELECT ok((SELECT retry_after > interval '0' AND retry_after <= interval '30 seconds'
                  AND retry_after > interval '20 seconds' FROM d1_conflict),
          'retry_after is the lease left: above 0, at most the lease');
SELECT results_eq($$SELECT r.ctid::text, r.updated_at, r.lease_until,
                           (SELECT count(*) FROM idempotency.claims WHERE scope = 'request:tap')
                      FROM idempotency.requests r WHERE scope = 'tap' AND key = 'd-1'$$,
                  $$SELECT * FROM d1_before$$,
                  'on_conflict => return writes nothing: the row and the claims are as they were');
SELECT throws_ok($$SELECT * FROM idem_request_begin('d-1', 'tap', '{"a": 1}')$$, 'IK002', NULL,
                 'IK002 stays the default');
CREATE FUNCTION pg_temp.ik002(sql text, OUT detail text, OUT hint text) LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE sql;
EXCEPTION WHEN SQLSTATE 'IK002' THEN
    GET STACKED DIAGNOSTICS detail = PG_EXCEPTION_DETAIL, hint = PG_EXCEPTION_HINT;
END
$$;
SELECT ok((SELECT detail ~ '^The lease of attempt 1 ends in [0-9]+\.[0-9]{3} seconds\.$'
                  AND substring(hint FROM '^Retry after ([0-9]+) seconds?, or begin with a wait\.$')::int
                      = ceil(substring(detail FROM 'ends in ([0-9.]+) seconds')::numeric)
                  AND substring(hint FROM '([0-9]+)')::int BETWEEN 1 AND 30
             FROM pg_temp.ik002($$SELECT * FROM idem_request_begin('d-1', 'tap')$$)),
          'IK002: the detail as before, the hint with its seconds rounded up');
SELECT throws_ok($$SELECT * FROM idem_request_begin('d-1', 'tap', '{"a": 2}', on_conflict => 'return')$$, 'IK001', NULL,
                 'on_conflict => return: another payload is still IK001');
-- a body as text, not canonical JSON, with headers: complete returns what it
-- stored, and the replay is the same bytes
CREATE TEMP TABLE d1_first AS
    SELECT * FROM idem_request_complete('d-1', 'tap', attempt => 1, response_status => 201,
        response_body => E'{"z":1,  "a" : [ 2,1 ]}\n',
        response_headers => '{"Content-Type": "application/json", "SET-COOKIE": ["b=2", "a=1"], "x-empty": ""}');
SELECT results_eq($$SELECT status, response, response_status, response_body, response_headers, replayed FROM d1_first$$,
                  $$VALUES ('completed'::text, NULL::jsonb, 201, E'{"z":1,  "a" : [ 2,1 ]}\n',
                            '{"content-type": "application/json", "set-cookie": ["b=2", "a=1"], "x-empty": ""}'::jsonb, false)$$,
                  'complete returns what it stored: the body text as given, headers with lower-case names');
CREATE TEMP TABLE d1_replay AS SELECT * FROM idem_request_begin('d-1', 'tap', '{"a": 1}');
SELECT ok((SELECT convert_to(r.response_body, 'UTF8') = convert_to(f.response_body, 'UTF8')
                  AND r.response_body = E'{"z":1,  "a" : [ 2,1 ]}\n'
             FROM d1_replay r, d1_first f),
          'the replay''s body is byte for byte the first answer''s (key order and whitespace kept)');
SELECT results_eq($$SELECT status, response_status, response_headers::text, replayed, retry_after FROM d1_replay$$,
                  $$SELECT 'completed'::text, response_status, response_headers::text, true, NULL::interval FROM d1_first$$,
                  'the replay: same status and headers (array order kept), replayed true, no retry_after');
SELECT results_eq($$SELECT status, replayed, response_body FROM idem_request_begin('d-1', 'tap', on_conflict => 'return')$$,
                  $$VALUES ('completed'::text, true, E'{"z":1,  "a" : [ 2,1 ]}\n')$$,
                  'on_conflict => return replays a completed request like the default');
-- a body as jsonb: its canonical text, the same in the first answer and the replays
SELECT is((SELECT attempt FROM idem_request_begin('d-2', 'tap')), 1, 'd-2 starts');
CREATE TEMP TABLE d2_first AS SELECT * FROM idem_request_complete('d-2', 'tap', '{"b": [1,2],  "a": "x"}', 1, 200);
SELECT results_eq($$SELECT response, response_body, response_headers, replayed FROM d2_first$$,
                  $$VALUES ('{"a": "x", "b": [1, 2]}'::jsonb, '{"a": "x", "b": [1, 2]}'::text, NULL::jsonb, false)$$,
                  'a jsonb response: complete returns its canonical text as response_body');
SELECT results_eq($$SELECT response, response_body, replayed FROM idem_request_begin('d-2', 'tap')$$,
                  $$SELECT response, response_body, true FROM d2_first$$,
                  'a jsonb response: the replay has the same jsonb and the same body text');
-- an empty body and an empty header object are kept as such
SELECT is((SELECT attempt FROM idem_request_begin('d-3', 'tap')), 1, 'd-3 starts');
SELECT results_eq($$SELECT response_body, response_headers FROM idem_request_complete('d-3', 'tap', response_body => '', response_headers => '{}', response_status => 204)$$,
                  $$VALUES (''::text, '{}'::jsonb)$$, 'an empty body and {} headers are stored as given');
SELECT results_eq($$SELECT response_body, response_headers, response_status FROM idem_request_begin('d-3', 'tap')$$,
                  $$VALUES (''::text, '{}'::jsonb, 204)$$, 'and replayed as given');
-- a 1 MB body (not ASCII), and a 1 MB jsonb response, come back whole
SELECT is((SELECT attempt FROM idem_request_begin('d-4', 'tap')), 1, 'd-4 starts');
SELECT is((SELECT octet_length(response_body) FROM idem_request_complete('d-4', 'tap', attempt => 1,
               response_body => repeat('é ', 350000) || 'end', response_headers => jsonb_build_object('x-big', repeat('v', 8000)))),
          1050003, 'complete stores a 1 MB body');
SELECT ok((SELECT md5(response_body) = md5(repeat('é ', 350000) || 'end') AND replayed
                  AND length(response_headers->>'x-big') = 8000
             FROM idem_request_begin('d-4', 'tap')), 'a 1 MB body is replayed byte for byte');
SELECT is((SELECT attempt FROM idem_request_begin('d-5', 'tap')), 1, 'd-5 starts');
SELECT is((SELECT md5(response_body) FROM idem_request_complete('d-5', 'tap', jsonb_build_object('data', repeat('y', 1048576)), 1)),
          (SELECT md5(response_body) FROM idem_request_begin('d-5', 'tap')),
          'a 1 MB jsonb response: first answer and replay are the same text');
-- abandon and a new start forget the stored body and headers
SELECT lives_ok($$SELECT idem_request_abandon('d-1', 'tap')$$, 'd-1 abandoned');
SELECT results_eq($$SELECT status, replayed, response_body, response_headers FROM idem_request_begin('d-1', 'tap')$$,
                  $$VALUES ('started'::text, false, NULL::text, NULL::jsonb)$$,
                  'after abandon: started, no body, no headers');
SELECT is((SELECT count(*)::int FROM idempotency.requests
            WHERE key = 'd-1' AND (response_body IS NOT NULL OR response_headers IS NOT NULL)), 0,
          'abandon cleared the stored body and headers');
-- a released claim whose holder is live: on_conflict => return leaves no claim
SELECT is((SELECT attempt FROM idem_request_begin('d-6', 'tap', lease => '1 hour')), 1, 'd-6 starts');
SELECT ok(idem_release('d-6', 'request:tap'), 'the claim of d-6 is released');
SELECT results_eq($$SELECT status, retry_after > interval '59 minutes' FROM idem_request_begin('d-6', 'tap', on_conflict => 'return')$$,
                  $$VALUES ('in_progress'::text, true)$$, 'd-6: in_progress for the live holder');
SELECT is((SELECT count(*)::int FROM idempotency.claims WHERE scope = 'request:tap' AND key = 'd-6'), 0,
          'on_conflict => return rolled back the claim it made (as IK002 would have)');

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
SELECT throws_ok($$SELECT * FROM idem_request_begin('k', on_conflict => NULL)$$, '22004', NULL, 'NULL on_conflict: 22004');
SELECT throws_ok($$SELECT * FROM idem_request_begin('k', on_conflict => '')$$, '22023', NULL, 'empty on_conflict: 22023');
SELECT throws_ok($$SELECT * FROM idem_request_begin('k', on_conflict => 'skip')$$, '22023', NULL, 'unknown on_conflict: 22023');
SELECT throws_ok($$SELECT * FROM idem_request_begin('k', on_conflict => 1)$$, '42883', NULL,
                 'on_conflict of another type: no such function');
SELECT is((SELECT attempt FROM idem_request_begin('bad', 'tap')), 1, 'a started key for the bad input below');
CREATE TEMP TABLE bad_before AS
    SELECT ctid::text AS row_ctid, updated_at, status FROM idempotency.requests WHERE scope = 'tap' AND key = 'bad';
SELECT throws_ok($$SELECT * FROM idem_request_complete('bad', 'tap', '{}', response_body => '{}')$$, '22023',
                 'response and response_body cannot both be given', 'response and response_body: 22023');
SELECT throws_ok($$SELECT * FROM idem_request_complete('bad', 'tap', response_body => 42)$$, '42883', NULL,
                 'a response_body of another type: no such function');
SELECT throws_ok($$SELECT * FROM idem_request_complete('bad', 'tap', response_headers => 'not json')$$, '22P02', NULL,
                 'response_headers that are not JSON: 22P02');
SELECT throws_ok(format('SELECT * FROM idem_request_complete(%L, %L, response_headers => %L)', 'bad', 'tap', h), '22023', NULL,
                 'response_headers ' || h || ': 22023')
  FROM unnest(ARRAY['[]', '"x"', 'null', '{"a": 1}', '{"a": null}', '{"a": []}', '{"a": [1]}', '{"a": {"b": "c"}}',
                    '{"": "x"}', '{"a b": "x"}', '{"a\u00e9": "x"}', '{"a": "x\r\nb: y"}', '{"a": ["x", "y\n"]}',
                    '{"A": "x", "a": "y"}']) h;
SELECT results_eq($$SELECT ctid::text, updated_at, status FROM idempotency.requests WHERE scope = 'tap' AND key = 'bad'$$,
                  $$SELECT * FROM bad_before$$, 'bad input left the request as it was');
SELECT results_eq($$SELECT status, response_headers FROM idem_request_complete('bad', 'tap', response_headers => '{"A": "x", "b": ["y", "z"]}')$$,
                  $$VALUES ('completed'::text, '{"a": "x", "b": ["y", "z"]}'::jsonb)$$,
                  'and good input then completes it');

SELECT * FROM finish();
ROLLBACK;
