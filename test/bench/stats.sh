#!/usr/bin/env bash
# test/bench/stats.sh: what the idempotency.stats counters cost the claim
# path.  The server is restarted with the library preloaded (so the counters
# exist), and idem_claim runs with idempotency.track_stats = on and off in
# interleaved rounds, for new keys and for duplicates (keys 1..10000 claimed
# beforehand); the ratio on / off is the cost (target >= 0.97x).  The plain
# INSERT ... ON CONFLICT DO NOTHING baseline runs in the same rounds.  The
# server is restarted as it was at the end.
#
# Connection from PGHOST/PGPORT/PGDATABASE/PGUSER; restarts need IDEM_DATA
# and IDEM_BINDIR (test/bench/run sets them all).  Settings:
# IDEM_BENCH_ROUNDS, IDEM_BENCH_SECONDS, IDEM_BENCH_CLIENTS (see lib.sh).
set -euo pipefail

dir=$(cd "$(dirname "$0")" && pwd)
. "$dir/lib.sh"

old_preload=$(psql -X -At -c 'SHOW shared_preload_libraries')
cleanup() {
    local rc=$?
    set +e
    bench_restart "shared_preload_libraries=${old_preload// /}" >/dev/null 2>&1
    return $rc
}
trap cleanup EXIT
bench_restart "shared_preload_libraries=${old_preload:+${old_preload// /},}idempotency"

bench_claims_setup
[[ $(psql -X -At -c 'SELECT preloaded FROM idempotency.stats_info()') == t ]] ||
    { echo "stats bench: the library is not preloaded" >&2; exit 1; }

echo "stats bench: $ROUNDS interleaved rounds of ${SECS}s per setting and case, $CLIENTS clients, -M prepared, synchronous_commit=off, library preloaded"
for case in new dup; do
    on=() off=() base=()
    stats_off() { PGOPTIONS="-c idempotency.track_stats=off" bench_tps "claims_${case}_idem.sql"; }
    stats_on() { PGOPTIONS="-c idempotency.track_stats=on" bench_tps "claims_${case}_idem.sql"; }
    for r in $(seq "$ROUNDS"); do
        base+=("$(bench_tps "claims_${case}_plain.sql")")
        # which setting runs first alternates, so the order costs neither
        bench_pair "$r" stats_off stats_on
        off+=("$b") on+=("$c")
        printf '  %s keys round %d: INSERT ON CONFLICT %.0f tps, idem_claim stats off %.0f tps, on %.0f tps\n' \
            "$case" "$r" "${base[-1]}" "$b" "$c"
    done
    label=$([[ $case == new ]] && echo "new keys" || echo "duplicate keys")
    bench_ratio "stats cost, $label" "idem_claim stats on" "${on[@]}" -- "stats off" "${off[@]}"
    bench_ratio "claims with stats on, $label" "idem_claim stats on" "${on[@]}" -- "INSERT ON CONFLICT" "${base[@]}"
done
psql -X -q -At -c "SELECT 'counted: ' || claims || ' claims, ' || duplicates || ' duplicates in scope default' FROM idempotency.stats WHERE scope = 'default'"
