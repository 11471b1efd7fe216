-- Claims: the summaries of dropped claims partitions, behind late-duplicate
-- detection (the cache trigger, idem_claimed_before() and the comments are
-- in sql/functions/10_claims.sql; the code in src/claims/late.c).
--
-- When maintenance drops an expired claims partition, the hashes of its keys
-- are added to a Bloom filter here, one row per summary, kept for
-- idempotency.late_duplicate_window after the last partition folded into it.
-- At most IDEM_LATE_MAX_SUMMARIES rows (src/claims/late.h); sizes and the
-- false-positive rate: doc/claims.md, "Late duplicates".  A configuration
-- table, so that pg_dump keeps what was dropped with the claims that are
-- still there.
CREATE TABLE idempotency.late_summaries (
    id           integer PRIMARY KEY CHECK (id > 0),
    expired_from timestamptz NOT NULL,  -- the earliest a claim in it expired
    expired_to   timestamptz NOT NULL,  -- the latest a claim in it expired
    last_drop    timestamptz NOT NULL,  -- a partition was last folded in: the window counts from it
    nkeys        bigint NOT NULL CHECK (nkeys >= 0),
    capacity     bigint NOT NULL CHECK (capacity > 0),  -- keys it was sized for
    bloom        bytea NOT NULL,
    CHECK (expired_from <= expired_to)
);
-- uncompressed, so that a backend can read one block of a filter
-- (src/claims/filters.c, summary_slice_test())
ALTER TABLE idempotency.late_summaries ALTER COLUMN bloom SET STORAGE EXTERNAL;
SELECT pg_catalog.pg_extension_config_dump('idempotency.late_summaries', '');
