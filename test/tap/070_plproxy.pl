# Scale-out with PL/Proxy: a router database and two shard databases
# (hash partitions 0 and 1 of 2) on one server, the shard side from
# examples/scale-out/shard.sql, the router side printed by
# idem_shard_router_ddl() and idem_shard_router_admin_ddl().
#   1. four clients redeliver events concurrently through the router: every
#      effect once, on the shard that owns its account;
#   2. misroutes are refused (IK006) before claiming: a call straight to the
#      wrong shard, and a whole stale router with its partitions swapped;
#   3. a batch split over both shards fails on shard 1 after shard 0
#      committed; retried whole, it applies only the rest;
#   4. partition 1 moves to another database by pg_dump/pg_restore under a
#      write freeze (IK007) while clients deliver, the ownership record
#      travelling with the claims; the old copy gives its partition up;
#      then everything is redelivered;
#   5. the outbox of each shard is relayed: one follow-up event per effect;
#   6. names and text chosen on a shard reach the router only quoted: a
#      shard database whose name ends a comment, a handler and a cluster
#      with $plproxy$ and quotes in their names, a routing key whose literal
#      holds ;, -- and $plproxy$: the printed DDL is applied as printed,
#      runs no other statement, and routes every call right.
# Skipped when PL/Proxy is not installed (test/run-tests installs
# postgresql-15-plproxy when run as root).
use strict;
use warnings;

use File::Basename qw(dirname);
use IPC::Run;
use List::Util qw(shuffle);
use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = idem_node('plproxy');
if ($node->safe_psql('postgres',
		"SELECT count(*) FROM pg_available_extensions WHERE name = 'plproxy'") ne '1')
{
	plan skip_all => 'PL/Proxy is not installed (Debian: apt-get install postgresql-15-plproxy;'
	  . ' test/run-tests installs it when run as root)';
}

my $shard_sql = slurp_file(dirname(__FILE__) . '/../../examples/scale-out/shard.sql');
my $host = $node->host;
my $port = $node->port;
my $EVENTS = 600;
my $ACCOUNTS = 97;

sub connstr { return "host=$host port=$port dbname=$_[0]"; }

for my $db (qw(router shard_a shard_b))
{
	$node->safe_psql('postgres', "CREATE DATABASE $db");
}
$node->safe_psql('shard_a', $shard_sql . "SELECT idem_shard_configure(2, '{0}');");
$node->safe_psql('shard_b', $shard_sql . "SELECT idem_shard_configure(2, '{1}');");

# the router: the cluster as a SQL/MED server, the proxies as generated
my $ddl = $node->safe_psql('shard_a', q{
	SELECT idem_shard_router_ddl('apply_payment(bigint, text, integer)', 'account_id::text')
	    || idem_shard_router_ddl('apply_batch(bigint[], text[], integer[])', 'account_ids::text',
	                             split => '{account_ids, event_ids, amounts}')
	    || idem_shard_router_admin_ddl()});
like($ddl, qr/RUN ON hashtext\(account_id::text\);/, 'the generated proxy routes by account');
$node->safe_psql('router', sprintf(q{
	CREATE EXTENSION plproxy;
	CREATE SERVER idem FOREIGN DATA WRAPPER plproxy OPTIONS (p0 '%s', p1 '%s');
	CREATE USER MAPPING FOR PUBLIC SERVER idem;
	%s}, connstr('shard_a'), connstr('shard_b'), $ddl));
is($node->safe_psql('router',
		'SELECT string_agg(database || owned::text, \' \' ORDER BY database) FROM idem_shards.ownership()'),
	'shard_a{0} shard_b{1}', 'the router reaches both shards; each owns one partition');

# event i: account (i mod 97) + 1, amount (i mod 7) + 1
sub event { my $i = shift; return ("ev-$i", $i % $ACCOUNTS + 1, $i % 7 + 1); }

# Start $n clients, each delivering events $from..$to through $db in its
# own shuffled order, a third of them twice; one SELECT per delivery, its
# own transaction.  Errors do not stop a client.
sub start_clients
{
	my ($n, $from, $to, $db, $tag) = @_;
	my @clients;
	for my $c (1 .. $n)
	{
		my @ids = shuffle(($from .. $to), grep { $_ % 3 == $c % 3 } ($from .. $to));
		my $file = $node->basedir . "/$tag-$c.sql";
		open my $fh, '>', $file or die "$file: $!";
		for (@ids)
		{
			my ($ev, $account, $amount) = event($_);
			print $fh "SELECT apply_payment($account, '$ev', $amount);\n";
		}
		close $fh;
		my %cl = (out => '', err => '');
		$cl{h} = IPC::Run::start(
			[ 'psql', '-XAtq', '-v', 'VERBOSITY=verbose', '-f', $file, '-d', connstr($db) ],
			'>', \$cl{out}, '2>', \$cl{err});
		push @clients, \%cl;
	}
	return \@clients;
}

# wait for the clients; returns (deliveries applied, errors by SQLSTATE)
sub finish_clients
{
	my ($clients) = @_;
	my ($applied, %errors) = (0);
	for my $cl (@$clients)
	{
		$cl->{h}->finish;
		$applied += () = $cl->{out} =~ /^t$/mg;
		$errors{$1}++ while $cl->{err} =~ /ERROR:  (\w{5}):/g;
	}
	return ($applied, \%errors);
}

# every effect on the given shards: doubled, lost (of events 1..$to), on a
# shard that does not own the account, and effects per shard
sub effects
{
	my ($to, @shards) = @_;
	my (%seen, $doubled, $wrong, @per_shard);
	for my $db (@shards)
	{
		my $rows = $node->safe_psql($db, q{
			SELECT e.event_id, (idem_shard_partition(e.account_id::text, o.partitions) = ANY (o.owned))::int
			  FROM effects e, idempotency.shard_ownership o});
		my $n = 0;
		for (split /\n/, $rows)
		{
			my ($ev, $owned) = split /\|/;
			$doubled++ if $seen{$ev}++;
			$wrong++ unless $owned;
			$n++;
		}
		push @per_shard, "$db=$n";
	}
	my $lost = grep { !$seen{"ev-$_"} } (1 .. $to);
	return { doubled => $doubled // 0, lost => $lost, wrong => $wrong // 0,
		per_shard => join(' ', @per_shard) };
}

# ---- 1. concurrent redelivery through the router ----
my ($applied, $errors) = finish_clients(start_clients(4, 1, $EVENTS, 'router', 'round1'));
is($applied, $EVENTS, "4 clients, each event delivered 4-5 times: $EVENTS deliveries applied");
is_deeply($errors, {}, 'no delivery failed');
my $r = effects($EVENTS, 'shard_a', 'shard_b');
is("$r->{doubled}/$r->{lost}/$r->{wrong}", '0/0/0', "0 doubled, 0 lost, 0 on a shard not owning the account ($r->{per_shard})");
like($r->{per_shard}, qr/^shard_a=[1-9]\d* shard_b=[1-9]\d*$/, 'both shards got effects');
is($node->safe_psql('router', q{
	SELECT count(*) FILTER (WHERE claimed_at IS NOT NULL) FROM idem_shards.claimed('ev-1', 'payments')}),
	'1', 'the admin proxy finds the claim of an event on exactly one shard');
is($node->safe_psql('router', q{
	SELECT string_agg(owned::text || ':' || claims, ' ' ORDER BY owned) || ' = ' || sum(claims)
	  FROM idem_shards.stats() WHERE scope = 'payments'}),
	$node->safe_psql('shard_a', q{SELECT '{0}:' || count(*) FROM idempotency.claims WHERE scope = 'payments'}) . ' '
	  . $node->safe_psql('shard_b', q{SELECT '{1}:' || count(*) FROM idempotency.claims WHERE scope = 'payments'})
	  . " = $EVENTS", 'the stats proxy adds up the claims of both shards');

# retention per scope and per store reach every shard through the router
$node->safe_psql('router', q{
	SELECT count(*) FROM idem_shards.configure_scope('payments', '3 days');
	SELECT count(*) FROM idem_shards.configure_store('inbox', '5 days')});
is(join(' ', map { $node->safe_psql($_, q{SELECT scope || '=' || retention FROM idempotency.scope_retention}) }
		qw(shard_a shard_b)),
	'payments=3 days payments=3 days', 'configure_scope() reached both shards');
is($node->safe_psql('router', q{
	SELECT string_agg(owned::text || ':' || retention || ':' || own, ' ' ORDER BY owned)
	  FROM idem_shards.store_settings() WHERE store = 'inbox'}),
	'{0}:5 days:true {1}:5 days:true', 'configure_store() reached both shards');
$node->safe_psql('router', q{
	SELECT count(*) FROM idem_shards.configure_scope('payments', NULL);
	SELECT count(*) FROM idem_shards.configure_store('inbox', NULL)});
is(join(' ', map { $node->safe_psql($_, q{SELECT count(*) FROM idempotency.scope_retention}) } qw(shard_a shard_b))
	  . ' ' . $node->safe_psql('router', q{SELECT bool_or(own) FROM idem_shards.store_settings()}),
	'0 0 f', 'and removed from both');

# ---- 2. misroutes are refused before claiming ----
my ($acct_b) = map { $_ } grep {
	$node->safe_psql('shard_a', "SELECT idem_shard_partition('$_', 2)") eq '1' } (1 .. 5);
my ($ret, $out, $err) = $node->psql('shard_a',
	"\\set VERBOSITY verbose\nSELECT apply_payment($acct_b, 'ev-misrouted', 1)");
like($err, qr/ERROR:  IK006: routing key "$acct_b" is in hash partition 1, which database "shard_a" does not own/,
	'a call straight to the wrong shard: IK006');
is($node->safe_psql('shard_a', q{SELECT count(*) FROM effects WHERE event_id = 'ev-misrouted'}) . '/'
	  . $node->safe_psql('shard_a', q{SELECT idem_claimed('ev-misrouted', 'payments') IS NULL}),
	'0/t', '... no effect, nothing claimed');
# a stale router: partitions swapped, its proxies in schema stale
# (its proxy in schema stale calls public.apply_payment on the shards)
my $stale_ddl = $node->safe_psql('shard_a', q{
	SELECT idem_shard_router_ddl('apply_payment(bigint, text, integer)', 'account_id::text', cluster => 'stale')});
$stale_ddl =~ s/FUNCTION public\.apply_payment/FUNCTION stale.apply_payment/;
$stale_ddl =~ s/(CLUSTER 'stale';)/$1\n    TARGET public.apply_payment;/;
$node->safe_psql('router', sprintf(q{
	CREATE SCHEMA stale;
	CREATE SERVER stale FOREIGN DATA WRAPPER plproxy OPTIONS (p0 '%s', p1 '%s');
	CREATE USER MAPPING FOR PUBLIC SERVER stale;
	%s}, connstr('shard_b'), connstr('shard_a'), $stale_ddl));
$node->safe_psql('router', q{
	CREATE FUNCTION stale.try(account bigint, ev text) RETURNS text LANGUAGE plpgsql AS $$
	BEGIN
	    RETURN stale.apply_payment(account, ev, 1)::text;
	EXCEPTION WHEN OTHERS THEN
	    RETURN SQLSTATE;
	END $$});
is($node->safe_psql('router', q{
	SELECT string_agg(r || ':' || n, ',' ORDER BY r)
	  FROM (SELECT stale.try(g % 97 + 1, 'ev-' || g) AS r, count(*) AS n
	          FROM generate_series(1, 50) g GROUP BY 1) x}),
	'IK006:50', 'a stale router redelivering 50 events: all 50 refused with IK006');
is($node->safe_psql('router', q{
	SELECT string_agg(r || ':' || n, ',' ORDER BY r)
	  FROM (SELECT stale.try(g % 97 + 1, 'ev-new-' || g) AS r, count(*) AS n
	          FROM generate_series(1, 50) g GROUP BY 1) x}),
	'IK006:50', '... and 50 new events too');
$r = effects($EVENTS, 'shard_a', 'shard_b');
is("$r->{doubled}/$r->{lost}/$r->{wrong}", '0/0/0', 'still 0 doubled, 0 lost, 0 misplaced');

# ---- 3. a batch fails on one shard after the other committed ----
my @batch = map { [ "ev-b$_", $_ % $ACCOUNTS + 1, 1 ] } (1 .. 40);
my ($poisoned) = grep {
	$node->safe_psql('shard_a', "SELECT idem_shard_partition('$_->[1]', 2)") eq '1' } @batch;
$node->safe_psql('shard_b', "INSERT INTO poison VALUES ('$poisoned->[0]')");
my $batch_sql = sprintf('SELECT count(*) FROM apply_batch(%s::bigint[], %s::text[], %s::int[])',
	map { my $k = $_; "'{" . join(',', map { $_->[$k] } @batch) . "}'" } (1, 0, 2));
($ret, $out, $err) = $node->psql('router', $batch_sql);
like($err, qr/event $poisoned->[0] is poisoned/, 'the batch fails on shard 1');
my $a_part = $node->safe_psql('shard_a', q{SELECT count(*) FROM effects WHERE event_id LIKE 'ev-b%'});
my $b_part = $node->safe_psql('shard_b', q{SELECT count(*) FROM effects WHERE event_id LIKE 'ev-b%'});
ok($a_part > 0 && $b_part == 0, "shard 0 committed its part ($a_part effects), shard 1 none: the router's call is not one transaction");
$node->safe_psql('shard_b', 'DELETE FROM poison');
is($node->safe_psql('router', $batch_sql), 40 - $a_part, 'retried whole, the batch applies only the rest');
is($node->safe_psql('router', $batch_sql), '0', 'retried again: nothing');
$r = effects(0, 'shard_a', 'shard_b');
is($node->safe_psql('shard_a', q{SELECT count(*) FROM effects WHERE event_id LIKE 'ev-b%'})
	  + $node->safe_psql('shard_b', q{SELECT count(*) FROM effects WHERE event_id LIKE 'ev-b%'}),
	40, 'each event of the batch applied once');
is($r->{doubled}, 0, '0 doubled');

# ---- 4. partition 1 moves to database shard_b2 under a write freeze ----
my $clients = start_clients(2, $EVENTS + 1, 2 * $EVENTS, 'router', 'during-move');
$node->safe_psql('shard_b', q{SELECT idem_shard_configure(2, '{1}', frozen => true)});
my $frozen_at = $node->safe_psql('shard_b', 'SELECT now()');
($ret, $out, $err) = $node->psql('router',
	"\\set VERBOSITY verbose\nSELECT apply_payment($acct_b, 'ev-frozen', 1)");
like($err, qr/ERROR:  IK007: .*\[shard_b\] REMOTE ERROR: database "shard_b" is frozen/,
	'during the freeze calls for partition 1 get IK007 through the router');
my $dump = $node->basedir . '/shard_b.dump';
$node->command_ok([ 'pg_dump', '-Fc', '-f', $dump, '-d', connstr('shard_b') ], 'pg_dump of partition 1');
$node->safe_psql('postgres', 'CREATE DATABASE shard_b2');
$node->command_ok([ 'pg_restore', '--exit-on-error', '-d', connstr('shard_b2'), $dump ],
	'pg_restore as database shard_b2 (another server in real life)');
is($node->safe_psql('shard_b2', 'SELECT partitions || owned::text || frozen FROM idempotency.shard_ownership'),
	'2{1}true', 'the ownership record travelled with the claims, still frozen');
$node->safe_psql('router', sprintf(q{ALTER SERVER idem OPTIONS (SET p1 '%s')}, connstr('shard_b2')));
$node->safe_psql('shard_b2', q{SELECT idem_shard_configure(2, '{1}')});
$node->safe_psql('shard_b', q{SELECT idem_shard_configure(2, '{}')});
($ret, $out, $err) = $node->psql('shard_b',
	"\\set VERBOSITY verbose\nSELECT apply_payment($acct_b, 'ev-stale', 1)");
like($err, qr/ERROR:  IK006: .*which database "shard_b" does not own/,
	'the old copy gave partition 1 up: a stale router gets IK006');
my ($during, $during_errors) = finish_clients($clients);
note("deliveries during the move: $during applied, errors: "
	  . join(', ', map { "$_ x$during_errors->{$_}" } sort keys %$during_errors));
ok(!grep({ $_ ne 'IK007' && $_ ne 'IK006' } keys %$during_errors),
	'deliveries during the move failed only with IK007 (frozen) or IK006 (old copy)');
is($node->safe_psql('shard_b', "SELECT count(*) FROM effects WHERE applied_at > '$frozen_at'"),
	'0', 'no effect on the old copy after the freeze');
# redeliver everything, concurrently
($applied, $errors) = finish_clients(start_clients(4, 1, 2 * $EVENTS, 'router', 'after-move'));
is_deeply($errors, {}, 'after the move every delivery succeeds');
$r = effects(2 * $EVENTS, 'shard_a', 'shard_b2');
is("$r->{doubled}/$r->{lost}/$r->{wrong}", '0/0/0',
	"after the move and a full redelivery: 0 doubled, 0 lost, 0 misplaced ($r->{per_shard})");
is($node->safe_psql('router', q{SELECT string_agg(database || owned::text, ' ' ORDER BY database) FROM idem_shards.ownership()}),
	'shard_a{0} shard_b2{1}', 'the router now reaches shard_a and shard_b2');

# ---- 5. the outbox, relayed from both shards ----
my (%relayed, $dup_relayed);
my $relayed_n = 0;
for my $db (qw(shard_a shard_b2))
{
	for my $round (1 .. 100)
	{
		my $rows = $node->safe_psql($db, q{
			CREATE TEMP TABLE batch AS SELECT * FROM idem_outbox_claim(10000, '1 minute');
			SELECT b.payload->>'event_id' FROM batch b;
			SELECT idem_outbox_ack(array_agg(id)) FROM batch HAVING count(*) > 0;});
		last if $rows eq '';
		my @rows = split /\n/, $rows;
		pop @rows;    # the ack's count
		for (@rows) { $dup_relayed++ if $relayed{$_}++; $relayed_n++; }
	}
}
my $effects_n = $node->safe_psql('shard_a', 'SELECT count(*) FROM effects')
  + $node->safe_psql('shard_b2', 'SELECT count(*) FROM effects');
is($relayed_n, $effects_n, "relayed from both shards: $relayed_n follow-up events, one per effect");
is($dup_relayed // 0, 0, '... none twice');
is($node->safe_psql('shard_a', q{SELECT count(*) FROM idem_outbox_claim(100, '1 minute')})
	  + $node->safe_psql('shard_b2', q{SELECT count(*) FROM idem_outbox_claim(100, '1 minute')}),
	0, 'nothing left to relay');

# ---- 6. hostile names: the printed DDL is applied as printed ----
# a shard database whose name would end the comment the DDL used to start with
my $evil_db = "shard_x\nCREATE ROLE idem_evil_db SUPERUSER;\n--";
$node->safe_psql('postgres', qq{CREATE DATABASE "$evil_db"});
$node->safe_psql($evil_db, $shard_sql);
my $evil_ddl = $node->safe_psql($evil_db, q{
	SELECT idem_shard_router_ddl('apply_payment(bigint, text, integer)', 'account_id::text')
	    || idem_shard_router_admin_ddl()});
unlike($evil_ddl, qr/shard_x|evil/, 'the database name is nowhere in the printed DDL');
$node->safe_psql('router', $evil_ddl);
# a handler with $plproxy$ and quotes in its name, a mixed-case split
# argument, a cluster named with $plproxy$, and a routing key whose literal
# holds ; -- and $plproxy$ (the handler passes the same text)
my $hostile_sql = q{
	CREATE FUNCTION "pay$plproxy$""'"(account_ids bigint[], "eventIds" text[])
	    RETURNS SETOF text LANGUAGE plpgsql AS $$
	BEGIN
	    FOR i IN 1 .. cardinality("eventIds") LOOP
	        IF idem_claim_routed(account_ids[i]::text || ';--$plproxy$', "eventIds"[i], 'hostile') THEN
	            RETURN NEXT "eventIds"[i];
	        END IF;
	    END LOOP;
	END $$;
};
$node->safe_psql($_, $hostile_sql) for qw(shard_a shard_b2);
my $hostile_ddl = $node->safe_psql('shard_a', q{
	SELECT idem_shard_router_ddl('"pay$plproxy$""''"(bigint[], text[])', 'account_ids::text || '';--$plproxy$''',
	                             cluster => 'idem$plproxy$', split => '{account_ids, eventIds}')});
like($hostile_ddl, qr/^AS \$plproxy_1\$$/m, 'the body is quoted with a tag it does not contain');
like($hostile_ddl, qr/^    SPLIT account_ids, \$2;$/m, 'the mixed-case split argument goes by position');
$node->safe_psql('router', sprintf(q{
	CREATE SERVER "idem$plproxy$" FOREIGN DATA WRAPPER plproxy OPTIONS (p0 '%s', p1 '%s');
	CREATE USER MAPPING FOR PUBLIC SERVER "idem$plproxy$";
	%s}, connstr('shard_a'), connstr('shard_b2'), $hostile_ddl));
is($node->safe_psql('router', q{SELECT count(*) FROM pg_roles WHERE rolname LIKE 'idem\_evil%'}),
	'0', 'applying the printed DDL ran no other statement');
my $batch_call = sprintf(q{SELECT count(*) FROM "pay$plproxy$""'"('{%s}', '{%s}')},
	join(',', map { ($_, $_) } (1 .. 20)), join(',', map { ("h-$_-1", "h-$_-2") } (1 .. 20)));
is($node->safe_psql('router', $batch_call), '40',
	'40 events of 20 accounts split through the hostile proxy: all applied, none misrouted');
is($node->safe_psql('router', $batch_call), '0', '... and redelivered: none again');
is($node->safe_psql('shard_a', q{SELECT count(*) FROM idempotency.claims WHERE scope = 'hostile'})
	  + $node->safe_psql('shard_b2', q{SELECT count(*) FROM idempotency.claims WHERE scope = 'hostile'}),
	40, 'each claimed once, on the shard that owns its routing key');

done_testing();
