-- pgTAP: the transactional outbox API (SPEC.md section 4): objects,
-- signatures, settings, and the outcome of every call and every bad input:
-- emit / emit_many / claim / ack / nack / extend / redrive / discard, dead
-- letters under both dead policies, backoff, outbox_mode, aggregate_types,
-- privileges.  Runs in one transaction that rolls back.  Time moves (always
-- forward) with the test-only setting idempotency.debug_clock_offset, which
-- shifts the extension's clock (leases, retry times, created_at).  Each block
-- uses its own aggregate types and claims only those, so blocks do not see
-- each other's events.
\ir include/begin.sql
-- load the library (it defines the settings)
DO $$ BEGIN PERFORM idempotency.current_settings(); END $$;

SELECT plan(352);

-- helpers -------------------------------------------------------------------

-- every event a claim handed out, tagged with the claim's name
CREATE TEMP TABLE got (
    call text, ord bigint, id uuid, aggregate_type text, aggregate_id text, seq bigint,
    event_type text, payload jsonb, headers jsonb, created_at timestamptz,
    attempts int, lease_token uuid, lease_until timestamptz);

-- pg_temp.claim(call, types, batch, lease): claim, remember the rows, return how many
CREATE FUNCTION pg_temp.claim(text, text[], int DEFAULT 100, interval DEFAULT '30 seconds')
RETURNS int LANGUAGE sql AS $$
    WITH c AS (
        INSERT INTO pg_temp.got
        SELECT $1, c.ord, c.id, c.aggregate_type, c.aggregate_id, c.seq, c.event_type, c.payload,
               c.headers, c.created_at, c.attempts, c.lease_token, c.lease_until
          FROM idem_outbox_claim($3, $4, $2) WITH ORDINALITY
               AS c(id, aggregate_type, aggregate_id, seq, event_type, payload, headers,
                    created_at, attempts, lease_token, lease_until, ord)
        RETURNING 1)
    SELECT count(*)::int FROM c
$$;
-- the lease token of a claim
CREATE FUNCTION pg_temp.tok(text) RETURNS uuid LANGUAGE sql AS $$
    SELECT lease_token FROM pg_temp.got WHERE call = $1 LIMIT 1
$$;
-- the ids a claim handed out (of one aggregate, or all), in hand-out order
CREATE FUNCTION pg_temp.ids(text, text DEFAULT NULL) RETURNS uuid[] LANGUAGE sql AS $$
    SELECT coalesce(array_agg(id ORDER BY ord), '{}') FROM pg_temp.got
     WHERE call = $1 AND ($2 IS NULL OR aggregate_id = $2)
$$;
-- what a claim handed out, as 'aggregate_id:seq' sorted, comma-separated
CREATE FUNCTION pg_temp.runs(text) RETURNS text LANGUAGE sql AS $$
    SELECT coalesce(string_agg(aggregate_id || ':' || seq, ',' ORDER BY aggregate_id, seq), '')
      FROM pg_temp.got WHERE call = $1
$$;
-- true if, within each aggregate, a claim's rows came in seq order, starting
-- from one point with no hole
CREATE FUNCTION pg_temp.in_order(text) RETURNS boolean LANGUAGE sql AS $$
    SELECT coalesce(bool_and(seq = prev + 1 OR prev IS NULL), true) FROM (
        SELECT seq, lag(seq) OVER (PARTITION BY aggregate_type, aggregate_id ORDER BY ord) AS prev
          FROM pg_temp.got WHERE call = $1) r
$$;
-- the id of a stored event
CREATE FUNCTION pg_temp.ev(text, text, bigint) RETURNS uuid LANGUAGE sql AS $$
    SELECT id FROM idempotency.outbox_events
     WHERE aggregate_type = $1 AND aggregate_id = $2 AND seq = $3
$$;
-- the delivery state of an aggregate
CREATE FUNCTION pg_temp.dl(text, text) RETURNS idempotency.outbox_deliveries LANGUAGE sql AS $$
    SELECT d FROM idempotency.outbox_deliveries d WHERE aggregate_type = $1 AND aggregate_id = $2
$$;
-- move the extension's clock forward by some seconds
CREATE FUNCTION pg_temp.advance(int) RETURNS int LANGUAGE sql AS $$
    SELECT set_config('idempotency.debug_clock_offset',
                      ((SELECT setting::int FROM pg_settings WHERE name = 'idempotency.debug_clock_offset') + $1)::text,
                      true);
    SELECT setting::int FROM pg_settings WHERE name = 'idempotency.debug_clock_offset'
$$;
-- the extension's clock now
CREATE FUNCTION pg_temp.ext_now() RETURNS timestamptz LANGUAGE sql AS $$
    SELECT clock_timestamp()
           + make_interval(secs => (SELECT setting::int FROM pg_settings WHERE name = 'idempotency.debug_clock_offset'))
$$;
-- the extension's clock at the start of the transaction (a lower bound)
CREATE FUNCTION pg_temp.ext_start() RETURNS timestamptz LANGUAGE sql AS $$
    SELECT now()
           + make_interval(secs => (SELECT setting::int FROM pg_settings WHERE name = 'idempotency.debug_clock_offset'))
$$;
-- the dead letters of an aggregate type, as 'aggregate_id:seq' sorted
CREATE FUNCTION pg_temp.dead(text) RETURNS text LANGUAGE sql AS $$
    SELECT coalesce(string_agg(aggregate_id || ':' || seq, ',' ORDER BY aggregate_id, seq), '')
      FROM idempotency.outbox_dead WHERE aggregate_type = $1
$$;
-- set an outbox setting for the rest of the transaction
CREATE FUNCTION pg_temp.setting(text, text) RETURNS text LANGUAGE sql AS $$
    SELECT set_config('idempotency.' || $1, $2, true)
$$;
-- failure cycle N of aggregate type $1: claim its batch, nack the first
-- event with error 'fail N' and retry_after $3 (the lease token fences it)
CREATE FUNCTION pg_temp.fail_head(text, int, interval) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    ids uuid[];
    tok uuid;
BEGIN
    SELECT array_agg(id), (array_agg(lease_token))[1] INTO ids, tok
      FROM idem_outbox_claim(10, '30 seconds', ARRAY[$1]);
    IF tok IS NULL THEN
        RAISE EXCEPTION '% cycle %: nothing claimed', $1, $2;
    END IF;
    PERFORM idem_outbox_nack(ids[1], 'fail ' || $2, $3, tok);
END $$;

-- 1. objects ----------------------------------------------------------------

SELECT has_type('idem_outbox_event', 'type idem_outbox_event exists');
SELECT is(ARRAY(SELECT a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                  FROM pg_attribute a JOIN pg_type t ON t.typrelid = a.attrelid
                 WHERE t.oid = 'idem_outbox_event'::regtype AND a.attnum > 0 AND NOT a.attisdropped
                 ORDER BY a.attnum),
          ARRAY['id uuid', 'aggregate_type text', 'aggregate_id text', 'seq bigint', 'event_type text',
                'payload jsonb', 'headers jsonb', 'created_at timestamp with time zone',
                'attempts integer', 'lease_token uuid', 'lease_until timestamp with time zone'],
          'idem_outbox_event has the columns of SPEC 4, in order');

SELECT has_function('idem_outbox_emit', ARRAY['text', 'text', 'text', 'jsonb', 'jsonb'], 'idem_outbox_emit(text, text, text, jsonb, jsonb)');
SELECT function_returns('idem_outbox_emit', ARRAY['text', 'text', 'text', 'jsonb', 'jsonb'], 'idem_outbox_event', 'idem_outbox_emit returns idem_outbox_event');
SELECT has_function('idem_outbox_emit_many', ARRAY['text', 'text[]', 'text[]', 'jsonb[]', 'jsonb[]'], 'idem_outbox_emit_many(text, text[], text[], jsonb[], jsonb[])');
SELECT function_returns('idem_outbox_emit_many', ARRAY['text', 'text[]', 'text[]', 'jsonb[]', 'jsonb[]'], 'setof idem_outbox_event', 'idem_outbox_emit_many returns setof idem_outbox_event');
SELECT has_function('idem_outbox_claim', ARRAY['integer', 'interval', 'text[]', 'text'], 'idem_outbox_claim(integer, interval, text[], text)');
SELECT function_returns('idem_outbox_claim', ARRAY['integer', 'interval', 'text[]', 'text'], 'setof idem_outbox_event', 'idem_outbox_claim returns setof idem_outbox_event');
SELECT has_function('idem_outbox_ack', ARRAY['uuid[]', 'uuid', 'text'], 'idem_outbox_ack(uuid[], uuid, text)');
SELECT function_returns('idem_outbox_ack', ARRAY['uuid[]', 'uuid', 'text'], 'integer', 'idem_outbox_ack returns integer');
SELECT has_function('idem_outbox_nack', ARRAY['uuid', 'text', 'interval', 'uuid', 'text'], 'idem_outbox_nack(uuid, text, interval, uuid, text)');
SELECT function_returns('idem_outbox_nack', ARRAY['uuid', 'text', 'interval', 'uuid', 'text'], 'void', 'idem_outbox_nack returns void');
SELECT has_function('idem_outbox_extend', ARRAY['uuid', 'interval', 'text'], 'idem_outbox_extend(uuid, interval, text)');
SELECT function_returns('idem_outbox_extend', ARRAY['uuid', 'interval', 'text'], 'integer', 'idem_outbox_extend returns integer');
SELECT has_function('idem_outbox_redrive', ARRAY['uuid[]', 'text'], 'idem_outbox_redrive(uuid[], text)');
SELECT function_returns('idem_outbox_redrive', ARRAY['uuid[]', 'text'], 'integer', 'idem_outbox_redrive returns integer');
SELECT has_function('idem_outbox_discard', ARRAY['uuid[]', 'text'], 'idem_outbox_discard(uuid[], text)');
SELECT function_returns('idem_outbox_discard', ARRAY['uuid[]', 'text'], 'integer', 'idem_outbox_discard returns integer');

SELECT is(pg_get_function_arguments('idem_outbox_emit(text, text, text, jsonb, jsonb)'::regprocedure),
          'aggregate_type text, aggregate_id text, event_type text, payload jsonb, headers jsonb DEFAULT ''{}''::jsonb',
          'idem_outbox_emit argument names and defaults');
SELECT is(pg_get_function_arguments('idem_outbox_emit_many(text, text[], text[], jsonb[], jsonb[])'::regprocedure),
          'aggregate_type text, aggregate_ids text[], event_types text[], payloads jsonb[], headers jsonb[] DEFAULT NULL::jsonb[]',
          'idem_outbox_emit_many argument names and defaults');
SELECT is(pg_get_function_arguments('idem_outbox_claim(integer, interval, text[], text)'::regprocedure),
          'batch integer DEFAULT 100, lease interval DEFAULT ''00:00:30''::interval, aggregate_types text[] DEFAULT NULL::text[], subscription text DEFAULT ''default''::text',
          'idem_outbox_claim argument names and defaults');
SELECT is(pg_get_function_arguments('idem_outbox_ack(uuid[], uuid, text)'::regprocedure),
          'ids uuid[], lease_token uuid DEFAULT NULL::uuid, subscription text DEFAULT ''default''::text',
          'idem_outbox_ack argument names and defaults');
SELECT is(pg_get_function_arguments('idem_outbox_nack(uuid, text, interval, uuid, text)'::regprocedure),
          'id uuid, error text, retry_after interval DEFAULT NULL::interval, lease_token uuid DEFAULT NULL::uuid, subscription text DEFAULT ''default''::text',
          'idem_outbox_nack argument names and defaults');
SELECT is(pg_get_function_arguments('idem_outbox_extend(uuid, interval, text)'::regprocedure),
          'lease_token uuid, lease interval, subscription text DEFAULT ''default''::text', 'idem_outbox_extend argument names');
SELECT is(pg_get_function_arguments('idem_outbox_redrive(uuid[], text)'::regprocedure),
          'ids uuid[], subscription text DEFAULT ''default''::text', 'idem_outbox_redrive argument names');
SELECT is(pg_get_function_arguments('idem_outbox_discard(uuid[], text)'::regprocedure),
          'ids uuid[], subscription text DEFAULT ''default''::text', 'idem_outbox_discard argument names');

SELECT is_partitioned('idempotency', 'outbox_events', 'idempotency.outbox_events is partitioned');
SELECT has_view('idempotency', 'outbox_dead', 'view idempotency.outbox_dead exists');
SELECT is(ARRAY(SELECT attname::text FROM pg_attribute
                 WHERE attrelid = 'idempotency.outbox_dead'::regclass AND attnum > 0 ORDER BY attnum),
          ARRAY['id', 'aggregate_type', 'aggregate_id', 'seq', 'event_type', 'payload', 'headers',
                'created_at', 'attempts', 'last_error', 'dead_at', 'subscription'],
          'idempotency.outbox_dead columns');
SELECT has_column('idempotency', 'partitions', 'store', 'idempotency.partitions has column store');

-- settings: defaults, contexts, validation
SELECT is(current_setting('idempotency.outbox_max_attempts'), '10', 'outbox_max_attempts defaults to 10');
SELECT is(current_setting('idempotency.outbox_dead_policy'), 'block', 'outbox_dead_policy defaults to block');
SELECT is(current_setting('idempotency.outbox_notify'), 'commit', 'outbox_notify defaults to commit');
SELECT is(current_setting('idempotency.outbox_mode'), 'table', 'outbox_mode defaults to table');
SELECT is(current_setting('idempotency.outbox_keep_undelivered'), 'on', 'outbox_keep_undelivered defaults to on');
SELECT is(ARRAY(SELECT name || '=' || context FROM pg_settings
                 WHERE name LIKE 'idempotency.outbox%' OR name = 'idempotency.debug_clock_offset' ORDER BY name),
          ARRAY['idempotency.debug_clock_offset=superuser', 'idempotency.outbox_dead_policy=user',
                'idempotency.outbox_keep_undelivered=user',
                'idempotency.outbox_max_attempts=user', 'idempotency.outbox_max_lag=user',
                'idempotency.outbox_mode=user', 'idempotency.outbox_notify=user',
                'idempotency.outbox_notify_window=user'],
          'outbox settings are user settings; the test clock is superuser only');
SELECT is(ARRAY(SELECT name || ':' || array_to_string(enumvals, '|') FROM pg_settings
                 WHERE name IN ('idempotency.outbox_dead_policy', 'idempotency.outbox_notify', 'idempotency.outbox_mode')
                 ORDER BY name),
          ARRAY['idempotency.outbox_dead_policy:block|skip', 'idempotency.outbox_mode:table|wal|both',
                'idempotency.outbox_notify:commit|coalesce|off'],
          'enum settings take the values of SPEC 4, and outbox_notify coalesce besides');
SELECT throws_ok($$SET idempotency.outbox_max_attempts = 0$$, '22023', NULL, 'outbox_max_attempts 0 is refused');
SELECT throws_ok($$SET idempotency.outbox_max_attempts = 1001$$, '22023', NULL, 'outbox_max_attempts 1001 is refused');
SELECT throws_ok($$SET idempotency.outbox_dead_policy = 'sometimes'$$, '22023', NULL, 'an unknown dead policy is refused');
SELECT throws_ok($$SET idempotency.outbox_notify = 'always'$$, '22023', NULL, 'an unknown notify value is refused');
SELECT throws_ok($$SET idempotency.outbox_mode = 'kafka'$$, '22023', NULL, 'an unknown outbox mode is refused');

-- the partitions view lists the outbox store; CREATE EXTENSION made the
-- current outbox partition and premake more, and a round has nothing to add
CREATE TEMP TABLE round0 AS SELECT * FROM idem_maintain();
SELECT is((SELECT count(*)::int FROM round0 WHERE object LIKE 'idempotency.outbox%'), 0,
          'CREATE EXTENSION made the outbox partitions: a round right after it does nothing');
SELECT is((SELECT count(*)::int FROM idempotency.outbox_partitions),
          (SELECT premake + 1 FROM idempotency.current_settings()),
          'the current outbox partition and premake more');
SELECT is((SELECT count(DISTINCT bucket)::int FROM idempotency.outbox_partitions),
          (SELECT count(*)::int FROM idempotency.outbox_partitions),
          'every outbox partition has a bucket of its own');
SELECT ok(ARRAY(SELECT DISTINCT store FROM idempotency.partitions) @> ARRAY['claims', 'outbox'],
          'idempotency.partitions lists the claims and the outbox among its stores');
SELECT is((SELECT count(*)::int FROM idempotency.partitions WHERE store = 'outbox' AND state = 'current'), 1,
          'one current outbox partition');
SELECT is((SELECT count(*)::int FROM idempotency.partitions WHERE store = 'outbox' AND state = 'future'),
          (SELECT premake FROM idempotency.current_settings()),
          'premake future outbox partitions (same setting as claims)');
SELECT is((SELECT count(*)::int FROM idempotency.partitions p JOIN idempotency.outbox_partitions o ON o.relid = p.partition
            WHERE p.store = 'outbox' AND p.lower = o.lower AND p.upper = o.upper),
          (SELECT count(*)::int FROM idempotency.outbox_partitions),
          'every registered outbox partition is in the view with its range');
SELECT is((SELECT count(*)::int FROM (
              SELECT upper, lead(lower) OVER (ORDER BY lower) AS next_lower FROM idempotency.outbox_partitions) r
            WHERE next_lower IS NOT NULL AND next_lower <> upper), 0,
          'outbox partition ranges are contiguous');
SELECT is((SELECT count(*)::int FROM idem_maintain() WHERE object LIKE 'idempotency.outbox%'), 0,
          'a second round right away has nothing to do for the outbox');

-- 2. emit -------------------------------------------------------------------

CREATE TEMP TABLE e AS
SELECT 'e1'::text AS tag, * FROM idem_outbox_emit('order', 'o-1', 'created', '{"n": 1}');
INSERT INTO e SELECT 'e2', * FROM idem_outbox_emit('order', 'o-1', 'paid', '{"n": 2}', '{"trace": "t1"}');
INSERT INTO e SELECT 'e3', * FROM idem_outbox_emit('order', 'o-2', 'created', '[1, 2]');
INSERT INTO e SELECT 'e4', * FROM idem_outbox_emit('invoice', 'o-1', 'created', '"x"');
INSERT INTO e SELECT 'e5', * FROM idem_outbox_emit('order', 'o-3', 'created', '{}', NULL);

SELECT is(ARRAY(SELECT seq FROM e ORDER BY tag), ARRAY[1, 2, 1, 1, 1]::bigint[],
          'seq counts per (aggregate_type, aggregate_id) from 1');
SELECT ok((SELECT aggregate_type = 'order' AND aggregate_id = 'o-1' AND event_type = 'created'
                  AND payload = '{"n": 1}' AND headers = '{}' FROM e WHERE tag = 'e1'),
          'emit returns the event as given; headers default to {}');
SELECT is((SELECT headers FROM e WHERE tag = 'e2'), '{"trace": "t1"}'::jsonb, 'emit keeps the headers given');
SELECT is((SELECT headers FROM e WHERE tag = 'e5'), '{}'::jsonb, 'NULL headers become {}');
SELECT is((SELECT payload FROM e WHERE tag = 'e3'), '[1, 2]'::jsonb, 'a payload need not be an object');
SELECT ok((SELECT bool_and(attempts = 0 AND lease_token IS NULL AND lease_until IS NULL) FROM e),
          'an emitted event has attempts 0 and no lease');
SELECT ok((SELECT bool_and(substr(id::text, 15, 1) = '7' AND substr(id::text, 20, 1) IN ('8', '9', 'a', 'b')) FROM e),
          'event ids are UUIDv7');
SELECT is((SELECT count(DISTINCT id)::int FROM e), 5, 'event ids are distinct');
SELECT ok((SELECT bool_and(('x' || substr(replace(id::text, '-', ''), 1, 12))::bit(48)::bigint
                           = floor(extract(epoch FROM created_at) * 1000)::bigint) FROM e),
          'the id carries created_at (its millisecond timestamp)');
SELECT ok((SELECT bool_and(created_at BETWEEN now() AND clock_timestamp()) FROM e),
          'created_at is the time of the emit');
SELECT is((SELECT count(*)::int FROM e JOIN idempotency.outbox_events o USING (id)
            WHERE o.aggregate_type = e.aggregate_type AND o.aggregate_id = e.aggregate_id AND o.seq = e.seq
              AND o.event_type = e.event_type AND o.payload = e.payload AND o.headers = e.headers
              AND o.created_at = e.created_at AND o.txid = pg_current_xact_id()),
          5, 'each emit stored one row, as returned, with the emitting transaction''s txid');
SELECT is((SELECT count(*)::int FROM idempotency.outbox_sequences WHERE aggregate_type = 'order'),
          0, 'table-mode emits write no counter (seq comes from the events)');

-- rollback to savepoint: no gap
SAVEPOINT s;
SELECT is((idem_outbox_emit('order', 'o-1', 'rolled back', '{}')).seq, 3::bigint, 'emit in a savepoint');
ROLLBACK TO SAVEPOINT s;
SELECT is((idem_outbox_emit('order', 'o-1', 'shipped', '{}')).seq, 3::bigint,
          'after ROLLBACK TO SAVEPOINT the seq is reused: no gap');
SELECT is((SELECT count(*)::int FROM idempotency.outbox_events WHERE event_type = 'rolled back'), 0,
          'the rolled-back event is gone');
-- ... also in a failed plpgsql block
DO $$
BEGIN
    BEGIN
        PERFORM idem_outbox_emit('order', 'o-2', 'failed block', '{}');
        RAISE EXCEPTION 'handler failed';
    EXCEPTION WHEN raise_exception THEN
        NULL;
    END;
END $$;
SELECT is((idem_outbox_emit('order', 'o-2', 'paid', '{}')).seq, 2::bigint,
          'an emit in a failed exception block leaves no gap');

-- the extension's clock gives created_at
SELECT pg_temp.advance(3600) \g /dev/null
SELECT ok((SELECT created_at BETWEEN now() + interval '3600 seconds' AND clock_timestamp() + interval '3600 seconds'
             FROM idem_outbox_emit('late', 'l-1', 'created', '{}')),
          'created_at follows the extension''s clock');

-- bad input; failures leave no trace
SELECT throws_ok($$SELECT idem_outbox_emit(NULL, 'b-1', 'x', '{}')$$, '22004', NULL, 'emit: NULL aggregate_type raises 22004');
SELECT throws_ok($$SELECT idem_outbox_emit('bad', NULL, 'x', '{}')$$, '22004', NULL, 'emit: NULL aggregate_id raises 22004');
SELECT throws_ok($$SELECT idem_outbox_emit('bad', 'b-1', NULL, '{}')$$, '22004', NULL, 'emit: NULL event_type raises 22004');
SELECT throws_ok($$SELECT idem_outbox_emit('bad', 'b-1', 'x', NULL)$$, '22004', NULL, 'emit: NULL payload raises 22004');
SELECT throws_ok($$SELECT idem_outbox_emit('', 'b-1', 'x', '{}')$$, '22023', NULL, 'emit: empty aggregate_type raises 22023');
SELECT throws_ok($$SELECT idem_outbox_emit('bad', '', 'x', '{}')$$, '22023', NULL, 'emit: empty aggregate_id raises 22023');
SELECT throws_ok($$SELECT idem_outbox_emit('bad', 'b-1', '', '{}')$$, '22023', NULL, 'emit: empty event_type raises 22023');
SELECT throws_ok($$SELECT idem_outbox_emit('bad', 'b-1', 'x', '{}', '[]')$$, '22023', NULL, 'emit: array headers raise 22023');
SELECT throws_ok($$SELECT idem_outbox_emit('bad', 'b-1', 'x', '{}', '"h"')$$, '22023', NULL, 'emit: scalar headers raise 22023');
SELECT throws_ok($$SELECT idem_outbox_emit(repeat('t', 64), 'b-1', 'x', '{}')$$, '22001', NULL, 'emit: a 64-byte aggregate_type raises 22001');
SELECT throws_ok($$SELECT idem_outbox_emit(repeat('é', 32), 'b-1', 'x', '{}')$$, '22001', NULL,
                 'emit: aggregate_type length counts bytes (32 characters, 64 bytes: 22001)');
SELECT throws_ok($$SELECT idem_outbox_emit('bad', repeat('i', 2001), 'x', '{}')$$, '22001', NULL, 'emit: a 2001-byte aggregate_id raises 22001');
SELECT throws_ok($$SELECT idem_outbox_emit('bad', 'b-1', repeat('e', 256), '{}')$$, '22001', NULL, 'emit: a 256-byte event_type raises 22001');
SELECT throws_ok($$SELECT idem_outbox_emit('bad', 'b-1', 'x', 'not json')$$, '22P02', NULL, 'emit: a payload that is not JSON raises 22P02');
SELECT throws_ok($$SELECT idem_outbox_emit('bad', 'b-1', 'x', 'text'::text)$$, '42883', NULL, 'emit: a text payload is not accepted (42883)');
SELECT is((SELECT count(*)::int FROM idempotency.outbox_events WHERE aggregate_type = 'bad')
          + (SELECT count(*)::int FROM idempotency.outbox_sequences WHERE aggregate_type = 'bad'), 0,
          'failed emits left no event and no counter');
-- a read-only transaction (as on a standby) emits nothing, whether the
-- aggregate has events or not
SELECT lives_ok($$SELECT idem_outbox_emit('ro', 'r-1', 'x', '{}')$$, 'emit: r-1 has an event');
SELECT throws_ok($$SET LOCAL transaction_read_only = on; SELECT idem_outbox_emit('ro', 'r-1', 'ro', '{}')$$,
                 '25006', NULL, 'emit in a read-only transaction raises 25006');
SELECT throws_ok($$SET LOCAL transaction_read_only = on;
                   SELECT idem_outbox_emit_many('ro', ARRAY['r-1', 'r-2'], ARRAY['ro', 'ro'], ARRAY['{}', '{}']::jsonb[])$$,
                 '25006', NULL, 'emit_many in a read-only transaction raises 25006');
SELECT is((SELECT array_agg(seq) FROM idempotency.outbox_events WHERE aggregate_type = 'ro')
          || (SELECT array_agg(last_seq) FROM idempotency.outbox_sequences WHERE aggregate_type = 'ro'),
          ARRAY[1]::bigint[], 'read-only emits left no event and wrote no counter');
SELECT is(ARRAY(SELECT (idem_outbox_emit(t, i, e, '{}')).seq
                  FROM (VALUES (repeat('t', 63), 'l', 'x'), ('long', repeat('i', 2000), 'x'),
                               ('long', 'l', repeat('e', 255))) v(t, i, e)),
          ARRAY[1, 1, 1]::bigint[], 'the longest aggregate_type, aggregate_id and event_type are accepted');

-- 3. emit_many --------------------------------------------------------------

SELECT is(ARRAY(SELECT aggregate_id || ':' || seq || ':' || event_type || ':' || payload::text
                  FROM idem_outbox_emit_many('cart', ARRAY['c1', 'c2', 'c1'], ARRAY['add', 'add', 'remove'],
                                             ARRAY['{"i": 1}', '{"i": 2}', '{"i": 3}']::jsonb[])),
          ARRAY['c1:1:add:{"i": 1}', 'c2:1:add:{"i": 2}', 'c1:2:remove:{"i": 3}'],
          'emit_many emits in array order, seq per aggregate');
SELECT is(ARRAY(SELECT headers FROM idempotency.outbox_events WHERE aggregate_type = 'cart' ORDER BY aggregate_id, seq),
          ARRAY['{}', '{}', '{}']::jsonb[], 'emit_many without headers stores {}');
SELECT is(ARRAY(SELECT headers::text || attempts || (lease_token IS NULL)
                  FROM idem_outbox_emit_many('cart', ARRAY['c3', 'c3'], ARRAY['a', 'b'], ARRAY['{}', '{}']::jsonb[],
                                             ARRAY['{"h": 1}', '{"h": 2}']::jsonb[])),
          ARRAY['{"h": 1}0true', '{"h": 2}0true'], 'emit_many takes headers per element; attempts 0, no lease');
SELECT is((idem_outbox_emit('cart', 'c1', 'checkout', '{}')).seq, 3::bigint, 'emit and emit_many share the counter');
SELECT is((SELECT count(DISTINCT txid)::int FROM idempotency.outbox_events WHERE aggregate_type = 'cart'), 1,
          'a batch is written by the calling transaction');
SELECT is((SELECT count(*)::int FROM idem_outbox_emit_many('cart', '{}', '{}', '{}')), 0,
          'emit_many with empty arrays emits nothing');
SELECT throws_ok($$SELECT idem_outbox_emit_many('cart', ARRAY['c9', 'c9'], ARRAY['a'], ARRAY['{}', '{}']::jsonb[])$$,
                 '22023', NULL, 'emit_many: fewer event_types than ids raises 22023');
SELECT throws_ok($$SELECT idem_outbox_emit_many('cart', ARRAY['c9'], ARRAY['a'], ARRAY['{}', '{}']::jsonb[])$$,
                 '22023', NULL, 'emit_many: more payloads than ids raises 22023');
SELECT throws_ok($$SELECT idem_outbox_emit_many('cart', ARRAY['c9'], ARRAY['a'], ARRAY['{}']::jsonb[], ARRAY['{}', '{}']::jsonb[])$$,
                 '22023', NULL, 'emit_many: more headers than ids raises 22023');
SELECT throws_ok($$SELECT idem_outbox_emit_many(NULL, ARRAY['c9'], ARRAY['a'], ARRAY['{}']::jsonb[])$$,
                 '22004', NULL, 'emit_many: NULL aggregate_type raises 22004');
SELECT throws_ok($$SELECT idem_outbox_emit_many('', ARRAY['c9'], ARRAY['a'], ARRAY['{}']::jsonb[])$$,
                 '22023', NULL, 'emit_many: empty aggregate_type raises 22023');
SELECT throws_ok($$SELECT idem_outbox_emit_many('cart', NULL, ARRAY['a'], ARRAY['{}']::jsonb[])$$,
                 '22004', NULL, 'emit_many: NULL aggregate_ids raises 22004');
SELECT throws_ok($$SELECT idem_outbox_emit_many('cart', ARRAY['c9'], NULL, ARRAY['{}']::jsonb[])$$,
                 '22004', NULL, 'emit_many: NULL event_types raises 22004');
SELECT throws_ok($$SELECT idem_outbox_emit_many('cart', ARRAY['c9'], ARRAY['a'], NULL)$$,
                 '22004', NULL, 'emit_many: NULL payloads raises 22004');
SELECT throws_ok($$SELECT idem_outbox_emit_many('cart', ARRAY['c9', NULL], ARRAY['a', 'b'], ARRAY['{}', '{}']::jsonb[])$$,
                 '22004', NULL, 'emit_many: a NULL aggregate_id raises 22004');
SELECT throws_ok($$SELECT idem_outbox_emit_many('cart', ARRAY['c9', 'c9'], ARRAY['a', NULL], ARRAY['{}', '{}']::jsonb[])$$,
                 '22004', NULL, 'emit_many: a NULL event_type raises 22004');
SELECT throws_ok($$SELECT idem_outbox_emit_many('cart', ARRAY['c9', 'c9'], ARRAY['a', 'b'], ARRAY['{}', NULL]::jsonb[])$$,
                 '22004', NULL, 'emit_many: a NULL payload raises 22004');
SELECT throws_ok($$SELECT idem_outbox_emit_many('cart', ARRAY['c9', ''], ARRAY['a', 'b'], ARRAY['{}', '{}']::jsonb[])$$,
                 '22023', NULL, 'emit_many: an empty aggregate_id raises 22023');
SELECT throws_ok($$SELECT idem_outbox_emit_many('cart', ARRAY['c9', 'c9'], ARRAY['a', ''], ARRAY['{}', '{}']::jsonb[])$$,
                 '22023', NULL, 'emit_many: an empty event_type raises 22023');
SELECT throws_ok($$SELECT idem_outbox_emit_many('cart', ARRAY['c9', repeat('i', 2001)], ARRAY['a', 'b'], ARRAY['{}', '{}']::jsonb[])$$,
                 '22001', NULL, 'emit_many: a too long aggregate_id raises 22001');
SELECT throws_ok($$SELECT idem_outbox_emit_many('cart', ARRAY['c9'], ARRAY['a'], ARRAY['{}']::jsonb[], ARRAY['[]']::jsonb[])$$,
                 '22023', NULL, 'emit_many: headers that are not an object raise 22023');
SELECT is((SELECT count(*)::int FROM idempotency.outbox_events WHERE aggregate_id = 'c9')
          + (SELECT count(*)::int FROM idempotency.outbox_sequences WHERE aggregate_id = 'c9'), 0,
          'failed batches left no event and no counter');

-- 4. claim ------------------------------------------------------------------

-- 'order': o-1 seq 1..3, o-2 seq 1..2, o-3 seq 1
SELECT is(pg_temp.claim('c1', ARRAY['order']), 6, 'claim hands out every pending event of the type');
SELECT is(pg_temp.runs('c1'), 'o-1:1,o-1:2,o-1:3,o-2:1,o-2:2,o-3:1', 'each aggregate''s run from its head');
SELECT ok(pg_temp.in_order('c1'), 'runs come in seq order');
SELECT ok((SELECT count(DISTINCT lease_token) = 1 AND count(lease_token) = count(*) FROM got WHERE call = 'c1'),
          'all rows of one claim share one lease_token');
SELECT ok((SELECT count(DISTINCT lease_until) = 1 AND count(lease_until) = count(*) FROM got WHERE call = 'c1'),
          'all rows of one claim share one lease_until');
SELECT ok((SELECT lease_until - interval '30 seconds' BETWEEN pg_temp.ext_start() AND pg_temp.ext_now()
             FROM got WHERE call = 'c1' LIMIT 1),
          'lease_until is the extension''s clock + 30 seconds by default');
SELECT ok((SELECT bool_and(attempts = 1) FROM got WHERE call = 'c1'), 'first hand-out: attempts 1');
SELECT is((SELECT count(*)::int FROM got g JOIN idempotency.outbox_events o USING (id)
            WHERE g.call = 'c1' AND o.aggregate_type = g.aggregate_type AND o.aggregate_id = g.aggregate_id
              AND o.seq = g.seq AND o.event_type = g.event_type AND o.payload = g.payload
              AND o.headers = g.headers AND o.created_at = g.created_at),
          6, 'claimed rows are the stored events');
SELECT ok((SELECT acked_seq = 0 AND leased_seq = 3 AND lease_token = pg_temp.tok('c1') AND attempts = 1
                  AND lease_until = (SELECT lease_until FROM got WHERE call = 'c1' LIMIT 1)
             FROM pg_temp.dl('order', 'o-1')),
          'outbox_deliveries records the lease');
SELECT is(pg_temp.claim('c2', ARRAY['order']), 0, 'a second claim gets nothing of leased aggregates');
SELECT is(pg_temp.claim('c2b', ARRAY['no-such-type']), 0, 'a claim of a type with no events gets nothing');

-- batch: b1 has 5 events, b2 3
SELECT count(*) FROM idem_outbox_emit_many('batch', ARRAY['b1', 'b1', 'b1', 'b1', 'b1', 'b2', 'b2', 'b2'],
                                           ARRAY['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x'],
                                           array_fill('{}'::jsonb, ARRAY[8])) \g /dev/null
SELECT is(pg_temp.claim('b', ARRAY['batch'], 6), 6, 'a claim fills its batch (6 of 8 pending)');
SELECT is((SELECT count(DISTINCT aggregate_id)::int FROM got WHERE call = 'b'), 2,
          '... taking as many aggregates as it needs');
SELECT ok((SELECT bool_and(n = mx AND mn = 1) FROM (
               SELECT count(*) AS n, max(seq) AS mx, min(seq) AS mn FROM got WHERE call = 'b' GROUP BY aggregate_id) r)
          AND pg_temp.in_order('b'),
          '... each aggregate''s part is its head run, in order');
SELECT is(pg_temp.claim('b-again', ARRAY['batch']), 0, 'both aggregates are leased, also the cut one');
-- ack the cut aggregate's part: its lease ends, its rest is claimable
CREATE TEMP TABLE cut AS
SELECT g.aggregate_id, count(*) AS handed, (SELECT count(*) FROM idempotency.outbox_events o
                                             WHERE o.aggregate_type = 'batch' AND o.aggregate_id = g.aggregate_id) AS total
  FROM got g WHERE call = 'b' GROUP BY g.aggregate_id HAVING count(*) < (SELECT count(*) FROM idempotency.outbox_events o
                                             WHERE o.aggregate_type = 'batch' AND o.aggregate_id = g.aggregate_id);
SELECT is((SELECT count(*)::int FROM cut), 1, 'exactly one aggregate was cut short');
SELECT is(idem_outbox_ack(pg_temp.ids('b', (SELECT aggregate_id FROM cut)), pg_temp.tok('b')),
          (SELECT handed::int FROM cut), 'ack of the cut part marks it');
SELECT is(pg_temp.claim('b-rest', ARRAY['batch']), (SELECT (total - handed)::int FROM cut),
          'then the rest of the cut aggregate is claimable at once');
SELECT ok((SELECT bool_and(aggregate_id = (SELECT aggregate_id FROM cut)) AND min(seq) = (SELECT handed + 1 FROM cut)
             FROM got WHERE call = 'b-rest'),
          '... starting after the acked part');
SELECT is(pg_temp.claim('b1', ARRAY['batch1'], 1), 0, 'no events of type batch1 yet');
SELECT count(*) FROM idem_outbox_emit_many('batch1', ARRAY['a', 'a', 'a'], ARRAY['x', 'x', 'x'], array_fill('{}'::jsonb, ARRAY[3])) \g /dev/null
SELECT is(pg_temp.claim('b1', ARRAY['batch1'], 1), 1, 'batch 1 hands out one event');
SELECT is(pg_temp.runs('b1'), 'a:1', '... the head');

-- bad input
SELECT throws_ok($$SELECT idem_outbox_claim(0)$$, '22023', NULL, 'claim: batch 0 raises 22023');
SELECT throws_ok($$SELECT idem_outbox_claim(-1)$$, '22023', NULL, 'claim: negative batch raises 22023');
SELECT throws_ok($$SELECT idem_outbox_claim(NULL)$$, '22004', NULL, 'claim: NULL batch raises 22004');
SELECT throws_ok($$SELECT idem_outbox_claim(10, '0 seconds')$$, '22023', NULL, 'claim: lease 0 raises 22023');
SELECT throws_ok($$SELECT idem_outbox_claim(10, '-1 second')$$, '22023', NULL, 'claim: negative lease raises 22023');
SELECT throws_ok($$SELECT idem_outbox_claim(10, NULL)$$, '22004', NULL, 'claim: NULL lease raises 22004');
SELECT throws_ok($$SELECT idem_outbox_claim(10, 'soon')$$, '22007', NULL, 'claim: a lease that is not an interval raises 22007');
SELECT throws_ok($$SELECT idem_outbox_claim('ten')$$, '22P02', NULL, 'claim: a batch that is not a number raises 22P02');

-- an expired lease makes the run claimable again, as a second attempt
SELECT pg_temp.advance(31) \g /dev/null
SELECT is(pg_temp.claim('c3', ARRAY['order']), 6, 'after the lease expired, the runs are claimable again');
SELECT is(pg_temp.runs('c3'), pg_temp.runs('c1'), '... the same events');
SELECT ok((SELECT bool_and(attempts = 2) FROM got WHERE call = 'c3'), '... with attempts 2');
SELECT isnt(pg_temp.tok('c3'), pg_temp.tok('c1'), '... under a new lease token');

-- 5. ack --------------------------------------------------------------------

SELECT is(idem_outbox_ack(pg_temp.ids('c1'), pg_temp.tok('c1')), 0, 'ack with a taken-over token marks nothing');
SELECT is((pg_temp.dl('order', 'o-1')).acked_seq, 0::bigint, '... nothing delivered');
SELECT is(idem_outbox_ack(ARRAY[pg_temp.ev('order', 'o-1', 3)], pg_temp.tok('c3')), 0,
          'ack of seq 3 alone marks nothing (not a prefix)');
SELECT is(idem_outbox_ack(ARRAY[pg_temp.ev('order', 'o-1', 1), pg_temp.ev('order', 'o-1', 3)], pg_temp.tok('c3')), 1,
          'ack of seqs 1 and 3 marks seq 1 (the contiguous prefix)');
SELECT is((pg_temp.dl('order', 'o-1')).acked_seq, 1::bigint, '... acked_seq 1');
SELECT is(idem_outbox_ack(ARRAY[pg_temp.ev('order', 'o-1', 3), pg_temp.ev('order', 'o-1', 2), pg_temp.ev('order', 'o-1', 2)],
                          pg_temp.tok('c3')), 2,
          'ack of seqs 3, 2, 2 marks two events (order and repeats do not matter)');
SELECT is(idem_outbox_ack(ARRAY[pg_temp.ev('order', 'o-1', 1)], pg_temp.tok('c3')), 0, 'acking again marks nothing');
SELECT is(idem_outbox_ack(ARRAY[gen_random_uuid()], pg_temp.tok('c3')), 0, 'unknown ids are ignored');
SELECT is(idem_outbox_ack('{}', pg_temp.tok('c3')), 0, 'an empty array marks nothing');
SELECT throws_ok($$SELECT idem_outbox_ack(NULL)$$, '22004', NULL, 'ack: NULL ids raises 22004');
SELECT throws_ok($$SELECT idem_outbox_ack('{not-a-uuid}')$$, '22P02', NULL, 'ack: ids that are not uuids raise 22P02');
-- o-1's run is fully acked: its lease ended, a new event is claimable at once
SELECT is((idem_outbox_emit('order', 'o-1', 'delivered', '{}')).seq, 4::bigint, 'emit o-1 seq 4');
SELECT is(pg_temp.claim('c4', ARRAY['order']), 1, 'a fully acked run ends the lease');
SELECT is(pg_temp.runs('c4'), 'o-1:4', '... only o-1 (o-2 and o-3 are still leased)');
SELECT is((SELECT attempts FROM got WHERE call = 'c4'), 1, '... first hand-out of the new head');
SELECT is(idem_outbox_ack(ARRAY[pg_temp.ev('order', 'o-2', 1), pg_temp.ev('order', 'o-3', 1), pg_temp.ev('order', 'o-1', 4)],
                          pg_temp.tok('c3')), 2,
          'one ack over three aggregates marks those the token still holds (o-2, o-3), not o-1');
SELECT is(idem_outbox_ack(ARRAY[pg_temp.ev('order', 'o-1', 4)]), 1, 'an ack without a token marks regardless of the lease');
SELECT ok((SELECT acked_seq = 4 AND lease_token IS NULL FROM pg_temp.dl('order', 'o-1')),
          '... and ends the lease of the fully acked run');
-- administrative ack of an aggregate never claimed
SELECT count(*) FROM idem_outbox_emit_many('adm', ARRAY['a1', 'a1'], ARRAY['x', 'x'], ARRAY['{}', '{}']::jsonb[]) \g /dev/null
SELECT is(idem_outbox_ack(ARRAY[pg_temp.ev('adm', 'a1', 1), pg_temp.ev('adm', 'a1', 2)]), 2,
          'an ack without a token works on an aggregate never claimed');
SELECT is(pg_temp.claim('adm', ARRAY['adm']), 0, '... its events are delivered');
-- an expired lease's token marks nothing
SELECT count(*) FROM idem_outbox_emit_many('exp', ARRAY['x1', 'x1'], ARRAY['x', 'x'], ARRAY['{}', '{}']::jsonb[]) \g /dev/null
SELECT is(pg_temp.claim('x1', ARRAY['exp'], 10, '10 seconds'), 2, 'claim with a 10-second lease');
SELECT pg_temp.advance(11) \g /dev/null
SELECT is(idem_outbox_ack(pg_temp.ids('x1'), pg_temp.tok('x1')), 0, 'ack with an expired lease''s token marks nothing');
SELECT is((pg_temp.dl('exp', 'x1')).acked_seq, 0::bigint, '... nothing delivered');
SELECT is(pg_temp.claim('x2', ARRAY['exp']), 2, 'the run is claimable again');
SELECT is((SELECT min(attempts) FROM got WHERE call = 'x2'), 2, '... second attempt');
SELECT is(idem_outbox_ack(pg_temp.ids('x2'), pg_temp.tok('x2')), 2, 'the live token acks');

-- 6. extend -----------------------------------------------------------------

SELECT count(*) FROM idem_outbox_emit_many('ext', ARRAY['e1', 'e1', 'e1', 'e2'], ARRAY['x', 'x', 'x', 'x'],
                                           array_fill('{}'::jsonb, ARRAY[4])) \g /dev/null
SELECT is(pg_temp.claim('x', ARRAY['ext'], 10, '10 seconds'), 4, 'claim 4 events of 2 aggregates');
SELECT is(idem_outbox_extend(pg_temp.tok('x'), '5 minutes'), 4, 'extend returns how many events the lease covers');
SELECT ok((SELECT lease_until - interval '5 minutes' BETWEEN pg_temp.ext_start() AND pg_temp.ext_now()
             FROM pg_temp.dl('ext', 'e1')),
          '... the lease now ends 5 minutes from now');
SELECT pg_temp.advance(60) \g /dev/null
SELECT is(pg_temp.claim('x-again', ARRAY['ext']), 0, 'past the old lease_until, the extended lease still holds');
SELECT is(idem_outbox_ack(ARRAY[pg_temp.ev('ext', 'e1', 1)], pg_temp.tok('x')), 1, '... and its token acks');
SELECT is(idem_outbox_extend(pg_temp.tok('x'), '5 minutes'), 3, 'after acking one event, the lease covers 3');
SELECT is(idem_outbox_extend(gen_random_uuid(), '1 minute'), 0, 'extend with an unknown token covers nothing');
SELECT throws_ok($$SELECT idem_outbox_extend(NULL, '1 minute')$$, '22004', NULL, 'extend: NULL token raises 22004');
SELECT throws_ok(format($$SELECT idem_outbox_extend(%L, NULL)$$, pg_temp.tok('x')), '22004', NULL, 'extend: NULL lease raises 22004');
SELECT throws_ok(format($$SELECT idem_outbox_extend(%L, '0 seconds')$$, pg_temp.tok('x')), '22023', NULL, 'extend: lease 0 raises 22023');
SELECT throws_ok(format($$SELECT idem_outbox_extend(%L, '-1 second')$$, pg_temp.tok('x')), '22023', NULL, 'extend: negative lease raises 22023');
SELECT pg_temp.advance(301) \g /dev/null
SELECT is(idem_outbox_extend(pg_temp.tok('x'), '5 minutes'), 0, 'extend of an expired lease covers nothing');
SELECT is(pg_temp.claim('x-late', ARRAY['ext']), 3, '... and the runs are claimable again');

-- 7. nack and backoff -------------------------------------------------------

SELECT count(*) FROM idem_outbox_emit_many('nk', ARRAY['n1', 'n1'], ARRAY['x', 'x'], ARRAY['{}', '{}']::jsonb[]) \g /dev/null
SELECT is(pg_temp.claim('n1', ARRAY['nk']), 2, 'claim 2 events');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'boom', NULL, %L)$$, pg_temp.ev('nk', 'n1', 1), pg_temp.tok('n1')),
                'nack with the live token');
SELECT ok((SELECT lease_token IS NULL AND last_error = 'boom' AND acked_seq = 0 FROM pg_temp.dl('nk', 'n1')),
          'nack ends the lease and records the error');
SELECT is((SELECT round(extract(epoch FROM retry_at - pg_temp.ext_now()))::int FROM pg_temp.dl('nk', 'n1')), 1,
          'first failure: retry after 1 second');
SELECT is(pg_temp.claim('n1-now', ARRAY['nk']), 0, 'not claimable before retry_at');
SELECT pg_temp.advance(2) \g /dev/null
SELECT is(pg_temp.claim('n2', ARRAY['nk']), 2, 'claimable after retry_at: the whole run again');
SELECT is((SELECT min(attempts) FROM got WHERE call = 'n2'), 2, '... second attempt');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'boom 2', NULL, %L)$$, pg_temp.ev('nk', 'n1', 1), pg_temp.tok('n2')),
                'second nack');
SELECT is((SELECT round(extract(epoch FROM retry_at - pg_temp.ext_now()))::int FROM pg_temp.dl('nk', 'n1')), 2,
          'second failure: retry after 2 seconds');
SELECT pg_temp.advance(3) \g /dev/null
SELECT is(pg_temp.claim('n3', ARRAY['nk']), 2, 'third claim');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'later', '10 minutes', %L)$$, pg_temp.ev('nk', 'n1', 1), pg_temp.tok('n3')),
                'nack with retry_after 10 minutes');
SELECT is((SELECT round(extract(epoch FROM retry_at - pg_temp.ext_now()))::int FROM pg_temp.dl('nk', 'n1')), 600,
          '... retry after 600 seconds');
SELECT pg_temp.advance(300) \g /dev/null
SELECT is(pg_temp.claim('n3-early', ARRAY['nk']), 0, 'not claimable 5 minutes later');
SELECT pg_temp.advance(301) \g /dev/null
SELECT is(pg_temp.claim('n4', ARRAY['nk']), 2, 'claimable after 10 minutes');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'again', '0', %L)$$, pg_temp.ev('nk', 'n1', 1), pg_temp.tok('n4')),
                'nack with retry_after 0');
SELECT is(pg_temp.claim('n5', ARRAY['nk']), 2, '... claimable at once');
SELECT is((SELECT min(attempts) FROM got WHERE call = 'n5'), 5, '... fifth attempt');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'stale', '0', %L)$$, pg_temp.ev('nk', 'n1', 1), gen_random_uuid()),
                'nack with a token that is not the lease');
SELECT ok((SELECT lease_token = pg_temp.tok('n5') AND last_error = 'again' FROM pg_temp.dl('nk', 'n1')),
          '... is a no-op (lease kept, no error recorded)');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'admin')$$, pg_temp.ev('nk', 'n1', 1)),
                'nack without a token');
SELECT ok((SELECT lease_token IS NULL AND last_error = 'admin' FROM pg_temp.dl('nk', 'n1')),
          '... ends the lease and records the error');
SELECT lives_ok($$SELECT idem_outbox_nack(gen_random_uuid(), 'who?')$$, 'nack of an unknown id is a no-op');
SELECT is((SELECT count(*)::int FROM idempotency.outbox_deliveries WHERE last_error = 'who?'), 0, '... nothing recorded');
SELECT throws_ok($$SELECT idem_outbox_nack(NULL, 'x')$$, '22004', NULL, 'nack: NULL id raises 22004');
SELECT throws_ok(format($$SELECT idem_outbox_nack(%L, NULL)$$, pg_temp.ev('nk', 'n1', 1)), '22004', NULL, 'nack: NULL error raises 22004');
SELECT throws_ok(format($$SELECT idem_outbox_nack(%L, 'x', '-1 second')$$, pg_temp.ev('nk', 'n1', 1)), '22023', NULL,
                 'nack: negative retry_after raises 22023');

-- the backoff doubles from 1 second and is capped at 1 hour
SELECT pg_temp.setting('outbox_max_attempts', '1000') \g /dev/null
SELECT count(*) FROM idem_outbox_emit('bo', 'b1', 'x', '{}') \g /dev/null
CREATE TEMP TABLE backoff (n int, secs int);
DO $$
BEGIN
    FOR i IN 1..14 LOOP
        PERFORM pg_temp.fail_head('bo', i, NULL);
        INSERT INTO pg_temp.backoff
        SELECT i, round(extract(epoch FROM retry_at - pg_temp.ext_now()))::int
          FROM idempotency.outbox_deliveries WHERE aggregate_type = 'bo';
        PERFORM pg_temp.advance(3601);
    END LOOP;
END $$;
SELECT is(ARRAY(SELECT secs FROM backoff ORDER BY n),
          ARRAY[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 3600, 3600],
          'backoff: 1 s * 2^(attempts - 1), capped at 1 hour');
SELECT is((pg_temp.dl('bo', 'b1')).attempts, 14, '... 14 attempts counted');
SELECT pg_temp.setting('outbox_max_attempts', '10') \g /dev/null

-- 8. dead letters -----------------------------------------------------------

-- the default: 10 failed attempts
SELECT count(*) FROM idem_outbox_emit('dd', 'd1', 'x', '{}') \g /dev/null
CREATE TEMP TABLE dead_after (n int, dead int);
DO $$
BEGIN
    FOR i IN 1..10 LOOP
        PERFORM pg_temp.fail_head('dd', i, '0');
        INSERT INTO pg_temp.dead_after
        SELECT i, count(*) FROM idempotency.outbox_dead WHERE aggregate_type = 'dd';
    END LOOP;
END $$;
SELECT is(ARRAY(SELECT dead FROM dead_after ORDER BY n), ARRAY[0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
          'with the default outbox_max_attempts, the 10th failure dead-letters');

-- block policy (default), 2 attempts
SELECT pg_temp.setting('outbox_max_attempts', '2') \g /dev/null
SELECT count(*) FROM idem_outbox_emit_many('dl', ARRAY['d1', 'd1', 'd1', 'd2'], ARRAY['first', 'second', 'third', 'only'],
                                           ARRAY['{"p": 1}', '{"p": 2}', '{"p": 3}', '{}']::jsonb[]) \g /dev/null
SELECT is(pg_temp.claim('d1', ARRAY['dl']), 4, 'claim d1 (3 events) and d2 (1)');
SELECT is(idem_outbox_ack(pg_temp.ids('d1', 'd2'), pg_temp.tok('d1')), 1, 'd2 delivered');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'e1', '0', %L)$$, pg_temp.ev('dl', 'd1', 1), pg_temp.tok('d1')),
                'first failure of d1');
SELECT is(pg_temp.dead('dl'), '', '... not dead after 1 of 2 attempts');
SELECT is(pg_temp.claim('d2', ARRAY['dl']), 3, 'claimed again');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'e2', '0', %L)$$, pg_temp.ev('dl', 'd1', 1), pg_temp.tok('d2')),
                'second failure of d1');
SELECT is(pg_temp.dead('dl'), 'd1:1', 'after 2 of 2 attempts the head is dead-lettered at once');
SELECT ok((SELECT id = pg_temp.ev('dl', 'd1', 1) AND event_type = 'first' AND payload = '{"p": 1}' AND headers = '{}'
                  AND attempts = 2 AND last_error = 'e2' AND dead_at IS NOT NULL
                  AND created_at = (SELECT created_at FROM idempotency.outbox_events WHERE id = pg_temp.ev('dl', 'd1', 1))
             FROM idempotency.outbox_dead WHERE aggregate_type = 'dl'),
          'outbox_dead shows the event, its attempts and last error');
SELECT is((pg_temp.dl('dl', 'd1')).dead_seq, 1::bigint, 'outbox_deliveries.dead_seq marks the dead head');
SELECT is(pg_temp.claim('d3', ARRAY['dl']), 0, 'block: the aggregate waits');
SELECT pg_temp.advance(60) \g /dev/null
SELECT is(pg_temp.claim('d3b', ARRAY['dl']), 0, '... also later');
SELECT is(idem_outbox_redrive(ARRAY[pg_temp.ev('dl', 'd1', 1)]), 1, 'redrive returns how many it put back');
SELECT is(pg_temp.dead('dl'), '', '... no longer listed as dead');
SELECT is(pg_temp.claim('d4', ARRAY['dl']), 3, 'after redrive the aggregate flows again');
SELECT is(pg_temp.runs('d4'), 'd1:1,d1:2,d1:3', '... from the redriven event, order intact');
SELECT is(idem_outbox_ack(pg_temp.ids('d4'), pg_temp.tok('d4')), 3, '... and is delivered');
SELECT is(idem_outbox_redrive(ARRAY[pg_temp.ev('dl', 'd1', 1)]), 0, 'redrive of an event no longer dead: 0');
SELECT is(idem_outbox_redrive(ARRAY[gen_random_uuid()]), 0, 'redrive of an unknown id: 0');
SELECT is(idem_outbox_redrive('{}'), 0, 'redrive of nothing: 0');
SELECT throws_ok($$SELECT idem_outbox_redrive(NULL)$$, '22004', NULL, 'redrive: NULL ids raises 22004');

-- discard (max attempts 1)
SELECT pg_temp.setting('outbox_max_attempts', '1') \g /dev/null
SELECT count(*) FROM idem_outbox_emit_many('dc', ARRAY['c1', 'c1'], ARRAY['first', 'second'], ARRAY['{}', '{}']::jsonb[]) \g /dev/null
SELECT is(pg_temp.claim('k1', ARRAY['dc']), 2, 'claim');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'bad', '0', %L)$$, pg_temp.ev('dc', 'c1', 1), pg_temp.tok('k1')), 'nack');
SELECT is(pg_temp.dead('dc'), 'c1:1', 'dead after 1 of 1 attempts');
SELECT is(pg_temp.claim('k2', ARRAY['dc']), 0, 'blocked');
SELECT is(idem_outbox_redrive(ARRAY[pg_temp.ev('dc', 'c1', 2)]), 0, 'redrive of an event that is not dead: 0');
SELECT is(idem_outbox_discard(ARRAY[pg_temp.ev('dc', 'c1', 2)]), 0, 'discard of an event that is not dead: 0');
SELECT is(idem_outbox_discard(ARRAY[pg_temp.ev('dc', 'c1', 1), gen_random_uuid()]), 1, 'discard returns how many it dropped');
SELECT is(pg_temp.dead('dc'), '', '... no longer listed as dead');
SELECT is(pg_temp.claim('k3', ARRAY['dc']), 1, 'a blocked aggregate moves on after discard');
SELECT is(pg_temp.runs('k3'), 'c1:2', '... with the next event');
SELECT is(idem_outbox_ack(pg_temp.ids('k3'), pg_temp.tok('k3')), 1, '... delivered');
SELECT is(pg_temp.claim('k4', ARRAY['dc']), 0, 'the discarded event never comes back');
SELECT is(idem_outbox_discard(ARRAY[pg_temp.ev('dc', 'c1', 1)]), 0, 'discard again: 0');
SELECT is(idem_outbox_redrive(ARRAY[pg_temp.ev('dc', 'c1', 1)]), 0, 'redrive of a discarded event: 0');
SELECT is(idem_outbox_discard('{}'), 0, 'discard of nothing: 0');
SELECT throws_ok($$SELECT idem_outbox_discard(NULL)$$, '22004', NULL, 'discard: NULL ids raises 22004');

-- an expired lease is a failed attempt too (max attempts 2)
SELECT pg_temp.setting('outbox_max_attempts', '2') \g /dev/null
SELECT count(*) FROM idem_outbox_emit('dx', 'x1', 'x', '{}') \g /dev/null
SELECT is(pg_temp.claim('y1', ARRAY['dx'], 10, '5 seconds'), 1, 'claim with a 5-second lease');
SELECT pg_temp.advance(6) \g /dev/null
SELECT is(pg_temp.claim('y2', ARRAY['dx'], 10, '5 seconds'), 1, 'expired: claimed again');
SELECT is((SELECT attempts FROM got WHERE call = 'y2'), 2, '... attempt 2');
SELECT pg_temp.advance(6) \g /dev/null
SELECT is(pg_temp.claim('y3', ARRAY['dx'], 10, '5 seconds'), 0, 'expired after the last attempt: not handed out again');
SELECT is(pg_temp.dead('dx'), 'x1:1', '... dead-lettered at that claim');
SELECT is((SELECT attempts FROM idempotency.outbox_dead WHERE aggregate_type = 'dx'), 2, '... after 2 attempts');

-- the dead policy is read when events are claimed: block, then skip
SELECT count(*) FROM idem_outbox_emit_many('dp', ARRAY['p1', 'p1'], ARRAY['x', 'x'], ARRAY['{}', '{}']::jsonb[]) \g /dev/null
SELECT pg_temp.setting('outbox_max_attempts', '1') \g /dev/null
SELECT is(pg_temp.claim('p1', ARRAY['dp']), 2, 'claim');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'bad', '0', %L)$$, pg_temp.ev('dp', 'p1', 1), pg_temp.tok('p1')), 'nack: dead');
SELECT is(pg_temp.claim('p2', ARRAY['dp']), 0, 'block: nothing');
SELECT pg_temp.setting('outbox_dead_policy', 'skip') \g /dev/null
SELECT is(pg_temp.claim('p3', ARRAY['dp']), 1, 'the same aggregate under skip: the next event flows');
SELECT is(pg_temp.runs('p3'), 'p1:2', '... seq 2');
SELECT is(idem_outbox_ack(pg_temp.ids('p3'), pg_temp.tok('p3')), 1, '... delivered');

-- 9. skip policy ------------------------------------------------------------

SELECT count(*) FROM idem_outbox_emit_many('sk', ARRAY['s1', 's1', 's1'], ARRAY['a', 'b', 'c'], array_fill('{}'::jsonb, ARRAY[3])) \g /dev/null
SELECT is(pg_temp.claim('s1', ARRAY['sk']), 3, 'claim');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'bad', '0', %L)$$, pg_temp.ev('sk', 's1', 1), pg_temp.tok('s1')), 'nack');
SELECT is(pg_temp.dead('sk'), 's1:1', 'skip: the head is dead-lettered');
SELECT is(pg_temp.claim('s2', ARRAY['sk']), 2, 'skip: later events flow on');
SELECT is(pg_temp.runs('s2'), 's1:2,s1:3', '... seqs 2 and 3');
SELECT is((SELECT min(attempts) FROM got WHERE call = 's2'), 1, '... first attempt of the new head');
SELECT is(idem_outbox_ack(pg_temp.ids('s2'), pg_temp.tok('s2')), 2, '... delivered');
SELECT is(pg_temp.claim('s3', ARRAY['sk']), 0, 'nothing left');
SELECT is(pg_temp.dead('sk'), 's1:1', 'the skipped event stays listed');
SELECT is(idem_outbox_redrive(ARRAY[pg_temp.ev('sk', 's1', 1)]), 1, 'redrive a skipped event');
SELECT is(pg_temp.claim('s4', ARRAY['sk']), 3, 'the aggregate rewinds to it');
SELECT is(pg_temp.runs('s4'), 's1:1,s1:2,s1:3', '... later events are delivered again');
SELECT ok(pg_temp.in_order('s4'), '... in seq order');
SELECT is(idem_outbox_ack(pg_temp.ids('s4'), pg_temp.tok('s4')), 3, '... delivered');
SELECT is(pg_temp.dead('sk'), '', 'nothing dead');
-- discard under skip
SELECT count(*) FROM idem_outbox_emit_many('sk', ARRAY['s2', 's2'], ARRAY['a', 'b'], ARRAY['{}', '{}']::jsonb[]) \g /dev/null
SELECT is(pg_temp.claim('s5', ARRAY['sk']), 2, 'claim');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'bad', '0', %L)$$, pg_temp.ev('sk', 's2', 1), pg_temp.tok('s5')), 'nack: dead');
SELECT is(pg_temp.claim('s6', ARRAY['sk']), 1, 'skip: seq 2 flows');
SELECT is(idem_outbox_ack(pg_temp.ids('s6'), pg_temp.tok('s6')), 1, '... delivered');
SELECT is(idem_outbox_discard(ARRAY[pg_temp.ev('sk', 's2', 1)]), 1, 'discard the skipped event');
SELECT is(pg_temp.claim('s7', ARRAY['sk']), 0, '... nothing is delivered again');
SELECT pg_temp.setting('outbox_dead_policy', 'block') \g /dev/null
SELECT pg_temp.setting('outbox_max_attempts', '10') \g /dev/null

-- 9b. delivery states: each has a way out ---------------------------------

-- the table refuses the states that none would have
SELECT count(*) FROM idem_outbox_emit('st', 'x1', 'x', '{}') \g /dev/null
-- (relays make an aggregate's row when they first meet it)
INSERT INTO idempotency.outbox_deliveries (subscription, aggregate_type, aggregate_id) VALUES (0, 'st', 'x1');
SELECT throws_ok($$UPDATE idempotency.outbox_deliveries SET retry_at = 'infinity' WHERE aggregate_type = 'st'$$,
                 '23514', NULL, 'parked for good without a dead head: refused');
SELECT throws_ok($$UPDATE idempotency.outbox_deliveries SET dead_seq = 1 WHERE aggregate_type = 'st'$$,
                 '23514', NULL, 'a dead head that is not parked: refused');
SELECT throws_ok($$UPDATE idempotency.outbox_deliveries SET dead_seq = 2, retry_at = now() WHERE aggregate_type = 'st'$$,
                 '23514', NULL, 'a dead seq that is not the head: refused');
SELECT throws_ok($$UPDATE idempotency.outbox_deliveries SET redrive_seq = 1 WHERE aggregate_type = 'st'$$,
                 '23514', NULL, 'a redrive waiting without a lease: refused');
SELECT is(idem_outbox_ack(ARRAY[pg_temp.ev('st', 'x1', 1)]), 1, 'st delivered');

-- a redrive that goes back before a later dead head (policy skip, then
-- block): everything from the redriven event is delivered again, the later
-- dead one is retried in turn and, failing again, blocks again
SELECT pg_temp.setting('outbox_max_attempts', '1') \g /dev/null
SELECT pg_temp.setting('outbox_dead_policy', 'skip') \g /dev/null
SELECT count(*) FROM idem_outbox_emit_many('rw', ARRAY['r1', 'r1', 'r1'], ARRAY['a', 'b', 'c'], array_fill('{}'::jsonb, ARRAY[3])) \g /dev/null
SELECT is(pg_temp.claim('rw1', ARRAY['rw']), 3, 'claim');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'bad 1', '0', %L)$$, pg_temp.ev('rw', 'r1', 1), pg_temp.tok('rw1')), 'seq 1 dead');
SELECT is(pg_temp.claim('rw2', ARRAY['rw']), 2, 'skip: seq 2 and 3 flow');
SELECT is(idem_outbox_ack(pg_temp.ids('rw2'), pg_temp.tok('rw2')), 2, '... delivered');
SELECT pg_temp.setting('outbox_dead_policy', 'block') \g /dev/null
SELECT count(*) FROM idem_outbox_emit('rw', 'r1', 'd', '{}') \g /dev/null
SELECT is(pg_temp.claim('rw3', ARRAY['rw']), 1, 'seq 4');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'bad 4', '0', %L)$$, pg_temp.ev('rw', 'r1', 4), pg_temp.tok('rw3')), 'seq 4 dead');
SELECT is(pg_temp.claim('rw4', ARRAY['rw']), 0, 'block: waits at seq 4');
SELECT is(pg_temp.dead('rw'), 'r1:1,r1:4', 'both dead letters listed');
SELECT is(idem_outbox_redrive(ARRAY[pg_temp.ev('rw', 'r1', 1)]), 1, 'redrive seq 1');
SELECT is(pg_temp.claim('rw5', ARRAY['rw']), 4, 'the aggregate goes back to seq 1');
SELECT is(pg_temp.runs('rw5'), 'r1:1,r1:2,r1:3,r1:4', '... and hands out everything from there, seq 4 (dead before) too');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'bad 4 again', '0', %L)$$, pg_temp.ev('rw', 'r1', 4), pg_temp.tok('rw5')),
                'seq 4 fails again (nothing acked)');
SELECT is(pg_temp.claim('rw6', ARRAY['rw']), 0, 'seq 1 is the head and died again: blocked');
SELECT is(pg_temp.dead('rw'), 'r1:1,r1:4', 'seq 1 listed again, seq 4 still');
SELECT is((SELECT last_error FROM idempotency.outbox_dead WHERE id = pg_temp.ev('rw', 'r1', 1)), 'bad 4 again',
          '... seq 1 with the error of its new death');
SELECT is(idem_outbox_discard(ARRAY[pg_temp.ev('rw', 'r1', 1)]), 1, 'discard seq 1');
SELECT is(pg_temp.claim('rw7', ARRAY['rw']), 3, 'seq 2 .. 4 flow');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'bad 4, third', '0', %L)$$, pg_temp.ev('rw', 'r1', 2), pg_temp.tok('rw7')),
                'seq 2 fails');
SELECT is(idem_outbox_discard(ARRAY[pg_temp.ev('rw', 'r1', 2)]), 1, 'discard seq 2');
SELECT is(pg_temp.claim('rw8', ARRAY['rw']), 2, 'seq 3 and 4');
SELECT is(idem_outbox_ack(pg_temp.ids('rw8'), pg_temp.tok('rw8')), 2, '... delivered at last');
SELECT is(idem_outbox_discard(ARRAY[pg_temp.ev('rw', 'r1', 4)]), 1, 'the stale listing of seq 4 can be discarded');
SELECT ok((SELECT acked_seq = 4 AND dead_seq IS NULL AND retry_at IS NULL AND lease_token IS NULL FROM pg_temp.dl('rw', 'r1')),
          'the aggregate ends delivered, not parked');

-- an ack without a lease token (by hand) of a blocked dead head passes it
SELECT count(*) FROM idem_outbox_emit_many('ah', ARRAY['h1', 'h1'], ARRAY['a', 'b'], ARRAY['{}', '{}']::jsonb[]) \g /dev/null
SELECT is(pg_temp.claim('ah1', ARRAY['ah']), 2, 'claim');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'bad', '0', %L)$$, pg_temp.ev('ah', 'h1', 1), pg_temp.tok('ah1')), 'seq 1 dead');
SELECT is(pg_temp.claim('ah2', ARRAY['ah']), 0, 'block');
SELECT is(idem_outbox_ack(ARRAY[pg_temp.ev('ah', 'h1', 1)]), 1, 'an ack by hand of the dead head marks it');
SELECT ok((SELECT acked_seq = 1 AND dead_seq IS NULL AND retry_at <> 'infinity' FROM pg_temp.dl('ah', 'h1')),
          '... no longer dead, no longer parked for good');
SELECT is(pg_temp.claim('ah3', ARRAY['ah']), 1, 'seq 2 flows');
SELECT is(idem_outbox_ack(pg_temp.ids('ah3'), pg_temp.tok('ah3')), 1, '... delivered');
SELECT is(pg_temp.dead('ah'), 'h1:1', 'its dead letter stays listed');
SELECT pg_temp.setting('outbox_max_attempts', '10') \g /dev/null

-- 10. outbox_mode -----------------------------------------------------------

SELECT pg_temp.setting('outbox_mode', 'wal') \g /dev/null
SELECT is(ARRAY(SELECT (idem_outbox_emit('wal', 'w1', 'x', '{}')).seq UNION ALL
                SELECT (idem_outbox_emit('wal', 'w1', 'x', '{}')).seq),
          ARRAY[1, 2]::bigint[], 'wal: emit returns the next seqs');
SELECT ok((SELECT id IS NOT NULL AND created_at IS NOT NULL AND attempts = 0 FROM idem_outbox_emit('wal', 'w2', 'x', '{}')),
          'wal: emit returns the event');
SELECT is(ARRAY(SELECT seq FROM idem_outbox_emit_many('wal', ARRAY['w1', 'w2'], ARRAY['x', 'x'], ARRAY['{}', '{}']::jsonb[])),
          ARRAY[3, 2]::bigint[], 'wal: emit_many advances the seqs too');
SELECT is((SELECT count(*)::int FROM idempotency.outbox_events WHERE aggregate_type = 'wal'), 0, 'wal: no event row stored');
SELECT is((SELECT last_seq FROM idempotency.outbox_sequences WHERE aggregate_type = 'wal' AND aggregate_id = 'w1'), 3::bigint,
          'wal: the counter advanced');
SELECT pg_temp.setting('outbox_mode', 'both') \g /dev/null
SELECT is((idem_outbox_emit('wal', 'w1', 'x', '{}')).seq, 4::bigint, 'both: the next seq');
SELECT is((SELECT count(*)::int FROM idempotency.outbox_events WHERE aggregate_type = 'wal'), 1, 'both: the row is stored');
SELECT pg_temp.setting('outbox_mode', 'table') \g /dev/null
SELECT is((idem_outbox_emit('wal', 'w1', 'x', '{}')).seq, 5::bigint, 'table: the next seq');
SELECT is((SELECT ARRAY[last_seq, stored_seq, wal_seq] FROM idempotency.outbox_sequences
            WHERE aggregate_type = 'wal' AND aggregate_id = 'w1'), ARRAY[3, 0, 3]::bigint[],
          'outbox_sequences: only the seqs no row carries (wal), the stored ones come from the rows');
SELECT is((SELECT ARRAY[last_seq, stored_seq, wal_seq] FROM idempotency.outbox_sequences
            WHERE aggregate_type = 'wal' AND aggregate_id = 'w2'), ARRAY[2, 0, 2]::bigint[],
          '... of an aggregate that went to WAL only');
SELECT is((SELECT pending FROM idempotency.outbox_backlog WHERE aggregate_type = 'wal'), 2::bigint,
          'the backlog counts only the stored events (w1: 4, 5)');
SELECT is(pg_temp.claim('w', ARRAY['wal']), 2, 'a relay gets the stored events of an aggregate whose first events went to WAL only');
SELECT is(pg_temp.runs('w'), 'w1:4,w1:5', '... seqs 4 and 5');
SELECT is(idem_outbox_ack(pg_temp.ids('w'), pg_temp.tok('w')), 2, '... delivered');
SELECT is((SELECT count(*)::int FROM idempotency.outbox_backlog WHERE aggregate_type = 'wal'), 0,
          'then nothing of that type is pending');

-- 11. aggregate_types -------------------------------------------------------

SELECT count(*) FROM unnest(ARRAY['ft-a', 'ft-b', 'ft-c']) t, LATERAL idem_outbox_emit(t, 'f', 'x', '{}') \g /dev/null
SELECT is(pg_temp.claim('f1', ARRAY['ft-a', 'ft-c', 'ft-none']), 2, 'aggregate_types: two of the types');
SELECT is((SELECT string_agg(aggregate_type, ',' ORDER BY aggregate_type) FROM got WHERE call = 'f1'), 'ft-a,ft-c',
          '... only those');
SELECT is(pg_temp.claim('f2', ARRAY['ft-b']), 1, 'aggregate_types: the other one');
SELECT count(*) FROM idem_outbox_emit('ft-d', 'f', 'x', '{}') \g /dev/null
SELECT ok(pg_temp.claim('f3', NULL, 1000) > 0, 'a claim of all types hands out events');
SELECT ok((SELECT count(*) FILTER (WHERE aggregate_type = 'ft-d') = 1
                  AND count(*) FILTER (WHERE aggregate_type IN ('ft-a', 'ft-b', 'ft-c')) = 0
             FROM got WHERE call = 'f3'),
          'NULL aggregate_types takes every type (ft-d), but not what others hold');

-- 12. privileges ------------------------------------------------------------

CREATE ROLE obt_nobody;
-- run a statement as obt_nobody
CREATE FUNCTION public.obt_as_nobody(sql text) RETURNS void LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    EXECUTE sql;
END $$;
ALTER FUNCTION public.obt_as_nobody(text) OWNER TO obt_nobody;
SELECT count(*) FROM idem_outbox_emit_many('priv', ARRAY['p1', 'p1'], ARRAY['x', 'x'], ARRAY['{}', '{}']::jsonb[]) \g /dev/null
SELECT is(pg_temp.claim('pv', ARRAY['priv']), 2, 'claim (as the test user)');
SELECT pg_temp.setting('outbox_max_attempts', '1') \g /dev/null
SELECT count(*) FROM idem_outbox_emit('priv', 'p2', 'x', '{}') \g /dev/null
SELECT is(pg_temp.claim('pv2', ARRAY['priv']), 1, 'claim p2');
SELECT lives_ok(format($$SELECT idem_outbox_nack(%L, 'bad', '0', %L)$$, pg_temp.ev('priv', 'p2', 1), pg_temp.tok('pv2')), 'p2 dead');
SELECT pg_temp.setting('outbox_max_attempts', '10') \g /dev/null
SELECT throws_ok($$SELECT obt_as_nobody('SELECT idem_outbox_emit(''priv'', ''p1'', ''x'', ''{}'')')$$,
                 '42501', NULL, 'a role without grants: emit raises 42501');
SELECT throws_ok($$SELECT obt_as_nobody('SELECT idem_outbox_emit_many(''priv'', ARRAY[''p1''], ARRAY[''x''], ARRAY[''{}'']::jsonb[])')$$,
                 '42501', NULL, 'a role without grants: emit_many raises 42501');
SELECT throws_ok($$SELECT obt_as_nobody('SELECT idem_outbox_claim()')$$,
                 '42501', NULL, 'a role without grants: claim raises 42501');
SELECT throws_ok(format($$SELECT obt_as_nobody(format('SELECT idem_outbox_ack(%%L, %%L)', %L::uuid[], %L::uuid))$$,
                        pg_temp.ids('pv'), pg_temp.tok('pv')),
                 '42501', NULL, 'a role without grants: ack raises 42501');
SELECT throws_ok(format($$SELECT obt_as_nobody(format('SELECT idem_outbox_nack(%%L, ''x'', NULL, %%L)', %L::uuid, %L::uuid))$$,
                        pg_temp.ev('priv', 'p1', 1), pg_temp.tok('pv')),
                 '42501', NULL, 'a role without grants: nack raises 42501');
SELECT throws_ok(format($$SELECT obt_as_nobody(format('SELECT idem_outbox_extend(%%L, ''1 minute'')', %L::uuid))$$, pg_temp.tok('pv')),
                 '42501', NULL, 'a role without grants: extend raises 42501');
SELECT throws_ok(format($$SELECT obt_as_nobody(format('SELECT idem_outbox_redrive(%%L)', %L::uuid[]))$$, ARRAY[pg_temp.ev('priv', 'p2', 1)]),
                 '42501', NULL, 'a role without grants: redrive raises 42501');
SELECT throws_ok(format($$SELECT obt_as_nobody(format('SELECT idem_outbox_discard(%%L)', %L::uuid[]))$$, ARRAY[pg_temp.ev('priv', 'p2', 1)]),
                 '42501', NULL, 'a role without grants: discard raises 42501');
SELECT throws_ok($$SELECT obt_as_nobody('SET idempotency.debug_clock_offset = 10')$$,
                 '42501', NULL, 'a role without grants: the test clock is not its to set');
SELECT lives_ok($$SELECT obt_as_nobody('SET LOCAL idempotency.outbox_mode = ''both''')$$,
                'a role without grants may set outbox settings');
SELECT ok((SELECT acked_seq = 0 AND lease_token = pg_temp.tok('pv') FROM pg_temp.dl('priv', 'p1'))
          AND pg_temp.dead('priv') = 'p2:1'
          AND (SELECT count(*) FROM idempotency.outbox_events WHERE aggregate_type = 'priv') = 3,
          'the refused calls changed nothing');

SELECT * FROM finish();
ROLLBACK;
