# The outbox and change data capture (wal_level = logical; wal2json and
# pgoutput).
# (a) idempotency.outbox_mode = 'wal' and 'both': every committed emit
#     arrives once through a wal2json slot, in commit order, as a
#     transactional message with prefix 'idempotency.outbox' whose content is
#     the event as JSON (the row emit returned); nothing for rolled-back
#     emits (transaction or savepoint); 'wal' stores no event row and keeps
#     seq gap-free; 'table' writes no message.
# (b) 'table' mode: a wal2json slot filtered on idempotency.* sees the
#     outbox_events partitions only INSERTed into (never UPDATE, DELETE or
#     TRUNCATE; test_decoding confirms, as it also shows changes to tables
#     without a replica identity), once per committed event, while events are claimed, acked,
#     nacked, dead-lettered and redriven and while maintenance creates and drops
#     partitions (1-second partitions, the clock moved with
#     idempotency.debug_clock_offset); a partition with an undelivered event
#     is kept until it is acked.  A publication FOR TABLE
#     idempotency.outbox_events WITH (publish_via_partition_root) lists the
#     parent only, and a pgoutput slot on it gets every event, also from
#     partitions created after the publication, as an insert into the parent.
use strict;
use warnings;

use IPC::Run;
use JSON::PP;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = PostgreSQL::Test::Cluster->new('outbox_cdc',
	($ENV{IDEM_TAP_PORT} ? (port => $ENV{IDEM_TAP_PORT}) : ()));
$node->init(allows_streaming => 'logical');
$node->append_conf('postgresql.conf', "max_replication_slots = 10\n");
$node->start;
my $db = 'postgres';
my $json = JSON::PP->new->canonical;
my $timer = IPC::Run::timer($PostgreSQL::Test::Utils::timeout_default);

# Some PostgreSQL builds only let listed libraries be output plugins
# (output_plugin_libraries); where that setting exists, list wal2json.
if ($node->safe_psql($db,
		"SELECT count(*) FROM pg_settings WHERE name = 'output_plugin_libraries'") eq '1')
{
	$node->safe_psql($db,
		"ALTER SYSTEM SET output_plugin_libraries = 'pgoutput', 'test_decoding', 'wal2json'");
	$node->reload;
}

my ($rc, $out, $err) = $node->psql($db,
	"SELECT pg_create_logical_replication_slot('w', 'wal2json')");
is($rc, 0, 'a wal2json slot can be created (package postgresql-15-wal2json)')
  or BAIL_OUT("wal2json is not usable: $err");

$node->safe_psql($db, 'CREATE EXTENSION idempotency');

# the decoded changes of SLOT since the last call, as parsed JSON (format 2)
sub wal2json_changes
{
	my ($slot, @opts) = @_;
	my $o = join '', map { ", '$_'" } @opts;
	my $rows = $node->safe_psql($db,
		"SELECT data FROM pg_logical_slot_get_changes('$slot', NULL, NULL, 'format-version', '2', 'include-xids', '1'$o)"
	);
	return map { decode_json($_) } grep { $_ ne '' } split /\n/, $rows;
}

# the outbox messages among CHANGES: [xid, content (parsed)]
sub outbox_messages
{
	return map { [ $_->{xid}, decode_json($_->{content}), $_ ] }
	  grep { $_->{action} eq 'M' && $_->{prefix} eq 'idempotency.outbox' } @_;
}

# the events emitted by SQL (rows of idem_outbox_event as JSON, one a line)
sub events
{
	my ($sql) = @_;
	return map { decode_json($_) } grep { $_ ne '' } split /\n/, $node->safe_psql($db, $sql);
}

# a psql session in the background, fed SQL; waits for MARKER
sub bg_session
{
	my ($sql, $marker) = @_;
	return bg_psql($node, $db, 'cdc', $timer, $sql, $marker);
}

sub feed
{
	my ($s, $sql, $marker) = @_;
	return bg_feed($s, $sql, $marker);
}

# ---------------- (a) wal and both ----------------
my $emit = q{SELECT row_to_json(e) FROM idem_outbox_emit(%s) e};
my @want;
push @want, events("SET idempotency.outbox_mode = 'wal';
BEGIN;
" . sprintf($emit, q{'walx', 'x', 'created', '{"n": 1, "s": "a\"b"}', '{"trace": "t1"}'}) . ";
" . sprintf($emit, q{'walx', 'y', 'created', '{"n": 2}'}) . ";
COMMIT;");
my @rolled = events("SET idempotency.outbox_mode = 'wal';
BEGIN;
" . sprintf($emit, q{'walx', 'x', 'rolled-back', '{}'}) . ";
ROLLBACK;");
is($rolled[0]{seq}, 2, 'wal: the rolled-back emit got seq 2');
push @want, events("SET idempotency.outbox_mode = 'wal';
" . sprintf($emit, q{'walx', 'x', 'updated', '{"n": 3}'}));
is($want[-1]{seq}, 2, 'wal: after the rollback the next emit gets seq 2 again (gap-free)');

# a savepoint rolled back inside a committed transaction
my @sp = events("SET idempotency.outbox_mode = 'wal';
BEGIN;
SAVEPOINT s;
" . sprintf($emit, q{'walx', 'z', 'in-savepoint', '{}'}) . ";
ROLLBACK TO SAVEPOINT s;
" . sprintf($emit, q{'walx', 'z', 'after-savepoint', '{}'}) . ";
COMMIT;");
is(scalar @sp, 2, 'wal: two emits in the savepoint transaction');
is($sp[1]{seq}, 1, 'wal: the emit after the rolled-back savepoint gets seq 1');
my @sp_rolled = ($sp[0]);
push @want, $sp[1];

# commit order differs from emit order: P emits first, Q commits first
my $p = bg_session("SET idempotency.outbox_mode = 'wal';\nBEGIN;\n"
	  . sprintf($emit, q{'walx', 'p', 'first-emitted', '{}'}) . ';', 'p-emitted');
my $q = bg_session("SET idempotency.outbox_mode = 'wal';\nBEGIN;\n"
	  . sprintf($emit, q{'walx', 'q', 'second-emitted', '{}'}) . ';', 'q-emitted');
feed($q, 'COMMIT;', 'q-committed');
feed($p, 'COMMIT;', 'p-committed');
my ($pe) = map { decode_json($_) } grep { /^\{/ } split /\n/, $p->{out};
my ($qe) = map { decode_json($_) } grep { /^\{/ } split /\n/, $q->{out};
push @want, $qe, $pe;
$_->{h}->finish for ($p, $q);

# emit_many in wal mode: array order
push @want, events("SET idempotency.outbox_mode = 'wal';
SELECT row_to_json(e) FROM idem_outbox_emit_many('walx', ARRAY['m', 'n', 'm'], ARRAY['e1', 'e2', 'e3'],
    ARRAY['{\"i\": 1}', '{\"i\": 2}', '{\"i\": 3}']::jsonb[], ARRAY['{}', '{\"h\": 2}', '{}']::jsonb[]) e");
is(join(',', map { "$_->{aggregate_id}$_->{seq}" } @want[-3 .. -1]), 'm1,n1,m2',
	'wal: emit_many numbers in array order');

# 'both' stores the row and writes the message; 'table' only the row
my @both = events("SET idempotency.outbox_mode = 'both';\n" . sprintf($emit, q{'walboth', 'b', 'both', '{"b": true}'}));
push @want, @both;
my @table = events("SET idempotency.outbox_mode = 'table';\n" . sprintf($emit, q{'waltable', 't', 'table', '{}'}));

is($node->safe_psql($db, "SELECT count(*) FROM idempotency.outbox_events WHERE aggregate_type = 'walx'"),
	'0', 'wal: no event row is stored');
is($node->safe_psql($db, "SELECT count(*) FROM idempotency.outbox_sequences WHERE aggregate_type = 'walx' AND aggregate_id = 'x'"),
	'1', 'wal: the emit counter is kept');
is($node->safe_psql($db, "SELECT string_agg(id::text, ',') FROM idempotency.outbox_events WHERE aggregate_type = 'walboth'"),
	$both[0]{id}, 'both: the event row is stored');
is($node->safe_psql($db, "SELECT count(*) FROM idempotency.outbox_events WHERE aggregate_type = 'waltable'"),
	'1', 'table: the event row is stored');

my @changes = wal2json_changes('w');
my @msgs = outbox_messages(@changes);
is(scalar @msgs, scalar @want,
	'wal/both: one message per committed event (' . scalar(@want) . ')');
is(join(' ', map { "$_->[1]{aggregate_type}/$_->[1]{aggregate_id}/$_->[1]{seq}" } @msgs),
	join(' ', map { "$_->{aggregate_type}/$_->{aggregate_id}/$_->{seq}" } @want),
	'wal/both: messages arrive in commit order (within a transaction, in emit order)');
is(scalar(grep { !$_->[2]{transactional} } @msgs), 0, 'wal/both: every message is transactional');
my %msg_ids = map { ($_->[1]{id} => 1) } @msgs;
is(scalar(grep { $msg_ids{ $_->{id} } } @rolled, @sp_rolled, @table), 0,
	'no message for rolled-back emits (transaction, savepoint) nor for table mode');
is(scalar(keys %msg_ids), scalar @msgs, 'no event arrives twice');
is($msgs[0][0], $msgs[1][0], 'the two events of the first transaction share its xid');

# the content is the event: the fields emit returned (created_at compared as timestamptz)
my @fields = qw(id aggregate_type aggregate_id seq event_type payload headers);
for my $i (0 .. $#want)
{
	my ($m, $w) = ($msgs[$i][1], $want[$i]);
	last unless $m;
	is( $json->encode({ map { ($_ => $m->{$_}) } @fields }),
		$json->encode({ map { ($_ => $w->{$_}) } @fields }),
		"message $i carries the event $w->{aggregate_id}/$w->{seq}");
	is($node->safe_psql($db,
			"SELECT '$m->{created_at}'::timestamptz = '$w->{created_at}'::timestamptz"),
		't', "message $i: created_at");
}
is_deeply([ sort keys %{ $msgs[0][1] } ],
	[ sort qw(id aggregate_type aggregate_id seq event_type payload headers created_at) ],
	'the message content has exactly the fields id, aggregate_type, aggregate_id, seq, event_type, payload, headers, created_at');
is(scalar(outbox_messages(wal2json_changes('w'))), 0, 'the slot has nothing more');

# at clock offset OFF: run SQL (after SET)
sub at
{
	my ($off, $sql) = @_;
	return $node->safe_psql($db, "SET idempotency.debug_clock_offset = $off;\n$sql");
}

# emit N events of TYPE to each of AGGS at offset OFF (after maintenance),
# recording them with the partition they landed in
sub emit_at
{
	my ($off, $type, $n, @aggs) = @_;
	my $ids = join ', ', map { "'$_'" } @aggs;
	at($off, 'SELECT count(*) FROM idem_maintain()');
	at($off, qq{
INSERT INTO cdc_emitted (id, off)
SELECT e.id, $off FROM unnest(ARRAY[$ids]) a, generate_series(1, $n) g,
     LATERAL idem_outbox_emit('$type', a, 'ev', jsonb_build_object('g', g)) e;
UPDATE cdc_emitted c SET part = o.tableoid::regclass
FROM idempotency.outbox_events o WHERE o.id = c.id AND c.part IS NULL});
	# the events just emitted that are not in a partition maintenance made
	return $node->safe_psql($db, qq{
SELECT count(*) FROM cdc_emitted c WHERE c.off = $off
   AND NOT EXISTS (SELECT FROM idempotency.outbox_partitions p WHERE p.relid = c.part)});
}

# claim and ack everything claimable at offset OFF; returns how many were acked
sub drain
{
	my ($off) = @_;
	my ($total, $n) = (0, 1);
	while ($n > 0)
	{
		$n = at($off, q{
CREATE TEMP TABLE b AS SELECT * FROM idem_outbox_claim(1000, '1 minute');
SELECT coalesce(sum(idem_outbox_ack(ids, tok)), 0) FROM
  (SELECT array_agg(id) AS ids, lease_token AS tok FROM b GROUP BY lease_token) x});
		$total += $n;
	}
	return $total;
}

# ---------------- (b) table mode, partitions come and go ----------------
# deliver the two table rows of (a) first
is(drain(0), 2, "(a)'s 'both' and 'table' events are claimed and acked");
$node->safe_psql(
	$db, q{
SELECT pg_create_logical_replication_slot('t', 'wal2json');
SELECT pg_create_logical_replication_slot('td', 'test_decoding');
CREATE PUBLICATION p FOR TABLE idempotency.outbox_events WITH (publish_via_partition_root = true);
SELECT pg_create_logical_replication_slot('pgo', 'pgoutput');
SELECT idem_configure(retention => '5 seconds', partition_interval => '1 second', premake => 2);
CREATE TABLE cdc_emitted (id uuid PRIMARY KEY, part regclass, off bigint);
});

# the outbox range partitions that exist now
sub outbox_parts
{
	my ($off) = @_;
	return split /\n/, $node->safe_psql($db,
		"SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		 WHERE i.inhparent = 'idempotency.outbox_events'::regclass
		   AND c.relname <> 'outbox_events_default' ORDER BY 1");
}

my $day = 86400;
my $off = 10 * $day;    # past the 1-day partitions CREATE EXTENSION premade
at($off, 'SELECT count(*) FROM idem_maintain()');
my @parts1 = outbox_parts();
ok(scalar @parts1 >= 1, 'maintenance made outbox partitions at the moved clock: ' . join(' ', @parts1));

is(emit_at($off, 'cdc', 3, 'k1', 'k2') + emit_at($off, 'cdcdead', 1, 'd'),
	0, 'the events landed in partitions that maintenance made');
my $part_e1 = $node->safe_psql($db, 'SELECT string_agg(DISTINCT part::text, \' \') FROM cdc_emitted');
is($node->safe_psql($db, 'SELECT count(*) FROM cdc_emitted WHERE part IS NULL'), '0',
	"the emitted events are stored ($part_e1)");

# a nack, a dead letter and a redrive along the way
my $nacked = at($off, q{
SELECT count(*) FROM (SELECT idem_outbox_nack(id, 'broken', '0 seconds', lease_token)
                      FROM idem_outbox_claim(1, '1 minute', ARRAY['cdc'])) x});
is($nacked, '1', 'one event nacked');
is(at($off, q{SET idempotency.outbox_max_attempts = 1;
SELECT count(*) FROM (SELECT idem_outbox_nack(id, 'fatal', '0 seconds', lease_token)
                      FROM idem_outbox_claim(1, '1 minute', ARRAY['cdcdead'])) x;
SELECT count(*) FROM idempotency.outbox_dead}), "1\n1", 'with outbox_max_attempts = 1 a nacked event is dead-lettered');
is(at($off, 'SELECT idem_outbox_redrive(ARRAY(SELECT id FROM idempotency.outbox_dead))'), '1',
	'and redriven');
is(drain($off), 7, 'the first 7 events are claimed and acked');

# an undelivered event pins its partition
$off += 2;
is(emit_at($off, 'cdc', 1, 'pin'), 0, 'the pinning event landed in a partition that maintenance made');
my $part_pin = $node->safe_psql($db,
	"SELECT part::text FROM cdc_emitted WHERE id = (SELECT id FROM idempotency.outbox_events WHERE aggregate_id = 'pin')");
$off += 60;
at($off, 'SELECT count(*) FROM idem_maintain()');
my %now = map { ($_ => 1) } outbox_parts();
ok(!grep({ $now{ s/^idempotency\.//r } } split / /, $part_e1),
	"the delivered events' partition(s) were dropped ($part_e1)");
ok($now{ $part_pin =~ s/^idempotency\.//r }, "the partition with an undelivered event is kept ($part_pin)");
my @created = grep { my $x = $_; !grep { $_ eq $x } @parts1 } keys %now;
ok(scalar @created >= 1, 'maintenance made new partitions after the publication: ' . join(' ', sort @created));

# events into the new partitions, then deliver everything and drop them all
is(emit_at($off, 'cdc', 2, 'k1', 'k3'), 0,
	'the later events too landed in partitions that maintenance made');
is(drain($off), 5, 'the pinned event and the 4 later ones are claimed and acked');
$off += 60;
at($off, 'SELECT count(*) FROM idem_maintain()');
%now = map { ($_ => 1) } outbox_parts();
ok(!$now{ $part_pin =~ s/^idempotency\.//r }, 'once acked, the pinned partition is dropped');
my $nemitted = $node->safe_psql($db, 'SELECT count(*) FROM cdc_emitted');
is($node->safe_psql($db,
		'SELECT count(*) FROM cdc_emitted c WHERE NOT EXISTS (SELECT FROM pg_class WHERE oid = c.part)'),
	$nemitted, "every partition that held one of the $nemitted events has been dropped");

# what the wal2json slot saw of the event partitions: the tables named
# outbox_* other than the outbox's state tables
my %state_tables = map { ($_ => 1) }
  qw(outbox_sequences outbox_deliveries outbox_cursor outbox_dead_letters outbox_partitions);
sub event_table { my ($t) = @_; return $t =~ /^outbox_/ && !$state_tables{$t}; }
my @tchanges = grep { event_table($_->{table} // '') }
  wal2json_changes('t', 'add-tables', 'idempotency.*');
my %actions;
$actions{ $_->{action} }++ for @tchanges;
is(join(',', map { "$_=$actions{$_}" } sort keys %actions), "I=$nemitted",
	"the slot saw only INSERTs into outbox_events partitions, $nemitted of them");
# test_decoding shows UPDATEs and DELETEs even without a replica identity
my %td;
for (split /\n/, $node->safe_psql($db, "SELECT data FROM pg_logical_slot_get_changes('td', NULL, NULL)"))
{
	$td{$2}++ if /^table idempotency\.(\S+): (\w+):/ && event_table($1);
}
is(join(',', map { "$_=$td{$_}" } sort keys %td), "INSERT=$nemitted",
	"test_decoding: only INSERTs into outbox_events partitions, $nemitted of them");
my @seen = sort map {
	my $c = $_;
	my ($i) = grep { $c->{columns}[$_]{name} eq 'id' } 0 .. $#{ $c->{columns} };
	defined $i ? $c->{columns}[$i]{value} : 'no id'
} @tchanges;
is(join(',', @seen),
	$node->safe_psql($db, q{SELECT string_agg(id::text, ',' ORDER BY id::text) FROM cdc_emitted}),
	'the inserted rows are exactly the emitted events, once each');

# the publication and the pgoutput slot
is($node->safe_psql($db, "SELECT string_agg(schemaname || '.' || tablename, ',') FROM pg_publication_tables WHERE pubname = 'p'"),
	'idempotency.outbox_events', 'the publication lists the parent only');
# (pgoutput of PostgreSQL 15 also sends a Relation message for each
# partition, after its root's: only the inserts' relation matters)
my $pg = $node->safe_psql(
	$db, q{
WITH m AS (SELECT chr(get_byte(data, 0)) AS kind,
                  CASE WHEN get_byte(data, 0) IN (73, 82)
                       THEN ('x' || encode(substring(data FROM 2 FOR 4), 'hex'))::bit(32)::int::oid END AS relid
           FROM pg_logical_slot_peek_binary_changes('pgo', NULL, NULL,
                    'proto_version', '1', 'publication_names', 'p'))
SELECT count(*) FILTER (WHERE kind = 'I' AND relid = 'idempotency.outbox_events'::regclass) || ' '
    || count(*) FILTER (WHERE kind = 'I' AND relid <> 'idempotency.outbox_events'::regclass) || ' '
    || count(*) FILTER (WHERE kind IN ('U', 'D', 'T'))
FROM m});
is($pg, "$nemitted 0 0",
	'pgoutput: every event as an insert into the parent (also from partitions made after the publication), no other change');

$node->stop;
done_testing();
