# What the idem-relay TAP tests (09x_relay_*.pl) share: a node with the
# extension and a relay role (relay_node; the role's rights are set up in
# relay_role only), emitters with rollbacks (start_emitters), the relay
# started, killed with SIGKILL and stopped with SIGTERM (start_relay,
# kill_relay, stop_relay), a broker binary found or the test skipped
# (need_binary: a skip only without CI=true), free loopback ports, and the
# checks every sink's test makes of what arrived (check_arrivals).  For
# the inbound tests (095-098): the role inbound with the handler capability
# for one source only (inbound_role), the relay started with --in
# (start_inbound), messages with deliberate duplicates (inbound_messages),
# what the inbox holds (inbox_rows) and the checks of it (check_inbox), and
# a webhook POST (http_post); the run every broker source's test makes
# (inbound_scenario).  The brokers, each on 127.0.0.1 and a free
# port with its data in a directory of the test's: redis (start_redis,
# redis_cli), nats-server with JetStream (start_nats, nats_requests: a few
# lines of the NATS protocol), RabbitMQ (rabbit_node, start_rabbit,
# stop_rabbit, amqp: helpers/amqp_dump.c, built here); stop_broker.  A
# TCP proxy between the relay and a broker that holds back what the broker
# sends (start_proxy, proxy_delay, proxy_cut; late_confirms).  What the
# sinks' tests repeat: the relay under emitters killed and restarted
# (relay_killed_and_restarted), the broker away and back (broker_outage),
# a poison event (poison_flows, poison_error), what a webhook receiver, a
# NATS stream or a RabbitMQ queue got (start_webhook, jsonl,
# nats_stream_info, nats_stored, nats_messages, rabbit_with_queue,
# amqp_arrivals), the relay's binaries (need_relay).  A test that dies
# leaves no broker or proxy behind.
#
# An arrival is a hash {id, aggregate_type, aggregate_id, seq}, in the order
# the broker (or the reader) got them.
package RelayTest;

use strict;
use warnings;

use Exporter 'import';
use IPC::Run;
use JSON::PP;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep time);
use IdemTest;

our @EXPORT = qw(relay_node relay_role need_binary free_port start_emitters
  stop_emitters start_relay kill_relay stop_relay wait_until check_arrivals
  emit_poison http_get relay_connstr drain_and_dead_letter inbound_role
  start_inbound inbound_messages inbox_rows check_inbox http_post metric
  start_redis redis_cli stop_broker start_nats nats_requests rabbit_node
  start_rabbit stop_rabbit amqp inbound_scenario start_proxy proxy_delay
  proxy_cut need_relay RABBITMQ_SERVER jsonl start_webhook nats_stream_info
  nats_stored nats_messages amqp_arrivals late_confirms
  relay_killed_and_restarted broker_outage poison_flows poison_error
  rabbit_with_queue);

# RabbitMQ's server (a broker binary for need_relay)
use constant RABBITMQ_SERVER => '/usr/lib/rabbitmq/bin/rabbitmq-server';

# skip the whole test if $bin is not on PATH, unless CI=true (then fail)
sub need_binary
{
	my ($bin) = @_;
	my $found = grep { -x "$_/$bin" } split /:/, ($ENV{PATH} // ''), -1;
	$found ||= -x $bin;
	return if $found;
	BAIL_OUT("$bin not found on PATH (CI=true: a missing broker is a failure)")
	  if ($ENV{CI} // '') eq 'true';
	plan skip_all => "$bin not found on PATH (install it: test/lib.sh IDEM_PACKAGES)";
}

# need_binary of idem-relay and @bins, then its --help must name $name
# among the sinks ($kind 'sink') or the sources ('source') compiled in
sub need_relay
{
	my ($kind, $name, @bins) = @_;
	need_binary($_) foreach ('idem-relay', @bins);
	my $list = $kind eq 'sink' ? 'Sinks' : 'Sources';
	like(`idem-relay --help`, qr/$list compiled in: .*\b\Q$name\E\b/, "the $name $kind is compiled in");
	return;
}

sub free_port { return PostgreSQL::Test::Cluster::get_free_port(); }

# The relay's role gets its rights here and nowhere else.
sub relay_role
{
	my ($node, $db) = @_;
	$node->safe_psql($db, q{
CREATE ROLE relay LOGIN;
SELECT idem_grant('relay', 'relay');
-- a poison event ends in dead letters soon, and its aggregate is skipped
ALTER ROLE relay SET idempotency.outbox_max_attempts = 3;
ALTER ROLE relay SET idempotency.outbox_dead_policy = 'skip';
});
	return;
}

sub relay_connstr
{
	my ($node, $db) = @_;
	return $node->connstr($db) . ' user=relay';
}

# a node with the extension, the relay role and the table of committed emits
sub relay_node
{
	my ($name) = @_;
	my $node = idem_node($name, conf => "max_connections = 40\nfsync = off");
	$node->safe_psql('postgres', q{
CREATE EXTENSION idempotency;
-- what committed emits returned (written in the emitting transaction)
CREATE TABLE emitted (id uuid PRIMARY KEY, aggregate_type text NOT NULL,
                      aggregate_id text NOT NULL, seq bigint NOT NULL);
});
	relay_role($node, 'postgres');
	return $node;
}

# pgbench emitters: 2 clients, at most $rate transactions/s in all, 20 % of
# them rolled back, 1-3 events per transaction to 30 aggregates of type
# 'load'; returns the harness
sub start_emitters
{
	my ($node, $rate) = @_;
	my $tmp = PostgreSQL::Test::Utils::tempdir();
	open my $fh, '>', "$tmp/emit.sql" or die;
	print $fh q{
\set a random(1, 30)
\set n random(1, 3)
\set r random(1, 100)
BEGIN;
INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM generate_series(1, :n) g,
       LATERAL idem_outbox_emit('load', 'a' || :a, 'ev', jsonb_build_object('g', g, 'r', :r)) e;
\if :r <= 20
ROLLBACK;
\else
COMMIT;
\endif
};
	close $fh;
	my $out = '';
	my $h = IPC::Run::start(
		[
			'pgbench', '-n', '-h', $node->host, '-p', $node->port,
			'-c', '2', '-R', $rate, '-T', '600', '-f', "$tmp/emit.sql", 'postgres'
		],
		'>&', \$out);
	return $h;
}

sub stop_emitters { my ($h) = @_; $h->kill_kill; return; }

# every relay started, killed at the end if still running (a test that
# dies leaves none behind)
my @relays;
END { local $?; $_->{h}->kill_kill for grep { $_->{h}->pumpable } @relays; }

# idem-relay with @args and --metrics-listen on a free port, stdout
# appended to $out (a file), stderr to $out.err; returns {h, port}
sub run_relay
{
	my ($out, @args) = @_;
	my $mport = free_port();
	my $h = IPC::Run::start([ 'idem-relay', '--metrics-listen', "127.0.0.1:$mport", @args ],
		'<', \undef, '>>', $out, '2>>', "$out.err");
	push @relays, { h => $h, port => $mport };
	return $relays[-1];
}

# the outbound relay as role relay with @args (besides -d, --listen,
# --poll, --lease, --timeout, --batch)
sub start_relay
{
	my ($node, $out, @args) = @_;
	return run_relay($out, '-d', relay_connstr($node, 'postgres'), '--listen',
		'--poll', '0.5', '--lease', '3', '--timeout', '1', '--batch', '20', @args);
}

# The inbound relay's role: the handler capability for inbox source
# $source only (idem_inbox_receive; nothing else).
sub inbound_role
{
	my ($node, $source) = @_;
	$node->safe_psql('postgres', qq{
CREATE ROLE inbound LOGIN;
SELECT idem_grant('inbound', 'handler', sources => ARRAY['$source']);
});
	return;
}

# idem-relay --in $in as role inbound with @args (besides -d, --poll,
# --timeout, --batch, --lease)
sub start_inbound
{
	my ($node, $out, $in, @args) = @_;
	return run_relay($out, '-d', $node->connstr('postgres') . ' user=inbound', '--in', $in,
		'--poll', '0.5', '--timeout', '2', '--lease', '3', '--batch', '20', @args);
}

# the value of metric $name at the relay's endpoint (undef if absent)
sub metric
{
	my ($r, $name) = @_;
	return http_get($r->{port}, '/metrics') =~ /^\Q$name\E (\S+)$/m ? $1 : undef;
}

# $n messages in rounds: a list of [message id, payload JSON] where about
# one in ten is sent twice (the same id and payload: a broker's redelivery
# or a producer's retry), ids "$prefix-1" ...; payload {"n": i, "account":
# "acct-(i mod 7)"}
sub inbound_messages
{
	my ($prefix, $n) = @_;
	my @m;
	for my $i (1 .. $n)
	{
		my $msg = [ "$prefix-$i", sprintf('{"n": %d, "account": "acct-%d"}', $i, $i % 7) ];
		push @m, $msg;
		push @m, $msg if $i % 10 == 3;
	}
	return @m;
}

# what the inbox holds for $source: message id => {count, n, ordering_key}
sub inbox_rows
{
	my ($node, $source) = @_;
	my %rows;
	foreach my $line (split /\n/, $node->safe_psql('postgres', qq{
SELECT message_id, count(*), min(payload->>'n'), min(coalesce(headers->>'ordering_key', ''))
  FROM idempotency.inbox_messages WHERE source = '$source' GROUP BY message_id}))
	{
		my ($id, $c, $n, $k) = split /\|/, $line, -1;
		$rows{$id} = { count => $c, n => $n, ordering_key => $k };
	}
	return \%rows;
}

# every message of @sent (inbound_messages' list) is in the inbox once with
# its payload, and nothing else is
sub check_inbox
{
	my ($node, $source, @sent) = @_;
	my $rows = inbox_rows($node, $source);
	my %want = map { $_->[0] => ($_->[1] =~ /"n": (\d+)/)[0] } @sent;
	my @missing = grep { !$rows->{$_} } sort keys %want;
	my @twice = grep { $rows->{$_}{count} != 1 } sort keys %$rows;
	my @foreign = grep { !exists $want{$_} } sort keys %$rows;
	my @wrong = grep { $rows->{$_} && $rows->{$_}{n} ne $want{$_} } sort keys %want;
	my $dups = @sent - scalar(keys %want);
	cmp_ok($dups, '>', 0, "the producers sent $dups messages twice");
	is(scalar(@missing), 0, 'every message sent is in the inbox (none lost)')
	  or diag('missing: ' . join(' ', @missing[ 0 .. ($#missing < 9 ? $#missing : 9) ]));
	is(scalar(@twice), 0, 'each message is stored once');
	is(scalar(@foreign), 0, 'nothing is stored that was not sent') or diag("foreign: @foreign");
	is(scalar(@wrong), 0, 'each message is stored with its payload') or diag("wrong: @wrong");
	return;
}

# The run of a broker source's test (096-098), as role inbound for inbox
# source $o{source}: 600 messages (inbound_messages 'w', 60 of them twice)
# published in 10 rounds by $o{publish}->(@messages); the relay
# ($o{start}->(): start_inbound's harness) killed with SIGKILL mid-stream
# and restarted, the broker restarted ($o{restart_broker}->(): stopped for
# 3 s, started) while messages wait; every message stored once, none lost,
# and $o{unacked}->() (the broker's messages not acked, read or not) 0 at
# the end.  Then the database refuses (capability revoked): 20 more
# messages ('r') fail, none is stored and none acked ($o{unacked} counts
# them all) until the capability is back; then they are stored and acked.
# Returns (the relay, every message sent).
sub inbound_scenario
{
	my (%o) = @_;
	my ($node, $source) = ($o{node}, $o{source});
	my $stored = sub { scalar(keys %{ inbox_rows($node, $source) }) };
	my @msgs = inbound_messages('w', 600);
	my @rounds = map { [ @msgs[ $_ * 66 .. ($_ == 9 ? $#msgs : $_ * 66 + 65) ] ] } 0 .. 9;

	$o{publish}->(@{ shift @rounds }) for 1 .. 3;
	my $relay = $o{start}->();
	ok(wait_until(60, sub { $stored->() >= 60 }), 'messages are stored');
	kill_relay($relay);
	note('relay killed with SIGKILL after ' . $stored->() . ' stored; not acked: ' . $o{unacked}->());
	$o{publish}->(@{ shift @rounds }) for 1 .. 2;
	$relay = $o{start}->();
	ok(wait_until(60, sub { $stored->() >= 250 }), 'the restarted relay stores');
	$o{restart_broker}->();
	$o{publish}->(@{ shift @rounds }) while @rounds;
	ok(wait_until(90, sub { $stored->() >= 540 }), 'storing resumes once the broker is back');
	ok(wait_until(30, sub { $o{unacked}->() == 0 }), 'every message was acked');
	check_inbox($node, $source, @msgs);
	like(metric($relay, 'idem_relay_in_source_reconnects_total'), qr/^[1-9]\d*$/,
		'metrics: the reconnection to the broker counted');

	$node->safe_psql('postgres', q{SELECT idem_revoke('inbound')});
	my @refused = inbound_messages('r', 20);
	$o{publish}->(@refused);
	ok(wait_until(30, sub { (metric($relay, 'idem_relay_in_failed_total') // 0) > 0 }),
		'with the capability revoked, storing fails');
	sleep 1;
	is($o{unacked}->(), scalar(@refused), 'none of the messages is acked');
	is(scalar(grep { /^r-/ } keys %{ inbox_rows($node, $source) }), 0, 'and none is stored');
	$node->safe_psql('postgres', qq{SELECT idem_grant('inbound', 'handler', sources => ARRAY['$source'])});
	ok(wait_until(60, sub { 20 == grep { /^r-/ } keys %{ inbox_rows($node, $source) } }),
		'the capability back, they are delivered again and stored');
	ok(wait_until(30, sub { $o{unacked}->() == 0 }), '... and acked');
	return ($relay, @msgs, @refused);
}

# POST $body to http://127.0.0.1:$port$path with headers (name => value,
# ...); (status, body), status 0 if no connection
sub http_post
{
	my ($port, $path, $body, @headers) = @_;
	require IO::Socket::INET;
	my $s = IO::Socket::INET->new(PeerAddr => '127.0.0.1', PeerPort => $port, Timeout => 10)
	  or return (0, '');
	my $req = "POST $path HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
	  . "Content-Type: application/json\r\nContent-Length: " . length($body) . "\r\n";
	while (my ($k, $v) = splice(@headers, 0, 2)) { $req .= "$k: $v\r\n"; }
	print $s "$req\r\n$body";
	local $/;
	my $resp = <$s> // '';
	close $s;
	my ($status) = $resp =~ m{^HTTP/1\.\d (\d{3})};
	$resp =~ s/^.*?\r\n\r\n//s;
	return ($status // 0, $resp);
}

# the complete lines of JSON lines file $path, decoded (a list)
sub jsonl
{
	my ($path) = @_;
	my @a;
	open my $in, '<', $path or return [];
	while (my $line = <$in>) { push @a, decode_json($line) if $line =~ /\n\z/; }
	close $in;
	return \@a;
}

# helpers/webhook.py on 127.0.0.1:$port writing what it is POSTed to $file
# (@args: its other arguments), its output in webhook.log beside $file;
# returns the harness once it accepts a connection
sub start_webhook
{
	my ($port, $file, @args) = @_;
	require File::Basename;
	require IO::Socket::INET;
	my $h = IPC::Run::start(
		[ 'python3', File::Basename::dirname(__FILE__) . '/helpers/webhook.py', $port, $file, @args ],
		'<', \undef, '>>', File::Basename::dirname($file) . '/webhook.log', '2>&1');
	wait_until(20, sub { IO::Socket::INET->new(PeerAddr => '127.0.0.1', PeerPort => $port) })
	  or die 'webhook receiver did not start';
	return $h;
}

# --- brokers

my (@brokers, @rabbits);
END
{
	local $?;
	$_->kill_kill for grep { $_->pumpable } @brokers;
	foreach my $r (@rabbits)
	{
		stop_rabbit($r) if $r->{h};
		local @ENV{ keys %{ $r->{env} } } = values %{ $r->{env} };
		system('epmd', '-port', $r->{env}{ERL_EPMD_PORT}, '-kill');
	}
}

sub stop_broker
{
	my ($h) = @_;
	$h->signal('TERM');
	$h->finish;
	return;
}

# redis-cli @args against 127.0.0.1:$port (--raw); its output
sub redis_cli
{
	my ($port, @args) = @_;
	my $o = '';
	IPC::Run::run([ 'redis-cli', '-h', '127.0.0.1', '-p', $port, '--raw', @args ], '>', \$o, '2>', \my $e);
	return $o;
}

# redis-server in $dir, append-only with fsync always (a restart keeps the
# streams); the harness once it answers PING
sub start_redis
{
	my ($dir, $port) = @_;
	my $h = IPC::Run::start(
		[
			'redis-server', '--port', $port, '--bind', '127.0.0.1', '--dir', $dir,
			'--save', '', '--appendonly', 'yes', '--appendfsync', 'always', '--protected-mode', 'yes'
		],
		'<', \undef, '>>', "$dir/redis.log", '2>&1');
	push @brokers, $h;
	wait_until(20, sub { redis_cli($port, 'PING') =~ /PONG/ })
	  or die 'redis-server did not start: ' . PostgreSQL::Test::Utils::slurp_file("$dir/redis.log");
	return $h;
}

# nats-server with JetStream, file storage in $dir/js (a restart keeps the
# streams); the harness once it accepts connections
sub start_nats
{
	my ($dir, $port) = @_;
	require IO::Socket::INET;
	my $h = IPC::Run::start(
		[ 'nats-server', '-js', '-a', '127.0.0.1', '-p', $port, '-sd', "$dir/js", '-l', "$dir/nats.log" ],
		'<', \undef, '>>', "$dir/nats.out", '2>&1');
	push @brokers, $h;
	wait_until(20, sub { IO::Socket::INET->new(PeerAddr => '127.0.0.1', PeerPort => $port) })
	  or die 'nats-server did not start';
	return $h;
}

# requests over one connection to nats-server on $port:
# nats_requests($port, [subject, payload, msg_id], ...) (msg_id: sent as
# header Nats-Msg-Id if defined) returns the reply payloads (undef for no
# responders)
sub nats_requests
{
	my ($port, @req) = @_;
	require IO::Socket::INET;
	my $s = IO::Socket::INET->new(PeerAddr => '127.0.0.1', PeerPort => $port, Timeout => 10)
	  or return;
	my $info = <$s>;
	print $s qq{CONNECT {"verbose":false,"pedantic":false,"headers":true,"no_responders":true}\r\nSUB _INBOX.t 1\r\n};
	my @replies;
	foreach my $r (@req)
	{
		my ($subject, $payload, $msg_id) = @$r;
		if (defined $msg_id)
		{
			my $h = "NATS/1.0\r\nNats-Msg-Id: $msg_id\r\n\r\n";
			print $s "HPUB $subject _INBOX.t " . length($h) . ' ' . (length($h) + length($payload))
			  . "\r\n$h$payload\r\n";
		}
		else
		{
			print $s "PUB $subject _INBOX.t " . length($payload) . "\r\n$payload\r\n";
		}
		my $reply;
		while (defined(my $line = <$s>))
		{
			if ($line =~ /^PING/) { print $s "PONG\r\n"; next; }
			if ($line =~ /^MSG\s.*?(\d+)\s*$/)
			{
				read($s, $reply, $1 + 2);
				$reply = substr($reply, 0, $1);
				last;
			}
			if ($line =~ /^HMSG\s.*?(\d+)\s*$/)
			{
				read($s, my $skip, $1 + 2);
				$reply = undef;
				last;
			}
			die "nats: $line" if $line =~ /^-ERR/;
		}
		push @replies, $reply;
	}
	close $s;
	return @replies;
}

# JetStream's information on stream $stream (default OUTBOX) of the
# nats-server on $port ({} if none)
sub nats_stream_info
{
	my ($port, $stream) = @_;
	$stream //= 'OUTBOX';
	my ($r) = nats_requests($port, [ "\$JS.API.STREAM.INFO.$stream", '' ]);
	return defined $r ? decode_json($r) : {};
}

# how many messages stream $stream (default OUTBOX) holds
sub nats_stored
{
	my ($port, $stream) = @_;
	return nats_stream_info($port, $stream)->{state}{messages} // 0;
}

# every message of stream $stream (default OUTBOX), in stream order, with
# msg_id (its Nats-Msg-Id) and stored_at (when the stream stored it)
sub nats_messages
{
	my ($port, $stream) = @_;
	require MIME::Base64;
	$stream //= 'OUTBOX';
	my $last = nats_stream_info($port, $stream)->{state}{last_seq} // 0;
	my @r = nats_requests($port, map { [ "\$JS.API.STREAM.MSG.GET.$stream", qq{{"seq":$_}} ] } 1 .. $last);
	my @a;
	foreach my $r (@r)
	{
		my $m = decode_json($r)->{message} or next;
		my $e = decode_json(MIME::Base64::decode_base64($m->{data}));
		my $hdrs = MIME::Base64::decode_base64($m->{hdrs} // '');
		$e->{msg_id} = $hdrs =~ /^Nats-Msg-Id:\s*(\S+)/mi ? $1 : '';
		$e->{stored_at} = $m->{time};
		push @a, $e;
	}
	return \@a;
}

# A RabbitMQ node of the test's user: a private node directory under
# $tmp, RABBITMQ_* variables, every port (epmd's too) free and on
# 127.0.0.1; helpers/amqp_dump.c built.  Returns {env, port, dump}.
sub rabbit_node
{
	my ($tmp) = @_;
	require File::Basename;
	my $dump = "$tmp/amqp_dump";
	my $cflags = `pkg-config --cflags --libs librabbitmq`;
	chomp $cflags;
	system("cc -o $dump " . File::Basename::dirname(__FILE__) . "/helpers/amqp_dump.c $cflags") == 0
	  or BAIL_OUT('cannot build helpers/amqp_dump.c');
	my ($port, $dist, $epmd) = (free_port(), free_port(), free_port());
	my %env = (
		HOME => $tmp,
		RABBITMQ_NODENAME => "idemtest$port\@localhost",
		RABBITMQ_NODE_IP_ADDRESS => '127.0.0.1',
		RABBITMQ_NODE_PORT => $port,
		RABBITMQ_DIST_PORT => $dist,
		ERL_EPMD_PORT => $epmd,
		ERL_EPMD_ADDRESS => '127.0.0.1',
		RABBITMQ_MNESIA_BASE => "$tmp/mnesia",
		RABBITMQ_LOG_BASE => "$tmp/log",
		RABBITMQ_CONFIG_FILE => "$tmp/rabbitmq",
		RABBITMQ_ENABLED_PLUGINS_FILE => "$tmp/enabled_plugins",
		RABBITMQ_PID_FILE => "$tmp/rabbit.pid",
		RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS => '-kernel inet_dist_use_interface {127,0,0,1}',
	);
	open my $fh, '>', "$tmp/enabled_plugins" or die;
	print $fh "[].\n";
	close $fh;
	open $fh, '>', "$tmp/rabbitmq.conf" or die;
	print $fh "listeners.tcp.default = 127.0.0.1:$port\n";
	close $fh;
	my $r = { env => \%env, port => $port, dump => $dump, tmp => $tmp };
	push @rabbits, $r;
	return $r;
}

# amqp_dump PORT @args (helpers/amqp_dump.c), $stdin its input; its
# output, undef if it failed
sub amqp
{
	my ($r, $stdin, @args) = @_;
	my ($out, $err) = ('', '');
	IPC::Run::run([ $r->{dump}, $r->{port}, @args ], '<', \$stdin, '>', \$out, '2>', \$err);
	return $? == 0 ? $out : undef;
}

# what queue "load" of node $r holds, taken (consumed and acked), appended
# to the list $list with msg_id (its message_id); returns $list
sub amqp_arrivals
{
	my ($r, $list) = @_;
	foreach my $line (split /\n/, amqp($r, '', 'take', 'load') // '')
	{
		my ($id, $body) = split / /, $line, 2;
		my $e = decode_json($body);
		$e->{msg_id} = $id;
		push @$list, $e;
	}
	return $list;
}

# A RabbitMQ node (rabbit_node in $tmp) started, with queue "load"; and a
# sub that returns every message the queue had so far (amqp_arrivals into
# a list of its own)
sub rabbit_with_queue
{
	my ($tmp) = @_;
	my $r = rabbit_node($tmp);
	my @list;
	start_rabbit($r, 'load');
	return ($r, sub { amqp_arrivals($r, \@list) });
}

# start the node; up once queue $queue (durable) is declared
sub start_rabbit
{
	my ($r, $queue) = @_;
	local @ENV{ keys %{ $r->{env} } } = values %{ $r->{env} };
	$r->{h} = IPC::Run::start([RABBITMQ_SERVER],
		'<', \undef, '>>', "$r->{tmp}/rabbit.out", '2>&1');
	wait_until(90, sub { defined amqp($r, '', 'declare', $queue) }) or BAIL_OUT('rabbitmq did not start');
	return;
}

sub stop_rabbit
{
	my ($r) = @_;
	local @ENV{ keys %{ $r->{env} } } = values %{ $r->{env} };
	IPC::Run::run([ '/usr/lib/rabbitmq/bin/rabbitmqctl', 'shutdown' ], '>', \my $o, '2>&1');
	$r->{h}->finish if $r->{h};
	$r->{h} = undef;
	return;
}

# --- a proxy between the relay and a broker

my @proxies;
END
{
	local $?;
	foreach my $p (@proxies) { kill 'KILL', $p; waitpid($p, 0); }
}

# A TCP proxy on 127.0.0.1 (a free port) to 127.0.0.1:$to_port, in a child
# process: what the client sends is forwarded at once; what the broker
# sends is held back, in order, until it has waited the delay that file
# $dir/proxy.delay says when it is due (seconds; no file: 0; "stall": until
# the file says otherwise), so a confirm can be made to come after the
# client's timeout; what is due is written at once, in one write (so what
# a stall held back reaches the client in one read).  Touching $dir/proxy.cut closes every connection (the
# data held back with them) and removes the file.  Returns {pid, port, dir}.
sub start_proxy
{
	my ($dir, $to_port) = @_;
	require IO::Select;
	require IO::Socket::INET;
	require POSIX;
	my $port = free_port();
	my $listen = IO::Socket::INET->new(LocalAddr => '127.0.0.1', LocalPort => $port,
		Listen => 16, ReuseAddr => 1) or die "proxy: cannot listen on $port: $!";
	unlink "$dir/proxy.delay", "$dir/proxy.cut";
	my $parent = $$;
	my $pid = fork() // die "fork: $!";
	if ($pid == 0)
	{
		eval { proxy_loop($listen, $to_port, $dir, $parent); };
		print STDERR "proxy: $@" if $@;
		POSIX::_exit(0);	# (not the test's END blocks)
	}
	close $listen;
	push @proxies, $pid;
	return { pid => $pid, port => $port, dir => $dir };
}

sub proxy_write
{
	my ($fh, $data) = @_;
	while (length $data)
	{
		my $n = syswrite($fh, $data);
		return 0 if !defined $n;
		substr($data, 0, $n) = '';
	}
	return 1;
}

sub proxy_loop
{
	my ($listen, $to_port, $dir, $parent) = @_;
	my @conns;		# {c: the client's socket, b: the broker's, q: [[arrived, data], ...]}
	my $drop = sub { my ($c) = @_; close $c->{c}; close $c->{b}; @conns = grep { $_ != $c } @conns; };
	while (getppid() == $parent)
	{
		my $delay = 0;
		if (open my $fh, '<', "$dir/proxy.delay")
		{
			my $d = <$fh> // '';
			$delay = $d =~ /stall/ ? 1e9 : ($d =~ /([\d.]+)/ ? $1 : 0);
		}
		if (-e "$dir/proxy.cut")
		{
			$drop->($_) for (my @all = @conns);
			unlink "$dir/proxy.cut";
		}
		my $sel = IO::Select->new($listen, map { ($_->{c}, $_->{b}) } @conns);
		foreach my $fh ($sel->can_read(0.005))
		{
			if ($fh == $listen)
			{
				my $c = $listen->accept or next;
				my $b = IO::Socket::INET->new(PeerAddr => '127.0.0.1', PeerPort => $to_port);
				if ($b) { push @conns, { c => $c, b => $b, q => [] }; } else { close $c; }
				next;
			}
			my ($conn) = grep { $_->{c} == $fh || $_->{b} == $fh } @conns or next;
			my $n = sysread($fh, my $buf, 65536);
			if (!$n) { $drop->($conn); next; }
			if ($fh == $conn->{c}) { proxy_write($conn->{b}, $buf) or $drop->($conn); }
			else { push @{ $conn->{q} }, [ time, $buf ]; }
		}
		my $now = time;
		foreach my $conn (my @all = @conns)
		{
			my $due = '';
			$due .= (shift @{ $conn->{q} })->[1]
			  while @{ $conn->{q} } && $conn->{q}[0][0] + $delay <= $now;
			proxy_write($conn->{c}, $due) or $drop->($conn) if length $due;
		}
	}
	return;
}

# what the broker sends through proxy $p is held back $secs seconds from now on
# ("stall": until the next call; 0: no more)
sub proxy_delay
{
	my ($p, $secs) = @_;
	open my $fh, '>', "$p->{dir}/proxy.delay.tmp" or die;
	print $fh "$secs\n";
	close $fh;
	rename "$p->{dir}/proxy.delay.tmp", "$p->{dir}/proxy.delay" or die;
	return;
}

# close every connection through proxy $p (what was held back is dropped); returns once done
sub proxy_cut
{
	my ($p) = @_;
	open my $fh, '>', "$p->{dir}/proxy.cut" or die;
	close $fh;
	wait_until(10, sub { !-e "$p->{dir}/proxy.cut" }) or die 'the proxy did not cut';
	return;
}

# What the broker sends held back through proxy $p by 1.5 s, past the
# relay's --timeout (1 s), for 8 s: no event counts as confirmed (a late
# $what, confirm or ack, settles nothing) and each publish fails.  Returns
# idem_relay_published_total, which stood still; the delay stays.
sub late_confirms
{
	my ($relay, $p, $what) = @_;
	proxy_delay($p, 1.5);
	# what was published before is settled by now (confirmed, or timed out,
	# and counted); a late confirm comes 1.5 s after its publish
	sleep 1.25;
	my $published = metric($relay, 'idem_relay_published_total');
	my $failed = metric($relay, 'idem_relay_failed_total');
	sleep 8;
	is(metric($relay, 'idem_relay_published_total'), $published,
		"while every $what comes after --timeout, no event counts as confirmed (a late $what settles nothing)");
	cmp_ok(metric($relay, 'idem_relay_failed_total'), '>', $failed, '... each publish failed (timed out)');
	return $published;
}

# --- relays

sub kill_relay
{
	my ($r) = @_;
	$r->{h}->signal('KILL');
	$r->{h}->finish;
	return;
}

# SIGTERM; true if it exited 0 within 30 s
sub stop_relay
{
	my ($r) = @_;
	$r->{h}->signal('TERM');
	my $t0 = time;
	# (pump_nb dies if the process ended between pumpable and it)
	while ($r->{h}->pumpable && time - $t0 < 30) { usleep(100_000); eval { $r->{h}->pump_nb }; }
	$r->{h}->finish if !$r->{h}->pumpable;
	return !$r->{h}->pumpable && $r->{h}->result == 0;
}

# poll $cond (a sub) every 0.2 s for up to $secs; its last value
sub wait_until
{
	my ($secs, $cond) = @_;
	my $t0 = time;
	my $v;
	while (!($v = $cond->()) && time - $t0 < $secs) { usleep(200_000); }
	return $v;
}

# a poison event: aggregate type $type, which the sink always refuses, then
# one event to ('load', 'after-poison') that must still flow.
sub emit_poison
{
	my ($node, $type) = @_;
	$node->safe_psql('postgres', qq{
INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM idem_outbox_emit('$type', 'p1', 'ev', '{}') e;
INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM idem_outbox_emit('load', 'after-poison', 'ev', '{}') e;
});
	return;
}

# The relay (start_relay with @args, output in $out) under emitters: what
# arrived ($count->(), a number) reaches $n, then after a SIGKILL and a
# restart 2 * $n.  Returns the restarted relay.
sub relay_killed_and_restarted
{
	my ($node, $out, $count, $n, @args) = @_;
	my $relay = start_relay($node, $out, @args);
	ok(wait_until(60, sub { $count->() >= $n }), 'events arrive while emitters run');
	kill_relay($relay);
	$relay = start_relay($node, $out, @args);
	ok(wait_until(60, sub { $count->() >= 2 * $n }), 'the restarted relay delivers');
	return $relay;
}

# The broker ($what) away for $secs: $stop->(), then $start->(); then
# what arrived ($count->()) grows by $n
sub broker_outage
{
	my ($what, $secs, $stop, $start, $count, $n) = @_;
	$stop->();
	sleep $secs;
	$start->();
	my $before = $count->();
	ok(wait_until(90, sub { $count->() >= $before + $n }), "delivery resumes once $what is back");
	return;
}

# emit_poison of type 'poison', then the event after it arrives
# ($arrivals->(): the list so far)
sub poison_flows
{
	my ($node, $arrivals) = @_;
	emit_poison($node, 'poison');
	ok(wait_until(60, sub { grep { $_->{aggregate_id} eq 'after-poison' } @{ $arrivals->() } }),
		'an aggregate emitted after the poison event flows');
	return;
}

# the error that the poison event was dead-lettered with
sub poison_error
{
	my ($node) = @_;
	return $node->safe_psql('postgres',
		q{SELECT last_error FROM idempotency.outbox_dead WHERE aggregate_type = 'poison'});
}

# After the run: stop the emitters, wait until every committed event (but
# the poison ones) is among what $arrivals (a sub returning the list so
# far) has seen, "all N committed events $where", and until the poison
# event of type 'poison' is dead-lettered.  Returns the number of events.
sub drain_and_dead_letter
{
	my ($node, $emitters, $arrivals, $where) = @_;
	stop_emitters($emitters);
	my $total = $node->safe_psql('postgres',
		q{SELECT count(*) FROM emitted WHERE aggregate_type <> 'poison'});
	ok( wait_until(90, sub {
			my %s = map { $_->{id} => 1 } @{ $arrivals->() };
			scalar(keys %s) >= $total }),
		"all $total committed events $where");
	ok( wait_until(30, sub {
			$node->safe_psql('postgres',
				q{SELECT count(*) FROM idempotency.outbox_dead WHERE aggregate_type = 'poison'}) eq '1' }),
		'the poison event is dead-lettered');
	return $total;
}

# GET http://127.0.0.1:$port$path; the body, '' on failure
sub http_get
{
	my ($port, $path) = @_;
	require IO::Socket::INET;
	my $s = IO::Socket::INET->new(PeerAddr => '127.0.0.1', PeerPort => $port, Timeout => 5)
	  or return '';
	print $s "GET $path HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
	local $/;
	my $resp = <$s> // '';
	close $s;
	$resp =~ s/^.*?\r\n\r\n//s;
	return $resp;
}

# The checks of what arrived ($arrivals: list of hashes, in arrival order)
# against table emitted, except events of aggregate type $poison (must be
# dead-lettered instead, if defined).  $max_dups: the most duplicates
# allowed (lost acks); prints the count.  Returns the duplicate count.
sub check_arrivals
{
	my ($node, $arrivals, %opt) = @_;
	my $poison = $opt{poison};
	my %committed;
	foreach my $row (split /\n/,
		$node->safe_psql('postgres', 'SELECT id, aggregate_type, aggregate_id, seq FROM emitted'))
	{
		my ($id, $t, $a, $s) = split /\|/, $row;
		$committed{$id} = { aggregate_type => $t, aggregate_id => $a, seq => $s };
	}
	my (%seen, $dups, @foreign, %last_first, @disorder);
	$dups = 0;
	foreach my $e (@$arrivals)
	{
		if (!exists $committed{ $e->{id} }) { push @foreign, $e->{id}; next; }
		if ($seen{ $e->{id} }++) { $dups++; next; }
		my $agg = "$e->{aggregate_type}:$e->{aggregate_id}";
		push @disorder, "$agg seq $e->{seq} after " . ($last_first{$agg} // 0)
		  if ($last_first{$agg} // 0) + 1 != $e->{seq};
		$last_first{$agg} = $e->{seq};
	}
	my @missing = grep {
		!$seen{$_} && !(defined $poison && $committed{$_}{aggregate_type} eq $poison)
	} keys %committed;
	my $n = scalar(keys %committed);
	cmp_ok($n, '>', 100, "emitters committed $n events (and rolled some back)");
	is(scalar(@missing), 0, 'every committed event arrived')
	  or diag('missing: ' . join(' ', (sort @missing)[ 0 .. ($#missing < 9 ? $#missing : 9) ]));
	is(scalar(@foreign), 0, 'nothing arrived that was not committed (rolled back)')
	  or diag("foreign: @foreign[0 .. ($#foreign < 9 ? $#foreign : 9)]");
	is(scalar(@disorder), 0, 'per aggregate, first arrivals are in seq order with no gap')
	  or diag(join("\n", @disorder[ 0 .. ($#disorder < 9 ? $#disorder : 9) ]));
	note("duplicates (redeliveries after a lost ack): $dups of " . scalar(@$arrivals) . ' arrivals');
	cmp_ok($dups, '<=', $opt{max_dups}, "duplicates ($dups) at most $opt{max_dups}")
	  if defined $opt{max_dups};
	if (defined $poison)
	{
		is(scalar(grep { $_->{aggregate_type} eq $poison } @$arrivals), 0,
			"the poison event ($poison) never arrived");
		is( $node->safe_psql('postgres',
				"SELECT count(*) FROM idempotency.outbox_dead WHERE aggregate_type = '$poison'"),
			'1', 'the poison event is in dead letters');
		ok($seen{ (grep { $committed{$_}{aggregate_id} eq 'after-poison' } keys %committed)[0] },
			'an event emitted after the poison one arrived (skip: no stall)');
	}
	return $dups;
}

1;
