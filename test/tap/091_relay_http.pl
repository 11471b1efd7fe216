# idem-relay's http sink against a webhook receiver (helpers/webhook.py on
# 127.0.0.1, a free port): POST with Idempotency-Key = the event id (the
# receiver refuses any other key), 503 on every 13th request (tried again in
# place), 400 for a poison aggregate type (nacked, dead-lettered after 3
# attempts while other aggregates flow: policy skip).  Under pgbench
# emitters with rollbacks, the relay is killed with SIGKILL and restarted
# and the receiver is stopped for 3 seconds and started again (no attempt
# is spent on an unreachable receiver); then every committed event arrived,
# none rolled back, first arrivals per aggregate in seq order, duplicates
# only from lost acks (counted, printed).  A slow receiver (0.8 s per event
# of one aggregate, 6 events: longer than the 3-second lease) gets each
# event once: the relay extends its lease while it waits.
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);
use IdemTest;
use RelayTest;

need_relay('sink', 'http', 'python3');

my $tmp = PostgreSQL::Test::Utils::tempdir();
my $file = "$tmp/received.jsonl";
my $port = free_port();
sub arrivals { return jsonl($file); }

my $server = start_webhook($port, $file);
END { local $?; $server->kill_kill if $server && $server->pumpable; }
my $node = relay_node('relay_http');
my $emitters = start_emitters($node, 60);
my @args = ('--sink', 'http', '--url', "http://127.0.0.1:$port/events",
	'--retries', '3', '--retry-max', '0.5', '--nack-retry-after', '0.2');
my $count = sub { scalar(@{ arrivals() }) };
my $relay = relay_killed_and_restarted($node, "$tmp/relay.out", $count, 200, @args);

# the receiver goes away for 3 seconds
broker_outage('the receiver', 3, sub { $server->kill_kill }, sub { $server = start_webhook($port, $file) },
	$count, 200);
poison_flows($node, \&arrivals);

# 6 events that take 0.8 s each, in one batch: 4.8 s, past the 3-second lease
$node->safe_psql('postgres', q{INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM generate_series(1, 6) g, LATERAL idem_outbox_emit('load', 'slow', 'ev', jsonb_build_object('g', g)) e});
ok(wait_until(60, sub { 6 <= grep { $_->{aggregate_id} eq 'slow' } @{ arrivals() } }),
	'the slow receiver got the 6 events');
my $total = drain_and_dead_letter($node, $emitters, \&arrivals, 'arrived');
my $metrics = http_get($relay->{port}, '/metrics');
like($metrics, qr/^idem_relay_failed_total [1-9]\d*$/m, 'metrics: failed publishes counted (503s, 400s)');
like($metrics, qr/^idem_relay_dead_lettered_total 1$/m, 'metrics: one event dead-lettered');
like($metrics, qr/^idem_relay_leases_lost_total 0$/m, 'metrics: no lease lost (extended while the receiver was slow)');
is(scalar(grep { $_->{aggregate_id} eq 'slow' } @{ arrivals() }), 6,
	'each slow event arrived once: the lease was extended, not lost');
ok(stop_relay($relay), 'SIGTERM: the relay drains and exits 0');
is(poison_error($node),
	'HTTP 400: poison refused', "the dead letter keeps the receiver's answer");

# the kill loses at most the two batches in hand (20 each)
check_arrivals($node, arrivals(), poison => 'poison', max_dups => 2 * 20);
$server->kill_kill;
$node->stop;
done_testing();
