# Packaging, without a server: META.json (PGXN) agrees with the control
# file, the released install scripts are unchanged, every earlier version has
# a chain of upgrade scripts to the current one, and no install or upgrade
# script sits where pg_regress would take it for a regression test.
use strict;
use warnings;

use Digest::SHA qw(sha256_hex);
use File::Basename qw(dirname);
use JSON::PP;
use Test::More;

my $root = dirname(__FILE__) . '/../..';

sub slurp
{
	my ($path) = @_;
	open(my $fh, '<', "$root/$path") or die "cannot read $path: $!";
	local $/;
	my $text = <$fh>;
	close $fh;
	return $text;
}

# --- the control file
my $control = slurp('idempotency.control');
my ($default_version) = $control =~ /^\s*default_version\s*=\s*'([^']*)'/m;
ok(defined $default_version, "default_version in idempotency.control: $default_version");
# PGXN needs semantic versions (1.1.0); the extension's are major.minor (1.1)
(my $semver = $default_version) =~ s/^(\d+\.\d+)$/$1.0/;

# --- META.json
my $meta = eval { decode_json(slurp('META.json')) };
ok($meta, 'META.json is valid JSON') or diag($@);
$meta //= {};
is($meta->{name}, 'idempotency', 'META.json: name');
is($meta->{version}, $semver,
	"META.json: version $semver matches default_version $default_version");
is($meta->{provides}{idempotency}{version}, $semver,
	'META.json: provides idempotency at the same version');
foreach my $key (qw(file docfile))
{
	my $f = $meta->{provides}{idempotency}{$key} // '(none)';
	ok(-f "$root/$f", "META.json: provides.idempotency.$key $f exists");
}
is($meta->{license}, 'postgresql', 'META.json: license postgresql');
like($meta->{prereqs}{runtime}{requires}{PostgreSQL} // '', qr/15\.0\.0/,
	'META.json: requires PostgreSQL 15');
ok($meta->{abstract} && $meta->{'meta-spec'}{version} && $meta->{resources},
	'META.json: abstract, meta-spec and resources');

# --- LICENSE and CHANGELOG.md
like(slurp('LICENSE'), qr/PostgreSQL License.*Copyright \(c\) \d{4}(-\d{4})?, the idempotency developers/s,
	'LICENSE: PostgreSQL licence of the idempotency developers');
like(slurp('CHANGELOG.md'), qr/^## \Q$default_version\E\b/m,
	"CHANGELOG.md has a section for $default_version");

# --- install and upgrade scripts
# Released scripts (install and update) are frozen in sql/released/; the
# current version's install script and its updates are built into sql/ from
# sql/tables/, sql/functions/, sql/init.sql and the hand-written parts in
# sql/updates/ (doc/development.md, "The SQL scripts").
sub scripts_in
{
	my ($dir) = @_;
	opendir(my $dh, "$root/$dir") or die "$dir: $!";
	my @found = sort grep { /^idempotency--.*\.sql$/ } readdir $dh;
	closedir $dh;
	return @found;
}
my @released_scripts = scripts_in('sql/released');
my @updates = scripts_in('sql/updates');
my @scripts = sort(@released_scripts, @updates);
my @installs = map { /^idempotency--([^-]+)\.sql$/ ? $1 : () } @released_scripts;
my %upgrades;    # from => [to, ...]
foreach (@scripts)
{
	push @{ $upgrades{$1} }, $2 if /^idempotency--([^-]+)--([^-]+)\.sql$/;
}
ok(scalar(grep { $_ eq '1.0' } @installs), 'the 1.0 install script is kept');
ok(!grep({ $_ eq $default_version } @installs),
	"$default_version is built, not frozen in sql/released");
my %is_released = map { $_ => 1 } @released_scripts;
is(join(' ', grep { !/^idempotency--[^-]+--\Q$default_version\E\.sql$/ || $is_released{$_} } @updates), '',
	"sql/updates/ holds only unreleased updates to $default_version");

# Released scripts never change: a database made by one must stay what the
# upgrade scripts expect.  Add each release's scripts here when they are
# frozen (doc/development.md, "Releasing a version").
my %released = (
	'idempotency--1.0.sql' => '7409f463cecf751a7e4679ea10e948f0e1a818049ba22aa847848466f99cd2b7',
);
foreach my $f (sort keys %released)
{
	is(sha256_hex(slurp("sql/released/$f")), $released{$f}, "released script $f unchanged");
}
is(join(' ', grep { !$released{$_} } @released_scripts), '',
	'every script in sql/released/ has its hash here');

# every earlier version reaches the current one through upgrade scripts
foreach my $v (@installs)
{
	my %seen = ($v => 1);
	my @todo = ($v);
	while (my $x = shift @todo)
	{
		foreach my $y (@{ $upgrades{$x} // [] })
		{
			push @todo, $y unless $seen{$y}++;
		}
	}
	ok($seen{$default_version}, "an upgrade path leads from $v to $default_version");
}

foreach my $f (grep { /--.*--/ } @scripts)
{
	my ($to) = $f =~ /--([^-]+)\.sql$/;
	my $dir = $is_released{$f} ? 'sql/released' : 'sql/updates';
	like(slurp("$dir/$f"),
		qr/\A\\echo Use "ALTER EXTENSION idempotency UPDATE TO '\Q$to\E'" to load this file\. \\quit\n/,
		"$dir/$f starts with its \\echo guard");
}

# sql/functions/ is run again by every update, so it holds only statements
# that can run twice; sql/tables/ runs once, in the install and in the
# update that first has the file, so it holds nothing an update would need
# again (a function, view, trigger, comment or grant changed there would
# never reach an updated database).  A statement starts at the start of a
# line (what the install script's sed relies on too).
sub lines_of_dir
{
	my ($dir) = @_;
	opendir(my $dh, "$root/$dir") or die "$dir: $!";
	my @files = sort grep { /\.sql$/ } readdir $dh;
	closedir $dh;
	my @lines;
	foreach my $f (@files)
	{
		my $n = 0;
		push @lines, map { ++$n; "$dir/$f:$n: $_" } split /\n/, slurp("$dir/$f");
	}
	return @lines;
}
my @functions = lines_of_dir('sql/functions');
my @tables = lines_of_dir('sql/tables');
ok(scalar(@functions) && scalar(@tables), 'sql/functions/ and sql/tables/ have files');
my @not_rerunnable = grep {
	my ($l) = /^[^ ]+: (.*)$/;
	($l =~ /^CREATE\b/ && $l !~ /^CREATE OR REPLACE (FUNCTION|VIEW|TRIGGER) /)
	  || ($l =~ /^ALTER\b/ && $l !~ /^ALTER TABLE \S+ ENABLE ALWAYS TRIGGER \w+;$/)
	  || $l =~ /^(DROP|INSERT|UPDATE|DELETE|TRUNCATE|DO)\b/
	  || $l =~ /pg_extension_config_dump|^\\echo/
} @functions;
is(join("\n", @not_rerunnable), '', 'sql/functions/ can be run again (CREATE OR REPLACE only)');
my @rerunnable_in_tables = grep {
	my ($l) = /^[^ ]+: (.*)$/;
	$l =~ /^(CREATE (OR REPLACE )?(FUNCTION|PROCEDURE|AGGREGATE|VIEW|TRIGGER)|COMMENT|GRANT|REVOKE)\b/
} @tables;
is(join("\n", @rerunnable_in_tables), '',
	'sql/tables/ holds no function, view, trigger, comment or grant (they go in sql/functions/)');

# The built scripts (test/run-tests builds before it runs this file)
my $install = "sql/idempotency--$default_version.sql";
SKIP:
{
	skip "$install is not built (make)", 3 unless -f "$root/$install";
	my $text = slurp($install);
	like($text, qr/\A(?:--[^\n]*\n|\n)*\\echo Use "CREATE EXTENSION idempotency" to load this file\. \\quit\n/,
		"$install starts with its \\echo guard");
	my @replace = grep { /^CREATE OR REPLACE / } split /\n/, $text;
	is("@replace", '', "$install takes over nothing (no CREATE OR REPLACE)");
	my $creates = () = $text =~ /^CREATE (?:FUNCTION|VIEW|TRIGGER) /mg;
	my $sources = grep { /^[^ ]+: CREATE OR REPLACE (FUNCTION|VIEW|TRIGGER) / } @functions;
	is($creates, $sources, "$install creates each function, view and trigger of sql/functions/");
}
foreach my $f (@updates)
{
	SKIP:
	{
		skip "sql/$f is not built (make)", 1 unless -f "$root/sql/$f";
		my $text = slurp("sql/$f");
		my @missing = grep { index($text, slurp("sql/functions/$_")) < 0 }
		  map { m{^sql/functions/([^:]+):} ? $1 : () } @functions;
		my %seen;
		is(join(' ', grep { !$seen{$_}++ } @missing), '', "sql/$f runs every sql/functions/ file as written");
	}
}

# pg_regress (Makefile REGRESS, test/run-tests) takes the sql/*.sql it finds:
# none but the built scripts may be there, and those it is told to skip
my %built = ("idempotency--$default_version.sql" => 1, map { $_ => 1 } @updates);
is(join(' ', grep { !$built{$_} } scripts_in('sql')), '',
	'no install or upgrade script in sql/ but the built ones (a stale one would run as a regression test)');

done_testing();
