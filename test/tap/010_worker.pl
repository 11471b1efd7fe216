# The maintenance background worker with shared_preload_libraries:
# it shows in pg_stat_activity as 'idempotency maintenance', creates and
# drops 1-second partitions on its own, comes back after
# pg_terminate_backend, and an error in a round is logged and retried by the
# same worker process (no exit, no crash loop).
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = idem_node('worker', conf => worker_conf('postgres'));

# the launcher and the worker of database postgres
ok(wait_for_workers($node, 'postgres', 1),
	'worker of database postgres shows in pg_stat_activity');
is( $node->safe_psql(
		'postgres',
		"SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idempotency launcher'"),
	'1',
	'one launcher runs');
is($node->safe_psql('postgres', 'SHOW idempotency.naptime'),
	'1s', 'idempotency.naptime is set');

# 1-second partitions kept for 3 seconds
setup_second_partitions($node, 'postgres', retention => '3 seconds', premake => 3);

# the worker creates 1-second partitions ahead of time ...
ok( $node->poll_query_until(
		'postgres', q{
SELECT count(*) >= 3 FROM idempotency.partitions
 WHERE upper - lower = interval '1 second' AND state = 'future'}),
	'worker premakes 1-second partitions');
# ... and drops the expired ones
ok( $node->poll_query_until(
		'postgres', q{
SELECT count(*) = 0 FROM idempotency.partition_registry
 WHERE upper < now() - interval '1 day'}),
	'worker drops the expired partitions');
ok( $node->poll_query_until(
		'postgres', q{
SELECT count(*) = 0 FROM idempotency.partitions WHERE state = 'expired'}),
	'no expired partitions left');
like(slurp_file($node->logfile),
	qr/idempotency maintenance: drop idempotency\.claims_/,
	'drops are logged');

# claims work while the worker rotates partitions, and a duplicate is found
is($node->safe_psql('postgres', "SELECT idem_claim('w1')"), 't', 'claim w1');
is($node->safe_psql('postgres', "SELECT idem_claim('w1')"),
	'f', 'w1 again is a duplicate');
# gone after retention + partition_interval once maintenance ran
ok( $node->poll_query_until(
		'postgres', "SELECT idem_claimed('w1') IS NULL"),
	'w1 is gone once its partition expired and was dropped');
is($node->safe_psql('postgres', "SELECT idem_claim('w1')"),
	't', 'w1 can be claimed again after retention');

# pg_terminate_backend: the launcher starts it again
my $pid = worker_pid($node, 'postgres');
isnt($pid, '', "worker pid $pid");
is($node->safe_psql('postgres', "SELECT pg_terminate_backend($pid)"),
	't', 'terminate the worker');
ok( $node->poll_query_until(
		'postgres',
		'SELECT count(*) = 1 FROM (' . worker_pid_sql('postgres') . ") w WHERE pid <> $pid"),
	'worker comes back after pg_terminate_backend');
my $pid2 = worker_pid($node, 'postgres');
isnt($pid2, $pid, "new worker pid $pid2");
my $upper = $node->safe_psql('postgres', $newest_sql);
ok($node->poll_query_until('postgres', "SELECT ($newest_sql) > '$upper'"),
	'the new worker maintains');

# an error in a round: logged, retried by the same process, no exit
my $offset = -s $node->logfile;
$node->safe_psql('postgres',
	'ALTER TABLE idempotency.settings RENAME TO settings_broken');
$node->wait_for_log(
	qr/ERROR:  relation "idempotency\.settings" does not exist/, $offset);
$node->wait_for_log(
	qr/LOG:  idempotency maintenance round in database "postgres" failed, retrying in 1 s/,
	$offset);
# let it fail a few more rounds
$node->poll_query_until('postgres',
	"SELECT ($newest_sql) < now() - interval '1 second'");
my $log = slurp_file($node->logfile, $offset);
my $failures = () = $log =~ /round in database "postgres" failed/g;
cmp_ok($failures, '>=', 2, "failing round retried every naptime ($failures failures)");
is(worker_pid($node, 'postgres'),
	$pid2, 'the same worker process keeps running through the errors');
unlike($log, qr/background worker "idempotency maintenance" \(PID \d+\) exited/,
	'no worker exited');

$node->safe_psql('postgres',
	'ALTER TABLE idempotency.settings_broken RENAME TO settings');
ok(wait_partitions_ahead($node, 'postgres'),
	'rounds succeed again once the cause is fixed');
is(worker_pid($node, 'postgres'), $pid2, 'still the same worker process');
is($node->safe_psql('postgres', "SELECT idem_claim('w2')"),
	't', 'claims work after the failed rounds');

$node->stop;
done_testing();
