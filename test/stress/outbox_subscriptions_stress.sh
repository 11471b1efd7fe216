#!/usr/bin/env bash
# test/stress/outbox_subscriptions_stress.sh: several subscriptions reading
# one outbox under concurrent emitters, relays that are killed, and
# rollbacks.
#
# Emitters (pgbench) emit onto zipf-skewed aggregates of types 'acct' and
# 'cart' (one emit, two to one aggregate, or emit_many over 4 aggregates in
# random order) and record what emit returned in stress_emitted, in the same
# transaction; ROLLBACK_PCT % roll back.  Three subscriptions read the log:
# 'default' (every type; two relays), 'audit' (type 'acct' only, subscribed
# 'earliest' before the run; two relays, one of which waits 5 s between
# publishing and acking and is terminated there, mid-lease, then started
# again) and 'late' (every type, subscribed 'now' halfway through the run;
# one relay).  A relay loops: claim a batch (2-second lease) for its
# subscription, "publish" it into consumer_log, ack it with the lease token.
# idem_maintain() runs every half second with 1-second partitions.
# Checks, per subscription:
#   - every committed event of its types was published to it at least once
#     ('late': every one committed after its subscribe), and nothing else:
#     no event of a rolled-back transaction, none of another type;
#   - per aggregate, its first publications come in seq order without gaps;
#   - its claims: one lease token each, one relay;
#   - the terminated audit relay held a lease, and its events were
#     published again by the other;
#   - afterwards every aggregate is acked to its newest seq (of the types
#     the subscription reads; 'late' from its start), no lease is left,
#     no event is dead, and the subscriptions' backlogs are empty.
# Connection from PGHOST/PGPORT/PGDATABASE/PGUSER (superuser: it terminates a
# backend); run by test/run-tests (part "stress") in an empty database.
# Settings: IDEM_STRESS_SECONDS (emitting time, default 15),
# IDEM_STRESS_CLIENTS (emitters, default 4), IDEM_STRESS_AGGREGATES (default
# 1000), IDEM_STRESS_ROLLBACK_PCT (default 20), IDEM_STRESS_RATE (emitting
# transactions per second, default 300), IDEM_STRESS_DRAIN (seconds allowed
# to deliver everything after the emitters stop, default 60).
set -euo pipefail

SECONDS_RUN=${IDEM_STRESS_SECONDS:-15}
CLIENTS=${IDEM_STRESS_CLIENTS:-4}
NAGGS=${IDEM_STRESS_AGGREGATES:-1000}
ROLLBACK_PCT=${IDEM_STRESS_ROLLBACK_PCT:-20}
RATE=${IDEM_STRESS_RATE:-300}
DRAIN=${IDEM_STRESS_DRAIN:-60}
LEASE='2 seconds'
BATCH=20

# the extension's clock 10 days ahead: past the 1-day partitions CREATE
# EXTENSION premade, so events go into 1-second ones
base_options=${PGOPTIONS:-}
export PGOPTIONS="$base_options -c idempotency.debug_clock_offset=864000"

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
SELECT idem_outbox_subscribe('audit', ARRAY['acct'], 'earliest');
CREATE TABLE stress_emitted (
    tx bigint NOT NULL, id uuid NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
    seq bigint NOT NULL, emitted_at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE consumer_log (
    n bigserial PRIMARY KEY, subscription text NOT NULL, relay int NOT NULL, lease_token uuid,
    id uuid NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL, seq bigint NOT NULL);
CREATE UNLOGGED TABLE relay_batch (
    relay int NOT NULL, subscription text, id uuid, aggregate_type text, aggregate_id text, seq bigint,
    lease_token uuid);
CREATE TABLE stress_subscribed (name text PRIMARY KEY, at timestamptz NOT NULL);
SQL

{ cat <<'PGBENCH'
\set a random_zipfian(1, :naggs, 1.1)
\set b random_zipfian(1, :naggs, 1.1)
\set c random_zipfian(1, :naggs, 1.1)
\set t random(1, 3)
\set mode random(1, 3)
\set r random(1, 100)
BEGIN;
\if :mode = 1
INSERT INTO stress_emitted (tx, id, aggregate_type, aggregate_id, seq)
  SELECT txid_current(), e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM idem_outbox_emit(CASE WHEN :t = 1 THEN 'cart' ELSE 'acct' END, :a::text, 'one', '{}') e;
\elif :mode = 2
INSERT INTO stress_emitted (tx, id, aggregate_type, aggregate_id, seq)
  SELECT txid_current(), e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM idem_outbox_emit(CASE WHEN :t = 1 THEN 'cart' ELSE 'acct' END, :a::text, 'first', '{}') e;
INSERT INTO stress_emitted (tx, id, aggregate_type, aggregate_id, seq)
  SELECT txid_current(), e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM idem_outbox_emit(CASE WHEN :t = 1 THEN 'cart' ELSE 'acct' END, :a::text, 'second', '{}') e;
\else
INSERT INTO stress_emitted (tx, id, aggregate_type, aggregate_id, seq)
  SELECT txid_current(), e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM idem_outbox_emit_many(CASE WHEN :t = 1 THEN 'cart' ELSE 'acct' END,
                             ARRAY[:a::text, :b::text, :a::text, :c::text], ARRAY['m1', 'm2', 'm3', 'm4'],
                             array_fill('{}'::jsonb, ARRAY[4])) e;
\endif
PGBENCH
pgbench_end rollback_pct
} >"$tmp/emit.sql"

# a relay round for subscription :sub: claim (kept in relay_batch), publish
# (a transaction of its own, which the termination looks for), wait
# :ack_delay ms, ack with the lease token
cat >"$tmp/relay.sql" <<'PGBENCH'
DELETE FROM relay_batch WHERE relay = :relay::int;
INSERT INTO relay_batch
  SELECT :relay::int, :sub, c.id, c.aggregate_type, c.aggregate_id, c.seq, c.lease_token
  FROM idem_outbox_claim(:batch, :lease::interval, NULL, :sub) c;
SELECT count(*) AS n, coalesce(min(lease_token::text), '00000000-0000-0000-0000-000000000000') AS tok
  FROM relay_batch WHERE relay = :relay::int \gset
\if :n > 0
INSERT INTO consumer_log (subscription, relay, lease_token, id, aggregate_type, aggregate_id, seq)
  SELECT subscription, relay, lease_token, id, aggregate_type, aggregate_id, seq
  FROM relay_batch WHERE relay = :relay::int ORDER BY aggregate_type, aggregate_id, seq;
\if :ack_delay > 0
\sleep :ack_delay ms
\endif
SELECT idem_outbox_ack(array_agg(id), :tok::uuid, :sub) FROM relay_batch WHERE relay = :relay::int;
\else
\sleep 20 ms
\endif
PGBENCH

# relay RELAY SUBSCRIPTION SECONDS ACK_DELAY_MS OUT ($! is its pid)
relay() {
    pgbench_loop "relay$1" "$3" "$tmp/relay.sql" "$5" -D relay="$1" -D sub="$2" -D batch="$BATCH" \
        -D lease="$LEASE" -D ack_delay="$4"
}

maintain_alongside
RELAY_SECS=$((SECONDS_RUN + DRAIN + 30))
echo "outbox subscriptions stress: $CLIENTS emitters for ${SECONDS_RUN}s at $RATE transactions/s on $NAGGS aggregates, $ROLLBACK_PCT % rollbacks;"
echo "  subscriptions default (2 relays), audit (acct only, earliest; 2 relays, one terminated mid-lease), late (now, halfway; 1 relay)"
start=$SECONDS
relay 1 default "$RELAY_SECS" 0 relay1.out; r1=$!
relay 2 default "$RELAY_SECS" 0 relay2.out; r2=$!
relay 3 audit "$RELAY_SECS" 0 relay3.out; r3=$!
relay 4 audit "$RELAY_SECS" 5000 relay4-killed.out; r4=$!
bg_pids+=("$r1" "$r2" "$r3" "$r4")
pgbench -n -M extended -c "$CLIENTS" -j 2 -T "$SECONDS_RUN" -R "$RATE" \
    -D naggs="$NAGGS" -D rollback_pct="$ROLLBACK_PCT" -f "$tmp/emit.sql" >"$tmp/emit.out" 2>&1 &
emit_pid=$!
bg_pids+=("$emit_pid")

# terminate relay 4 while it waits between publishing and acking
sleep 1
terminate_mid_publish 4
if [[ -n $killed_token ]]; then
    wait "$r4" || true
    relay 4 audit "$((RELAY_SECS - (SECONDS - start)))" 0 relay4.out; r4=$!
    bg_pids+=("$r4")
fi

# halfway: subscription 'late' from now, and its relay
sleep $((SECONDS_RUN / 2 > SECONDS - start ? SECONDS_RUN / 2 - (SECONDS - start) : 0))
sql -c "INSERT INTO stress_subscribed SELECT 'late', clock_timestamp() WHERE idem_outbox_subscribe('late')" >/dev/null
relay 5 late "$((RELAY_SECS - (SECONDS - start)))" 0 relay5.out; r5=$!
bg_pids+=("$r5")

rc=0
wait "$emit_pid" || rc=$?
pgbench_report emitters emit.out "$rc"

# what each subscription must get: (subscription, event), 'late' from its
# subscribe on (committed after it: emitted_at is taken before the commit,
# so an event emitted earlier may have committed later -- those it may get)
cat >"$tmp/expected.sql" <<'SQL'
CREATE VIEW expected AS
SELECT 'default'::text AS subscription, s.* FROM stress_emitted s
UNION ALL
SELECT 'audit', s.* FROM stress_emitted s WHERE s.aggregate_type = 'acct'
UNION ALL
SELECT 'late', s.* FROM stress_emitted s, stress_subscribed b WHERE b.name = 'late' AND s.emitted_at > b.at;
-- what a subscription may get: 'late' also what committed around its start
CREATE VIEW allowed AS
SELECT 'default'::text AS subscription, s.* FROM stress_emitted s
UNION ALL
SELECT 'audit', s.* FROM stress_emitted s WHERE s.aggregate_type = 'acct'
UNION ALL
SELECT 'late', s.* FROM stress_emitted s;
SQL
sql -f "$tmp/expected.sql" >/dev/null

wait_drained "$DRAIN" "SELECT NOT EXISTS (SELECT FROM expected x WHERE NOT EXISTS
                         (SELECT FROM consumer_log c WHERE c.subscription = x.subscription AND c.id = x.id))
                       AND NOT EXISTS (SELECT FROM idempotency.outbox_subscriptions_status WHERE pending > 0)"
echo "relays drained every subscription ${drain_secs}s after the emitters stopped"
[[ $drained == t ]] || fail "the relays did not deliver everything within ${DRAIN}s after the emitters stopped"
sleep 3     # the last acks (a lease of 2 s) settle
for p in "$r1" "$r2" "$r3" "$r4" "$r5"; do
    kill "$p" 2>/dev/null || fail "a relay's pgbench ended before the outbox was drained"
    wait "$p" 2>/dev/null || true
done
check_outputs "$tmp"/relay[12345].out
maintain_stop

read -r emitted parts <<<"$(sql -F ' ' -c "
SELECT (SELECT count(*) FROM stress_emitted), (SELECT count(DISTINCT tableoid) FROM idempotency.outbox_events)")"
sql -c "SELECT subscription, count(DISTINCT id), count(*) FROM consumer_log GROUP BY 1 ORDER BY 1" |
    sed 's/^/  published (subscription|distinct events|publications): /'
echo "committed events: $emitted in $parts partitions; relay 4 (audit) terminated holding lease ${killed_token:-<none>}"
[[ $emitted -ge 500 ]] || fail "only $emitted committed events: too few to mean anything"
[[ -n $killed_token ]] || fail "relay 4 was never terminated mid-lease"

expect_zero "(subscription, committed event) pairs never published" \
    "SELECT count(*) FROM expected x WHERE NOT EXISTS
       (SELECT FROM consumer_log c WHERE c.subscription = x.subscription AND c.id = x.id)"
expect_zero "publications a subscription should not have had (rolled back, another type)" \
    "SELECT count(*) FROM consumer_log c WHERE NOT EXISTS
       (SELECT FROM allowed a WHERE a.subscription = c.subscription AND a.id = c.id AND a.seq = c.seq
          AND a.aggregate_type = c.aggregate_type AND a.aggregate_id = c.aggregate_id)" \
    "SELECT subscription, aggregate_type, aggregate_id, seq FROM consumer_log c WHERE NOT EXISTS
       (SELECT FROM allowed a WHERE a.subscription = c.subscription AND a.id = c.id) LIMIT 5"
gaps="FROM (SELECT subscription, aggregate_type, aggregate_id, seq, lag(seq) OVER w AS prev
         FROM (SELECT subscription, aggregate_type, aggregate_id, seq, min(n) AS first_n
                 FROM consumer_log GROUP BY 1, 2, 3, 4) f
         WINDOW w AS (PARTITION BY subscription, aggregate_type, aggregate_id ORDER BY first_n)) x
       WHERE x.prev IS NOT NULL AND x.seq <> x.prev + 1"
expect_zero "aggregates whose first publications to a subscription are not in seq order, one by one" \
    "SELECT count(*) $gaps" "SELECT subscription, aggregate_type, aggregate_id, seq, prev $gaps LIMIT 5"
expect_zero "claims with more than one lease token or relay" \
    "SELECT count(*) FROM (SELECT lease_token FROM consumer_log GROUP BY 1
       HAVING count(DISTINCT relay) > 1 OR count(DISTINCT subscription) > 1) x"
expect_zero "events of relay 4's terminated lease not published again by another relay" \
    "SELECT count(*) FROM consumer_log k WHERE k.lease_token::text = '${killed_token:-none}'
       AND NOT EXISTS (SELECT FROM consumer_log c WHERE c.id = k.id AND c.subscription = 'audit' AND c.relay <> 4)"
expect_zero "aggregates of a subscription not acked to their newest seq" \
    "SELECT count(*) FROM (SELECT subscription, aggregate_type, aggregate_id, max(seq) AS m FROM expected GROUP BY 1, 2, 3) e
       JOIN idempotency.outbox_subscriptions b ON b.name = e.subscription
       LEFT JOIN idempotency.outbox_deliveries d
         ON d.subscription = b.id AND d.aggregate_type = e.aggregate_type AND d.aggregate_id = e.aggregate_id
       WHERE d.acked_seq IS DISTINCT FROM (SELECT max(o.seq) FROM idempotency.outbox_events o
                                           WHERE o.aggregate_type = e.aggregate_type AND o.aggregate_id = e.aggregate_id)"
expect_zero "leases left, parked or dead aggregates" \
    "SELECT count(*) FROM idempotency.outbox_deliveries WHERE lease_token IS NOT NULL OR retry_at IS NOT NULL
       OR dead_seq IS NOT NULL"
expect_zero "subscriptions with a backlog, dead letters or detached" \
    "SELECT count(*) FROM idempotency.outbox_subscriptions_status WHERE pending > 0 OR dead > 0 OR state <> 'active'"

[[ $failed -eq 0 ]] && echo "outbox subscriptions stress: all checks passed"
exit "$failed"
