# ALTER EXTENSION idempotency UPDATE from every earlier release (each
# idempotency--X.sql installed next to the current version; today 1.0):
# claims (in sealed and open partitions, some with payloads), settings, the
# partition registry with its Bloom filters, and guards on user tables all
# survive and keep working, and the upgraded database has exactly the member
# objects of a fresh install of the current version (definitions, columns,
# constraints, indexes, triggers, ACLs, comments, initial privileges,
# configuration tables), and claim partitions of the same shape.  A failing
# run prints what differs: "- upgraded" lines exist only in the upgraded
# database, "+ fresh" lines only in the fresh install.
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(sleep);
use IdemTest;

my $node = idem_node('upgrade');

my $current = $node->safe_psql('postgres',
	"SELECT default_version FROM pg_available_extensions WHERE name = 'idempotency'");
my @old = split /\n/, $node->safe_psql('postgres', q{
	SELECT version FROM pg_available_extension_versions
	 WHERE name = 'idempotency' AND version <> (
	       SELECT default_version FROM pg_available_extensions WHERE name = 'idempotency')
	 ORDER BY string_to_array(version, '.')::int[]});
ok(scalar(grep { $_ eq '1.0' } @old), "1.0 is installable next to $current")
  or diag("available versions other than $current: @old");

# One line per fact about the extension's member objects.  Lines are
# separated by chr(30), since function definitions span several lines.
my $describe_sql = q{
WITH ext AS (
    SELECT oid, extconfig, extcondition FROM pg_extension WHERE extname = 'idempotency'),
members AS (
    SELECT d.classid, d.objid, d.objsubid
      FROM pg_depend d, ext
     WHERE d.refclassid = 'pg_extension'::regclass AND d.refobjid = ext.oid
       AND d.deptype = 'e'),
rels AS (                         -- member relations and member composite types' relations
    SELECT c.* FROM pg_class c
     WHERE c.oid IN (SELECT objid FROM members WHERE classid = 'pg_class'::regclass)
        OR c.oid IN (SELECT t.typrelid FROM pg_type t JOIN members m
                       ON m.classid = 'pg_type'::regclass AND m.objid = t.oid
                      WHERE t.typtype = 'c')),
procs AS (
    SELECT p.* FROM pg_proc p
     WHERE p.oid IN (SELECT objid FROM members WHERE classid = 'pg_proc'::regclass)),
types AS (
    SELECT t.* FROM pg_type t
     WHERE t.oid IN (SELECT objid FROM members WHERE classid = 'pg_type'::regclass)),
lines(line) AS (
    SELECT 'member: ' || pg_describe_object(classid, objid, objsubid) FROM members
UNION ALL
    SELECT 'comment: ' || pg_describe_object(d.classoid, d.objoid, d.objsubid) || ': ' || d.description
      FROM pg_description d JOIN members m ON d.classoid = m.classid AND d.objoid = m.objid
UNION ALL
    SELECT 'initial privileges: ' || pg_describe_object(i.classoid, i.objoid, i.objsubid)
           || ': ' || i.initprivs::text
      FROM pg_init_privs i JOIN members m ON i.classoid = m.classid AND i.objoid = m.objid
     WHERE i.privtype = 'e'
UNION ALL
    SELECT 'configuration table: ' || c.relid::regclass::text || ' condition '
           || quote_literal(coalesce(c.cond, '(none)'))
      FROM ext, unnest(ext.extconfig, ext.extcondition) AS c(relid, cond)
UNION ALL
    SELECT 'function: ' || p.oid::regprocedure::text || E'\n'
           || CASE WHEN p.prokind = 'a' THEN 'aggregate' ELSE pg_get_functiondef(p.oid) END
      FROM procs p
UNION ALL
    SELECT 'function acl: ' || p.oid::regprocedure::text || ': ' || coalesce(p.proacl::text, 'default')
      FROM procs p
UNION ALL
    SELECT 'schema acl: ' || n.nspname || ': ' || coalesce(n.nspacl::text, 'default')
      FROM pg_namespace n
     WHERE n.oid IN (SELECT objid FROM members WHERE classid = 'pg_namespace'::regclass)
UNION ALL
    SELECT format('relation: %s kind %s persistence %s options %s rls %s/%s replident %s acl %s',
                  r.oid::regclass, r.relkind, r.relpersistence, coalesce(r.reloptions::text, '-'),
                  r.relrowsecurity, r.relforcerowsecurity, r.relreplident,
                  coalesce(r.relacl::text, 'default'))
      FROM rels r
UNION ALL
    SELECT 'view: ' || r.oid::regclass::text || E'\n' || pg_get_viewdef(r.oid, true)
      FROM rels r WHERE r.relkind IN ('v', 'm')
UNION ALL
    SELECT format('column: %s #%s %s %s%s%s%s%s%s acl %s',
                  a.attrelid::regclass,
                  row_number() OVER (PARTITION BY a.attrelid ORDER BY a.attnum),
                  quote_ident(a.attname), format_type(a.atttypid, a.atttypmod),
                  CASE WHEN a.attcollation <> t.typcollation
                       THEN ' COLLATE ' || a.attcollation::regcollation::text ELSE '' END,
                  coalesce(' DEFAULT ' || pg_get_expr(ad.adbin, ad.adrelid), ''),
                  CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END,
                  CASE a.attidentity WHEN '' THEN '' ELSE ' IDENTITY ' || a.attidentity::text END,
                  CASE a.attgenerated WHEN '' THEN '' ELSE ' GENERATED ' || a.attgenerated::text END,
                  coalesce(a.attacl::text, 'default'))
      FROM rels r
      JOIN pg_attribute a ON a.attrelid = r.oid AND a.attnum > 0 AND NOT a.attisdropped
      JOIN pg_type t ON t.oid = a.atttypid
      LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
UNION ALL
    SELECT 'constraint: ' || c.conrelid::regclass::text || ' ' || quote_ident(c.conname) || ': '
           || pg_get_constraintdef(c.oid)
      FROM pg_constraint c WHERE c.conrelid IN (SELECT oid FROM rels)
UNION ALL
    SELECT 'index: ' || pg_get_indexdef(i.indexrelid)
      FROM pg_index i WHERE i.indrelid IN (SELECT oid FROM rels)
UNION ALL
    SELECT 'trigger: ' || pg_get_triggerdef(g.oid) || ' [tgenabled ' || g.tgenabled::text || ']'
      FROM pg_trigger g WHERE g.tgrelid IN (SELECT oid FROM rels) AND NOT g.tgisinternal
UNION ALL
    SELECT 'rule: ' || pg_get_ruledef(w.oid)
      FROM pg_rewrite w WHERE w.ev_class IN (SELECT oid FROM rels) AND w.rulename <> '_RETURN'
UNION ALL
    SELECT format('policy: %s %s %s %s to %s using %s check %s', p.polrelid::regclass,
                  quote_ident(p.polname), p.polcmd, p.polpermissive, p.polroles::regrole[],
                  pg_get_expr(p.polqual, p.polrelid), pg_get_expr(p.polwithcheck, p.polrelid))
      FROM pg_policy p WHERE p.polrelid IN (SELECT oid FROM rels)
UNION ALL
    SELECT format('sequence: %s %s start %s increment %s min %s max %s cache %s cycle %s',
                  s.seqrelid::regclass, s.seqtypid::regtype, s.seqstart, s.seqincrement,
                  s.seqmin, s.seqmax, s.seqcache, s.seqcycle)
      FROM pg_sequence s WHERE s.seqrelid IN (SELECT oid FROM rels)
UNION ALL
    SELECT 'enum: ' || t.oid::regtype::text || ': '
           || (SELECT string_agg(quote_literal(e.enumlabel), ', ' ORDER BY e.enumsortorder)
                 FROM pg_enum e WHERE e.enumtypid = t.oid)
      FROM types t WHERE t.typtype = 'e'
UNION ALL
    SELECT format('domain: %s over %s%s%s', t.oid::regtype, format_type(t.typbasetype, t.typtypmod),
                  CASE WHEN t.typnotnull THEN ' NOT NULL' ELSE '' END,
                  coalesce(' DEFAULT ' || t.typdefault, ''))
      FROM types t WHERE t.typtype = 'd'
UNION ALL
    SELECT 'domain constraint: ' || c.contypid::regtype::text || ' ' || quote_ident(c.conname)
           || ': ' || pg_get_constraintdef(c.oid)
      FROM pg_constraint c WHERE c.contypid IN (SELECT oid FROM types)
UNION ALL
    SELECT 'type acl: ' || t.oid::regtype::text || ': ' || coalesce(t.typacl::text, 'default')
      FROM types t
)
SELECT string_agg(line, chr(30) ORDER BY line COLLATE "C") FROM lines
};

# The shape of every claim partition, its name replaced by P (index names
# contain it): one chr(30)-separated string per distinct shape.
my $partition_shapes_sql = q{
WITH parts AS (
    SELECT i.inhrelid AS relid, c.relname
      FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
     WHERE i.inhparent = 'idempotency.claims'::regclass),
shape AS (
    SELECT p.relid, replace(l.line, p.relname, 'P') AS line
      FROM parts p,
      LATERAL (
          SELECT format('column #%s %s %s%s%s local %s inherited %s', a.attnum,
                        quote_ident(a.attname), format_type(a.atttypid, a.atttypmod),
                        CASE WHEN a.attcollation <> t.typcollation
                             THEN ' COLLATE ' || a.attcollation::regcollation::text ELSE '' END,
                        CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END,
                        a.attislocal, a.attinhcount)
            FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
           WHERE a.attrelid = p.relid AND a.attnum > 0 AND NOT a.attisdropped
          UNION ALL
          SELECT 'index: ' || pg_get_indexdef(x.indexrelid)
            FROM pg_index x WHERE x.indrelid = p.relid
          UNION ALL
          SELECT 'constraint: ' || pg_get_constraintdef(k.oid)
            FROM pg_constraint k WHERE k.conrelid = p.relid
          UNION ALL
          SELECT 'trigger: ' || pg_get_triggerdef(g.oid)
            FROM pg_trigger g WHERE g.tgrelid = p.relid AND NOT g.tgisinternal
          UNION ALL
          SELECT format('relation: kind %s persistence %s options %s acl %s', c.relkind,
                        c.relpersistence, coalesce(c.reloptions::text, '-'),
                        coalesce(c.relacl::text, 'default'))
            FROM pg_class c WHERE c.oid = p.relid
          UNION ALL
          SELECT 'parents: ' || string_agg(i.inhparent::regclass::text, ', ' ORDER BY i.inhseqno)
            FROM pg_inherits i WHERE i.inhrelid = p.relid
      ) l(line)),
shapes AS (
    SELECT relid, string_agg(line, chr(30) ORDER BY line COLLATE "C") AS s
      FROM shape GROUP BY relid)
SELECT DISTINCT s FROM shapes
};

sub lines_of
{
	my ($node, $db, $sql) = @_;
	return split /\x1e/, $node->safe_psql($db, $sql);
}

# differences between two lists of lines, as "- upgraded" / "+ fresh" text
sub difference
{
	my ($upgraded, $fresh) = @_;
	my (%u, %f);
	$u{$_}++ for @$upgraded;
	$f{$_}++ for @$fresh;
	my @d;
	push @d, map { "- upgraded: $_" } grep { !$f{$_} } @$upgraded;
	push @d, map { "+ fresh:    $_" } grep { !$u{$_} } @$fresh;
	return join("\n", @d);
}

# fresh install of the current version
$node->safe_psql('postgres', 'CREATE DATABASE fresh');
$node->safe_psql('fresh', 'CREATE EXTENSION idempotency');
is($node->safe_psql('fresh', "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"),
	$current, "fresh install is $current");
my @fresh = lines_of($node, 'fresh', $describe_sql);
ok(scalar(grep { /^function: .*idem_claim\(text,text,jsonb\)/ } @fresh)
	  && scalar(grep { /^trigger: CREATE TRIGGER registry_changed / } @fresh)
	  && scalar(grep { /^column: idempotency\.claims #2 key text COLLATE "C" NOT NULL/ } @fresh),
	'the description of a fresh install has functions, triggers and columns')
  or diag(join("\n", @fresh));
my @fresh_shapes = split /\n/, $node->safe_psql('fresh', $partition_shapes_sql);

my $n = 0;
foreach my $old (@old)
{
	my $db = 'upgrade_' . ++$n;
	$node->safe_psql('postgres', "CREATE DATABASE $db");

	# --- an $old database in use: settings, sealed partitions, claims, guards
	$node->safe_psql($db, qq{
		CREATE EXTENSION idempotency VERSION '$old';
		SELECT idem_configure(retention => '90 seconds', partition_interval => '1 second', premake => 2);
		-- the partitions CREATE EXTENSION made (of 1 day) expire, so maintenance
		-- makes 1-second ones at once
		UPDATE idempotency.partition_registry
		   SET lower = lower - interval '30 days', upper = upper - interval '30 days';
		SELECT count(*) FROM idem_maintain();
		SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'k' || g FROM generate_series(1, 200) g));
		SELECT idem_claim('pay-1', 'billing', '{"amount": 10, "currency": "EUR"}');
		SELECT idem_claim('pay-2', 'billing', '{"amount": 20}');
	});
	is($node->safe_psql($db, "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"),
		$old, "installed $old");
	# maintenance seals a partition a second after its range has passed (and
	# never the newest one): run rounds until the claims' partition is sealed
	my $sealed_claims_sql = q{
		SELECT count(*) FROM idempotency.claims c
		  JOIN idempotency.partition_registry r ON r.relid = c.tableoid
		 WHERE r.sealed AND r.bloom IS NOT NULL};
	my $actions = '';
	sleep 2;
	foreach my $try (1 .. 40)
	{
		$actions .= $node->safe_psql($db, 'SELECT action FROM idem_maintain()') . "\n";
		last if $node->safe_psql($db, $sealed_claims_sql) > 0;
		sleep 0.5;
	}
	like($actions, qr/^seal$/m, "$old: maintenance sealed partitions");
	ok($node->safe_psql($db, $sealed_claims_sql) > 0,
		"$old: claims in a sealed partition with a Bloom filter");
	$node->safe_psql($db, qq{
		SELECT idem_claim('late-1');
		SELECT idem_claim('pay-3', 'billing', '{"amount": 30}');

		CREATE TABLE accounts (id int PRIMARY KEY, balance int, version int);
		SELECT idem_guard_version('accounts');
		INSERT INTO accounts VALUES (1, 100, 5);

		CREATE TABLE items (id int PRIMARY KEY, name text, seq bigint);
		SELECT idem_guard_version('items', 'seq', on_stale => 'error');
		INSERT INTO items VALUES (1, 'a', 10);

		CREATE TABLE orders (id int PRIMARY KEY, state text);
		SELECT idem_guard_transitions('orders', 'state',
		  '{"pending": ["dispatched", "cancelled"], "dispatched": ["delivered"]}');
		INSERT INTO orders VALUES (1, 'pending'), (2, 'pending');
	});
	ok($node->safe_psql($db, q{
		SELECT count(*) FROM idempotency.claims c
		  JOIN idempotency.partition_registry r ON r.relid = c.tableoid
		 WHERE NOT r.sealed}) > 0,
		"$old: and claims in a partition that still takes claims");

	my $claims_sql = q{
		SELECT count(*), md5(string_agg(concat_ws('|', scope, key, claimed_at, fingerprint, tableoid::regclass),
		                                ',' ORDER BY scope, key))
		  FROM idempotency.claims};
	my $registry_sql = q{
		SELECT string_agg(concat_ws('|', relid, lower, upper, sealed, md5(bloom)), ',' ORDER BY lower)
		  FROM idempotency.partition_registry};
	# roles that claimed and released with 1.0's table grants
	$node->safe_psql($db, qq{
		DO \$\$ BEGIN
		    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'app_claimer') THEN
		        CREATE ROLE app_claimer;
		        CREATE ROLE app_releaser;
		    END IF;
		END \$\$;
		GRANT INSERT, SELECT ON idempotency.claims TO app_claimer;
		GRANT SELECT, DELETE ON idempotency.claims TO app_releaser;
		SET ROLE app_claimer;
		SELECT idem_claim('app-1', 'app');
	});
	my $claims_before = $node->safe_psql($db, $claims_sql);
	my $registry_before = $node->safe_psql($db, $registry_sql);

	# --- the update
	my ($rc, $out, $err) = $node->psql($db, 'ALTER EXTENSION idempotency UPDATE', on_error_die => 1);
	like($err, qr/WARNING:  role app_claimer held INSERT, SELECT on idempotency.claims: granted capability handler/,
		"$old -> $current: the update says what it made of a claimer's table grants");
	like($err, qr/WARNING:  role app_releaser held DELETE, SELECT on idempotency.claims: granted capability operator/,
		"$old -> $current: and of a releaser's");
	is($node->safe_psql($db, q{
		SELECT role || ':' || capability || ':' || coalesce(scopes::text, 'unlimited')
		  FROM idempotency.capability_grants ORDER BY 1}),
		"app_claimer:handler:unlimited\napp_releaser:operator:unlimited",
		"$old -> $current: the roles hold the capabilities, unlimited");
	is($node->safe_psql($db, q{
		SELECT has_table_privilege('app_claimer', 'idempotency.claims', 'INSERT, SELECT, DELETE'),
		       has_table_privilege('app_releaser', 'idempotency.claims', 'INSERT, SELECT, DELETE')}),
		'f|f', "$old -> $current: and no table privilege any more");
	is($node->safe_psql($db, q{
		SET ROLE app_claimer;
		SELECT idem_claim('app-1', 'app'), idem_claim('app-2', 'app');
		SELECT idem_claimed('app-2', 'app') IS NOT NULL}),
		"f|t\nt", "$old -> $current: the claimer goes on claiming");
	is($node->safe_psql($db, q{SET ROLE app_releaser; SELECT idem_release('app-2', 'app')}),
		't', "$old -> $current: the releaser goes on releasing");
	$claims_before = $node->safe_psql($db, $claims_sql);
	is($node->safe_psql($db, "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'"),
		$current, "$old updated to $current");

	# --- contents intact
	is($node->safe_psql($db, $claims_sql), $claims_before, "$old -> $current: claims unchanged");
	# the scope history starts with what the sealed partitions hold
	ok($node->safe_psql($db, 'SELECT sum(claims) FROM idempotency.scope_history') > 0,
		"$old -> $current: scope history filled from the sealed partitions");
	is($node->safe_psql($db,
			q{SELECT string_agg(scope || '=' || claims, ',' ORDER BY scope) FROM idempotency.consumers}),
		$node->safe_psql($db, q{
			SELECT string_agg(scope || '=' || n, ',' ORDER BY scope)
			  FROM (SELECT scope, count(*) AS n FROM idempotency.claims GROUP BY scope) x}),
		"$old -> $current: consumers count every claim once, sealed or not");
	is($node->safe_psql($db, $registry_sql), $registry_before,
		"$old -> $current: partition registry (ranges, sealed, Bloom filters) unchanged");
	is($node->safe_psql($db,
			'SELECT retention, partition_interval, premake FROM idempotency.settings'),
		'00:01:30|00:00:01|2', "$old -> $current: settings intact");

	# --- claims still found
	is($node->safe_psql($db, q{
		SELECT count(*) FILTER (WHERE NOT idem_claim(k)), count(*) FILTER (WHERE idem_claimed(k) IS NOT NULL)
		  FROM (SELECT 'k' || g FROM generate_series(1, 200) g UNION ALL SELECT 'late-1') AS t(k)}),
		'201|201', "$old -> $current: old claims are duplicates and have a claimed_at");
	is($node->safe_psql($db,
			"SELECT count(*) FROM idem_claim_many(ARRAY(SELECT 'k' || g FROM generate_series(1, 210) g))"),
		'10', "$old -> $current: idem_claim_many claims only the new keys");
	is($node->safe_psql($db, q{
		SELECT idem_claim('pay-1', 'billing', '{"currency": "EUR", "amount": 10}'),
		       idem_claim('pay-3', 'billing', '{"amount": 30}'),
		       idem_claim('pay-4', 'billing', '{"amount": 40}')}),
		'f|f|t', "$old -> $current: same payload is a duplicate, a new key is claimed");
	my ($ret, $stdout, $stderr) = $node->psql($db, q{
		\set VERBOSITY verbose
		SELECT idem_claim('pay-2', 'billing', '{"amount": 21}')});
	like($stderr, qr/IK001/, "$old -> $current: a different payload still raises IK001");

	# --- guards still active
	is($node->safe_psql($db, q{
		UPDATE accounts SET balance = 1, version = 4 WHERE id = 1;
		SELECT balance, version, (SELECT stale_skipped FROM idempotency.guard_stats())
		  FROM accounts WHERE id = 1}),
		'100|5|1', "$old -> $current: version guard skips a stale update");
	is($node->safe_psql($db, q{
		UPDATE accounts SET balance = 2, version = 6 WHERE id = 1;
		SELECT balance, version FROM accounts WHERE id = 1}),
		'2|6', "$old -> $current: version guard lets a newer version through");
	($ret, $stdout, $stderr) = $node->psql($db, q{
		\set VERBOSITY verbose
		UPDATE items SET name = 'b', seq = 9 WHERE id = 1});
	like($stderr, qr/IK004/, "$old -> $current: version guard in error mode raises IK004");
	is($node->safe_psql($db, q{
		UPDATE orders SET state = 'delivered' WHERE id = 1;
		SELECT state, (SELECT invalid_skipped FROM idempotency.guard_stats())
		  FROM orders WHERE id = 1}),
		'pending|1', "$old -> $current: transition guard skips an invalid transition");
	is($node->safe_psql($db, q{
		UPDATE orders SET state = 'dispatched' WHERE id = 1;
		SELECT state FROM orders WHERE id = 1}),
		'dispatched', "$old -> $current: transition guard lets a valid transition through");
	is($node->safe_psql($db, q{
		SELECT idem_transition('orders', 2, 'delivered'), idem_transition('orders', 2, 'cancelled'),
		       idem_upsert(ROW(1, 3, 7)::accounts), idem_upsert(ROW(1, 4, 7)::accounts)}),
		'rejected|applied|updated|stale', "$old -> $current: idem_transition and idem_upsert");

	# --- maintenance goes on, over the old partitions and new ones
	sleep 1.5;
	ok($node->safe_psql($db, "SELECT count(*) FROM idem_maintain() WHERE action = 'create'") >= 1,
		"$old -> $current: maintenance creates partitions after the update");
	is($node->safe_psql($db, "SELECT idem_claimed('k1') IS NOT NULL, idem_claim('k1')"),
		't|f', "$old -> $current: claims still found after a maintenance round");

	# --- the same objects as a fresh install
	my @upgraded = lines_of($node, $db, $describe_sql);
	my $diff = difference(\@upgraded, \@fresh);
	ok($diff eq '', "$old -> $current: member objects identical to a fresh install of $current")
	  or diag("differences ($old updated vs fresh $current):\n$diff");

	# --- every partition, old or new, has the shape of a fresh install's
	my @upgraded_shapes = split /\n/, $node->safe_psql($db, $partition_shapes_sql);
	is(scalar(@upgraded_shapes), 1, "$old -> $current: all partitions have one shape")
	  or diag("shapes:\n" . join("\n\n", map { s/\x1e/\n/gr } @upgraded_shapes));
	$diff = difference([ map { split /\x1e/ } @upgraded_shapes ], [ map { split /\x1e/ } @fresh_shapes ]);
	ok($diff eq '', "$old -> $current: partitions shaped like a fresh install's")
	  or diag("differences (partitions of $old updated vs of fresh $current; P is the partition's name):\n$diff");
}

$node->stop;
done_testing();
