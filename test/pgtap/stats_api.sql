-- pgTAP: the public API of observability (SPEC.md §6): the views and their
-- columns in SPEC order, idem_stats_reset() and who may call it, the
-- security of the functions the views call (owner's rights, pinned
-- search_path, read only), and what the views answer without preload (the
-- pgTAP cluster does not preload the library).  Runs in one transaction
-- that rolls back.
\ir include/begin.sql

SELECT plan(24);

-- objects and columns, in the order SPEC §6 writes them
SELECT has_view('idempotency', 'stats', 'view idempotency.stats exists');
SELECT is(ARRAY(SELECT attname::text FROM pg_attribute
                 WHERE attrelid = 'idempotency.stats'::regclass AND attnum > 0 ORDER BY attnum),
          ARRAY['scope', 'relation', 'claims', 'duplicates', 'payload_mismatches', 'releases',
                'stale_skips', 'invalid_transitions', 'requests_started', 'requests_completed',
                'requests_conflicted', 'outbox_pending', 'outbox_dead', 'outbox_oldest_pending_age',
                'last_claim_at', 'last_duplicate_at', 'stats_reset',
                'inbox_pending', 'inbox_dead', 'inbox_oldest_pending_age', 'late_duplicates'],
          'idempotency.stats has the SPEC columns in order, then the inbox''s, then late_duplicates');
SELECT col_type_is('idempotency', 'stats', 'relation', 'regclass', 'stats.relation is regclass');
SELECT col_type_is('idempotency', 'stats', 'outbox_oldest_pending_age', 'interval',
                   'stats.outbox_oldest_pending_age is an interval');
SELECT has_view('idempotency', 'consumers', 'view idempotency.consumers exists');
SELECT is(ARRAY(SELECT attname::text FROM pg_attribute
                 WHERE attrelid = 'idempotency.consumers'::regclass AND attnum > 0 ORDER BY attnum),
          ARRAY['scope', 'first_claim_at', 'last_claim_at', 'claims'],
          'idempotency.consumers has the SPEC columns in order');
SELECT has_table('idempotency', 'scope_history', 'table idempotency.scope_history exists');
SELECT ok((SELECT 'idempotency.scope_history'::regclass::oid = ANY (extconfig) FROM pg_extension
            WHERE extname = 'idempotency'), 'scope_history is dumped by pg_dump');

-- idem_stats_reset(): an operator's business (every database: a superuser's)
SELECT has_function('idem_stats_reset', ARRAY['boolean'], 'idem_stats_reset(all_databases boolean) exists');
SELECT function_returns('idem_stats_reset', ARRAY['boolean'], 'void', 'idem_stats_reset() returns void');
SELECT is((SELECT pg_get_function_arguments('idem_stats_reset(boolean)'::regprocedure)),
          'all_databases boolean DEFAULT false', 'idem_stats_reset resets this database by default');
SELECT ok(has_function_privilege('public', 'idem_stats_reset(boolean)', 'EXECUTE'),
          'PUBLIC may call idem_stats_reset, which checks the operator capability itself (test/regress/sql/capabilities.sql)');
SELECT ok(NOT has_function_privilege('public', 'idempotency.stats_rows()', 'EXECUTE')
          AND NOT has_function_privilege('public', 'idempotency.live_scopes()', 'EXECUTE'),
          'PUBLIC may not call the functions behind the views');
SELECT ok(has_table_privilege('pg_monitor', 'idempotency.stats', 'SELECT')
          AND has_function_privilege('pg_monitor', 'idempotency.stats_rows()', 'EXECUTE'),
          'pg_monitor reads the views');

-- the functions behind the views run as the owner, read only, search_path
-- pinned (test/pgtap/privileges.sql pins every SECURITY DEFINER function);
-- live_scopes() is C and needs no owner's rights
SELECT is(ARRAY(SELECT p.oid::regprocedure::text FROM pg_proc p
                 WHERE p.prosecdef AND p.pronamespace = 'idempotency'::regnamespace
                 ORDER BY 1),
          ARRAY['idempotency.inbox_partition_pinned(regclass)',
                'idempotency.outbox_partition_pinned(regclass)',
                'idempotency.outbox_partition_pinned_by(regclass)', 'idempotency.stats_rows()'],
          'the only SECURITY DEFINER functions are the four the views call');
SELECT is(ARRAY(SELECT p.oid::regprocedure::text FROM pg_proc p
                 WHERE p.prosecdef AND p.pronamespace = 'idempotency'::regnamespace
                   AND NOT 'search_path=pg_catalog, pg_temp' = ANY (coalesce(p.proconfig, '{}'))),
          ARRAY[]::text[], 'each pins search_path');
SELECT is(ARRAY(SELECT p.oid::regprocedure::text FROM pg_proc p
                 WHERE p.prosecdef AND p.pronamespace = 'idempotency'::regnamespace
                   AND p.provolatile = 'v'),
          ARRAY[]::text[], 'none is volatile');
SELECT is(ARRAY(SELECT p.oid::regprocedure::text FROM pg_proc p
                 WHERE p.prosecdef AND p.pronamespace <> 'idempotency'::regnamespace
                   AND p.oid IN (SELECT objid FROM pg_depend WHERE refobjid =
                                 (SELECT oid FROM pg_extension WHERE extname = 'idempotency'))),
          ARRAY[]::text[], 'no public idem_ function is SECURITY DEFINER');
SELECT is(idempotency.outbox_partition_pinned('idempotency.settings'), NULL,
          'outbox_partition_pinned answers nothing about a table that is no outbox partition');

-- without preload: the tables answer, the counters are NULL
SELECT ok(idem_claim('pgtap-1', 'pgtap-scope'), 'a claim');
SELECT is((SELECT format('%s|%s|%s|%s', scope, claims, duplicates, stats_reset)
             FROM idempotency.stats WHERE scope = 'pgtap-scope'),
          'pgtap-scope|1||',
          'without preload: claims from the tables, duplicates and stats_reset NULL');
SELECT is((SELECT claims FROM idempotency.consumers WHERE scope = 'pgtap-scope'), 1::bigint,
          'consumers lists the scope');
SELECT is((SELECT preloaded FROM idempotency.stats_info()), false, 'stats_info: not preloaded');
SELECT is(ARRAY(SELECT unnest(proargnames) FROM pg_proc WHERE oid = 'idempotency.stats_info()'::regprocedure),
          ARRAY['preloaded', 'max_scopes', 'scopes_tracked', 'databases', 'dropped', 'stats_reset',
                'last_maintenance', 'database_scopes', 'fair_share'],
          'stats_info: its columns, this database''s rows and fair share last');

SELECT * FROM finish();
ROLLBACK;
