# doc/reference.md is the only reference: every object of the extension must
# be named there.  With the library preloaded (so that every setting is
# defined), list every member function (public idem_* and internals in
# schema idempotency alike), table, view and composite type of the extension,
# every view of schema idempotency and every idempotency.* setting, and check
# that each name occurs in doc/reference.md: a function as "name(", the
# others as the whole name.  The other way round, every function the page
# calls by name must exist, so a removed or renamed one cannot linger there.
use strict;
use warnings;

use File::Basename qw(dirname);
use Test::More;
use IdemTest;

my $root = dirname(__FILE__) . '/../..';
open(my $fh, '<', "$root/doc/reference.md") or die "cannot read doc/reference.md: $!";
my $reference = do { local $/; <$fh> };
close $fh;

my $node = idem_node('reference', conf => "shared_preload_libraries = 'idempotency'");
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

# name of an object as the reference writes it: schema-qualified in schema
# idempotency, bare in the extension's schema
my $qualify = q{CASE WHEN n.nspname = 'idempotency' THEN 'idempotency.' ELSE '' END};
my $members = q{
	JOIN pg_depend d ON d.objid = o.oid AND d.deptype = 'e'
	JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'idempotency'};

my %kinds = (
	function => qq{
		SELECT DISTINCT $qualify || o.proname FROM pg_proc o
		JOIN pg_namespace n ON n.oid = o.pronamespace $members
		WHERE d.classid = 'pg_proc'::regclass},
	relation => qq{
		SELECT $qualify || o.relname FROM pg_class o
		JOIN pg_namespace n ON n.oid = o.relnamespace $members
		WHERE d.classid = 'pg_class'::regclass AND o.relkind IN ('r', 'p', 'v')
		UNION
		SELECT 'idempotency.' || c.relname FROM pg_class c
		WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind = 'v'},
	type => qq{
		SELECT $qualify || o.typname FROM pg_type o
		JOIN pg_namespace n ON n.oid = o.typnamespace $members
		WHERE d.classid = 'pg_type'::regclass AND o.typtype = 'c'},
	setting => q{SELECT name FROM pg_settings WHERE name LIKE 'idempotency.%'},);

# Enough of each kind that a broken query cannot pass unnoticed.
my %least = (function => 50, relation => 20, type => 3, setting => 15);
my %exists;

foreach my $kind (sort keys %kinds)
{
	my @names = split /\n/, $node->safe_psql('postgres', "$kinds{$kind} ORDER BY 1");
	cmp_ok(scalar(@names), '>=', $least{$kind}, "the extension has at least $least{$kind} ${kind}s");
	my @missing;
	foreach my $name (@names)
	{
		$exists{$kind}{$name} = 1;
		my $pattern =
		  $kind eq 'function'
		  ? qr/(?<![\w.])\Q$name\E\(/
		  : qr/(?<![\w.])\Q$name\E(?![\w(])/;
		push @missing, $name unless $reference =~ $pattern;
	}
	is(join(', ', @missing), '',
		scalar(@names) . " ${kind}s of the extension, each named in doc/reference.md");
}

# every function the reference names in a call exists
my %named;
$named{$1} = 1 while $reference =~ /(?<![\w.])((?:idempotency\.)?idem_\w+|idempotency\.\w+)\(/g;
my @unknown = grep { !$exists{function}{$_} } sort keys %named;
is(join(', ', @unknown), '', 'every function doc/reference.md names exists');

$node->stop;
done_testing();
