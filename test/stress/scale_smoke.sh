#!/usr/bin/env bash
# test/stress/scale_smoke.sh: a tiny version of the build of test/bench/scale.sh,
# checked for correctness (not speed).
#
# Builds 3 past daily partitions and the current one with 2000 claims each,
# the honest way: the extension is created with idempotency.debug_clock_offset
# putting its clock 3 days back; for each partition the clock is moved into
# its range, idem_maintain() runs (creating it, sealing the previous one with
# its Bloom filter), and its claims are inserted straight into the partition
# named by idempotency.partition_registry.  Then, at offset 0 after
# idem_maintain(), checks:
#   - the 3 past partitions are sealed, with 2000 claims and a Bloom filter each;
#   - every loaded key is found by idem_claimed and is a duplicate for idem_claim;
#   - filter_status() reports mode 'local' (not preloaded) with the filters loaded;
#   - new keys are true once, then false;
#   - idem_claim_many over loaded and new keys (one repeated) returns exactly
#     the new keys, once each, in input order;
#   - with the clock past the last premade partition (maintenance lagging),
#     new keys are claimed (true), go into the newest partition, are
#     duplicates afterwards, and are found by idem_claimed;
#   - idem_maintain() at that clock reports an 'extend'; afterwards the lagged
#     claims and the loaded keys are still duplicates, every sealed non-empty
#     partition has a filter, and no (scope, key) is stored twice.
# Exits non-zero on the first violation.  Connection from PGHOST/PGPORT/
# PGDATABASE/PGUSER (a superuser: the clock offset is a superuser setting);
# run by test/run-tests (part "stress") in an empty database, not preloaded.
set -euo pipefail

PER=2000
PAST=3
DAY=86400
BASE=1000000000

q() { psql -X -q -At -v ON_ERROR_STOP=1 "$@"; }
fail() { echo "FAILED: $*" >&2; exit 1; }
# check WHAT EXPECTED ACTUAL
check() {
    [[ $2 == "$3" ]] || fail "$1: expected '$2', got '$3'"
    echo "ok: $1 ($3)"
}
offset_to() { echo $(($1 - $(date +%s))); }

# ---- build
realnow=$(q -c "SELECT floor(extract(epoch FROM now()))::bigint")
t=$((realnow - PAST * DAY))
q >/dev/null <<SQL
SET client_min_messages = warning;
SET idempotency.debug_clock_offset = $(offset_to $((t + 2)));
CREATE EXTENSION idempotency;
SELECT idem_configure(retention => '30 days', partition_interval => '1 day', premake => 2);
SQL
g0=0
nparts=0
while ((t < realnow)); do
    line=$(q <<SQL
SET idempotency.debug_clock_offset = $(offset_to $((t + 2)));
\o /dev/null
SELECT * FROM idem_maintain();
\o
SELECT relid::regclass, extract(epoch FROM lower)::bigint, extract(epoch FROM upper)::bigint
FROM idempotency.partition_registry
WHERE NOT sealed AND lower <= to_timestamp($t + 2) AND to_timestamp($t + 2) < upper;
SQL
)
    IFS='|' read -r rel lo up <<<"$line"
    [[ -n $rel && $up -gt $t ]] || fail "no unsealed partition covers $(date -u -d @"$((t + 2))") after idem_maintain() at that clock"
    from=$((lo > t ? lo : t))
    to=$((up < realnow ? up : realnow))
    q -c "INSERT INTO $rel (scope, key, claimed_at)
          SELECT 'default', ($BASE + g)::text, to_timestamp($from + ($to - $from) * (g - $g0 - 0.5) / $PER)
          FROM generate_series($g0 + 1, $g0 + $PER) g"
    g0=$((g0 + PER))
    nparts=$((nparts + 1))
    t=$up
done
q -c "SET idempotency.debug_clock_offset = 0" -c "SELECT count(*) FROM idem_maintain()" >/dev/null
loaded=$g0
echo "built $nparts partitions with $PER claims each ($loaded claims), $PAST days back to now"

# ---- the build itself
check "partitions loaded" $((PAST + 1)) "$nparts"
check "claims stored" "$loaded" "$(q -c "SELECT count(*) FROM idempotency.claims")"
check "past partitions sealed with a filter and $PER claims" "$PAST" \
    "$(q -c "SELECT count(*) FROM idempotency.partitions
             WHERE store = 'claims' AND state = 'sealed' AND has_bloom_filter AND claims = $PER
               AND upper <= now()")"
check "current partition unsealed, holding $PER claims" "1|$PER" \
    "$(q -c "SELECT count(*), sum((SELECT count(*) FROM idempotency.claims c WHERE c.tableoid = p.partition))
             FROM idempotency.partitions p WHERE store = 'claims' AND state = 'current'")"

# ---- loaded keys: found and duplicates, filters loaded (one session)
out=$(q <<SQL
SELECT count(*) FILTER (WHERE idem_claimed(($BASE + g)::text) IS NULL) FROM generate_series(1, $loaded) g;
SELECT count(*) FILTER (WHERE idem_claim(($BASE + g)::text)) FROM generate_series(1, $loaded) g;
SELECT format('%s|%s|%s', mode, filters >= $PAST, refused) FROM idempotency.filter_status();
SQL
)
check "loaded keys not found by idem_claimed" 0 "$(sed -n 1p <<<"$out")"
check "loaded keys that idem_claim called new" 0 "$(sed -n 2p <<<"$out")"
check "filter_status: mode, at least $PAST filters loaded, refused" "local|t|0" "$(sed -n 3p <<<"$out")"
check "claims stored after the duplicate claims" "$loaded" "$(q -c "SELECT count(*) FROM idempotency.claims")"

# ---- new keys: true once
NEW=(500000000000 500)   # keys 500000000001 .. 500000000500
check "new keys that idem_claim called new (first time)" 500 \
    "$(q -c "SELECT count(*) FILTER (WHERE idem_claim((${NEW[0]} + g)::text)) FROM generate_series(1, ${NEW[1]}) g")"
check "new keys that idem_claim called new (second time)" 0 \
    "$(q -c "SELECT count(*) FILTER (WHERE idem_claim((${NEW[0]} + g)::text)) FROM generate_series(1, ${NEW[1]}) g")"

# ---- idem_claim_many over a mix: loaded keys from every partition, new keys, one new key twice
mix="ARRAY(SELECT k FROM (
        SELECT g, CASE WHEN g % 3 = 0 THEN (600000000000 + g)::text
                       ELSE ($BASE + 1 + (g * 7919) % $loaded)::text END AS k
        FROM generate_series(1, 600) g
        UNION ALL SELECT 601, '600000000003') s ORDER BY g)"
expected=$(q -c "SELECT string_agg(k, ',' ORDER BY g) FROM (
                   SELECT DISTINCT ON (k) g, k FROM unnest($mix) WITH ORDINALITY u(k, g)
                   WHERE k LIKE '6000000%' ORDER BY k, g) s")
got=$(q -c "SELECT string_agg(k, ',' ORDER BY n) FROM idem_claim_many($mix) WITH ORDINALITY r(k, n)")
[[ -n $expected ]] || fail "idem_claim_many: no new keys in the test batch"
nnew=$(tr ',' '\n' <<<"$expected" | wc -l)
[[ $got == "$expected" ]] || fail "idem_claim_many: expected the $nnew new keys '$expected', got '$got'"
echo "ok: idem_claim_many returned exactly the $nnew new keys of 601 (one repeated), in input order"
check "idem_claim_many again returns nothing" "" "$(q -c "SELECT string_agg(k, ',') FROM idem_claim_many($mix) k")"

# ---- lagging maintenance: the clock past the last premade partition
lag=$(q -c "SELECT ceil(extract(epoch FROM max(upper) - now()))::bigint + 3600 FROM idempotency.partition_registry")
newest=$(q -c "SELECT relid::regclass FROM idempotency.partition_registry ORDER BY upper DESC LIMIT 1")
LAG="SET idempotency.debug_clock_offset = $lag"
keys="generate_series(1, 300) g"
check "claims while lagging (clock +${lag}s, no partition covers it)" 300 \
    "$(q -c "$LAG" -c "SELECT count(*) FILTER (WHERE idem_claim((700000000000 + g)::text)) FROM $keys")"
check "lagged claims stored in the newest partition $newest" 300 \
    "$(q -c "SELECT count(*) FROM $newest WHERE key LIKE '7000000%' AND claimed_at >= (SELECT max(upper) FROM idempotency.partition_registry)")"
check "lagged keys that idem_claim called new again while lagging" 0 \
    "$(q -c "$LAG" -c "SELECT count(*) FILTER (WHERE idem_claim((700000000000 + g)::text)) FROM $keys")"
# (only at the lagging clock: seen from the real clock these claims lie days
# ahead, in a partition that has not begun, which claims do not consult; a
# clock that goes back by days is outside the contract)
check "lagged keys not found by idem_claimed (lagging clock)" 0 \
    "$(q -c "$LAG" -c "SELECT count(*) FILTER (WHERE idem_claimed((700000000000 + g)::text) IS NULL) FROM $keys")"
actions=$(q -c "$LAG" -c "SELECT string_agg(action || ' ' || object, ', ') FROM idem_maintain()")
echo "idem_maintain() at the lagging clock: $actions"
[[ $actions == *"extend "* ]] || fail "idem_maintain() at the lagging clock did no 'extend': $actions"
echo "ok: idem_maintain() at the lagging clock extended the newest partition"
check "lagged keys that idem_claim called new after the extend (lagging clock)" 0 \
    "$(q -c "$LAG" -c "SELECT count(*) FILTER (WHERE idem_claim((700000000000 + g)::text)) FROM $keys")"
check "loaded and earlier new keys that idem_claim called new after the extend (lagging clock)" 0 \
    "$(q -c "$LAG" -c "SELECT count(*) FILTER (WHERE idem_claim(k)) FROM (
                         SELECT ($BASE + g)::text FROM generate_series(1, $loaded) g
                         UNION ALL SELECT (${NEW[0]} + g)::text FROM generate_series(1, ${NEW[1]}) g) s(k)")"
check "sealed non-empty partitions without a filter" 0 \
    "$(q -c "SELECT count(*) FROM idempotency.partition_registry WHERE sealed AND nkeys > 0 AND bloom IS NULL")"
check "(scope, key) stored twice" 0 \
    "$(q -c "SELECT count(*) FROM (SELECT 1 FROM idempotency.claims GROUP BY scope, key HAVING count(*) > 1) d")"
check "claims stored in all" $((loaded + 500 + nnew + 300)) \
    "$(q -c "SELECT count(*) FROM idempotency.claims")"
echo "scale smoke: all checks passed"
