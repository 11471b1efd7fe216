#!/usr/bin/env bash
# test/bench/claims_held.sh: claims beside one long open claiming transaction.
#
# pgbench clients claim new keys (drawn from a huge range) over 1-second
# partitions (retention 60 s, premake 5) while idem_maintain() runs every
# second, once alone (the baseline) and once beside a "long" session that
# BEGINs, claims a key every 3 seconds and does not commit during the run
# (it keeps RowExclusiveLock on every partition it claimed in).  A third run
# beside a session that holds an open transaction with an xid but never
# claims shows what any long transaction costs here (nothing of ours is
# held; the registry and catalog rows the rounds replace cannot be pruned
# meanwhile).  Rounds are interleaved, the baseline first in odd rounds and
# second in even ones (as bench_pair does); pgbench -M prepared,
# synchronous_commit = off.
# Prints per round the tps of each, the CPU time the claiming backends spent
# per transaction (from /proc: much less disturbed than tps by other load on
# the machine) and, at the end of the run beside the long session, the
# claims partitions by state (those not yet sealed are what every claim
# probes); then the ratios of the medians.  Target: tps >= 0.8x; the script
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

# the CPU clock ticks the processes have used
cpu_ticks() {
    local p f s=0
    for p in "$@"; do
        read -r -a f <"/proc/$p/stat" || continue
        s=$((s + f[13] + f[14]))
    done
    echo "$s"
}
commits() { psql -X -At -c "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"; }

# one pgbench run as bench_tps makes it; prints its tps and the CPU
# microseconds its backends used per transaction (between 2 s after the
# start and 2 s before the end)
measured() {
    local pg pids t0 x0 t1 x1 tps
    PGOPTIONS="${PGOPTIONS:-} -c synchronous_commit=off" pgbench -n -M prepared \
        -c "$CLIENTS" -j "$CLIENTS" -T "$SECS" -f "$bench_dir/claims_new_idem.sql" >"$tmp/pgbench.out" 2>&1 &
    pg=$!
    sleep 2
    pids=$(psql -X -At -c "SELECT string_agg(pid::text, ' ') FROM pg_stat_activity
                            WHERE application_name = 'pgbench' AND datname = current_database()")
    t0=$(cpu_ticks $pids) x0=$(commits)
    sleep $((SECS - 4))
    t1=$(cpu_ticks $pids) x1=$(commits)
    wait "$pg" || { cat "$tmp/pgbench.out" >&2; echo "pgbench failed" >&2; return 1; }
    tps=$(sed -n 's/^tps = \([0-9.]*\) .*/\1/p' "$tmp/pgbench.out" | head -n 1)
    awk -v tps="$tps" -v t=$((t1 - t0)) -v x=$((x1 - x0)) -v hz="$(getconf CLK_TCK)" \
        'BEGIN { printf "%s %.1f\n", tps, t / hz * 1e6 / x }'
}

base() { measured; }

# a run beside the long session (claiming, or only holding an xid: IDLE=1);
# the states at its end go to $tmp/states
cand() {
    local r=$1 out
    (
        echo 'BEGIN;'
        [[ -n ${IDLE:-} ]] && echo 'SELECT pg_current_xact_id();'
        i=0
        while :; do
            i=$((i + 1))
            if [[ -n ${IDLE:-} ]]; then
                echo 'SELECT 1;'
            else
                echo "SELECT idem_claim('long-$r-$i', 'held-bench');"
            fi
            sleep 3
        done
    ) | psql -X -q -At -v ON_ERROR_STOP=1 >/dev/null 2>"$tmp/long.err" &
    local long=$!
    sleep 1
    out=$(measured)
    states >"$tmp/states"
    kill "$long" 2>/dev/null || true
    wait "$long" 2>/dev/null || true
    sleep 3                 # let maintenance seal what the session held
    echo "$out"
}

echo "claims beside a long claiming transaction: $ROUNDS interleaved rounds of ${SECS}s per run, $CLIENTS clients, 1-second partitions, maintenance every second, -M prepared, synchronous_commit=off"
b_all=() c_all=() i_all=() bcpu=() ccpu=() icpu=()
for r in $(seq "$ROUNDS"); do
    # the baseline first in odd rounds, last in even ones
    ((r % 2)) && read -r b bc < <(base)
    read -r c cc < <(cand "$r")
    states=$(cat "$tmp/states")
    read -r i ic < <(IDLE=1 cand "$r")
    ((r % 2)) || read -r b bc < <(base)
    b_all+=("$b") c_all+=("$c") i_all+=("$i") bcpu+=("$bc") ccpu+=("$cc") icpu+=("$ic")
    printf '  round %d: alone %.0f tps (%s us CPU per claim); beside the long claiming transaction %.0f tps (%s us; partitions at its end: %s); beside an open transaction that does not claim %.0f tps (%s us)\n' \
        "$r" "$b" "$bc" "$c" "$cc" "$states" "$i" "$ic"
done
awk -v c="$(bench_median "${ccpu[@]}")" -v b="$(bench_median "${bcpu[@]}")" -v i="$(bench_median "${icpu[@]}")" \
    'BEGIN { printf "CPU per claim beside a long claiming transaction (lower is better): with it %.1f us vs without %.1f us = %.2fx (beside one that does not claim: %.1f us)\n", c, b, c / b, i }'
bench_ratio "claims beside an open transaction that does not claim" "with it" "${i_all[@]}" -- "without" "${b_all[@]}"
line=$(bench_ratio "claims beside a long claiming transaction" "with it" "${c_all[@]}" -- "without" "${b_all[@]}")
echo "$line"
ratio=$(sed -n 's/.*= \([0-9.]*\)x$/\1/p' <<<"$line")
if awk -v r="$ratio" 'BEGIN { exit !(r >= 0.8) }'; then
    echo "target >= 0.80x: met"
else
    echo "target >= 0.80x: NOT met"
    exit 1
fi
