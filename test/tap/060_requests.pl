# Requests (SPEC 5) where sessions and time matter:
#   wait   a begin with "wait" that finds another attempt's live lease
#          returns the stored response as soon as the holder completes, or
#          takes over when the lease runs out during the wait, or raises
#          IK002 (with the lease left) when the wait runs out first; under
#          REPEATABLE READ too, whose snapshot never shows the completion
#          (begin reads the row as it is now);
#   crash  after a crash (stop -m immediate), committed begins and
#          checkpoints hold and in-flight ones are gone: a begin that had
#          not committed leaves the key free, an uncommitted checkpoint is
#          not where a takeover resumes, and a fenced transaction in flight
#          does not keep a takeover waiting.
use strict;
use warnings;

use IPC::Run;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);
use IdemTest;

my $node = idem_node('requests', conf => "synchronous_commit = on");
my $db = 'postgres';
my $timer = IPC::Run::timer($PostgreSQL::Test::Utils::timeout_default);

$node->safe_psql($db, 'CREATE EXTENSION idempotency');

sub sql { return $node->safe_psql($db, $_[0]); }

# start a begin with a wait in the background (after the SQL $before, and
# with $after once it printed its marker); returns the session
sub begin_waiting
{
	my ($name, $key, $wait, $before, $after) = @_;
	my $s = bg_psql($node, $db, $name, $timer, '\set ON_ERROR_STOP 0');
	bg_feed($s, ($before // '') . "SELECT status || ':' || attempt || ':' || coalesce(response::text, '')"
		  . " FROM idem_request_begin('$key', 'api', wait => '$wait');\n\\echo $name-done" . ($after // ''));
	return $s;
}

# wait until a background session printed its marker; returns its output
sub finish
{
	my ($s, $marker) = @_;
	$s->{h}->pump until $s->{out} =~ /$marker/ || $timer->is_expired;
	die "no $marker: $s->{err}" unless $s->{out} =~ /$marker/;
	return $s->{out};
}

# is the begin of session $name still waiting (sleeping on its latch)?
sub still_waiting
{
	my ($name) = @_;
	return sql("SELECT count(*) FROM pg_stat_activity WHERE application_name = '$name'"
		  . " AND state = 'active' AND query LIKE '%idem_request_begin%'") eq '1';
}

# ---------------- wait ----------------
# 1. the holder completes during the wait: the waiter replays its response
# waiter_replays(KEY, WAITS, REPLAYS, BEFORE, AFTER): another attempt holds
# KEY with a live lease; a begin with a wait (BEFORE and AFTER around it, as
# in begin_waiting) waits (test WAITS), and replays the response as soon as
# the holder completes (test REPLAYS)
sub waiter_replays
{
	my ($key, $waits, $replays, $before, $after) = @_;
	sql("SELECT idem_request_begin('$key', 'api', lease => '1 minute')");
	my $t0 = time;
	my $s = begin_waiting($key, $key, '30 seconds', $before, $after);
	sleep 1;
	ok(still_waiting($key), $waits);
	sql(qq{SELECT idem_request_complete('$key', 'api', '{"id": "r$key"}', 1, 201)});
	like(finish($s, "$key-done"), qr/^completed:1:\{"id": "r$key"\}$/m, $replays);
	cmp_ok(time - $t0, '<', 10, '... soon after the completion, not at the end of the wait');
	$s->{h}->finish;
}
waiter_replays('w1', 'a begin with a wait waits while another attempt holds a live lease',
	'... and replays the response once the holder completes');

# 2. the lease runs out during the wait: the waiter takes over as attempt 2
sql("SELECT idem_request_begin('w2', 'api', lease => '2 seconds')");
my $t0 = time;
my $w2 = begin_waiting('w2', 'w2', '30 seconds');
like(finish($w2, 'w2-done'), qr/^started:2:$/m,
	'a begin with a wait takes over when the lease runs out during the wait');
cmp_ok(time - $t0, '<', 10, '... when it runs out');
$w2->{h}->finish;

# 3. the wait runs out first: IK002, with the lease left in the detail
sql("SELECT idem_request_begin('w3', 'api', lease => '1 minute')");
$t0 = time;
my ($rc, $out, $err) = $node->psql($db,
	"\\set VERBOSITY verbose\nSELECT idem_request_begin('w3', 'api', wait => '1.5 seconds')");
my $took = time - $t0;
like($err, qr/IK002/, 'a wait that runs out first ends in IK002');
like($err, qr/The lease of attempt 1 ends in 5\d\.\d{3} seconds\./, '... with the lease left in the detail');
cmp_ok($took, '>=', 1.4, '... after the whole wait');

# 4. under REPEATABLE READ, with a snapshot from before the completion: the
# waiter still replays the response as soon as the holder completes
waiter_replays('w4', 'a begin with a wait under REPEATABLE READ waits for a live lease',
	'... and replays the response its snapshot cannot see once the holder completes',
	"BEGIN ISOLATION LEVEL REPEATABLE READ;\nSELECT count(*) FROM idempotency.requests;\n", "\nCOMMIT;");

# ---------------- crash ----------------
sql(q{
SELECT idem_request_begin('c1', 'api', lease => '1 minute');
SELECT idem_request_checkpoint('c1', 'api', 1, 'charged', '{"charge": "ch_1"}');
SELECT idem_request_begin('c3', 'api', lease => '1 minute');
});
# in flight at the crash: a begin of a new key, a later checkpoint of c1,
# and a fenced effect transaction of c3
my $begun = bg_psql($node, $db, 'inflight_begin', $timer,
	"BEGIN;\nSELECT idem_request_begin('c2', 'api');", 'c2-begun');
my $checkpointed = bg_psql($node, $db, 'inflight_checkpoint', $timer,
	"BEGIN;\nSELECT idem_request_checkpoint('c1', 'api', 1, 'recorded', '{\"charge\": \"ch_1\"}');",
	'c1-checkpointed');
my $fenced = bg_psql($node, $db, 'inflight_fence', $timer,
	"BEGIN;\nSELECT idem_request_fence('c3', 'api', 1);", 'c3-fenced');

$node->stop('immediate');
$_->{h}->kill_kill for ($begun, $checkpointed, $fenced);
$node->start;

is(sql(q{SELECT status || ':' || attempt FROM idem_request_begin('c2', 'api')}), 'started:1',
	'a begin in flight at the crash left the key free');
is(sql(q{SELECT recovery_point || ':' || state::text FROM idempotency.requests WHERE key = 'c1'}),
	'charged:{"charge": "ch_1"}', 'the committed checkpoint held, the one in flight is gone');
is(sql(q{SET idempotency.debug_clock_offset = 120;
SELECT status || ':' || attempt || ':' || recovery_point FROM idem_request_begin('c1', 'api')}),
	'started:2:charged', 'a takeover after the crash resumes from the committed recovery point');
is(sql(q{SET idempotency.debug_clock_offset = 120;
SET lock_timeout = '5s';
SELECT status || ':' || attempt FROM idem_request_begin('c3', 'api')}),
	'started:2', 'a fenced transaction in flight at the crash holds no takeover back');
is(sql(q{SELECT count(*) || ':' || count(DISTINCT (scope, key)) FROM idempotency.requests}), '7:7',
	'one row per request (w1-w4, c1-c3), none doubled');

$node->stop;
done_testing();
