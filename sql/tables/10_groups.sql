-- Claims: filter groups, one Bloom filter over the keys of up to
-- IDEM_GROUP_MAX_MEMBERS sealed partitions (src/claims/groups.h), so that a
-- new key costs one filter test per group rather than one per partition
-- (the cache trigger and the comment are in sql/functions/10_claims.sql;
-- the code in src/claims/groups.c).
--
-- Maintenance adds a partition's keys to the newest group in the
-- transaction that seals it, and deletes a group once none of its members
-- is in the registry.  A configuration table, so that pg_dump keeps the
-- groups of the partitions it keeps (members are dumped by name).
CREATE TABLE idempotency.filter_groups (
    id        integer PRIMARY KEY CHECK (id > 0),
    members   regclass[] NOT NULL,  -- the sealed partitions whose keys it holds
    nkeys     bigint NOT NULL CHECK (nkeys >= 0),
    capacity  bigint NOT NULL CHECK (capacity > 0),  -- keys it was sized for
    bloom     bytea NOT NULL
);
-- random bits do not compress: do not try
ALTER TABLE idempotency.filter_groups ALTER COLUMN bloom SET STORAGE EXTERNAL;
SELECT pg_catalog.pg_extension_config_dump('idempotency.filter_groups', '');
