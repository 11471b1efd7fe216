-- The stores' own retention: idem_configure_store() and what is in force
-- (the table is in sql/tables/22_store_settings.sql).

-- The same cache trigger as idempotency.settings' (00_schema.sql): a cache
-- of the retention in force (the claims' of the inbox and of requests
-- follow their store's) hears of a change at the writer's commit.
CREATE OR REPLACE TRIGGER store_settings_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.store_settings
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.store_settings ENABLE ALWAYS TRIGGER store_settings_changed;

CREATE OR REPLACE FUNCTION idem_configure_store(store text, retention interval)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_configure_store' LANGUAGE C VOLATILE;
COMMENT ON FUNCTION idem_configure_store(text, interval) IS
    'set the retention of store outbox, inbox or requests (NULL: follow idem_configure''s again)';

-- The stores' retention in force: their own, or idem_configure's.
CREATE OR REPLACE FUNCTION idempotency.current_store_settings(
        OUT store text, OUT retention interval, OUT own boolean)
    RETURNS SETOF record
    AS 'MODULE_PATHNAME', 'idem_current_store_settings' LANGUAGE C STABLE;
COMMENT ON FUNCTION idempotency.current_store_settings() IS
    'the retention in force of each store (outbox, requests, inbox), and whether it is its own (else idem_configure''s)';

-- Like idem_configure: the unlimited operator capability, which the
-- function checks, decides who may call it.
REVOKE ALL ON FUNCTION idem_configure_store(text, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idem_configure_store(text, interval) TO PUBLIC;
