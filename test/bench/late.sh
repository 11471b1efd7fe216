#!/usr/bin/env bash
# test/bench/late.sh: what late-duplicate detection costs claims.  The same
# idem_claim scripts as the claims bench (claims_new_idem.sql,
# claims_dup_idem.sql), with idempotency.late_duplicate_window 0 (off: the
# baseline) against the default 30 days (on: the candidate), beside
# IDEM_BENCH_LATE_SUMMARIES summaries (default 3: two full buckets and the
# current one, the steady state; 16 is the most there can be) of 200 000
# keys each, made by real drops (bench_late_summaries).  Interleaved rounds
# in one run, without and with shared_preload_libraries = 'idempotency'
# (filters in backend memory, then in the shared area).  Cases: new keys,
# duplicate keys (which never check), a connection per claim (pgbench -C,
# new keys: without preload a connection reads only the blocks it tests
# until it has checked 64 times), idem_claim_many of 1000 new keys, and
# "cpu": the CPU time of one backend claiming 100 000 new keys in one
# statement (one by one, and with idem_claim_many in batches of 1000), window off and on alternately in the same session (the least
# noisy figure on a shared machine, read from /proc/self/stat; the ratio is
# time off / time on), and "lookup": the CPU time of idem_claimed_before()
# over a million fresh keys, window off and on (what the check itself costs
# a new key).
#
# Needs test/bench/run (it exports IDEM_DATA/IDEM_BINDIR for the restart).
# Settings: IDEM_BENCH_LATE_SUMMARIES, IDEM_BENCH_LATE_MODES (default
# "local preloaded"), IDEM_BENCH_LATE_CASES (the pgbench cases, default
# "new dup conn many"; empty: none; cpu is always measured); rounds, seconds and
# clients from lib.sh.
set -euo pipefail

dir=$(cd "$(dirname "$0")" && pwd)
. "$dir/lib.sh"

NSUM=${IDEM_BENCH_LATE_SUMMARIES:-3}
MODES=${IDEM_BENCH_LATE_MODES:-local preloaded}
DB=idem_bench_late
preloaded=0
cleanup() {
    local rc=$?
    set +e
    [[ $preloaded == 1 ]] && bench_restart shared_preload_libraries=pg_cron >/dev/null 2>&1
    psql -X -q -d postgres -c "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1
    return $rc
}
trap cleanup EXIT

psql -X -q -d postgres -c "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB" >/dev/null
export PGDATABASE=$DB
bench_claims_setup
bench_setup <<'SQL'
-- CPU time of this backend (user + system), in microseconds (clock ticks of 10 ms)
CREATE FUNCTION bench_cpu_us() RETURNS float8 LANGUAGE sql AS $$
    SELECT (f[12]::float8 + f[13]::float8) * 10000
      FROM regexp_split_to_array(split_part(pg_read_file('/proc/self/stat'), ') ', 2), ' ') f
$$;
-- CPU microseconds per call: n new claims, or n look-ups of fresh keys
CREATE FUNCTION bench_late_us(what text, n integer) RETURNS float8 LANGUAGE plpgsql AS $$
DECLARE
    t0 float8 := bench_cpu_us();
    base bigint := (random() * 1e15)::bigint;
BEGIN
    IF what = 'claim' THEN
        PERFORM idem_claim((base + g)::text) FROM generate_series(1, n) g;
    ELSIF what = 'many' THEN
        -- n keys in batches of 1000
        PERFORM (SELECT count(*) FROM idem_claim_many(ARRAY(SELECT (base + b * 1000 + g)::text
                                                             FROM generate_series(1, 1000) g)))
           FROM generate_series(0, n / 1000 - 1) b;
    ELSE
        PERFORM idem_claimed_before((base + g)::text) FROM generate_series(1, n) g;
    END IF;
    RETURN (bench_cpu_us() - t0) / n;
END
$$;
SQL
bench_late_summaries "$DB" "$NSUM" 200000
echo "late bench: $NSUM summaries ($(psql -X -At -c "SELECT sum(nkeys) || ' keys, ' || pg_size_pretty(sum(octet_length(bloom))::bigint) FROM idempotency.late_summaries")); $ROUNDS interleaved rounds of ${SECS}s, $CLIENTS clients, -M prepared, synchronous_commit=off"
# the summaries are checked: a key of a dropped partition is a late duplicate
[[ $(psql -X -At -c "SELECT idem_claimed_before('late-1-1', 'late') IS NOT NULL") == t ]] ||
    { echo "late bench: the summaries are not found" >&2; exit 1; }

off="-c idempotency.late_duplicate_window=0"
for mode in $MODES; do
    case $mode in
        local) if [[ $preloaded == 1 ]]; then bench_restart shared_preload_libraries=pg_cron; preloaded=0; fi ;;
        preloaded) bench_restart shared_preload_libraries=pg_cron,idempotency; preloaded=1 ;;
        *) echo "unknown mode '$mode' (local or preloaded)" >&2; exit 1 ;;
    esac
    # cpu: CPU microseconds per new claim (and per look-up of a fresh key
    # with idem_claimed_before), off and on alternately in one session
    for what in claim many lookup; do
        n=$([[ $what == lookup ]] && echo 1000000 || echo 100000)
        # off first in odd rounds, on first in even ones: claims pile up in
        # the current partition, so later runs cost a little more
        cpu=$(for r in $(seq "$ROUNDS"); do
            off_sql="SET idempotency.late_duplicate_window = 0; SELECT 'off', bench_late_us('$what', $n);"
            on_sql="RESET idempotency.late_duplicate_window; SELECT 'on', bench_late_us('$what', $n);"
            if ((r % 2)); then echo "$off_sql"; echo "$on_sql"; else echo "$on_sql"; echo "$off_sql"; fi
        done | psql -X -q -At -F ' ' -v ON_ERROR_STOP=1)
        read -r -a uoff <<<"$(awk '$1 == "off" { printf "%s ", $2 }' <<<"$cpu")"
        read -r -a uon <<<"$(awk '$1 == "on" { printf "%s ", $2 }' <<<"$cpu")"
        printf '  %s cpu us per %s: window off %s; window on %s\n' "$mode" "$what" "${uoff[*]}" "${uon[*]}"
        awk -v l="late ($mode, $NSUM summaries) cpu per $what, window on / off" \
            -v on="$(bench_median "${uon[@]}")" -v off="$(bench_median "${uoff[@]}")" \
            'BEGIN { printf "%s: window on %.3f us vs window off %.3f us = %.3fx (%+.3f us)\n", l, on, off, off / on, on - off }'
    done
    for case in ${IDEM_BENCH_LATE_CASES-new dup conn many}; do
        script=claims_${case/conn/new}_idem.sql
        extra=()
        [[ $case == conn ]] && extra=(-C)
        [[ $case == many ]] && script=scale_many_idem.sql extra=(-D lo=1000000000000 -D hi=9000000000000000000)
        plain() { PGOPTIONS="$off" bench_tps "$script" "${extra[@]}"; }
        idem() { bench_tps "$script" "${extra[@]}"; }
        bench_rounds "$mode $case keys" "window off" "window on"
        bench_ratio "late ($mode, $NSUM summaries) $case keys, window on / off" "window on" "${cand[@]}" -- "window off" "${base[@]}"
    done
done
