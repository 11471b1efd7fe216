#!/bin/bash
# Benchmark of guarded writes (the guards: doc/guards.md; figures: doc/benchmarks.md).
#
# Compares, in interleaved rounds on one server:
#   hand-written  INSERT ... ON CONFLICT DO UPDATE ... WHERE t.version < EXCLUDED.version
#   table guard   the same upsert without a WHERE, into a table guarded by idem_guard_version()
#   idem_upsert   SELECT idem_upsert(ROW(...)::table)
# Every transaction upserts one of 10000 rows; one in five carries a stale
# version, the others a newer one.
#
# Connection: the standard libpq variables (PGHOST, PGPORT, PGDATABASE, PGUSER).
# Knobs: IDEM_BENCH_SECONDS (per round and variant, default 5),
#        IDEM_BENCH_ROUNDS (default 5), IDEM_BENCH_CLIENTS (default 2).
# Many short interleaved rounds and the median of each variant keep a noisy
# shared machine from deciding the result; lengthen both for a real figure.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"

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

declare -A results=([hand]="" [guard]="" [idem]="")
variants=(hand guard idem)
declare -A script=([hand]=guards_handwritten.sql [guard]=guards_table_guard.sql [idem]=guards_idem_upsert.sql)
for ((r = 0; r < ROUNDS; r++)); do
    # rotate the order each round so no variant always runs first
    for ((k = 0; k < 3; k++)); do
        v=${variants[$(((r + k) % 3))]}
        tps=$(bench_tps "${script[$v]}")
        [ -n "$tps" ] || { echo "guards: pgbench failed for $v" >&2; exit 1; }
        echo "guards: round $((r + 1)) $v: $tps tps" >&2
        results[$v]+="$tps "
    done
done

read -ra hand <<<"${results[hand]}"; read -ra guard <<<"${results[guard]}"; read -ra idem <<<"${results[idem]}"
bench_ratio "guards: table guard vs hand-written ON CONFLICT WHERE version <" "guarded upsert" "${guard[@]}" -- "hand-written" "${hand[@]}"
bench_ratio "guards: idem_upsert vs hand-written ON CONFLICT WHERE version <" idem_upsert "${idem[@]}" -- "hand-written" "${hand[@]}"
