# pg_cron runs idem_maintain() beside the maintenance worker: the job's runs
# succeed in cron.job_run_details, the worker keeps running and maintaining,
# and neither logs an error (concurrent rounds serialise on a try lock: the
# loser returns at once).  pg_cron 1.4 schedules by the minute, so this test
# waits for the next minute boundary.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('cron',
	($ENV{IDEM_TAP_PORT} ? (port => $ENV{IDEM_TAP_PORT}) : ()));
$node->init;
$node->append_conf(
	'postgresql.conf', q{
shared_preload_libraries = 'pg_cron,idempotency'
cron.database_name = 'postgres'
cron.use_background_workers = on
max_worker_processes = 16
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
CREATE EXTENSION pg_cron;
CREATE EXTENSION idempotency;
SELECT idem_configure(retention => '3 seconds', partition_interval => '1 second', premake => 3);
UPDATE idempotency.partition_registry
   SET lower = lower - interval '30 days', upper = upper - interval '30 days';
});
note('pg_cron version '
	  . $node->safe_psql('postgres',
		"SELECT extversion FROM pg_extension WHERE extname = 'pg_cron'"));

ok( $node->poll_query_until(
		'postgres', "SELECT ($newest_sql) > now() + interval '1 second'"),
	'worker maintains');
my $pid = $node->safe_psql('postgres', $worker_pid_sql);
isnt($pid, '', "worker pid $pid");

# the schedule documented in the README
my $offset = -s $node->logfile;
my $jobid = $node->safe_psql('postgres',
	"SELECT cron.schedule('idempotency-maintenance', '* * * * *', 'SELECT idem_maintain()')"
);
like($jobid, qr/^\d+$/, "job scheduled (jobid $jobid)");

ok( $node->poll_query_until(
		'postgres', qq{
SELECT count(*) >= 1 FROM cron.job_run_details
 WHERE jobid = $jobid AND status = 'succeeded'}),
	'pg_cron ran idem_maintain() with status succeeded');
is( $node->safe_psql(
		'postgres', qq{
SELECT count(*) FROM cron.job_run_details
 WHERE jobid = $jobid AND status NOT IN ('succeeded', 'running', 'starting')}),
	'0',
	'no failed pg_cron run');
note('job_run_details: '
	  . $node->safe_psql('postgres',
		"SELECT string_agg(status || ' ' || coalesce(return_message, ''), '; ') FROM cron.job_run_details WHERE jobid = $jobid"
	  ));

# the worker was not disturbed
is($node->safe_psql('postgres', $worker_pid_sql),
	$pid, 'the worker kept running beside pg_cron');
my $newest = $node->safe_psql('postgres', $newest_sql);
ok( $node->poll_query_until(
		'postgres', "SELECT ($newest_sql) > '$newest'"),
	'and keeps maintaining');
is($node->safe_psql('postgres', "SELECT idem_claim('cron')"), 't', 'claims work');
unlike(slurp_file($node->logfile, $offset),
	qr/ERROR:|exited with exit code/,
	'no error logged and no worker exited');

$node->safe_psql('postgres', "SELECT cron.unschedule($jobid)");
$node->stop;
done_testing();
