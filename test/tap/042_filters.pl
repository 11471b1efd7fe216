# Bloom filters of sealed partitions held in shared memory (library
# preloaded): loaded once per cluster on first use, gone with a restart and
# loaded again from the registry, a filter that does not fit degrades to
# probing and is reported, a partition held by a prepared transaction is
# checked through its filter across a restart until the seal is finished,
# and a streaming standby loads its own.  The clock
# is moved forward with the test-only setting idempotency.debug_clock_offset
# so that partitions pass and are sealed without waiting.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $conf = qq{
shared_preload_libraries = 'idempotency'
idempotency.filter_memory = '200kB'
max_prepared_transactions = 2
};
my $primary = idem_node('filters', init => [ allows_streaming => 1 ], conf => $conf);

# two partitions: 20 000 claims (a 25 kB filter) and 200 000 (250 kB: no room)
$primary->safe_psql(
	'postgres', q{
CREATE EXTENSION idempotency;
SELECT idem_configure(retention => '1 day', partition_interval => '1 hour', premake => 1);
SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'a-' || g FROM generate_series(1, 20000) g));
SET idempotency.debug_clock_offset = '2h';
SELECT count(*) FROM idem_maintain();
SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'b-' || g FROM generate_series(1, 200000) g));
SET idempotency.debug_clock_offset = '4h';
SELECT count(*) FROM idem_maintain();
});
is( $primary->safe_psql(
		'postgres',
		q{SELECT count(*) FROM idempotency.partition_registry WHERE sealed AND nkeys IN (20000, 200000) AND bloom IS NOT NULL}),
	'2',
	'both partitions sealed with filters');

my $dups = q{
SET idempotency.debug_clock_offset = '5h';
SELECT (SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'a-' || g FROM generate_series(1, 20000) g)))
     + (SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'b-' || g FROM generate_series(1, 200000, 7) g)));
};
my $status = q{SELECT mode || ' ' || filters || ' ' || CASE WHEN refused > 0 THEN 't' ELSE 'f' END FROM idempotency.filter_status()};

is($primary->safe_psql('postgres', $dups), '0', 'every claim in both partitions is a duplicate');
is($primary->safe_psql('postgres', $status), 'shared 1 t',
	'the small filter is held once for the cluster; the large one found no room');
like(slurp_file($primary->logfile), qr/no room for the Bloom filter of claims partition \d+/,
	'the refusal is logged');
is($primary->safe_psql('postgres', $dups), '0', 'duplicates still found from another connection');
is( $primary->safe_psql(
		'postgres',
		q{SET idempotency.debug_clock_offset = '5h'; SELECT idem_claim('a-new') AND idem_claim('b-new')}),
	't',
	'new keys are still new');

# the filter is held per cluster, not per backend: a new connection finds it
is($primary->safe_psql('postgres', q{SELECT filters FROM idempotency.filter_status()}),
	'1', 'a new connection sees the loaded filter');

# a restart empties the area; the registry still has the filters
$primary->restart;
is($primary->safe_psql('postgres', $status), 'shared 0 f', 'after restart: area empty');
is($primary->safe_psql('postgres', $dups), '0', 'after restart: duplicates still found');
is($primary->safe_psql('postgres', $status), 'shared 1 t', 'after restart: loaded again');

# A partition sealed while a prepared transaction has claims in it is held:
# claimers use its filter (with those claims) from the shared area at once,
# also after a restart, which the prepared transaction survives; once it
# commits, the next round marks the partition sealed (a new registry row),
# and claimers load the filter again under that row.
$primary->safe_psql(
	'postgres', q{
SET idempotency.debug_clock_offset = '5h';
SELECT count(*) FROM idem_maintain();
BEGIN;
SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'c-' || g FROM generate_series(1, 1000) g));
PREPARE TRANSACTION 'held';
});
my $held_state = q{
SELECT p.state || ' ' || (p.held_by_xids::xid[] = ARRAY(SELECT transaction FROM pg_prepared_xacts))
  FROM idempotency.partitions p JOIN idempotency.partition_registry r ON r.relid = p.partition
 WHERE r.held_by IS NOT NULL};
is( $primary->safe_psql(
		'postgres', q{
SET idempotency.debug_clock_offset = '7h';
SELECT string_agg(action, ',' ORDER BY action) FROM idem_maintain() WHERE action IN ('close', 'hold');
SELECT string_agg(action, ',' ORDER BY action) FROM idem_maintain() WHERE action IN ('close', 'hold');
}),
	"close
hold",
	'the prepared transaction\'s partition is closed, then sealed as held');
is($primary->safe_psql('postgres', $held_state), 'held true', 'held by the prepared transaction');
my $new_keys = q{
SET idempotency.debug_clock_offset = '7h';
SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'd-' || g || '-' || random() FROM generate_series(1, 50) g));
};
is($primary->safe_psql('postgres', $new_keys), '50', 'new keys are new beside a held partition');
is($primary->safe_psql('postgres', $status), 'shared 2 t', 'the held partition\'s filter is in the shared area');

$primary->restart;
is($primary->safe_psql('postgres', $held_state), 'held true', 'after restart: still held');
is($primary->safe_psql('postgres', $new_keys), '50', 'after restart: new keys are new');
is($primary->safe_psql('postgres', $status), 'shared 2 t', 'after restart: the held filter loaded again');

$primary->safe_psql('postgres', q{COMMIT PREPARED 'held'});
is( $primary->safe_psql(
		'postgres', q{
SET idempotency.debug_clock_offset = '7h';
SELECT count(*) FROM idem_maintain() WHERE action = 'seal';
SELECT count(*) FROM idempotency.partition_registry WHERE held_by IS NOT NULL;
}),
	"1
0",
	'after the commit the round finishes the seal');
is( $primary->safe_psql(
		'postgres', q{
SET idempotency.debug_clock_offset = '7h';
SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'c-' || g FROM generate_series(1, 1000) g));
}),
	'0',
	'its claims are duplicates');
is($primary->safe_psql('postgres', $status), 'shared 2 t',
	'the filter is held under the sealed row, the held one forgotten');

# a streaming standby loads its own filters from the replicated registry
$primary->backup('bkp');
my $standby = PostgreSQL::Test::Cluster->new('filters_standby');
$standby->init_from_backup($primary, 'bkp', has_streaming => 1);
$standby->start;
$primary->wait_for_catchup($standby);
is($standby->safe_psql('postgres', $status), 'shared 0 f', 'standby: its own empty area');
is( $standby->safe_psql(
		'postgres', q{
SET idempotency.debug_clock_offset = '5h';
SELECT count(*) FROM generate_series(1, 20000, 13) g WHERE idem_claimed('a-' || g) IS NULL}),
	'0',
	'standby: claims in the sealed partition are found');
is($standby->safe_psql('postgres', q{SELECT filters FROM idempotency.filter_status()}),
	'2', 'standby: loaded the filters (of the 20 000 and of the once held partition) into its own area');

$standby->stop;
$primary->stop;
done_testing();
