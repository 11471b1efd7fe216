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

-- Each partition with its time range, state and size.
CREATE VIEW idempotency.partitions AS
SELECT r.relid AS partition,
       r.lower,
       r.upper,
       CASE
           WHEN r.upper <= now() - s.retention THEN 'expired'
           WHEN r.lower > now() THEN 'future'
           WHEN now() < r.upper THEN 'current'
           ELSE 'sealed'
       END AS state,
       pg_catalog.pg_total_relation_size(r.relid) AS bytes
FROM idempotency.partition_registry r
CROSS JOIN (SELECT coalesce((SELECT retention FROM idempotency.settings),
                            interval '7 days') AS retention) s;
COMMENT ON VIEW idempotency.partitions IS
    'time partitions of idempotency.claims with range, state and size';
