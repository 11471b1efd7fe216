#!/usr/bin/env bash
# test/stress/outbox_stress.sh: the outbox under concurrent emitters and relays.
#
# Emitters (pgbench) emit events onto a zipf-skewed set of aggregates of two
# types, 'acct' and 'cart' (idem_outbox_emit once or twice, or
# idem_outbox_emit_many over 4 aggregates, repeats allowed, in random order)
# and record what emit returned in stress_emitted in the same transaction;
# ROLLBACK_PCT % of the transactions roll back.  A two-phase emitter emits,
# PREPAREs (under the default outbox_notify = 'commit'), waits and then
# COMMITs PREPARED (or, ROLLBACK_PCT % of the time, rolls back PREPARED).
# About 1 % of the events are poison ('poison': true in the payload): every
# relay fails them.  Four relays (pgbench, one client each) loop: claim a
# batch with a 2-second lease (relay 3 only aggregate type 'acct'),
# "publish" it by inserting it into consumer_log in a transaction of its own
# -- per aggregate only the events before its first poison event -- then
# ack what it published with the lease token, logging what the ack returned
# in ack_log, and nack the poison event.  After outbox_max_attempts (5)
# failures a poison event is dead-lettered; the relays start under
# outbox_dead_policy 'block' (its aggregate waits) and switch to 'skip'
# halfway through the emitting time (read from stress_policy every round),
# so blocked aggregates are taken through the dead path while emitters keep
# emitting to them and relays are terminated and go stale.  Relay 4 waits
# between publishing and acking; its backend is terminated while it waits
# (mid-lease), and it is started again.  A fifth, "stale" relay claims,
# publishes, sleeps past its lease and acks late: the ack must mark nothing.
# idem_maintain() runs every half second with 1-second partitions.  After
# the emitters stop, the relays drain.
# Checks:
#   - pgbench: no emitter (two-phase included) or relay got an error (except
#     relay 4's termination), idem_maintain() never failed, no prepared
#     transaction is left;
#   - the committed emits (stress_emitted) and idempotency.outbox_events hold
#     the same events (id, aggregate, seq); per aggregate seqs are 1..max
#     without gaps or repeats, and no emit wrote a counter (outbox_sequences
#     is empty: table-mode emits take seq from the events);
#   - inside one emitting transaction, the events of one aggregate have
#     consecutive seqs in call / array order;
#   - every committed event was published, with its payload, at least once,
#     except the poison ones, which all ended dead-lettered (and nothing
#     else did); nothing else was published;
#   - per aggregate, the first publications come in seq order, passing only
#     over dead-lettered events, and no claim made under 'block' (before the
#     switch) published anything behind a dead-lettered event; some event
#     died before the switch (the switch took blocked aggregates);
#   - every claim: one lease token, one lease_until, one relay; per aggregate
#     a run of consecutive seqs in output order;
#   - relay 3 published only 'acct' events;
#   - no event was handed out again after a publication of it was fully
#     acked (claims ordered by their lease ends: a relay that stalled past
#     its lease may still publish its stale copy later, and its ack marks
#     nothing), and the acks marked every event that is not poison exactly
#     once in all (sum of ack results = those events);
#   - relay 4 was terminated holding a non-empty unacked lease, and those
#     events were published again later by another relay;
#   - the stale relay's late ack returned 0;
#   - afterwards every aggregate is fully acked (past its dead letters), none
#     is parked or dead, and no lease is left.
# Connection from PGHOST/PGPORT/PGDATABASE/PGUSER (superuser: it terminates a
# backend and sets idempotency.debug_clock_offset); run by test/run-tests (part "stress") in an empty database.
# Settings: IDEM_STRESS_SECONDS (emitting time, default 15),
# IDEM_STRESS_CLIENTS (emitters, default 6; plus the two-phase one),
# IDEM_STRESS_AGGREGATES (default
# 2000), IDEM_STRESS_ROLLBACK_PCT (default 20), IDEM_STRESS_RATE (emitting
# transactions per second, all emitters together, default 800: about what
# four relays deliver on two cores, so the drain measures no backlog of an
# unthrottled run), IDEM_STRESS_DRAIN (at most this many seconds after the
# emitters stop, the relays must have delivered everything, default 45).
set -euo pipefail

SECONDS_RUN=${IDEM_STRESS_SECONDS:-15}
CLIENTS=${IDEM_STRESS_CLIENTS:-6}
NAGGS=${IDEM_STRESS_AGGREGATES:-2000}
ROLLBACK_PCT=${IDEM_STRESS_ROLLBACK_PCT:-20}
RATE=${IDEM_STRESS_RATE:-800}
DRAIN=${IDEM_STRESS_DRAIN:-45}
LEASE='2 seconds'
BATCH=20

# every session runs with the extension's clock 10 days ahead, past the
# 1-day partitions CREATE EXTENSION premade (outbox partitions do not reshape
# when partition_interval changes), so the events go into 1-second ones
base_options=${PGOPTIONS:-}
CLOCK_OFFSET=864000
export PGOPTIONS="$base_options -c idempotency.debug_clock_offset=$CLOCK_OFFSET -c idempotency.outbox_max_attempts=5"

. "$(dirname "$0")/common.bash"

PGOPTIONS=$base_options sql >/dev/null <<'SQL'
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS idempotency;
-- retention longer than emitting and draining together, so every event is
-- still there for the checks at the end
SELECT idem_configure(retention => '75 seconds', partition_interval => '1 second', premake => 20);
-- the first partitions of the run, on the run's clock: in place before the
-- load starts (the rounds alongside may find a partition busy and skip)
SET idempotency.debug_clock_offset = 864000;
SELECT count(*) FROM idem_maintain();
RESET idempotency.debug_clock_offset;
-- what the committed emits returned: tx and pos give the call / array order
CREATE TABLE stress_emitted (
    tx bigint NOT NULL, pos int NOT NULL,
    id uuid NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
    seq bigint NOT NULL, payload jsonb NOT NULL);
-- what the relays published (n gives the publication order), with the dead
-- policy and the time of the claim
CREATE TABLE consumer_log (
    n bigserial PRIMARY KEY, relay int NOT NULL, lease_token uuid, lease_until timestamptz,
    ord bigint NOT NULL, id uuid NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
    seq bigint NOT NULL, payload jsonb, attempts int, policy text, claimed_at timestamptz,
    published_at timestamptz NOT NULL DEFAULT clock_timestamp());
-- what the acks returned
CREATE TABLE ack_log (relay int NOT NULL, lease_token uuid, sent int NOT NULL, acked int NOT NULL,
                      acked_at timestamptz NOT NULL DEFAULT clock_timestamp());
-- each relay's current batch, as claimed; publish: before the first poison
-- event of its aggregate in the batch
CREATE UNLOGGED TABLE relay_batch (
    relay int NOT NULL, ord bigint NOT NULL, id uuid, aggregate_type text, aggregate_id text,
    seq bigint, payload jsonb, attempts int, lease_token uuid, lease_until timestamptz,
    publish boolean, policy text, claimed_at timestamptz);
-- the dead policy the relays use (read every round), and when it changed
CREATE TABLE stress_policy (policy text NOT NULL, switched_at timestamptz);
INSERT INTO stress_policy VALUES ('block', NULL);
SQL

# what a relay keeps of its claim ($claim: the idem_outbox_claim call)
keep_batch() {
    cat <<SQL
INSERT INTO relay_batch
  SELECT $1, c.ordinality, c.id, c.aggregate_type, c.aggregate_id, c.seq, c.payload, c.attempts,
         c.lease_token, c.lease_until,
         NOT coalesce(bool_or((c.payload->>'poison')::boolean)
                        OVER (PARTITION BY c.aggregate_type, c.aggregate_id ORDER BY c.seq), false),
         current_setting('idempotency.outbox_dead_policy'), clock_timestamp()
  FROM $2 WITH ORDINALITY c;
SQL
}
# publishing: the batch's publishable events into consumer_log
publish_batch() {
    cat <<SQL
INSERT INTO consumer_log (relay, lease_token, lease_until, ord, id, aggregate_type, aggregate_id, seq, payload,
                          attempts, policy, claimed_at)
  SELECT relay, lease_token, lease_until, ord, id, aggregate_type, aggregate_id, seq, payload, attempts,
         policy, claimed_at
  FROM relay_batch WHERE relay = $1 AND publish ORDER BY ord;
SQL
}

# an emitting transaction: one emit, two emits to the same aggregate, or
# emit_many over 4 aggregates in random order (repeats allowed); type 'cart'
# a quarter of the time; ROLLBACK_PCT % roll back
{ cat <<'PGBENCH'
\set a random_zipfian(1, :naggs, 1.1)
\set b random_zipfian(1, :naggs, 1.1)
\set c random_zipfian(1, :naggs, 1.1)
\set t random(1, 4)
\set mode random(1, 4)
\set r random(1, 100)
\set p random(1, 100)
BEGIN;
\if :mode <= 2
INSERT INTO stress_emitted SELECT txid_current(), 1, e.id, e.aggregate_type, e.aggregate_id, e.seq, e.payload
  FROM idem_outbox_emit(CASE WHEN :t = 1 THEN 'cart' ELSE 'acct' END, :a::text, 'one',
                        jsonb_build_object('a', :a::int, 'r', :r::int, 'poison', :p::int = 1)) e;
\elif :mode = 3
INSERT INTO stress_emitted SELECT txid_current(), 1, e.id, e.aggregate_type, e.aggregate_id, e.seq, e.payload
  FROM idem_outbox_emit(CASE WHEN :t = 1 THEN 'cart' ELSE 'acct' END, :a::text, 'first',
                        jsonb_build_object('a', :a::int, 'n', 1)) e;
INSERT INTO stress_emitted SELECT txid_current(), 2, e.id, e.aggregate_type, e.aggregate_id, e.seq, e.payload
  FROM idem_outbox_emit(CASE WHEN :t = 1 THEN 'cart' ELSE 'acct' END, :a::text, 'second',
                        jsonb_build_object('a', :a::int, 'n', 2), '{"h": 1}') e;
\else
INSERT INTO stress_emitted SELECT txid_current(), e.ordinality, e.id, e.aggregate_type, e.aggregate_id, e.seq, e.payload
  FROM idem_outbox_emit_many(CASE WHEN :t = 1 THEN 'cart' ELSE 'acct' END,
                             ARRAY[:a::text, :b::text, :a::text, :c::text],
                             ARRAY['m1', 'm2', 'm3', 'm4'],
                             ARRAY[jsonb_build_object('p', 1, 'poison', :p::int = 1), jsonb_build_object('p', 2),
                                   jsonb_build_object('p', 3), jsonb_build_object('p', 4)])
       WITH ORDINALITY e;
\endif
PGBENCH
pgbench_end rollback_pct
} >"$tmp/emit.sql"

# a two-phase emitting transaction (pgbench -M simple: the gid is literal
# text); a prepared transaction sends no NOTIFY, its events wait for the
# relays' polls
cat >"$tmp/emit2pc.sql" <<'PGBENCH'
\set a random_zipfian(1, :naggs, 1.1)
\set r random(1, 100)
\set p random(1, 100)
\set g random(1, 1000000000)
BEGIN;
INSERT INTO stress_emitted SELECT txid_current(), 1, e.id, e.aggregate_type, e.aggregate_id, e.seq, e.payload
  FROM idem_outbox_emit('acct', ':a', 'prepared', jsonb_build_object('a', :a, 'r', :r, 'poison', :p = 1)) e;
PREPARE TRANSACTION 'stress-:client_id-:g';
\sleep 20 ms
\if :r <= :rollback_pct
ROLLBACK PREPARED 'stress-:client_id-:g';
\else
COMMIT PREPARED 'stress-:client_id-:g';
\endif
PGBENCH

# a relay round: the dead policy of the moment; claim (autocommit; the batch
# is kept in relay_batch), publish (a transaction of its own: the
# INSERT INTO consumer_log, which relay 4's termination looks for), wait
# ack_delay ms, ack what it published with the lease token, nack the first
# poison event of each aggregate
cat >"$tmp/relay.sql" <<PGBENCH
SELECT set_config('idempotency.outbox_dead_policy', policy, false) FROM stress_policy;
DELETE FROM relay_batch WHERE relay = :relay::int;
$(keep_batch ':relay::int' "idem_outbox_claim(:batch, :lease::interval,
                         CASE WHEN :relay::int = 3 THEN ARRAY['acct'] END)")
SELECT count(*) AS n, coalesce(min(lease_token::text), '00000000-0000-0000-0000-000000000000') AS tok
  FROM relay_batch WHERE relay = :relay::int \gset
\if :n > 0
$(publish_batch ':relay::int')
\if :ack_delay > 0
\sleep :ack_delay ms
\endif
INSERT INTO ack_log (relay, lease_token, sent, acked)
  SELECT :relay::int, :tok::uuid, count(*),
         idem_outbox_ack(coalesce(array_agg(id ORDER BY ord), '{}'), :tok::uuid)
  FROM relay_batch WHERE relay = :relay::int AND publish;
SELECT count(idem_outbox_nack(b.id, 'poison', '0', b.lease_token)) FROM relay_batch b
 WHERE b.relay = :relay::int AND NOT b.publish
   AND NOT EXISTS (SELECT FROM relay_batch q WHERE q.relay = b.relay AND NOT q.publish
                     AND q.aggregate_type = b.aggregate_type AND q.aggregate_id = b.aggregate_id AND q.seq < b.seq);
\else
\sleep 20 ms
\endif
PGBENCH

# relay RELAY SECONDS ACK_DELAY_MS OUT: one relay in the background ($! is
# its pid), output to $tmp/OUT
relay() {
    pgbench_loop "relay$1" "$2" "$tmp/relay.sql" "$4" -D relay="$1" -D batch="$BATCH" -D lease="$LEASE" \
        -D ack_delay="$3"
}

maintain_alongside

RELAY_SECS=$((SECONDS_RUN + DRAIN + 30))     # stopped once all is delivered
echo "outbox stress: $CLIENTS emitters for ${SECONDS_RUN}s at $RATE transactions/s on $NAGGS zipf-skewed aggregates, $ROLLBACK_PCT % rollbacks;"
echo "  1 two-phase emitter (PREPARE, COMMIT / ROLLBACK PREPARED); 1 % poison events, dead after 5 attempts;"
echo "  4 relays (batch $BATCH, lease $LEASE) until all is delivered (at most ${DRAIN}s after the emitters), relay 4 terminated mid-lease, 1 stale relay;"
echo "  dead policy 'block', then 'skip' after $((SECONDS_RUN / 2))s"
start=$SECONDS
relay 1 "$RELAY_SECS" 0 relay1.out; r1=$!
relay 2 "$RELAY_SECS" 0 relay2.out; r2=$!
relay 3 "$RELAY_SECS" 0 relay3.out; r3=$!
relay 4 "$RELAY_SECS" 5000 relay4-killed.out; r4=$!   # 5 s between publish and ack: room to terminate it there, even on a loaded machine
bg_pids+=("$r1" "$r2" "$r3" "$r4")
pgbench -n -M extended -c "$CLIENTS" -j 2 -T "$SECONDS_RUN" -R "$RATE" \
    -D naggs="$NAGGS" -D rollback_pct="$ROLLBACK_PCT" -f "$tmp/emit.sql" >"$tmp/emit.out" 2>&1 &
emit_pid=$!
bg_pids+=("$emit_pid")
pgbench -n -M simple -c 1 -T "$SECONDS_RUN" -R 20 \
    -D naggs="$NAGGS" -D rollback_pct="$ROLLBACK_PCT" -f "$tmp/emit2pc.sql" >"$tmp/emit2pc.out" 2>&1 &
emit2pc_pid=$!
bg_pids+=("$emit2pc_pid")
# halfway: the relays switch from 'block' to 'skip' (switched_at is taken
# before the change commits: a relay that reads 'skip' read it later)
(
    sleep $((SECONDS_RUN / 2))
    sql -c "UPDATE stress_policy SET policy = 'skip', switched_at = clock_timestamp()"
) &
switch_pid=$!
bg_pids+=("$switch_pid")

sleep 1
# terminate relay 4 while it waits between publishing and acking
terminate_mid_publish 4
if [[ -n $killed_token ]]; then
    rc=0
    wait "$r4" || rc=$?
    [[ $rc -ne 0 ]] || { cat "$tmp/relay4-killed.out"; fail "relay 4 did not end by the termination of its backend (status $rc)"; }
    relay 4 "$((RELAY_SECS - (SECONDS - start)))" 0 relay4.out; r4b=$!
    bg_pids+=("$r4b")
fi

# the stale relay: claim, publish, sleep past the lease, ack late (relay 5);
# it tries while the emitters run (the throttled outbox is often empty, and
# the other relays poll every 20 ms)
for _ in $(seq 1 300); do
    kill -0 "$emit_pid" 2>/dev/null || break
    PGOPTIONS="$PGOPTIONS -c client_min_messages=warning" sql <<SQL
DELETE FROM relay_batch WHERE relay = 5;
$(keep_batch 5 "idem_outbox_claim($BATCH, '$LEASE')")
$(publish_batch 5)
SQL
    [[ $(sql -c "SELECT count(*) FROM relay_batch WHERE relay = 5") -gt 0 ]] && break
    sleep 0.1
done
stale_n=$(sql -c "SELECT count(*) FROM relay_batch WHERE relay = 5")
stale_ack=''
if [[ $stale_n -gt 0 ]]; then
    sleep 3     # the 2-second lease expires; the other relays may take the run over
    stale_ack=$(sql -c "INSERT INTO ack_log (relay, lease_token, sent, acked)
                        SELECT 5, t.tok, count(b.id),
                               idem_outbox_ack(coalesce(array_agg(b.id ORDER BY b.ord), '{}'), t.tok)
                        FROM (SELECT min(lease_token::text)::uuid AS tok FROM relay_batch WHERE relay = 5) t
                        LEFT JOIN relay_batch b ON b.relay = 5 AND b.publish
                        GROUP BY t.tok RETURNING acked")
fi

rc=0
wait "$emit_pid" || rc=$?
pgbench_report emitters emit.out "$rc"
rc=0
wait "$emit2pc_pid" || rc=$?
pgbench_report "two-phase emitter" emit2pc.out "$rc"
wait "$switch_pid" || fail "the switch to policy 'skip' failed"
expect_zero "prepared transactions left" "SELECT count(*) FROM pg_prepared_xacts" "SELECT gid FROM pg_prepared_xacts"
# the relays drain what is left, then stop
wait_drained "$DRAIN" "SELECT NOT EXISTS (SELECT FROM stress_emitted s
                                         WHERE (s.payload->>'poison')::boolean IS NOT TRUE
                                           AND NOT EXISTS (SELECT FROM consumer_log c WHERE c.id = s.id))
                        AND (SELECT coalesce(sum(acked), 0) FROM ack_log)
                            >= (SELECT count(*) FROM stress_emitted WHERE (payload->>'poison')::boolean IS NOT TRUE)
                        AND NOT EXISTS (SELECT FROM (SELECT aggregate_type, aggregate_id, max(seq) AS m
                                                     FROM stress_emitted GROUP BY 1, 2) e
                                        LEFT JOIN idempotency.outbox_deliveries d USING (aggregate_type, aggregate_id)
                                        WHERE d.acked_seq IS DISTINCT FROM e.m)"
echo "relays drained the outbox ${drain_secs}s after the emitters stopped"
[[ $drained == t ]] || fail "the relays did not deliver and ack everything within ${DRAIN}s after the emitters stopped"
for p in "$r1" "$r2" "$r3" "${r4b:-$r4}"; do
    kill "$p" 2>/dev/null || fail "a relay's pgbench ended before the outbox was drained"
    wait "$p" 2>/dev/null || true
done
check_outputs "$tmp"/relay[1234].out
maintain_stop

read -r emitted events published pubs claims aggs parts <<<"$(sql -F ' ' -c "
SELECT (SELECT count(*) FROM stress_emitted),
       (SELECT count(*) FROM idempotency.outbox_events),
       (SELECT count(DISTINCT id) FROM consumer_log),
       (SELECT count(*) FROM consumer_log),
       (SELECT count(DISTINCT lease_token) FROM consumer_log),
       (SELECT count(*) FROM (SELECT DISTINCT aggregate_type, aggregate_id FROM stress_emitted) x),
       (SELECT count(DISTINCT tableoid) FROM idempotency.outbox_events)")"
echo "committed events: $emitted on $aggs aggregates (outbox_events: $events rows in $parts partitions)"
echo "published: $published distinct events in $pubs publications from $claims claims"
echo "relay 4 terminated holding lease ${killed_token:-<none>}; stale relay: $stale_n events, late ack returned '${stale_ack}'"

[[ $emitted -ge 1000 ]] || fail "only $emitted committed events: too few to mean anything"
[[ $parts -ge 3 ]] || fail "events landed in $parts partition(s), expected several (1-second partitions)"

expect_zero "committed emits missing from outbox_events" \
    "SELECT count(*) FROM stress_emitted s WHERE NOT EXISTS (SELECT FROM idempotency.outbox_events e
       WHERE e.id = s.id AND e.aggregate_type = s.aggregate_type AND e.aggregate_id = s.aggregate_id AND e.seq = s.seq)" \
    "SELECT * FROM stress_emitted s WHERE NOT EXISTS (SELECT FROM idempotency.outbox_events e WHERE e.id = s.id) LIMIT 5"
expect_zero "events in outbox_events that no committed emit returned" \
    "SELECT count(*) FROM idempotency.outbox_events e WHERE NOT EXISTS (SELECT FROM stress_emitted s
       WHERE e.id = s.id AND e.aggregate_type = s.aggregate_type AND e.aggregate_id = s.aggregate_id AND e.seq = s.seq)"
expect_zero "event ids stored twice" \
    "SELECT count(*) FROM (SELECT id FROM idempotency.outbox_events GROUP BY id HAVING count(*) > 1) x"
expect_zero "aggregates whose seqs are not exactly 1..max" \
    "SELECT count(*) FROM (SELECT aggregate_type, aggregate_id FROM idempotency.outbox_events
       GROUP BY 1, 2 HAVING min(seq) <> 1 OR max(seq) <> count(*) OR count(DISTINCT seq) <> count(*)) x" \
    "SELECT aggregate_type, aggregate_id, min(seq), max(seq), count(*), count(DISTINCT seq) FROM idempotency.outbox_events
       GROUP BY 1, 2 HAVING min(seq) <> 1 OR max(seq) <> count(*) OR count(DISTINCT seq) <> count(*) LIMIT 5"
expect_zero "counter rows written by table-mode emits (seq comes from the events)" \
    "SELECT count(*) FROM idempotency.outbox_sequences"
expect_zero "emitting transactions whose events of one aggregate are not consecutive seqs in call order" \
    "SELECT count(*) FROM (SELECT seq - lag(seq) OVER w AS d FROM stress_emitted
       WINDOW w AS (PARTITION BY tx, aggregate_type, aggregate_id ORDER BY pos)) x WHERE d <> 1"
expect_zero "committed events never published, not poison" \
    "SELECT count(*) FROM stress_emitted s WHERE NOT EXISTS (SELECT FROM consumer_log c WHERE c.id = s.id)
       AND (s.payload->>'poison')::boolean IS NOT TRUE" \
    "SELECT s.aggregate_type, s.aggregate_id, s.seq, d.acked_seq, d.leased_seq, d.lease_until, d.dead_seq, d.retry_at
       FROM stress_emitted s LEFT JOIN idempotency.outbox_deliveries d USING (aggregate_type, aggregate_id)
       WHERE NOT EXISTS (SELECT FROM consumer_log c WHERE c.id = s.id) AND (s.payload->>'poison')::boolean IS NOT TRUE LIMIT 5"
expect_zero "poison events published" \
    "SELECT count(*) FROM consumer_log WHERE (payload->>'poison')::boolean IS TRUE"
expect_zero "committed poison events not dead-lettered" \
    "SELECT count(*) FROM stress_emitted s WHERE (s.payload->>'poison')::boolean IS TRUE
       AND NOT EXISTS (SELECT FROM idempotency.outbox_dead l WHERE l.id = s.id)"
expect_zero "dead letters of events that are not poison (or not committed)" \
    "SELECT count(*) FROM idempotency.outbox_dead l WHERE NOT EXISTS (SELECT FROM stress_emitted s
       WHERE s.id = l.id AND (s.payload->>'poison')::boolean IS TRUE)" \
    "SELECT aggregate_type, aggregate_id, seq, attempts, last_error FROM idempotency.outbox_dead l
      WHERE NOT EXISTS (SELECT FROM stress_emitted s WHERE s.id = l.id AND (s.payload->>'poison')::boolean IS TRUE) LIMIT 5"
expect_zero "publications of events that no committed emit returned, or with another aggregate, seq or payload" \
    "SELECT count(*) FROM consumer_log c WHERE NOT EXISTS (SELECT FROM stress_emitted s
       WHERE s.id = c.id AND s.aggregate_type = c.aggregate_type AND s.aggregate_id = c.aggregate_id
         AND s.seq = c.seq AND s.payload = c.payload)"
# (in seq order: a seq passed over between two first publications must be a
# dead letter)
out_of_order="FROM (SELECT aggregate_type, aggregate_id, seq, lag(seq) OVER w AS prev
         FROM (SELECT aggregate_type, aggregate_id, seq, min(n) AS first_n FROM consumer_log GROUP BY 1, 2, 3) f
         WINDOW w AS (PARTITION BY aggregate_type, aggregate_id ORDER BY first_n)) x
       WHERE seq <= coalesce(prev, 0)
          OR EXISTS (SELECT FROM generate_series(coalesce(prev, 0) + 1, seq - 1) g(s)
                     WHERE NOT EXISTS (SELECT FROM idempotency.outbox_dead l WHERE l.aggregate_type = x.aggregate_type
                                         AND l.aggregate_id = x.aggregate_id AND l.seq = g.s))"
expect_zero "aggregates whose first publications are not in seq order" \
    "SELECT count(*) $out_of_order" "SELECT aggregate_type, aggregate_id, seq, prev $out_of_order LIMIT 5"
switched_at=$(sql -c "SELECT switched_at FROM stress_policy")
[[ -n $switched_at ]] || fail "the dead policy never switched to 'skip'"
# (dead_at is on the extension's clock, CLOCK_OFFSET seconds ahead)
dead_before=$(sql -c "SELECT count(*) FROM idempotency.outbox_dead
                      WHERE dead_at - interval '$CLOCK_OFFSET seconds' < '$switched_at'")
[[ $dead_before -gt 0 ]] && echo "ok: $dead_before events died under 'block', before the switch to 'skip'" \
    || fail "no event died before the switch to 'skip' (the switch took no blocked aggregate)"
expect_zero "publications by claims under 'block' (before the switch) of events behind a dead letter" \
    "SELECT count(*) FROM consumer_log c WHERE c.claimed_at < '$switched_at' AND EXISTS (
       SELECT FROM idempotency.outbox_dead l WHERE l.aggregate_type = c.aggregate_type
         AND l.aggregate_id = c.aggregate_id AND l.seq < c.seq)"
echo "claims under 'skip' that published: $(sql -c "SELECT count(DISTINCT lease_token) FROM consumer_log WHERE policy = 'skip'")," \
     "two-phase events committed: $(sql -c "SELECT count(*) FROM idempotency.outbox_events WHERE event_type = 'prepared'")"
expect_zero "claims whose rows carry more than one lease token / lease_until / relay" \
    "SELECT count(*) FROM (SELECT lease_token FROM consumer_log GROUP BY 1
       HAVING count(DISTINCT lease_until) <> 1 OR count(DISTINCT relay) <> 1 OR lease_token IS NULL) x"
expect_zero "claims whose run of an aggregate is not consecutive seqs in output order" \
    "SELECT count(*) FROM (SELECT seq - lag(seq) OVER w AS d, ord - lag(ord) OVER w AS o FROM consumer_log
       WINDOW w AS (PARTITION BY lease_token, aggregate_type, aggregate_id ORDER BY ord)) x WHERE d <> 1"
expect_zero "claims that interleave aggregates (a run is not contiguous in the output)" \
    "SELECT count(*) FROM (SELECT lease_token, aggregate_type, aggregate_id FROM consumer_log
       GROUP BY 1, 2, 3 HAVING max(ord) - min(ord) + 1 <> count(*)) x"
expect_zero "publications with attempts < 1" "SELECT count(*) FROM consumer_log WHERE NOT attempts >= 1"
expect_zero "claims larger than the batch" \
    "SELECT count(*) FROM (SELECT lease_token FROM consumer_log GROUP BY 1 HAVING count(*) > $BATCH) x"
expect_zero "events of type 'cart' published by relay 3 (restricted to 'acct')" \
    "SELECT count(*) FROM consumer_log WHERE relay = 3 AND aggregate_type <> 'acct'"
# (an event handed out again after a publication of it was fully acked; a
# relay that stalled past its lease between claim and publish may publish
# its stale copy after the relay that took over acked it -- at-least-once,
# its own ack then marks nothing -- so claims are ordered by their leases,
# all of one length, not by when they were published)
expect_zero "events handed out again after a publication of them was fully acked" \
    "SELECT count(*) FROM consumer_log c WHERE EXISTS (
       SELECT FROM consumer_log p JOIN ack_log a ON a.lease_token = p.lease_token
       WHERE p.id = c.id AND p.lease_until < c.lease_until AND a.acked = a.sent)" \
    "SELECT c.relay, c.aggregate_id, c.seq, c.attempts, c.lease_until, p.relay, p.attempts, p.lease_until, a.*
       FROM consumer_log c JOIN consumer_log p ON p.id = c.id AND p.lease_until < c.lease_until
       JOIN ack_log a ON a.lease_token = p.lease_token WHERE a.acked = a.sent LIMIT 5"
echo "publications after another relay's full ack of the same event (a stale lease; at-least-once):" \
    "$(sql -c "SELECT count(*) FROM consumer_log c WHERE EXISTS (
                 SELECT FROM consumer_log p JOIN ack_log a ON a.lease_token = p.lease_token
                 WHERE p.id = c.id AND p.n < c.n AND a.acked = a.sent)")"
acked_sum=$(sql -c "SELECT coalesce(sum(acked), 0) FROM ack_log")
deliverable=$(sql -c "SELECT count(*) FROM stress_emitted WHERE (payload->>'poison')::boolean IS NOT TRUE")
[[ $acked_sum -eq $deliverable ]] && echo "ok: the acks marked $acked_sum events, one per committed event not poison" \
    || fail "the acks marked $acked_sum events in all, but $deliverable events not poison were committed (each must be marked exactly once)"
expect_zero "aggregates not fully acked at the end, or parked or dead" \
    "SELECT count(*) FROM (SELECT aggregate_type, aggregate_id, max(seq) AS m FROM stress_emitted GROUP BY 1, 2) e
       LEFT JOIN idempotency.outbox_deliveries d USING (aggregate_type, aggregate_id)
       WHERE d.acked_seq IS DISTINCT FROM e.m OR d.dead_seq IS NOT NULL OR d.retry_at IS NOT NULL" \
    "SELECT e.*, d.* FROM (SELECT aggregate_type, aggregate_id, max(seq) AS m FROM stress_emitted GROUP BY 1, 2) e
       LEFT JOIN idempotency.outbox_deliveries d USING (aggregate_type, aggregate_id)
       WHERE d.acked_seq IS DISTINCT FROM e.m OR d.dead_seq IS NOT NULL OR d.retry_at IS NOT NULL LIMIT 5"
expect_zero "a claim now still returns events" "SELECT count(*) FROM idem_outbox_claim(1000, '1 second')"

if [[ -z $killed_token ]]; then
    fail "relay 4 was never caught between publishing and acking (not terminated mid-lease)"
else
    expect_zero "relay 4's terminated lease has an ack" \
        "SELECT count(*) FROM ack_log WHERE lease_token = '$killed_token'"
    kn=$(sql -c "SELECT count(*) FROM consumer_log WHERE lease_token = '$killed_token'")
    [[ $kn -gt 0 ]] && echo "ok: relay 4 was terminated after publishing $kn events unacked" \
        || fail "relay 4's terminated lease published nothing"
    expect_zero "events of relay 4's terminated lease not published again by another relay" \
        "SELECT count(*) FROM consumer_log k WHERE k.lease_token = '$killed_token'
           AND NOT EXISTS (SELECT FROM consumer_log c WHERE c.id = k.id AND c.n > k.n AND c.lease_token <> k.lease_token)"
    # the head of each aggregate of that lease did not move (never acked), so
    # its next hand-out counts one more attempt
    expect_zero "heads of relay 4's terminated lease handed out again without a higher attempts count" \
        "SELECT count(*) FROM (SELECT DISTINCT ON (aggregate_type, aggregate_id) aggregate_type, aggregate_id, seq, attempts
                               FROM consumer_log WHERE lease_token = '$killed_token'
                               ORDER BY aggregate_type, aggregate_id, seq) k
           WHERE (SELECT c.attempts FROM consumer_log c WHERE c.id = (SELECT id FROM consumer_log x
                    WHERE x.lease_token = '$killed_token' AND x.aggregate_type = k.aggregate_type
                      AND x.aggregate_id = k.aggregate_id AND x.seq = k.seq)
                    AND c.lease_token <> '$killed_token' AND c.n > (SELECT min(n) FROM consumer_log
                      WHERE lease_token = '$killed_token')
                  ORDER BY c.n LIMIT 1) IS DISTINCT FROM k.attempts + 1" \
        "SELECT n, relay, lease_token, aggregate_type, aggregate_id, seq, attempts FROM consumer_log c
           WHERE (aggregate_type, aggregate_id) IN (SELECT aggregate_type, aggregate_id FROM consumer_log
                                                   WHERE lease_token = '$killed_token') ORDER BY n LIMIT 10"
fi
if [[ $stale_n -gt 0 ]]; then
    [[ $stale_ack == 0 ]] && echo "ok: the stale relay's late ack returned 0" \
        || fail "the stale relay's ack after its lease expired returned '$stale_ack', expected 0"
    expect_zero "events of the stale relay's lease (not poison) not published again" \
        "SELECT count(*) FROM relay_batch k WHERE k.relay = 5 AND (k.payload->>'poison')::boolean IS NOT TRUE
           AND NOT EXISTS (SELECT FROM consumer_log c WHERE c.id = k.id AND c.relay <> 5)"
else
    fail "the stale relay never got a batch"
fi
dups=$(sql -c "SELECT count(*) - count(DISTINCT id) FROM consumer_log")
echo "re-publications (at-least-once): $dups"

if [[ $failed -ne 0 ]]; then
    echo "outbox stress: FAILED"
    exit 1
fi
echo "outbox stress: ok"
