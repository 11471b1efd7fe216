-- Transition guard: idem_guard_transitions() on tables, every outcome.
\getenv abs_srcdir PG_ABS_SRCDIR
\set guard_schema guard_t
\set setup_sql :abs_srcdir '/include/guard_setup.sql'
\i :setup_sql
SET idempotency.guard_log_level = notice;

CREATE TYPE order_state AS ENUM ('pending', 'dispatched', 'delivered', 'cancelled');
CREATE TABLE orders (
    id            int PRIMARY KEY,
    state         order_state,
    dispatched_at int,
    note          text
);
INSERT INTO orders VALUES (1, 'pending', NULL, NULL), (2, 'pending', NULL, NULL),
                          (3, 'dispatched', 10, NULL), (4, NULL, NULL, NULL);
SELECT idem_guard_transitions('orders', 'state',
    '{"pending": ["dispatched", "cancelled"], "dispatched": ["delivered"]}');
SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgrelid = 'orders'::regclass;

-- along an edge: applied
UPDATE orders SET state = 'dispatched', dispatched_at = 100 WHERE id = 1 RETURNING id;
-- the same transition again: already applied, the whole row stays (first dispatched_at wins)
UPDATE orders SET state = 'dispatched', dispatched_at = 200, note = 'redelivered' WHERE id = 1 RETURNING id;
SELECT * FROM orders WHERE id = 1;
-- not an edge: skipped, the row stays
UPDATE orders SET state = 'pending', note = 'replayed' WHERE id = 1 RETURNING id;
UPDATE orders SET state = 'delivered' WHERE id = 2 RETURNING id;
-- from a terminal state, and from a state the map does not know as a source
UPDATE orders SET state = 'delivered' WHERE id = 3 RETURNING id;
UPDATE orders SET state = 'cancelled' WHERE id = 3 RETURNING id;
-- to NULL: not an edge
UPDATE orders SET state = NULL WHERE id = 2 RETURNING id;
-- from NULL (no state yet): any state
UPDATE orders SET state = 'dispatched' WHERE id = 4 RETURNING id;
-- updates that do not name the state column pass untouched
UPDATE orders SET note = 'gift wrap' WHERE id = 3 RETURNING id;
SELECT * FROM orders ORDER BY id;

-- multi-row: some applied, some already applied, some invalid
UPDATE orders SET state = 'delivered', note = 'batch' RETURNING id;
SELECT * FROM orders ORDER BY id;

-- the DO UPDATE arm of INSERT ... ON CONFLICT
INSERT INTO orders VALUES (2, 'pending', NULL, 'dup create'), (5, 'pending', NULL, 'new')
    ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state, note = EXCLUDED.note
    RETURNING id;
INSERT INTO orders VALUES (2, 'cancelled', NULL, 'cancel')
    ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state, note = EXCLUDED.note
    RETURNING id;
-- ON CONFLICT that does not set the state column: untouched by the guard
INSERT INTO orders VALUES (2, 'pending', NULL, 'note only')
    ON CONFLICT (id) DO UPDATE SET note = EXCLUDED.note
    RETURNING id;
SELECT * FROM orders ORDER BY id;
SELECT * FROM idempotency.guard_stats();

-- 'error' mode: IK005; already-applied transitions are still no error
SELECT idem_guard_transitions('orders', 'state',
    '{"pending": ["dispatched", "cancelled"], "dispatched": ["delivered"]}', 'error');
SELECT pg_temp.try($$UPDATE orders SET state = 'pending' WHERE id = 1$$);
SELECT pg_temp.try($$UPDATE orders SET state = 'delivered', note = 'again' WHERE id = 1$$);
SELECT pg_temp.try($$UPDATE orders SET state = 'dispatched' WHERE id = 5$$);
SELECT pg_temp.try($$INSERT INTO orders VALUES (5, 'pending') ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state$$);
\set VERBOSITY sqlstate
UPDATE orders SET state = 'cancelled' WHERE id = 1;
\set VERBOSITY default
UPDATE orders SET state = 'cancelled' WHERE id = 1;
SELECT * FROM orders ORDER BY id;

-- a text state column, and both guards on one table
CREATE TABLE tickets (id bigint PRIMARY KEY, status text NOT NULL, version int NOT NULL);
INSERT INTO tickets VALUES (1, 'open', 1);
SELECT idem_guard_transitions('tickets', 'status', '{"open": ["closed"], "closed": ["open"]}');
SELECT idem_guard_version('tickets');
UPDATE tickets SET status = 'closed', version = 2 RETURNING *;
UPDATE tickets SET status = 'open', version = 2 RETURNING *;
UPDATE tickets SET status = 'open', version = 3 RETURNING *;
SELECT tgname FROM pg_trigger WHERE tgrelid = 'tickets'::regclass ORDER BY tgname;
SELECT idem_unguard('tickets');
SELECT tgname FROM pg_trigger WHERE tgrelid = 'tickets'::regclass ORDER BY tgname;

-- malformed transitions, or states the column cannot hold: 22023
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', '[]')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', '"pending"')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', '1')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', '{}')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', '{"pending": "dispatched"}')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', '{"pending": [1]}')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', '{"pending": [null]}')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', '{"pending": [["dispatched"]]}')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', '{"pending": {"to": "dispatched"}}')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', '{"pending": ["shipped"]}')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', '{"lost": []}')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', 'not json')$$);
-- NULL arguments, bad mode, unknown table and column
SELECT pg_temp.try($$SELECT idem_guard_transitions(NULL, 'state', '{"a": []}')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', NULL, '{"a": []}')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', NULL)$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', '{"pending": []}', NULL)$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', '{"pending": []}', 'warn')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'status', '{"pending": []}')$$);
SELECT pg_temp.try($$SELECT idem_guard_transitions('nope', 'state', '{"pending": []}')$$);
-- the failed calls left the installed guard alone
SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgrelid = 'orders'::regclass;

-- only the owner may install a guard
CREATE ROLE guard_t_other;
GRANT USAGE ON SCHEMA guard_t TO guard_t_other;
GRANT ALL ON orders TO guard_t_other;
SET ROLE guard_t_other;
SELECT pg_temp.try($$SELECT idem_guard_transitions('orders', 'state', '{"pending": []}')$$);
SELECT pg_temp.try($$SELECT idem_unguard('orders')$$);
RESET ROLE;

-- quoted identifiers all the way through
CREATE TABLE "Odd Table" ("Key" int PRIMARY KEY, "State Col" text);
INSERT INTO "Odd Table" VALUES (1, 'a''s');
SELECT idem_guard_transitions('"Odd Table"', 'State Col', '{"a''s": ["b \"q\""]}');
UPDATE "Odd Table" SET "State Col" = 'c' RETURNING *;
UPDATE "Odd Table" SET "State Col" = 'b "q"' RETURNING *;
SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgrelid = '"Odd Table"'::regclass;

-- a role that may update the state but not read it is not told the stored state
CREATE TABLE blind (id int PRIMARY KEY, state text);
INSERT INTO blind VALUES (1, 'secret-state');
SELECT idem_guard_transitions('blind', 'state', '{"secret-state": ["next"]}', on_invalid => 'error');
GRANT UPDATE (state) ON blind TO guard_t_other;
SET ROLE guard_t_other;
\set VERBOSITY default
UPDATE blind SET state = 'elsewhere';
\set VERBOSITY terse
RESET ROLE;

\set guard_roles 'guard_t_other'
\i :guard_teardown
