#!/usr/bin/env bash
# test/bench/claims.sh: idem_claim against the hand-written baseline
#   INSERT INTO bench_plain (scope, key) VALUES ('default', :k) ON CONFLICT DO NOTHING
# on a plain (scope, key) primary-key table, for new keys (drawn from a huge
# range) and duplicate keys (1..10000, claimed/inserted beforehand in both).
# Rounds are interleaved (baseline, candidate, baseline, ...) in one run;
# pgbench -M prepared, synchronous_commit = off (the commit flush would hide
# CPU cost).  Prints per-round tps, then per case the median tps of both and
# the ratio candidate / baseline.
#
# Connection from PGHOST/PGPORT/PGDATABASE/PGUSER (test/bench/run sets them).
# Settings: IDEM_BENCH_ROUNDS (default 5), IDEM_BENCH_SECONDS per round
# (default 5), IDEM_BENCH_CLIENTS (default 2).
set -euo pipefail

dir=$(cd "$(dirname "$0")" && pwd)
ROUNDS=${IDEM_BENCH_ROUNDS:-5}
SECS=${IDEM_BENCH_SECONDS:-5}
CLIENTS=${IDEM_BENCH_CLIENTS:-2}

psql -X -q -v ON_ERROR_STOP=1 >/dev/null <<'SQL'
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS idempotency;
DROP TABLE IF EXISTS bench_plain;
CREATE TABLE bench_plain (
    scope      text,
    key        text,
    claimed_at timestamptz DEFAULT now(),
    PRIMARY KEY (scope, key)
);
-- the duplicates: keys 1..10000 exist in both
SELECT count(*) FROM idem_claim_many(ARRAY(SELECT g::text FROM generate_series(1, 10000) g));
INSERT INTO bench_plain (scope, key)
SELECT 'default', g::text FROM generate_series(1, 10000) g ON CONFLICT DO NOTHING;
VACUUM ANALYZE;
CHECKPOINT;
SQL

# tps SCRIPT: one pgbench round, prints its tps
tps() {
    local out
    out=$(PGOPTIONS='-c synchronous_commit=off' pgbench -n -M prepared -c "$CLIENTS" -j "$CLIENTS" \
        -T "$SECS" -f "$dir/$1" 2>&1) || { echo "$out" >&2; echo "pgbench failed on $1" >&2; return 1; }
    sed -n 's/^tps = \([0-9.]*\) .*/\1/p' <<<"$out" | head -n 1
}

# median of the arguments
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

echo "claims bench: $ROUNDS interleaved rounds of ${SECS}s per method and case, $CLIENTS clients, -M prepared, synchronous_commit=off"
for case in new dup; do
    base=() cand=()
    for r in $(seq "$ROUNDS"); do
        b=$(tps "claims_${case}_plain.sql")
        c=$(tps "claims_${case}_idem.sql")
        base+=("$b") cand+=("$c")
        printf '  %s keys round %d: INSERT ON CONFLICT %.0f tps, idem_claim %.0f tps\n' "$case" "$r" "$b" "$c"
    done
    mb=$(median "${base[@]}")
    mc=$(median "${cand[@]}")
    label=$([[ $case == new ]] && echo "new keys" || echo "duplicate keys")
    awk -v l="$label" -v c="$mc" -v b="$mb" \
        'BEGIN { printf "claims %s: idem_claim %.0f tps vs INSERT ON CONFLICT %.0f tps = %.2fx\n", l, c, b, c / b }'
done
