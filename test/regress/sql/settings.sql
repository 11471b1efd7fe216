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
