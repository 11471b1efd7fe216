#!/usr/bin/env bash
# test/bench/outbox_bloat.sh: relay throughput of the outbox beside a
# long-running transaction, against a hand-written SKIP LOCKED outbox.
#
# Four runs, each on fresh tables with a prefilled backlog (so the relays,
# not the emitters, set the pace): {idem outbox, hand-written outbox} x
# {no other transaction, a REPEATABLE READ transaction that took its snapshot
# before the run and stays idle in transaction throughout}.  During a run,
# emitters (pgbench, rate-limited) add events and relays (pgbench) deliver
# them:
#   idem:         claim 100 (idem_outbox_claim, one statement), then ack them
#                 with the lease token (idem_outbox_ack, a second statement);
#   hand-written: DELETE FROM hw_outbox WHERE id IN (SELECT id ... ORDER BY
#                 id LIMIT 100 FOR UPDATE SKIP LOCKED) RETURNING *.
# Prints per run the events delivered per second (every 5 s, and overall
# over the intervals that ended with a backlog left and the relays running),
# the dead tuples left (pg_stat_user_tables.n_dead_tup, and pgstattuple's
# dead_tuple_count where that extension is available) in the event
# partitions, the outbox's state tables and the hand-written table, and for
# each outbox the ratio held / none (target for idem: >= 0.9x).
#
# Connection from PGHOST/PGPORT/PGDATABASE/PGUSER (test/bench/run sets them).
# Settings: IDEM_BENCH_OUTBOX_SECONDS (per run, default 30),
# IDEM_BENCH_OUTBOX_BACKLOG (events prefilled for idem, default 500000),
# IDEM_BENCH_OUTBOX_HW_BACKLOG (for the hand-written outbox, default 1500000),
# IDEM_BENCH_OUTBOX_AGGREGATES (default 1000), IDEM_BENCH_OUTBOX_RELAYS
# (default 4), IDEM_BENCH_OUTBOX_EMIT_RATE (events per second, default 1000).
set -euo pipefail

SECS=${IDEM_BENCH_OUTBOX_SECONDS:-30}
BACKLOG=${IDEM_BENCH_OUTBOX_BACKLOG:-500000}
HW_BACKLOG=${IDEM_BENCH_OUTBOX_HW_BACKLOG:-1500000}
NAGG=${IDEM_BENCH_OUTBOX_AGGREGATES:-1000}
RELAYS=${IDEM_BENCH_OUTBOX_RELAYS:-4}
RATE=${IDEM_BENCH_OUTBOX_EMIT_RATE:-1000}
STEP=5

tmp=$(mktemp -d)
holder=''
trap 'rm -rf "$tmp"; [[ -n $holder ]] && kill "$holder" 2>/dev/null; kill $(jobs -p) 2>/dev/null || true' EXIT

q() { psql -X -q -At -v ON_ERROR_STOP=1 "$@"; }

q >/dev/null <<'SQL'
SET client_min_messages = warning;
DROP EXTENSION IF EXISTS idempotency CASCADE;
DROP TABLE IF EXISTS hw_outbox, bench_anchor;
CREATE TABLE bench_anchor (x int);
INSERT INTO bench_anchor VALUES (1);
SQL
have_pgstattuple=0
q -c 'CREATE EXTENSION IF NOT EXISTS pgstattuple' >/dev/null 2>&1 && have_pgstattuple=1

cat >"$tmp/idem_emit.sql" <<'PGBENCH'
\set a random(1, :nagg)
SELECT 1 FROM idem_outbox_emit('bench', :a::text, 'e', '{"x": 1}');
PGBENCH
cat >"$tmp/idem_relay.sql" <<'PGBENCH'
SELECT coalesce(array_agg(id)::text, '{}') AS ids,
       coalesce(min(lease_token::text), '00000000-0000-0000-0000-000000000000') AS tok
  FROM idem_outbox_claim(100, '30 seconds') \gset
SELECT idem_outbox_ack(:ids::uuid[], :tok::uuid);
PGBENCH
cat >"$tmp/hw_emit.sql" <<'PGBENCH'
\set a random(1, :nagg)
INSERT INTO hw_outbox (aggregate_id, event_type, payload) VALUES (:a::text, 'e', '{"x": 1}');
PGBENCH
cat >"$tmp/hw_relay.sql" <<'PGBENCH'
DELETE FROM hw_outbox WHERE id IN (SELECT id FROM hw_outbox ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED)
RETURNING *;
PGBENCH

# reset KIND: fresh tables with the backlog, vacuumed
reset() {
    if [[ $1 == idem ]]; then
        q >/dev/null <<SQL
SET client_min_messages = warning;
DROP EXTENSION IF EXISTS idempotency CASCADE;
CREATE EXTENSION idempotency;
SQL
        local done=0 n
        while ((done < BACKLOG)); do
            n=$((BACKLOG - done < 10000 ? BACKLOG - done : 10000))
            q -c "SELECT count(*) FROM idem_outbox_emit_many('bench',
                    ARRAY(SELECT (1 + (g % $NAGG))::text FROM generate_series(1, $n) g),
                    array_fill('e'::text, ARRAY[$n]), array_fill('{\"x\": 1}'::jsonb, ARRAY[$n]))" >/dev/null
            done=$((done + n))
        done
        q -c 'VACUUM ANALYZE' >/dev/null
    else
        q >/dev/null <<SQL
SET client_min_messages = warning;
DROP TABLE IF EXISTS hw_outbox;
CREATE TABLE hw_outbox (id bigserial PRIMARY KEY, aggregate_id text NOT NULL, event_type text NOT NULL,
                        payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
INSERT INTO hw_outbox (aggregate_id, event_type, payload)
SELECT (1 + (g % $NAGG))::text, 'e', '{"x": 1}' FROM generate_series(1, $HW_BACKLOG) g;
VACUUM ANALYZE hw_outbox;
SQL
    fi
}

# delivered KIND: events delivered so far
delivered() {
    if [[ $1 == idem ]]; then
        q -c 'SELECT coalesce(sum(acked_seq), 0) FROM idempotency.outbox_deliveries'
    else
        q -c 'SELECT (SELECT last_value FROM hw_outbox_id_seq) - (SELECT count(*) FROM hw_outbox)'
    fi
}

# pending KIND: events not delivered yet
pending() {
    if [[ $1 == idem ]]; then
        q -c "SELECT (SELECT coalesce(sum(m), 0) FROM (SELECT max(seq) AS m FROM idempotency.outbox_events
                                                       GROUP BY aggregate_type, aggregate_id) e)
                   - (SELECT coalesce(sum(acked_seq), 0) FROM idempotency.outbox_deliveries)"
    else
        q -c 'SELECT count(*) FROM hw_outbox'
    fi
}

# dead_tuples KIND: "name n_dead_tup [pgstattuple dead] size" per table
dead_tuples() {
    local rels
    if [[ $1 == idem ]]; then
        rels="SELECT 'event partitions' AS name, array_agg(c.oid) AS oids FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                WHERE i.inhparent = 'idempotency.outbox_events'::regclass
              UNION ALL SELECT 'outbox_deliveries', ARRAY['idempotency.outbox_deliveries'::regclass::oid]
              UNION ALL SELECT 'outbox_sequences', ARRAY['idempotency.outbox_sequences'::regclass::oid]
              UNION ALL SELECT 'outbox_cursor', ARRAY['idempotency.outbox_cursor'::regclass::oid]"
    else
        rels="SELECT 'hw_outbox' AS name, ARRAY['hw_outbox'::regclass::oid] AS oids"
    fi
    sleep 1.5     # let the backends' statistics reach the cumulative stats
    q -F ' ' -c "SELECT pg_stat_force_next_flush()" >/dev/null
    q -F '|' -c "
        SELECT r.name,
               (SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables WHERE relid = ANY (r.oids)),
               $(if ((have_pgstattuple)); then
                   echo "(SELECT coalesce(sum((pgstattuple(o)).dead_tuple_count), 0) FROM unnest(r.oids) o)"
                 else echo "'n/a'"; fi),
               pg_size_pretty((SELECT sum(pg_total_relation_size(o)) FROM unnest(r.oids) o))
        FROM ($rels) r" |
        awk -F'|' '{ printf "    %-18s n_dead_tup %9s   pgstattuple dead %9s   size %s\n", $1, $2, $3, $4 }'
}

declare -A RESULT
# run KIND HELD: one run; sets RESULT[KIND,HELD] to events/s
run() {
    local kind=$1 held=$2 d0 prev now left rates=()
    reset "$kind"
    if [[ $held == held ]]; then
        mkfifo "$tmp/holder.in"
        psql -X -q -At <"$tmp/holder.in" >"$tmp/holder.out" 2>&1 &
        holder=$!
        exec 9>"$tmp/holder.in"
        echo "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1 FROM bench_anchor; \\echo snapshot-taken" >&9
        for _ in $(seq 1 100); do grep -q snapshot-taken "$tmp/holder.out" && break; sleep 0.1; done
        grep -q snapshot-taken "$tmp/holder.out" || { cat "$tmp/holder.out"; echo "holder did not start" >&2; exit 1; }
    fi
    d0=$(delivered "$kind")
    PGOPTIONS='-c synchronous_commit=off' pgbench -n -M extended -c 2 -j 2 -T "$SECS" -R "$RATE" \
        -D nagg="$NAGG" -f "$tmp/${kind}_emit.sql" >"$tmp/emit.out" 2>&1 &
    local epid=$!
    PGOPTIONS='-c synchronous_commit=off' pgbench -n -M extended -c "$RELAYS" -j "$RELAYS" -T "$SECS" \
        -f "$tmp/${kind}_relay.sql" >"$tmp/relay.out" 2>&1 &
    local rpid=$!
    # sample every STEP s while the relays run; the rate counts only the
    # intervals at whose end a backlog (more than 5 batches) was still left
    local t0 tp tn dt secs_ok=0 deliv_ok=0 counted rate
    t0=$(date +%s.%N); tp=$t0; prev=$d0
    while sleep "$STEP"; kill -0 "$rpid" 2>/dev/null; do
        now=$(delivered "$kind")
        left=$(pending "$kind")
        tn=$(date +%s.%N)
        dt=$(awk -v a="$tp" -v b="$tn" 'BEGIN { print b - a }')
        counted=''
        if ((left > 500)) && kill -0 "$rpid" 2>/dev/null; then counted=1; fi
        rate=$(awk -v d=$((now - prev)) -v t="$dt" 'BEGIN { printf "%.0f", d / t }')
        if [[ -n $counted ]]; then rates+=("$rate"); else rates+=("$rate(not counted)"); fi
        if [[ -n $counted ]]; then
            secs_ok=$(awk -v a="$secs_ok" -v b="$dt" 'BEGIN { print a + b }')
            deliv_ok=$((deliv_ok + now - prev))
        fi
        prev=$now; tp=$tn
    done
    wait "$epid" || { cat "$tmp/emit.out"; echo "emitters failed" >&2; exit 1; }
    wait "$rpid" || { cat "$tmp/relay.out"; echo "relays failed" >&2; exit 1; }
    if [[ $secs_ok == 0 ]]; then
        echo "    WARNING: no interval with a backlog left; raise the backlog"
        secs_ok=1
    fi
    RESULT[$kind,$held]=$(awk -v d="$deliv_ok" -v t="$secs_ok" 'BEGIN { printf "%.0f", d / t }')
    printf '  %-13s %-14s %7d events/s   (every %ds: %s)   backlog left %s\n' \
        "$kind" "$held" "${RESULT[$kind,$held]}" "$STEP" "${rates[*]}" "$(pending "$kind")"
    dead_tuples "$kind"
    if [[ $held == held ]]; then
        echo "    (held snapshot: xmin age $(q -c "SELECT age(backend_xmin) FROM pg_stat_activity
                                                 WHERE state = 'idle in transaction' AND backend_xmin IS NOT NULL
                                                 ORDER BY age(backend_xmin) DESC LIMIT 1"))"
        echo 'COMMIT;' >&9
        exec 9>&-
        wait "$holder" || true
        holder=''
        rm -f "$tmp/holder.in"
    fi
}

echo "outbox bloat bench: ${SECS}s per run, backlog $BACKLOG events on $NAGG aggregates, $RELAYS relays (batch 100),"
echo "  emitters at $RATE events/s; 'held' = a REPEATABLE READ transaction idle since before the run"
for kind in idem hw; do
    for held in none held; do
        run "$kind" "$held"
    done
done

ratio() {
    awk -v l="$1" -v c="$2" -v b="$3" 'BEGIN { printf "%s: held snapshot %.0f events/s vs none %.0f events/s = %.2fx\n", l, c, b, (b > 0 ? c / b : 0) }'
}
ratio "outbox relay throughput, idem (target >= 0.9)" "${RESULT[idem,held]}" "${RESULT[idem,none]}"
ratio "outbox relay throughput, hand-written SKIP LOCKED" "${RESULT[hw,held]}" "${RESULT[hw,none]}"
