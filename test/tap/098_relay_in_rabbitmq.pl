# idem-relay --in amqp: a RabbitMQ queue consumer with manual acks (queue
# inbox, durable, persistent messages) into the inbox, as role inbound with
# only the handler capability for source orders; message id the message_id
# property (the default), ordering key the JSON pointer /account.
# RelayTest's inbound_scenario: 600 messages (60 of them twice) published
# with publisher confirms in rounds while the relay is killed with SIGKILL
# mid-stream and restarted (RabbitMQ requeues what it had not acked) and
# the node is stopped and started again; every message stored once with
# its payload, none lost, the queue empty at the end (ready and unacked).
# The database refusing (capability revoked): messages are nacked back to
# the queue, none acked or stored, until the capability is back.  A body
# that is not JSON is rejected (not requeued) and stored nowhere.  The
# node and its helpers: RelayTest's rabbit_node, amqp (helpers/amqp_dump.c).
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;
use RelayTest;

need_relay('source', 'amqp', RABBITMQ_SERVER, 'cc');

my $tmp = PostgreSQL::Test::Utils::tempdir();
my $rabbit = rabbit_node($tmp);
start_rabbit($rabbit, 'inbox');
my $node = relay_node('relay_in_rabbitmq');
inbound_role($node, 'orders');

sub publish
{
	my @msgs = @_;
	defined amqp($rabbit, join('', map { "$_->[0] $_->[1]\n" } @msgs), 'publish', 'inbox')
	  or die 'publishing to rabbitmq failed';
	return;
}

# the queue's messages, ready or delivered and unacked
sub unacked
{
	local @ENV{ keys %{ $rabbit->{env} } } = values %{ $rabbit->{env} };
	my $out = '';
	IPC::Run::run([ '/usr/lib/rabbitmq/bin/rabbitmqctl', '-s', 'list_queues', 'name', 'messages' ],
		'>', \$out, '2>', \my $err);
	return $out =~ /^inbox\s+(\d+)/m ? $1 : -1;
}

my @args = ('--url', "amqp://guest:guest\@127.0.0.1:$rabbit->{port}/", '--target', 'inbox',
	'--source', 'orders', '--ordering-key', 'json:/account');
my ($relay, @sent) = inbound_scenario(
	node => $node,
	source => 'orders',
	start => sub { start_inbound($node, "$tmp/in.out", 'amqp', @args) },
	publish => \&publish,
	restart_broker => sub { stop_rabbit($rabbit); sleep 2; start_rabbit($rabbit, 'inbox'); },
	unacked => \&unacked);
is(inbox_rows($node, 'orders')->{'w-8'}{ordering_key}, 'acct-1', 'the ordering key (json:/account) is in the headers');

# a message that can never be stored: rejected, not requeued
publish([ 'bad-1', 'not json' ]);
ok(wait_until(30, sub { (metric($relay, 'idem_relay_in_rejected_total') // 0) == 1 }),
	'a body that is not JSON is rejected');
ok(wait_until(30, sub { unacked() == 0 }), '... and not requeued');
ok(!inbox_rows($node, 'orders')->{'bad-1'}, '... nor stored');
ok(stop_relay($relay), 'SIGTERM: the relay exits 0');
check_inbox($node, 'orders', @sent);

stop_rabbit($rabbit);
$node->stop;
done_testing();
