-- The guard tests' common set-up, included by test/regress/sql/guard_*.sql
-- once they have set abs_srcdir (\getenv abs_srcdir PG_ABS_SRCDIR) and
-- guard_schema (the test's own schema): the extension, the schema first on
-- the search path, the guard statistics reset, and pg_temp.try(); it sets
-- guard_teardown, the clean-up the test includes at its end.
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS idempotency;
RESET client_min_messages;
CREATE SCHEMA :"guard_schema";
SET search_path = :"guard_schema", public;
SELECT idempotency.guard_stats_reset();
\set try_sql :abs_srcdir '/include/try.sql'
\i :try_sql
\set guard_teardown :abs_srcdir '/include/guard_teardown.sql'
