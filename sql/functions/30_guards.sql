-- Guarded writes: version and state-transition guards on user tables.
--
-- A guard is a BEFORE UPDATE row trigger named idem_guard_version or
-- idem_guard_transitions whose arguments hold its whole configuration, so
-- pg_dump/pg_restore keep guards like any other trigger.  All functions run
-- with the caller's privileges (no SECURITY DEFINER); see src/guards/guards.h.

CREATE OR REPLACE FUNCTION idempotency.version_guard() RETURNS trigger
    AS 'MODULE_PATHNAME', 'idem_version_guard' LANGUAGE C;
COMMENT ON FUNCTION idempotency.version_guard() IS
    'trigger installed by idem_guard_version(): skips or rejects updates that do not raise the version';

CREATE OR REPLACE FUNCTION idempotency.transition_guard() RETURNS trigger
    AS 'MODULE_PATHNAME', 'idem_transition_guard' LANGUAGE C;
COMMENT ON FUNCTION idempotency.transition_guard() IS
    'trigger installed by idem_guard_transitions(): skips or rejects state changes not in the map';

CREATE OR REPLACE FUNCTION idem_guard_version(target regclass, version_column name DEFAULT 'version',
                                              on_stale text DEFAULT 'skip')
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_guard_version' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_guard_transitions(target regclass, state_column name, transitions jsonb,
                                                  on_invalid text DEFAULT 'skip')
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_guard_transitions' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_unguard(target regclass)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_unguard' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_upsert(new_row anyelement, version_column name DEFAULT 'version')
    RETURNS text
    AS 'MODULE_PATHNAME', 'idem_upsert' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idem_transition(target regclass, id anyelement, to_state text)
    RETURNS text
    AS 'MODULE_PATHNAME', 'idem_transition' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE OR REPLACE FUNCTION idempotency.guard_stats(
        OUT stale_skipped bigint, OUT stale_rejected bigint, OUT upsert_stale bigint,
        OUT invalid_skipped bigint, OUT invalid_rejected bigint, OUT already_applied bigint)
    RETURNS record
    AS 'MODULE_PATHNAME', 'idem_guard_stats' LANGUAGE C VOLATILE PARALLEL RESTRICTED;

CREATE OR REPLACE FUNCTION idempotency.guard_stats_reset()
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
