-- idempotency: the stores' own retention (the functions over it and its
-- cache trigger are in sql/functions/22_store_settings.sql).

-- At most one row per store (the outbox, the inbox, the requests), written
-- by idem_configure_store() (which validates); a store with no row follows
-- the retention of idem_configure().  Kept by pg_dump (configuration
-- table), so the stores' retentions survive dump and restore.
CREATE TABLE idempotency.store_settings (
    store     text     PRIMARY KEY CHECK (store IN ('outbox', 'inbox', 'requests')),
    retention interval NOT NULL
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.store_settings', '');
