#!/usr/bin/env bash
# test/bench/classes.sh: what retention per scope costs a claim (issue 25).
#
# New keys claimed with idem_claim, against the hand-written dedup insert
# (INSERT ... ON CONFLICT DO NOTHING on a plain table), in three databases
# of one shape (1-hour partitions, 2 days, premake 1):
#   one     the default retention class alone;
#   three   two more classes, for other scopes (idem_configure_scope of
#           'hooks-*' 14 days and 'internal' 3 hours): a claim of the
#           default scope also probes each class's current partition;
#   scope   the same three classes, claims of scope 'hooks-stripe' (its
#           own class).
# Interleaved rounds; prints each against the baseline, and three against one.
#
# Connection from PGHOST/PGPORT/PGDATABASE/PGUSER (test/bench/run sets them).
# Settings: those of lib.sh.
set -euo pipefail

dir=$(cd "$(dirname "$0")" && pwd)
. "$dir/lib.sh"

shape="SELECT idem_configure(retention => '2 days', partition_interval => '1 hour', premake => 1);"
bench_setup <<SQL
$shape
SQL
bench_claims_setup
for db in idem_bench_classes; do
    psql -X -q -v ON_ERROR_STOP=1 -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" >/dev/null
done
PGDATABASE=idem_bench_classes bench_setup <<SQL
$shape
SELECT idem_configure_scope('hooks-*', '14 days');
SELECT idem_configure_scope('internal', '3 hours');
SQL
PGDATABASE=idem_bench_classes bench_claims_setup
classes=$(PGDATABASE=idem_bench_classes psql -X -At -c \
    "SELECT count(DISTINCT coalesce(retention, '0')) FROM idempotency.partition_registry WHERE NOT sealed")
echo "classes bench: $ROUNDS interleaved rounds of ${SECS}s, $CLIENTS clients; $classes classes in the second database"
plain=() one=() three=() scope=()
for r in $(seq "$ROUNDS"); do
    p=$(bench_tps claims_new_plain.sql)
    a=$(bench_tps claims_new_idem.sql)
    b=$(PGDATABASE=idem_bench_classes bench_tps claims_new_idem.sql)
    c=$(PGDATABASE=idem_bench_classes bench_tps classes_scope_idem.sql)
    plain+=("$p") one+=("$a") three+=("$b") scope+=("$c")
    printf '  round %d: plain %.0f, one class %.0f, three classes %.0f, own class %.0f tps\n' \
        "$r" "$p" "$a" "$b" "$c"
done
bench_ratio "classes new keys, default class alone" "idem_claim" "${one[@]}" -- "INSERT ON CONFLICT" "${plain[@]}"
bench_ratio "classes new keys, beside 2 more classes" "idem_claim" "${three[@]}" -- "INSERT ON CONFLICT" "${plain[@]}"
bench_ratio "classes new keys, a scope's own class" "idem_claim" "${scope[@]}" -- "INSERT ON CONFLICT" "${plain[@]}"
bench_ratio "classes three against one" "three classes" "${three[@]}" -- "one class" "${one[@]}"
psql -X -q -c 'DROP DATABASE idem_bench_classes' >/dev/null
