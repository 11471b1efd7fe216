#!/usr/bin/env bash
# test/stress/claims_stress.sh: concurrent claims across 1-second partitions.
#
# Several pgbench clients claim keys drawn from a smallish range (so they
# collide, also across partition boundaries), apply an effect when the claim
# is true, record every attempt, and roll back a fraction of transactions at
# random, while idem_maintain() runs in a loop.  Beside them, a slow handler
# claims a key of the current second (new: it inserts) and keeps its
# transaction open for 3.5 s, across partition boundaries, so maintenance
# closes the partition it holds RowExclusiveLock on and seals it (held,
# while the claim is still in progress); a follower claims the slow
# handler's keys of the last seconds, so it waits for claims in progress in
# closed or held partitions or finds them through their filters.  Both
# record attempts and effects as the pgbench clients do.  Afterwards, SQL
# checks:
#   - no key has two effects, and no key has two committed claims;
#   - the keys with a committed claim and the keys with an effect are the same;
#   - every key with a committed attempt has exactly one effect, and exactly
#     one committed attempt that got true;
#   - maintenance closed partitions a transaction held, and sealed them.
# Exits non-zero on any violation.  Connection from PGHOST/PGPORT/PGDATABASE/
# PGUSER; run by test/run-tests (part "stress") in an empty database.
# Settings: IDEM_STRESS_SECONDS (default 18), IDEM_STRESS_CLIENTS (default 6),
# IDEM_STRESS_KEYS (default 20000), IDEM_STRESS_ROLLBACK_PCT (default 20).
set -euo pipefail

SECONDS_RUN=${IDEM_STRESS_SECONDS:-18}
CLIENTS=${IDEM_STRESS_CLIENTS:-6}
NKEYS=${IDEM_STRESS_KEYS:-20000}
ROLLBACK_PCT=${IDEM_STRESS_ROLLBACK_PCT:-20}

. "$(dirname "$0")/common.bash"
maint_pid=''
slow_pids=()

sql >/dev/null <<'SQL'
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS idempotency;
SELECT idem_configure(retention => '60 seconds', partition_interval => '1 second', premake => 30);
CREATE TABLE stress_effects (key text NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE stress_attempts (key text NOT NULL, claimed boolean NOT NULL);
SQL

# one transaction: claim a key (30 % of draws from a hot range of 500 keys),
# apply the effect if the claim is true, record the attempt, and commit or
# (ROLLBACK_PCT % of the time) roll back
{ cat <<'PGBENCH'
\set hot random(1, 100)
\if :hot <= 30
\set k random(1, 500)
\else
\set k random(1, :nkeys)
\endif
\set r random(1, 100)
BEGIN;
SELECT idem_claim(:k::text, 'stress')::int AS claimed \gset
\if :claimed
INSERT INTO stress_effects (key) VALUES (:k::text);
\endif
INSERT INTO stress_attempts (key, claimed) VALUES (:k::text, :claimed::int::boolean);
PGBENCH
pgbench_end rollback_pct
} >"$tmp/claim.sql"

# maintenance running alongside the claims, its actions logged; any error
# fails the test
(
    while :; do
        sql -c 'SELECT action FROM idem_maintain()' >>"$tmp/actions" 2>>"$tmp/maintain.err" \
            || echo "idem_maintain failed" >>"$tmp/maintain.err"
        sleep 0.5
    done
) &
maint_pid=$!
bg_pids+=("$maint_pid")

# claim_step KEY_SQL: psql lines that claim the key KEY_SQL evaluates to,
# apply the effect if the claim is true, and record the attempt
claim_step() {
    cat <<PSQL
SELECT $1 AS k \gset
SELECT idem_claim(:'k', 'stress')::int AS claimed \gset
\if :claimed
INSERT INTO stress_effects (key) VALUES (:'k');
\endif
INSERT INTO stress_attempts (key, claimed) VALUES (:'k', :claimed::int::boolean);
PSQL
}
# the slow handler: a key of the current second, then 3.5 s with the
# transaction open; the follower: a key of the slow handler's last 6 seconds
slow_key="'slow-' || extract(epoch FROM date_trunc('second', clock_timestamp()))::bigint"
follow_key="'slow-' || (extract(epoch FROM date_trunc('second', clock_timestamp()))::bigint - 1 - (random() * 5)::int)"
(
    end=$((SECONDS + SECONDS_RUN))
    while ((SECONDS < end)); do
        { echo 'BEGIN;'; claim_step "$slow_key"; echo 'SELECT pg_sleep(3.5);'
          ((RANDOM % 100 < ROLLBACK_PCT)) && echo 'ROLLBACK;' || echo 'COMMIT;'; } |
            sql >/dev/null 2>>"$tmp/slow.err" || echo "slow handler failed" >>"$tmp/slow.err"
    done
) &
slow_pids+=($!)
bg_pids+=($!)
(
    end=$((SECONDS + SECONDS_RUN))
    while ((SECONDS < end)); do
        { echo 'BEGIN;'; claim_step "$follow_key"; echo 'COMMIT;'; } |
            sql >/dev/null 2>>"$tmp/slow.err" || echo "follower failed" >>"$tmp/slow.err"
        sleep 0.2
    done
) &
slow_pids+=($!)
bg_pids+=($!)

echo "pgbench: $CLIENTS clients, ${SECONDS_RUN}s, keys 1..$NKEYS (30 % from 1..500), $ROLLBACK_PCT % rollbacks, 1-second partitions"
rc=0
pgbench -n -M prepared -c "$CLIENTS" -j 2 -T "$SECONDS_RUN" \
    -D nkeys="$NKEYS" -D rollback_pct="$ROLLBACK_PCT" -f "$tmp/claim.sql" >"$tmp/pgbench.out" 2>&1 || rc=$?
grep -E 'processed|failed|tps|aborted' "$tmp/pgbench.out" | sed 's/^/  /' || true
wait "${slow_pids[@]}" 2>/dev/null || true
slow_pids=()
kill "$maint_pid" 2>/dev/null; wait "$maint_pid" 2>/dev/null || true
maint_pid=''


if [[ $rc -ne 0 ]]; then
    tail -n 20 "$tmp/pgbench.out"
    fail "pgbench exited with status $rc (a client got an error)"
fi
if [[ -s $tmp/maintain.err ]]; then
    head -n 5 "$tmp/maintain.err"
    fail "idem_maintain() failed during the run"
fi
if [[ -s $tmp/slow.err ]]; then
    head -n 5 "$tmp/slow.err"
    fail "the slow handler or the follower got an error"
fi

read -r attempts keys effects effect_keys claims claim_keys dup_attempts seconds <<<"$(sql -F ' ' -c "
SELECT (SELECT count(*) FROM stress_attempts),
       (SELECT count(DISTINCT key) FROM stress_attempts),
       (SELECT count(*) FROM stress_effects),
       (SELECT count(DISTINCT key) FROM stress_effects),
       (SELECT count(*) FROM idempotency.claims WHERE scope = 'stress'),
       (SELECT count(DISTINCT key) FROM idempotency.claims WHERE scope = 'stress'),
       (SELECT count(*) FROM stress_attempts WHERE NOT claimed),
       (SELECT count(DISTINCT date_trunc('second', claimed_at)) FROM idempotency.claims WHERE scope = 'stress')")"
partitions=$(sql -c "SELECT count(DISTINCT tableoid) FROM idempotency.claims WHERE scope = 'stress'" 2>/dev/null || echo '?')
# partitions sealed during the run: duplicates in them were found through
# their Bloom filters, without the value lock
sealed=$(sql -c "SELECT count(*) FROM idempotency.partition_registry r
                 WHERE r.sealed AND EXISTS (SELECT FROM idempotency.claims c
                                            WHERE c.tableoid = r.relid AND c.scope = 'stress')")

echo "committed attempts: $attempts on $keys keys ($dup_attempts answered false)"
echo "effects: $effects on $effect_keys keys; committed claims: $claims on $claim_keys keys"
echo "claims made during $seconds distinct seconds, stored in $partitions partitions, $sealed of them sealed during the run"

doubled=$(sql -c "SELECT count(*) FROM (SELECT key FROM stress_effects GROUP BY key HAVING count(*) > 1) x")
double_claims=$(sql -c "SELECT count(*) FROM (SELECT key FROM idempotency.claims WHERE scope = 'stress' GROUP BY key HAVING count(*) > 1) x")
claim_no_effect=$(sql -c "SELECT count(*) FROM (SELECT DISTINCT key FROM idempotency.claims WHERE scope = 'stress') c
                          WHERE NOT EXISTS (SELECT FROM stress_effects e WHERE e.key = c.key)")
effect_no_claim=$(sql -c "SELECT count(*) FROM (SELECT DISTINCT key FROM stress_effects) e
                          WHERE NOT EXISTS (SELECT FROM idempotency.claims c WHERE c.scope = 'stress' AND c.key = e.key)")
lost=$(sql -c "SELECT count(*) FROM (SELECT DISTINCT key FROM stress_attempts) a
               WHERE NOT EXISTS (SELECT FROM stress_effects e WHERE e.key = a.key)")
not_one_true=$(sql -c "SELECT count(*) FROM (SELECT key FROM stress_attempts GROUP BY key
                                             HAVING count(*) FILTER (WHERE claimed) <> 1) x")

echo "keys with two effects: $doubled; keys with two claims: $double_claims"
echo "claims without effect: $claim_no_effect; effects without claim: $effect_no_claim"
echo "keys with committed attempts but no effect (lost): $lost; keys whose committed attempts got true not exactly once: $not_one_true"

[[ $doubled -eq 0 ]] || fail "$doubled keys have two or more effects"
[[ $double_claims -eq 0 ]] || fail "$double_claims keys have two or more committed claims"
[[ $claim_no_effect -eq 0 ]] || fail "$claim_no_effect keys have a claim but no effect"
[[ $effect_no_claim -eq 0 ]] || fail "$effect_no_claim keys have an effect but no claim"
[[ $lost -eq 0 ]] || fail "$lost keys with a committed attempt have no effect"
[[ $not_one_true -eq 0 ]] || fail "$not_one_true keys got true in a committed attempt other than exactly once"
[[ $attempts -ge 1000 ]] || fail "only $attempts committed attempts: too few to mean anything"
min_parts=$((SECONDS_RUN / 2 < 5 ? SECONDS_RUN / 2 : 5))
[[ $seconds -ge $min_parts ]] || fail "claims span only $seconds seconds (expected at least $min_parts)"
[[ $partitions =~ ^[0-9]+$ && $partitions -ge $min_parts ]] \
    || fail "claims made over $seconds seconds landed in $partitions partition(s), expected at least $min_parts with partition_interval = 1 second: the test crossed no partition boundaries"

[[ $sealed -ge $((min_parts / 2)) ]] \
    || fail "only $sealed partitions were sealed during the run: the sealed-partition path was not exercised"

closes=$(grep -c '^close$' "$tmp/actions" || true)
holds=$(grep -c '^hold$' "$tmp/actions" || true)
slow_keys=$(sql -c "SELECT count(DISTINCT key) FROM stress_attempts WHERE key LIKE 'slow-%'")
slow_dups=$(sql -c "SELECT count(*) FROM stress_attempts WHERE key LIKE 'slow-%' AND NOT claimed")
echo "slow handler and follower: $slow_keys keys, $slow_dups attempts answered false; maintenance closed $closes partitions a transaction held, $holds of them sealed while it was open"
[[ $closes -ge 1 && $holds -ge 1 ]] \
    || fail "maintenance closed $closes and held $holds partitions: the slow handler's claims in progress were never sealed in"
[[ $slow_dups -ge 1 ]] || fail "the follower never found a claim of the slow handler"

if [[ $failed -ne 0 ]]; then
    echo "claims stress: FAILED"
    exit 1
fi
echo "claims stress: ok"
