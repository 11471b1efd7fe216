-- Transactional outbox: the functions, the dead letters' view and the
-- partitions' trigger (the tables are in sql/tables/40_outbox.sql).

COMMENT ON TABLE idempotency.outbox_events IS
    'outbox events, insert-only, in time partitions (emit with idem_outbox_emit())';

-- Emitters cache the partition list; changes reach them like the claims'.
CREATE OR REPLACE TRIGGER outbox_partitions_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.outbox_partitions
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.outbox_partitions ENABLE ALWAYS TRIGGER outbox_partitions_changed;

CREATE OR REPLACE VIEW idempotency.outbox_dead AS
SELECT id, aggregate_type, aggregate_id, seq, event_type, payload, headers,
       created_at, attempts, last_error, dead_at
FROM idempotency.outbox_dead_letters;
COMMENT ON VIEW idempotency.outbox_dead IS
    'dead-lettered outbox events (idem_outbox_redrive() puts them back, idem_outbox_discard() drops them)';

-- The dead events an operator may see (its aggregate types), without a
-- right on the view: src/delivery/dead_letters.c.
CREATE OR REPLACE FUNCTION idem_outbox_dead() RETURNS SETOF idempotency.outbox_dead
    AS 'MODULE_PATHNAME', 'idem_outbox_dead' LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idem_outbox_dead() IS
    'dead-lettered outbox events of the aggregate types the caller''s operator capability covers';

CREATE OR REPLACE FUNCTION idem_outbox_emit(aggregate_type text, aggregate_id text, event_type text,
                                            payload jsonb, headers jsonb DEFAULT '{}')
    RETURNS idem_outbox_event
    AS 'MODULE_PATHNAME', 'idem_outbox_emit' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_outbox_emit_many(aggregate_type text, aggregate_ids text[],
                                                 event_types text[], payloads jsonb[],
                                                 headers jsonb[] DEFAULT NULL)
    RETURNS SETOF idem_outbox_event
    AS 'MODULE_PATHNAME', 'idem_outbox_emit_many' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_outbox_claim(batch integer DEFAULT 100, lease interval DEFAULT '30 seconds',
                                             aggregate_types text[] DEFAULT NULL)
    RETURNS SETOF idem_outbox_event
    AS 'MODULE_PATHNAME', 'idem_outbox_claim' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_outbox_ack(ids uuid[], lease_token uuid DEFAULT NULL)
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_outbox_ack' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_outbox_nack(id uuid, error text, retry_after interval DEFAULT NULL,
                                            lease_token uuid DEFAULT NULL)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_outbox_nack' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_outbox_extend(lease_token uuid, lease interval)
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_outbox_extend' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_outbox_redrive(ids uuid[])
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_outbox_redrive' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_outbox_discard(ids uuid[])
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_outbox_discard' LANGUAGE C VOLATILE PARALLEL UNSAFE;

COMMENT ON FUNCTION idem_outbox_emit(text, text, text, jsonb, jsonb) IS
    'write an event in the calling transaction; seq is the next number of its aggregate';
COMMENT ON FUNCTION idem_outbox_emit_many(text, text[], text[], jsonb[], jsonb[]) IS
    'emit a batch of events in array order';
COMMENT ON FUNCTION idem_outbox_claim(integer, interval, text[]) IS
    'lease aggregates and return their runs of undelivered events, in seq order';
COMMENT ON FUNCTION idem_outbox_ack(uuid[], uuid) IS
    'mark events delivered (nothing, for an aggregate whose lease the token no longer holds)';
COMMENT ON FUNCTION idem_outbox_nack(uuid, text, interval, uuid) IS
    'record a failed delivery; the aggregate is retried after retry_after or a backoff';
COMMENT ON FUNCTION idem_outbox_extend(uuid, interval) IS
    'prolong a live lease; returns how many events it covers';
COMMENT ON FUNCTION idem_outbox_redrive(uuid[]) IS
    'put dead-lettered events back in place, order intact';
COMMENT ON FUNCTION idem_outbox_discard(uuid[]) IS
    'drop dead-lettered events for good';

-- True if a partition holds an undelivered or dead-lettered event, so
-- maintenance must keep it (NULL for a table that is no outbox partition).
-- Runs as the extension's owner, so that idempotency.partitions reads for
-- a monitoring role granted only the view; it reads only a partition that
-- is ours (idempotency.relation_distrust()).  May scan the partition:
-- maintenance and the view ask it only of partitions past their retention.
CREATE OR REPLACE FUNCTION idempotency.outbox_partition_pinned(part regclass)
    RETURNS boolean
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    pinned boolean;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM idempotency.outbox_partitions p WHERE p.relid = part) THEN
        RETURN NULL;            -- not one of ours: nothing to say
    END IF;
    -- nor if it is not as we made it: planning over it could run its owner's code
    IF idempotency.relation_distrust(part, 'idempotency.outbox_events') IS NOT NULL THEN
        RETURN NULL;
    END IF;
    EXECUTE format(
        'SELECT EXISTS (SELECT 1 FROM idempotency.outbox_dead_letters x JOIN %1$s e'
        '                 ON e.aggregate_type = x.aggregate_type'
        '                AND e.aggregate_id = x.aggregate_id AND e.seq = x.seq)'
        '    OR EXISTS (SELECT 1 FROM %1$s e'
        '               LEFT JOIN idempotency.outbox_deliveries d'
        '                 ON d.aggregate_type = e.aggregate_type AND d.aggregate_id = e.aggregate_id'
        '               WHERE e.seq > coalesce(d.acked_seq, 0))', part)
        INTO pinned;
    RETURN pinned;
END
$$;
COMMENT ON FUNCTION idempotency.outbox_partition_pinned(regclass) IS
    'true if an outbox partition holds an undelivered or dead-lettered event (NULL: not a partition as the extension makes them)';
-- Which partitions hold pending work is the monitoring's business.
REVOKE ALL ON FUNCTION idempotency.outbox_partition_pinned(regclass) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.outbox_partition_pinned(regclass) TO pg_monitor;
