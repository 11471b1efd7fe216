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
-- Claims: the dedup marker.
--
-- idempotency.claims is the inheritance parent of the time partitions and the
-- place to query claims with SQL.  idem_claim() writes straight into the
-- partitions (never into the parent) under its own cross-partition value
-- lock; see src/claims.c.  Privileges on idempotency.claims decide who may
-- claim (INSERT), look up (SELECT) and release (DELETE).

CREATE TABLE idempotency.claims (
    scope       text COLLATE "C" NOT NULL,
    key         text COLLATE "C" NOT NULL,
    claimed_at  timestamptz NOT NULL,
    fingerprint bigint          -- hash of the claim's payload, if one was given
);
COMMENT ON TABLE idempotency.claims IS
    'claims made by idem_claim(), across all time partitions (read-only: claim with idem_claim())';

CREATE FUNCTION idempotency.claims_read_only() RETURNS trigger
    LANGUAGE plpgsql AS
$$
BEGIN
    RAISE EXCEPTION 'cannot insert into idempotency.claims directly'
        USING ERRCODE = 'feature_not_supported',
              HINT = 'Claim keys with idem_claim() or idem_claim_many().';
END
$$;

CREATE TRIGGER claims_read_only
    BEFORE INSERT ON idempotency.claims
    FOR EACH ROW EXECUTE FUNCTION idempotency.claims_read_only();

CREATE FUNCTION idem_claim(key text, scope text DEFAULT 'default', payload jsonb DEFAULT NULL)
    RETURNS boolean
    AS 'MODULE_PATHNAME', 'idem_claim' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_claim_many(keys text[], scope text DEFAULT 'default')
    RETURNS SETOF text
    AS 'MODULE_PATHNAME', 'idem_claim_many' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_claimed(key text, scope text DEFAULT 'default')
    RETURNS timestamptz
    AS 'MODULE_PATHNAME', 'idem_claimed' LANGUAGE C STABLE PARALLEL RESTRICTED;

CREATE FUNCTION idem_release(key text, scope text DEFAULT 'default')
    RETURNS boolean
    AS 'MODULE_PATHNAME', 'idem_release' LANGUAGE C VOLATILE PARALLEL UNSAFE;

COMMENT ON FUNCTION idem_claim(text, text, jsonb) IS
    'claim (scope, key) in the calling transaction: true = apply the effect, false = duplicate';
COMMENT ON FUNCTION idem_claim_many(text[], text) IS
    'claim a batch of keys; returns the keys this call newly claimed, in input order';
COMMENT ON FUNCTION idem_claimed(text, text) IS
    'when (scope, key) was claimed, or NULL';
COMMENT ON FUNCTION idem_release(text, text) IS
    'forget the claim on (scope, key) so it can be processed again';
-- Retention: settings, maintenance and the partitions view.

CREATE FUNCTION idem_configure(retention interval DEFAULT NULL,
                               partition_interval interval DEFAULT NULL,
                               premake integer DEFAULT NULL)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_configure' LANGUAGE C VOLATILE;

CREATE FUNCTION idem_maintain()
    RETURNS TABLE(action text, object text)
    AS 'MODULE_PATHNAME', 'idem_maintain' LANGUAGE C VOLATILE;

COMMENT ON FUNCTION idem_configure(interval, interval, integer) IS
    'set retention, partition interval and premake (NULL keeps a value)';
COMMENT ON FUNCTION idem_maintain() IS
    'create partitions ahead and drop expired ones; one row per action';

-- Each partition with its time range, state and size.  States: future
-- (premade), current (takes claims now), sealing (its range has passed; the
-- next maintenance round seals it), sealed (takes no more claims; checked
-- through its Bloom filter), expired (every claim older than the retention
-- window; dropped by the next round that can lock it).
CREATE VIEW idempotency.partitions AS
SELECT r.relid AS partition,
       r.lower,
       r.upper,
       CASE
           WHEN r.upper <= now() - s.retention THEN 'expired'
           WHEN r.sealed THEN 'sealed'
           WHEN r.lower > now() THEN 'future'
           WHEN now() < r.upper THEN 'current'
           ELSE 'sealing'
       END AS state,
       r.bloom IS NOT NULL AS has_bloom_filter,
       pg_catalog.pg_total_relation_size(r.relid) AS bytes
FROM idempotency.partition_registry r
CROSS JOIN (SELECT coalesce((SELECT retention FROM idempotency.settings),
                            interval '7 days') AS retention) s;
COMMENT ON VIEW idempotency.partitions IS
    'time partitions of idempotency.claims with range, state and size';
-- Guarded writes: version and state-transition guards on user tables.
--
-- A guard is a BEFORE UPDATE row trigger named idem_guard_version or
-- idem_guard_transitions whose arguments hold its whole configuration, so
-- pg_dump/pg_restore keep guards like any other trigger.  All functions run
-- with the caller's privileges (no SECURITY DEFINER); see src/guards.c.

CREATE FUNCTION idempotency.version_guard() RETURNS trigger
    AS 'MODULE_PATHNAME', 'idem_version_guard' LANGUAGE C;
COMMENT ON FUNCTION idempotency.version_guard() IS
    'trigger installed by idem_guard_version(): skips or rejects updates that do not raise the version';

CREATE FUNCTION idempotency.transition_guard() RETURNS trigger
    AS 'MODULE_PATHNAME', 'idem_transition_guard' LANGUAGE C;
COMMENT ON FUNCTION idempotency.transition_guard() IS
    'trigger installed by idem_guard_transitions(): skips or rejects state changes not in the map';

CREATE FUNCTION idem_guard_version(target regclass, version_column name DEFAULT 'version',
                                   on_stale text DEFAULT 'skip')
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_guard_version' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_guard_transitions(target regclass, state_column name, transitions jsonb,
                                       on_invalid text DEFAULT 'skip')
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_guard_transitions' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_unguard(target regclass)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_unguard' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_upsert(new_row anyelement, version_column name DEFAULT 'version')
    RETURNS text
    AS 'MODULE_PATHNAME', 'idem_upsert' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_transition(target regclass, id anyelement, to_state text)
    RETURNS text
    AS 'MODULE_PATHNAME', 'idem_transition' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idempotency.guard_stats(
        OUT stale_skipped bigint, OUT stale_rejected bigint, OUT upsert_stale bigint,
        OUT invalid_skipped bigint, OUT invalid_rejected bigint, OUT already_applied bigint)
    RETURNS record
    AS 'MODULE_PATHNAME', 'idem_guard_stats' LANGUAGE C VOLATILE PARALLEL RESTRICTED;

CREATE FUNCTION idempotency.guard_stats_reset()
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_guard_stats_reset' LANGUAGE C VOLATILE PARALLEL RESTRICTED;

COMMENT ON FUNCTION idem_guard_version(regclass, name, text) IS
    'guard a table: an update whose version is not greater than the stored one is skipped or raises IK004';
COMMENT ON FUNCTION idem_guard_transitions(regclass, name, jsonb, text) IS
    'guard a table''s state column with a map of allowed transitions; others are skipped or raise IK005';
COMMENT ON FUNCTION idem_unguard(regclass) IS
    'remove the version and transition guards from a table';
COMMENT ON FUNCTION idem_upsert(anyelement, name) IS
    'insert the row into its table, or update it if its version is newer: inserted, updated or stale';
COMMENT ON FUNCTION idem_transition(regclass, anyelement, text) IS
    'move a row to a state under the table''s transition guard: applied, already_applied, rejected or not_found';
COMMENT ON FUNCTION idempotency.guard_stats() IS
    'this backend''s counters of skipped and rejected guarded writes';

-- Counters are per backend and only an observer's business.
REVOKE ALL ON FUNCTION idempotency.guard_stats_reset() FROM PUBLIC;
-- First partitions, so that claims work right after CREATE EXTENSION.
SELECT count(*) FROM idem_maintain();
