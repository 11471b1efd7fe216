#!/usr/bin/env bash
# test/bench/scale.sh: claims at realistic retained volumes, against a plain
# (scope, key) primary-key table holding the same rows, in the same run, with
# and without shared_preload_libraries = 'idempotency'.
#
# Shapes (each in its own database, built once, then benchmarked in both modes):
#   a  1 M claims in 8 daily partitions (retention 7 days)
#   b  30 daily partitions of IDEM_SCALE_CLAIMS_PER_PARTITION claims each
#      (default 1 050 000: > 1 M each, 31.5 M in all; retention 29 days)
#   c  3.6 M claims over 30 days in hourly partitions (721 live): idem_configure
#      refuses that shape; the refusal is printed and the shape its hint
#      recommends (same retention and claims, the hinted interval) is built.
#   d  IDEM_SCALE_D_SEALED (default 99) sealed hourly partitions of 20 000
#      claims each (retention that many hours, premake 1): the filter-group
#      shape, where a new key is ruled out by one test per group of 16
# Shapes a, c and d scale with b: their claim counts are multiplied by
# IDEM_SCALE_CLAIMS_PER_PARTITION / 1 050 000.
#
# How a shape is built (honestly, with the extension's own code): the
# extension is created with idempotency.debug_clock_offset set so that its
# clock is at the start of the history; then, partition after partition, the
# clock is moved into the partition's range, idem_maintain() runs (creating
# partitions, sealing the previous one: its real seal scan builds its Bloom
# filter), and the partition's claims are bulk-loaded with INSERT ... SELECT
# generate_series straight into the partition named by
# idempotency.partition_registry (claimed_at inside its range, scope
# 'default'); the same rows go into bench_plain in the same batches.  At the
# end the offset is 0 and idem_maintain() seals the last past partition.
# Keys are the decimal texts of 1000000001, 1000000002, ... (oldest first).
#
# Cases (each a ratio ours / baseline from the medians of interleaved
# rounds, pgbench -M prepared, synchronous_commit = off, 2 clients unless said):
#   1 new       idem_claim of a key from a huge range vs INSERT ON CONFLICT DO NOTHING
#   2 dup       a key of the current partition (claimed recently)
#   3 hot32     one key, 32 clients (a duplicate after the first claim)
#   4 conn      pgbench -C (a connection per transaction), new keys
#   5 first     latency of a new connection's first claim / insert, in ms
#               (pgbench -C, 1 client; connection set-up excluded), ours/baseline
#   6 memory    backend memory (sum of pg_backend_memory_contexts.total_bytes)
#               after one claim / insert in a fresh connection, MB
#   7 lag       new keys while maintenance lags: the pgbench sessions set
#               idempotency.debug_clock_offset past the newest premade partition
#   8 many-new / many-dup
#               idem_claim_many of 1000 keys vs INSERT ... SELECT FROM unnest(...)
#               ON CONFLICT DO NOTHING RETURNING key, new and duplicate keys
#  10 cpu       backend CPU per new key (perf stat -e task-clock on the one
#               backend, a statement claiming IDEM_SCALE_CPU_KEYS (default
#               20 000) new keys in one transaction, after a warm-up
#               statement in the same session; a PL/pgSQL loop runs one
#               statement per key or per 1000), ours against INSERT ON
#               CONFLICT DO NOTHING one row and 1000 rows at a time: idem_claim of new keys, the same while
#               maintenance lags (as case 7), idem_claim_many of 1000; for
#               machines too busy for tps to mean much.  Ratio: baseline
#               CPU / ours (higher is better, as for tps).  Needs perf.
#   9 late      new keys, ours with idempotency.late_duplicate_window at its
#               default (on) against ours with it 0 (off, the baseline here):
#               what late-duplicate detection costs beside 3 summaries of
#               200 000 keys each (bench_late_summaries, made after the
#               shape is built; every other case runs beside them too, with
#               the window on, as by default)
#
# Needs test/bench/run (it exports IDEM_DATA/IDEM_BINDIR for the restart).
# Settings: IDEM_SCALE_SHAPES (default "a b c d"), IDEM_SCALE_D_SEALED (default 99), IDEM_SCALE_CLAIMS_PER_PARTITION
# (default 1050000), IDEM_SCALE_MODES (default "local preloaded"),
# IDEM_SCALE_CASES (default "new dup hot32 conn first lag many-new many-dup late";
# "cpu" is not a default),
# memory is always measured), IDEM_SCALE_KEEP=1 keeps the shape databases; rounds, seconds and clients from
# lib.sh (IDEM_BENCH_ROUNDS, IDEM_BENCH_SECONDS, IDEM_BENCH_CLIENTS).
set -euo pipefail

dir=$(cd "$(dirname "$0")" && pwd)
. "$dir/lib.sh"

CPP=${IDEM_SCALE_CLAIMS_PER_PARTITION:-1050000}
SHAPES=${IDEM_SCALE_SHAPES:-a b c d}
D_SEALED=${IDEM_SCALE_D_SEALED:-99}
MODES=${IDEM_SCALE_MODES:-local preloaded}
KEY_BASE=1000000000
NEW_LO=1000000000000          # new keys: far above every loaded key
NEW_HI=9000000000000000000
DAY=86400

declare -A RES=() INFO=()
preloaded=0
cleanup() {
    local rc=$?
    set +e
    if [[ $preloaded == 1 ]]; then
        bench_restart shared_preload_libraries=pg_cron >/dev/null 2>&1
    fi
    if [[ -z ${IDEM_SCALE_KEEP:-} ]]; then
        for s in $SHAPES; do psql -X -q -d postgres -c "DROP DATABASE IF EXISTS idem_scale_$s" >/dev/null 2>&1; done
    fi
    return $rc
}
trap cleanup EXIT

q() { psql -X -q -At -v ON_ERROR_STOP=1 "$@"; }
# lag_offset DB: a clock offset (s) an hour past the newest partition, for case 7
lag_offset() { q -d "$1" -c "SELECT ceil(extract(epoch FROM max(upper) - now()))::bigint + 3600 FROM idempotency.partition_registry"; }
scaled() { awk -v n="$1" -v c="$CPP" 'BEGIN { v = int(n * c / 1050000 + 0.5); print (v < 1 ? 1 : v) }'; }

# ---------------------------------------------------------------- building

# refuse_hourly DB: try the hourly shape, print the refusal, set INFO[c_refusal]
# and INFO[c_interval] (the interval, in seconds, that its hint names)
refuse_hourly() {
    local db=$1 out
    out=$(q -d "$db" <<'SQL'
CREATE FUNCTION pg_temp.try_configure(r interval, i interval, OUT code text, OUT message text,
                                      OUT detail text, OUT hint text) AS $$
BEGIN
    PERFORM idem_configure(retention => r, partition_interval => i);
    code := '00000';
EXCEPTION WHEN others THEN
    GET STACKED DIAGNOSTICS code = RETURNED_SQLSTATE, message = MESSAGE_TEXT,
                            detail = PG_EXCEPTION_DETAIL, hint = PG_EXCEPTION_HINT;
END $$ LANGUAGE plpgsql;
SELECT code, message, detail, hint FROM pg_temp.try_configure('30 days', '1 hour');
SQL
)
    IFS='|' read -r st msg det hint <<<"$out"
    {
        echo "  shape c: idem_configure(retention => '30 days', partition_interval => '1 hour') (721 hourly partitions):"
        echo "    SQLSTATE $st: $msg"
        echo "    DETAIL: $det"
        echo "    HINT: $hint"
    } >&2
    [[ $st == 22023 ]] || { echo "shape c: expected SQLSTATE 22023, got $st" >&2; return 1; }
    INFO[c_refusal]="SQLSTATE $st: $msg; HINT: $hint"
    INFO[c_interval]=$(sed -n 's/.*at least \([0-9]*\) seconds.*/\1/p' <<<"$hint")
}

# build_shape NAME RETENTION_S INTERVAL_S PER_PARTITION SPAN_S [PREMAKE]
build_shape() {
    local name=$1 ret=$2 ivl=$3 per=$4 span=$5 db=idem_scale_$1
    local premake=${6:-} realnow t off line rel lo up from to g0=0 nparts=0 started=$SECONDS
    q -d postgres -c "SET client_min_messages = warning" -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" >/dev/null
    realnow=$(q -d "$db" -c "SELECT floor(extract(epoch FROM now()))::bigint")
    t=$((realnow - span))
    off=$((t + 2 - $(date +%s)))
    q -d "$db" >/dev/null <<SQL
SET client_min_messages = warning;
SET idempotency.debug_clock_offset = $off;
CREATE EXTENSION idempotency;
CREATE TABLE bench_plain (scope text, key text, claimed_at timestamptz DEFAULT now(),
                          PRIMARY KEY (scope, key));
SQL
    if [[ $name == c ]]; then
        refuse_hourly "$db"
        ivl=${INFO[c_interval]}
        [[ -n $ivl ]] || { echo "shape c: no interval in the hint" >&2; return 1; }
        per=$(awk -v n="$(scaled 3600000)" -v i="$ivl" -v r="$ret" 'BEGIN { printf "%d", n * i / r + 0.5 }')
    fi
    q -d "$db" >/dev/null <<SQL
SET idempotency.debug_clock_offset = $off;
SELECT idem_configure(retention => make_interval(secs => $ret), partition_interval => make_interval(secs => $ivl),
                      premake => ${premake:-NULL});
SQL
    while ((t < realnow)); do
        off=$((t + 2 - $(date +%s)))
        line=$(q -d "$db" <<SQL
SET idempotency.debug_clock_offset = $off;
\o /dev/null
SELECT * FROM idem_maintain();
\o
SELECT relid::regclass, extract(epoch FROM lower)::bigint, extract(epoch FROM upper)::bigint
FROM idempotency.partition_registry
WHERE NOT sealed AND lower <= to_timestamp($t + 2) AND to_timestamp($t + 2) < upper
ORDER BY lower DESC LIMIT 1;
SQL
)
        IFS='|' read -r rel lo up <<<"$line"
        [[ -n $rel && $up -gt $t ]] || { echo "shape $name: no partition covers $(date -u -d @"$t")" >&2; return 1; }
        from=$((lo > t ? lo : t))
        to=$((up < realnow ? up : realnow))
        q -d "$db" >/dev/null <<SQL
SET synchronous_commit = off;
BEGIN;
INSERT INTO $rel (scope, key, claimed_at)
SELECT 'default', ($KEY_BASE + g)::text, to_timestamp($from + ($to - $from) * (g - $g0 - 0.5) / $per)
FROM generate_series($g0 + 1, $g0 + $per) g;
INSERT INTO bench_plain (scope, key, claimed_at)
SELECT 'default', ($KEY_BASE + g)::text, to_timestamp($from + ($to - $from) * (g - $g0 - 0.5) / $per)
FROM generate_series($g0 + 1, $g0 + $per) g;
COMMIT;
SQL
        INFO[${name}_dup_lo]=$((KEY_BASE + g0 + 1))
        g0=$((g0 + per))
        INFO[${name}_dup_hi]=$((KEY_BASE + g0))
        nparts=$((nparts + 1))
        t=$up
    done
    q -d "$db" >/dev/null <<'SQL'
SET idempotency.debug_clock_offset = 0;
SELECT * FROM idem_maintain();
SET maintenance_work_mem = '1GB';
VACUUM (ANALYZE);
CHECKPOINT;
SQL
    INFO[${name}_lag]=$(lag_offset "$db")
    INFO[${name}_desc]=$(q -d "$db" <<SQL
SELECT format('%s claims (%s in bench_plain) in %s partitions holding claims, %s per partition; '
              '%s sealed with a Bloom filter, %s live in all (%s); claims %s, bench_plain %s',
              (SELECT count(*) FROM idempotency.claims), (SELECT count(*) FROM bench_plain),
              $nparts, $per,
              count(*) FILTER (WHERE state = 'sealed' AND has_bloom_filter),
              count(*) FILTER (WHERE state <> 'expired'),
              string_agg(DISTINCT state, '/'),
              pg_size_pretty(sum(bytes)), pg_size_pretty(pg_total_relation_size('bench_plain')))
FROM idempotency.partitions WHERE store = 'claims';
SQL
)
    INFO[${name}_groups]=$(q -d "$db" -c "SELECT format('%s groups, %s members, %s keys', count(*), sum(cardinality(members)), sum(nkeys)) FROM idempotency.filter_groups")
    echo "  shape $name built in $((SECONDS - started)) s: ${INFO[${name}_desc]}"
}

# ---------------------------------------------------------------- measuring

# first_ms SCRIPT ARGS...: mean latency (ms) of transactions that are each the
# first of a new connection (pgbench -C; -P makes pgbench measure latencies,
# which exclude the connection set-up)
first_ms() {
    local script=$1 out
    shift
    out=$(PGOPTIONS="-c synchronous_commit=off" pgbench -n -M prepared -C -c 1 -j 1 -T "$SECS" \
        -P 100000 "$@" -f "$bench_dir/$script" 2>&1) ||
        { echo "$out" >&2; echo "pgbench failed on $script" >&2; return 1; }
    sed -n 's/^latency average = \([0-9.]*\) ms.*/\1/p' <<<"$out" | head -n 1
}

# memory DB: "ours_bytes base_bytes filter_status" after one claim / insert in fresh connections
memory() {
    local db=$1 ours base fs k
    k="mem-$RANDOM$RANDOM"
    ours=$(q -d "$db" -c "SELECT idem_claim('$k')" \
        -c "SELECT sum(total_bytes) FROM pg_backend_memory_contexts" \
        -c "SELECT format('%s %s %s %s', mode, used_bytes, filters, refused) FROM idempotency.filter_status()")
    base=$(q -d "$db" -c "INSERT INTO bench_plain (scope, key) VALUES ('default', '$k') ON CONFLICT DO NOTHING" \
        -c "SELECT sum(total_bytes) FROM pg_backend_memory_contexts")
    echo "$(sed -n 2p <<<"$ours") $base $(sed -n 3p <<<"$ours")"
}

# key_cpu DB N KIND [PGOPTIONS]: microseconds of backend CPU per key of one
# statement claiming (or inserting) N new keys (KIND: claim, many, insert,
# insert-many), measured by perf stat on the session's backend after a
# warm-up statement of 1000 keys in the same session
key_cpu() {
    local db=$1 n=$2 kind=$3 opts=${4:-} pidf pid ps pf out base sql warm
    base=$((NEW_LO + (RANDOM * 32768 + RANDOM) * 100000))
    cpu_sql() {
        case $kind in
            claim) echo "DO \$\$ BEGIN FOR g IN 1..$1 LOOP PERFORM idem_claim(($2 + g)::text); END LOOP; END \$\$" ;;
            many) echo "DO \$\$ BEGIN FOR b IN 0..$1 / 1000 - 1 LOOP PERFORM count(*) FROM idem_claim_many(ARRAY(SELECT ($2 + b * 1000 + g)::text FROM generate_series(0, 999) g)); END LOOP; END \$\$" ;;
            insert) echo "DO \$\$ BEGIN FOR g IN 1..$1 LOOP INSERT INTO bench_plain (scope, key) VALUES ('default', ($2 + g)::text) ON CONFLICT DO NOTHING; END LOOP; END \$\$" ;;
            insert-many) echo "DO \$\$ BEGIN FOR b IN 0..$1 / 1000 - 1 LOOP INSERT INTO bench_plain (scope, key) SELECT 'default', k FROM unnest(ARRAY(SELECT ($2 + b * 1000 + g)::text FROM generate_series(0, 999) g)) k ON CONFLICT DO NOTHING; END LOOP; END \$\$" ;;
        esac
    }
    sql=$(cpu_sql "$n" "$base")
    warm=$(cpu_sql 1000 $((base + n + 1000)))
    pidf=$(mktemp)
    out=$(mktemp)
    PGOPTIONS="-c synchronous_commit=off $opts" psql -X -q -At -d "$db" -v ON_ERROR_STOP=1 >/dev/null <<SQL &
\o $pidf
SELECT pg_backend_pid();
\o /dev/null
BEGIN; $warm; COMMIT;
SELECT pg_sleep(0.5);
BEGIN; $sql; COMMIT;
SQL
    ps=$!
    while [[ ! -s $pidf ]] && kill -0 "$ps" 2>/dev/null; do sleep 0.05; done
    pid=$(cat "$pidf")
    sleep 0.25
    perf stat -x, -e task-clock -p "$pid" -o "$out" 2>/dev/null &
    pf=$!
    wait "$ps"
    kill -INT "$pf" 2>/dev/null
    wait "$pf" 2>/dev/null
    awk -F, -v n="$n" '/task-clock/ { printf "%.2f\n", $1 * 1000 / n }' "$out"
    rm -f "$pidf" "$out"
}
CPU_KEYS=${IDEM_SCALE_CPU_KEYS:-20000}

read -r -a CASES <<<"${IDEM_SCALE_CASES:-new dup hot32 conn first lag many-new many-dup late}"

bench_shape() {
    local name=$1 mode=$2 db=idem_scale_$1 r c b i
    local dlo=${INFO[${name}_dup_lo]} dhi=${INFO[${name}_dup_hi]} mhi
    mhi=$((dhi - 999 > dlo ? dhi - 999 : dlo))
    declare -A O=() B=() CO=() CB=()
    local -a mem
    read -r -a mem <<<"$(memory "$db")"
    RES[$name,$mode,memory]=$(awk -v o="${mem[0]}" -v b="${mem[1]}" \
        'BEGIN { printf "%.1f / %.1f (+%.1f)", o / 1048576, b / 1048576, (o - b) / 1048576 }')
    RES[$name,$mode,filters]="${mem[2]}: ${mem[4]} filters, $(awk -v u="${mem[3]}" 'BEGIN { printf "%.1f MB", u / 1048576 }') used, ${mem[5]} refused"
    printf '  shape %s, %s: backend memory after one claim %s MB vs after one insert; filters %s\n' \
        "$name" "$mode" "${RES[$name,$mode,memory]%% (*}" "${RES[$name,$mode,filters]}"
    for r in $(seq "$ROUNDS"); do
        # no job runs maintenance in the shape's database: run it as one
        # would, so that a round after an hour boundary (shape d) does not
        # find the past partition still open (two probes for a new key);
        # it may premake one more partition, which case 7's clock must pass
        q -d "$db" -c "SELECT count(*) FROM idem_maintain()" >/dev/null
        INFO[${name}_lag]=$(lag_offset "$db")
        for c in "${CASES[@]}"; do
            case $c in
                new)   b=$(PGDATABASE=$db bench_tps scale_claim_plain.sql -D lo=$NEW_LO -D hi=$NEW_HI)
                       i=$(PGDATABASE=$db bench_tps scale_claim_idem.sql -D lo=$NEW_LO -D hi=$NEW_HI) ;;
                dup)   b=$(PGDATABASE=$db bench_tps scale_claim_plain.sql -D lo="$dlo" -D hi="$dhi")
                       i=$(PGDATABASE=$db bench_tps scale_claim_idem.sql -D lo="$dlo" -D hi="$dhi") ;;
                hot32) b=$(PGDATABASE=$db CLIENTS=32 bench_tps scale_claim_plain.sql -D lo=1 -D hi=1)
                       i=$(PGDATABASE=$db CLIENTS=32 bench_tps scale_claim_idem.sql -D lo=1 -D hi=1) ;;
                conn)  b=$(PGDATABASE=$db bench_tps scale_claim_plain.sql -C -D lo=$NEW_LO -D hi=$NEW_HI)
                       i=$(PGDATABASE=$db bench_tps scale_claim_idem.sql -C -D lo=$NEW_LO -D hi=$NEW_HI) ;;
                first) b=$(PGDATABASE=$db first_ms scale_claim_plain.sql -D lo=$NEW_LO -D hi=$NEW_HI)
                       i=$(PGDATABASE=$db first_ms scale_claim_idem.sql -D lo=$NEW_LO -D hi=$NEW_HI) ;;
                lag)   b=$(PGDATABASE=$db bench_tps scale_claim_plain.sql -D lo=$NEW_LO -D hi=$NEW_HI)
                       i=$(PGDATABASE=$db PGOPTIONS="-c idempotency.debug_clock_offset=${INFO[${name}_lag]}" \
                           bench_tps scale_claim_idem.sql -D lo=$NEW_LO -D hi=$NEW_HI) ;;
                many-new) b=$(PGDATABASE=$db bench_tps scale_many_plain.sql -D lo=$NEW_LO -D hi=$NEW_HI)
                          i=$(PGDATABASE=$db bench_tps scale_many_idem.sql -D lo=$NEW_LO -D hi=$NEW_HI) ;;
                many-dup) b=$(PGDATABASE=$db bench_tps scale_many_plain.sql -D lo="$dlo" -D hi="$mhi")
                          i=$(PGDATABASE=$db bench_tps scale_many_idem.sql -D lo="$dlo" -D hi="$mhi") ;;
                cpu)   if ! command -v perf >/dev/null; then
                           echo "  cpu: perf not found (Debian: linux-perf); not measured" >&2
                           continue
                       fi
                       CB[claim]+="$(key_cpu "$db" "$CPU_KEYS" insert) "
                       CO[claim]+="$(key_cpu "$db" "$CPU_KEYS" claim) "
                       CB[lag]+="$(key_cpu "$db" "$CPU_KEYS" insert) "
                       CO[lag]+="$(key_cpu "$db" "$CPU_KEYS" claim "-c idempotency.debug_clock_offset=${INFO[${name}_lag]}") "
                       CB[many]+="$(key_cpu "$db" "$CPU_KEYS" insert-many) "
                       CO[many]+="$(key_cpu "$db" "$CPU_KEYS" many) "
                       continue ;;
                late)  b=$(PGDATABASE=$db PGOPTIONS="-c idempotency.late_duplicate_window=0" \
                           bench_tps scale_claim_idem.sql -D lo=$NEW_LO -D hi=$NEW_HI)
                       i=$(PGDATABASE=$db bench_tps scale_claim_idem.sql -D lo=$NEW_LO -D hi=$NEW_HI) ;;
            esac
            B[$c]+="$b " O[$c]+="$i "
        done
        printf '  shape %s, %s, round %d:' "$name" "$mode" "$r"
        for c in "${!CO[@]}"; do
            local co=(${CO[$c]}) cb=(${CB[$c]})
            printf ' cpu-%s %s/%s us' "$c" "${co[-1]}" "${cb[-1]}"
        done
        for c in "${CASES[@]}"; do
            [[ $c == cpu ]] && continue
            local ob=(${O[$c]}) bb=(${B[$c]})
            printf ' %s %.0f/%.0f' "$c" "${ob[-1]}" "${bb[-1]}"
        done
        echo
    done
    for c in claim lag many; do
        [[ -n ${CO[$c]:-} ]] || continue
        local cm bm
        cm=$(bench_median ${CO[$c]})
        bm=$(bench_median ${CB[$c]})
        awk -v l="scale ($name, $mode) cpu $c" -v o="$cm" -v b="$bm" \
            'BEGIN { printf "%s: ours %.2f us vs baseline %.2f us of backend CPU per key = %.2fx\n", l, o, b, b / o }'
        RES[$name,$mode,cpu-$c]=$(awk -v o="$cm" -v b="$bm" 'BEGIN { printf "**%.2fx** (%.2f / %.2f)", b / o, o, b }')
    done
    for c in "${CASES[@]}"; do
        [[ $c == cpu ]] && continue
        local om bm
        om=$(bench_median ${O[$c]})
        bm=$(bench_median ${B[$c]})
        if [[ $c == first ]]; then
            awk -v l="scale ($name, $mode) first claim of a new connection, latency ours/baseline (higher is slower)" \
                -v o="$om" -v b="$bm" 'BEGIN { printf "%s: idem_claim %.2f ms vs INSERT %.2f ms = %.2fx\n", l, o, b, o / b }'
            RES[$name,$mode,$c]=$(awk -v o="$om" -v b="$bm" 'BEGIN { printf "%.2f / %.2f ms", o, b }')
        else
            bench_ratio "scale ($name, $mode) $c" ours ${O[$c]} -- baseline ${B[$c]}
            RES[$name,$mode,$c]=$(awk -v o="$om" -v b="$bm" \
                'BEGIN { printf "**%.2fx** (%.0f / %.0f)", o / b, o, b }')
        fi
    done
}

# ---------------------------------------------------------------- main

echo "scale bench: shapes '$SHAPES', modes '$MODES'; $ROUNDS interleaved rounds of ${SECS}s per case, $CLIENTS clients (32 for hot32), -M prepared, synchronous_commit=off"
nshapes=$(wc -w <<<"$SHAPES") nmodes=$(wc -w <<<"$MODES")
echo "expect about $((nshapes * nmodes * ${#CASES[@]} * 2 * ROUNDS * (SECS + 1) / 60)) min of pgbench rounds after the build"
echo "building shapes (claims per partition of shape b: $CPP)"
for s in $SHAPES; do
    case $s in
        a) build_shape a $((7 * DAY)) $DAY "$(scaled 125000)" $((7 * DAY)) ;;
        b) build_shape b $((29 * DAY)) $DAY "$CPP" $((29 * DAY)) ;;
        c) build_shape c $((30 * DAY)) 3600 0 $((30 * DAY)) ;;
        d) build_shape d $((D_SEALED * 3600)) 3600 "$(scaled 20000)" $((D_SEALED * 3600)) 1 ;;
        *) echo "unknown shape '$s' (a, b, c or d)" >&2; exit 1 ;;
    esac
    bench_late_summaries "idem_scale_$s" 3 200000
done

for mode in $MODES; do
    case $mode in
        local)
            if [[ $preloaded == 1 ]]; then bench_restart shared_preload_libraries=pg_cron; preloaded=0; fi ;;
        preloaded)
            bench_restart shared_preload_libraries=pg_cron,idempotency
            preloaded=1 ;;
        *) echo "unknown mode '$mode' (local or preloaded)" >&2; exit 1 ;;
    esac
    echo "mode $mode: shared_preload_libraries = '$(q -c 'SHOW shared_preload_libraries')'"
    # the first connection to a database after a restart rebuilds the
    # relcache init file (and uses more memory): not what case 6 measures
    for s in $SHAPES; do q -d "idem_scale_$s" -c 'SELECT count(*) FROM idempotency.partitions' >/dev/null; done
    for s in $SHAPES; do bench_shape "$s" "$mode"; done
done

echo
echo "### Scale: ours / plain table with the same rows (ratio of median tps, ours / baseline tps)"
echo
for s in $SHAPES; do
    case $s in
        a) echo "- (a) 1 M claims shape, 8 daily partitions: ${INFO[a_desc]}" ;;
        b) echo "- (b) 30 daily partitions: ${INFO[b_desc]}" ;;
        c) echo "- (c) hourly, 30 days: refused (${INFO[c_refusal]}); built instead with partition_interval ${INFO[c_interval]} s: ${INFO[c_desc]}" ;;
        d) echo "- (d) $D_SEALED sealed hourly partitions: ${INFO[d_desc]}; filter groups: ${INFO[d_groups]}" ;;
    esac
done
echo
echo "| shape | mode | 1 new | 2 dup | 3 hot key, 32 clients | 4 connect per txn | 5 first claim ms (ours / base) | 6 backend MB (ours / base) | 7 lagging maintenance | 8 many new | 8 many dup | 9 late check on / off | 10 CPU per key, new (us ours / base) | 10 lagging | 10 many new | filters (filter_status after 1 claim; shared: all databases) |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for s in $SHAPES; do
    for mode in $MODES; do
        printf '| %s | %s |' "$s" "$mode"
        for c in new dup hot32 conn first memory lag many-new many-dup late cpu-claim cpu-lag cpu-many filters; do
            printf ' %s |' "${RES[$s,$mode,$c]:--}"
        done
        echo
    done
done
