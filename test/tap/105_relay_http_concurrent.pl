# idem-relay's http sink with --http-concurrency 8 (a batch's POSTs in
# waves, up to 8 at once) against helpers/webhook.py with a request log and
# 5 ms per request: under pgbench emitters with rollbacks, the relay killed
# with SIGKILL and restarted, the receiver stopped for 3 seconds and started
# again, every committed event arrives, none rolled back, first arrivals per
# aggregate in seq order; requests really overlap (the receiver saw more
# than one in flight at once) but never two of one aggregate; a poison
# event (400) is dead-lettered while other aggregates flow; an event that is
# answered 503 once (aggregate "flaky") is tried again in place, not nacked.
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;
use RelayTest;

need_binary('idem-relay');
need_binary('python3');
like(`idem-relay --help`, qr/--http-concurrency N/, 'the http sink has --http-concurrency');

my $tmp = PostgreSQL::Test::Utils::tempdir();
my $file = "$tmp/received.jsonl";
my $log = "$tmp/requests.jsonl";
my $port = free_port();
sub start_server { return start_webhook($port, $file, $log, '0.005'); }
sub arrivals { return jsonl($file); }

# a bad value is refused
my $bad = `idem-relay --sink http --url http://127.0.0.1:1/ --http-concurrency 0 2>&1`;
is($? >> 8, 2, '--http-concurrency 0: exit 2');
like($bad, qr/--http-concurrency must be from 1 to 1000/, '--http-concurrency 0: the reason');
`idem-relay --sink stdout --http-concurrency 4 2>&1`;
is($? >> 8, 2, '--http-concurrency with another sink: exit 2');

my $server = start_server();
END { local $?; $server->kill_kill if $server && $server->pumpable; }
my $node = relay_node('relay_http_c');
my $emitters = start_emitters($node, 40);
my @args = ('--sink', 'http', '--url', "http://127.0.0.1:$port/events", '--http-concurrency', '8',
	'--retries', '3', '--retry-max', '0.5', '--nack-retry-after', '0.2');
my $count = sub { scalar(@{ arrivals() }) };
my $relay = relay_killed_and_restarted($node, "$tmp/relay.out", $count, 200, @args);
broker_outage('the receiver', 3, sub { $server->kill_kill }, sub { $server = start_server() }, $count, 200);
poison_flows($node, \&arrivals);

# 3 events of aggregate "flaky", each answered 503 at its first POST
my @flaky = split /\n/, $node->safe_psql('postgres', q{INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM generate_series(1, 3) g, LATERAL idem_outbox_emit('load', 'flaky', 'ev', jsonb_build_object('g', g)) e
  RETURNING id});
ok(wait_until(60, sub { 3 <= grep { $_->{aggregate_id} eq 'flaky' } @{ arrivals() } }),
	'the flaky events arrived');

drain_and_dead_letter($node, $emitters, \&arrivals, 'arrived');
ok(stop_relay($relay), 'SIGTERM: the relay drains and exits 0');

# the requests as the receiver saw them
my $requests = jsonl($log);
my $max = 0;
$max = $_->{inflight} > $max ? $_->{inflight} : $max for @$requests;
cmp_ok($max, '>', 1, "requests overlapped: at most $max in flight at once");
my (%by_agg, @overlaps);
push @{ $by_agg{ $_->{aggregate} } }, $_ for @$requests;
foreach my $agg (sort keys %by_agg)
{
	my @r = sort { $a->{t0} <=> $b->{t0} } @{ $by_agg{$agg} };
	for my $i (1 .. $#r)
	{
		push @overlaps, "$agg: $r[$i]{id} began before $r[$i-1]{id} was answered"
		  if $r[$i]{t0} < $r[ $i - 1 ]{t1};
	}
}
is(scalar(@overlaps), 0, 'never two requests of one aggregate in flight at once')
  or diag(join("\n", @overlaps[ 0 .. ($#overlaps < 9 ? $#overlaps : 9) ]));

foreach my $id (@flaky)
{
	my @st = map { $_->{status} } grep { $_->{id} eq $id } @$requests;
	is("@st[0, 1]", '503 200', "flaky event $id: 503, then 200 on the next try");
}
my $errlog = slurp_file("$tmp/relay.out.err");
my @flaky_nacks = grep { /nacking the event/ && /aggregate_id=flaky/ } split /\n/, $errlog;
is(scalar(@flaky_nacks), 0, 'the 503 of a flaky event was tried again in place, not nacked')
  or diag($flaky_nacks[0]);
is(poison_error($node),
	'HTTP 400: poison refused', "the dead letter keeps the receiver's answer");

# the kill loses at most the two batches in hand (20 each)
check_arrivals($node, arrivals(), poison => 'poison', max_dups => 2 * 20);
$server->kill_kill;
$node->stop;
done_testing();
