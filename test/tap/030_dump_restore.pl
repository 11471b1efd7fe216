# Settings, claims, payload fingerprints, guards, the outbox, requests and the
# inbox survive
# pg_dump | pg_restore into a fresh database: partitions are data (dumped
# like user tables, attached beside those CREATE EXTENSION made in the
# target), the registries, settings and outbox state are configuration
# tables.
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
	-- outbox: events in the partitions, one emitted past every range (it
	-- goes into the newest); a delivered, b parked after a
	-- failure, c delivered; one dead letter in another aggregate type
	SELECT count(*) FROM idem_outbox_emit_many('order', ARRAY['a', 'a', 'b'],
	    ARRAY['e', 'e', 'e'], ARRAY['{}', '{}', '{}']::jsonb[]);
	SET idempotency.debug_clock_offset = '10d';
	SELECT count(*) FROM idem_outbox_emit('later', 'z', 'e', '{}');
	RESET idempotency.debug_clock_offset;
	SELECT count(*) FROM idem_outbox_emit_many('order', ARRAY['a', 'b', 'c'],
	    ARRAY['e', 'e', 'e'], ARRAY['{}', '{}', '{}']::jsonb[]);
	CREATE TEMP TABLE claimed AS SELECT * FROM idem_outbox_claim(100, '1 minute', ARRAY['order']);
	SELECT idem_outbox_ack(array_agg(id)) FROM claimed WHERE aggregate_id IN ('a', 'c');
	SELECT idem_outbox_nack(id, 'try later', '0 seconds') FROM claimed
	 WHERE aggregate_id = 'b' AND seq = 1;
	SELECT count(*) FROM idem_outbox_emit('invoice', 'x', 'e', '{}');
	SET idempotency.outbox_max_attempts = 1;
	SELECT count(*) FROM idem_outbox_claim(100, '1 minute', ARRAY['invoice']);
	SELECT idem_outbox_nack(id, 'poison') FROM idempotency.outbox_events
	 WHERE aggregate_type = 'invoice';
	-- a second subscription, to orders only, that has delivered a
	SELECT idem_outbox_subscribe('audit', ARRAY['order'], 'earliest');
	CREATE TEMP TABLE audited AS SELECT * FROM idem_outbox_claim(100, '1 minute', NULL, 'audit');
	SELECT idem_outbox_ack(array_agg(id), NULL, 'audit') FROM audited WHERE aggregate_id = 'a';
	-- requests: one completed, one in progress under a long lease
	SELECT count(*) FROM idem_request_begin('r1', 'api', '{"amount": 1}');
	SELECT idem_request_complete('r1', 'api', '{"id": "pay_1"}', 1, 201);
	SELECT count(*) FROM idem_request_begin('r2', 'api', lease => '1 hour');
	SELECT idem_request_checkpoint('r2', 'api', 1, 'charged', '{"charge": "ch_2"}');
	-- inbox: m1 done, m2 and m3 (ordering key k, seq 1 and 2) pending, m4 dead
	SELECT idem_inbox_receive('broker', 'm' || g, jsonb_build_object('n', g),
	                          CASE WHEN g IN (2, 3) THEN '{"ordering_key": "k"}' ELSE '{}' END::jsonb)
	  FROM generate_series(1, 4) g;
	SELECT idem_inbox_done(ARRAY(SELECT id FROM idempotency.inbox_messages WHERE message_id = 'm1'));
	SET idempotency.inbox_max_attempts = 1;
	CREATE TEMP TABLE taken AS SELECT * FROM idem_inbox_claim(100, '1 minute');
	SELECT idem_inbox_fail(id, 'poison') FROM taken WHERE message_id = 'm4';
	RESET idempotency.inbox_max_attempts;
	SELECT idem_inbox_fail(id, 'later', '0 seconds') FROM taken WHERE message_id <> 'm4';
});
# the claims' partition sealed, so the scope history holds them
$node->safe_psql('source', q{
	SET idempotency.debug_clock_offset = '2h';
	SELECT count(*) FROM idem_maintain();
});
my $consumers_sql = q{
	SELECT (SELECT string_agg(scope || '=' || claims, ',' ORDER BY scope) FROM idempotency.consumers),
	       (SELECT sum(claims) FROM idempotency.scope_history)};
my $consumers_before = $node->safe_psql('source', $consumers_sql);
like($consumers_before, qr/\|\d+$/, 'source: sealed claims are in the scope history');

my $dump = $node->basedir . '/source.dump';
$node->command_ok(
	[ 'pg_dump', '-Fc', '-f', $dump, '-d', $node->connstr('source') ],
	'pg_dump of a database using idempotency');
$node->command_ok(
	[ 'pg_restore', '--exit-on-error', '-d', $node->connstr('target'), $dump ],
	'pg_restore into a fresh database');

is($node->safe_psql('target', $consumers_sql), $consumers_before,
	'consumers and the scope history restored');
is($node->safe_psql('target',
		'SELECT retention, partition_interval, premake FROM idempotency.settings'),
	'3 days|01:00:00|2', 'settings restored');
is($node->safe_psql('target', q{SELECT count(*) FROM idempotency.claims WHERE scope NOT LIKE 'request:%' AND scope NOT LIKE 'inbox:%'}),
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

# the outbox: every event, in the default and the range partitions; the
# delivery state and dead letters; seq goes on; the relay finds the rest
is($node->safe_psql('target', q{
	SELECT string_agg(aggregate_id || seq, ',' ORDER BY aggregate_id, seq)
	  FROM idempotency.outbox_events}),
	'a1,a2,a3,b1,b2,c1,x1,z1', 'every outbox event restored');
is($node->safe_psql('target', q{
	SELECT count(*) FROM idempotency.outbox_events e JOIN idempotency.outbox_partitions p
	    ON p.bucket = e.bucket AND p.relid = e.tableoid}),
	'8', 'every event is in a registered partition (restored beside those CREATE EXTENSION made)');
is($node->safe_psql('target', q{
	SELECT string_agg(b.name || '/' || d.aggregate_id || ':' || d.acked_seq, ','
	                  ORDER BY b.name, d.aggregate_id)
	  FROM idempotency.outbox_deliveries d
	  JOIN idempotency.outbox_subscriptions b ON b.id = d.subscription}),
	'audit/a:3,audit/b:0,audit/c:0,default/a:3,default/b:0,default/c:1,default/x:0',
	'delivery state restored, per subscription');
is($node->safe_psql('target', q{
	SELECT string_agg(name || ':' || start || ':' || coalesce(aggregate_types::text, '-'), ',' ORDER BY name)
	  FROM idempotency.outbox_subscriptions}),
	'audit:earliest:{order},default:earliest:-',
	'the subscriptions restored, the default one once');
is($node->safe_psql('target', 'SELECT aggregate_id || seq FROM idempotency.outbox_dead'),
	'x1', 'dead letters restored');
is($node->safe_psql('target', q{SELECT seq FROM idem_outbox_emit('order', 'a', 'e', '{}')}),
	'4', 'seq goes on after restore');
is($node->safe_psql('target', q{
	SELECT string_agg(aggregate_id || seq, ',' ORDER BY aggregate_id, seq)
	  FROM idem_outbox_claim(100, '1 minute')}),
	'a4,b1,b2,z1', 'a relay on the restored database gets what was pending, in order');
is($node->safe_psql('target', q{
	SELECT string_agg(aggregate_id || seq, ',' ORDER BY aggregate_id, seq)
	  FROM idem_outbox_claim(100, '1 minute', NULL, 'audit')}),
	'a4', '... and so does a relay of the other subscription; its leases on b and c came back live');
is($node->safe_psql('target', q{
	SET idempotency.debug_clock_offset = 120;
	SELECT string_agg(aggregate_id || seq, ',' ORDER BY aggregate_id, seq)
	  FROM idem_outbox_claim(100, '1 minute', NULL, 'audit')}),
	'a4,b1,b2,c1', '... and once they expire, all that was pending for it');
is($node->safe_psql('target', q{
	SELECT count(*) FROM idempotency.outbox_partitions o
	 WHERE NOT EXISTS (SELECT FROM pg_class c WHERE c.oid = o.relid)}),
	'0', 'outbox registry points at the restored partitions');

# requests: a completed one replays, one in progress is still held, and
# payloads still count
is($node->safe_psql('target', q{
	SELECT status || ':' || response::text || ':' || response_status
	  FROM idem_request_begin('r1', 'api', '{"amount": 1}')}),
	'completed:{"id": "pay_1"}:201', 'a completed request replays its response after restore');
($ret, $stdout, $stderr) = $node->psql('target',
	q{SELECT * FROM idem_request_begin('r1', 'api', '{"amount": 2}')});
like($stderr, qr/another payload/, 'request payloads restored: another payload is still IK001');
($ret, $stdout, $stderr) = $node->psql('target', q{SELECT * FROM idem_request_begin('r2', 'api')});
like($stderr, qr/is in progress/, 'a request in progress is still held after restore (IK002)');
is($node->safe_psql('target', q{
	SET idempotency.debug_clock_offset = '2h';
	SELECT status || ':' || attempt || ':' || recovery_point FROM idem_request_begin('r2', 'api')}),
	'started:2:charged', '... and taken over from its recovery point once its lease ran out');
is($node->safe_psql('target', q{
	SELECT count(*) FROM idempotency.requests r JOIN idempotency.request_partitions p
	    ON p.bucket = r.bucket AND p.relid = r.tableoid}),
	'2', 'every request is in a registered partition');

# the inbox: every message with its state; received ids stay duplicates;
# seq goes on; a worker gets what was pending, the key's run in order
is($node->safe_psql('target', q{
	SELECT string_agg(message_id || ':' || coalesce(seq::text, '-') || ':'
	                  || CASE WHEN done_at IS NOT NULL THEN 'done' WHEN dead_at IS NOT NULL THEN 'dead'
	                          ELSE 'pending' END, ',' ORDER BY message_id)
	  FROM idempotency.inbox_messages}),
	'm1:-:done,m2:1:pending,m3:2:pending,m4:-:dead', 'every inbox message restored with its state');
is($node->safe_psql('target', q{
	SELECT count(*) FROM idempotency.inbox_messages m JOIN idempotency.inbox_partitions p
	    ON p.bucket = m.bucket AND p.relid = m.tableoid}),
	'4', 'every message is in a registered partition');
is($node->safe_psql('target', q{SELECT idem_inbox_receive('broker', 'm2', '{"n": 2}')}),
	'f', 'a received message is still a duplicate after restore');
$node->safe_psql('target', q{SELECT idem_inbox_receive('broker', 'm5', '{}', '{"ordering_key": "k"}')});
is($node->safe_psql('target', q{SELECT seq FROM idempotency.inbox_messages WHERE message_id = 'm5'}),
	'3', 'seq of an ordering key goes on after restore');
is($node->safe_psql('target', q{
	SELECT string_agg(message_id, ',') FROM idem_inbox_claim(100, '1 minute')}),
	'm2,m3,m5', 'a worker on the restored database gets the pending messages, the key in seq order');
is($node->safe_psql('target', 'SELECT message_id FROM idempotency.inbox_dead'),
	'm4', 'dead messages restored');

$node->stop;
done_testing();
