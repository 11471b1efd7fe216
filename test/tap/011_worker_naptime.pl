# SIGHUP changes idempotency.naptime of a running worker: with a naptime of
# an hour no round runs; after ALTER SYSTEM SET idempotency.naptime = 1 and
# pg_reload_conf() rounds resume within seconds, in the same worker process.
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = idem_node('naptime', conf => worker_conf('postgres'));
setup_second_partitions($node, 'postgres', retention => '1 minute', premake => 2);

# with naptime 1 the worker keeps 1-second partitions ahead of now
ok(wait_partitions_ahead($node, 'postgres'), 'rounds run with naptime 1');
my $pid = worker_pid($node, 'postgres');
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
ok(wait_partitions_ahead($node, 'postgres'),
	'rounds resume after reloading naptime 1');
is(worker_pid($node, 'postgres'), $pid, 'same worker process throughout');
is($node->safe_psql('postgres', "SELECT idem_claim('lag')"),
	'f', 'the claim made while lagging is still found');

$node->stop;
done_testing();
