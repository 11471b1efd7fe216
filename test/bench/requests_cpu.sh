#!/usr/bin/env bash
# test/bench/requests_cpu.sh: the CPU one backend spends per transaction of
# each script of test/bench/requests.sh (new keys and replays, the
# extension's and the hand-written), for machines too busy for tps to mean
# much: tps counts the time a backend waits for a CPU, this counts the CPU
# it got (perf stat -e task-clock on the one pgbench backend, which starts
# a moment after pgbench: those few transactions' CPU is not counted).
# One client, -M prepared, synchronous_commit = off; IDEM_BENCH_ROUNDS
# interleaved repetitions of IDEM_BENCH_CPU_TX transactions (default 4000)
# each.  Prints every measure, then per case the medians and the ratio
# hand-written / extension (what tps would be if the backend's CPU were all
# that counted).  Needs perf (linux-perf); without it, says so and stops.
#
# Connection from PGHOST/PGPORT/PGDATABASE/PGUSER (test/bench/run sets them).
set -euo pipefail

dir=$(cd "$(dirname "$0")" && pwd)
. "$dir/lib.sh"
TX=${IDEM_BENCH_CPU_TX:-4000}

if ! command -v perf >/dev/null; then
    echo "requests_cpu: perf not found (Debian: linux-perf); nothing measured"
    exit 0
fi

# requests.sh's tables and keys, unless it made them already in this database
if [[ $(psql -XAtc "SELECT to_regclass('bench_requests') IS NULL") == t ]]; then
    sed -n "/^bench_setup <<'SQL'/,/^SQL\$/p" "$dir/requests.sh" | sed '1d;$d' | bench_setup
fi

# cpu SCRIPT: microseconds of backend CPU per transaction of test/bench/SCRIPT
cpu() {
    local pid='' pg
    PGOPTIONS="${PGOPTIONS:-} -c synchronous_commit=off" pgbench -n -M prepared -c 1 -t "$TX" -f "$dir/$1" >/dev/null 2>&1 &
    pg=$!
    while [[ -z $pid ]] && kill -0 "$pg" 2>/dev/null; do
        pid=$(psql -XAtc "SELECT pid FROM pg_stat_activity WHERE application_name = 'pgbench'")
    done
    if [[ -n $pid ]]; then
        perf stat -x, -e task-clock -p "$pid" 2>&1 >/dev/null |
            awk -F, -v tx="$TX" '/task-clock/ { printf "%.1f\n", $1 * 1000 / tx }'
    fi
    wait "$pg"
}

echo "requests_cpu bench: $ROUNDS interleaved rounds of $TX transactions per script, 1 client, backend CPU per transaction"
for case in new replay; do
    plain=() idem=()
    for r in $(seq 1 "$ROUNDS"); do
        p=$(cpu "requests_${case}_plain.sql")
        i=$(cpu "requests_${case}_idem.sql")
        echo "  $case round $r: hand-written ${p:-?} us, idem_request_* ${i:-?} us (load $(cut -d' ' -f1 /proc/loadavg))"
        [[ -n $p ]] && plain+=("$p")
        [[ -n $i ]] && idem+=("$i")
    done
    mp=$(bench_median "${plain[@]}")
    mi=$(bench_median "${idem[@]}")
    label=$([[ $case == new ]] && echo "new keys" || echo "replays")
    echo "requests CPU, $label: idem_request_* $mi us vs hand-written $mp us per transaction = $(awk -v a="$mp" -v b="$mi" 'BEGIN {printf "%.2f", a / b}')x"
done
