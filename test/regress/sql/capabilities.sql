-- Capabilities (SPEC section 10, doc/reference.md "Capabilities"): the
-- whole matrix of public functions x roles, then the attacks of issue 22,
-- each refused.  Every call of the matrix runs in a subtransaction that is
-- rolled back, so each starts from the same state; an outcome is 'ok: '
-- and the call's value, or the SQLSTATE and the hint.
CREATE EXTENSION idempotency;

CREATE FUNCTION pg_temp.as_role(r text, sql text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    res text;
    hint text;
BEGIN
    BEGIN
        IF r IS NOT NULL THEN
            EXECUTE format('SET LOCAL ROLE %I', r);
        END IF;
        IF sql ~* '^\s*(select|values|with)\M' THEN
            EXECUTE sql INTO res;
        ELSE
            EXECUTE sql;
        END IF;
        res := 'ok: ' || coalesce(res, '-');
        RAISE EXCEPTION USING ERRCODE = 'P0099';    -- undo the call
    EXCEPTION
        WHEN SQLSTATE 'P0099' THEN NULL;
        WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS hint = PG_EXCEPTION_HINT;
            res := SQLSTATE || coalesce(' ' || nullif(hint, ''), '');
    END;
    RETURN res;
END
$$;

-- one role per capability, one with none, one limited to other names
CREATE ROLE cap_none;
CREATE ROLE cap_handler;
CREATE ROLE cap_relay;
CREATE ROLE cap_operator;
CREATE ROLE cap_monitor;
CREATE ROLE cap_limited;
SELECT idem_grant('cap_handler', 'handler');
SELECT idem_grant('cap_relay', 'relay');
SELECT idem_grant('cap_operator', 'operator');
SELECT idem_grant('cap_monitor', 'monitor');
SELECT idem_grant('cap_limited', 'handler', scopes => ARRAY['other:*'],
                  aggregate_types => ARRAY['other'], sources => ARRAY['other']);
SELECT idem_grant('cap_limited', 'relay', aggregate_types => ARRAY['other'], sources => ARRAY['other*']);
SELECT idem_grant('cap_limited', 'operator', scopes => ARRAY['other'],
                  aggregate_types => ARRAY['other'], sources => ARRAY['other']);
SELECT role, capability, scopes, aggregate_types, sources
  FROM idempotency.capability_grants ORDER BY role, capability;

-- what the calls act on: a claim, events of type order (one leased), inbox
-- messages of source src (one leased), a started request, a guarded table
SELECT idem_claim('k', 's');
SELECT id AS ev1 FROM idem_outbox_emit('order', '1', 'created', '{}') \gset
SELECT lease_token AS otok FROM idem_outbox_claim(1) \gset
SELECT id AS ev9 FROM idem_outbox_emit('order', '9', 'created', '{}') \gset
SELECT idem_inbox_receive('src', 'm1', '{}');
SELECT lease_token AS itok, id AS msg1 FROM idem_inbox_claim(1) \gset
SELECT idem_inbox_receive('src', 'm9', '{}');
SELECT status, attempt FROM idem_request_begin('rk', 's');
CREATE TABLE public.cap_acct (id int PRIMARY KEY, balance int, version int, state text);
GRANT ALL ON public.cap_acct TO PUBLIC;
INSERT INTO public.cap_acct VALUES (1, 0, 1, 'open');
SELECT idem_guard_version('public.cap_acct');

CREATE TEMP TABLE calls (n serial, fn text, sql text);
INSERT INTO calls (fn, sql) VALUES
  -- handler
  ('idem_claim', $$SELECT idem_claim('new', 's')$$),
  ('idem_claim_many', $$SELECT count(*) FROM idem_claim_many(ARRAY['n1', 'n2'], 's')$$),
  ('idem_claimed', $$SELECT idem_claimed('k', 's') IS NOT NULL$$),
  ('idem_outbox_emit', $$SELECT (idem_outbox_emit('order', '2', 'created', '{}')).seq$$),
  ('idem_outbox_emit_many', $$SELECT count(*) FROM idem_outbox_emit_many('order', ARRAY['3'], ARRAY['created'], ARRAY['{}'::jsonb])$$),
  ('idem_inbox_receive', $$SELECT idem_inbox_receive('src', 'm2', '{}')$$),
  ('idem_request_begin', $$SELECT status FROM idem_request_begin('rk2', 's')$$),
  ('idem_request_checkpoint', $$SELECT idem_request_checkpoint('rk', 's', 1, 'step')$$),
  ('idem_request_fence', $$SELECT idem_request_fence('rk', 's', 1)$$),
  ('idem_request_extend', $$SELECT idem_request_extend('rk', 's', 1, '1 minute')$$),
  ('idem_request_complete', $$SELECT idem_request_complete('rk', 's', '{}', 1)$$),
  ('idem_request_abandon', $$SELECT idem_request_abandon('rk', 's')$$),
  -- relay
  ('idem_outbox_claim', $$SELECT count(*) FROM idem_outbox_claim()$$),
  ('idem_outbox_claim(types)', $$SELECT count(*) FROM idem_outbox_claim(aggregate_types => ARRAY['order'])$$),
  ('idem_outbox_ack', format($$SELECT idem_outbox_ack(ARRAY[%L::uuid], %L)$$, :'ev1', :'otok')),
  ('idem_outbox_nack', format($$SELECT idem_outbox_nack(%L, 'boom', lease_token => %L)$$, :'ev1', :'otok')),
  ('idem_outbox_extend', format($$SELECT idem_outbox_extend(%L, '1 minute')$$, :'otok')),
  ('idem_inbox_claim', $$SELECT count(*) FROM idem_inbox_claim()$$),
  ('idem_inbox_claim(sources)', $$SELECT count(*) FROM idem_inbox_claim(sources => ARRAY['src'])$$),
  ('idem_inbox_done', format($$SELECT idem_inbox_done(ARRAY[%L::uuid], %L)$$, :'msg1', :'itok')),
  ('idem_inbox_fail', format($$SELECT idem_inbox_fail(%L, 'boom', lease_token => %L)$$, :'msg1', :'itok')),
  ('idem_inbox_extend', format($$SELECT idem_inbox_extend(%L, '1 minute')$$, :'itok')),
  -- operator
  ('idem_release', $$SELECT idem_release('k', 's')$$),
  ('idem_outbox_redrive', format($$SELECT idem_outbox_redrive(ARRAY[%L::uuid])$$, :'ev1')),
  ('idem_outbox_discard', format($$SELECT idem_outbox_discard(ARRAY[%L::uuid])$$, :'ev1')),
  ('idem_inbox_replay', $$SELECT idem_inbox_replay('src', '-infinity', 'infinity')$$),
  ('idem_outbox_dead', $$SELECT count(*) FROM idem_outbox_dead()$$),
  ('idem_inbox_dead', $$SELECT count(*) FROM idem_inbox_dead()$$),
  ('idem_maintain', $$SELECT count(*) >= 0 FROM idem_maintain()$$),
  ('idem_configure', $$SELECT idem_configure(premake => 3)$$),
  ('idem_configure_scope', $$SELECT idem_configure_scope('cap:*', '8 days')$$),
  ('idem_stats_reset', $$SELECT idem_stats_reset()$$),
  -- monitor: the views
  ('idempotency.stats', $$SELECT count(*) > 0 FROM idempotency.stats$$),
  ('idempotency.consumers', $$SELECT count(*) FROM idempotency.consumers$$),
  ('idempotency.outbox_backlog', $$SELECT count(*) FROM idempotency.outbox_backlog$$),
  ('idempotency.inbox_backlog', $$SELECT count(*) FROM idempotency.inbox_backlog$$),
  ('idempotency.partitions', $$SELECT count(*) > 0 FROM idempotency.partitions$$),
  ('idempotency.capability_grants', $$SELECT count(*) FROM idempotency.capability_grants$$),
  -- guards: the role's own table rights, no capability
  ('idem_upsert', $$SELECT idem_upsert(ROW(1, 5, 2, 'open')::public.cap_acct)$$),
  -- owners only
  ('idem_grant', $$SELECT idem_grant('cap_none', 'handler')$$),
  ('idem_revoke', $$SELECT idem_revoke('cap_handler')$$);

SELECT c.fn, coalesce(r, '(owner)') AS role, pg_temp.as_role(r, c.sql) AS outcome
  FROM calls c,
       unnest(ARRAY['cap_none', 'cap_handler', 'cap_relay', 'cap_operator', 'cap_monitor',
                    'cap_limited', NULL]) WITH ORDINALITY AS x(r, o)
 ORDER BY c.n, x.o;

-- a grant to a group role covers its members; revoking it ends that
CREATE ROLE cap_group;
CREATE ROLE cap_member IN ROLE cap_group;
SELECT pg_temp.as_role('cap_member', $$SELECT idem_claim('g', 's')$$) AS before_grant;
SELECT idem_grant('cap_group', 'handler', scopes => ARRAY['s']);
SELECT pg_temp.as_role('cap_member', $$SELECT idem_claim('g', 's')$$) AS member_of_grantee;
SELECT pg_temp.as_role('cap_member', $$SELECT idem_claim('g', 't')$$) AS other_scope;
SELECT idem_revoke('cap_group');
SELECT pg_temp.as_role('cap_member', $$SELECT idem_claim('g', 's')$$) AS after_revoke;

-- bad input: 22004, 22023, 42704, and nothing stored
SELECT count(*) AS grants_before FROM idempotency.capabilities \gset
SELECT pg_temp.as_role(NULL, $$SELECT idem_grant(NULL, 'handler')$$);
SELECT pg_temp.as_role(NULL, $$SELECT idem_grant('cap_none', NULL)$$);
SELECT pg_temp.as_role(NULL, $$SELECT idem_grant('cap_none', 'admin')$$);
SELECT pg_temp.as_role(NULL, $$SELECT idem_grant('cap_none', '')$$);
SELECT pg_temp.as_role(NULL, $$SELECT idem_grant('cap_none', 'handler', scopes => ARRAY['a*b'])$$);
SELECT pg_temp.as_role(NULL, $$SELECT idem_grant('cap_none', 'handler', scopes => ARRAY[''])$$);
SELECT pg_temp.as_role(NULL, $$SELECT idem_grant('cap_none', 'handler', sources => ARRAY[NULL])$$);
SELECT pg_temp.as_role(NULL, $$SELECT idem_grant('cap_none', 'handler', scopes => ARRAY[repeat('x', 64)])$$);
SELECT pg_temp.as_role(NULL, $$SELECT idem_grant('cap_none', 'handler', scopes => ARRAY[['a'], ['b']])$$);
SELECT pg_temp.as_role(NULL, $$SELECT idem_grant('cap_none', 'monitor', scopes => ARRAY['a'])$$);
SELECT pg_temp.as_role(NULL, $$SELECT idem_grant('no_such_role', 'handler')$$);
SELECT pg_temp.as_role(NULL, $$SELECT idem_grant(4000000000::oid::regrole, 'handler')$$);
SELECT pg_temp.as_role(NULL, $$SELECT idem_revoke(NULL)$$);
SELECT pg_temp.as_role(NULL, $$SELECT idem_revoke('cap_none', 'admin')$$);
SELECT count(*) - :grants_before AS grants_added FROM idempotency.capabilities;
-- an empty limit allows nothing on its axis; a grant replaces the limits
SELECT idem_grant('cap_none', 'handler', scopes => '{}');
SELECT pg_temp.as_role('cap_none', $$SELECT idem_claim('e', 's')$$) AS empty_limit;
SELECT idem_grant('cap_none', 'handler', scopes => ARRAY['s']);
SELECT pg_temp.as_role('cap_none', $$SELECT idem_claim('e', 's')$$) AS replaced;
SELECT idem_revoke('cap_none', 'handler') AS revoked, idem_revoke('cap_none') AS none_left;

-- a dropped role's rows are never used and go at the next grant
CREATE ROLE cap_gone;
SELECT idem_grant('cap_gone', 'handler');
DROP ROLE cap_gone;
SELECT count(*) AS listed FROM idempotency.capability_grants WHERE role = 'cap_gone';
SELECT count(*) AS stored_before FROM idempotency.capabilities \gset
SELECT idem_grant('cap_none', 'monitor');
SELECT count(*) - :stored_before AS stored_change FROM idempotency.capabilities;
SELECT idem_revoke('cap_none');

-------- the attacks of issue 22, each refused --------

-- 1. No table right, so none of the 1.0-era sabotage works: pre-marking
-- another aggregate delivered, jumping its seq, reading its events,
-- deleting or locking every scope's claims, rewriting a stored response.
-- Even with USAGE on the schema (which no capability needs) each is 42501.
GRANT USAGE ON SCHEMA idempotency TO cap_handler;
SELECT a.what, pg_temp.as_role('cap_handler', a.sql) AS outcome
  FROM (VALUES
    (1, 'pre-mark delivered', $$INSERT INTO idempotency.outbox_deliveries (aggregate_type, aggregate_id, acked_seq) VALUES ('order', '9', 1000)$$),
    (2, 'jump a seq', $$UPDATE idempotency.outbox_sequences SET last_seq = 1000$$),
    (3, 'read events', $$SELECT count(*) FROM idempotency.outbox_events$$),
    (4, 'delete claims', $$DELETE FROM idempotency.claims$$),
    (5, 'lock claims', $$LOCK idempotency.claims IN ACCESS EXCLUSIVE MODE$$),
    (6, 'rewrite a response', $$UPDATE idempotency.requests SET response = '{"evil": 1}'$$),
    (7, 'read messages', $$SELECT count(*) FROM idempotency.inbox_messages$$),
    (8, 'grant itself', $$INSERT INTO idempotency.capabilities VALUES ('cap_handler', 'operator')$$)
  ) a(n, what, sql) ORDER BY a.n;
REVOKE USAGE ON SCHEMA idempotency FROM cap_handler;
-- nor does any table have a privilege for PUBLIC (but the shard map, which
-- every routed call may read: doc/scale-out.md)
SELECT c.relname, (SELECT string_agg(a.privilege_type, ',') FROM aclexplode(c.relacl) a
                    WHERE a.grantee = 0) AS public_privileges
  FROM pg_class c JOIN pg_depend d ON d.objid = c.oid AND d.deptype = 'e'
       JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'idempotency'
 WHERE c.relkind IN ('r', 'p') AND EXISTS (SELECT FROM aclexplode(c.relacl) a WHERE a.grantee = 0)
 ORDER BY 1;

-- 2. Scope limits hold through every function: a handler of billing:* and
-- an operator of billing:* reach no other scope's claims or requests
CREATE ROLE cap_billing;
SELECT idem_grant('cap_billing', 'handler', scopes => ARRAY['billing:*']);
SELECT idem_grant('cap_billing', 'operator', scopes => ARRAY['billing:*']);
SELECT idem_claim('victim-key', 'shipping');
SELECT status FROM idem_request_begin('victim-req', 'shipping');
SELECT idem_request_complete('victim-req', 'shipping', '{"paid": false}', 1);
SELECT pg_temp.as_role('cap_billing', $$SELECT idem_claim('k', 'billing:eu')$$) AS own_scope;
SELECT pg_temp.as_role('cap_billing', $$SELECT idem_claimed('victim-key', 'shipping')$$) AS probe_other;
SELECT pg_temp.as_role('cap_billing', $$SELECT idem_release('victim-key', 'shipping')$$) AS release_other;
SELECT pg_temp.as_role('cap_billing', $$SELECT idem_claim('victim-key', 'shipping')$$) AS claim_other;
SELECT pg_temp.as_role('cap_billing', $$SELECT idem_request_abandon('victim-req', 'shipping')$$) AS abandon_other;
SELECT pg_temp.as_role('cap_billing', $$SELECT status FROM idem_request_begin('victim-req', 'shipping')$$) AS read_other;
SELECT idem_claimed('victim-key', 'shipping') IS NOT NULL AS victim_claim_kept;
SELECT status, response FROM idem_request_begin('victim-req', 'shipping');

-- 3. A relay limited to type A never leases, acks, nacks or extends type B:
-- another type's event is as good as unknown (0, nothing changes)
CREATE ROLE cap_relay_a;
SELECT idem_grant('cap_relay_a', 'relay', aggregate_types => ARRAY['type_a']);
SELECT id AS b_ev FROM idem_outbox_emit('type_b', 'b1', 'created', '{}') \gset
SELECT id AS a_ev FROM idem_outbox_emit('type_a', 'a1', 'created', '{}') \gset
SET ROLE cap_relay_a;
SELECT aggregate_type, aggregate_id FROM idem_outbox_claim();
SELECT idem_outbox_ack(ARRAY[:'b_ev'::uuid]) AS acked_b;
SELECT idem_outbox_nack(:'b_ev', 'sabotage');
RESET ROLE;
SELECT lease_token AS b_tok FROM idem_outbox_claim(aggregate_types => ARRAY['type_b']) \gset
SET ROLE cap_relay_a;
SELECT idem_outbox_extend(:'b_tok', '1 hour') AS extended_b;
RESET ROLE;
SELECT pg_temp.as_role('cap_relay_a', $$SELECT count(*) FROM idem_outbox_claim(aggregate_types => ARRAY['type_b'])$$) AS ask_for_b;
SELECT aggregate_type, acked_seq, attempts, last_error
  FROM idempotency.outbox_deliveries WHERE aggregate_type LIKE 'type_%' ORDER BY 1;
SELECT lease_until < now() + interval '10 minutes' AS b_lease_not_extended
  FROM idempotency.outbox_deliveries WHERE aggregate_type = 'type_b';
-- a prefix limit filters the same way
SELECT idem_grant('cap_relay_a', 'relay', aggregate_types => ARRAY['type_a*']);
SELECT id AS a2_ev FROM idem_outbox_emit('type_a2', 'a2', 'created', '{}') \gset
SELECT pg_temp.as_role('cap_relay_a', $$SELECT string_agg(aggregate_type, ',' ORDER BY aggregate_type) FROM idem_outbox_claim()$$) AS prefix_claims;

-- 4. The same for inbox sources
CREATE ROLE cap_worker_a;
SELECT idem_grant('cap_worker_a', 'relay', sources => ARRAY['src_a']);
SELECT idem_grant('cap_worker_a', 'operator', sources => ARRAY['src_a']);
SELECT idem_inbox_receive('src_b', 'b1', '{}');
SELECT idem_inbox_receive('src_a', 'a1', '{}');
SELECT id AS b_msg FROM idempotency.inbox_messages WHERE source = 'src_b' \gset
SET ROLE cap_worker_a;
SELECT source, message_id FROM idem_inbox_claim();
SELECT idem_inbox_done(ARRAY[:'b_msg'::uuid]) AS done_b;
SELECT idem_inbox_fail(:'b_msg', 'sabotage');
RESET ROLE;
SELECT pg_temp.as_role('cap_worker_a', $$SELECT idem_inbox_replay('src_b', '-infinity', 'infinity')$$) AS replay_b;
SELECT source, done_at IS NULL AS not_done, attempts, last_error
  FROM idempotency.inbox_messages WHERE source = 'src_b';

-- 5. No internal SQL in what a user sees: a failure inside a function
-- (here: a read-only transaction, as a standby would give) shows the
-- function's error, with no "SQL statement" context
\set VERBOSITY default
BEGIN READ ONLY;
SELECT idem_outbox_ack(ARRAY[:'a_ev'::uuid]);
ROLLBACK;
BEGIN READ ONLY;
SELECT idem_inbox_done(ARRAY[:'b_msg'::uuid]);
ROLLBACK;

SET client_min_messages = warning;
DROP TABLE public.cap_acct;
SELECT idem_revoke(r::regrole) FROM unnest(ARRAY['cap_handler', 'cap_relay', 'cap_operator', 'cap_monitor',
    'cap_limited', 'cap_billing', 'cap_relay_a', 'cap_worker_a']) r \g /dev/null
DROP EXTENSION idempotency CASCADE;
DROP ROLE cap_none, cap_handler, cap_relay, cap_operator, cap_monitor, cap_limited,
    cap_group, cap_member, cap_billing, cap_relay_a, cap_worker_a;
RESET client_min_messages;
