-- Retention: settings, maintenance and the partitions view.

CREATE OR REPLACE FUNCTION idem_configure(retention interval DEFAULT NULL,
                                          partition_interval interval DEFAULT NULL,
                                          premake integer DEFAULT NULL)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_configure' LANGUAGE C VOLATILE;

CREATE OR REPLACE FUNCTION idem_maintain()
    RETURNS TABLE(action text, object text)
    AS 'MODULE_PATHNAME', 'idem_maintain' LANGUAGE C VOLATILE;

COMMENT ON FUNCTION idem_configure(interval, interval, integer) IS
    'set retention, partition interval and premake (NULL keeps a value)';
COMMENT ON FUNCTION idem_maintain() IS
    'create partitions ahead and drop expired ones; one row per action';

-- The partitions view, which lists the outbox's partitions too, is in
-- 60_partitions.sql.

-- Maintenance is a capability: a round runs as the extension's owner
-- (src/maintenance/maintenance.c), so who may start one is who holds the
-- unlimited operator capability (src/common/capabilities.c), which both
-- functions check.  (Revoked and granted again, so that the ACL is the one
-- the update from 1.0 leaves.)
REVOKE ALL ON FUNCTION idem_configure(interval, interval, integer), idem_maintain() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idem_configure(interval, interval, integer), idem_maintain() TO PUBLIC;

-- Retention per scope (sql/tables/10_scope_retention.sql): idem_configure_scope()
-- writes the table, as the extension's owner, under the maintenance lock;
-- the trigger makes every claimer re-read it with the partition registry
-- (src/claims/partitions.c), whose cache decides the partition a claim goes into.
CREATE OR REPLACE FUNCTION idem_configure_scope(scope text, retention interval)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_configure_scope' LANGUAGE C VOLATILE;
COMMENT ON FUNCTION idem_configure_scope(text, interval) IS
    'keep the claims of a scope (or of every scope starting with a prefix, ''prefix*'') for a retention of their own; NULL removes it';
REVOKE ALL ON FUNCTION idem_configure_scope(text, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idem_configure_scope(text, interval) TO PUBLIC;

COMMENT ON TABLE idempotency.scope_retention IS
    'retention per scope or scope prefix (written by idem_configure_scope)';
REVOKE ALL ON idempotency.scope_retention FROM PUBLIC;

CREATE OR REPLACE TRIGGER scope_retention_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.scope_retention
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.scope_retention ENABLE ALWAYS TRIGGER scope_retention_changed;
