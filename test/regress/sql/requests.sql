-- Requests: the outcomes of SPEC section 5, to read: begin (started,
-- completed, IK002, IK001), takeover from the last recovery point, fencing
-- and IK003 for stale attempts, complete with a status, abandon, waiting,
-- bad input, privileges, and the partitions of idempotency.requests.  Time
-- moves (always forward) with the test-only setting
-- idempotency.debug_clock_offset.
CREATE EXTENSION idempotency;

\getenv abs_srcdir PG_ABS_SRCDIR
\set try_sql :abs_srcdir '/include/try.sql'
\i :try_sql
-- the detail of an error, its number of seconds masked
CREATE FUNCTION pg_temp.detail(sql text, mask boolean DEFAULT true) RETURNS text LANGUAGE plpgsql AS $$
DECLARE d text;
BEGIN
    EXECUTE sql;
    RETURN 'no error';
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS d = PG_EXCEPTION_DETAIL;
    RETURN SQLSTATE || ': ' || CASE WHEN mask THEN regexp_replace(d, '[0-9]+\.[0-9]{3} seconds', 'N.NNN seconds') ELSE d END;
END
$$;

-- IK002's seconds: those of the detail, and the hint's whole seconds
CREATE FUNCTION pg_temp.lease_left(sql text, OUT detail_seconds numeric, OUT hint_seconds int)
LANGUAGE plpgsql AS $$
DECLARE d text; h text;
BEGIN
    EXECUTE sql;
EXCEPTION WHEN SQLSTATE 'IK002' THEN
    GET STACKED DIAGNOSTICS d = PG_EXCEPTION_DETAIL, h = PG_EXCEPTION_HINT;
    detail_seconds := substring(d FROM 'ends in ([0-9.]+) seconds')::numeric;
    hint_seconds := substring(h FROM '^Retry after ([0-9]+) seconds?, or begin with a wait\.$')::int;
END
$$;

-- maintenance made the requests' partitions with the others
SELECT state, count(*) FROM idempotency.partitions WHERE store = 'requests' GROUP BY 1 ORDER BY 1;

-- 1. A new key: started, attempt 1, nothing to resume from
SELECT * FROM idem_request_begin('k-1', 'payments', '{"amount": 10}', '10 seconds');
-- the row, and the claim that makes the key unique
SELECT scope, key, status, attempt, recovery_point, state, response, response_status,
       lease_until - created_at AS lease, digest IS NOT NULL AS has_digest
  FROM idempotency.requests;
SELECT scope, key FROM idempotency.claims WHERE scope LIKE 'request:%';
-- while the lease is live, another begin is refused (even with the same payload)
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k-1', 'payments', '{"amount": 10}')$$);
-- the detail gives the lease left, for Retry-After
SELECT pg_temp.detail($$SELECT * FROM idem_request_begin('k-1', 'payments')$$);
SELECT substring(pg_temp.detail($$SELECT * FROM idem_request_begin('k-1', 'payments')$$, false)
                 FROM 'ends in ([0-9.]+) seconds')::numeric BETWEEN 5 AND 10 AS lease_left_5_to_10s;
-- same key, another payload: IK001 (key order and whitespace do not matter)
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k-1', 'payments', '{"amount": 11}')$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k-1', 'payments', '{ "amount" : 10 }')$$);
-- scopes are independent
SELECT status, attempt FROM idem_request_begin('k-1', 'refunds');

-- 2. Recovery points: the holder records progress; NULL state keeps the last
SELECT idem_request_checkpoint('k-1', 'payments', 1, 'charge_created', '{"charge": "ch_1"}');
SELECT idem_request_checkpoint('k-1', 'payments', 1, 'charge_confirmed');
SELECT recovery_point, state FROM idempotency.requests WHERE scope = 'payments';
SELECT idem_request_extend('k-1', 'payments', 1, '10 seconds');

-- 3. The lease expires: the next begin takes over as attempt 2 and resumes
SET idempotency.debug_clock_offset = 30;
SELECT * FROM idem_request_begin('k-1', 'payments', '{"amount": 10}', '10 seconds');
-- attempt 1 is fenced off everywhere
SELECT pg_temp.try($$SELECT idem_request_fence('k-1', 'payments', 1)$$);
SELECT pg_temp.try($$SELECT idem_request_checkpoint('k-1', 'payments', 1, 'x')$$);
SELECT pg_temp.try($$SELECT idem_request_extend('k-1', 'payments', 1, '1 minute')$$);
SELECT pg_temp.try($$SELECT idem_request_complete('k-1', 'payments', '{}', 1)$$);
SELECT pg_temp.try($$SELECT idem_request_abandon('k-1', 'payments', 1)$$);
-- and so is an attempt that never was
SELECT pg_temp.try($$SELECT idem_request_fence('k-1', 'payments', 3)$$);
-- the detail names the current attempt
SELECT pg_temp.detail($$SELECT idem_request_fence('k-1', 'payments', 1)$$);
SELECT attempt, status FROM idempotency.requests WHERE scope = 'payments';

-- 4. The effect transaction: fence, the effect, complete, together
CREATE TABLE charges (key text PRIMARY KEY, charge text);
BEGIN;
SELECT idem_request_fence('k-1', 'payments', 2);
INSERT INTO charges SELECT 'k-1', state->>'charge' FROM idempotency.requests WHERE scope = 'payments';
SELECT idem_request_complete('k-1', 'payments', '{"id": "pay_1", "amount": 10}', 2, 201);
COMMIT;
-- every later begin replays the stored response; nothing runs again
SELECT * FROM idem_request_begin('k-1', 'payments', '{"amount": 10}');
SELECT status, response_status FROM idem_request_begin('k-1', 'payments');
-- a completed request still refuses another payload
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k-1', 'payments', '{"amount": 12}')$$);
-- calls for a completed request: IK003
SELECT pg_temp.try($$SELECT idem_request_complete('k-1', 'payments', '{}', 2)$$);
SELECT pg_temp.try($$SELECT idem_request_checkpoint('k-1', 'payments', 2, 'x')$$);
SELECT pg_temp.try($$SELECT idem_request_fence('k-1', 'payments', 2)$$);
-- a rolled-back completion leaves the request started
SELECT status, attempt FROM idem_request_begin('k-2', 'payments');
BEGIN;
SELECT idem_request_complete('k-2', 'payments', '{"x": 1}', 1, 200);
ROLLBACK;
SELECT status, response FROM idempotency.requests WHERE key = 'k-2';
-- errors are stored and replayed like any response; complete without an
-- attempt completes whichever is current
SELECT idem_request_complete('k-2', 'payments', '{"error": "card_declined"}', response_status => 402);
SELECT status, response, response_status, attempt FROM idem_request_begin('k-2', 'payments');
-- no response at all is a response too
SELECT status, attempt FROM idem_request_begin('k-3', 'payments');
SELECT idem_request_complete('k-3', 'payments');
SELECT status, response IS NULL AS no_response, response_status FROM idem_request_begin('k-3', 'payments');

-- 5. Abandon: forget the outcome, so the next request starts afresh (a new
-- payload is fine); the attempt number goes on, so no earlier holder can
-- pass for the new one
SELECT status, attempt FROM idem_request_begin('k-4', 'payments', '{"v": 1}', '10 seconds');
SELECT idem_request_checkpoint('k-4', 'payments', 1, 'half_way', '{"n": 1}');
SELECT idem_request_abandon('k-4', 'payments', 1);
SELECT status, recovery_point, state, response FROM idempotency.requests WHERE key = 'k-4';
SELECT pg_temp.try($$SELECT idem_request_complete('k-4', 'payments', '{}', 1)$$);
SELECT * FROM idem_request_begin('k-4', 'payments', '{"v": 2}');
SELECT pg_temp.try($$SELECT idem_request_fence('k-4', 'payments', 1)$$);
SELECT idem_request_fence('k-4', 'payments', 2);
-- abandon without an attempt forgets even a completed request
SELECT idem_request_abandon('k-1', 'payments');
SELECT status, attempt, response FROM idem_request_begin('k-1', 'payments', '{"amount": 99}');
-- abandoning a key never begun does nothing; with an attempt it is IK003
SELECT idem_request_abandon('never', 'payments');
SELECT pg_temp.try($$SELECT idem_request_abandon('never', 'payments', 1)$$);
SELECT count(*) AS rows_for_never FROM idempotency.requests WHERE key = 'never';
-- calls for a key never begun: IK003
SELECT pg_temp.try($$SELECT idem_request_complete('never', 'payments')$$);
SELECT pg_temp.try($$SELECT idem_request_checkpoint('never', 'payments', 1, 'x')$$);
SELECT pg_temp.try($$SELECT idem_request_extend('never', 'payments', 1, '1 minute')$$);
SELECT pg_temp.try($$SELECT idem_request_fence('never', 'payments', 1)$$);

-- 6. wait: begin waits for a live lease to end, and then takes over; in one
-- session nothing else can complete meanwhile, so a short wait ends in IK002
SELECT status, attempt FROM idem_request_begin('k-5', 'payments', lease => '1 second');
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k-5', 'payments', wait => '0.2 seconds')$$);
SELECT clock_timestamp() AS t0 \gset
SELECT status, attempt FROM idem_request_begin('k-5', 'payments', wait => '3 seconds');
SELECT clock_timestamp() - :'t0' BETWEEN interval '0.1 seconds' AND interval '2.5 seconds' AS waited_for_the_lease;

-- 7. The row of a claimed key may expire before its claim (its partition
-- dropped first): begin makes it again, as attempt 1
SELECT status, attempt FROM idem_request_begin('k-6', 'payments');
DELETE FROM idempotency.requests WHERE key = 'k-6';
SELECT status, attempt FROM idem_request_begin('k-6', 'payments');
SELECT count(*) AS rows_for_k6 FROM idempotency.requests WHERE key = 'k-6';

-- 7b. A request and its claim live and leave together.  When the claim goes
-- first (released here; maintenance drops a claims partition past its
-- retention while a reader keeps the request's partition from going), the
-- key is new again: begin starts it afresh in the one row the key has --
-- not in a second row in today's partition -- and the attempt number goes
-- on, so no holder of the old request can pass for the new one
SELECT status, attempt FROM idem_request_begin('k-7', 'payments', '{"v": 1}', '10 seconds');
SELECT idem_request_checkpoint('k-7', 'payments', 1, 'charged', '{"charge": "ch_7"}');
SELECT idem_request_complete('k-7', 'payments', '{"first": true}', 1, 200);
SELECT idem_release('k-7', 'request:payments') AS claim_released;
-- a day later, so a row made now would go into another partition
SET idempotency.debug_clock_offset = '30h';
SELECT * FROM idem_request_begin('k-7', 'payments', '{"v": 2}', '10 seconds');
SELECT count(*) AS rows_for_k7, min(status) AS status, min(attempt) AS attempt,
       bool_and(created_at > now() + interval '29 hours') AS created_anew
  FROM idempotency.requests WHERE key = 'k-7';
SELECT scope, key FROM idempotency.claims WHERE key = 'k-7';
-- every call of the key acts on that row: checkpoint, takeover, abandon,
-- restart, complete
SELECT idem_request_checkpoint('k-7', 'payments', 2, 'step_1');
SET idempotency.debug_clock_offset = '31h';
SELECT status, attempt, recovery_point FROM idem_request_begin('k-7', 'payments', '{"v": 2}');
SELECT pg_temp.try($$SELECT idem_request_fence('k-7', 'payments', 2)$$);
SELECT idem_request_abandon('k-7', 'payments');
SELECT status, attempt FROM idem_request_begin('k-7', 'payments', '{"v": 3}');
SELECT idem_request_complete('k-7', 'payments', '{"second": true}', 4, 201);
SELECT status, response, response_status, attempt FROM idem_request_begin('k-7', 'payments', '{"v": 3}');
SELECT count(*) AS rows_for_k7, min(status) AS status, min(attempt) AS attempt
  FROM idempotency.requests WHERE key = 'k-7';
-- a released claim whose request still holds a live lease: the new claim
-- does not take the key from that holder (IK002, and the claim rolls back)
SELECT status, attempt FROM idem_request_begin('k-8', 'payments', NULL, '1 hour');
SELECT idem_release('k-8', 'request:payments') AS claim_released;
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k-8', 'payments')$$);
SELECT count(*) AS claims_for_k8 FROM idempotency.claims WHERE key = 'k-8';
SELECT idem_request_fence('k-8', 'payments', 1);
SELECT count(*) AS rows_for_k8 FROM idempotency.requests WHERE key = 'k-8';

-- 7c. Under REPEATABLE READ, begin decides from the row as it is now,
-- this transaction's own changes included
BEGIN ISOLATION LEVEL REPEATABLE READ;
SELECT status, attempt FROM idem_request_begin('k-9', 'payments');
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k-9', 'payments')$$);
SELECT idem_request_complete('k-9', 'payments', '{"ok": 9}', 1, 200);
SELECT status, response, attempt FROM idem_request_begin('k-9', 'payments');
SELECT idem_request_abandon('k-9', 'payments');
SELECT status, attempt FROM idem_request_begin('k-9', 'payments');
COMMIT;
SELECT status, attempt, count(*) OVER () AS rows_for_k9 FROM idempotency.requests WHERE key = 'k-9';

-- 7d. What an HTTP handler needs comes back as data: the lease left of a
-- live holder (retry_after, for Retry-After), the stored body as text, byte
-- for byte, the stored headers, and whether the answer is a replay
SELECT status, attempt FROM idem_request_begin('h-1', 'payments', '{"n": 1}', '10 seconds');
-- on_conflict => 'return': a live holder is a row instead of IK002, with
-- nothing but status and retry_after (no attempt to act for), and nothing
-- written
BEGIN;
SELECT status, response, response_status, attempt, recovery_point, state,
       retry_after > '9 seconds' AND retry_after <= '10 seconds' AS retry_after_9_to_10s,
       replayed, response_body, response_headers
  FROM idem_request_begin('h-1', 'payments', '{"n": 1}', on_conflict => 'return');
SELECT txid_current_if_assigned() IS NULL AS wrote_nothing;
COMMIT;
-- IK002 stays the default: its detail, and its hint with the whole seconds
SELECT detail_seconds BETWEEN 9 AND 10 AS detail_9_to_10s, hint_seconds = ceil(detail_seconds) AS hint_rounds_up
  FROM pg_temp.lease_left($$SELECT * FROM idem_request_begin('h-1', 'payments')$$);
-- another payload is IK001 whatever on_conflict says
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('h-1', 'payments', '{"n": 2}', on_conflict => 'return')$$);
-- complete stores a body given as text (not canonical JSON, here) and
-- headers (names in lower case), and returns what it stored
SELECT * FROM idem_request_complete('h-1', 'payments', attempt => 1, response_status => 201,
    response_body => E'{"id":  "pay_h1",\n "amount": 10}',
    response_headers => '{"Content-Type": "application/json", "Set-Cookie": ["a=1", "b=2"], "location": "/payments/h1"}');
-- a replay: the same status, body text and headers, marked as a replay
SELECT status, response, response_status, response_body, response_headers, replayed, retry_after
  FROM idem_request_begin('h-1', 'payments', '{"n": 1}', on_conflict => 'return');
-- a body given as jsonb is returned as its canonical text, by complete and
-- by every replay alike
SELECT status, attempt FROM idem_request_begin('h-2', 'payments');
SELECT response, response_body, replayed FROM idem_request_complete('h-2', 'payments', '{"b": 2,  "a": [1,2]}', 1, 200);
SELECT response, response_body, replayed FROM idem_request_begin('h-2', 'payments');
-- an empty body is a body (a 204); no body is NULL
SELECT status, attempt FROM idem_request_begin('h-3', 'payments');
SELECT response_body = '' AS empty_body FROM idem_request_complete('h-3', 'payments', response_body => '', response_status => 204);
SELECT response, response_body = '' AS empty_body, response_status FROM idem_request_begin('h-3', 'payments');
-- each body is stored once: as jsonb or as text
SELECT key, response, response_body, response_headers FROM idempotency.requests
 WHERE key LIKE 'h-%' ORDER BY key;
-- a released claim whose holder is live: 'return' leaves no claim behind
SELECT status, attempt FROM idem_request_begin('h-4', 'payments', NULL, '1 hour');
SELECT idem_release('h-4', 'request:payments') AS claim_released;
SELECT status, attempt, retry_after > '59 minutes' AS retry_after_about_1h
  FROM idem_request_begin('h-4', 'payments', on_conflict => 'return');
SELECT count(*) AS claims_for_h4 FROM idempotency.claims WHERE key = 'h-4';
-- an expired lease with 'return' is taken over as usual
SELECT status, attempt FROM idem_request_begin('h-5', 'payments', NULL, '1 second');
SET idempotency.debug_clock_offset = '32h';
SELECT status, attempt, retry_after FROM idem_request_begin('h-5', 'payments', on_conflict => 'return');

-- 8. Bad input: NULL 22004, empty or invalid 22023, too long 22001
SELECT count(*) AS requests_before FROM idempotency.requests \gset
SELECT count(*) AS claims_before FROM idempotency.claims \gset
SELECT pg_temp.try($$SELECT status FROM idem_request_begin(NULL)$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k', NULL)$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('')$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k', '')$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin(repeat('k', 2001))$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k', repeat('s', 56))$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k', lease => NULL)$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k', lease => '0 seconds')$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k', lease => '-1 second')$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k', wait => '-1 second')$$);
-- absurd intervals are refused, not overflowed into an out-of-range lease
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k', lease => '300000 years')$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k', lease => '2147483647 months -2147483647 days')$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k', wait => '2147483647 days')$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k', wait => NULL)$$);
SELECT pg_temp.try($$SELECT idem_request_checkpoint('k-2', 'payments', NULL, 'x')$$);
SELECT pg_temp.try($$SELECT idem_request_checkpoint('k-2', 'payments', 0, 'x')$$);
SELECT pg_temp.try($$SELECT idem_request_checkpoint('k-2', 'payments', 1, NULL)$$);
SELECT pg_temp.try($$SELECT idem_request_checkpoint('k-2', 'payments', 1, '')$$);
SELECT pg_temp.try($$SELECT idem_request_fence('k-2', NULL, 1)$$);
SELECT pg_temp.try($$SELECT idem_request_extend('k-2', 'payments', 1, '0 seconds')$$);
SELECT pg_temp.try($$SELECT idem_request_extend('k-2', 'payments', 1, '200 years')$$);
SELECT pg_temp.try($$SELECT idem_request_complete('k-2', 'payments', '{}', -1)$$);
SELECT pg_temp.try($$SELECT idem_request_complete('k-2', 'payments', '{}', 1, 99)$$);
SELECT pg_temp.try($$SELECT idem_request_complete('k-2', 'payments', '{}', 1, 600)$$);
SELECT pg_temp.try($$SELECT idem_request_abandon('k-2', 'payments', 0)$$);
SELECT pg_temp.try($$SELECT idem_request_begin('k', 'payments', 'not json')$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k', on_conflict => NULL)$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k', on_conflict => 'ignore')$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('k', on_conflict => 'RETURN')$$);
SELECT pg_temp.try($$SELECT status FROM idem_request_complete('k-2', 'payments', '{}', response_body => '{}')$$);
-- headers: an object of strings or arrays of strings, with HTTP token names
SELECT h, pg_temp.try(q) AS error, pg_temp.detail(q, false)
  FROM unnest(ARRAY['[]', '"text/plain"', '{"a": 1}', '{"a": null}', '{"a": []}', '{"a": [1]}',
                    '{"a": ["x", ["y"]]}', '{"a": {"b": "c"}}', '{"": "x"}', '{"bad name": "x"}',
                    '{"a:b": "x"}', E'{"x-a": "1\\r\\nset-cookie: evil=1"}', '{"x-a": "\u0007"}',
                    '{"Content-Type": "a", "content-type": "b"}']) h,
       format('SELECT status FROM idem_request_complete(%L, %L, response_headers => %L)', 'k-2', 'payments', h) q;
-- none of that wrote anything
SELECT count(*) - :requests_before AS requests_written FROM idempotency.requests;
SELECT count(*) - :claims_before AS claims_written FROM idempotency.claims;

-- 9. Capabilities: every request function needs handler (for the scope);
-- no privilege on a table, no USAGE on schema idempotency
RESET idempotency.debug_clock_offset;
CREATE ROLE idem_api;
CREATE ROLE idem_nobody;
SELECT idem_grant('idem_api', 'handler', scopes => ARRAY['payments']);
SET ROLE idem_nobody;
SELECT pg_temp.try($$SELECT status FROM idem_request_begin('p-1', 'payments')$$);
SELECT pg_temp.try($$SELECT idem_request_complete('k-2', 'payments')$$);
SELECT pg_temp.try($$SELECT idem_request_fence('k-2', 'payments', 1)$$);
RESET ROLE;
SET ROLE idem_api;
SELECT status, attempt FROM idem_request_begin('p-1', 'payments');
SELECT idem_request_checkpoint('p-1', 'payments', 1, 'step');
SELECT idem_request_fence('p-1', 'payments', 1);
SELECT idem_request_complete('p-1', 'payments', '{"ok": true}', 1, 200);
SELECT status, response FROM idem_request_begin('p-1', 'payments');
RESET ROLE;
SELECT idem_revoke('idem_api') AS revoked;
DROP OWNED BY idem_api, idem_nobody;
DROP ROLE idem_api, idem_nobody;

-- 10. Maintenance makes and drops request partitions with the claims'
-- settings: a partition past its retention goes
SELECT idem_configure(retention => '1 day', partition_interval => '1 day', premake => 1);
SET idempotency.debug_clock_offset = '96h';
SELECT count(*) > 0 AS dropped_some FROM idem_maintain() WHERE action = 'drop'
   AND object LIKE 'idempotency.requests_%';
SELECT count(*) AS left_past_retention FROM idempotency.request_partitions
 WHERE upper < now() + interval '96 hours' - interval '1 day';
SELECT count(*) AS requests_left FROM idempotency.requests;
RESET idempotency.debug_clock_offset;

SET client_min_messages = warning;
DROP TABLE charges;
DROP EXTENSION idempotency CASCADE;
