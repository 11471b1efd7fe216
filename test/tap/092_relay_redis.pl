# idem-relay's redis sink against a real redis-server (started here in a
# temporary directory, 127.0.0.1 only, a free port, append-only file so a
# restart keeps the stream): XADD to stream outbox:{aggregate_type} with the
# event's fields.  Under pgbench emitters with rollbacks, the relay is
# killed with SIGKILL and restarted and redis is stopped for 3 seconds and
# started again; a poison aggregate type (its stream key holds a string, so
# XADD fails with WRONGTYPE) ends in dead letters while other aggregates
# flow (skip).  Then every committed event is in the stream, none rolled
# back, first entries per aggregate in seq order; duplicates (Redis does no
# dedup: a lost ack is a second entry) counted and printed.
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;
use RelayTest;

need_relay('sink', 'redis', 'redis-server', 'redis-cli');

my $tmp = PostgreSQL::Test::Utils::tempdir();
my $port = free_port();
# the entries of stream outbox:load, in stream order
sub arrivals
{
	my @l = split /\n/, redis_cli($port, 'XRANGE', 'outbox:load', '-', '+');
	my @a;
	while (@l >= 15)
	{
		my (undef, %f) = splice(@l, 0, 15);
		push @a, \%f;
	}
	return \@a;
}

my $redis = start_redis($tmp, $port);
redis_cli($port, 'SET', 'outbox:poison', 'not a stream');
my $node = relay_node('relay_redis');
my $emitters = start_emitters($node, 100);
my @args = ('--sink', 'redis', '--url', "redis://127.0.0.1:$port", '--target', 'outbox:{aggregate_type}',
	'--retries', '3', '--retry-max', '0.5', '--nack-retry-after', '0.2');
my $count = sub { scalar(@{ arrivals() }) };
my $relay = relay_killed_and_restarted($node, "$tmp/relay.out", $count, 300, @args);
broker_outage('redis', 3, sub { stop_broker($redis) }, sub { $redis = start_redis($tmp, $port) }, $count, 300);
poison_flows($node, \&arrivals);
my $total = drain_and_dead_letter($node, $emitters, \&arrivals, 'are in the stream');
like(poison_error($node),
	qr/WRONGTYPE/, "the dead letter keeps redis's error");
like(http_get($relay->{port}, '/metrics'), qr/^idem_relay_sink_reconnects_total [1-9]\d*$/m,
	'metrics: the reconnection to redis counted');
ok(stop_relay($relay), 'SIGTERM: the relay drains and exits 0');

# the kill and the broker's stop: each at most the two batches in hand (20 each)
check_arrivals($node, arrivals(), poison => 'poison', max_dups => 2 * 2 * 20);
stop_broker($redis);
$node->stop;
done_testing();
