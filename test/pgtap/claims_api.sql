-- pgTAP: the public API of claims and retention settings (SPEC.md §1-2):
-- names, signatures, return types, the claims relation, and the basic
-- outcomes and error codes.  Runs in one transaction that rolls back.
\ir include/begin.sql

SELECT plan(51);

-- objects
SELECT has_schema('idempotency', 'schema idempotency exists');
SELECT has_relation('idempotency', 'claims', 'relation idempotency.claims exists');
SELECT has_column('idempotency', 'claims', 'scope', 'idempotency.claims has scope');
SELECT has_column('idempotency', 'claims', 'key', 'idempotency.claims has key');
SELECT has_column('idempotency', 'claims', 'claimed_at', 'idempotency.claims has claimed_at');
SELECT col_type_is('idempotency', 'claims', 'scope', 'text', 'scope is text');
SELECT col_type_is('idempotency', 'claims', 'key', 'text', 'key is text');
SELECT col_type_is('idempotency', 'claims', 'claimed_at', 'timestamp with time zone', 'claimed_at is timestamptz');

-- functions: signatures and return types
SELECT has_function('idem_claim', ARRAY['text', 'text', 'jsonb'], 'idem_claim(text, text, jsonb)');
SELECT function_returns('idem_claim', ARRAY['text', 'text', 'jsonb'], 'boolean', 'idem_claim returns boolean');
SELECT has_function('idem_claim_many', ARRAY['text[]', 'text'], 'idem_claim_many(text[], text)');
SELECT function_returns('idem_claim_many', ARRAY['text[]', 'text'], 'setof text', 'idem_claim_many returns setof text');
SELECT has_function('idem_claimed', ARRAY['text', 'text'], 'idem_claimed(text, text)');
SELECT function_returns('idem_claimed', ARRAY['text', 'text'], 'timestamp with time zone', 'idem_claimed returns timestamptz');
SELECT has_function('idem_release', ARRAY['text', 'text'], 'idem_release(text, text)');
SELECT function_returns('idem_release', ARRAY['text', 'text'], 'boolean', 'idem_release returns boolean');
SELECT has_function('idem_configure', ARRAY['interval', 'interval', 'integer'], 'idem_configure(interval, interval, integer)');
SELECT function_returns('idem_configure', ARRAY['interval', 'interval', 'integer'], 'void', 'idem_configure returns void');
SELECT has_function('idem_maintain', ARRAY[]::text[], 'idem_maintain()');
SELECT function_returns('idem_maintain', ARRAY[]::text[], 'setof record', 'idem_maintain returns a table');
SELECT is((SELECT pg_get_function_result('idem_maintain()'::regprocedure)),
          'TABLE(action text, object text)', 'idem_maintain returns TABLE(action text, object text)');
SELECT is((SELECT pg_get_function_arguments('idem_claim(text, text, jsonb)'::regprocedure)),
          'key text, scope text DEFAULT ''default''::text, payload jsonb DEFAULT NULL::jsonb',
          'idem_claim argument names and defaults');
SELECT is((SELECT pg_get_function_arguments('idem_configure(interval, interval, integer)'::regprocedure)),
          'retention interval DEFAULT NULL::interval, partition_interval interval DEFAULT NULL::interval, premake integer DEFAULT NULL::integer',
          'idem_configure argument names and defaults');

-- first claim, duplicate in the same transaction, scopes
SELECT is(idem_claim('pgtap-x'), true, 'first claim is true');
SELECT is(idem_claim('pgtap-x'), false, 'second claim in the same transaction is false');
SELECT is(idem_claim('pgtap-x', 'default'), false, 'scope defaults to ''default''');
SELECT is(idem_claim('pgtap-x', 'pgtap-other'), true, 'the same key in another scope is another claim');
SELECT is(idem_claimed('pgtap-never'), NULL, 'idem_claimed of an unclaimed key is NULL');
SELECT is(idem_claim(repeat('k', 1024)), true, 'a 1024-byte key works');

-- rollback to savepoint forgets the claim
SAVEPOINT s;
SELECT is(idem_claim('pgtap-sp'), true, 'claim inside a savepoint');
ROLLBACK TO SAVEPOINT s;
SELECT is(idem_claim('pgtap-sp'), true, 'claim is gone after ROLLBACK TO SAVEPOINT');

-- payload fingerprints
SELECT is(idem_claim('pgtap-p', 'default', '{"a": 1, "b": 2}'), true, 'claim with a payload');
SELECT is(idem_claim('pgtap-p', 'default', '{"b":2,"a":1}'), false, 'same payload, keys reordered: a duplicate');
SELECT throws_ok($$SELECT idem_claim('pgtap-p', 'default', '{"a": 1, "b": 3}')$$, 'IK001', NULL,
                 'a different payload raises IK001');

-- bad input
SELECT throws_ok($$SELECT idem_claim(NULL)$$, '22004', NULL, 'NULL key raises 22004');
SELECT throws_ok($$SELECT idem_claim('')$$, '22023', NULL, 'empty key raises 22023');
SELECT throws_ok($$SELECT idem_claim('k', NULL)$$, '22004', NULL, 'NULL scope raises 22004');
SELECT throws_ok($$SELECT idem_claim('k', '')$$, '22023', NULL, 'empty scope raises 22023');
SELECT throws_ok($$SELECT idem_claim('k', repeat('s', 64))$$, '22001', NULL, 'a 64-byte scope raises 22001 (too long)');
SELECT is(idem_claim('pgtap-scope', repeat('s', 63)), true, 'a 63-byte scope works');

-- batches: newly claimed keys, each once, in input order
SELECT is(ARRAY(SELECT idem_claim_many(ARRAY['m2', 'm1', 'm2', 'pgtap-x', 'm3'])),
          ARRAY['m2', 'm1', 'm3'], 'idem_claim_many returns the new keys once, in input order');
SELECT is(ARRAY(SELECT idem_claim_many(ARRAY['m1', 'm4'])), ARRAY['m4'],
          'idem_claim_many skips keys already claimed');
SELECT throws_ok($$SELECT idem_claim_many(ARRAY['m5', NULL])$$, '22004', NULL,
                 'NULL element in a batch raises 22004');

-- release
SELECT is(idem_release('pgtap-never'), false, 'releasing an unclaimed key is false');

-- configure: validation
SELECT throws_ok($$SELECT idem_configure(retention => '1 hour', partition_interval => '2 hours')$$,
                 '22023', NULL, 'retention shorter than partition_interval raises 22023');
SELECT throws_ok($$SELECT idem_configure(partition_interval => '500 milliseconds')$$,
                 '22023', NULL, 'partition_interval under 1 second raises 22023');
SELECT throws_ok($$SELECT idem_configure(retention => '1 hour', partition_interval => '1 second', premake => 30)$$,
                 '22023', 'too many live partitions: 3631, at most 400',
                 'a shape with more live partitions than the claim path serves raises 22023');
SELECT lives_ok($$SELECT idem_configure(retention => '395 seconds', partition_interval => '1 second', premake => 4)$$,
                'a shape of exactly 400 live partitions is accepted');
SELECT throws_ok($$SELECT idem_configure(retention => '396 seconds', partition_interval => '1 second', premake => 4)$$,
                 '22023', 'too many live partitions: 401, at most 400',
                 'one live partition more than 400 raises 22023');
SELECT lives_ok($$SELECT idem_configure(retention => '1 minute', partition_interval => '1 second', premake => 30)$$,
                'idem_configure with 1-second partitions');
SELECT is(idem_claim('pgtap-after-configure'), true, 'claims work after idem_configure');

SELECT * FROM finish();
ROLLBACK;
