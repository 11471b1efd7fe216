# pg_terminate_backend of the launcher: its workers go with it (so the
# restarted launcher cannot double them), the postmaster restarts the
# launcher, and it starts exactly one worker per database again.
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = idem_node('launcher', conf => worker_conf('postgres'));
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

my $count_sql = q{
	SELECT count(*) FROM pg_stat_activity WHERE backend_type = '%s'};
ok( $node->poll_query_until(
		'postgres', sprintf($count_sql, 'idempotency maintenance'), '1'),
	'one worker');
my $launcher = $node->safe_psql('postgres',
	"SELECT pid FROM pg_stat_activity WHERE backend_type = 'idempotency launcher'");
isnt($launcher, '', "launcher pid $launcher");

$node->safe_psql('postgres', "SELECT pg_terminate_backend($launcher)");
ok( $node->poll_query_until(
		'postgres', sprintf($count_sql, 'idempotency maintenance'), '0'),
	'the worker stops with its launcher');
ok( $node->poll_query_until(
		'postgres',
		"SELECT count(*) = 1 FROM pg_stat_activity WHERE backend_type = 'idempotency launcher' AND pid <> $launcher"
	),
	'the postmaster restarts the launcher');
ok( $node->poll_query_until(
		'postgres', sprintf($count_sql, 'idempotency maintenance'), '1'),
	'which starts the worker again');
sleep 2;
is($node->safe_psql('postgres', sprintf($count_sql, 'idempotency maintenance')),
	'1', 'exactly one worker for the database');
is($node->safe_psql('postgres', "SELECT idem_claim('after')"), 't', 'claims work');

$node->stop;
done_testing();
