-- The partitions view: every time partition of the claims, the outbox, the
-- requests and the inbox.
--
-- Claims partitions (store 'claims'): future (premade), current (takes
-- claims now), sealing (its range has passed; the next maintenance round
-- seals it, or closes it if a transaction holds a lock on it), closing
-- (takes no more claims; the next round seals it), held (sealed while
-- transactions that claimed there were open -- held_by_xids, held_by_pids
-- name those still open: checked through its Bloom filter, but counted in
-- idempotency.consumers as live and not dropped until they end), sealed
-- (takes no more claims; checked through its Bloom filter), expired
-- (sealed, and its newest claim -- or its upper bound, if later -- is older
-- than its retention -- or it is empty; dropped by the next round that
-- can lock it).  A claims partition's retention is its class's, or longer
-- if it holds claims of scopes kept longer: keep_retention, and
-- idem_configure()'s if keep_default (scopes that follow it now).
--
-- Outbox partitions (store 'outbox'): future, current, sealed (its range
-- has passed; kept for the retention), pinned (past its retention, but it
-- holds an undelivered or dead-lettered event), expired (dropped by the next
-- round that can lock it).
--
-- Request partitions (store 'requests'): future, current, sealed (its
-- range has passed; kept for the retention), expired.
--
-- Each store's partitions are kept for that store's retention
-- (idempotency.current_store_settings()), shown in the retention column.
--
-- Inbox partitions (store 'inbox'): the same states; pinned means it holds
-- a message that is not done (pending, leased, waiting or dead).
--
-- The columns of the 1.0 view come first, in their order, so that the
-- upgrade replaces the view in place (CREATE OR REPLACE, which can only
-- append columns): a view of a user's over it must not block ALTER
-- EXTENSION UPDATE.  Add a column at the end, never between.
CREATE OR REPLACE VIEW idempotency.partitions AS
SELECT r.relid AS partition,
       r.lower,
       r.upper,
       CASE
           WHEN NOT r.sealed AND r.held_by IS NOT NULL THEN 'held'
           WHEN r.sealed AND (r.nkeys = 0
                 OR greatest(r.upper, r.max_claimed_at) <= now() - k.retention) THEN 'expired'
           WHEN r.sealed THEN 'sealed'
           WHEN r.closed THEN 'closing'
           WHEN r.lower > now() THEN 'future'
           WHEN now() < r.upper THEN 'current'
           ELSE 'sealing'
       END AS state,
       r.bloom IS NOT NULL AS has_bloom_filter,
       pg_catalog.pg_total_relation_size(r.relid) AS bytes,
       r.nkeys AS claims,
       r.max_claimed_at AS newest_claim,
       'claims'::text AS store,
       h.xids AS held_by_xids,
       h.pids AS held_by_pids,
       k.retention
FROM idempotency.partition_registry r
CROSS JOIN idempotency.current_settings() s
CROSS JOIN LATERAL (
    SELECT greatest(coalesce(r.retention, s.retention), coalesce(r.keep_retention, interval '0'),
                    CASE WHEN r.keep_default THEN s.retention ELSE interval '0' END) AS retention) k
-- a held partition's holders that are still open, and their backends
-- (none for a prepared transaction); pg_locks is read only for those
LEFT JOIN LATERAL (
    SELECT ARRAY(SELECT x FROM pg_catalog.unnest(r.held_by) x
                  WHERE pg_catalog.pg_xact_status(x) = 'in progress' ORDER BY x) AS xids,
           ARRAY(SELECT DISTINCT l.pid FROM pg_catalog.pg_locks l
                  WHERE l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock' AND l.granted
                    AND l.pid IS NOT NULL
                    AND l.transactionid = ANY (r.held_by::pg_catalog.xid[])
                  ORDER BY l.pid) AS pids
     WHERE NOT r.sealed AND r.held_by IS NOT NULL) h ON true
UNION ALL
SELECT o.relid, o.lower, o.upper,
       CASE
           WHEN o.lower > now() THEN 'future'
           WHEN now() < o.upper THEN 'current'
           WHEN o.upper > now() - s.retention THEN 'sealed'
           WHEN idempotency.outbox_partition_pinned(o.relid) THEN 'pinned'
           ELSE 'expired'
       END,
       false,
       pg_catalog.pg_total_relation_size(o.relid),
       NULL, NULL,
       'outbox', NULL, NULL, s.retention
FROM idempotency.outbox_partitions o
CROSS JOIN (SELECT c.retention FROM idempotency.current_store_settings() c
            WHERE c.store = 'outbox') s
UNION ALL
SELECT q.relid, q.lower, q.upper,
       CASE
           WHEN q.lower > now() THEN 'future'
           WHEN now() < q.upper THEN 'current'
           WHEN q.upper > now() - s.retention THEN 'sealed'
           ELSE 'expired'
       END,
       false,
       pg_catalog.pg_total_relation_size(q.relid),
       NULL, NULL,
       'requests', NULL, NULL, s.retention
FROM idempotency.request_partitions q
CROSS JOIN (SELECT c.retention FROM idempotency.current_store_settings() c
            WHERE c.store = 'requests') s
UNION ALL
SELECT i.relid, i.lower, i.upper,
       CASE
           WHEN i.lower > now() THEN 'future'
           WHEN now() < i.upper THEN 'current'
           WHEN i.upper > now() - s.retention THEN 'sealed'
           WHEN idempotency.inbox_partition_pinned(i.relid) THEN 'pinned'
           ELSE 'expired'
       END,
       false,
       pg_catalog.pg_total_relation_size(i.relid),
       NULL, NULL,
       'inbox', NULL, NULL, s.retention
FROM idempotency.inbox_partitions i
CROSS JOIN (SELECT c.retention FROM idempotency.current_store_settings() c
            WHERE c.store = 'inbox') s;
COMMENT ON VIEW idempotency.partitions IS
    'time partitions of idempotency.claims, idempotency.outbox_events, idempotency.requests and idempotency.inbox_messages with range, state and size';
