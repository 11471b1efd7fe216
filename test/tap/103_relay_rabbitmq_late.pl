# idem-relay's amqp sink when RabbitMQ's publisher confirms come after
# --timeout (1 s here): the relay talks to the node through a proxy
# (RelayTest's start_proxy) that holds back what the broker sends by 1.5 s
# for a while, so every confirm (and every reply of a reconnection's
# login) comes late.  A publish whose confirm did not come in time is
# settled as a retry; the late basic.ack, carrying the delivery tag of a
# publish already given up, then arrives while the relay waits for another
# publish's confirm, and must settle nothing: while every confirm is late
# the relay counts no event as confirmed (idem_relay_published_total stands
# still) though the broker gets the messages, and it keeps running.  Once
# the confirms come in time again, delivery resumes; at the end every
# committed event was in the queue, none rolled back, first arrivals per
# aggregate in seq order, duplicates (the copies whose confirms were late)
# counted and printed.
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
my $node = relay_node('relay_rabbitmq_late');
# every try of the late phase fails: none of them may dead-letter an event
$node->safe_psql('postgres', 'ALTER ROLE relay SET idempotency.outbox_max_attempts = 1000');
my $proxy = start_proxy($tmp, $rabbit->{port});
my $emitters = start_emitters($node, 60);
my $relay = start_relay($node, "$tmp/relay.out", '--sink', 'amqp',
	'--url', "amqp://guest:guest\@127.0.0.1:$proxy->{port}/", '--target', '{aggregate_type}',
	'--retries', '3', '--retry-max', '0.5', '--nack-retry-after', '0.2');
ok(wait_until(60, sub { @{ arrivals() } >= 200 }), 'events arrive through the proxy');

my $got = @{ arrivals() };
my $published = late_confirms($relay, $proxy, 'confirm');
cmp_ok(scalar(@{ arrivals() }), '>', $got, '... though the broker got messages and confirmed them, late');
ok($relay->{h}->pumpable, '... and the relay is still running');
like(PostgreSQL::Test::Utils::slurp_file("$tmp/relay.out.err"), qr/waiting for the confirm: request timed out/,
	'the relay logged the confirms it waited for in vain');

proxy_delay($proxy, 0);
$got = @{ arrivals() };
ok(wait_until(60, sub { metric($relay, 'idem_relay_published_total') > $published + 100 }),
	'once the confirms come in time again, delivery resumes');
stop_emitters($emitters);
my $total = $node->safe_psql('postgres', 'SELECT count(*) FROM emitted');
ok( wait_until(90, sub {
		my %s = map { $_->{id} => 1 } @{ arrivals() };
		scalar(keys %s) >= $total }),
	"all $total committed events were in the queue");
ok(wait_until(30, sub {
		$node->safe_psql('postgres', 'SELECT coalesce(sum(pending), 0) FROM idempotency.outbox_backlog') eq '0' }),
	'and the outbox has nothing pending');
ok(stop_relay($relay), 'SIGTERM: the relay exits 0');
my $all = arrivals();
is($node->safe_psql('postgres', 'SELECT count(*) FROM idempotency.outbox_dead'), '0', 'nothing was dead-lettered');
check_arrivals($node, $all);
stop_rabbit($rabbit);
$node->stop;
done_testing();
