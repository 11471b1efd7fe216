-- Outbox: the main outcomes of SPEC section 4, to read: emit, claim, ack,
-- nack and backoff, dead letters (block and skip), redrive and discard,
-- fencing by lease token, the messages of outbox_mode 'wal' (and the
-- backlog, which does not count them), two-phase commit of emits, the
-- partitions view and maintenance of outbox partitions.  Time moves (always
-- forward) with the test-only setting idempotency.debug_clock_offset.
-- Values that differ from run to run (uuids, times) are shown as
-- comparisons.
CREATE EXTENSION idempotency;

\getenv abs_srcdir PG_ABS_SRCDIR
\set try_sql :abs_srcdir '/include/try.sql'
\i :try_sql

-- The partitions view lists claims and outbox partitions (column store);
-- CREATE EXTENSION makes the current partition and premake (4) more of each.
SELECT store, state, count(*) FROM idempotency.partitions WHERE store IN ('claims', 'outbox')
 GROUP BY 1, 2 ORDER BY 1, 2;

-- 1. Emit: seq counts 1, 2, 3 ... per (aggregate_type, aggregate_id)
SELECT aggregate_type, aggregate_id, seq, event_type, payload, headers, attempts,
       lease_token IS NULL AND lease_until IS NULL AS no_lease
  FROM idem_outbox_emit('order', 'o-1', 'created', '{"total": 10}');
SELECT seq, headers FROM idem_outbox_emit('order', 'o-1', 'paid', '{"total": 10}', '{"trace": "t-1"}');
SELECT seq FROM idem_outbox_emit('order', 'o-2', 'created', '{"total": 7}');
-- what rolls back leaves no gap
BEGIN;
SELECT seq FROM idem_outbox_emit('order', 'o-1', 'cancelled', '{}');
ROLLBACK;
SELECT seq FROM idem_outbox_emit('order', 'o-1', 'shipped', '{}');
-- a batch, in array order
SELECT aggregate_id, seq, event_type
  FROM idem_outbox_emit_many('order', ARRAY['o-3', 'o-2', 'o-3'], ARRAY['created', 'paid', 'paid'],
                             ARRAY['{}', '{"total": 7}', '{}']::jsonb[]);
SELECT aggregate_id, seq, event_type, payload, headers FROM idempotency.outbox_events ORDER BY aggregate_id, seq;
-- table-mode emits write no counter: seq comes from the events
SELECT count(*) AS counters FROM idempotency.outbox_sequences;

-- bad input
SELECT pg_temp.try($$SELECT idem_outbox_emit(NULL, 'o-1', 'x', '{}')$$);
SELECT pg_temp.try($$SELECT idem_outbox_emit('order', '', 'x', '{}')$$);
SELECT pg_temp.try($$SELECT idem_outbox_emit('order', 'o-1', 'x', '{}', '[]')$$);
SELECT pg_temp.try($$SELECT idem_outbox_emit(repeat('t', 64), 'o-1', 'x', '{}')$$);
SELECT pg_temp.try($$SELECT idem_outbox_emit_many('order', ARRAY['a', 'b'], ARRAY['x'], ARRAY['{}', '{}']::jsonb[])$$);
SELECT pg_temp.try($$SELECT idem_outbox_emit_many('order', ARRAY['a', NULL], ARRAY['x', 'y'], ARRAY['{}', '{}']::jsonb[])$$);
SELECT pg_temp.try($$SELECT idem_outbox_claim(0)$$);
SELECT pg_temp.try($$SELECT idem_outbox_claim(10, '-1 second')$$);
SELECT pg_temp.try($$SELECT idem_outbox_claim(10, '300000 years')$$);
SELECT pg_temp.try($$SELECT idem_outbox_ack(NULL)$$);
SELECT pg_temp.try($$SELECT idem_outbox_nack(gen_random_uuid(), 'x', '-1 second')$$);
SELECT pg_temp.try($$SELECT idem_outbox_nack(gen_random_uuid(), 'x', '2147483647 days')$$);
SELECT pg_temp.try($$SELECT idem_outbox_extend(gen_random_uuid(), '0 seconds')$$);
SELECT pg_temp.try($$SELECT idem_outbox_redrive(NULL)$$);
SELECT count(*) AS events_after_bad_input FROM idempotency.outbox_events;

-- 2. Claim: leases aggregates and hands out each one's run from its head, in
-- seq order, all under one lease token and lease_until
CREATE TEMP TABLE c1 AS SELECT * FROM idem_outbox_claim();
SELECT aggregate_id, seq, event_type, attempts,
       lease_token = (SELECT lease_token FROM c1 LIMIT 1) AS same_token,
       lease_until = (SELECT lease_until FROM c1 LIMIT 1) AS same_until,
       lease_until - now() BETWEEN '20 seconds' AND '30 seconds' AS leased_30s
  FROM c1 ORDER BY aggregate_id, seq;
-- another relay gets nothing while those leases are live
SELECT count(*) AS second_relay FROM idem_outbox_claim();
SELECT aggregate_id, acked_seq, leased_seq, attempts, lease_token IS NOT NULL AS leased
  FROM idempotency.outbox_deliveries ORDER BY 1;

-- 3. Ack: marks delivered the contiguous prefix among the ids given, returns
-- how many; a fully acked run ends its lease
SELECT idem_outbox_ack(ARRAY(SELECT id FROM c1 WHERE aggregate_id = 'o-1' AND seq IN (1, 3)),
                       (SELECT lease_token FROM c1 LIMIT 1)) AS acked_1_and_3;
SELECT idem_outbox_ack(ARRAY(SELECT id FROM c1 WHERE aggregate_id IN ('o-1', 'o-3')),
                       (SELECT lease_token FROM c1 LIMIT 1)) AS acked_rest_of_o1_o3;
SELECT idem_outbox_ack(ARRAY[gen_random_uuid()], (SELECT lease_token FROM c1 LIMIT 1)) AS acked_unknown;
SELECT aggregate_id, acked_seq, leased_seq, lease_token IS NOT NULL AS leased
  FROM idempotency.outbox_deliveries ORDER BY 1;
-- o-1 is free again: a new event there is claimable at once
SELECT seq FROM idem_outbox_emit('order', 'o-1', 'delivered', '{}');
CREATE TEMP TABLE c2 AS SELECT * FROM idem_outbox_claim();
SELECT aggregate_id, seq, attempts FROM c2 ORDER BY 1, 2;
SELECT idem_outbox_ack(ARRAY(SELECT id FROM c2), (SELECT lease_token FROM c2 LIMIT 1)) AS acked;

-- 4. Nack: ends the lease, records the error, parks the aggregate for a
-- backoff (1 second after the first failure, then 2, 4 ...)
SELECT idem_outbox_nack((SELECT id FROM c1 WHERE aggregate_id = 'o-2' AND seq = 1), 'broker down',
                        NULL, (SELECT lease_token FROM c1 LIMIT 1));
SELECT aggregate_id, acked_seq, attempts, last_error, lease_token IS NULL AS lease_ended,
       retry_at > now() AND retry_at <= now() + interval '1 second' AS retry_within_1s
  FROM idempotency.outbox_deliveries WHERE aggregate_id = 'o-2';
SELECT count(*) AS claimed_while_parked FROM idem_outbox_claim();
SET idempotency.debug_clock_offset = 2;
CREATE TEMP TABLE c3 AS SELECT * FROM idem_outbox_claim();
SELECT aggregate_id, seq, attempts FROM c3 ORDER BY 1, 2;

-- 5. Dead letters: after outbox_max_attempts failed attempts the head is
-- dead-lettered; policy 'block' (default) holds the rest of the aggregate
SET idempotency.outbox_max_attempts = 2;
SELECT idem_outbox_nack((SELECT id FROM c3 WHERE seq = 1), 'broker still down', '0',
                        (SELECT lease_token FROM c3 LIMIT 1));
SELECT aggregate_type, aggregate_id, seq, event_type, attempts, last_error FROM idempotency.outbox_dead;
SELECT aggregate_id, acked_seq, dead_seq FROM idempotency.outbox_deliveries WHERE aggregate_id = 'o-2';
SELECT count(*) AS claimed_while_blocked FROM idem_outbox_claim();
-- redrive puts it back in place, order intact
SELECT idem_outbox_redrive(ARRAY(SELECT id FROM idempotency.outbox_dead)) AS redriven;
SELECT count(*) AS dead FROM idempotency.outbox_dead;
CREATE TEMP TABLE c4 AS SELECT * FROM idem_outbox_claim();
SELECT aggregate_id, seq, event_type FROM c4 ORDER BY 1, 2;
SELECT idem_outbox_ack(ARRAY(SELECT id FROM c4), (SELECT lease_token FROM c4 LIMIT 1)) AS acked;

-- policy 'skip': later events flow on; discard drops the dead one for good
SET idempotency.outbox_dead_policy = 'skip';
SET idempotency.outbox_max_attempts = 1;
SELECT count(*) FROM idem_outbox_emit_many('payment', ARRAY['p-1', 'p-1', 'p-1'], ARRAY['authorized', 'captured', 'settled'],
                                           ARRAY['{}', '{}', '{}']::jsonb[]);
CREATE TEMP TABLE c5 AS SELECT * FROM idem_outbox_claim();
SELECT idem_outbox_nack((SELECT id FROM c5 WHERE seq = 1), 'rejected', '0', (SELECT lease_token FROM c5 LIMIT 1));
SELECT aggregate_id, seq, event_type, last_error FROM idempotency.outbox_dead;
CREATE TEMP TABLE c6 AS SELECT * FROM idem_outbox_claim();
SELECT aggregate_id, seq, event_type FROM c6 ORDER BY 1, 2;
SELECT idem_outbox_ack(ARRAY(SELECT id FROM c6), (SELECT lease_token FROM c6 LIMIT 1)) AS acked;
SELECT idem_outbox_discard(ARRAY(SELECT id FROM idempotency.outbox_dead)) AS discarded;
SELECT count(*) AS dead, (SELECT count(*) FROM idem_outbox_claim()) AS claimed_after_discard
  FROM idempotency.outbox_dead;
RESET idempotency.outbox_dead_policy;
RESET idempotency.outbox_max_attempts;

-- 6. Fencing: a relay whose lease expired and was taken over acks nothing
SELECT seq FROM idem_outbox_emit('account', 'a-1', 'opened', '{}');
CREATE TEMP TABLE slow AS SELECT * FROM idem_outbox_claim(10, '10 seconds');
SET idempotency.debug_clock_offset = 20;
CREATE TEMP TABLE fast AS SELECT * FROM idem_outbox_claim(10, '10 seconds');
SELECT aggregate_id, seq, attempts, lease_token <> (SELECT lease_token FROM slow) AS new_token FROM fast;
SELECT idem_outbox_ack(ARRAY(SELECT id FROM slow), (SELECT lease_token FROM slow)) AS stale_ack;
SELECT idem_outbox_extend((SELECT lease_token FROM slow), '1 minute') AS stale_extend;
SELECT idem_outbox_extend((SELECT lease_token FROM fast), '1 minute') AS live_extend;
SELECT idem_outbox_ack(ARRAY(SELECT id FROM fast), (SELECT lease_token FROM fast)) AS live_ack;
SELECT aggregate_id, acked_seq, lease_token IS NULL AS lease_ended
  FROM idempotency.outbox_deliveries WHERE aggregate_id = 'a-1';
-- back to the real clock: section 9 compares partition ranges with now()
RESET idempotency.debug_clock_offset;

-- 7. outbox_mode 'wal' writes a transactional logical decoding message per
-- emit (prefix idempotency.outbox, the event as JSON) and no row; 'both'
-- writes both; seq counts on in every mode
CREATE EXTENSION pg_walinspect;
SELECT pg_current_wal_insert_lsn() AS wal_start \gset
SET idempotency.outbox_mode = 'wal';
SELECT seq FROM idem_outbox_emit('cdc', 'c-1', 'created', '{"a": 1}', '{"h": "v"}');
SELECT seq FROM idem_outbox_emit_many('cdc', ARRAY['c-1'], ARRAY['updated'], ARRAY['{"a": 2}']::jsonb[]);
SELECT count(*) AS rows_stored FROM idempotency.outbox_events WHERE aggregate_type = 'cdc';
SELECT aggregate_id, last_seq FROM idempotency.outbox_sequences WHERE aggregate_type = 'cdc';
SET idempotency.outbox_mode = 'both';
SELECT seq FROM idem_outbox_emit('cdc', 'c-2', 'created', '{"a": 3}');
RESET idempotency.outbox_mode;
SELECT seq FROM idem_outbox_emit('cdc', 'c-3', 'created', '{}');
-- one aggregate in every mode: seq 1 and 3 in 'wal', seq 2 stored
SET idempotency.outbox_mode = 'wal';
SELECT seq FROM idem_outbox_emit('cdc', 'c-4', 'created', '{}');
RESET idempotency.outbox_mode;
SELECT seq FROM idem_outbox_emit('cdc', 'c-4', 'updated', '{}');
SET idempotency.outbox_mode = 'wal';
SELECT seq FROM idem_outbox_emit('cdc', 'c-4', 'closed', '{}');
RESET idempotency.outbox_mode;
-- what 'wal' emitted waits for no relay (logical decoding delivers it): the
-- backlog counts the stored events only, c-2:1, c-3:1 and c-4:2
SELECT aggregate_type, pending, dead, oldest_pending_age >= '0' AS has_age
  FROM idempotency.outbox_backlog WHERE aggregate_type = 'cdc';
SELECT outbox_pending FROM idempotency.stats WHERE scope = 'outbox:cdc';
SELECT aggregate_id, seq, event_type FROM idempotency.outbox_events WHERE aggregate_type = 'cdc' ORDER BY 1, 2;
WITH m AS (
    SELECT split_part(description, ',', 1) AS kind,
           substring(description FROM 'prefix "([^"]*)"') AS prefix,
           convert_from(decode(replace(substring(description FROM 'bytes\): (.*)$'), ' ', ''), 'hex'), 'UTF8')::jsonb AS msg
      FROM pg_get_wal_records_info(:'wal_start', pg_current_wal_flush_lsn())
     WHERE resource_manager = 'LogicalMessage')
SELECT kind, prefix,
       ARRAY(SELECT jsonb_object_keys(msg) ORDER BY 1) AS keys,
       msg->>'aggregate_type' AS aggregate_type, msg->>'aggregate_id' AS aggregate_id, msg->'seq' AS seq,
       msg->>'event_type' AS event_type, msg->'payload' AS payload, msg->'headers' AS headers,
       (msg->>'id')::uuid IS NOT NULL AS has_id,
       (msg->>'created_at')::timestamptz BETWEEN now() - interval '1 hour' AND now() + interval '1 hour' AS has_created_at,
       (msg->>'id')::uuid IN (SELECT id FROM idempotency.outbox_events) AS row_stored
  FROM m ORDER BY msg->>'aggregate_id', msg->'seq';
DROP EXTENSION pg_walinspect;
-- the stored ones are relayed as usual
CREATE TEMP TABLE c7 AS SELECT * FROM idem_outbox_claim();
SELECT aggregate_id, seq FROM c7 ORDER BY 1, 2;
SELECT idem_outbox_ack(ARRAY(SELECT id FROM c7), (SELECT lease_token FROM c7 LIMIT 1)) AS acked;
-- delivered: nothing of 'cdc' is pending any more
SELECT count(*) AS cdc_backlog FROM idempotency.outbox_backlog WHERE aggregate_type = 'cdc';
SELECT count(*) AS cdc_stats FROM idempotency.stats WHERE scope = 'outbox:cdc';

-- 8. Two-phase commit: an emitting transaction may be prepared, under the
-- default outbox_notify = 'commit' too (a prepared transaction sends no
-- NOTIFY: relays find its events by polling); COMMIT PREPARED commits its
-- events, ROLLBACK PREPARED takes their seqs back
SHOW idempotency.outbox_notify;
BEGIN;
SELECT seq FROM idem_outbox_emit('twophase', 't-1', 'created', '{}');
SELECT aggregate_id, seq FROM idem_outbox_emit_many('twophase', ARRAY['t-1', 't-2'], ARRAY['paid', 'created'],
                                                    ARRAY['{}', '{}']::jsonb[]);
PREPARE TRANSACTION 'outbox_twophase';
SELECT gid FROM pg_prepared_xacts;
SELECT count(*) AS claimed_while_prepared FROM idem_outbox_claim(10, '30 seconds', ARRAY['twophase']);
COMMIT PREPARED 'outbox_twophase';
CREATE TEMP TABLE c8 AS SELECT * FROM idem_outbox_claim(10, '30 seconds', ARRAY['twophase']);
SELECT aggregate_id, seq, event_type FROM c8 ORDER BY 1, 2;
SELECT idem_outbox_ack(ARRAY(SELECT id FROM c8), (SELECT lease_token FROM c8 LIMIT 1)) AS acked;
-- rolled back after PREPARE: no event, and no gap
BEGIN;
SELECT seq FROM idem_outbox_emit('twophase', 't-1', 'cancelled', '{}');
PREPARE TRANSACTION 'outbox_twophase';
ROLLBACK PREPARED 'outbox_twophase';
SELECT seq FROM idem_outbox_emit('twophase', 't-1', 'shipped', '{}');
SELECT aggregate_id, seq, event_type FROM idempotency.outbox_events WHERE aggregate_type = 'twophase' ORDER BY 1, 2;
SELECT count(*) AS prepared_left FROM pg_prepared_xacts;
SELECT idem_outbox_ack(ARRAY(SELECT id FROM idem_outbox_claim(10, '30 seconds', ARRAY['twophase']))) AS acked;

-- 9. Maintenance makes and drops outbox partitions like claims partitions,
-- but keeps a partition that holds an undelivered or dead-lettered event
-- (pinned)
-- every event went into the partition that covers its time
SELECT count(*) AS outside_their_range
  FROM idempotency.outbox_events e JOIN idempotency.outbox_partitions p ON p.bucket = e.bucket
 WHERE NOT (p.lower <= e.created_at AND e.created_at < p.upper);
SELECT idem_configure(retention => '1 day', partition_interval => '1 hour', premake => 2);
-- the outbox follows the new width at once (registry ranges only): the
-- current partition ends at the next hour, the premade ones are an hour wide
SELECT count(*) AS premade_of_another_width FROM idempotency.outbox_partitions
 WHERE lower > now() AND upper - lower <> interval '1 hour';
SELECT upper - now() <= interval '1 hour 1 second' AS current_ends_within_the_hour
  FROM idempotency.outbox_partitions WHERE lower <= now() AND now() < upper;
SELECT count(*) AS gaps FROM (
    SELECT upper, lead(lower) OVER (ORDER BY lower) AS next_lower FROM idempotency.outbox_partitions) r
 WHERE next_lower IS NOT NULL AND next_lower <> upper;
-- everything emitted so far is delivered, except one event left pending
SELECT count(*) AS pending FROM idem_outbox_claim();
SELECT seq FROM idem_outbox_emit('keep', 'k-1', 'pending', '{}');
SELECT tableoid::regclass AS keep_part FROM idempotency.outbox_events WHERE aggregate_type = 'keep' \gset
SELECT count(*) AS parts_before FROM idempotency.outbox_partitions \gset
-- six days later every day partition made so far is past its retention
-- (its upper bound + 1 day): the one with the pending event is pinned, the
-- others go, and hourly partitions are made for the new time
SET idempotency.debug_clock_offset = '144h';
CREATE TEMP TABLE round1 AS SELECT * FROM idem_maintain();
SELECT count(*) FILTER (WHERE action IN ('create', 'extend')) > 0 AS made_outbox_partitions,
       count(*) FILTER (WHERE action = 'drop') = :parts_before - 1 AS dropped_all_but_one
  FROM round1 WHERE object LIKE 'idempotency.outbox%';
SELECT count(*) AS expired_left_but_pinned FROM idempotency.outbox_partitions
 WHERE upper <= now() + interval '144 hours' - interval '1 day' AND relid <> :'keep_part'::regclass;
SELECT count(*) AS keep_part_dropped FROM round1 WHERE action = 'drop' AND object = :'keep_part';
SELECT idempotency.outbox_partition_pinned(:'keep_part') AS pinned,
       (SELECT count(*) FROM idempotency.outbox_partitions WHERE relid = :'keep_part'::regclass) AS still_registered;
SELECT count(*) AS events_kept FROM idempotency.outbox_events WHERE aggregate_type = 'keep';
-- delivered: the next round drops it
SELECT idem_outbox_ack(ARRAY(SELECT id FROM idempotency.outbox_events WHERE aggregate_type = 'keep')) AS acked;
SELECT idempotency.outbox_partition_pinned(:'keep_part') AS pinned;
SELECT count(*) AS keep_part_dropped FROM idem_maintain() WHERE action = 'drop' AND object = :'keep_part';
SELECT to_regclass(:'keep_part') IS NULL AS keep_part_gone;
SELECT count(*) AS events_left FROM idempotency.outbox_events WHERE aggregate_type = 'keep';
-- where nothing acks (change data capture reads the WAL), maintenance can
-- be told not to keep undelivered events: a pinned partition goes too
SELECT seq FROM idem_outbox_emit('cdc', 'c-1', 'pending', '{}');
SELECT tableoid::regclass AS cdc_part FROM idempotency.outbox_events WHERE aggregate_type = 'cdc' \gset
SET idempotency.debug_clock_offset = '300h';
SELECT count(*) AS cdc_part_dropped FROM idem_maintain() WHERE action = 'drop' AND object = :'cdc_part';
SET idempotency.outbox_keep_undelivered = off;
SELECT count(*) AS cdc_part_dropped FROM idem_maintain() WHERE action = 'drop' AND object = :'cdc_part';
RESET idempotency.outbox_keep_undelivered;
-- subscriptions: a partition is kept until every live subscription has
-- passed it; one further behind than idempotency.outbox_max_lag is
-- detached, loudly (a WARNING, an action, its state), and pins no more
SELECT idem_outbox_subscribe('audit', ARRAY['lag'], 'now') AS subscribed;
SELECT seq FROM idem_outbox_emit('lag', 'l-1', 'pending', '{}');
SELECT tableoid::regclass AS lag_part FROM idempotency.outbox_events WHERE aggregate_type = 'lag' \gset
SELECT idem_outbox_ack(ARRAY(SELECT id FROM idempotency.outbox_events WHERE aggregate_type = 'lag')) AS acked_by_default;
SELECT array_agg(b.name) AS pinned_by
  FROM unnest(idempotency.outbox_partition_pinned_by(:'lag_part')) s(id)
  JOIN idempotency.outbox_subscriptions b ON b.id = s.id;
-- four days on, past its retention: audit keeps it (14 days allowed)
SET idempotency.debug_clock_offset = '400h';
SELECT count(*) FILTER (WHERE action = 'keep (pinned)' AND object = :'lag_part') AS kept_for_audit,
       count(*) FILTER (WHERE action = 'detach subscription') AS detached
  FROM idem_maintain();
SELECT pending, state FROM idempotency.outbox_subscriptions_status WHERE name = 'audit';
-- allowed two days behind: detached, and the partition goes
SET idempotency.outbox_max_lag = '2d';
\set VERBOSITY terse
CREATE TEMP TABLE round2 AS SELECT * FROM idem_maintain();
SELECT string_agg(action || ' ' || object, ', ') AS detach_actions FROM round2 WHERE action = 'detach subscription';
SELECT count(*) AS lag_part_dropped FROM round2 WHERE action = 'drop' AND object = :'lag_part';
SELECT state, detached_at IS NOT NULL AS has_time, detach_reason LIKE 'needed events of partition %' AS says_why
  FROM idempotency.outbox_subscriptions_status WHERE name = 'audit';
SELECT count(*) FROM idem_outbox_claim(10, '1 minute', NULL, 'audit');
SELECT idem_outbox_subscribe('audit', ARRAY['lag'], 'now');
\set VERBOSITY default
SELECT idem_outbox_unsubscribe('audit') AS unsubscribed;
SELECT idem_outbox_subscribe('audit', ARRAY['lag'], 'now') AS subscribed_again;
SELECT idem_outbox_unsubscribe('audit') AS unsubscribed;
RESET idempotency.outbox_max_lag;
-- the ranges that take events stay contiguous
SELECT count(*) AS gaps FROM (
    SELECT upper, lead(lower) OVER (ORDER BY lower) AS next_lower FROM idempotency.outbox_partitions) r
 WHERE next_lower IS NOT NULL AND next_lower <> upper;
RESET idempotency.debug_clock_offset;

SET client_min_messages = warning;
DROP EXTENSION idempotency CASCADE;
