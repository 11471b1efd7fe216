-- test/demo.sql: schema of test/run-demo.
--
-- A toy broker (demo.inbox) hands out deliveries at least once: every event
-- once, some twice or three times, in shuffled order, under a lease; a
-- delivery that is not acknowledged before its lease runs out is handed out
-- again.  Consumers apply each event's effect through idem_claim, in the same
-- transaction as the effect.
\set ON_ERROR_STOP 1
SET client_min_messages = warning;

CREATE EXTENSION IF NOT EXISTS idempotency;
CREATE SCHEMA demo;

-- what the producer published: one row per event
CREATE TABLE demo.events (
    id      int PRIMARY KEY,
    account int NOT NULL,
    amount  int NOT NULL
);

-- the broker's queue: one row per pending delivery
CREATE TABLE demo.inbox (
    delivery   bigint PRIMARY KEY,
    event_id   int NOT NULL,
    visible_at timestamptz NOT NULL DEFAULT '-infinity'   -- leased until
);

-- every hand-out of a delivery to a consumer (committed at hand-out)
CREATE TABLE demo.delivery_log (
    delivery bigint NOT NULL,
    event_id int NOT NULL,
    consumer text NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- the side effects.  No unique constraint on purpose: a doubled effect must
-- show up in the count, not as an error.
CREATE TABLE demo.effects (
    event_id   int NOT NULL,
    consumer   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE demo.accounts (
    id      int PRIMARY KEY,
    balance bigint NOT NULL DEFAULT 0
);
-- each committed handling of a delivery, and whether it applied the effect
CREATE TABLE demo.handled (
    event_id int NOT NULL,
    consumer text NOT NULL,
    applied  boolean NOT NULL
);

-- publish :events events to 10 accounts; the broker queues each once, 30 %
-- of them a second time and 10 % a third time, in random order
INSERT INTO demo.accounts SELECT g FROM generate_series(1, 10) g;
INSERT INTO demo.events
SELECT g, 1 + g % 10, 1 + (random() * 99)::int FROM generate_series(1, :events) g;
INSERT INTO demo.inbox (delivery, event_id)
SELECT row_number() OVER (ORDER BY random()), id
FROM (SELECT id FROM demo.events
      UNION ALL SELECT id FROM demo.events WHERE random() < 0.3
      UNION ALL SELECT id FROM demo.events WHERE random() < 0.1) d;

-- receive: the broker hands out the oldest visible delivery under a lease
CREATE FUNCTION demo.receive(consumer text, lease interval DEFAULT '1 second',
                             OUT delivery bigint, OUT event_id int)
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE demo.inbox i SET visible_at = clock_timestamp() + lease
    WHERE i.delivery = (SELECT q.delivery FROM demo.inbox q
                        WHERE q.visible_at <= clock_timestamp()
                        ORDER BY q.delivery LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING i.delivery, i.event_id INTO receive.delivery, receive.event_id;
    IF receive.delivery IS NOT NULL THEN
        INSERT INTO demo.delivery_log (delivery, event_id, consumer)
        VALUES (receive.delivery, receive.event_id, consumer);
    END IF;
END
$$;

-- handle: THE event handler.  The claim and the effect commit or roll back
-- together, in the caller's transaction.
CREATE FUNCTION demo.handle(e int, consumer text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    fresh boolean := idem_claim('event-' || e, 'demo');
BEGIN
    IF fresh THEN
        INSERT INTO demo.effects (event_id, consumer) VALUES (e, consumer);
        UPDATE demo.accounts a SET balance = a.balance + ev.amount
        FROM demo.events ev WHERE ev.id = e AND a.id = ev.account;
    END IF;
    INSERT INTO demo.handled VALUES (e, consumer, fresh);
    RETURN fresh;
END
$$;

-- a consumer: receive, handle, acknowledge, one transaction each, until the
-- broker has nothing left.  Now and then it "crashes" between commit and
-- acknowledgement (skips the ack), so the broker redelivers.
CREATE PROCEDURE demo.consume(consumer text, skip_ack_percent int DEFAULT 3)
LANGUAGE plpgsql AS $$
DECLARE
    d bigint;
    e int;
BEGIN
    LOOP
        SELECT r.delivery, r.event_id INTO d, e FROM demo.receive(consumer) r;
        IF d IS NULL THEN
            EXIT WHEN NOT EXISTS (SELECT FROM demo.inbox);
            COMMIT;
            PERFORM pg_sleep(0.05);      -- the rest is leased: wait for expiry
            CONTINUE;
        END IF;
        COMMIT;
        PERFORM demo.handle(e, consumer);
        COMMIT;
        IF random() * 100 >= skip_ack_percent THEN
            DELETE FROM demo.inbox WHERE delivery = d;
        END IF;
        COMMIT;
    END LOOP;
END
$$;

-- for the demo script: cut off (pg_terminate_backend) a consumer that is
-- inside a write transaction; polls for up to `wait`; returns its pid or NULL
CREATE FUNCTION demo.terminate_a_consumer(wait interval DEFAULT '2 seconds') RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    p int;
    deadline timestamptz := clock_timestamp() + wait;
BEGIN
    LOOP
        PERFORM pg_stat_clear_snapshot();
        SELECT pid INTO p FROM pg_stat_activity
        WHERE application_name LIKE 'consumer-%' AND backend_xid IS NOT NULL AND state = 'active'
        ORDER BY random() LIMIT 1;
        IF p IS NOT NULL AND pg_terminate_backend(p) THEN
            RETURN p;
        END IF;
        EXIT WHEN clock_timestamp() > deadline;
        PERFORM pg_sleep(0.001);
    END LOOP;
    RETURN NULL;
END
$$;
