# What the idem-relay TAP tests (09x_relay_*.pl) share: a node with the
# extension and a relay role (relay_node; the role's rights are set up in
# relay_role only), emitters with rollbacks (start_emitters), the relay
# started, killed with SIGKILL and stopped with SIGTERM (start_relay,
# kill_relay, stop_relay), a broker binary found or the test skipped
# (need_binary: a skip only without CI=true), free loopback ports, and the
# checks every sink's test makes of what arrived (check_arrivals).
#
# An arrival is a hash {id, aggregate_type, aggregate_id, seq}, in the order
# the broker (or the reader) got them.
package RelayTest;

use strict;
use warnings;

use Exporter 'import';
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep time);
use IdemTest;

our @EXPORT = qw(relay_node relay_role need_binary free_port start_emitters
  stop_emitters start_relay kill_relay stop_relay wait_until check_arrivals
  emit_poison http_get relay_connstr drain_and_dead_letter);

# skip the whole test if $bin is not on PATH, unless CI=true (then fail)
sub need_binary
{
	my ($bin) = @_;
	my $found = grep { -x "$_/$bin" } split /:/, ($ENV{PATH} // ''), -1;
	$found ||= -x $bin;
	return if $found;
	BAIL_OUT("$bin not found on PATH (CI=true: a missing broker is a failure)")
	  if ($ENV{CI} // '') eq 'true';
	plan skip_all => "$bin not found on PATH (install it: test/lib.sh IDEM_PACKAGES)";
}

sub free_port { return PostgreSQL::Test::Cluster::get_free_port(); }

# The relay's role gets its rights here and nowhere else.
sub relay_role
{
	my ($node, $db) = @_;
	$node->safe_psql($db, q{
CREATE ROLE relay LOGIN;
SELECT idem_grant('relay', 'relay');
-- a poison event ends in dead letters soon, and its aggregate is skipped
ALTER ROLE relay SET idempotency.outbox_max_attempts = 3;
ALTER ROLE relay SET idempotency.outbox_dead_policy = 'skip';
});
	return;
}

sub relay_connstr
{
	my ($node, $db) = @_;
	return $node->connstr($db) . ' user=relay';
}

# a node with the extension, the relay role and the table of committed emits
sub relay_node
{
	my ($name) = @_;
	my $node = idem_node($name, conf => "max_connections = 40\nfsync = off");
	$node->safe_psql('postgres', q{
CREATE EXTENSION idempotency;
-- what committed emits returned (written in the emitting transaction)
CREATE TABLE emitted (id uuid PRIMARY KEY, aggregate_type text NOT NULL,
                      aggregate_id text NOT NULL, seq bigint NOT NULL);
});
	relay_role($node, 'postgres');
	return $node;
}

# pgbench emitters: 2 clients, at most $rate transactions/s in all, 20 % of
# them rolled back, 1-3 events per transaction to 30 aggregates of type
# 'load'; returns the harness
sub start_emitters
{
	my ($node, $rate) = @_;
	my $tmp = PostgreSQL::Test::Utils::tempdir();
	open my $fh, '>', "$tmp/emit.sql" or die;
	print $fh q{
\set a random(1, 30)
\set n random(1, 3)
\set r random(1, 100)
BEGIN;
INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM generate_series(1, :n) g,
       LATERAL idem_outbox_emit('load', 'a' || :a, 'ev', jsonb_build_object('g', g, 'r', :r)) e;
\if :r <= 20
ROLLBACK;
\else
COMMIT;
\endif
};
	close $fh;
	my $out = '';
	my $h = IPC::Run::start(
		[
			'pgbench', '-n', '-h', $node->host, '-p', $node->port,
			'-c', '2', '-R', $rate, '-T', '600', '-f', "$tmp/emit.sql", 'postgres'
		],
		'>&', \$out);
	return $h;
}

sub stop_emitters { my ($h) = @_; $h->kill_kill; return; }

# every relay started, killed at the end if still running (a test that
# dies leaves none behind)
my @relays;
END { local $?; $_->{h}->kill_kill for grep { $_->{h}->pumpable } @relays; }

# idem-relay with @args (besides -d, --listen, --poll, --lease and
# --metrics-listen), stdout appended to $out (a file), stderr to $out.err;
# returns {h, port}
sub start_relay
{
	my ($node, $out, @args) = @_;
	my $mport = free_port();
	my $h = IPC::Run::start(
		[
			'idem-relay', '-d', relay_connstr($node, 'postgres'), '--listen',
			'--poll', '0.5', '--lease', '3', '--timeout', '1', '--batch', '20',
			'--metrics-listen', "127.0.0.1:$mport", @args
		],
		'<', \undef, '>>', $out, '2>>', "$out.err");
	push @relays, { h => $h, port => $mport };
	return $relays[-1];
}

sub kill_relay
{
	my ($r) = @_;
	$r->{h}->signal('KILL');
	$r->{h}->finish;
	return;
}

# SIGTERM; true if it exited 0 within 30 s
sub stop_relay
{
	my ($r) = @_;
	$r->{h}->signal('TERM');
	my $t0 = time;
	while ($r->{h}->pumpable && time - $t0 < 30) { usleep(100_000); $r->{h}->pump_nb; }
	$r->{h}->finish if !$r->{h}->pumpable;
	return !$r->{h}->pumpable && $r->{h}->result == 0;
}

# poll $cond (a sub) every 0.2 s for up to $secs; its last value
sub wait_until
{
	my ($secs, $cond) = @_;
	my $t0 = time;
	my $v;
	while (!($v = $cond->()) && time - $t0 < $secs) { usleep(200_000); }
	return $v;
}

# a poison event: aggregate type $type, which the sink always refuses, then
# one event to ('load', 'after-poison') that must still flow.
sub emit_poison
{
	my ($node, $type) = @_;
	$node->safe_psql('postgres', qq{
INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM idem_outbox_emit('$type', 'p1', 'ev', '{}') e;
INSERT INTO emitted SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
  FROM idem_outbox_emit('load', 'after-poison', 'ev', '{}') e;
});
	return;
}

# After the run: stop the emitters, wait until every committed event (but
# the poison ones) is among what $arrivals (a sub returning the list so
# far) has seen, "all N committed events $where", and until the poison
# event of type 'poison' is dead-lettered.  Returns the number of events.
sub drain_and_dead_letter
{
	my ($node, $emitters, $arrivals, $where) = @_;
	stop_emitters($emitters);
	my $total = $node->safe_psql('postgres',
		q{SELECT count(*) FROM emitted WHERE aggregate_type <> 'poison'});
	ok( wait_until(90, sub {
			my %s = map { $_->{id} => 1 } @{ $arrivals->() };
			scalar(keys %s) >= $total }),
		"all $total committed events $where");
	ok( wait_until(30, sub {
			$node->safe_psql('postgres',
				q{SELECT count(*) FROM idempotency.outbox_dead WHERE aggregate_type = 'poison'}) eq '1' }),
		'the poison event is dead-lettered');
	return $total;
}

# GET http://127.0.0.1:$port$path; the body, '' on failure
sub http_get
{
	my ($port, $path) = @_;
	require IO::Socket::INET;
	my $s = IO::Socket::INET->new(PeerAddr => '127.0.0.1', PeerPort => $port, Timeout => 5)
	  or return '';
	print $s "GET $path HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
	local $/;
	my $resp = <$s> // '';
	close $s;
	$resp =~ s/^.*?\r\n\r\n//s;
	return $resp;
}

# The checks of what arrived ($arrivals: list of hashes, in arrival order)
# against table emitted, except events of aggregate type $poison (must be
# dead-lettered instead, if defined).  $max_dups: the most duplicates
# allowed (lost acks); prints the count.  Returns the duplicate count.
sub check_arrivals
{
	my ($node, $arrivals, %opt) = @_;
	my $poison = $opt{poison};
	my %committed;
	foreach my $row (split /\n/,
		$node->safe_psql('postgres', 'SELECT id, aggregate_type, aggregate_id, seq FROM emitted'))
	{
		my ($id, $t, $a, $s) = split /\|/, $row;
		$committed{$id} = { aggregate_type => $t, aggregate_id => $a, seq => $s };
	}
	my (%seen, $dups, @foreign, %last_first, @disorder);
	$dups = 0;
	foreach my $e (@$arrivals)
	{
		if (!exists $committed{ $e->{id} }) { push @foreign, $e->{id}; next; }
		if ($seen{ $e->{id} }++) { $dups++; next; }
		my $agg = "$e->{aggregate_type}:$e->{aggregate_id}";
		push @disorder, "$agg seq $e->{seq} after " . ($last_first{$agg} // 0)
		  if ($last_first{$agg} // 0) + 1 != $e->{seq};
		$last_first{$agg} = $e->{seq};
	}
	my @missing = grep {
		!$seen{$_} && !(defined $poison && $committed{$_}{aggregate_type} eq $poison)
	} keys %committed;
	my $n = scalar(keys %committed);
	cmp_ok($n, '>', 100, "emitters committed $n events (and rolled some back)");
	is(scalar(@missing), 0, 'every committed event arrived')
	  or diag('missing: ' . join(' ', (sort @missing)[ 0 .. ($#missing < 9 ? $#missing : 9) ]));
	is(scalar(@foreign), 0, 'nothing arrived that was not committed (rolled back)')
	  or diag("foreign: @foreign[0 .. ($#foreign < 9 ? $#foreign : 9)]");
	is(scalar(@disorder), 0, 'per aggregate, first arrivals are in seq order with no gap')
	  or diag(join("\n", @disorder[ 0 .. ($#disorder < 9 ? $#disorder : 9) ]));
	note("duplicates (redeliveries after a lost ack): $dups of " . scalar(@$arrivals) . ' arrivals');
	cmp_ok($dups, '<=', $opt{max_dups}, "duplicates ($dups) at most $opt{max_dups}")
	  if defined $opt{max_dups};
	if (defined $poison)
	{
		is(scalar(grep { $_->{aggregate_type} eq $poison } @$arrivals), 0,
			"the poison event ($poison) never arrived");
		is( $node->safe_psql('postgres',
				"SELECT count(*) FROM idempotency.outbox_dead WHERE aggregate_type = '$poison'"),
			'1', 'the poison event is in dead letters');
		ok($seen{ (grep { $committed{$_}{aggregate_id} eq 'after-poison' } keys %committed)[0] },
			'an event emitted after the poison one arrived (skip: no stall)');
	}
	return $dups;
}

1;
