# idempotency.stats with the library preloaded: counters from parallel
# clients add up exactly (claims, duplicates, payload mismatches, stale
# guarded writes); releases, requests and invalid transitions count;
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
	  . "idempotency.stats_max_scopes = 6\n"
	  . "max_connections = 40\n");
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

sub stat_row
{
	my ($node, $where, $cols) = @_;
	return $node->safe_psql('postgres', "SELECT $cols FROM idempotency.stats WHERE $where");
}

is( $node->safe_psql(
		'postgres',
		'SELECT preloaded, max_scopes, scopes_tracked FROM idempotency.stats_info()'),
	't|6|0',
	'preloaded, bound 6, nothing tracked yet');

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
	'1|2|1|1|1',
	'request:api: 1 started, 1 completed, 1 conflicted; the retry and the replay are duplicates');

# ---- 3. the bound: scopes beyond it count in the overflow row ----
is( $node->safe_psql('postgres', 'SELECT scopes_tracked FROM idempotency.stats_info()'),
	'5', 'par, pay, acct, orders, request:api: 5 rows of the 6 in use');
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
	'6|0', 'the bound is reached; nothing dropped (the overflow row took it)');

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
	'1', 'the other database keeps its counters (its claim found no room: overflow row)');
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
	'2', 'its counters keep their row (beside extra-2) until a reset');

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
