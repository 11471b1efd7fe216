-- pgTAP: the privilege audit (SPEC.md §10).  Every function of the
-- extension -- found through pg_depend, not a list kept by hand -- that runs
-- with its owner's rights (SECURITY DEFINER), with its owner, its pinned
-- settings and who may execute it; every function PUBLIC may execute; and
-- every function granted to a role by name.  Each is pinned as the
-- expected set, so a new SECURITY DEFINER function or a new grant cannot
-- slip in unnoticed: whoever adds one updates this file, and says why in
-- the commit.  Runs in one transaction that rolls back.
\ir include/begin.sql

SELECT plan(7);

-- the extension's functions, with the roles that may execute each (the
-- owner left out: it always may), 'PUBLIC' for everyone
CREATE TEMP VIEW ext_functions AS
SELECT p.oid, p.oid::regprocedure::text AS fn, p.prosecdef, p.provolatile,
       p.proowner = e.extowner AS owned_by_extension_owner,
       array_to_string(p.proconfig, ', ') AS config,
       coalesce((SELECT string_agg(CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                                        ELSE pg_get_userbyid(a.grantee) END, ',' ORDER BY 1)
                   FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
                  WHERE a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner), '') AS grantees
  FROM pg_depend d
  JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'idempotency'
  JOIN pg_proc p ON p.oid = d.objid
 WHERE d.classid = 'pg_proc'::regclass AND d.refclassid = 'pg_extension'::regclass
   AND d.deptype = 'e';

SELECT cmp_ok((SELECT count(*) FROM ext_functions), '>', 50::bigint,
              'the audit sees the extension''s functions');

-- SECURITY DEFINER: owned by the extension's owner, search_path pinned,
-- executable by the monitoring only (each reads only what is ours)
SELECT is(ARRAY(SELECT format('%s | %s | %s | %s', fn,
                              CASE WHEN owned_by_extension_owner THEN 'extension owner' ELSE 'OTHER OWNER' END,
                              config, grantees)
                  FROM ext_functions WHERE prosecdef ORDER BY fn),
          ARRAY['idempotency.inbox_partition_pinned(regclass) | extension owner | search_path=pg_catalog, pg_temp | pg_monitor',
                'idempotency.outbox_partition_pinned(regclass) | extension owner | search_path=pg_catalog, pg_temp | pg_monitor',
                'idempotency.outbox_partition_pinned_by(regclass) | extension owner | search_path=pg_catalog, pg_temp | pg_monitor',
                'idempotency.stats_rows() | extension owner | search_path=pg_catalog, pg_temp | pg_monitor'],
          'the SECURITY DEFINER functions, their owner, settings and grantees');
SELECT is(ARRAY(SELECT fn FROM ext_functions WHERE prosecdef AND provolatile = 'v'),
          ARRAY[]::text[], 'no SECURITY DEFINER function is volatile (they only read)');

-- executable by PUBLIC: the API (each checks its caller's capability
-- first -- handler, relay, operator: src/common/capabilities.c -- or works
-- through the caller's own table rights, or is the caller's own test,
-- maintenance included: idem_maintain and idem_configure check the
-- unlimited operator capability) and read-only diagnosis; not
-- idem_grant/idem_revoke (owners only)
SELECT is(ARRAY(SELECT fn FROM ext_functions WHERE grantees ~ '(^|,)PUBLIC(,|$)' ORDER BY fn),
          ARRAY['idem_check_replay(regprocedure,jsonb[],text,integer,double precision,double precision,integer)',
                'idem_claim(text,text,jsonb)',
                'idem_claim_many(text[],text)',
                'idem_claim_routed(text,text,text,jsonb)',
                'idem_claimed(text,text)', 'idem_claimed_before(text,text)',
                'idem_configure(interval,interval,integer)',
                'idem_configure_scope(text,interval)', 'idem_configure_store(text,interval)',
                'idem_guard_transitions(regclass,name,jsonb,text)',
                'idem_guard_version(regclass,name,text)',
                'idem_inbox_claim(integer,interval,text[])',
                'idem_inbox_dead()',
                'idem_inbox_done(uuid[],uuid)',
                'idem_inbox_extend(uuid,interval)',
                'idem_inbox_fail(uuid,text,interval,uuid)',
                'idem_inbox_receive(text,text,jsonb,jsonb)',
                'idem_inbox_replay(text,timestamp with time zone,timestamp with time zone)',
                'idem_is_replay_safe(regprocedure,jsonb[],text,text)',
                'idem_maintain()',
                'idem_outbox_ack(uuid[],uuid,text)',
                'idem_outbox_claim(integer,interval,text[],text)',
                'idem_outbox_dead()',
                'idem_outbox_discard(uuid[],text)',
                'idem_outbox_emit(text,text,text,jsonb,jsonb)',
                'idem_outbox_emit_many(text,text[],text[],jsonb[],jsonb[])',
                'idem_outbox_extend(uuid,interval,text)',
                'idem_outbox_nack(uuid,text,interval,uuid,text)',
                'idem_outbox_redrive(uuid[],text)',
                'idem_outbox_subscribe(text,text[],text,text)',
                'idem_outbox_unsubscribe(text)',
                'idem_release(text,text)',
                'idem_request_abandon(text,text,integer)',
                'idem_request_begin(text,text,jsonb,interval,interval,text)',
                'idem_request_checkpoint(text,text,integer,text,jsonb)',
                'idem_request_complete(text,text,jsonb,integer,integer,text,jsonb)',
                'idem_request_extend(text,text,integer,interval)',
                'idem_request_fence(text,text,integer)',
                'idem_shard_partition(text,integer)',
                'idem_stats_reset(boolean)',
                'idem_transition(regclass,anyelement,text)',
                'idem_unguard(regclass)',
                'idem_upsert(anyelement,name)',
                'idempotency.cached_partitions()',
                'idempotency.current_settings()',
                'idempotency.current_store_settings()',
                'idempotency.filter_status()',
                'idempotency.guard_stats()',
                'idempotency.transition_guard()',
                'idempotency.version_guard()'],
          'the functions PUBLIC may execute');
SELECT is(ARRAY(SELECT fn FROM ext_functions WHERE prosecdef AND grantees ~ '(^|,)PUBLIC(,|$)'),
          ARRAY[]::text[], 'no SECURITY DEFINER function is executable by PUBLIC');

-- granted to a role by name: the monitoring's functions
SELECT is(ARRAY(SELECT format('%s | %s', fn, grantees) FROM ext_functions
                 WHERE grantees <> '' AND grantees !~ '(^|,)PUBLIC(,|$)' ORDER BY fn),
          ARRAY['idempotency.inbox_partition_pinned(regclass) | pg_monitor',
                'idempotency.live_scopes() | pg_monitor',
                'idempotency.outbox_partition_pinned(regclass) | pg_monitor',
                'idempotency.outbox_partition_pinned_by(regclass) | pg_monitor',
                'idempotency.stats_counters() | pg_monitor',
                'idempotency.stats_info() | pg_monitor',
                'idempotency.stats_rows() | pg_monitor'],
          'the functions granted to a named role');

-- tables and views: no application role holds a right on any of them;
-- pg_monitor reads the views (and so does a role granted the monitor
-- capability, which gets the same rights), everyone the shard map
SELECT is(ARRAY(SELECT format('%s | %s | %s', c.oid::regclass,
                              CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE pg_get_userbyid(a.grantee) END,
                              a.privilege_type)
                  FROM pg_depend d
                  JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'idempotency'
                  JOIN pg_class c ON c.oid = d.objid,
                       aclexplode(c.relacl) a
                 WHERE d.classid = 'pg_class'::regclass AND d.deptype = 'e'
                   AND a.grantee <> c.relowner
                 ORDER BY 1),
          ARRAY['idempotency.capability_grants | pg_monitor | SELECT',
                'idempotency.consumers | pg_monitor | SELECT',
                'idempotency.inbox_backlog | pg_monitor | SELECT',
                'idempotency.outbox_backlog | pg_monitor | SELECT',
                'idempotency.outbox_subscriptions_status | pg_monitor | SELECT',
                'idempotency.partitions | pg_monitor | SELECT',
                'idempotency.shard_ownership | PUBLIC | SELECT',
                'idempotency.stats | pg_monitor | SELECT'],
          'the rights on the extension''s tables and views');

SELECT * FROM finish();
ROLLBACK;
