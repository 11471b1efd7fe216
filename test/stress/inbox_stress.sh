#!/usr/bin/env bash
# test/stress/inbox_stress.sh: the inbox under concurrent receivers and
# workers.
#
# Receivers (pgbench, IDEM_STRESS_CLIENTS) receive messages whose ids are
# drawn from 1..IDEM_STRESS_MESSAGES, so most ids come again and again
# (redelivery); 70 % of the ids carry an ordering key (one of
# IDEM_STRESS_KEYS), the payload is fixed per id.  What receive returned is
# recorded in stress_received in the same transaction; ROLLBACK_PCT % of the
# transactions roll back.  Three workers (pgbench, one client each) loop:
# claim a batch with a 2-second lease; FAIL_PCT % of the batches fail as a
# whole (idem_inbox_fail, retried at once); the others are processed in one
# transaction: the effect (a row per message in stress_effects) and
# idem_inbox_done with the lease token, rolled back if done did not mark
# the whole batch.  Worker 3 sometimes sleeps past its lease before
# processing (its done must mark nothing, and its effects roll back);
# worker 2 sometimes works past its lease too, but extends it by 10 s
# half-way (idem_inbox_extend), so its done marks the whole batch.
# idem_maintain() runs every half second with 1-second partitions.  After
# the receivers stop, the workers drain the inbox.
# Checks:
#   - pgbench: no receiver or worker got an error; idem_maintain() never
#     failed; duplicates were received (false) and some receives rolled back;
#   - every committed true receive stored exactly one message, and each
#     message id was received (true, committed) at most once;
#   - per (source, ordering_key), seq is 1..max without gaps and
#     inbox_sequences.last_seq = max; messages without a key have no seq;
#   - every message was processed exactly once in effect (one effect row),
#     with its own payload; all messages are done, none dead, none leased,
#     and a claim finds nothing;
#   - per ordering key, effects happened in seq order (the effect of seq n
#     was written after the commit of seq n-1's);
#   - every claim: one lease token and lease_until, at most the batch; a
#     claim never held two messages of one key out of seq order;
#   - worker 3's late done returned 0 at least once (stale leases happened);
#   - worker 2 extended leases, and every batch whose whole lease it
#     extended was marked done in full.
# Connection from PGHOST/PGPORT/PGDATABASE/PGUSER (superuser: it sets
# idempotency.debug_clock_offset); run by test/run-tests (part "stress") in
# an empty database.
# Settings: IDEM_STRESS_SECONDS (receiving time, default 15),
# IDEM_STRESS_CLIENTS (receivers, default 4), IDEM_STRESS_MESSAGES (distinct
# ids, default 6000), IDEM_STRESS_KEYS (ordering keys, default 100),
# IDEM_STRESS_ROLLBACK_PCT (default 20), IDEM_STRESS_FAIL_PCT (failed
# batches, default 15), IDEM_STRESS_DRAIN (at most this many seconds after
# the receivers stop, the workers must have processed everything, default
# 90: on a loaded machine 45 was not always enough).
set -euo pipefail

SECONDS_RUN=${IDEM_STRESS_SECONDS:-15}
CLIENTS=${IDEM_STRESS_CLIENTS:-4}
NMSG=${IDEM_STRESS_MESSAGES:-6000}
NKEYS=${IDEM_STRESS_KEYS:-100}
ROLLBACK_PCT=${IDEM_STRESS_ROLLBACK_PCT:-20}
FAIL_PCT=${IDEM_STRESS_FAIL_PCT:-15}
DRAIN=${IDEM_STRESS_DRAIN:-90}
LEASE='2 seconds'
BATCH=10

# the extension's clock 10 days ahead, past the 1-day partitions CREATE
# EXTENSION premade, so the messages go into 1-second ones; failures are
# retried often enough that nothing dies of them
base_options=${PGOPTIONS:-}
export PGOPTIONS="$base_options -c idempotency.debug_clock_offset=864000 -c idempotency.inbox_max_attempts=1000"

. "$(dirname "$0")/common.bash"

PGOPTIONS=$base_options sql >/dev/null <<'SQL'
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS idempotency;
SELECT idem_configure(retention => '75 seconds', partition_interval => '1 second', premake => 20);
-- the first partitions of the run, on the run's clock: in place before the
-- load starts (the rounds alongside may find a partition busy and skip)
SET idempotency.debug_clock_offset = 864000;
SELECT count(*) FROM idem_maintain();
RESET idempotency.debug_clock_offset;
-- the extension's clock, which lease_until follows
CREATE FUNCTION stress_now() RETURNS timestamptz LANGUAGE sql AS
    $$ SELECT clock_timestamp() + current_setting('idempotency.debug_clock_offset')::interval $$;
-- what committed receives returned
CREATE TABLE stress_received (n bigserial, message_id text NOT NULL, got boolean NOT NULL);
-- the effects of processing, written with done in one transaction
CREATE TABLE stress_effects (n bigserial, worker int NOT NULL, lease_token uuid NOT NULL,
                             id uuid NOT NULL, message_id text NOT NULL, ordering_key text,
                             seq bigint, payload jsonb NOT NULL,
                             xid xid8 NOT NULL DEFAULT pg_current_xact_id(),
                             snap pg_snapshot NOT NULL DEFAULT pg_current_snapshot());
-- every claim, as handed out
CREATE TABLE stress_claims (worker int NOT NULL, ord bigint NOT NULL, id uuid NOT NULL,
                            message_id text NOT NULL, lease_token uuid NOT NULL,
                            lease_until timestamptz NOT NULL, attempts int NOT NULL,
                            at timestamptz NOT NULL DEFAULT stress_now());
-- what each done returned, and the failed batches (marked -1)
CREATE TABLE stress_done (worker int NOT NULL, lease_token uuid NOT NULL, sent int NOT NULL, marked int NOT NULL,
                          at timestamptz NOT NULL DEFAULT stress_now());
-- worker 2's extends: the batch's size, and what the extend covered
-- (started: when the extending statement began, on the extension's clock, so
-- no later than the "now" the extend measured the lease from)
CREATE TABLE stress_extends (worker int NOT NULL, lease_token uuid NOT NULL, sent int NOT NULL, covered int NOT NULL,
                             at timestamptz NOT NULL DEFAULT stress_now(),
                             started timestamptz NOT NULL
                                 DEFAULT statement_timestamp() + current_setting('idempotency.debug_clock_offset')::interval);
-- each worker's current batch
CREATE UNLOGGED TABLE worker_batch (worker int NOT NULL, ord bigint NOT NULL, id uuid NOT NULL,
                                    message_id text NOT NULL, payload jsonb NOT NULL, lease_token uuid NOT NULL);
SQL

{ cat <<'PGBENCH'
\set m random(1, :nmsg)
\set r random(1, 100)
BEGIN;
INSERT INTO stress_received (message_id, got)
SELECT :m::text, idem_inbox_receive('src', :m::text, jsonb_build_object('m', :m::int),
                                    CASE WHEN :m::int % 10 < 7
                                         THEN jsonb_build_object('ordering_key', 'k' || (:m::int % :nkeys))
                                         ELSE jsonb_build_object('plain', true) END);
PGBENCH
pgbench_end rollback_pct
} >"$tmp/receive.sql"

# a worker round: claim (autocommit), then fail the batch or process it
cat >"$tmp/worker.sql" <<'PGBENCH'
DELETE FROM worker_batch WHERE worker = :w::int;
WITH c AS (SELECT * FROM idem_inbox_claim(:batch, :lease::interval) WITH ORDINALITY c),
     k AS (INSERT INTO stress_claims (worker, ord, id, message_id, lease_token, lease_until, attempts)
           SELECT :w::int, ordinality, id, message_id, lease_token, lease_until, attempts FROM c)
INSERT INTO worker_batch SELECT :w::int, ordinality, id, message_id, payload, lease_token FROM c;
SELECT count(*) AS n, coalesce(min(lease_token::text), '00000000-0000-0000-0000-000000000000') AS tok
  FROM worker_batch WHERE worker = :w::int \gset
\if :n > 0
\set r random(1, 100)
\set late random(1, 100)
\if :r <= :fail_pct
WITH f AS (SELECT idem_inbox_fail(id, 'random failure', '0', :tok::uuid) FROM worker_batch WHERE worker = :w::int)
INSERT INTO stress_done (worker, lease_token, sent, marked) SELECT :w::int, :tok::uuid, count(*), -1 FROM f;
\else
\if :w = 3 AND :late <= 10
\sleep 2500 ms
\endif
\if :w = 2 AND :late <= 10
\sleep 1200 ms
INSERT INTO stress_extends (worker, lease_token, sent, covered)
VALUES (:w::int, :tok::uuid, :n, idem_inbox_extend(:tok::uuid, '10 seconds'));
\sleep 1200 ms
\endif
BEGIN;
INSERT INTO stress_effects (worker, lease_token, id, message_id, ordering_key, seq, payload)
SELECT :w::int, b.lease_token, b.id, b.message_id, m.ordering_key, m.seq, b.payload
  FROM worker_batch b JOIN idempotency.inbox_messages m USING (id)
 WHERE b.worker = :w::int ORDER BY b.ord;
INSERT INTO stress_done (worker, lease_token, sent, marked)
SELECT :w::int, :tok::uuid, count(*), idem_inbox_done(array_agg(id), :tok::uuid)
  FROM worker_batch WHERE worker = :w::int RETURNING (marked = sent)::int AS all_marked \gset
\if :all_marked
COMMIT;
\else
ROLLBACK;
INSERT INTO stress_done (worker, lease_token, sent, marked) VALUES (:w::int, :tok::uuid, :n, 0);
\endif
\endif
\else
\sleep 20 ms
\endif
PGBENCH

# worker W SECONDS OUT: one worker in the background ($! is its pid)
worker() {
    pgbench_loop "worker$1" "$2" "$tmp/worker.sql" "$3" -D w="$1" -D batch="$BATCH" -D lease="$LEASE" \
        -D fail_pct="$FAIL_PCT"
}

maintain_alongside

WORKER_SECS=$((SECONDS_RUN + DRAIN + 30))     # stopped once all is processed
echo "inbox stress: $CLIENTS receivers for ${SECONDS_RUN}s on $NMSG message ids ($NKEYS ordering keys), $ROLLBACK_PCT % rollbacks;"
echo "  3 workers (batch $BATCH, lease $LEASE, $FAIL_PCT % failed batches, worker 3 sometimes late, worker 2"
echo "  sometimes slow but extending its lease) until all is processed"
worker 1 "$WORKER_SECS" worker1.out; w1=$!
worker 2 "$WORKER_SECS" worker2.out; w2=$!
worker 3 "$WORKER_SECS" worker3.out; w3=$!
bg_pids+=("$w1" "$w2" "$w3")
rc=0
pgbench -n -M extended -c "$CLIENTS" -j 2 -T "$SECONDS_RUN" -D nmsg="$NMSG" -D nkeys="$NKEYS" \
    -D rollback_pct="$ROLLBACK_PCT" -f "$tmp/receive.sql" >"$tmp/receive.out" 2>&1 || rc=$?
pgbench_report receivers receive.out "$rc"

wait_drained "$DRAIN" "SELECT NOT EXISTS (SELECT FROM idempotency.inbox_messages WHERE done_at IS NULL)"
echo "workers drained the inbox ${drain_secs}s after the receivers stopped"
[[ $drained == t ]] || fail "the workers did not process everything within ${DRAIN}s after the receivers stopped"
for p in "$w1" "$w2" "$w3"; do
    kill "$p" 2>/dev/null || fail "a worker's pgbench ended before the inbox was drained"
    wait "$p" 2>/dev/null || true
done
check_outputs "$tmp"/worker[123].out
maintain_stop

read -r receives stored dups messages keyed parts claims fails late extends extended <<<"$(sql -F ' ' -c "
SELECT (SELECT count(*) FROM stress_received),
       (SELECT count(*) FROM stress_received WHERE got),
       (SELECT count(*) FROM stress_received WHERE NOT got),
       (SELECT count(*) FROM idempotency.inbox_messages),
       (SELECT count(*) FROM idempotency.inbox_messages WHERE ordering_key IS NOT NULL),
       (SELECT count(DISTINCT tableoid) FROM idempotency.inbox_messages),
       (SELECT count(DISTINCT lease_token) FROM stress_claims),
       (SELECT count(*) FROM idempotency.inbox_messages WHERE attempts > 1),
       (SELECT count(*) FROM stress_done WHERE worker = 3 AND marked = 0),
       (SELECT count(*) FROM stress_extends),
       (SELECT count(*) FROM stress_extends WHERE covered = sent)")"
echo "committed receives: $receives ($stored stored, $dups duplicates); messages: $messages ($keyed with an ordering key) in $parts partitions"
echo "claims: $claims; messages handed out more than once: $fails; worker 3's done that marked nothing: $late"
echo "worker 2's extends: $extends, $extended of them while its whole batch was still leased"

[[ $stored -ge 500 ]] || fail "only $stored messages stored: too few to mean anything"
[[ $dups -gt 0 ]] || fail "no duplicate was received"
processed=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$tmp/receive.out")
[[ ${processed:-0} -gt $receives ]] ||
    fail "no receive rolled back ($processed transactions, $receives committed)"
[[ $parts -ge 3 ]] || fail "messages landed in $parts partition(s), expected several (1-second partitions)"
[[ $fails -gt 0 ]] || fail "no message was handed out twice (failures and late workers should cause that)"
[[ $late -gt 0 ]] || echo "note: worker 3 was never late past its lease in this run"
[[ $extended -gt 0 ]] || fail "worker 2 never extended the lease of a whole batch"

expect_zero "message ids received (true, committed) more than once" \
    "SELECT count(*) FROM (SELECT message_id FROM stress_received WHERE got GROUP BY 1 HAVING count(*) > 1) x"
expect_zero "committed true receives without their message, or messages without one" \
    "SELECT count(*) FROM (SELECT message_id FROM stress_received WHERE got) r
       FULL JOIN (SELECT message_id FROM idempotency.inbox_messages) m USING (message_id)
      WHERE r.message_id IS NULL OR m.message_id IS NULL"
expect_zero "messages stored twice" \
    "SELECT count(*) FROM (SELECT source, message_id FROM idempotency.inbox_messages GROUP BY 1, 2 HAVING count(*) > 1) x"
expect_zero "messages with another payload or ordering key than their id says" \
    "SELECT count(*) FROM idempotency.inbox_messages
      WHERE payload <> jsonb_build_object('m', message_id::int)
         OR ordering_key IS DISTINCT FROM CASE WHEN message_id::int % 10 < 7 THEN 'k' || (message_id::int % $NKEYS) END
         OR (ordering_key IS NULL) <> (seq IS NULL)"
expect_zero "ordering keys whose seqs are not exactly 1..max" \
    "SELECT count(*) FROM (SELECT ordering_key FROM idempotency.inbox_messages WHERE ordering_key IS NOT NULL
       GROUP BY 1 HAVING min(seq) <> 1 OR max(seq) <> count(*) OR count(DISTINCT seq) <> count(*)) x"
expect_zero "ordering keys whose inbox_sequences.last_seq is not their max seq" \
    "SELECT count(*) FROM (SELECT source, ordering_key, max(seq) AS m FROM idempotency.inbox_messages
                            WHERE ordering_key IS NOT NULL GROUP BY 1, 2) e
       FULL JOIN idempotency.inbox_sequences q USING (source, ordering_key)
      WHERE q.last_seq IS DISTINCT FROM e.m"
expect_zero "messages not processed exactly once in effect" \
    "SELECT count(*) FROM idempotency.inbox_messages m
      WHERE (SELECT count(*) FROM stress_effects e WHERE e.id = m.id) <> 1" \
    "SELECT m.message_id, m.attempts, m.done_at, (SELECT count(*) FROM stress_effects e WHERE e.id = m.id)
       FROM idempotency.inbox_messages m WHERE (SELECT count(*) FROM stress_effects e WHERE e.id = m.id) <> 1 LIMIT 5"
expect_zero "effects with another message, key, seq or payload than the stored message" \
    "SELECT count(*) FROM stress_effects e JOIN idempotency.inbox_messages m USING (id)
      WHERE e.message_id <> m.message_id OR e.ordering_key IS DISTINCT FROM m.ordering_key
         OR e.seq IS DISTINCT FROM m.seq OR e.payload <> m.payload"
expect_zero "messages not done, dead, leased or waiting at the end" \
    "SELECT count(*) FROM idempotency.inbox_messages
      WHERE done_at IS NULL OR dead_at IS NOT NULL OR lease_token IS NOT NULL OR retry_at IS NOT NULL"
# (only a done that certainly came while the extended lease lived: its row
# was written before the extending statement's start + 10 s, the least the
# extended lease can last; on a loaded machine the done may come later, and
# then marking nothing is right)
expect_zero "batches whose whole lease worker 2 extended that its done did not mark in full" \
    "SELECT count(*) FROM stress_extends e WHERE e.covered = e.sent AND NOT EXISTS (
       SELECT FROM stress_done d WHERE d.lease_token = e.lease_token AND d.marked = e.sent)
       AND EXISTS (SELECT FROM stress_done d WHERE d.lease_token = e.lease_token
                    AND d.at < e.started + interval '10 seconds')" \
    "SELECT e.sent, e.covered, e.started AS extend_started, e.at AS extended_at, d.marked, d.at AS done_at,
            (SELECT min(lease_until) FROM stress_claims c WHERE c.lease_token = e.lease_token) AS claimed_until
       FROM stress_extends e LEFT JOIN stress_done d USING (lease_token)
      WHERE e.covered = e.sent AND NOT EXISTS (
            SELECT FROM stress_done d WHERE d.lease_token = e.lease_token AND d.marked = e.sent)"
expect_zero "a claim now still returns messages" "SELECT count(*) FROM idem_inbox_claim(1000, '1 second')"
# effects of one key in seq order: the transaction that processed seq n
# saw the one that processed seq n-1 committed (in its snapshot), unless
# both were one run processed by one transaction
expect_zero "effects of a key that did not see the effect of the key's previous seq committed" \
    "SELECT count(*) FROM (SELECT xid, snap, lag(xid) OVER w AS prev_xid FROM stress_effects
       WHERE ordering_key IS NOT NULL WINDOW w AS (PARTITION BY ordering_key ORDER BY seq)) x
      WHERE prev_xid <> xid AND NOT pg_visible_in_snapshot(prev_xid, snap)" \
    "SELECT ordering_key, seq, xid, snap FROM stress_effects WHERE ordering_key IN (
       SELECT ordering_key FROM (SELECT ordering_key, xid, snap, lag(xid) OVER w AS prev_xid FROM stress_effects
         WHERE ordering_key IS NOT NULL WINDOW w AS (PARTITION BY ordering_key ORDER BY seq)) x
        WHERE prev_xid <> xid AND NOT pg_visible_in_snapshot(prev_xid, snap) LIMIT 1) ORDER BY seq"
expect_zero "claims with more than one lease_until or worker, or larger than the batch" \
    "SELECT count(*) FROM (SELECT lease_token FROM stress_claims GROUP BY 1
       HAVING count(DISTINCT lease_until) <> 1 OR count(DISTINCT worker) <> 1 OR count(*) > $BATCH) x"
expect_zero "claims that hand out messages of one key out of seq order" \
    "SELECT count(*) FROM (SELECT m.seq - lag(m.seq) OVER w AS d FROM stress_claims c
       JOIN idempotency.inbox_messages m USING (id) WHERE m.ordering_key IS NOT NULL
       WINDOW w AS (PARTITION BY c.lease_token, m.ordering_key ORDER BY c.ord)) x WHERE d <> 1"
# two live leases on one key at once: a claim handed out a message of a key
# while an earlier claim's lease on a message of the same key was live and
# not settled (done, or failed: recorded in the same transaction, so before
# a later claim could see it).  A claim's time is that of its first row in
# stress_claims, written after the claim ran and before it committed.
overlap="
WITH cl AS (SELECT lease_token, min(at) AS at, max(lease_until) AS lease_until FROM stress_claims GROUP BY 1),
     ck AS (SELECT DISTINCT c.lease_token, m.ordering_key FROM stress_claims c JOIN idempotency.inbox_messages m USING (id)
             WHERE m.ordering_key IS NOT NULL)
SELECT a.ordering_key, ca.lease_token AS later, ca.at AS later_at, cb.lease_token AS earlier, cb.at AS earlier_at,
       cb.lease_until AS earlier_until
  FROM ck a JOIN cl ca USING (lease_token)
  JOIN ck b ON b.ordering_key = a.ordering_key AND b.lease_token <> a.lease_token
  JOIN cl cb ON cb.lease_token = b.lease_token
 WHERE cb.at < ca.at AND cb.lease_until > ca.at
   AND NOT EXISTS (SELECT FROM stress_done d WHERE d.lease_token = b.lease_token AND d.marked <> 0 AND d.at < ca.at)"
expect_zero "claims that handed out a key while an earlier claim held a live lease on it" \
    "SELECT count(*) FROM ($overlap) x" "$overlap LIMIT 5"

if [[ $failed -ne 0 ]]; then
    echo "inbox stress: FAILED"
    exit 1
fi
echo "inbox stress: ok"
