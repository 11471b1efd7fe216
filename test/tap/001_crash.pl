# Claims across a crash (pg_ctl stop -m immediate, then start):
# a committed claim survives; a claim whose transaction was still open at the
# crash is gone, so the event it guarded can be claimed and applied again.
use strict;
use warnings;

use IPC::Run;
use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = idem_node('crash', conf => 'synchronous_commit = on');

$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');

# k1: claimed and committed before the crash
is($node->safe_psql('postgres', "SELECT idem_claim('k1')"),
	't', 'k1: first claim is true');
isnt($node->safe_psql('postgres', "SELECT idem_claimed('k1')"),
	'', 'k1: idem_claimed is set after commit');

# k2: claimed in a transaction that is still open at the crash
my ($in, $out, $err) = ('', '', '');
my $timer = IPC::Run::timer($PostgreSQL::Test::Utils::timeout_default);
my $h = IPC::Run::start(
	[
		'psql', '-XAtq', '-v', 'ON_ERROR_STOP=1', '-f', '-',
		'-d', $node->connstr('postgres')
	],
	'<', \$in, '>', \$out, '2>', \$err, $timer);
$in .= "BEGIN;\nSELECT idem_claim('k2');\n\\echo claimed-in-flight\nSELECT pg_sleep(600);\n";
$h->pump until $out =~ /claimed-in-flight/ || $timer->is_expired;
like($out, qr/^t\nclaimed-in-flight/m, 'k2: claimed inside an open transaction');
is($node->safe_psql('postgres', "SELECT idem_claimed('k2') IS NULL"),
	't', 'k2: not visible to others while in flight');

$node->stop('immediate');
$h->kill_kill;
$node->start;

is($node->safe_psql('postgres', "SELECT idem_claimed('k1') IS NOT NULL"),
	't', 'k1: committed claim survives the crash');
is($node->safe_psql('postgres', "SELECT idem_claim('k1')"),
	'f', 'k1: claiming again after the crash is a duplicate');
is($node->safe_psql('postgres', "SELECT idem_claimed('k2')"),
	'', 'k2: in-flight claim is gone after the crash (idem_claimed is NULL)');
is($node->safe_psql('postgres', "SELECT idem_claim('k2')"),
	't', 'k2: can be claimed again after the crash');
is($node->safe_psql('postgres', "SELECT idem_claim('k2')"),
	'f', 'k2: and only once');

$node->stop;
done_testing();
