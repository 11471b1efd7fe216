# idem-relay --in http: a webhook receiver storing each POST with
# idem_inbox_receive, as role inbound with only the handler capability for
# its source.  The answers: 200 only after the commit, 200 with
# "duplicate" for a redelivery, 409 for another payload under a stored id
# (IK001), 400 for no id or a body that is not JSON (nothing stored), 405
# and 404 for other methods and paths; the ordering key from a JSON pointer
# lands in the headers.  A producer that retries until it gets a 2xx (as
# webhook providers do) sends 600 messages with 60 sent twice while the
# relay is killed with SIGKILL and restarted and the database refuses
# (capability revoked: 503, nothing stored) and accepts again: every
# message is stored once with its payload, none lost, the redeliveries got
# 2xx.  Signatures: GitHub-style hex HMAC (X-Hub-Signature-256) and
# Stripe-style (t=,v1= with a tolerance), good ones stored, bad, missing or
# stale ones 401 with nothing stored.
use strict;
use warnings;

use Digest::SHA qw(hmac_sha256_hex);
use POSIX ();
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);
use IdemTest;
use RelayTest;

need_relay('source', 'http');

my $tmp = PostgreSQL::Test::Utils::tempdir();
my $node = relay_node('relay_in_http');
inbound_role($node, 'hooks');

sub start_receiver
{
	my ($port, @more) = @_;
	my $r = start_inbound($node, "$tmp/in.out", 'http', '--url', "http://127.0.0.1:$port/hook",
		'--source', 'hooks', '--ordering-key', 'json:/account', @more);
	wait_until(20, sub { (http_post($port, '/hook', '{}'))[0] != 0 })
	  or die 'the receiver did not start: ' . slurp_file("$tmp/in.out.err");
	return $r;
}

sub stored { return scalar(keys %{ inbox_rows($node, 'hooks') }); }

# --- the answers
my $port = free_port();
my $relay = start_receiver($port);
my @st = http_post($port, '/hook', '{"n": 1, "account": "acct-1"}', 'Idempotency-Key' => 'a-1');
is($st[0], 200, 'a new message: 200');
like($st[1], qr/"stored":true/, '... stored');
@st = http_post($port, '/hook', '{"n": 1, "account": "acct-1"}', 'Idempotency-Key' => 'a-1');
is($st[0], 200, 'the same message again (a redelivery): 200');
like($st[1], qr/"duplicate":true/, '... as a duplicate');
@st = http_post($port, '/hook', '{"n": 2}', 'Idempotency-Key' => 'a-1');
is($st[0], 409, 'another payload under a stored id: 409 (IK001)');
is((http_post($port, '/hook', '{"n": 3}'))[0], 400, 'no Idempotency-Key: 400');
is((http_post($port, '/hook', 'not json', 'Idempotency-Key' => 'a-3'))[0], 400, 'a body that is not JSON: 400');
is((http_post($port, '/other', '{}', 'Idempotency-Key' => 'a-4'))[0], 404, 'another path: 404');
is(http_get($port, '/hook'), '{"error":"POST expected"}' . "\n", 'a GET: refused (405)');
is_deeply([ sort keys %{ inbox_rows($node, 'hooks') } ], ['a-1'], 'only the good message is stored');
is(inbox_rows($node, 'hooks')->{'a-1'}{ordering_key}, 'acct-1', 'the ordering key (json:/account) is in the headers');

# --- a retrying producer while the relay is killed and the database refuses
my @msgs = inbound_messages('w', 600);
my $log = "$tmp/producer.log";
my $pid = fork() // die "fork: $!";
if ($pid == 0)
{
	open my $out, '>', $log or POSIX::_exit(1);
	$out->autoflush(1);
	my $sent = 0;
	foreach my $m (@msgs)
	{
		# the rest once the database refuses (file go)
		usleep(100_000) while $sent++ == 400 && !-e "$tmp/go";
		my $t0 = time;
		while (1)
		{
			my ($status, $body) = http_post($port, '/hook', $m->[1], 'Idempotency-Key' => $m->[0]);
			print $out "$m->[0] $status " . ($body =~ /duplicate/ ? 'duplicate' : '-') . "\n";
			last if $status == 200 || time - $t0 > 120;
			usleep(50_000);
		}
	}
	close $out;
	POSIX::_exit(0);
}
ok(wait_until(60, sub { stored() >= 150 }), 'messages are stored while the producer runs');
kill_relay($relay);
note('relay killed with SIGKILL after ' . stored() . ' stored');
sleep 1;
$relay = start_receiver($port);
ok(wait_until(60, sub { stored() >= 300 }), 'the restarted relay stores');

# the database refuses: 503, nothing stored, until the capability is back
$node->safe_psql('postgres', q{SELECT idem_revoke('inbound')});
open my $go, '>', "$tmp/go" or die;
close $go;
ok(wait_until(30, sub { (metric($relay, 'idem_relay_in_failed_total') // 0) > 0 }),
	'with the capability revoked, messages fail');
my $frozen = stored();
sleep 2;
is(stored(), $frozen, '... and nothing is stored meanwhile');
$node->safe_psql('postgres', q{SELECT idem_grant('inbound', 'handler', sources => ARRAY['hooks'])});
is(waitpid($pid, 0), $pid, 'the producer finished');
is($?, 0, '... and exited 0');

my (%ok, %codes, $dup_answers);
open my $in, '<', $log or die;
while (<$in>)
{
	my ($id, $status, $dup) = split;
	$codes{$status}++;
	$ok{$id} = 1 if $status == 200;
	$dup_answers++ if $status == 200 && $dup eq 'duplicate';
}
close $in;
note('answers to the producer: ' . join(', ', map { "$_: $codes{$_}" } sort keys %codes));
is(scalar(grep { !$ok{ $_->[0] } } @msgs), 0, 'every message got a 200 in the end');
cmp_ok($codes{503} // 0, '>', 0, 'the refusal was answered 503 (and the producer sent again)');
cmp_ok($dup_answers, '>=', 60, "redeliveries were answered 200 as duplicates ($dup_answers)");
check_inbox($node, 'hooks', [ 'a-1', '{"n": 1}' ], @msgs);
like(metric($relay, 'idem_relay_in_stored_total'), qr/^[1-9]\d*$/, 'metrics: stored counted');
like(metric($relay, 'idem_relay_in_duplicates_total'), qr/^[1-9]\d*$/, 'metrics: duplicates counted');
ok(stop_relay($relay), 'SIGTERM: the relay exits 0');

# --- signatures: GitHub style
my $secret = 's3cret';
$relay = start_receiver($port, '--hmac-secret', $secret);
my $body = '{"n": 7001, "account": "acct-1"}';
my $sig = 'sha256=' . hmac_sha256_hex($body, $secret);
is((http_post($port, '/hook', $body, 'Idempotency-Key' => 'h-1', 'X-Hub-Signature-256' => $sig))[0],
	200, 'hex HMAC: a good signature is stored');
is((http_post($port, '/hook', $body, 'Idempotency-Key' => 'h-2', 'X-Hub-Signature-256' => uc(hmac_sha256_hex($body, $secret))))[0],
	200, 'hex HMAC: without "sha256=" and in upper case too');
is((http_post($port, '/hook', $body, 'Idempotency-Key' => 'h-3', 'X-Hub-Signature-256' => 'sha256=' . hmac_sha256_hex($body, 'other')))[0],
	401, 'hex HMAC: a signature under another key: 401');
is((http_post($port, '/hook', $body . ' ', 'Idempotency-Key' => 'h-4', 'X-Hub-Signature-256' => $sig))[0],
	401, 'hex HMAC: a body changed after signing: 401');
is((http_post($port, '/hook', $body, 'Idempotency-Key' => 'h-5'))[0], 401, 'hex HMAC: no signature: 401');
ok(stop_relay($relay), 'SIGTERM: the relay exits 0');

# --- Stripe style
$relay = start_receiver($port, '--hmac-secret', $secret, '--hmac-format', 'stripe', '--hmac-tolerance', '60');
my $t = time;
my $v1 = hmac_sha256_hex("$t.$body", $secret);
is((http_post($port, '/hook', $body, 'Idempotency-Key' => 's-1', 'Stripe-Signature' => "t=$t,v1=$v1"))[0],
	200, 'stripe: a good signature is stored');
is((http_post($port, '/hook', $body, 'Idempotency-Key' => 's-2', 'Stripe-Signature' => "t=$t,v1=" . ('0' x 64) . ",v1=$v1,v0=abc"))[0],
	200, 'stripe: one good v1 among several is enough');
my $old = $t - 120;
is((http_post($port, '/hook', $body, 'Idempotency-Key' => 's-3', 'Stripe-Signature' => "t=$old,v1=" . hmac_sha256_hex("$old.$body", $secret)))[0],
	401, 'stripe: a timestamp outside the tolerance: 401');
is((http_post($port, '/hook', $body, 'Idempotency-Key' => 's-4', 'Stripe-Signature' => "t=$t,v1=" . hmac_sha256_hex($body, $secret)))[0],
	401, 'stripe: the HMAC of the body without the timestamp: 401');
is((http_post($port, '/hook', $body, 'Idempotency-Key' => 's-5', 'X-Hub-Signature-256' => $sig))[0],
	401, 'stripe: no Stripe-Signature: 401');
is(metric($relay, 'idem_relay_in_rejected_total'), 4,
	"metrics: the refused signatures counted (these 3 and start_receiver's unsigned probe)");
ok(stop_relay($relay), 'SIGTERM: the relay exits 0');
is_deeply([ sort grep { /^[hs]-/ } keys %{ inbox_rows($node, 'hooks') } ], [qw(h-1 h-2 s-1 s-2)],
	'only the messages with good signatures are stored');

$node->stop;
done_testing();
