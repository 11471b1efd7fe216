# The outbox across a crash (pg_ctl stop -m immediate, then start), with
# transactions open in each phase at the moment of the crash:
#   A  5 events committed, claimed (1-hour lease), seqs 1-2 acked; in flight:
#      an emit to the same aggregate (seq 6) and a second emit queued behind
#      it on the aggregate's lock;
#   B  3 events committed and claimed; in flight: the ack of the whole run;
#   C  2 events committed; in flight: a claim (inside BEGIN) that returned them;
#   D  in flight only: an emit_many;
#   load  pgbench emitters (20 % rollbacks, each commit logs what emit
#      returned in the same transaction) and relays (claim, publish in a
#      transaction of their own, ack) running.
# After the restart: committed events are all there and nothing else (the
# emit log and outbox_events agree), seqs are 1..max per aggregate and the
# emit counters match; committed acks and leases hold, in-flight ones are
# gone; a relay run after the restart delivers per aggregate exactly
# acked_seq+1..max, in seq order, and the first publications over the whole
# run are in seq order.
use strict;
use warnings;

use IPC::Run;
use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = idem_node('outbox_crash',
	conf => "synchronous_commit = on\nmax_connections = 40");
my $db = 'postgres';
my $timer = IPC::Run::timer($PostgreSQL::Test::Utils::timeout_default);

$node->safe_psql(
	$db, q{
CREATE EXTENSION idempotency;
-- what committed emits returned (written in the emitting transaction)
CREATE TABLE emitted (id uuid PRIMARY KEY, aggregate_type text NOT NULL,
                      aggregate_id text NOT NULL, seq bigint NOT NULL);
-- what relays published, in order (n), before ('pre') and after ('post') the crash
CREATE TABLE published (n bigserial PRIMARY KEY, phase text NOT NULL, relay text,
                        id uuid NOT NULL, aggregate_type text NOT NULL,
                        aggregate_id text NOT NULL, seq bigint NOT NULL,
                        lease_token uuid, attempts int);
CREATE TABLE relay_batch (relay text, ord bigint, id uuid, aggregate_type text,
                                   aggregate_id text, seq bigint, lease_token uuid, attempts int);
});

# emit N events to (TYPE, ID), committed, logged in emitted; returns their ids
sub emit_committed
{
	my ($type, $id, $n) = @_;
	return split /\n/, $node->safe_psql(
		$db, qq{
INSERT INTO emitted
SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
FROM generate_series(1, $n) g,
     LATERAL idem_outbox_emit('$type', '$id', 'ev', jsonb_build_object('g', g)) e
RETURNING id});
}

# a psql session in the background fed SQL (see IdemTest's bg_psql)
sub bg_session
{
	my ($name, $sql, $marker) = @_;
	return bg_psql($node, $db, $name, $timer, $sql, $marker);
}

# claim (BATCH, LEASE, TYPE) in one autocommit statement, keeping the rows in
# relay_batch for RELAY; returns "seq:attempts" strings in output order
sub claim
{
	my ($relay, $type, $lease, $offset) = @_;
	my $set = defined $offset ? "SET idempotency.debug_clock_offset = $offset;" : '';
	return split /\n/, $node->safe_psql(
		$db, qq{$set
DELETE FROM relay_batch WHERE relay = '$relay';
INSERT INTO relay_batch
SELECT '$relay', c.ordinality, c.id, c.aggregate_type, c.aggregate_id, c.seq, c.lease_token, c.attempts
FROM idem_outbox_claim(100, '$lease', ARRAY['$type']) WITH ORDINALITY c;
SELECT seq || ':' || attempts FROM relay_batch WHERE relay = '$relay' ORDER BY ord});
}

# publish RELAY's batch (phase PHASE)
sub publish
{
	my ($relay, $phase) = @_;
	$node->safe_psql(
		$db, qq{
INSERT INTO published (phase, relay, id, aggregate_type, aggregate_id, seq, lease_token, attempts)
SELECT '$phase', relay, id, aggregate_type, aggregate_id, seq, lease_token, attempts
FROM relay_batch WHERE relay = '$relay' ORDER BY ord});
	return;
}

# the SQL that acks RELAY's batch events with seq <= MAXSEQ, with its token
sub ack_sql
{
	my ($relay, $maxseq) = @_;
	return qq{SELECT idem_outbox_ack(array_agg(id ORDER BY ord), min(lease_token::text)::uuid)
FROM relay_batch WHERE relay = '$relay' AND seq <= $maxseq};
}

sub acked_seq
{
	my ($type) = @_;
	return $node->safe_psql($db,
		"SELECT coalesce(max(acked_seq), 0) FROM idempotency.outbox_deliveries WHERE aggregate_type = '$type'"
	);
}

# ---- A: committed, claimed, partly acked; an emit in flight, one queued ----
emit_committed('crashA', 'a', 5);
is(join(',', claim('A', 'crashA', '1 hour')),
	'1:1,2:1,3:1,4:1,5:1', 'A: the claim returns seqs 1-5, first attempt');
publish('A', 'pre');
is($node->safe_psql($db, ack_sql('A', 2)), '2', 'A: ack of seqs 1-2 marks 2');
my $a_emit = bg_session('a_emit', q{
BEGIN;
SELECT seq FROM idem_outbox_emit('crashA', 'a', 'lost', '{}');}, 'a-emitted');
like($a_emit->{out}, qr/^6$/m, 'A: the in-flight emit got seq 6');
my $a_queued = bg_session('a_queued', q{
BEGIN;
SELECT seq FROM idem_outbox_emit('crashA', 'a', 'queued', '{}');}, undef);
ok( $node->poll_query_until(
		$db,
		"SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE application_name = 'a_queued'"),
	'A: a second emit waits behind the first');

# ---- B: committed and claimed; the ack in flight ----
emit_committed('crashB', 'b', 3);
is(join(',', claim('B', 'crashB', '1 hour')), '1:1,2:1,3:1', 'B: claim returns seqs 1-3');
publish('B', 'pre');
my $b_token = $node->safe_psql($db, "SELECT min(lease_token::text) FROM relay_batch WHERE relay = 'B'");
my $b_ack = bg_session('b_ack', "BEGIN;\n" . ack_sql('B', 3) . ';', 'b-acked');
like($b_ack->{out}, qr/^3$/m, 'B: the in-flight ack marks 3');

# ---- C: committed; a claim in flight ----
emit_committed('crashC', 'c', 2);
my $c_claim = bg_session('c_claim', q{
BEGIN;
SELECT seq FROM idem_outbox_claim(100, '1 hour', ARRAY['crashC']);}, 'c-claimed');
like($c_claim->{out}, qr/^1\n2$/m, 'C: the in-flight claim returned seqs 1-2');

# ---- D: only an emit_many in flight ----
my $d_emit = bg_session('d_emit', q{
BEGIN;
SELECT count(*) FROM idem_outbox_emit_many('crashD', ARRAY['d1', 'd2', 'd1'], ARRAY['x', 'y', 'z'],
                                           ARRAY['{}', '{}', '{}']::jsonb[]);}, 'd-emitted');
like($d_emit->{out}, qr/^3$/m, 'D: the in-flight emit_many returned 3 events');

# ---- load: pgbench emitters and relays ----
my $tmp = PostgreSQL::Test::Utils::tempdir();
open my $fh, '>', "$tmp/emit.sql" or die;
print $fh q{
\set a random_zipfian(1, 200, 1.1)
\set r random(1, 100)
BEGIN;
INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM idem_outbox_emit_many('load', ARRAY[:a::text, :a::text], ARRAY['one', 'two'],
                             ARRAY['{}', '{}']::jsonb[]) e;
\if :r <= 20
ROLLBACK;
\else
COMMIT;
\endif
};
close $fh;
open $fh, '>', "$tmp/relay.sql" or die;
print $fh q{
DELETE FROM relay_batch WHERE relay = 'load' || :client_id::text;
INSERT INTO relay_batch
  SELECT 'load' || :client_id::text, c.ordinality, c.id, c.aggregate_type, c.aggregate_id, c.seq, c.lease_token, c.attempts
  FROM idem_outbox_claim(10, '2 seconds', ARRAY['load']) WITH ORDINALITY c;
INSERT INTO published (phase, relay, id, aggregate_type, aggregate_id, seq, lease_token, attempts)
  SELECT 'pre', relay, id, aggregate_type, aggregate_id, seq, lease_token, attempts
  FROM relay_batch WHERE relay = 'load' || :client_id::text ORDER BY ord;
SELECT idem_outbox_ack(array_agg(id ORDER BY ord), min(lease_token::text)::uuid)
  FROM relay_batch WHERE relay = 'load' || :client_id::text HAVING count(*) > 0;
\sleep 5 ms
};
close $fh;
my @pgb = ('pgbench', '-n', '-M', 'extended', '-h', $node->host, '-p', $node->port, '-T', '300');
my ($eo, $ro) = ('', '');
my $emitters = IPC::Run::start([ @pgb, '-c', '4', '-f', "$tmp/emit.sql", $db ], '>&', \$eo);
my $relays = IPC::Run::start([ @pgb, '-c', '2', '-f', "$tmp/relay.sql", $db ], '>&', \$ro);
ok( $node->poll_query_until(
		$db,
		"SELECT (SELECT count(*) FROM emitted WHERE aggregate_type = 'load') >= 1000
		    AND (SELECT count(*) FROM published WHERE aggregate_type = 'load') >= 300"),
	'load: events emitted and published before the crash');

# ---- crash ----
$node->stop('immediate');
$_->{h}->kill_kill for ($a_emit, $a_queued, $b_ack, $c_claim, $d_emit);
$emitters->kill_kill;
$relays->kill_kill;
$node->start;

# ---- committed is there, nothing else, seqs gap-free ----
is( $node->safe_psql(
		$db, q{
SELECT count(*) FROM emitted m
WHERE NOT EXISTS (SELECT FROM idempotency.outbox_events e
                  WHERE e.id = m.id AND e.aggregate_type = m.aggregate_type
                    AND e.aggregate_id = m.aggregate_id AND e.seq = m.seq)}),
	'0', 'every committed event is in outbox_events after the crash');
is( $node->safe_psql(
		$db, q{
SELECT count(*) FROM idempotency.outbox_events e
WHERE NOT EXISTS (SELECT FROM emitted m
                  WHERE e.id = m.id AND e.aggregate_type = m.aggregate_type
                    AND e.aggregate_id = m.aggregate_id AND e.seq = m.seq)}),
	'0', 'outbox_events holds no event that was not committed');
is( $node->safe_psql(
		$db, q{
SELECT count(*) FROM (SELECT aggregate_type, aggregate_id FROM idempotency.outbox_events GROUP BY 1, 2
                      HAVING min(seq) <> 1 OR max(seq) <> count(*) OR count(DISTINCT seq) <> count(*)) x}),
	'0', 'per aggregate, seqs are 1..max without gaps or repeats');
is( $node->safe_psql(
		$db, q{
SELECT count(*) FROM idempotency.outbox_sequences}),
	'0', 'no emit wrote a counter (table mode: seq comes from the events)');
my $nload = $node->safe_psql($db, "SELECT count(*) FROM emitted WHERE aggregate_type = 'load'");
note "load: $nload committed events before the crash";

# ---- A ----
is($node->safe_psql($db, "SELECT string_agg(seq::text, ',' ORDER BY seq) FROM idempotency.outbox_events WHERE aggregate_type = 'crashA'"),
	'1,2,3,4,5', 'A: the in-flight and the queued emit are gone');
is(acked_seq('crashA'), '2', 'A: the committed ack (seqs 1-2) holds');
is(join(',', claim('A2', 'crashA', '1 minute')), '',
	'A: the committed 1-hour lease still excludes other relays');
my @a2 = claim('A2', 'crashA', '1 minute', 7200);
is(join(',', map { s/:.*//r } @a2), '3,4,5',
	'A: once the lease expires, a claim returns seqs 3-5 (not 1-2)');
# SPEC 4: "attempts counts how often an event has been handed out"; seqs
# 3-5 were handed out before the crash (under the lease that expired)
is(join(',', map { s/.*://r } @a2), '2,2,2',
	'A: seqs 3-5, handed out for the second time, carry attempts 2');
publish('A2', 'post');
is($node->safe_psql($db, "SET idempotency.debug_clock_offset = 7200;" . ack_sql('A2', 5)),
	'3', 'A: ack of 3-5 marks 3');
is($node->safe_psql($db, "SELECT seq FROM idem_outbox_emit('crashA', 'a', 'after', '{}')"),
	'6', 'A: the next emit gets seq 6');

# ---- B ----
is(acked_seq('crashB'), '0', 'B: the in-flight ack is gone');
is(join(',', claim('B2', 'crashB', '1 minute')), '',
	'B: the committed lease still excludes other relays');
is($node->safe_psql($db, ack_sql('B', 3)), '3',
	'B: the original lease token (still live) acks seqs 1-3 after the restart');
is(acked_seq('crashB'), '3', 'B: acked up to 3');
is(join(',', claim('B2', 'crashB', '1 minute', 7200)), '',
	'B: nothing is handed out again');

# ---- C ----
is(join(',', claim('C', 'crashC', '1 minute')), '1:1,2:1',
	'C: the in-flight claim is gone: seqs 1-2 are claimable at once, first attempt');
publish('C', 'post');
is($node->safe_psql($db, ack_sql('C', 2)), '2', 'C: acked');

# ---- D ----
is($node->safe_psql($db, q{
SELECT (SELECT count(*) FROM idempotency.outbox_events WHERE aggregate_type = 'crashD')
     + (SELECT count(*) FROM idempotency.outbox_sequences WHERE aggregate_type = 'crashD')}),
	'0', 'D: no event and no counter left by the in-flight emit_many');
is($node->safe_psql($db, "SELECT seq FROM idem_outbox_emit('crashD', 'd1', 'after', '{}')"),
	'1', 'D: the next emit to d1 gets seq 1');

# ---- load: drain with a relay after the restart ----
$node->safe_psql($db,
	'CREATE TABLE acked_at_restart AS SELECT aggregate_type, aggregate_id, acked_seq FROM idempotency.outbox_deliveries'
);
my ($rounds, $n) = (0, 1);
while ($n > 0 && $rounds < 2000)
{
	# 2-second pre-crash leases: an hour later they have all expired
	$n = scalar claim('post', 'load', '1 minute', 3600);
	publish('post', 'post');
	$node->safe_psql($db, 'SET idempotency.debug_clock_offset = 3600;' . ack_sql('post', '1e18'))
	  if $n;
	$rounds++;
}
is($n, 0, "load: a relay after the restart drained the outbox ($rounds rounds)");
is( $node->safe_psql(
		$db, q{
SELECT count(*) FROM emitted m WHERE NOT EXISTS (SELECT FROM published p WHERE p.id = m.id)}),
	'0', 'every committed event was published');
is( $node->safe_psql(
		$db, q{
SELECT count(*) FROM published p
WHERE p.phase = 'post' AND p.aggregate_type = 'load'
  AND p.seq <= coalesce((SELECT acked_seq FROM acked_at_restart a
                         WHERE a.aggregate_type = p.aggregate_type AND a.aggregate_id = p.aggregate_id), 0)}),
	'0', 'after the restart, no event at or below the acked position was handed out again');
is( $node->safe_psql(
		$db, q{
SELECT count(*) FROM (
  SELECT seq, lag(seq) OVER w AS prev, row_number() OVER w AS k, a.acked_seq
  FROM (SELECT aggregate_type, aggregate_id, seq, min(n) AS n FROM published
        WHERE phase = 'post' AND aggregate_type = 'load' GROUP BY 1, 2, 3) f
  LEFT JOIN acked_at_restart a USING (aggregate_type, aggregate_id)
  WINDOW w AS (PARTITION BY f.aggregate_type, f.aggregate_id ORDER BY f.n)) x
WHERE seq <> coalesce(prev, coalesce(acked_seq, 0)) + 1}),
	'0', 'after the restart, each aggregate is delivered from acked_seq+1 on, in seq order');
is( $node->safe_psql(
		$db, q{
SELECT count(*) FROM (
  SELECT seq, lag(seq) OVER w AS prev
  FROM (SELECT aggregate_type, aggregate_id, seq, min(n) AS n FROM published GROUP BY 1, 2, 3) f
  WINDOW w AS (PARTITION BY aggregate_type, aggregate_id ORDER BY n)) x
WHERE seq <> coalesce(prev, 0) + 1}),
	'0', 'over the whole run, first publications per aggregate are in seq order');
is( $node->safe_psql(
		$db, q{
SELECT count(*) FROM (SELECT aggregate_type, aggregate_id, max(seq) AS m FROM emitted GROUP BY 1, 2) e
LEFT JOIN idempotency.outbox_deliveries d USING (aggregate_type, aggregate_id)
WHERE d.acked_seq IS DISTINCT FROM e.m}),
	'0', 'every aggregate is acked up to its last committed event');

$node->stop;
done_testing();
