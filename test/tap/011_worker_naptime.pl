# SIGHUP changes idempotency.naptime of a running worker: with a naptime of
# an hour no round runs; after ALTER SYSTEM SET idempotency.naptime = 1 and
# pg_reload_conf() rounds resume within seconds, in the same worker process.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('naptime',
	($ENV{IDEM_TAP_PORT} ? (port => $ENV{IDEM_TAP_PORT}) : ()));
$node->init;
$node->append_conf(
	'postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.database = 'postgres'
idempotency.naptime = 1
});
$node->start;

my $worker_pid_sql = q{
	SELECT pid FROM pg_stat_activity
	 WHERE backend_type = 'idempotency maintenance' AND datname = 'postgres'};
my $newest_sql = 'SELECT max(upper) FROM idempotency.partition_registry';

$node->safe_psql(
	'postgres', q{
CREATE EXTENSION idempotency;
SELECT idem_configure(retention => '1 minute', partition_interval => '1 second', premake => 2);
UPDATE idempotency.partition_registry
   SET lower = lower - interval '30 days', upper = upper - interval '30 days';
});

# with naptime 1 the worker keeps 1-second partitions ahead of now
ok( $node->poll_query_until(
		'postgres', "SELECT ($newest_sql) > now() + interval '1 second'"),
	'rounds run with naptime 1');
my $pid = $node->safe_psql('postgres', $worker_pid_sql);
isnt($pid, '', "worker pid $pid");

# naptime 1 hour: the reload wakes the worker, which then sleeps for an hour
my $offset = -s $node->logfile;
$node->safe_psql('postgres',
	"ALTER SYSTEM SET idempotency.naptime = '1h'; SELECT pg_reload_conf();");
$node->wait_for_log(qr/parameter "idempotency.naptime" changed to "1h"/,
	$offset);
is($node->safe_psql('postgres', 'SHOW idempotency.naptime'),
	'1h', 'naptime reloaded as 1h');
sleep 2;    # a round already under way may still finish
my $newest = $node->safe_psql('postgres', $newest_sql);

# premake is 2 seconds: without rounds, the newest partition falls behind now
ok( $node->poll_query_until(
		'postgres', "SELECT ($newest_sql) < now() - interval '2 seconds'"),
	'newest partition falls behind now');
is($node->safe_psql('postgres', $newest_sql),
	$newest, 'no round ran with naptime 1h');

# claims still work while maintenance lags (they use the newest partition)
is($node->safe_psql('postgres', "SELECT idem_claim('lag')"),
	't', 'claim while maintenance lags');
is($node->safe_psql('postgres', "SELECT idem_claim('lag')"),
	'f', 'duplicate found while maintenance lags');

# back to 1 second: rounds resume at once
$node->safe_psql('postgres',
	"ALTER SYSTEM SET idempotency.naptime = 1; SELECT pg_reload_conf();");
ok( $node->poll_query_until(
		'postgres', "SELECT ($newest_sql) > now() + interval '1 second'"),
	'rounds resume after reloading naptime 1');
is($node->safe_psql('postgres', $worker_pid_sql),
	$pid, 'same worker process throughout');
is($node->safe_psql('postgres', "SELECT idem_claim('lag')"),
	'f', 'the claim made while lagging is still found');

$node->stop;
done_testing();
