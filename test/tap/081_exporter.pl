# examples/monitoring/queries.yaml with the real postgres_exporter (Debian
# prometheus-postgres-exporter), connected as a monitoring role granted
# only what doc/observability.md lists: every query runs without error, and the
# metrics carry the values the database holds (claims and duplicates per
# scope, stale skips per guarded table, outbox and inbox backlog, dead letters,
# partitions per state, time since the last maintenance round, room for
# counters, consumers).
# Skipped when the exporter is not installed (test/run-tests installs it on
# Debian).
use strict;
use warnings;

use File::Basename qw(dirname);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(sleep);
use IdemTest;

my $exporter = '/usr/bin/prometheus-postgres-exporter';
plan skip_all => "$exporter is not installed (apt-get install prometheus-postgres-exporter)"
  unless -x $exporter;
system('curl --version >/dev/null 2>&1') == 0
  or plan skip_all => 'curl is not installed';

my $queries = dirname(__FILE__) . '/../../examples/monitoring/queries.yaml';
ok(-f $queries, 'examples/monitoring/queries.yaml exists');

my $node = idem_node('exporter',
	conf => "shared_preload_libraries = 'idempotency'\n");
$node->safe_psql(
	'postgres', q{
CREATE EXTENSION idempotency;
-- the monitoring role of doc/observability.md ("Set-up")
CREATE ROLE idem_monitor LOGIN;
GRANT USAGE ON SCHEMA idempotency TO idem_monitor;
GRANT pg_monitor TO idem_monitor;
-- activity
SELECT idem_claim('k' || g, 'billing') FROM generate_series(1, 5) g;
SELECT idem_claim('k1', 'billing'), idem_claim('k2', 'billing');
CREATE TABLE acct (id int PRIMARY KEY, version int NOT NULL);
INSERT INTO acct VALUES (1, 5);
SELECT idem_guard_version('acct');
UPDATE acct SET version = 4 WHERE id = 1;
SELECT count(*) FROM idem_outbox_emit('order', 'o-1', 'created', '{}');
SELECT count(*) FROM idem_outbox_emit('order', 'o-1', 'paid', '{}');
SELECT idem_outbox_subscribe('audit', ARRAY['order'], 'earliest');
SELECT idem_outbox_ack(ARRAY(SELECT id FROM idem_outbox_claim(1, '1 minute', NULL, 'audit')), NULL, 'audit');
SELECT idem_inbox_receive('hooks', 'm' || g, '{}') FROM generate_series(1, 3) g;
SELECT count(*) FROM idem_maintain();
});

my $port = PostgreSQL::Test::Cluster::get_free_port();
my $dsn = sprintf('host=%s port=%d user=idem_monitor dbname=postgres sslmode=disable',
	$node->host, $node->port);
my ($out, $err) = ('', '');
my $h = IPC::Run::start(
	[
		$exporter, "--web.listen-address=127.0.0.1:$port",
		"--extend.query-path=$queries", '--disable-default-metrics',
		'--disable-settings-metrics'
	],
	'>', \$out, '2>', \$err,
	init => sub { $ENV{DATA_SOURCE_NAME} = $dsn; });

my $metrics = '';
foreach my $try (1 .. 60)
{
	$metrics = `curl -s http://127.0.0.1:$port/metrics`;
	last if $metrics =~ /^idempotency_consumer_first_claim/m;
	sleep 0.5;
}
$h->kill_kill;

sub metric
{
	my ($name, $labels) = @_;
	foreach my $line (split /\n/, $metrics)
	{
		next unless $line =~ /^\Q$name\E\{([^}]*)\} (\S+)$/;
		my ($l, $v) = ($1, $2);
		next if grep { index($l, $_) < 0 } @$labels;
		return $v;
	}
	return undef;
}

is(metric('idempotency_scope_claims', ['scope="billing"']), 5, 'scope billing: 5 claims');
is(metric('idempotency_scope_duplicates', ['scope="billing"']), 2, 'scope billing: 2 duplicates');
my $v = metric('idempotency_scope_seconds_without_duplicate', ['scope="billing"']);
ok(defined $v && $v < 600, 'scope billing: a recent duplicate');
is(metric('idempotency_guard_stale_skips', ['relation="acct"']), 1, 'acct: 1 stale skip');
is(metric('idempotency_outbox_pending', ['subscription="default"', 'aggregate_type="order"']), 2,
	'outbox order: 2 pending for the default subscription');
is(metric('idempotency_outbox_pending', ['subscription="audit"', 'aggregate_type="order"']), 1,
	'... 1 for audit');
is(metric('idempotency_outbox_dead', ['subscription="default"', 'aggregate_type="order"']), 0, 'outbox order: none dead');
is(metric('idempotency_outbox_subscription_pending', ['subscription="audit"']), 1, 'subscription audit: 1 pending');
$v = metric('idempotency_outbox_subscription_lag_seconds', ['subscription="audit"']);
ok(defined $v && $v >= 0 && $v < 600, 'subscription audit: its lag');
is(metric('idempotency_outbox_subscription_detached', ['subscription="audit"']), 0, 'subscription audit: not detached');
is(metric('idempotency_inbox_pending', ['source="hooks"']), 3, 'inbox hooks: 3 pending');
is(metric('idempotency_inbox_dead', ['source="hooks"']), 0, 'inbox hooks: none dead');
is(metric('idempotency_partitions_partitions', [ 'store="claims"', 'state="current"' ]),
	1, 'claims: one current partition');
$v = metric('idempotency_maintenance_seconds_ahead', ['store="claims"']);
ok(defined $v && $v > 86400, 'claims: premade partitions reach more than a day ahead');
is(metric('idempotency_stats_room_database_scopes', []), 3,
	'stats room: this database holds 3 rows (billing, inbox:hooks, acct)');
is(metric('idempotency_stats_room_fair_share', []), 1000, 'stats room: alone, its share is the whole table');
$v = metric('idempotency_maintenance_round_seconds_since', []);
ok(defined $v && $v < 600, 'the last maintenance round is recent');
ok(defined metric('idempotency_consumer_first_claim', ['scope="billing"']),
	'consumers: billing has a first claim');
unlike($err, qr/level=(error|warn)/i, 'the exporter logged no error or warning')
  or diag($err);
unlike($metrics, qr/^pg_exporter_user_queries_load_error\{[^}]*\} 1/m,
	'the queries file loaded');

done_testing();
