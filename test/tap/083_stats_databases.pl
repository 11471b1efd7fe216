# The shared stats table between databases (issue 19, findings 7a and 7b):
# a claimer in one database cannot push another database's scopes into its
# overflow row -- not with a transaction it rolls back (nothing it did
# counts), nor with committed claims in made-up scopes (each database that
# counts keeps a fair share of idempotency.stats_max_scopes, taken back
# from a database holding more); a count delayed across a reset lands in
# its own scope, never in the row another database made meanwhile; a
# superuser resets every database at once, a grantee only its own; a
# transaction claiming in thousands of scopes loses no count.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = idem_node('statsdb',
	conf => "shared_preload_libraries = 'idempotency'\n"
	  . "idempotency.stats_max_scopes = 10\n");
foreach my $db (qw(noisy quiet))
{
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	$node->safe_psql($db, 'CREATE EXTENSION idempotency');
}

# rows of database $db: "scope=claims" for its own rows, "(overflow)=claims" for its overflow row
sub rows
{
	my ($db) = @_;
	return $node->safe_psql(
		$db, q{
SELECT coalesce(string_agg(coalesce(scope, '(overflow)') || '=' || claims, ',' ORDER BY scope NULLS LAST), '')
  FROM idempotency.stats WHERE relation IS NULL AND claims IS NOT NULL});
}

# ---- 7a. a rolled-back flood takes no room ----
$node->safe_psql(
	'noisy', q{
BEGIN;
SELECT count(*) FROM (SELECT idem_claim('k', 'fake-' || g) FROM generate_series(1, 1000) g) c;
ROLLBACK;});
is($node->safe_psql('noisy', 'SELECT scopes_tracked FROM idempotency.stats_info()'),
	'0', 'a flood of claims that rolled back takes no row');
$node->safe_psql('quiet',
	"SELECT idem_claim('k', 'real-' || g) FROM generate_series(1, 3) g");
is(rows('quiet'), 'real-1=1,real-2=1,real-3=1',
	'the other database\'s real scopes have rows of their own');

# ---- 7a. a committed flood takes its share, and gives back what is above it ----
$node->safe_psql('noisy',
	"SELECT count(*) FROM (SELECT idem_claim('k', 'fake-' || g) FROM generate_series(1, 20) g) c");
is( $node->safe_psql(
		'noisy',
		"SELECT count(*) FILTER (WHERE scope LIKE 'fake-%'), sum(claims) FROM idempotency.stats"
		  . ' WHERE relation IS NULL AND claims IS NOT NULL'),
	'7|20',
	'the flood takes the 7 free rows; the rest counts in its overflow row (nothing lost)');
is( $node->safe_psql(
		'quiet', 'SELECT scopes_tracked, database_scopes, fair_share FROM idempotency.stats_info()'),
	'10|3|5', 'the table is full: 10 rows, 3 of them quiet\'s, a fair share of 10 / 2 databases');
$node->safe_psql('quiet',
	"SELECT idem_claim('k', 'real-' || g) FROM generate_series(4, 6) g");
is(rows('quiet'), 'real-1=1,real-2=1,real-3=1,real-4=1,real-5=1,(overflow)=1',
	'quiet takes rows back up to its fair share (5); its sixth scope overflows');
is( $node->safe_psql(
		'noisy',
		"SELECT count(*) FILTER (WHERE scope LIKE 'fake-%'), sum(claims) FROM idempotency.stats"
		  . ' WHERE relation IS NULL AND claims IS NOT NULL'),
	'5|20',
	'noisy gave up the 2 rows it held beyond its share: their counts moved to its overflow row');
is( $node->safe_psql(
		'noisy', 'SELECT scopes_tracked, database_scopes, fair_share FROM idempotency.stats_info()'),
	'10|5|5', 'both hold their fair share now');
# more made-up scopes in noisy take nothing from quiet
$node->safe_psql('noisy',
	"SELECT count(*) FROM (SELECT idem_claim('k', 'more-' || g) FROM generate_series(1, 20) g) c");
is(rows('quiet'), 'real-1=1,real-2=1,real-3=1,real-4=1,real-5=1,(overflow)=1',
	'a database at its share takes no row from another at its share');

# ---- 7b. a count delayed across a reset stays in its scope ----
# in quiet: one scope row, 'race', whose payload a session will mismatch;
# that session stops after it found the row; quiet is reset (the row is
# removed) and noisy makes a row at once (reusing the memory); then the
# mismatch is counted
$node->safe_psql('quiet',
	"SELECT idem_stats_reset(); SELECT idem_claim('m', 'race', '{\"v\": 1}')");
$node->safe_psql('noisy', 'SELECT idem_stats_reset()');
my $timer = IPC::Run::timer($PostgreSQL::Test::Utils::timeout_default);
my $hold = bg_psql($node, 'quiet', 'hold', $timer, 'SELECT pg_advisory_lock(7370);', 'held');
my $s1 = bg_psql(
	$node, 'quiet', 's1', $timer, q{
SET idempotency.debug_wait_point = 'stats-count';
DO $$ BEGIN PERFORM idem_claim('m', 'race', '{"v": 2}');
          EXCEPTION WHEN SQLSTATE 'IK001' THEN NULL; END $$;
\echo mismatched
});
ok( $node->poll_query_until(
		'quiet', q{
SELECT count(*) = 1 FROM pg_locks
 WHERE locktype = 'advisory' AND objid = 7370 AND NOT granted}),
	'the mismatching session waits before counting');
$node->safe_psql('quiet', 'SELECT idem_stats_reset()');
$node->safe_psql('noisy', "SELECT idem_claim('k', 'victim')");
bg_feed($hold, 'SELECT pg_advisory_unlock(7370);', 'released');
$s1->{h}->pump until $s1->{out} =~ /mismatched/ || $timer->is_expired;
like($s1->{out}, qr/mismatched/, 'the mismatch was counted');
is( $node->safe_psql(
		'noisy', "SELECT claims, payload_mismatches FROM idempotency.stats WHERE scope = 'victim'"),
	'1|0', 'the other database\'s new row got nothing of it');
is( $node->safe_psql(
		'quiet', q{SELECT coalesce(scope, '(overflow)') || '=' || payload_mismatches
		             FROM idempotency.stats WHERE payload_mismatches > 0}),
	'race=1', 'the mismatch counts in its own scope (after the reset: the new period)');
$_->{h}->finish foreach ($hold, $s1);

# ---- reset: every database for a superuser, its own for a grantee ----
$node->safe_psql('postgres', 'CREATE ROLE operator LOGIN');
$node->safe_psql($_, "SELECT idem_grant('operator', 'operator')")
  foreach qw(noisy quiet);
my ($ret, $out, $err) = $node->psql('quiet',
	"\\set VERBOSITY verbose\nSELECT idem_stats_reset(all_databases => true)",
	extra_params => [ '-U', 'operator' ]);
like($err, qr/42501: permission denied to reset the statistics of every database/,
	'a grantee may not reset every database (42501)');
isnt(rows('noisy'), '', 'noisy kept its counters');
($ret, $out, $err) = $node->psql('quiet', "\\set VERBOSITY verbose\nSELECT idem_stats_reset(NULL)");
like($err, qr/22004: all_databases must not be null/, 'NULL is refused (22004)');
isnt(rows('noisy'), '', 'noisy kept its counters');
$node->safe_psql('quiet', 'SELECT idem_stats_reset()', extra_params => [ '-U', 'operator' ]);
is(rows('quiet'), '', 'a grantee resets its own database');
isnt(rows('noisy'), '', 'and only that');
my $before = $node->safe_psql('noisy', 'SELECT stats_reset FROM idempotency.stats_info()');
$node->safe_psql('quiet', 'SELECT idem_stats_reset(all_databases => true)');
is(rows('noisy'), '', 'a superuser resets every database');
is( $node->safe_psql(
		'noisy', "SELECT stats_reset > '$before', scopes_tracked FROM idempotency.stats_info()"),
	't|0', 'every database\'s stats_reset moved; nothing tracked');

# ---- a transaction claiming in very many scopes: bounded memory, nothing lost ----
$node->safe_psql('quiet',
	"SELECT count(*) FROM (SELECT idem_claim('k', 'many-' || g) FROM generate_series(1, 5000) g) c");
is( $node->safe_psql(
		'quiet', 'SELECT sum(claims), count(*) FILTER (WHERE scope IS NOT NULL) FROM idempotency.stats'
		  . ' WHERE relation IS NULL AND claims IS NOT NULL'),
	'5000|10', 'all 5000 claims counted: 10 scopes with rows, the rest in the overflow row');

done_testing();
