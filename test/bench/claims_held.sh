#!/usr/bin/env bash
# test/bench/claims_held.sh: claims beside one long open claiming transaction.
#
# pgbench clients claim new keys (drawn from a huge range) over 1-second
# partitions (retention 60 s, premake 5) while idem_maintain() runs every
# second, once alone (the baseline) and once beside a "long" session that
# BEGINs, claims a key every 3 seconds and does not commit during the run
# (it keeps RowExclusiveLock on every partition it claimed in).  Rounds are
# interleaved, the baseline first in odd rounds and second in even ones
# (bench_pair); pgbench -M prepared, synchronous_commit = off.  Prints per
# round the tps of both and, at the end of the run beside the long session,
# the claims partitions by state (those not yet sealed are what every claim
# probes), then the ratio of the medians.  Target: >= 0.8x; the script
# exits non-zero below it.
#
# Connection from PGHOST/PGPORT/PGDATABASE/PGUSER (test/bench/run sets them).
# Settings: IDEM_BENCH_HELD_ROUNDS (default 2), IDEM_BENCH_HELD_SECONDS per
# run (default 60: unsealed partitions pile up over the run), and
# IDEM_BENCH_CLIENTS (default 2).
set -euo pipefail

dir=$(cd "$(dirname "$0")" && pwd)
. "$dir/lib.sh"
ROUNDS=${IDEM_BENCH_HELD_ROUNDS:-2}
SECS=${IDEM_BENCH_HELD_SECONDS:-60}
tmp=$(mktemp -d)
maint=''
cleanup() {
    [[ -n $maint ]] && kill "$maint" 2>/dev/null
    kill $(jobs -p) 2>/dev/null || true
    rm -rf "$tmp"
}
trap cleanup EXIT

psql -X -q -v ON_ERROR_STOP=1 >/dev/null <<'SQL'
SET client_min_messages = warning;
DROP EXTENSION IF EXISTS idempotency CASCADE;
CREATE EXTENSION idempotency;
SELECT idem_configure(retention => '60 seconds', partition_interval => '1 second', premake => 5);
SQL

# maintenance every second, for the whole script
( while :; do psql -X -q -At -c 'SELECT count(*) FROM idem_maintain()' >/dev/null 2>&1 || true
      sleep 1; done ) &
maint=$!
sleep 3

# the claims partitions by state, e.g. "current=1 future=5 held=3 sealed=40"
states() {
    psql -X -q -At -c "SELECT string_agg(state || '=' || n, ' ' ORDER BY state)
                         FROM (SELECT state, count(*) AS n FROM idempotency.partitions
                                WHERE store = 'claims' GROUP BY state) s"
}

base() { bench_tps claims_new_idem.sql; }

# a run beside the long session; the states at its end go to $tmp/states
cand() {
    local r=$1 tps
    (
        echo 'BEGIN;'
        i=0
        while :; do
            i=$((i + 1))
            echo "SELECT idem_claim('long-$r-$i', 'held-bench');"
            sleep 3
        done
    ) | psql -X -q -At -v ON_ERROR_STOP=1 >/dev/null 2>"$tmp/long.err" &
    local long=$!
    sleep 1
    tps=$(bench_tps claims_new_idem.sql)
    states >"$tmp/states"
    kill "$long" 2>/dev/null || true
    wait "$long" 2>/dev/null || true
    sleep 3                 # let maintenance seal what the session held
    echo "$tps"
}

echo "claims beside a long claiming transaction: $ROUNDS interleaved rounds of ${SECS}s per run, $CLIENTS clients, 1-second partitions, maintenance every second, -M prepared, synchronous_commit=off"
b_all=() c_all=()
for r in $(seq "$ROUNDS"); do
    with() { cand "$r"; }
    bench_pair "$r" base with
    b_all+=("$b") c_all+=("$c")
    printf '  round %d: alone %.0f tps, beside the long transaction %.0f tps (partitions at its end: %s)\n' \
        "$r" "$b" "$c" "$(cat "$tmp/states")"
done
line=$(bench_ratio "claims beside a long claiming transaction" "with it" "${c_all[@]}" -- "without" "${b_all[@]}")
echo "$line"
ratio=$(sed -n 's/.*= \([0-9.]*\)x$/\1/p' <<<"$line")
if awk -v r="$ratio" 'BEGIN { exit !(r >= 0.8) }'; then
    echo "target >= 0.80x: met"
else
    echo "target >= 0.80x: NOT met"
    exit 1
fi
