#!/usr/bin/env bash
# test/bench/outbox.sh: the transactional outbox (idem_outbox_*) against a
# hand-written outbox table and against PgQ, in one run on one server.
#
# bench-packages: postgresql-15-pgq3 pgqd
#   (test/bench/run installs these when run as root, like the test suite's
#   packages; otherwise it prints the apt-get command and stops)
#
# The hand-written outbox (the baseline of a, b and e):
#   bench_outbox (id bigserial PRIMARY KEY, aggregate_type text, aggregate_id text,
#                 type text, payload jsonb, created_at timestamptz DEFAULT now())
# written with INSERT and drained with
#   DELETE FROM bench_outbox WHERE id IN (SELECT id FROM bench_outbox ORDER BY id
#       LIMIT 100 FOR UPDATE SKIP LOCKED) RETURNING ...
# Every event is ('order', <one of IDEM_OUTBOX_AGGREGATES ids>, 'created', '{"n":1}').
#
# Parts (each in its own database, created and dropped by this script):
#   a emit    one event per transaction: SELECT idem_outbox_emit(...) vs INSERT
#             into bench_outbox (target >= 0.9x); also with
#             idempotency.outbox_notify = coalesce and = off (the default, 'commit', sends a
#             NOTIFY at each emitting commit, which the baseline does not)
#   b drain   IDEM_OUTBOX_EVENTS events (50 per transaction, aggregate =
#             event number mod IDEM_OUTBOX_AGGREGATES) are loaded into both
#             sides, then IDEM_OUTBOX_RELAYS parallel relays drain them:
#             candidate "claim 100" (SELECT array_agg(id), min(lease_token)
#             ... FROM idem_outbox_claim(100)) then idem_outbox_ack(ids, token),
#             two transactions; baseline one DELETE ... SKIP LOCKED ... RETURNING
#             of 100.  Each relay runs events / (100 * relays) transactions,
#             timed by the wall clock; events/s = events delivered / seconds
#             (target >= 1.5x); a drain still running after
#             IDEM_OUTBOX_DRAIN_MAX_SECONDS is stopped and counted as far as it
#             got (what is left is then acked administratively, untimed).
#             Delivered events of the candidate stay in
#             their partitions (they leave by partition drop), so later
#             rounds run beside the earlier rounds' events, as in production;
#             the baseline's table is vacuumed before each drain.
#   c e2e     CLIENTS emitters and one relay at once for IDEM_OUTBOX_E2E_SECONDS:
#             idem_outbox_emit + the claim/ack relay vs PgQ (pgq.insert_event +
#             a batch consumer: pgq.next_batch, pgq.get_batch_events,
#             pgq.finish_batch).  Ticks: IDEM_OUTBOX_PGQ_TICKER=consumer (the
#             consumer calls pgq.ticker() when no batch is ready: a tick per
#             ticker_max_count = 500 events) or pgqd (the daemon, ticker_period
#             1 s).  Both relays sleep IDEM_OUTBOX_IDLE_MS when they find less
#             than a full batch (PgQ: no batch and no new tick).  Prints events/s
#             emitted and delivered (target: delivered >= 1.0x).  PgQ keeps no
#             per-aggregate order and has no per-event leases.
#   d many    100 events in one transaction: one idem_outbox_emit_many vs 100
#             idem_outbox_emit statements (BEGIN ... COMMIT, 102 round trips)
#             (target >= 10x); each client uses its own aggregates
#   e wal     WAL bytes per event (pg_current_wal_lsn() difference / events),
#             candidate vs baseline, for IDEM_OUTBOX_WAL_EVENTS single-event
#             transactions: emit; emit + drain (relays of 100 until empty);
#             emit + drain + VACUUM of the tables written.  Measured after a
#             warm-up pass of the same size (pages touched since the last
#             checkpoint: no full-page images), so these are steady-state
#             figures; a checkpoint adds a full-page image per page first
#             touched after it (many more pages for the candidate: its
#             sequence, delivery and aggregate-index pages are spread out)
#   f cpu     CPU time per event in one backend (utime + stime of
#             /proc/PID/stat, which other load on a shared machine barely
#             moves; Linux only), as caps.sh does for claims: a DO loop of
#             IDEM_OUTBOX_CPU_EVENTS INSERTs into bench_outbox, as many
#             idem_outbox_emit calls, and emit_many calls of 100 (a
#             commit per 100 events, outbox_notify = off; the same
#             aggregates in the same order on each side, 100 per
#             transaction, stride 97 as in (d)), interleaved,
#             the first round discarded as warm-up, medians of the rest:
#             emit vs INSERT (target >= 0.9x) and emit_many vs emit
#   g subs    k = IDEM_OUTBOX_SUBSCRIPTIONS subscriptions (default "1 2 4":
#             'default' and k - 1 more, subscribed 'now'): emit as in (a)
#             beside INSERT with k subscriptions (target: unchanged), then
#             IDEM_OUTBOX_SUB_EVENTS events loaded as in (b) (one event per
#             aggregate per batch) and each subscription drained in turn by
#             2 relays: events/s of each, against 1 subscription's drain
#             (target >= 0.9x)
#
# Ratios are candidate / baseline of the medians of interleaved rounds (the
# order of the two sides alternates from round to round); for (e) lower is
# better.  pgbench -M prepared, synchronous_commit = off (lib.sh).
#
# Connection from PGHOST/PGPORT/PGUSER (test/bench/run sets them).
# Settings: IDEM_BENCH_ROUNDS (default 3 here), IDEM_BENCH_SECONDS (5),
# IDEM_BENCH_CLIENTS (2), and
#   IDEM_OUTBOX_PARTS       parts to run (default "emit drain e2e many wal")
#   IDEM_OUTBOX_AGGREGATES  distinct aggregate ids (10000)
#   IDEM_OUTBOX_EVENTS      events loaded per drain (200000)
#   IDEM_OUTBOX_RELAYS      relay counts for (b) (default "2 4")
#   IDEM_OUTBOX_BATCH       claim / DELETE batch (100)
#   IDEM_OUTBOX_DRAIN_MAX_SECONDS
#                           a drain of (b) is stopped after this many seconds
#                           (15); the round then reports what it delivered
#   IDEM_OUTBOX_E2E_SECONDS seconds per side and round of (c) (2 x IDEM_BENCH_SECONDS)
#   IDEM_OUTBOX_IDLE_MS     relay sleep after a short batch in (c) (10)
#   IDEM_OUTBOX_PGQ_TICKER  consumer | pgqd (consumer)
#   IDEM_OUTBOX_WAL_EVENTS  events per side in (e) (20000)
#   IDEM_OUTBOX_CPU_EVENTS  events per side and round in (f) (20000)
#   IDEM_OUTBOX_SUBSCRIPTIONS  subscription counts for (g) ("1 2 4")
#   IDEM_OUTBOX_SUB_EVENTS  events loaded per drain in (g) (50000)
#   IDEM_OUTBOX_KEEP=1      keep the databases (obx_emit, obx_drain, ...)
#   IDEM_OUTBOX_BASELINE_ONLY=1  skip every candidate measurement (to try
#                           the script on a build without the outbox)
set -euo pipefail

dir=$(cd "$(dirname "$0")" && pwd)
. "$dir/lib.sh"

ROUNDS=${IDEM_BENCH_ROUNDS:-3}
PARTS=${IDEM_OUTBOX_PARTS:-emit drain e2e many wal cpu subs}
AGGS=${IDEM_OUTBOX_AGGREGATES:-10000}
NEV=${IDEM_OUTBOX_EVENTS:-200000}
RELAYS=${IDEM_OUTBOX_RELAYS:-2 4}
BATCH=${IDEM_OUTBOX_BATCH:-100}
E2E_SECS=${IDEM_OUTBOX_E2E_SECONDS:-$((2 * SECS))}
IDLE=${IDEM_OUTBOX_IDLE_MS:-10}
TICKER=${IDEM_OUTBOX_PGQ_TICKER:-consumer}
WAL_EV=${IDEM_OUTBOX_WAL_EVENTS:-20000}
CPU_EV=${IDEM_OUTBOX_CPU_EVENTS:-20000}
DRAIN_MAX=${IDEM_OUTBOX_DRAIN_MAX_SECONDS:-15}
SUB_COUNTS=${IDEM_OUTBOX_SUBSCRIPTIONS:-1 2 4}
SUB_EV=${IDEM_OUTBOX_SUB_EVENTS:-50000}
LOAD_TXN=50     # events per transaction when (b) loads its events
BASE_ONLY=${IDEM_OUTBOX_BASELINE_ONLY:-}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/obbench.XXXXXX")
dbs=()
bgpids=()
cleanup() {
    local rc=$? p d
    set +e
    for p in "${bgpids[@]}"; do kill "$p" 2>/dev/null && wait "$p" 2>/dev/null; done
    if [[ -z ${IDEM_OUTBOX_KEEP:-} ]]; then
        for d in "${dbs[@]}"; do psql -X -q -d postgres -c "DROP DATABASE IF EXISTS $d" >/dev/null 2>&1; done
    fi
    rm -rf "$tmp"
    return $rc
}
trap cleanup EXIT

die() { echo "outbox bench: $*" >&2; exit 1; }
q() { local db=$1; shift; psql -X -q -At -v ON_ERROR_STOP=1 -d "$db" "$@"; }
now() { date +%s.%N; }
median() { bench_median "$@"; }
# fmt N: a number rounded, for the round lines
fmt() { awk -v v="$1" 'BEGIN { printf "%.0f", v }'; }

# ratio LABEL UNIT CNAME CVALS... -- BNAME BVALS...: the ratio line of the medians
ratio() {
    local label=$1 unit=$2 cname=$3 c=() b=() bname
    shift 3
    while [[ $1 != -- ]]; do c+=("$1"); shift; done
    shift
    bname=$1
    shift
    b=("$@")
    if [[ -n $BASE_ONLY ]]; then
        awk -v l="$label" -v u="$unit" -v bn="$bname" -v b="$(median "${b[@]}")" \
            'BEGIN { printf "%s: %s %.0f %s (candidate skipped)\n", l, bn, b, u }'
        return
    fi
    awk -v l="$label" -v u="$unit" -v cn="$cname" -v bn="$bname" \
        -v c="$(median "${c[@]}")" -v b="$(median "${b[@]}")" \
        'BEGIN { printf "%s: %s %.0f %s vs %s %.0f %s = %.2fx\n", l, cn, c, u, bn, b, u, c / b }'
}

# pgb DB SCRIPT PGBENCH_ARGS...: pgbench on DB (synchronous_commit = off),
# output in $tmp/pgbench.out; fails loudly
pgb() {
    local db=$1 script=$2
    shift 2
    PGDATABASE=$db PGOPTIONS="${PGOPTIONS:-} -c synchronous_commit=off" \
        pgbench -n -M prepared -D aggregates="$AGGS" "$@" -f "$dir/$script" >"$tmp/pgbench.out" 2>&1 ||
        { cat "$tmp/pgbench.out" >&2; die "pgbench failed on $script"; }
    if grep -q 'aborted' "$tmp/pgbench.out"; then
        cat "$tmp/pgbench.out" >&2
        die "a pgbench client aborted on $script"
    fi
}
tps() { sed -n 's/^tps = \([0-9.]*\) .*/\1/p' "$tmp/pgbench.out" | head -n 1; }

# new_db NAME: a fresh database with both extensions and the baseline table
new_db() {
    local db=$1
    dbs+=("$db")
    q postgres -c "SET client_min_messages = warning" -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" >/dev/null
    q "$db" >/dev/null <<'SQL'
SET client_min_messages = warning;
CREATE EXTENSION idempotency;
-- a maintenance round, as production runs them
SELECT count(*) FROM idem_maintain();
CREATE TABLE bench_outbox (
    id             bigserial PRIMARY KEY,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    type           text NOT NULL,
    payload        jsonb NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now()
);
SQL
    if [[ -z $BASE_ONLY ]]; then
        [[ $(q "$db" -c "SELECT to_regproc('idem_outbox_emit') IS NOT NULL") == t ]] ||
            die "the idempotency extension here has no idem_outbox_emit(): build a version with the outbox (src/delivery/outbox.c)"
    fi
}

# warm_aggregates DB: one delivered event per aggregate on both sides, so
# the measured emits update sequence rows rather than create them
warm_aggregates() {
    local db=$1
    q "$db" >/dev/null <<SQL
INSERT INTO bench_outbox (aggregate_type, aggregate_id, type, payload)
SELECT 'order', g::text, 'created', '{"n":1}' FROM generate_series(1, $AGGS) g;
DELETE FROM bench_outbox;
SQL
    [[ -n $BASE_ONLY ]] && return 0
    q "$db" >/dev/null <<SQL
SELECT count(idem_outbox_emit('order', g::text, 'created', '{"n":1}')) FROM generate_series(1, $AGGS) g;
SQL
    drain_all_idem "$db"
}

# backlog_idem DB: events emitted and not acked
# backlog_idem DB [SUBSCRIPTION]: events not delivered to the subscription
# ('default'), which has a deliveries row for every aggregate (warm_aggregates
# drained them all; the others are subscribed 'now' after)
backlog_idem() {
    q "$1" -c "SELECT coalesce((SELECT sum(m) FROM (SELECT max(seq) AS m FROM idempotency.outbox_events
                                                   GROUP BY aggregate_type, aggregate_id) e), 0)
                    - coalesce((SELECT sum(d.acked_seq) FROM idempotency.outbox_deliveries d
                                 JOIN idempotency.outbox_subscriptions b ON b.id = d.subscription
                                WHERE b.name = '${2:-default}'), 0)"
}
backlog_plain() { q "$1" -c "SELECT count(*) FROM bench_outbox"; }
acked_idem() { q "$1" -c "SELECT coalesce(sum(acked_seq), 0) FROM idempotency.outbox_deliveries"; }
# (table mode: the newest seq of every aggregate is in its rows)
emitted_idem() {
    q "$1" -c "SELECT coalesce(sum(m), 0) FROM (SELECT max(seq) AS m FROM idempotency.outbox_events
                                                GROUP BY aggregate_type, aggregate_id) e"
}

# settle_idem DB: mark every pending event delivered with an administrative
# ack (no lease token: leases of stopped relays do not matter); untimed
# clean-up between rounds
settle_idem() {
    local sub=${2:-default}
    q "$1" >/dev/null <<SQL
SELECT idem_outbox_ack(ARRAY(
    SELECT e.id FROM idempotency.outbox_events e
    LEFT JOIN idempotency.outbox_deliveries d
      ON d.subscription = (SELECT id FROM idempotency.outbox_subscriptions WHERE name = '$sub')
     AND d.aggregate_type = e.aggregate_type AND d.aggregate_id = e.aggregate_id
    WHERE e.seq > coalesce(d.acked_seq, 0)), NULL, '$sub');
SQL
    local left
    left=$(backlog_idem "$1" "$sub")
    ((left == 0)) || die "$1: $left events still undelivered to $sub after an administrative ack of all"
}

# drain_all_idem / drain_all_plain DB: relays of 100 until nothing is left
drain_all_idem() {
    local db=$1 left
    for _ in $(seq 50); do
        left=$(backlog_idem "$db")
        ((left == 0)) && return 0
        pgb "$db" outbox_relay_idem.sql -c "$CLIENTS" -j "$CLIENTS" \
            -t $(((left + 100 * CLIENTS - 1) / (100 * CLIENTS))) -D batch=100 -D idle=0 -D sub=default
    done
    die "$db: $(backlog_idem "$db") events still undelivered after 50 drains"
}
drain_all_plain() {
    local db=$1 left
    for _ in $(seq 50); do
        left=$(backlog_plain "$db")
        ((left == 0)) && return 0
        pgb "$db" outbox_relay_plain.sql -c "$CLIENTS" -j "$CLIENTS" \
            -t $(((left + 100 * CLIENTS - 1) / (100 * CLIENTS))) -D batch=100
    done
    die "$db: $(backlog_plain "$db") rows still in bench_outbox after 50 drains"
}

# load_plain / load_idem DB N: N events, LOAD_TXN per transaction, event i to
# aggregate i mod AGGS (every aggregate gets N / AGGS events, spread over the load)
load_plain() {
    q "$1" >/dev/null <<SQL
SET synchronous_commit = off;
DO \$\$
BEGIN
    FOR b IN 0 .. $2 / $LOAD_TXN - 1 LOOP
        INSERT INTO bench_outbox (aggregate_type, aggregate_id, type, payload)
        SELECT 'order', ((b * $LOAD_TXN + g) % $AGGS + 1)::text, 'created', '{"n":1}'
        FROM generate_series(0, $LOAD_TXN - 1) g;
        COMMIT;
    END LOOP;
END
\$\$;
SQL
}
load_idem() {
    q "$1" >/dev/null <<SQL
SET synchronous_commit = off;
DO \$\$
BEGIN
    FOR b IN 0 .. $2 / $LOAD_TXN - 1 LOOP
        PERFORM idem_outbox_emit_many('order',
            ARRAY(SELECT ((b * $LOAD_TXN + g) % $AGGS + 1)::text FROM generate_series(0, $LOAD_TXN - 1) g),
            array_fill('created'::text, ARRAY[$LOAD_TXN]), array_fill('{"n":1}'::jsonb, ARRAY[$LOAD_TXN]));
        COMMIT;
    END LOOP;
END
\$\$;
SQL
}

lsn() { q "$1" -c "SELECT pg_current_wal_lsn()"; }
lsn_diff() { q postgres -c "SELECT pg_wal_lsn_diff('$2', '$1')"; }

# ------------------------------------------------------------------ checks

[[ $BATCH -gt 0 && $AGGS -gt 0 && $NEV -ge $LOAD_TXN ]] || die "bad IDEM_OUTBOX_BATCH / _AGGREGATES / _EVENTS"
case $TICKER in consumer|pgqd) ;; *) die "IDEM_OUTBOX_PGQ_TICKER must be consumer or pgqd" ;; esac
if [[ " $PARTS " == *" e2e "* ]]; then
    [[ $(q postgres -c "SELECT count(*) FROM pg_available_extensions WHERE name = 'pgq'") == 1 ]] ||
        die "PgQ is not installed in this PostgreSQL (no pgq.control in $(q postgres -c "SELECT setting FROM pg_config WHERE name = 'SHAREDIR'")/extension): install the Debian package postgresql-15-pgq3 (test/bench/run does, as root); with IDEM_PG_ROOT, copy it into the private PostgreSQL too. Or leave e2e out of IDEM_OUTBOX_PARTS."
    if [[ $TICKER == pgqd ]]; then
        command -v pgqd >/dev/null || die "pgqd not found: install the Debian package pgqd, or use IDEM_OUTBOX_PGQ_TICKER=consumer"
    fi
fi

echo "outbox bench: parts '$PARTS'; $ROUNDS interleaved rounds; ${SECS}s per round (e2e ${E2E_SECS}s); $CLIENTS clients;"
echo "  $AGGS aggregates; drain: $NEV events, relays '$RELAYS', batch $BATCH; -M prepared, synchronous_commit=off"

# ------------------------------------------------------------------ (a) emit

part_emit() {
    local db=obx_emit r b c n k order
    local -a B=() C=() N=() K=()
    new_db $db
    warm_aggregates $db
    q $db -c "VACUUM ANALYZE" -c "CHECKPOINT" >/dev/null
    echo "(a) emit: one event per transaction, $ROUNDS x ${SECS}s, $CLIENTS clients"
    for r in $(seq "$ROUNDS"); do
        b=0 c=0 n=0 k=0
        order="base cand coalesce nonotify"
        ((r % 2 == 0)) && order="nonotify coalesce cand base"
        for s in $order; do
            case $s in
                base) pgb $db outbox_emit_plain.sql -c "$CLIENTS" -j "$CLIENTS" -T "$SECS"; b=$(tps) ;;
                cand) [[ -n $BASE_ONLY ]] && continue
                      pgb $db outbox_emit_idem.sql -c "$CLIENTS" -j "$CLIENTS" -T "$SECS"; c=$(tps) ;;
                nonotify) [[ -n $BASE_ONLY ]] && continue
                      PGOPTIONS="-c idempotency.outbox_notify=off" \
                          pgb $db outbox_emit_idem.sql -c "$CLIENTS" -j "$CLIENTS" -T "$SECS"; n=$(tps) ;;
                coalesce) [[ -n $BASE_ONLY ]] && continue
                      PGOPTIONS="-c idempotency.outbox_notify=coalesce" \
                          pgb $db outbox_emit_idem.sql -c "$CLIENTS" -j "$CLIENTS" -T "$SECS"; k=$(tps) ;;
            esac
        done
        B+=("$b") C+=("$c") N+=("$n") K+=("$k")
        printf '  round %d: INSERT %s tps, idem_outbox_emit %s tps, outbox_notify=coalesce %s tps, =off %s tps\n' \
            "$r" "$(fmt "$b")" "$(fmt "$c")" "$(fmt "$k")" "$(fmt "$n")"
    done
    ratio "outbox (a) emit, 1 event per transaction" tps idem_outbox_emit "${C[@]}" -- INSERT "${B[@]}"
    ratio "outbox (a) emit, outbox_notify = coalesce" tps idem_outbox_emit "${K[@]}" -- INSERT "${B[@]}"
    ratio "outbox (a) emit, outbox_notify = off" tps idem_outbox_emit "${N[@]}" -- INSERT "${B[@]}"
}

# ------------------------------------------------------------------ (b) drain

# drain_round DB SIDE RELAYS [SUBSCRIPTION [EVENTS]]: drain what is pending
# (for the subscription, 'default'); sets DR_EV (events delivered), DR_SECS
# (wall-clock seconds), DR_LEFT (events left)
drain_round() {
    local db=$1 side=$2 nrel=$3 sub=${4:-default} nev=${5:-$NEV} before after t0 t1 per
    per=$(((nev + BATCH * nrel - 1) / (BATCH * nrel)))
    if [[ $side == plain ]]; then
        before=$(backlog_plain $db)
        t0=$(now)
        drain_pgbench $db outbox_relay_plain.sql -c "$nrel" -j "$nrel" -t "$per" -D batch="$BATCH"
        t1=$(now)
        after=$(backlog_plain $db)
    else
        before=$(backlog_idem $db "$sub")
        t0=$(now)
        drain_pgbench $db outbox_relay_idem.sql -c "$nrel" -j "$nrel" -t "$per" -D batch="$BATCH" -D idle=0 \
            -D sub="$sub"
        t1=$(now)
        after=$(backlog_idem $db "$sub")
    fi
    DR_EV=$((before - after)) DR_LEFT=$after
    DR_SECS=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')
}

# drain_pgbench DB SCRIPT ARGS...: pgb, stopped (SIGINT) after DRAIN_MAX
# seconds; sets DR_CAPPED
drain_pgbench() {
    local db=$1 script=$2 rc=0
    shift 2
    DR_CAPPED=""
    PGDATABASE=$db PGOPTIONS="-c synchronous_commit=off" timeout -s INT "$DRAIN_MAX" \
        pgbench -n -M prepared "$@" -f "$dir/$script" >"$tmp/pgbench.out" 2>&1 || rc=$?
    if [[ $rc == 124 ]]; then
        DR_CAPPED=" (stopped after ${DRAIN_MAX}s)"
    elif [[ $rc != 0 ]] || grep -q aborted "$tmp/pgbench.out"; then
        cat "$tmp/pgbench.out" >&2
        die "pgbench failed on $script"
    fi
}

part_drain() {
    local db=obx_drain r nrel ev secs left order s rate
    declare -A DBASE=() DCAND=()
    new_db $db
    warm_aggregates $db
    q $db -c "VACUUM ANALYZE" -c "CHECKPOINT" >/dev/null
    echo "(b) drain: $NEV events over $AGGS aggregates per side and drain, relays of $BATCH"
    for r in $(seq "$ROUNDS"); do
        for nrel in $RELAYS; do
            load_plain $db "$NEV"
            [[ -z $BASE_ONLY ]] && load_idem $db "$NEV"
            q $db -c "VACUUM ANALYZE" >/dev/null
            order="plain idem"
            ((r % 2 == 0)) && order="idem plain"
            local line=""
            for s in $order; do
                [[ $s == idem && -n $BASE_ONLY ]] && continue
                drain_round $db $s "$nrel"
                ev=$DR_EV secs=$DR_SECS left=$DR_LEFT
                rate=$(awk -v e="$ev" -v s="$secs" 'BEGIN { printf "%.1f", e / s }')
                if [[ $s == plain ]]; then
                    DBASE[$nrel]+="$rate "
                    line+="  DELETE SKIP LOCKED $ev events in ${secs}s = $(fmt "$rate")/s ($left left$DR_CAPPED)"
                else
                    DCAND[$nrel]+="$rate "
                    line+="  claim+ack $ev events in ${secs}s = $(fmt "$rate")/s ($left left$DR_CAPPED)"
                fi
            done
            echo "  round $r, $nrel relays:$line"
            # what a round leaves behind (SKIP LOCKED stragglers) goes before the next
            drain_all_plain $db
            [[ -z $BASE_ONLY ]] && settle_idem $db
        done
    done
    for nrel in $RELAYS; do
        # shellcheck disable=SC2086
        ratio "outbox (b) drain, $nrel relays, batch $BATCH" events/s claim+ack ${DCAND[$nrel]:-0} -- "DELETE SKIP LOCKED" ${DBASE[$nrel]}
    done
}

# ------------------------------------------------------------------ (g) subscriptions

part_subs() {
    local db=obx_subs r k i b c s order rate line
    declare -A EMIT=() BASE=() DRAIN=()
    new_db $db
    warm_aggregates $db
    q $db -c "VACUUM ANALYZE" -c "CHECKPOINT" >/dev/null
    echo "(g) subscriptions: emit with k of them, then each one's drain of $SUB_EV events (2 relays, batch $BATCH)"
    for k in $SUB_COUNTS; do
        # k subscriptions: 'default' and s2 .. sk, from now
        q $db -c "SELECT count(idem_outbox_subscribe('s' || g, start => 'now')) FROM generate_series(2, $k) g" >/dev/null
        for r in $(seq "$ROUNDS"); do
            order="base cand"
            ((r % 2 == 0)) && order="cand base"
            for s in $order; do
                if [[ $s == base ]]; then
                    pgb $db outbox_emit_plain.sql -c "$CLIENTS" -j "$CLIENTS" -T "$SECS"; b=$(tps)
                else
                    pgb $db outbox_emit_idem.sql -c "$CLIENTS" -j "$CLIENTS" -T "$SECS"; c=$(tps)
                fi
            done
            BASE[$k]+="$b " EMIT[$k]+="$c "
            for i in default $(seq -f 's%g' 2 "$k"); do settle_idem $db "$i"; done
            q $db -c "TRUNCATE bench_outbox" >/dev/null
            load_idem $db "$SUB_EV"
            q $db -c "VACUUM ANALYZE" >/dev/null
            line=""
            for i in default $(seq -f 's%g' 2 "$k"); do
                drain_round $db idem 2 "$i" "$SUB_EV"
                rate=$(awk -v e="$DR_EV" -v s="$DR_SECS" 'BEGIN { printf "%.1f", e / s }')
                DRAIN[$k]+="$rate "
                line+=" $i $(fmt "$rate")/s$DR_CAPPED"
                settle_idem $db "$i"
            done
            echo "  $k subscription(s), round $r: INSERT $(fmt "$b") tps, emit $(fmt "$c") tps; drains:$line"
        done
        q $db -c "SELECT count(idem_outbox_unsubscribe('s' || g)) FROM generate_series(2, $k) g" >/dev/null
    done
    for k in $SUB_COUNTS; do
        # shellcheck disable=SC2086
        ratio "outbox (g) emit with $k subscription(s)" tps idem_outbox_emit ${EMIT[$k]} -- INSERT ${BASE[$k]}
    done
    local first
    first=$(echo "$SUB_COUNTS" | awk '{ print $1 }')
    for k in $SUB_COUNTS; do
        # shellcheck disable=SC2086
        ratio "outbox (g) drain of each of $k subscription(s)" events/s "each of $k" ${DRAIN[$k]} -- "1 subscription" ${DRAIN[$first]}
    done
}

# ------------------------------------------------------------------ (c) end to end

pgqd_start() {
    local db=$1 ini=$tmp/pgqd.ini
    cat >"$ini" <<EOF
[pgqd]
logfile = $tmp/pgqd.log
pidfile = $tmp/pgqd.pid
base_connstr = host=${PGHOST:-/tmp} port=${PGPORT:-5432} user=${PGUSER:-$(id -un)}
initial_database = $db
database_list = $db
ticker_period = 1
EOF
    pgqd "$ini" >"$tmp/pgqd.out" 2>&1 &
    bgpids+=($!)
    sleep 1
    kill -0 "${bgpids[-1]}" 2>/dev/null || { cat "$tmp/pgqd.out" "$tmp/pgqd.log" >&2 2>/dev/null; die "pgqd did not start"; }
}

# e2e_round DB SIDE: sets E2E_EMIT and E2E_DELIV (events/s) and E2E_LEFT
# (the backlog the run added)
e2e_round() {
    local db=$1 side=$2 e0 d0 e1 d1 epid rpid tick=1 st=0 c
    [[ $TICKER == pgqd ]] && tick=0
    if [[ $side == pgq ]]; then
        c=$(q $db -F ' ' -c "SELECT * FROM bench_pgq_counts()")
        read -r e0 d0 <<<"$c"
    else
        e0=$(emitted_idem $db) d0=$(acked_idem $db)
    fi
    (
        if [[ $side == pgq ]]; then
            PGDATABASE=$db PGOPTIONS="-c synchronous_commit=off" pgbench -n -M prepared -D aggregates="$AGGS" \
                -c "$CLIENTS" -j "$CLIENTS" -T "$E2E_SECS" -f "$dir/outbox_emit_pgq.sql" >"$tmp/emit.out" 2>&1
        else
            PGDATABASE=$db PGOPTIONS="-c synchronous_commit=off" pgbench -n -M prepared -D aggregates="$AGGS" \
                -c "$CLIENTS" -j "$CLIENTS" -T "$E2E_SECS" -f "$dir/outbox_emit_idem.sql" >"$tmp/emit.out" 2>&1
        fi
    ) &
    epid=$!
    (
        if [[ $side == pgq ]]; then
            PGDATABASE=$db PGOPTIONS="-c synchronous_commit=off" pgbench -n -M prepared -c 1 -j 1 -T "$E2E_SECS" \
                -D tick=$tick -D idle="$IDLE" -f "$dir/outbox_relay_pgq.sql" >"$tmp/relay.out" 2>&1
        else
            PGDATABASE=$db PGOPTIONS="-c synchronous_commit=off" pgbench -n -M prepared -c 1 -j 1 -T "$E2E_SECS" \
                -D batch="$BATCH" -D idle="$IDLE" -D sub=default -f "$dir/outbox_relay_idem.sql" >"$tmp/relay.out" 2>&1
        fi
    ) &
    rpid=$!
    wait $epid || st=1
    wait $rpid || st=1
    if [[ $st != 0 ]] || grep -q aborted "$tmp/emit.out" "$tmp/relay.out"; then
        cat "$tmp/emit.out" "$tmp/relay.out" >&2
        die "pgbench failed in the end-to-end run ($side)"
    fi
    if [[ $side == pgq ]]; then
        c=$(q $db -F ' ' -c "SELECT * FROM bench_pgq_counts()")
        read -r e1 d1 <<<"$c"
    else
        e1=$(emitted_idem $db) d1=$(acked_idem $db)
    fi
    read -r E2E_EMIT E2E_DELIV E2E_LEFT < <(awk -v e0="$e0" -v e1="$e1" -v d0="$d0" -v d1="$d1" -v s="$E2E_SECS" \
        'BEGIN { printf "%.1f %.1f %d\n", (e1 - e0) / s, (d1 - d0) / s, (e1 - e0) - (d1 - d0) }')
}

part_e2e() {
    local db=obx_e2e r order s e d l line
    local -a PE=() PD=() IE=() ID=()
    new_db $db
    q $db >/dev/null <<'SQL'
SET client_min_messages = warning;
CREATE EXTENSION pgq;
SELECT pgq.create_queue('bench');
SELECT pgq.register_consumer('bench', 'relay');
-- events emitted (the queue's event id sequence) and delivered (the event
-- sequence at the consumer's last finished tick)
CREATE FUNCTION bench_pgq_counts(OUT emitted bigint, OUT delivered bigint) AS $$
    SELECT pgq.seq_getval(q.queue_event_seq), t.tick_event_seq
    FROM pgq.queue q
    JOIN pgq.subscription s ON s.sub_queue = q.queue_id
    JOIN pgq.consumer c ON c.co_id = s.sub_consumer AND c.co_name = 'relay'
    JOIN pgq.tick t ON t.tick_queue = q.queue_id AND t.tick_id = s.sub_last_tick
    WHERE q.queue_name = 'bench'
$$ LANGUAGE sql;
SQL
    warm_aggregates $db
    q $db -c "VACUUM ANALYZE" -c "CHECKPOINT" >/dev/null
    if [[ $TICKER == pgqd ]]; then
        pgqd_start $db
    fi
    echo "(c) end to end: $CLIENTS emitters + 1 relay for ${E2E_SECS}s; relay batch $BATCH (PgQ: a batch per tick, ticks by $TICKER), idle sleep ${IDLE} ms"
    echo "    PgQ: no per-aggregate order, no leases; ours: per-aggregate seq order, leases, acks"
    for r in $(seq "$ROUNDS"); do
        order="pgq idem"
        ((r % 2 == 0)) && order="idem pgq"
        line=""
        for s in $order; do
            [[ $s == idem && -n $BASE_ONLY ]] && continue
            e2e_round $db $s
            e=$E2E_EMIT d=$E2E_DELIV l=$E2E_LEFT
            if [[ $s == pgq ]]; then
                PE+=("$e") PD+=("$d")
                line+="  PgQ emitted $(fmt "$e")/s delivered $(fmt "$d")/s (backlog $l)"
            else
                IE+=("$e") ID+=("$d")
                line+="  idem emitted $(fmt "$e")/s delivered $(fmt "$d")/s (backlog $l)"
            fi
        done
        echo "  round $r:$line"
        # the next round starts with both queues empty
        [[ -z $BASE_ONLY ]] && settle_idem $db
        pgb $db outbox_relay_pgq.sql -c 1 -j 1 -T 2 -D tick=1 -D idle=0
    done
    ratio "outbox (c) end to end, $CLIENTS emitters + 1 relay, delivered" events/s idem "${ID[@]:-0}" -- PgQ "${PD[@]}"
    ratio "outbox (c) end to end, $CLIENTS emitters + 1 relay, emitted" events/s idem "${IE[@]:-0}" -- PgQ "${PE[@]}"
}

# ------------------------------------------------------------------ (d) many

part_many() {
    local db=obx_many r b c order s
    local -a B=() C=()
    new_db $db
    q $db -c "VACUUM ANALYZE" -c "CHECKPOINT" >/dev/null
    echo "(d) 100 events in one transaction, $ROUNDS x ${SECS}s, $CLIENTS clients (each on its own $AGGS aggregates)"
    if [[ -n $BASE_ONLY ]]; then
        echo "  (skipped: both sides are the outbox)"
        return 0
    fi
    for r in $(seq "$ROUNDS"); do
        order="single many"
        ((r % 2 == 0)) && order="many single"
        for s in $order; do
            if [[ $s == single ]]; then
                pgb $db outbox_many_single.sql -c "$CLIENTS" -j "$CLIENTS" -T "$SECS"; b=$(awk -v t="$(tps)" 'BEGIN { print t * 100 }')
            else
                pgb $db outbox_many_idem.sql -c "$CLIENTS" -j "$CLIENTS" -T "$SECS"; c=$(awk -v t="$(tps)" 'BEGIN { print t * 100 }')
            fi
        done
        B+=("$b") C+=("$c")
        printf '  round %d: 100 x idem_outbox_emit %s events/s, idem_outbox_emit_many %s events/s\n' "$r" "$(fmt "$b")" "$(fmt "$c")"
    done
    ratio "outbox (d) 100 events per transaction" events/s idem_outbox_emit_many "${C[@]}" -- "100 x idem_outbox_emit" "${B[@]}"
}

# ------------------------------------------------------------------ (e) WAL

# wal_side DB SIDE: sets WAL_E, WAL_D, WAL_V: bytes per event of emit,
# emit + drain, emit + drain + VACUUM
wal_side() {
    local db=$1 side=$2 per l0 l1 l2 l3
    per=$(((WAL_EV + CLIENTS - 1) / CLIENTS))
    for _ in warm measure; do   # a warm-up pass, then the measured one
        l0=$(lsn $db)
        if [[ $side == plain ]]; then
            pgb $db outbox_emit_plain.sql -c "$CLIENTS" -j "$CLIENTS" -t "$per"
            l1=$(lsn $db)
            drain_all_plain $db
            l2=$(lsn $db)
            q $db -c "VACUUM bench_outbox" >/dev/null
        else
            pgb $db outbox_emit_idem.sql -c "$CLIENTS" -j "$CLIENTS" -t "$per"
            l1=$(lsn $db)
            drain_all_idem $db
            l2=$(lsn $db)
            q $db -c "VACUUM idempotency.outbox_events, idempotency.outbox_sequences, idempotency.outbox_deliveries, idempotency.outbox_cursor" >/dev/null
        fi
        l3=$(lsn $db)
    done
    local n=$((per * CLIENTS))
    waldump_top "$side emit" "$l0" "$l1" "$n"
    waldump_top "$side drain" "$l1" "$l2" "$n"
    WAL_E=$(($(lsn_diff "$l0" "$l1") / n)) WAL_D=$(($(lsn_diff "$l0" "$l2") / n))
    WAL_V=$(($(lsn_diff "$l0" "$l3") / n))
}

# waldump_top LABEL FROM TO EVENTS: the record types that wrote the most WAL
# between two LSNs, in bytes per event (needs pg_waldump and the data
# directory, IDEM_DATA, which test/bench/run exports)
waldump_top() {
    local label=$1 from=$2 to=$3 n=$4 wd out
    [[ -n ${IDEM_DATA:-} && -d $IDEM_DATA/pg_wal ]] || return 0
    wd=$(command -v pg_waldump) || return 0
    sleep 0.5   # asynchronous commits: let the WAL writer flush the range
    out=$("$wd" --stats=record -p "$IDEM_DATA/pg_wal" -s "$from" -e "$to" 2>/dev/null |
        awk -v n="$n" '
            # Type N (%) Record size (%) FPI size (%) Combined size (%)
            { gsub(/\([^)]*\)/, "") }
            $1 ~ /\// && NF == 5 && $5 > 0 { printf "%d %s\n", $5, $1 }' |
        sort -rn | head -n 6 |
        awk -v n="$n" '{ printf "%s%s %.0f", (NR > 1 ? ", " : ""), $2, $1 / n }') || true
    [[ -n $out ]] && echo "    WAL by record type, $label, bytes/event: $out"
    return 0
}

part_wal() {
    local db=obx_wal pe pd pv ie id iv
    new_db $db
    warm_aggregates $db
    q $db -c "VACUUM ANALYZE" -c "CHECKPOINT" >/dev/null
    echo "(e) WAL per event: $WAL_EV single-event transactions per side ($CLIENTS clients), after a warm-up pass of the same size"
    wal_side $db plain
    pe=$WAL_E pd=$WAL_D pv=$WAL_V
    echo "  hand-written: emit $pe B/event, emit+drain $pd B/event, emit+drain+VACUUM $pv B/event"
    if [[ -n $BASE_ONLY ]]; then return 0; fi
    wal_side $db idem
    ie=$WAL_E id=$WAL_D iv=$WAL_V
    echo "  idem:         emit $ie B/event, emit+drain $id B/event, emit+drain+VACUUM $iv B/event"
    ratio "outbox (e) WAL per event (lower is better), emit" B idem "$ie" -- hand-written "$pe"
    ratio "outbox (e) WAL per event (lower is better), emit+drain" B idem "$id" -- hand-written "$pd"
    ratio "outbox (e) WAL per event (lower is better), emit+drain+VACUUM" B idem "$iv" -- hand-written "$pv"
}

started=$SECONDS
# ------------------------------------------------------------------ (f) cpu

part_cpu() {
    local db=obx_cpu
    new_db $db
    warm_aggregates $db
    echo "(f) CPU time per event in one backend, $((ROUNDS + 1)) rounds of $CPU_EV events per side (the first discarded)"
    if [[ -n $BASE_ONLY ]]; then return 0; fi
    q $db -v rounds=$((ROUNDS + 1)) -v events="$CPU_EV" -v aggs="$AGGS" <<'SQL'
SET client_min_messages = warning;
SET idempotency.outbox_notify = off;
CREATE TEMP TABLE t (what text, secs float8);
CREATE FUNCTION pg_temp.cpu() RETURNS float8 LANGUAGE sql AS $$
    SELECT (f[12]::float8 + f[13]::float8) / 100     -- utime, stime: fields 14, 15 (the 12th, 13th after the name)
      FROM (SELECT string_to_array(split_part(pg_read_file('/proc/' || pg_backend_pid() || '/stat'), ') ', 2), ' ') AS f) s
$$;
SELECT set_config('bench.rounds', :'rounds', false), set_config('bench.events', :'events', false),
       set_config('bench.aggs', :'aggs', false) \gset
DO $$
DECLARE
    c0 float8;
    rounds int := current_setting('bench.rounds')::int;
    n int := current_setting('bench.events')::int;
    aggs int := current_setting('bench.aggs')::int;
BEGIN
    FOR r IN 1..rounds LOOP
        c0 := pg_temp.cpu();
        FOR i IN 1..n LOOP
            INSERT INTO bench_outbox (aggregate_type, aggregate_id, type, payload)
            VALUES ('order', (((i - 1) / 100 * 100 + (i - 1) % 100 * 97) % aggs + 1)::text, 'created', '{"n":1}');
            IF i % 100 = 0 THEN COMMIT; END IF;
        END LOOP;
        COMMIT;
        IF r > 1 THEN INSERT INTO t VALUES ('INSERT', pg_temp.cpu() - c0); END IF;
        c0 := pg_temp.cpu();
        FOR i IN 1..n LOOP
            PERFORM idem_outbox_emit('order', (((i - 1) / 100 * 100 + (i - 1) % 100 * 97) % aggs + 1)::text,
                                     'created', '{"n":1}');
            IF i % 100 = 0 THEN COMMIT; END IF;
        END LOOP;
        COMMIT;
        IF r > 1 THEN INSERT INTO t VALUES ('idem_outbox_emit', pg_temp.cpu() - c0); END IF;
        c0 := pg_temp.cpu();
        FOR i IN 1..n / 100 LOOP
            PERFORM count(*) FROM idem_outbox_emit_many('order',
                ARRAY(SELECT (((i - 1) * 100 + g * 97) % aggs + 1)::text FROM generate_series(0, 99) g),
                array_fill('created'::text, ARRAY[100]), array_fill('{"n":1}'::jsonb, ARRAY[100]));
            COMMIT;
        END LOOP;
        IF r > 1 THEN INSERT INTO t VALUES ('idem_outbox_emit_many', pg_temp.cpu() - c0); END IF;
        COMMIT;
    END LOOP;
END
$$;
WITH m AS (SELECT what, percentile_cont(0.5) WITHIN GROUP (ORDER BY secs) / current_setting('bench.events')::int * 1e6 AS us
             FROM t GROUP BY what)
SELECT format('  %s: %s us/event', what, round(us::numeric, 2)) FROM m ORDER BY what;
WITH m AS (SELECT what, percentile_cont(0.5) WITHIN GROUP (ORDER BY secs) AS secs FROM t GROUP BY what)
SELECT format('outbox (f) CPU per event in one backend, emit: idem_outbox_emit %s events/s vs INSERT %s events/s = %sx',
              round(n / e.secs), round(n / i.secs), round((i.secs / e.secs)::numeric, 2))
  FROM m e, m i, (SELECT current_setting('bench.events')::int AS n) c
 WHERE e.what = 'idem_outbox_emit' AND i.what = 'INSERT'
UNION ALL
SELECT format('outbox (f) CPU per event in one backend, batch: idem_outbox_emit_many %s events/s vs idem_outbox_emit %s events/s = %sx',
              round(n / b.secs), round(n / e.secs), round((e.secs / b.secs)::numeric, 2))
  FROM m b, m e, (SELECT current_setting('bench.events')::int AS n) c
 WHERE b.what = 'idem_outbox_emit_many' AND e.what = 'idem_outbox_emit';
SQL
}

for p in $PARTS; do
    t=$SECONDS
    case $p in
        emit)  part_emit ;;
        drain) part_drain ;;
        subs) part_subs ;;
        e2e)   part_e2e ;;
        many)  part_many ;;
        wal)   part_wal ;;
        cpu)   part_cpu ;;
        *) die "unknown part '$p' (emit drain e2e many wal cpu subs)" ;;
    esac
    echo "  ($p: $((SECONDS - t)) s)"
done
echo "outbox bench: $((SECONDS - started)) s"
