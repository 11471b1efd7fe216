# pg_cron runs idem_maintain() beside the maintenance worker: the job's runs
# succeed in cron.job_run_details, the worker keeps running and maintaining,
# and neither logs an error (concurrent rounds serialise on a try lock: the
# loser returns at once).  pg_cron 1.4 schedules by the minute, so this test
# waits for the next minute boundary.
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = idem_node(
	'cron', conf => q{
shared_preload_libraries = 'pg_cron,idempotency'
cron.database_name = 'postgres'
cron.use_background_workers = on
max_worker_processes = 16
idempotency.database = 'postgres'
idempotency.naptime = 1
});

$node->safe_psql('postgres', 'CREATE EXTENSION pg_cron');
setup_second_partitions($node, 'postgres', retention => '3 seconds', premake => 3);
note('pg_cron version '
	  . $node->safe_psql('postgres',
		"SELECT extversion FROM pg_extension WHERE extname = 'pg_cron'"));

ok(wait_partitions_ahead($node, 'postgres'), 'worker maintains');
my $pid = worker_pid($node, 'postgres');
isnt($pid, '', "worker pid $pid");

# the schedule documented in the README
my $offset = -s $node->logfile;
my $jobid = $node->safe_psql('postgres',
	"SELECT cron.schedule('idempotency-maintenance', '* * * * *', 'SELECT idem_maintain()')"
);
like($jobid, qr/^\d+$/, "job scheduled (jobid $jobid)");

# the same job for a maintenance role that is not a superuser: the
# operator capability is all it needs of ours (the round runs as the
# extension's owner), USAGE on schema cron all pg_cron needs
$node->safe_psql(
	'postgres', q{
CREATE ROLE maint LOGIN;
SELECT idem_grant('maint', 'operator');
GRANT USAGE ON SCHEMA cron TO maint;
});
my $maint_jobid = $node->safe_psql('postgres',
	"SET ROLE maint; SELECT cron.schedule('idempotency-maintenance-role', '* * * * *', 'SELECT idem_maintain()')"
);
like($maint_jobid, qr/^\d+$/, "job scheduled by a non-superuser (jobid $maint_jobid)");

ok( $node->poll_query_until(
		'postgres', qq{
SELECT count(*) >= 1 FROM cron.job_run_details
 WHERE jobid = $jobid AND status = 'succeeded'}),
	'pg_cron ran idem_maintain() with status succeeded');
ok( $node->poll_query_until(
		'postgres', qq{
SELECT count(*) >= 1 FROM cron.job_run_details
 WHERE jobid = $maint_jobid AND status = 'succeeded' AND username = 'maint'}),
	'and as the non-superuser maintenance role');
is( $node->safe_psql(
		'postgres', qq{
SELECT count(*) FROM cron.job_run_details
 WHERE jobid IN ($jobid, $maint_jobid) AND status NOT IN ('succeeded', 'running', 'starting')}),
	'0',
	'no failed pg_cron run');
note('job_run_details: '
	  . $node->safe_psql('postgres',
		"SELECT string_agg(status || ' ' || coalesce(return_message, ''), '; ') FROM cron.job_run_details WHERE jobid = $jobid"
	  ));

# the worker was not disturbed
is(worker_pid($node, 'postgres'), $pid, 'the worker kept running beside pg_cron');
my $newest = $node->safe_psql('postgres', $newest_sql);
ok( $node->poll_query_until(
		'postgres', "SELECT ($newest_sql) > '$newest'"),
	'and keeps maintaining');
is($node->safe_psql('postgres', "SELECT idem_claim('cron')"), 't', 'claims work');
unlike(slurp_file($node->logfile, $offset),
	qr/ERROR:|exited with exit code/,
	'no error logged and no worker exited');

$node->safe_psql('postgres', "SELECT cron.unschedule($jobid), cron.unschedule($maint_jobid)");
$node->stop;
done_testing();
