-- idem_upsert() and idem_transition(): outcomes, bad input, privileges.
\getenv abs_srcdir PG_ABS_SRCDIR
\set guard_schema guard_h
\set setup_sql :abs_srcdir '/include/guard_setup.sql'
\i :setup_sql

---- idem_upsert ----
CREATE TABLE items (id int PRIMARY KEY, name text, qty int, version bigint);
SELECT idem_upsert(ROW(1, 'apple', 5, 1)::items);          -- inserted
SELECT idem_upsert(ROW(1, 'apple', 7, 2)::items);          -- updated
SELECT idem_upsert(ROW(1, 'apple', 9, 2)::items);          -- equal: stale
SELECT idem_upsert(ROW(1, 'apple', 1, 1)::items);          -- older: stale
SELECT * FROM items;
-- a row variable, as a handler would pass it; many calls reuse the plan
DO $$
DECLARE r items; res text; counts text := '';
BEGIN
    FOR i IN 1..12 LOOP
        r := ROW(2, 'pear', i, i % 6)::items;   -- versions 1..5,0,1..5,0
        res := idem_upsert(r);
        counts := counts || left(res, 1);
    END LOOP;
    RAISE NOTICE 'outcomes: %', counts;
END $$;
SELECT * FROM items ORDER BY id;
-- generic and custom plans give the same answers
SET plan_cache_mode = force_generic_plan;
SELECT idem_upsert(ROW(3, 'fig', 1, v)::items) FROM unnest('{1,1,2,1,3}'::int[]) v;
SET plan_cache_mode = force_custom_plan;
SELECT idem_upsert(ROW(3, 'fig', 1, v)::items) FROM unnest('{3,4,4}'::int[]) v;
RESET plan_cache_mode;
SELECT upsert_stale FROM idempotency.guard_stats();

-- the cached plan follows ALTER TABLE
ALTER TABLE items ADD COLUMN colour text;
SELECT idem_upsert(ROW(1, 'apple', 10, 3, 'red')::items);
ALTER TABLE items DROP COLUMN qty;
SELECT idem_upsert(ROW(1, 'apple', 4, 'green')::items);
SELECT * FROM items ORDER BY id;

-- another version column name, odd identifiers, a generated column and an
-- identity column (GENERATED ALWAYS: the table's value is kept, the row's ignored)
CREATE TABLE "Odd Items" (
    "Item Id" text PRIMARY KEY,
    seq       bigint GENERATED ALWAYS AS IDENTITY,
    "Rev"     timestamptz,
    body      text,
    body_len  int GENERATED ALWAYS AS (length(body)) STORED
);
SELECT idem_upsert(ROW('a', 100, '2024-01-01 00:00+00', 'hello', NULL)::"Odd Items", 'Rev');
SELECT idem_upsert(ROW('a', 100, '2024-01-01 00:00+00', 'same rev', NULL)::"Odd Items", 'Rev');
SELECT idem_upsert(ROW('a', 100, '2024-01-02 00:00+00', 'next day', NULL)::"Odd Items", 'Rev');
SELECT "Item Id", seq, "Rev", body, body_len FROM "Odd Items";

-- a partitioned table, and a guarded table in 'error' mode (the upsert's own
-- version test stops a stale row before the guard sees it: 'stale', no error)
CREATE TABLE parted (region int, id int, version int, payload text, PRIMARY KEY (region, id))
    PARTITION BY LIST (region);
CREATE TABLE parted_1 PARTITION OF parted FOR VALUES IN (1);
CREATE TABLE parted_2 PARTITION OF parted FOR VALUES IN (2);
SELECT idem_guard_version('parted', on_stale => 'error');
SELECT idem_upsert(ROW(r, 1, v, 'p' || v)::parted)
  FROM (VALUES (1, 1), (2, 1), (1, 2), (1, 2), (2, 0), (1, 1)) x(r, v);
SELECT tableoid::regclass, * FROM parted ORDER BY region;

-- bad input
CREATE TABLE nopk (id int, version int);
CREATE TABLE textver (id int PRIMARY KEY, version text);
SELECT pg_temp.try($$SELECT idem_upsert(ROW(1, 'x', NULL, NULL)::items)$$);
SELECT pg_temp.try($$SELECT idem_upsert(NULL::items)$$);
SELECT pg_temp.try($$SELECT idem_upsert(ROW(1, 'x', 1, NULL)::items, NULL)$$);
SELECT pg_temp.try($$SELECT idem_upsert(42)$$);
SELECT pg_temp.try($$SELECT idem_upsert(ROW(1, 2))$$);
SELECT pg_temp.try($$SELECT idem_upsert(ROW(1, 1)::nopk)$$);
SELECT pg_temp.try($$SELECT idem_upsert(ROW(1, 'x', 1, NULL)::items, 'rev')$$);
SELECT pg_temp.try($$SELECT idem_upsert(ROW(1, '1')::textver)$$);

---- idem_transition ----
CREATE TYPE ship_state AS ENUM ('pending', 'dispatched', 'delivered', 'cancelled');
CREATE TABLE shipments (id bigint PRIMARY KEY, state ship_state NOT NULL, dispatched_at int);
INSERT INTO shipments VALUES (1, 'pending'), (2, 'pending'), (3, 'delivered');
SELECT pg_temp.try($$SELECT idem_transition('shipments', 1, 'dispatched')$$);  -- no guard yet
SELECT idem_guard_transitions('shipments', 'state',
    '{"pending": ["dispatched", "cancelled"], "dispatched": ["delivered"]}');
SELECT idem_transition('shipments', 1, 'dispatched');        -- applied
SELECT idem_transition('shipments', 1, 'dispatched');        -- already_applied
SELECT idem_transition('shipments', 1::bigint, 'pending');   -- rejected
SELECT idem_transition('shipments', 1::smallint, 'delivered'); -- applied
SELECT idem_transition('shipments', 99, 'delivered');        -- not_found
SELECT idem_transition('shipments', 3, 'cancelled');         -- rejected
SELECT * FROM shipments ORDER BY id;
SELECT invalid_skipped, already_applied FROM idempotency.guard_stats();
-- 'error' mode: the guard's IK005 reaches the caller
SELECT idem_guard_transitions('shipments', 'state',
    '{"pending": ["dispatched", "cancelled"], "dispatched": ["delivered"]}', 'error');
SELECT pg_temp.try($$SELECT idem_transition('shipments', 3, 'pending')$$);
SELECT idem_transition('shipments', 2, 'cancelled');
-- bad input
SELECT pg_temp.try($$SELECT idem_transition('shipments', 2, 'lost')$$);
SELECT pg_temp.try($$SELECT idem_transition('shipments', NULL::int, 'pending')$$);
SELECT pg_temp.try($$SELECT idem_transition(NULL, 1, 'pending')$$);
SELECT pg_temp.try($$SELECT idem_transition('shipments', 1, NULL)$$);
SELECT pg_temp.try($$SELECT idem_transition('nope', 1, 'pending')$$);
SELECT pg_temp.try($$SELECT idem_transition(4000000000::oid::regclass, 1, 'pending')$$);
CREATE TABLE twokey (a int, b int, s text, PRIMARY KEY (a, b));
SELECT idem_guard_transitions('twokey', 's', '{"x": ["y"]}');
SELECT pg_temp.try($$SELECT idem_transition('twokey', 1, 'y')$$);
-- text key and text state
CREATE TABLE docs (slug text PRIMARY KEY, status text);
INSERT INTO docs VALUES ('a-b', 'draft');
SELECT idem_guard_transitions('docs', 'status', '{"draft": ["published"]}');
SELECT idem_transition('docs', 'a-b'::text, 'published'), idem_transition('docs', 'a-b'::varchar, 'published');

---- privileges: the helpers write only what the caller could write itself ----
CREATE ROLE guard_h_reader;
CREATE ROLE guard_h_writer;
GRANT USAGE ON SCHEMA guard_h TO guard_h_reader, guard_h_writer;
GRANT SELECT ON items, shipments TO guard_h_reader;
GRANT SELECT, INSERT ON items TO guard_h_reader;      -- INSERT but no UPDATE
GRANT SELECT, INSERT, UPDATE ON items, shipments TO guard_h_writer;
-- the plans are already cached from the owner's calls above
SET ROLE guard_h_reader;
SELECT pg_temp.try($$SELECT idem_upsert(ROW(1, 'apple', 99, 'blue')::items)$$);   -- would update
SELECT pg_temp.try($$SELECT idem_upsert(ROW(50, 'kiwi', 1, 'green')::items)$$);   -- would insert
SELECT pg_temp.try($$SELECT idem_transition('shipments', 2, 'pending')$$);
SELECT pg_temp.try($$SELECT idem_guard_version('items')$$);
RESET ROLE;
SET ROLE guard_h_writer;
SELECT pg_temp.try($$SELECT idem_upsert(ROW(1, 'apple', 99, 'blue')::items)$$);
SELECT pg_temp.try($$SELECT idem_upsert(ROW(50, 'kiwi', 1, 'green')::items)$$);
SELECT pg_temp.try($$SELECT idem_transition('shipments', 1, 'delivered')$$);
RESET ROLE;
-- row level security applies to the helpers as to any statement
ALTER TABLE items ENABLE ROW LEVEL SECURITY;
CREATE POLICY only_low_ids ON items USING (id < 10) WITH CHECK (id < 10);
SET ROLE guard_h_writer;
SELECT pg_temp.try($$SELECT idem_upsert(ROW(60, 'plum', 1, 'x')::items)$$);
SELECT pg_temp.try($$SELECT idem_upsert(ROW(2, 'pear', 9, 'y')::items)$$);
RESET ROLE;
SELECT * FROM items ORDER BY id;

\set guard_roles 'guard_h_reader, guard_h_writer'
\i :guard_teardown
