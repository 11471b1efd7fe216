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
my @scripts;
foreach my $dir (qw(sql/released sql/updates))
{
	opendir(my $dh, "$root/$dir") or die "$dir: $!";
	push @scripts, grep { /^idempotency--.*\.sql$/ } readdir $dh;
	closedir $dh;
}
@scripts = sort @scripts;
my @installs = map { /^idempotency--([^-]+)\.sql$/ ? $1 : () } @scripts;
my %upgrades;    # from => [to, ...]
foreach (@scripts)
{
	push @{ $upgrades{$1} }, $2 if /^idempotency--([^-]+)--([^-]+)\.sql$/;
}
ok(scalar(grep { $_ eq '1.0' } @installs), 'the 1.0 install script is kept');
ok(!grep({ $_ eq $default_version } @installs),
	"$default_version is built from sql/functions, not frozen in sql/released");

# Released scripts never change: a database made by one must stay what the
# upgrade scripts expect.  Add each release's script here when it is frozen.
my %released = (
	'idempotency--1.0.sql' => '7409f463cecf751a7e4679ea10e948f0e1a818049ba22aa847848466f99cd2b7',
);
foreach my $f (sort keys %released)
{
	is(sha256_hex(slurp("sql/released/$f")), $released{$f}, "released script $f unchanged");
}

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
	my $dir = -f "$root/sql/released/$f" ? 'sql/released' : 'sql/updates';
	like(slurp("$dir/$f"),
		qr/\A\\echo Use "ALTER EXTENSION idempotency UPDATE TO '\Q$to\E'" to load this file\. \\quit\n/,
		"$f starts with its \\echo guard");
}

# pg_regress (Makefile REGRESS, test/run-tests) takes every sql/*.sql
opendir(my $dh, "$root/sql") or die "sql: $!";
my @stray = grep { /^idempotency--.*\.sql$/ } readdir $dh;
closedir $dh;
is("@stray", '', 'no install or upgrade script in sql/ (it would run as a regression test)');

done_testing();
