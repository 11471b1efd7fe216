-- Convergence: a naive handler (plain INSERT ... ON CONFLICT DO UPDATE, no
-- guard of its own) replays a shuffled stream with duplicates into a guarded
-- table and ends exactly where the ordered stream ends.  The same stream into
-- an unguarded table is the control: it must end somewhere else.
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS idempotency;
RESET client_min_messages;
CREATE SCHEMA guard_c;
SET search_path = guard_c, public;
SELECT idempotency.guard_stats_reset();

---- versions ----
-- 50 accounts x 20 versions, each event a full snapshot of the account
CREATE TABLE events AS
    SELECT a AS account, v AS version, md5(a || ':' || v) AS balance
      FROM generate_series(1, 50) a, generate_series(1, 20) v;
-- delivered shuffled, every event at least once, a third of them twice or more
SELECT setseed(0.4242);
CREATE TABLE delivery AS
    SELECT row_number() OVER (ORDER BY random()) AS pos, e.*
      FROM (SELECT * FROM events
            UNION ALL SELECT * FROM events WHERE random() < 0.33
            UNION ALL SELECT * FROM events WHERE random() < 0.10) e;
SELECT count(*) AS deliveries, count(DISTINCT (account, version)) AS distinct_events FROM delivery;

CREATE TABLE guarded   (account int PRIMARY KEY, balance text, version int);
CREATE TABLE unguarded (account int PRIMARY KEY, balance text, version int);
SELECT idem_guard_version('guarded');

-- the naive handler: last write wins, whatever its version
CREATE FUNCTION naive_apply(tbl regclass, e delivery) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('INSERT INTO %s AS t VALUES ($1, $2, $3)
                    ON CONFLICT (account) DO UPDATE
                    SET balance = EXCLUDED.balance, version = EXCLUDED.version', tbl)
      USING e.account, e.balance, e.version;
END
$$;
SELECT count(naive_apply('guarded', d)) FROM (SELECT * FROM delivery ORDER BY pos) d;
SELECT count(naive_apply('unguarded', d)) FROM (SELECT * FROM delivery ORDER BY pos) d;

-- the state the ordered stream gives: the last event of each account
CREATE VIEW expected_accounts AS
    SELECT DISTINCT ON (account) account, balance, version
      FROM events ORDER BY account, version DESC;
SELECT (SELECT count(*) FROM (SELECT * FROM guarded EXCEPT SELECT * FROM expected_accounts) x) AS guarded_wrong,
       (SELECT count(*) FROM (SELECT * FROM expected_accounts EXCEPT SELECT * FROM guarded) x) AS guarded_missing;
SELECT count(*) > 0 AS unguarded_diverged
  FROM (SELECT * FROM unguarded EXCEPT SELECT * FROM expected_accounts) x;
-- every skip was counted: all deliveries but those that inserted an account
-- or raised its version
SELECT stale_skipped = (
           SELECT count(*) FROM (
               SELECT version, max(version) OVER (PARTITION BY account ORDER BY pos
                        ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before
                 FROM delivery) d
            WHERE version <= before) AS skips_counted
  FROM idempotency.guard_stats();

---- transitions ----
-- 40 orders, each created, dispatched, delivered, in that order per order
-- (ordering within one aggregate holds), interleaved at random across
-- orders, with replays of earlier events arriving late.  Every delivery is
-- stamped with when it was received; the handler records that stamp.
CREATE TYPE order_state AS ENUM ('pending', 'dispatched', 'delivered');
SELECT setseed(0.1717);
CREATE TABLE order_events AS
    WITH draws AS (
        SELECT o AS order_id, s.step, s.state, random() AS at
          FROM generate_series(1, 40) o,
               (VALUES (1, 'pending'::order_state), (2, 'dispatched'), (3, 'delivered')) s(step, state))
    -- three random instants per order, handed out in step order
    SELECT order_id, step, state,
           (array_agg(at) OVER (PARTITION BY order_id ORDER BY at
                                ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING))[step] AS at
      FROM draws;
CREATE TABLE order_delivery AS
    SELECT row_number() OVER (ORDER BY at) AS received, order_id, step, state
      FROM (SELECT order_id, step, state, at FROM order_events
            UNION ALL   -- replays: some time after the original
            SELECT order_id, step, state, at + random() * (1 - at)
              FROM order_events WHERE random() < 0.5) d;
SELECT count(*) AS deliveries FROM order_delivery;
-- per order, the originals arrive in step order
SELECT bool_and(ok) AS per_order_order_holds FROM (
    SELECT min(received) FILTER (WHERE step = 1) < min(received) FILTER (WHERE step = 2)
       AND min(received) FILTER (WHERE step = 2) < min(received) FILTER (WHERE step = 3) AS ok
      FROM order_delivery GROUP BY order_id) x;

CREATE TABLE orders_guarded (id int PRIMARY KEY, state order_state NOT NULL,
                             dispatched_at bigint, delivered_at bigint);
CREATE TABLE orders_unguarded (LIKE orders_guarded INCLUDING ALL);
SELECT idem_guard_transitions('orders_guarded', 'state',
    '{"pending": ["dispatched"], "dispatched": ["delivered"]}');

-- the naive handler: one upsert per event, stamping what it saw
CREATE FUNCTION naive_order(tbl regclass, d order_delivery) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF d.state = 'pending' THEN
        EXECUTE format('INSERT INTO %s AS t (id, state) VALUES ($1, $2)
                        ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state', tbl)
          USING d.order_id, d.state;
    ELSIF d.state = 'dispatched' THEN
        EXECUTE format('INSERT INTO %s AS t (id, state, dispatched_at) VALUES ($1, $2, $3)
                        ON CONFLICT (id) DO UPDATE
                        SET state = EXCLUDED.state, dispatched_at = EXCLUDED.dispatched_at', tbl)
          USING d.order_id, d.state, d.received;
    ELSE
        EXECUTE format('INSERT INTO %s AS t (id, state, delivered_at) VALUES ($1, $2, $3)
                        ON CONFLICT (id) DO UPDATE
                        SET state = EXCLUDED.state, delivered_at = EXCLUDED.delivered_at', tbl)
          USING d.order_id, d.state, d.received;
    END IF;
END
$$;
SELECT count(naive_order('orders_guarded', d)) FROM (SELECT * FROM order_delivery ORDER BY received) d;
SELECT count(naive_order('orders_unguarded', d)) FROM (SELECT * FROM order_delivery ORDER BY received) d;

-- the ordered stream without replays: every order delivered, stamped by the
-- first delivery of each event
CREATE VIEW expected_orders AS
    SELECT order_id AS id, 'delivered'::order_state AS state,
           min(received) FILTER (WHERE step = 2) AS dispatched_at,
           min(received) FILTER (WHERE step = 3) AS delivered_at
      FROM order_delivery GROUP BY order_id;
SELECT (SELECT count(*) FROM (SELECT * FROM orders_guarded EXCEPT SELECT * FROM expected_orders) x) AS guarded_wrong,
       (SELECT count(*) FROM (SELECT * FROM expected_orders EXCEPT SELECT * FROM orders_guarded) x) AS guarded_missing;
SELECT count(*) > 0 AS unguarded_diverged
  FROM (SELECT * FROM orders_unguarded EXCEPT SELECT * FROM expected_orders) x;

RESET search_path;
SET client_min_messages = warning;
DROP SCHEMA guard_c CASCADE;
SET client_min_messages = warning;
DROP EXTENSION idempotency CASCADE;
