-- Observability: the row type of idempotency.stats and the scope history
-- behind idempotency.consumers (the views and the functions behind them
-- are in sql/functions/65_stats.sql).

-- A counted row of idempotency.stats.
CREATE TYPE idempotency.stats_row AS (
    scope text, relation regclass,
    claims bigint, duplicates bigint, payload_mismatches bigint,
    releases bigint, stale_skips bigint, invalid_transitions bigint,
    requests_started bigint, requests_completed bigint, requests_conflicted bigint,
    late_duplicates bigint,
    last_claim_at timestamptz, last_duplicate_at timestamptz);

-- Per scope: what the claims of the partitions sealed so far held.  The
-- maintenance round adds a partition here in the same transaction that
-- seals it, so every claim is counted once: here once sealed, in the live
-- partitions before.  Kept by pg_dump.
CREATE TABLE idempotency.scope_history (
    scope          text COLLATE "C" PRIMARY KEY,
    first_claim_at timestamptz NOT NULL,
    last_claim_at  timestamptz NOT NULL,
    claims         bigint NOT NULL
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.scope_history', '');

-- 1.0 sealed partitions without this table: count them now (in a fresh
-- install there are none).
INSERT INTO idempotency.scope_history
SELECT c.scope, min(c.claimed_at), max(c.claimed_at), count(*)
FROM idempotency.claims c
WHERE c.tableoid IN (SELECT r.relid FROM idempotency.partition_registry r WHERE r.sealed)
GROUP BY c.scope;
