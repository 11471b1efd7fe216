-- Requests in several partitions.  begin and the holder's calls find a
-- key's row partition by partition (the one a row begun now goes into
-- first, then the others; src/delivery/requests.c), not by a statement on
-- idempotency.requests: each call must act on the key's row wherever it
-- is, on no other row (not the same key's in another scope), and find none
-- where there is none -- also once a partition has been dropped.  Time
-- moves forward with idempotency.debug_clock_offset, across the partitions
-- premade at install.
CREATE EXTENSION idempotency;

\getenv abs_srcdir PG_ABS_SRCDIR
\set try_sql :abs_srcdir '/include/try.sql'
\i :try_sql

-- the rows, each in the partition its bucket names, and which partition
-- (in order of their time ranges)
CREATE VIEW pg_temp.rows AS
SELECT r.scope, r.key, r.status, r.attempt, r.recovery_point, r.state, r.response,
       r.response_status, p.bucket = r.bucket AS in_its_partition,
       dense_rank() OVER (ORDER BY p.lower) AS partition
  FROM idempotency.requests r JOIN idempotency.request_partitions p ON p.relid = r.tableoid
 ORDER BY r.scope, r.key;

-- 1. Rows made on day 0, day 1 and day 3: one key in two scopes, others
SELECT status, attempt FROM idem_request_begin('a', 'one');
SET idempotency.debug_clock_offset = '25h';
SELECT status, attempt FROM idem_request_begin('a', 'two');
SELECT status, attempt FROM idem_request_begin('b', 'one');
SET idempotency.debug_clock_offset = '73h';
SELECT status, attempt FROM idem_request_begin('c', 'one');
SELECT * FROM pg_temp.rows;

-- 2. On day 3 the holder's calls find the rows of older partitions, each
-- the key's own: only a/one's recovery point, b/one's lease and a/two's
-- response change
SELECT lease_until AS b_lease FROM idempotency.requests WHERE key = 'b' \gset
SELECT idem_request_checkpoint('a', 'one', 1, 'step_1', '{"s": 1}');
SELECT idem_request_extend('b', 'one', 1, '1 hour');
SELECT status, response FROM idem_request_complete('a', 'two', '{"two": true}', 1, 201);
SELECT * FROM pg_temp.rows;
SELECT lease_until > :'b_lease' AS b_extended FROM idempotency.requests WHERE key = 'b';
SELECT idem_request_fence('a', 'one', 1);
SELECT pg_temp.try($$SELECT idem_request_fence('a', 'two', 1)$$);
SELECT pg_temp.try($$SELECT idem_request_checkpoint('c', 'one', 2, 'x')$$);
SELECT status, response, replayed FROM idem_request_begin('a', 'two');

-- 3. A takeover and a restart act on the rows where they are: a/one's
-- lease (day 0) has expired, b/one is abandoned and begun again
SET idempotency.debug_clock_offset = '74h';
SELECT status, attempt, recovery_point, state FROM idem_request_begin('a', 'one');
SELECT pg_temp.try($$SELECT idem_request_checkpoint('a', 'one', 1, 'stale')$$);
SELECT idem_request_abandon('b', 'one');
SELECT status, attempt, recovery_point FROM idem_request_begin('b', 'one');
SELECT * FROM pg_temp.rows;

-- 4. A row that outlived its claim (released here): the new claim starts
-- the key afresh in that row, in its older partition, and complete finds it
SELECT idem_release('a', 'request:two') AS claim_released;
SELECT status, attempt, response FROM idem_request_begin('a', 'two');
SELECT status, response FROM idem_request_complete('a', 'two', '{"two": "again"}', 2, 200);
SELECT * FROM pg_temp.rows;

-- 5. A key with no row: IK003, nothing to forget, and no row made
SELECT pg_temp.try($$SELECT idem_request_complete('nope', 'one', '{}', 1)$$);
SELECT pg_temp.try($$SELECT idem_request_extend('nope', 'one', 1, '1 minute')$$);
SELECT pg_temp.try($$SELECT idem_request_fence('nope', 'one', 1)$$);
SELECT idem_request_abandon('nope', 'one');
SELECT count(*) AS rows FROM idempotency.requests;

-- 6. Retention drops day 0's partition between a begin and its complete
-- (this backend had it cached): a/one's calls find no row; b/one's and
-- c/one's are found in the partitions that stay
SELECT tableoid AS day0 FROM idempotency.requests WHERE scope = 'one' AND key = 'a' \gset
SELECT idem_configure(retention => '1 day', partition_interval => '1 day', premake => 1);
SELECT count(*) >= 0 AS maintained FROM idem_maintain();
SELECT count(*) AS day0_partitions FROM idempotency.request_partitions WHERE relid = :'day0'::regclass;
SELECT * FROM pg_temp.rows;
SELECT pg_temp.try($$SELECT idem_request_complete('a', 'one', '{}', 2)$$);
SELECT pg_temp.try($$SELECT idem_request_fence('b', 'one', 2)$$);
SELECT status, response FROM idem_request_complete('c', 'one', '{"c": true}', 1, 200);
SELECT * FROM pg_temp.rows;

RESET idempotency.debug_clock_offset;
SET client_min_messages = warning;
DROP EXTENSION idempotency CASCADE;
