-- Claims: the dedup marker (the table is in sql/tables/10_claims.sql).
--
-- idem_claim() writes straight into the partitions of idempotency.claims
-- (never into the parent, whose trigger refuses a direct insert) under its
-- own cross-partition value lock; see src/claims/claims.c.
-- Capabilities decide who may claim and look up (handler) and release
-- (operator): src/common/capabilities.c.

COMMENT ON TABLE idempotency.claims IS
    'claims made by idem_claim(), across all time partitions (read-only: claim with idem_claim())';
-- nobody but the owner has a right on it: roles claim with capabilities
-- (sql/tables/07_capabilities.sql revokes 1.0's grants on update)
REVOKE ALL ON idempotency.claims FROM PUBLIC;

CREATE OR REPLACE FUNCTION idempotency.claims_read_only() RETURNS trigger
    LANGUAGE plpgsql AS
$$
BEGIN
    RAISE EXCEPTION 'cannot insert into idempotency.claims directly'
        USING ERRCODE = 'feature_not_supported',
              HINT = 'Claim keys with idem_claim() or idem_claim_many().';
END
$$;

REVOKE ALL ON FUNCTION idempotency.claims_read_only() FROM PUBLIC;

CREATE OR REPLACE TRIGGER claims_read_only
    BEFORE INSERT ON idempotency.claims
    FOR EACH ROW EXECUTE FUNCTION idempotency.claims_read_only();

CREATE OR REPLACE FUNCTION idem_claim(key text, scope text DEFAULT 'default', payload jsonb DEFAULT NULL)
    RETURNS boolean
    AS 'MODULE_PATHNAME', 'idem_claim' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_claim_many(keys text[], scope text DEFAULT 'default')
    RETURNS SETOF text
    AS 'MODULE_PATHNAME', 'idem_claim_many' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_claimed(key text, scope text DEFAULT 'default')
    RETURNS timestamptz
    AS 'MODULE_PATHNAME', 'idem_claimed' LANGUAGE C STABLE PARALLEL RESTRICTED;

CREATE OR REPLACE FUNCTION idem_claimed_before(key text, scope text DEFAULT 'default')
    RETURNS timestamptz
    AS 'MODULE_PATHNAME', 'idem_claimed_before' LANGUAGE C STABLE PARALLEL RESTRICTED;

CREATE OR REPLACE FUNCTION idem_release(key text, scope text DEFAULT 'default')
    RETURNS boolean
    AS 'MODULE_PATHNAME', 'idem_release' LANGUAGE C VOLATILE PARALLEL UNSAFE;

COMMENT ON FUNCTION idem_claim(text, text, jsonb) IS
    'claim (scope, key) in the calling transaction: true = apply the effect, false = duplicate';
COMMENT ON FUNCTION idem_claim_many(text[], text) IS
    'claim a batch of keys; returns the keys this call newly claimed, in input order';
COMMENT ON FUNCTION idem_claimed(text, text) IS
    'when (scope, key) was claimed, or NULL';
COMMENT ON FUNCTION idem_claimed_before(text, text) IS
    'if (scope, key) was probably claimed before and its claim expired (a summary of dropped partitions): by when it had expired; else NULL';
COMMENT ON FUNCTION idem_release(text, text) IS
    'forget the claim on (scope, key) so it can be processed again';

-- Late duplicates: the summaries of dropped partitions (the table is in
-- sql/tables/10_late.sql; src/claims/late.c).  Every backend's list of them
-- is dropped when maintenance changes them (sql/functions/00_schema.sql
-- describes the trigger).
COMMENT ON TABLE idempotency.late_summaries IS
    'Bloom filters of the keys of dropped claims partitions, kept for idempotency.late_duplicate_window (written by maintenance)';
REVOKE ALL ON idempotency.late_summaries FROM PUBLIC;

CREATE OR REPLACE TRIGGER late_summaries_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.late_summaries
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.late_summaries ENABLE ALWAYS TRIGGER late_summaries_changed;

-- Filter groups of sealed partitions (sql/tables/10_groups.sql;
-- src/claims/groups.c): every backend's list of them is dropped when
-- maintenance changes them.
COMMENT ON TABLE idempotency.filter_groups IS
    'Bloom filters each over the keys of a group of sealed claims partitions, tested before their own (written by maintenance)';
REVOKE ALL ON idempotency.filter_groups FROM PUBLIC;

CREATE OR REPLACE TRIGGER filter_groups_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.filter_groups
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.filter_groups ENABLE ALWAYS TRIGGER filter_groups_changed;
