# idem-relay --in nats: a JetStream durable pull consumer (stream INBOX on
# subjects inbox.>, consumer idem-relay, created by the relay) into the
# inbox, as role inbound with only the handler capability for source
# orders; message id the Nats-Msg-Id header (the default), ordering key
# the JSON pointer /account.  RelayTest's inbound_scenario: 600 messages published in
# rounds while the relay is killed with SIGKILL mid-stream and restarted
# (what it had fetched and not acked comes again after AckWait) and
# nats-server is stopped for 3 seconds and started again (file storage:
# the stream and the consumer survive); every message stored once with its
# payload, none lost, and the consumer has nothing pending or unacked at
# the end.  The 60 second copies are published after the stream's
# duplicate window (0.5 s here) so JetStream keeps them and the inbox
# dedupes them.  The database refusing (capability revoked): messages are
# nak'ed, none acked or stored, until the capability is back.
use strict;
use warnings;

use JSON::PP;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);
use IdemTest;
use RelayTest;

need_relay('source', 'nats', 'nats-server');

my $tmp = PostgreSQL::Test::Utils::tempdir();
my $port = free_port();
my $nats = start_nats($tmp, $port);
my ($created) = nats_requests($port, [ '$JS.API.STREAM.CREATE.INBOX',
	'{"name":"INBOX","subjects":["inbox.>"],"storage":"file","duplicate_window":500000000}' ]);
like($created, qr/"name":"INBOX"/, 'stream INBOX created (0.5 s duplicate window)');
my $node = relay_node('relay_in_nats');
inbound_role($node, 'orders');

# publish each [id, payload] with header Nats-Msg-Id, the
# second copy of an id after the duplicate window; every publish acked
my %published;
sub publish
{
	my @msgs = @_;
	my (@first, @again);
	push @{ $published{ $_->[0] }++ ? \@again : \@first }, $_ foreach @msgs;
	foreach my $batch (\@first, \@again)
	{
		next unless @$batch;
		usleep(600_000) if $batch == \@again;
		my @acks = nats_requests($port, map { [ 'inbox.orders', $_->[1], $_->[0] ] } @$batch);
		my $bad = grep { !defined || !/"seq":\d+/ } @acks;
		die "nats: $bad publishes not acked" if $bad;
	}
	return;
}

sub consumer
{
	my ($r) = nats_requests($port, [ '$JS.API.CONSUMER.INFO.INBOX.idem-relay', '' ]);
	return defined $r ? decode_json($r) : {};
}

# messages of the consumer not acked: not delivered yet, or delivered and unacked
sub unacked
{
	my $c = consumer();
	return ($c->{num_pending} // 0) + ($c->{num_ack_pending} // 0);
}

my ($relay, @sent) = inbound_scenario(
	node => $node,
	source => 'orders',
	start => sub {
		start_inbound($node, "$tmp/in.out", 'nats', '--url', "nats://127.0.0.1:$port", '--target', 'INBOX',
			'--source', 'orders', '--ordering-key', 'json:/account') },
	publish => \&publish,
	restart_broker => sub { stop_broker($nats); sleep 3; $nats = start_nats($tmp, $port); },
	unacked => \&unacked);
is(consumer()->{config}{durable_name}, 'idem-relay', 'the relay created the durable consumer');
cmp_ok(metric($relay, 'idem_relay_in_duplicates_total'), '>', 0,
	'second copies (after the duplicate window) were acked as duplicates');
ok(stop_relay($relay), 'SIGTERM: the relay exits 0');
check_inbox($node, 'orders', @sent);

stop_broker($nats);
$node->stop;
done_testing();
