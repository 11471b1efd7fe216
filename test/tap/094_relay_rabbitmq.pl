# idem-relay's amqp sink against a real RabbitMQ node (started here as the
# test's user with a private node directory, RABBITMQ_* variables, every
# port, epmd's too, free and on 127.0.0.1, stopped at the end): publisher
# confirms, message_id = the event id, routing key {aggregate_type} on the
# default exchange (queue "load", durable; messages persistent).  Under
# pgbench emitters with rollbacks, the relay is killed with SIGKILL and
# restarted and the node is stopped for a few seconds and started again; a
# poison aggregate type (no queue: unroutable, returned) ends in dead
# letters while other aggregates flow (skip).  Then every committed event
# was in the queue, none rolled back, first arrivals per aggregate in seq
# order; duplicates (RabbitMQ does not dedupe) counted and printed.  The
# queue is declared and read by helpers/amqp_dump.c (RelayTest's amqp).
use strict;
use warnings;

use JSON::PP;
use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;
use RelayTest;

my $server = '/usr/lib/rabbitmq/bin/rabbitmq-server';
need_binary('idem-relay');
need_binary($server);
need_binary('cc');
like(`idem-relay --help`, qr/Sinks compiled in: .*\bamqp\b/, 'the amqp sink is compiled in');

my $tmp = PostgreSQL::Test::Utils::tempdir();
my $rabbit = rabbit_node($tmp);

my @arrivals;
sub arrivals
{
	my $out = amqp($rabbit, '', 'take', 'load') // '';
	foreach my $line (split /\n/, $out)
	{
		my ($id, $body) = split / /, $line, 2;
		my $e = decode_json($body);
		$e->{msg_id} = $id;
		push @arrivals, $e;
	}
	return \@arrivals;
}

start_rabbit($rabbit, 'load');
my $node = relay_node('relay_rabbitmq');
my $emitters = start_emitters($node, 60);
my @args = ('--sink', 'amqp', '--url', "amqp://guest:guest\@127.0.0.1:$rabbit->{port}/", '--target', '{aggregate_type}',
	'--retries', '3', '--retry-max', '0.5', '--nack-retry-after', '0.2');
my $relay = start_relay($node, "$tmp/relay.out", @args);

ok(wait_until(60, sub { @{ arrivals() } >= 200 }), 'events arrive while emitters run');
kill_relay($relay);
$relay = start_relay($node, "$tmp/relay.out", @args);
ok(wait_until(60, sub { @{ arrivals() } >= 400 }), 'the restarted relay delivers');

stop_rabbit($rabbit);
sleep 2;
start_rabbit($rabbit, 'load');
my $before = @{ arrivals() };
ok(wait_until(90, sub { @{ arrivals() } >= $before + 200 }), 'delivery resumes once rabbitmq is back');

emit_poison($node, 'poison');
ok(wait_until(60, sub { grep { $_->{aggregate_id} eq 'after-poison' } @{ arrivals() } }),
	'an aggregate emitted after the poison event flows');
my $total = drain_and_dead_letter($node, $emitters, \&arrivals, 'were in the queue');
like( $node->safe_psql('postgres', q{SELECT last_error FROM idempotency.outbox_dead WHERE aggregate_type = 'poison'}),
	qr/unroutable/, 'the dead letter says why');
ok(stop_relay($relay), 'SIGTERM: the relay drains and exits 0');
arrivals();
is(scalar(grep { $_->{msg_id} ne $_->{id} } @arrivals), 0, 'every message has message_id = its event id');
# (with the two batches in hand of the overlap, twice the bound of one)
check_arrivals($node, \@arrivals, poison => 'poison', max_dups => 2 * 60);
stop_rabbit($rabbit);
$node->stop;
done_testing();
