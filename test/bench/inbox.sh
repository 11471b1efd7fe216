#!/usr/bin/env bash
# test/bench/inbox.sh: idem_inbox_receive against the hand-written
# equivalent, a claim of the message id (idem_claim in scope inbox:<source>,
# with the payload) and an INSERT of the message into a plain table, in one
# statement:
#   INSERT INTO bench_inbox_plain (source, message_id, payload, headers)
#   SELECT ... WHERE idem_claim(:k, 'inbox:bench', payload)
# bench_inbox_plain (id uuid DEFAULT gen_random_uuid() PRIMARY KEY, source,
# message_id, ordering_key, seq, payload, headers, received_at DEFAULT now()).
# Cases: new message ids (drawn from a huge range), duplicates (ids
# 1..10000, received / claimed and stored beforehand), and new messages with
# an ordering key (one of 1000; the baseline upserts a per-key counter like
# receive does).  Rounds are interleaved in one run, the baseline first in
# odd rounds and second in even ones (bench_pair); pgbench -M prepared, synchronous_commit = off (the commit flush would
# hide CPU cost).  Prints per-round tps, then per case the median tps of
# both and the ratio candidate / baseline (target >= 1.0x).
#
# Connection from PGHOST/PGPORT/PGDATABASE/PGUSER (test/bench/run sets them).
# Settings: IDEM_BENCH_ROUNDS (default 5), IDEM_BENCH_SECONDS per round
# (default 5), IDEM_BENCH_CLIENTS (default 2), IDEM_INBOX_CASES (default
# "new dup key").
set -euo pipefail

dir=$(cd "$(dirname "$0")" && pwd)
. "$dir/lib.sh"

CASES=${IDEM_INBOX_CASES:-new dup key}

bench_setup <<'SQL'
DROP TABLE IF EXISTS bench_inbox_plain, bench_inbox_seq;
CREATE TABLE bench_inbox_plain (
    id           uuid DEFAULT gen_random_uuid() PRIMARY KEY,
    source       text NOT NULL,
    message_id   text NOT NULL,
    ordering_key text,
    seq          bigint,
    payload      jsonb NOT NULL,
    headers      jsonb NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE bench_inbox_seq (ordering_key text PRIMARY KEY, last_seq bigint NOT NULL);
-- the duplicates: ids 1..10000 exist on both sides
SELECT count(*) FILTER (WHERE idem_inbox_receive('bench', g::text, '{"n": 1}'))
  FROM generate_series(1, 10000) g;
INSERT INTO bench_inbox_plain (source, message_id, payload, headers)
SELECT 'plain', g::text, '{"n": 1}', '{}' FROM generate_series(1, 10000) g
 WHERE idem_claim(g::text, 'inbox:plain', '{"n": 1}');
VACUUM ANALYZE;
CHECKPOINT;
SQL

echo "inbox bench: $ROUNDS interleaved rounds of ${SECS}s per method and case, $CLIENTS clients, -M prepared, synchronous_commit=off"
for case in $CASES; do
    # the baseline's claims scope, passed as a variable (pgbench would take
    # the colon in a literal 'inbox:...' for one)
    scope=inbox:plain
    [[ $case == new ]] && scope=inbox:bench
    plain() { bench_tps "inbox_${case}_plain.sql" -D scope="$scope"; }
    idem() { bench_tps "inbox_${case}_idem.sql"; }
    bench_rounds "$case" "idem_claim + INSERT" idem_inbox_receive
    case $case in
        new) label="new messages" ;;
        dup) label="duplicate messages" ;;
        key) label="new messages with an ordering key" ;;
    esac
    bench_ratio "inbox $label" idem_inbox_receive "${cand[@]}" -- "idem_claim + INSERT" "${base[@]}"
done
