# idem-relay --in redis: a Redis Streams consumer group (stream
# inbox:orders, group idem-relay) into the inbox, as role inbound with only
# the handler capability for source orders; message id the entry's field
# id, ordering key its field account, body its field payload.
# RelayTest's inbound_scenario: a producer XADDs 600 messages, 60 of them
# twice, in rounds while the relay is killed with SIGKILL mid-stream and
# restarted and redis is stopped for 3 seconds and started again
# (append-only file: the stream and the group's pending lists survive);
# every message stored once with its payload, none lost, and no entry of
# the group left unacked (XPENDING empty, nothing unread).  The database
# refusing (capability revoked): no entry acked (the ones read stay
# pending), nothing stored, until the capability is back.  Entries pending
# with a relay that died under another consumer name are taken over
# (XAUTOCLAIM, after --lease) by the next one.
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;
use RelayTest;

need_relay('source', 'redis', 'redis-server', 'redis-cli');

my $tmp = PostgreSQL::Test::Utils::tempdir();
my $port = free_port();
my $redis = start_redis($tmp, $port);
my $node = relay_node('relay_in_redis');
inbound_role($node, 'orders');

# XADD each [id, payload] of @msgs to inbox:orders (one redis-cli)
sub publish
{
	my @msgs = @_;
	my $in = '';
	foreach my $m (@msgs)
	{
		(my $q = $m->[1]) =~ s/(["\\])/\\$1/g;
		my ($acct) = $m->[1] =~ /"account": "([^"]+)"/;
		$in .= qq{XADD inbox:orders * id "$m->[0]" account "$acct" payload "$q"\n};
	}
	my $out = '';
	IPC::Run::run([ 'redis-cli', '-h', '127.0.0.1', '-p', $port ], '<', \$in, '>', \$out, '2>&1');
	return;
}

sub pending { return (split /\n/, redis_cli($port, 'XPENDING', 'inbox:orders', 'idem-relay'))[0] // -1; }

# entries of the group not acked: pending (read, not acked) plus lag (not read yet)
sub unacked
{
	my %g = split /\n/, redis_cli($port, 'XINFO', 'GROUPS', 'inbox:orders');
	return ($g{pending} // 0) + ($g{lag} // 0);
}

my @args = ('--url', "redis://127.0.0.1:$port", '--target', 'inbox:orders', '--source', 'orders',
	'--ordering-key', 'header:account');
my ($relay, @sent) = inbound_scenario(
	node => $node,
	source => 'orders',
	start => sub { start_inbound($node, "$tmp/in.out", 'redis', @args) },
	publish => \&publish,
	restart_broker => sub { stop_broker($redis); sleep 3; $redis = start_redis($tmp, $port); },
	unacked => \&unacked);
is(inbox_rows($node, 'orders')->{'w-8'}{ordering_key}, 'acct-1', 'the ordering key (field account) is in the headers');

# a relay dies with entries pending; the next one, another consumer, takes them over
$node->safe_psql('postgres', q{SELECT idem_revoke('inbound')});
my @orphans = inbound_messages('c', 10);
publish(@orphans);
ok(wait_until(30, sub { pending() > 0 }), 'entries pending with the relay');
is(unacked(), scalar(@orphans), 'none acked');
kill_relay($relay);
$node->safe_psql('postgres', q{SELECT idem_grant('inbound', 'handler', sources => ARRAY['orders'])});
$relay = start_inbound($node, "$tmp/in.out", 'redis', @args, '--consumer', 'other');
ok(wait_until(60, sub { 10 == grep { /^c-/ } keys %{ inbox_rows($node, 'orders') } }),
	'another consumer took them over (XAUTOCLAIM after --lease) and stored them');
ok(wait_until(30, sub { pending() eq '0' }), 'XPENDING is empty at the end');
ok(stop_relay($relay), 'SIGTERM: the relay exits 0');
check_inbox($node, 'orders', @sent, @orphans);

stop_broker($redis);
$node->stop;
done_testing();
