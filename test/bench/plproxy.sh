#!/usr/bin/env bash
# test/bench/plproxy.sh: the router hop.  The handler of
# examples/scale-out/shard.sql (idem_claim_routed + effect + outbox event)
# called through a PL/Proxy router (database bench_router, RUN ON
# hashtext(account_id::text) over bench_shard_a and bench_shard_b, which own
# hash partitions 0 and 1 of 2) against the same handler called directly on
# one unsharded database (bench_direct, which owns the single partition of
# 1, so the ownership check still runs there).  Two cases: new events, and
# duplicates (events d1..d10000 applied beforehand in both).  A third pair
# prices the ownership check itself on bench_direct: idem_claim_routed
# against idem_claim.  Rounds are interleaved; pgbench -M prepared,
# synchronous_commit = off on every database (the shards' sessions are
# opened by PL/Proxy, so it is set per database).  Prints per-round tps,
# the ratios, and the hop per call in ms (clients / tps, router minus direct).
# Which of a pair runs first alternates from round to round.
#
# Connection from PGHOST/PGPORT/PGUSER (test/bench/run sets them).
# Settings: IDEM_BENCH_ROUNDS (default 5), IDEM_BENCH_SECONDS per round
# (default 5), IDEM_BENCH_CLIENTS (default 2).
# bench-packages: postgresql-15-plproxy
set -euo pipefail

dir=$(cd "$(dirname "$0")" && pwd)
. "$dir/lib.sh"
shard_sql=$dir/../../examples/scale-out/shard.sql

q() { psql -X -q -v ON_ERROR_STOP=1 "$@" >/dev/null; }

for db in bench_router bench_shard_a bench_shard_b bench_direct; do
    q -d postgres -c "SET client_min_messages = warning" -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" \
        -c "ALTER DATABASE $db SET synchronous_commit = off"
done
q -d bench_shard_a -f "$shard_sql" -c "SELECT idem_shard_configure(2, '{0}')"
q -d bench_shard_b -f "$shard_sql" -c "SELECT idem_shard_configure(2, '{1}')"
q -d bench_direct -f "$shard_sql" -c "SELECT idem_shard_configure(1, '{0}')"
ddl=$(psql -X -At -v ON_ERROR_STOP=1 -d bench_shard_a \
    -c "SELECT idem_shard_router_ddl('apply_payment(bigint, text, integer)', 'account_id::text')")
q -d bench_router <<SQL
CREATE EXTENSION plproxy;
CREATE SERVER idem FOREIGN DATA WRAPPER plproxy OPTIONS (
    p0 'host=$PGHOST port=$PGPORT dbname=bench_shard_a',
    p1 'host=$PGHOST port=$PGPORT dbname=bench_shard_b');
CREATE USER MAPPING FOR PUBLIC SERVER idem;
$ddl
-- the duplicates
SELECT count(*) FROM generate_series(1, 10000) g WHERE apply_payment(g % 1000 + 1, 'd' || g, 1);
SQL
q -d bench_direct -c "SELECT count(*) FROM generate_series(1, 10000) g WHERE apply_payment(g % 1000 + 1, 'd' || g, 1)"
for db in bench_shard_a bench_shard_b bench_direct; do q -d "$db" -c 'VACUUM ANALYZE'; done
q -d postgres -c CHECKPOINT
[[ $(psql -X -At -d bench_shard_a -c 'SELECT count(*) FROM effects') -gt 0 &&
   $(psql -X -At -d bench_shard_b -c 'SELECT count(*) FROM effects') -gt 0 ]] ||
    { echo "the router did not reach both shards" >&2; exit 1; }

# ms per call and client: clients / tps
per_call() { awk -v c="$CLIENTS" -v t="$(bench_median "$@")" 'BEGIN { printf "%.3f", 1000 * c / t }'; }

echo "plproxy bench: $ROUNDS interleaved rounds of ${SECS}s per method and case, $CLIENTS clients, -M prepared, synchronous_commit=off"
for case in new dup guard; do
    base=() cand=()
    base_run() { PGDATABASE=$bdb bench_tps "$bscript"; }
    cand_run() { PGDATABASE=$cdb bench_tps "$cscript"; }
    for r in $(seq "$ROUNDS"); do
        if [[ $case == guard ]]; then
            bdb=bench_direct bscript=plproxy_claim_plain.sql cdb=bench_direct cscript=plproxy_claim_routed.sql
        else
            bdb=bench_direct bscript=plproxy_$case.sql cdb=bench_router cscript=plproxy_$case.sql
        fi
        bench_pair "$r" base_run cand_run
        if [[ $case == guard ]]; then
            printf '  %s round %d: idem_claim %.0f tps, idem_claim_routed %.0f tps\n' "$case" "$r" "$b" "$c"
        else
            printf '  %s round %d: direct %.0f tps, through the router %.0f tps\n' "$case" "$r" "$b" "$c"
        fi
        base+=("$b") cand+=("$c")
    done
    case $case in
        new) bench_ratio "plproxy, new events" "through the router" "${cand[@]}" -- "direct" "${base[@]}" ;;
        dup) bench_ratio "plproxy, duplicates" "through the router" "${cand[@]}" -- "direct" "${base[@]}" ;;
        guard) bench_ratio "plproxy, ownership check" "idem_claim_routed" "${cand[@]}" -- "idem_claim" "${base[@]}" ;;
    esac
    if [[ $case != guard ]]; then
        awk -v l="$case" -v r="$(per_call "${cand[@]}")" -v d="$(per_call "${base[@]}")" \
            'BEGIN { printf "  %s: %.3f ms per call through the router, %.3f ms direct: the hop costs %.3f ms per call\n", l, r, d, r - d }'
    fi
done


# every effect once, the router's on both shards
for db in bench_shard_a bench_shard_b bench_direct; do
    psql -X -At -v ON_ERROR_STOP=1 -d "$db" -c "
        SELECT '  $db: ' || count(*) || ' effects, ' || (count(*) - count(DISTINCT event_id)) || ' doubled'
          FROM effects"
done
for db in bench_router bench_shard_a bench_shard_b bench_direct; do
    q -d postgres -c "DROP DATABASE $db WITH (FORCE)"
done
