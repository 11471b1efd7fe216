# idem-relay (tools/idem-relay) with the stdout sink, as role relay with
# the relay capability only: pgbench emitters run with 20 % rollbacks while
# the relay is killed with SIGKILL mid-batch and restarted, and its database
# connection is terminated (it reconnects); then every committed event has
# arrived, nothing rolled back did, first arrivals per aggregate are in seq
# order, duplicates are at most two batches per kill (lost acks, counted and
# printed); SIGTERM drains and exits 0; the metrics endpoint counts.  Also
# the configuration: --help names the sinks and sources compiled in, bad
# configuration (flags, environment, file; outbound and --in) exits 2 with
# a message, and a file and the
# environment are read with the command line winning.  --listen: the
# claim once more after a notification (--notify-window, or the database's
# longer idempotency.outbox_notify_window) finds what emitters under
# outbox_notify = 'coalesce' committed without one, and a notification
# libpq read with a claim's result wakes the relay at once.
use strict;
use warnings;

use JSON::PP;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep time);
use IdemTest;
use RelayTest;

need_binary('idem-relay');

# --- configuration, without a server
my ($out, $err);
IPC::Run::run([ 'idem-relay', '--help' ], '>', \$out, '2>', \$err);
like($out, qr/Sinks compiled in: stdout/, '--help names the sinks compiled in');
like($out, qr/--metrics-listen/, '--help lists the options');
like($out, qr/Sources compiled in: /, '--help names the sources compiled in');
like($out, qr/--in SOURCE.*--hmac-secret/s, '--help lists the inbound options');

my $tmp = PostgreSQL::Test::Utils::tempdir();
my @bad = (
	[ [ '--bogus' ], {}, qr/unknown option "--bogus"/ ],
	[ [ '--batch', 'ten' ], {}, qr/invalid value "ten" for --batch/ ],
	[ [ '--batch', '0' ], {}, qr/--batch must be at least 1/ ],
	[ [ '--sink', 'kafka' ], {}, qr/unknown sink "kafka" \(compiled in: stdout/ ],
	[ [ '--lease', '5', '--timeout', '10' ], {}, qr/--timeout must be shorter than --lease/ ],
	[ [ '--log-format', 'xml' ], {}, qr/invalid --log-format "xml"/ ],
	[ [ '--metrics-listen', 'nowhere' ], {}, qr/HOST:PORT expected/ ],
	[ [], { IDEM_RELAY_LEASE => 'soon' }, qr/invalid value "soon" for IDEM_RELAY_LEASE/ ],
	[ [ '--config', "$tmp/missing.conf" ], {}, qr/could not open configuration file/ ],
	[ [ '--batch' ], {}, qr/option --batch needs a value/ ],
	# inbound (--in)
	[ [ '--in', 'kafka' ], {}, qr/unknown source "kafka" \(compiled in: / ],
	[ [ '--in', 'http', '--sink', 'stdout' ], {}, qr/--in and --sink exclude each other/ ],
	[ [ '--in', 'http' ], { IDEM_RELAY_SINK => 'redis' }, qr/--in and --sink exclude each other/ ],
	[ [ '--in', 'http', '--message-id', 'Idempotency-Key' ], {}, qr/invalid --message-id "Idempotency-Key": header:NAME or json:\/POINTER expected/ ],
	[ [ '--in', 'http', '--message-id', 'header:' ], {}, qr/--message-id must name a header or a JSON pointer/ ],
	[ [ '--in', 'http', '--ordering-key', 'json:account' ], {}, qr/invalid --ordering-key "json:account"/ ],
	[ [ '--in', 'http', '--source', '' ], {}, qr/--source must not be empty/ ],
	[ [ '--in', 'http', '--hmac-format', 'md5' ], {}, qr/invalid --hmac-format "md5": hex or stripe/ ],
	[ [ '--in', 'redis', '--hmac-secret', 'x' ], {}, qr/--hmac-secret is for --in http only/ ],
	[ [ '--in', 'http', '--hmac-tolerance', '-1' ], {}, qr/invalid value "-1" for --hmac-tolerance/ ],
);
open my $fh, '>', "$tmp/bad.conf" or die;
print $fh "# a comment\nbatch = 5\nfrobnicate = 1\n";
close $fh;
push @bad, [ [ '--config', "$tmp/bad.conf" ], {}, qr/unknown option "frobnicate" in .*bad.conf line 3/ ];
foreach my $b (@bad)
{
	my ($args, $env, $re) = @$b;
	local @ENV{ keys %$env } = values %$env;
	IPC::Run::run([ 'idem-relay', @$args ], '<', \undef, '>', \$out, '2>', \$err);
	is($? >> 8, 2, "exit 2: idem-relay @$args " . join(' ', %$env));
	like($err, $re, "message: $re");
}

# --- the node, the emitters and the relay
my $node = relay_node('relay_stdout');
my $db = 'postgres';
my $file = "$tmp/out.jsonl";

# the file, the environment and the command line, the last winning: the
# file's sink would be refused (http without --url), the environment
# overrides it, and the command line's --once makes this run end
open $fh, '>', "$tmp/relay.conf" or die;
print $fh "sink = http\nbatch = 7\n";
close $fh;
{
	local $ENV{IDEM_RELAY_SINK} = 'stdout';
	$node->safe_psql($db, q{INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM generate_series(1, 10) g, LATERAL idem_outbox_emit('load', 'pre', 'ev', jsonb_build_object('g', g)) e});
	IPC::Run::run([ 'idem-relay', '--config', "$tmp/relay.conf", '-d', relay_connstr($node, $db), '--once', '-v' ],
		'<', \undef, '>>', $file, '2>', \$err);
	is($?, 0, '--config file, environment and flags: --once exits 0 when nothing is left');
	like($err, qr/msg="batch done" claimed=7 published=7/, 'the file set the batch (7), the environment the sink');
}

# --subscription: a relay of another subscription delivers the same events
# again, its own progress apart; one of no subscription exits non-zero
$node->safe_psql($db, q{SELECT idem_outbox_subscribe('audit', ARRAY['load'], 'earliest')});
IPC::Run::run([ 'idem-relay', '-d', relay_connstr($node, $db), '--subscription', 'audit', '--once', '-v' ],
	'<', \undef, '>', \$out, '2>', \$err);
is($?, 0, '--subscription audit --once exits 0');
is(scalar(grep { ((eval { decode_json($_) } // {})->{aggregate_id} // '') eq 'pre' } split /\n/, $out), 10,
	'... having delivered the 10 events that the default subscription had delivered already');
is($node->safe_psql($db, q{SELECT pending FROM idempotency.outbox_subscriptions_status WHERE name = 'audit'}),
	'0', '... and acked them on audit');
# (no --once: it stops by itself, as no retry would help)
IPC::Run::run([ 'idem-relay', '-d', relay_connstr($node, $db), '--subscription', 'nosuch' ],
	'<', \undef, '>', \$out, '2>', \$err, IPC::Run::timeout(60));
isnt($?, 0, '--subscription of none: the relay stops, with a non-zero exit');
like($err, qr/cannot deliver this subscription.*outbox subscription \\?"nosuch\\?" does not exist/,
	'... saying why');
$node->safe_psql($db, q{SELECT idem_outbox_unsubscribe('audit')});

my $emitters = start_emitters($node, 150);
my $relay = start_relay($node, $file);

sub arrivals
{
	my @a;
	open my $in, '<', $file or return [];
	while (my $line = <$in>)
	{
		next unless $line =~ /\n\z/;    # a line cut by SIGKILL is no arrival
		my $e = eval { decode_json($line) } or next;
		push @a, $e;
	}
	close $in;
	return \@a;
}

ok(wait_until(60, sub { @{ arrivals() } >= 300 }), 'events arrive while emitters run');
kill_relay($relay);
note('relay killed with SIGKILL after ' . scalar(@{ arrivals() }) . ' arrivals');
$relay = start_relay($node, $file);
ok(wait_until(60, sub { @{ arrivals() } >= 700 }), 'the restarted relay delivers');

# the database drops the relay's connection: it reconnects
$node->safe_psql($db, q{SELECT pg_terminate_backend(pid) FROM pg_stat_activity
  WHERE usename = 'relay' AND backend_type = 'client backend'});
ok(wait_until(60, sub { @{ arrivals() } >= 1000 }), 'the relay reconnected and delivers');
stop_emitters($emitters);

my $total = $node->safe_psql($db, 'SELECT count(*) FROM emitted');
ok( wait_until(90, sub {
		my %s = map { $_->{id} => 1 } @{ arrivals() };
		scalar(keys %s) >= $total }),
	"all $total committed events arrived");
my $metrics = http_get($relay->{port}, '/metrics');
like($metrics, qr/^idem_relay_published_total [1-9]\d*$/m, 'metrics: published counted');
like($metrics, qr/^idem_relay_acked_total [1-9]\d*$/m, 'metrics: acked counted');
like($metrics, qr/^idem_relay_db_reconnects_total [1-9]\d*$/m, 'metrics: the reconnect counted');
like($metrics, qr/^idem_relay_batch_seconds_count [1-9]\d*$/m, 'metrics: the batch latency histogram');
like(http_get($relay->{port}, '/other'), qr/not found/, 'metrics: other paths are 404');
ok(stop_relay($relay), 'SIGTERM: the relay drains and exits 0');

# a kill and a terminated connection: each loses at most the two batches
# in hand (the one published and the one whose ack was in flight), 20 each
check_arrivals($node, arrivals(), max_dups => 2 * 2 * 20);
is($node->safe_psql($db, 'SELECT coalesce(sum(pending), 0) FROM idempotency.outbox_backlog'), '0',
	'nothing is left undelivered');

# --notify-window: an emitter under outbox_notify = 'coalesce' sends no
# NOTIFY for a commit within its window (1 s) of its last one; the relay
# claims once more --notify-window (2 s) after each notification, so such
# an event arrives long before --poll (30 s)
my $cfile = "$tmp/coalesce.out";
my $crelay = RelayTest::run_relay($cfile, '-d', relay_connstr($node, $db), '--listen', '--poll', '30',
	'--notify-window', '2', '--batch', '20');
sub arrived
{
	my ($id, $file) = @_;
	open my $in, '<', $file // $cfile or return 0;
	my $n = grep { /"aggregate_id": ?"\Q$id\E"/ } <$in>;
	close $in;
	return $n;
}
# it listens: an event of a 'commit' emitter wakes it
ok(wait_until(30, sub {
		$node->safe_psql($db, q{SELECT idem_outbox_emit('burst', 'warm', 'e', '{}')}) if !arrived('warm');
		sleep(1);
		arrived('warm') }), 'the relay is listening');
$node->safe_psql($db, q{
SET idempotency.outbox_notify = 'coalesce';
SET idempotency.outbox_notify_window = '1s';
SELECT idem_outbox_emit('burst', 'first', 'e', '{}');
SELECT pg_sleep(0.3);
SELECT idem_outbox_emit('burst', 'second', 'e', '{}');
});
ok(wait_until(10, sub { arrived('first') && arrived('second') }),
	"--notify-window: the event committed without a NOTIFY arrives before --poll");
ok(stop_relay($crelay), 'SIGTERM: exit 0');

# a notification that libpq read with a claim's result (the event committed
# after the claim's snapshot; the server sends what came meanwhile before
# ReadyForQuery) is acted on at once, not when select() next times out
# (0.2 s): the relay reaches the server through a proxy, stalled while a
# claim (--poll 1) runs and an event commits, then handing over both in one
# write.  The median of 3 tries.
$node->append_conf('postgresql.conf', "listen_addresses = '127.0.0.1'");
$node->restart;
my $proxy = start_proxy($tmp, $node->port);
my $bfile = "$tmp/buffered.out";
my $brelay = RelayTest::run_relay($bfile, '-d', "host=127.0.0.1 port=$proxy->{port} dbname=$db user=relay",
	'--listen', '--poll', '1', '--notify-window', '0');
$node->safe_psql($db, q{SELECT idem_outbox_emit('burst', 'ready', 'e', '{}')});
ok(wait_until(30, sub { arrived('ready', $bfile) }), 'the relay delivers through the proxy');
my @late;
foreach my $try (1 .. 3)
{
	usleep(500_000);	# the claims after the last batch done: the relay waits
	proxy_delay($proxy, 'stall');
	my $stalled = $node->safe_psql($db, 'SELECT pg_catalog.clock_timestamp()');
	ok( wait_until(10, sub {
			# (or, on a slow machine, the relay waits for a reply held back
			# since before: it has not polled for 2 s)
			$node->safe_psql($db, qq{SELECT count(*) FROM pg_stat_activity
  WHERE usename = 'relay' AND state = 'idle'
    AND (query LIKE '%idem_outbox_claim%' AND query_start > '$stalled'
         OR state_change < pg_catalog.now() - interval '2 s')}) eq '1' }),
		"try $try: a claim ran, its result held back");
	$node->safe_psql($db, qq{SELECT idem_outbox_emit('burst', 'late$try', 'e', '{}')});
	usleep(300_000);	# its NOTIFY reaches the proxy
	my $t0 = time;
	proxy_delay($proxy, 0);
	usleep(10_000) until arrived("late$try", $bfile) || time - $t0 > 10;
	push @late, time - $t0;
}
my $median = (sort { $a <=> $b } @late)[1];
note(sprintf('latencies of an event whose notification came with a claim: %s', join(' ', map { sprintf('%.3f', $_) } @late)));
cmp_ok($median, '<', 0.15, 'a notification read with a claim\'s result wakes the relay at once (median)');
ok(stop_relay($brelay), 'SIGTERM: exit 0');

# the emitters' window longer than --notify-window (0.02 s, the default):
# the relay claims once more after twice the window its session sees (here
# the database's 500 ms, stored while the library was not loaded: 1 s), not
# only at --poll (30 s)
$node->safe_psql($db, q{ALTER DATABASE postgres SET idempotency.outbox_notify_window = '500ms'});
my $wfile = "$tmp/window.out";
my $wrelay = RelayTest::run_relay($wfile, '-d', relay_connstr($node, $db), '--listen', '--poll', '30');
$node->safe_psql($db, q{SELECT idem_outbox_emit('burst', 'wready', 'e', '{}')});
ok(wait_until(30, sub { arrived('wready', $wfile) }), 'the relay delivers');
sleep(1);
like(slurp_file("$wfile.err"), qr/connected to the database.*notify_window=1\b/,
	'it waits twice the database\'s window, longer than its --notify-window');
$node->safe_psql($db, q{
SET idempotency.outbox_notify = 'coalesce';
SELECT idem_outbox_emit('burst', 'wfirst', 'e', '{}');
SELECT pg_sleep(0.1);
SELECT idem_outbox_emit('burst', 'wsecond', 'e', '{}');
});
my $tw = time;
usleep(10_000) until arrived('wsecond', $wfile) || time - $tw > 10;
$tw = time - $tw;
note(sprintf('the event committed without a NOTIFY arrived %.3f s after its commit', $tw));
cmp_ok($tw, '<', 5, 'an event in the database\'s window arrives about the window after the NOTIFY, not at --poll');
ok(stop_relay($wrelay), 'SIGTERM: exit 0');
$node->safe_psql($db, q{ALTER DATABASE postgres RESET idempotency.outbox_notify_window});

# the window as a session that has not loaded the library sees it: a bare
# number is milliseconds (twice 300 ms: 0.6 s); a value the relay cannot
# read is logged, and --notify-window (0.02 s, the default) stays
foreach my $case (
	[ '300', qr/connected to the database.*notify_window=0\.6\b/, 'a bare number is milliseconds' ],
	[ 'soon', qr/cannot read idempotency\.outbox_notify_window.*value=soon(?s:.*)connected to the database.*notify_window=0\.02\b/,
	  'a value it cannot read is logged, and --notify-window kept' ])
{
	my ($value, $want, $name) = @$case;
	my $cfile = "$tmp/window-$value.out";

	$node->safe_psql($db, "ALTER DATABASE postgres SET idempotency.outbox_notify_window = '$value'");
	my $crelay = RelayTest::run_relay($cfile, '-d', relay_connstr($node, $db), '--listen', '--poll', '30');
	ok(wait_until(30, sub { -e "$cfile.err" && slurp_file("$cfile.err") =~ /connected to the database/ }),
		"the relay connects with the database's window '$value'");
	like(slurp_file("$cfile.err"), $want, $name);
	ok(stop_relay($crelay), 'SIGTERM: exit 0');
	$node->safe_psql($db, q{ALTER DATABASE postgres RESET idempotency.outbox_notify_window});
}

$node->stop;
done_testing();
