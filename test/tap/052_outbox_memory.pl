# The memory of an outbox claim is bounded by its batch, not by the backlog
# it scans.  A claim that scans a 100 000-event backlog and can take none of
# it -- an aggregate_types filter that matches nothing pending, or a second
# relay beside a hot aggregate that another relay has leased -- must keep
# the private memory of its backend (RssAnon in /proc/<pid>/status, sampled
# while the claim runs; shared buffers do not count there) within a few MB
# of what a claim over an empty outbox takes.  Each measured claim runs in a
# session of its own, opened (and warmed up) before the backlog was made.
use strict;
use warnings;

use IPC::Run;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);
use IdemTest;

plan skip_all => 'needs /proc/<pid>/status with RssAnon'
  unless -r '/proc/self/status' && `grep -c '^RssAnon:' /proc/self/status` > 0;

my $node = idem_node('outbox_memory');
my $db = 'postgres';
my $events = 100_000;
my $slack_kb = 5 * 1024;    # "within a few MB"

$node->safe_psql($db, 'CREATE EXTENSION idempotency');

sub rss_anon_kb
{
	my ($pid) = @_;
	open my $f, '<', "/proc/$pid/status" or return undef;
	while (my $line = <$f>)
	{
		return $1 if $line =~ /^RssAnon:\s+(\d+)\s+kB/;
	}
	return undef;
}

# A session with its statements prepared by a warm-up claim over the empty
# outbox (the warm-up must not scan a backlog: memory a backend freed stays
# resident and would hide the growth of a later claim).
sub warm_session
{
	my ($name) = @_;
	my $timer = IPC::Run::timer($PostgreSQL::Test::Utils::timeout_default);
	my $s = bg_psql($node, $db, $name, $timer,
		q{SELECT 'pid=' || pg_backend_pid();
SELECT count(*) FROM idem_outbox_claim(1, '1 second', ARRAY['warm-up']);},
		'warmed');
	($s->{pid}) = $s->{out} =~ /pid=(\d+)/;
	die "no backend pid in '$s->{out}'" unless $s->{pid};
	$s->{out} = '';
	return $s;
}

# Run $claim (a query returning one number) in session $s; returns (its
# result, RssAnon growth in kB from before the claim to its peak while the
# claim ran, seconds the claim took).
sub measure
{
	my ($s, $claim) = @_;
	my $pid = $s->{pid};
	my $before = rss_anon_kb($pid);
	my $peak = $before;
	my $start = time;
	$s->{in} .= "SELECT 'result=' || ($claim);\n\\echo measured\n";
	while ($s->{out} !~ /measured/ && !$s->{timer}->is_expired)
	{
		$s->{h}->pump_nb;
		my $now = rss_anon_kb($pid);
		$peak = $now if defined $now && $now > $peak;
		usleep(2000);
	}
	my $took = time - $start;
	die "claim did not finish: $s->{err}" unless $s->{out} =~ /measured/;
	my ($result) = $s->{out} =~ /result=(\d+)/;
	$s->{in} .= "\\q\n";
	$s->{h}->finish;
	return ($result, $peak - $before, $took);
}

my %session = map { $_ => warm_session($_) } qw(empty filter beside);

my ($n, $empty_kb, $empty_s) =
  measure($session{empty}, q{SELECT count(*) FROM idem_outbox_claim(100, '30 seconds')});
is($n, 0, 'a claim over an empty outbox returns nothing');
diag(sprintf('empty outbox: RssAnon +%d kB, %.3f s', $empty_kb, $empty_s));

# one hot aggregate with a backlog of $events events (a payload of ~250 bytes each)
$node->safe_psql(
	$db, qq{
SELECT count(*) FROM idem_outbox_emit_many('busy', array_fill('hot'::text, ARRAY[$events]),
    array_fill('ev'::text, ARRAY[$events]),
    ARRAY(SELECT jsonb_build_object('n', g, 'pad', repeat('x', 200)) FROM generate_series(1, $events) g))});

my ($nf, $filter_kb, $filter_s) = measure($session{filter},
	q{SELECT count(*) FROM idem_outbox_claim(100, '30 seconds', ARRAY['nothing-pending'])});
is($nf, 0, 'a claim whose aggregate_types match nothing pending returns nothing');
diag(sprintf('filter over %d events: RssAnon +%d kB, %.3f s', $events, $filter_kb, $filter_s));
cmp_ok($filter_kb, '<=', $empty_kb + $slack_kb,
	'its memory stays within a few MB of a claim over an empty outbox');

# relay 1 leases the hot aggregate for an hour; relay 2 scans past it
is( $node->safe_psql($db,
		q{SELECT count(*) FROM idem_outbox_claim(100, '1 hour')}),
	100, 'relay 1 leases the hot aggregate');
my ($nh, $hot_kb, $hot_s) =
  measure($session{beside}, q{SELECT count(*) FROM idem_outbox_claim(100, '30 seconds')});
is($nh, 0, 'a second relay beside the leased hot aggregate gets nothing');
diag(sprintf('beside a leased aggregate of %d events: RssAnon +%d kB, %.3f s',
		$events, $hot_kb, $hot_s));
cmp_ok($hot_kb, '<=', $empty_kb + $slack_kb,
	'its memory stays within a few MB of a claim over an empty outbox');

$node->stop;
done_testing();
