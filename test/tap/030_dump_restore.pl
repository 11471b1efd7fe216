# Settings, claims, payload fingerprints and guards survive
# pg_dump | pg_restore into a fresh database: partitions are data (dumped
# like user tables), the registry and settings are configuration tables.
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = idem_node('dump');

$node->safe_psql('postgres', 'CREATE DATABASE source');
$node->safe_psql('postgres', 'CREATE DATABASE target');
$node->safe_psql('source', q{
	CREATE EXTENSION idempotency;
	SELECT idem_configure(retention => '3 days', partition_interval => '1 hour', premake => 2);
	SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'k' || g FROM generate_series(1, 500) g));
	SELECT idem_claim('pay', 'billing', '{"amount": 10}');
	CREATE TABLE accounts (id int PRIMARY KEY, balance int, version int);
	SELECT idem_guard_version('accounts');
	INSERT INTO accounts VALUES (1, 100, 5);
});

my $dump = $node->basedir . '/source.dump';
$node->command_ok(
	[ 'pg_dump', '-Fc', '-f', $dump, '-d', $node->connstr('source') ],
	'pg_dump of a database using idempotency');
$node->command_ok(
	[ 'pg_restore', '--exit-on-error', '-d', $node->connstr('target'), $dump ],
	'pg_restore into a fresh database');

is($node->safe_psql('target',
		'SELECT retention, partition_interval, premake FROM idempotency.settings'),
	'3 days|01:00:00|2', 'settings restored');
is($node->safe_psql('target', 'SELECT count(*) FROM idempotency.claims'),
	'501', 'every claim restored');
is($node->safe_psql('target',
		"SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'k' || g FROM generate_series(1, 510) g))"),
	'10', 'restored claims are duplicates, only new keys are claimed');
is($node->safe_psql('target', q{SELECT idem_claim('pay', 'billing', '{"amount": 10}')}),
	'f', 'same payload after restore: duplicate');
my ($ret, $stdout, $stderr) = $node->psql('target',
	q{SELECT idem_claim('pay', 'billing', '{"amount": 11}')});
like($stderr, qr/different payload/, 'payload fingerprint restored: mismatch still IK001');
is($node->safe_psql('target',
		'SELECT count(*) FROM idempotency.partition_registry r'
		  . ' WHERE NOT EXISTS (SELECT FROM pg_class c WHERE c.oid = r.relid)'),
	'0', 'registry points at the restored partitions');
is($node->safe_psql('target', 'SELECT count(*) >= 0 FROM idem_maintain()'),
	't', 'maintenance runs on the restored database');
is($node->safe_psql('target', q{
	UPDATE accounts SET balance = 1, version = 4 WHERE id = 1;
	SELECT balance FROM accounts WHERE id = 1}),
	'100', 'version guard restored with its table');
is($node->safe_psql('target', q{
	SELECT count(*) FROM (SELECT scope, key FROM idempotency.claims
	                      GROUP BY 1, 2 HAVING count(*) > 1) d}),
	'0', 'no key doubled after restore');

$node->stop;
done_testing();
