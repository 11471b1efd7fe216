# A streaming standby runs no maintenance while in recovery (no launcher,
# no worker) while claims continue on the primary and replicate; once the
# standby is promoted, its worker starts, creates partitions there, and
# claims work on it, with the primary's claims still found.
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $primary = idem_node(
	'primary',
	init => [ allows_streaming => 1 ],
	conf => worker_conf('postgres'));

my $idem_backends_sql = q{
	SELECT count(*) FROM pg_stat_activity
	 WHERE backend_type IN ('idempotency maintenance', 'idempotency launcher')};

setup_second_partitions($primary, 'postgres', retention => '1 minute', premake => 2);
ok(wait_partitions_ahead($primary, 'postgres'), 'primary: worker maintains');
is($primary->safe_psql('postgres', "SELECT idem_claim('before-backup')"),
	't', 'primary: claim before the backup');

$primary->backup('bkp');
my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($primary, 'bkp', has_streaming => 1);
$standby->start;

# claims continue on the primary and replicate
is($primary->safe_psql('postgres', "SELECT idem_claim('during-recovery')"),
	't', 'primary: claim while the standby is in recovery');
$primary->wait_for_catchup($standby);
is($standby->safe_psql('postgres', 'SELECT pg_is_in_recovery()'),
	't', 'standby is in recovery');
is( $standby->safe_psql(
		'postgres', "SELECT idem_claimed('during-recovery') IS NOT NULL"),
	't',
	'standby: sees the replicated claim');

# nothing of ours runs on the standby, for several naptimes
sleep 3;
is($standby->safe_psql('postgres', $idem_backends_sql),
	'0', 'standby: no idempotency launcher or worker while in recovery');
unlike(slurp_file($standby->logfile),
	qr/idempotency maintenance worker started|idempotency maintenance: /,
	'standby: no maintenance logged while in recovery');

# the primary's worker kept going meanwhile
ok(wait_partitions_ahead($primary, 'postgres'), 'primary: still maintained');
$primary->wait_for_catchup($standby);

# promote: the worker starts on the new primary and maintains it
$standby->promote;
is($standby->safe_psql('postgres', 'SELECT pg_is_in_recovery()'),
	'f', 'standby promoted');
ok(wait_for_workers($standby, 'postgres', 1), 'promoted: worker starts');
$standby->wait_for_log(
	qr/idempotency maintenance worker started for database "postgres"/);
$standby->wait_for_log(qr/idempotency maintenance: create idempotency\.claims_/);
my ($created) = slurp_file($standby->logfile) =~
  /idempotency maintenance: create (idempotency\.claims_\w+)/;
# the action is logged before its round commits: wait for the commit
ok( $standby->poll_query_until(
		'postgres',
		"SELECT count(*) = 1 FROM idempotency.partition_registry WHERE relid = to_regclass('$created')"
	),
	"promoted: worker created and registered partition $created");
ok(wait_partitions_ahead($standby, 'postgres'),
	'promoted: worker keeps partitions ahead of now');

# claims on the promoted node
is($standby->safe_psql('postgres', "SELECT idem_claim('after-promotion')"),
	't', 'promoted: new claim');
is($standby->safe_psql('postgres', "SELECT idem_claim('after-promotion')"),
	'f', 'promoted: its duplicate');
is($standby->safe_psql('postgres', "SELECT idem_claim('during-recovery')"),
	'f', 'promoted: claim made on the old primary is a duplicate');
is($standby->safe_psql('postgres', "SELECT idem_claim('before-backup')"),
	'f', 'promoted: claim from before the backup is a duplicate');

$standby->stop;
$primary->stop;
done_testing();
