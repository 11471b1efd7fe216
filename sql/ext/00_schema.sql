-- idempotency 1.0: schema, settings and the partition registry.
--
-- Public functions (idem_*) are created in the extension's schema; tables,
-- views and internals live in schema "idempotency".

\echo Use "CREATE EXTENSION idempotency" to load this file. \quit

CREATE SCHEMA idempotency;
COMMENT ON SCHEMA idempotency IS 'tables, views and internals of the idempotency extension';

-- At most one row; no row means every setting has its default.  Kept by
-- pg_dump (configuration table), so settings survive dump and restore.
CREATE TABLE idempotency.settings (
    singleton          boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    retention          interval NOT NULL DEFAULT '7 days',
    partition_interval interval NOT NULL DEFAULT '1 day',
    premake            integer  NOT NULL DEFAULT 4
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.settings', '');

-- Every time partition of the claims table, with the time range of the
-- claims it takes.  Read by every claiming backend (cached, and refreshed
-- through a relcache invalidation that the trigger below sends on any change).
CREATE TABLE idempotency.partition_registry (
    relid      regclass    PRIMARY KEY,
    lower      timestamptz NOT NULL,
    upper      timestamptz NOT NULL,
    sealed     boolean     NOT NULL DEFAULT false,  -- no claim can go here any more
    bloom      bytea,                               -- Bloom filter of a sealed partition's keys
    CHECK (lower < upper)
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.partition_registry', '');

CREATE FUNCTION idempotency.registry_changed() RETURNS trigger
    AS 'MODULE_PATHNAME', 'idem_registry_changed' LANGUAGE C;

CREATE TRIGGER registry_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.partition_registry
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.registry_changed();

CREATE TRIGGER settings_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.settings
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.registry_changed();
