-- Retention: settings, maintenance and the partitions view.

CREATE FUNCTION idem_configure(retention interval DEFAULT NULL,
                               partition_interval interval DEFAULT NULL,
                               premake integer DEFAULT NULL)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_configure' LANGUAGE C VOLATILE;

CREATE FUNCTION idem_maintain()
    RETURNS TABLE(action text, object text)
    AS 'MODULE_PATHNAME', 'idem_maintain' LANGUAGE C VOLATILE;

COMMENT ON FUNCTION idem_configure(interval, interval, integer) IS
    'set retention, partition interval and premake (NULL keeps a value)';
COMMENT ON FUNCTION idem_maintain() IS
    'create partitions ahead and drop expired ones; one row per action';

-- Each partition with its time range, state and size.  States: future
-- (premade), current (takes claims now), sealing (its range has passed; the
-- next maintenance round seals it), sealed (takes no more claims; checked
-- through its Bloom filter), expired (sealed, and its newest claim -- or its
-- upper bound, if later -- is older than the retention window, or it is
-- empty; dropped by the next round that can lock it).
CREATE VIEW idempotency.partitions AS
SELECT r.relid AS partition,
       r.lower,
       r.upper,
       CASE
           WHEN r.sealed AND (r.nkeys = 0
                 OR greatest(r.upper, r.max_claimed_at) <= now() - s.retention) THEN 'expired'
           WHEN r.sealed THEN 'sealed'
           WHEN r.lower > now() THEN 'future'
           WHEN now() < r.upper THEN 'current'
           ELSE 'sealing'
       END AS state,
       r.nkeys AS claims,
       r.max_claimed_at AS newest_claim,
       r.bloom IS NOT NULL AS has_bloom_filter,
       pg_catalog.pg_total_relation_size(r.relid) AS bytes
FROM idempotency.partition_registry r
CROSS JOIN idempotency.current_settings() s;
COMMENT ON VIEW idempotency.partitions IS
    'time partitions of idempotency.claims with range, state and size';
