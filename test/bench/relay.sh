#!/usr/bin/env bash
# test/bench/relay.sh: idem-relay's throughput against the outbox drain
# alone, in one run on one server.
#
# bench-packages: redis-server redis-tools
#
# Each round loads IDEM_RELAY_BENCH_EVENTS events (default 50000) over 1000
# aggregates, then drains them, timed by the wall clock (events/s):
#   drain   the outbox alone: one pgbench client running
#           test/bench/outbox_relay_idem.sql (idem_outbox_claim(100), then
#           idem_outbox_ack of the batch): the database's side of a relay,
#           publishing nothing;
#   stdout  idem-relay --once --batch 100 --sink stdout > /dev/null;
#   redis   idem-relay --once --batch 100 --sink redis: one XADD per event,
#           each awaited, to a redis-server started here (127.0.0.1, a free
#           port, no persistence);
#   xadd    redis's own rate for the same calls: redis-benchmark, one
#           client, no pipelining, XADD of a 200-byte field.
# Ratios (medians of IDEM_BENCH_ROUNDS rounds, default 3): stdout / drain,
# redis / drain, and redis / xadd.  Run: test/bench/run relay.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
ROUNDS=${IDEM_BENCH_ROUNDS:-3}
EVENTS=${IDEM_RELAY_BENCH_EVENTS:-50000}
DB=idem_bench_relay

command -v idem-relay >/dev/null || { echo "idem-relay not on PATH (make install)" >&2; exit 1; }
psql -X -q -v ON_ERROR_STOP=1 -d postgres -c "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB"
export PGDATABASE=$DB
psql -X -q -v ON_ERROR_STOP=1 -c 'CREATE EXTENSION idempotency'

tmp=$(mktemp -d "${TMPDIR:-/tmp}/relay-bench.XXXXXX")
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --dir "$tmp" --save '' --appendonly no >"$tmp/redis.log" 2>&1 &
redis_pid=$!
trap 'kill "$redis_pid" 2>/dev/null; wait "$redis_pid" 2>/dev/null; rm -rf "$tmp"; psql -X -q -d postgres -c "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1' EXIT
for _ in $(seq 50); do redis-cli -p "$port" PING >/dev/null 2>&1 && break; sleep 0.1; done

load() {
    psql -X -q -v ON_ERROR_STOP=1 >/dev/null <<SQL
SELECT count(*) FROM generate_series(0, $EVENTS - 1, 500) b,
  LATERAL idem_outbox_emit_many('order', ARRAY(SELECT ((b + g) % 1000)::text FROM generate_series(0, 499) g),
                                array_fill('created'::text, ARRAY[500]),
                                array_fill('{"n": 1, "note": "a payload of some size, as events have"}'::jsonb, ARRAY[500]));
SQL
}

pending() { psql -X -At -c 'SELECT coalesce(sum(pending), 0) FROM idempotency.outbox_backlog'; }

# events/s of "$@" draining what load put there
timed() {
    local t0 t1
    load
    t0=$(date +%s.%N)
    "$@"
    t1=$(date +%s.%N)
    [[ $(pending) == 0 ]] || { echo "relay.sh: $* left $(pending) events" >&2; exit 1; }
    awk -v n="$EVENTS" -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f\n", n / (b - a) }'
}

drain() {
    pgbench -n -M prepared -c 1 -t $((EVENTS / 100 + 1)) -D batch=100 -D idle=0 -D sub=default \
        -f "$bench_dir/outbox_relay_idem.sql" >/dev/null
}
relay_stdout() { idem-relay --once --batch 100 >/dev/null 2>"$tmp/relay.err"; }
relay_redis() {
    idem-relay --once --batch 100 --sink redis --url "redis://127.0.0.1:$port" --target bench >/dev/null 2>"$tmp/relay.err"
    redis-cli -p "$port" DEL bench >/dev/null
}
xadd() {
    redis-benchmark -p "$port" -c 1 -P 1 -n "$EVENTS" -q XADD benchx '*' payload "$(head -c 200 /dev/zero | tr '\0' x)" |
        sed -n 's/.*: \([0-9.]*\) requests per second.*/\1/p' | head -n 1
    redis-cli -p "$port" DEL benchx >/dev/null
}

d=() s=() r=() x=()
for round in $(seq "$ROUNDS"); do
    d+=("$(timed drain)")
    s+=("$(timed relay_stdout)")
    r+=("$(timed relay_redis)")
    x+=("$(xadd)")
    echo "round $round: drain ${d[-1]} events/s, stdout ${s[-1]}, redis ${r[-1]}, redis-benchmark XADD ${x[-1]}"
done
bench_ratio "relay stdout" "idem-relay stdout" "${s[@]}" -- "drain alone" "${d[@]}"
bench_ratio "relay redis" "idem-relay redis" "${r[@]}" -- "drain alone" "${d[@]}"
bench_ratio "relay redis vs broker" "idem-relay redis" "${r[@]}" -- "redis-benchmark XADD" "${x[@]}"
