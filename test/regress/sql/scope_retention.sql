-- Retention per scope: idem_configure_scope(), the retention classes and
-- their partitions, where claims go, and that no claim is dropped before its
-- scope's retention (across seal, drop, configure changes and lag).
CREATE EXTENSION idempotency;

\getenv abs_srcdir PG_ABS_SRCDIR
\set try_sql :abs_srcdir '/include/try.sql'
\i :try_sql

SELECT idem_configure(retention => '2 days', partition_interval => '1 hour', premake => 1);

-- where each claim went: the retention class of its partition
CREATE TEMP VIEW placed AS
SELECT c.scope, c.key, coalesce(r.retention::text, 'default') AS class,
       r.keep_retention
  FROM idempotency.claims c JOIN idempotency.partition_registry r ON r.relid = c.tableoid;
-- the partitions that take claims, per class
CREATE TEMP VIEW open_classes AS
SELECT coalesce(retention::text, 'default') AS class, count(*) AS open_partitions
  FROM idempotency.partition_registry WHERE NOT closed GROUP BY 1 ORDER BY 1;

-- bad input: 22004, 22023, 22001, and nothing stored
SELECT pg_temp.try($$SELECT idem_configure_scope(NULL, '1 day')$$);
SELECT pg_temp.try($$SELECT idem_configure_scope('', '1 day')$$);
SELECT pg_temp.try($$SELECT idem_configure_scope('*', '1 day')$$);
SELECT pg_temp.try($$SELECT idem_configure_scope('a*b', '1 day')$$);
SELECT pg_temp.try($$SELECT idem_configure_scope('a**', '1 day')$$);
SELECT pg_temp.try($$SELECT idem_configure_scope(repeat('x', 65), '1 day')$$);
-- a scope is at most 63 bytes; only a prefix may have a 64th, its '*'
SELECT pg_temp.try($$SELECT idem_configure_scope(repeat('x', 64), '1 day')$$);
SELECT pg_temp.try($$SELECT idem_configure_scope(repeat('x', 64) || '*', '1 day')$$);
SELECT pg_temp.try($$SELECT idem_configure_scope('s', '0 seconds')$$);
SELECT pg_temp.try($$SELECT idem_configure_scope('s', '-1 day')$$);
SELECT pg_temp.try($$SELECT idem_configure_scope('s', '1000 years')$$);
SELECT pg_temp.try($$SELECT idem_configure_scope('s', '30 minutes')$$);
SELECT pg_temp.try($$SELECT idem_configure_scope('s', 'soon')$$);
SELECT pg_temp.try($$SELECT idem_configure_scope('s', '400 hours')$$);
SELECT count(*) AS patterns FROM idempotency.scope_retention;
SELECT * FROM open_classes;
-- the hint of a shape that is too big names an interval that works
\set VERBOSITY default
SELECT idem_configure_scope('s', '400 hours');
\set VERBOSITY terse
-- removing what is not there does nothing
SELECT idem_configure_scope('nothing', NULL);

-- three patterns, two classes: an exact scope beats a prefix, the longest
-- prefix wins
SELECT idem_configure_scope('webhooks:*', '7 days');
SELECT idem_configure_scope('webhooks:internal', '3 hours');
SELECT idem_configure_scope('fast*', '3 hours');
SELECT idem_configure_scope('webhooks:stripe:*', '7 days');
-- the longest scope and the longest prefix fit
SELECT idem_configure_scope(repeat('y', 63), '3 hours'), idem_configure_scope(repeat('y', 63) || '*', '3 hours');
SELECT length(scope) FROM idempotency.scope_retention WHERE scope LIKE 'yyy%' ORDER BY 1;
SELECT idem_configure_scope(repeat('y', 63), NULL), idem_configure_scope(repeat('y', 63) || '*', NULL);
SELECT scope, retention FROM idempotency.scope_retention ORDER BY scope;
-- each class got its current partition and premake at once
SELECT * FROM open_classes;
SELECT idem_claim('k', 'webhooks:github'), idem_claim('k', 'webhooks:internal'),
       idem_claim('k', 'fast'), idem_claim('k', 'fastlane'), idem_claim('k', 'default'),
       idem_claim('k', 'webhooks'), idem_claim('k', 'webhooks:stripe:eu');
SELECT scope, class FROM placed ORDER BY scope;
-- duplicates are duplicates in every class
SELECT idem_claim('k', 'webhooks:github'), idem_claim('k', 'webhooks:internal'),
       idem_claim('k', 'fast'), idem_claim('k', 'default');
SELECT count(*) AS claimed FROM idem_claim_many(ARRAY['k', 'k2'], 'fast');
SELECT idem_claimed('k', 'fast') IS NOT NULL AS found, idem_claimed('k2', 'fast') IS NOT NULL AS found2;

-- a scope that changes class still finds its older claims where they are
SELECT idem_claim('old', 'moving') AS in_default;
SELECT idem_configure_scope('moving', '7 days');
SELECT idem_claim('old', 'moving') AS claimed_again, idem_claim('new', 'moving') AS new_key;
SELECT key, class FROM placed WHERE scope = 'moving' ORDER BY key;
SELECT idem_configure_scope('moving', NULL);
SELECT idem_claim('old', 'moving') AS claimed_again, idem_claim('new', 'moving') AS claimed_again2;

-- too many classes: the ninth distinct retention is refused, nothing changes
SELECT idem_configure_scope('c' || g, make_interval(hours => 3 + g)) FROM generate_series(1, 6) g;
SELECT count(DISTINCT retention) AS classes FROM idempotency.scope_retention;
SELECT pg_temp.try($$SELECT idem_configure_scope('c7', '20 hours')$$);
SELECT pg_temp.try($$SELECT idem_configure_scope('c1', '20 hours')$$) AS reusing_is_fine;
SELECT count(DISTINCT retention) AS classes FROM idempotency.scope_retention;
SELECT idem_configure_scope('c' || g, NULL) FROM generate_series(1, 6) g;
-- a class no scope has any more is sealed at once (it takes no claims)
SELECT * FROM open_classes;

-- Never early.  A claim per class in the first hour; in the second, one in
-- the default class whose scope is then kept longer while its partition
-- still takes claims; in the third, one whose scope is kept longer once its
-- partition was sealed.  Then the clock moves on, with maintenance.
SELECT idem_claim('t0', 'webhooks:github') AS week, idem_claim('t0', 'fast') AS hours,
       idem_claim('t0', 'default') AS days;
SET idempotency.debug_clock_offset = '1h';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT idem_claim('t0', 'later') AS raised_while_open;
SELECT idem_configure_scope('later', '7 days');
SET idempotency.debug_clock_offset = '2h';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT idem_claim('t0', 'sealed-then-raised') AS raised_when_sealed;
CREATE TEMP TABLE probe (scope text, days interval);
INSERT INTO probe VALUES ('webhooks:github', '7 days'), ('fast', '3 hours'), ('default', '2 days'),
                         ('later', '7 days'), ('sealed-then-raised', '5 days');
-- found (true) while within its scope's retention, checked at each step
CREATE FUNCTION pg_temp.check_kept(age interval) RETURNS TABLE(scope text, kept boolean, early boolean)
LANGUAGE sql AS $$
    SELECT p.scope, idem_claimed('t0', p.scope) IS NOT NULL,
           idem_claimed('t0', p.scope) IS NULL AND age < p.days
      FROM probe p ORDER BY p.scope
$$;
SET idempotency.debug_clock_offset = '4h';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
-- the partitions the claims are in are sealed now; raise one scope's retention
SELECT idem_configure_scope('sealed-then-raised', '5 days');
SELECT scope, class, keep_retention FROM placed WHERE key = 't0' ORDER BY scope;
-- only the sealed partition that holds its claim is kept longer
SELECT count(*) AS kept_for_five_days FROM idempotency.partition_registry
 WHERE keep_retention = '5 days';
SELECT * FROM pg_temp.check_kept('4 hours');
SET idempotency.debug_clock_offset = '6h';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
-- the short class's claim left with its partition (dropped, not deleted)
SELECT count(*) AS fast_left FROM idempotency.claims WHERE scope = 'fast' AND key = 't0';
SELECT * FROM pg_temp.check_kept('6 hours');
SET idempotency.debug_clock_offset = '1d';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT * FROM pg_temp.check_kept('1 day');
SET idempotency.debug_clock_offset = '52h';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT * FROM pg_temp.check_kept('52 hours');
-- a lowered retention applies to new claims: the claim made under 5 days stays
SELECT idem_configure_scope('sealed-then-raised', '3 hours');
SET idempotency.debug_clock_offset = '4d';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT * FROM pg_temp.check_kept('4 days');
SET idempotency.debug_clock_offset = '6d';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT * FROM pg_temp.check_kept('6 days');
SET idempotency.debug_clock_offset = '8d';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT * FROM pg_temp.check_kept('8 days');
-- storage left by partition drop: nothing of the first hour is left
SELECT count(*) AS claims_left FROM idempotency.claims WHERE key = 't0';
SELECT count(*) AS doubled FROM (
    SELECT scope, key FROM idempotency.claims GROUP BY 1, 2 HAVING count(*) > 1) d;
RESET idempotency.debug_clock_offset;

-- the inbox's and the requests' dedup claims follow their store's retention
-- (idem_configure_store), unless a scope row of their own says otherwise
SELECT idem_configure_store('inbox', '4 days');
SELECT idem_configure_store('requests', '4 days');
SELECT idem_configure_scope('inbox:special', '7 days');
SELECT idem_inbox_receive('src', 'm1', '{}') AS received,
       idem_inbox_receive('special', 'm1', '{}') AS received_special,
       (SELECT status FROM idem_request_begin('r1', 'api')) AS begun;
SELECT scope, class FROM placed WHERE scope IN ('inbox:src', 'inbox:special', 'request:api')
 ORDER BY scope;
SELECT idem_inbox_receive('src', 'm1', '{}') AS received_again;
-- raising a store's retention keeps its sealed dedup partitions longer too
SET idempotency.debug_clock_offset = '2h';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT idem_configure_store('inbox', '7 days');
SELECT keep_retention FROM placed WHERE scope = 'inbox:src';
RESET idempotency.debug_clock_offset;
SELECT idem_configure_store('inbox', NULL);
SELECT idem_configure_store('requests', NULL);
SELECT idem_configure_scope('inbox:special', NULL);

-- A removed retention is a change too: the scopes fall back to a prefix's
-- retention or the default's, and the partitions holding their claims are
-- kept that long -- sealed ones when it is removed, open ones when they are
-- sealed; for the default (keep_default) as it changes later.
SET idempotency.debug_clock_offset = '10d';
SELECT idem_configure_scope('fallback', '3 hours'), idem_configure_scope('fallback-open', '3 hours'),
       idem_configure_scope('fb:*', '7 days'), idem_configure_scope('fb:x:*', '3 hours'),
       idem_configure_store('inbox', '3 hours');
SELECT idem_claim('f', 'fallback'), idem_claim('f', 'fallback-open'),
       idem_inbox_receive('src2', 'f', '{}') AS received;
SET idempotency.debug_clock_offset = '241h';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT idem_claim('f', 'fb:x:1');
SELECT scope, class FROM placed WHERE key = 'f' ORDER BY scope;
SET idempotency.debug_clock_offset = '242h';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
-- the first hour's partition is sealed: removed, its scopes fall back to the default
SELECT idem_configure_scope('fallback', NULL), idem_configure_store('inbox', NULL);
-- a claim of a scope's class while its partition is open, then removed
SELECT idem_claim('g', 'fallback-open');
SELECT idem_configure_scope('fallback-open', NULL);
SET idempotency.debug_clock_offset = '244h';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
-- removed once sealed: its scopes fall back to a shorter prefix's 7 days
SELECT idem_configure_scope('fb:x:*', NULL);
SELECT c.scope, c.key, r.keep_retention, r.keep_default, p.retention
  FROM idempotency.claims c JOIN idempotency.partition_registry r ON r.relid = c.tableoid
  JOIN idempotency.partitions p ON p.partition = r.relid
 WHERE c.key IN ('f', 'g') AND c.scope NOT LIKE 'webhooks%' ORDER BY c.scope, c.key;
SET idempotency.debug_clock_offset = '11d';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT idem_claimed('f', 'fallback') IS NOT NULL AS kept_default,
       idem_claimed('f', 'fallback-open') IS NOT NULL AS kept_sealed_after,
       idem_claimed('g', 'fallback-open') IS NOT NULL AS kept_claimed_after,
       idem_claimed('f', 'fb:x:1') IS NOT NULL AS kept_prefix,
       idem_claimed('f', 'inbox:src2') IS NOT NULL AS kept_store;
-- the default raised later: the partitions that follow it are kept longer
SELECT idem_configure(retention => '3 days');
SET idempotency.debug_clock_offset = '300h';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT idem_claimed('f', 'fallback') IS NOT NULL AS kept_default,
       idem_claimed('g', 'fallback-open') IS NOT NULL AS kept_claimed_after,
       idem_claimed('f', 'inbox:src2') IS NOT NULL AS kept_store;
SET idempotency.debug_clock_offset = '318h';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT idem_claimed('f', 'fallback') IS NOT NULL AS kept_default,
       idem_claimed('g', 'fallback-open') IS NOT NULL AS kept_claimed_after,
       idem_claimed('f', 'fb:x:1') IS NOT NULL AS kept_prefix;
SET idempotency.debug_clock_offset = '414h';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT count(*) AS left_after_their_retention FROM idempotency.claims WHERE key IN ('f', 'g');
-- a scope given a retention below the default, then the default lowered
-- below it: its claims in the default class are kept for the scope's
SET idempotency.debug_clock_offset = '500h';
SELECT idem_configure(retention => '2 days');
SELECT idem_claim('d', 'lowdef');
SET idempotency.debug_clock_offset = '503h';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT idem_configure_scope('lowdef', '30 hours');
SELECT idem_configure(retention => '1 day');
SET idempotency.debug_clock_offset = '528h';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT idem_claimed('d', 'lowdef') IS NOT NULL AS kept_for_its_scope;
SET idempotency.debug_clock_offset = '534h';
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT idem_claimed('d', 'lowdef') IS NOT NULL AS kept_after_its_scope;
RESET idempotency.debug_clock_offset;
SELECT idem_configure(retention => '2 days');
SELECT idem_configure_scope('fb:*', NULL), idem_configure_scope('lowdef', NULL);

-- a role without the unlimited operator capability may not configure
CREATE ROLE scope_ret_operator;
SELECT idem_grant('scope_ret_operator', 'operator', scopes => ARRAY['webhooks:*']);
SET ROLE scope_ret_operator;
SELECT pg_temp.try($$SELECT idem_configure_scope('webhooks:*', '8 days')$$);
RESET ROLE;
SELECT retention FROM idempotency.scope_retention WHERE scope = 'webhooks:*';
SELECT idem_revoke('scope_ret_operator');
DROP ROLE scope_ret_operator;

SET client_min_messages = warning;
DROP EXTENSION idempotency CASCADE;
