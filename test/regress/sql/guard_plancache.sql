-- The plan caches of idem_upsert() and idem_transition() are bounded (128
-- tables each per backend): a backend that writes to more tables than that
-- keeps working, evicting and rebuilding plans, and holds no more plans than
-- the bound.  The plans are visible as CachedPlanSource memory contexts,
-- named by their query text.
\getenv abs_srcdir PG_ABS_SRCDIR
\set guard_schema guard_pc
\set setup_sql :abs_srcdir '/include/guard_setup.sql'
\i :setup_sql

CREATE FUNCTION cached_plans(prefix text) RETURNS bigint LANGUAGE sql AS $$
    SELECT count(*) FROM pg_backend_memory_contexts
     WHERE name = 'CachedPlanSource' AND ident LIKE prefix || '%'
$$;

-- 150 tables, each written by idem_upsert and moved by idem_transition
DO $$
BEGIN
    FOR i IN 1..150 LOOP
        EXECUTE format('CREATE TABLE guard_pc.v%s (id int PRIMARY KEY, payload text, version int)', i);
        EXECUTE format('CREATE TABLE guard_pc.s%s (id int PRIMARY KEY, state text)', i);
        EXECUTE format('INSERT INTO guard_pc.s%s VALUES (1, %L)', i, 'new');
        PERFORM idem_guard_transitions(format('guard_pc.s%s', i)::regclass, 'state',
                                       '{"new": ["done"]}');
    END LOOP;
END $$;

-- three rounds over all tables, the last in reverse order, so every round
-- finds most plans evicted; each round's outcomes are counted
CREATE TABLE outcomes (round int, result text);
DO $$
DECLARE r text;
BEGIN
    FOR round IN 1..3 LOOP
        FOR k IN 1..150 LOOP
            DECLARE i int := CASE WHEN round = 3 THEN 151 - k ELSE k END;
            BEGIN
                EXECUTE format('SELECT idem_upsert(ROW(1, %L, %s)::guard_pc.v%s)',
                               'round ' || round, least(round, 2), i) INTO r;
                INSERT INTO outcomes VALUES (round, 'upsert ' || r);
                EXECUTE format('SELECT idem_transition(%L, 1, %L)',
                               format('guard_pc.s%s', i), 'done') INTO r;
                INSERT INTO outcomes VALUES (round, 'transition ' || r);
            END;
        END LOOP;
    END LOOP;
END $$;
SELECT round, result, count(*) FROM outcomes GROUP BY 1, 2 ORDER BY 1, 2;
SELECT count(*) FILTER (WHERE payload = 'round 2') AS rows_at_round_2,
       count(*) AS rows FROM (SELECT payload FROM v1 UNION ALL SELECT payload FROM v150) x;

-- no more plans kept than the bound: one upsert plan per table, a lookup and
-- an update per table for idem_transition
SELECT cached_plans('INSERT INTO guard_pc.') AS upsert_plans,
       cached_plans('SELECT t.state ') AS transition_lookups,
       cached_plans('UPDATE guard_pc.') AS transition_updates;

-- a call that runs while its own plan is in use: a trigger on the table it
-- writes calls the helpers on all the other tables, so the cache evicts
-- around the entry that is running, and that plan must survive
CREATE TABLE outer_t (id int PRIMARY KEY, version int);
CREATE FUNCTION touch_all() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1..150 LOOP
        EXECUTE format('SELECT idem_upsert(ROW(2, %L, %s)::guard_pc.v%s)', 'nested', NEW.version, i);
    END LOOP;
    RETURN NEW;
END $$;
CREATE TRIGGER touch_all BEFORE INSERT OR UPDATE ON outer_t FOR EACH ROW EXECUTE FUNCTION touch_all();
SELECT idem_upsert(ROW(1, 1)::outer_t), idem_upsert(ROW(1, 2)::outer_t), idem_upsert(ROW(1, 2)::outer_t);
SELECT * FROM outer_t;
SELECT count(*) AS nested_rows FROM (SELECT * FROM v1 WHERE id = 2 UNION ALL SELECT * FROM v150 WHERE id = 2) x;
SELECT cached_plans('INSERT INTO guard_pc.') <= 128 AS upsert_plans_bounded;

-- a plan rebuilt after ALTER TABLE follows the table's new shape
ALTER TABLE v1 ADD COLUMN extra text;
SELECT idem_upsert(ROW(1, 'altered', 3, 'x')::v1);
SELECT * FROM v1 WHERE id = 1;

\i :guard_teardown
