-- Inbox: the idem_inbox_* functions, the dead letters' view and the
-- partitions' trigger (the tables, and how a message is stored, are in
-- sql/tables/55_inbox.sql).

COMMENT ON TABLE idempotency.inbox_messages IS
    'inbox messages with their processing state, in time partitions (receive with idem_inbox_receive())';

-- Receivers cache the partition list; changes reach them like the claims'.
CREATE OR REPLACE TRIGGER inbox_partitions_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.inbox_partitions
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.inbox_partitions ENABLE ALWAYS TRIGGER inbox_partitions_changed;

CREATE OR REPLACE VIEW idempotency.inbox_dead AS
SELECT id, source, message_id, ordering_key, seq, payload, headers, received_at,
       attempts, last_error, dead_at
FROM idempotency.inbox_messages
WHERE dead_at IS NOT NULL AND done_at IS NULL;
COMMENT ON VIEW idempotency.inbox_dead IS
    'dead-lettered inbox messages (idem_inbox_replay() makes them claimable again)';

-- The dead messages an operator may see (its sources), without a right on
-- the view: src/delivery/dead_letters.c.
CREATE OR REPLACE FUNCTION idem_inbox_dead() RETURNS SETOF idempotency.inbox_dead
    AS 'MODULE_PATHNAME', 'idem_inbox_dead' LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idem_inbox_dead() IS
    'dead-lettered inbox messages of the sources the caller''s operator capability covers';

CREATE OR REPLACE FUNCTION idem_inbox_receive(source text, message_id text, payload jsonb,
                                              headers jsonb DEFAULT '{}')
    RETURNS boolean
    AS 'MODULE_PATHNAME', 'idem_inbox_receive' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_inbox_claim(batch integer DEFAULT 100, lease interval DEFAULT '30 seconds',
                                            sources text[] DEFAULT NULL)
    RETURNS SETOF idem_inbox_message
    AS 'MODULE_PATHNAME', 'idem_inbox_claim' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_inbox_done(ids uuid[], lease_token uuid DEFAULT NULL)
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_inbox_done' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_inbox_fail(id uuid, error text, retry_after interval DEFAULT NULL,
                                           lease_token uuid DEFAULT NULL)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_inbox_fail' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_inbox_extend(lease_token uuid, lease interval)
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_inbox_extend' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_inbox_replay(source text, since timestamptz, until timestamptz DEFAULT now())
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
CREATE OR REPLACE FUNCTION idempotency.inbox_partition_pinned(part regclass)
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
