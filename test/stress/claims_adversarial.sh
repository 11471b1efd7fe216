#!/usr/bin/env bash
# test/stress/claims_adversarial.sh: a longer, adversarial stress test of the
# claims store, through its public API only (idem_claim, idem_claim_many,
# idem_claimed, idem_release, idem_configure, idem_maintain and the views
# idempotency.claims and idempotency.partitions).
#
# pgbench clients run four kinds of handler transactions against one scope:
#   single     one idem_claim (30 % of draws from a few hot keys);
#   savepoint  maybe a claim, then a claim inside a SAVEPOINT that is rolled
#              back to half of the time and then maybe claimed again;
#   batch      idem_claim_many over 2-10 keys, hot and cold, sometimes with
#              repeats, in random order (so batches overlap in other orders);
#   release    idem_release of a hot key (deliberate reprocessing), then
#              maybe a new claim and effect in the same transaction.
# Every transaction may also roll back as a whole.  A claim that returns
# true applies an "effect" (a row in adv_effects) in the same transaction;
# every claim call is recorded in adv_attempts and every release that
# returned true in adv_releases, all in the claiming/releasing transaction,
# so only committed work is recorded.  Each record carries the
# transaction's id, clock_timestamp() before and after the call, and the
# snapshot the call started from (pg_current_snapshot()).
#
# Meanwhile:
#   - a maintenance loop runs idem_maintain() with random lag (sleeps of
#     0-3 s, now and then longer), logging every action;
#   - a configure loop changes the shape every 2-5 s: partition_interval
#     1-3 s, retention 6-40 s (the 1st, 3rd, ... change sets 6-12 s, so
#     drops happen), premake 1-10; half of the interval changes are timed to
#     land a few milliseconds before the first boundary of the new grid is
#     one second ahead (so claimers already probe the premade partition the
#     reshape replaces); a change refused with 22023 is logged, not a
#     failure;
#   - three "slow handlers" claim three keys in turn with sleeps of
#     0.2-1 s between, then commit (or roll back): long transactions that
#     hold claims and partition locks across boundaries and reshapes;
#   - keys of odd number are claimed in scope '<SCOPE>_long', even ones in
#     '<SCOPE>' (so a key names its scope); a multi-key transaction claims
#     the '<SCOPE>' keys first, then the '<SCOPE>_long' ones, each in byte
#     order; after each idem_configure change the configure loop changes
#     '<SCOPE>_long''s retention with idem_configure_scope: raised (15-40 s),
#     lowered (3-5 s, below every default) or removed (NULL: the default);
#   - a sampler claims keys whose latest claim is still owed (in a
#     transaction it rolls back): each such claim must return false unless
#     the key was released.  A claim is owed while it is younger than the
#     retention in force (its scope's own, else the default) at every moment
#     since it, minus a margin: a retention raised after a claim is owed in
#     full, one lowered below its age frees it (adv_owed).
#
# At the end it checks, and prints the offending keys of:
#   doubled   two committed effects on one key with no committed release
#             between them, the second claimed while the first was owed;
#   lost      a committed claim that returned false while neither an own
#             claim nor another transaction's committed, unreleased effect
#             existed.  A committed idem_release that returned true forgets
#             the key's claims made before it (deliberate reprocessing): it
#             counts for an effect whose transaction is visible in the
#             release's snapshot, when the release's transaction is visible in
#             the claim's snapshot (or is the claim's own, earlier);
#   mismatch  a committed true claim without exactly one effect, an effect
#             without a true claim, a claim row in idempotency.claims for a
#             key with fewer effects than claim rows;
#   dropped   a key whose latest claim is owed and was not released, yet
#             idem_claimed() is NULL at the end (after a final
#             idem_maintain()); and sampler claims that returned true.
# It also fails if something it is meant to exercise did not happen: too
# few transactions, no rollbacks, savepoint rollbacks, batches, releases,
# partition seals or drops, configure changes or interval changes.
#
# Connection from PGHOST/PGPORT/PGDATABASE/PGUSER, in a database of its own
# (test/run-tests, part "stress").  Settings:
#   IDEM_ADV_SECONDS       pgbench run time (default 25; 600 for a long run)
#   IDEM_ADV_CLIENTS       pgbench clients (default 8)
#   IDEM_ADV_HOT           hot keys (default 200)
#   IDEM_ADV_KEYS          all keys, hot ones included (default 50000)
#   IDEM_ADV_ROLLBACK_PCT  whole-transaction rollbacks (default 15)
#   IDEM_ADV_MARGIN        seconds of slack on retention windows (default 0.25)
#   IDEM_ADV_SEED          random seed of pgbench and of the initial shape (the
#                          timing of the loops is not reproducible anyway)
# The adv_* tables stay in the database for inspection (with IDEM_KEEP=1,
# test/run-tests keeps the cluster).
set -euo pipefail

RUN_SECONDS=${IDEM_ADV_SECONDS:-25}
CLIENTS=${IDEM_ADV_CLIENTS:-8}
HOT=${IDEM_ADV_HOT:-200}
NKEYS=${IDEM_ADV_KEYS:-50000}
ROLLBACK_PCT=${IDEM_ADV_ROLLBACK_PCT:-15}
MARGIN=${IDEM_ADV_MARGIN:-0.25}
SEED=${IDEM_ADV_SEED:-$(( $(date +%s) % 1000000 ))}
RET_FLOOR=6             # smallest retention the configure loop ever sets
RET_CEIL=40             # largest; retention/partition_interval stays <= 40
SCOPE=adv
LSCOPE=${SCOPE}_long     # keys of odd number; its retention changes

RANDOM=$SEED
started=${EPOCHREALTIME/,/.}
. "$(dirname "$0")/common.bash"
now_epoch() { echo "${EPOCHREALTIME/,/.}"; }
# rand LO HI: a random integer in [LO, HI]
rand() { echo $(( $1 + RANDOM % ($2 - $1 + 1) )); }
# now_ms: wall clock in milliseconds, without a fork
now_ms() { local t=${EPOCHREALTIME/[.,]/}; echo $(( t / 1000 )); }
# sleep_ms MS: sleep until MS milliseconds have passed (by the clock, so a
# loaded machine does not stretch it) or the loops are told to stop
sleep_ms() {
    local end=$(( $(now_ms) + $1 )) left
    while [[ ! -e $tmp/stop ]]; do
        left=$(( end - $(now_ms) ))
        (( left > 0 )) || break
        (( left > 250 )) && left=250
        sleep "0.$(printf '%03d' "$left")"
    done
}
# background loops run until $tmp/stop exists; the SQL in flight finishes
running() { [[ ! -e $tmp/stop ]]; }

# ---------------------------------------------------------------- set-up
init_ret=$(rand "$RET_FLOOR" 10)
init_iv=1
init_pm=$(rand 1 10)
init_lret=$(rand 3 5)    # a short class from the start, so its partitions drop

sql >/dev/null <<SQL
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS idempotency;
SELECT idem_configure(retention => make_interval(secs => $init_ret),
                      partition_interval => make_interval(secs => $init_iv),
                      premake => $init_pm);
SELECT idem_configure_scope('$LSCOPE', make_interval(secs => $init_lret));

-- every configuration in force during the run, from when it was made;
-- long_retention_s is $LSCOPE's own (NULL: it follows retention_s)
CREATE TABLE adv_config (at timestamptz NOT NULL DEFAULT clock_timestamp(),
                         retention_s int NOT NULL, long_retention_s int, interval_s int NOT NULL,
                         premake int NOT NULL, args text NOT NULL, took_ms int);
INSERT INTO adv_config (retention_s, long_retention_s, interval_s, premake, args)
VALUES ($init_ret, $init_lret, $init_iv, $init_pm, 'initial');

-- committed claim calls (one row per distinct key of a batch)
CREATE TABLE adv_attempts (key text NOT NULL, claimed boolean NOT NULL,
                           txid xid8 NOT NULL, snap pg_snapshot NOT NULL,
                           t_before timestamptz NOT NULL,
                           t_after timestamptz NOT NULL DEFAULT clock_timestamp(),
                           via text NOT NULL);
-- committed effects: one per claim that returned true
CREATE TABLE adv_effects (key text NOT NULL, txid xid8 NOT NULL,
                          t_before timestamptz NOT NULL,
                          t_after timestamptz NOT NULL DEFAULT clock_timestamp(),
                          via text NOT NULL);
CREATE INDEX ON adv_effects (t_before);
-- committed releases that returned true
CREATE TABLE adv_releases (key text NOT NULL, txid xid8 NOT NULL, snap pg_snapshot NOT NULL,
                           t_before timestamptz NOT NULL,
                           t_after timestamptz NOT NULL DEFAULT clock_timestamp());
-- counters that survive rollbacks
CREATE SEQUENCE adv_n_claim_calls;
CREATE SEQUENCE adv_n_claim_true;
CREATE SEQUENCE adv_n_release_calls;
CREATE SEQUENCE adv_n_rollbacks;
CREATE SEQUENCE adv_n_sp_rollbacks;

CREATE FUNCTION adv_key(n int) RETURNS text LANGUAGE sql IMMUTABLE
    AS \$\$ SELECT 'k' || lpad(n::text, 7, '0') \$\$;
-- the scope a key is claimed in: odd numbers in $LSCOPE
CREATE FUNCTION adv_key_scope(k text) RETURNS text LANGUAGE sql IMMUTABLE
    AS \$\$ SELECT CASE WHEN substr(k, 2)::int % 2 = 1 THEN '$LSCOPE' ELSE '$SCOPE' END \$\$;

-- claim one key; apply and record the effect if the claim is true
CREATE FUNCTION adv_claim(n int, via text) RETURNS int LANGUAGE plpgsql AS \$\$
DECLARE
    k text := adv_key(n);
    s pg_snapshot;
    t0 timestamptz;
    c boolean;
BEGIN
    s := pg_current_snapshot();
    t0 := clock_timestamp();
    c := idem_claim(k, adv_key_scope(k));
    INSERT INTO adv_attempts (key, claimed, txid, snap, t_before, via)
    VALUES (k, c, pg_current_xact_id(), s, t0, via);
    IF c THEN
        INSERT INTO adv_effects (key, txid, t_before, via) VALUES (k, pg_current_xact_id(), t0, via);
        PERFORM nextval('adv_n_claim_true');
    END IF;
    PERFORM nextval('adv_n_claim_calls');
    RETURN c::int;
END \$\$;

-- claim a batch of n keys (half hot, some repeated) with idem_claim_many
CREATE FUNCTION adv_claim_many(n int, hot int, nkeys int) RETURNS int LANGUAGE plpgsql AS \$\$
DECLARE
    keys text[] := '{}';
    got text[];
    got_l text[];
    want text[];
    s pg_snapshot;
    t0 timestamptz;
BEGIN
    FOR i IN 1 .. n LOOP
        IF i > 1 AND random() < 0.15 THEN
            keys := keys || keys[1 + floor(random() * (i - 1))::int];
        ELSIF random() < 0.5 THEN
            keys := keys || adv_key(1 + floor(random() * hot)::int);
        ELSE
            keys := keys || adv_key(hot + 1 + floor(random() * (nkeys - hot))::int);
        END IF;
    END LOOP;
    s := pg_current_snapshot();
    t0 := clock_timestamp();
    -- one call per scope, '$SCOPE' first (the order every handler takes)
    SELECT coalesce(array_agg(x ORDER BY o), '{}') INTO got
    FROM idem_claim_many(ARRAY(SELECT k FROM unnest(keys) WITH ORDINALITY u(k, o)
                               WHERE adv_key_scope(k) = '$SCOPE' ORDER BY o), '$SCOPE')
         WITH ORDINALITY AS t(x, o);
    SELECT coalesce(array_agg(x ORDER BY o), '{}') INTO got_l
    FROM idem_claim_many(ARRAY(SELECT k FROM unnest(keys) WITH ORDINALITY u(k, o)
                               WHERE adv_key_scope(k) = '$LSCOPE' ORDER BY o), '$LSCOPE')
         WITH ORDINALITY AS t(x, o);
    -- as one list in input order (each call returns its keys in input order)
    SELECT coalesce(array_agg(k ORDER BY first), '{}') INTO got
    FROM (SELECT k, min(o) AS first FROM unnest(keys) WITH ORDINALITY AS u(k, o)
          WHERE k = ANY (got || got_l) GROUP BY k) d;
    -- the contract: the newly claimed keys, each once, in input order
    SELECT coalesce(array_agg(k ORDER BY first), '{}') INTO want
    FROM (SELECT k, min(o) AS first FROM unnest(keys) WITH ORDINALITY AS u(k, o)
          GROUP BY k) d
    WHERE k = ANY (got);
    IF got IS DISTINCT FROM want THEN
        RAISE EXCEPTION 'idem_claim_many(%) returned %, expected %', keys, got, want;
    END IF;
    INSERT INTO adv_attempts (key, claimed, txid, snap, t_before, via)
    SELECT k, k = ANY (got), pg_current_xact_id(), s, t0, 'batch'
    FROM (SELECT DISTINCT k FROM unnest(keys) AS k) d;
    INSERT INTO adv_effects (key, txid, t_before, via)
    SELECT k, pg_current_xact_id(), t0, 'batch' FROM unnest(got) AS k;
    PERFORM nextval('adv_n_claim_calls') FROM (SELECT DISTINCT k FROM unnest(keys) AS k) d;
    PERFORM nextval('adv_n_claim_true') FROM unnest(got);
    RETURN cardinality(got);
END \$\$;

-- release a key (deliberate reprocessing); record it if there was a claim
CREATE FUNCTION adv_release(n int) RETURNS int LANGUAGE plpgsql AS \$\$
DECLARE
    k text := adv_key(n);
    s pg_snapshot;
    t0 timestamptz;
    r boolean;
BEGIN
    s := pg_current_snapshot();
    t0 := clock_timestamp();
    r := idem_release(k, adv_key_scope(k));
    IF r THEN
        INSERT INTO adv_releases (key, txid, snap, t_before) VALUES (k, pg_current_xact_id(), s, t0);
    END IF;
    PERFORM nextval('adv_n_release_calls');
    RETURN r::int;
END \$\$;

-- the smallest retention in force for key k's scope at any time in
-- [t_from, t_to] (its scope's own, else the default): the configuration made
-- before t_from and every one made since (with a second of slack, as a
-- configuration takes effect when it commits)
CREATE FUNCTION adv_min_retention(k text, t_from timestamptz, t_to timestamptz) RETURNS int
LANGUAGE sql STABLE AS \$\$
    SELECT min(CASE WHEN adv_key_scope(k) = '$LSCOPE' THEN coalesce(lr, r) ELSE r END) FROM (
        (SELECT retention_s AS r, long_retention_s AS lr FROM adv_config
         WHERE at <= t_from - interval '1 s' ORDER BY at DESC LIMIT 1)
        UNION ALL
        SELECT retention_s, long_retention_s FROM adv_config
        WHERE at > t_from - interval '1 s' AND at <= t_to + interval '1 s') c
\$\$;

-- is key k's claim made at t_from owed at t_to: was it younger than the
-- retention in force (its scope's own, else the default) at every moment in
-- between, minus the margin?  Each configuration is taken to be in force
-- from a second before it was recorded to a second after the next one, so
-- at any moment every retention that may have been in force counts.  Unlike
-- adv_min_retention's bound, a retention raised after the claim is owed in
-- full: the claims it covers must be kept for it.
CREATE FUNCTION adv_owed(k text, t_from timestamptz, t_to timestamptz) RETURNS boolean
LANGUAGE sql STABLE AS \$\$
    SELECT coalesce(bool_and(least(p_end, t_to) - t_from < make_interval(secs => r - $MARGIN)), true) FROM (
        SELECT CASE WHEN adv_key_scope(k) = '$LSCOPE' THEN coalesce(long_retention_s, retention_s)
                    ELSE retention_s END AS r,
               coalesce(lead(at) OVER (ORDER BY at) + interval '1 s', 'infinity') AS p_end,
               at - interval '1 s' AS p_start
        FROM adv_config) c
    WHERE p_end > t_from AND p_start < t_to
\$\$;
SQL

# ------------------------------------------------------- pgbench scripts
# keys are 'k' || 7 digits, so numeric order is byte order: a transaction
# claiming two keys with separate calls takes them in byte order, as
# idem_claim_many does, so handlers cannot deadlock among themselves
{ cat <<'PGBENCH'
\set h random(1, 100)
\if :h <= 30
\set k random(1, :hot)
\else
\set k random(:hot + 1, :nkeys)
\endif
\set r random(1, 100)
BEGIN;
SELECT adv_claim(:k, 'single');
PGBENCH
pgbench_end rb_pct "SELECT nextval('adv_n_rollbacks');"
} >"$tmp/single.sql"

{ cat <<'PGBENCH'
\set a random(1, :hot)
\set h random(1, 100)
\if :h <= 50
\set b random(1, :hot)
\else
\set b random(:hot + 1, :nkeys)
\endif
\set sa (:a % 2) * 100000000 + :a
\set sb (:b % 2) * 100000000 + :b
\if :sa <= :sb
\set k1 :a
\set k2 :b
\else
\set k1 :b
\set k2 :a
\endif
\set outer random(1, 100)
\set spr random(1, 100)
\set re random(1, 100)
\set r random(1, 100)
BEGIN;
\if :outer <= 50
SELECT adv_claim(:k1, 'sp-outer');
\endif
SAVEPOINT s1;
SELECT adv_claim(:k2, 'sp-inner');
\if :spr <= 50
ROLLBACK TO SAVEPOINT s1;
SELECT nextval('adv_n_sp_rollbacks');
\if :re <= 60
SELECT adv_claim(:k2, 'sp-reclaim');
\endif
\else
RELEASE SAVEPOINT s1;
\endif
PGBENCH
pgbench_end rb_pct "SELECT nextval('adv_n_rollbacks');"
} >"$tmp/savepoint.sql"

{ cat <<'PGBENCH'
\set n random(2, 10)
\set r random(1, 100)
BEGIN;
SELECT adv_claim_many(:n, :hot, :nkeys);
PGBENCH
pgbench_end rb_pct "SELECT nextval('adv_n_rollbacks');"
} >"$tmp/batch.sql"

{ cat <<'PGBENCH'
\set k random(1, :hot)
\set re random(1, 100)
\set r random(1, 100)
BEGIN;
SELECT adv_release(:k);
\if :re <= 50
SELECT adv_claim(:k, 'reprocess');
\endif
PGBENCH
pgbench_end rb_pct "SELECT nextval('adv_n_rollbacks');"
} >"$tmp/release.sql"

# ------------------------------------------------------ background loops
# maintenance with random lag; the log has "round EPOCH" and "EPOCH|action|object"
maintain_loop() {
    local out
    while running; do
        echo "round $(now_epoch)" >>"$tmp/maintain.log"
        if out=$(sql -F '|' -c "SELECT extract(epoch FROM clock_timestamp()), action, object FROM idem_maintain()" 2>&1); then
            [[ -n $out ]] && printf '%s\n' "$out" >>"$tmp/maintain.log"
        else
            printf '%s %s\n' "$(now_epoch)" "$out" >>"$tmp/maintain.err"
        fi
        if (( RANDOM % 12 == 0 )); then
            sleep_ms "$(rand 3000 5000)"        # a longer lag now and then
        else
            sleep_ms "$(rand 0 3000)"
        fi
    done
}

# random reshapes every 2-5 s; every other one keeps retention short
configure_loop() {
    local ret=$init_ret iv=$init_iv pm=$init_pm n=0 lret=$init_lret m=0
    local nret niv npm a_ret a_iv a_pm args out timing d nl a_l
    while running; do
        sleep_ms "$(rand 2000 5000)"
        running || break
        n=$((n + 1))
        nret=$ret niv=$iv npm=$pm a_ret=NULL a_iv=NULL a_pm=NULL
        while [[ $a_ret == NULL && $a_iv == NULL && $a_pm == NULL ]]; do
            if (( n % 2 == 1 )); then
                nret=$(rand "$RET_FLOOR" 12)
                a_ret="make_interval(secs => $nret)"
            elif (( RANDOM % 3 != 0 )); then
                nret=$(rand "$RET_FLOOR" "$RET_CEIL")
                a_ret="make_interval(secs => $nret)"
            fi
            if (( RANDOM % 5 < 3 )); then
                niv=$(( (iv + RANDOM % 2) % 3 + 1 ))    # another of 1, 2, 3
                a_iv="make_interval(secs => $niv)"
            fi
            if (( RANDOM % 2 == 0 )); then
                npm=$(rand 1 10)
                a_pm=$npm
            fi
        done
        args="retention=$([[ $a_ret == NULL ]] && echo NULL || echo "${nret}s")"
        args+=" partition_interval=$([[ $a_iv == NULL ]] && echo NULL || echo "${niv}s")"
        args+=" premake=$a_pm"
        # half of the interval changes are timed to land just before the
        # point where the first boundary of the new grid is one second
        # ahead: the premade partition starting there is already probed by
        # claimers, and the reshape drops it
        timing="SELECT 'untimed'"
        if [[ $a_iv != NULL ]] && (( RANDOM % 2 == 0 )); then
            d=$(rand 0 3000)
            args+=" timed(-${d}us)"
            timing="SELECT pg_sleep(greatest(0, ceil((e + 1.05) / $niv) * $niv - 1 - $d / 1e6 - e))
                    FROM (SELECT extract(epoch FROM clock_timestamp()) AS e) x"
        fi
        if out=$(sql -v VERBOSITY=sqlstate 2>&1 <<SQL
BEGIN;
$timing;
SELECT clock_timestamp() AS c0 \gset
SELECT idem_configure(retention => $a_ret, partition_interval => $a_iv, premake => $a_pm);
INSERT INTO adv_config (retention_s, long_retention_s, interval_s, premake, args, took_ms)
VALUES ($nret, $([[ $lret == NULL ]] && echo NULL || echo "$lret"), $niv, $npm, '$args',
        round(extract(epoch FROM clock_timestamp() - :'c0'::timestamptz) * 1000));
COMMIT;
SQL
        ); then
            ret=$nret iv=$niv pm=$npm
            echo "$(now_epoch) ok $args -> retention=${ret}s interval=${iv}s premake=$pm" >>"$tmp/configure.log"
        elif grep -q '22023' <<<"$out"; then
            echo "$(now_epoch) refused (22023) $args: $out" >>"$tmp/configure.log"
        else
            echo "$(now_epoch) ERROR $args: $out" >>"$tmp/configure.log"
            echo "$(now_epoch) $args: $out" >>"$tmp/configure.err"
        fi
        # then $LSCOPE's retention, in turn raised, lowered, removed
        sleep_ms "$(rand 200 1000)"
        running || break
        m=$((m + 1))
        case $((m % 3)) in
            1) nl=$(rand 15 "$RET_CEIL") ;;
            2) nl=$(rand 3 5) ;;
            0) nl=NULL ;;
        esac
        a_l=NULL
        [[ $nl == NULL ]] || a_l="make_interval(secs => $nl)"
        args="scope $LSCOPE retention=$([[ $nl == NULL ]] && echo NULL || echo "${nl}s")"
        if out=$(sql -v VERBOSITY=sqlstate 2>&1 <<SQL
BEGIN;
SELECT clock_timestamp() AS c0 \gset
SELECT idem_configure_scope('$LSCOPE', $a_l);
INSERT INTO adv_config (retention_s, long_retention_s, interval_s, premake, args, took_ms)
VALUES ($ret, $([[ $nl == NULL ]] && echo NULL || echo "$nl"), $iv, $pm, '$args',
        round(extract(epoch FROM clock_timestamp() - :'c0'::timestamptz) * 1000));
COMMIT;
SQL
        ); then
            lret=$nl
            echo "$(now_epoch) ok $args" >>"$tmp/configure.log"
        elif grep -q '22023' <<<"$out"; then
            echo "$(now_epoch) refused (22023) $args: $out" >>"$tmp/configure.log"
        else
            echo "$(now_epoch) ERROR $args: $out" >>"$tmp/configure.log"
            echo "$(now_epoch) $args: $out" >>"$tmp/configure.err"
        fi
    done
}

# claims of keys whose latest effect is younger than the smallest retention
# the run can configure must return false (rolled back, so it changes nothing)
sampler_loop() {
    local out
    while running; do
        sleep_ms "$(rand 200 600)"
        running || break
        if out=$(sql -F '|' 2>&1 <<SQL
BEGIN;
SELECT s.key, s.t_before, idem_claim(s.key, adv_key_scope(s.key))::int, clock_timestamp()
FROM (SELECT key, max(t_before) AS t_before FROM adv_effects
      WHERE t_before > clock_timestamp() - make_interval(secs => $RET_CEIL)
      GROUP BY key
      HAVING adv_owed(key, max(t_before), clock_timestamp())
      ORDER BY bool_or(via = 'slow') DESC, random() LIMIT 20) s
WHERE NOT EXISTS (SELECT FROM adv_releases r WHERE r.key = s.key AND r.t_after > s.t_before)
ORDER BY adv_key_scope(s.key), s.key;
ROLLBACK;
SQL
        ); then
            [[ -n $out ]] && printf '%s\n' "$out" >>"$tmp/sampler.log"
        else
            printf '%s %s\n' "$(now_epoch)" "$out" >>"$tmp/sampler.err"
        fi
    done
}

# slow handlers: claim a key, work a while, claim another, work, claim a
# third (in byte order, as everyone does), work, commit: transactions that
# hold claims and partition locks across partition boundaries and
# configuration changes, and claim again after them
slow_loop() {
    local ks k1 k2 k3 out end
    while running; do
        # in (scope, key) order: even numbers ($SCOPE) first
        ks=$( { rand 1 "$HOT"; rand 1 "$HOT"; rand 1 "$NKEYS"; } |
              awk '{print $1 % 2, $1}' | sort -k1,1n -k2,2n | awk '{print $2}' | tr '\n' ' ')
        read -r k1 k2 k3 <<<"$ks"
        end=COMMIT
        (( RANDOM % 100 < ROLLBACK_PCT )) && end=ROLLBACK
        if ! out=$(sql 2>&1 <<SQL
BEGIN;
SELECT adv_claim($k1, 'slow');
SELECT pg_sleep($(rand 2 10) / 10.0);
SELECT adv_claim($k2, 'slow');
SELECT pg_sleep($(rand 2 10) / 10.0);
SELECT adv_claim($k3, 'slow');
SELECT pg_sleep($(rand 0 5) / 10.0);
$end;
SQL
        ); then
            printf '%s %s\n' "$(now_epoch)" "$out" >>"$tmp/slow.err"
        fi
        echo "$end" >>"$tmp/slow.log"
    done
}

: >"$tmp/maintain.log"; : >"$tmp/configure.log"; : >"$tmp/sampler.log"; : >"$tmp/slow.log"
maintain_loop & bg_pids+=($!)
configure_loop & bg_pids+=($!)
sampler_loop & bg_pids+=($!)
slow_loop & bg_pids+=($!)
slow_loop & bg_pids+=($!)
slow_loop & bg_pids+=($!)

echo "pgbench: $CLIENTS clients, ${RUN_SECONDS}s, seed $SEED, keys 1..$NKEYS (30 % of single claims from $HOT hot keys), $ROLLBACK_PCT % rollbacks"
echo "initial shape: retention=${init_ret}s partition_interval=${init_iv}s premake=$init_pm"
rc=0
pgbench -n -M prepared -c "$CLIENTS" -j 2 -T "$RUN_SECONDS" --random-seed="$SEED" \
    -D hot="$HOT" -D nkeys="$NKEYS" -D rb_pct="$ROLLBACK_PCT" \
    -f "$tmp/single.sql@45" -f "$tmp/savepoint.sql@20" -f "$tmp/batch.sql@25" -f "$tmp/release.sql@10" \
    >"$tmp/pgbench.out" 2>&1 || rc=$?
touch "$tmp/stop"
for p in "${bg_pids[@]}"; do wait "$p" 2>/dev/null || true; done
bg_pids=()
grep -E '^(number of transactions actually processed|number of failed|tps)' "$tmp/pgbench.out" | sed 's/^/  /' || true

# a last round, so everything that may be dropped is dropped before the checks
echo "round $(now_epoch)" >>"$tmp/maintain.log"
sql -F '|' -c "SELECT extract(epoch FROM clock_timestamp()), action, object FROM idem_maintain()" \
    >>"$tmp/maintain.log" 2>>"$tmp/maintain.err" || echo "final idem_maintain failed" >>"$tmp/maintain.err"

# at once, while the window is widest: every key whose latest claim is owed
# and not released since must still be claimed
sql >/dev/null <<SQL
CREATE TABLE adv_young AS
SELECT e.key, e.txid, e.t_before, clock_timestamp() AS checked_at,
       adv_min_retention(e.key, e.t_before, clock_timestamp()) AS min_retention,
       idem_claimed(e.key, adv_key_scope(e.key)) AS claimed_at
FROM (SELECT DISTINCT ON (key) key, txid, t_before FROM adv_effects
      WHERE t_before > clock_timestamp() - make_interval(secs => $RET_CEIL)
      ORDER BY key, t_before DESC) e
WHERE adv_owed(e.key, e.t_before, clock_timestamp())
  AND NOT EXISTS (SELECT FROM adv_releases r WHERE r.key = e.key AND r.t_after > e.t_before);
SQL
parts_after=$(sql -c "SELECT coalesce(string_agg(state || ' ' || n, ', '), 'none')
                      FROM (SELECT state, count(*) AS n FROM idempotency.partitions GROUP BY state ORDER BY state) s")


if [[ $rc -ne 0 ]]; then
    grep -vE '^(transaction type|scaling factor|query mode|number of clients|number of threads|duration|latency|initial connection|tps|maximum number of tries|SQL script|  -)' \
        "$tmp/pgbench.out" | head -n 30
    fail "pgbench exited with status $rc (a client got an error)"
fi
for f in maintain configure sampler slow; do
    if [[ -s $tmp/$f.err ]]; then
        echo "--- errors of the $f loop:"
        head -n 10 "$tmp/$f.err"
        fail "the $f loop got errors"
    fi
done

sql -c "CREATE INDEX ON adv_effects (key, t_before); CREATE INDEX ON adv_attempts (key) WHERE NOT claimed;
        CREATE INDEX ON adv_attempts (txid, key); CREATE INDEX ON adv_releases (key); ANALYZE" >/dev/null

# ------------------------------------------------------- what was exercised
q() { sql -c "$1"; }
read -r n_txn n_failed_txn <<<"$(awk '/number of transactions actually processed/ {split($NF, a, "/"); p=a[1]} /number of failed transactions/ {f=$5} END {print p+0, f+0}' "$tmp/pgbench.out")"
IFS='|' read -r calls trues rel_calls rollbacks sp_rollbacks <<<"$(sql -F '|' -c "
    SELECT (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM adv_n_claim_calls),
           (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM adv_n_claim_true),
           (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM adv_n_release_calls),
           (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM adv_n_rollbacks),
           (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM adv_n_sp_rollbacks)")"
IFS='|' read -r c_att c_true c_false c_keys c_eff c_eff_keys c_batches c_batch_keys c_rel c_reproc c_spre c_spre_true <<<"$(sql -F '|' -c "
    SELECT count(*), count(*) FILTER (WHERE claimed), count(*) FILTER (WHERE NOT claimed), count(DISTINCT key),
           (SELECT count(*) FROM adv_effects), (SELECT count(DISTINCT key) FROM adv_effects),
           count(DISTINCT txid) FILTER (WHERE via = 'batch'), count(*) FILTER (WHERE via = 'batch'),
           (SELECT count(*) FROM adv_releases),
           (SELECT count(*) FROM adv_effects WHERE via = 'reprocess'),
           count(*) FILTER (WHERE via = 'sp-reclaim'), count(*) FILTER (WHERE via = 'sp-reclaim' AND claimed)
    FROM adv_attempts")"

rounds=$(grep -c '^round ' "$tmp/maintain.log" || true)
count_action() { awk -F'|' -v a="$1" '$2 == a' "$tmp/maintain.log" | wc -l; }
n_create=$(count_action create); n_seal=$(count_action seal); n_drop=$(count_action drop)
n_extend=$(count_action extend); n_skip=$(count_action 'skip drop (in use)')
# a partition of a class other than the default has its retention in its name
n_drop_class=$(awk -F'|' '$2 == "drop" && $3 ~ /claims_r[0-9]+_/' "$tmp/maintain.log" | wc -l)
n_drop_default=$((n_drop - n_drop_class))
drops_per_class=$(awk -F'|' '$2 == "drop" {c = "default"; if (match($3, /claims_r[0-9]+_/)) c = substr($3, RSTART + 8, RLENGTH - 9) "s"; n[c]++}
                  END {for (c in n) printf "%s%s %d", (s++ ? ", " : ""), c, n[c]}' "$tmp/maintain.log")
max_lag=$(awk '/^round / {if (p) {d = $2 - p; if (d > m) m = d} p = $2} END {printf "%.1f", m}' "$tmp/maintain.log")
n_cfg_ok=$(grep -c ' ok ' "$tmp/configure.log" || true)
n_cfg_refused=$(grep -c ' refused ' "$tmp/configure.log" || true)
IFS='|' read -r n_iv_changes ret_min ret_max <<<"$(sql -F '|' -c "
    SELECT count(*) FILTER (WHERE interval_s <> prev), min(retention_s), max(retention_s)
    FROM (SELECT interval_s, retention_s, lag(interval_s) OVER (ORDER BY at) AS prev FROM adv_config) c")"
# scope changes, by the retention $LSCOPE had in force before (its own or the default)
IFS='|' read -r n_sc n_sc_raised n_sc_lowered n_sc_removed lret_min lret_max <<<"$(sql -F '|' -c "
    SELECT count(*), count(*) FILTER (WHERE lr IS NOT NULL AND lr > prev),
           count(*) FILTER (WHERE lr IS NOT NULL AND lr < prev), count(*) FILTER (WHERE lr IS NULL),
           min(lr), max(lr)
    FROM (SELECT args, long_retention_s AS lr,
                 lag(coalesce(long_retention_s, retention_s)) OVER (ORDER BY at) AS prev FROM adv_config) c
    WHERE args LIKE 'scope %'")"
n_samples=$(wc -l <"$tmp/sampler.log")
n_slow=$(grep -c COMMIT "$tmp/slow.log" || true)

echo "transactions: $n_txn committed or rolled back by pgbench ($n_failed_txn failed), $rollbacks rolled back as a whole"
echo "claim calls: $calls ($trues true, including rolled-back work); committed: $c_att on $c_keys keys, $c_true true, $c_false false"
echo "effects: $c_eff on $c_eff_keys keys ($c_reproc of them reprocessing after a release in the same transaction)"
echo "savepoints: $sp_rollbacks rolled back to; $c_spre committed re-claims after that, $c_spre_true of them true"
echo "slow handlers (three claims over 0.4-2.5 s): $n_slow committed, $(grep -c ROLLBACK "$tmp/slow.log" || true) rolled back"
echo "batches: $c_batches committed idem_claim_many calls over $c_batch_keys distinct keys"
echo "releases: $rel_calls calls, $c_rel committed releases of an existing claim"
echo "maintenance: $rounds rounds, max lag ${max_lag}s; partitions created $n_create, extended $n_extend, sealed $n_seal, dropped $n_drop, drops skipped (in use) $n_skip"
echo "configure: $n_cfg_ok changes ($n_iv_changes of partition_interval, $n_sc of $LSCOPE's retention), $n_cfg_refused refused with 22023; retention between ${ret_min}s and ${ret_max}s"
echo "scope $LSCOPE: $n_sc retention changes ($n_sc_raised raised, $n_sc_lowered lowered, $n_sc_removed removed), own retention between ${lret_min:-?}s and ${lret_max:-?}s (initial ${init_lret}s)"
echo "drops per class: ${drops_per_class:-none} ($n_drop_default default, $n_drop_class of a scope's class)"
sql -F ' ' -c "SELECT '  ' || to_char(at, 'HH24:MI:SS.MS'), 'retention=' || retention_s || 's',
                      '$LSCOPE=' || coalesce(long_retention_s || 's', 'default'), 'interval=' || interval_s || 's',
                      'premake=' || premake, '(' || args || coalesce(', took ' || took_ms || ' ms', '') || ')'
               FROM adv_config ORDER BY at LIMIT 30"
[[ $n_cfg_ok -lt 30 ]] || echo "  ... and $((n_cfg_ok - 29)) more"
grep ' refused ' "$tmp/configure.log" | sed 's/^/  /' | head -n 5 || true
echo "partitions after the last round: $parts_after"
echo "sampler: $n_samples claims of keys younger than their scope's retention in force - ${MARGIN}s"
IFS='|' read -r n_young_s n_young_l <<<"$(sql -F '|' -c "
    SELECT count(*) FILTER (WHERE adv_key_scope(key) = '$SCOPE'), count(*) FILTER (WHERE adv_key_scope(key) = '$LSCOPE')
    FROM adv_young")"

# ------------------------------------------------------------------ checks
# show HEADER SQL: run a query listing violations; print them (at most 20)
# and return their count in $nviol
show() {
    local out
    out=$(sql -F ' | ' -c "$2")
    nviol=0
    if [[ -n $out ]]; then
        nviol=$(wc -l <<<"$out")
        echo "  $1 ($nviol):"
        head -n 20 <<<"$out" | sed 's/^/    /'
    fi
}

# doubled: consecutive effects on a key, no committed release in between,
# the second claimed within the smallest retention in force since the first
doubled_sql="
WITH e AS (
    SELECT key, txid, t_before, t_after, via,
           lag(txid) OVER w AS p_txid, lag(t_before) OVER w AS p_before, lag(via) OVER w AS p_via
    FROM adv_effects WINDOW w AS (PARTITION BY key ORDER BY t_after))
SELECT key, 'first txid ' || p_txid || ' (' || p_via || ') at ' || to_char(p_before, 'HH24:MI:SS.MS'),
       'second txid ' || txid || ' (' || via || ') at ' || to_char(t_after, 'HH24:MI:SS.MS'),
       'gap <= ' || round(extract(epoch FROM t_after - p_before), 3) || 's',
       'min retention ' || adv_min_retention(key, p_before, t_after) || 's'
FROM e
WHERE p_txid IS NOT NULL
  AND t_after - p_before < make_interval(secs => $RET_CEIL)
  AND adv_owed(key, p_before, t_after)
  AND NOT EXISTS (SELECT FROM adv_releases r WHERE r.key = e.key
                  AND r.t_after > e.p_before AND r.t_after < e.t_after)
ORDER BY p_before"
show "doubled effects (two committed effects within retention, no release between)" "$doubled_sql"
n_doubled=$nviol
[[ $n_doubled -eq 0 ]] || fail "$n_doubled doubled effects"

IFS='|' read -r reclaim_release reclaim_expiry <<<"$(sql -F '|' -c "
WITH e AS (SELECT key, t_after, lag(t_before) OVER (PARTITION BY key ORDER BY t_after) AS p_before FROM adv_effects)
SELECT count(*) FILTER (WHERE rel), count(*) FILTER (WHERE NOT rel)
FROM (SELECT EXISTS (SELECT FROM adv_releases r WHERE r.key = e.key AND r.t_after > e.p_before
                     AND r.t_after < e.t_after) AS rel
      FROM e WHERE p_before IS NOT NULL) x")"
echo "re-claims of a key with effects: $reclaim_release after a release, $reclaim_expiry after the retention in force (expiry)"

# lost: a committed false with no own claim and no committed effect that was
# not surely released before the claim
lost_sql="
SELECT a.key, 'txid ' || a.txid || ' (' || a.via || ') got false at ' || to_char(a.t_before, 'HH24:MI:SS.MS'),
       coalesce((SELECT 'latest effect before: txid ' || e.txid || ' at ' || to_char(e.t_before, 'HH24:MI:SS.MS')
                 FROM adv_effects e WHERE e.key = a.key AND e.t_before < a.t_after
                 ORDER BY e.t_before DESC LIMIT 1), 'no effect before'),
       coalesce((SELECT 'released by txid ' || r.txid || ' at ' || to_char(r.t_before, 'HH24:MI:SS.MS')
                 FROM adv_releases r WHERE r.key = a.key AND r.t_before < a.t_after
                 ORDER BY r.t_before DESC LIMIT 1), 'no release before')
FROM adv_attempts a
WHERE NOT a.claimed
  AND NOT EXISTS (SELECT FROM adv_attempts o WHERE o.txid = a.txid AND o.key = a.key
                  AND o.claimed AND o.t_after <= a.t_before)
  AND NOT EXISTS (
      SELECT FROM (SELECT e.txid, e.t_after FROM adv_effects e
                   WHERE e.key = a.key AND e.t_before < a.t_after AND e.txid <> a.txid
                   ORDER BY e.t_before DESC LIMIT 3) e
      WHERE NOT EXISTS (
          SELECT FROM adv_releases r
          WHERE r.key = a.key AND r.txid <> e.txid AND pg_visible_in_snapshot(e.txid, r.snap)
            AND ((r.txid = a.txid AND r.t_after <= a.t_before)
                 OR (r.txid <> a.txid AND pg_visible_in_snapshot(r.txid, a.snap)))))
ORDER BY a.t_before"
show "lost (a committed claim got false with no committed, unreleased claim)" "$lost_sql"
n_lost=$nviol
[[ $n_lost -eq 0 ]] || fail "$n_lost claims answered false with nothing to be a duplicate of"

# claims and effects agree
show "true claims without exactly one effect" "
SELECT a.key, 'txid ' || a.txid, (SELECT count(*) FROM adv_effects e WHERE e.txid = a.txid AND e.key = a.key) || ' effects'
FROM adv_attempts a WHERE a.claimed
  AND (SELECT count(*) FROM adv_effects e WHERE e.txid = a.txid AND e.key = a.key) <> 1"
n_mismatch=$nviol
show "effects without a true claim" "
SELECT e.key, 'txid ' || e.txid FROM adv_effects e
WHERE NOT EXISTS (SELECT FROM adv_attempts a WHERE a.txid = e.txid AND a.key = e.key AND a.claimed)"
n_mismatch=$((n_mismatch + nviol))
show "keys with more claim rows in idempotency.claims than effects" "
SELECT c.key, c.n || ' claim rows', coalesce(e.n, 0) || ' effects'
FROM (SELECT key COLLATE \"C\" AS key, count(*) AS n FROM idempotency.claims
      WHERE scope IN ('$SCOPE', '$LSCOPE') AND scope = adv_key_scope(key) GROUP BY 1) c
LEFT JOIN (SELECT key COLLATE \"C\" AS key, count(*) AS n FROM adv_effects GROUP BY 1) e USING (key)
WHERE c.n > coalesce(e.n, 0)"
n_mismatch=$((n_mismatch + nviol))
[[ $n_mismatch -eq 0 ]] || fail "$n_mismatch disagreements between claims and effects"

# dropped early (checked right after the run, above)
IFS='|' read -r n_young young_window <<<"$(sql -F '|' -c "
    SELECT count(*), coalesce(round(extract(epoch FROM max(checked_at - t_before)), 1), 0) FROM adv_young")"
show "claims gone before their retention (idem_claimed is NULL right after the run)" "
SELECT key, 'effect txid ' || txid || ' at ' || to_char(t_before, 'HH24:MI:SS.MS'),
       'age ' || round(extract(epoch FROM checked_at - t_before), 3) || 's',
       'min retention since ' || min_retention || 's'
FROM adv_young WHERE claimed_at IS NULL ORDER BY t_before"
n_dropped=$nviol
n_raised_owed=$(sql -c "SELECT count(*) FROM adv_young
                        WHERE checked_at - t_before >= make_interval(secs => min_retention - $MARGIN)")
echo "retention check: $n_young keys ($n_young_s of $SCOPE, $n_young_l of $LSCOPE) with owed claims (oldest ${young_window}s) checked with idem_claimed(), $n_raised_owed of them older than the smallest retention in force since them (owed for a raised retention)"

# sampler claims that returned true, unless a release committed in between
sql -c "CREATE TABLE adv_samples (key text, t_before timestamptz, claimed int, at timestamptz)" >/dev/null
if [[ -s $tmp/sampler.log ]]; then
    sql -c "\\copy adv_samples FROM '$tmp/sampler.log' WITH (DELIMITER '|')" >/dev/null
fi
show "sampler: claims of young, unreleased keys that returned true" "
SELECT s.key, 'effect at ' || to_char(s.t_before, 'HH24:MI:SS.MS'), 'claimed again at ' || to_char(s.at, 'HH24:MI:SS.MS'),
       'min retention since ' || adv_min_retention(s.key, s.t_before, s.at) || 's'
FROM adv_samples s WHERE s.claimed = 1
  AND adv_owed(s.key, s.t_before, s.at)
  AND NOT EXISTS (SELECT FROM adv_releases r WHERE r.key = s.key AND r.t_after > s.t_before AND r.t_before < s.at)
ORDER BY s.at"
n_dropped=$((n_dropped + nviol))
[[ $n_dropped -eq 0 ]] || fail "$n_dropped claims dropped before their retention"

echo "violations: doubled $n_doubled, lost $n_lost, mismatched $n_mismatch, dropped early $n_dropped"

# --------------------------------------------------- was it all exercised?
need() { [[ $2 -ge $3 ]] || fail "not exercised: $1 ($2, expected at least $3)"; }
min_txn=$((RUN_SECONDS * 40))
need "committed claim calls" "$c_att" "$min_txn"
need "committed false answers" "$c_false" 10
need "rollbacks" "$rollbacks" 1
need "savepoint rollbacks" "$sp_rollbacks" 1
need "re-claims after a savepoint rollback" "$c_spre" 1
need "idem_claim_many batches" "$c_batches" 1
need "committed releases" "$c_rel" 1
need "reprocessing effects" "$c_reproc" 1
need "maintenance rounds" "$rounds" 3
need "partition seals" "$n_seal" 1
need "partition drops" "$n_drop" 1
need "partition drops of the default class" "$n_drop_default" 1
need "partition drops of a scope's own class" "$n_drop_class" 1
need "scope retention raised" "$n_sc_raised" 1
need "scope retention lowered" "$n_sc_lowered" 1
need "scope retention removed" "$n_sc_removed" 1
need "configure changes" "$n_cfg_ok" 2
need "partition_interval changes" "$n_iv_changes" 1
need "sampler claims" "$n_samples" 1
need "keys checked for retention at the end" "$n_young" 1
need "keys of $SCOPE checked for retention at the end" "$n_young_s" 1
need "keys of $LSCOPE checked for retention at the end" "$n_young_l" 1

need "slow handlers" "$n_slow" 1

echo "runtime: $(awk -v a="$started" -v b="$(now_epoch)" 'BEGIN {printf "%.0f", b - a}')s"
if [[ $failed -ne 0 ]]; then
    echo "claims adversarial: FAILED"
    exit 1
fi
echo "claims adversarial: ok"
