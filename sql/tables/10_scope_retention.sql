-- Claims: retention per scope (the cache trigger, idem_configure_scope() and
-- the comments are in sql/functions/20_retention.sql; the code in
-- src/claims/classes.c).
--
-- One row per scope, or scope prefix ('webhooks:*'), whose claims are kept
-- for a retention of their own instead of idem_configure()'s.  Each distinct
-- retention here is a retention class with its own series of partitions
-- (partition_registry.retention), so that a shorter one is reclaimed by
-- partition drop as well.  At most IDEM_MAX_SCOPE_PATTERNS rows and
-- IDEM_MAX_RETENTION_CLASSES distinct retentions (src/claims/classes.h).  A
-- configuration table: pg_dump keeps it.
CREATE TABLE idempotency.scope_retention (
    scope     text COLLATE "C" PRIMARY KEY
              CHECK (scope <> '' AND pg_catalog.strpos(pg_catalog.rtrim(scope, '*'), '*') = 0),
    retention interval NOT NULL CHECK (retention > interval '0')
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.scope_retention', '');
