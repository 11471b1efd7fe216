# idem-relay's sql sink: each event runs a statement on a connection of
# its own to a second PostgreSQL server (started here, the "downstream"
# database: no extension there), $1 the event as JSON and $2 its id.  Under
# pgbench emitters with rollbacks, the relay is killed with SIGKILL and
# restarted and the downstream server is stopped for 3 seconds and started
# again; a poison aggregate type (the statement's function raises for it)
# ends in dead letters while other aggregates flow (skip); a serialization
# failure is tried again in place and costs no attempt; statement_timeout
# is --timeout.  Then every committed event is downstream, none rolled
# back, first arrivals per aggregate in seq order; duplicates (only after a
# lost ack) counted and printed.  Also: --url - (the relay's own database),
# the sink connection's application_name, and the configurations that
# exit 2 (no --sql, --sql without --sink sql, a statement that cannot be
# prepared, more than two parameters).
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;
use RelayTest;

need_relay('sink', 'sql');

my ($out, $err);
foreach my $bad (
	[ [ '--sink', 'sql' ], qr/--sink sql needs --sql STATEMENT/ ],
	[ [ '--sql', 'SELECT 1' ], qr/--sql is for --sink sql only/ ],
	[ [ '--sink', 'redis', '--sql', 'SELECT 1' ], qr/--sql is for --sink sql only/ ],
	[ [ '--in', 'http', '--sql', 'SELECT 1' ], qr/--sql is for --sink sql only/ ])
{
	IPC::Run::run([ 'idem-relay', @{ $bad->[0] } ], '<', \undef, '>', \$out, '2>', \$err);
	is($? >> 8, 2, "exit 2: idem-relay @{ $bad->[0] }");
	like($err, $bad->[1], "message: $bad->[1]");
}

my $tmp = PostgreSQL::Test::Utils::tempdir();
my $node = relay_node('relay_sql');

# the downstream database: arrivals in commit order; poison refused; the
# first try of aggregate type 'flaky' fails with a serialization failure;
# 'slow' sleeps past --timeout on its first try
my $down = idem_node('relay_sql_downstream', conf => 'fsync = off');
$down->safe_psql('postgres', q{
CREATE TABLE arrivals (n bigserial PRIMARY KEY, id uuid NOT NULL, ev jsonb NOT NULL);
CREATE SEQUENCE flaky_tries;
CREATE SEQUENCE slow_tries;
CREATE FUNCTION receive(ev jsonb, id uuid) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF ev->>'aggregate_type' = 'poison' THEN
        RAISE EXCEPTION 'downstream refuses %', id USING ERRCODE = 'check_violation';
    END IF;
    IF ev->>'aggregate_type' = 'flaky' AND nextval('flaky_tries') = 1 THEN
        RAISE EXCEPTION 'try again' USING ERRCODE = 'serialization_failure';
    END IF;
    IF ev->>'aggregate_type' = 'slow' AND nextval('slow_tries') = 1 THEN
        PERFORM pg_sleep(5);
    END IF;
    INSERT INTO arrivals (id, ev) VALUES (id, ev);
END $$;
CREATE ROLE sink LOGIN;
GRANT INSERT ON arrivals TO sink;
GRANT USAGE ON SEQUENCE arrivals_n_seq, flaky_tries, slow_tries TO sink;
GRANT EXECUTE ON FUNCTION receive(jsonb, uuid) TO sink;
});
my $down_conn = $down->connstr('postgres') . ' user=sink';
my $stmt = 'SELECT receive($1, $2)';    # jsonb and uuid

sub arrivals
{
	my @a;
	foreach my $row (split /\n/, $down->safe_psql('postgres',
		q{SELECT id, ev->>'aggregate_type', ev->>'aggregate_id', ev->>'seq' FROM arrivals ORDER BY n}))
	{
		my ($id, $t, $a, $s) = split /\|/, $row;
		push @a, { id => $id, aggregate_type => $t, aggregate_id => $a, seq => $s };
	}
	return \@a;
}

# statements that can never work stop the relay with exit 2, saying why
foreach my $bad (
	[ 'SELEC 1', qr/--sql cannot be prepared: ERROR:  syntax error/ ],
	[ 'SELECT nosuch($1::jsonb)', qr/--sql cannot be prepared: .*function nosuch\(jsonb\) does not exist/ ],
	[ 'SELECT $1::jsonb, $2::uuid, $3::int', qr/--sql has 3 parameters: at most 2/ ])
{
	IPC::Run::run([ 'idem-relay', '-d', relay_connstr($node, 'postgres'), '--sink', 'sql',
			'--url', $down_conn, '--sql', $bad->[0], '--once' ],
		'<', \undef, '>', \$out, '2>', \$err, IPC::Run::timeout(60));
	is($? >> 8, 2, "exit 2: --sql '$bad->[0]'");
	like($err, $bad->[1], "message: $bad->[1]");
}

# --url - : the relay's own database, a second connection; $2 alone is fine
$node->safe_psql('postgres', q{
CREATE TABLE local_sink (id uuid PRIMARY KEY);
GRANT INSERT ON local_sink TO relay;
INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM generate_series(1, 5) g, LATERAL idem_outbox_emit('local', 'l1', 'ev', jsonb_build_object('g', g)) e;
});
IPC::Run::run([ 'idem-relay', '-d', relay_connstr($node, 'postgres'), '--sink', 'sql', '--types', 'local',
		'--sql', 'INSERT INTO local_sink VALUES ($2::uuid)', '--once' ],
	'<', \undef, '>', \$out, '2>', \$err, IPC::Run::timeout(60));
is($?, 0, '--url - (the default): --once exits 0') or diag($err);
is($node->safe_psql('postgres', q{SELECT count(*) FROM local_sink l JOIN emitted e USING (id)}),
	'5', '... having run the statement for the 5 events in the relay\'s own database');

# --sql-commit: a batch is one transaction (its statements share an xid),
# or each event its own; a batch with a failing statement rolls back and
# goes again one event at a time: the others arrive once each, in seq order
$node->safe_psql('postgres', q{
CREATE TABLE local_tx (n bigserial PRIMARY KEY, id uuid NOT NULL, g int, xid xid8 NOT NULL DEFAULT pg_current_xact_id());
CREATE SEQUENCE local_fail_tries;
-- the first try of g = 4 fails (the sequence outlives its rollback)
CREATE FUNCTION local_receive(ev jsonb, id uuid) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF (ev->'payload'->>'g')::int = 4 AND nextval('local_fail_tries') = 1 THEN
        RAISE EXCEPTION 'the first try of g = 4 fails' USING ERRCODE = 'serialization_failure';
    END IF;
    INSERT INTO local_tx (id, g) VALUES (id, (ev->'payload'->>'g')::int);
END $$;
GRANT INSERT ON local_tx TO relay;
GRANT USAGE ON SEQUENCE local_tx_n_seq, local_fail_tries TO relay;
GRANT EXECUTE ON FUNCTION local_receive(jsonb, uuid) TO relay;
});
foreach my $mode ('batch', 'event')
{
	$node->safe_psql('postgres', qq{
		TRUNCATE local_tx;
		SELECT setval('local_fail_tries', 1, false);
		INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
		  FROM generate_series(1, 6) g,
		       LATERAL idem_outbox_emit('local_$mode', 'l' || (g % 2), 'ev', jsonb_build_object('g', g)) e;
	});
	IPC::Run::run([ 'idem-relay', '-d', relay_connstr($node, 'postgres'), '--sink', 'sql',
			'--types', "local_$mode", '--sql-commit', $mode, '--retry-max', '0.1',
			'--sql', 'SELECT local_receive($1, $2)', '--once' ],
		'<', \undef, '>', \$out, '2>', \$err, IPC::Run::timeout(60));
	is($?, 0, "--sql-commit $mode: --once exits 0") or diag($err);
	is($node->safe_psql('postgres', q{SELECT string_agg(g::text, ',' ORDER BY g) FROM local_tx}),
		'1,2,3,4,5,6', "--sql-commit $mode: each event once, the one that failed first too");
	is($node->safe_psql('postgres', q{
		SELECT bool_and(ordered) FROM (
		    SELECT g > coalesce(lag(g) OVER (PARTITION BY g % 2 ORDER BY n), 0) AS ordered FROM local_tx) o}),
		't', "--sql-commit $mode: per aggregate in seq order");
	is($node->safe_psql('postgres', q{SELECT count(DISTINCT xid) FROM local_tx}),
		'6', "--sql-commit $mode: after the failure, one transaction per event");
	$node->safe_psql('postgres', qq{DELETE FROM emitted WHERE aggregate_type = 'local_$mode'});
}
# a batch that does not fail is one transaction
$node->safe_psql('postgres', q{
	TRUNCATE local_tx;
	INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
	  FROM generate_series(1, 6) g, LATERAL idem_outbox_emit('local_ok', 'l' || (g % 2), 'ev', jsonb_build_object('g', g)) e;
});
IPC::Run::run([ 'idem-relay', '-d', relay_connstr($node, 'postgres'), '--sink', 'sql', '--types', 'local_ok',
		'--sql', 'SELECT local_receive($1, $2)', '--once' ],
	'<', \undef, '>', \$out, '2>', \$err, IPC::Run::timeout(60));
is($node->safe_psql('postgres', q{SELECT count(*) || ' in ' || count(DISTINCT xid) FROM local_tx}),
	'6 in 1', 'a batch that does not fail: its 6 statements in one transaction');
$node->safe_psql('postgres', q{DELETE FROM emitted WHERE aggregate_type = 'local_ok'});
IPC::Run::run([ 'idem-relay', '--sink', 'sql', '--sql', 'SELECT 1', '--sql-commit', 'sometimes' ],
	'<', \undef, '>', \$out, '2>', \$err);
is($? >> 8, 2, 'exit 2: --sql-commit sometimes');
like($err, qr/invalid --sql-commit "sometimes": batch or event/, 'message: batch or event');

# (they are not among what the downstream database must get)
$node->safe_psql('postgres', q{DELETE FROM emitted WHERE aggregate_type = 'local'});

my $emitters = start_emitters($node, 100);
my @args = ('--sink', 'sql', '--url', $down_conn, '--sql', $stmt,
	'--retries', '3', '--retry-max', '0.5', '--nack-retry-after', '0.2', '--verbose');
my $relay;
{
	local $ENV{PGAPPNAME} = 'relay-sql';
	$relay = start_relay($node, "$tmp/relay.out", @args);
}
ok(wait_until(60, sub { @{ arrivals() } >= 300 }), 'events arrive while emitters run');
is($down->safe_psql('postgres',
		q{SELECT string_agg(DISTINCT application_name, ',') FROM pg_stat_activity WHERE usename = 'sink'}),
	'relay-sql/sink', "the sink connection's application_name is PGAPPNAME/sink");
kill_relay($relay);
$relay = start_relay($node, "$tmp/relay.out", @args);
ok(wait_until(60, sub { @{ arrivals() } >= 600 }), 'the restarted relay delivers');

$down->stop('fast');
sleep 3;
$down->start;
my $before = @{ arrivals() };
ok(wait_until(60, sub { @{ arrivals() } >= $before + 300 }), 'delivery resumes once the downstream server is back');

# a serialization failure and a statement past --timeout (1 s) are tried
# again in place: each arrives, having spent no attempt
$node->safe_psql('postgres', q{
INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM idem_outbox_emit('flaky', 'f1', 'ev', '{}') e;
INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM idem_outbox_emit('slow', 's1', 'ev', '{}') e;
});
ok(wait_until(60, sub { grep { $_->{aggregate_type} eq 'flaky' } @{ arrivals() } }),
	'the event whose first try was a serialization failure arrives');
ok(wait_until(60, sub { grep { $_->{aggregate_type} eq 'slow' } @{ arrivals() } }),
	'the event whose first try ran past --timeout arrives');
is($node->safe_psql('postgres', q{SELECT count(*) FROM idempotency.outbox_dead WHERE aggregate_type IN ('flaky', 'slow')}),
	'0', '... neither dead-lettered');

poison_flows($node, \&arrivals);
my $total = drain_and_dead_letter($node, $emitters, \&arrivals, 'are downstream');
like(poison_error($node),
	qr/downstream refuses/, "the dead letter keeps the statement's error");
like(http_get($relay->{port}, '/metrics'), qr/^idem_relay_sink_reconnects_total [1-9]\d*$/m,
	'metrics: the reconnection to the downstream server counted');
ok(stop_relay($relay), 'SIGTERM: the relay drains and exits 0');

my $log = slurp_file("$tmp/relay.out.err");
# (in its batch's transaction, which rolled back, or on its own)
my $again = qr/(?:publish failed: trying again|pipelined publish stopped in a run: going on one event at a time)/;
like($log, qr/$again.*(?:could not serialize|try again)/, 'the serialization failure was logged as tried again');
like($log, qr/$again.*statement timeout/, 'so was the statement timeout');

is(scalar(grep { $_->{aggregate_type} eq 'local' } @{ arrivals() }), 0,
	'(the --url - run wrote nothing downstream)');
# the kill and the downstream stop: each at most the two batches in hand (20 each)
check_arrivals($node, arrivals(), poison => 'poison', max_dups => 2 * 2 * 20);
$down->stop;
$node->stop;
done_testing();
