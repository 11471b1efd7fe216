#!/usr/bin/env bash
# test/bench/relay.sh: idem-relay's throughput through each sink against
# the outbox drain alone, in one run on one server, and against each
# broker's own publish rate (issue 24).
#
# bench-packages: nats-server rabbitmq-server redis-server redis-tools libnats-dev librabbitmq-dev libcurl4-openssl-dev libmicrohttpd-dev pkg-config
#
# Each round loads IDEM_RELAY_BENCH_EVENTS events (default 50000), then
# drains them, timed by the wall clock (events/s), once for each shape of
# IDEM_RELAY_BENCH_SHAPES (events per aggregate, default "30 1": the events
# over EVENTS/30 aggregates, so a claim of 100 holds about 3 runs of 30
# events; and one event per aggregate, as many aggregates as events, so a
# claim holds 100 runs of one, the common shape):
#   drain   the outbox alone: one pgbench client running
#           test/bench/outbox_relay_idem.sql (idem_outbox_claim(100), then
#           idem_outbox_ack of the batch): the database's side of a relay,
#           publishing nothing;
#   SINK    idem-relay --once --batch 100 --sink SINK, for stdout (to
#           /dev/null) and each sink compiled in whose broker is installed:
#           redis (XADD to a stream), nats (JetStream, a stream capturing
#           the subject), amqp (RabbitMQ, a durable queue by the default
#           exchange), http (POST to broker_publish serve; and http_c8:
#           --http-concurrency 8, a batch's POSTs in waves, 8 at once) and sql (INSERT
#           into a table of this database, on the sink's own connection;
#           one transaction per batch, and sql_event: --sql-commit event).
#           After each run the broker must hold exactly the events (XLEN,
#           stream and queue counts, POSTs counted, rows).
#   SINK_serial  the same with --prefetch 0 (claim, publish, ack in
#           series), for stdout, redis and nats: what the overlap of the
#           database and the sink gains, in the same run.
# The brokers, started here on 127.0.0.1 and free ports, in the temporary
# directory: redis-server (no persistence), nats-server -js (file store),
# rabbitmq-server (a private node, as test/tap/RelayTest.pm's rabbit_node),
# and the HTTP receiver.  Their own rates, one client, the same guarantee
# as the sink (each publish confirmed before the next), the body an event
# as the relay sends it: redis-benchmark XADD (no pipelining),
# broker_publish.c (built here) nats / amqp / http, pgbench of the sql
# sink's INSERT (one per transaction).  Beside them the pipelined rates
# (not what the relay does today, what its pipelining could reach):
# redis-benchmark -P 100, and nats / amqp publishing 100 at a time (the
# relay's batch) or all N, awaiting the acks after each window.
# The brokers' own rates do not depend on the shape: measured once a round.
# IDEM_RELAY_BENCH_BATCH (default 100) is the claim's batch of the drain and
# of every relay (--batch): a batch of 1000 holds ten times the aggregates'
# runs, so a wave of the nats and amqp sinks carries ten times the events.
# Ratios (medians of IDEM_BENCH_ROUNDS rounds, default 3), for each shape:
# each sink / the drain, each sink / its broker's rate, each sink / its
# broker's pipelined rate.  A broker not installed, or a sink not compiled in, is "skipped".
# Run: test/bench/run relay.
set -euo pipefail
shopt -s inherit_errexit
. "$(dirname "$0")/lib.sh"
ROUNDS=${IDEM_BENCH_ROUNDS:-3}
EVENTS=${IDEM_RELAY_BENCH_EVENTS:-50000}
BATCH=${IDEM_RELAY_BENCH_BATCH:-100}
read -r -a SHAPES <<<"${IDEM_RELAY_BENCH_SHAPES:-30 1}"
PER=${SHAPES[0]}	# the shape load makes: events per aggregate
DB=idem_bench_relay
# shellcheck disable=SC2016 # $1 and $2 are the sink's parameters
SQL_STMT='INSERT INTO bench_sink(id, ev) VALUES ($2::uuid, $1::jsonb)'

command -v idem-relay >/dev/null || { echo "idem-relay not on PATH (make install)" >&2; exit 1; }
psql -X -q -v ON_ERROR_STOP=1 -d postgres -c "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB"
export PGDATABASE=$DB
psql -X -q -v ON_ERROR_STOP=1 -c 'CREATE EXTENSION idempotency'
sinks=" $(idem-relay --help | sed -n 's/^Sinks compiled in: *//p') "

tmp=$(mktemp -d "${TMPDIR:-/tmp}/relay-bench.XXXXXX")
pids=()
rabbit_up=''
cleanup() {
    local p
    if [[ -n $rabbit_up ]]; then
        rabbit_env /usr/lib/rabbitmq/bin/rabbitmqctl shutdown >/dev/null 2>&1 || true
        rabbit_env epmd -port "$epmd_port" -kill >/dev/null 2>&1 || true
    fi
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$tmp"
    psql -X -q -d postgres -c "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1 || true
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# until "$@" succeeds, at most $1 seconds
wait_for() {
    local secs=$1
    shift
    for _ in $(seq $((secs * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
    return 1
}
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
has_sink() { [[ $sinks == *" $1 "* ]]; }
skip() { echo "skipped: $*"; }
# "$@" prints N; fail unless N is $expect
expect_count() {
    local expect=$1 got
    shift
    got=$("$@")
    [[ $got == "$expect" ]] || { echo "relay.sh: $* counted $got, not $expect" >&2; exit 1; }
}

# broker_publish.c, with the parts whose libraries pkg-config knows
bp=$tmp/broker_publish
bp_defs=() bp_libs=()
for lib in libnats:HAVE_NATS librabbitmq:HAVE_RABBITMQ libcurl:HAVE_CURL libmicrohttpd:HAVE_MHD; do
    if pkg-config --exists "${lib%%:*}" 2>/dev/null; then
        bp_defs+=("-D${lib#*:}") bp_libs+=("${lib%%:*}")
    fi
done
bp_werror=()
[[ ${CI:-} == true ]] && bp_werror=(-Werror)
# shellcheck disable=SC2046 # the flags are words
cc -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -O2 -Wall -Wextra "${bp_werror[@]}" -pthread \
    "${bp_defs[@]}" -o "$bp" "$bench_dir/broker_publish.c" \
    $( ((${#bp_libs[@]})) && pkg-config --cflags --libs "${bp_libs[@]}") ||
    { echo "relay.sh: cannot build broker_publish.c" >&2; exit 1; }
bp_has() { [[ " ${bp_defs[*]} " == *" -D$1 "* ]]; }

# n events (default EVENTS) over n / PER aggregates, each aggregate's
# events spread over the load
load() {
    local n=${1:-$EVENTS} aggs
    aggs=$((n / PER > 0 ? n / PER : 1))
    psql -X -q -v ON_ERROR_STOP=1 >/dev/null <<SQL
SELECT count(*) FROM generate_series(0, $n - 1, 500) b,
  LATERAL idem_outbox_emit_many('order', ARRAY(SELECT ((b + g) % $aggs)::text FROM generate_series(0, least(499, $n - 1 - b)) g),
                                array_fill('created'::text, ARRAY[least(500, $n - b)]),
                                array_fill('{"n": 1, "note": "a payload of some size, as events have"}'::jsonb, ARRAY[least(500, $n - b)]));
SQL
}

pending() { psql -X -At -c 'SELECT coalesce(sum(pending), 0) FROM idempotency.outbox_backlog'; }

# one event as the relay sends it: the body of the brokers' own publishes
load 1
idem-relay --once --batch 100 >"$tmp/event.json" 2>"$tmp/relay.err"
[[ $(pending) == 0 && $(wc -l <"$tmp/event.json") == 1 ]] ||
    { cat "$tmp/relay.err" >&2; echo "relay.sh: no sample event" >&2; exit 1; }

# events/s of run_NAME draining what load put there; then check_NAME, if
# there is one, checks what arrived
timed() {
    local t0 t1
    load
    t0=$(date +%s.%N)
    "run_$1"
    t1=$(date +%s.%N)
    [[ $(pending) == 0 ]] || { echo "relay.sh: $1 left $(pending) events" >&2; exit 1; }
    if declare -F "check_$1" >/dev/null; then "check_$1"; fi
    awk -v n="$EVENTS" -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f\n", n / (b - a) }'
}

relay() {
    idem-relay --once --batch "$BATCH" "$@" >/dev/null 2>"$tmp/relay.err" ||
        { cat "$tmp/relay.err" >&2; echo "relay.sh: idem-relay $* failed" >&2; exit 1; }
}

run_drain() {
    pgbench -n -M prepared -c 1 -t $((EVENTS / BATCH + 1)) -D batch="$BATCH" -D idle=0 -D sub=default \
        -f "$bench_dir/outbox_relay_idem.sql" >/dev/null
}
run_stdout() { relay; }
run_stdout_serial() { relay --prefetch 0; }

# --- redis
redis_port=''
if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then
    skip "redis: redis-server or redis-benchmark not installed"
elif ! has_sink redis; then
    skip "redis: the redis sink is not compiled in"
else
    redis_port=$(free_port)
    redis-server --port "$redis_port" --bind 127.0.0.1 --dir "$tmp" --save '' --appendonly no >"$tmp/redis.log" 2>&1 &
    pids+=($!)
    wait_for 10 redis-cli -p "$redis_port" PING || { echo "relay.sh: redis-server did not start" >&2; exit 1; }
fi
run_redis() { relay --sink redis --url "redis://127.0.0.1:$redis_port" --target bench "$@"; }
check_redis() {
    expect_count "$EVENTS" redis-cli -p "$redis_port" XLEN bench
    redis-cli -p "$redis_port" DEL bench >/dev/null
}
run_redis_serial() { run_redis --prefetch 0; }
check_redis_serial() { check_redis; }
# redis-benchmark XADD of an event-sized field, PIPE commands in flight
xadd() {
    redis-benchmark -p "$redis_port" -c 1 -P "$1" -n "$EVENTS" -q XADD benchx '*' payload "$(cat "$tmp/event.json")" |
        sed -n 's/.*: \([0-9.]*\) requests per second.*/\1/p' | head -n 1 | awk '{ printf "%.0f\n", $1 }'
    expect_count "$EVENTS" redis-cli -p "$redis_port" XLEN benchx
    redis-cli -p "$redis_port" DEL benchx >/dev/null
}

# --- nats
nats_url=''
if ! command -v nats-server >/dev/null; then
    skip "nats: nats-server not installed"
elif ! has_sink nats || ! bp_has HAVE_NATS; then
    skip "nats: the nats sink or libnats is not there"
else
    nats_port=$(free_port)
    nats_url=nats://127.0.0.1:$nats_port
    nats-server -js -a 127.0.0.1 -p "$nats_port" -sd "$tmp/js" -l "$tmp/nats.log" >"$tmp/nats.out" 2>&1 &
    pids+=($!)
    wait_for 20 port_open "$nats_port" || { echo "relay.sh: nats-server did not start" >&2; exit 1; }
    # the stream capturing the subject the relay publishes to
    "$bp" nats-stream "$nats_url" BENCH bench >/dev/null
fi
run_nats() { relay --sink nats --url "$nats_url" --target bench "$@"; }
check_nats() { expect_count "$EVENTS" "$bp" nats-stream "$nats_url" BENCH bench; }
run_nats_serial() { run_nats --prefetch 0; }
check_nats_serial() { check_nats; }
nats_rate() {
    "$bp" nats "$nats_url" bench "$EVENTS" "$@" <"$tmp/event.json"
    check_nats
}

# --- amqp
amqp_url=''
rabbit=/usr/lib/rabbitmq/bin/rabbitmq-server
if [[ ! -x $rabbit ]]; then
    skip "amqp: rabbitmq-server not installed"
elif ! has_sink amqp || ! bp_has HAVE_RABBITMQ; then
    skip "amqp: the amqp sink or librabbitmq is not there"
else
    # a private node: its own directory, node name, ports (epmd's too) on
    # 127.0.0.1, as test/tap/RelayTest.pm's rabbit_node
    amqp_port=$(free_port) dist_port=$(free_port) epmd_port=$(free_port)
    amqp_url=amqp://guest:guest@127.0.0.1:$amqp_port/
    mkdir "$tmp/rabbit"
    echo '[].' >"$tmp/rabbit/enabled_plugins"
    echo "listeners.tcp.default = 127.0.0.1:$amqp_port" >"$tmp/rabbit/rabbitmq.conf"
    rabbit_env() {
        env HOME="$tmp/rabbit" RABBITMQ_NODENAME="idembench$amqp_port@localhost" \
            RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT="$amqp_port" RABBITMQ_DIST_PORT="$dist_port" \
            ERL_EPMD_PORT="$epmd_port" ERL_EPMD_ADDRESS=127.0.0.1 \
            RABBITMQ_MNESIA_BASE="$tmp/rabbit/mnesia" RABBITMQ_LOG_BASE="$tmp/rabbit/log" \
            RABBITMQ_CONFIG_FILE="$tmp/rabbit/rabbitmq" RABBITMQ_ENABLED_PLUGINS_FILE="$tmp/rabbit/enabled_plugins" \
            RABBITMQ_PID_FILE="$tmp/rabbit/rabbit.pid" \
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS='-kernel inet_dist_use_interface {127,0,0,1}' "$@"
    }
    rabbit_env "$rabbit" >"$tmp/rabbit/rabbit.out" 2>&1 &
    pids+=($!)
    rabbit_up=1
    # up once the queue (durable, by the default exchange) is declared;
    # a node takes 10-30 s to start here
    wait_for 90 "$bp" amqp-queue "$amqp_url" bench ||
        { tail -n 20 "$tmp/rabbit/rabbit.out" >&2; echo "relay.sh: rabbitmq-server did not start" >&2; exit 1; }
fi
run_amqp() { relay --sink amqp --url "$amqp_url" --target bench; }
check_amqp() { expect_count "$EVENTS" "$bp" amqp-queue "$amqp_url" bench; }
amqp_rate() {
    "$bp" amqp "$amqp_url" bench "$EVENTS" "$@" <"$tmp/event.json"
    check_amqp
}

# --- http
http_url=''
if ! has_sink http || ! bp_has HAVE_CURL || ! bp_has HAVE_MHD; then
    skip "http: the http sink, libcurl or libmicrohttpd is not there"
else
    http_port=$(free_port)
    http_url=http://127.0.0.1:$http_port/events
    "$bp" serve "$http_port" &
    pids+=($!)
    wait_for 10 port_open "$http_port" || { echo "relay.sh: the HTTP receiver did not start" >&2; exit 1; }
fi
http_count() { python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$http_port/count').read().decode().strip())"; }
run_http() { relay --sink http --url "$http_url"; }
check_http() { expect_count "$EVENTS" http_count; }
run_http_c8() { relay --sink http --url "$http_url" --http-concurrency 8; }
check_http_c8() { check_http; }
http_rate() {
    "$bp" http "$http_url" "$EVENTS" <"$tmp/event.json"
    check_http
}

# --- sql
sql_on=''
if ! has_sink sql; then
    skip "sql: the sql sink is not compiled in (idem-relay --help)"
else
    sql_on=1
    psql -X -q -v ON_ERROR_STOP=1 -c 'CREATE TABLE bench_sink (id uuid PRIMARY KEY, ev jsonb NOT NULL)'
    # pgbench's form of the sink's statement: the event's id made here
    echo 'INSERT INTO bench_sink(id, ev) VALUES (gen_random_uuid(), :ev::jsonb);' >"$tmp/sql_insert.sql"
fi
run_sql() { relay --sink sql --sql "$SQL_STMT"; }
run_sql_event() { relay --sink sql --sql-commit event --sql "$SQL_STMT"; }
check_sql_event() { check_sql; }
check_sql() {
    expect_count "$EVENTS" psql -X -At -c 'SELECT count(*) FROM bench_sink'
    psql -X -q -c 'TRUNCATE bench_sink'
}
sql_rate() {
    pgbench -n -M prepared -c 1 -t "$EVENTS" -D ev="$(cat "$tmp/event.json")" -f "$tmp/sql_insert.sql" |
        sed -n 's/^tps = \([0-9.]*\) .*/\1/p' | head -n 1 | awk '{ printf "%.0f\n", $1 }'
    check_sql
}

# the figures of each round, by name: r_NAME is an array
names=()
record() {
    local name=$1 v
    shift
    v=$("$@")
    [[ -n $v ]] || { echo "relay.sh: no figure for $name" >&2; exit 1; }
    [[ " ${names[*]} " == *" $name "* ]] || { names+=("$name"); declare -g -a "r_$name=()"; }
    eval "r_$name+=(\"\$v\")"
    line+=" $name $v,"
}

# the sinks' runs of one round in the shape PER, the names suffixed _aPER
sink_round() {
    local a=_a$PER
    record "drain$a" timed drain
    record "stdout$a" timed stdout
    record "stdout_serial$a" timed stdout_serial
    if [[ -n $redis_port ]]; then
        record "redis$a" timed redis
        record "redis_serial$a" timed redis_serial
    fi
    if [[ -n $nats_url ]]; then
        record "nats$a" timed nats
        record "nats_serial$a" timed nats_serial
    fi
    [[ -n $amqp_url ]] && record "amqp$a" timed amqp
    if [[ -n $http_url ]]; then
        record "http$a" timed http
        record "http_c8$a" timed http_c8
    fi
    if [[ -n $sql_on ]]; then
        record "sql$a" timed sql
        record "sql_event$a" timed sql_event
    fi
    return 0
}

for round in $(seq "$ROUNDS"); do
    line=''
    for PER in "${SHAPES[@]}"; do sink_round; done
    if [[ -n $redis_port ]]; then
        record xadd xadd 1
        record xadd_p100 xadd 100
    fi
    if [[ -n $nats_url ]]; then
        record js_pub nats_rate
        record js_pub_w100 nats_rate 100
        record js_pub_all nats_rate "$EVENTS"
    fi
    if [[ -n $amqp_url ]]; then
        record amqp_pub amqp_rate
        record amqp_pub_w100 amqp_rate 100
        record amqp_pub_all amqp_rate "$EVENTS"
    fi
    [[ -n $http_url ]] && record http_post http_rate
    [[ -n $sql_on ]] && record sql_insert sql_rate
    echo "round $round (events/s; _aN: N events per aggregate):${line%,}"
done

# bench_ratio over the rounds' figures of CAND and BASE
ratio() {
    local label=$1 cname=$2 cand=$3 bname=$4 base=$5 c b
    c="r_${cand}[@]" b="r_${base}[@]"
    bench_ratio "$label" "$cname" "${!c}" -- "$bname" "${!b}"
}
has() { [[ " ${names[*]} " == *" $1 "* ]]; }
for PER in "${SHAPES[@]}"; do
    a=_a$PER w=" ($PER/aggregate)"
    ratio "relay stdout$w" "idem-relay stdout" "stdout$a" "drain alone" "drain$a"
    for s in redis nats amqp http http_c8 sql; do
        has "$s$a" && ratio "relay $s$w" "idem-relay $s" "$s$a" "drain alone" "drain$a"
    done
    ratio "relay stdout overlap vs serial$w" "idem-relay stdout" "stdout$a" "idem-relay stdout --prefetch 0" "stdout_serial$a"
    for s in redis nats; do
        has "$s$a" &&
            ratio "relay $s overlap vs serial$w" "idem-relay $s" "$s$a" "idem-relay $s --prefetch 0" "${s}_serial$a"
    done
    if has "redis$a"; then
        ratio "relay redis vs broker$w" "idem-relay redis" "redis$a" "redis-benchmark XADD" xadd
        ratio "relay redis vs broker pipelined$w" "idem-relay redis" "redis$a" "redis-benchmark XADD -P 100" xadd_p100
    fi
    if has "nats$a"; then
        ratio "relay nats vs broker$w" "idem-relay nats" "nats$a" "js publish, each ack awaited" js_pub
        ratio "relay nats vs broker pipelined$w" "idem-relay nats" "nats$a" "js publish async, acks per 100" js_pub_w100
        ratio "relay nats vs broker all async$w" "idem-relay nats" "nats$a" "js publish async, acks at the end" js_pub_all
    fi
    if has "amqp$a"; then
        ratio "relay amqp vs broker$w" "idem-relay amqp" "amqp$a" "amqp publish, each confirm awaited" amqp_pub
        ratio "relay amqp vs broker pipelined$w" "idem-relay amqp" "amqp$a" "amqp publish, confirms per 100" amqp_pub_w100
        ratio "relay amqp vs broker all async$w" "idem-relay amqp" "amqp$a" "amqp publish, confirms at the end" amqp_pub_all
    fi
    has "http$a" && ratio "relay http vs receiver$w" "idem-relay http" "http$a" "curl POST loop, keep-alive" http_post
    has "http_c8$a" &&
        ratio "relay http concurrency 8 vs 1$w" "idem-relay http --http-concurrency 8" "http_c8$a" "idem-relay http" "http$a"
    if has "sql$a"; then
        ratio "relay sql vs pgbench$w" "idem-relay sql" "sql$a" "pgbench INSERT, 1 per transaction" sql_insert
        ratio "relay sql batch vs event$w" "idem-relay sql" "sql$a" "idem-relay sql --sql-commit event" "sql_event$a"
    fi
done
