--
-- The extension's settings as the server sees them: name, boot value,
-- bounds, unit and context.  Each default, minimum and maximum is defined
-- once in C (a *_DEFAULT / *_MIN / *_MAX macro beside its owner); this
-- output is where a change of any of them shows, so doc/reference.md's
-- settings table can be checked against it.  The settings a preloaded
-- library adds (the worker's and shared memory's, context postmaster) do not
-- exist in this unpreloaded cluster: test/tap/080_stats.pl and the worker
-- tests cover them.
--
LOAD 'idempotency';
SELECT name, vartype, boot_val, min_val, max_val, unit, context
FROM pg_catalog.pg_settings
WHERE name LIKE 'idempotency.%'
ORDER BY name;

--
-- Bad values of idempotency.outbox_notify_window (an integer of ms, 1 to
-- 10000; units taken): PostgreSQL's GUC code refuses them with 22023, at
-- SET and at ALTER DATABASE, and nothing changes.
--
SET idempotency.outbox_notify_window = '250ms';
SET idempotency.outbox_notify_window = 0;
\echo :LAST_ERROR_SQLSTATE
SET idempotency.outbox_notify_window = -1;
\echo :LAST_ERROR_SQLSTATE
SET idempotency.outbox_notify_window = 10001;
\echo :LAST_ERROR_SQLSTATE
SET idempotency.outbox_notify_window = 'abc';
\echo :LAST_ERROR_SQLSTATE
SET idempotency.outbox_notify_window = '';
\echo :LAST_ERROR_SQLSTATE
SET idempotency.outbox_notify_window = '11s';
\echo :LAST_ERROR_SQLSTATE
SET idempotency.outbox_notify_window = '1min';
\echo :LAST_ERROR_SQLSTATE
SET idempotency.outbox_notify_window = '5 parsecs';
\echo :LAST_ERROR_SQLSTATE
SHOW idempotency.outbox_notify_window;
-- units: seconds, and a fraction of a second rounded to ms
SET idempotency.outbox_notify_window = '5s';
SHOW idempotency.outbox_notify_window;
SET idempotency.outbox_notify_window = '0.5s';
SHOW idempotency.outbox_notify_window;
RESET idempotency.outbox_notify_window;
SHOW idempotency.outbox_notify_window;

-- the database's default: a bad value is refused and the good one kept
SELECT pg_catalog.current_database() AS db \gset
ALTER DATABASE :"db" SET idempotency.outbox_notify_window = '250ms';
ALTER DATABASE :"db" SET idempotency.outbox_notify_window = 0;
\echo :LAST_ERROR_SQLSTATE
ALTER DATABASE :"db" SET idempotency.outbox_notify_window = -1;
\echo :LAST_ERROR_SQLSTATE
ALTER DATABASE :"db" SET idempotency.outbox_notify_window = 10001;
\echo :LAST_ERROR_SQLSTATE
ALTER DATABASE :"db" SET idempotency.outbox_notify_window = 'abc';
\echo :LAST_ERROR_SQLSTATE
ALTER DATABASE :"db" SET idempotency.outbox_notify_window = '11s';
\echo :LAST_ERROR_SQLSTATE
SELECT c AS kept
FROM pg_catalog.pg_db_role_setting s CROSS JOIN unnest(s.setconfig) c JOIN pg_catalog.pg_database d ON d.oid = s.setdatabase
WHERE d.datname = pg_catalog.current_database() AND s.setrole = 0 AND c LIKE 'idempotency.%';
ALTER DATABASE :"db" RESET idempotency.outbox_notify_window;
