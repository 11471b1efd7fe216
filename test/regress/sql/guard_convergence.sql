-- Convergence: a naive handler (plain INSERT ... ON CONFLICT DO UPDATE, no
-- guard of its own) replays a shuffled stream with duplicates into a guarded
-- table and ends exactly where the ordered stream ends.  The same stream into
-- an unguarded table is the control: it must end somewhere else.
\getenv abs_srcdir PG_ABS_SRCDIR
\set guard_schema guard_c
\set setup_sql :abs_srcdir '/include/guard_setup.sql'
\i :setup_sql

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

-- the same stream into a guarded and an unguarded table for every version
-- type (and a domain): event v of an account carries the version given by
-- expr (a format() string, %s being v), the naive handler writes each
-- delivery as it comes
CREATE DOMAIN posnum AS numeric CHECK (VALUE > 0);
CREATE FUNCTION converge_versions(typ text, expr text)
RETURNS TABLE (version_type text, guarded_wrong bigint, guarded_missing bigint, unguarded_diverged boolean)
LANGUAGE plpgsql AS $$
DECLARE
    g text := 'vg_' || md5(typ);
    u text := 'vu_' || md5(typ);
    d record;
    upsert text := 'INSERT INTO guard_c.%I AS t VALUES ($1, $2, ' || format(expr, '$3') || ')
                    ON CONFLICT (account) DO UPDATE SET balance = EXCLUDED.balance, version = EXCLUDED.version';
BEGIN
    EXECUTE format('CREATE TABLE guard_c.%I (account int PRIMARY KEY, balance text, version %s)', g, typ);
    EXECUTE format('CREATE TABLE guard_c.%I (account int PRIMARY KEY, balance text, version %s)', u, typ);
    PERFORM idem_guard_version(format('guard_c.%I', g)::regclass);
    FOR d IN SELECT * FROM delivery ORDER BY pos LOOP
        EXECUTE format(upsert, g) USING d.account, d.balance, d.version;
        EXECUTE format(upsert, u) USING d.account, d.balance, d.version;
    END LOOP;
    EXECUTE format('CREATE TEMP VIEW expected_v AS
                        SELECT DISTINCT ON (account) account, balance, (%s)::%s AS version
                          FROM guard_c.events ORDER BY account, version DESC', format(expr, 'version'), typ);
    version_type := typ;
    EXECUTE format('SELECT count(*) FROM (SELECT * FROM guard_c.%I EXCEPT SELECT * FROM expected_v) x', g)
        INTO guarded_wrong;
    EXECUTE format('SELECT count(*) FROM (SELECT * FROM expected_v EXCEPT SELECT * FROM guard_c.%I) x', g)
        INTO guarded_missing;
    EXECUTE format('SELECT count(*) > 0 FROM (SELECT * FROM guard_c.%I EXCEPT SELECT * FROM expected_v) x', u)
        INTO unguarded_diverged;
    DROP VIEW expected_v;
    RETURN NEXT;
END
$$;
SELECT c.* FROM (VALUES
        ('smallint', '(%s)::smallint'),
        ('integer', '(%s) * 100000'),
        ('bigint', '(%s) * 1000000000000::bigint'),
        ('numeric', '(%s) / 8.0'),
        ('timestamp', $$'2024-01-01 00:00'::timestamp + (%s) * interval '1.5 seconds'$$),
        ('timestamptz', $$'2024-01-01 00:00+00'::timestamptz + (%s) * interval '1 millisecond'$$),
        ('posnum', '(%s) / 3.0')) t(typ, expr),
     LATERAL converge_versions(t.typ, t.expr) c;

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

-- the same deliveries for a state column of every type with an equality:
-- labels are the states in order (a boolean has two: its third event is
-- not delivered)
CREATE DOMAIN order_label AS text CHECK (VALUE IN ('pending', 'dispatched', 'delivered'));
CREATE FUNCTION converge_states(typ text, labels text[])
RETURNS TABLE (state_type text, guarded_wrong bigint, guarded_missing bigint, unguarded_diverged boolean)
LANGUAGE plpgsql AS $$
DECLARE
    n int := array_length(labels, 1);
    g text := 'sg_' || md5(typ);
    u text := 'su_' || md5(typ);
    map jsonb;
    d record;
    tbl text;
BEGIN
    SELECT jsonb_object_agg(labels[i], jsonb_build_array(labels[i + 1])) INTO map
      FROM generate_series(1, n - 1) i;
    FOREACH tbl IN ARRAY ARRAY[g, u] LOOP
        EXECUTE format('CREATE TABLE guard_c.%I (id int PRIMARY KEY, state %s NOT NULL,
                                                 dispatched_at bigint, delivered_at bigint)', tbl, typ);
    END LOOP;
    PERFORM idem_guard_transitions(format('guard_c.%I', g)::regclass, 'state', map);
    FOR d IN SELECT * FROM order_delivery WHERE step <= n ORDER BY received LOOP
        FOREACH tbl IN ARRAY ARRAY[g, u] LOOP
            -- the naive handler of naive_order(), for any state type
            EXECUTE format('INSERT INTO guard_c.%I AS t (id, state, dispatched_at, delivered_at)
                            VALUES ($1, CAST($2 AS %s), $3, $4)
                            ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state%s', tbl, typ,
                           CASE d.step WHEN 2 THEN ', dispatched_at = EXCLUDED.dispatched_at'
                                       WHEN 3 THEN ', delivered_at = EXCLUDED.delivered_at' ELSE '' END)
              USING d.order_id, labels[d.step],
                    CASE WHEN d.step = 2 THEN d.received END, CASE WHEN d.step = 3 THEN d.received END;
        END LOOP;
    END LOOP;
    EXECUTE format('CREATE TEMP VIEW expected_s AS
                        SELECT order_id AS id, CAST(%L AS %s) AS state,
                               min(received) FILTER (WHERE step = 2) AS dispatched_at,
                               min(received) FILTER (WHERE step = 3) AS delivered_at
                          FROM guard_c.order_delivery WHERE step <= %s GROUP BY order_id',
                   labels[n], typ, n);
    state_type := typ;
    EXECUTE format('SELECT count(*) FROM (SELECT * FROM guard_c.%I EXCEPT SELECT * FROM expected_s) x', g)
        INTO guarded_wrong;
    EXECUTE format('SELECT count(*) FROM (SELECT * FROM expected_s EXCEPT SELECT * FROM guard_c.%I) x', g)
        INTO guarded_missing;
    EXECUTE format('SELECT count(*) > 0 FROM (SELECT * FROM guard_c.%I EXCEPT SELECT * FROM expected_s) x', u)
        INTO unguarded_diverged;
    DROP VIEW expected_s;
    RETURN NEXT;
END
$$;
SELECT c.* FROM (VALUES
        ('text', '{pending,dispatched,delivered}'::text[]),
        ('varchar(20)', '{pending,dispatched,delivered}'),
        ('char(12)', '{pending,dispatched,delivered}'),
        ('guard_c.order_state', '{pending,dispatched,delivered}'),
        ('boolean', '{false,true}'),
        ('integer', '{10,20,30}'),
        ('guard_c.order_label', '{pending,dispatched,delivered}')) t(typ, labels),
     LATERAL converge_states(t.typ, t.labels) c;

\i :guard_teardown
