#!/usr/bin/env bash
# test/bench/retention.sh: what retention costs claimers.
#
# (a) Claim latency while retention runs beside a reader that holds a
#     4-second query on the claims: idem_claim with 1-second partitions and
#     idem_maintain() every half second (dropping a partition a second), side
#     by side with DELETE-based retention (INSERT ... ON CONFLICT DO NOTHING
#     into a plain table, DELETE of expired rows every half second, the same
#     reader).  Prints the slowest claim and the 99th percentile of each.
# (b) Claim throughput with 30 live partitions (29 sealed, with Bloom
#     filters, plus the current one) against a single partition, for new and
#     duplicate keys, interleaved rounds.  Target: >= 0.9x.
#
# Connection from PGHOST/PGPORT/PGDATABASE/PGUSER (test/bench/run sets them).
# Settings: those of lib.sh, and IDEM_BENCH_LATENCY_SECONDS (default 20).
set -euo pipefail

dir=$(cd "$(dirname "$0")" && pwd)
. "$dir/lib.sh"
LAT_SECS=${IDEM_BENCH_LATENCY_SECONDS:-20}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; kill $(jobs -p) 2>/dev/null || true' EXIT

# ---- (a) latency beside maintenance and a 4-second reader ----
psql -X -q -v ON_ERROR_STOP=1 >/dev/null <<'SQL'
SET client_min_messages = warning;
DROP EXTENSION IF EXISTS idempotency CASCADE;
CREATE EXTENSION idempotency;
SELECT idem_configure(retention => '5 seconds', partition_interval => '1 second', premake => 3);
DROP TABLE IF EXISTS bench_plain;
CREATE TABLE bench_plain (scope text, key text, claimed_at timestamptz DEFAULT now(),
                          PRIMARY KEY (scope, key));
CREATE INDEX ON bench_plain (claimed_at);
SQL

# latency_run NAME SCRIPT CLEANER_SQL READER_SQL: pgbench with per-transaction
# log, a cleaner every 0.5 s and a 4-second reader, both in the background
latency_run() {
    local name=$1 script=$2 cleaner=$3 reader=$4
    ( end=$((SECONDS + LAT_SECS)); while ((SECONDS < end)); do
          psql -X -q -c "$cleaner" >/dev/null 2>&1 || true; sleep 0.5; done ) &
    local cpid=$!
    ( end=$((SECONDS + LAT_SECS)); while ((SECONDS < end)); do
          psql -X -q -c "$reader" >/dev/null 2>&1 || true; done ) &
    local rpid=$!
    (cd "$tmp" && PGOPTIONS='-c synchronous_commit=off' pgbench -n -M prepared \
        -c "$CLIENTS" -j "$CLIENTS" -T "$LAT_SECS" -R 2000 -l --log-prefix="$name" \
        -f "$dir/$script" >/dev/null)
    wait "$cpid" "$rpid" || true
    # column 3 of the log is the latency in microseconds
    cat "$tmp/$name".* | awk '{ print $3 }' | sort -n | awk -v n="$name" '
        { v[NR] = $1 } END { printf "%s %d %.2f %.2f\n", n, NR, v[int(NR * 0.99)] / 1000, v[NR] / 1000 }'
}

echo "retention bench (a): ${LAT_SECS}s of claims at up to 2000/s beside retention every 0.5s and a 4s reader"
read -r _ n1 p1 m1 < <(latency_run idem claims_new_idem.sql \
    'SELECT count(*) FROM idem_maintain()' \
    'SELECT count(*), pg_sleep(4) FROM idempotency.claims')
read -r _ n2 p2 m2 < <(latency_run plain claims_new_plain.sql \
    "DELETE FROM bench_plain WHERE claimed_at < now() - interval '5 seconds'" \
    'SELECT count(*), pg_sleep(4) FROM bench_plain')
printf '  partition drops: %d claims, p99 %.2f ms, slowest %.2f ms\n' "$n1" "$p1" "$m1"
printf '  row DELETEs:     %d claims, p99 %.2f ms, slowest %.2f ms\n' "$n2" "$p2" "$m2"
echo "retention latency: slowest claim ${m1} ms beside partition drops, ${m2} ms beside DELETE retention (target < 50 ms)"

# ---- (b) 30 live partitions against 1 ----
psql -X -q -v ON_ERROR_STOP=1 >/dev/null <<'SQL'
SET client_min_messages = warning;
DROP EXTENSION IF EXISTS idempotency CASCADE;
CREATE EXTENSION idempotency;
SELECT idem_configure(retention => '60 days', partition_interval => '1 day', premake => 2);
SELECT count(*) FROM idem_claim_many(ARRAY(SELECT g::text FROM generate_series(1, 10000) g));
SQL
# the same claims in a second database with 29 more, older partitions of
# 20000 claims each, sealed by maintenance as it would seal them
psql -X -q -v ON_ERROR_STOP=1 -c 'DROP DATABASE IF EXISTS idem_bench_30' -c 'CREATE DATABASE idem_bench_30' >/dev/null
PGDATABASE=idem_bench_30 psql -X -q -v ON_ERROR_STOP=1 >/dev/null <<'SQL'
SET client_min_messages = warning;
CREATE EXTENSION idempotency;
SELECT idem_configure(retention => '60 days', partition_interval => '1 day', premake => 2);
ALTER TABLE idempotency.claims DISABLE TRIGGER claims_read_only;
DO $$
DECLARE
    day0 timestamptz := (SELECT min(lower) FROM idempotency.partition_registry);
BEGIN
    FOR d IN 1..29 LOOP
        EXECUTE format('CREATE TABLE idempotency.claims_old_%s () INHERITS (idempotency.claims)', d);
        EXECUTE format('CREATE UNIQUE INDEX ON idempotency.claims_old_%s (scope, key)', d);
        EXECUTE format('INSERT INTO idempotency.claims_old_%s SELECT ''default'', ''old-%s-'' || g, %L, NULL'
                       ' FROM generate_series(1, 20000) g', d, d, day0 - d * interval '1 day');
        INSERT INTO idempotency.partition_registry (relid, lower, upper)
        VALUES (format('idempotency.claims_old_%s', d)::regclass,
                day0 - d * interval '1 day', day0 - (d - 1) * interval '1 day');
    END LOOP;
END $$;
ALTER TABLE idempotency.claims ENABLE TRIGGER claims_read_only;
SELECT count(*) FROM idem_maintain();
SELECT count(*) FROM idem_claim_many(ARRAY(SELECT g::text FROM generate_series(1, 10000) g));
VACUUM ANALYZE;
SQL
live=$(PGDATABASE=idem_bench_30 psql -X -At -c "SELECT count(*) FILTER (WHERE state <> 'future') || ' live, ' || count(*) FILTER (WHERE state = 'sealed') || ' sealed' FROM idempotency.partitions WHERE store = 'claims'")
psql -X -q -c 'VACUUM ANALYZE' >/dev/null
echo "retention bench (b): $ROUNDS interleaved rounds of ${SECS}s, $CLIENTS clients; 30-partition database: $live"
for case in new dup; do
    one=() thirty=()
    for r in $(seq "$ROUNDS"); do
        a=$(bench_tps "claims_${case}_idem.sql")
        b=$(PGDATABASE=idem_bench_30 bench_tps "claims_${case}_idem.sql")
        one+=("$a") thirty+=("$b")
        printf '  %s keys round %d: 1 partition %.0f tps, 30 partitions %.0f tps\n' "$case" "$r" "$a" "$b"
    done
    label=$([[ $case == new ]] && echo "new keys" || echo "duplicate keys")
    bench_ratio "retention $label" "30 partitions" "${thirty[@]}" -- "1 partition" "${one[@]}"
done
psql -X -q -c 'DROP DATABASE idem_bench_30' >/dev/null
