-- Transactional outbox: events that commit with the business write (the
-- tables and the event type; the functions, the view and the partitions'
-- trigger are in sql/functions/40_outbox.sql).
--
-- Events are insert-only rows in time partitions of idempotency.outbox_events
-- (declarative LIST partitions on "bucket", one random bucket per partition,
-- so a publication with publish_via_partition_root sees every partition, old
-- and new, and partitions restored from a dump never clash with those
-- CREATE EXTENSION made).  Nothing ever updates or deletes an event: seqs
-- that no row carries live in outbox_sequences, delivery state in
-- outbox_deliveries, both narrow tables whose updates touch no indexed
-- column (HOT).  Any number of subscriptions read the one log, each with a
-- deliveries row per aggregate, a cursor and dead letters of its own.  See
-- src/delivery/outbox.c and src/delivery/outbox_subscriptions.c.

CREATE TABLE idempotency.outbox_events (
    id             uuid NOT NULL,            -- UUIDv7: created_at, then the bucket
    aggregate_type text COLLATE "C" NOT NULL,
    aggregate_id   text COLLATE "C" NOT NULL,
    seq            bigint NOT NULL,          -- 1, 2, 3 ... per aggregate
    event_type     text NOT NULL,
    payload        jsonb NOT NULL,
    headers        jsonb NOT NULL,
    created_at     timestamptz NOT NULL,
    txid           xid8 NOT NULL,            -- the emitting transaction
    bucket         integer NOT NULL          -- the partition it went into
) PARTITION BY LIST (bucket);

-- The partitions, as maintenance made them: the time range of the events
-- each takes (while maintenance lags, the newest also takes later ones).
-- Every partition has indexes of its own, made with it (none is declared on
-- the parent, whose indexes pg_restore could not attach dumped ones to).
CREATE TABLE idempotency.outbox_partitions (
    relid  regclass    PRIMARY KEY,
    bucket integer     NOT NULL UNIQUE,
    lower  timestamptz NOT NULL,
    upper  timestamptz NOT NULL,
    CHECK (lower < upper)
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.outbox_partitions', '');

-- Per aggregate: the seqs its event rows do not carry.  An emit takes seq
-- from the aggregate's newest event row or this counter, whichever is
-- greater, under the aggregate's emit lock (src/delivery/outbox_emit.c), so
-- table-mode emits write no counter.  Written only by emits in
-- outbox_mode 'wal', which store no row (last_seq and wal_seq: the newest
-- such seq), and by retention, before it drops the partition that holds an
-- aggregate's newest event (last_seq and stored_seq: that event's seq).
-- Most aggregates have no row.
CREATE TABLE idempotency.outbox_sequences (
    aggregate_type text COLLATE "C" NOT NULL,
    aggregate_id   text COLLATE "C" NOT NULL,
    last_seq       bigint NOT NULL,             -- the newest seq it carries
    stored_seq     bigint NOT NULL DEFAULT 0,   -- the newest seq of a dropped row (0: none)
    wal_seq        bigint NOT NULL DEFAULT 0,   -- the newest seq never stored ('wal'; 0: none)
    PRIMARY KEY (aggregate_type, aggregate_id)
) WITH (fillfactor = 50);
SELECT pg_catalog.pg_extension_config_dump('idempotency.outbox_sequences', '');

-- The subscriptions: each reads every event of its aggregate types (NULL:
-- all) with progress of its own.  'default' (id 0) is made here, so that
-- calls that name no subscription work from the start; like any other it
-- can be unsubscribed (and subscribed again, as id 0; a restore makes it
-- anew).  Other ids are never reused: rows a relay of a dropped
-- subscription still writes belong to no one.  detached_at: maintenance
-- detached it for being further behind than idempotency.outbox_max_lag
-- (its relays' calls fail; it pins nothing) until it is unsubscribed.
CREATE TABLE idempotency.outbox_subscriptions (
    id              integer PRIMARY KEY,
    name            text COLLATE "C" NOT NULL UNIQUE,
    aggregate_types text[] COLLATE "C",         -- NULL: every type
    dead_policy     text CHECK (dead_policy IN ('block', 'skip')),  -- NULL: the setting's
    start           text NOT NULL CHECK (start IN ('now', 'earliest')),
    created_at      timestamptz NOT NULL,
    detached_at     timestamptz,
    detach_reason   text,
    CHECK ((detached_at IS NULL) = (detach_reason IS NULL))
);
CREATE SEQUENCE idempotency.outbox_subscription_ids AS integer MINVALUE 1;
INSERT INTO idempotency.outbox_subscriptions (id, name, start, created_at)
VALUES (0, 'default', 'earliest', pg_catalog.now());
-- the default row comes with CREATE EXTENSION, so a restore must not copy it
SELECT pg_catalog.pg_extension_config_dump('idempotency.outbox_subscriptions', 'WHERE id <> 0');
SELECT pg_catalog.pg_extension_config_dump('idempotency.outbox_subscription_ids', '');

-- Per subscription and aggregate: how far delivery got, and who holds it.
-- Relays make the row when they first meet the aggregate (subscribe 'now'
-- makes those of the aggregates that exist) and update it;
-- only a change of retry_at (parking after a failure, unparking) is not HOT.
-- Every state has a way out, and the checks keep out those that would not
-- (see "Delivery states" in src/delivery/outbox.c): an aggregate is parked for good
-- only at a dead head (which skip, redrive and discard see), a dead head is
-- parked and leased to nobody, and a redrive waits only for a lease.
CREATE TABLE idempotency.outbox_deliveries (
    subscription   integer NOT NULL,            -- outbox_subscriptions.id
    aggregate_type text COLLATE "C" NOT NULL,
    aggregate_id   text COLLATE "C" NOT NULL,
    acked_seq      bigint NOT NULL DEFAULT 0,   -- delivered up to here
    leased_seq     bigint,                      -- handed out up to here under the lease
    lease_token    uuid,
    lease_until    timestamptz,
    attempts       integer NOT NULL DEFAULT 0,  -- hand-outs of the head since it last moved
    retry_at       timestamptz,                 -- parked: found by this, not by the cursor
    dead_seq       bigint,                      -- the head is dead-lettered
    last_error     text,
    redrive_seq    bigint,                      -- redriven behind the live lease: back here once it ends
    PRIMARY KEY (subscription, aggregate_type, aggregate_id),
    CONSTRAINT outbox_deliveries_lease
        CHECK ((leased_seq IS NULL) = (lease_token IS NULL) AND (lease_token IS NULL) = (lease_until IS NULL)),
    CONSTRAINT outbox_deliveries_dead_head
        CHECK (dead_seq IS NULL OR (dead_seq = acked_seq + 1 AND retry_at IS NOT NULL AND lease_token IS NULL)),
    CONSTRAINT outbox_deliveries_blocked
        CHECK (retry_at <> 'infinity' OR dead_seq IS NOT NULL),
    CONSTRAINT outbox_deliveries_redrive
        CHECK (redrive_seq IS NULL OR lease_token IS NOT NULL)
) WITH (fillfactor = 50);
SELECT pg_catalog.pg_extension_config_dump('idempotency.outbox_deliveries', '');
CREATE INDEX outbox_deliveries_parked ON idempotency.outbox_deliveries (subscription, retry_at)
    WHERE retry_at IS NOT NULL;

-- Per subscription: every event before (position, event_id) is delivered,
-- or belongs to a parked aggregate: its relays scan from here.  A lower
-- bound only; written at most about once a second per relay.  Not dumped:
-- transaction ids mean nothing in another cluster, so a restore starts
-- from 0 (a subscription without a row does too).
CREATE TABLE idempotency.outbox_cursor (
    subscription integer PRIMARY KEY,           -- outbox_subscriptions.id
    position     xid8 NOT NULL,                 -- an emitting transaction ...
    event_id     uuid NOT NULL                  -- ... and an event id in it
);
INSERT INTO idempotency.outbox_cursor (subscription, position, event_id)
VALUES (0, '0', '00000000-0000-0000-0000-000000000000');

-- Dead-lettered events (a copy of each, per subscription), until redriven
-- or discarded.
CREATE TABLE idempotency.outbox_dead_letters (
    subscription   integer NOT NULL,            -- outbox_subscriptions.id
    id             uuid NOT NULL,
    aggregate_type text COLLATE "C" NOT NULL,
    aggregate_id   text COLLATE "C" NOT NULL,
    seq            bigint NOT NULL,
    event_type     text NOT NULL,
    payload        jsonb NOT NULL,
    headers        jsonb NOT NULL,
    created_at     timestamptz NOT NULL,
    attempts       integer NOT NULL,
    last_error     text,
    dead_at        timestamptz NOT NULL,
    PRIMARY KEY (subscription, id)
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.outbox_dead_letters', '');
CREATE INDEX outbox_dead_letters_aggregate
    ON idempotency.outbox_dead_letters (aggregate_type, aggregate_id, seq);

CREATE TYPE idem_outbox_event AS (
    id             uuid,
    aggregate_type text,
    aggregate_id   text,
    seq            bigint,
    event_type     text,
    payload        jsonb,
    headers        jsonb,
    created_at     timestamptz,
    attempts       integer,
    lease_token    uuid,
    lease_until    timestamptz
);
