# test/bench/lib.sh: helpers shared by the benchmark scripts (sourced).
#
# Settings: IDEM_BENCH_ROUNDS (default 5), IDEM_BENCH_SECONDS per round
# (default 5), IDEM_BENCH_CLIENTS (default 2).
#
# bench_tps SCRIPT [PGBENCH_ARGS...]
#                         one pgbench round of test/bench/SCRIPT; prints its tps
#                         (-M prepared, synchronous_commit = off: the commit
#                         flush would hide CPU cost); extra arguments (e.g. -C,
#                         -D name=value) go to pgbench
# bench_median N...       median of the numbers
# bench_ratio LABEL CAND_NAME CAND_TPS... -- BASE_NAME BASE_TPS...
#                         prints "LABEL: CAND x tps vs BASE y tps = r.rrx" from
#                         the medians (test/bench/run collects these lines)
# bench_pair ROUND BASE_FN CAND_FN
#                         one round of a pair: runs the shell functions
#                         BASE_FN and CAND_FN (each prints a tps), the
#                         baseline first in odd rounds and second in even
#                         ones (going first or second costs a few %);
#                         sets b and c
# bench_rounds LABEL BASE_NAME CAND_NAME [BASE_FN CAND_FN]
#                         ROUNDS rounds of bench_pair over the shell
#                         functions BASE_FN and CAND_FN (default plain and
#                         idem), each round's tps printed as "LABEL round N:
#                         BASE_NAME x tps, CAND_NAME y tps"; leaves the tps
#                         in the arrays base and cand (for bench_ratio)
# bench_setup             runs the SQL on its standard input (quiet, stopping
#                         at the first error) after SET client_min_messages
#                         = warning and CREATE EXTENSION IF NOT EXISTS
#                         idempotency
# bench_claims_setup      the claims benches' tables: bench_plain, the
#                         hand-written (scope, key) baseline, and keys
#                         1..10000 claimed and inserted beforehand in both
#                         (the duplicates)
# bench_late_summaries DB N KEYS
#                         give DB (where the extension exists) N
#                         late-duplicate summaries of KEYS keys each, made
#                         by the extension's own drops in a scratch
#                         database (the clock moved with
#                         idempotency.debug_clock_offset), with last_drop
#                         now: all within the window
# bench_restart [NAME=VALUE...]
#                         ALTER SYSTEM SET each setting (NAME=  resets it; a
#                         VALUE with commas is a list: 'a', 'b'), then
#                         restart the server test/bench/run started (needs
#                         IDEM_DATA and IDEM_BINDIR, which it exports)

ROUNDS=${IDEM_BENCH_ROUNDS:-5}
SECS=${IDEM_BENCH_SECONDS:-5}
CLIENTS=${IDEM_BENCH_CLIENTS:-2}
bench_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

bench_tps() {
    local out script=$1
    shift
    out=$(PGOPTIONS="${PGOPTIONS:-} -c synchronous_commit=off" pgbench -n -M prepared \
        -c "$CLIENTS" -j "$CLIENTS" -T "$SECS" "$@" -f "$bench_dir/$script" 2>&1) ||
        { echo "$out" >&2; echo "pgbench failed on $script" >&2; return 1; }
    sed -n 's/^tps = \([0-9.]*\) .*/\1/p' <<<"$out" | head -n 1
}

bench_median() {
    printf '%s\n' "$@" | sort -g |
        awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

bench_ratio() {
    local label=$1 cname=$2 bname c=() b=()
    shift 2
    while [[ $1 != -- ]]; do c+=("$1"); shift; done
    shift
    bname=$1
    shift
    b=("$@")
    awk -v l="$label" -v cn="$cname" -v bn="$bname" \
        -v c="$(bench_median "${c[@]}")" -v b="$(bench_median "${b[@]}")" \
        'BEGIN { printf "%s: %s %.0f tps vs %s %.0f tps = %.2fx\n", l, cn, c, bn, b, c / b }'
}

bench_restart() {
    local kv name value
    [[ -n ${IDEM_DATA:-} && -n ${IDEM_BINDIR:-} ]] ||
        { echo "bench_restart: IDEM_DATA/IDEM_BINDIR not set (run through test/bench/run)" >&2; return 1; }
    for kv in "$@"; do
        name=${kv%%=*} value=${kv#*=}
        if [[ -z $value ]]; then
            psql -X -q -v ON_ERROR_STOP=1 -c "ALTER SYSTEM RESET $name" >/dev/null
        else
            # a comma-separated VALUE is a list: 'a', 'b'
            psql -X -q -v ON_ERROR_STOP=1 -c "ALTER SYSTEM SET $name = '${value//,/"', '"}'" >/dev/null
        fi
    done
    "$IDEM_BINDIR/pg_ctl" -D "$IDEM_DATA" ${IDEM_LOG:+-l "$IDEM_LOG"} -m fast -w -t 120 restart >/dev/null || {
        [[ -n ${IDEM_LOG:-} ]] && tail -n 20 "$IDEM_LOG" >&2
        echo "bench_restart: the server did not restart" >&2
        return 1
    }
}

bench_late_summaries() {
    local db=$1 n=$2 keys=$3 gen=idem_bench_late_gen i h rows
    rows=$(mktemp)
    psql -X -q -d postgres -c "DROP DATABASE IF EXISTS $gen" -c "CREATE DATABASE $gen" >/dev/null
    PGDATABASE=$gen bench_setup <<'SQL'
SELECT idem_configure(retention => '1 hour', partition_interval => '1 hour', premake => 1);
SQL
    for i in $(seq 1 "$n"); do
        h=$((4 * i))
        PGDATABASE=$gen bench_setup <<SQL
SET idempotency.debug_clock_offset = '${h}h';
SELECT count(*) FROM idem_maintain();
SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'late-$i-' || g FROM generate_series(1, $keys) g), 'late');
SQL
        for h in $((4 * i + 2)) $((4 * i + 3)); do
            PGDATABASE=$gen bench_setup <<<"SET idempotency.debug_clock_offset = '${h}h'; SELECT count(*) FROM idem_maintain();"
        done
        psql -X -q -At -d $gen -v ON_ERROR_STOP=1 -c "COPY (SELECT $i, expired_from, expired_to, now(), nkeys, capacity, bloom FROM idempotency.late_summaries) TO STDOUT" >>"$rows"
        psql -X -q -d $gen -v ON_ERROR_STOP=1 -c 'TRUNCATE idempotency.late_summaries' >/dev/null
    done
    psql -X -q -d postgres -c "DROP DATABASE $gen" >/dev/null
    [[ $(wc -l <"$rows") -eq $n ]] || { echo "bench_late_summaries: made $(wc -l <"$rows") summaries, not $n" >&2; return 1; }
    psql -X -q -d "$db" -v ON_ERROR_STOP=1 -c 'TRUNCATE idempotency.late_summaries' \
        -c "\\copy idempotency.late_summaries FROM '$rows'" >/dev/null
    rm -f "$rows"
}

bench_pair() {
    if (($1 % 2)); then
        b=$($2)
        c=$($3)
    else
        c=$($3)
        b=$($2)
    fi
}

bench_rounds() {
    local r
    base=() cand=()
    for r in $(seq "$ROUNDS"); do
        bench_pair "$r" "${4:-plain}" "${5:-idem}"
        base+=("$b") cand+=("$c")
        printf '  %s round %d: %s %.0f tps, %s %.0f tps\n' "$1" "$r" "$2" "$b" "$3" "$c"
    done
}

bench_setup() {
    { printf 'SET client_min_messages = warning;\nCREATE EXTENSION IF NOT EXISTS idempotency;\n'; cat; } |
        psql -X -q -v ON_ERROR_STOP=1 >/dev/null
}

bench_claims_setup() {
    bench_setup <<'SQL'
DROP TABLE IF EXISTS bench_plain;
CREATE TABLE bench_plain (
    scope      text,
    key        text,
    claimed_at timestamptz DEFAULT now(),
    PRIMARY KEY (scope, key)
);
SELECT count(*) FROM idem_claim_many(ARRAY(SELECT g::text FROM generate_series(1, 10000) g));
INSERT INTO bench_plain (scope, key)
SELECT 'default', g::text FROM generate_series(1, 10000) g ON CONFLICT DO NOTHING;
VACUUM ANALYZE;
CHECKPOINT;
SQL
}
