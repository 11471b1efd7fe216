-- Scale-out with PL/Proxy, on one database standing for a shard: the
-- partition a routing key hashes to, the ownership record and its checks
-- (IK006 for a partition not owned, IK007 while frozen), privileges, the
-- router-side DDL the generators print, and what they refuse: routing
-- expressions that are not one plain expression, names with control
-- characters (PL/Proxy itself is not needed on a shard: a stand-in language
-- takes the printed DDL; test/tap/070_plproxy.pl runs it on a real router).
-- The freeze's locking is in test/isolation/specs/shard_freeze*.spec.
CREATE EXTENSION idempotency;

\getenv abs_srcdir PG_ABS_SRCDIR
\set try_sql :abs_srcdir '/include/try.sql'
\i :try_sql

-- 1. Partitions: hashtext(key) & (partitions - 1), as PL/Proxy's RUN ON computes
SELECT k, hashtext(k) AS hash, idem_shard_partition(k, 1) AS of1, idem_shard_partition(k, 2) AS of2,
       idem_shard_partition(k, 8) AS of8, idem_shard_partition(k, 8) = hashtext(k) & 7 AS same
  FROM unnest(ARRAY['1', '2', '42', 'acct-7', 'ü']) k;
SELECT pg_temp.try($$SELECT idem_shard_partition('k', 3)$$);
SELECT pg_temp.try($$SELECT idem_shard_partition('k', 0)$$);
SELECT pg_temp.try($$SELECT idem_shard_partition('k', 131072)$$);
SELECT pg_temp.try($$SELECT idem_shard_partition('k', NULL)$$);
SELECT pg_temp.try($$SELECT idem_shard_partition(NULL, 2)$$);
SELECT pg_temp.try($$SELECT idem_shard_partition('', 2)$$);

-- 2. Not configured: every routed call passes (a single server is unaffected)
SELECT count(*) FROM idempotency.shard_ownership;
SELECT pg_temp.try($$SELECT idem_shard_assert('1')$$);
SELECT idem_claim_routed('1', 'e-0', 'payments');
SELECT idem_claim_routed('1', 'e-0', 'payments');

-- 3. Configuring: bad input changes nothing
SELECT pg_temp.try($$SELECT idem_shard_configure(3, '{0}')$$);
SELECT pg_temp.try($$SELECT idem_shard_configure(4, '{4}')$$);
SELECT pg_temp.try($$SELECT idem_shard_configure(4, '{-1}')$$);
SELECT pg_temp.try($$SELECT idem_shard_configure(4, '{1,1}')$$);
SELECT pg_temp.try($$SELECT idem_shard_configure(4, '{1,NULL}')$$);
SELECT pg_temp.try($$SELECT idem_shard_configure(4, '{{1},{2}}')$$);
SELECT pg_temp.try($$SELECT idem_shard_configure(NULL, '{1}')$$);
SELECT pg_temp.try($$SELECT idem_shard_configure(4, NULL)$$);
SELECT pg_temp.try($$SELECT idem_shard_configure(4, '{1}', NULL)$$);
SELECT count(*) FROM idempotency.shard_ownership;
-- the table keeps the record sound even when written directly
SELECT pg_temp.try($$INSERT INTO idempotency.shard_ownership (partitions, owned) VALUES (4, '{5}')$$);
SELECT pg_temp.try($$INSERT INTO idempotency.shard_ownership (partitions, owned) VALUES (6, '{1}')$$);
SELECT pg_temp.try($$INSERT INTO idempotency.shard_ownership (partitions, owned) VALUES (4, '{1,NULL}')$$);
SELECT pg_temp.try($$INSERT INTO idempotency.shard_ownership (partitions, owned) VALUES (1073741824, '{1}')$$);

-- this database owns partitions 3 and 1 of 4 (stored sorted)
SELECT idem_shard_configure(4, '{3,1}');
SELECT partitions, owned, frozen FROM idempotency.shard_ownership;
SELECT k, idem_shard_partition(k, 4) AS p, pg_temp.try(format('SELECT idem_shard_assert(%L)', k)) AS assert
  FROM unnest(ARRAY['1', '2', '42', 'acct-7', 'ü']) k;

-- a huge routing key is cut to 100 bytes in the message
SELECT left(m, 5) AS sqlstate, length(m) < 400 AS message_is_short
  FROM (SELECT pg_temp.try(format('SELECT idem_shard_assert(%L)', k)) AS m
          FROM (SELECT repeat('r', 100000) || g AS k FROM generate_series(1, 50) g) x
         WHERE idem_shard_partition(k, 4) IN (0, 2) LIMIT 1) y;

-- 4. A misrouted claim is refused before claiming: nothing is claimed
SELECT pg_temp.try($$SELECT idem_claim_routed('2', 'e-2', 'payments')$$);
SELECT idem_claimed('e-2', 'payments') IS NULL AS not_claimed;
-- the message in full
SELECT idem_claim_routed('2', 'e-2', 'payments');
-- owned: an ordinary claim, then a duplicate; the claim is idem_claim's
SELECT idem_claim_routed('1', 'e-1', 'payments', '{"amount": 1}');
SELECT idem_claim_routed('1', 'e-1', 'payments', '{"amount": 1}');
SELECT pg_temp.try($$SELECT idem_claim_routed('1', 'e-1', 'payments', '{"amount": 2}')$$);
SELECT idem_claim('e-1', 'payments');
-- bad input: the claim's own checks
SELECT pg_temp.try($$SELECT idem_claim_routed('1', NULL, 'payments')$$);
SELECT pg_temp.try($$SELECT idem_claim_routed('1', 'e', NULL)$$);
SELECT pg_temp.try($$SELECT idem_claim_routed('1', '', 'payments')$$);
SELECT pg_temp.try($$SELECT idem_claim_routed('1', 'e', repeat('s', 64))$$);
SELECT pg_temp.try($$SELECT idem_claim_routed(NULL, 'e', 'payments')$$);
-- a misroute inside a handler rolls back what the handler did before it
CREATE TABLE effects (event_id text PRIMARY KEY);
CREATE FUNCTION handle(account text, event_id text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF NOT idem_claim_routed(account, event_id, 'handler') THEN
        RETURN false;
    END IF;
    INSERT INTO effects VALUES (event_id);
    RETURN true;
END
$$;
SELECT handle('1', 'h-1'), handle('1', 'h-1');
SELECT pg_temp.try($$SELECT handle('2', 'h-2')$$);
SELECT event_id FROM effects ORDER BY 1;

-- 5. Frozen (a move in progress): every routed call is refused, owned or not
SELECT idem_shard_configure(4, '{1,3}', frozen => true);
SELECT pg_temp.try($$SELECT idem_shard_assert('1')$$);
SELECT pg_temp.try($$SELECT idem_claim_routed('1', 'e-9', 'payments')$$);
SELECT pg_temp.try($$SELECT idem_shard_assert('2')$$);
-- a plain claim carries no routing key: not checked
SELECT idem_claim('plain-1', 'payments');
SELECT idem_shard_configure(4, '{1,3}');
SELECT idem_claim_routed('1', 'e-9', 'payments');
-- owning nothing refuses every routed call (the old copy after a move)
SELECT idem_shard_configure(4, '{}');
SELECT partitions, owned, frozen FROM idempotency.shard_ownership;
SELECT pg_temp.try($$SELECT idem_shard_assert('1')$$);

-- 6. The cache follows every change: a direct UPDATE by the owner, a
-- DELETE (not sharded any more), a rolled-back change
UPDATE idempotency.shard_ownership SET owned = '{0,1,2,3}';
SELECT pg_temp.try($$SELECT idem_shard_assert('2')$$);
BEGIN;
SELECT idem_shard_configure(2, '{0}');
SELECT pg_temp.try($$SELECT idem_shard_assert('1')$$);
ROLLBACK;
SELECT pg_temp.try($$SELECT idem_shard_assert('1')$$);
DELETE FROM idempotency.shard_ownership;
SELECT pg_temp.try($$SELECT idem_shard_assert('1')$$);
SELECT idem_shard_configure(2, '{1}');

-- 7. Privileges: the check needs a grant (a check that passes holds a lock a
-- freeze waits for); a claim needs the handler capability, as idem_claim does;
-- only the table's owner configures, and only the owner may generate router DDL
CREATE ROLE idem_shard_app;
CREATE ROLE idem_shard_nobody;
GRANT USAGE ON SCHEMA idempotency TO idem_shard_app;
SELECT idem_grant('idem_shard_app', 'handler');
SET ROLE idem_shard_app;
SELECT partitions, owned FROM idempotency.shard_ownership;
SELECT pg_temp.try($$SELECT idem_shard_assert('1')$$);
SELECT pg_temp.try($$SELECT idem_claim_routed('1', 'app-1')$$);
SELECT pg_temp.try($$SELECT idem_claim_routed('2', 'app-2')$$);
SELECT pg_temp.try($$SELECT idem_shard_configure(2, '{0,1}')$$);
SELECT pg_temp.try($$UPDATE idempotency.shard_ownership SET owned = '{0,1}'$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle(text,text)', 'account')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_admin_ddl()$$);
RESET ROLE;
-- granted, the check passes and refuses as for anyone
GRANT EXECUTE ON FUNCTION idem_shard_assert(text) TO idem_shard_app;
SET ROLE idem_shard_app;
SELECT pg_temp.try($$SELECT idem_shard_assert('1')$$);
SELECT pg_temp.try($$SELECT idem_shard_assert('2')$$);
RESET ROLE;
-- a role with no grant at all: 42501 everywhere, and no lock left behind
BEGIN;
SET LOCAL ROLE idem_shard_nobody;
SELECT pg_temp.try($$SELECT idem_shard_assert('1')$$);
SELECT pg_temp.try($$SELECT idem_claim_routed('1', 'nobody-1')$$);
SELECT pg_temp.try($$SELECT idem_shard_configure(2, '{0,1}')$$);
SELECT pg_temp.try($$SELECT count(*) FROM idempotency.shard_ownership$$);
RESET ROLE;
SELECT count(*) AS locks_held FROM pg_locks
 WHERE pid = pg_backend_pid() AND relation = 'idempotency.shard_ownership'::regclass;
ROLLBACK;
SELECT p.proname, p.proacl IS NOT NULL AND NOT has_function_privilege('public', p.oid, 'EXECUTE') AS closed_to_public
  FROM pg_proc p
 WHERE p.proname IN ('idem_shard_assert', 'idem_shard_configure', 'idem_shard_router_ddl',
                     'idem_shard_router_admin_ddl', 'idem_claim_routed', 'idem_shard_partition')
    OR p.pronamespace = 'idempotency'::regnamespace AND p.proname LIKE 'shard\_%'
 ORDER BY 1;

-- 8. The router-side proxy of a handler (printed as it is)
\a
\t on
SELECT idem_shard_router_ddl('handle(text,text)', 'account');
CREATE SCHEMA "Billing";
CREATE TYPE "Billing".currency AS ENUM ('EUR', 'USD');
CREATE FUNCTION "Billing"."Pay"(account_id bigint, "eventId" text, amount numeric DEFAULT 0,
                                currency "Billing".currency DEFAULT 'EUR', OUT applied boolean, OUT balance numeric)
    LANGUAGE sql AS $$ SELECT true, amount $$;
SELECT idem_shard_router_ddl('"Billing"."Pay"(bigint, text, numeric, "Billing".currency)',
                             'account_id::text', cluster => 'billing''s');
-- a batch: parallel arrays split per partition, the element routed by itself
CREATE FUNCTION handle_batch(accounts bigint[], event_ids text[], note text) RETURNS SETOF text
    LANGUAGE sql AS $$ SELECT unnest(event_ids) $$;
SELECT idem_shard_router_ddl('handle_batch(bigint[], text[], text)', '(accounts)::text',
                             split => ARRAY['accounts', 'event_ids']);
-- any expression of the arguments, as long as it is text
SELECT idem_shard_router_ddl('handle(text,text)', 'lower(account) || ''/x''') ~ 'RUN ON hashtext\(lower\(account\) \|\| ''/x''\);' AS expr_kept;

\a
\t off

-- 9. Bad input to the generator
-- pg_temp.why(sql): as pg_temp.try, with the error's detail (which says
-- what in the expression is refused)
CREATE FUNCTION pg_temp.why(sql text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    r text;
    d text;
BEGIN
    EXECUTE sql INTO r;
    RETURN coalesce(nullif(r, ''), 'ok');
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS d = PG_EXCEPTION_DETAIL;
    RETURN SQLSTATE || ': ' || SQLERRM || coalesce(' | ' || nullif(d, ''), '');
END
$$;
CREATE PROCEDURE proc(account text) LANGUAGE sql AS $$ SELECT 1 $$;
CREATE FUNCTION returns_void(account text) RETURNS void LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION unnamed(text, text) RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
CREATE FUNCTION variadic_handler(account text, VARIADIC ids text[]) RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
SELECT pg_temp.try($$SELECT idem_shard_router_ddl(NULL, 'account')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle(text,text)', NULL)$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle(text,text)', 'account', NULL)$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle(text,text)', ' ')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle(text,text)', 'account', '')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('no_such_handler(text)', 'account')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle(int,text)', 'account')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('proc(text)', 'account')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('max(integer)', 'account')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('returns_void(text)', 'account')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('unnamed(text,text)', '$1')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('variadic_handler(text,text[])', 'account')$$);
-- the expression: a column that is no argument, not text, constant, not one expression
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle(text,text)', 'account_id')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('"Billing"."Pay"(bigint,text,numeric,"Billing".currency)', 'account_id')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle(text,text)', '''constant''')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account); DROP TABLE effects; SELECT (1')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account -- x')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', '(SELECT account)')$$);
-- checked on its parse tree, not its text: no subquery in any form ...
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', '(TABLE public.effects)::text || account')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', '(VALUES (1))::text || account')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', '(WITH x AS (SELECT account) TABLE x)')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'WITH x AS (SELECT 1) SELECT account')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account || EXISTS (SELECT FROM effects)::text')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account || ARRAY(SELECT 1)::text')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account IN (SELECT event_id FROM effects)')$$);
-- ... one value, nothing of a query around it ...
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account, event_id')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account AS r')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account r')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'ALL account')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'DISTINCT account')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account FROM effects')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account UNION SELECT event_id')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account ORDER BY 1')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account) AS r FROM (SELECT NULL::text AS account) x UNION SELECT (account')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', '*')$$);
-- ... no volatile or set-returning function, aggregate or window function ...
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account || random()::text')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account || clock_timestamp()::text')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account || generate_series(1, 2)::text')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'max(account)')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account || rank() OVER ()::text')$$);
-- ... nothing PL/Proxy's scanner reads otherwise: comments, semicolons and
-- dollar signs outside quotes, backslashes, control characters ...
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account /* x */')$$);
SELECT pg_temp.why($q$SELECT idem_shard_router_ddl('handle(text,text)', 'account || $$x$$')$q$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', '$1')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account || E''\x41''')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'account || ''\''')$$);
SELECT pg_temp.why(format('SELECT idem_shard_router_ddl(%L, %L)', 'handle(text,text)', E'account\n|| event_id'));
SELECT pg_temp.why(format('SELECT idem_shard_router_ddl(%L, %L)', 'handle(text,text)', E'account\t|| event_id'));
SELECT pg_temp.why(format('SELECT idem_shard_router_ddl(%L, %L)', 'handle(text,text)', E'account || ''\r'''));
SELECT pg_temp.why(format('SELECT idem_shard_router_ddl(%L, %L)', 'handle(text,text)', E'account || ''\x7f'''));
-- ... arguments by their plain names, as PL/Proxy replaces them: not
-- quoted, not qualified, and no other use of an argument's name
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', '"account"')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('handle(text,text)', 'handle.account')$$);
CREATE FUNCTION lower_named(lower text, text text) RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('lower_named(text,text)', 'lower(text)')$$);
SELECT pg_temp.why($$SELECT idem_shard_router_ddl('lower_named(text,text)', 'lower || text')$$) ~ 'RUN ON hashtext\(lower \|\| text\);' AS plain_names_kept;
-- quoted text may hold anything but control characters and backslashes,
-- and a mixed-case argument is referred to as PL/Proxy does, without case
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle(text,text)', 'account || '';--/*$x$"''')$$) ~ 'RUN ON hashtext\(account \|\| '';--/\*\$x\$"''\);' AS quoted_text_kept;
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('"Billing"."Pay"(bigint,text,numeric,"Billing".currency)', 'eventid')$$) ~ 'RUN ON hashtext\(eventid\);' AS mixed_case_argument;
-- huge: a 100 kB literal is kept whole
SELECT length(idem_shard_router_ddl('handle(text,text)', format('account || %L', repeat('x', 100000)))) > 100000 AS huge_kept;
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle(text,text)', 42)$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle(text,text)', 'account ||')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle(text,text)', 'account || nope')$$);
-- arrays: routed unsplit, split names that are no arrays or no arguments,
-- a split the expression does not use, a split handler without SETOF
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle_batch(bigint[],text[],text)', 'accounts::text')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle_batch(bigint[],text[],text)', 'accounts::text', split => '{accounts,note}')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle_batch(bigint[],text[],text)', 'accounts::text', split => '{accounts,nope}')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle_batch(bigint[],text[],text)', 'accounts::text', split => '{accounts,accounts}')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle_batch(bigint[],text[],text)', 'accounts::text', split => '{}')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle_batch(bigint[],text[],text)', 'note', split => '{accounts,event_ids}')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle(text,text)', 'account', split => '{account}')$$);

-- 10. The admin proxies, RUN ON ALL
\a
\t on
SELECT idem_shard_router_admin_ddl('billing', 'Billing Admin');
\a
\t off
SELECT pg_temp.try($$SELECT idem_shard_router_admin_ddl(NULL)$$);
SELECT pg_temp.try($$SELECT idem_shard_router_admin_ddl('idem', '')$$);

-- 11. Names a lesser role chose reach the DDL only as quoted identifiers or
-- literals, never in a comment, and a control character in any of them is
-- refused.  What is emitted is run back through psql, as a DBA applies it,
-- with a stand-in for PL/Proxy (a language without validator): psql echoes
-- every statement it sends (ECHO queries), and only the proxies' are there.
CREATE SCHEMA idem_scratch;
CREATE FUNCTION idem_scratch.plproxy_stand_in() RETURNS language_handler
    AS '$libdir/plpgsql', 'plpgsql_call_handler' LANGUAGE C;
CREATE LANGUAGE plproxy HANDLER idem_scratch.plproxy_stand_in;
-- pg_temp.apply(sql): run the DDL that the query sql returns
CREATE FUNCTION pg_temp.apply(sql text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE ddl text;
BEGIN
    EXECUTE sql INTO ddl;
    EXECUTE ddl;
    RETURN 'applied';
EXCEPTION WHEN OTHERS THEN
    RETURN SQLSTATE || ': ' || SQLERRM;
END
$$;
-- a handler whose name ends the comment the DDL used to start with
CREATE FUNCTION idem_scratch."ap
CREATE ROLE idem_evil SUPERUSER;
--"(account text) RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
SELECT pg_temp.apply(format('SELECT idem_shard_router_ddl(%s::regprocedure, %L)', p.oid, 'account'))
  FROM pg_proc p WHERE p.pronamespace = 'idem_scratch'::regnamespace AND p.proname LIKE 'ap%';
SELECT count(*) AS evil_roles FROM pg_roles WHERE rolname LIKE 'idem\_evil%';
-- every other place a name reaches the DDL: schema, argument, type, result
CREATE SCHEMA "idem
scratch";
CREATE FUNCTION "idem
scratch".h(account text) RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
CREATE TYPE idem_scratch."cur
rency" AS ENUM ('EUR');
CREATE FUNCTION idem_scratch.h_type(account text, c idem_scratch."cur
rency") RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
-- (tab, carriage return and 0x7f written as escapes)
DO $do$
BEGIN
    EXECUTE format('CREATE FUNCTION idem_scratch.h_arg(account text, %I text) RETURNS boolean'
                   ' LANGUAGE sql AS $$ SELECT true $$', E'x\ty');
    EXECUTE format('CREATE FUNCTION idem_scratch.h_result(account text) RETURNS TABLE(%I boolean)'
                   ' LANGUAGE sql AS $$ SELECT true $$', E'ok\r');
    EXECUTE format('CREATE FUNCTION idem_scratch.%I(account text) RETURNS boolean'
                   ' LANGUAGE sql AS $$ SELECT true $$', E'h_name\x7f');
END
$do$;
CREATE FUNCTION idem_scratch.h_default(account text, note text DEFAULT E'a\nb') RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
SELECT coalesce(substring(p.proname FROM '^h_([a-z]+)'), 'schema') AS what,
       pg_temp.try(format('SELECT idem_shard_router_ddl(%s::regprocedure, %L)', p.oid, 'account')) AS ddl
  FROM pg_proc p
 WHERE p.pronamespace IN ('idem_scratch'::regnamespace, E'"idem\nscratch"'::regnamespace) AND p.proname ~ '^h'
 ORDER BY p.proname;
SELECT pg_temp.try($$SELECT idem_shard_router_ddl('handle(text,text)', 'account', E'idem\n')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_admin_ddl(E'idem\n')$$);
SELECT pg_temp.try($$SELECT idem_shard_router_admin_ddl('idem', E'idem\x7fshards')$$);
-- emitted: quotes and dollar signs in a handler's name, and $plproxy$ (the
-- tag the body used to have) in the cluster, or in a literal of the
-- expression: the body gets a tag it does not contain
CREATE FUNCTION idem_scratch."pay$plproxy$""'"(account text) RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
CREATE FUNCTION idem_scratch.pay_2(account text) RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
SELECT idem_shard_router_ddl('idem_scratch."pay$plproxy$""''"(text)', 'account',
                             cluster => 'x$plproxy$; DROP SCHEMA idem_scratch CASCADE; --''') AS ddl \gset
\set ECHO queries
:ddl
\set ECHO all
SELECT idem_shard_router_ddl('idem_scratch.pay_2(text)', 'account || ''$plproxy$; DROP SCHEMA idem_scratch CASCADE; --''') AS ddl \gset
\set ECHO queries
:ddl
\set ECHO all
SELECT p.proname, l.lanname, p.prosrc
  FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
 WHERE p.pronamespace = 'idem_scratch'::regnamespace AND p.proname LIKE 'pay%'
 ORDER BY 1;
-- a database whose name ends a comment: the name is in neither output (and
-- the admin proxies, with $plproxy$ as cluster, get another tag)
SELECT current_database() AS regress_db \gset
SELECT E'idem_shards\nCREATE ROLE idem_evil_db SUPERUSER;\n--' AS evil_db \gset
CREATE DATABASE :"evil_db";
\c :"evil_db"
SET client_min_messages = warning;
CREATE EXTENSION idempotency;
CREATE FUNCTION handle(account text) RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
CREATE FUNCTION plproxy_stand_in() RETURNS language_handler AS '$libdir/plpgsql', 'plpgsql_call_handler' LANGUAGE C;
CREATE LANGUAGE plproxy HANDLER plproxy_stand_in;
SELECT idem_shard_router_ddl('handle(text)', 'account') || idem_shard_router_admin_ddl(cluster => '$plproxy$') AS ddl \gset
SELECT strpos(:'ddl', current_database()) AS name_at, :'ddl' ~ 'evil' AS mentions_evil;
\set ECHO queries
:ddl
\set ECHO all
SELECT count(*) AS admin_proxies,
       count(*) FILTER (WHERE p.prosrc ~ '^\n    CLUSTER ''\$plproxy\$'';\n    RUN ON ALL;\n    SELECT [^;]*;\n$') AS as_written
  FROM pg_proc p WHERE p.pronamespace = 'idem_shards'::regnamespace;
\c :"regress_db"
DROP DATABASE :"evil_db";
SELECT count(*) AS evil_roles FROM pg_roles WHERE rolname LIKE 'idem\_evil%';

SET client_min_messages = warning;
DROP FUNCTION handle(text, text);
DROP FUNCTION handle_batch(bigint[], text[], text);
DROP FUNCTION returns_void(text);
DROP FUNCTION unnamed(text, text);
DROP FUNCTION variadic_handler(text, text[]);
DROP FUNCTION lower_named(text, text);
DROP PROCEDURE proc(text);
DROP SCHEMA "Billing" CASCADE;
DROP TABLE effects;
DROP EXTENSION idempotency CASCADE;
DROP ROLE idem_shard_app;
DROP ROLE idem_shard_nobody;
DROP SCHEMA idem_scratch, "idem
scratch" CASCADE;
DROP ROLE IF EXISTS idem_evil;
DROP ROLE IF EXISTS idem_evil_db;
