-- Guards and helpers on every kind of column: identity keys, state columns
-- of every type with an equality, generated columns, non-finite versions,
-- partitions of guarded tables.
\getenv abs_srcdir PG_ABS_SRCDIR
\set guard_schema guard_k
\set setup_sql :abs_srcdir '/include/guard_setup.sql'
\i :setup_sql
SET idempotency.guard_log_level = notice;

---- idem_upsert on a GENERATED ALWAYS AS IDENTITY primary key: the row's key is used ----
CREATE TABLE ident_items (id int GENERATED ALWAYS AS IDENTITY PRIMARY KEY, name text, version int);
SELECT idem_upsert(ROW(1, 'a', 1)::ident_items);      -- inserted, as id 1
SELECT idem_upsert(ROW(1, 'b', 2)::ident_items);      -- updated
SELECT idem_upsert(ROW(1, 'c', 2)::ident_items);      -- stale
SELECT idem_upsert(ROW(7, 'x', 1)::ident_items);      -- inserted, as id 7
SELECT * FROM ident_items ORDER BY id;
-- a composite key with an identity part, and a non-key identity column
-- (GENERATED ALWAYS, not in the key: still the table's own value)
CREATE TABLE ident_parts (region int, id bigint GENERATED ALWAYS AS IDENTITY,
                          seq int GENERATED ALWAYS AS IDENTITY (START 100),
                          version int, PRIMARY KEY (region, id));
SELECT idem_upsert(ROW(1, 5, 0, 1)::ident_parts), idem_upsert(ROW(1, 5, 0, 2)::ident_parts),
       idem_upsert(ROW(2, 5, 0, 1)::ident_parts);
SELECT * FROM ident_parts ORDER BY region, id;

---- idem_upsert on a table with a transition guard ----
CREATE TYPE order_state AS ENUM ('pending', 'dispatched', 'delivered');
CREATE TABLE orders (id int PRIMARY KEY, state order_state, note text, version int);
SELECT idem_guard_transitions('orders', 'state', '{"pending": ["dispatched"], "dispatched": ["delivered"]}');
SELECT idem_upsert(ROW(1, 'pending', 'created', 1)::orders);         -- inserted
SELECT idem_upsert(ROW(1, 'pending', 'address fixed', 2)::orders);   -- newer, same state: updated
SELECT idem_upsert(ROW(1, 'pending', 'replayed', 2)::orders);        -- equal version: stale
SELECT idem_upsert(ROW(1, 'dispatched', 'sent', 3)::orders);         -- along an edge: updated
SELECT idem_upsert(ROW(1, 'pending', 'back?', 4)::orders);           -- not an edge: not applied
SELECT idem_upsert(ROW(1, 'dispatched', 'tracking no.', 5)::orders); -- newer, same state: updated
SELECT idem_upsert(ROW(1, 'delivered', 'old news', 4)::orders);      -- older: stale
SELECT * FROM orders;
-- a NULL state is a state like any other: newer NULL-state rows apply
SELECT idem_upsert(ROW(2, NULL, 'draft', 1)::orders), idem_upsert(ROW(2, NULL, 'draft 2', 2)::orders),
       idem_upsert(ROW(2, 'pending', 'placed', 3)::orders);
SELECT * FROM orders WHERE id = 2;
-- 'error' mode: a refused move raises IK005, a newer row in the same state does not
SELECT idem_guard_transitions('orders', 'state', '{"pending": ["dispatched"], "dispatched": ["delivered"]}', 'error');
SELECT pg_temp.try($$SELECT idem_upsert(ROW(1, 'pending', 'back?', 6)::orders)$$);
SELECT idem_upsert(ROW(1, 'dispatched', 'tracking no. 2', 6)::orders);
SELECT * FROM orders WHERE id = 1;

---- a table with both guards: the version says what is new, the map which moves are allowed ----
CREATE TABLE tickets (id int PRIMARY KEY, status text NOT NULL, note text, version int NOT NULL);
INSERT INTO tickets VALUES (1, 'open', 'filed', 1);
SELECT idem_guard_transitions('tickets', 'status', '{"open": ["closed"]}');
SELECT idem_guard_version('tickets');
-- same state, newer version: a newer snapshot, applied
UPDATE tickets SET status = 'open', note = 'triaged', version = 2 RETURNING *;
-- same state, same version: a redelivery, the row stays (already applied)
UPDATE tickets SET status = 'open', note = 'redelivered', version = 2 RETURNING *;
-- same state, older version
UPDATE tickets SET status = 'open', note = 'older', version = 1 RETURNING *;
-- a move along an edge that does not raise the version: stale
UPDATE tickets SET status = 'closed', note = 'stale close', version = 2 RETURNING *;
UPDATE tickets SET status = 'closed', note = 'closed', version = 3 RETURNING *;
SELECT idem_upsert(ROW(1, 'closed', 'closed, newer', 4)::tickets);
SELECT idem_upsert(ROW(1, 'closed', 'closed, again', 4)::tickets);
SELECT * FROM tickets;
-- idem_transition sets no version: refused on such a table
SELECT pg_temp.try($$SELECT idem_transition('tickets', 1, 'open')$$);

---- state columns of every type with an equality: compared as values ----
CREATE DOMAIN ticket_status AS text CHECK (VALUE IN ('new', 'done'));
CREATE TABLE states (
    id     int PRIMARY KEY,
    c      char(10),
    b      boolean,
    i      integer,
    vc     varchar(12),
    d      ticket_status
);
INSERT INTO states VALUES (1, 'pending', false, 1, 'pending', 'new');
-- char(n): 'pending' in the map is the stored 'pending   '
SELECT idem_guard_transitions('states', 'c', '{"pending": ["done"]}');
UPDATE states SET c = 'done' RETURNING c;
UPDATE states SET c = 'done  ' RETURNING c;          -- already applied
UPDATE states SET c = 'pending' RETURNING c;         -- not an edge
SELECT idem_transition('states', 1, 'done');
-- boolean: any spelling of a boolean names the state
SELECT idem_guard_transitions('states', 'b', '{"f": ["true"]}');
UPDATE states SET b = true RETURNING b;
UPDATE states SET b = 'yes' RETURNING b;             -- already applied
UPDATE states SET b = false RETURNING b;             -- not an edge
SELECT idem_transition('states', 1, 't'), idem_transition('states', 1, 'on');
-- integer: "02" is 2; two keys naming one state share their targets
SELECT idem_guard_transitions('states', 'i', '{"1": ["02"], "2": ["3"], "+2": ["5"]}');
UPDATE states SET i = 2 RETURNING i;
UPDATE states SET i = 5 RETURNING i;
UPDATE states SET i = 1 RETURNING i;                 -- not an edge
-- varchar and a domain over text
SELECT idem_guard_transitions('states', 'vc', '{"pending": ["done"]}');
UPDATE states SET vc = 'done' RETURNING vc;
SELECT idem_guard_transitions('states', 'd', '{"new": ["done"]}');
UPDATE states SET d = 'done' RETURNING d;
UPDATE states SET d = 'new' RETURNING d;             -- not an edge
SELECT pg_temp.try($$SELECT idem_guard_transitions('states', 'd', '{"new": ["gone"]}')$$);
SELECT * FROM states;
-- a state the column cannot hold, and types without an equality operator
SELECT pg_temp.try($$SELECT idem_guard_transitions('states', 'b', '{"f": ["maybe"]}')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('states', 'c', '{"pending": ["far too long a state"]}')$$);
CREATE TABLE eqless (id int PRIMARY KEY, p point, j json);
SELECT pg_temp.try($$SELECT idem_guard_transitions('eqless', 'p', '{"(0,0)": ["(1,1)"]}')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('eqless', 'j', '{"1": ["2"]}')$$);
SELECT idem_guard_transitions('eqless', 'p', '{"(0,0)": ["(1,1)"]}');

---- generated columns cannot be guarded ----
CREATE TABLE gen (id int PRIMARY KEY, base int, version int GENERATED ALWAYS AS (base * 2) STORED,
                  state text GENERATED ALWAYS AS (CASE WHEN base > 0 THEN 'on' ELSE 'off' END) STORED);
INSERT INTO gen (id, base) VALUES (1, 1);
SELECT pg_temp.try($$SELECT idem_guard_version('gen')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('gen', 'state', '{"on": ["off"]}')$$);
SELECT idem_guard_version('gen');
SELECT count(*) AS guards FROM pg_trigger WHERE tgrelid = 'gen'::regclass;
-- nor by a trigger made by hand (or restored): every update fails rather than being skipped
CREATE TRIGGER idem_guard_version BEFORE UPDATE ON gen
    FOR EACH ROW EXECUTE FUNCTION idempotency.version_guard('version', 'skip');
SELECT pg_temp.try($$UPDATE gen SET base = 5$$);
DROP TRIGGER idem_guard_version ON gen;
UPDATE gen SET base = 5 RETURNING *;

---- versions must be finite ----
CREATE TABLE vnum (id int PRIMARY KEY, version numeric);
CREATE TABLE vts (id int PRIMARY KEY, version timestamptz);
-- rows written before the guard (INSERT is not guarded)
INSERT INTO vnum VALUES (1, 1), (2, 'NaN'), (3, '-Infinity'), (4, 'Infinity');
INSERT INTO vts VALUES (1, '2024-01-01 00:00+00'), (2, '-infinity'), (3, 'infinity');
SELECT idem_guard_version('vnum'), idem_guard_version('vts');
SELECT pg_temp.try($$UPDATE vnum SET version = 'NaN' WHERE id = 1$$);
SELECT pg_temp.try($$UPDATE vnum SET version = 'Infinity' WHERE id = 1$$);
SELECT pg_temp.try($$UPDATE vnum SET version = '-Infinity' WHERE id = 1$$);
SELECT pg_temp.try($$UPDATE vts SET version = 'infinity' WHERE id = 1$$);
SELECT pg_temp.try($$UPDATE vts SET version = '-infinity' WHERE id = 1$$);
UPDATE vnum SET version = 'NaN' WHERE id = 1;
UPDATE vts SET version = '-infinity' WHERE id = 1;
-- the NaN that used to sort above everything blocks nothing
UPDATE vnum SET version = 2 WHERE id = 1 RETURNING *;
UPDATE vnum SET version = 3 WHERE id = 1 RETURNING *;
-- a stored NaN is no version yet: any version replaces it
UPDATE vnum SET version = 0.5 WHERE id = 2 RETURNING *;
-- stored infinities compare as usual: -infinity is below any version,
-- infinity above any (the row keeps it: raise it by hand if it was a mistake)
UPDATE vnum SET version = -99999 WHERE id = 3 RETURNING *;
UPDATE vnum SET version = 99999 WHERE id = 4 RETURNING *;
UPDATE vts SET version = '1970-01-01 00:00+00' WHERE id = 2 RETURNING *;
UPDATE vts SET version = '9999-01-01 00:00+00' WHERE id = 3 RETURNING *;
-- idem_upsert refuses them too
SELECT pg_temp.try($$SELECT idem_upsert(ROW(1, 'NaN')::vnum)$$);
SELECT pg_temp.try($$SELECT idem_upsert(ROW(9, 'Infinity')::vnum)$$);
SELECT pg_temp.try($$SELECT idem_upsert(ROW(9, '-infinity')::vts)$$);
SELECT idem_upsert(ROW(1, 4)::vnum);
-- and take any version over a stored NULL or NaN, as the guard does
INSERT INTO vnum VALUES (5, 'NaN'), (6, NULL);
CREATE TABLE vnull (id int PRIMARY KEY, version bigint);
INSERT INTO vnull VALUES (1, NULL);
SELECT idem_upsert(ROW(5, -1)::vnum), idem_upsert(ROW(6, -1)::vnum), idem_upsert(ROW(1, 1)::vnull);
SELECT idem_upsert(ROW(5, -1)::vnum), idem_upsert(ROW(6, -2)::vnum), idem_upsert(ROW(1, 1)::vnull);
SELECT * FROM vnum ORDER BY id;

---- partitions of guarded tables ----
CREATE TABLE parted (region int, id int, state text, version int, PRIMARY KEY (region, id))
    PARTITION BY LIST (region);
CREATE TABLE parted_1 PARTITION OF parted FOR VALUES IN (1);
CREATE TABLE parted_2 PARTITION OF parted FOR VALUES IN (2, 3) PARTITION BY LIST (region);
CREATE TABLE parted_2a PARTITION OF parted_2 FOR VALUES IN (2);
SELECT idem_guard_version('parted');
SELECT idem_guard_transitions('parted', 'state', '{"a": ["b"]}');
-- a partition's guard is the partitioned table's: clear errors
SELECT pg_temp.try($$SELECT idem_guard_version('parted_1', on_stale => 'error')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('parted_2a', 'state', '{"a": ["c"]}')$$);
SELECT pg_temp.try($$SELECT idem_unguard('parted_2')$$);
SELECT pg_temp.try($$SELECT idem_unguard('parted_2a')$$);
SELECT idem_guard_version('parted_1', on_stale => 'error');
-- installing again on the partitioned table replaces the guard everywhere
SELECT idem_guard_version('parted', on_stale => 'error');
INSERT INTO parted VALUES (2, 1, 'a', 5);
SELECT pg_temp.try($$UPDATE parted SET version = 4$$);
SELECT count(*) AS guards, count(*) FILTER (WHERE tgparentid <> 0) AS inherited
  FROM pg_trigger WHERE tgname LIKE 'idem_guard_%' AND tgrelid::regclass::text LIKE 'parted%';
-- a partition with a guard of its own keeps the partitioned table from taking one
SELECT idem_unguard('parted');
SELECT idem_guard_version('parted_2a');
SELECT idem_guard_version('parted');
SELECT idem_guard_transitions('parted', 'state', '{"a": ["b"]}');  -- another kind: fine
SELECT idem_unguard('parted_2a');
SELECT pg_temp.try($$SELECT idem_unguard('parted_2a')$$);
SELECT idem_unguard('parted');
SELECT idem_unguard('parted_2a');
SELECT idem_guard_version('parted');
UPDATE parted SET version = 4 RETURNING *;
UPDATE parted SET version = 6 RETURNING *;

\i :guard_teardown
