# idem-relay --in http with --url .../webhooks/{source}: one receiver for
# several webhook senders, each POST stored under the inbox source its path
# names, if --source lists it (404 otherwise).  And the answers a webhook
# sender acts on, each for the reason it needs: 2xx for a message stored
# and for one received before (the sender stops), 4xx for a message that
# can never be stored (no id, an empty or over-long id, not JSON, another
# payload under a stored id: the sender must not retry it forever), 5xx
# when the database refuses (a source the role may not write) or is away
# (the sender retries, and the retry is stored).  Bad {source} settings
# exit 2.  The relay runs as role inbound with the handler capability for
# sources shop and billing only.
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;
use RelayTest;

need_binary('idem-relay');

my $tmp = PostgreSQL::Test::Utils::tempdir();
my $node = relay_node('relay_in_http_sources');
$node->safe_psql('postgres', q{
CREATE ROLE inbound LOGIN;
SELECT idem_grant('inbound', 'handler', sources => ARRAY['shop', 'billing']);
});

my $port = free_port();
my @args = ('--url', "http://127.0.0.1:$port/webhooks/{source}", '--source', 'shop,billing,crm',
	'--message-id', 'header:X-Delivery-Id', '--ordering-key', 'header:X-Ordering-Key');
my $relay = start_inbound($node, "$tmp/in.out", 'http', @args);
wait_until(20, sub { (http_post($port, '/webhooks/shop', '{}'))[0] != 0 })
  or die 'the receiver did not start: ' . slurp_file("$tmp/in.out.err");

# POST $body to $path with delivery id $id (undef: none): (status, body)
sub post
{
	my ($path, $id, $body, @more) = @_;
	return http_post($port, $path, $body, (defined $id ? ('X-Delivery-Id' => $id) : ()), @more);
}

# the status and the Retry-After header of a POST (http_post drops headers)
sub post_retry_after
{
	my ($path, $id, $body) = @_;
	require IO::Socket::INET;
	my $s = IO::Socket::INET->new(PeerAddr => '127.0.0.1', PeerPort => $port, Timeout => 15)
	  or return (0, '');
	print $s "POST $path HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nX-Delivery-Id: $id\r\n"
	  . 'Content-Length: ' . length($body) . "\r\n\r\n$body";
	local $/;
	my $resp = <$s> // '';
	close $s;
	my ($status) = $resp =~ m{^HTTP/1\.\d (\d{3})};
	my ($after) = $resp =~ m{^Retry-After:\s*(\S+)}mi;
	return ($status // 0, $after // '');
}

# source => [message ids] in the inbox
sub stored
{
	my %by;
	foreach my $line (split /\n/, $node->safe_psql('postgres',
		q{SELECT source, message_id FROM idempotency.inbox_messages ORDER BY source, message_id}))
	{
		my ($s, $m) = split /\|/, $line;
		push @{ $by{$s} }, $m;
	}
	return \%by;
}

# --- routing by {source}
my $body = '{"account": "acct-7", "amount": 250}';
my @st = post('/webhooks/shop', 'evt-1', $body, 'X-Ordering-Key' => 'acct-7');
is($st[0], 200, '/webhooks/shop: 200');
like($st[1], qr/"stored":true/, '... stored');
@st = post('/webhooks/billing', 'evt-1', $body);
is($st[0], 200, '/webhooks/billing, the same id: 200');
like($st[1], qr/"stored":true/, '... stored too: another source, another message');
@st = post('/webhooks/shop', 'evt-1', $body, 'X-Ordering-Key' => 'acct-7');
is($st[0], 200, '/webhooks/shop again (a redelivery): 200');
like($st[1], qr/"duplicate":true/, '... as a duplicate');
is((post('/webhooks/other', 'evt-2', $body))[0], 404, 'a source --source does not list: 404');
is((post('/webhooks/', 'evt-2', $body))[0], 404, 'no source: 404');
is((post('/webhooks/shop/more', 'evt-2', $body))[0], 404, 'a path below a source: 404');
is((post('/webhooks/shop,billing', 'evt-2', $body))[0], 404, 'the --source list itself: 404');
is((post('/hooks/shop', 'evt-2', $body))[0], 404, 'another prefix: 404');
is_deeply(stored(), { shop => ['evt-1'], billing => ['evt-1'] }, 'each message under the source its path named');
is($node->safe_psql('postgres',
	q{SELECT headers->>'ordering_key' FROM idempotency.inbox_messages WHERE source = 'shop'}),
	'acct-7', 'the ordering key (header:X-Ordering-Key) is in the headers');

# --- never storable: 4xx, so the sender gives up on it
is((post('/webhooks/shop', undef, $body))[0], 400, 'no X-Delivery-Id: 400');
is((post('/webhooks/shop', '', $body))[0], 400, 'an empty X-Delivery-Id: 400');
is((post('/webhooks/shop', 'x' x 2001, $body))[0], 400, 'a 2001-byte delivery id: 400');
is((post('/webhooks/shop', 'evt-3', '{oops'))[0], 400, 'a body that is not JSON: 400');
is((post('/webhooks/shop', 'evt-3', ''))[0], 400, 'an empty body: 400');
is((post('/webhooks/shop', 'evt-1', '{"account": "acct-7", "amount": 251}'))[0], 409,
	'another payload under a stored delivery id: 409 (IK001)');
is_deeply(stored(), { shop => ['evt-1'], billing => ['evt-1'] }, 'none of them stored');

# --- the database refuses or is away: 5xx, so the sender retries
my ($status, $after) = post_retry_after('/webhooks/crm', 'evt-4', $body);
is($status, 503, 'a source the role may not write (capability): 503');
is($after, '1', '... with Retry-After: 1');
$node->safe_psql('postgres', q{SELECT idem_grant('inbound', 'handler', sources => ARRAY['shop', 'billing', 'crm'])});
is((post('/webhooks/crm', 'evt-4', $body))[0], 200, 'the capability granted, the retry: 200');

$node->stop('fast');
($status, $after) = post_retry_after('/webhooks/shop', 'evt-5', $body);
is($status, 503, 'the database stopped: 503');
is($after, '1', '... with Retry-After: 1');
$node->start;
ok(wait_until(30, sub { (post('/webhooks/shop', 'evt-5', $body))[0] == 200 }),
	'the database back, the retry: 200');
is_deeply(stored(), { shop => [ 'evt-1', 'evt-5' ], billing => ['evt-1'], crm => ['evt-4'] },
	'what the sender retried is stored once');
like(metric($relay, 'idem_relay_in_failed_total'), qr/^[1-9]\d*$/, 'metrics: the failures counted');
ok(stop_relay($relay), 'SIGTERM: the relay exits 0');

# --- bad {source} settings: exit 2 with a message
foreach my $bad (
	[ 'redis', [ '--url', 'redis://127.0.0.1:1/{source}' ], qr/\{source\} is for --in http only/ ],
	[ 'http', [ '--url', "http://127.0.0.1:$port/{source}/in" ], qr/whole last path segment/ ],
	[ 'http', [ '--url', "http://127.0.0.1:$port/w{source}" ], qr/whole last path segment/ ],
	[ 'http', [ '--url', "http://127.0.0.1:$port/webhooks/{source}", '--source', 'shop,,crm' ], qr/none empty/ ])
{
	my ($in, $more, $re) = @$bad;
	my $out = `idem-relay -d 'dbname=none' --in $in @$more 2>&1`;
	is($? >> 8, 2, "--in $in @$more: exit 2");
	like($out, $re, '... saying why');
}

$node->stop;
done_testing();
