-- Claims: the dedup marker (the table; its trigger and the functions are
-- in sql/functions/10_claims.sql).
--
-- idempotency.claims is the inheritance parent of the time partitions and the
-- place to query claims with SQL.  idem_claim() writes straight into the
-- partitions (never into the parent) under its own cross-partition value
-- lock; see src/claims/claims.c.  Privileges on idempotency.claims decide who may
-- claim (INSERT), look up (SELECT) and release (DELETE).

CREATE TABLE idempotency.claims (
    scope       text COLLATE "C" NOT NULL,
    key         text COLLATE "C" NOT NULL,
    claimed_at  timestamptz NOT NULL,
    fingerprint bigint,         -- payload hash of claims made by version 1.0
    digest      bytea           -- SHA-256 of the claim's canonical payload, if one was given
);
