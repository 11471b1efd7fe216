# idem-relay's overlap of the database and the sink (--prefetch 1, the
# default): while one batch is published the next is claimed, so two
# batches are in hand.  With a slow sink (the sql sink, a statement that
# sleeps 10 ms per event into table got, on the relay's own database):
# two live leases are seen at once (one with --prefetch 0); SIGTERM with
# two batches in hand exits 0 with every arrived event acked and no lease
# left (the rest of the batch and the prefetched one given back, claimable
# at once); --once exits only when nothing is left, also when one
# aggregate's events span several batches (a claim beside a leased batch
# comes back empty without meaning that); a batch longer than the lease
# keeps both leases; the relay killed with SIGKILL
# with two batches in hand and the server restarted mid-overlap: every
# event arrives, first arrivals per aggregate in seq order, duplicates at
# most two batches per loss.
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);
use IdemTest;
use RelayTest;

need_binary('idem-relay');

my $node = relay_node('relay_overlap');
my $db = 'postgres';
my $tmp = PostgreSQL::Test::Utils::tempdir();
$node->safe_psql($db, q{
CREATE TABLE got (n bigserial PRIMARY KEY, id uuid NOT NULL, ev jsonb NOT NULL);
GRANT INSERT ON got TO relay;
GRANT USAGE ON SEQUENCE got_n_seq TO relay;
});
my @sink = ('--sink', 'sql', '--sql',
	'INSERT INTO got (id, ev) SELECT $2, $1 FROM pg_catalog.pg_sleep(0.01)');

# $n events to each of $aggs aggregates 'o1'.. of type 'load', recorded in emitted
sub emit
{
	my ($aggs, $n, $prefix) = @_;
	$node->safe_psql($db, qq{
INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM generate_series(1, $n) k, generate_series(1, $aggs) a,
       LATERAL idem_outbox_emit('load', '$prefix' || a, 'ev', jsonb_build_object('k', k)) e
  ORDER BY k, a});
	return;
}

sub arrivals
{
	return [ map { my ($i, $t, $a, $s) = split /\|/; { id => $i, aggregate_type => $t, aggregate_id => $a, seq => $s } }
		  split /\n/, $node->safe_psql($db,
			q{SELECT id, ev->>'aggregate_type', ev->>'aggregate_id', ev->>'seq' FROM got ORDER BY n}) ];
}
sub live_leases
{
	return $node->safe_psql($db,
		q{SELECT count(DISTINCT lease_token) FROM idempotency.outbox_deliveries WHERE lease_until > now()});
}
sub pending
{
	return $node->safe_psql($db, 'SELECT coalesce(sum(pending), 0) FROM idempotency.outbox_backlog');
}
# the most live leases seen in $secs, polled every 50 ms
sub max_live_leases
{
	my ($secs) = @_;
	my $max = 0;
	my $t0 = time;
	while (time - $t0 < $secs)
	{
		my $l = live_leases();
		$max = $l if $l > $max;
		last if $max >= 2;
		usleep(50_000);
	}
	return $max;
}

# --- the event's JSON, built by the relay: byte for byte what jsonb gives
# (keys in jsonb's order, strings escaped as jsonb escapes them), also for
# names with quotes, backslashes, control characters and non-ASCII
# (not in table emitted: it goes to stdout, not to table got)
my $weird = $node->safe_psql($db, q{
SELECT e.id FROM idem_outbox_emit('we"ird' || chr(92) || chr(10) || chr(9) || chr(8) || chr(12) || chr(13) || chr(1) || chr(31),
  'agg ' || chr(233) || chr(20013) || ' "q"', 'ev/' || chr(92) || 'x',
  '{"a": [1, 2.50, null, "s\\u0001x"], "b": {"c": true}}', '{"h": "v"}') e});
my $want = $node->safe_psql($db, qq{SELECT jsonb_build_object('id', e.id, 'aggregate_type', e.aggregate_type,
  'aggregate_id', e.aggregate_id, 'seq', e.seq, 'event_type', e.event_type, 'payload', e.payload,
  'headers', e.headers, 'created_at', e.created_at, 'attempts', 1)::text
  FROM idempotency.outbox_events e WHERE e.id = '$weird'});
my ($out, $err);
IPC::Run::run([ 'idem-relay', '-d', relay_connstr($node, $db), '--once' ],
	'<', \undef, '>', \$out, '2>', \$err, IPC::Run::timeout(60));
is($?, 0, 'stdout --once: exit 0');
is($out, "$want\n", "the event's JSON is jsonb's, byte for byte") or diag($err);

# --- two batches in hand, and SIGTERM with them
emit(20, 20, 'o');		# 400 events, 20 aggregates
my $relay = start_relay($node, "$tmp/relay1.out", @sink);
ok(wait_until(30, sub { @{ arrivals() } >= 20 }), 'events arrive through the slow sink');
is(max_live_leases(20), 2, 'two batches in hand: the next one claimed while this one is published');
ok(stop_relay($relay), 'SIGTERM with two batches in hand: exit 0');
my %arrived = map { $_->{id} => 1 } @{ arrivals() };
cmp_ok(scalar(keys %arrived), '<', 400, 'stopped before the end (' . scalar(keys %arrived) . ' arrived)');
is(live_leases(), '0', 'no lease left: the rest of the batch and the prefetched batch given back');
is(pending(), 400 - scalar(keys %arrived), 'every event that arrived is acked, no other');
like(slurp_file("$tmp/relay1.out.err"), qr/msg=stopped/, 'the relay says it stopped');

# --prefetch 0: one batch at a time
$relay = start_relay($node, "$tmp/relay2.out", @sink, '--prefetch', '0');
ok(wait_until(30, sub { live_leases() >= 1 }), '--prefetch 0 delivers');
is(max_live_leases(3), 1, '--prefetch 0: never two batches in hand');
ok(stop_relay($relay), '--prefetch 0: SIGTERM, exit 0');
is(live_leases(), '0', '--prefetch 0: no lease left after SIGTERM');

# --once drains all, in order (the same run checked with check_arrivals below)
IPC::Run::run([ 'idem-relay', '-d', relay_connstr($node, $db), '--once', '-v', '--batch', '20', @sink ],
	'<', \undef, '>', \$out, '2>', \$err, IPC::Run::timeout(120));
is($?, 0, '--once exits 0');
is(pending(), '0', '--once: nothing left');
like($err, qr/msg="batch done" claimed=20 published=20/, '--once: batches of 20');

# one aggregate over several batches: the prefetched claim finds it leased
emit(1, 70, 'single');
IPC::Run::run([ 'idem-relay', '-d', relay_connstr($node, $db), '--once', '-v', '--batch', '20', @sink ],
	'<', \undef, '>', \$out, '2>', \$err, IPC::Run::timeout(120));
is($?, 0, '--once, one aggregate over 4 batches: exit 0');
is(pending(), '0', '... when nothing is left: a claim beside a leased batch that came back empty is not the end');
is(scalar(() = $err =~ /msg="batch done"/g), 4, '... in 4 batches (20 20 20 10)');

# a sink slower than the lease: both batches' leases are extended (the
# prefetched one, claimed with the first, would expire before its turn):
# 3 aggregates of 20 events, a batch each, 0.2 s an event, so 4 s a batch
# under a 3 s lease
emit(3, 20, 'slow');
IPC::Run::run([ 'idem-relay', '-d', relay_connstr($node, $db), '--once', '-v', '--batch', '20',
		'--lease', '3', '--timeout', '1', '--sink', 'sql', '--sql',
		'INSERT INTO got (id, ev) SELECT $2, $1 FROM pg_catalog.pg_sleep(0.2)' ],
	'<', \undef, '>', \$out, '2>', \$err, IPC::Run::timeout(120));
is($?, 0, 'a batch longer than the lease: --once exits 0');
is(pending(), '0', '... with everything delivered');
unlike($err, qr/lease|marked fewer/, '... no lease lost, no ack short: both leases were extended');
is($node->safe_psql($db, q{SELECT count(*) - count(DISTINCT id) FROM got WHERE ev->>'aggregate_id' LIKE 'slow%'}),
	'0', '... and no event twice');

# --- SIGKILL with two batches in hand, then the server restarted mid-overlap
emit(20, 25, 'k');		# 500 more
my $before = @{ arrivals() };
$relay = start_relay($node, "$tmp/relay3.out", @sink);
ok(wait_until(30, sub { @{ arrivals() } >= $before + 40 }), 'the relay delivers');
is(max_live_leases(20), 2, 'two batches in hand ...');
kill_relay($relay);
note('... relay killed with SIGKILL after ' . (@{ arrivals() } - $before) . ' arrivals');
note('... with ' . live_leases() . ' live leases');
ok(wait_until(10, sub { live_leases() eq '0' }), '... which expire (3 s)');
$relay = start_relay($node, "$tmp/relay3.out", @sink);
ok(wait_until(30, sub { @{ arrivals() } >= $before + 200 }), 'the restarted relay delivers');
is(max_live_leases(20), 2, 'two batches in hand ...');
$node->restart;
note('... server restarted after ' . (@{ arrivals() } - $before) . ' arrivals');
ok(wait_until(90, sub { pending() eq '0' }), 'the relay reconnected and delivered everything');
like(http_get($relay->{port}, '/metrics'), qr/^idem_relay_db_reconnects_total [1-9]\d*$/m,
	'metrics: the reconnection counted');
ok(stop_relay($relay), 'SIGTERM: exit 0');

# a kill and a restart: each loses at most the two batches in hand (20 each)
check_arrivals($node, arrivals(), max_dups => 2 * 2 * 20);

$node->stop;
done_testing();
