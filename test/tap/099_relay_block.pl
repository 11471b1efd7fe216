# idem-relay under dead-letter policy block (the default;
# idempotency.outbox_dead_policy for role relay), with the redis sink
# (stream outbox:{aggregate_type}:{event_type}): aggregate mixed/m1 emits a
# good event, a poison one (event type bad: its stream key holds a string,
# XADD fails with WRONGTYPE) and two good ones.  The first arrives; the
# poison event is nacked to dead letters after 3 attempts and its aggregate
# is blocked: the two after it never arrive while it stays dead (nor did
# the redis sink's pipelined run put them in after the failed XADD),
# though other aggregates' events, emitted before and after, all arrive.
# Discarding the dead event (operator) releases the aggregate: the two
# arrive, in seq order.
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;
use RelayTest;

need_binary('idem-relay');
need_binary('redis-server');
need_binary('redis-cli');

my $tmp = PostgreSQL::Test::Utils::tempdir();
my $port = free_port();
my $redis = start_redis($tmp, $port);
redis_cli($port, 'SET', 'outbox:mixed:bad', 'not a stream');
my $node = relay_node('relay_block');
$node->safe_psql('postgres', q{ALTER ROLE relay SET idempotency.outbox_dead_policy = 'block'});

# the seq fields of stream $key, in stream order
sub seqs
{
	my ($key) = @_;
	my @l = split /\n/, redis_cli($port, 'XRANGE', $key, '-', '+');
	my @s;
	while (@l >= 15)
	{
		my (undef, %f) = splice(@l, 0, 15);
		push @s, $f{seq};
	}
	return @s;
}

sub emit_load
{
	my ($tag, $n) = @_;
	$node->safe_psql('postgres', qq{SELECT count(*) FROM generate_series(1, $n) g,
  LATERAL idem_outbox_emit('load', '$tag' || (g % 10), 'ev', jsonb_build_object('g', g))});
	return;
}

emit_load('before-', 100);
$node->safe_psql('postgres', q{
SELECT idem_outbox_emit('mixed', 'm1', 'ok', '{"n": 1}');
SELECT idem_outbox_emit('mixed', 'm1', 'bad', '{}');
SELECT idem_outbox_emit('mixed', 'm1', 'ok', '{"n": 3}');
SELECT idem_outbox_emit('mixed', 'm1', 'ok', '{"n": 4}');
});
my $relay = start_relay($node, "$tmp/relay.out", '--sink', 'redis', '--url', "redis://127.0.0.1:$port",
	'--target', 'outbox:{aggregate_type}:{event_type}', '--retries', '2', '--retry-max', '0.2',
	'--nack-retry-after', '0.2');
ok( wait_until(60, sub {
		$node->safe_psql('postgres', q{SELECT count(*) FROM idempotency.outbox_dead WHERE aggregate_id = 'm1'}) eq '1' }),
	'the poison event is dead-lettered');
like( $node->safe_psql('postgres', q{SELECT last_error FROM idempotency.outbox_dead WHERE aggregate_id = 'm1'}),
	qr/WRONGTYPE/, "the dead letter keeps redis's error");
emit_load('after-', 100);
ok(wait_until(60, sub { seqs('outbox:load:ev') >= 200 }),
	'the other aggregates flow: every event emitted before and after the dead letter arrived');
sleep 3;    # several polls and claims
is(join(',', seqs('outbox:mixed:ok')), '1', "policy block: the aggregate's events after its dead one wait");
is( $node->safe_psql('postgres', q{SELECT pending FROM idempotency.outbox_backlog WHERE aggregate_type = 'mixed'}),
	'2', '... and are pending in the backlog');

$node->safe_psql('postgres', q{SELECT idem_outbox_discard(array_agg(id)) FROM idempotency.outbox_dead WHERE aggregate_id = 'm1'});
ok(wait_until(60, sub { seqs('outbox:mixed:ok') >= 3 }), 'the dead event discarded, the aggregate moves on');
is(join(',', seqs('outbox:mixed:ok')), '1,3,4', '... its events in seq order');
ok(stop_relay($relay), 'SIGTERM: the relay exits 0');
is(scalar(seqs('outbox:load:ev')), 200, 'no other event was lost (or, here, duplicated)');

stop_broker($redis);
$node->stop;
done_testing();
