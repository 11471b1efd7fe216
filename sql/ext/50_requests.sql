-- Request idempotency: stored responses for HTTP-style Idempotency-Key
-- requests whose work spans several transactions (SPEC section 5).
--
-- A request is a claim in scope 'request:<scope>' (so the same uniqueness
-- and retention as claims) plus one row of idempotency.requests that holds
-- its state: the holder's attempt and lease, the last recovery point and
-- state, and once completed the response.  The rows live in time partitions
-- (LIST on "bucket", like the outbox's events, made and dropped by the
-- maintenance round); a row is updated in place while its request runs and
-- never deleted.  See src/delivery/requests.c.
--
-- This file is new in 1.1: the upgrade script from 1.0 includes it whole
-- (see the Makefile), so it must only create objects.

CREATE TABLE idempotency.requests (
    scope           text COLLATE "C" NOT NULL,
    key             text COLLATE "C" NOT NULL,
    digest          bytea,                    -- SHA-256 of the canonical payload
    status          text NOT NULL,            -- started, completed, abandoned
    attempt         integer NOT NULL,         -- the fencing token; never repeats
    lease_until     timestamptz,
    recovery_point  text,
    state           jsonb,
    response        jsonb,                    -- the body, when given as jsonb
    response_status integer,
    response_body   text,                     -- the body, when given as text
    response_headers jsonb,                   -- {"name": "value" or ["value", ...]}, names lower case
    created_at      timestamptz NOT NULL,
    updated_at      timestamptz NOT NULL,
    bucket          integer NOT NULL,         -- the partition it went into
    CHECK (response IS NULL OR response_body IS NULL)
) PARTITION BY LIST (bucket);
COMMENT ON TABLE idempotency.requests IS
    'Idempotency-Key requests and their stored responses, in time partitions (see idem_request_begin())';

-- The partitions, as maintenance made them (like outbox_partitions).
CREATE TABLE idempotency.request_partitions (
    relid  regclass    PRIMARY KEY,
    bucket integer     NOT NULL UNIQUE,
    lower  timestamptz NOT NULL,
    upper  timestamptz NOT NULL,
    CHECK (lower < upper)
);
SELECT pg_catalog.pg_extension_config_dump('idempotency.request_partitions', '');

CREATE TRIGGER request_partitions_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON idempotency.request_partitions
    FOR EACH STATEMENT EXECUTE FUNCTION idempotency.partition_cache_invalidate();
ALTER TABLE idempotency.request_partitions ENABLE ALWAYS TRIGGER request_partitions_changed;

CREATE FUNCTION idem_request_begin(key text, scope text DEFAULT 'default', payload jsonb DEFAULT NULL,
                                   lease interval DEFAULT '1 minute', wait interval DEFAULT '0',
                                   on_conflict text DEFAULT 'error')
    RETURNS TABLE(status text, response jsonb, response_status integer, attempt integer,
                  recovery_point text, state jsonb, retry_after interval, replayed boolean,
                  response_body text, response_headers jsonb)
    AS 'MODULE_PATHNAME', 'idem_request_begin' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_request_checkpoint(key text, scope text, attempt integer, recovery_point text,
                                        state jsonb DEFAULT NULL)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_request_checkpoint' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_request_fence(key text, scope text, attempt integer)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_request_fence' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_request_extend(key text, scope text, attempt integer, lease interval)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_request_extend' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_request_complete(key text, scope text DEFAULT 'default', response jsonb DEFAULT NULL,
                                      attempt integer DEFAULT NULL, response_status integer DEFAULT NULL,
                                      response_body text DEFAULT NULL, response_headers jsonb DEFAULT NULL)
    RETURNS TABLE(status text, response jsonb, response_status integer, response_body text,
                  response_headers jsonb, replayed boolean)
    AS 'MODULE_PATHNAME', 'idem_request_complete' LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_request_abandon(key text, scope text DEFAULT 'default', attempt integer DEFAULT NULL)
    RETURNS void
    AS 'MODULE_PATHNAME', 'idem_request_abandon' LANGUAGE C VOLATILE PARALLEL UNSAFE;
