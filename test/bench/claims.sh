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
. "$dir/lib.sh"

bench_claims_setup

echo "claims bench: $ROUNDS interleaved rounds of ${SECS}s per method and case, $CLIENTS clients, -M prepared, synchronous_commit=off"
for case in new dup; do
    plain() { bench_tps "claims_${case}_plain.sql"; }
    idem() { bench_tps "claims_${case}_idem.sql"; }
    bench_rounds "$case keys" "INSERT ON CONFLICT" idem_claim
    label=$([[ $case == new ]] && echo "new keys" || echo "duplicate keys")
    bench_ratio "claims $label" idem_claim "${cand[@]}" -- "INSERT ON CONFLICT" "${base[@]}"
done
