# idem-relay's nats sink against a real nats-server with JetStream (started
# here in a temporary directory, 127.0.0.1 only, a free port, file storage
# so a restart keeps the stream): each event published to
# outbox.{aggregate_type}.{event_type} with Nats-Msg-Id = the event id and
# a publish ack awaited.  Under pgbench emitters with rollbacks, the relay
# is killed with SIGKILL and restarted and nats-server is stopped for 3
# seconds and started again; a poison aggregate type (a subject no stream
# captures: no responders) ends in dead letters while other aggregates
# flow (skip).  Then every committed event is in the stream, none rolled
# back, in seq order per aggregate, and no duplicate: JetStream's duplicate
# window drops the redeliveries of lost acks.  A run whose middle event
# stream BIG refuses (too large): the event after it is stored only once
# the refused one is dead-lettered, never while it is being retried (the
# sink pipelines a batch, and must not publish past an event that may
# fail).  The streams are created and read by a few lines of the NATS
# protocol (RelayTest's nats_requests).
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;
use RelayTest;

need_relay('sink', 'nats', 'nats-server');

my $tmp = PostgreSQL::Test::Utils::tempdir();
my $port = free_port();

# every message of stream $stream (default OUTBOX), in stream order
sub arrivals { return nats_messages($port, @_); }
sub stored { return nats_stored($port); }

my $nats = start_nats($tmp, $port);
my ($created) = nats_requests($port, [ '$JS.API.STREAM.CREATE.OUTBOX',
	'{"name":"OUTBOX","subjects":["outbox.load.>"],"storage":"file","duplicate_window":120000000000}' ]);
like($created, qr/"name":"OUTBOX"/, 'stream OUTBOX created (2-minute duplicate window)');
($created) = nats_requests($port, [ '$JS.API.STREAM.CREATE.BIG',
	'{"name":"BIG","subjects":["outbox.mid.>"],"storage":"file","max_msg_size":4096}' ]);
like($created, qr/"name":"BIG"/, 'stream BIG created (messages of 4 kB at most)');

my $node = relay_node('relay_nats');

# a relay that published 20 events and died before its ack: they are in
# the stream (published here, with their ids as Nats-Msg-Id) but not acked
$node->safe_psql('postgres', q{INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM generate_series(1, 20) g, LATERAL idem_outbox_emit('load', 'lost-ack', 'ev', jsonb_build_object('g', g)) e});
my @lost = map { [ split /\|/ ] } split /\n/, $node->safe_psql('postgres', q{
SELECT id, jsonb_build_object('id', id, 'aggregate_type', aggregate_type, 'aggregate_id', aggregate_id, 'seq', seq)
  FROM emitted WHERE aggregate_id = 'lost-ack' ORDER BY seq});
my @acks = nats_requests($port, map { [ 'outbox.load.ev', $_->[1], $_->[0] ] } @lost);
is(scalar(grep { defined && /"seq":\d+/ } @acks), 20, 'the 20 events of the dead relay are in the stream');
my $emitters = start_emitters($node, 100);
my @args = ('--sink', 'nats', '--url', "nats://127.0.0.1:$port",
	'--retries', '3', '--retry-max', '0.5', '--nack-retry-after', '0.2');
my $relay = relay_killed_and_restarted($node, "$tmp/relay.out", \&stored, 300, @args);
broker_outage('nats-server', 3, sub { stop_broker($nats) }, sub { $nats = start_nats($tmp, $port) }, \&stored, 300);
poison_flows($node, \&arrivals);
stop_emitters($emitters);
my $total = $node->safe_psql('postgres', q{SELECT count(*) FROM emitted WHERE aggregate_type <> 'poison'});
ok(wait_until(90, sub { stored() >= $total }), "all $total committed events are in the stream");
ok( wait_until(30, sub {
		$node->safe_psql('postgres', q{SELECT count(*) FROM idempotency.outbox_dead WHERE aggregate_type = 'poison'}) eq '1' }),
	'the poison event is dead-lettered');
like(poison_error($node),
	qr/no stream captures the subject/, 'the dead letter says why');

# one transaction, so one claim hands out the run of three
my @mid = split /\n/, $node->safe_psql('postgres', q{
SELECT e.id FROM generate_series(1, 3) g,
  LATERAL idem_outbox_emit('mid', 'm1', 'ev', CASE WHEN g = 2 THEN jsonb_build_object('pad', repeat('x', 8000))
                                                   ELSE jsonb_build_object('g', g) END) e
ORDER BY e.seq});
ok( wait_until(60, sub {
		$node->safe_psql('postgres', "SELECT count(*) FROM idempotency.outbox_dead WHERE id = '$mid[1]'") eq '1' }),
	'the too large event of a run is dead-lettered');
like( $node->safe_psql('postgres', "SELECT last_error FROM idempotency.outbox_dead WHERE id = '$mid[1]'"),
	qr/JetStream error [1-9]/, 'refused by the stream (a JetStream error for the message)');
ok(wait_until(30, sub { nats_stored($port, 'BIG') >= 2 }), 'the run goes on after the dead letter');
my $big = arrivals('BIG');
is(join(',', map { $_->{id} } @$big), "$mid[0],$mid[2]",
	'stream BIG holds the events before and after the refused one, once each, in order');
is( $node->safe_psql('postgres',
		"SELECT '$big->[1]{stored_at}'::timestamptz >= dead_at FROM idempotency.outbox_dead WHERE id = '$mid[1]'"),
	't', 'the event after the refused one was stored only after the refused one was dead-lettered');
ok(stop_relay($relay), 'SIGTERM: the relay drains and exits 0');

my $arrivals = arrivals();
is(join(',', map { $_->{id} } @$arrivals[ 0 .. 19 ]), join(',', map { $_->[0] } @lost),
	'the dead relay\'s events are the first 20 of the stream, and the relay\'s second publication of them was dropped');
is(scalar(grep { $_->{msg_id} ne $_->{id} } @$arrivals), 0, 'every message has Nats-Msg-Id = its event id');
is(stored(), $total, 'the stream holds each committed event once');
check_arrivals($node, $arrivals, poison => 'poison', max_dups => 0);
stop_broker($nats);
$node->stop;
done_testing();
