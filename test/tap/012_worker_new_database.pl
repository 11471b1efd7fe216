# Databases that do not exist, or lack the extension, when the server
# starts: a listed database that does not exist is logged once and looked up
# again every naptime; once created it gets a worker, which logs once that
# the extension is missing and keeps checking; once the extension is created
# the worker maintains it.  A database added to idempotency.database with
# ALTER SYSTEM and pg_reload_conf() gets a worker; one removed loses it.
# A template database is not served.  Throughout, nothing crash-loops and
# the server stays up.
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = idem_node('newdb', conf => worker_conf('late_db, template1'));

sub count_in_log
{
	my ($re, $offset) = @_;
	my $log = slurp_file($node->logfile, $offset);
	my $n = () = $log =~ /$re/g;
	return $n;
}

# a listed database that does not exist: logged once, no worker, no loop
$node->wait_for_log(
	qr/LOG:  database "late_db" listed in idempotency.database does not exist/);
sleep 3;    # three more lookups at naptime 1
is(count_in_log(qr/database "late_db" listed in idempotency.database does not exist/),
	1, 'missing database logged once, not every lookup');
is(worker_pid($node, 'late_db'), '', 'no worker for a database that does not exist');
unlike(slurp_file($node->logfile), qr/exited with exit code/,
	'no worker started and exited for it');

# a template database is not served (a worker would block CREATE DATABASE)
is(count_in_log(qr/database "template1" listed in idempotency.database is a template database and is not served/),
	1, 'template database logged once and not served');
is(worker_pid($node, 'template1'), '', 'no worker for template1');

# created after the server started: the launcher starts its worker
my $offset = -s $node->logfile;
$node->safe_psql('postgres', 'CREATE DATABASE late_db');
ok(wait_for_workers($node, 'late_db', 1),
	'worker starts once the database exists');
my $pid = worker_pid($node, 'late_db');

# no extension yet: logged once, the worker stays and keeps checking
$node->wait_for_log(
	qr/LOG:  extension "idempotency" is not installed in database "late_db"/,
	$offset);
sleep 3;
is( count_in_log(
		qr/extension "idempotency" is not installed in database "late_db"/, $offset),
	1,
	'missing extension logged once, not every round');
is(worker_pid($node, 'late_db'), $pid, 'the worker keeps running without the extension');

# with the extension the worker maintains it
setup_second_partitions($node, 'late_db', retention => '3 seconds', premake => 3);
$node->wait_for_log(
	qr/LOG:  extension "idempotency" is now installed in database "late_db", maintenance starts/,
	$offset);
ok( $node->poll_query_until(
		'late_db', q{
SELECT count(*) >= 3 FROM idempotency.partitions
 WHERE upper - lower = interval '1 second' AND state = 'future'}),
	'worker maintains the database once the extension exists');
ok( $node->poll_query_until(
		'late_db', q{
SELECT count(*) = 0 FROM idempotency.partition_registry
 WHERE upper < now() - interval '1 day'}),
	'and drops its expired partitions');
is($node->safe_psql('late_db', "SELECT idem_claim('n1')"), 't', 'claims work');
is(worker_pid($node, 'late_db'), $pid, 'same worker process all along');

# add a database with ALTER SYSTEM and reload
$node->safe_psql('postgres', 'CREATE DATABASE added_db');
$node->safe_psql('added_db', 'CREATE EXTENSION idempotency');
$node->safe_psql('postgres',
	"ALTER SYSTEM SET idempotency.database = 'late_db, added_db'; SELECT pg_reload_conf();");
ok(wait_for_workers($node, 'added_db', 1),
	'database added by reload gets a worker');
is(worker_pid($node, 'late_db'), $pid, 'the worker of late_db is untouched by the reload');

# remove it again: its worker stops, the database can be dropped
$node->safe_psql('postgres',
	"ALTER SYSTEM SET idempotency.database = 'late_db'; SELECT pg_reload_conf();");
ok(wait_for_workers($node, 'added_db', 0),
	'database removed by reload loses its worker');
$node->safe_psql('postgres', 'DROP DATABASE added_db');
pass('unlisted database can be dropped');

is($node->safe_psql('postgres', 'SELECT 1'), '1', 'server is up');
$node->stop;
done_testing();
