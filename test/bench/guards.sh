#!/bin/bash
# Benchmark of guarded writes (see GUARDS-README-SNIPPET.md).
#
# Compares, in interleaved rounds on one server:
#   hand-written  INSERT ... ON CONFLICT DO UPDATE ... WHERE t.version < EXCLUDED.version
#   table guard   the same upsert without a WHERE, into a table guarded by idem_guard_version()
#   idem_upsert   SELECT idem_upsert(ROW(...)::table)
# Every transaction upserts one of 10000 rows; one in five carries a stale
# version, the others a newer one.
#
# Connection: the standard libpq variables (PGHOST, PGPORT, PGDATABASE, PGUSER).
# Knobs: GUARDS_BENCH_SECONDS (per round and variant, default 3),
#        GUARDS_BENCH_ROUNDS (default 10), GUARDS_BENCH_CLIENTS (default 2).
# Many short interleaved rounds and the median of each variant keep a noisy
# shared machine from deciding the result; lengthen both for a real figure.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
secs=${GUARDS_BENCH_SECONDS:-3}
rounds=${GUARDS_BENCH_ROUNDS:-10}
clients=${GUARDS_BENCH_CLIENTS:-2}
export PGOPTIONS="${PGOPTIONS:-} -c synchronous_commit=off"

psql_q() { psql -X -q -v ON_ERROR_STOP=1 "$@"; }

cleanup() {
    psql_q -c 'DROP TABLE IF EXISTS guards_bench_hand, guards_bench_guard, guards_bench_idem' >/dev/null 2>&1 || true
}
trap cleanup EXIT

psql_q >/dev/null <<'SQL'
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS idempotency;
DROP TABLE IF EXISTS guards_bench_hand, guards_bench_guard, guards_bench_idem;
CREATE TABLE guards_bench_hand  (id int PRIMARY KEY, payload text, version bigint NOT NULL);
CREATE TABLE guards_bench_guard (LIKE guards_bench_hand INCLUDING ALL);
CREATE TABLE guards_bench_idem  (LIKE guards_bench_hand INCLUDING ALL);
INSERT INTO guards_bench_hand  SELECT g, 'payload ' || g, 2 FROM generate_series(1, 10000) g;
INSERT INTO guards_bench_guard SELECT * FROM guards_bench_hand;
INSERT INTO guards_bench_idem  SELECT * FROM guards_bench_hand;
SELECT idem_guard_version('guards_bench_guard');
VACUUM ANALYZE guards_bench_hand, guards_bench_guard, guards_bench_idem;
SQL

# tps of one pgbench run of script $1
run() {
    pgbench -n -M prepared -c "$clients" -j "$clients" -T "$secs" -f "$here/$1" 2>&1 |
        sed -n 's/^tps = \([0-9.]*\) .*/\1/p'
}

declare -A results=([hand]="" [guard]="" [idem]="")
variants=(hand guard idem)
declare -A script=([hand]=guards_handwritten.sql [guard]=guards_table_guard.sql [idem]=guards_idem_upsert.sql)
for ((r = 0; r < rounds; r++)); do
    # rotate the order each round so no variant always runs first
    for ((k = 0; k < 3; k++)); do
        v=${variants[$(((r + k) % 3))]}
        tps=$(run "${script[$v]}")
        [ -n "$tps" ] || { echo "guards: pgbench failed for $v" >&2; exit 1; }
        echo "guards: round $((r + 1)) $v: $tps tps" >&2
        results[$v]+="$tps "
    done
done

median() { tr ' ' '\n' <<<"${results[$1]}" | grep . | sort -g |
           awk '{a[NR] = $1} END {printf "%.0f", (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
hand=$(median hand); guard=$(median guard); idem=$(median idem)
ratio() { awk -v a="$1" -v b="$hand" 'BEGIN {printf "%.2f", a / b}'; }
echo "guards: guarded upsert vs hand-written ON CONFLICT … WHERE version <: $(ratio "$guard")x ($guard vs $hand tps, median of $rounds rounds)"
echo "guards: idem_upsert vs hand-written ON CONFLICT … WHERE version <: $(ratio "$idem")x ($idem vs $hand tps, median of $rounds rounds)"
