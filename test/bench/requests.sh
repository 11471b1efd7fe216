#!/usr/bin/env bash
# test/bench/requests.sh: a request's begin + complete against the
# hand-written baseline on a plain (scope, key) primary-key table:
#   INSERT INTO bench_requests ... ON CONFLICT DO NOTHING   (begin)
#   UPDATE bench_requests SET status = 'completed', response = ... (complete)
# each statement its own transaction, as an API handler runs them (the
# effect happens between).  Two cases: new keys (drawn from a huge range),
# and replays (keys 1..10000 completed beforehand in both: begin returns
# the stored response; the baseline inserts nothing and reads it back).
# Rounds are interleaved in one run; pgbench -M prepared,
# synchronous_commit = off.  Prints per-round tps, then per case the median
# tps of both and the ratio candidate / baseline.
#
# Connection from PGHOST/PGPORT/PGDATABASE/PGUSER (test/bench/run sets them).
# Settings: IDEM_BENCH_ROUNDS (default 5), IDEM_BENCH_SECONDS per round
# (default 5), IDEM_BENCH_CLIENTS (default 2).
set -euo pipefail

dir=$(cd "$(dirname "$0")" && pwd)
. "$dir/lib.sh"

bench_setup <<'SQL'
DROP TABLE IF EXISTS bench_requests;
CREATE TABLE bench_requests (
    scope           text,
    key             text,
    digest          bytea,
    status          text NOT NULL,
    attempt         integer NOT NULL,
    lease_until     timestamptz,
    response        jsonb,
    response_status integer,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, key)
);
-- the replays: keys 1..10000 completed in both, 1000 a transaction (the
-- begin of a new key holds a lock to its commit: 10000 in one transaction
-- would exhaust the lock table)
DO $$
BEGIN
    FOR b IN 0..9 LOOP
        PERFORM FROM generate_series(b * 1000 + 1, b * 1000 + 1000) g,
                LATERAL idem_request_begin(g::text, 'api', '{"amount": 10}');
        PERFORM idem_request_complete(g::text, 'api', '{"id": "pay", "amount": 10}', 1, 201)
           FROM generate_series(b * 1000 + 1, b * 1000 + 1000) g;
        COMMIT;
    END LOOP;
END
$$;
INSERT INTO bench_requests (scope, key, digest, status, attempt, response, response_status)
SELECT 'api', g::text, sha256('{"amount": 10}'), 'completed', 1, '{"id": "pay", "amount": 10}', 201
  FROM generate_series(1, 10000) g;
VACUUM ANALYZE;
CHECKPOINT;
SQL

echo "requests bench: $ROUNDS interleaved rounds of ${SECS}s per method and case, $CLIENTS clients, -M prepared, synchronous_commit=off"
for case in new replay; do
    plain() { bench_tps "requests_${case}_plain.sql"; }
    idem() { bench_tps "requests_${case}_idem.sql"; }
    bench_rounds "$case" hand-written "idem_request_*"
    if [[ $case == new ]]; then
        bench_ratio "requests, new keys" "idem_request_begin + complete" "${cand[@]}" -- \
            "INSERT ON CONFLICT + UPDATE" "${base[@]}"
    else
        bench_ratio "requests, replays" "idem_request_begin" "${cand[@]}" -- \
            "INSERT ON CONFLICT + SELECT" "${base[@]}"
    fi
done
