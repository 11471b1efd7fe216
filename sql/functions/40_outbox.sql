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
SELECT x.id, x.aggregate_type, x.aggregate_id, x.seq, x.event_type, x.payload, x.headers,
       x.created_at, x.attempts, x.last_error, x.dead_at, b.name::text AS subscription
FROM idempotency.outbox_dead_letters x
JOIN idempotency.outbox_subscriptions b ON b.id = x.subscription;
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
                                             aggregate_types text[] DEFAULT NULL,
                                             subscription text DEFAULT 'default')
    RETURNS SETOF idem_outbox_event
    AS 'MODULE_PATHNAME', 'idem_outbox_claim' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_outbox_ack(ids uuid[], lease_token uuid DEFAULT NULL,
                                           subscription text DEFAULT 'default')
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_outbox_ack' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_outbox_nack(id uuid, error text, retry_after interval DEFAULT NULL,
                                            lease_token uuid DEFAULT NULL,
                                            subscription text DEFAULT 'default')
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_outbox_nack' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_outbox_extend(lease_token uuid, lease interval,
                                              subscription text DEFAULT 'default')
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_outbox_extend' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_outbox_redrive(ids uuid[], subscription text DEFAULT 'default')
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_outbox_redrive' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_outbox_discard(ids uuid[], subscription text DEFAULT 'default')
    RETURNS integer
    AS 'MODULE_PATHNAME', 'idem_outbox_discard' LANGUAGE C VOLATILE PARALLEL UNSAFE;

COMMENT ON FUNCTION idem_outbox_emit(text, text, text, jsonb, jsonb) IS
    'write an event in the calling transaction; seq is the next number of its aggregate';
COMMENT ON FUNCTION idem_outbox_emit_many(text, text[], text[], jsonb[], jsonb[]) IS
    'emit a batch of events in array order';
CREATE OR REPLACE FUNCTION idem_outbox_subscribe(name text, aggregate_types text[] DEFAULT NULL,
                                                 start text DEFAULT 'now', dead_policy text DEFAULT NULL)
    RETURNS boolean
    AS 'MODULE_PATHNAME', 'idem_outbox_subscribe' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_outbox_unsubscribe(name text)
    RETURNS boolean
    AS 'MODULE_PATHNAME', 'idem_outbox_unsubscribe' LANGUAGE C VOLATILE PARALLEL UNSAFE;

COMMENT ON FUNCTION idem_outbox_claim(integer, interval, text[], text) IS
    'lease aggregates and return their runs of undelivered events, in seq order';
COMMENT ON FUNCTION idem_outbox_ack(uuid[], uuid, text) IS
    'mark events delivered (nothing, for an aggregate whose lease the token no longer holds)';
COMMENT ON FUNCTION idem_outbox_nack(uuid, text, interval, uuid, text) IS
    'record a failed delivery; the aggregate is retried after retry_after or a backoff';
COMMENT ON FUNCTION idem_outbox_extend(uuid, interval, text) IS
    'prolong a live lease; returns how many events it covers';
COMMENT ON FUNCTION idem_outbox_redrive(uuid[], text) IS
    'put dead-lettered events back in place, order intact';
COMMENT ON FUNCTION idem_outbox_discard(uuid[], text) IS
    'drop dead-lettered events for good';
COMMENT ON FUNCTION idem_outbox_subscribe(text, text[], text, text) IS
    'add a named subscription to the outbox (false: it exists as asked)';
COMMENT ON FUNCTION idem_outbox_unsubscribe(text) IS
    'drop a subscription with its progress and dead letters (false: there was none)';

-- The live subscriptions for which a partition holds an undelivered or
-- dead-lettered event: maintenance keeps the partition for them (or
-- detaches them, idempotency.outbox_detach_lagging()), as an array of
-- their ids.  NULL for a table that is no outbox partition, or not one as
-- we made it: nothing to say.  Runs as the extension's owner, so that
-- idempotency.partitions reads for a monitoring role granted only the view;
-- it reads only a partition that is ours (idempotency.relation_distrust()).
-- May scan the partition: maintenance and the view ask it only of
-- partitions past their retention.  An aggregate a subscription has no
-- deliveries row for has delivered nothing to it.
CREATE OR REPLACE FUNCTION idempotency.outbox_partition_pinned_by(part regclass)
    RETURNS integer[]
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    ids integer[];
BEGIN
    IF NOT EXISTS (SELECT 1 FROM idempotency.outbox_partitions p WHERE p.relid = part)
       OR idempotency.relation_distrust(part, 'idempotency.outbox_events') IS NOT NULL THEN
        RETURN NULL;
    END IF;
    EXECUTE format(
        'SELECT coalesce(array_agg(b.id ORDER BY b.id), ''{}'') FROM idempotency.outbox_subscriptions b'
        ' WHERE b.detached_at IS NULL'
        '   AND (EXISTS (SELECT 1 FROM idempotency.outbox_dead_letters x JOIN %1$s e'
        '                  ON e.aggregate_type = x.aggregate_type'
        '                 AND e.aggregate_id = x.aggregate_id AND e.seq = x.seq'
        '                WHERE x.subscription = b.id)'
        '     OR EXISTS (SELECT 1 FROM %1$s e'
        '                LEFT JOIN idempotency.outbox_deliveries d'
        '                  ON d.subscription = b.id AND d.aggregate_type = e.aggregate_type'
        '                 AND d.aggregate_id = e.aggregate_id'
        '                WHERE (b.aggregate_types IS NULL OR e.aggregate_type = ANY (b.aggregate_types))'
        '                  AND e.seq > coalesce(d.acked_seq, 0)))', part)
        INTO ids;
    RETURN ids;
END
$$;
COMMENT ON FUNCTION idempotency.outbox_partition_pinned_by(regclass) IS
    'the live subscriptions for which an outbox partition holds an undelivered or dead-lettered event';

-- True if a partition holds an undelivered or dead-lettered event of a
-- live subscription (NULL for a table that is no outbox partition as the
-- extension makes them).
CREATE OR REPLACE FUNCTION idempotency.outbox_partition_pinned(part regclass)
    RETURNS boolean
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pg_catalog.cardinality(idempotency.outbox_partition_pinned_by(part)) > 0
$$;
COMMENT ON FUNCTION idempotency.outbox_partition_pinned(regclass) IS
    'true if an outbox partition holds an undelivered or dead-lettered event (NULL: not a partition as the extension makes them)';

-- Maintenance, before it keeps a pinned partition: the subscriptions that
-- pin it although it ended longer than max_lag before "at" (the round's
-- clock) are detached, loudly (a
-- WARNING each, and the round reports them).  They pin nothing from then
-- on; their relays' calls fail until they are unsubscribed.  Returns the
-- names detached.
CREATE OR REPLACE FUNCTION idempotency.outbox_detach_lagging(part regclass, max_lag interval, at timestamptz)
    RETURNS SETOF text
    LANGUAGE plpgsql VOLATILE
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    b record;
    ended timestamptz;
BEGIN
    SELECT p.upper INTO ended FROM idempotency.outbox_partitions p WHERE p.relid = part;
    IF ended IS NULL OR max_lag <= interval '0' OR ended > at - max_lag THEN
        RETURN;
    END IF;
    FOR b IN
        UPDATE idempotency.outbox_subscriptions s
        SET detached_at = at,
            detach_reason = format('needed events of partition %s, which ended at %s, more than %s ago (idempotency.outbox_max_lag)',
                                   part, ended, max_lag)
        WHERE s.id = ANY (idempotency.outbox_partition_pinned_by(part)) AND s.detached_at IS NULL
        RETURNING s.name
    LOOP
        RAISE WARNING 'outbox subscription "%" detached: it is more than % behind', b.name, max_lag
            USING DETAIL = format('It still needed events of partition %s, which ended at %s.', part, ended),
                  HINT = 'Unsubscribe it with idem_outbox_unsubscribe() and subscribe again.';
        RETURN NEXT b.name;
    END LOOP;
END
$$;
COMMENT ON FUNCTION idempotency.outbox_detach_lagging(regclass, interval, timestamptz) IS
    'detach the subscriptions that pin an outbox partition which ended longer than max_lag before at';
REVOKE ALL ON FUNCTION idempotency.outbox_detach_lagging(regclass, interval, timestamptz) FROM PUBLIC;

-- Which partitions hold pending work is the monitoring's business.
REVOKE ALL ON FUNCTION idempotency.outbox_partition_pinned(regclass),
                       idempotency.outbox_partition_pinned_by(regclass) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.outbox_partition_pinned(regclass),
                          idempotency.outbox_partition_pinned_by(regclass) TO pg_monitor;
