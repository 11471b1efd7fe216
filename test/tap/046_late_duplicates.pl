# Late duplicates with the library preloaded: keys of a dropped claims
# partition are found in its summary after a restart (counted, warned
# about or refused per idempotency.late_duplicate_policy, and counted in
# idempotency.stats.late_duplicates for what committed); the summaries stay
# few and expire with the window; and the false-positive rate over a
# million fresh keys, against a summary filled to its capacity, is within
# what doc/claims.md states.  The clock is moved with the test-only
# setting idempotency.debug_clock_offset, so partitions pass without
# waiting.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = idem_node('late', conf => qq{
shared_preload_libraries = 'idempotency'
idempotency.filter_memory = '16MB'
});

# Rounds at clock offset $h hours (one transaction each).
sub rounds_at
{
	my ($h) = @_;
	$node->safe_psql('postgres',
		"SET idempotency.debug_clock_offset = '${h}h'; SELECT count(*) FROM idem_maintain();")
	  for 1 .. 2;
}

$node->safe_psql(
	'postgres', q{
CREATE EXTENSION idempotency;
SELECT idem_configure(retention => '1 hour', partition_interval => '1 hour', premake => 1);
SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'a-' || g FROM generate_series(1, 100000) g), 'late');
});
rounds_at($_) for 2 .. 4;
is( $node->safe_psql(
		'postgres',
		q{SELECT count(*) FROM idempotency.claims WHERE scope = 'late'}),
	'0', 'the partition with the claims was dropped');
is($node->safe_psql('postgres', q{SELECT count(*) || ' ' || sum(nkeys) FROM idempotency.late_summaries}),
	'1 100000', 'its 100 000 keys are in one summary');

# across a restart: the summary is in the table, its filter loaded again
$node->restart;
my $at = q{SET idempotency.debug_clock_offset = '5h';};
is($node->safe_psql('postgres', $at . q{SELECT idem_claimed_before('a-1', 'late') IS NOT NULL}),
	't', 'after restart: idem_claimed_before() finds the key');
is($node->safe_psql('postgres', $at . q{SELECT idem_claim('a-1', 'late')}),
	't', 'policy count: the late duplicate is claimed');
my ($rc, $out, $err) = $node->psql('postgres',
	$at . q{SET idempotency.late_duplicate_policy = 'warn'; SELECT idem_claim('a-2', 'late')});
is($out, 't', 'policy warn: claimed');
like($err, qr/WARNING:  late duplicate of an expired claim\nDETAIL:  Scope "late", key "a-2" was probably claimed before; that claim expired between \S+ \S+ and \S+ \S+\./,
	'policy warn: a WARNING names scope, key and when the claim expired');
($rc, $out, $err) = $node->psql('postgres',
	$at . q{SET idempotency.late_duplicate_policy = 'error'; SELECT idem_claim('a-3', 'late')});
isnt($rc, 0, 'policy error: the claim fails');
like($err, qr/ERROR:  late duplicate of an expired claim\nDETAIL:  Scope "late", key "a-3" was probably claimed before; that claim expired between/,
	'policy error: IK008 says when the earlier claim expired');
is($node->safe_psql('postgres', q{SELECT count(*) FROM idempotency.claims WHERE key = 'a-3'}),
	'0', 'policy error: nothing claimed');
# rolled back: not counted
$node->safe_psql('postgres', $at . q{BEGIN; SELECT idem_claim('a-4', 'late'); ROLLBACK;});
# fresh keys are not late duplicates
$node->safe_psql('postgres', $at . q{SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'new-' || g FROM generate_series(1, 1000) g), 'late')});
is( $node->safe_psql(
		'postgres', q{SELECT claims || ' ' || duplicates || ' ' || late_duplicates FROM idempotency.stats WHERE scope = 'late'}),
	'1002 0 3',
	'stats: two late duplicates claimed and one refused counted, the rolled-back one not; fresh keys are claims');
is($node->safe_psql('postgres', q{SELECT filters FROM idempotency.filter_status()}),
	'1', 'the summary\'s filter is held in the shared area');

# SQLSTATE of the refusal
($rc, $out, $err) = $node->psql('postgres',
	$at . q{SET idempotency.late_duplicate_policy = 'error';
DO $$ BEGIN PERFORM idem_claim('a-5', 'late'); EXCEPTION WHEN SQLSTATE 'IK008' THEN RAISE NOTICE 'refused with IK008'; END $$});
like($err, qr/NOTICE:  refused with IK008/, 'the refusal is IK008');

# The false-positive rate.  A second partition dropped in the same bucket
# fills the summary to its capacity (200 000: twice the first drop; this
# one holds 98 000 b- keys and the 1 002 claimed above); then a million
# fresh keys are looked up.
$node->safe_psql('postgres',
	$at . q{SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'b-' || g FROM generate_series(1, 98000) g), 'late')});
rounds_at($_) for 6 .. 8;
my $fill = $node->safe_psql('postgres',
	q{SELECT count(*) || ' ' || sum(nkeys) || ' ' || max(nkeys::float8 / capacity) FROM idempotency.late_summaries});
note "summaries, keys, fullest: $fill";
my ($nsum, $nkeys, $fullest) = split / /, $fill;
cmp_ok($nkeys, '>=', 199000, 'both drops are summarised');
my $fp = $node->safe_psql('postgres',
	q{SET idempotency.debug_clock_offset = '9h';
SELECT count(*) FROM generate_series(1, 1000000) g WHERE idem_claimed_before('fresh-' || g, 'late') IS NOT NULL});
my $rate = $fp / 1e6;
diag sprintf('late-duplicate false positives: %d of 1 000 000 fresh keys (%.4f %%) over %d summar%s, the fullest at %.0f %% of capacity',
	$fp, 100 * $rate, $nsum, $nsum == 1 ? 'y' : 'ies', 100 * $fullest);
# doc/claims.md: at most 0.02 % per summary at capacity (0.0197 % computed)
cmp_ok($rate, '<=', 0.0003 * $nsum, 'false-positive rate within 0.03 % per summary (stated: 0.02 %)');
SKIP:
{
	# the drops fell into two buckets (1 in 20 runs): two half-full summaries
	skip 'the two drops went into two summaries', 1 if $nsum > 1;
	cmp_ok($fp, '>', 0, 'a full summary shows false positives: the measurement can see them');
}
is($node->safe_psql('postgres', q{SET idempotency.debug_clock_offset = '9h'; SELECT count(*) FROM generate_series(1, 98000, 7) g WHERE idem_claimed_before('b-' || g, 'late') IS NULL}),
	'0', 'no false negatives: every dropped key is found');

# Bounded: with a 4-hour window (2-hour buckets) and a partition dropped
# every hour, the summaries stay few, and those past the window go.
$node->append_conf('postgresql.conf', q{idempotency.late_duplicate_window = '4h'});
$node->reload;
my $max = 0;
my $expired = 0;
for my $h (10 .. 24)
{
	$node->safe_psql('postgres',
		"SET idempotency.debug_clock_offset = '${h}h'; SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'h$h-' || g FROM generate_series(1, 2000) g), 'late')");
	for (1 .. 2)
	{
		$expired += $node->safe_psql('postgres',
			"SET idempotency.debug_clock_offset = '${h}h'; SELECT count(*) FROM idem_maintain() WHERE action = 'expire'");
	}
	my $n = $node->safe_psql('postgres', q{SELECT count(*) FROM idempotency.late_summaries});
	$max = $n if $n > $max;
}
note "most summaries at once: $max";
cmp_ok($max, '<=', 4, 'at most window / bucket + 2 summaries live');
cmp_ok($expired, '>', 0, 'summaries past the window expired');
is( $node->safe_psql(
		'postgres', q{SET idempotency.debug_clock_offset = '24h';
SELECT count(*) FROM idempotency.late_summaries WHERE last_drop <= now() + interval '20 hours'}),
	'0', 'no summary whose last drop is past the window is kept');
# keys dropped before the window: found only as false positives (about
# 0.02 % per full summary, three summaries live)
cmp_ok( $node->safe_psql(
		'postgres', q{SET idempotency.debug_clock_offset = '24h';
SELECT count(*) FROM generate_series(1, 2000) g WHERE idem_claimed_before('h10-' || g, 'late') IS NOT NULL}),
	'<=', 5, 'keys dropped before the window claim silently (but for false positives)');
is( $node->safe_psql(
		'postgres', q{SET idempotency.debug_clock_offset = '24h';
SELECT bool_and(idem_claimed_before('h20-' || g, 'late') IS NOT NULL) FROM generate_series(1, 2000) g}),
	't', 'keys dropped within the window are found');
is( $node->safe_psql(
		'postgres', q{SET idempotency.debug_clock_offset = '24h'; SET idempotency.late_duplicate_policy = 'error';
SELECT idem_claim((SELECT 'h10-' || g FROM generate_series(1, 2000) g
                   WHERE idem_claimed_before('h10-' || g, 'late') IS NULL LIMIT 1), 'late')}),
	't', 'a key past the window is claimed even under policy error');

$node->stop;
done_testing();
