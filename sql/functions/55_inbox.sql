-- Inbox: messages stored idempotently the moment they arrive, processed
-- later by workers that lease them (src/inbox.c).
--
-- A message is received at most once per (source, message_id) within the
-- retention: idem_inbox_receive() claims the key in scope 'inbox:<source>'
-- (src/claims.c) and stores the message only if the claim is new.  Messages
-- live in time partitions of idempotency.inbox_messages (declarative LIST
-- partitions on "bucket", one random bucket per partition, like the
-- outbox's events; src/store.c makes and drops them).  Unlike outbox
-- events, a message carries its processing state in its own row (lease,
-- attempts, retry time, done, dead): a claim, done or fail updates the
-- message row (done is not a HOT update), so a long transaction elsewhere
-- leaves dead row versions in the message partitions until it ends.  No
-- row is ever deleted: partitions are dropped whole, never while one holds
-- a message that is not done.
--
-- This file is new in 1.1: the upgrade script from 1.0 includes it whole
-- (see the Makefile), so it must only create objects.

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
COMMENT ON TABLE idempotency.inbox_messages IS
    'inbox messages with their processing state, in time partitions (receive with idem_inbox_receive())';

-- The partitions, as maintenance made them (see outbox_partitions).
CREATE TABLE idempotency.inbox_partitions (
    relid  regclass    PRIMARY KEY,
    bucket integer     NOT NULL UNIQUE,
    lower  timestamptz NOT NULL,
    upper  timestamptz NOT NULL,
    CHECK (lower < upper)
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.inbox_partitions', '');

-- Receivers cache the partition list; changes reach them like the claims'.
CREATE TRIGGER inbox_partitions_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.inbox_partitions
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.inbox_partitions ENABLE ALWAYS TRIGGER inbox_partitions_changed;

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

CREATE VIEW idempotency.inbox_dead AS
SELECT id, source, message_id, ordering_key, seq, payload, headers, received_at,
       attempts, last_error, dead_at
FROM idempotency.inbox_messages
WHERE dead_at IS NOT NULL AND done_at IS NULL;
COMMENT ON VIEW idempotency.inbox_dead IS
    'dead-lettered inbox messages (idem_inbox_replay() makes them claimable again)';

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

CREATE FUNCTION idem_inbox_receive(source text, message_id text, payload jsonb,
                                   headers jsonb DEFAULT '{}')
    RETURNS boolean
    AS 'MODULE_PATHNAME', 'idem_inbox_receive' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_inbox_claim(batch integer DEFAULT 100, lease interval DEFAULT '30 seconds',
                                 sources text[] DEFAULT NULL)
    RETURNS SETOF idem_inbox_message
    AS 'MODULE_PATHNAME', 'idem_inbox_claim' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_inbox_done(ids uuid[], lease_token uuid DEFAULT NULL)
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_inbox_done' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_inbox_fail(id uuid, error text, retry_after interval DEFAULT NULL,
                                lease_token uuid DEFAULT NULL)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_inbox_fail' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_inbox_extend(lease_token uuid, lease interval)
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_inbox_extend' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_inbox_replay(source text, since timestamptz, until timestamptz DEFAULT now())
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_inbox_replay' LANGUAGE C VOLATILE PARALLEL UNSAFE;

COMMENT ON FUNCTION idem_inbox_receive(text, text, jsonb, jsonb) IS
    'store a message once per (source, message_id); false for a duplicate';
COMMENT ON FUNCTION idem_inbox_claim(integer, interval, text[]) IS
    'lease messages to process (per ordering_key one run at a time, in receipt order)';
COMMENT ON FUNCTION idem_inbox_done(uuid[], uuid) IS
    'mark messages processed (nothing, for those whose lease the token no longer holds)';
COMMENT ON FUNCTION idem_inbox_fail(uuid, text, interval, uuid) IS
    'record a failed attempt; retried after retry_after or a backoff, dead after inbox_max_attempts';
COMMENT ON FUNCTION idem_inbox_extend(uuid, interval) IS
    'prolong the live lease of a token; returns how many messages it covers (0 once it expired)';
COMMENT ON FUNCTION idem_inbox_replay(text, timestamptz, timestamptz) IS
    'make processed and dead messages of a source received in [since, until) claimable again';

-- True if a partition holds a message that is not done (pending, leased,
-- waiting for a retry or dead), so maintenance must keep it; NULL for a
-- table that is no inbox partition, or one not as we made it.  Runs as the
-- extension's owner, like outbox_partition_pinned(), and like it is closed
-- to PUBLIC.
CREATE FUNCTION idempotency.inbox_partition_pinned(part regclass)
    RETURNS boolean
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    pinned boolean;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM idempotency.inbox_partitions p WHERE p.relid = part) THEN
        RETURN NULL;            -- not one of ours: nothing to say
    END IF;
    -- nor if it is not as we made it: planning over it could run its owner's code
    IF idempotency.relation_distrust(part, 'idempotency.inbox_messages') IS NOT NULL THEN
        RETURN NULL;
    END IF;
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s m WHERE m.done_at IS NULL)', part)
        INTO pinned;
    RETURN pinned;
END
$$;
COMMENT ON FUNCTION idempotency.inbox_partition_pinned(regclass) IS
    'true if an inbox partition holds a message that is not done (NULL: not a partition as the extension makes them)';
REVOKE ALL ON FUNCTION idempotency.inbox_partition_pinned(regclass) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.inbox_partition_pinned(regclass) TO pg_monitor;
