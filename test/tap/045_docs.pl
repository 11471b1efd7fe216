# Docs that run: every ```sql block of README.md, doc/*.md and
# examples/*/README.md runs, file by
# file and in order, on a fresh server (pg_cron preloaded, its database
# postgres) as the role it names, and fails the test on any error it does
# not announce.  The annotation is an HTML comment on the line right before
# the fence (doc/development.md, "Docs that run"):
#
#   <!-- doc-test: role=superuser -->     run as the bootstrap superuser
#   <!-- doc-test: role=maint -->         run as role maint (LOGIN)
#   <!-- doc-test: expect-error=42501 --> every error of the block has this
#                                         SQLSTATE (or 25P02 after it), and
#                                         there is at least one
#   <!-- doc-test: skip: reason -->       not run (reason required)
#   <!-- doc-test: setup role=... (no -->: a hidden block: the comment
#                                         opened holds the fence, and closes
#                                         with --> on the line after it;
#                                         "check" instead of "setup" for a
#                                         hidden block that tests the text
#
# A block that names no role runs as role app.  A line "-- as maint" or
# "-- as a superuser: ..." (the whole line, at the start of a statement)
# runs the rest of its block as that role, so a block that mixes roles says
# so where a reader sees it.  README.md starts on a bare
# database (its quick start creates the extension and the role app); each
# doc/*.md starts on a database with the extension created and a login role
# app with no rights of its own; an example's README.md on a database where
# its schema.sql ran as a superuser (its first step), so its blocks name the
# example's roles.  A block runs on the session of the block
# before it when they have the same role (as pasted into one psql), and on a
# new connection (\connect) when the role changes.
#
# A one-line statement whose comment starts with true or false
# ("SELECT idem_claim('k');   -- true: first time") must print exactly that.
#
# Placeholders in blocks are psql variables (:'lease_token'), set by a
# hidden set-up block before them.
use strict;
use warnings;

use File::Basename qw(basename dirname);
use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $root = dirname(__FILE__) . '/../..';
my @files = ("$root/README.md", sort(glob("$root/doc/*.md")), sort(glob("$root/examples/*/README.md")));
# IDEM_DOCS_ONLY=REGEX: only the files whose name matches (while editing)
@files = grep { /$ENV{IDEM_DOCS_ONLY}/ } @files if $ENV{IDEM_DOCS_ONLY};

my %known = map { $_ => 1 } qw(role expect-error skip setup check);

# the blocks of a markdown file: a list of hashes (line: of the first SQL
# line, sql: the lines, role, expect, skip, hidden)
sub blocks
{
	my ($path) = @_;
	open(my $fh, '<', $path) or die "cannot read $path: $!";
	my @lines = <$fh>;
	close $fh;
	chomp @lines;
	my $name =
	    basename(dirname($path)) eq 'doc' ? 'doc/' . basename($path)
	  : basename(dirname(dirname($path))) eq 'examples'
	  ? 'examples/' . basename(dirname($path)) . '/' . basename($path)
	  : basename($path);
	my @blocks;
	for (my $i = 0; $i < @lines; $i++)
	{
		next unless $lines[$i] =~ /^(\s*)```sql\s*$/;
		my $indent = length $1;
		my %b = (file => $name, line => $i + 2, sql => [], role => 'app');
		if ($i > 0 && $lines[ $i - 1 ] =~ /^\s*<!--\s*doc-test:\s*(.*?)\s*(-->)?\s*$/)
		{
			my ($opts, $closed) = ($1, $2);
			$b{hidden} = !$closed;
			if ($opts =~ s/(?:^|\s)skip:\s*(.*)$//)
			{
				$b{skip} = $1;
				die "$name:$i: skip needs a reason\n" if $b{skip} eq '';
			}
			foreach my $opt (split ' ', $opts)
			{
				my ($k, $v) = split /=/, $opt, 2;
				die "$name:$i: unknown doc-test option '$k'\n" unless $known{$k};
				$b{role} = $v if $k eq 'role';
				$b{expect} = $v if $k eq 'expect-error';
				$b{setup} = $k if $k eq 'setup' || $k eq 'check';
			}
			die "$name:$i: expect-error needs a SQLSTATE\n"
			  if exists $b{expect} && ($b{expect} // '') !~ /^[0-9A-Z]{5}$/;
			die "$name:$i: a hidden block (the comment holds the fence) must say setup or check\n"
			  if $b{hidden} && !$b{setup};
		}
		my $j = $i + 1;
		for (; $j < @lines && $lines[$j] !~ /^\s*```\s*$/; $j++)
		{
			my $l = $lines[$j];
			$l =~ s/^ {0,$indent}//;
			push @{ $b{sql} }, $l;
		}
		die "$name:" . ($i + 1) . ": unclosed ```sql block\n" if $j >= @lines;
		die "$name:" . ($j + 2) . ": a hidden block's comment must close (-->) right after its fence\n"
		  if $b{hidden} && ($lines[ $j + 1 ] // '') !~ /^\s*-->\s*$/;
		push @blocks, \%b;
		$i = $j;
	}
	return @blocks;
}

my $nblocks = 0;
my $nrun = 0;
my $nchecks = 0;
my @skipped;
foreach my $path (@files)
{
	my @blocks = blocks($path);
	next unless @blocks;
	my $name = $blocks[0]{file};
	$nblocks += @blocks;

	(my $nodename = $name) =~ s/\W/_/g;
	my $node = idem_node(
		"docs_$nodename", conf => q{
shared_preload_libraries = 'pg_cron'
cron.database_name = 'postgres'
max_prepared_transactions = 10
});
	my $super = $node->safe_psql('postgres', 'SELECT current_user');
	if ($name =~ m{^examples/})
	{
		my $schema = dirname($path) . '/schema.sql';
		$node->safe_psql('postgres', "SET client_min_messages = warning;\n" . slurp_file($schema))
		  if -f $schema;
	}
	elsif ($name ne 'README.md')
	{
		$node->safe_psql('postgres', 'CREATE EXTENSION idempotency; CREATE ROLE app LOGIN');
	}

	# the script: each block, with a \connect when the role changes, and
	# markers around the statements whose result is checked; %where maps a
	# script line to its block and the line in the markdown file
	my @script = ('\set VERBOSITY verbose', '\set ON_ERROR_STOP 0');
	my (%where, @checks);
	my $role = $super;
	for my $bi (0 .. $#blocks)
	{
		my $b = $blocks[$bi];
		if (defined $b->{skip})
		{
			push @skipped, "$name:$b->{line} ($b->{skip})";
			next;
		}
		$nrun++;
		my $connect = sub {
			my ($r, $line) = @_;
			my $want = $r eq 'superuser' ? $super : $r;
			return if $want eq $role;
			push @script, "\\connect - $want";
			$where{ scalar @script } = [ $bi, $line ];
			$role = $want;
		};
		$connect->($b->{role}, $b->{line});
		my $depth = 0;    # inside $$ ... $$
		my $start = 1;    # the line starts a statement
		for my $li (0 .. $#{ $b->{sql} })
		{
			my $l = $b->{sql}[$li];
			my $check;
			# "-- as maint", "-- as a superuser: ...": the rest of the block
			# runs as that role
			if ($start && !$depth && $l =~ /^--\s+as\s+(a superuser|(?!(?:the|an?)\b)[a-z_]\w*)\s*(?:[:,(].*)?$/)
			{
				$connect->($1 eq 'a superuser' ? 'superuser' : $1, $b->{line} + $li);
			}
			if ($start && !$depth && $l =~ /^\s*[^-\s].*;\s*--\s*(true|false)\b/)
			{
				$check = $1 eq 'true' ? 't' : 'f';
				push @checks, [ $bi, $b->{line} + $li, $check ];
				push @script, "\\echo '\@\@check $#checks'";
			}
			push @script, $l;
			$where{ scalar @script } = [ $bi, $b->{line} + $li ];
			push @script, "\\echo '\@\@end $#checks'" if defined $check;
			my $code = $l =~ s/--.*$//r;
			$depth ^= 1 for $code =~ /\$\$/g;
			$start = 1 if !$depth && $code =~ /;\s*$/;
			$start = 0 if !$depth && $code =~ /\S/ && $code !~ /;\s*$/;
		}
		# the block was reached (psql stops at a failed \connect)
		push @script, "\\echo '\@\@ran $bi'";
	}
	my ($stdout, $stderr);
	# kept beside the logs, to read when a block fails
	my $file = "${PostgreSQL::Test::Utils::tmp_check}/docs_$nodename.sql";
	open(my $out, '>', $file) or die "cannot write $file: $!";
	print $out join("\n", @script), "\n";
	close $out;
	my $rc = $node->psql(
		'postgres', join("\n", @script) . "\n",
		stdout => \$stdout,
		stderr => \$stderr,
		on_error_stop => 0);

	# the errors of each block: psql:FILE:LINE: ERROR:  SQLSTATE: message
	my %errors;
	my @unplaced;
	foreach my $e (split /\n/, $stderr)
	{
		if ($e =~ /^psql:[^:]*:(\d+): (?:ERROR|FATAL|PANIC|error):\s+(?:([0-9A-Z]{5}): )?(.*)$/)
		{
			my $at = $where{$1};
			if ($at)
			{
				push @{ $errors{ $at->[0] } }, [ $2 // '-----', "$name:$at->[1]: $e" ];
			}
			else
			{
				push @unplaced, $e;
			}
		}
	}
	is(join("\n", @unplaced), '', "$name: no error outside a block");
	is($rc, 0, "$name: psql ran the whole script") or diag($stderr);

	for my $bi (0 .. $#blocks)
	{
		my $b = $blocks[$bi];
		next if defined $b->{skip};
		my @e = @{ $errors{$bi} // [] };
		push @e, [ 'unrun', "$name:$b->{line}: not reached: psql stopped before it" ]
		  unless $stdout =~ /^\@\@ran $bi$/m;
		my $what = "$name:$b->{line} as $b->{role}" . ($b->{setup} ? " (hidden $b->{setup})" : '');
		if (defined $b->{expect})
		{
			my @other = grep { $_->[0] ne $b->{expect} && $_->[0] ne '25P02' } @e;
			ok(@e && !@other, "$what fails with $b->{expect}")
			  or diag(@e ? join("\n", map { $_->[1] } @e) : 'no error');
		}
		else
		{
			ok(!@e, "$what runs") or diag(join("\n", map { $_->[1] } @e));
		}
	}
	for my $ci (0 .. $#checks)
	{
		my ($bi, $line, $want) = @{ $checks[$ci] };
		my ($got) = $stdout =~ /^\@\@check $ci\n(.*?)\@\@end $ci$/ms;
		$got =~ s/\n+$// if defined $got;
		is($got, $want, "$name:$line prints " . ($want eq 't' ? 'true' : 'false'));
		$nchecks++;
	}
	$node->stop;
}

# enough blocks and checks that a broken extractor cannot pass unnoticed
cmp_ok($nblocks, '>=', 35, "$nblocks ```sql blocks in README.md and doc/*.md");
cmp_ok($nchecks, '>=', 2, "$nchecks results checked");
note("skipped: $_") foreach @skipped;
cmp_ok(scalar(@skipped), '<=', 5, scalar(@skipped) . ' blocks skipped, each with its reason');

done_testing();
