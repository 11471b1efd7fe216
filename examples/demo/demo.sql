-- examples/demo/demo.sql: schema of examples/demo/run.
--
-- A toy broker (demo.inbox) hands out deliveries at least once: every event
-- once, some twice or three times, in shuffled order, under a lease; a
-- delivery that is not acknowledged before its lease runs out is handed out
-- again.  Consumers apply each event's effect through idem_claim, in the same
-- transaction as the effect, and emit a follow-up event (balance_changed)
-- through the transactional outbox in that transaction too.  Relays
-- (tools/idem-relay) deliver the follow-up events, at least once, to a
-- downstream consumer (demo.deliver) that dedupes them on
-- aggregate_type:aggregate_id:seq with a claim in its own scope and keeps a
-- read model (demo.account_view) behind a version guard.
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

-- handle: THE event handler.  The claim, the effect and the follow-up event
-- commit or roll back together, in the caller's transaction.
CREATE FUNCTION demo.handle(e int, consumer text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    fresh boolean := idem_claim('event-' || e, 'demo');
    acc int;
    bal bigint;
    amt int;
BEGIN
    IF fresh THEN
        INSERT INTO demo.effects (event_id, consumer) VALUES (e, consumer);
        UPDATE demo.accounts a SET balance = a.balance + ev.amount
        FROM demo.events ev WHERE ev.id = e AND a.id = ev.account
        RETURNING a.id, a.balance, ev.amount INTO acc, bal, amt;
        -- tell the world: seq is the next number of aggregate account:<acc>
        PERFORM idem_outbox_emit('account', acc::text, 'balance_changed',
                                 jsonb_build_object('event_id', e, 'amount', amt, 'balance', bal));
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

-- Downstream: the service that consumes the follow-up events (in the same
-- database here, for the demo's sake).  The relays (tools/idem-relay
-- --sql) call demo.deliver for each event, on a connection of their own.

-- each event the consumer applied, in arrival order.  No unique constraint
-- on purpose: a doubled event must show up in the count.
CREATE TABLE demo.received (
    arrival bigserial PRIMARY KEY,
    key     text NOT NULL,              -- aggregate_type:aggregate_id:seq
    account int NOT NULL,
    seq     bigint NOT NULL,
    relay   text NOT NULL
);
-- every delivery the consumer committed, duplicates included
CREATE TABLE demo.downstream_log (
    key          text NOT NULL,
    account      int NOT NULL,
    seq          bigint NOT NULL,
    relay        text NOT NULL,
    fresh        boolean NOT NULL,      -- the claim was new: the event was applied
    view_updated boolean NOT NULL,      -- the version guard let the read model update through
    at           timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- the read model: each account's balance as the newest event told it.  The
-- version guard skips an update whose version (the event's seq) is not newer.
CREATE TABLE demo.account_view (
    id      int PRIMARY KEY,
    balance bigint NOT NULL DEFAULT 0,
    version bigint NOT NULL DEFAULT 0
);
INSERT INTO demo.account_view (id) SELECT id FROM demo.accounts;
SELECT count(*) AS guarded FROM idem_guard_version('demo.account_view') \gset

-- deliver: the consumer's endpoint.  Dedupes on the Idempotency-Key with a
-- claim in its own scope, in the transaction that applies the event.  It
-- takes 20 ms an event (think of a network hop), and now and then it is
-- "unavailable" (raises before doing anything): the relay nacks the event
-- and redelivers it.
CREATE FUNCTION demo.deliver(ev jsonb, relay text, fail_percent float DEFAULT 1) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    key text := format('%s:%s:%s', ev->>'aggregate_type', ev->>'aggregate_id', ev->>'seq');
    acc int := (ev->>'aggregate_id')::int;
    s bigint := (ev->>'seq')::bigint;
    fresh boolean;
    updated int;
BEGIN
    PERFORM pg_sleep(0.02);
    IF random() * 100 < fail_percent THEN
        RAISE EXCEPTION 'consumer unavailable (simulated 503)';
    END IF;
    fresh := idem_claim(key, 'downstream');
    IF fresh THEN
        INSERT INTO demo.received (key, account, seq, relay) VALUES (key, acc, s, relay);
    END IF;
    UPDATE demo.account_view SET balance = (ev->'payload'->>'balance')::bigint, version = s
    WHERE id = acc;
    GET DIAGNOSTICS updated = ROW_COUNT;
    INSERT INTO demo.downstream_log (key, account, seq, relay, fresh, view_updated)
    VALUES (key, acc, s, relay, fresh, updated > 0);
    RETURN fresh;
END
$$;

-- Who runs what: this file runs as the cluster's superuser (the DBA's
-- part); the consumers run as demo_app and the relays (and their sink
-- connections) as demo_relay, each with only its capability on the
-- extension's functions (README, "What to grant") and the table rights its
-- own code needs.
CREATE ROLE demo_app LOGIN;
CREATE ROLE demo_relay LOGIN;
SELECT idem_grant('demo_app', 'handler');                                -- claims, emits
SELECT idem_grant('demo_relay', 'relay');                                -- lease, ack, nack
SELECT idem_grant('demo_relay', 'handler', scopes => ARRAY['downstream']);  -- demo.deliver's claims
GRANT USAGE ON SCHEMA demo TO demo_app, demo_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON demo.events, demo.inbox, demo.delivery_log, demo.effects,
    demo.accounts, demo.handled TO demo_app;
GRANT INSERT ON demo.received, demo.downstream_log TO demo_relay;
GRANT SELECT, UPDATE ON demo.account_view TO demo_relay;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA demo TO demo_app, demo_relay;
