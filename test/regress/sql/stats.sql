-- Observability without preload (the regression cluster does not preload
-- the library): idempotency.stats answers from the tables and leaves the
-- shared-memory counters NULL; idempotency.consumers keeps every scope
-- across sealing and dropping of partitions; the outbox backlog; reading as
-- a monitoring role; idem_stats_reset(), who may reset every database,
-- and bad input.  The counters
-- themselves (preloaded) are tested in test/tap/080_stats.pl.
CREATE EXTENSION idempotency;

\getenv abs_srcdir PG_ABS_SRCDIR
\set try_sql :abs_srcdir '/include/try.sql'
\i :try_sql

-- not preloaded: nothing counted, nothing tracked
SELECT preloaded, max_scopes, scopes_tracked, databases, dropped, stats_reset
  FROM idempotency.stats_info();
SELECT count(*) AS counted_rows FROM idempotency.stats_counters();
SELECT count(*) AS rows_before_any_claim FROM idempotency.stats;

-- 1. claims in two scopes, a duplicate, a release
SELECT count(*) FILTER (WHERE idem_claim('k' || g, 'billing')) AS billing_claimed
  FROM generate_series(1, 5) g;
SELECT idem_claim('k1', 'billing') AS dup, idem_claim('x', 'shipping') AS shipping;
SELECT idem_release('k5', 'billing') AS released;
SELECT scope, relation, claims, duplicates, payload_mismatches, releases,
       last_claim_at IS NOT NULL AS has_last_claim, last_duplicate_at, stats_reset
  FROM idempotency.stats ORDER BY scope;
SELECT scope, claims, first_claim_at <= last_claim_at AS ordered
  FROM idempotency.consumers ORDER BY scope;

-- 2. a guarded table is listed, its counters unknown without preload
CREATE TABLE acct (id int PRIMARY KEY, version int NOT NULL, state text);
SELECT idem_guard_version('acct');
SELECT scope, relation, stale_skips, invalid_transitions
  FROM idempotency.stats WHERE relation IS NOT NULL;

-- 3. requests: what the request store still holds
SELECT status FROM idem_request_begin('r-1', 'api', '{"n": 1}');
SELECT status FROM idem_request_begin('r-2', 'api', '{"n": 2}');
SELECT idem_request_complete('r-1', 'api', '{"ok": true}');
SELECT scope, claims, requests_started, requests_completed, requests_conflicted
  FROM idempotency.stats WHERE scope LIKE 'request:%';

-- 4. the outbox: backlog per aggregate type, its oldest waiting event,
-- dead letters
SELECT count(*) FROM idem_outbox_emit('order', 'o-1', 'created', '{}');
SELECT count(*) FROM idem_outbox_emit('order', 'o-1', 'paid', '{}');
SELECT count(*) FROM idem_outbox_emit('order', 'o-2', 'created', '{}');
SELECT count(*) FROM idem_outbox_emit('invoice', 'i-1', 'created', '{}');
SELECT aggregate_type, pending, dead, oldest_pending_age >= '0' AS has_age
  FROM idempotency.outbox_backlog ORDER BY 1;
CREATE TEMP TABLE batch AS SELECT * FROM idem_outbox_claim(10);
-- o-1 #1 delivered; i-1 fails for good (max attempts 1): a dead letter
SELECT idem_outbox_ack(ARRAY(SELECT id FROM batch WHERE aggregate_id = 'o-1' AND seq = 1),
                       (SELECT lease_token FROM batch LIMIT 1));
SET idempotency.outbox_max_attempts = 1;
SELECT idem_outbox_nack((SELECT id FROM batch WHERE aggregate_id = 'i-1'), 'rejected', '0',
                        (SELECT lease_token FROM batch LIMIT 1));
RESET idempotency.outbox_max_attempts;
SELECT scope, claims, outbox_pending, outbox_dead, outbox_oldest_pending_age >= '0' AS has_age
  FROM idempotency.stats WHERE scope LIKE 'outbox:%' ORDER BY 1;

-- 4b. the inbox: messages not done per source, dead letters, on the row
-- of the source's claims
SELECT idem_inbox_receive('hooks', 'm' || g, '{}') FROM generate_series(1, 3) g;
CREATE TEMP TABLE taken AS SELECT * FROM idem_inbox_claim(10);
SELECT idem_inbox_done(ARRAY(SELECT id FROM taken WHERE message_id = 'm1'));
SET idempotency.inbox_max_attempts = 1;
SELECT idem_inbox_fail((SELECT id FROM taken WHERE message_id = 'm2'), 'poison');
RESET idempotency.inbox_max_attempts;
SELECT source, pending, dead, oldest_pending_age >= '0' AS has_age FROM idempotency.inbox_backlog;
SELECT scope, claims, inbox_pending, inbox_dead, inbox_oldest_pending_age >= '0' AS has_age
  FROM idempotency.stats WHERE scope LIKE 'inbox:%';

-- 5. consumers across retention: sealed partitions are folded into the
-- scope history once (same totals), dropped ones stay counted
SELECT sum(claims) AS claims_before_seal FROM idempotency.consumers;
SET idempotency.debug_clock_offset = '2d';
SELECT count(*) > 0 AS sealed FROM idem_maintain() WHERE action = 'seal';
SELECT scope, claims FROM idempotency.scope_history ORDER BY scope;
SELECT scope, claims FROM idempotency.consumers ORDER BY scope;
-- new claims go to a live partition and add up with the history
SELECT idem_claim('k9', 'billing') AS claimed_later;
SELECT scope, claims, last_claim_at > first_claim_at AS later
  FROM idempotency.consumers WHERE scope = 'billing';
-- a second round seals nothing twice
SELECT count(*) AS sealed_again FROM idem_maintain() WHERE action = 'seal';
SELECT sum(claims) AS history_total FROM idempotency.scope_history;
-- past the retention the partitions are dropped; the scopes stay
SET idempotency.debug_clock_offset = '12d';
SELECT count(*) > 0 AS dropped FROM idem_maintain() WHERE action = 'drop';
SELECT count(*) AS claims_left FROM idempotency.claims;
SELECT scope, claims FROM idempotency.consumers ORDER BY scope;
RESET idempotency.debug_clock_offset;

-- 6. a monitoring role reads the views without any right on the tables
CREATE ROLE idem_monitor;
CREATE ROLE idem_nobody;
GRANT USAGE ON SCHEMA idempotency TO idem_monitor, idem_nobody;
GRANT pg_monitor TO idem_monitor;
SET ROLE idem_monitor;
SELECT count(*) > 0 AS monitor_reads_stats FROM idempotency.stats;
SELECT count(*) AS monitor_reads_consumers FROM idempotency.consumers;
SELECT pg_temp.try($$SELECT count(*) FROM idempotency.claims$$);
SELECT count(*) > 0 AS monitor_reads_partitions FROM idempotency.partitions;
SELECT pg_temp.try($$SELECT idempotency.outbox_partition_pinned('idempotency.settings')$$) AS monitor_may_ask_pinned;
RESET ROLE;
SET ROLE idem_nobody;
SELECT pg_temp.try($$SELECT count(*) FROM idempotency.stats$$);
SELECT pg_temp.try($$SELECT count(*) FROM idempotency.consumers$$);
SELECT pg_temp.try($$SELECT idem_stats_reset()$$);
-- nor around the views, through the functions they call
SELECT pg_temp.try($$SELECT count(*) FROM idempotency.stats_rows()$$);
SELECT pg_temp.try($$SELECT count(*) FROM idempotency.live_scopes()$$);
SELECT pg_temp.try($$SELECT count(*) FROM idempotency.stats_counters()$$);
-- nor which partitions hold pending work
SELECT pg_temp.try($$SELECT idempotency.outbox_partition_pinned('idempotency.settings')$$);
SELECT pg_temp.try($$SELECT idempotency.inbox_partition_pinned('idempotency.settings')$$);
RESET ROLE;
DROP OWNED BY idem_monitor, idem_nobody;
DROP ROLE idem_monitor, idem_nobody;

-- 7. reset without preload: nothing to reset, says so; bad input
SELECT idem_stats_reset();
SELECT idem_stats_reset(all_databases => true);
SELECT pg_temp.try($$SELECT idem_stats_reset(NULL)$$);
SELECT pg_temp.try($$SELECT idem_stats_reset('maybe')$$);
-- every database is a superuser's to reset; a grantee resets its own
CREATE ROLE idem_operator;
SELECT idem_grant('idem_operator', 'operator');
SET ROLE idem_operator;
SELECT pg_temp.try($$SELECT idem_stats_reset(all_databases => true)$$);
SELECT pg_temp.try($$SELECT idem_stats_reset()$$);
RESET ROLE;
SELECT idem_revoke('idem_operator') AS revoked;
DROP OWNED BY idem_operator;
DROP ROLE idem_operator;
SELECT pg_temp.try($$SELECT * FROM idempotency.stats_counters('x')$$);

SET client_min_messages = warning;
DROP TABLE acct;
DROP EXTENSION idempotency CASCADE;
