# The maintenance worker (the bootstrap superuser) never runs code that a
# partition's owner controls.  A role that owns a claims partition (as 1.0's
# rounds left them to whoever ran them) adds an index whose expression calls
# an IMMUTABLE function that calls a VOLATILE one: planning a query over the
# partition, or building its index entries, folds the expression and runs
# it.  Under 1.0's code the worker's seal planned such a query
# (GROUP BY scope, for the consumers history) and the function ran as
# superuser: here it would record that and make its role a superuser.  Now
# the round refuses the partition (not ours) and reports it; nothing runs.
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes ();
use IdemTest;

my $node = idem_node('owner', conf => worker_conf('postgres'));

$node->safe_psql(
	'postgres', q{
CREATE ROLE mallory LOGIN;
CREATE SCHEMA m AUTHORIZATION mallory;
CREATE TABLE m.ran (who name, superuser boolean);
GRANT INSERT ON m.ran TO PUBLIC;
CREATE EXTENSION idempotency;
SELECT idem_configure(retention => '60 seconds', partition_interval => '1 second', premake => 3);
GRANT USAGE, CREATE ON SCHEMA idempotency TO mallory;   -- as a 1.0 maintenance role needed
});

# mallory's functions: the volatile one records who runs it and tries to
# make mallory a superuser (which only a superuser could do)
$node->safe_psql(
	'postgres', q{
SET ROLE mallory;
CREATE FUNCTION m.evil() RETURNS text LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    INSERT INTO m.ran SELECT current_user, r.rolsuper FROM pg_roles r WHERE r.rolname = current_user;
    BEGIN
        ALTER ROLE mallory SUPERUSER;
    EXCEPTION WHEN insufficient_privilege THEN
        NULL;
    END;
    RETURN '';
END $$;
CREATE FUNCTION m.imm() RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN m.evil();
END $$;
});

# a partition a few seconds ahead becomes mallory's; mallory indexes it
# (found and taken in one query: one seen ahead by a first query may no
# longer be by a second)
my $part = '';
for (1 .. 300)
{
	$part = $node->safe_psql(
		'postgres', q{
SELECT relid FROM idempotency.partition_registry
 WHERE lower > now() + interval '2 seconds' AND upper - lower = interval '1 second'
 ORDER BY lower LIMIT 1});
	last if $part ne '';
	Time::HiRes::usleep(100_000);
}
isnt($part, '', 'the worker made 1-second partitions ahead');
my $upper = $node->safe_psql('postgres',
	"SELECT upper FROM idempotency.partition_registry WHERE relid = '$part'::regclass");
my $partoid = $node->safe_psql('postgres', "SELECT '$part'::regclass::oid");
$node->safe_psql('postgres', "ALTER TABLE $part OWNER TO mallory");
$node->safe_psql('postgres',
	"SET ROLE mallory; CREATE INDEX ON $part ((scope || m.imm()))");
is($node->safe_psql('postgres', "SELECT count(*) > 0 AND bool_and(who = 'mallory') FROM m.ran"),
	't', 'building the index ran the function, as mallory (the test is live)');
$node->safe_psql('postgres', 'TRUNCATE m.ran');

# the worker's rounds pass the partition's range (a round a second)
my $offset = -s $node->logfile;
ok( $node->poll_query_until(
		'postgres', "SELECT now() > '$upper'::timestamptz + interval '4 seconds'"),
	'the partition\'s range has passed by 4 seconds');
like(slurp_file($node->logfile, $offset),
	qr/skip seal \(not ours: owned by role mallory[^)]*\) \Q$part\E/,
	'and reports this one as not ours');
is($node->safe_psql('postgres', 'SELECT count(*) FROM m.ran'),
	'0', 'the function never ran during maintenance');
is($node->safe_psql('postgres', "SELECT rolsuper FROM pg_roles WHERE rolname = 'mallory'"),
	'f', 'mallory is not a superuser');
is($node->safe_psql('postgres', "SELECT sealed FROM idempotency.partition_registry WHERE relid::oid = $partoid"),
	'f', 'the partition stays unsealed');

# given back to the extension's owner (and the index gone), it is handled again
$node->safe_psql('postgres', "DROP INDEX " .
	  $node->safe_psql('postgres', "SELECT indexrelid::regclass FROM pg_index WHERE indrelid = '$part'::regclass AND indexprs IS NOT NULL"));
$node->safe_psql('postgres', "ALTER TABLE $part OWNER TO CURRENT_USER");
ok( $node->poll_query_until(
		'postgres', "SELECT count(*) = 0 FROM idempotency.partition_registry WHERE relid::oid = $partoid"),
	'once ours again, the worker seals it and drops it when it expires');
is($node->safe_psql('postgres', 'SELECT count(*) FROM m.ran'), '0', 'still nothing ran');

$node->stop;
done_testing();
