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

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;
use RelayTest;

need_relay('sink', 'amqp', RABBITMQ_SERVER, 'cc');

my $tmp = PostgreSQL::Test::Utils::tempdir();
my ($rabbit, $arrivals) = rabbit_with_queue($tmp);
sub arrivals { return $arrivals->(); }
my $node = relay_node('relay_rabbitmq');
my $emitters = start_emitters($node, 60);
my @args = ('--sink', 'amqp', '--url', "amqp://guest:guest\@127.0.0.1:$rabbit->{port}/", '--target', '{aggregate_type}',
	'--retries', '3', '--retry-max', '0.5', '--nack-retry-after', '0.2');
my $count = sub { scalar(@{ arrivals() }) };
my $relay = relay_killed_and_restarted($node, "$tmp/relay.out", $count, 200, @args);
broker_outage('rabbitmq', 2, sub { stop_rabbit($rabbit) }, sub { start_rabbit($rabbit, 'load') }, $count, 200);
poison_flows($node, \&arrivals);
my $total = drain_and_dead_letter($node, $emitters, \&arrivals, 'were in the queue');
like(poison_error($node),
	qr/unroutable/, 'the dead letter says why');
ok(stop_relay($relay), 'SIGTERM: the relay drains and exits 0');
my $all = arrivals();
is(scalar(grep { $_->{msg_id} ne $_->{id} } @$all), 0, 'every message has message_id = its event id');
# (with the two batches in hand of the overlap, twice the bound of one)
check_arrivals($node, $all, poison => 'poison', max_dups => 2 * 60);
stop_rabbit($rabbit);
$node->stop;
done_testing();
