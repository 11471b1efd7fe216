-- Version guard: idem_guard_version() on tables, every outcome.
\getenv abs_srcdir PG_ABS_SRCDIR
\set guard_schema guard_v
\set setup_sql :abs_srcdir '/include/guard_setup.sql'
\i :setup_sql
-- show every skip, with its gap, in the test output
SET idempotency.guard_log_level = notice;

CREATE TABLE acct (id int PRIMARY KEY, balance int, version bigint);
INSERT INTO acct VALUES (1, 10, 5), (2, 20, 5), (3, 30, 5), (4, 40, NULL);
SELECT idem_guard_version('acct');

-- older, equal and newer versions
UPDATE acct SET balance = 11, version = 4 WHERE id = 1;
UPDATE acct SET balance = 11, version = 5 WHERE id = 1;
UPDATE acct SET balance = 11, version = 6 WHERE id = 1;
-- an update that does not raise the version does not change the row either
UPDATE acct SET balance = 12 WHERE id = 1;
-- a row without a version yet takes any version
UPDATE acct SET balance = 41, version = 1 WHERE id = 4;
SELECT * FROM acct ORDER BY id;

-- multi-row update where only some rows are stale: 2 of 4 applied
UPDATE acct a SET balance = v.balance, version = v.version
  FROM (VALUES (1, 100, 7), (2, 200, 3), (3, 300, 5), (4, 400, 2)) v(id, balance, version)
 WHERE a.id = v.id
RETURNING a.id AS applied;
SELECT * FROM acct ORDER BY id;

-- the DO UPDATE arm of INSERT ... ON CONFLICT, with no WHERE of its own
INSERT INTO acct VALUES (2, 0, 4), (3, 333, 6), (5, 50, 1)
    ON CONFLICT (id) DO UPDATE SET balance = EXCLUDED.balance, version = EXCLUDED.version;
INSERT INTO acct VALUES (1, 1, 1)
    ON CONFLICT (id) DO UPDATE SET balance = EXCLUDED.balance, version = EXCLUDED.version
    RETURNING *;
SELECT * FROM acct ORDER BY id;

-- NULL new version: 22004, also in skip mode
SELECT pg_temp.try($$UPDATE acct SET version = NULL WHERE id = 1$$);

SELECT * FROM idempotency.guard_stats();

-- 'error' mode: IK004, and the whole statement is rolled back
SELECT idem_guard_version('acct', 'version', 'error');
SELECT pg_temp.try($$UPDATE acct SET balance = balance + 1, version = version + 1$$);  -- all newer: ok
SELECT pg_temp.try($$UPDATE acct SET balance = -1, version = 6 WHERE id = 1$$);
SELECT pg_temp.try($$UPDATE acct SET balance = -1, version = version + (id % 2) $$);
SELECT pg_temp.try($$INSERT INTO acct VALUES (1, -1, 2) ON CONFLICT (id) DO UPDATE SET balance = EXCLUDED.balance, version = EXCLUDED.version$$);
SELECT * FROM acct ORDER BY id;
\set VERBOSITY sqlstate
UPDATE acct SET version = 0 WHERE id = 1;
\set VERBOSITY default
UPDATE acct SET version = 0 WHERE id = 1;
SELECT stale_rejected > 0 AS rejected_counted FROM idempotency.guard_stats();

-- installing again replaces the guard: one trigger, the new mode
SELECT idem_guard_version('acct', on_stale => 'skip');
SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger WHERE tgrelid = 'acct'::regclass ORDER BY tgname;

-- each supported type (and a domain over one); gaps in the skip notices
CREATE DOMAIN posint AS integer CHECK (VALUE > 0);
CREATE TABLE t_int2 (id int PRIMARY KEY, v smallint);
CREATE TABLE t_int4 (id int PRIMARY KEY, v integer);
CREATE TABLE t_int8 (id int PRIMARY KEY, v bigint);
CREATE TABLE t_num  (id int PRIMARY KEY, v numeric);
CREATE TABLE t_ts   (id int PRIMARY KEY, v timestamp);
CREATE TABLE t_tstz (id int PRIMARY KEY, v timestamptz);
CREATE TABLE t_dom  (id int PRIMARY KEY, v posint);
INSERT INTO t_int2 VALUES (1, 10);
INSERT INTO t_int4 VALUES (1, 10);
INSERT INTO t_int8 VALUES (1, 9223372036854775807);
INSERT INTO t_num  VALUES (1, 10.5);
INSERT INTO t_ts   VALUES (1, '2024-01-02 12:00');
INSERT INTO t_tstz VALUES (1, '2024-01-02 12:00+00');
INSERT INTO t_dom  VALUES (1, 10);
SELECT idem_guard_version(t, 'v') FROM unnest('{t_int2,t_int4,t_int8,t_num,t_ts,t_tstz,t_dom}'::regclass[]) t;
UPDATE t_int2 SET v = 9;
UPDATE t_int2 SET v = 11;
UPDATE t_int4 SET v = -2147483648;
UPDATE t_int4 SET v = 2147483647;
UPDATE t_int8 SET v = -9223372036854775808;
UPDATE t_int8 SET v = 9223372036854775807;
UPDATE t_num  SET v = 10.25;
UPDATE t_num  SET v = 10.500;
UPDATE t_num  SET v = 10.51;
UPDATE t_ts   SET v = '2024-01-01 11:30';
UPDATE t_ts   SET v = '2024-01-02 12:00:00.000001';
UPDATE t_tstz SET v = '2024-01-02 13:00+02';
UPDATE t_tstz SET v = '2024-01-02 13:00+00';
UPDATE t_dom  SET v = 3;
UPDATE t_dom  SET v = 12;
SELECT 'int2' t, v::text FROM t_int2 UNION ALL SELECT 'int4', v::text FROM t_int4
UNION ALL SELECT 'int8', v::text FROM t_int8 UNION ALL SELECT 'numeric', v::text FROM t_num
UNION ALL SELECT 'timestamp', v::text FROM t_ts UNION ALL SELECT 'timestamptz', v::text FROM t_tstz
UNION ALL SELECT 'domain', v::text FROM t_dom;

-- a table without a primary key: the notice has no key
CREATE TABLE nokey (v int);
INSERT INTO nokey VALUES (5);
SELECT idem_guard_version('nokey', 'v');
UPDATE nokey SET v = 5;

-- bad input
CREATE TABLE badtypes (id int PRIMARY KEY, vtext text, vreal real, vdate date);
SELECT pg_temp.try($$SELECT idem_guard_version('badtypes', 'vtext')$$);
SELECT pg_temp.try($$SELECT idem_guard_version('badtypes', 'vreal')$$);
SELECT pg_temp.try($$SELECT idem_guard_version('badtypes', 'vdate')$$);
SELECT pg_temp.try($$SELECT idem_guard_version('badtypes', 'nope')$$);
SELECT pg_temp.try($$SELECT idem_guard_version('badtypes', 'xmin')$$);
SELECT pg_temp.try($$SELECT idem_guard_version('no_such_table')$$);
SELECT pg_temp.try($$SELECT idem_guard_version(4000000000::oid::regclass)$$);
SELECT pg_temp.try($$SELECT idem_guard_version('acct', 'version', 'ignore')$$);
SELECT pg_temp.try($$SELECT idem_guard_version(NULL)$$);
SELECT pg_temp.try($$SELECT idem_guard_version('acct', NULL)$$);
SELECT pg_temp.try($$SELECT idem_guard_version('acct', 'version', NULL)$$);
CREATE VIEW acct_v AS SELECT * FROM acct;
SELECT pg_temp.try($$SELECT idem_guard_version('acct_v')$$);
SELECT pg_temp.try($$SELECT idem_unguard(NULL)$$);

-- only the owner may install or remove a guard
CREATE ROLE guard_v_other;
GRANT USAGE ON SCHEMA guard_v TO guard_v_other;
GRANT ALL ON acct TO guard_v_other;
SET ROLE guard_v_other;
SELECT pg_temp.try($$SELECT idem_guard_version('acct')$$);
SELECT pg_temp.try($$SELECT idem_unguard('acct')$$);
-- but the guard protects this role's writes too
UPDATE acct SET version = 1 WHERE id = 1;
RESET ROLE;

-- the trigger function refuses to run other than as a BEFORE UPDATE row trigger
CREATE TABLE misuse (id int PRIMARY KEY, version int);
CREATE TRIGGER wrong AFTER UPDATE ON misuse FOR EACH ROW EXECUTE FUNCTION idempotency.version_guard('version', 'skip');
INSERT INTO misuse VALUES (1, 1);
SELECT pg_temp.try($$UPDATE misuse SET version = 2$$);
DROP TRIGGER wrong ON misuse;
CREATE TRIGGER wrong BEFORE UPDATE ON misuse FOR EACH ROW EXECUTE FUNCTION idempotency.version_guard('gone', 'skip');
SELECT pg_temp.try($$UPDATE misuse SET version = 2$$);
SELECT pg_temp.try($$SELECT idempotency.version_guard()$$);

-- guard on a partitioned table reaches every partition
CREATE TABLE parted (id int, region int, version int, PRIMARY KEY (region, id)) PARTITION BY LIST (region);
CREATE TABLE parted_1 PARTITION OF parted FOR VALUES IN (1);
SELECT idem_guard_version('parted');
CREATE TABLE parted_2 PARTITION OF parted FOR VALUES IN (2);
INSERT INTO parted VALUES (1, 1, 5), (1, 2, 5);
UPDATE parted SET version = 4;
UPDATE parted SET version = 6 WHERE region = 2;
SELECT tableoid::regclass, * FROM parted ORDER BY region;

-- what pg_dump writes for the guard restores it: drop it, replay its
-- definition, and it works as before
CREATE TEMP TABLE saved AS
    SELECT pg_get_triggerdef(oid) AS def FROM pg_trigger WHERE tgrelid = 'acct'::regclass;
SELECT idem_unguard('acct');
SELECT count(*) AS guards_left FROM pg_trigger WHERE tgrelid = 'acct'::regclass;
UPDATE acct SET version = 0 WHERE id = 5;
DO $$ BEGIN EXECUTE (SELECT def FROM saved); END $$;
UPDATE acct SET version = -1 WHERE id = 5;
SELECT * FROM acct WHERE id = 5;
-- unguarding twice is harmless
SELECT idem_unguard('acct');
SELECT idem_unguard('acct');

\set guard_roles 'guard_v_other'
\i :guard_teardown
