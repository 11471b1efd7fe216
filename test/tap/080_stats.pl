# idempotency.stats with the library preloaded: counters from parallel
# clients add up exactly (claims, duplicates, payload mismatches, stale
# guarded writes); releases, requests and invalid transitions count;
# claims, duplicates and releases count what committed (not a rolled-back
# transaction or subtransaction, nor one whose commit failed; a prepared
# transaction when it is prepared), payload mismatches and request
# conflicts although their transaction fails;
# idem_stats_reset() resets one database only and lets overflowing scopes in
# again; scopes beyond idempotency.stats_max_scopes count in the overflow
# row; idempotency.track_stats = off stops counting; counters start again at
# zero after a restart (as documented); a streaming standby answers the view.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = idem_node(
	'stats',
	init => [ allows_streaming => 1 ],
	conf => "shared_preload_libraries = 'idempotency'\n"
	  . "idempotency.stats_max_scopes = 8\n"
	  . "max_connections = 40\n"
	  . "max_prepared_transactions = 2\n");
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

sub stat_row
{
	my ($node, $where, $cols) = @_;
	return $node->safe_psql('postgres', "SELECT $cols FROM idempotency.stats WHERE $where");
}

is( $node->safe_psql(
		'postgres',
		'SELECT preloaded, max_scopes, scopes_tracked FROM idempotency.stats_info()'),
	't|8|0',
	'preloaded, bound 8, nothing tracked yet');

# ---- 1. parallel clients add up exactly ----
$node->safe_psql(
	'postgres', q{
CREATE TABLE mismatch_log (k text);
-- a claim with a payload; a mismatch (IK001) is logged and swallowed
CREATE FUNCTION claim_pay(k text, v int) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM idem_claim(k, 'pay', jsonb_build_object('v', v));
EXCEPTION WHEN SQLSTATE 'IK001' THEN
    INSERT INTO mismatch_log VALUES (k);
END $$;
CREATE TABLE acct (id int PRIMARY KEY, version int NOT NULL);
INSERT INTO acct SELECT g, 0 FROM generate_series(1, 10) g;
SELECT idem_guard_version('acct');
CREATE TABLE update_log (applied int);
CREATE FUNCTION set_version(i int, v int) RETURNS void LANGUAGE plpgsql AS $$
DECLARE n int;
BEGIN
    UPDATE acct SET version = v WHERE id = i;
    GET DIAGNOSTICS n = ROW_COUNT;
    INSERT INTO update_log VALUES (n);
END $$;
});

my $clients = 8;
my $per_client = 300;
$node->pgbench(
	"--no-vacuum --client=$clients --jobs=2 --transactions=$per_client",
	0,
	[qr{processed: 2400/2400}],
	[qr{^$}],
	'8 parallel clients: claims, payload claims, guarded updates',
	{
		'claims@4' => q{
\set k random(1, 400)
SELECT idem_claim('k' || :k, 'par');
},
		'payload@3' => q{
\set k random(1, 60)
\set v random(1, 2)
SELECT claim_pay('m' || :k, :v);
},
		'guard@3' => q{
\set i random(1, 10)
\set v random(1, 200)
SELECT set_version(:i, :v);
}
	});

my ($calls_par, $calls_pay, $calls_guard) = split /\|/, $node->safe_psql(
	'postgres', q{
SELECT (SELECT count(*) FROM idempotency.claims WHERE scope = 'par'),
       (SELECT count(*) FROM idempotency.claims WHERE scope = 'pay'),
       (SELECT count(*) FROM update_log)});
my ($par_claims, $par_dups) =
  split /\|/, stat_row($node, "scope = 'par'", 'claims, duplicates');
is($par_claims, $calls_par, "scope par: claims = rows claimed ($calls_par)");
my ($pay_claims, $pay_dups, $pay_mism) = split /\|/,
  stat_row($node, "scope = 'pay'", 'claims, duplicates, payload_mismatches');
is($pay_claims, $calls_pay, "scope pay: claims = rows claimed ($calls_pay)");
is($pay_mism, $node->safe_psql('postgres', 'SELECT count(*) FROM mismatch_log'),
	"scope pay: payload mismatches = IK001 raised ($pay_mism), though each rolled back");
cmp_ok($pay_mism, '>', 0, 'scope pay: some mismatches happened');
is( $par_claims + $par_dups + $pay_claims + $pay_dups + $pay_mism + $calls_guard,
	$clients * $per_client,
	'every call counted exactly once: claims + duplicates + mismatches + guarded updates = 2400');
is( stat_row($node, "relation = 'acct'::regclass", 'stale_skips'),
	$node->safe_psql('postgres', 'SELECT count(*) FROM update_log WHERE applied = 0'),
	'acct: stale skips = updates the guard skipped');
is( $node->safe_psql(
		'postgres',
		"SELECT last_duplicate_at >= last_claim_at - interval '1 minute'"
		  . " AND stats_reset <= last_claim_at FROM idempotency.stats WHERE scope = 'par'"),
	't',
	'scope par: last_claim_at, last_duplicate_at and stats_reset are set');

# ---- 2. releases, invalid transitions, requests ----
my $released = $node->safe_psql('postgres',
	"SELECT count(*) FROM (VALUES ('k1'), ('k2')) v(k) WHERE idem_claimed(k, 'par') IS NOT NULL");
$node->safe_psql(
	'postgres', q{
SELECT idem_release('k1', 'par'), idem_release('k2', 'par'), idem_release('never', 'par');
CREATE TABLE orders (id int PRIMARY KEY, state text);
INSERT INTO orders VALUES (1, 'new');
SELECT idem_guard_transitions('orders', 'state', '{"new": ["paid"], "paid": ["shipped"]}');
UPDATE orders SET state = 'shipped' WHERE id = 1;
UPDATE orders SET state = 'paid' WHERE id = 1;
UPDATE orders SET state = 'new' WHERE id = 1;
SELECT status FROM idem_request_begin('r-1', 'api', '{"n": 1}');
});
is(stat_row($node, "scope = 'par'", 'releases'), $released,
	"scope par: releases = claims released ($released)");
is(stat_row($node, "relation = 'orders'::regclass", 'invalid_transitions'),
	'2', 'orders: 2 invalid transitions');
my ($ret, $out, $err) = $node->psql('postgres',
	q{SELECT status FROM idem_request_begin('r-1', 'api', '{"n": 1}', wait => '0')});
like($err, qr/is in progress/, 'a second begin while the lease lives: IK002');
$node->safe_psql('postgres', q{SELECT idem_request_complete('r-1', 'api', '{"ok": true}')});
$node->safe_psql('postgres', q{SELECT status FROM idem_request_begin('r-1', 'api', '{"n": 1}')});
is( stat_row(
		$node, "scope = 'request:api'",
		'claims, duplicates, requests_started, requests_completed, requests_conflicted'),
	'1|1|1|1|1',
	'request:api: 1 started, 1 completed, 1 conflicted (its transaction failed, so its duplicate'
	  . ' does not count); the replay is a duplicate');

# ---- 2b. what committed counts ----
$node->safe_psql(
	'postgres', q{
CREATE TABLE deferred_check (k int UNIQUE DEFERRABLE INITIALLY DEFERRED);
-- a transaction that rolls back: its claims, duplicates and releases do not count
BEGIN;
SELECT idem_claim('a' || g, 'tx') FROM generate_series(1, 3) g;
SELECT idem_claim('a1', 'tx');
SELECT idem_release('a2', 'tx');
ROLLBACK;
-- savepoints: a rolled-back subtransaction's claims do not count, a released one's do
BEGIN;
SELECT idem_claim('b1', 'tx');
SAVEPOINT s1;
SELECT idem_claim('b2', 'tx');
SAVEPOINT s2;
SELECT idem_claim('b3', 'tx');
ROLLBACK TO SAVEPOINT s1;
SELECT idem_claim('b4', 'tx');
SAVEPOINT s3;
SELECT idem_claim('b5', 'tx'), idem_claim('b1', 'tx');
RELEASE SAVEPOINT s3;
COMMIT;
-- an exception block is a subtransaction too
DO $$
BEGIN
    PERFORM idem_claim('c1', 'tx');
    RAISE EXCEPTION 'undo';
EXCEPTION WHEN raise_exception THEN
    PERFORM idem_claim('c2', 'tx');
END $$;
});
is(stat_row($node, "scope = 'tx'", 'claims, duplicates, releases'),
	'4|1|0', "scope tx: b1, b4, b5 and c2 claimed, b1 again a duplicate; nothing of what rolled back");
# a transaction whose commit fails (a deferred unique check)
my ($rc) = $node->psql('postgres', q{
BEGIN;
SELECT idem_claim('d1', 'tx');
INSERT INTO deferred_check VALUES (1), (1);
COMMIT;});
isnt($rc, 0, 'a commit that fails its deferred check');
is(stat_row($node, "scope = 'tx'", 'claims'), '4', 'scope tx: the claim of a failed commit does not count');
# a payload mismatch counts although its transaction rolls back
$node->psql('postgres', q{
BEGIN;
SELECT idem_claim('p1', 'tx', '{"v": 1}');
COMMIT;
BEGIN;
SELECT idem_claim('p1', 'tx', '{"v": 2}');
ROLLBACK;});
is(stat_row($node, "scope = 'tx'", 'claims, duplicates, payload_mismatches'),
	'5|1|1', 'scope tx: the mismatch counts, its rolled-back transaction notwithstanding');
# a prepared transaction counts when it is prepared (no hook runs at COMMIT PREPARED)
$node->safe_psql('postgres', q{
BEGIN;
SELECT idem_claim('e1', 'tx');
PREPARE TRANSACTION 'stats_prepared';});
is(stat_row($node, "scope = 'tx'", 'claims'), '6', 'scope tx: a prepared claim counts at PREPARE');
$node->safe_psql('postgres', "COMMIT PREPARED 'stats_prepared'");
is(stat_row($node, "scope = 'tx'", 'claims'), '6', '... and not again at COMMIT PREPARED');
is($node->safe_psql('postgres', "SELECT claims FROM idempotency.consumers WHERE scope = 'tx'"),
	'6', 'scope tx: the counter agrees with the claims the tables hold');
$node->safe_psql('postgres', "SELECT idem_release('b5', 'tx'), idem_release('e1', 'tx')");
is(stat_row($node, "scope = 'tx'", 'releases'), '2', 'scope tx: committed releases count');

# ---- 2c. a replay test leaves the counters as they were ----
# its handler claims (duplicates on redelivery) and mismatches a payload;
# every run rolls back, and idem_check_replay() sandboxes the mismatches
$node->safe_psql(
	'postgres', q{
CREATE FUNCTION replayed(e jsonb) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM idem_claim(e->>'id', 'replayed');
    PERFORM idem_claim('fixed', 'replayed', e);
EXCEPTION WHEN SQLSTATE 'IK001' THEN NULL;
END $$;
});
my $stats_before = $node->safe_psql('postgres', 'SELECT count(*), sum(claims) FROM idempotency.stats');
is( $node->safe_psql(
		'postgres', q{
SELECT count(*) FROM idem_check_replay('replayed(jsonb)',
       ARRAY(SELECT jsonb_build_object('id', 'r' || g) FROM generate_series(1, 5) g), 'SELECT 1')}),
	'20', 'a replay of 20 runs');
is($node->safe_psql('postgres', 'SELECT count(*), sum(claims) FROM idempotency.stats'),
	$stats_before, 'the counters did not move');
is($node->safe_psql('postgres', "SELECT count(*) FROM idempotency.stats WHERE scope = 'replayed'"),
	'0', 'the replay\'s scope has no row');
# the sandbox ends with the call, on error too: a mismatch after it counts
is( $node->safe_psql(
		'postgres', q{
DO $$ BEGIN
    PERFORM count(*) FROM idem_check_replay('replayed(jsonb)', ARRAY['{"id": null}']::jsonb[], 'SELECT 1');
EXCEPTION WHEN null_value_not_allowed THEN NULL;
END $$;
SELECT current_setting('idempotency.stats_sandbox');
SELECT idem_claim('fixed', 'sandbox-after', '{"v": 1}');
DO $$ BEGIN
    PERFORM idem_claim('fixed', 'sandbox-after', '{"v": 2}');
EXCEPTION WHEN SQLSTATE 'IK001' THEN NULL;
END $$;
SELECT payload_mismatches FROM idempotency.stats WHERE scope = 'sandbox-after'}),
	"off\nt\n1", 'after a replay that failed, the sandbox is off and mismatches count');

# ---- 3. the bound: scopes beyond it count in the overflow row ----
is( $node->safe_psql('postgres', 'SELECT scopes_tracked FROM idempotency.stats_info()'),
	'7', 'par, pay, acct, orders, request:api, tx, sandbox-after: 7 rows of the 8 in use');
$node->safe_psql('postgres',
	"SELECT idem_claim('x', 'extra-' || g) FROM generate_series(1, 5) g");
is( $node->safe_psql(
		'postgres',
		'SELECT claims FROM idempotency.stats WHERE scope IS NULL AND relation IS NULL'),
	'4',
	'overflow row: claims of the 4 scopes that found no room');
is( $node->safe_psql(
		'postgres', "SELECT string_agg(scope, ',') FROM idempotency.stats WHERE scope LIKE 'extra-%'"),
	'extra-1', 'only the first of them has a row of its own');
is( $node->safe_psql('postgres', 'SELECT scopes_tracked, dropped FROM idempotency.stats_info()'),
	'8|0', 'the bound is reached; nothing dropped (the overflow row took it)');

# ---- 4. reset: this database only; overflowing scopes find room ----
$node->safe_psql('postgres', 'CREATE DATABASE other');
$node->safe_psql('other',
	"CREATE EXTENSION idempotency; SELECT idem_claim('o', 'other-scope')");
my $before = $node->safe_psql('postgres', 'SELECT stats_reset FROM idempotency.stats_info()');
$node->safe_psql('postgres', 'SELECT idem_stats_reset()');
is( $node->safe_psql(
		'postgres',
		'SELECT count(*) FROM idempotency.stats WHERE claims > 0 OR stale_skips > 0'),
	'0',
	'after reset: nothing counted in this database');
is( $node->safe_psql(
		'postgres',
		"SELECT stats_reset > '$before' FROM idempotency.stats_info()"),
	't', 'after reset: stats_reset moved');
is($node->safe_psql('other', 'SELECT sum(claims) FROM idempotency.stats'),
	'1', 'the other database keeps its counters (its scope took a row from this database,'
	  . ' which held more than its fair share; see 083_stats_databases.pl)');
$node->safe_psql('postgres', "SELECT idem_claim('y', 'extra-2')");
is(stat_row($node, "scope = 'extra-2'", 'claims'),
	'1', 'after reset an overflowed scope has a row of its own');
is( $node->safe_psql(
		'postgres', 'SELECT count(*) FROM idempotency.stats WHERE scope IS NULL AND relation IS NULL'),
	'0', 'after reset: no overflow row until something overflows');

# ---- 5. idempotency.track_stats = off ----
$node->safe_psql('postgres',
	"SET idempotency.track_stats = off; SELECT idem_claim('z', 'extra-2')");
is(stat_row($node, "scope = 'extra-2'", 'claims'),
	'1', 'track_stats = off: the claim is not counted');
$node->safe_psql('postgres', 'CREATE ROLE app LOGIN');
($ret, $out, $err) = $node->psql('postgres', 'SET idempotency.track_stats = off',
	extra_params => [ '-U', 'app' ]);
like($err, qr/permission denied to set parameter/,
	'track_stats is for superusers to change');

# a dropped guarded table leaves no row behind
$node->safe_psql('postgres', 'CREATE TABLE gone (id int PRIMARY KEY, version int NOT NULL);'
	. " SELECT idem_guard_version('gone'); INSERT INTO gone VALUES (1, 2);"
	. ' UPDATE gone SET version = 1; DROP TABLE gone');
is( $node->safe_psql(
		'postgres',
		q{SELECT count(*) FROM idempotency.stats WHERE relation IS NOT NULL AND relation::text ~ '^[0-9]+$'}),
	'0', 'a dropped guarded table has no row');
is( $node->safe_psql('postgres', 'SELECT scopes_tracked FROM idempotency.stats_info()'),
	'3', 'its counters keep their row (beside extra-2 and the other database\'s scope) until a reset');

# ---- 6. a streaming standby answers ----
$node->backup('bkp');
my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($node, 'bkp', has_streaming => 1);
$standby->start;
$node->safe_psql('postgres',
	"SELECT count(e.*) FROM generate_series(1, 3) g, idem_outbox_emit('order', 'o-' || g, 'created', '{}') e");
$node->wait_for_catchup($standby);
is( $standby->safe_psql(
		'postgres',
		"SELECT outbox_pending FROM idempotency.stats WHERE scope = 'outbox:order'"),
	'3', 'standby: outbox backlog from the tables');
is( $standby->safe_psql('postgres', 'SELECT sum(claims) FROM idempotency.consumers'),
	$node->safe_psql('postgres', 'SELECT sum(claims) FROM idempotency.consumers'),
	'standby: consumers as on the primary');
is( $standby->safe_psql('postgres', 'SELECT preloaded, scopes_tracked FROM idempotency.stats_info()'),
	't|0', 'standby: its own counters, none tracked (it takes no claims)');
cmp_ok($node->safe_psql('postgres', 'SELECT scopes_tracked FROM idempotency.stats_info()'),
	'>', 0, 'while the primary tracks its scopes');
$standby->stop;

# ---- 7. restart: counters start again at zero ----
$before = $node->safe_psql('postgres', 'SELECT stats_reset FROM idempotency.stats_info()');
$node->restart;
is( $node->safe_psql(
		'postgres',
		'SELECT count(*) FROM idempotency.stats WHERE claims > 0 OR stale_skips > 0'),
	'0',
	'after restart: counters are zero');
is( $node->safe_psql(
		'postgres',
		"SELECT stats_reset > '$before' FROM idempotency.stats_info()"),
	't', 'after restart: stats_reset is the start time');
my $kept = $node->safe_psql('postgres',
	"SELECT min(key) FROM idempotency.claims WHERE scope = 'par'");
is($node->safe_psql('postgres', "SELECT idem_claim('$kept', 'par')"),
	'f', 'claims themselves survive the restart');
is(stat_row($node, "scope = 'par'", 'claims, duplicates'),
	'0|1', 'and count again from zero');

done_testing();
