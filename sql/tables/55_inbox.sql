-- Inbox: messages stored idempotently the moment they arrive, processed
-- later by workers that lease them (src/delivery/inbox.c).  The tables and the
-- message type; the functions, the dead letters' view and the partitions'
-- trigger are in sql/functions/55_inbox.sql.
--
-- A message is received at most once per (source, message_id) within the
-- retention: idem_inbox_receive() claims the key in scope 'inbox:<source>'
-- (src/claims/claims.c) and stores the message only if the claim is new.  Messages
-- live in time partitions of idempotency.inbox_messages (declarative LIST
-- partitions on "bucket", one random bucket per partition, like the
-- outbox's events; src/maintenance/store_partitions.c makes and drops them).  Unlike outbox
-- events, a message carries its processing state in its own row (lease,
-- attempts, retry time, done, dead): a claim, done or fail updates the
-- message row (done is not a HOT update), so a long transaction elsewhere
-- leaves dead row versions in the message partitions until it ends.  No
-- row is ever deleted: partitions are dropped whole, never while one holds
-- a message that is not done.

CREATE TABLE idempotency.inbox_messages (
    id           uuid NOT NULL,            -- UUIDv7: received_at, then the bucket
    source       text COLLATE "C" NOT NULL,
    message_id   text COLLATE "C" NOT NULL,
    ordering_key text COLLATE "C",         -- headers->>'ordering_key'
    seq          bigint,                   -- 1, 2, 3 ... per (source, ordering_key)
    payload      jsonb NOT NULL,
    headers      jsonb NOT NULL,
    received_at  timestamptz NOT NULL,
    txid         xid8 NOT NULL,            -- the receiving transaction
    bucket       integer NOT NULL,         -- the partition it went into
    attempts     integer NOT NULL,         -- hand-outs since received or replayed
    lease_token  uuid,
    lease_until  timestamptz,
    retry_at     timestamptz,              -- failed: not handed out before this
    done_at      timestamptz,              -- processed
    dead_at      timestamptz,              -- dead-lettered (until replayed)
    last_error   text
) PARTITION BY LIST (bucket);

-- The partitions, as maintenance made them (see outbox_partitions).
CREATE TABLE idempotency.inbox_partitions (
    relid  regclass    PRIMARY KEY,
    bucket integer     NOT NULL UNIQUE,
    lower  timestamptz NOT NULL,
    upper  timestamptz NOT NULL,
    CHECK (lower < upper)
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.inbox_partitions', '');

-- Per (source, ordering_key): the seq of its newest message.  A receiver
-- updates it and holds its row lock to commit, so seq follows commit order
-- without gaps.  Messages without an ordering key never touch it.
CREATE TABLE idempotency.inbox_sequences (
    source       text COLLATE "C" NOT NULL,
    ordering_key text COLLATE "C" NOT NULL,
    last_seq     bigint NOT NULL,
    PRIMARY KEY (source, ordering_key)
) WITH (fillfactor = 50);
SELECT pg_catalog.pg_extension_config_dump('idempotency.inbox_sequences', '');

CREATE TYPE idem_inbox_message AS (
    id          uuid,
    source      text,
    message_id  text,
    payload     jsonb,
    headers     jsonb,
    received_at timestamptz,
    attempts    integer,
    lease_token uuid,
    lease_until timestamptz
);
