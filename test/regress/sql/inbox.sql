-- Inbox: the outcomes of SPEC section 4b, to read: receive (new, duplicate,
-- IK001), bad input of every function, privileges, claim / done / fail with
-- backoff and dead letters, fencing by lease token, ordering_key runs,
-- replay of a time range, and maintenance of inbox partitions (a pinned one
-- is kept).  Time moves (always forward) with the test-only setting
-- idempotency.debug_clock_offset.  Values that differ from run to run
-- (uuids, times) are shown as comparisons.
CREATE EXTENSION idempotency;

\getenv abs_srcdir PG_ABS_SRCDIR
\set try_sql :abs_srcdir '/include/try.sql'
\i :try_sql

-- CREATE EXTENSION makes the current inbox partition and premake (4) more
SELECT state, count(*) FROM idempotency.partitions WHERE store = 'inbox' GROUP BY 1 ORDER BY 1;

-- the extension's clock (debug_clock_offset ahead of the real one)
CREATE FUNCTION pg_temp.idem_now() RETURNS timestamptz LANGUAGE sql AS $$
    SELECT clock_timestamp() + current_setting('idempotency.debug_clock_offset')::interval
$$;
-- a message's stored state, to read
CREATE FUNCTION pg_temp.msgs() RETURNS TABLE (source text, message_id text, ordering_key text,
        seq bigint, attempts int, state text, last_error text)
LANGUAGE sql AS $$
    SELECT source, message_id, ordering_key, seq, attempts,
           CASE WHEN done_at IS NOT NULL THEN 'done'
                WHEN dead_at IS NOT NULL THEN 'dead'
                WHEN lease_until > pg_temp.idem_now() THEN 'leased'
                WHEN lease_until IS NOT NULL THEN 'lease expired'
                WHEN retry_at > pg_temp.idem_now() THEN 'waiting'
                ELSE 'pending' END,
           last_error
      FROM idempotency.inbox_messages ORDER BY id
$$;

-- 1. Receive: true when stored, false for a duplicate of (source, message_id)
SELECT idem_inbox_receive('orders', 'm-1', '{"total": 10}') AS new;
SELECT idem_inbox_receive('orders', 'm-1', '{"total": 10}') AS duplicate;
-- the payload of a duplicate must be the same (jsonb: key order does not matter)
SELECT idem_inbox_receive('orders', 'm-1', '{ "total" : 10 }') AS same_payload;
SELECT pg_temp.try($$SELECT idem_inbox_receive('orders', 'm-1', '{"total": 11}')$$) AS other_payload;
-- sources are separate namespaces
SELECT idem_inbox_receive('billing', 'm-1', '{"total": 11}') AS other_source;
-- a rolled-back receive leaves nothing behind
BEGIN;
SELECT idem_inbox_receive('orders', 'm-2', '{}') AS in_rolled_back_tx;
ROLLBACK;
SELECT idem_inbox_receive('orders', 'm-2', '{"n": 2}', '{"trace": "t-2"}') AS after_rollback;
-- in one transaction: the second receive of an id is a duplicate
BEGIN;
SELECT idem_inbox_receive('orders', 'm-3', '{}'), idem_inbox_receive('orders', 'm-3', '{}');
COMMIT;
-- it is a claim in scope inbox:<source>
SELECT scope, key FROM idempotency.claims WHERE scope LIKE 'inbox:%' ORDER BY 1, 2;
SELECT source, message_id, ordering_key, seq, payload, headers, attempts,
       lease_token IS NULL AND lease_until IS NULL AND retry_at IS NULL
         AND done_at IS NULL AND dead_at IS NULL AND last_error IS NULL AS fresh,
       received_at BETWEEN now() - interval '1 minute' AND now() + interval '1 minute' AS received_now,
       bucket IS NOT NULL AS has_bucket
  FROM idempotency.inbox_messages ORDER BY id;
-- ids sort by receipt and locate the partition
SELECT count(*) AS out_of_order FROM (
    SELECT id, received_at, lag(received_at) OVER (ORDER BY id) AS prev FROM idempotency.inbox_messages) m
 WHERE prev > received_at;
SELECT count(*) AS in_wrong_partition
  FROM idempotency.inbox_messages m JOIN idempotency.inbox_partitions p ON p.bucket = m.bucket
 WHERE m.tableoid <> p.relid;
-- no ordering key, no counter
SELECT count(*) AS counters FROM idempotency.inbox_sequences;
-- a source of 57 bytes fits (the scope 'inbox:' || source is at most 63)
SELECT idem_inbox_receive(repeat('s', 57), 'm-1', '{}') AS longest_source;
SELECT idem_inbox_receive('orders', repeat('k', 2000), '{}') AS longest_message_id;

-- bad input
SELECT pg_temp.try($$SELECT idem_inbox_receive(NULL, 'm', '{}')$$);
SELECT pg_temp.try($$SELECT idem_inbox_receive('orders', NULL, '{}')$$);
SELECT pg_temp.try($$SELECT idem_inbox_receive('orders', 'm', NULL)$$);
SELECT pg_temp.try($$SELECT idem_inbox_receive('', 'm', '{}')$$);
SELECT pg_temp.try($$SELECT idem_inbox_receive('orders', '', '{}')$$);
SELECT pg_temp.try($$SELECT idem_inbox_receive(repeat('s', 58), 'm', '{}')$$);
SELECT pg_temp.try($$SELECT idem_inbox_receive('orders', repeat('k', 2001), '{}')$$);
SELECT pg_temp.try($$SELECT idem_inbox_receive('orders', 'm', '{}', '[]')$$);
SELECT pg_temp.try($$SELECT idem_inbox_receive('orders', 'm', '{}', '"x"')$$);
SELECT pg_temp.try($$SELECT idem_inbox_receive('orders', 'm', '{}', '{"ordering_key": {"a": 1}}')$$);
SELECT pg_temp.try($$SELECT idem_inbox_receive('orders', 'm', '{}', '{"ordering_key": true}')$$);
SELECT pg_temp.try($$SELECT idem_inbox_receive('orders', 'm', '{}', '{"ordering_key": ""}')$$);
SELECT pg_temp.try($$SELECT idem_inbox_receive('orders', 'm', '{}', jsonb_build_object('ordering_key', repeat('k', 2001)))$$);
SELECT pg_temp.try($$SELECT idem_inbox_claim(NULL)$$);
SELECT pg_temp.try($$SELECT idem_inbox_claim(0)$$);
SELECT pg_temp.try($$SELECT idem_inbox_claim(10001)$$);
SELECT pg_temp.try($$SELECT idem_inbox_claim(10, NULL)$$);
SELECT pg_temp.try($$SELECT idem_inbox_claim(10, '0 seconds')$$);
SELECT pg_temp.try($$SELECT idem_inbox_claim(10, '-1 second')$$);
SELECT pg_temp.try($$SELECT idem_inbox_claim(10, '300000 years')$$);
SELECT pg_temp.try($$SELECT idem_inbox_claim(10, '1 minute', ARRAY['orders', NULL])$$);
SELECT pg_temp.try($$SELECT idem_inbox_claim(10, '1 minute', ARRAY[['a'], ['b']])$$);
SELECT pg_temp.try($$SELECT idem_inbox_done(NULL)$$);
SELECT pg_temp.try($$SELECT idem_inbox_done(ARRAY[NULL]::uuid[])$$);
SELECT pg_temp.try($$SELECT idem_inbox_fail(NULL, 'x')$$);
SELECT pg_temp.try($$SELECT idem_inbox_fail(gen_random_uuid(), NULL)$$);
SELECT pg_temp.try($$SELECT idem_inbox_fail(gen_random_uuid(), 'x', '-1 second')$$);
SELECT pg_temp.try($$SELECT idem_inbox_fail(gen_random_uuid(), 'x', '2147483647 months')$$);
SELECT pg_temp.try($$SELECT idem_inbox_replay(NULL, now())$$);
SELECT pg_temp.try($$SELECT idem_inbox_replay('', now())$$);
SELECT pg_temp.try($$SELECT idem_inbox_replay(repeat('s', 58), now())$$);
SELECT pg_temp.try($$SELECT idem_inbox_replay('orders', NULL)$$);
SELECT pg_temp.try($$SELECT idem_inbox_replay('orders', now(), NULL)$$);
SELECT pg_temp.try($$SELECT idem_inbox_replay('orders', now(), now() - interval '1 second')$$);
-- unknown ids and ids of no message change nothing
SELECT idem_inbox_done(ARRAY[gen_random_uuid(), '01900000-0000-7000-8001-000000000000']) AS done_unknown;
SELECT pg_temp.try($$SELECT idem_inbox_fail(gen_random_uuid(), 'x')$$) AS fail_unknown;
SELECT count(*) AS messages_after_bad_input, count(*) FILTER (WHERE attempts > 0) AS touched
  FROM idempotency.inbox_messages;

-- 2. Capabilities: handler receives, relay claims and settles, operator
-- replays; no table privilege is needed (or used)
CREATE ROLE regress_inbox_nobody;
CREATE ROLE regress_inbox_app;
CREATE ROLE regress_inbox_worker;
-- what README "Inbox" tells to grant
SELECT idem_grant('regress_inbox_app', 'handler');
SELECT idem_grant('regress_inbox_worker', 'relay');
SELECT idem_grant('regress_inbox_worker', 'operator', sources => ARRAY['orders']);
SET ROLE regress_inbox_nobody;
SELECT pg_temp.try($$SELECT idem_inbox_receive('orders', 'p-1', '{}')$$) AS nobody_receive;
SELECT pg_temp.try($$SELECT idem_inbox_claim()$$) AS nobody_claim;
SELECT pg_temp.try($$SELECT idem_inbox_done(ARRAY['01900000-0000-7000-8001-000000000000'::uuid])$$) AS nobody_done;
SELECT pg_temp.try($$SELECT idem_inbox_fail((SELECT '01900000-0000-7000-8000-000000000000'::uuid), 'x')$$) AS nobody_fail;
SELECT pg_temp.try($$SELECT idem_inbox_replay('orders', '-infinity')$$) AS nobody_replay;
RESET ROLE;
-- table privileges on the claims do not store a message
GRANT SELECT, INSERT ON idempotency.claims TO regress_inbox_nobody;
SET ROLE regress_inbox_nobody;
SELECT pg_temp.try($$SELECT idem_inbox_receive('orders', 'p-1', '{}')$$) AS claims_only_receive;
RESET ROLE;
SET ROLE regress_inbox_app;
SELECT idem_inbox_receive('orders', 'p-1', '{}', '{"ordering_key": "perm"}') AS app_receive;
SELECT idem_inbox_receive('orders', 'p-2', '{}', '{"ordering_key": "perm"}') AS app_receive;
SELECT pg_temp.try($$SELECT idem_inbox_claim()$$) AS app_claim;
SELECT pg_temp.try($$SELECT count(*) FROM idempotency.inbox_messages$$) AS app_reads;
RESET ROLE;
SET ROLE regress_inbox_worker;
CREATE TEMP TABLE w AS SELECT * FROM idem_inbox_claim(100, '1 minute', ARRAY['orders']);
SELECT left(message_id, 8) AS message_id, attempts FROM w ORDER BY id;
SELECT idem_inbox_done(ARRAY(SELECT id FROM w), (SELECT lease_token FROM w LIMIT 1)) AS worker_done;
SELECT idem_inbox_replay('orders', '-infinity', 'infinity') AS worker_replay;
SELECT pg_temp.try($$SELECT idem_inbox_receive('orders', 'p-3', '{}')$$) AS worker_receive;
RESET ROLE;
REVOKE ALL ON idempotency.claims FROM regress_inbox_nobody;
SELECT idem_revoke('regress_inbox_app') + idem_revoke('regress_inbox_worker') AS revoked;
DROP TABLE w;
DROP ROLE regress_inbox_nobody;
DROP ROLE regress_inbox_app;
DROP ROLE regress_inbox_worker;
-- start over with the messages of section 1 pending
SELECT idem_inbox_done(ARRAY(SELECT id FROM idempotency.inbox_messages)) AS done_by_hand;
CREATE TEMP TABLE c0 AS SELECT * FROM idem_inbox_claim();
SELECT count(*) AS claimable_after_done FROM c0;
DROP TABLE c0;

-- 3. Claim: a batch of messages under one lease token and lease_until,
-- attempts counted; not handed out again while the lease is live
SELECT idem_inbox_receive('pay', 'a', '{"n": 1}'), idem_inbox_receive('pay', 'b', '{"n": 2}'),
       idem_inbox_receive('pay', 'c', '{"n": 3}'), idem_inbox_receive('ship', 'd', '{"n": 4}');
CREATE TEMP TABLE c1 AS SELECT * FROM idem_inbox_claim(2, '30 seconds', ARRAY['pay']);
SELECT count(*) AS handed_out, count(DISTINCT lease_token) AS tokens, count(DISTINCT lease_until) AS untils,
       bool_and(source = 'pay') AS only_pay, bool_and(attempts = 1) AS first_attempt,
       bool_and(lease_until - pg_temp.idem_now() BETWEEN '25 seconds' AND '30 seconds') AS leased_30s
  FROM c1;
SELECT message_id, payload, headers FROM c1 ORDER BY id;
CREATE TEMP TABLE c2 AS SELECT * FROM idem_inbox_claim();
SELECT message_id FROM c2 ORDER BY id;
SELECT count(*) AS nothing_left FROM idem_inbox_claim();

-- 4. Done: only messages whose live lease the token is; returns how many
SELECT idem_inbox_done(ARRAY(SELECT id FROM c1), gen_random_uuid()) AS stale_token;
SELECT idem_inbox_done(ARRAY(SELECT id FROM c1 UNION ALL SELECT id FROM c2),
                       (SELECT lease_token FROM c1 LIMIT 1)) AS own_lease;
SELECT idem_inbox_done(ARRAY(SELECT id FROM c1), (SELECT lease_token FROM c1 LIMIT 1)) AS again;
SELECT * FROM pg_temp.msgs() WHERE message_id IN ('a', 'b', 'c', 'd');

-- 5. Fail: records the error, ends the lease, backoff 1 s after the first
-- failure, then 2 s, 4 s ...; or after retry_after
SELECT idem_inbox_fail((SELECT id FROM c2 WHERE message_id = 'c'), 'db down', NULL,
                       (SELECT lease_token FROM c2 LIMIT 1));
SELECT message_id, attempts, last_error, lease_token IS NULL AS lease_ended,
       retry_at - pg_temp.idem_now() BETWEEN '0.5 seconds' AND '1 second' AS retry_in_1s
  FROM idempotency.inbox_messages WHERE message_id = 'c';
SELECT count(*) AS claimed_while_waiting FROM idem_inbox_claim();
-- a stale token fails nothing
SELECT idem_inbox_fail((SELECT id FROM c2 WHERE message_id = 'd'), 'late', NULL, gen_random_uuid());
SELECT message_id, last_error, lease_token IS NOT NULL AS still_leased
  FROM idempotency.inbox_messages WHERE message_id = 'd';
SET idempotency.debug_clock_offset = 2;
CREATE TEMP TABLE c3 AS SELECT * FROM idem_inbox_claim();
SELECT message_id, attempts FROM c3 ORDER BY id;
SELECT idem_inbox_fail((SELECT id FROM c3), 'db still down', NULL, (SELECT lease_token FROM c3));
SELECT retry_at - pg_temp.idem_now() BETWEEN '1.5 seconds' AND '2 seconds' AS retry_in_2s
  FROM idempotency.inbox_messages WHERE message_id = 'c';
SELECT idem_inbox_fail((SELECT id FROM c3), 'by hand', '1 hour');
SELECT retry_at - pg_temp.idem_now() BETWEEN '59 minutes' AND '1 hour' AS retry_in_1h, attempts
  FROM idempotency.inbox_messages WHERE message_id = 'c';

-- 6. Dead letters: after inbox_max_attempts failed attempts (a fail, or an
-- expired lease) a message is dead and listed in idempotency.inbox_dead
SET idempotency.inbox_max_attempts = 3;
SET idempotency.debug_clock_offset = 3700;
CREATE TEMP TABLE c4 AS SELECT * FROM idem_inbox_claim(10, '10 seconds');
SELECT message_id, attempts FROM c4 ORDER BY id;
-- d's lease (30 s) expired long ago: handed out again as a new attempt
SELECT idem_inbox_fail((SELECT id FROM c4 WHERE message_id = 'c'), 'poison', '0',
                       (SELECT lease_token FROM c4 LIMIT 1));
SELECT source, message_id, attempts, last_error, dead_at IS NOT NULL AS dead FROM idempotency.inbox_dead;
-- the third attempt of d expires: dead at the next claim
SET idempotency.debug_clock_offset = 3720;
SELECT idem_inbox_receive('ship', 'e', '{}') AS more;
CREATE TEMP TABLE c5 AS SELECT * FROM idem_inbox_claim(10, '10 seconds');
SELECT message_id, attempts FROM c5 ORDER BY id;
SELECT idem_inbox_done(ARRAY(SELECT id FROM c5 WHERE message_id = 'e'), (SELECT lease_token FROM c5 LIMIT 1)) AS done_e;
SET idempotency.debug_clock_offset = 3740;
SELECT count(*) AS claimed FROM idem_inbox_claim();
SELECT source, message_id, attempts, last_error FROM idempotency.inbox_dead ORDER BY message_id;
-- a dead message is done only by hand (no token)
SELECT idem_inbox_done(ARRAY(SELECT id FROM idempotency.inbox_dead WHERE message_id = 'd'),
                       (SELECT lease_token FROM c4 LIMIT 1)) AS dead_with_token;
SELECT * FROM pg_temp.msgs() WHERE message_id IN ('c', 'd', 'e');
RESET idempotency.inbox_max_attempts;

-- 7. Ordering keys: per (source, ordering_key) seq counts 1, 2, 3 ... in
-- receipt order; one run at a time, from the key's first message not done;
-- a later message is not handed out while an earlier one is leased,
-- waiting for a retry, or dead
SELECT idem_inbox_receive('acct', 'o-' || i, jsonb_build_object('i', i),
                          jsonb_build_object('ordering_key', CASE WHEN i % 2 = 1 THEN 'k1' ELSE 'k2' END))
  FROM generate_series(1, 6) i;
SELECT idem_inbox_receive('acct', 'o-7', '{}', '{"ordering_key": 42}') AS numeric_key;
SELECT message_id, ordering_key, seq FROM idempotency.inbox_messages WHERE source = 'acct' ORDER BY id;
SELECT source, ordering_key, last_seq FROM idempotency.inbox_sequences ORDER BY 1, 2;
-- the same key in another source is another sequence
SELECT idem_inbox_receive('acct2', 'o-1', '{}', '{"ordering_key": "k1"}');
SELECT seq FROM idempotency.inbox_messages WHERE source = 'acct2';
-- a run is handed out in seq order, up to the batch
CREATE TEMP TABLE r1 AS SELECT *, row_number() OVER () AS pos FROM idem_inbox_claim(2, '1 minute', ARRAY['acct']);
SELECT m.message_id, m.ordering_key, m.seq FROM r1 JOIN idempotency.inbox_messages m USING (id) ORDER BY pos;
-- the rest of a leased key waits; other keys flow
CREATE TEMP TABLE r2 AS SELECT *, row_number() OVER () AS pos FROM idem_inbox_claim(10, '1 minute', ARRAY['acct']);
SELECT m.message_id, m.ordering_key, m.seq FROM r2 JOIN idempotency.inbox_messages m USING (id) ORDER BY pos;
SELECT count(*) AS while_leased FROM idem_inbox_claim(10, '1 minute', ARRAY['acct']);
-- done with the head only: the rest of the run stays leased
SELECT idem_inbox_done(ARRAY(SELECT id FROM r1 WHERE pos = 1), (SELECT lease_token FROM r1 LIMIT 1));
SELECT count(*) AS while_run_leased FROM idem_inbox_claim(10, '1 minute', ARRAY['acct']);
-- a failed message holds its key while it waits; others of the key wait too
SELECT idem_inbox_fail((SELECT id FROM r1 WHERE pos = 2), 'later', '1 minute', (SELECT lease_token FROM r1 LIMIT 1));
SELECT count(*) AS while_waiting FROM idem_inbox_claim(10, '1 minute', ARRAY['acct']);
SET idempotency.debug_clock_offset = 3820;
CREATE TEMP TABLE r3 AS SELECT *, row_number() OVER () AS pos FROM idem_inbox_claim(10, '1 minute', ARRAY['acct']);
SELECT m.message_id, m.ordering_key, m.seq, r3.attempts FROM r3 JOIN idempotency.inbox_messages m USING (id) ORDER BY pos;
-- a dead message blocks its key
SET idempotency.inbox_max_attempts = 2;
SELECT idem_inbox_fail((SELECT id FROM r3 WHERE pos = 1), 'poison', '0', (SELECT lease_token FROM r3 LIMIT 1));
SELECT message_id, seq FROM idempotency.inbox_dead WHERE source = 'acct';
RESET idempotency.inbox_max_attempts;
-- once the leases have expired, k1 and 42 are handed out again, k2 not
SET idempotency.debug_clock_offset = 3890;
CREATE TEMP TABLE r4 AS SELECT *, row_number() OVER () AS pos FROM idem_inbox_claim(10, '1 minute', ARRAY['acct']);
SELECT m.message_id, m.ordering_key, m.seq, r4.attempts FROM r4 JOIN idempotency.inbox_messages m USING (id) ORDER BY pos;
SELECT * FROM pg_temp.msgs() WHERE source = 'acct';

-- 8. Replay: the done and dead messages of a source received in
-- [since, until) become claimable again, attempts reset; receive stays a
-- duplicate
SET idempotency.debug_clock_offset = 3900;
SELECT idem_inbox_receive('replay', 'x-1', '{}');
SET idempotency.debug_clock_offset = 3910;
SELECT idem_inbox_receive('replay', 'x-2', '{}');
SET idempotency.debug_clock_offset = 3920;
SELECT idem_inbox_receive('replay', 'x-3', '{}');
SELECT idem_inbox_receive('replay', 'x-4', '{}');
CREATE TEMP TABLE x1 AS SELECT * FROM idem_inbox_claim(10, '1 minute', ARRAY['replay']);
SELECT idem_inbox_done(ARRAY(SELECT id FROM x1 WHERE message_id <> 'x-4'), (SELECT lease_token FROM x1 LIMIT 1)) AS done;
SELECT idem_inbox_fail((SELECT id FROM x1 WHERE message_id = 'x-4'), 'bug', '0', (SELECT lease_token FROM x1 LIMIT 1));
SELECT received_at AS x2_at FROM idempotency.inbox_messages WHERE message_id = 'x-2' \gset
SELECT received_at AS x3_at FROM idempotency.inbox_messages WHERE message_id = 'x-3' \gset
-- [x-2, x-3): exactly x-2 (since is inclusive, until exclusive)
SELECT idem_inbox_replay('replay', :'x2_at', :'x3_at') AS replayed;
SELECT * FROM pg_temp.msgs() WHERE message_id LIKE 'x-%';
CREATE TEMP TABLE x2 AS SELECT * FROM idem_inbox_claim(10, '1 minute', ARRAY['replay']);
SELECT message_id, attempts FROM x2 ORDER BY id;
SELECT idem_inbox_done(ARRAY(SELECT id FROM x2), (SELECT lease_token FROM x2 LIMIT 1)) AS done;
-- [x-2, end): x-2, x-3 (done) and x-4 (waiting for a retry, not yet dead: untouched)
SELECT idem_inbox_replay('replay', :'x2_at', 'infinity') AS replayed;
SELECT * FROM pg_temp.msgs() WHERE message_id LIKE 'x-%';
-- other sources are untouched; receive is still a duplicate
SELECT idem_inbox_replay('nothing-here', '-infinity', 'infinity') AS other_source;
SELECT idem_inbox_receive('replay', 'x-2', '{}') AS received_again;
-- section 7 replayed: the dead head of k2 and the done head of k1 are
-- pending again; k2 flows from its head, in order; k1 waits while the
-- rest of it is still leased (one run at a time per key)
SELECT idem_inbox_replay('acct', '-infinity', 'infinity') AS replayed_acct;
CREATE TEMP TABLE r5 AS SELECT *, row_number() OVER () AS pos FROM idem_inbox_claim(100, '1 minute', ARRAY['acct']);
SELECT m.message_id, m.ordering_key, m.seq, r5.attempts FROM r5 JOIN idempotency.inbox_messages m USING (id) ORDER BY pos;
SELECT * FROM pg_temp.msgs() WHERE source = 'acct';

-- 8b. Extend: a worker slower than its lease prolongs it, and its messages
-- are not handed out again meanwhile.  Fenced like done: only a token's
-- live lease, only its messages not settled; it returns how many it covers
SET idempotency.debug_clock_offset = 4000;
SELECT count(*) FILTER (WHERE r) AS received
  FROM (SELECT idem_inbox_receive('slow', 's-' || g, '{}') AS r FROM generate_series(1, 3) g) x;
CREATE TEMP TABLE s1 AS SELECT * FROM idem_inbox_claim(10, '10 seconds', ARRAY['slow']);
SELECT lease_token AS s1_token FROM s1 LIMIT 1 \gset
SELECT count(*) AS leased FROM s1;
SELECT idem_inbox_extend(:'s1_token', '1 minute') AS covered;
SELECT count(DISTINCT lease_until) AS untils,
       bool_and(lease_until - pg_temp.idem_now() BETWEEN '55 seconds' AND '1 minute') AS leased_1m,
       bool_and(attempts = 1) AS attempts_unchanged
  FROM idempotency.inbox_messages WHERE source = 'slow';
-- 30 seconds on, past the lease the claim gave: still held
SET idempotency.debug_clock_offset = 4030;
SELECT count(*) AS handed_out_again FROM idem_inbox_claim(10, '10 seconds', ARRAY['slow']);
SELECT * FROM pg_temp.msgs() WHERE source = 'slow';
-- done and failed messages leave the lease; the rest it covers
SELECT idem_inbox_done(ARRAY(SELECT id FROM s1 WHERE message_id = 's-1'), :'s1_token') AS done;
SELECT idem_inbox_extend(:'s1_token', '1 minute') AS covered;
SELECT idem_inbox_fail((SELECT id FROM s1 WHERE message_id = 's-2'), 'later', '1 hour', :'s1_token');
SELECT idem_inbox_extend(:'s1_token', '1 minute') AS covered;
SELECT idem_inbox_extend(gen_random_uuid(), '1 minute') AS unknown_token;
-- the lease runs out: extending it is too late; another worker takes s-3,
-- and the first worker's token extends, settles and fails nothing of it
SET idempotency.debug_clock_offset = 4200;
SELECT idem_inbox_extend(:'s1_token', '1 hour') AS expired;
CREATE TEMP TABLE s2 AS SELECT * FROM idem_inbox_claim(10, '10 seconds', ARRAY['slow']);
SELECT lease_token AS s2_token FROM s2 LIMIT 1 \gset
SELECT message_id, attempts FROM s2;
SELECT idem_inbox_extend(:'s1_token', '1 hour') AS old_token;
SELECT idem_inbox_done(ARRAY(SELECT id FROM s2), :'s1_token') AS old_token_done;
SELECT lease_until - pg_temp.idem_now() BETWEEN '5 seconds' AND '10 seconds' AS new_lease_untouched
  FROM idempotency.inbox_messages WHERE message_id = 's-3';
SELECT idem_inbox_extend(:'s2_token', '1 hour') AS new_token;
-- a message that died holding the lease is not covered
SET idempotency.inbox_max_attempts = 2;
SET idempotency.debug_clock_offset = 7900;
SELECT count(*) AS claimed FROM idem_inbox_claim(10, '10 seconds', ARRAY['slow']);
SELECT idem_inbox_extend(:'s2_token', '1 hour') AS dead_not_covered;
RESET idempotency.inbox_max_attempts;
SELECT * FROM pg_temp.msgs() WHERE source = 'slow';
-- bad input: NULL 22004, zero, negative or absurd lease 22023, wrong type
-- 22P02 / 22007; none of it changes a lease
CREATE TEMP TABLE s_before AS SELECT id, lease_token, lease_until FROM idempotency.inbox_messages WHERE source = 'slow';
SELECT pg_temp.try($$SELECT idem_inbox_extend(NULL, '1 minute')$$);
SELECT pg_temp.try(format($$SELECT idem_inbox_extend(%L, NULL)$$, :'s2_token'));
SELECT pg_temp.try(format($$SELECT idem_inbox_extend(%L, '0 seconds')$$, :'s2_token'));
SELECT pg_temp.try(format($$SELECT idem_inbox_extend(%L, '-1 second')$$, :'s2_token'));
SELECT pg_temp.try(format($$SELECT idem_inbox_extend(%L, '300000 years')$$, :'s2_token'));
SELECT pg_temp.try(format($$SELECT idem_inbox_extend(%L, '2147483647 months -2147483647 days')$$, :'s2_token'));
SELECT pg_temp.try($$SELECT idem_inbox_extend('not a token', '1 minute')$$);
SELECT pg_temp.try(format($$SELECT idem_inbox_extend(%L, 'a while')$$, :'s2_token'));
SELECT count(*) AS leases_changed
  FROM idempotency.inbox_messages m JOIN s_before b USING (id)
 WHERE m.lease_token IS DISTINCT FROM b.lease_token OR m.lease_until IS DISTINCT FROM b.lease_until;
-- capabilities: extend needs relay (the worker's grant of README "Inbox"),
-- table privileges do nothing
SELECT idem_inbox_receive('slow', 's-4', '{}') AS received;
CREATE TEMP TABLE s3 AS SELECT * FROM idem_inbox_claim(10, '10 seconds', ARRAY['slow']);
SELECT lease_token AS s3_token FROM s3 LIMIT 1 \gset
CREATE ROLE regress_inbox_slow;
GRANT USAGE ON SCHEMA idempotency TO regress_inbox_slow;
GRANT SELECT ON idempotency.inbox_messages TO regress_inbox_slow;
SET ROLE regress_inbox_slow;
SELECT pg_temp.try(format($$SELECT idem_inbox_extend(%L, '1 minute')$$, :'s3_token')) AS select_only;
RESET ROLE;
SELECT idem_grant('regress_inbox_slow', 'relay');
SET ROLE regress_inbox_slow;
SELECT idem_inbox_extend(:'s3_token', '1 minute') AS worker_extend;
RESET ROLE;
SELECT idem_revoke('regress_inbox_slow') AS revoked;
REVOKE ALL ON idempotency.inbox_messages FROM regress_inbox_slow;
REVOKE ALL ON SCHEMA idempotency FROM regress_inbox_slow;
DROP ROLE regress_inbox_slow;
DROP TABLE s1, s2, s3, s_before;

-- 9. Maintenance makes and drops inbox partitions like the outbox's, but
-- keeps a partition that holds a message not done (pinned)
RESET idempotency.debug_clock_offset;
SELECT idem_inbox_done(ARRAY(SELECT id FROM idempotency.inbox_messages)) > 0 AS all_done;
SELECT idem_configure(retention => '1 day', partition_interval => '1 hour', premake => 2);
SELECT count(*) AS gaps FROM (
    SELECT upper, lead(lower) OVER (ORDER BY lower) AS next_lower FROM idempotency.inbox_partitions) r
 WHERE next_lower IS NOT NULL AND next_lower <> upper;
SELECT idem_inbox_receive('keep', 'k-1', '{}') AS pending;
SELECT tableoid::regclass AS keep_part FROM idempotency.inbox_messages WHERE source = 'keep' \gset
SELECT count(*) AS parts_before FROM idempotency.inbox_partitions \gset
-- six days later every partition made so far is past its retention: the
-- one with the pending message is pinned, the others go
SET idempotency.debug_clock_offset = '144h';
CREATE TEMP TABLE round1 AS SELECT * FROM idem_maintain();
SELECT count(*) FILTER (WHERE action = 'create') > 0 AS made_inbox_partitions,
       count(*) FILTER (WHERE action = 'drop') = :parts_before - 1 AS dropped_all_but_one,
       count(*) FILTER (WHERE action = 'keep (pinned)' AND object = :'keep_part') AS kept_pinned
  FROM round1 WHERE object LIKE 'idempotency.inbox%';
SELECT idempotency.inbox_partition_pinned(:'keep_part') AS pinned,
       (SELECT count(*) FROM idempotency.inbox_messages WHERE source = 'keep') AS messages_kept;
SELECT store, count(*) > 0 AS listed FROM idempotency.partitions WHERE store = 'inbox' GROUP BY 1;
-- a dead message pins too; done, the partition goes
SET idempotency.inbox_max_attempts = 1;
CREATE TEMP TABLE k1 AS SELECT * FROM idem_inbox_claim(10, '1 minute', ARRAY['keep']);
SELECT idem_inbox_fail((SELECT id FROM k1), 'poison', NULL, (SELECT lease_token FROM k1));
RESET idempotency.inbox_max_attempts;
SELECT count(*) AS dead, idempotency.inbox_partition_pinned(:'keep_part') AS pinned
  FROM idempotency.inbox_dead WHERE source = 'keep';
SELECT count(*) AS keep_part_dropped FROM idem_maintain() WHERE action = 'drop' AND object = :'keep_part';
SELECT idem_inbox_done(ARRAY(SELECT id FROM k1)) AS done_by_hand;
SELECT idempotency.inbox_partition_pinned(:'keep_part') AS pinned;
SELECT count(*) AS keep_part_dropped FROM idem_maintain() WHERE action = 'drop' AND object = :'keep_part';
SELECT to_regclass(:'keep_part') IS NULL AS keep_part_gone;
-- receive goes on into the new partitions
SELECT idem_inbox_receive('keep', 'k-2', '{}') AS received;
SELECT count(*) AS in_range
  FROM idempotency.inbox_messages m JOIN idempotency.inbox_partitions p ON p.bucket = m.bucket
 WHERE m.source = 'keep' AND p.lower <= m.received_at AND m.received_at < p.upper;
RESET idempotency.debug_clock_offset;

SET client_min_messages = warning;
DROP EXTENSION idempotency CASCADE;
