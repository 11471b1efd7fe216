# The extension's owner changes under a backend that has cached it
# (src/common/ownership.c keeps it per backend; REASSIGN OWNED moves the
# extension and its schema together, and the schema's invalidation tells
# every backend).  admin1 made the extension and then lost superuser: as
# the owner it holds every capability.  A session of admin1 uses one (the
# owner is cached, and the capability cache decided "owner: all"); another
# session reassigns what admin1 owns; the first session's next call is
# refused (without the invalidation, the cached owner would keep admin1's
# "all" for the backend's life).
use strict;
use warnings;

use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = idem_node('owner');
$node->safe_psql('postgres', q{
	CREATE ROLE admin1 LOGIN SUPERUSER;
	SET ROLE admin1;
	CREATE EXTENSION idempotency;
	RESET ROLE;
	ALTER ROLE admin1 NOSUPERUSER;
	-- a call's SQLSTATE, or ok
	CREATE FUNCTION public.try(sql text) RETURNS text LANGUAGE plpgsql AS $$
	BEGIN
	    EXECUTE sql;
	    RETURN 'ok';
	EXCEPTION WHEN OTHERS THEN
	    RETURN SQLSTATE;
	END $$;
});
is($node->safe_psql('postgres', q{
	SELECT r.rolname FROM pg_extension e JOIN pg_roles r ON r.oid = e.extowner WHERE e.extname = 'idempotency'}),
	'admin1', 'admin1 owns the extension');

my $timer = IPC::Run::timer($PostgreSQL::Test::Utils::timeout_default);
my $s = bg_psql($node, 'postgres', 'admin1', $timer, q{
	SET ROLE admin1;
	SELECT 'first:' || public.try('SELECT idem_release(''k'', ''s'')');
	SELECT 'outbox:' || public.try('SELECT idem_outbox_subscribe(''audit'')');
}, 'm1');
like($s->{out}, qr/first:ok/, 'as the owner, admin1 may release (the operator capability)');
like($s->{out}, qr/outbox:ok/, '... and subscribe');

$node->safe_psql('postgres', 'REASSIGN OWNED BY admin1 TO CURRENT_USER');
isnt($node->safe_psql('postgres', q{
	SELECT r.rolname FROM pg_extension e JOIN pg_roles r ON r.oid = e.extowner WHERE e.extname = 'idempotency'}),
	'admin1', 'the extension has a new owner');

bg_feed($s, q{
	SELECT 'second:' || public.try('SELECT idem_release(''k'', ''s'')');
	SELECT 'unsub:' || public.try('SELECT idem_outbox_unsubscribe(''audit'')');
}, 'm2');
like($s->{out}, qr/second:42501/, 'the same session of admin1 is refused once it is no longer the owner');
like($s->{out}, qr/unsub:42501/, '... for the outbox too');

# and the new owner's backend acts as the new owner: what maintenance makes is its
$node->safe_psql('postgres', q{SELECT count(*) FROM idem_maintain()});
is($node->safe_psql('postgres', q{
	SELECT count(*) FROM idempotency.partition_registry p JOIN pg_class c ON c.oid = p.relid
	 WHERE c.relowner = 'admin1'::regrole}),
	'0', 'no partition is left to the old owner');

$s->{in} .= "\\q\n";
$s->{h}->finish;
$node->stop;
done_testing();
