# Set-up shared by the TAP tests in test/tap (they run with prove -I test/tap):
# idem_node builds and starts a node, worker_conf is the postgresql.conf text
# that runs the maintenance worker every second, setup_second_partitions makes
# a database whose partitions the worker turns over within seconds, and the
# rest find or wait for the maintenance worker and its partitions.
# IDEM_TAP_PORT, if set, fixes the port of the node idem_node builds (it
# listens on a private unix socket only, so any port is free).
package IdemTest;

use strict;
use warnings;

use Exporter 'import';
use IPC::Run;
use PostgreSQL::Test::Cluster;

our @EXPORT = qw(idem_node worker_conf setup_second_partitions
  worker_pid_sql worker_pid wait_for_workers
  $newest_sql wait_partitions_ahead bg_psql bg_feed);

# upper bound of the newest partition
our $newest_sql = 'SELECT max(upper) FROM idempotency.partition_registry';

# A started node.  init => [...] is passed to init (e.g. allows_streaming => 1),
# conf => '...' is appended to postgresql.conf before the start.
sub idem_node
{
	my ($name, %opt) = @_;
	my $node = PostgreSQL::Test::Cluster->new($name,
		($ENV{IDEM_TAP_PORT} ? (port => $ENV{IDEM_TAP_PORT}) : ()));
	$node->init(@{ $opt{init} // [] });
	$node->append_conf('postgresql.conf', $opt{conf}) if defined $opt{conf};
	$node->start;
	return $node;
}

# preload the library and run maintenance in $databases (a list as
# idempotency.database takes it) every second
sub worker_conf
{
	my ($databases) = @_;
	return qq{
shared_preload_libraries = 'idempotency'
idempotency.database = '$databases'
idempotency.naptime = 1
};
}

# CREATE EXTENSION idempotency in $db with 1-second partitions kept for
# retention => '...', premake => N of them.  CREATE EXTENSION premade
# partitions of the default 1 day; move them into the past so they expire
# and the worker has to make the 1-second ones.
sub setup_second_partitions
{
	my ($node, $db, %opt) = @_;
	die 'setup_second_partitions needs retention and premake'
	  unless defined $opt{retention} && defined $opt{premake};
	$node->safe_psql(
		$db, qq{
CREATE EXTENSION idempotency;
SELECT idem_configure(retention => '$opt{retention}', partition_interval => '1 second', premake => $opt{premake});
UPDATE idempotency.partition_registry
   SET lower = lower - interval '30 days', upper = upper - interval '30 days';
});
	return;
}

# the pid of the maintenance worker of database $db (none: no row), asked
# in database postgres
sub worker_pid_sql
{
	my ($db) = @_;
	return qq{
	SELECT pid FROM pg_stat_activity
	 WHERE backend_type = 'idempotency maintenance' AND datname = '$db'};
}

# the pid of the maintenance worker of database $db, '' if none
sub worker_pid
{
	my ($node, $db) = @_;
	return $node->safe_psql('postgres', worker_pid_sql($db));
}

# wait until database $db has $n maintenance workers; true if it came to that
sub wait_for_workers
{
	my ($node, $db, $n) = @_;
	return $node->poll_query_until('postgres',
		"SELECT count(*) = $n FROM (" . worker_pid_sql($db) . ') w');
}

# wait until the newest partition of $db reaches more than a second past now
# (so maintenance rounds run); true if it came to that
sub wait_partitions_ahead
{
	my ($node, $db) = @_;
	return $node->poll_query_until($db,
		"SELECT ($newest_sql) > now() + interval '1 second'");
}

# A psql session in the background on $db of $node (application_name
# $name), fed $sql as bg_feed does.  Returns a hash: h (the IPC::Run
# harness), in, out, err, timer.
sub bg_psql
{
	my ($node, $db, $name, $timer, $sql, $marker) = @_;
	my %s = (in => '', out => '', err => '', timer => $timer);
	$s{h} = IPC::Run::start(
		[
			'psql', '-XAtq', '-v', 'ON_ERROR_STOP=1', '-f', '-', '-d',
			$node->connstr($db) . " application_name=$name"
		],
		'<', \$s{in}, '>', \$s{out}, '2>', \$s{err}, $timer);
	bg_feed(\%s, $sql, $marker);
	return \%s;
}

# Hand a background session more SQL.  With $marker, wait until psql has
# echoed it (so everything before it ran); without, only until psql took
# the text.
sub bg_feed
{
	my ($s, $sql, $marker) = @_;
	$s->{in} .= "$sql\n";
	if (defined $marker)
	{
		$s->{in} .= "\\echo $marker\n";
		$s->{h}->pump until $s->{out} =~ /$marker/ || $s->{timer}->is_expired;
		die "session did not reach $marker: $s->{err}"
		  unless $s->{out} =~ /$marker/;
	}
	else
	{
		$s->{h}->pump while length $s->{in} && !$s->{timer}->is_expired;
	}
	return;
}

1;
