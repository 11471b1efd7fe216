# ALTER EXTENSION idempotency UPDATE from 1.0 while claimers run.  The
# update alters the claims parent, which recurses into every partition; taken
# in its own order, its locks met the claimers' (they lock the partition they
# insert into, then the others newest first) and claimers died with 40P01
# (two runs of three in the review).  Now the update takes its locks first,
# in the claimers' order, each with a short lock_timeout and the set retried:
# three updates under load, no claimer gets an error.  And a role with only
# USAGE on schema idempotency made a view over idempotency.partitions, which
# the update used to drop (and so could not): the update replaces it in place.
use strict;
use warnings;

use IPC::Run;
use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = idem_node('upgradeload', conf => "max_connections = 40\n");

my $script = PostgreSQL::Test::Utils::tempdir() . '/claim.sql';
PostgreSQL::Test::Utils::append_to_file($script,
	"SELECT idem_claim(md5(random()::text), 'load');\n"
	  . "SELECT idem_claim('hot-' || (random() * 20)::int::text, 'load');\n");

$node->safe_psql('postgres', 'CREATE ROLE watcher LOGIN');

for my $run (1 .. 3)
{
	my $db = "up$run";
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	$node->safe_psql(
		$db, q{
CREATE EXTENSION idempotency VERSION '1.0';
-- 1-second partitions (1.0's bound allows them), so that the update meets
-- many partitions, some sealed, while claims go on
SELECT idem_configure(retention => '30 seconds', partition_interval => '1 second', premake => 3);
GRANT USAGE ON SCHEMA idempotency TO watcher;
GRANT SELECT ON idempotency.partitions TO watcher;
GRANT CREATE ON SCHEMA public TO watcher;
});
	# a role with USAGE only builds on the partitions view
	$node->safe_psql($db,
		'SET ROLE watcher; CREATE VIEW public.watch AS SELECT partition, state FROM idempotency.partitions');
	# make some partitions pass and be sealed before the update
	for (1 .. 4)
	{
		$node->safe_psql($db, "SELECT idem_claim('warm-' || g, 'load') FROM generate_series(1, 50) g");
		$node->safe_psql($db, 'SELECT count(*) FROM idem_maintain()');
		sleep 1;
	}

	my ($out, $err) = ('', '');
	my $bench = IPC::Run::start(
		[
			'pgbench', '-n', '-c', '6', '-j', '2', '-T', '12', '-f', $script,
			'-h', $node->host, '-p', $node->port, $db
		],
		'>', \$out, '2>', \$err);
	sleep 3;
	my ($rc, $uout, $uerr) = $node->psql($db, 'ALTER EXTENSION idempotency UPDATE');
	$bench->finish;

	is($rc, 0, "run $run: the update succeeded under load") or diag($uerr);
	unlike($err, qr/deadlock|40P01/, "run $run: no claimer deadlocked") or diag($err);
	unlike($err, qr/ERROR|aborted/, "run $run: no claimer got an error") or diag($err);
	like($out, qr/number of transactions actually processed: [1-9]/,
		"run $run: the claimers made progress");
	is($node->safe_psql($db, "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"),
		'1.1', "run $run: now at 1.1");
	is($node->safe_psql($db, 'SET ROLE watcher; SELECT count(*) > 0 FROM public.watch'),
		't', "run $run: the role's view over idempotency.partitions still works");
	is($node->safe_psql($db,
			"SELECT idem_claim('after-update', 'load'), idem_claim('after-update', 'load')"),
		't|f', "run $run: claims work after the update");
}

$node->stop;
done_testing();
