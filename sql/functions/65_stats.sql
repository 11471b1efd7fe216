-- Observability: idempotency.stats (counters per scope and per guarded
-- table) and idempotency.consumers (every scope ever claimed in).
--
-- The counters live in shared memory when the library is preloaded (see
-- src/stats/stats.c); without preload the view answers what the tables can tell
-- and leaves the rest NULL.  Like PostgreSQL's own statistics views these
-- are for monitoring roles (pg_monitor, see the end of this file): they
-- read them whole without any right on the tables behind (stats_rows()
-- runs as the extension's owner, read only, with search_path pinned;
-- live_scopes() is C that reads without checking table privileges).
-- Nothing here reads a partition that is not ours
-- (idempotency.relation_distrust()): the partition's owner could have
-- attached code that would run with the reader's rights.  The row type
-- and the scope history are in sql/tables/65_stats.sql.

CREATE OR REPLACE FUNCTION idempotency.stats_counters()
    RETURNS SETOF idempotency.stats_row
    AS 'MODULE_PATHNAME', 'idem_stats_counters' LANGUAGE C VOLATILE PARALLEL RESTRICTED;
COMMENT ON FUNCTION idempotency.stats_counters() IS
    'this database''s shared-memory counters since the last reset (no rows unless the library is preloaded)';

CREATE OR REPLACE FUNCTION idempotency.stats_info(
        OUT preloaded boolean, OUT max_scopes integer, OUT scopes_tracked integer,
        OUT databases integer, OUT dropped bigint, OUT stats_reset timestamptz,
        OUT last_maintenance timestamptz, OUT database_scopes integer, OUT fair_share integer)
    RETURNS record
    AS 'MODULE_PATHNAME', 'idem_stats_info' LANGUAGE C VOLATILE PARALLEL RESTRICTED;
COMMENT ON FUNCTION idempotency.stats_info() IS
    'whether counters are kept, idempotency.stats_max_scopes, rows in use (all databases), events no row could take, this database''s last reset and last committed maintenance round, the rows it holds and the fair share it may keep';

CREATE OR REPLACE FUNCTION idem_stats_reset(all_databases boolean DEFAULT false)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_stats_reset' LANGUAGE C VOLATILE PARALLEL UNSAFE;
COMMENT ON FUNCTION idem_stats_reset(boolean) IS
    'start this database''s idempotency.stats counters afresh (every database''s: all_databases, superuser only)';
-- Resetting is an operator's business, like pg_stat_reset(): it checks the
-- unlimited operator capability (src/common/capabilities.c).

COMMENT ON TABLE idempotency.scope_history IS
    'claims per scope of the sealed partitions (written by maintenance; read idempotency.consumers)';

-- Per scope: the claims of the partitions not sealed yet, in the caller's
-- snapshot (STABLE), so a seal that committed is seen both here and in
-- scope_history, or in neither.  In C (src/stats/stats.c): it reads only the
-- partitions that are ours (idempotency.relation_distrust()), by a heap
-- scan that plans nothing, so no code a partition's owner attached runs;
-- it checks no table privilege, so it needs no SECURITY DEFINER.
CREATE OR REPLACE FUNCTION idempotency.live_scopes(
        OUT scope text, OUT first_claim_at timestamptz, OUT last_claim_at timestamptz,
        OUT claims bigint)
    RETURNS SETOF record
    AS 'MODULE_PATHNAME', 'idem_live_scopes' LANGUAGE C STABLE PARALLEL RESTRICTED;
COMMENT ON FUNCTION idempotency.live_scopes() IS
    'claims per scope in the partitions not sealed yet (those that are not the extension''s are skipped)';

CREATE OR REPLACE VIEW idempotency.consumers AS
SELECT x.scope,
       min(x.first_claim_at) AS first_claim_at,
       max(x.last_claim_at) AS last_claim_at,
       sum(x.claims)::bigint AS claims
FROM (SELECT h.scope::text COLLATE "C" AS scope, h.first_claim_at, h.last_claim_at, h.claims
      FROM idempotency.scope_history h
      UNION ALL
      SELECT l.scope COLLATE "C", l.first_claim_at, l.last_claim_at, l.claims
      FROM idempotency.live_scopes() l) x
GROUP BY x.scope;
COMMENT ON VIEW idempotency.consumers IS
    'every scope claimed in, with its first and last claim and how many claims it made (released ones not counted)';

-- Per live subscription and aggregate type: the outbox's backlog, dead
-- letters and the age of the oldest event waiting (gauges, read from the
-- tables).  An event behind a dead-lettered head waits; the head itself
-- counts as dead.  Only stored events wait: what outbox_mode 'wal' emitted
-- (no row) went out through logical decoding, and a relay passes over its
-- seqs.  An aggregate a subscription has no deliveries row for has had
-- nothing delivered to it.
CREATE OR REPLACE VIEW idempotency.outbox_backlog AS
WITH pending AS (
    SELECT b.name AS subscription, e.aggregate_type, count(*) AS waiting,
           min(e.created_at) AS oldest
    FROM idempotency.outbox_subscriptions b
    JOIN idempotency.outbox_events e
      ON b.aggregate_types IS NULL OR e.aggregate_type = ANY (b.aggregate_types)
    LEFT JOIN idempotency.outbox_deliveries d
      ON d.subscription = b.id AND d.aggregate_type = e.aggregate_type AND d.aggregate_id = e.aggregate_id
    WHERE b.detached_at IS NULL
      AND e.seq > coalesce(d.acked_seq, 0) + CASE WHEN d.dead_seq > d.acked_seq THEN 1 ELSE 0 END
    GROUP BY b.name, e.aggregate_type
), by_type AS (
    SELECT p.subscription, p.aggregate_type, p.waiting AS pending, p.oldest
    FROM pending p
), dead AS (
    SELECT b.name AS subscription, l.aggregate_type, count(*) AS dead
    FROM idempotency.outbox_dead_letters l
    JOIN idempotency.outbox_subscriptions b ON b.id = l.subscription AND b.detached_at IS NULL
    GROUP BY b.name, l.aggregate_type
)
SELECT coalesce(b.aggregate_type, d.aggregate_type)::text AS aggregate_type,
       coalesce(b.pending, 0)::bigint AS pending,
       coalesce(d.dead, 0)::bigint AS dead,
       now() - b.oldest AS oldest_pending_age,
       coalesce(b.subscription, d.subscription)::text AS subscription
FROM by_type b
FULL JOIN dead d ON d.aggregate_type = b.aggregate_type AND d.subscription = b.subscription;
COMMENT ON VIEW idempotency.outbox_backlog IS
    'per live subscription and aggregate type: outbox events not delivered yet, dead letters, age of the oldest waiting event';

-- Per subscription: its definition, whether it was detached (and why),
-- and its backlog over all its aggregate types.
CREATE OR REPLACE VIEW idempotency.outbox_subscriptions_status AS
SELECT b.name::text AS name, b.aggregate_types::text[] AS aggregate_types,
       b.start, b.dead_policy, b.created_at,
       CASE WHEN b.detached_at IS NULL THEN 'active' ELSE 'detached' END AS state,
       b.detached_at, b.detach_reason,
       coalesce(k.pending, 0)::bigint AS pending,
       coalesce(k.dead, 0)::bigint AS dead,
       k.oldest_pending_age
FROM idempotency.outbox_subscriptions b
LEFT JOIN (SELECT o.subscription, sum(o.pending) AS pending, sum(o.dead) AS dead,
                  max(o.oldest_pending_age) AS oldest_pending_age
           FROM idempotency.outbox_backlog o GROUP BY o.subscription) k
  ON k.subscription = b.name;
COMMENT ON VIEW idempotency.outbox_subscriptions_status IS
    'outbox subscriptions: definition, active or detached, backlog, dead letters and lag';

-- Per source: the inbox's messages not done yet, dead letters among them,
-- and the age of the oldest waiting one (gauges, read from the tables).
CREATE OR REPLACE VIEW idempotency.inbox_backlog AS
SELECT m.source::text AS source,
       count(*) FILTER (WHERE m.dead_at IS NULL) AS pending,
       count(*) FILTER (WHERE m.dead_at IS NOT NULL) AS dead,
       now() - min(m.received_at) FILTER (WHERE m.dead_at IS NULL) AS oldest_pending_age
FROM idempotency.inbox_messages m
WHERE m.done_at IS NULL
GROUP BY m.source;
COMMENT ON VIEW idempotency.inbox_backlog IS
    'per source: inbox messages not processed yet, dead letters, age of the oldest waiting message';

-- The counted rows of idempotency.stats: with preload, what shared memory
-- counted since the last reset (and the guarded tables nothing was counted
-- for yet, with zeros); without, what the tables hold -- a row per scope of
-- idempotency.consumers, with claims, last_claim_at and the requests the
-- request store still keeps, and a row per guarded table -- and NULL for
-- what only shared memory knows.  A function, so that only one of the two
-- is ever computed.  It runs as the owner: the requests are read partition
-- by partition, and only from the partitions that are ours
-- (idempotency.relation_distrust()), since planning over one could run its
-- owner's code.
CREATE OR REPLACE FUNCTION idempotency.stats_rows()
    RETURNS SETOF idempotency.stats_row
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    preloaded boolean := (SELECT i.preloaded FROM idempotency.stats_info() i);
    parts text;
    requests jsonb := '{}';
BEGIN
    IF NOT preloaded THEN
        SELECT string_agg(format('SELECT r.scope, r.status FROM %s r', i.inhrelid::regclass), ' UNION ALL ')
          INTO parts
          FROM pg_catalog.pg_inherits i
         WHERE i.inhparent = 'idempotency.requests'::regclass
           AND idempotency.relation_distrust(i.inhrelid, i.inhparent) IS NULL;
        IF parts IS NOT NULL THEN
            EXECUTE format(
                'SELECT coalesce(jsonb_object_agg(q.scope, jsonb_build_array(q.started, q.completed)), ''{}'')'
                '  FROM (SELECT ''request:'' || r.scope AS scope, count(*) AS started,'
                '               count(*) FILTER (WHERE r.status = ''completed'') AS completed'
                '          FROM (%s) r GROUP BY r.scope) q', parts)
                INTO requests;
        END IF;
    END IF;
    -- the counters are read once; without preload there are none
    RETURN QUERY
    WITH c AS MATERIALIZED (SELECT * FROM idempotency.stats_counters()),
         g AS (SELECT DISTINCT t.tgrelid::regclass AS relation
               FROM pg_catalog.pg_trigger t
               WHERE t.tgfoid IN ('idempotency.version_guard()'::regprocedure,
                                  'idempotency.transition_guard()'::regprocedure))
    -- a dropped table's counters stay in shared memory: not shown
    SELECT * FROM c
    WHERE c.relation IS NULL
       OR EXISTS (SELECT 1 FROM pg_catalog.pg_class r WHERE r.oid = c.relation)
    UNION ALL
    -- guarded tables nothing was counted for: zeros, or NULL without preload
    SELECT NULL, g.relation, z, z, z, z, z, z, z, z, z, z, NULL, NULL
    FROM g, LATERAL (SELECT CASE WHEN preloaded THEN 0::bigint END AS z) zero
    WHERE NOT EXISTS (SELECT 1 FROM c WHERE c.relation = g.relation)
    UNION ALL
    -- without preload: the scopes the tables know
    SELECT k.scope, NULL, k.claims, NULL, NULL, NULL, NULL, NULL,
           (requests -> k.scope ->> 0)::bigint, (requests -> k.scope ->> 1)::bigint, NULL, NULL,
           k.last_claim_at, NULL
    FROM idempotency.consumers k
    WHERE NOT preloaded;
END
$$;
COMMENT ON FUNCTION idempotency.stats_rows() IS
    'the counted rows of idempotency.stats (shared memory when preloaded, the tables otherwise)';

-- One row per scope (relation NULL), per guarded table (scope NULL), per
-- outbox aggregate type (scope 'outbox:<type>', its backlog summed over the
-- live subscriptions, the oldest age among them), and the
-- overflow row (both NULL) once scopes exceeded idempotency.stats_max_scopes.
-- An inbox source's backlog joins its claims' row ('inbox:<source>').  The
-- columns of SPEC section 6 come first, in its order; the inbox's follow,
-- then late_duplicates (SPEC section 2: new claims of keys probably claimed
-- before whose claim had expired, src/claims/late.c).
CREATE OR REPLACE VIEW idempotency.stats AS
SELECT coalesce(r.scope, o.scope, i.scope) AS scope,
       r.relation,
       r.claims, r.duplicates, r.payload_mismatches, r.releases,
       r.stale_skips, r.invalid_transitions,
       r.requests_started, r.requests_completed, r.requests_conflicted,
       o.pending AS outbox_pending,
       o.dead AS outbox_dead,
       o.oldest_pending_age AS outbox_oldest_pending_age,
       r.last_claim_at, r.last_duplicate_at,
       n.stats_reset,
       i.pending AS inbox_pending,
       i.dead AS inbox_dead,
       i.oldest_pending_age AS inbox_oldest_pending_age,
       r.late_duplicates
FROM idempotency.stats_rows() r
FULL JOIN (SELECT ('outbox:' || b.aggregate_type) COLLATE "C" AS scope,
                  sum(b.pending)::bigint AS pending, sum(b.dead)::bigint AS dead,
                  max(b.oldest_pending_age) AS oldest_pending_age
           FROM idempotency.outbox_backlog b GROUP BY b.aggregate_type) o ON r.scope COLLATE "C" = o.scope
FULL JOIN (SELECT ('inbox:' || b.source) COLLATE "C" AS scope, b.*
           FROM idempotency.inbox_backlog b) i ON coalesce(r.scope, o.scope) COLLATE "C" = i.scope
CROSS JOIN idempotency.stats_info() n;
COMMENT ON VIEW idempotency.stats IS
    'claims, duplicates, mismatches, releases per scope; stale and invalid writes per guarded table; requests; outbox backlog; late duplicates';

-- Who reads: members of pg_monitor (with USAGE on schema idempotency), or
-- roles granted the same rights.  The functions stay closed to PUBLIC:
-- stats_rows() runs as the owner and live_scopes() reads the claims
-- whatever the caller's rights, so calling them is reading the views.
REVOKE ALL ON FUNCTION idempotency.stats_counters(), idempotency.stats_info(),
                       idempotency.stats_rows(), idempotency.live_scopes() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idempotency.stats_counters(), idempotency.stats_info(),
                          idempotency.stats_rows(), idempotency.live_scopes() TO pg_monitor;
GRANT SELECT ON idempotency.stats, idempotency.consumers, idempotency.outbox_backlog,
                idempotency.outbox_subscriptions_status,
                idempotency.inbox_backlog, idempotency.partitions TO pg_monitor;
