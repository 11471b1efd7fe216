-- The guard tests' common clean-up, included at the end of
-- test/regress/sql/guard_*.sql (as :guard_teardown, which guard_setup.sql
-- sets): the test's schema (guard_schema), its roles if it names them in
-- guard_roles (a comma-separated list), and the extension.
RESET idempotency.guard_log_level;
RESET search_path;
SET client_min_messages = warning;
DROP SCHEMA :"guard_schema" CASCADE;
\if :{?guard_roles}
DROP ROLE :guard_roles;
\endif
DROP EXTENSION idempotency CASCADE;
