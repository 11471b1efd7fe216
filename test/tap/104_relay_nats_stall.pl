# idem-relay's nats sink when JetStream's publish acks come late or not at
# all: the relay talks to nats-server through a proxy (RelayTest's
# start_proxy) that holds back what the server sends.  --timeout is 1 s.
#  - Acks 1.5 s late for a while: each publish times out (settled by the
#    library's timeout as a retry) and its late ack settles nothing: the
#    relay counts no event as confirmed meanwhile (idem_relay_published_total
#    stands still) and keeps running.
#  - Acks held back, then the connection cut while the asynchronous
#    publishes of a wave are pending: the library never settles them (the
#    connection is closed), so the wave's wait for them ends at its
#    backstop and the sink takes them back from the library (nats_quiesce)
#    before it reconnects; the relay says so, never leaves an ack handler's
#    memory behind, and goes on delivering.
#  - Acks held back, then SIGTERM: the relay exits 0 in a few seconds.
# Then every committed event is in the stream once (the duplicate window
# drops the copies of the publishes whose acks were late or lost), none
# rolled back, in seq order per aggregate.
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);
use IdemTest;
use RelayTest;

need_relay('sink', 'nats', 'nats-server');

my $tmp = PostgreSQL::Test::Utils::tempdir();
my $port = free_port();

sub stored { return nats_stored($port); }

my $nats = start_nats($tmp, $port);
my ($created) = nats_requests($port, [ '$JS.API.STREAM.CREATE.OUTBOX',
	'{"name":"OUTBOX","subjects":["outbox.load.>"],"storage":"file","duplicate_window":120000000000}' ]);
like($created, qr/"name":"OUTBOX"/, 'stream OUTBOX created (2-minute duplicate window)');

my $node = relay_node('relay_nats_stall');
# every try while the acks are held back fails: none of them may dead-letter an event
$node->safe_psql('postgres', 'ALTER ROLE relay SET idempotency.outbox_max_attempts = 1000');
my $proxy = start_proxy($tmp, $port);
my $emitters = start_emitters($node, 100);
my @args = ('--sink', 'nats', '--url', "nats://127.0.0.1:$proxy->{port}",
	'--retries', '3', '--retry-max', '0.5', '--nack-retry-after', '0.2');
my $relay = start_relay($node, "$tmp/relay.out", @args);
ok(wait_until(60, sub { stored() >= 300 }), 'events arrive through the proxy');
my $log = sub { PostgreSQL::Test::Utils::slurp_file("$tmp/relay.out.err") };

# --- late acks
my $published = late_confirms($relay, $proxy, 'ack');
ok($relay->{h}->pumpable, '... and the relay is still running');
proxy_delay($proxy, 0);
ok(wait_until(60, sub { metric($relay, 'idem_relay_published_total') > $published + 100 }),
	'once the acks come in time again, delivery resumes');

# --- a wave pending when the connection is cut
my $reconnects = metric($relay, 'idem_relay_sink_reconnects_total');
proxy_delay($proxy, 'stall');
# events to publish now, beside the emitters': a wave goes out at once
$node->safe_psql('postgres', q{INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM generate_series(1, 20) g, LATERAL idem_outbox_emit('load', 'cut' || g, 'ev', '{}') e});
sleep 0.3;
proxy_cut($proxy);
proxy_delay($proxy, 0);
ok(wait_until(30, sub { $log->() =~ /publishes still pending after the wave's wait: taken back/ }),
	'the cut left publishes pending in the library: the sink took them back');
ok(wait_until(30, sub { metric($relay, 'idem_relay_sink_reconnects_total') > $reconnects }),
	'the relay reconnected');
$published = metric($relay, 'idem_relay_published_total');
ok(wait_until(60, sub { metric($relay, 'idem_relay_published_total') > $published + 100 }),
	'and goes on delivering');
unlike($log->(), qr/an ack handler is still running/, 'no ack handler\'s memory was left behind');

# --- SIGTERM while the acks are held back
proxy_delay($proxy, 'stall');
sleep 0.3;
my $t0 = time;
ok(stop_relay($relay), 'SIGTERM while the acks are held back: the relay exits 0');
cmp_ok(time - $t0, '<', 10, '... within 10 s');
proxy_delay($proxy, 0);
$relay = start_relay($node, "$tmp/relay.out", @args);

stop_emitters($emitters);
my $total = $node->safe_psql('postgres', 'SELECT count(*) FROM emitted');
ok(wait_until(90, sub { stored() >= $total }), "all $total committed events are in the stream");
ok(wait_until(30, sub {
		$node->safe_psql('postgres', 'SELECT coalesce(sum(pending), 0) FROM idempotency.outbox_backlog') eq '0' }),
	'and the outbox has nothing pending');
ok(stop_relay($relay), 'SIGTERM: the relay exits 0');
is($node->safe_psql('postgres', 'SELECT count(*) FROM idempotency.outbox_dead'), '0', 'nothing was dead-lettered');
is(stored(), $total, 'the stream holds each committed event once');
check_arrivals($node, nats_messages($port), max_dups => 0);
stop_broker($nats);
$node->stop;
done_testing();
